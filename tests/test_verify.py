"""``verify``: good conversions pass at every level, and every level demonstrably FAILS on corruption.

The self-tests below corrupt one tensor of a finished conversion in place (same dtype and shape, new
bytes), then re-record that file's size and sha256 in the manifest, so the checksum check cannot be
what catches it: the values (exact re-derivation) and numeric (reference forward) levels must. For
the semantic corruptions (a)-(d) the numeric gate is also run on its own (``run_layer`` +
``compare_outputs`` + ``within_tolerance``, bypassing structure/values) to prove it is not vacuous.

Metrics the numeric gate measured on these fixtures (torch backend, cpu, 16 tokens, seed 0; printed by
``test_numeric_gate_alone_catches_corruption`` under ``-s``). Tolerances: max_rel <= 2e-2, cosine >= 0.9999,
top1 >= 0.9, top5 >= 1.0.

  correct conversions (every good variant, tp 1/4, tp/ep): logits/hidden max_rel <= 4e-7, top1 1.0
  case (fixture, tp, where)                 logits max_rel / cos     hidden max_rel / cos    top1 / top5
  (a) w13 halves swapped, fp4 tp2 r1 e0     0.178 / 0.991674         0.239 / 0.991403        0.875 / 1
      fp8-e8m0 tp2 r1 e0                    0.177 / 0.993723         0.222 / 0.993340        0.9375 / 1
      (fp4 tp1, each expert 0..7 in turn: logits max_rel 0.20-0.32, cos 0.973-0.998: all caught)
  (b) fused [wkv; wq_a], fp4 tp1            1.012 / 0.746435         0.983 / 0.735194        0.1875 / 0.4375
      fp8 tp2                               0.923 / 0.696258         0.878 / 0.697356        0.125 / 0.3125
      scale blocks only, fp8 tp1            0.305 / 0.992575         0.389 / 0.992757        0.875 / 0.9375
  (c) E8M0 numeric, fp4 tp1 e0              0.278 / 0.979161         0.326 / 0.979008        0.625 / 0.875
      fp4 tp4 ep r1 local 0 (= expert 2)    0.298 / 0.989336         0.319 / 0.987635        0.875 / 1
      (fp4 tp1, each expert 0..7 in turn: logits max_rel 0.19-0.41: all caught)
  (d) attn_sink r1 := r0, fp4 tp2           0.0614 / 0.999608        0.0532 / 0.999602       0.9375 / 1
      fp8 tp4                               0.0553 / 0.999733        0.0479 / 0.999781       1 / 1
      -> the smallest margin of all: ~2.5x over max_rel, 1-cos 2.7-4x over (sinks are O(0.1-0.5)).
  (e) wo_b bytes from dim 0, fp4 tp2 r1     0.779 / 0.861818         0.680 / 0.861986        0.375 / 0.75

Fixture note: in the E8M0 fixtures every FP8 linear has ONE block-scale value per tensor (pow2-ceil of
similar amaxes), so a scale-layout bug in an FP8 linear is invisible there (swapping the fused scale
rows is a no-op); only the ``fp8`` fixture (float32 scales) exercises it, hence case (b') below.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_tool.checkpoint.headers import read_shard_header
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.cli.render import coverage_text, github_annotations, github_summary, render_verify, write_junit
from ckpt_tool.fixtures.make import EXPERTS, GOOD_VARIANTS, MAIN_LAYERS, O_GROUPS, O_LORA, Q_LORA
from ckpt_tool.mapping.plan import Options
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.mapping.profiles import PROFILES
from ckpt_tool.mapping.rules import Rule, Split
from ckpt_tool.output.convert import convert
from ckpt_tool.verify import coverage, linear_check, mtp_forward, numeric, reference, tensor_units, weight_sides
from ckpt_tool.verify.levels import verify
from ckpt_tool.verify.tensor_units import LinearUnit
from ckpt_tool.verify.verdict import Check, VerifyReport, skipped_check

MANIFEST = "ckpt-tool.json"
S = MAIN_LAYERS  # engine layer of mtp.0
P = f"model.layers.{S}.mtp_block."
# names of the default profile, vllm-0.33
W13 = P + "ffn.experts.routed_experts.w13_weight"
W13_SCALE_FP4 = P + "ffn.experts.routed_experts.w13_weight_scale"
FUSED = P + "attn.fused_wqa_wkv.weight"
FUSED_SCALE = P + "attn.fused_wqa_wkv.weight_scale_inv"
SINK = P + "attn.attn_sink"
WO_B = P + "attn.wo_b.weight"
WO_B_SCALE = P + "attn.wo_b.weight_scale_inv"
HEAD = f"model.layers.{S}.shared_head.head.weight"
SHARED = P + "ffn.experts._shared_experts._layer."  # + gate_up_proj / down_proj .weight / .weight_scale_inv

# Verify through the torch GEMM path on cpu: deterministic and independent of triton/CUDA.
CLI_BACKEND = ("--kernels", "torch", "--device", "cpu")


# ---------------------------------------------------------------------------------------------
# helpers


def do_convert(src: Path, out: Path, tp: int = 1, moe: str = "tp", only: str | None = None) -> Path:
    convert(src, out, Options(tp=tp, moe_parallel=moe, only=only))
    return out


def cli_verify(capsys, out: Path, src: Path, *extra) -> tuple[int, str, str]:
    return run_cli(capsys, "verify", out, "--source", src, *CLI_BACKEND, *extra)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def rerecord_in_manifest(out: Path, relpath: str) -> None:
    """Make the manifest's size/sha256 for ``relpath`` match the file again (hide the edit from checksums)."""
    path = out / MANIFEST
    doc = json.loads(path.read_text())
    doc["outputs"][relpath]["size"] = (out / relpath).stat().st_size
    doc["outputs"][relpath]["sha256"] = sha256_of(out / relpath)
    path.write_text(json.dumps(doc, indent=2))


def file_of(out: Path, name: str, rank: int, comp: str = "mtp") -> str:
    idx = json.loads((out / comp / "index.json").read_text())
    return f"{comp}/{idx['ranks'][str(rank)][name]}"


def read_tensor(out: Path, name: str, rank: int, comp: str = "mtp") -> torch.Tensor:
    with safe_open(str(out / file_of(out, name, rank, comp)), framework="pt") as fh:
        return fh.get_tensor(name)


def rewrite_tensors(
    out: Path,
    rank: int,
    edits: dict[str, Callable[[torch.Tensor], torch.Tensor]],
    *,
    keep_shape: bool = True,
    comp: str = "mtp",
) -> None:
    """Replace tensors of one rank's output file in place (safetensors' own reader/writer), keeping the
    other tensors, then re-record the file's size/sha256 in the manifest."""
    rels = {file_of(out, name, rank, comp) for name in edits}
    assert len(rels) == 1, rels
    rel = rels.pop()
    with safe_open(str(out / rel), framework="pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    changed = []
    for name, edit in edits.items():
        old = tensors[name]
        new = edit(old.clone()).contiguous()
        assert new.dtype == old.dtype, (name, new.dtype, old.dtype)
        if keep_shape:
            assert new.shape == old.shape, (name, new.shape, old.shape)
        changed.append(
            new.shape != old.shape or not torch.equal(new.view(torch.uint8), old.contiguous().view(torch.uint8))
        )
        tensors[name] = new
    assert any(changed), f"{list(edits)}: the edit changed nothing"
    save_file(tensors, str(out / rel), metadata=meta)
    rerecord_in_manifest(out, rel)


def drop_tensor(out: Path, name: str, rank: int, comp: str = "mtp") -> None:
    """Remove ``name`` from its file and from index.json; re-record the file in the manifest."""
    rel = file_of(out, name, rank, comp)
    with safe_open(str(out / rel), framework="pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k) for k in fh.keys() if k != name}
    save_file(tensors, str(out / rel), metadata=meta)
    rerecord_in_manifest(out, rel)
    idx_path = out / comp / "index.json"
    idx = json.loads(idx_path.read_text())
    del idx["ranks"][str(rank)][name]
    idx_path.write_text(json.dumps(idx, indent=2))


def source_tensor(src: Path, name: str) -> torch.Tensor:
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(src / weight_map[name]), framework="pt") as fh:
        return fh.get_tensor(name)


def _plan_of(out: Path, src: Path):
    manifest = json.loads((out / MANIFEST).read_text())
    ckpt = open_checkpoint(src)
    return ckpt, plan_conversion(ckpt.require_config(), ckpt.tensors, Options(**manifest["options"]))


def numeric_gate(out: Path, src: Path, *, tokens: int = 16, seed: int = 0) -> VerifyReport:
    """The numeric level alone, bypassing structure/values: every output tensor against the source, then
    the forward of every MTP layer (a report with only numeric checks)."""
    ckpt, plan = _plan_of(out, src)
    headers = {f.relpath: read_shard_header(out / f.relpath, f.relpath) for f in plan.files}
    report = VerifyReport(str(out), str(src), "numeric")
    numeric.check_numeric(out, plan, ckpt, headers, report, kernels="torch", device="cpu", tokens=tokens, seed=seed)
    return report


def forward_only(
    out: Path, src: Path, *, tokens: int = 16, seed: int = 0, route_all: bool = True
) -> list[tuple[dict, list[str]]]:
    """The MTP forward alone: (metrics, tolerance violations) per MTP layer."""
    ckpt, plan = _plan_of(out, src)
    cfg = plan.config
    dev = torch.device("cpu")
    inputs = mtp_forward.make_inputs(cfg, tokens, seed, dev)
    results = []
    for i in range(cfg.num_nextn_predict_layers):
        a, b = mtp_forward.run_layer(
            cfg, plan, ckpt, out, i, inputs, device=dev, kernels="torch", act="bf16", route_all=route_all
        )
        metrics = reference.compare_outputs(a, b)
        results.append((metrics, mtp_forward.within_tolerance(metrics)))
    return results


# ---------------------------------------------------------------------------------------------
# corruptions: each returns the (full) name of the tensor it corrupted


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def corrupt_swap_w13(out: Path, src: Path, rank: int = 0, expert: int = 0) -> str:
    """(a) w1 and w3 halves of one expert swapped inside w13_weight (a fusion written as [w3; w1])."""

    def edit(t: torch.Tensor) -> torch.Tensor:
        u = as_bytes(t)
        half = u.shape[1] // 2
        u[expert] = torch.cat([u[expert, half:], u[expert, :half]]).clone()
        return u.view(t.dtype)

    rewrite_tensors(out, rank, {W13: edit})
    return W13


def corrupt_swap_fused(out: Path, src: Path, rank: int = 0) -> str:
    """(b) fused_wqa_wkv written as [wkv; wq_a]: weight rows and 128-row scale blocks (shape unchanged)."""

    def rows(n_first: int):
        def edit(t: torch.Tensor) -> torch.Tensor:
            u = as_bytes(t)
            return torch.cat([u[n_first:], u[:n_first]]).view(t.dtype)

        return edit

    rewrite_tensors(out, rank, {FUSED: rows(Q_LORA), FUSED_SCALE: rows(Q_LORA // 128)})
    return FUSED


def corrupt_swap_fused_scale_only(out: Path, src: Path, rank: int = 0) -> str:
    """(b') only the scale blocks of fused_wqa_wkv in [wkv; wq_a] order (weight rows right). Needs a
    fixture whose block scales differ (fp8: float32 scales); E8M0 fixtures have one scale per tensor."""
    blocks = Q_LORA // 128
    rewrite_tensors(out, rank, {FUSED_SCALE: lambda t: torch.cat([t[blocks:], t[:blocks]])})
    return FUSED_SCALE


def corrupt_numeric_e8m0(out: Path, src: Path, rank: int = 0, expert: int = 0) -> str:
    """(c) one fp4 expert's raw E8M0 scale bytes b written numerically, uint8(2^(b-127)) (mostly 0)."""

    def edit(t: torch.Tensor) -> torch.Tensor:
        assert t.dtype == torch.uint8
        t[expert] = torch.exp2(t[expert].float() - 127).clamp(max=255).to(torch.uint8)
        return t

    rewrite_tensors(out, rank, {W13_SCALE_FP4: edit})
    return W13_SCALE_FP4


def corrupt_sink_rank(out: Path, src: Path) -> str:
    """(d) rank 1's attn_sink replaced by rank 0's slice (a split that ignored the rank)."""
    rank0 = read_tensor(out, SINK, 0)
    rewrite_tensors(out, 1, {SINK: lambda t: rank0.clone()})
    return SINK


def wo_b_wrong_dim(src: Path, tp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """wo_b (row-parallel: the rank's slice is along dim 1) sliced along dim 0 instead, weight and scale."""
    w, s = source_tensor(src, "mtp.0.attn.wo_b.weight"), source_tensor(src, "mtp.0.attn.wo_b.scale")
    assert tuple(w.shape) == (w.shape[0], O_GROUPS * O_LORA)
    wn, sn = w.shape[0] // tp, s.shape[0] // tp
    return w[rank * wn : (rank + 1) * wn].contiguous(), s[rank * sn : (rank + 1) * sn].contiguous()


def corrupt_wo_b_wrong_shape(out: Path, src: Path, tp: int = 2, rank: int = 1) -> str:
    """(e1) wo_b split on dim 0 instead of dim 1: the rank file holds a [D/T, G*Or] tensor."""
    w, s = wo_b_wrong_dim(src, tp, rank)
    rewrite_tensors(out, rank, {WO_B: lambda t: w, WO_B_SCALE: lambda t: s}, keep_shape=False)
    return WO_B


def corrupt_wo_b_wrong_bytes(out: Path, src: Path, tp: int = 2, rank: int = 1) -> str:
    """(e2) the dim-0 slice's bytes written under the right [D, G*Or/T] shape (same element count)."""
    w, s = wo_b_wrong_dim(src, tp, rank)

    def like(x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: x.reshape(t.shape)

    rewrite_tensors(out, rank, {WO_B: like(w), WO_B_SCALE: like(s)})
    return WO_B


def corrupt_pad(
    out: Path, src: Path, name: str, rank: int, where: Callable[[torch.Tensor], torch.Tensor], value
) -> str:
    """(z) the engine's zero padding of a shared-expert tensor overwritten (``where`` selects the padded part)."""

    def edit(t: torch.Tensor) -> torch.Tensor:
        where(as_bytes(t) if t.element_size() == 1 else t).fill_(value)
        return t

    rewrite_tensors(out, rank, {name: edit})
    return name


# (id, variant, tp, moe, corruption, failing level)
CORRUPTIONS = [
    ("a-swap-w13-fp4", "fp4", 2, "tp", lambda o, s: corrupt_swap_w13(o, s, rank=1), "values"),
    ("a-swap-w13-fp8-e8m0", "fp8-e8m0", 2, "tp", lambda o, s: corrupt_swap_w13(o, s, rank=1), "values"),
    ("b-fused-wkv-first-fp4", "fp4", 1, "tp", corrupt_swap_fused, "values"),
    ("b-fused-wkv-first-fp8", "fp8", 2, "tp", corrupt_swap_fused, "values"),
    ("b-fused-scale-only-fp8", "fp8", 1, "tp", corrupt_swap_fused_scale_only, "values"),
    ("c-e8m0-numeric-fp4-tp1", "fp4", 1, "tp", corrupt_numeric_e8m0, "values"),
    ("c-e8m0-numeric-fp4-tp4-ep", "fp4", 4, "ep", lambda o, s: corrupt_numeric_e8m0(o, s, rank=1), "values"),
    ("d-sink-rank0-tp2", "fp4", 2, "tp", corrupt_sink_rank, "values"),
    ("d-sink-rank0-tp4", "fp8", 4, "tp", corrupt_sink_rank, "values"),
    ("e-wo_b-wrong-dim-shape", "fp4", 2, "tp", corrupt_wo_b_wrong_shape, "structure"),
    ("e-wo_b-wrong-dim-bytes", "fp4", 2, "tp", corrupt_wo_b_wrong_bytes, "values"),
    # a replicated tensor corrupted on rank 1 only: values catches it (the numeric gate does not, see below)
    ("r-fused-wkv-first-on-rank1", "fp4", 2, "tp", lambda o, s: corrupt_swap_fused(o, s, rank=1), "values"),
    # the engine's zero padding of the 3-block shared experts: rank 3 of tp 4 holds zeros only; rank 1 of tp 2 one
    # real block, then zeros (w1 rows 128:256 of its gate_up share; down_proj columns 128:256); with fp8 experts
    # the float32 scale pad is 2^-127 (E8M0 byte 0), so a plain 0.0 there is wrong too
    (
        "z-pad-gate_up-rank-of-zeros",
        "fp4-pad",
        4,
        "ep",
        lambda o, s: corrupt_pad(o, s, SHARED + "gate_up_proj.weight", 3, lambda t: t[200:201, 7:8], 0x38),
        "values",
    ),
    (
        "z-pad-down-columns-part-real-rank",
        "fp4-pad",
        2,
        "ep",
        lambda o, s: corrupt_pad(o, s, SHARED + "down_proj.weight", 1, lambda t: t[:, 128:], 0x38),
        "values",
    ),
    (
        "z-pad-f32-scale-zero-not-2^-127",
        "fp8-e8m0-pad",
        2,
        "ep",
        lambda o, s: corrupt_pad(o, s, SHARED + "gate_up_proj.weight_scale_inv", 1, lambda t: t[3:4], 0.0),
        "values",
    ),
]
NUMERIC_GATE = [c for c in CORRUPTIONS if c[0][0] in "abcde" and c[5] == "values"]


# ---------------------------------------------------------------------------------------------
# good conversions pass


GOOD = (
    [(v, 1, "tp") for v in GOOD_VARIANTS]
    + [(v, 4, "tp") for v in GOOD_VARIANTS]
    + [
        ("fp4", 4, "ep"),
        ("fp8-e8m0", 4, "ep"),
        # shared experts zero-padded by the engine: a rank part real part zeros (tp 2), a rank of zeros only (tp 4);
        # their MXFP4 routed experts (192 / 96 rows a rank under --moe-parallel tp) convert with ep only
        ("fp4-pad", 2, "ep"),
        ("fp4-pad", 4, "ep"),
        ("fp8-e8m0-pad", 2, "ep"),
    ]
)


@pytest.mark.parametrize("variant,tp,moe", GOOD, ids=[f"{v}-tp{t}-{m}" for v, t, m in GOOD])
def test_good_conversion_passes_numeric_verify(fixture_dir, tmp_path, capsys, variant, tp, moe) -> None:
    src = fixture_dir(variant)
    out = do_convert(src, tmp_path / "out", tp, moe)
    report = verify(out, src, level="numeric", kernels="torch", device="cpu")
    assert report.ok, [(c.name, c.message) for c in report.failures]
    names = {c.name for c in report.checks}
    assert {"manifest", "plan", "source-fingerprint", "index:model", "index:mtp"} <= names
    n_mtp = len(report.numeric)
    assert n_mtp == open_checkpoint(src).require_config().num_nextn_predict_layers
    assert sum(n.startswith("values:") for n in names) == sum(n.startswith("structure:") for n in names) == 2 * tp
    for entry in report.numeric:
        assert entry["backend"] == "torch" and entry["ok"]
        # a correct conversion sits far inside the tolerances (measured <= 4e-7)
        assert entry["logits_max_rel"] < 1e-5 and entry["hidden_max_rel"] < 1e-5, entry
        assert entry["top1_agreement"] == 1.0

    code, stdout, err = cli_verify(capsys, out, src, "--json")
    assert code == 0, err
    doc = json.loads(stdout)  # exactly one JSON document on stdout
    assert doc["ok"] is True and doc["failed"] == 0 and doc["level"] == "numeric"
    assert doc["checks"] == len(report.checks)
    assert [n["layer"] for n in doc["numeric"]] == [S + i for i in range(n_mtp)]


def test_cli_without_json_prints_pass_and_metrics(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    code, stdout, err = cli_verify(capsys, out, src)
    assert code == 0, err
    assert "PASS" in stdout and f"numeric layer {S}" in stdout
    assert "::error" not in stdout + err


@pytest.mark.parametrize("only", ["mtp", "model"])
def test_only_component_conversions_verify(fixture_dir, tmp_path, capsys, only) -> None:
    src = fixture_dir("fp4-2mtp")
    out = do_convert(src, tmp_path / "out", 2, only=only)
    other = "model" if only == "mtp" else "mtp"
    assert not (out / other).exists()
    report = verify(out, src, level="numeric", kernels="torch", device="cpu")
    assert report.ok, [(c.name, c.message) for c in report.failures]
    names = {c.name for c in report.checks}
    assert f"index:{only}" in names and f"index:{other}" not in names
    if only == "mtp":
        assert len(report.numeric) == 2 and report.skipped == []
    else:  # the MTP forward does not apply: skipped with its reason, not passed
        assert report.numeric == [] and [(c.name, c.status) for c in report.skipped] == [
            ("numeric:mtp-forward", "skipped")
        ]
        assert "--only model" in report.skipped[0].message
    assert report.coverage["percent"] == 100.0 and set(report.coverage["components"]) == {only}
    code, stdout, err = cli_verify(capsys, out, src, "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["ok"] is True and [c["name"] for c in doc["skipped"]] == [c.name for c in report.skipped]
    assert "numeric:mtp-forward" not in doc["passed"]
    assert {r["name"]: r["status"] for r in doc["results"]}.get("numeric:mtp-forward") == (
        None if only == "mtp" else "skipped"
    )


# ---------------------------------------------------------------------------------------------
# corruption self-tests: the checks can fail, and name the tensor


def test_rewrite_helper_alone_keeps_verify_green(fixture_dir, tmp_path) -> None:
    """Control: rewriting a file with the same tensors (new layout/bytes on disk) + re-recorded manifest passes.
    So any failure below comes from the corrupted values, not from the rewrite itself."""
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    rel = file_of(out, W13, 1)
    before = sha256_of(out / rel)
    with safe_open(str(out / rel), framework="pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k) for k in reversed(list(fh.keys()))}
    save_file(tensors, str(out / rel), metadata={**(meta or {}), "rewritten": "yes"})
    assert sha256_of(out / rel) != before
    # without re-recording, the checksum check catches the changed file
    report = verify(out, src, level="structure")
    assert not report.ok and "differs from the manifest" in report.failures[0].message
    rerecord_in_manifest(out, rel)
    report = verify(out, src, level="numeric", kernels="torch", device="cpu")
    assert report.ok, [(c.name, c.message) for c in report.failures]


def _numeric_levels_started(monkeypatch) -> list:
    """The :class:`numeric.NumericLevel` objects ``verify`` starts, in order."""
    started, real = [], numeric.NumericLevel.start

    def start(self, *args, **kwargs) -> None:
        started.append(self)
        real(self, *args, **kwargs)

    monkeypatch.setattr(numeric.NumericLevel, "start", start)
    return started


def test_numeric_workers_compute_while_the_values_level_runs(fixture_dir, tmp_path, monkeypatch) -> None:
    """verify --level numeric forks the numeric level's workers before the values level starts, and they answer
    while it runs (one pass: each task once the values walk has read its bytes; a window of one byte makes the walk
    wait for every answer due): the levels share the disk and the cores instead of taking turns. The report, its
    checks and coverage, are those of the serial level."""
    from ckpt_tool.verify import levels
    from ckpt_tool.verify.compute_pool import can_fork_workers

    if not can_fork_workers():
        pytest.skip("forked workers are not available here")
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    started, answered_during_values = _numeric_levels_started(monkeypatch), []
    real_values = levels.check_values

    def values_then_count_answers(*args, **kwargs):
        real_values(*args, **kwargs)
        answered_during_values.append(started[0]._answers.qsize())

    monkeypatch.setattr(levels, "check_values", values_then_count_answers)
    monkeypatch.setattr(levels, "ONE_PASS_WINDOW", 1)
    report = verify(out, src, level="numeric", kernels="torch", device="cpu", workers=2)
    assert started[0].pace is not None and answered_during_values[0] > 0
    monkeypatch.undo()
    assert report.ok, [(c.name, c.message) for c in report.failures]
    assert report.coverage["percent"] == 100.0
    serial = verify(out, src, level="numeric", kernels="torch", device="cpu", workers=1)
    assert [(c.name, c.ok, c.message) for c in report.checks] == [(c.name, c.ok, c.message) for c in serial.checks]
    assert report.coverage == serial.coverage


FORKED_NUMERIC_RUNS = 30
FORKED_RUN_SECONDS = 60  # one run takes about a quarter of a second here; a stuck worker never answers


@pytest.mark.parametrize("one_pass", [False, True], ids=["alone", "one-pass"])
def test_forked_numeric_workers_answer_every_task_run_after_run(fixture_dir, tmp_path, monkeypatch, one_pass) -> None:
    """The numeric level's forked path 30 times in a row, each time forked from a thread that has just run a matmul
    on a team of two OpenMP threads (what once left a worker spinning in a matmul): the workers answer every task
    of every run in time (a watchdog kills workers still running at the deadline, which fails the run), and every
    report passes at full coverage. ``one-pass``: as verify runs it, the values walk beside the workers releasing
    their tasks (on a window of one byte: it waits on every answer due), at tp 2 and 4 in turn, ``--moe-parallel
    ep`` every third run (a member walks a rank's parts in turn); the walk ends too (no deadlock), and its report
    passes."""
    import threading

    from ckpt_tool.verify.compute_pool import ForkedTasks, can_fork_workers
    from ckpt_tool.verify.values import check_values, values_walk
    from ckpt_tool.verify.verdict import NoProgress

    assert can_fork_workers(), "the forked numeric path needs Linux and no other thread running"
    src = fixture_dir("fp4")
    outs = (
        [do_convert(src, tmp_path / "out", 1)]
        if not one_pass
        else [
            do_convert(src, tmp_path / "tp2", 2),
            do_convert(src, tmp_path / "tp4", 4),
            do_convert(src, tmp_path / "ep", 2, "ep"),
        ]
    )
    forked, answered, real_results = [], [], ForkedTasks.results

    def results(self, ended=None):
        forked.append((self, len(self.pids)))
        for item in real_results(self, ended):
            answered.append(item[0])
            yield item

    monkeypatch.setattr(ForkedTasks, "results", results)
    threads, team = torch.get_num_threads(), torch.ones(256, 256)
    try:
        for run in range(FORKED_NUMERIC_RUNS):
            out = outs[run % len(outs)]
            ckpt, plan = _plan_of(out, src)
            headers = {f.relpath: read_shard_header(out / f.relpath, f.relpath) for f in plan.files}
            forked.clear()
            answered.clear()
            torch.set_num_threads(2)
            team @ team  # noqa: B018 - a thread team now attached to this thread, which forks the workers
            report = VerifyReport(str(out), str(src), "numeric")
            with numeric.NumericLevel(
                out,
                plan,
                ckpt,
                headers,
                kernels="torch",
                device="cpu",
                tokens=4,
                seed=run,
                workers=2,
                one_pass=one_pass,
            ) as level:
                level.start(values_walk(plan, headers), 1) if one_pass else level.start()
                watchdog = threading.Timer(FORKED_RUN_SECONDS, lambda: forked and forked[0][0].stop())
                watchdog.daemon = True
                watchdog.start()
                try:
                    if one_pass:
                        walk = threading.Thread(
                            target=check_values,
                            args=(out, plan, ckpt.open_bytes(), headers, report, NoProgress()),
                            kwargs={"workers": 2, "pace": level.pace},
                        )
                        walk.start()
                        walk.join(FORKED_RUN_SECONDS)
                        assert not walk.is_alive(), f"run {run}: the values walk did not end (deadlock?)"
                    level.finish(report)
                finally:
                    watchdog.cancel()
            assert [processes for _, processes in forked] == [2], f"run {run}: the workers were not forked"
            assert sorted(answered) == list(range(forked[0][0].tasks)), f"run {run}: workers left tasks unanswered"
            assert report.ok, (run, [(c.name, c.message) for c in report.failures])
            assert report.coverage["percent"] == 100.0
    finally:
        torch.set_num_threads(threads)


def test_a_values_failure_stops_the_numeric_workers_and_adds_no_numeric_check(
    fixture_dir, tmp_path, monkeypatch
) -> None:
    """The numeric level's workers, already computing, are stopped and reaped when the values level fails: the
    report holds the values failure and no numeric check (numeric runs only after the levels before passed)."""
    import os

    from ckpt_tool.verify.compute_pool import ForkedTasks, can_fork_workers

    if not can_fork_workers():
        pytest.skip("forked workers are not available here")
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    name = corrupt_swap_w13(out, src)
    rerecord_in_manifest(out, file_of(out, W13, 0))
    pids, real_start = [], ForkedTasks.start

    def start(self):
        real_start(self)
        pids.extend(self.pids.values())
        return self

    monkeypatch.setattr(ForkedTasks, "start", start)
    report = verify(out, src, level="numeric", kernels="torch", device="cpu", workers=2)
    assert not report.ok and report.failures[0].name.startswith("values:") and report.failures[0].tensor == name
    assert not [c.name for c in report.checks if c.name.startswith("numeric")]
    assert report.numeric == [] and report.coverage is None
    assert len(pids) == 2
    for pid in pids:  # stopped and reaped: no process of that id is left, not even a zombie
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("cid,variant,tp,moe,corrupt,level", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corruption_fails_verify_naming_the_tensor(
    fixture_dir, tmp_path, capsys, cid, variant, tp, moe, corrupt, level
) -> None:
    src = fixture_dir(variant)
    out = do_convert(src, tmp_path / "out", tp, moe)
    name = corrupt(out, src)

    report = verify(out, src, level="numeric", kernels="torch", device="cpu")
    assert not report.ok
    first = report.failures[0]
    assert first.name.startswith(f"{level}:mtp/"), (first.name, first.message)
    assert first.tensor == name and repr(name) in first.message, first.message
    assert all("sha256" not in c.message for c in report.failures)  # the checksum is not what caught it
    assert report.numeric == []  # numeric does not run after a failed level

    code, stdout, err = cli_verify(capsys, out, src, "--json")
    assert code == 1, err
    doc = json.loads(stdout)
    assert doc["ok"] is False and doc["failures"][0]["tensor"] == name
    assert name in doc["failures"][0]["message"]


def test_dropped_mtp_tensor_fails_structure_naming_it(fixture_dir, tmp_path, capsys) -> None:
    """(f) one MTP tensor removed from its rank file and from index.json."""
    src = fixture_dir("fp4-mtp-emb")
    out = do_convert(src, tmp_path / "out", 2)
    drop_tensor(out, HEAD, rank=1)
    report = verify(out, src, level="numeric", kernels="torch", device="cpu")
    assert not report.ok
    fail = next(c for c in report.failures if c.name == "structure:mtp/model-rank-1-part-0.safetensors")
    assert fail.tensor == HEAD and repr(HEAD) in fail.message and "missing" in fail.message
    assert any(c.name == "index:mtp" for c in report.failures)  # index no longer matches the plan either
    assert all("sha256" not in c.message for c in report.failures)
    code, _, err = cli_verify(capsys, out, src)
    assert code == 1
    assert HEAD in err


@pytest.mark.parametrize("cid,variant,tp,moe,corrupt,level", NUMERIC_GATE, ids=[c[0] for c in NUMERIC_GATE])
def test_numeric_gate_alone_catches_corruption(fixture_dir, tmp_path, cid, variant, tp, moe, corrupt, level) -> None:
    """Bypass structure/values: the numeric level alone must reject the corrupted output, naming the tensor."""
    src = fixture_dir(variant)
    out = do_convert(src, tmp_path / "out", tp, moe)
    clean = numeric_gate(out, src)
    assert clean.ok, [(c.name, c.message) for c in clean.failures]  # control: the same call on the clean output passes
    assert clean.coverage["percent"] == 100.0
    name = corrupt(out, src)
    report = numeric_gate(out, src)
    assert not report.ok, f"{cid}: numeric gate passed a corrupted conversion"
    first = report.failures[0]
    assert first.name.startswith("numeric:mtp/") and repr(name) in first.message, (first.name, first.message)
    # the MTP forward (every expert routed) sees it too, well past the noise floor
    ((metrics, bad),) = forward_only(out, src)
    print(
        f"{cid}: "
        + ", ".join(
            f"{k}={metrics[k]:.6g}"
            for k in (
                "logits_max_rel",
                "logits_cosine",
                "hidden_max_rel",
                "hidden_cosine",
                "top1_agreement",
                "top5_agreement",
            )
        )
    )
    assert bad, f"{cid}: forward passed a corrupted conversion: {metrics}"
    assert metrics["logits_max_rel"] > 2e-2 and metrics["hidden_max_rel"] > 2e-2, metrics
    assert metrics["logits_cosine"] < 0.9999, metrics


@pytest.mark.parametrize("linear,rank,tp", [("gate_up_proj", 3, 4), ("down_proj", 1, 2)])
def test_numeric_gate_alone_catches_garbage_in_the_engine_padding(fixture_dir, tmp_path, linear, rank, tp) -> None:
    """Nonzero weights and scales in the shared experts' zero padding change what the engine computes: padded
    gate_up rows must compute exactly 0, and padded down_proj inputs carry probe values that must add nothing."""
    src = fixture_dir("fp4-pad")
    out = do_convert(src, tmp_path / "out", tp, "ep")
    assert numeric_gate(out, src).ok
    base = SHARED + linear
    pad = (lambda t: t) if linear == "gate_up_proj" else (lambda t: t[:, t.shape[1] // 2 :])  # all / the second block

    def fill(value: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: (pad(as_bytes(t)).fill_(value), t)[1]

    rewrite_tensors(
        out, rank, {base + ".weight": fill(0x38), base + ".weight_scale_inv": fill(127)}
    )  # fp8 1.0, E8M0 2^0
    report = numeric_gate(out, src)
    assert not report.ok
    first = report.failures[0]
    assert first.name.startswith("numeric:mtp/") and first.tensor == base + ".weight", (first.name, first.message)
    assert ("zero padding" in first.message) == (linear == "gate_up_proj"), first.message


def test_numeric_gate_alone_sees_replicated_tensors_on_every_rank(fixture_dir, tmp_path) -> None:
    """A replicated tensor corrupted on rank 1 only: the forward reads rank 0's copy and passes; the
    per-tensor check compares every rank's copy and names it."""
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    corrupt_swap_fused(out, src, rank=1)
    assert not verify(out, src, level="values").ok  # the exact check does catch it
    ((metrics, bad),) = forward_only(out, src)
    assert bad == [], metrics
    report = numeric_gate(out, src)
    first = report.failures[0]
    assert first.tensor == FUSED and "rank 1" in first.message and "mtp.0.attn.wq_a" in first.message, first.message


def reached_experts(out: Path, src: Path, tokens: int, monkeypatch) -> set[int]:
    """Routed experts the plain top-k MTP forward runs on ``tokens`` tokens (spied on the source side)."""
    seen: set[int] = set()
    real = weight_sides.SourceShard.linear

    def spy(self, role, x):
        if role.startswith("expert."):
            seen.add(int(role.split(".")[1]))
        return real(self, role, x)

    with monkeypatch.context() as m:
        m.setattr(weight_sides.SourceShard, "linear", spy)
        forward_only(out, src, tokens=tokens, route_all=False)
    return seen


@pytest.mark.parametrize(
    "variant,tp,moe", [("fp4", 2, "tp"), ("fp8-e8m0", 4, "ep")], ids=["fp4-tp2", "fp8-e8m0-tp4-ep"]
)
def test_corrupted_expert_no_token_reaches_is_caught(fixture_dir, tmp_path, monkeypatch, variant, tp, moe) -> None:
    """On 2 tokens the top-k reaches 4 of the 8 experts: corrupt one it does not reach. The plain forward
    passes it; the per-tensor check and the forward routed to every expert both fail, naming the tensor."""
    src = fixture_dir(variant)
    out = do_convert(src, tmp_path / "out", tp, moe)
    reached = reached_experts(out, src, 2, monkeypatch)
    unreached = sorted(set(range(EXPERTS)) - reached)
    assert unreached, reached
    j = unreached[-1]
    rank, slot = (j // (EXPERTS // tp), j % (EXPERTS // tp)) if moe == "ep" else (tp - 1, j)
    name = corrupt_swap_w13(out, src, rank=rank, expert=slot)
    ((metrics, bad),) = forward_only(out, src, tokens=2, route_all=False)
    assert bad == [], metrics  # invisible to the top-k forward
    ((metrics, bad),) = forward_only(out, src, tokens=2, route_all=True)
    assert bad, metrics
    report = numeric_gate(out, src, tokens=2)
    first = report.failures[0]
    assert first.tensor == name and f"expert {j} " in first.message and f"rank {rank}" in first.message, first.message
    assert f"mtp.0.ffn.experts.{j}.w1" in first.message


def corrupt_main_fused(out: Path, src: Path, layer: int = 1, rank: int = 0) -> str:
    """fused_wqa_wkv of main layer ``layer`` written as [wkv; wq_a] (weight rows and scale blocks)."""
    name = f"model.layers.{layer}.attn.fused_wqa_wkv.weight"

    def rows(n_first: int):
        return lambda t: torch.cat([as_bytes(t)[n_first:], as_bytes(t)[:n_first]]).view(t.dtype)

    rewrite_tensors(out, rank, {name: rows(Q_LORA), name + "_scale_inv": rows(Q_LORA // 128)}, comp="model")
    return name


def corrupt_main_expert_scale(out: Path, src: Path, layer: int = 2, rank: int = 1, expert: int = 5) -> str:
    """one fp4 expert's E8M0 scale bytes in main layer ``layer`` written numerically (mostly 0)."""
    name = f"model.layers.{layer}.ffn.experts.routed_experts.w2_weight_scale"

    def edit(t: torch.Tensor) -> torch.Tensor:
        t[expert] = torch.exp2(t[expert].float() - 127).clamp(max=255).to(torch.uint8)
        return t

    rewrite_tensors(out, rank, {name: edit}, comp="model")
    return name


def corrupt_main_sink(out: Path, src: Path, layer: int = 0) -> str:
    name = f"model.layers.{layer}.attn.attn_sink"
    rank0 = read_tensor(out, name, 0, comp="model")
    rewrite_tensors(out, 1, {name: lambda t: rank0.clone()}, comp="model")
    return name


MAIN_CORRUPTIONS = [
    ("main-fused-wkv-first", "fp8", 2, corrupt_main_fused, "model.layers.1.attn.fused_wqa_wkv.weight"),
    (
        "main-expert-e8m0-numeric",
        "fp4",
        2,
        corrupt_main_expert_scale,
        "model.layers.2.ffn.experts.routed_experts.w2_weight",
    ),
    ("main-sink-rank0", "fp4", 2, corrupt_main_sink, "model.layers.0.attn.attn_sink"),
]


@pytest.mark.parametrize("cid,variant,tp,corrupt,tensor", MAIN_CORRUPTIONS, ids=[c[0] for c in MAIN_CORRUPTIONS])
def test_main_layer_corruption_caught_by_numeric_alone(
    fixture_dir, tmp_path, cid, variant, tp, corrupt, tensor
) -> None:
    """Main-model layers have no forward here: the per-tensor check alone fails, naming the tensor and layer."""
    src = fixture_dir(variant)
    out = do_convert(src, tmp_path / "out", tp)
    name = corrupt(out, src)
    report = numeric_gate(out, src)
    bad = [c for c in report.failures if c.name.startswith("numeric:model/")]
    assert bad and bad[0].tensor == tensor and repr(name) in bad[0].message, [
        (c.name, c.message) for c in report.failures
    ]
    layer = name.split(".")[2]
    assert bad[0].name == f"numeric:model/layers.{layer}"
    assert all(c.ok for c in report.checks if c.name.startswith("numeric:mtp"))  # the MTP layer is untouched


def _swapped_fused_rules(monkeypatch, profile: str = "vllm-0.33+", where: str = "layers.{layer}.") -> None:
    """Break the rule table on purpose: fuse [wkv; wq_a] instead of [wq_a; wkv] (weight and scale) for the
    layers whose source names start with ``where`` (main layers by default). Convert and verify's values level
    both follow the broken table, so only the numeric level, which names the engine's tensors independently,
    can see it."""
    base = PROFILES[profile]

    def swap(rule: Rule) -> Rule:
        if rule.kind == "fuse" and rule.sources[0].startswith(where) and ".attn.wq_a." in rule.sources[0]:
            return dataclasses.replace(rule, sources=tuple(reversed(rule.sources)))
        return rule

    broken = dataclasses.replace(base, build=lambda expert_dtype: [swap(r) for r in base.build(expert_dtype)])
    monkeypatch.setitem(PROFILES, profile, broken)


@pytest.mark.parametrize(
    "variant,where,component",
    [
        ("fp8", "layers.{layer}.", "model"),
        ("fp4", "mtp.{mtp}.", "mtp"),
    ],
    ids=["main-layers-fp8", "mtp-fp4"],
)
def test_broken_rule_table_passes_values_and_fails_numeric(
    fixture_dir, tmp_path, monkeypatch, variant, where, component
) -> None:
    """Why the numeric level exists: a mapping bug (swapped fused parts) that the values level, re-deriving through
    the same plan, cannot see; the numeric level fails and names the engine tensor."""
    _swapped_fused_rules(monkeypatch, where=where)
    src = fixture_dir(variant)
    out = do_convert(src, tmp_path / "out", 2)
    report = verify(out, src, level="numeric", kernels="torch", device="cpu")
    assert all(c.ok for c in report.checks if not c.name.startswith("numeric")), [
        (c.name, c.message) for c in report.failures
    ]
    assert not report.ok
    first = report.failures[0]
    assert first.name.startswith(f"numeric:{component}/")
    assert first.tensor.endswith("attn.fused_wqa_wkv.weight") and "attn.wq_a" in first.message, first.message


# ---------------------------------------------------------------------------------------------
# the vision model: its tower, aligner, image_* and bias_vl at every level

VISION = [
    ("vl-fp4", 2, "tp"),
    ("vl-fp4", 2, "ep"),
    ("vl-fp4-h2", 4, "tp"),
    ("vl-fp4-nomtp", 1, "tp"),
    ("vl-fp4-f32", 2, "tp"),
]


@pytest.mark.parametrize("variant,tp,moe", VISION, ids=[f"{v}-tp{t}-{m}" for v, t, m in VISION])
def test_vision_conversion_passes_numeric_verify_with_every_vision_tensor_covered(
    fixture_dir, tmp_path, variant, tp, moe
) -> None:
    """The vision model verifies at every level; the numeric level compares the tower's BF16 linears by value (each
    q|k|v and gate|up section on its own) and counts them: 100 % of the units, every vision tensor named."""
    src = fixture_dir(variant)
    out = do_convert(src, tmp_path / "out", tp, moe)
    report = verify(out, src, level="numeric", kernels="torch", device="cpu")
    assert report.ok, [(c.name, c.message) for c in report.failures]
    assert report.coverage["percent"] == 100.0, report.coverage
    names = {c.name for c in report.checks}
    assert "numeric:model/vision" in names and "numeric:model/vision.blocks.1" in names
    ckpt, plan = _plan_of(out, src)
    units = tensor_units.tensor_units(plan.config, plan.options.profile, "model", tp, moe, set(ckpt.tensors))
    parts = {p for u in units for p in tensor_units.unit_parts(u)}
    assert {"vision.blocks.0.attn.wqkv.weight (k)", "vision.blocks.0.mlp.w1.weight (up)", "image_pad"} <= parts
    assert all(
        u.weight.startswith("language_model.") for u in units if isinstance(u, LinearUnit) and ".ffn." in u.weight
    )


def test_vision_sections_split_as_one_block_pass_values_and_fail_numeric(fixture_dir, tmp_path, monkeypatch) -> None:
    """A mapping bug in the vision rules (q|k|v split as one block instead of per section): values re-derives
    through the same plan and passes; the numeric level names the tensor and the section it holds wrong."""
    from ckpt_tool.mapping.profiles import model_class

    real = model_class.VISION.extra_rules

    def unsectioned() -> list[Rule]:
        return [dataclasses.replace(r, sections=1) if r.sections == 3 else r for r in real()]

    monkeypatch.setattr(model_class, "VISION", dataclasses.replace(model_class.VISION, extra_rules=unsectioned))
    src = fixture_dir("vl-fp4")
    out = do_convert(src, tmp_path / "out", 2)
    report = verify(out, src, level="numeric", kernels="torch", device="cpu")
    assert all(c.ok for c in report.checks if not c.name.startswith("numeric")), report.failures
    bad = [c for c in report.failures if c.name.startswith("numeric:model/vision.blocks.")]
    assert bad and "attn.wqkv" in bad[0].message, [(c.name, c.message) for c in report.failures]


def test_a_replicated_tower_where_vllm_splits_it_fails_structure(fixture_dir, tmp_path, monkeypatch) -> None:
    from ckpt_tool.mapping.profiles import model_class

    real = model_class.VISION.extra_rules

    def replicated() -> list[Rule]:
        return [dataclasses.replace(r, split=Split.REPLICATE) if r.replicate_unless else r for r in real()]

    monkeypatch.setattr(model_class, "VISION", dataclasses.replace(model_class.VISION, extra_rules=replicated))
    src = fixture_dir("vl-fp4-h2")  # 2 heads: vLLM splits the tower at tp 2
    out = do_convert(src, tmp_path / "out", 2)
    report = verify(out, src, level="structure")
    assert not report.ok
    messages = [c.message for c in report.failures]
    assert any("'aligner.w1.bias': shape [256], the engine's parameter takes [128]" in m for m in messages), messages


# ---------------------------------------------------------------------------------------------
# coverage: what was computed, per rank, expert and fused part


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_an_expert_probe_removed_drops_coverage_and_fails_the_check(fixture_dir, tmp_path, monkeypatch, moe) -> None:
    """Rank 1's probe output of MTP expert 5's w3 thrown away after the forward: that part was not compared on the
    ranks holding it (tp: both, the ranks' columns are compared together; ep: its owner, rank 1), so coverage
    counts exactly those units missing, below 100 %, and the coverage check fails naming expert, part and rank."""
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2, moe)
    j, real = 5, mtp_forward.LayerForward.finish

    def forward_losing_one_probe(self, pool):
        a, b = real(self, pool)
        self.sides[1][-1].outputs.pop(f"expert.{j}.w3")  # the last rank's probe rows (sides: source, then ranks)
        return a, b

    monkeypatch.setattr(mtp_forward.LayerForward, "finish", forward_losing_one_probe)
    report = numeric_gate(out, src)
    cov = report.coverage
    holders = ["0", "1"] if moe == "tp" else ["1"]
    assert cov["total"] - cov["checked"] == len(holders) and cov["percent"] < 100, cov
    ranks = cov["components"]["mtp"]["ranks"]
    assert {r for r, c in ranks.items() if c["checked"] < c["total"]} == set(holders), ranks
    assert cov["components"]["model"]["percent"] == 100.0
    assert [c.name for c in report.failures] == [
        "numeric:coverage"
    ]  # nothing compared wrong; something was not compared
    msg = report.failures[0].message
    assert f"mtp rank {holders[0]}: {W13}[expert {j}] part mtp.0.ffn.experts.{j}.w3" in msg, msg
    assert len(report.failures[0].details["not_computed"]) == len(holders)


def test_coverage_counts_per_rank_what_the_runner_compared(fixture_dir, tmp_path) -> None:
    """Main layer 0's attn_sink gone from rank 1's file (the numeric level run alone, without structure): rank 0's
    slice was compared, rank 1's could not be; coverage is short by exactly that rank's unit."""
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    sink = "model.layers.0.attn.attn_sink"
    drop_tensor(out, sink, rank=1, comp="model")
    report = numeric_gate(out, src)
    ranks = report.coverage["components"]["model"]["ranks"]
    assert ranks["0"]["checked"] == ranks["0"]["total"] and ranks["1"]["total"] - ranks["1"]["checked"] == 1, ranks
    assert [c.name for c in report.failures] == ["numeric:model/layers.0", "numeric:coverage"]
    assert f"model rank 1: {sink} part layers.0.attn.attn_sink" in report.failures[1].message


def test_coverage_counts_a_stacked_expert_the_unit_table_forgets(fixture_dir, tmp_path, monkeypatch) -> None:
    """Expected units do not come from the unit table alone: a table that forgets main layer 1's expert 3 of w2
    leaves that slot of the rank's w2 tensors (weight and scale, both ranks) counted and not computed."""
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    real = linear_check.tensor_units
    w2 = "model.layers.1.ffn.experts.routed_experts.w2_weight"

    def forgetful(*args, **kwargs):
        return [
            u for u in real(*args, **kwargs) if not (isinstance(u, LinearUnit) and u.weight == w2 and u.expert == 3)
        ]

    monkeypatch.setattr(linear_check, "tensor_units", forgetful)
    report = numeric_gate(out, src)
    cov = report.coverage["components"]["model"]
    assert cov["total"] - cov["checked"] == 4 and cov["percent"] < 100, cov  # w2_weight, w2_weight_scale x 2 ranks
    fail = next(c for c in report.failures if c.name == "numeric:coverage")
    assert f"{w2} slot 3 (no numeric check computes it)" in fail.message, fail.message


def test_nothing_to_cover_is_n_a_never_100_percent() -> None:
    assert coverage_text({"checked": 0, "total": 0, "percent": None}) == "n/a (0 of 0)"
    assert coverage_text(None) == "-"  # the numeric level did not run
    assert coverage._tally(0, 0)["percent"] is None
    assert coverage._tally(99999, 100000)["percent"] == 99.99  # floored: short of every unit never reads 100


# ---------------------------------------------------------------------------------------------
# reports


def test_junit_has_one_testcase_per_check_and_counts_failures(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    good_xml = tmp_path / "good.xml"
    code, _, err = cli_verify(capsys, out, src, "--junit", good_xml)
    assert code == 0, err
    report = verify(out, src, level="numeric", kernels="torch", device="cpu")
    root = ET.parse(good_xml).getroot()
    cases = root.findall(".//testcase")
    assert [c.get("name") for c in cases] == [c.name for c in report.checks]
    assert root.get("failures") == "0" and not root.findall(".//failure")

    corrupt_sink_rank(out, src)
    bad_xml = tmp_path / "bad.xml"
    code, _, _ = cli_verify(capsys, out, src, "--junit", bad_xml)
    assert code == 1
    root = ET.parse(bad_xml).getroot()
    failures = root.findall(".//failure")
    assert int(root.get("failures")) == len(failures) > 0
    assert int(root.get("tests")) == len(root.findall(".//testcase"))
    assert any(SINK in (f.get("message") or "") for f in failures)


def _three_outcomes() -> VerifyReport:
    report = VerifyReport("out", "src", "numeric")
    report.add(Check("manifest", True))
    report.add(skipped_check("numeric:mtp-forward", "OUT holds no MTP draft (converted with --only model)"))
    report.add(
        Check("values:model/a.safetensors", False, "tensor 'w': bytes differ", file="model/a.safetensors", tensor="w")
    )
    return report


def test_each_check_is_passed_failed_or_skipped_and_json_keeps_them_apart() -> None:
    report = _three_outcomes()
    assert [c.status for c in report.checks] == ["passed", "skipped", "failed"]
    assert not report.ok and report.counts() == "1 passed, 1 skipped, 1 failed"
    doc = report.to_json()
    assert doc["checks"] == 3 and doc["failed"] == 1 and doc["passed"] == ["manifest"]
    assert [(c["name"], c["status"], c["message"]) for c in doc["skipped"]] == [
        ("numeric:mtp-forward", "skipped", "OUT holds no MTP draft (converted with --only model)")
    ]
    assert [(c["name"], c["status"]) for c in doc["failures"]] == [("values:model/a.safetensors", "failed")]
    assert [(r["name"], r["status"]) for r in doc["results"]] == [
        ("manifest", "passed"),
        ("numeric:mtp-forward", "skipped"),
        ("values:model/a.safetensors", "failed"),
    ]
    report.checks.pop()
    assert report.ok  # a skip alone does not fail the gate
    with pytest.raises(AssertionError):
        skipped_check("numeric", "")  # a skip says why
    with pytest.raises(AssertionError):
        Check("numeric", False, "x", status="skipped")  # a failure is never a skip


def test_junit_github_and_the_summary_line_show_skipped_checks(tmp_path, capsys, monkeypatch) -> None:
    report = _three_outcomes()
    write_junit(report, tmp_path / "v.xml")
    root = ET.parse(tmp_path / "v.xml").getroot()
    suite = root.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("3", "1", "1")
    assert root.get("skipped") == "1"
    case = {c.get("name"): c for c in suite.findall("testcase")}
    assert case["numeric:mtp-forward"].find("skipped").get("message").startswith("OUT holds no MTP draft")
    assert case["numeric:mtp-forward"].find("failure") is None and case["manifest"].find("skipped") is None
    assert case["values:model/a.safetensors"].find("failure") is not None

    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path / "summary.md"))
    capsys.readouterr()
    github_summary(report)
    github_annotations(report)
    render_verify(report)
    text = (tmp_path / "summary.md").read_text()
    assert "| numeric | 3 | 1 | 1 | 1 | - |" in text and "### Skipped" in text
    assert "- `numeric:mtp-forward`: OUT holds no MTP draft" in text
    cap = capsys.readouterr()
    assert "::notice title=ckpt-tool verify numeric%3Amtp-forward skipped::OUT holds no MTP draft" in cap.out
    assert "verify (numeric): FAIL 1 passed, 1 skipped, 1 failed (3 checks)" in cap.out
    assert "skipped numeric:mtp-forward: OUT holds no MTP draft" in cap.err


def test_github_annotations_on_failure_and_json_stays_clean(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    code, stdout, err = cli_verify(capsys, out, src, "--github")
    assert code == 0 and "::error" not in stdout + err

    corrupt_swap_fused(out, src)
    code, stdout, _ = cli_verify(capsys, out, src, "--github")
    assert code == 1
    lines = [ln for ln in stdout.splitlines() if ln.startswith("::error")]
    assert lines and "%0A" not in lines[0][:8]
    assert "file=mtp/model-rank-0-part-0.safetensors" in lines[0] and FUSED in lines[0]
    # with --json, stdout is one JSON document and the annotations go to stderr
    code, stdout, err = cli_verify(capsys, out, src, "--github", "--json")
    assert code == 1
    assert json.loads(stdout)["ok"] is False
    assert any(ln.startswith("::error") and FUSED in ln for ln in err.splitlines())


# ---------------------------------------------------------------------------------------------
# the source, the manifest, usage


def test_source_changed_after_conversion_fails_source_fingerprint(fixture_copy, tmp_path, capsys) -> None:
    src = fixture_copy("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    # same tensors, new header (metadata + order): only the fingerprint can tell
    shard = sorted(src.glob("*.safetensors"))[-1]
    with safe_open(str(shard), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    save_file(tensors, str(shard), metadata={"format": "pt", "edited": "after conversion"})
    report = verify(out, src, level="structure")
    assert not report.ok
    assert [c.name for c in report.failures] == ["source-fingerprint"]
    assert shard.name in report.failures[0].message
    code, stdout, err = cli_verify(capsys, out, src, "--json")
    assert code == 1
    assert json.loads(stdout)["failures"][0]["name"] == "source-fingerprint"


def test_source_config_changed_after_conversion_fails_source_fingerprint(fixture_copy, tmp_path) -> None:
    src = fixture_copy("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    cfg = json.loads((src / "config.json").read_text())
    cfg["routed_scaling_factor"] = 2.5
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    report = verify(out, src, level="structure")
    assert any(c.name == "source-fingerprint" for c in report.failures)


def test_missing_output_config_json_fails_verify(fixture_dir, tmp_path) -> None:
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    (out / "mtp" / "config.json").unlink()
    report = verify(out, src, level="structure")
    assert not report.ok


def test_missing_or_incomplete_manifest_exits_1(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 1)
    doc = json.loads((out / MANIFEST).read_text())

    doc["complete"] = False
    (out / MANIFEST).write_text(json.dumps(doc))
    report = verify(out, src)
    assert [c.name for c in report.failures] == ["manifest"] and "not complete" in report.failures[0].message
    code, _, err = cli_verify(capsys, out, src)
    assert code == 1 and "not complete" in err

    (out / MANIFEST).unlink()
    report = verify(out, src)
    assert [c.name for c in report.failures] == ["manifest"] and "missing" in report.failures[0].message
    code, stdout, err = cli_verify(capsys, out, src, "--json")
    assert code == 1
    assert json.loads(stdout)["failures"][0]["name"] == "manifest"


@pytest.mark.parametrize("args", [("--level", "bogus"), ("--kernels", "cuda-graphs"), ("--device", "tpu")])
def test_unknown_level_kernels_device_exit_2(fixture_dir, tmp_path, capsys, args) -> None:
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 1)
    code, stdout, err = run_cli(capsys, "verify", out, "--source", src, *args)
    assert code == 2, (stdout, err)
    assert args[0] in err and "Traceback" not in err
    with pytest.raises(ValueError):
        verify(out, src, level="bogus")


@pytest.mark.parametrize("direct", ["1", "0"], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("block", [4096, 12288])
def test_values_reads_tensors_spanning_many_read_blocks(
    fixture_dir, tmp_path, monkeypatch, direct: str, block: int
) -> None:
    """The values level reads each output file in blocks, ahead of the comparison, and hashes them in order:
    with blocks far smaller than the tensors every tensor spans several, the file's end is a partial block,
    and a good OUT still passes while one flipped byte is named (O_DIRECT and buffered reads alike)."""
    from ckpt_tool.checkpoint import reader as reads
    from ckpt_tool.verify import values as verify_mod

    monkeypatch.setattr(verify_mod, "VALUE_BLOCK_BYTES", block)
    monkeypatch.setattr(reads, "DIRECT_IO", direct == "1")
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    report = verify(out, src, level="values")
    assert report.ok, [(c.name, c.message) for c in report.failures]
    name = corrupt_sink_rank(out, src)
    report = verify(out, src, level="values")
    assert not report.ok and report.failures[0].tensor == name


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_values_reads_each_source_block_once_for_every_rank_within_the_window(
    fixture_dir, tmp_path, monkeypatch, moe
) -> None:
    """The values level reads each source block once for all the ranks cut from it (a split tensor's block is taken by
    every rank, and read by one; a block two groups cut from, the MTP draft's copy of the embedding, is read once by
    each, through the page cache), and the ranks of a group stay close: when a source block is read, no file of the
    reading rank's group (the other ranks' same part; under ep, whose parts may differ, the other ranks' component) is
    more than the window (+ the steps a position takes) past that rank's position. Rank 0 is slowed down (a sleep per
    OUT read): without the lockstep the other ranks run away from it."""
    import threading
    import time

    from ckpt_tool.checkpoint.reader import LocalFiles, SequentialRead
    from ckpt_tool.verify import shared_rows, values

    block, window, tp = 4096, 8 * 4096, 4
    monkeypatch.setattr(values, "VALUE_BLOCK_BYTES", block)
    monkeypatch.setattr(values, "LOCKSTEP_WINDOW", window * tp)  # divided among a group's members
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", tp, moe)
    ckpt = open_checkpoint(src)
    plan = plan_conversion(ckpt.require_config(), ckpt.tensors, Options(tp=tp, moe_parallel=moe))
    files = {f.relpath: f for f in plan.files}
    groups = {
        m[0].relpath: [g for member in group for g in member]
        for group in values._lockstep_groups(list(files.values()))
        for m in group
    }
    sizes = {rel: (out / rel).stat().st_size for rel in files}
    assert max(sizes.values()) > 8 * window, "the files must be much longer than the window for this to mean much"

    lock = threading.Lock()
    pos: dict[str, int] = {}  # OUT file -> where it is being read now (its member's position: earlier parts added)
    base = {
        rel: sum(sizes[g.relpath] for g in groups[rel] if g.rank == files[rel].rank and g.part < files[rel].part)
        for rel in files
    }
    mine = threading.local()
    leads: list[tuple[int, str, tuple]] = []  # (how far the group's leader is past the reading rank, file, range)
    taken: dict[tuple, set[int]] = {}  # source block -> the ranks that cut from it
    cached: dict[tuple, list[bool]] = {}  # source block -> read through the page cache, per read

    class Tracked(SequentialRead):
        def __init__(self, path, size, block_bytes=4096, **how):
            super().__init__(path, size, block_bytes, **how)
            mine.rel = str(Path(path).relative_to(out))
            with lock:
                pos[mine.rel] = base[mine.rel]

        def _at(self, start):
            with lock:
                pos[mine.rel] = base[mine.rel] + start
            if files[mine.rel].rank == 0:
                time.sleep(0.002)

        def read(self, start, n):  # (the engine's zero padding)
            self._at(start)
            return super().read(start, n)

        def mismatch(self, start, want):  # (bytes cut from the source)
            self._at(start)
            return super().mismatch(start, want)

    class Watched(LocalFiles):
        def read_span(self, file, offset, n, scratch, **how):
            rel = mine.rel
            with lock:
                here = pos[rel]
                lead = max(pos.get(g.relpath, 0) for g in groups[rel]) - here
                leads.append((lead, rel, (str(file), offset, n)))
                cached.setdefault((str(file), offset, n), []).append(how.get("again", False))
            return super().read_span(file, offset, n, scratch, **how)

    class Noted(shared_rows.SharedRows):
        def rows(self, key, *, what=""):
            with lock:
                taken.setdefault((str(key[0]), key[1], key[2]), set()).add(files[mine.rel].rank)
            return super().rows(key, what=what)

    monkeypatch.setattr(values, "SequentialRead", Tracked)
    monkeypatch.setattr(values, "SharedRows", Noted)
    monkeypatch.setattr(type(ckpt), "open_bytes", lambda self, **how: Watched(self.root))
    report = verify(out, ckpt, level="values")
    assert report.ok, [(c.name, c.message) for c in report.failures]
    assert set(cached) == set(taken)
    once = [how for how in cached.values() if how == [False]]
    twice = [how for how in cached.values() if how == [True, True]]  # the MTP draft's embedding and head
    odd = {k: v for k, v in cached.items() if v not in ([False], [True, True])}
    assert once and twice and not odd, odd
    assert any(len(r) == tp for r in taken.values()), "every rank cuts from the blocks of a split tensor"
    sink = ckpt.tensors["mtp.0.attn.attn_sink"]  # split by rows, and small: one read of it whole, cut by every rank
    assert sink.nbytes <= block // values.SMALL_TENSORS
    assert taken[(sink.file, sink.start, sink.nbytes)] == set(range(tp))
    header = max(read_shard_header(out / rel, rel).data_start for rel in files)
    worst = max(leads)
    assert worst[0] <= window + 2 * block + header, worst


def test_shared_rows_reads_a_block_once_and_lets_it_go_after_its_last_request(tmp_path) -> None:
    """SharedRows: a block wanted three times is read once and kept until the third request; one given up (skip)
    counts as made; a block wanted once, or read while the kept ones fill ``most``, is not kept; a failed read
    fails every request waiting on it, and is let go."""
    import threading
    from collections import Counter

    from ckpt_tool.checkpoint.reader import LocalFiles
    from ckpt_tool.errors import CheckpointError
    from ckpt_tool.verify.shared_rows import SharedRows

    (tmp_path / "f").write_bytes(bytes(range(256)) * 64)
    a, b, c = ("f", 0, 4096), ("f", 4096, 4096), ("f", 8192, 4096)
    rows = SharedRows(LocalFiles(tmp_path), Counter({a: 3, b: 1, c: 2}), most=4096)
    for _ in range(2):
        with rows.rows(a) as view:
            assert bytes(view) == bytes(range(256)) * 16
    assert (rows.reads, rows.held) == (1, 1)
    with rows.rows(c) as view:  # a is kept, filling most: c is read for this request only
        assert bytes(view[:2]) == b"\x00\x01"
    assert (rows.reads, rows.held) == (2, 1)
    rows.skip([a])  # a's third request will not come
    assert rows.held == 0
    with rows.rows(b):
        pass
    with rows.rows(c):  # read again: it was not kept
        pass
    assert (rows.reads, rows.held) == (4, 0)

    failing = SharedRows(LocalFiles(tmp_path), Counter({("f", 1 << 20, 4096): 2}), most=1 << 20)
    errors = []

    def ask() -> None:
        try:
            with failing.rows(("f", 1 << 20, 4096)):
                pass
        except CheckpointError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 2 and "ended early" in errors[0] and failing.held == 0


def test_a_rank_that_stops_at_a_mismatch_leaves_no_source_block_kept(fixture_dir, tmp_path, monkeypatch) -> None:
    """A rank whose tensor differs stops reading it there: the source blocks it will not ask for are given up, so the
    other ranks' last requests let them go (nothing is kept to the end of the group), and the mismatch is named."""
    from ckpt_tool.verify import shared_rows, values

    made: list[shared_rows.SharedRows] = []

    class Noted(shared_rows.SharedRows):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self)

    def flip_first(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(torch.uint8).view(-1)[0] ^= 0x01
        return t

    monkeypatch.setattr(values, "VALUE_BLOCK_BYTES", 4096)
    monkeypatch.setattr(values, "SharedRows", Noted)
    src = fixture_dir("fp4")
    out = do_convert(src, tmp_path / "out", 2)
    rewrite_tensors(out, 1, {WO_B: flip_first})  # row-parallel: both ranks cut from every block of its rows
    report = verify(out, src, level="values")
    assert not report.ok and report.failures[0].tensor == WO_B
    assert "first at source element [0, " in report.failures[0].message
    assert made and all(r.held == 0 and r._kept_bytes == 0 and not r._left for r in made)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 3 * 4096, 3 * 4096 + 7])
def test_output_files_hash_like_hashlib_through_the_read_ahead_reader(tmp_path, monkeypatch, size: int) -> None:
    """structure's checksums read each output file the way values does (O_DIRECT blocks, read ahead); any size,
    block boundaries and an empty file included, gives hashlib's digest."""
    import hashlib

    from ckpt_tool.checkpoint.reader import sha256_file

    data = bytes((i * 7 + 3) % 251 for i in range(size))
    path = tmp_path / "f.safetensors"
    path.write_bytes(data)
    assert sha256_file(path, block=4096) == hashlib.sha256(data).hexdigest()
