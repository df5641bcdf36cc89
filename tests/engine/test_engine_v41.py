"""DeepSeek V4.1 (``DeepseekV41ForCausalLM``, the vision wrapper ``vllm/models/deepseek_v41/nvidia/vl_model.py`` around
``nvidia/model.py``'s text model) and its DSpark draft (``DSparkV41DraftModel``,
``vllm/models/deepseek_v41/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM``, speculative method "dspark"), built by the
worker (tests/engine/vllm_worker.py) from every verified vLLM release on CPU: its components ``model`` and
``dspark`` pick the V4.1 classes when config.json says ``model_type: deepseek_v41``. No ckpt-tool here:

* the harness self-test, per component: vLLM's own stock load of the ``v41`` fixture (the original DeepSeek names),
  written by vLLM's own ``ShardedStateLoader.save_model``, loads back through ``ShardedStateLoader.load_weights``
  byte for byte on every rank at tp 1, 2, 4 and with expert parallel at tp 2 and 4, warnings listed. The draft's
  ``model.embed_tokens.weight`` and ``lm_head.weight`` are written by no checkpoint tensor (vLLM aliases the
  target's after a real load): in the saved draft files they are replaced by the target's own rank shards;
* the values vLLM holds, read against the fixture's own tensors: each rank's Engram rows (whole hash heads) and the
  MXFP8 scales (32x32 checkpoint blocks, rows repeated 32 times, then the usual TP slice);
* the per-rank key table (printed with ``-s``), collapsed over layers, with the Engram tables' per-rank row counts.

Run: ``pytest -m engine tests/engine/test_engine_v41.py -s``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_tool.fixtures.make import (
    V41_DSPARK_EXPERTS,
    V41_ENGRAM_LAYERS,
    V41_EXPERTS,
    V41_HEAD_DIM,
    V41_STAGES,
    v41_engram_rank_rows,
)

pytestmark = pytest.mark.engine

TARGET_CLASS = "vllm.models.deepseek_v41.nvidia.vl_model.DeepseekV41ForCausalLM"
DRAFT_CLASS = "vllm.models.deepseek_v41.nvidia.dspark.DSparkDeepseekV4ForCausalLM"
COMPONENTS = ("model", "dspark")
# (tp, expert parallel): tp 2 and tp 4 with expert parallel (uneven Engram rows, whole experts); ckpt-tool's own output
# is proven at tp 1, 2, 4 and ep below (V4_1 matrix), so the harness needs no more settings (CI time)
SETTINGS = [(2, False), (4, True)]
# written by no checkpoint tensor: vLLM's load_dspark_model aliases the target's (v1/worker/gpu/spec_decode/dspark)
SHARED_WITH_TARGET = {
    "model.embed_tokens.weight": "language_model.model.embed_tokens.weight",
    "lm_head.weight": "language_model.lm_head.weight",
}
CONTEXT_WKV = ("model.context_wkv_proj.weight", "model.context_wkv_proj.weight_scale")  # the 0.34 draft only
_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.w[123]\.(weight|scale)$")
_LAYER = re.compile(r"^((?:language_model\.)?model\.layers\.)(\d+)\.")


def _tag(tp: int, ep: bool) -> str:
    return f"tp{tp}{'-ep' if ep else ''}"


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def v41_runs(vllm_release, fixture_dir, run_worker, tmp_path_factory) -> dict:
    """Every setting, component and rank: vLLM's stock load of ``v41`` (+ save_model), then its sharded load of what
    it saved; two worker processes (one vLLM import each)."""
    src = fixture_dir("v41")
    root = tmp_path_factory.mktemp(f"v41-{vllm_release.version}")
    stock_jobs, sharded_jobs = [], []
    for tp, ep in SETTINGS:
        tag = _tag(tp, ep)
        for component in COMPONENTS:
            for rank in range(tp):
                base = {"config": str(src), "tp": tp, "rank": rank, "ep": ep, "component": component}
                stock_jobs.append(
                    {
                        **base,
                        "op": "stock-load",
                        "source": str(src),
                        "save": str(root / tag / component),
                        "dump": str(root / "dumps" / f"stock-{tag}-{component}-{rank}.safetensors"),
                    }
                )
                sharded_jobs.append(
                    {
                        **base,
                        "op": "sharded-load",
                        "folder": str(root / tag / component),
                        "dump": str(root / "dumps" / f"sharded-{tag}-{component}-{rank}.safetensors"),
                    }
                )
    expect_jobs = [
        {"op": "expect", "config": str(src), "tp": 2, "rank": 1, "ep": False, "component": c} for c in COMPONENTS
    ]
    t0 = time.perf_counter()
    results = run_worker(stock_jobs + expect_jobs)
    t_stock = time.perf_counter() - t0
    stock = {(_tag(r["job"]["tp"], r["job"]["ep"]), r["job"]["component"], r["job"]["rank"]): r for r in results[:-2]}
    expect = {r["job"]["component"]: r for r in results[-2:]}
    for key, r in stock.items():
        assert r["error"] is None and r["exception"] is None, (key, r["error"], r.get("exception"))
    # What load_dspark_model ends with: the draft's embedding and head are the target's (rank r's shard).
    for tp, ep in SETTINGS:
        tag = _tag(tp, ep)
        for rank in range(tp):
            files = sorted((root / tag / "dspark").glob(f"model-rank-{rank}-part-*.safetensors"))
            assert len(files) == 1, files
            draft = load_file(files[0])
            target = load_file(stock[(tag, "model", rank)]["job"]["dump"])
            for key, target_key in SHARED_WITH_TARGET.items():
                assert draft[key].shape == target[target_key].shape, (tag, rank, key)
                draft[key] = target[target_key].clone()
            save_file(draft, str(files[0]))
    t1 = time.perf_counter()
    sharded_results = run_worker(sharded_jobs)
    t_sharded = time.perf_counter() - t1
    sharded = {
        (_tag(r["job"]["tp"], r["job"]["ep"]), r["job"]["component"], r["job"]["rank"]): r for r in sharded_results
    }
    print(
        f"\n[{vllm_release.id} v41] {len(stock_jobs)} stock loads + save_model + {len(expect_jobs)} expect: "
        f"{t_stock:.1f}s; {len(sharded_jobs)} sharded loads: {t_sharded:.1f}s"
    )
    return {"src": src, "stock": stock, "sharded": sharded, "expect": expect}


def _warnings(records: list[dict]) -> list[str]:
    return [r["message"] for r in records if r["level"] in ("WARNING", "ERROR", "CRITICAL")]


@pytest.mark.parametrize("component", COMPONENTS)
def test_v41_harness_on_vllms_own_sharded_save(component, vllm_release, v41_runs):
    stock, sharded = v41_runs["stock"], v41_runs["sharded"]
    problems: list[str] = []
    listed: dict[tuple[str, str], list[str]] = {}
    for tp, ep in SETTINGS:
        tag = _tag(tp, ep)
        for rank in range(tp):
            where = f"{component} {tag} rank {rank}"
            st, sh = stock[(tag, component, rank)], sharded[(tag, component, rank)]
            assert st["class"] == (TARGET_CLASS if component == "model" else DRAFT_CLASS), (where, st["class"])
            assert st["saved"] == [f"model-rank-{rank}-part-0.safetensors"], (where, st["saved"])
            if component == "model":
                # every non-draft tensor of the checkpoint is placed somewhere, and every key is written
                assert st["untouched_keys"] == [], (where, st["untouched_keys"])
                skipped = [s for s in st["sources_read"] if not s.startswith("mtp.")]
            else:
                assert sorted(st["untouched_keys"]) == sorted(SHARED_WITH_TARGET), (where, st["untouched_keys"])
                skipped = [s for s in st["sources_read"] if s.startswith("mtp.")]
                wkv = st["provenance"]["mtp.0.attn.wkv.scale"]["keys"]
                has_context = "model.context_wkv_proj.weight_scale" in wkv
                # 0.34 copies every stage's wkv into context_wkv_proj; 0.33 has no such parameter
                assert has_context == (vllm_release.version != "0.33.0"), (where, wkv)
            if ep:  # expert parallel: a rank places its own experts only
                n_experts = V41_EXPERTS if component == "model" else V41_DSPARK_EXPERTS
                local = range(rank * n_experts // tp, (rank + 1) * n_experts // tp)
                other = [s for s in skipped if (m := _EXPERT.search(s)) and int(m.group(1)) not in local]
                skipped = [s for s in skipped if s not in other]
                assert other, (where, "expert parallel skips no other rank's expert")
            assert not skipped, (where, skipped)
            assert sh["error"] is None, (where, sh["error"])
            assert sh["exception"] is None, (where, sh["exception"], sh["precheck"])
            assert not any(sh["precheck"].values()), (where, sh["precheck"])
            assert sh["keys"] == st["keys"], f"{where}: the two builds disagree on the engine table"
            got, want = load_file(sh["job"]["dump"]), load_file(st["job"]["dump"])
            assert set(got) == set(want) == set(st["keys"]), where
            for key in sorted(want):
                if component == "dspark" and key in SHARED_WITH_TARGET:
                    target = load_file(stock[(tag, "model", rank)]["job"]["dump"])[SHARED_WITH_TARGET[key]]
                    if not _bits_equal(got[key], target):
                        problems.append(f"{where}: {key} is not the target's {SHARED_WITH_TARGET[key]}")
                elif not _bits_equal(got[key], want[key]):
                    problems.append(f"{where}: {key} differs from the stock load")
            for phase, records, warns in (
                ("build", st["build_log"], st["build_warnings"]),
                ("stock load", st["load_log"], st["load_warnings"]),
                ("sharded load", sh["load_log"], sh["load_warnings"]),
            ):
                for message in _warnings(records) + warns:
                    listed.setdefault((phase, message), []).append(where.removeprefix(f"{component} "))
    print(f"\n[{vllm_release.id} v41 {component} harness self-test] {len(SETTINGS)} settings, every rank")
    for (phase, message), places in sorted(listed.items()):
        print(
            f"  {phase} warning ({len(places)} rank(s): {', '.join(places[:3])}{', ...' if len(places) > 3 else ''}):"
        )
        print(f"    {message}")
    assert not problems, "\n".join(problems)
    sharded_warnings = [(message, places) for (phase, message), places in listed.items() if phase == "sharded load"]
    assert not sharded_warnings, sharded_warnings


def _source(src: Path) -> dict[str, torch.Tensor]:
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        with safe_open(src / file, framework="pt") as f:
            for k in f.keys():  # noqa: SIM118
                out[k] = f.get_tensor(k)
    return out


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _expanded(scale: torch.Tensor) -> torch.Tensor:
    """A 32x32-block E8M0 checkpoint scale as vLLM's MXFP8 parameter holds it, before the TP slice: raw bytes, every
    row repeated 32 times (KMxfp8Static.get_scale_weight_loader)."""
    return _u8(scale).repeat_interleave(32, dim=0)


def test_v41_values_as_vllm_reads_them(vllm_release, v41_runs):
    """Per rank, from the stock dumps: Engram tables hold whole hash heads (rows of the checkpoint table, raw bytes),
    MXFP8 scales are the checkpoint's rows repeated 32 times then split as their weight (output rows for column /
    merged-column / replicated linears, input blocks for row-parallel ones)."""
    src = _source(v41_runs["src"])
    lm = "language_model.model.layers"
    for tp, ep in SETTINGS:
        tag = _tag(tp, ep)
        rows = v41_engram_rank_rows(tp)
        for rank in range(tp):
            where = f"{tag} rank {rank}"
            got = load_file(v41_runs["stock"][(tag, "model", rank)]["job"]["dump"])
            for i, layer in enumerate(V41_ENGRAM_LAYERS):
                start, n = rows[i][rank]
                table = got[f"{lm}.{layer}.engram.embed_tokens.weight"]
                scale = got[f"{lm}.{layer}.engram.embed_tokens.weight_scale_inv"]
                assert table.dtype == torch.float8_e4m3fn and scale.dtype == torch.uint8, where
                assert _bits_equal(table, src[f"layers.{layer}.engram.embed.weight"][start : start + n]), where
                assert torch.equal(scale, _u8(src[f"layers.{layer}.engram.embed.scale"])[start : start + n]), where
                # engram.wkv: ColumnParallelLinear(gather_output=True): output rows split
                w = _expanded(src[f"layers.{layer}.engram.wkv.scale"])
                per = w.shape[0] // tp
                assert torch.equal(got[f"{lm}.{layer}.engram.wkv.weight_scale"], w[rank * per : (rank + 1) * per])
            # merged, replicated: fused_wqa_wkv = wq_a | wkv, each expanded on its own
            fused = torch.cat([_expanded(src["layers.0.attn.wq_a.scale"]), _expanded(src["layers.0.attn.wkv.scale"])])
            assert torch.equal(got[f"{lm}.0.attn.fused_wqa_wkv.weight_scale"], fused), where
            # column parallel: wq_b's output rows
            w = _expanded(src["layers.0.attn.wq_b.scale"])
            per = w.shape[0] // tp
            assert torch.equal(got[f"{lm}.0.attn.wq_b.weight_scale"], w[rank * per : (rank + 1) * per]), where
            # row parallel: wo_b's input blocks
            w = _expanded(src["layers.0.attn.wo_b.scale"])
            per = w.shape[1] // tp
            assert torch.equal(got[f"{lm}.0.attn.wo_b.weight_scale"], w[:, rank * per : (rank + 1) * per]), where
            if vllm_release.version != "0.33.0":
                draft = load_file(v41_runs["stock"][(tag, "dspark", rank)]["job"]["dump"])
                stages = [_expanded(src[f"mtp.{i}.attn.wkv.scale"]) for i in range(V41_STAGES)]
                assert torch.equal(draft["model.context_wkv_proj.weight_scale"], torch.cat(stages)), where


def _collapse(table: dict) -> list[tuple[str, str, tuple]]:
    """(key, dtype, shape) rows; a key repeated over layers with one dtype and shape is written once as
    ``layers.{a-b}.`` or ``layers.{a,c}.``."""
    groups: dict[tuple, list] = {}
    for key, info in table.items():
        m = _LAYER.match(key)
        pattern = key if m is None else m.group(1) + "{L}." + key[m.end() :]
        groups.setdefault((pattern, info["dtype"], tuple(info["shape"])), []).append(int(m.group(2)) if m else None)
    rows = []
    for (pattern, dtype, shape), ids in groups.items():
        if ids[0] is not None:
            ids = sorted(ids)
            contiguous = len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1))
            pattern = pattern.replace(
                "{L}", f"{{{ids[0]}-{ids[-1]}}}" if contiguous else "{" + ",".join(map(str, ids)) + "}"
            )
        rows.append((pattern, dtype, shape))
    return sorted(rows)


def test_v41_classes_and_per_rank_key_tables(vllm_release, v41_runs):
    stock, expect = v41_runs["stock"], v41_runs["expect"]
    config = json.loads((v41_runs["src"] / "config.json").read_text())
    text = config["text_config"]
    # the op expect gives the same table as the stock-load builds
    for component, r in expect.items():
        assert r["error"] is None, r["error"]
        assert r["keys"] == stock[("tp2", component, 1)]["keys"], component
    for (tag, component, rank), r in stock.items():
        where = f"{component} {tag} rank {rank}"
        if component == "model":
            assert r["class"] == r["registry_class"] == TARGET_CLASS, (where, r["class"], r["registry_class"])
            assert r["registry_architecture"] == "DeepseekV41ForCausalLM", where
        else:
            assert r["class"] == r["registry_class"] == DRAFT_CLASS, (where, r["class"], r["registry_class"])
            assert r["registry_architecture"] == "DSparkV41DraftModel", where
            spec = r["speculative"]
            assert spec["method"] == "dspark" and spec["draft_architectures"] == ["DSparkV41DraftModel"], spec
            assert spec["draft_model_type"] == "deepseek_v41", spec
            assert spec["num_speculative_tokens"] == text["dspark_block_size"], spec
            keys = r["keys"]
            layer_ids = {int(m.group(2)) for k in keys if (m := _LAYER.match(k))}
            assert layer_ids == set(range(V41_STAGES)), (where, layer_ids)
            assert all(k in keys for k in CONTEXT_WKV) == (vllm_release.version != "0.33.0"), where
            if vllm_release.version != "0.33.0":
                assert keys[CONTEXT_WKV[0]]["shape"] == [V41_HEAD_DIM * V41_STAGES, text["hidden_size"]], where
            experts = keys["model.layers.0.ffn.experts.routed_experts.w13_weight"]["shape"][0]
            tp, ep = r["job"]["tp"], r["job"]["ep"]
            assert experts == (V41_DSPARK_EXPERTS // tp if ep else V41_DSPARK_EXPERTS), (where, experts)
        if component == "model":
            keys = r["keys"]
            tp, ep = r["job"]["tp"], r["job"]["ep"]
            experts = keys["language_model.model.layers.0.ffn.experts.routed_experts.w13_weight"]["shape"][0]
            assert experts == (V41_EXPERTS // tp if ep else V41_EXPERTS), (where, experts)
            rows = v41_engram_rank_rows(tp)
            for i, layer in enumerate(V41_ENGRAM_LAYERS):
                shape = keys[f"language_model.model.layers.{layer}.engram.embed_tokens.weight"]["shape"]
                assert shape == [rows[i][rank][1], text["engram_head_dim"]], (where, layer, shape)
            assert not any("hc_head" in k for k in keys), where
            # NgramHashState built the tokenizer's compressed vocab and found it equal to the config's
            vocab = text["engram_compressed_vocab_size"]
            built = [m["message"] for m in r["build_log"] if m["message"].startswith("Built engram token map")]
            assert built and all(f"-> {vocab} ids" in m for m in built), (where, built)

    for component in COMPONENTS:
        _print_tables(vllm_release.id, component, stock)


def _print_tables(release: str, component: str, stock: dict) -> None:
    """The first setting's rank 0 table in full, then per setting the ranks grouped by identical tables, with the rows
    that differ from it; the Engram tables' rows, which differ per rank, in a table of their own."""
    engram = re.compile(r"\.engram\.embed_tokens\.")
    first = _tag(*SETTINGS[0])
    ref = _collapse(stock[(first, component, 0)]["keys"])
    ref_by_name = {name: (dtype, list(shape)) for name, dtype, shape in ref}
    print(f"\n[{release} v41 {component}] per-rank keys (vLLM's ShardedStateLoader._filter_subtensors)")
    print(f"  {first} rank 0: {len(stock[(first, component, 0)]['keys'])} keys")
    for name, dtype, shape in ref:
        print(f"    {name:<94} {dtype:<14} {list(shape)}")
    for tp, ep in SETTINGS[1:]:
        tag = _tag(tp, ep)
        groups: dict[tuple, list[int]] = {}
        for rank in range(tp):
            rows = _collapse(stock[(tag, component, rank)]["keys"])
            groups.setdefault(tuple(r for r in rows if r not in ref and not engram.search(r[0])), []).append(rank)
        for rows, ranks in groups.items():
            n = len(stock[(tag, component, ranks[0])]["keys"])
            which = f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"
            print(f"  {tag} {which}: {n} keys; differ from {first}:")
            for name, dtype, shape in rows:
                was = ref_by_name.get(name)
                was_text = (
                    f"({first} {was[1]})"
                    if was and was[0] == dtype
                    else f"({first} {was})"
                    if was
                    else f"(not at {first})"
                )
                print(f"    {name:<94} {dtype:<14} {str(list(shape)):<16} {was_text}")
    if component == "model":
        print("  Engram tables (engram.embed_tokens.weight [rows, 32] and .weight_scale_inv [rows, 1]):")
        for tp, ep in SETTINGS:
            tag = _tag(tp, ep)
            per_layer = []
            for layer in V41_ENGRAM_LAYERS:
                key = f"language_model.model.layers.{layer}.engram.embed_tokens.weight"
                counts = [stock[(tag, "model", rank)]["keys"][key]["shape"][0] for rank in range(tp)]
                per_layer.append(f"layer {layer}: " + " / ".join(map(str, counts)))
            print(f"    {tag:<7} rows per rank: " + "; ".join(per_layer))
        refused = [t for t in range(1, 9) if v41_engram_rank_rows(t) is None]
        print(f"    the Engram split refuses tp {refused} ((tp - 1) * ceil(n_hash_cols / tp) >= n_hash_cols)")


# ckpt-tool's conversion of V4.1 for the release under test (--vllm: the draft's files differ between 0.33 and 0.34),
# the target and its DSpark draft loaded by that release's own ShardedStateLoader into its DeepseekV41ForCausalLM and
# DSparkDeepseekV4ForCausalLM on every rank, byte-identical to the same classes' stock load of the source; the Engram
# tables split unevenly by hash head. (tp, expert parallel): tp 8 with expert parallel (the fixture's experts of 512
# rows would leave 64 a rank, which vLLM's MXFP4 backends round up), so tp 1, 2, 4, 8 and ep
V41_CASES = [(1, False), (2, False), (4, False), (8, True)]


@pytest.mark.parametrize(("tp", "ep"), V41_CASES, ids=[f"tp{t}{'-ep' if e else ''}" for t, e in V41_CASES])
def test_v41_sharded_load_matches_stock_load(tp, ep, vllm_release, fixture_dir, converted, run_worker, tmp_path):
    from test_engine_matrix import _jobs, _report, compare, engine_table_problems, manifest_of, target_of

    t0 = time.perf_counter()
    target = target_of(vllm_release)
    src = fixture_dir("v41")
    out = converted("v41", tp, ep, target, "--vllm", vllm_release.version)
    manifest = manifest_of(out)
    series = manifest["options"]["vllm_series"]
    assert vllm_release.version.startswith(series + "."), (series, vllm_release.version)
    results = run_worker(_jobs(src, out, tp, ep, tmp_path / "dumps", components=COMPONENTS))
    classes = {r["job"]["component"]: r["class"] for r in results}
    assert classes == {"model": TARGET_CLASS, "dspark": DRAFT_CLASS}, classes
    layers = json.loads((src / "config.json").read_text())["text_config"]["num_hidden_layers"]
    problems, allowed, warnings_left = compare(
        results, tp, manifest, layers, components=COMPONENTS, target_prefix="language_model."
    )
    problems += engine_table_problems(results, src, tp, ep, target, series)
    _report(
        f"[{vllm_release.id} v41 tp{tp}{' ep' if ep else ''} --target {target} --vllm {vllm_release.version}] "
        f"{time.perf_counter() - t0:.1f}s ({len(results)} builds)",
        allowed,
        warnings_left,
    )
    assert not problems, "\n".join(problems)
    # the draft's embedding and head are the target's own shards as vLLM loaded them: compare() judged them by the
    # manifest's materializations (the stock load writes neither); this holds them to it without the manifest
    for rank in range(tp):
        by = {r["job"]["component"]: r for r in results if r["op"] == "sharded-load" and r["job"]["rank"] == rank}
        draft, model = load_file(by["dspark"]["job"]["dump"]), load_file(by["model"]["job"]["dump"])
        for key, target_key in SHARED_WITH_TARGET.items():
            assert _bits_equal(draft[key], model[target_key]), f"dspark rank {rank}: {key} is not the target's"
