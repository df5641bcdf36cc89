"""The GPU the engine harness fakes for a checkpoint (``vllm_stubs.gpu_for_checkpoint``): a B200 (SM100) for NVIDIA's
NVFP4 exports, an H100 (SM90) for every other checkpoint.

On the B200 each release builds its own ``ModelOptNvFp4FusedMoE`` for the NVFP4 routed experts with the FlashInfer
NVFP4 MoE backend a Blackwell user gets (FLASHINFER_TRTLLM, which keeps every expert's input scales on each rank
under ``--enable-expert-parallel``), and ``Mxfp4MoEMethod`` for the experts the export's ``ignore`` leaves MXFP4;
without ``ignore`` every expert, the draft's too, is NVFP4. A served worker that built an NVFP4 export builds the
next MXFP4 checkpoint exactly as a fresh one does (nothing vLLM cached about the B200 leaks into the H100's build).

The NVFP4 config is the fp4 fixture's config.json with the keys an NVFP4 export adds to ``quantization_config``
(``expect`` reads no tensor).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

WORKER = Path(__file__).resolve().with_name("vllm_worker.py")

EXPERTS = 8  # n_routed_experts of the fp4 fixture
HIDDEN = 256  # hidden_size
INTER = 512  # moe_intermediate_size
NVFP4 = "ModelOptNvFp4FusedMoE"
MXFP4 = "Mxfp4MoEMethod"


def nvfp4_config(fixture_dir, folder: Path, ignore: list[str] | None) -> Path:
    """The fp4 fixture's config files, its quantization_config made an NVFP4 export's (``ignore`` absent if None)."""
    folder.mkdir()
    for f in fixture_dir("fp4").iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, folder / f.name)
    config = json.loads((folder / "config.json").read_text())
    quant = config["quantization_config"]
    quant.update(quant_algo="MIXED_PRECISION", moe_quant_algo="NVFP4")
    if ignore is not None:
        quant["ignore"] = ignore
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def expect(config: Path, component: str, tp: int, ep: bool, rank: int = 0) -> dict:
    return {"op": "expect", "config": str(config), "component": component, "tp": tp, "ep": ep, "rank": rank}


def routed(result: dict) -> dict:
    """{parameter name after ``routed_experts.``: [dtype, shape]} of the first routed-experts module."""
    assert result["error"] is None, result["error"]
    first = next(iter(result["moe_methods"]))
    return {
        k.removeprefix(f"{first}."): [v["dtype"], v["shape"]]
        for k, v in result["keys"].items()
        if k.startswith(f"{first}.")
    }


@pytest.mark.parametrize("ignore", [["mtp.*"], None], ids=["ignore-mtp", "no-ignore"])
def test_an_nvfp4_export_builds_vllms_nvfp4_experts_on_a_faked_b200(run_worker, fixture_dir, tmp_path, ignore):
    config = nvfp4_config(fixture_dir, tmp_path / "nvfp4", ignore)
    model_ep, mtp_ep, model_tp = run_worker(
        [expect(config, "model", 2, True, rank=1), expect(config, "mtp", 2, True), expect(config, "model", 2, False)]
    )
    for result in (model_ep, mtp_ep, model_tp):
        assert result["gpu"]["sm"] == "SM100", result["gpu"]
    for name, method in model_ep["moe_methods"].items():
        picked = (method["method"], method["backend"], method["use_global_sf"])
        assert picked == (NVFP4, "FLASHINFER_TRTLLM", True), name
    local = EXPERTS // 2
    assert routed(model_ep) == {
        "w13_weight": ["uint8", [local, 2 * INTER, HIDDEN // 2]],
        "w2_weight": ["uint8", [local, HIDDEN, INTER // 2]],
        "w13_weight_scale": ["float8_e4m3fn", [local, 2 * INTER, HIDDEN // 16]],
        "w2_weight_scale": ["float8_e4m3fn", [local, HIDDEN, INTER // 16]],
        "w13_weight_scale_2": ["float32", [local, 2]],
        "w2_weight_scale_2": ["float32", [local]],
        # FLASHINFER_TRTLLM keeps every expert's input scales on each rank (is_global_sf_supported_for_nvfp4_backend)
        "w13_input_scale": ["float32", [EXPERTS, 2]],
        "w2_input_scale": ["float32", [EXPERTS]],
    }
    assert routed(model_tp)["w13_weight"] == ["uint8", [EXPERTS, INTER, HIDDEN // 2]]
    assert routed(model_tp)["w2_weight_scale"] == ["float8_e4m3fn", [EXPERTS, HIDDEN, INTER // 2 // 16]]
    (draft,) = mtp_ep["moe_methods"].values()
    if ignore:  # "mtp.*" matches the draft's "mtp.0.ffn.experts": left MXFP4, FlashInfer's MXFP4 x MXFP8 on Blackwell
        assert (draft["method"], draft["backend"]) == (MXFP4, "FLASHINFER_TRTLLM_MXFP4_MXFP8"), draft
        assert routed(mtp_ep)["w13_weight_scale"] == ["uint8", [local, 2 * INTER, HIDDEN // 32]]
    else:
        assert (draft["method"], draft["backend"]) == (NVFP4, "FLASHINFER_TRTLLM"), draft
        assert routed(mtp_ep) == routed(model_ep)


def test_a_served_worker_builds_an_mxfp4_checkpoint_after_an_nvfp4_one_as_a_fresh_process(
    run_worker, engine_site, fixture_dir, tmp_path
):
    config = nvfp4_config(fixture_dir, tmp_path / "nvfp4", ["mtp.*"])
    fp4 = fixture_dir("fp4")
    fresh = subprocess.run(
        [sys.executable, str(WORKER), "--site", str(engine_site), "expect", "--config", str(fp4)]
        + ["--tp", "2", "--ep", "--component", "mtp"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert fresh.returncode == 0, fresh.stderr[-4000:]
    fresh = json.loads(fresh.stdout)
    nvfp4_model, nvfp4_mtp, served = run_worker(
        [expect(config, "model", 1, False), expect(config, "mtp", 2, True), expect(fp4, "mtp", 2, True)]
    )
    assert nvfp4_mtp["gpu"]["sm"] == "SM100" and nvfp4_model["gpu"]["sm"] == "SM100"
    for result in (fresh, served):
        assert result["error"] is None, result["error"]
        assert result["gpu"]["sm"] == "SM90", result["gpu"]
    (method,) = served["moe_methods"].values()
    assert (method["method"], method["backend"]) == (MXFP4, "MARLIN"), method
    assert (served["keys"], served["aliases"], served["moe_methods"]) == (
        fresh["keys"],
        fresh["aliases"],
        fresh["moe_methods"],
    )
