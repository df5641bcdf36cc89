"""``convert``: the output of every good fixture against an independent expectation built from the documented layout.

The expectation below is written directly from the layout docs/output-format.md documents (names, tensor
parallelism, dtype rules) with plain torch on the source tensors (read with ``safetensors.safe_open``); it
deliberately does not import ``ckpt_tool.mapping.rules`` or ``ckpt_tool.mapping.planner``, so a wrong rule table
cannot agree with itself.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from safetensors import safe_open

from ckpt_tool.fixtures.make import GOOD_VARIANTS, MAIN_LAYERS, VISION_VARIANTS
from ckpt_tool.fixtures.safetensors_file import write_safetensors
from ckpt_tool.mapping.plan import Options
from ckpt_tool.output.convert import convert

MTP_MISSING = (
    "MTP speculative decoding layer 3 weights missing from checkpoint. The checkpoint may have been quantized "
    "without including the MTP layers. Use a checkpoint that includes MTP layer weights, "
    "or disable speculative decoding."
)
PART_RE = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")


# ---------------------------------------------------------------------------------------------
# Independent expectation (the documented layout, profile vllm-seed; vllm-0.33+ is proven by vLLM's own loader
# in tests/engine)

_SOURCE_CACHE: dict[Path, tuple[dict, dict[str, torch.Tensor]]] = {}


def load_source(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and every tensor of a source folder (cached: fixtures are never modified)."""
    src = Path(src)
    if src not in _SOURCE_CACHE:
        config = json.loads((src / "config.json").read_text())
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(src.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    assert k not in tensors
                    tensors[k] = fh.get_tensor(k)
        _SOURCE_CACHE[src] = (config, tensors)
    return _SOURCE_CACHE[src]


class _Builder:
    """Maps source tensors to the output of one rank; records every source it consumed.

    ``pad_shared``: shared experts as vLLM 0.33 loads them: each weight (scale) zero-padded on its intermediate
    dim to a multiple of tp 128-blocks (tp blocks) in its own dtype, then split evenly (``_pad_shared_expert_weight``).
    """

    def __init__(
        self, src: dict[str, torch.Tensor], cfg: dict, tp: int, rank: int, moe: str, pad_shared: bool = False
    ) -> None:
        self.src, self.cfg, self.tp, self.r, self.moe = src, cfg, tp, rank, moe
        self.pad_shared = pad_shared
        self.used: set[str] = set()
        self.fp4 = cfg.get("expert_dtype", "fp4") == "fp4"

    def get(self, name: str) -> torch.Tensor:
        self.used.add(name)
        return self.src[name]

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] // self.tp
        assert n * self.tp == t.shape[0]
        return t[self.r * n : (self.r + 1) * n]

    def cols(self, t: torch.Tensor) -> torch.Tensor:
        n = t.shape[1] // self.tp
        assert n * self.tp == t.shape[1]
        return t[:, self.r * n : (self.r + 1) * n]

    def padded(self, t: torch.Tensor, dim: int, step: int) -> torch.Tensor:
        """``t`` with zeros (of its dtype) appended on ``dim`` up to a multiple of tp * step, if pad_shared."""
        extra = -t.shape[dim] % (self.tp * step) if self.pad_shared else 0
        if not extra:
            return t
        shape = list(t.shape)
        shape[dim] = extra
        return torch.cat([t, t.new_zeros(shape)], dim=dim)

    def expert_tensor(self, t: torch.Tensor, is_scale: bool) -> torch.Tensor:
        if self.fp4:  # MXFP4 packed weights and their E8M0 scales: raw bytes as uint8
            return t.contiguous().view(torch.uint8)
        if is_scale and t.dtype == torch.float8_e8m0fnu:  # lands in a float32 param: 2^(b-127)
            return t.to(torch.float32)
        return t  # FP8 weights, float32 scales: unchanged

    def block(self, sp: str, dp: str) -> dict[str, torch.Tensor]:
        """One decoder block: source prefix ``sp`` (``layers.L`` / ``mtp.i``) → output prefix ``dp``."""
        g, s = self.get, self.src
        o: dict[str, torch.Tensor] = {}
        for n in [
            "attn_norm.weight",
            "ffn_norm.weight",
            "attn.q_norm.weight",
            "attn.kv_norm.weight",
            "ffn.gate.weight",
        ]:
            o[f"{dp}.{n}"] = g(f"{sp}.{n}")
        for part in ("attn", "ffn"):
            for k in ("fn", "base", "scale"):
                o[f"{dp}.hc_{part}_{k}"] = g(f"{sp}.hc_{part}_{k}")
        if f"{sp}.ffn.gate.bias" in s:
            o[f"{dp}.ffn.gate.e_score_correction_bias"] = g(f"{sp}.ffn.gate.bias")
        if f"{sp}.ffn.gate.tid2eid" in s:
            o[f"{dp}.ffn.gate.tid2eid"] = g(f"{sp}.ffn.gate.tid2eid")
        if f"{sp}.ffn.gate.bias_vl" in s:  # the vision model's router bias for image tokens
            o[f"{dp}.ffn.gate.bias_vl"] = g(f"{sp}.ffn.gate.bias_vl")
        a, da = f"{sp}.attn", f"{dp}.attn"
        o[f"{da}.fused_wqa_wkv.weight"] = torch.cat([g(f"{a}.wq_a.weight"), g(f"{a}.wkv.weight")])
        o[f"{da}.fused_wqa_wkv.weight_scale_inv"] = torch.cat([g(f"{a}.wq_a.scale"), g(f"{a}.wkv.scale")])
        for n in ("wq_b", "wo_a"):
            o[f"{da}.{n}.weight"] = self.rows(g(f"{a}.{n}.weight"))
            o[f"{da}.{n}.weight_scale_inv"] = self.rows(g(f"{a}.{n}.scale"))
        o[f"{da}.wo_b.weight"] = self.cols(g(f"{a}.wo_b.weight"))
        o[f"{da}.wo_b.weight_scale_inv"] = self.cols(g(f"{a}.wo_b.scale"))
        o[f"{da}.attn_sink"] = self.rows(g(f"{a}.attn_sink"))
        if f"{a}.compressor.wkv.weight" in s:
            c, dc = f"{a}.compressor", f"{da}.mla_attn.compressor"
            o[f"{dc}.fused_wkv_wgate.weight"] = torch.cat([g(f"{c}.wkv.weight"), g(f"{c}.wgate.weight")])
            o[f"{dc}.ape"] = g(f"{c}.ape")
            o[f"{dc}.norm.weight"] = g(f"{c}.norm.weight")
        if f"{a}.indexer.wq_b.weight" in s:
            i, di = f"{a}.indexer", f"{da}.indexer"
            o[f"{di}.wq_b.weight"] = g(f"{i}.wq_b.weight")
            o[f"{di}.wq_b.weight_scale_inv"] = g(f"{i}.wq_b.scale")
            o[f"{di}.weights_proj.weight"] = g(f"{i}.weights_proj.weight")
            o[f"{di}.compressor.fused_wkv_wgate.weight"] = torch.cat(
                [g(f"{i}.compressor.wkv.weight"), g(f"{i}.compressor.wgate.weight")]
            )
            o[f"{di}.compressor.ape"] = g(f"{i}.compressor.ape")
            o[f"{di}.compressor.norm.weight"] = g(f"{i}.compressor.norm.weight")
        se, dse = f"{sp}.ffn.shared_experts", f"{dp}.ffn.shared_experts"
        for suf, dsuf, step in (("weight", "weight", 128), ("scale", "weight_scale_inv", 1)):
            w1, w3 = (self.padded(g(f"{se}.{w}.{suf}"), 0, step) for w in ("w1", "w3"))
            o[f"{dse}.gate_up_proj.{dsuf}"] = torch.cat([self.rows(w1), self.rows(w3)])
            o[f"{dse}.down_proj.{dsuf}"] = self.cols(self.padded(g(f"{se}.w2.{suf}"), 1, step))
        # routed experts
        E = self.cfg["n_routed_experts"]
        ex, dex = f"{sp}.ffn.experts", f"{dp}.ffn.experts"
        if self.moe == "ep":
            per = E // self.tp
            assert per * self.tp == E
            experts, split = range(self.r * per, (self.r + 1) * per), False
            # the other experts are placed whole on the other ranks
            self.used.update(n for n in self.src if n.startswith(f"{ex}."))
        else:
            experts, split = range(E), True
        scale_name = "weight_scale" if self.fp4 else "weight_scale_inv"
        for suf, dsuf, is_scale in (("weight", "weight", False), ("scale", scale_name, True)):
            w13, w2 = [], []
            for e in experts:
                w1, w3, w2e = (g(f"{ex}.{e}.{w}.{suf}") for w in ("w1", "w3", "w2"))
                if split:
                    w1, w3, w2e = self.rows(w1), self.rows(w3), self.cols(w2e)
                w13.append(self.expert_tensor(torch.cat([w1, w3]), is_scale))
                w2.append(self.expert_tensor(w2e, is_scale))
            o[f"{dex}.w13_{dsuf}"] = torch.stack(w13)
            o[f"{dex}.w2_{dsuf}"] = torch.stack(w2)
        return o

    def model(self) -> dict[str, torch.Tensor]:
        g = self.get
        o = {
            "model.embed_tokens.weight": self.rows(g("embed.weight")),
            "lm_head.weight": self.rows(g("head.weight")),
            "model.norm.weight": g("norm.weight"),
        }
        for k in ("fn", "base", "scale"):
            o[f"model.hc_head_{k}"] = g(f"hc_head_{k}")
        for L in range(self.cfg["num_hidden_layers"]):
            o.update(self.block(f"layers.{L}", f"model.layers.{L}"))
        if self.cfg.get("vision_n_layers", 0) > 0:
            o = {f"language_model.{n}": t for n, t in o.items()}
            o.update(self.vision())
        return o

    def vision(self) -> dict[str, torch.Tensor]:
        """The vision tower as vLLM's DeepseekV4ForConditionalGeneration holds it (docs/vision.md): q|k|v and
        gate|up split per section, wo / w2 / aligner.w2 by columns, aligner.w1 by rows; everything whole when
        vision_n_heads does not divide tp; image_* float32, the rest bfloat16."""
        g, cfg = self.get, self.cfg
        tp, r = (self.tp, self.r) if cfg["vision_n_heads"] % self.tp == 0 else (1, 0)

        def rows(t: torch.Tensor, sections: int = 1) -> torch.Tensor:
            parts = t.chunk(sections)
            return torch.cat([p[r * (p.shape[0] // tp) : (r + 1) * (p.shape[0] // tp)] for p in parts])

        def cols(t: torch.Tensor) -> torch.Tensor:
            n = t.shape[1] // tp
            return t[:, r * n : (r + 1) * n]

        bf = torch.bfloat16
        o = {n: g(n).to(bf) for n in ("vision.patch_embed.proj.weight", "vision.patch_embed.proj.bias")}
        for b in range(cfg["vision_n_layers"]):
            p = f"vision.blocks.{b}"
            for n in ("norm1.weight", "norm2.weight", "attn.wo.bias"):
                o[f"{p}.{n}"] = g(f"{p}.{n}").to(bf)
            o[f"{p}.attn.wqkv.weight"] = rows(g(f"{p}.attn.wqkv.weight"), 3).to(bf)
            o[f"{p}.attn.wqkv.bias"] = rows(g(f"{p}.attn.wqkv.bias"), 3).to(bf)
            o[f"{p}.attn.wo.weight"] = cols(g(f"{p}.attn.wo.weight")).to(bf)
            o[f"{p}.mlp.w1.weight"] = rows(g(f"{p}.mlp.w1.weight"), 2).to(bf)
            o[f"{p}.mlp.w2.weight"] = cols(g(f"{p}.mlp.w2.weight")).to(bf)
        o["vision.norm.weight"] = g("vision.norm.weight").to(bf)
        o["aligner.w1.weight"] = rows(g("aligner.w1.weight")).to(bf)
        o["aligner.w1.bias"] = rows(g("aligner.w1.bias")).to(bf)
        o["aligner.w2.weight"] = cols(g("aligner.w2.weight")).to(bf)
        o["aligner.w2.bias"] = g("aligner.w2.bias").to(bf)
        for n in ("image_start", "image_end", "image_newline", "image_pad"):
            o[n] = g(n).to(torch.float32)
        return o

    def mtp(self) -> dict[str, torch.Tensor]:
        g, s = self.get, self.src
        N = self.cfg["num_hidden_layers"]
        o: dict[str, torch.Tensor] = {}
        for i in range(self.cfg["num_nextn_predict_layers"]):
            S, p, dp = N + i, f"mtp.{i}", f"model.layers.{N + i}"
            if i == 0:  # materialized from embed.weight when the checkpoint has no MTP embedding
                emb = f"{p}.emb.tok_emb.weight" if f"{p}.emb.tok_emb.weight" in s else "embed.weight"
                o["model.embed_tokens.weight"] = self.rows(g(emb))
            elif f"{p}.emb.tok_emb.weight" in s:
                g(f"{p}.emb.tok_emb.weight")  # seed skips it: dropped
            head = f"{p}.head.weight" if f"{p}.head.weight" in s else "head.weight"
            o[f"{dp}.shared_head.head.weight"] = self.rows(g(head))
            o[f"{dp}.shared_head.norm.weight"] = g(f"{p}.norm.weight")
            for n in (
                "enorm.weight",
                "hnorm.weight",
                "e_proj.weight",
                "h_proj.weight",
                "hc_head_fn",
                "hc_head_base",
                "hc_head_scale",
            ):
                o[f"{dp}.{n}"] = g(f"{p}.{n}")
            o[f"{dp}.e_proj.weight_scale_inv"] = g(f"{p}.e_proj.scale")
            o[f"{dp}.h_proj.weight_scale_inv"] = g(f"{p}.h_proj.scale")
            assert S == N + i
            o.update(self.block(p, f"{dp}.mtp_block"))
        return o


_EXPECT_CACHE: dict[tuple, dict[str, dict[str, torch.Tensor]]] = {}


def expected_outputs(
    src: Path, tp: int, rank: int, moe: str = "tp", pad_shared: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """{"model": {name: tensor}, "mtp": {name: tensor}} for rank ``rank`` of ``tp``, from the SPEC rules
    (``pad_shared``: with vLLM 0.33's zero-padded shared experts)."""
    key = (Path(src), tp, rank, moe, pad_shared)
    if key not in _EXPECT_CACHE:
        _EXPECT_CACHE.clear()  # one conversion's worth at a time keeps memory small
        _EXPECT_CACHE[key] = _expected_outputs(src, tp, rank, moe, pad_shared)
    return _EXPECT_CACHE[key]


def _expected_outputs(
    src: Path, tp: int, rank: int, moe: str, pad_shared: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    cfg, tensors = load_source(src)
    b = _Builder(tensors, cfg, tp, rank, moe, pad_shared)
    out = {"model": b.model(), "mtp": b.mtp()}
    unused = sorted(set(tensors) - b.used)
    assert not unused, f"expectation builder does not cover source tensors {unused[:10]}"
    return out


# ---------------------------------------------------------------------------------------------
# Reading an output folder


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def header_of(path: Path) -> dict:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


def read_component(d: Path) -> dict[int, dict[str, tuple[str, torch.Tensor]]]:
    """{rank: {name: (file, tensor)}} from every part file of ``d``; checks part naming and no duplicates."""
    ranks: dict[int, dict[str, tuple[str, torch.Tensor]]] = {}
    parts: dict[int, list[int]] = {}
    for f in sorted(d.glob("*.safetensors")):
        m = PART_RE.match(f.name)
        assert m, f"unexpected output file name {f.name}"
        r, p = int(m.group(1)), int(m.group(2))
        parts.setdefault(r, []).append(p)
        got = ranks.setdefault(r, {})
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                assert k not in got, f"{k} stored twice on rank {r} ({got.get(k, ('?',))[0]} and {f.name})"
                got[k] = (f.name, fh.get_tensor(k))
    for r, ps in parts.items():
        assert sorted(ps) == list(range(len(ps))), f"rank {r}: part numbers {sorted(ps)} not 0..n-1"
    return ranks


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert torch.equal(raw(got), raw(want)), f"{name}: bytes differ from the expectation"


def assert_matches_expectation(src: Path, out: Path, tp: int, moe: str, components=("model", "mtp")) -> None:
    got = {comp: read_component(out / comp) for comp in components}
    for comp in components:
        assert sorted(got[comp]) == list(range(tp)), f"{comp}: ranks {sorted(got[comp])}, expected 0..{tp - 1}"
    for r in range(tp):
        expect = expected_outputs(src, tp, r, moe)
        for comp in components:
            want, have = expect[comp], got[comp][r]
            missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
            assert not missing and not extra, f"{comp} rank {r}: missing {missing[:8]}, extra {extra[:8]}"
            for name, w in want.items():
                assert_same_tensor(f"{comp} rank {r} {name}", have[name][1], w)


def assert_index_and_manifest(src: Path, out: Path, tp: int, components=("model", "mtp")) -> None:
    for comp in components:
        d = out / comp
        idx = json.loads((d / "index.json").read_text())
        assert idx["tp"] == tp
        assert set(idx["ranks"]) == {str(r) for r in range(tp)}
        total = 0
        seen: dict[str, dict[str, str]] = {}
        for f in sorted(d.glob("*.safetensors")):
            r = PART_RE.match(f.name).group(1)
            for name, meta in header_of(f).items():
                if name == "__metadata__":
                    continue
                seen.setdefault(r, {})[name] = f.name
                total += meta["data_offsets"][1] - meta["data_offsets"][0]
        assert idx["ranks"] == seen, f"{comp}/index.json disagrees with the tensors in the files"
        assert idx["total_size"] == total
        assert (d / "config.json").read_bytes() == (src / "config.json").read_bytes()
    manifest = json.loads((out / "ckpt-tool.json").read_text())
    assert manifest["complete"] is True
    files = {str(p.relative_to(out)) for c in components for p in (out / c).glob("*.safetensors")}
    assert set(manifest["outputs"]) == files
    for rel, meta in manifest["outputs"].items():
        data = (out / rel).read_bytes()
        assert meta["size"] == len(data), rel
        assert meta["sha256"] == hashlib.sha256(data).hexdigest(), rel
    for comp in {"model", "mtp"} - set(components):
        assert not (out / comp).exists()


# ---------------------------------------------------------------------------------------------
# The conversion matrix

MATRIX = (
    [(v, 1, "tp") for v in GOOD_VARIANTS]
    + [(v, 4, "tp") for v in GOOD_VARIANTS]
    + [("fp8-e8m0", 2, "tp"), ("fp4-2mtp", 2, "tp")]
    + [("fp4", 4, "ep"), ("fp8", 2, "ep")]
)


@pytest.mark.parametrize("variant,tp,moe", MATRIX, ids=[f"{v}-tp{t}-{m}" for v, t, m in MATRIX])
def test_convert_output_equals_independent_expectation(fixture_dir, tmp_path, variant, tp, moe) -> None:
    src = fixture_dir(variant)
    before = tree_hashes(src)
    out = tmp_path / "out"
    convert(src, out, Options(tp=tp, moe_parallel=moe, profile="vllm-seed"))
    assert tree_hashes(src) == before, "the source folder was modified"
    assert_matches_expectation(src, out, tp, moe)
    assert_index_and_manifest(src, out, tp)


VISION_MATRIX = (
    [("vl-fp4", tp, "tp") for tp in (1, 2, 4)]
    + [("vl-fp4", 2, "ep"), ("vl-fp4-nomtp", 2, "tp")]
    + [("vl-fp4-h2", 2, "tp"), ("vl-fp4-h2", 4, "tp")]  # split at tp 2; vLLM replicates the tower at tp 4
    + [("vl-fp4-f32", 2, "tp")]  # a float32 tower rounded to bfloat16, bfloat16 image_* widened, as torch casts
)


@pytest.mark.parametrize("variant,tp,moe", VISION_MATRIX, ids=[f"{v}-tp{t}-{m}" for v, t, m in VISION_MATRIX])
@pytest.mark.parametrize("profile", ["vllm-seed", "vllm-0.33+"])
def test_vision_model_converts_to_the_independent_expectation(fixture_dir, tmp_path, variant, tp, moe, profile):
    """The vision model: language_model.-prefixed text keys, bias_vl, the tower split (or replicated) per rank.
    Under vllm-0.33+ only the names of the text model move (test_profile_consistency, tests/engine); the tower's
    bytes are the same, so that profile is held to the expectation on the keys that do not move."""
    src = fixture_dir(variant)
    assert variant in VISION_VARIANTS
    out = tmp_path / "out"
    convert(src, out, Options(tp=tp, moe_parallel=moe, profile=profile))
    cfg, _ = load_source(src)
    components = ("model", "mtp") if cfg["num_nextn_predict_layers"] else ("model",)
    if profile == "vllm-seed":
        assert_matches_expectation(src, out, tp, moe, components)
        assert_index_and_manifest(src, out, tp, components)
        return
    got = read_component(out / "model")
    for r in range(tp):
        want = expected_outputs(src, tp, r, moe)["model"]
        for name in [n for n in want if not n.startswith("language_model.")]:
            assert_same_tensor(f"rank {r} {name}", got[r][name][1], want[name])


def test_expected_dtypes_follow_spec_for_each_expert_kind(fixture_dir) -> None:
    """Sanity of the expectation itself: the dtype rules it encodes are the documented ones."""
    fp4 = expected_outputs(fixture_dir("fp4"), 1, 0)["mtp"]
    assert fp4["model.layers.3.mtp_block.ffn.experts.w13_weight"].dtype == torch.uint8
    assert fp4["model.layers.3.mtp_block.ffn.experts.w13_weight_scale"].dtype == torch.uint8
    assert fp4["model.layers.3.mtp_block.attn.fused_wqa_wkv.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    e8 = expected_outputs(fixture_dir("fp8-e8m0"), 1, 0)["mtp"]
    assert e8["model.layers.3.mtp_block.ffn.experts.w2_weight"].dtype == torch.float8_e4m3fn
    s = e8["model.layers.3.mtp_block.ffn.experts.w2_weight_scale_inv"]
    assert s.dtype == torch.float32 and bool((torch.log2(s) == torch.log2(s).round()).all())
    f32 = expected_outputs(fixture_dir("fp8"), 1, 0)["mtp"]
    assert f32["model.layers.3.mtp_block.ffn.experts.w13_weight_scale_inv"].dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# CLI behaviour


def test_missing_mtp_layer_fails_before_writing_with_the_seed_message(fixture_dir, tmp_path, capsys) -> None:
    assert MAIN_LAYERS == 3  # the missing MTP layer 0 is engine layer S = num_hidden_layers + 0
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", fixture_dir("missing-mtp"), out)
    assert code == 1
    assert MTP_MISSING in err, err
    assert not out.exists() or not any(out.iterdir())


def test_only_mtp_writes_only_the_draft_model(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp4-2mtp")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", src, out, "--tp", "2", "--only", "mtp", "--target", "vllm-seed")
    assert code == 0, err
    assert not (out / "model").exists()
    assert_matches_expectation(src, out, 2, "tp", components=("mtp",))
    assert_index_and_manifest(src, out, 2, components=("mtp",))


def test_max_shard_size_splits_parts_whose_union_equals_the_single_part_result(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp4")
    big, small = tmp_path / "big", tmp_path / "small"
    assert run_cli(capsys, "convert", src, big, "--tp", "2")[0] == 0
    assert run_cli(capsys, "convert", src, small, "--tp", "2", "--max-shard-size", "1MB")[0] == 0
    for comp in ("model", "mtp"):
        assert sorted(p.name for p in (big / comp).glob("*.safetensors")) == [
            "model-rank-0-part-0.safetensors",
            "model-rank-1-part-0.safetensors",
        ]
        for r in range(2):
            parts = sorted((small / comp).glob(f"model-rank-{r}-part-*.safetensors"))
            assert len(parts) >= 2, f"{comp} rank {r}: one part only"
            for p in parts:
                sizes = [
                    m["data_offsets"][1] - m["data_offsets"][0] for k, m in header_of(p).items() if k != "__metadata__"
                ]
                assert sum(sizes) <= 1_000_000 or len(sizes) == 1, (
                    f"{p.name}: {sum(sizes)} bytes in {len(sizes)} tensors"
                )
        a, b = read_component(big / comp), read_component(small / comp)
        for r in range(2):
            assert set(a[r]) == set(b[r])
            for name in a[r]:
                assert_same_tensor(name, b[r][name][1], a[r][name][1])
    assert_index_and_manifest(src, small, 2)


def test_dry_run_writes_nothing_and_json_plan_names_match_expectation(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp4-mtp-emb")
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        capsys, "convert", src, out, "--tp", "2", "--dry-run", "--json", "--target", "vllm-seed"
    )
    assert code == 0, err
    assert not out.exists()
    plan = json.loads(stdout)
    got: dict[tuple[str, int], set[str]] = {}
    for f in plan["files"]:
        comp = f["file"].split("/")[0]
        names = got.setdefault((comp, f["rank"]), set())
        for t in f["tensors"]:
            assert t["name"] not in names
            names.add(t["name"])
    for r in range(2):
        want = expected_outputs(src, 2, r)
        for comp in ("model", "mtp"):
            assert got[(comp, r)] == set(want[comp]), comp
    # without --json the plan is printed for people; still nothing is written
    code, _, err = run_cli(capsys, "convert", src, out, "--dry-run")
    assert code == 0, err
    assert not out.exists()


def test_finished_output_refuses_second_convert_and_force_rewrites_identical_bytes(
    fixture_dir, tmp_path, capsys
) -> None:
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    assert run_cli(capsys, "convert", src, out, "--tp", "2")[0] == 0
    first = tree_hashes(out)
    code, _, err = run_cli(capsys, "convert", src, out, "--tp", "2")
    assert code == 1
    assert "--force" in err
    assert tree_hashes(out) == first
    code, _, err = run_cli(capsys, "convert", src, out, "--tp", "2", "--force")
    assert code == 0, err
    assert tree_hashes(out) == first


def test_tp_that_does_not_divide_exits_1_naming_a_tensor(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", src, out, "--tp", "3")
    assert code == 1
    m = re.search(r"tensor '([^']+)'", err)
    assert m, err
    assert m.group(1) in load_source(src)[1]
    assert "tp=3" in err
    assert not out.exists() or not any(out.iterdir())


def test_unknown_source_tensor_exits_1_listing_it(fixture_copy, tmp_path, capsys) -> None:
    src = fixture_copy("fp4")
    bogus = "layers.1.attn.bogus_proj.weight"
    data = torch.ones(8, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    write_safetensors(src / "extra.safetensors", [(bogus, "BF16", (8,), data)])
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][bogus] = "extra.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", src, out)
    assert code == 1
    assert bogus in err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("variant,flipped", [("fp4", "fp8"), ("fp8", "fp4")])
def test_config_expert_dtype_disagreeing_with_stored_experts_exits_1(
    fixture_copy, tmp_path, capsys, variant, flipped
) -> None:
    src = fixture_copy(variant)
    cfg = json.loads((src / "config.json").read_text())
    cfg["expert_dtype"] = flipped
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", src, out)
    assert code == 1
    assert "expert_dtype" in err and ".experts." in err
    assert not out.exists() or not any(out.iterdir())


def test_out_inside_source_exits_1_and_writes_nothing(fixture_copy, capsys) -> None:
    src = fixture_copy("fp4")
    before = tree_hashes(src)
    for out in (src / "converted", src):
        code, _, err = run_cli(capsys, "convert", src, out)
        assert code == 1, out
        assert "OUT" in err
    assert not (src / "converted").exists()
    assert tree_hashes(src) == before


def test_workers_2_gives_byte_identical_output_to_workers_1(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp8")
    one, two = tmp_path / "w1", tmp_path / "w2"
    assert run_cli(capsys, "convert", src, one, "--tp", "4", "--max-shard-size", "300KB", "--workers", "1")[0] == 0
    assert run_cli(capsys, "convert", src, two, "--tp", "4", "--max-shard-size", "300KB", "--workers", "2")[0] == 0
    h1 = tree_hashes(one)
    assert len([k for k in h1 if k.endswith(".safetensors")]) > 8
    assert tree_hashes(two) == h1


def test_two_conversions_of_the_same_source_are_byte_identical(fixture_dir, tmp_path) -> None:
    src = fixture_dir("fp4-2mtp")
    a, b = tmp_path / "a", tmp_path / "b"
    convert(src, a, Options(tp=2))
    convert(src, b, Options(tp=2))
    ha = tree_hashes(a)
    assert "ckpt-tool.json" in ha and "mtp/index.json" in ha
    assert tree_hashes(b) == ha


def test_converting_a_copy_of_the_source_elsewhere_gives_the_same_tensor_files(fixture_dir, tmp_path) -> None:
    """A copy of the source in another folder converts to the same tensor files (paths do not leak in)."""
    src = fixture_dir("fp4-mtp-emb")
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    a, b = tmp_path / "a", tmp_path / "b"
    convert(src, a, Options(tp=1))
    convert(copy, b, Options(tp=1))
    ha, hb = tree_hashes(a), tree_hashes(b)
    tensor_files = {k: v for k, v in ha.items() if k.endswith(".safetensors") or k.endswith("index.json")}
    assert tensor_files == {k: hb[k] for k in tensor_files}


def test_under_ep_a_ranks_stacked_experts_name_only_its_own_experts_as_sources(fixture_dir) -> None:
    """--dry-run says where each tensor comes from: under --moe-parallel ep rank r's stack is built from experts
    [r*E/tp, (r+1)*E/tp) only (it listed all E before); under tp every rank reads a slice of every expert."""
    from ckpt_tool.checkpoint.source import open_checkpoint
    from ckpt_tool.mapping.plan import Options
    from ckpt_tool.mapping.planner import plan_conversion

    ck = open_checkpoint(fixture_dir("fp4"))
    cfg = ck.require_config()
    E, tp = cfg.n_routed_experts, 4
    for moe in ("ep", "tp"):
        plan = plan_conversion(cfg, ck.tensors, Options(tp=tp, moe_parallel=moe))
        for f in plan.files:
            for t in f.tensors:
                if t.name.endswith("routed_experts.w13_weight") and ".layers.0." in t.name:
                    experts = range(f.rank * E // tp, (f.rank + 1) * E // tp) if moe == "ep" else range(E)
                    assert t.sources == tuple(
                        f"layers.0.ffn.experts.{j}.{w}.weight" for j in experts for w in ("w1", "w3")
                    ), (moe, f.rank)
                    assert {s.src for s in t.segments} == set(t.sources)


@pytest.mark.parametrize("args", [["--tp", "2"], ["--tp", "4", "--moe-parallel", "ep"], ["--tp", "1", "--only", "mtp"]])
def test_dry_run_json_text_is_exactly_what_json_dumps_prints(fixture_dir, tmp_path, capsys, args: list[str]) -> None:
    """The dry run encodes each tensor document its ranks share, and each distinct list of a file's tensors, once,
    and writes the pieces one after another (jsondoc.json_pieces_sharing): the text must be the plain encoder's,
    byte for byte."""
    code, stdout, err = run_cli(
        capsys, "convert", fixture_dir("fp4-2mtp"), tmp_path / "out", *args, "--dry-run", "--json"
    )
    assert code == 0, err
    assert stdout == json.dumps(json.loads(stdout)) + "\n"


def test_float_casts_round_as_torch_does() -> None:
    """to_bf16 / to_f32 (a vision tower stored in the other float dtype) give torch's cast bit for bit: round to
    nearest even, ties, subnormals, infinities and NaN included."""
    from ckpt_tool.checkpoint.headers import TensorInfo
    from ckpt_tool.mapping import conversions

    g = torch.Generator().manual_seed(7)
    x = torch.cat(
        [
            torch.randn(4096, generator=g) * 10.0 ** torch.randint(-40, 38, (4096,), generator=g).float(),
            torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, float("inf"), -float("inf"), float("nan")]),
            # exact ties between two bfloat16 values: the even one wins
            (torch.arange(0, 256, dtype=torch.int32) << 16 | 0x8000).view(torch.float32),
        ]
    )
    info = TensorInfo("t", "F32", tuple(x.shape), "f", 0, 4 * x.numel())
    got = torch.frombuffer(bytearray(conversions.forward("to_bf16", x.numpy().tobytes(), info)), dtype=torch.bfloat16)
    want = x.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    b = want[~nan]
    back = conversions.forward("to_f32", b.view(torch.int16).numpy().tobytes(), info)
    assert torch.equal(torch.frombuffer(bytearray(back), dtype=torch.float32), b.to(torch.float32))
    assert conversions.out_dtype("BF16", "to_bf16") == "BF16" and conversions.effective("BF16", "to_bf16") == "copy"
