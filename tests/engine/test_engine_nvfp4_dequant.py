"""verify's NVFP4 reference (``ckpt_tool.verify.quant``) against each vLLM release's own NVFP4 code, run from its wheel.

The reference was written from the format's definition (e2m1 code x E4M3 block scale of its 16 inputs x float32
global scale, the low nibble the even input); these tests hold it to what vLLM itself computes from the same bytes:

* ``dequantize_to_dtype`` (``layers/quantization/utils/nvfp4_emulation_utils.py``, its torch path on CPU: vLLM's
  ``break_fp4_bytes`` nibble order and e2m1 table) on every packed byte under every finite E4M3 scale byte;
* ``ModelOptNvFp4FusedMoE.dequantize_weight`` (``layers/quantization/modelopt.py``), the class that serves
  NVIDIA's NVFP4 DeepSeek V4 experts, on one rank's stacked ``w13_weight`` / ``w2_weight`` with their
  ``w13_weight_scale_2 [E, 2]`` / ``w2_weight_scale_2 [E]`` (which global scale scales which rows);
* ``ref_nvfp4_quant`` (the same file) against :func:`~ckpt_tool.verify.quant.nvfp4_quant`'s scales and codes.

vLLM multiplies the block scale by the global scale first and then the e2m1 value (two roundings); the reference
rounds the exact product once. The two therefore agree bit for bit when the global scale is a power of two and
within one float32 ulp otherwise, which is what the tests allow. vLLM runs in a subprocess with the release's site
folder first on ``sys.path`` (the engine matrix's ``engine_site``), so its packages never mix with this process's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ckpt_tool.verify import quant

pytestmark = pytest.mark.engine

SCRIPT = r"""
import sys, types
import torch
site, inp, outp = sys.argv[1:4]
sys.path.insert(0, site)
import vllm
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4FusedMoE
from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils as nv

d = torch.load(inp)
out = {"version": vllm.__version__}
for key in ("pow2", "any"):
    out["flat_" + key] = nv.dequantize_to_dtype(
        d["packed"], d["scale"], d["g_" + key], torch.float32, block_size=16, swizzle=False
    )
layer = types.SimpleNamespace(params_dtype=torch.float32, **{k: d[k] for k in d if k.startswith(("w13_", "w2_"))})
method = types.SimpleNamespace(quant_config=types.SimpleNamespace(group_size=16))
got = ModelOptNvFp4FusedMoE.dequantize_weight(method, layer)
if isinstance(got, tuple):  # 0.33.0: (w13, w2)
    out["w13"], out["w2"] = got
else:  # 0.34.0: (experts, w13, w2) chunks
    chunks = list(got)
    out["w13"] = torch.cat([c[1] for c in chunks])
    out["w2"] = torch.cat([c[2] for c in chunks])
codes, scale = nv.ref_nvfp4_quant(d["w"], 1.0 / d["w_global"], 16)  # vLLM's reference takes the encode scale
out["ref_values"], out["ref_scale"] = codes, scale.to(torch.float8_e4m3fn)
torch.save(out, outp)
"""

FINITE_E4M3 = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
E, INTER, HIDDEN = 3, 32, 64  # one rank's experts: w13 [E, 2 * INTER, HIDDEN / 2], w2 [E, HIDDEN, INTER / 2]


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(44)
    rows = FINITE_E4M3.numel()

    def random_packed(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)

    def random_scale(*shape: int) -> torch.Tensor:
        return FINITE_E4M3[torch.randint(0, rows, shape, generator=gen)].view(torch.float8_e4m3fn)

    w, w_global = _quant_input(gen)
    return {
        # every byte (every code in both nibbles) under every finite scale byte
        "packed": torch.arange(256, dtype=torch.int32).to(torch.uint8).expand(rows, 256).contiguous(),
        "scale": FINITE_E4M3[:, None].expand(rows, 32).contiguous().view(torch.float8_e4m3fn),
        "g_pow2": torch.tensor(2.0**-7),
        "g_any": torch.tensor(0.0123),
        "w13_weight": random_packed(E, 2 * INTER, HIDDEN // 2),
        "w13_weight_scale": random_scale(E, 2 * INTER, HIDDEN // 16),
        "w13_weight_scale_2": torch.rand(E, 2, generator=gen) * 0.01 + 1e-4,  # w1's and w3's differ
        "w2_weight": random_packed(E, HIDDEN, INTER // 2),
        "w2_weight_scale": random_scale(E, HIDDEN, INTER // 16),
        "w2_weight_scale_2": torch.rand(E, generator=gen) * 0.01 + 1e-4,
        "w": w,
        "w_global": w_global,
    }


def _quant_input(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(32, 128, generator=gen) * torch.exp2(torch.randint(-6, 6, (32, 1), generator=gen).float())
    return w, quant.nvfp4_quant(w)[2]


@pytest.fixture(scope="module")
def vllm_answers(engine_site, vllm_release, tmp_path_factory) -> tuple[dict, dict]:
    """(inputs, what the release's own NVFP4 functions made of them)."""
    folder = tmp_path_factory.mktemp(f"nvfp4-{vllm_release.version}")
    inputs = _inputs()
    torch.save(inputs, folder / "in.pt")
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "OMP_NUM_THREADS": "1",
        "VLLM_CACHE_ROOT": str(folder / "vllm-cache"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(engine_site), str(folder / "in.pt"), str(folder / "out.pt")],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(folder / "out.pt")
    assert out["version"] == vllm_release.version, f"imported vLLM {out['version']} from {engine_site}"
    return inputs, out


def _assert_within_one_ulp(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """Equal, or one float32 rounding apart (|a - b| <= 2**-23 |a|); on failure name the worst element."""
    assert ours.shape == theirs.shape and theirs.dtype == torch.float32, (what, theirs.shape, theirs.dtype)
    diff = (ours.double() - theirs.double()).abs()
    bad = diff > ours.double().abs() * 2.0**-23
    if bool(bad.any()):
        i = int(torch.argmax(diff.flatten()))
        idx = [int(t) for t in torch.unravel_index(torch.tensor(i), tuple(ours.shape))]
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements differ by more than one float32 rounding; worst at "
            f"{idx}: ours {ours.flatten()[i].item()!r}, vLLM {theirs.flatten()[i].item()!r}"
        )


def test_every_code_under_every_scale_byte_dequantizes_as_vllm_does(vllm_answers) -> None:
    inputs, out = vllm_answers
    ours = quant.nvfp4_dequant(inputs["packed"], inputs["scale"], inputs["g_pow2"])
    assert torch.equal(ours, out["flat_pow2"]), (ours - out["flat_pow2"]).abs().max()  # a power of two: exact
    ours = quant.nvfp4_dequant(inputs["packed"], inputs["scale"], inputs["g_any"])
    _assert_within_one_ulp(ours, out["flat_any"], "every byte x every E4M3 scale, global 0.0123")


def test_one_ranks_stacked_experts_dequantize_as_modelopt_nvfp4_fused_moe_does(vllm_answers) -> None:
    """w13's first half scaled by w13_weight_scale_2[:, 0] (w1), its second by [:, 1] (w3); w2 by its own."""
    inputs, out = vllm_answers
    w13 = quant.nvfp4_stacked_dequant(
        inputs["w13_weight"], inputs["w13_weight_scale"], inputs["w13_weight_scale_2"], what="w13"
    )
    _assert_within_one_ulp(w13, out["w13"], "w13_weight")
    w2 = quant.nvfp4_stacked_dequant(
        inputs["w2_weight"], inputs["w2_weight_scale"], inputs["w2_weight_scale_2"], what="w2"
    )
    _assert_within_one_ulp(w2, out["w2"], "w2_weight")


def test_nvfp4_quant_makes_vllms_reference_scales_and_codes(vllm_answers) -> None:
    inputs, out = vllm_answers
    packed, scale, g = quant.nvfp4_quant(inputs["w"])
    assert torch.equal(g, inputs["w_global"])
    assert torch.equal(scale.view(torch.uint8), out["ref_scale"].view(torch.uint8))
    values = quant.e2m1_decode(quant.mxfp4_unpack_codes(packed))
    assert torch.equal(values, out["ref_values"]), (values != out["ref_values"]).sum()
