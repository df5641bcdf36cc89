"""Full-width DeepSeek V4-Flash skeleton: real config, names, shapes and dtypes; random (or no) bytes.

    python bench/make_skeleton.py OUT                      # embed/head/norm/hc_head + MTP layer, ~5.4 GB
    python bench/make_skeleton.py OUT --layers 1           # ... plus main layer 0 (+3.3 GiB per layer)
    python bench/make_skeleton.py OUT --headers-only       # all 43 layers + MTP, 46 shards, ~69k tensors,
                                                           # headers only: data are sparse holes (no disk)
    python bench/make_skeleton.py OUT --layers 1 --nvfp4   # NVIDIA's NVFP4 export of it (+3.6 GiB per layer)
    python bench/make_skeleton.py --self-check             # names/dtypes/shapes == ckpt_tool.fixtures.make's specs,
                                                           # and == what ckpt-tool derives from config.json
                                                           # (both forms: MXFP4 experts and the NVFP4 export)

The tensor set follows ckpt_tool/fixtures/make.py (``block_specs`` / ``mtp_specs``) at the real V4-Flash
dimensions of the released checkpoints (deepseek-ai/DeepSeek-V4-Flash config.json and headers). The specs are
written out here instead of imported, because importing ``ckpt_tool.fixtures.make`` pulls in torch (~230 MB RSS)
and this generator must stay under 200 MB;
``--self-check`` imports it in a separate run and compares the two spec lists for a few layer kinds.

Bytes are random but valid: E8M0 scales in 110..140 (never the NaN code 0xFF), FP8 e4m3 avoiding
the NaN codes 0x7F/0xFF, BF16/F32 with |x| < 2 (no Inf/NaN), tid2eid expert ids < 256, plain random
I8 for packed MXFP4. ``--nvfp4`` writes NVIDIA's NVFP4 export instead (the ``nvfp4`` fixture's form: DeepSeek's
names, the main layers' routed experts NVFP4 — U8 E2M1 pairs [out, in/2], F8_E4M3 ``weight_scale`` [out, in/16]
with positive finite codes, positive finite F32 ``weight_scale_2`` and ``input_scale`` scalars — the MTP layer's
left MXFP4 by ``ignore: [..., "mtp.*"]``, and quantization_config's ``quant_algo`` / ``moe_quant_algo`` / ``ignore``).
Data are streamed in chunks from small per-dtype pools: no tensor is ever built
in memory. With ``--headers-only`` (or ``--sparse``) each shard gets its header and is truncated to
its full size, so its data read back as zeros without using disk space.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ckpt_tool.checkpoint.dtypes import DTYPE_BITS  # noqa: E402  (the standard library only: no torch here)

GiB = 1024**3
MiB = 1024**2

# V4-Flash (deepseek-ai/DeepSeek-V4-Flash config.json)
VOCAB = 129280
HIDDEN = 4096
HEADS = 64
HEAD_DIM = 512
ROPE_DIM = 64
Q_LORA = 1024
O_GROUPS = 8
O_LORA = 1024
EXPERTS = 256
TOPK = 6
MOE_INTER = 2048
HC = 4
INDEX_HEADS = 64
INDEX_HEAD_DIM = 128
INDEX_TOPK = 512
NUM_LAYERS = 43
HASH_LAYERS = 3
MTP_LAYERS = 1
COMPRESS_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [0] * MTP_LAYERS  # len 44: 43 main layers + the MTP layer
INDEX_TOPK_VALUE = 512

# NVIDIA's NVFP4 export (ckpt_tool/fixtures/make.py NVFP4_IGNORE / nvfp4_quant_keys, written out: no torch here;
# --self-check compares): the ignore list leaves only the MTP layer's routed experts MXFP4, as vLLM matches it
# (models/deepseek_v41/quant_config.py _is_nvfp4_expert_layer: fnmatch of "{layer}.ffn.experts", vLLM 0.33.0/0.34.0)
NVFP4_IGNORE = ("*.attn.*", "*.ffn.shared_experts.*", "*.ffn.gate", "head", "mtp.*")
NVFP4_GROUP = 16  # inputs sharing one E4M3 block scale

# V4-Pro (DeepSeek-V4-Pro's published dimensions, from secondary sources): 61 layers, 384 experts, wider everything.
# Unconfirmed there and assumed here: index_n_heads 64, hc_mult 4, and the compress-ratio pattern
# (Flash's: two SWA layers, then CSA/HCA alternating, CSA last).
PRO = dict(
    HIDDEN=7168,
    HEADS=128,
    Q_LORA=1536,
    O_GROUPS=16,
    O_LORA=1024,
    EXPERTS=384,
    MOE_INTER=3072,
    NUM_LAYERS=61,
    COMPRESS_RATIOS=[0, 0] + [4, 128] * 29 + [4] + [0] * MTP_LAYERS,
    INDEX_TOPK_VALUE=1024,
)


def use_pro() -> None:
    """Switch this module's dimensions to V4-Pro's (the spec functions read the module constants)."""
    globals().update(PRO)


def nvfp4_layer(layer: str) -> bool:
    """Whether the routed experts of ``layer`` (``layers.L`` / ``mtp.K``) are NVFP4 in the NVFP4 export."""
    return not any(fnmatchcase(f"{layer}.ffn.experts", pat) for pat in NVFP4_IGNORE)


def make_config(num_hidden_layers: int | None = None, *, nvfp4: bool = False) -> dict:
    """The released V4-Flash config.json (the keys of deepseek-ai/DeepSeek-V4-Flash's), or V4-Pro's after use_pro();
    ``nvfp4``: with the keys NVIDIA's NVFP4 export adds to quantization_config."""
    if num_hidden_layers is None:
        num_hidden_layers = NUM_LAYERS
    nvfp4_keys = {"quant_algo": "MIXED_PRECISION", "moe_quant_algo": "NVFP4", "ignore": list(NVFP4_IGNORE)}
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": num_hidden_layers,
        "num_nextn_predict_layers": MTP_LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "qk_rope_head_dim": ROPE_DIM,
        "q_lora_rank": Q_LORA,
        "o_groups": O_GROUPS,
        "o_lora_rank": O_LORA,
        "sliding_window": 128,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "num_experts_per_tok": TOPK,
        "moe_intermediate_size": MOE_INTER,
        "num_hash_layers": min(HASH_LAYERS, num_hidden_layers),  # a skeleton of k < 3 layers hashes all k
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "first_k_dense_replace": 0,
        "rms_norm_eps": 1e-6,
        "hc_mult": HC,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "index_n_heads": INDEX_HEADS,
        "index_head_dim": INDEX_HEAD_DIM,
        "index_topk": INDEX_TOPK_VALUE,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 1048576,
        "compress_ratios": COMPRESS_RATIOS[:num_hidden_layers] + [0] * MTP_LAYERS,
        "tie_word_embeddings": False,
        "expert_dtype": "fp4",
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
            **(nvfp4_keys if nvfp4 else {}),
        },
    }


# ---------------------------------------------------------------------------------------------
# Specs (mirror ckpt_tool/fixtures/make.py; --self-check proves it)


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    fill: str | None = None  # which pool of valid bytes (Pools): the dtype's unless a tensor needs its own

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BITS[self.dtype] // 8


def _fp8_linear(prefix: str, out: int, inp: int) -> list[Spec]:
    return [
        Spec(f"{prefix}.weight", "F8_E4M3", (out, inp)),
        Spec(f"{prefix}.scale", "F8_E8M0", (math.ceil(out / 128), math.ceil(inp / 128))),
    ]


def _expert(prefix: str, out: int, inp: int) -> list[Spec]:  # MXFP4: I8 [out, in/2] + E8M0 [out, in/32]
    return [Spec(f"{prefix}.weight", "I8", (out, inp // 2)), Spec(f"{prefix}.scale", "F8_E8M0", (out, inp // 32))]


def _nvfp4_expert(prefix: str, out: int, inp: int) -> list[Spec]:  # NVIDIA's NVFP4 export of one projection
    return [
        Spec(f"{prefix}.weight", "U8", (out, inp // 2), "I8"),  # two E2M1 codes a byte: any byte (I8's pool)
        Spec(f"{prefix}.weight_scale", "F8_E4M3", (out, inp // NVFP4_GROUP), "e4m3_scale"),
        Spec(f"{prefix}.weight_scale_2", "F32", (), "f32_scale"),
        Spec(f"{prefix}.input_scale", "F32", (), "f32_scale"),
    ]


def block_specs(prefix: str, *, ratio: int, hash_layer: bool, nvfp4: bool = False) -> list[Spec]:
    mix = (2 + HC) * HC
    s = [Spec(f"{prefix}.attn_norm.weight", "BF16", (HIDDEN,)), Spec(f"{prefix}.ffn_norm.weight", "BF16", (HIDDEN,))]
    for part in ("attn", "ffn"):
        s += [
            Spec(f"{prefix}.hc_{part}_fn", "F32", (mix, HC * HIDDEN)),
            Spec(f"{prefix}.hc_{part}_base", "F32", (mix,)),
            Spec(f"{prefix}.hc_{part}_scale", "F32", (3,)),
        ]
    a = f"{prefix}.attn"
    s += _fp8_linear(f"{a}.wq_a", Q_LORA, HIDDEN)
    s += [Spec(f"{a}.q_norm.weight", "BF16", (Q_LORA,))]
    s += _fp8_linear(f"{a}.wq_b", HEADS * HEAD_DIM, Q_LORA)
    s += _fp8_linear(f"{a}.wkv", HEAD_DIM, HIDDEN)
    s += [Spec(f"{a}.kv_norm.weight", "BF16", (HEAD_DIM,))]
    s += _fp8_linear(f"{a}.wo_a", O_GROUPS * O_LORA, HEADS * HEAD_DIM // O_GROUPS)
    s += _fp8_linear(f"{a}.wo_b", HIDDEN, O_GROUPS * O_LORA)
    s += [Spec(f"{a}.attn_sink", "F32", (HEADS,))]
    if ratio:
        coff = 2 if ratio == 4 else 1
        c = f"{a}.compressor"
        s += [
            Spec(f"{c}.wkv.weight", "BF16", (coff * HEAD_DIM, HIDDEN)),
            Spec(f"{c}.wgate.weight", "BF16", (coff * HEAD_DIM, HIDDEN)),
            Spec(f"{c}.ape", "F32", (ratio, coff * HEAD_DIM)),
            Spec(f"{c}.norm.weight", "BF16", (HEAD_DIM,)),
        ]
    if ratio == 4:
        i = f"{a}.indexer"
        s += _fp8_linear(f"{i}.wq_b", INDEX_HEADS * INDEX_HEAD_DIM, Q_LORA)
        s += [
            Spec(f"{i}.weights_proj.weight", "BF16", (INDEX_HEADS, HIDDEN)),
            Spec(f"{i}.compressor.wkv.weight", "BF16", (2 * INDEX_HEAD_DIM, HIDDEN)),
            Spec(f"{i}.compressor.wgate.weight", "BF16", (2 * INDEX_HEAD_DIM, HIDDEN)),
            Spec(f"{i}.compressor.ape", "F32", (4, 2 * INDEX_HEAD_DIM)),
            Spec(f"{i}.compressor.norm.weight", "BF16", (INDEX_HEAD_DIM,)),
        ]
    f = f"{prefix}.ffn"
    s += [Spec(f"{f}.gate.weight", "BF16", (EXPERTS, HIDDEN))]
    s += (
        [Spec(f"{f}.gate.tid2eid", "I64", (VOCAB, TOPK))] if hash_layer else [Spec(f"{f}.gate.bias", "F32", (EXPERTS,))]
    )
    s += _fp8_linear(f"{f}.shared_experts.w1", MOE_INTER, HIDDEN)
    s += _fp8_linear(f"{f}.shared_experts.w2", HIDDEN, MOE_INTER)
    s += _fp8_linear(f"{f}.shared_experts.w3", MOE_INTER, HIDDEN)
    expert = _nvfp4_expert if nvfp4 and nvfp4_layer(prefix) else _expert
    for j in range(EXPERTS):
        s += expert(f"{f}.experts.{j}.w1", MOE_INTER, HIDDEN)
        s += expert(f"{f}.experts.{j}.w2", HIDDEN, MOE_INTER)
        s += expert(f"{f}.experts.{j}.w3", MOE_INTER, HIDDEN)
    return s


def mtp_specs(i: int, *, nvfp4: bool = False) -> list[Spec]:
    p = f"mtp.{i}"
    s = [
        Spec(f"{p}.enorm.weight", "BF16", (HIDDEN,)),
        Spec(f"{p}.hnorm.weight", "BF16", (HIDDEN,)),
        *_fp8_linear(f"{p}.e_proj", HIDDEN, HIDDEN),
        *_fp8_linear(f"{p}.h_proj", HIDDEN, HIDDEN),
    ]
    s += block_specs(p, ratio=0, hash_layer=False, nvfp4=nvfp4)
    s += [
        Spec(f"{p}.norm.weight", "BF16", (HIDDEN,)),
        Spec(f"{p}.hc_head_fn", "F32", (HC, HC * HIDDEN)),
        Spec(f"{p}.hc_head_base", "F32", (HC,)),
        Spec(f"{p}.hc_head_scale", "F32", (1,)),
    ]
    return s  # the released V4-Flash stores no mtp.{i}.emb / mtp.{i}.head (the converter materializes them)


def all_specs(layers: int, *, nvfp4: bool = False) -> list[Spec]:
    """Tensors in file order: embed, main layers 0..layers-1, final norm/head/hc_head, MTP layers (``nvfp4``: as
    NVIDIA's NVFP4 export writes them)."""
    s = [Spec("embed.weight", "BF16", (VOCAB, HIDDEN))]
    for layer in range(layers):
        s += block_specs(f"layers.{layer}", ratio=COMPRESS_RATIOS[layer], hash_layer=layer < HASH_LAYERS, nvfp4=nvfp4)
    s += [
        Spec("norm.weight", "BF16", (HIDDEN,)),
        Spec("head.weight", "BF16", (VOCAB, HIDDEN)),
        Spec("hc_head_fn", "F32", (HC, HC * HIDDEN)),
        Spec("hc_head_base", "F32", (HC,)),
        Spec("hc_head_scale", "F32", (1,)),
    ]
    for i in range(MTP_LAYERS):
        s += mtp_specs(i, nvfp4=nvfp4)
    return s


def shard(specs: list[Spec], *, shard_size: int | None = None, num_shards: int | None = None) -> list[list[Spec]]:
    """Cut ``specs`` (in order) into shards: at most ``shard_size`` bytes each, or exactly ``num_shards``
    of about equal size (a tensor goes to the shard its first byte falls in)."""
    total = sum(s.nbytes for s in specs)
    if num_shards:
        target = total / num_shards
        out: list[list[Spec]] = [[] for _ in range(num_shards)]
        pos = 0
        for s in specs:
            out[min(num_shards - 1, int(pos // target))].append(s)
            pos += s.nbytes
        return [g for g in out if g]
    assert shard_size
    groups: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        if groups[-1] and size + s.nbytes > shard_size:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.nbytes
    return groups


# ---------------------------------------------------------------------------------------------
# Bytes


class Pools:
    """Per-dtype pools of valid random bytes; chunks are slices at random 8-aligned offsets."""

    POOL = 8 * MiB
    PIECE = 4 * MiB  # bytes per write

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.pools: dict[str, np.ndarray] = {}

    def _make(self, dtype: str) -> np.ndarray:
        n = self.POOL + self.PIECE
        rng = self.rng
        if dtype == "e4m3_scale":  # NVFP4 block scales: positive finite e4m3fn codes (0x08..0x77: 2^-6 .. 240)
            return rng.integers(0x08, 0x78, size=n, dtype=np.uint8)
        if dtype == "f32_scale":  # NVFP4 global and input scales: positive finite float32 (2^-12 .. 2^-4)
            return np.exp2(rng.random(n // 4, dtype=np.float32) * 8 - 12).astype("<f4").view(np.uint8)
        if dtype == "F8_E8M0":
            return rng.integers(110, 141, size=n, dtype=np.uint8)  # 2^-17 .. 2^13, never 0xFF (NaN)
        b = rng.integers(0, 256, size=n, dtype=np.uint8)
        if dtype == "F8_E4M3":
            b[(b & 0x7F) == 0x7F] ^= 1  # 0x7F / 0xFF are NaN in e4m3fn
        elif dtype == "BF16":
            b[1::2] &= 0xBF  # clear the top exponent bit: |x| < 2, never Inf/NaN
        elif dtype == "F32":
            b[3::4] &= 0xBF
        elif dtype == "I64":
            b = b.view("<u8") % EXPERTS  # expert ids
            b = b.astype("<i8").view(np.uint8)
        return b

    def chunk(self, dtype: str, n: int) -> memoryview:
        pool = self.pools.get(dtype)
        if pool is None:
            pool = self.pools[dtype] = self._make(dtype)
        off = int(self.rng.integers(0, self.POOL // 8)) * 8
        return memoryview(pool[off : off + n])


def header_bytes(specs: list[Spec]) -> bytes:
    doc: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        doc[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_shard(path: Path, specs: list[Spec], pools: Pools | None) -> int:
    """Header, then every tensor's bytes in <= 4 MiB pieces (or a hole when ``pools`` is None)."""
    head = header_bytes(specs)
    data = sum(s.nbytes for s in specs)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, head)
        if pools is None:
            os.ftruncate(fd, len(head) + data)
            return len(head) + data
        for s in specs:
            left = s.nbytes
            while left:
                n = min(left, Pools.PIECE)
                mv = pools.chunk(s.fill or s.dtype, n)
                while mv:
                    mv = mv[os.write(fd, mv) :]
                left -= n
    finally:
        os.close(fd)
    return len(head) + data


def make_skeleton(
    out: Path,
    *,
    layers: int = 0,
    headers_only: bool = False,
    shard_size: int = 4 * GiB,
    num_shards: int | None = None,
    seed: int = 0,
    nvfp4: bool = False,
    log=print,
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    specs = all_specs(layers, nvfp4=nvfp4)
    groups = shard(specs, shard_size=shard_size, num_shards=num_shards)
    n = len(groups)
    # a skeleton of k main layers says so in its config: the engine (and convert) want every layer it names
    (out / "config.json").write_text(json.dumps(make_config(layers or None, nvfp4=nvfp4), indent=2) + "\n")
    pools = None if headers_only else Pools(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for k, group in enumerate(groups, start=1):
        file = f"model-{k:05d}-of-{n:05d}.safetensors"
        size = write_shard(out / file, group, pools)
        for s in group:
            weight_map[s.name] = file
            total += s.nbytes
        if log and not headers_only:
            log(f"  {file}: {len(group)} tensors, {size / GiB:.2f} GiB")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    if log:
        what = ("headers only (sparse)" if headers_only else "data") + (", NVFP4 export" if nvfp4 else "")
        log(f"wrote {out}: {n} shards, {len(specs)} tensors, {total / GiB:.2f} GiB, {what}")
    return out


def self_check() -> int:
    """Compare this module's specs with ckpt_tool.fixtures.make's (monkeypatched to V4-Flash dims), in both forms:
    MXFP4 experts (the ``fp4`` fixture) and NVIDIA's NVFP4 export (the ``nvfp4`` fixture)."""
    import ckpt_tool.fixtures.make as fm  # imports torch: only --self-check pays for it

    for name in (
        "VOCAB",
        "HIDDEN",
        "HEADS",
        "HEAD_DIM",
        "ROPE_DIM",
        "Q_LORA",
        "O_GROUPS",
        "O_LORA",
        "EXPERTS",
        "TOPK",
        "MOE_INTER",
        "HC",
        "INDEX_HEADS",
        "INDEX_HEAD_DIM",
        "HASH_LAYERS",
    ):
        setattr(fm, name, globals()[name])
    ok = True
    for form, nvfp4 in (("fp4", False), ("nvfp4", True)):
        # the variant carries its own moe_intermediate_size (set when ckpt_tool.fixtures.make was imported): ours
        variant = dataclasses.replace(fm.VARIANTS[form], moe_inter=MOE_INTER)
        print(f"{form} ({'NVIDIA NVFP4 export' if nvfp4 else 'MXFP4 experts'}):")
        cases = [("layers.0", 0, True), ("layers.2", 4, True), ("layers.3", 128, False), ("layers.5", 4, False)]
        for prefix, ratio, hashed in cases:
            theirs = [
                (s.name, s.dtype, tuple(s.shape))
                for s in fm.block_specs(prefix, variant, ratio=ratio, hash_layer=hashed)
            ]
            mine = [
                (s.name, s.dtype, s.shape) for s in block_specs(prefix, ratio=ratio, hash_layer=hashed, nvfp4=nvfp4)
            ]
            ok &= theirs == mine
            print(f"  block {prefix} ratio {ratio}: {'same' if theirs == mine else 'DIFFERENT'} ({len(mine)} tensors)")
        theirs = [(s.name, s.dtype, tuple(s.shape)) for s in fm.mtp_specs(0, variant)]
        mine = [(s.name, s.dtype, s.shape) for s in mtp_specs(0, nvfp4=nvfp4)]
        ok &= theirs == mine
        print(f"  mtp.0: {'same' if theirs == mine else 'DIFFERENT'} ({len(mine)} tensors)")
        cfg = fm.make_config(variant)
        missing = sorted(set(cfg) - set(make_config(nvfp4=nvfp4)))
        ok &= not missing
        print(f"  config keys missing vs fixtures: {missing or 'none'}")
        # the keys the export adds (fixtures.make nvfp4_quant_keys) and nothing else of the fixture's is left out
        quant = make_config(nvfp4=nvfp4)["quantization_config"]
        quant_missing = {k: v for k, v in cfg["quantization_config"].items() if quant.get(k) != v}
        ok &= not quant_missing
        print(f"  quantization_config keys differing from the fixture's: {quant_missing or 'none'}")
        ok &= agrees_with_its_config(nvfp4=nvfp4)
    return 0 if ok else 1


def agrees_with_its_config(*, nvfp4: bool = False) -> bool:
    """Whether every tensor of the full skeleton has the shape and dtype ckpt-tool derives from its config.json, and
    (``nvfp4``) whether ckpt-tool reads the expert format of each layer as written."""
    from ckpt_tool.checkpoint.agreement import config_disagreement
    from ckpt_tool.checkpoint.config import V4Config
    from ckpt_tool.checkpoint.headers import TensorInfo

    tensors, offset = [], 0
    for s in all_specs(NUM_LAYERS, nvfp4=nvfp4):
        tensors.append(TensorInfo(s.name, s.dtype, s.shape, "skeleton.safetensors", offset, offset + s.nbytes))
        offset += s.nbytes
    config = V4Config.from_dict(make_config(nvfp4=nvfp4))
    found = config_disagreement(config, tensors)
    print(
        f"  shapes and dtypes ckpt-tool derives from config.json ({len(tensors)} tensors): "
        f"{'same' if found is None else found.message(config)}"
    )
    return found is None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, nargs="?", help="folder to write (created)")
    p.add_argument(
        "--layers", type=int, default=None, help="main layers with data (default 0; --headers-only: all 43, Pro 61)"
    )
    p.add_argument(
        "--headers-only",
        action="store_true",
        help="headers + sparse holes; default: the full 43-layer checkpoint in 46 shards",
    )
    p.add_argument("--sparse", action="store_true", help="like --headers-only but for the --layers/--shard-size layout")
    p.add_argument("--shard-size", type=float, default=4.0, help="GiB per shard (default 4)")
    p.add_argument(
        "--num-shards",
        type=int,
        default=None,
        help="exactly N shards of about equal size (default 46 with --headers-only)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--self-check", action="store_true", help="compare specs with ckpt_tool.fixtures.make (imports torch) and exit"
    )
    p.add_argument("--model", choices=("flash", "pro"), default="flash", help="V4-Flash (default) or V4-Pro dimensions")
    p.add_argument(
        "--nvfp4",
        action="store_true",
        help="NVIDIA's NVFP4 export: NVFP4 main-layer experts, the MTP layer's MXFP4 (ignore mtp.*)",
    )
    args = p.parse_args(argv)
    if args.model == "pro":
        use_pro()
    if args.self_check:
        return self_check()
    if args.out is None:
        p.error("OUT is required")
    layers = args.layers if args.layers is not None else (NUM_LAYERS if args.headers_only else 0)
    if not 0 <= layers <= NUM_LAYERS:
        p.error(f"--layers must be in 0..{NUM_LAYERS}")
    num_shards = args.num_shards if args.num_shards else (46 if args.headers_only and args.layers is None else None)
    make_skeleton(
        args.out,
        layers=layers,
        headers_only=args.headers_only or args.sparse,
        shard_size=int(args.shard_size * GiB),
        num_shards=num_shards,
        seed=args.seed,
        nvfp4=args.nvfp4,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
