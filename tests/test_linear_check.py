"""The per-tensor numeric check: its unit table covers every engine parameter, and the pieces it rests on
(the fp8 activation path on 3-D inputs, routing to every expert, row reads) behave."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.expert_format import MoeQuant
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.fixtures.make import EXPERTS
from ckpt_tool.mapping.engine_table import ENGINES, engine_params
from ckpt_tool.mapping.plan import Options
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.output.convert import convert
from ckpt_tool.verify import numeric, quant, reference, weight_sides
from ckpt_tool.verify.forward_names import CONVERTED_TENSORS
from ckpt_tool.verify.kernels import fp8_block_gemm
from ckpt_tool.verify.kernels.fp8_gemm import prepare_activation
from ckpt_tool.verify.linear_check import LinearRunner
from ckpt_tool.verify.rows import RowReader
from ckpt_tool.verify.tensor_units import (
    ExactUnit,
    LinearUnit,
    Part,
    _Builder,
    tensor_units,
    unit_label,
    unit_tensors,
)

LAYOUTS = [(1, "tp"), (2, "tp"), (4, "tp"), (4, "ep")]


@pytest.mark.parametrize("profile", sorted(ENGINES))
@pytest.mark.parametrize("variant", ["fp4", "fp8", "fp4-2mtp", "fp4-mtp-emb"])
def test_units_name_every_engine_parameter_exactly_once(fixture_dir, profile, variant) -> None:
    ckpt = open_checkpoint(fixture_dir(variant))
    cfg = ckpt.require_config()
    for tp, moe in LAYOUTS:
        for comp in ("model", "mtp"):
            units = tensor_units(cfg, profile, comp, tp, moe, set(ckpt.tensors))
            expected = set(engine_params(cfg, profile, comp, tp, moe))
            for rank in range(tp):
                names = [n for u in units if rank in u.ranks for n in unit_tensors(u)]
                stacked = {
                    n for u in units if isinstance(u, LinearUnit) and u.expert is not None for n in unit_tensors(u)
                }
                assert set(names) == expected, (comp, tp, moe, rank, sorted(set(names) ^ expected)[:5])
                plain = [n for n in names if n not in stacked]
                assert len(plain) == len(set(plain)), (comp, tp, moe)  # stacked expert tensors appear once per expert
            # every source tensor a unit reads exists in the checkpoint
            for u in units:
                parts = (
                    [u.source]
                    if not isinstance(u, LinearUnit)
                    else [
                        n
                        for p in u.parts
                        for n in ((p.source,) if u.kind == "bf16" else (p.source + ".weight", p.source + ".scale"))
                    ]
                )
                assert all(n in ckpt.tensors for n in parts), parts


def test_fp8_activation_path_takes_3d_inputs() -> None:
    """h_proj's input is [T, hc, D]: the fp8 activation groups run per token along the last dim."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 256, generator=g)
    flat = prepare_activation(x.reshape(-1, 256), "fp8").reshape(3, 4, 256)
    assert torch.equal(prepare_activation(x, "fp8"), flat)
    w, s = quant.fp8_block_quant(torch.randn(128, 256, generator=g) / 16)
    y = fp8_block_gemm(x.reshape(-1, 256), w, s, act="fp8", backend="torch")
    assert torch.equal(prepare_activation(x, "fp8").reshape(-1, 256) @ quant.fp8_block_dequant(w, s).T, y)


def test_numeric_level_with_fp8_activations_passes(fixture_dir, tmp_path) -> None:
    """act='fp8' runs the whole MTP forward (h_proj on 3-D input included) and every tensor check."""
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    convert(src, out, Options(tp=2))
    from ckpt_tool.checkpoint.headers import read_shard_header
    from ckpt_tool.verify.verdict import VerifyReport

    ckpt = open_checkpoint(src)
    plan = plan_conversion(
        ckpt.require_config(), ckpt.tensors, Options(**json.loads((out / "ckpt-tool.json").read_text())["options"])
    )
    headers = {f.relpath: read_shard_header(out / f.relpath, f.relpath) for f in plan.files}
    report = VerifyReport(str(out), str(src), "numeric")
    numeric.check_numeric(out, plan, ckpt, headers, report, kernels="torch", device="cpu", tokens=8, seed=1, act="fp8")
    assert report.ok, [(c.name, c.message) for c in report.failures]
    assert report.coverage["percent"] == 100.0


def test_route_all_reaches_every_expert_and_keeps_topk_weights() -> None:
    from ckpt_tool.fixtures.make import VARIANTS, make_config

    cfg = V4Config.from_dict(make_config(VARIANTS["fp4"]))
    weights = reference.make_random_layer(cfg, seed=3)
    shard = reference.DenseShard(cfg, weights)
    x = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    dense = reference.route_every_expert(cfg, shard, x)
    assert (dense != 0).any(0).all()  # every expert has a token
    w, ids = reference.route(cfg, shard, x)
    assert torch.equal(dense.gather(1, ids), w)  # the router's own choices keep their weights
    assert int((dense != 0).sum()) == cfg.num_experts_per_tok * 2 + (EXPERTS - len(set(ids.flatten().tolist())))


def test_row_reader_reads_stacked_expert_rows(fixture_dir, tmp_path) -> None:
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    convert(src, out, Options(tp=1))
    from safetensors import safe_open

    idx = json.loads((out / "mtp" / "index.json").read_text())["ranks"]["0"]
    name = next(n for n in idx if n.endswith("w13_weight"))
    path = out / "mtp" / idx[name]
    from ckpt_tool.checkpoint.headers import read_shard_header

    info = read_shard_header(path, "x").tensors[name]
    with safe_open(str(path), framework="pt") as fh:
        full = fh.get_tensor(name)
    E, N, K = full.shape
    with RowReader() as r:
        assert torch.equal(r.rows(path, info, 3 * N + 5, 3 * N + 9), full[3, 5:9])
        assert torch.equal(r.whole(path, info), full)


@pytest.mark.parametrize("direct", [True, False])
def test_row_reader_direct_reads_give_what_the_file_holds(fixture_dir, tmp_path, monkeypatch, direct) -> None:
    """Reads of OUT's files (O_DIRECT, small ones through the page cache on a second descriptor) give the bytes
    safetensors gives, from many threads at once, up to the last byte of the file; so does the buffered path."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors import safe_open

    from ckpt_tool.checkpoint import reader as reads
    from ckpt_tool.checkpoint.headers import read_shard_header
    from ckpt_tool.verify import rows as tensor_rows

    monkeypatch.setattr(reads, "DIRECT_IO", direct)
    monkeypatch.setattr(reads, "DIRECT_FROM", 8192)  # the fixture's tensors: both kinds of read
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    convert(src, out, Options(tp=2))
    path = next((out / "mtp").glob("*.safetensors"))
    infos = read_shard_header(path, "x").tensors
    with safe_open(str(path), framework="pt") as fh:
        full = {n: fh.get_tensor(n) for n in infos}
    g = torch.Generator().manual_seed(3)
    jobs = []
    for name, info in sorted(infos.items(), key=lambda kv: kv[1].start):
        rows = tensor_rows.row_count(info)
        for _ in range(4):
            r0 = int(torch.randint(0, rows, (1,), generator=g))
            jobs.append((name, r0, int(torch.randint(r0, rows + 1, (1,), generator=g))))
        jobs.append((name, 0, rows))
    last = max(infos.values(), key=lambda i: i.start)
    jobs.append((last.name, tensor_rows.row_count(last) - 1, tensor_rows.row_count(last)))  # the file's last bytes

    with tensor_rows.RowReader(direct_root=out) as reader:

        def read(job):
            name, r0, r1 = job
            return reader.rows(path, infos[name], r0, r1)

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(read, jobs))
        assert reader._out._fd(path, buffered=False)[1] is direct
    for (name, r0, r1), t in zip(jobs, got):
        want = full[name].reshape(-1, full[name].shape[-1] if full[name].dim() else 1)[r0:r1]
        assert t.shape[0] == r1 - r0
        assert torch.equal(t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (name, r0, r1)


def test_numeric_level_gives_the_same_report_on_one_worker_or_several(fixture_dir, tmp_path) -> None:
    """The compute pool only changes who computes: checks, coverage and the forward's metrics are identical (the
    experts' outputs are summed in the same order whatever thread computed them)."""
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    convert(src, out, Options(tp=2))
    from ckpt_tool.checkpoint.headers import read_shard_header
    from ckpt_tool.verify.verdict import VerifyReport

    ckpt = open_checkpoint(src)
    plan = plan_conversion(
        ckpt.require_config(), ckpt.tensors, Options(**json.loads((out / "ckpt-tool.json").read_text())["options"])
    )
    headers = {f.relpath: read_shard_header(out / f.relpath, f.relpath) for f in plan.files}
    reports, threads = [], torch.get_num_threads()
    for workers in (1, 3):
        report = VerifyReport(str(out), str(src), "numeric")
        numeric.check_numeric(
            out, plan, ckpt, headers, report, kernels="torch", device="cpu", tokens=8, seed=2, workers=workers
        )
        reports.append(report)
    one, many = reports
    assert one.ok and many.ok, [(c.name, c.message) for c in one.failures + many.failures]
    assert [(c.name, c.ok) for c in one.checks] == [(c.name, c.ok) for c in many.checks]
    assert one.coverage == many.coverage and one.coverage["percent"] == 100.0
    assert one.numeric == many.numeric
    assert torch.get_num_threads() == threads  # the pool gave the caller its torch threads back


def test_fan_out_answers_every_task_from_forked_children() -> None:
    import os

    from ckpt_tool.verify.compute_pool import can_fork_workers, fan_out

    if not can_fork_workers():
        pytest.skip("forked workers are not available here")
    me = os.getpid()
    answers = dict(fan_out(50, 2, lambda task, pool: (task * task, os.getpid(), pool.workers)))
    assert sorted(answers) == list(range(50))
    assert all(sq == t * t and pid != me and workers == 1 for t, (sq, pid, workers) in answers.items())


def test_a_forked_worker_that_dies_leaves_its_units_to_the_parent(fixture_dir, tmp_path, monkeypatch) -> None:
    """A child killed in the middle of a unit answers nothing for it: the parent runs what is missing, so the checks
    and the coverage are what one worker gives."""
    import os

    from ckpt_tool.checkpoint.headers import read_shard_header
    from ckpt_tool.verify import linear_check
    from ckpt_tool.verify.compute_pool import can_fork_workers
    from ckpt_tool.verify.verdict import VerifyReport

    if not can_fork_workers():
        pytest.skip("forked workers are not available here")
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    convert(src, out, Options(tp=2))
    ckpt = open_checkpoint(src)
    plan = plan_conversion(
        ckpt.require_config(), ckpt.tensors, Options(**json.loads((out / "ckpt-tool.json").read_text())["options"])
    )
    headers = {f.relpath: read_shard_header(out / f.relpath, f.relpath) for f in plan.files}
    parent, real = os.getpid(), linear_check.LinearRunner.run

    def dies_in_children(self, u):
        if os.getpid() != parent and u.expert == 3:
            os._exit(1)
        return real(self, u)

    def check(workers: int) -> VerifyReport:
        report = VerifyReport(str(out), str(src), "numeric")
        numeric.check_numeric(
            out, plan, ckpt, headers, report, kernels="torch", device="cpu", tokens=4, seed=0, workers=workers
        )
        return report

    one = check(1)
    monkeypatch.setattr(linear_check.LinearRunner, "run", dies_in_children)
    many = check(2)
    assert many.ok and many.coverage == one.coverage and many.coverage["percent"] == 100.0
    assert [(c.name, c.ok) for c in many.checks] == [(c.name, c.ok) for c in one.checks]


class _InMemorySides:
    """The two sides of a LinearRunner from tensors in memory: source tensors by name, each rank's by name."""

    device = torch.device("cpu")

    def __init__(self, source: dict[str, torch.Tensor], ranks: dict[int, dict[str, torch.Tensor]]) -> None:
        self.source, self.ranks = source, ranks

    @staticmethod
    def _rows(t: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        """Rows of the 2-D view, as RowReader.rows reads them (a stacked [E, R, C] tensor: E * R rows; a 0-d or 1-D
        one: one row)."""
        return (t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1))[r0:r1]

    def source_rows(self, name, r0, r1, into=None):
        return self._rows(self.source[name], r0, r1)

    def engine_info(self, rank, name):
        return None, SimpleNamespace(shape=tuple(self.ranks[rank][name].shape))

    def engine_rows(self, rank, name, r0, r1, into=None):
        return self._rows(self.ranks[rank][name], r0, r1)


@pytest.mark.parametrize("expand", ["as vLLM does", "wrongly"])
def test_an_mxfp8_split_inside_a_32_row_scale_block_is_checked_from_the_block_start(expand) -> None:
    """96 MXFP8 rows over 2 ranks: rank 1 starts at row 48, inside checkpoint scale block 1, and its rows run on into
    block 2; its reference rows are computed from block 1's first row. A scale expanded per row as vLLM does agrees;
    rank 1 holding the next block's scale for its first 16 rows fails, naming the rank."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 126, (96, 64), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(120, 134, (3, 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    rows = scale.repeat_interleave(32, dim=0)
    if expand == "wrongly":  # rank 1's start rounded up to the next block
        rows = torch.cat([rows[:48], scale[2:3].expand(16, 2), rows[64:]])
    ranks = {
        r: {"w.weight": bits[48 * r : 48 * (r + 1)], "w.weight_scale": rows[48 * r : 48 * (r + 1)]} for r in (0, 1)
    }
    unit = LinearUnit("g", "w.weight", "w.weight_scale", "mxfp8", (Part("src", 96),), 64, "col", (0, 1))
    runner = LinearRunner(
        _InMemorySides({"src.weight": bits, "src.scale": scale}, ranks), kernels="torch", act="bf16", seed=0
    )
    problem = runner.run(unit)
    if expand == "as vLLM does":
        assert problem is None and runner.take_computed() == {("w.weight", "src"): 0b11}
    else:
        assert problem is not None and "'w.weight' (scale 'w.weight_scale') (rank 1)" in problem, problem


NV_E, NV_D, NV_I = 2, 64, 64  # experts, hidden size, expert intermediate size: I / 2 ranks = 32 inputs, 2 groups


def _nvfp4_experts(gen: torch.Generator, prefix: str = "src") -> dict[str, torch.Tensor]:
    """Source tensors of NV_E NVFP4 experts as NVIDIA's export names them: .weight, .weight_scale, .weight_scale_2,
    .input_scale (every part's scales different, so one taken for another shows)."""
    src = {}
    for j in range(NV_E):
        for which, (rows, inp) in {"w1": (NV_I, NV_D), "w3": (NV_I, NV_D), "w2": (NV_D, NV_I)}.items():
            packed, scale, g = quant.nvfp4_quant(torch.randn(rows, inp, generator=gen) * (1 + j + len(which)))
            base = f"{prefix}.experts.{j}.{which}"
            src[f"{base}.weight"], src[f"{base}.weight_scale"], src[f"{base}.weight_scale_2"] = packed, scale, g
            src[f"{base}.input_scale"] = torch.rand((), generator=gen) + 0.01
    return src


def _nvfp4_ranks(
    src: dict[str, torch.Tensor], moe: str, prefix: str = "src", engine: str = "r", input_scales: str | None = None
) -> dict[int, dict[str, torch.Tensor]]:
    """Each rank's stacked parameters as vLLM's ModelOptNvFp4FusedMoE holds them: tp 2 splits w1/w3 rows and w2
    inputs (packed bytes and scale groups alike), ep 2 gives each rank one whole expert; with ``input_scales``
    ("local" or "global": every expert's on every rank) also w13_input_scale / w2_input_scale."""
    ranks = {}
    for r in range(2):
        experts = range(NV_E) if moe == "tp" else [r]
        w13, s13, g13, w2, s2, g2 = [], [], [], [], [], []
        for j in experts:
            e = f"{prefix}.experts.{j}"
            rows = slice(r * NV_I // 2, (r + 1) * NV_I // 2) if moe == "tp" else slice(None)
            w13.append(torch.cat([src[f"{e}.w1.weight"][rows], src[f"{e}.w3.weight"][rows]]))
            s13.append(torch.cat([src[f"{e}.w1.weight_scale"][rows], src[f"{e}.w3.weight_scale"][rows]]))
            g13.append(torch.stack([src[f"{e}.w1.weight_scale_2"], src[f"{e}.w3.weight_scale_2"]]))
            cols = slice(r * NV_I // 4, (r + 1) * NV_I // 4) if moe == "tp" else slice(None)
            groups = slice(r * NV_I // 32, (r + 1) * NV_I // 32) if moe == "tp" else slice(None)
            w2.append(src[f"{e}.w2.weight"][:, cols])
            s2.append(src[f"{e}.w2.weight_scale"][:, groups])
            g2.append(src[f"{e}.w2.weight_scale_2"])
        ranks[r] = {
            f"{engine}.w13_weight": torch.stack(w13),
            f"{engine}.w13_weight_scale": torch.stack(s13),
            f"{engine}.w13_weight_scale_2": torch.stack(g13),
            f"{engine}.w2_weight": torch.stack(w2),
            f"{engine}.w2_weight_scale": torch.stack(s2),
            f"{engine}.w2_weight_scale_2": torch.stack(g2),
        }
        if input_scales:
            held = range(NV_E) if input_scales == "global" else experts
            a13 = [torch.stack([src[f"{prefix}.experts.{j}.{w}.input_scale"] for w in ("w1", "w3")]) for j in held]
            ranks[r][f"{engine}.w13_input_scale"] = torch.stack(a13)
            ranks[r][f"{engine}.w2_input_scale"] = torch.stack(
                [src[f"{prefix}.experts.{j}.w2.input_scale"] for j in held]
            )
    return ranks


def _nvfp4_units(moe: str) -> list[LinearUnit]:
    units = []
    for j in range(NV_E):
        ranks, local, lay13, lay2 = ((0, 1), (j, j), "col", "row") if moe == "tp" else ((j,), (0,), "full", "full")
        e = f"src.experts.{j}"
        units.append(
            LinearUnit(
                "g", "r.w13_weight", "r.w13_weight_scale", "nvfp4", (Part(f"{e}.w1", NV_I), Part(f"{e}.w3", NV_I)),
                NV_D, lay13, ranks, j, local, global_scale="r.w13_weight_scale_2",
            )
        )  # fmt: skip
        units.append(
            LinearUnit(
                "g", "r.w2_weight", "r.w2_weight_scale", "nvfp4", (Part(f"{e}.w2", NV_D),), NV_I, lay2, ranks, j,
                local, global_scale="r.w2_weight_scale_2",
            )
        )  # fmt: skip
    return units


@pytest.mark.parametrize("moe", ["tp", "ep"])
@pytest.mark.parametrize("broken", [None, "w1 and w3 global scales swapped", "w2 global scale of another expert"])
def test_nvfp4_experts_are_checked_part_by_part_with_their_own_global_scales(moe: str, broken: str | None) -> None:
    """NVFP4 routed experts through the per-tensor runner (kernels and torch reference), tp 2 and ep 2: every part on
    every rank agrees and counts; a rank whose w13_weight_scale_2 has w1's and w3's swapped, or whose
    w2_weight_scale_2 holds another expert's, fails naming the tensor, the expert and the rank."""
    gen = torch.Generator().manual_seed(44)
    src = _nvfp4_experts(gen)
    ranks = _nvfp4_ranks(src, moe)
    if broken == "w1 and w3 global scales swapped":
        ranks[1]["r.w13_weight_scale_2"] = ranks[1]["r.w13_weight_scale_2"].flip(-1).contiguous()
    elif broken == "w2 global scale of another expert":
        if moe == "tp":
            ranks[1]["r.w2_weight_scale_2"] = ranks[1]["r.w2_weight_scale_2"].flip(0).contiguous()
        else:
            ranks[1]["r.w2_weight_scale_2"] = src["src.experts.0.w2.weight_scale_2"].reshape(1)
    runner = LinearRunner(_InMemorySides(src, ranks), kernels="torch", act="bf16", seed=0)
    problems = [p for p in (runner.run(u) for u in _nvfp4_units(moe)) if p is not None]
    if broken is None:
        assert problems == []
        every_rank = 0b11 if moe == "tp" else None
        for j in range(NV_E):
            want = every_rank or 1 << j
            assert runner.computed[(f"r.w13_weight[expert {j}]", f"src.experts.{j}.w1")] == want
            assert runner.computed[(f"r.w13_weight[expert {j}]", f"src.experts.{j}.w3")] == want
            assert runner.computed[(f"r.w2_weight[expert {j}]", f"src.experts.{j}.w2")] == want
        return
    tensor = "r.w13_weight" if broken.startswith("w1") else "r.w2_weight"
    where = "rank 1" if moe == "ep" or tensor == "r.w13_weight" else "ranks summed"
    assert problems and all(tensor in p for p in problems), problems
    assert any(f"expert 1 ({where})" in p for p in problems), problems


def test_nvfp4_experts_through_the_triton_kernel_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tp 2 experts with the engine side through the Triton NVFP4 kernel (the CPU interpreter)."""
    pytest.importorskip("triton")
    import triton.language  # noqa: F401  (before the variable: see tests/test_kernels.py's module doc)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    src = _nvfp4_experts(torch.Generator().manual_seed(45))
    runner = LinearRunner(_InMemorySides(src, _nvfp4_ranks(src, "tp")), kernels="triton", act="bf16", seed=0)
    assert [runner.run(u) for u in _nvfp4_units("tp")] == [None] * (2 * NV_E)


def test_nvfp4_units_name_their_global_scales_for_the_coverage() -> None:
    unit = _nvfp4_units("tp")[0]
    assert unit_tensors(unit) == ["r.w13_weight", "r.w13_weight_scale", "r.w13_weight_scale_2"]


@pytest.mark.parametrize(("moe", "input_scales"), [("tp", "local"), ("ep", "local"), ("ep", "global")])
@pytest.mark.parametrize("broken", [False, True])
def test_nvfp4_routed_units_follow_the_config_and_check_input_scales(
    fixture_dir, moe: str, input_scales: str, broken: bool
) -> None:
    """A config whose moe_quant_algo is NVFP4 with mtp.* ignored: layers.0's routed experts become nvfp4 units (global
    scales on the linears, each expert's three input scales as elements of the stacked w13_input_scale [E_x, 2] /
    w2_input_scale [E_x], local slots or global ids under ep), mtp.0's stay mxfp4; every unit runs clean and counts
    every rank; rank 1 holding w1's and w3's input scales swapped fails naming the tensor and the rank."""
    base = open_checkpoint(fixture_dir("fp4")).require_config()
    cfg = replace(
        base,
        hidden_size=NV_D,
        moe_intermediate_size=NV_I,
        n_routed_experts=NV_E,
        moe_quant=MoeQuant("NVFP4", ("mtp.*",)),
    )
    profile = sorted(ENGINES)[0]
    b = _Builder(cfg, ENGINES[profile], 2, moe == "ep", set(), global_input_scales=input_scales == "global")
    b.routed("P", "layers.0", NV_E)
    b.routed("Q", "mtp.0", NV_E)
    engine = f"P.{ENGINES[profile].routed}"
    layer, draft = [u for u in b.units if "P." in unit_label(u)], [u for u in b.units if "Q." in unit_label(u)]
    assert {u.kind for u in draft} == {"mxfp4"} and all(u.global_scale is None for u in draft)
    assert {u.kind for u in layer if isinstance(u, LinearUnit)} == {"nvfp4"}
    assert sorted({n for u in layer for n in unit_tensors(u)}) == sorted(
        f"{engine}.{t}" for w in ("w13", "w2") for t in (f"{w}_weight", f"{w}_weight_scale", f"{w}_weight_scale_2",
                                                          f"{w}_input_scale")
    )  # fmt: skip
    src = _nvfp4_experts(torch.Generator().manual_seed(46), "layers.0.ffn")
    ranks = _nvfp4_ranks(src, moe, "layers.0.ffn", engine, input_scales)
    if broken:
        ranks[1][f"{engine}.w13_input_scale"] = ranks[1][f"{engine}.w13_input_scale"].flip(-1).contiguous()
    runner = LinearRunner(_InMemorySides(src, ranks), kernels="torch", act="bf16", seed=0)
    problems = [p for p in (runner.run_exact(u) if isinstance(u, ExactUnit) else runner.run(u) for u in layer) if p]
    if broken:
        assert problems and all(f"'{engine}.w13_input_scale' (rank 1)" in p for p in problems), problems
        return
    assert problems == []
    held = {r: range(NV_E) if moe == "tp" or input_scales == "global" else [r] for r in (0, 1)}
    for j in range(NV_E):
        for w in ("w1", "w3", "w2"):
            want = sum(1 << r for r in (0, 1) if j in held[r])
            key = (f"{engine}.{'w2' if w == 'w2' else 'w13'}_input_scale", f"layers.0.ffn.experts.{j}.{w}.input_scale")
            assert runner.computed[key] == want, (key, runner.computed.get(key))


class _InMemoryReader:
    """RowReader's reads from tensors in memory, by tensor name (the rows of their 2-D view)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.infos = {n: SimpleNamespace(name=n, shape=tuple(t.shape)) for n, t in tensors.items()}

    def rows(self, path, info, r0, r1, into=None):
        return _InMemorySides._rows(self.tensors[info.name], r0, r1)

    def source_rows(self, ckpt, name, r0, r1, into=None):
        return _InMemorySides._rows(self.tensors[name], r0, r1)


@pytest.mark.parametrize("broken", [False, True])
def test_the_mtp_forwards_weight_sides_run_nvfp4_experts(fixture_dir, broken: bool) -> None:
    """The MTP forward's two sides (verify/weight_sides.py) on an older NVFP4 export (no ignore: the draft's experts
    NVFP4 too): the source's experts dequantized in torch from .weight_scale / .weight_scale_2, each tp rank's through
    the NVFP4 GEMM with its w13_weight_scale_2[slot, part] / w2_weight_scale_2[slot]; recombined as the engine does
    they agree, and a rank holding w1's and w3's global scales swapped gives w1 and w3 outputs that do not."""
    base_cfg = open_checkpoint(fixture_dir("fp4")).require_config()
    cfg = replace(
        base_cfg, hidden_size=NV_D, moe_intermediate_size=NV_I, n_routed_experts=NV_E, moe_quant=MoeQuant("NVFP4")
    )
    profile = sorted(CONVERTED_TENSORS)[0]
    engine = CONVERTED_TENSORS[profile]["experts"].format(S=cfg.num_hidden_layers)
    src = _nvfp4_experts(torch.Generator().manual_seed(47), "mtp.0.ffn")
    ranks = _nvfp4_ranks(src, "tp", "mtp.0.ffn", engine)
    if broken:
        ranks[1][f"{engine}.w13_weight_scale_2"] = ranks[1][f"{engine}.w13_weight_scale_2"].flip(-1).contiguous()
    source_reader = _InMemoryReader(src)
    source = weight_sides.SourceShard(
        cfg, SimpleNamespace(tensors=source_reader.infos), 0, torch.device("cpu"), source_reader
    )
    plan = SimpleNamespace(options=SimpleNamespace(tp=2, moe_parallel="tp", profile=profile), files=[])
    shards = []
    for r in (0, 1):
        reader = _InMemoryReader(ranks[r])
        shard = weight_sides.ConvertedShard(cfg, plan, None, {}, r, 0, torch.device("cpu"), reader, "torch", "bf16")
        shard.locate = {n: (None, info) for n, info in reader.infos.items()}
        shards.append(shard)
    assert shards[0].expert_kind == "nvfp4"
    x = torch.randn(3, NV_D, generator=torch.Generator().manual_seed(1))
    worst = {}
    for j in range(NV_E):
        for which in ("w1", "w3", "w2"):
            role = f"expert.{j}.{which}"
            xs = x if which != "w2" else torch.randn(3, NV_I, generator=torch.Generator().manual_seed(j))
            want = source.linear(role, xs)
            if which == "w2":  # row parallel: each rank its half of the inputs, partial sums added
                got = sum(s.linear(role, xs[:, r * NV_I // 2 : (r + 1) * NV_I // 2]) for r, s in enumerate(shards))
            else:  # column parallel: each rank its half of the rows
                got = torch.cat([s.linear(role, xs) for s in shards], dim=-1)
            worst[role] = ((got - want).abs().max() / want.abs().max()).item()
    bad = {role for role, rel in worst.items() if rel > 1e-5}
    assert bad == ({f"expert.{j}.{w}" for j in range(NV_E) for w in ("w1", "w3")} if broken else set()), worst
