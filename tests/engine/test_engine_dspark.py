"""The DSpark draft of DeepSeek V4 (``vllm/models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM``,
registry name ``DSparkDraftModel``) as the worker's third component ``dspark``, for every verified vLLM release.

vLLM builds it for ``--speculative-config '{"method": "dspark", "model": DRAFT}'`` (the worker asks for it when
config.json has ``dspark_target_layer_ids``) under the draft config of ``load_dspark_model``
(v1/worker/gpu/spec_decode/dspark/utils.py, mirrored by ``vllm_stubs.component_vllm_config``). No ckpt-tool here:

* the harness self-test: vLLM's own stock load of the original checkpoint, written by vLLM's own
  ``ShardedStateLoader.save_model``, loads back through ``ShardedStateLoader.load_weights`` warning-free and byte
  for byte. ``model.embed_tokens.weight`` and ``lm_head.weight`` are written by no checkpoint tensor (vLLM puts the
  target's in their place after a real load), so the stock load leaves them uninitialised: in the saved files they
  are replaced by the target model's own rank shards (from vLLM's stock load of the target), and the sharded load
  must hold exactly those;
* the matrix: ckpt-tool's conversion (``--target auto``'s profile for the release) loaded by the release's own
  ``ShardedStateLoader`` into its DSpark class (and the target into its model class) on every rank, byte-identical
  to the same classes' stock load of the source, and the engine table verify uses equal to vLLM's keys;
* the class, the registry's answer, the speculative config, and the per-rank key table (``expect``) at tp 1, tp 2
  and tp 2 expert parallel, printed with ``-s`` for comparison with ckpt-tool's engine table.

Run: ``pytest -m engine tests/engine/test_engine_dspark.py -s``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from test_engine_matrix import _bits_equal, _jobs, _report, compare, engine_table_problems, manifest_of, target_of

pytestmark = pytest.mark.engine

DSPARK_CLASS = "vllm.models.deepseek_v4.nvidia.dspark.DSparkDeepseekV4ForCausalLM"
VARIANTS = ("dspark-fp4",)  # the fp8-expert draft is proven by the matrix below
# (variant, tp, expert parallel): fp4 at tp 1 and tp 2 ep, fp8 experts (float32 scales from E8M0) at tp 2
# (tp 2 without ep is the fp8 case's; the fp4 experts' row split at tp 2 is the V4 matrix's)
DSPARK_CASES = [("dspark-fp4", 1, False), ("dspark-fp4", 2, True), ("dspark-fp8", 2, False)]
# written by no checkpoint tensor: vLLM replaces them by the target's after a real load (dspark/utils.py)
SHARED_WITH_TARGET = {"model.embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
UNINITIALISED = "stock load leaves it uninitialised and the manifest lists no materialization"


def _config(src: Path) -> dict:
    return json.loads((src / "config.json").read_text())


def _replace_shared_with_target(saved: Path, target_dumps: dict[int, Path], tp: int) -> None:
    """What vLLM's load_dspark_model ends with: embed_tokens/lm_head are the target's (rank ``r``'s shard)."""
    for rank in range(tp):
        files = sorted(saved.glob(f"model-rank-{rank}-part-*.safetensors"))
        assert len(files) == 1, files
        t = load_file(files[0])
        target = load_file(target_dumps[rank])
        for key, target_key in SHARED_WITH_TARGET.items():
            assert t[key].shape == target[target_key].shape and t[key].dtype == target[target_key].dtype, key
            t[key] = target[target_key].clone()
        save_file(t, str(files[0]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_harness_on_vllms_own_dspark_save(variant, vllm_release, fixture_dir, run_worker, tmp_path):
    t0 = time.perf_counter()
    tp, ep = 2, False
    src = fixture_dir(variant)
    layers = _config(src)["num_hidden_layers"]
    out, dumps = tmp_path / "vllm-saved", tmp_path / "dumps"

    stock_jobs = _jobs(src, out, tp, ep, dumps, ops=("stock-load",), components=("dspark",))
    for j in stock_jobs:
        j["save"] = str(out / "dspark")
    target_jobs = _jobs(src, out, tp, ep, dumps, ops=("stock-load",), components=("model",))
    stock = run_worker(stock_jobs + target_jobs)
    for r in stock:
        assert r["error"] is None and r["exception"] is None, (r["job"], r["error"], r.get("exception"))
    stock_dspark = [r for r in stock if r["job"]["component"] == "dspark"]
    for r in stock_dspark:
        where = f"dspark rank {r['job']['rank']}"
        assert r["class"] == DSPARK_CLASS, r["class"]
        assert r["saved"] == [f"model-rank-{r['job']['rank']}-part-0.safetensors"], r["saved"]
        # the class's load_weights takes every mtp.* tensor and skips the target's
        assert sorted(r["untouched_keys"]) == sorted(SHARED_WITH_TARGET), (where, r["untouched_keys"])
        skipped_mtp = [s for s in r["sources_read"] if s.startswith("mtp.")]
        assert not skipped_mtp, (where, skipped_mtp)
        # context_wkv_proj is written from every stage's attn.wkv (vLLM's _duplicate_context_wkv_weights)
        n_stages = _config(src)["n_mtp_layers"]
        for i in range(n_stages):
            for what, suffix in (("weight", "weight"), ("scale", "weight_scale_inv")):
                written = r["provenance"][f"mtp.{i}.attn.wkv.{what}"]["keys"]
                assert f"model.context_wkv_proj.{suffix}" in written, (where, i, written)
                assert f"model.layers.{i}.attn.fused_wqa_wkv.{suffix}" in written, (where, i, written)

    target_dumps = {r["job"]["rank"]: Path(r["job"]["dump"]) for r in stock if r["job"]["component"] == "model"}
    _replace_shared_with_target(out / "dspark", target_dumps, tp)
    sharded = run_worker(_jobs(src, out, tp, ep, dumps, ops=("sharded-load",), components=("dspark",)))
    assert all(not any(r["precheck"].values()) for r in sharded), [r["precheck"] for r in sharded]

    problems, allowed, warnings_left = compare(stock_dspark + sharded, tp, {}, layers, components=("dspark",))
    expected = {f"dspark rank {rank}: {key}: {UNINITIALISED}" for rank in range(tp) for key in SHARED_WITH_TARGET}
    # judged by what the stock load wrote (nothing), whatever its uninitialised memory holds
    assert sorted(problems) == sorted(expected), problems
    for r in sharded:
        rank = r["job"]["rank"]
        got = load_file(r["job"]["dump"])
        target = load_file(dumps / f"stock-model-{rank}.safetensors")
        for key, target_key in SHARED_WITH_TARGET.items():
            assert _bits_equal(got[key], target[target_key]), f"dspark rank {rank}: {key} is not the target's"
            allowed.append(f"dspark rank {rank}: {key} holds the target's {target_key} (stock leaves it uninitialised)")
    timing = [
        f"{r['op']} rank {r['job']['rank']}: build {r['build_seconds']:.2f}s load {r['load_seconds']:.2f}s "
        f"job {r['seconds']:.2f}s"
        for r in stock_dspark + sharded
    ]
    _report(
        f"[{vllm_release.id} dspark harness self-test {variant} tp{tp}] {time.perf_counter() - t0:.1f}s; "
        + "; ".join(timing),
        allowed,
        warnings_left,
    )
    assert not warnings_left, warnings_left


@pytest.mark.parametrize(
    ("variant", "tp", "ep"), DSPARK_CASES, ids=[f"{v}-tp{t}{'-ep' if e else ''}" for v, t, e in DSPARK_CASES]
)
def test_dspark_sharded_load_matches_stock_load(
    variant, tp, ep, vllm_release, fixture_dir, converted, run_worker, tmp_path
):
    t0 = time.perf_counter()
    target = target_of(vllm_release)
    src = fixture_dir(variant)
    out = converted(variant, tp, ep, target)
    manifest = manifest_of(out)
    components = ("model", "dspark")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(components)
    results = run_worker(_jobs(src, out, tp, ep, tmp_path / "dumps", components=components))
    classes = {r["job"]["component"]: r.get("class") for r in results}
    assert classes["dspark"] == DSPARK_CLASS, classes
    problems, allowed, warnings_left = compare(
        results, tp, manifest, _config(src)["num_hidden_layers"], components=components
    )
    problems += engine_table_problems(results, src, tp, ep, target)
    _report(
        f"[{vllm_release.id} {variant} tp{tp}{' ep' if ep else ''} --target {target}] "
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
        for key in SHARED_WITH_TARGET:
            assert _bits_equal(draft[key], model[key]), f"dspark rank {rank}: {key} is not the target's"


EXPECT_SETTINGS = ((1, False), (2, False), (2, True))  # (tp, expert parallel)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _collapse(table: dict) -> list[tuple[str, str, tuple]]:
    """(key, dtype, shape) rows, a key repeated over draft layers with one dtype and shape written once as
    ``model.layers.{a-b}.`` (vLLM fuses the routed experts: one ``w13_weight``/``w2_weight`` per layer)."""
    groups: dict[tuple, list] = {}
    for key, info in table.items():
        m = _LAYER.match(key)
        pattern = key if m is None else "model.layers.{L}." + key[m.end() :]
        groups.setdefault((pattern, info["dtype"], tuple(info["shape"])), []).append(int(m.group(1)) if m else None)
    rows = []
    for (pattern, dtype, shape), ids in groups.items():
        if ids[0] is not None:
            ids = sorted(ids)
            contiguous = len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1))
            pattern = pattern.replace("{L}", f"{{{ids[0]}-{ids[-1]}}}" if contiguous else ",".join(map(str, ids)))
        rows.append((pattern, dtype, shape))
    return sorted(rows)


@pytest.mark.parametrize("variant", VARIANTS)
def test_dspark_class_and_key_table(variant, vllm_release, fixture_dir, run_worker):
    src = fixture_dir(variant)
    config = _config(src)
    jobs = [
        {"op": "expect", "config": str(src), "tp": tp, "rank": rank, "ep": ep, "component": "dspark"}
        for tp, ep in EXPECT_SETTINGS
        for rank in range(tp)
    ]
    # a DSpark checkpoint has no classic-MTP component: the worker says so
    jobs.append({"op": "expect", "config": str(src), "tp": 1, "rank": 0, "ep": False, "component": "mtp"})
    results = run_worker(jobs)
    *results, mtp = results
    assert mtp["error"] is not None and "dspark" in mtp["error"]["message"], mtp["error"]

    print(f"\n[{vllm_release.id} {variant}] DSpark draft key table (vLLM's ShardedStateLoader._filter_subtensors)")
    n_stages = config["n_mtp_layers"]
    for r in results:
        job = r["job"]
        where = f"tp{job['tp']}{' ep' if job['ep'] else ''} rank {job['rank']}"
        assert r["error"] is None, (where, r["error"])
        assert r["class"] == DSPARK_CLASS, (where, r["class"])
        assert r["registry_class"] == DSPARK_CLASS, (where, r["registry_class"])
        assert r["registry_architecture"] == "DSparkDraftModel", (where, r["registry_architecture"])
        spec = r["speculative"]
        assert spec["method"] == "dspark" and spec["draft_architectures"] == ["DSparkDraftModel"], (where, spec)
        assert spec["num_speculative_tokens"] == config["dspark_block_size"], (where, spec)
        keys = r["keys"]
        layer_ids = {int(m.group(1)) for k in keys if (m := _LAYER.match(k))}
        assert layer_ids == set(range(n_stages)), (where, layer_ids)
        for key in (
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.main_proj.weight",
            "model.main_norm.weight",
            "model.context_wkv_proj.weight",
            "model.norm.weight",
            "model.hc_head_fn",
            "model.hc_head_base",
            "model.hc_head_scale",
            "model.markov_head.markov_w1.weight",
            "model.markov_head.markov_w2.weight",
            "model.confidence_head.proj.weight",
        ):
            assert key in keys, (where, key)
        assert keys["model.context_wkv_proj.weight"]["shape"] == [
            config["head_dim"] * n_stages,
            config["hidden_size"],
        ], (where, keys["model.context_wkv_proj.weight"])
        assert keys["model.main_proj.weight"]["shape"][1] == config["hidden_size"] * len(
            config["dspark_target_layer_ids"]
        ), (where, keys["model.main_proj.weight"])

    by_setting: dict[tuple, list] = {}
    for r in results:
        by_setting.setdefault((r["job"]["tp"], r["job"]["ep"]), []).append(r)
    for (tp, ep), rs in by_setting.items():
        rs.sort(key=lambda r: r["job"]["rank"])
        base = _collapse(rs[0]["keys"])
        for r in rs[1:]:
            assert set(r["keys"]) == set(rs[0]["keys"]), f"tp{tp} ep={ep}: ranks hold different keys"
        warns = sorted({w["message"] for r in rs for w in r["build_log"] if w["level"] in ("WARNING", "ERROR")})
        print(
            f"  tp{tp}{' ep' if ep else ''}: {len(rs[0]['keys'])} keys per rank; build "
            + ", ".join(f"rank {r['job']['rank']} {r['build_seconds']:.2f}s" for r in rs)
            + (f"; build warnings: {warns}" if warns else "")
        )
        for name, dtype, shape in base:
            print(f"    {name:<70} {dtype:<15} {list(shape)}")
        for r in rs[1:]:
            differ = sorted(set(_collapse(r["keys"])) - set(base))
            print(f"    rank {r['job']['rank']}: " + ("same shapes as rank 0" if not differ else "differs:"))
            for name, dtype, shape in differ:
                print(f"      {name:<68} {dtype:<15} {list(shape)}")
