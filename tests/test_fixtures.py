"""The generated fixture checkpoints are what the other tests assume: faithful V4 structure, deterministic,
sane values."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckpt_tool.checkpoint.config import REQUIRED_KEYS, V4Config
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.errors import CheckpointError, HeaderError
from ckpt_tool.fixtures.make import (
    BROKEN_VARIANTS,
    DRAFT_BROKEN_VARIANTS,
    DSPARK_VARIANTS,
    EXPERTS,
    GOOD_VARIANTS,
    HIDDEN,
    MAIN_LAYERS,
    MOE_INTER,
    NVFP4_BROKEN_VARIANTS,
    NVFP4_VARIANTS,
    PAD_VARIANTS,
    SEED,
    TOPK,
    VARIANTS,
    VISION_VARIANTS,
    VOCAB,
    make_checkpoint,
    serving_files,
)

INDEX = "model.safetensors.index.json"
SHARDS = [f"model-{k:05d}-of-00004.safetensors" for k in range(1, 5)]


def weight_map(root: Path) -> dict[str, str]:
    return json.loads((root / INDEX).read_text())["weight_map"]


def families(names, pattern: str) -> set[str]:
    return {n for n in names if re.search(pattern, n)}


# ---------------------------------------------------------------------------------------------
# Good variants: structure


def test_variant_lists_partition_the_variants() -> None:
    lists = (GOOD_VARIANTS, PAD_VARIANTS, BROKEN_VARIANTS, VISION_VARIANTS, DSPARK_VARIANTS, NVFP4_VARIANTS)
    assert set().union(*lists) == set(VARIANTS)
    assert sum(map(len, lists)) == len(VARIANTS)
    assert {"vl-fp4", "vl-fp4-nomtp"} <= set(VISION_VARIANTS)
    assert {"fp4", "fp4-mtp-emb", "fp8", "fp8-e8m0", "fp4-2mtp"} <= set(GOOD_VARIANTS)
    assert {"fp4-pad", "fp8-e8m0-pad"} <= set(PAD_VARIANTS)
    assert {"missing-mtp", "truncated", "bad-header-len", "overlap", "missing-file"} <= set(BROKEN_VARIANTS)
    assert {"nvfp4", "nvfp4-all", "dspark-nvfp4", "v41-nvfp4"} == set(NVFP4_VARIANTS)


@pytest.mark.parametrize("variant", GOOD_VARIANTS + PAD_VARIANTS)
def test_good_variant_opens_and_index_matches_shards(fixture_dir, variant: str) -> None:
    root = fixture_dir(variant)
    ck = open_checkpoint(root)
    assert ck.config is not None and ck.config_error is None
    assert ck.index_file == INDEX
    wm = weight_map(root)
    assert {n: t.file for n, t in ck.tensors.items()} == wm
    assert sorted(ck.shards) == SHARDS
    assert json.loads((root / INDEX).read_text())["metadata"]["total_size"] == ck.total_bytes
    assert ck.config.num_nextn_predict_layers == VARIANTS[variant].mtp_layers
    assert ck.config.expert_dtype == VARIANTS[variant].expert_dtype


EXPECTED_QUANT = {
    # variant: (expert weight dtype, expert scale dtype, linear scale dtype)
    "fp4": ("I8", "F8_E8M0", "F8_E8M0"),
    "fp4-mtp-emb": ("I8", "F8_E8M0", "F8_E8M0"),
    "fp4-2mtp": ("I8", "F8_E8M0", "F8_E8M0"),
    "fp8": ("F8_E4M3", "F32", "F32"),
    "fp8-e8m0": ("F8_E4M3", "F8_E8M0", "F8_E8M0"),
    "fp4-pad": ("I8", "F8_E8M0", "F8_E8M0"),
    "fp8-e8m0-pad": ("F8_E4M3", "F8_E8M0", "F8_E8M0"),
}


@pytest.mark.parametrize("variant", GOOD_VARIANTS + PAD_VARIANTS)
def test_good_variant_quantized_tensor_families(fixture_dir, variant: str) -> None:
    t = open_checkpoint(fixture_dir(variant)).tensors
    w_dt, s_dt, lin_s_dt = EXPECTED_QUANT[variant]
    experts_w = families(t, r"\.ffn\.experts\.\d+\.w[123]\.weight$")
    experts_s = families(t, r"\.ffn\.experts\.\d+\.w[123]\.scale$")
    blocks = 3 + VARIANTS[variant].mtp_layers
    assert len(experts_w) == len(experts_s) == blocks * EXPERTS * 3
    assert {t[n].dtype for n in experts_w} == {w_dt}
    assert {t[n].dtype for n in experts_s} == {s_dt}

    # Shapes of one expert's w1 (in=HIDDEN) and w2 (in=moe_intermediate_size).
    inter = VARIANTS[variant].moe_inter
    for proj, out, inp in (("w1", inter, HIDDEN), ("w2", HIDDEN, inter), ("w3", inter, HIDDEN)):
        w, s = t[f"layers.1.ffn.experts.3.{proj}.weight"], t[f"layers.1.ffn.experts.3.{proj}.scale"]
        if w_dt == "I8":  # MXFP4: two e2m1 codes per byte, one E8M0 scale per 32 inputs
            assert w.shape == (out, inp // 2) and s.shape == (out, inp // 32)
        else:  # block FP8: one scale per 128x128 block
            assert w.shape == (out, inp) and s.shape == (math.ceil(out / 128), math.ceil(inp / 128))

    linear_w = [n for n in t if n.endswith(".weight") and t[n].dtype == "F8_E4M3" and n not in experts_w]
    assert linear_w, "no FP8 linears"
    for n in linear_w:
        s = t[n[: -len(".weight")] + ".scale"]
        assert s.dtype == lin_s_dt
        out, inp = t[n].shape
        assert s.shape == (math.ceil(out / 128), math.ceil(inp / 128))
    # Norms and embeddings stay BF16, hc_* F32.
    assert t["embed.weight"].dtype == "BF16" and t["embed.weight"].shape == (VOCAB, HIDDEN)
    assert {t[n].dtype for n in families(t, r"norm\.weight$")} == {"BF16"}
    assert {t[n].dtype for n in families(t, r"\.hc_(attn|ffn|head)_(fn|base|scale)$|^hc_head_")} == {"F32"}


@pytest.mark.parametrize("variant", GOOD_VARIANTS)
def test_mtp_emb_and_head_only_in_variants_that_store_them(fixture_dir, variant: str) -> None:
    t = open_checkpoint(fixture_dir(variant)).tensors
    v = VARIANTS[variant]
    for i in range(v.mtp_layers):
        stored = {f"mtp.{i}.emb.tok_emb.weight", f"mtp.{i}.head.weight"} & set(t)
        assert stored == ({f"mtp.{i}.emb.tok_emb.weight", f"mtp.{i}.head.weight"} if v.mtp_emb_head else set())
    assert ("mtp.0.emb.tok_emb.weight" in t) == (variant in ("fp4-mtp-emb", "fp8"))


def test_fp4_mtp_emb_has_mtp_embedding_and_head_and_fp4_does_not(fixture_dir) -> None:
    with_emb = open_checkpoint(fixture_dir("fp4-mtp-emb")).tensors
    plain = open_checkpoint(fixture_dir("fp4")).tensors
    for name in ("mtp.0.emb.tok_emb.weight", "mtp.0.head.weight"):
        assert name in with_emb and with_emb[name].shape == (VOCAB, HIDDEN) and with_emb[name].dtype == "BF16"
        assert name not in plain
    assert set(plain) == set(with_emb) - {"mtp.0.emb.tok_emb.weight", "mtp.0.head.weight"}


@pytest.mark.parametrize("variant", GOOD_VARIANTS)
def test_mtp_layers_present_match_config(fixture_dir, variant: str) -> None:
    t = open_checkpoint(fixture_dir(variant)).tensors
    present = sorted({int(m.group(1)) for n in t if (m := re.match(r"^mtp\.(\d+)\.", n))})
    assert present == list(range(VARIANTS[variant].mtp_layers))
    if variant == "fp4-2mtp":
        assert present == [0, 1]
        assert len(families(t, r"^mtp\.0\.")) == len(families(t, r"^mtp\.1\."))
    for i in present:
        for name in (
            "enorm.weight",
            "hnorm.weight",
            "e_proj.weight",
            "h_proj.weight",
            "norm.weight",
            "hc_head_fn",
            "attn.wq_a.weight",
            "ffn.gate.bias",
            "ffn.shared_experts.w2.weight",
        ):
            assert f"mtp.{i}.{name}" in t


@pytest.mark.parametrize("variant", GOOD_VARIANTS)
def test_attention_layer_kinds_swa_csa_hca(fixture_dir, variant: str) -> None:
    ck = open_checkpoint(fixture_dir(variant))
    t = ck.tensors
    assert list(ck.config.compress_ratios[:3]) == [0, 4, 128]
    comp = ("wkv.weight", "wgate.weight", "ape", "norm.weight")
    # layer 0: sliding window only
    assert not families(t, r"^layers\.0\.attn\.(compressor|indexer)\.")
    # layer 1: CSA (ratio 4) has compressor (doubled width) and indexer
    for c in comp:
        assert f"layers.1.attn.compressor.{c}" in t
        assert f"layers.1.attn.indexer.compressor.{c}" in t
    assert t["layers.1.attn.compressor.wkv.weight"].shape == (2 * 128, HIDDEN)
    assert t["layers.1.attn.compressor.ape"].shape == (4, 2 * 128)
    for n in ("wq_b.weight", "wq_b.scale", "weights_proj.weight"):
        assert f"layers.1.attn.indexer.{n}" in t
    # layer 2: HCA (ratio 128) has a compressor only
    for c in comp:
        assert f"layers.2.attn.compressor.{c}" in t
    assert t["layers.2.attn.compressor.ape"].shape == (128, 128)
    assert not families(t, r"^layers\.2\.attn\.indexer\.")
    # MTP blocks are sliding-window
    assert not families(t, r"^mtp\.\d+\.attn\.(compressor|indexer)\.")


@pytest.mark.parametrize("variant", GOOD_VARIANTS)
def test_tid2eid_only_on_hash_layer_0(fixture_dir, variant: str) -> None:
    root = fixture_dir(variant)
    t = open_checkpoint(root).tensors
    assert families(t, r"tid2eid") == {"layers.0.ffn.gate.tid2eid"}
    info = t["layers.0.ffn.gate.tid2eid"]
    assert info.dtype == "I64" and info.shape == (VOCAB, TOPK)
    assert "layers.0.ffn.gate.bias" not in t
    for n in families(t, r"^(layers\.[12]|mtp\.\d+)\.ffn\.gate\.weight$"):
        assert n.replace(".weight", ".bias") in t
    with safe_open(str(root / info.file), framework="pt") as f:
        ids = f.get_tensor("layers.0.ffn.gate.tid2eid")
    assert int(ids.min()) >= 0 and int(ids.max()) < EXPERTS
    assert all(len(set(row.tolist())) == TOPK for row in ids)  # distinct experts per token


@pytest.mark.parametrize("variant", GOOD_VARIANTS)
def test_mtp_layer_0_is_stored_across_two_shards(fixture_dir, variant: str) -> None:
    t = open_checkpoint(fixture_dir(variant)).tensors
    files = {t[n].file for n in families(t, r"^mtp\.0\.")}
    assert files == {SHARDS[2], SHARDS[3]}
    # the cut is inside the routed experts
    assert t["mtp.0.ffn.experts.3.w3.scale"].file == SHARDS[2]
    assert t["mtp.0.ffn.experts.4.w1.weight"].file == SHARDS[3]


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("variant", GOOD_VARIANTS)
def test_config_has_every_required_key_and_loads(fixture_dir, variant: str) -> None:
    root = fixture_dir(variant)
    raw = json.loads((root / "config.json").read_text())
    assert set(REQUIRED_KEYS) <= set(raw)
    for key, typ in REQUIRED_KEYS.items():
        assert isinstance(raw[key], typ) and not isinstance(raw[key], bool), key
    cfg = V4Config.load(root / "config.json")
    v = VARIANTS[variant]
    assert cfg.num_nextn_predict_layers == v.mtp_layers
    assert cfg.expert_dtype == v.expert_dtype
    assert cfg.hidden_size == HIDDEN and cfg.vocab_size == VOCAB and cfg.n_routed_experts == EXPERTS
    assert len(cfg.compress_ratios) == cfg.num_hidden_layers + v.mtp_layers
    assert cfg.weight_block_size == (128, 128)
    assert ("scale_fmt" in raw["quantization_config"]) == (v.scale_dtype == "e8m0")


# ---------------------------------------------------------------------------------------------
# Determinism


def test_generation_is_deterministic_and_seed_dependent(fixture_dir, tmp_path: Path) -> None:
    first = fixture_dir("fp4")
    again = make_checkpoint(tmp_path / "again", "fp4")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert names == sorted(["config.json", INDEX, *SHARDS, *serving_files()])
    for name in names:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name

    other = make_checkpoint(tmp_path / "other", "fp4", seed=SEED + 1)
    assert (other / "config.json").read_bytes() == (first / "config.json").read_bytes()
    assert (other / INDEX).read_bytes() == (first / INDEX).read_bytes()
    for shard in SHARDS:
        a, b = (first / shard).read_bytes(), (other / shard).read_bytes()
        assert len(a) == len(b) and a != b, shard


# ---------------------------------------------------------------------------------------------
# Broken variants


BROKEN = {
    # variant: (error type, message fragment, file the message must name)
    "truncated": (HeaderError, "truncated", SHARDS[3]),
    "bad-header-len": (HeaderError, "points past the end", SHARDS[3]),
    "overlap": (HeaderError, "overlaps", SHARDS[3]),
    "missing-file": (CheckpointError, "missing", SHARDS[1]),
}


def test_every_broken_variant_is_covered() -> None:
    # the NVFP4 exports' broken variants: tests/test_nvfp4.py
    covered = set(BROKEN) | {"missing-mtp"} | set(DRAFT_BROKEN_VARIANTS) | set(NVFP4_BROKEN_VARIANTS)
    assert covered == set(BROKEN_VARIANTS)


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_broken_variant_raises_the_right_error_naming_the_file(fixture_dir, variant: str) -> None:
    exc_type, fragment, file = BROKEN[variant]
    with pytest.raises(exc_type) as info:
        open_checkpoint(fixture_dir(variant))
    msg = str(info.value)
    assert fragment in msg and msg.startswith(file + ":"), msg
    if isinstance(info.value, HeaderError):
        assert info.value.file == file


def test_missing_mtp_parses_but_lacks_mtp_tensors(fixture_dir) -> None:
    ck = open_checkpoint(fixture_dir("missing-mtp"))
    assert ck.config.num_nextn_predict_layers == 1
    assert not [n for n in ck.tensors if n.startswith("mtp.")]
    assert {n for n in ck.tensors if n.startswith("layers.")}  # the main model is intact
    assert set(ck.tensors) == {n for n in open_checkpoint(fixture_dir("fp4")).tensors if not n.startswith("mtp.")}


@pytest.mark.parametrize("tp", [2, 4])
def test_pad_variants_split_everywhere_but_at_their_shared_experts(fixture_dir, tp: int) -> None:
    """fp4-pad / fp8-e8m0-pad: only the shared experts' 3 FP8 blocks miss whole-block splits at tp 2 and 4 (so an
    engine that does not pad refuses them there), every other split dim divides; fp8's 128-block routed
    experts split only with --moe-parallel ep."""
    from ckpt_tool.errors import PlanError
    from ckpt_tool.mapping.plan import Options
    from ckpt_tool.mapping.planner import plan_conversion

    for variant, moe in (("fp4-pad", "ep"), ("fp8-e8m0-pad", "ep")):
        ck = open_checkpoint(fixture_dir(variant))
        cfg = ck.require_config()
        assert cfg.moe_intermediate_size // 128 == 3
        with pytest.raises(PlanError, match=r"shared_experts\.w[123]\.(weight|scale)'"):
            plan_conversion(cfg, ck.tensors, Options(tp=tp, moe_parallel=moe, profile="vllm-seed"))
        plan = plan_conversion(cfg, ck.tensors, Options(tp=tp, moe_parallel=moe, profile="vllm-0.33+"))
        padded = {t.name.split(".ffn.")[-1] for f in plan.files for t in f.tensors if t.padding}
        assert padded == {
            f"experts._shared_experts._layer.{n}"
            for n in (
                "gate_up_proj.weight",
                "gate_up_proj.weight_scale_inv",
                "down_proj.weight",
                "down_proj.weight_scale_inv",
            )
        }
    ck = open_checkpoint(fixture_dir("fp8-e8m0-pad"))
    with pytest.raises(PlanError, match=r"ffn\.experts\.0\.w1\.(weight|scale)'.*choose"):
        plan_conversion(ck.require_config(), ck.tensors, Options(tp=tp, moe_parallel="tp", profile="vllm-0.33+"))


# ---------------------------------------------------------------------------------------------
# Values, read by safetensors itself


@pytest.mark.parametrize("variant", GOOD_VARIANTS + PAD_VARIANTS)
def test_safetensors_loads_every_tensor_with_finite_values(fixture_dir, variant: str) -> None:
    root = fixture_dir(variant)
    ck = open_checkpoint(root)
    seen = 0
    for file in SHARDS:
        blob = (root / file).read_bytes()
        with safe_open(str(root / file), framework="pt") as f:
            for name in f.keys():
                x = f.get_tensor(name)
                info = ck.tensors[name]
                assert info.file == file and tuple(x.shape) == info.shape
                assert blob[info.start : info.end] == x.contiguous().view(torch.uint8).numpy().tobytes(), name
                if x.is_floating_point():
                    assert bool(torch.isfinite(x.float()).all()), name
                seen += 1
    assert seen == len(ck.tensors)


# ---------------------------------------------------------------------------------------------
# Quantization sanity: a local dequantizer, independent of ckpt_tool


def _load(root: Path, ck, name: str) -> torch.Tensor:
    with safe_open(str(root / ck.tensors[name].file), framework="pt") as f:
        return f.get_tensor(name)


def dequant_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block-FP8 dequant: every 128x128 block of ``q`` times its scale (E8M0 or F32)."""
    out, inp = q.shape
    s = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inp]
    return q.float() * s


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 dequant: low nibble is element 2k, high nibble 2k+1; one power-of-two scale per 32 elements."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    vals = E2M1[codes]
    return vals * scale.float().repeat_interleave(32, dim=-1)


FP8_LINEARS = [  # (name, fan_in)
    ("layers.0.attn.wq_a", HIDDEN),
    ("layers.1.attn.wq_b", 256),
    ("layers.2.ffn.shared_experts.w2", MOE_INTER),
    ("mtp.0.e_proj", HIDDEN),
]


@pytest.mark.parametrize("variant", ["fp4", "fp8", "fp8-e8m0"])
def test_fp8_dequantized_weights_have_magnitude_one_over_sqrt_fan_in(fixture_dir, variant: str) -> None:
    root = fixture_dir(variant)
    ck = open_checkpoint(root)
    names = list(FP8_LINEARS)
    if VARIANTS[variant].expert_dtype == "fp8":
        names += [("layers.1.ffn.experts.5.w1", HIDDEN), ("layers.1.ffn.experts.5.w2", MOE_INTER)]
    for name, fan_in in names:
        q, s = _load(root, ck, name + ".weight"), _load(root, ck, name + ".scale")
        assert q.dtype == torch.float8_e4m3fn and q.shape[1] == fan_in
        w = dequant_fp8(q, s)
        rms = w.pow(2).mean().sqrt().item()
        assert 0.9 < rms * math.sqrt(fan_in) < 1.1, (name, rms)
        # The block scale is tight: the largest code in each block uses the top of the E4M3 range.
        qa = q.float().abs()
        out, inp = q.shape
        amax = qa.view(out // 128, 128, inp // 128, 128).amax(dim=(1, 3))
        if s.dtype == torch.float8_e8m0fnu:
            assert bool((amax >= 224).all() and (amax <= 448).all()), (
                name
            )  # power-of-two scale: within 2x (224.x rounds to 224)
        else:
            assert bool((amax >= 416).all() and (amax <= 448).all()), name  # exact scale: 448 up to rounding


def test_mxfp4_dequantized_experts_have_magnitude_one_over_sqrt_fan_in(fixture_dir) -> None:
    root = fixture_dir("fp4")
    ck = open_checkpoint(root)
    for name, fan_in in (
        ("layers.1.ffn.experts.2.w1", HIDDEN),
        ("layers.2.ffn.experts.7.w2", MOE_INTER),
        ("mtp.0.ffn.experts.4.w3", HIDDEN),
    ):
        packed, s = _load(root, ck, name + ".weight"), _load(root, ck, name + ".scale")
        assert packed.dtype == torch.int8 and s.dtype == torch.float8_e8m0fnu
        w = dequant_mxfp4(packed, s)
        assert w.shape[1] == fan_in
        rms = w.pow(2).mean().sqrt().item()
        assert 0.9 < rms * math.sqrt(fan_in) < 1.1, (name, rms)
        # each group of 32 reaches the top half of the e2m1 range (scale = ceil pow2 of amax/6)
        group_amax = (w / s.float().repeat_interleave(32, dim=-1)).abs().view(w.shape[0], -1, 32).amax(-1)
        assert bool((group_amax >= 3.0).all()), name


@pytest.mark.parametrize("variant", ["vl-fp4", "vl-fp4-f32"])
def test_vision_fixtures_are_deterministic_and_hold_the_vision_model(fixture_dir, tmp_path: Path, variant: str) -> None:
    first = fixture_dir(variant)
    again = make_checkpoint(tmp_path / "again", variant)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    ck = open_checkpoint(first)
    assert ck.config.is_vision and ck.config.vision_n_layers == 2
    tower = {n: t.dtype for n, t in ck.tensors.items() if n.startswith(("vision.", "aligner."))}
    assert len(tower) == 2 + 8 * 2 + 1 + 4
    assert set(tower.values()) == ({"F32"} if variant == "vl-fp4-f32" else {"BF16"})
    assert {f"layers.{i}.ffn.gate.bias_vl" for i in range(MAIN_LAYERS)} | {"layers.0.ffn.gate.bias"} <= set(ck.tensors)
