"""NVIDIA's NVFP4 exports of DeepSeek V4 (``nvidia/DeepSeek-V4-Flash-NVFP4`` and siblings) in the engine matrix: for
every verified vLLM release, ckpt-tool's conversion (``--target auto``'s profile for the release) loaded by the
release's own ``ShardedStateLoader`` into its own classes, on a faked B200 (SM100: vLLM picks its FlashInfer NVFP4 MoE
backend, ``vllm_stubs.gpu_for_checkpoint``), on every rank of target and draft, byte-identical to the same classes'
stock load of the source (``test_engine_matrix.compare``), and the engine table verify uses equal to vLLM's keys.

The routed experts of the main layers are vLLM's ``ModelOptNvFp4FusedMoE``; the draft's are ``Mxfp4MoEMethod`` where
the export's ``ignore`` leaves them MXFP4 (``nvfp4``, ``dspark-nvfp4``, ``v41-nvfp4``), NVFP4 too where it has no
``ignore`` (``nvfp4-all``, the older export). Under expert parallelism each rank holds every expert's input scales, as
the FlashInfer backends keep them (the manifest's ``nvfp4_input_scales: global``).

Run: ``pytest -m engine tests/engine/test_engine_nvfp4.py -s``.
"""

from __future__ import annotations

import json
import time

import pytest
from test_engine_matrix import COMPONENTS, _jobs, _report, compare, engine_table_problems, manifest_of, target_of

pytestmark = pytest.mark.engine

NVFP4_METHOD = "ModelOptNvFp4FusedMoE"
# (variant, tp, expert parallel, components): each kind (V4 with its MXFP4 MTP draft, DSpark, V4.1) at tp 1, 2 and
# ep; the older export (every expert NVFP4, the draft's too) under ep
DSPARK = ("model", "dspark")
NVFP4_CASES = [
    ("nvfp4", 1, False, COMPONENTS),
    ("nvfp4", 2, False, COMPONENTS),
    ("nvfp4", 2, True, COMPONENTS),
    ("nvfp4-all", 2, True, COMPONENTS),
    ("dspark-nvfp4", 1, False, DSPARK),
    ("dspark-nvfp4", 2, False, DSPARK),
    ("dspark-nvfp4", 2, True, DSPARK),
    ("v41-nvfp4", 1, False, DSPARK),
    ("v41-nvfp4", 2, False, DSPARK),
    ("v41-nvfp4", 2, True, DSPARK),
]


@pytest.mark.parametrize(
    ("variant", "tp", "ep", "components"),
    NVFP4_CASES,
    ids=[f"{v}-tp{t}{'-ep' if e else ''}" for v, t, e, _ in NVFP4_CASES],
)
def test_nvfp4_sharded_load_matches_stock_load(
    variant, tp, ep, components, vllm_release, fixture_dir, converted, run_worker, tmp_path
):
    t0 = time.perf_counter()
    target = target_of(vllm_release)
    src = fixture_dir(variant)
    config = json.loads((src / "config.json").read_text())
    layers = config.get("text_config", config)["num_hidden_layers"]
    extra = ("--vllm", vllm_release.version) if variant.startswith("v41") else ()
    out = converted(variant, tp, ep, target, *extra)
    manifest = manifest_of(out)
    assert manifest["options"].get("nvfp4_input_scales") == ("global" if ep else None), manifest["options"]
    results = run_worker(_jobs(src, out, tp, ep, tmp_path / "dumps", components=components))
    for r in results:
        assert r.get("gpu", {}).get("sm") in (None, "SM100"), r.get("gpu")  # the B200 vLLM picks FlashInfer on
    prefix = "language_model." if variant.startswith("v41") else ""
    problems, allowed, warnings_left = compare(
        results, tp, manifest, layers, components=components, target_prefix=prefix
    )
    options = manifest["options"]
    problems += engine_table_problems(
        results, src, tp, ep, target, options.get("vllm_series"), options.get("nvfp4_input_scales")
    )
    _report(
        f"[{vllm_release.id} {variant} tp{tp}{' ep' if ep else ''} --target {target}] "
        f"{time.perf_counter() - t0:.1f}s ({len(results)} builds)",
        allowed,
        warnings_left,
    )
    assert not problems, "\n".join(problems)
    # the routed experts of the main layers are vLLM's NVFP4 parameters (their eight keys), not MXFP4's four
    model = next(r for r in results if r["op"] == "sharded-load" and r["job"]["component"] == "model")
    nvfp4_keys = [k for k in model["keys"] if k.endswith("routed_experts.w13_weight_scale_2")]
    assert len(nvfp4_keys) == layers, nvfp4_keys


def test_nvfp4_local_input_scales_load_on_hopper(vllm_release, fixture_dir, converted, run_worker, tmp_path):
    """``--nvfp4-input-scales local``: the layout of the NVFP4 MoE backends that keep only the rank's own experts'
    input scales (an H100 serving the export picks one: MARLIN), loaded on a faked H100 byte-identical to the stock
    load there; and the global layout (Blackwell's) is refused there by vLLM's own loader, so the two differ."""
    tp, target = 2, target_of(vllm_release)
    src = fixture_dir("nvfp4")
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    local = converted("nvfp4", tp, True, target, "--nvfp4-input-scales", "local")
    assert manifest_of(local)["options"]["nvfp4_input_scales"] == "local"
    jobs = [{**j, "gpu": "H100"} for j in _jobs(src, local, tp, True, tmp_path / "dumps")]
    results = run_worker(jobs)
    assert {r["gpu"]["sm"] for r in results} == {"SM90"}, [r["gpu"] for r in results]
    problems, allowed, warnings_left = compare(results, tp, manifest_of(local), layers)
    problems += engine_table_problems(results, src, tp, True, target, None, "local")
    _report(f"[{vllm_release.id} nvfp4 tp{tp} ep, local input scales, on an H100]", allowed, warnings_left)
    assert not problems, "\n".join(problems)
    flashinfer = converted("nvfp4", tp, True, target)
    jobs = [{**j, "gpu": "H100"} for j in _jobs(src, flashinfer, tp, True, tmp_path / "dumps-g", ops=("sharded-load",))]
    refused = [r for r in run_worker(jobs) if r["job"]["component"] == "model"]
    assert all(r["exception"] is not None for r in refused), [r["exception"] for r in refused]
