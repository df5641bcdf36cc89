"""The DeepSeek V4.1 fixtures (``v41`` and its broken variants): nested config, safetensors/index structure, tensor
names and dtypes, Engram layout, determinism. What vLLM makes of them is proven by tests/engine/test_engine_v41.py."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckpt_tool.checkpoint.dtypes import DTYPE_BITS
from ckpt_tool.fixtures.make import (
    BROKEN_VARIANTS,
    DRAFT_BROKEN_VARIANTS,
    DSPARK_VARIANTS,
    SEED,
    V41_BROKEN_VARIANTS,
    V41_COMPRESS_RATIOS,
    V41_ENGRAM_HEAD_DIM,
    V41_ENGRAM_HEADS,
    V41_ENGRAM_LAYERS,
    V41_ENGRAM_MAX_NGRAM,
    V41_INDEX_SOURCES,
    V41_KV_SOURCES,
    V41_LAYERS,
    V41_STAGES,
    V41_VARIANTS,
    VARIANTS,
    VISION_VARIANTS,
    make_checkpoint,
    serving_files,
    v41_engram_head_sizes,
    v41_engram_num_embeddings,
    v41_engram_rank_rows,
    v41_shard_plan,
)

INDEX = "model.safetensors.index.json"
SHARDS = [f"model-{k:05d}-of-00005.safetensors" for k in range(1, 6)]
N_HASH_COLS = (V41_ENGRAM_MAX_NGRAM - 1) * V41_ENGRAM_HEADS


def _headers(root: Path) -> dict[str, tuple[str, list[int], str]]:
    """name -> (safetensors dtype, shape, file), read from every shard's header with safetensors itself."""
    out = {}
    for file in sorted(p.name for p in root.glob("model-*.safetensors")):
        with safe_open(root / file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                sl = f.get_slice(name)
                out[name] = (sl.get_dtype(), list(sl.get_shape()), file)
    return out


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(p.name for p in root.glob("model-*.safetensors")):
        with safe_open(root / file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                out[name] = f.get_tensor(name)
    return out


def test_v41_variant_lists() -> None:
    assert V41_VARIANTS == ["v41"]
    assert V41_BROKEN_VARIANTS == ["v41-missing-engram", "v41-missing-stage"]
    assert set(V41_BROKEN_VARIANTS) <= set(BROKEN_VARIANTS) & set(DRAFT_BROKEN_VARIANTS)
    # listed once among the partition's lists (tests/test_fixtures.py): the good one with the DSpark drafts, not
    # with the V4 vision models (whose tests convert with V4 rules)
    assert "v41" in DSPARK_VARIANTS and not set(V41_VARIANTS + V41_BROKEN_VARIANTS) & set(VISION_VARIANTS)
    assert all(VARIANTS[n].family == "v41" for n in V41_VARIANTS + V41_BROKEN_VARIANTS)


def test_v41_nested_config(fixture_dir) -> None:
    config = json.loads((fixture_dir("v41") / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41" and config["architectures"] == ["DeepseekV41ForCausalLM"]
    assert set(config) >= {"text_config", "vision_config", "quantization_config"}
    q = config["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [32, 32] and q["expert_dtype"] == "fp4"
    text = config["text_config"]
    assert "expert_dtype" not in text  # vLLM takes it from quantization_config
    assert text["num_hidden_layers"] == V41_LAYERS
    assert text["compress_ratios"] == V41_COMPRESS_RATIOS + [0] * V41_STAGES
    assert set(text["compress_ratios"]) <= {0, 1, 2}
    assert text["kv_source_layer_ids"] == V41_KV_SOURCES and text["index_source_layer_ids"] == V41_INDEX_SOURCES
    assert text["head_dim"] == 512 and text["qk_rope_head_dim"] == 64  # asserted by vLLM's V4.1 compressor
    assert text["engram_layer_ids"] == V41_ENGRAM_LAYERS
    assert text["engram_num_embeddings"] == v41_engram_num_embeddings()
    # every token of the fixture tokenizer normalizes differently: vLLM's compressed vocab is the vocab
    vocab = json.loads(serving_files()["tokenizer.json"])["model"]["vocab"]
    assert text["engram_compressed_vocab_size"] == len(vocab) == text["vocab_size"]
    assert text["dspark_n_routed_experts"] != text["n_routed_experts"]
    assert text["n_mtp_layers"] == text["num_nextn_predict_layers"] == V41_STAGES
    assert config["vision_config"]["num_hidden_layers"] > 0


def test_v41_engram_layout() -> None:
    sizes = v41_engram_head_sizes()
    assert [len(s) for s in sizes] == [N_HASH_COLS] * len(V41_ENGRAM_LAYERS)
    flat = [p for s in sizes for p in s]
    assert len(set(flat)) == len(flat)  # a prime is never handed out twice
    assert all(all(p % k for k in range(2, int(p**0.5) + 1)) for p in flat)
    assert v41_engram_num_embeddings() == [sum(s) for s in sizes]
    for tp in (1, 2, 4):
        rows = v41_engram_rank_rows(tp)
        assert rows is not None, tp
        for i, total in enumerate(v41_engram_num_embeddings()):
            assert sum(n for _s, n in rows[i]) == total
            starts = [s for s, _n in rows[i]]
            assert starts == sorted(starts) and starts[0] == 0
    assert len({n for _s, n in v41_engram_rank_rows(2)[0]}) == 2  # ranks hold different row counts
    assert len({n for _s, n in v41_engram_rank_rows(4)[0]}) == 4
    assert v41_engram_rank_rows(8) is not None  # 16 hash heads: two a rank
    assert v41_engram_rank_rows(5) is None and v41_engram_rank_rows(7) is None  # vLLM's assertion refuses them


def _pattern(name: str) -> str:
    return re.sub(r"\.experts\.\d+\.", ".experts.E.", re.sub(r"^(layers|mtp)\.\d+\.", r"\1.N.", name))


def test_v41_structure(fixture_dir) -> None:
    root = fixture_dir("v41")
    names = sorted(p.name for p in root.iterdir())
    assert names == sorted(["config.json", INDEX, *SHARDS, *serving_files()])
    heads = _headers(root)
    index = json.loads((root / INDEX).read_text())
    assert index["weight_map"] == {n: f for n, (_d, _s, f) in heads.items()}
    assert index["metadata"]["total_size"] == sum(DTYPE_BITS[d] // 8 * math.prod(s) for d, s, _f in heads.values())
    specs = {s.name: s for g in v41_shard_plan(VARIANTS["v41"]) for s in g}
    assert {n: (d, s) for n, (d, s, _f) in heads.items()} == {n: (s.dtype, list(s.shape)) for n, s in specs.items()}
    assert sum(p.stat().st_size for p in root.iterdir()) < 32 * 2**20  # 8 heads and 16 hash heads: tp 8
    # a draft stage straddles two shards
    assert len({heads[n][2] for n in heads if n.startswith("mtp.1.")}) == 2
    # DeepSeek's names, by family
    assert "embed.weight" in heads and "head.weight" in heads and "norm.weight" in heads
    assert not [n for n in heads if "hc_head" in n or n == "image_pad" or n.endswith(".ape")]
    assert {n for n in heads if n.startswith("image_")} == {"image_start", "image_end", "image_newline"}
    for layer in range(V41_LAYERS):
        p = f"layers.{layer}."
        has = {n[len(p) :] for n in heads if n.startswith(p)}
        assert ("attn.compressor.wkv.weight" in has) == (layer in V41_KV_SOURCES), layer
        assert ("attn.compressor.wgate.weight" in has) == (layer in V41_KV_SOURCES and V41_COMPRESS_RATIOS[layer] == 2)
        assert ("attn.indexer.wq_b.weight" in has) == (layer in V41_INDEX_SOURCES), layer
        assert ("attn.indexer.wk.weight" in has) == (layer in V41_INDEX_SOURCES and layer in V41_KV_SOURCES), layer
        assert ("engram.embed.weight" in has) == (layer in V41_ENGRAM_LAYERS), layer
        assert {"ffn.gate.bias", "ffn.gate.bias_vl"} <= has and "ffn.gate.tid2eid" not in has
    for i, layer in enumerate(V41_ENGRAM_LAYERS):
        rows = v41_engram_num_embeddings()[i]
        assert heads[f"layers.{layer}.engram.embed.weight"][:2] == ("F8_E4M3", [rows, V41_ENGRAM_HEAD_DIM])
        assert heads[f"layers.{layer}.engram.embed.scale"][:2] == ("F8_E8M0", [rows, V41_ENGRAM_HEAD_DIM // 32])
    for n, (dtype, shape, _f) in heads.items():
        if n.endswith(".scale") and ".experts." not in n and ".engram.embed." not in n:
            w = heads[n[: -len(".scale")] + ".weight"]
            assert dtype == "F8_E8M0" and w[0] == "F8_E4M3" and shape == [w[1][0] // 32, w[1][1] // 32], n
        if re.search(r"\.experts\.\d+\.w[123]\.scale$", n):
            w = heads[n[: -len(".scale")] + ".weight"]
            assert dtype == "F8_E8M0" and w[0] == "I8" and shape == [w[1][0], w[1][1] * 2 // 32], n
    # the DSpark V4.1 draft: Markov head in the checkpoint's names, bias_vl on every stage, no hc_head
    last = f"mtp.{V41_STAGES - 1}."
    assert {f"{last}markov_head.embed.weight", f"{last}markov_head.head.weight"} <= set(heads)
    assert f"{last}confidence_head.proj.weight" in heads and "mtp.0.main_proj.scale" in heads
    assert all(f"mtp.{i}.ffn.gate.bias_vl" in heads for i in range(V41_STAGES))
    assert not [n for n in heads if n.startswith("mtp.") and ("compressor" in n or "indexer" in n or "engram" in n)]
    print("\nv41 tensors (collapsed over layers, stages and experts):")
    seen: dict[tuple, None] = {}
    for n, (dtype, shape, _f) in heads.items():
        seen.setdefault((_pattern(n), dtype, tuple(shape)))
    for pattern, dtype, shape in sorted(seen):
        print(f"  {pattern:<52} {dtype:<8} {list(shape)}")


def test_v41_values(fixture_dir) -> None:
    t = _tensors(fixture_dir("v41"))
    for n, x in t.items():
        if x.dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
            assert torch.isfinite(x.float()).all(), n
        if x.dtype == torch.float8_e8m0fnu:
            b = x.view(torch.uint8)
            assert int(b.min()) > 100 and int(b.max()) < 140, n  # plausible exponents, never NaN (255)
    # scales of one 32x32 MXFP8 linear differ between blocks (a block-layout bug changes the weights)
    assert t["layers.0.attn.wq_b.scale"].view(torch.uint8).unique().numel() > 1
    assert t["layers.1.engram.embed.scale"].view(torch.uint8).unique().numel() > 1


@pytest.mark.parametrize("variant", V41_BROKEN_VARIANTS)
def test_v41_broken_variants_lack_exactly_their_part(fixture_dir, variant: str) -> None:
    good, broken = _tensors(fixture_dir("v41")), _tensors(fixture_dir(variant))
    gone = sorted(set(good) - set(broken))
    assert not set(broken) - set(good)
    if variant == "v41-missing-engram":
        layer = V41_ENGRAM_LAYERS[-1]
        assert gone == [f"layers.{layer}.engram.embed.scale", f"layers.{layer}.engram.embed.weight"]
    else:
        assert gone == sorted(n for n in good if n.startswith(f"mtp.{V41_STAGES - 1}."))
    for n, x in broken.items():
        assert torch.equal(x.view(-1).view(torch.uint8), good[n].view(-1).view(torch.uint8)), n
    config = json.loads((fixture_dir(variant) / "config.json").read_text())
    assert config == json.loads((fixture_dir("v41") / "config.json").read_text())


def test_v41_generation_is_deterministic_and_seed_dependent(fixture_dir, tmp_path: Path) -> None:
    first = fixture_dir("v41")
    again = make_checkpoint(tmp_path / "again", "v41")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    other = make_checkpoint(tmp_path / "other", "v41", seed=SEED + 1)
    assert (other / "config.json").read_bytes() == (first / "config.json").read_bytes()
    assert (other / INDEX).read_bytes() == (first / INDEX).read_bytes()
    for shard in SHARDS:
        a, b = (first / shard).read_bytes(), (other / shard).read_bytes()
        assert len(a) == len(b) and a != b, shard


def test_v41_opens_with_ckpt_tool(fixture_dir) -> None:
    """ckpt_tool's reader sees the same tensors and shards (what it makes of the nested config is the converter's
    business: not asserted here)."""
    from ckpt_tool.checkpoint.source import open_checkpoint

    root = fixture_dir("v41")
    ck = open_checkpoint(root)
    assert ck.index_file == INDEX
    assert {n: t.file for n, t in ck.tensors.items()} == json.loads((root / INDEX).read_text())["weight_map"]
    assert sorted(ck.shards) == SHARDS
    assert ck.total_bytes == json.loads((root / INDEX).read_text())["metadata"]["total_size"]
