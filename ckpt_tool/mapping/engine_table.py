"""The engine's parameter table: every key, per-rank shape and dtype a target profile's engine holds.

This is the engine's side of the contract, written from the engine's code (vLLM's
``vllm/models/deepseek_v4/nvidia/model.py`` / ``mtp.py`` state_dict after its sharded loader's
``_filter_subtensors``, 0.33 and 0.34), independently of the rule table: verify compares the converted output with it,
so a rule table gone stale against the engine fails verify instead of the engine's start-up. The
engine test (tests/engine) checks this table against vLLM's own model classes built on CPU.

Shapes follow from config.json alone. vLLM (0.33, 0.34) gives block-FP8 shared experts whole 128-blocks per
rank, rounding the per-rank count up where the blocks do not divide tp (its loader zero-fills the rest).
``attn_sink`` is the one documented prefix: the engine pads its parameter to the attention backend's
head count (FlashMLA 64/128) and loads the ``H/tp`` real heads into the leading slots; the table lists
the ``H/tp`` the file holds and marks it ``prefix``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ckpt_tool.checkpoint.blocks import FP8_BLOCK, MX_BLOCK, NVFP4_BLOCK, cdiv
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.engram import engram_split
from ckpt_tool.checkpoint.expert_format import MXFP4, NVFP4, layer_format
from ckpt_tool.mapping.profiles import PROFILES, EngineNames, draft_kind_of, get_profile, model_class_of


@dataclass(frozen=True)
class EngineParam:
    name: str
    shape: tuple[int, ...]
    dtype: str | None  # safetensors dtype; None: the engine takes whatever dtype the source stores
    prefix: bool = False  # the engine's parameter is larger; the loader fills this leading slice


# Each profile's engine names and dtypes, from its module in ckpt_tool.mapping.profiles (the one place per layout).
ENGINES: dict[str, EngineNames] = {name: p.engine for name, p in PROFILES.items()}


class _Table:
    def __init__(self, cfg: V4Config, names: EngineNames, tp: int, ep: bool, global_input_scales: bool = True) -> None:
        self.cfg, self.n, self.tp, self.ep = cfg, names, tp, ep
        self.global_input_scales = global_input_scales
        self.params: dict[str, EngineParam] = {}
        fp4 = cfg.expert_dtype == "fp4"
        self.scale_dtype = names.fp4_expert_linear_scale if fp4 else names.fp8_expert_linear_scale

    def add(self, name: str, shape: tuple[int, ...], dtype: str | None, prefix: bool = False) -> None:
        self.params[name] = EngineParam(name, tuple(shape), dtype, prefix)

    def linear(self, name: str, out: int, inp: int, split: str | None = None) -> None:
        """A block-FP8 linear [out, in] with [out/128, in/128] scales, column (dim 0) or row (dim 1) split."""
        so, si = cdiv(out, FP8_BLOCK), cdiv(inp, FP8_BLOCK)
        if split == "col":
            out, so = out // self.tp, so // self.tp
        elif split == "row":
            inp, si = inp // self.tp, si // self.tp
        self.add(f"{name}.weight", (out, inp), "F8_E4M3")
        self.add(f"{name}.weight_scale_inv", (so, si), self.scale_dtype)

    def routed(self, r: str, src: str, experts: int) -> None:
        """The routed experts under ``r`` of the block the checkpoint holds under ``src`` (``layers.L`` / ``mtp.K``),
        in that block's format (ckpt_tool.checkpoint.expert_format: vLLM's choice), ``experts`` of them."""
        D, I, T = self.cfg.hidden_size, self.cfg.moe_intermediate_size, self.tp
        El, Il = (experts // T, I) if self.ep else (experts, I // T)
        fmt = layer_format(self.cfg, src)
        if fmt is MXFP4:  # Mxfp4MoEMethod: packed bytes and E8M0 per-32 scales, as uint8
            self.add(f"{r}.w13_weight", (El, 2 * Il, D // 2), "U8")
            self.add(f"{r}.w13_weight_scale", (El, 2 * Il, D // MX_BLOCK), "U8")
            self.add(f"{r}.w2_weight", (El, D, Il // 2), "U8")
            self.add(f"{r}.w2_weight_scale", (El, D, Il // MX_BLOCK), "U8")
        elif fmt is NVFP4:
            # ModelOptNvFp4FusedMoE.create_weights (model_executor/layers/quantization/modelopt.py, 0.33.0 and 0.34.0):
            # packed uint8, E4M3 scales per 16 inputs, one float32 global scale a projection (w13: w1's, w3's), and
            # the input scales of every expert where the FlashInfer backends keep them all (fused_moe/oracle/nvfp4.py
            # is_global_sf_supported_for_nvfp4_backend), else of the local ones
            Eg = experts if self.global_input_scales else El
            self.add(f"{r}.w13_weight", (El, 2 * Il, D // 2), "U8")
            self.add(f"{r}.w13_weight_scale", (El, 2 * Il, D // NVFP4_BLOCK), "F8_E4M3")
            self.add(f"{r}.w13_weight_scale_2", (El, 2), "F32")
            self.add(f"{r}.w13_input_scale", (Eg, 2), "F32")
            self.add(f"{r}.w2_weight", (El, D, Il // 2), "U8")
            self.add(f"{r}.w2_weight_scale", (El, D, Il // NVFP4_BLOCK), "F8_E4M3")
            self.add(f"{r}.w2_weight_scale_2", (El,), "F32")
            self.add(f"{r}.w2_input_scale", (Eg,), "F32")
        else:  # block FP8 with float32 scales
            self.add(f"{r}.w13_weight", (El, 2 * Il, D), "F8_E4M3")
            self.add(f"{r}.w13_weight_scale_inv", (El, 2 * Il // FP8_BLOCK, D // FP8_BLOCK), "F32")
            self.add(f"{r}.w2_weight", (El, D, Il), "F8_E4M3")
            self.add(f"{r}.w2_weight_scale_inv", (El, D // FP8_BLOCK, Il // FP8_BLOCK), "F32")

    def block(self, p: str, src: str, *, ratio: int, hash_layer: bool) -> None:
        c, n, T = self.cfg, self.n, self.tp
        D, hc = c.hidden_size, c.hc_mult
        mix = (2 + hc) * hc
        self.add(f"{p}.attn_norm.weight", (D,), "BF16")
        self.add(f"{p}.ffn_norm.weight", (D,), "BF16")
        for part in ("attn", "ffn"):
            self.add(f"{p}.hc_{part}_fn", (mix, hc * D), "F32")
            self.add(f"{p}.hc_{part}_base", (mix,), "F32")
            self.add(f"{p}.hc_{part}_scale", (3,), "F32")
        a = f"{p}.attn"
        H, hd, ql = c.num_attention_heads, c.head_dim, c.q_lora_rank
        self.add(f"{a}.attn_sink", (H // T,), "F32", prefix=True)
        # fused_wqa_wkv: MergedColumnParallelLinear(disable_tp) of wq_a [ql, D] and wkv [hd, D]
        self.add(f"{a}.fused_wqa_wkv.weight", (ql + hd, D), "F8_E4M3")
        self.add(
            f"{a}.fused_wqa_wkv.weight_scale_inv",
            (cdiv(ql, FP8_BLOCK) + cdiv(hd, FP8_BLOCK), cdiv(D, FP8_BLOCK)),
            self.scale_dtype,
        )
        self.add(f"{a}.q_norm.weight", (ql,), "BF16")
        self.add(f"{a}.kv_norm.weight", (hd,), "BF16")
        self.linear(f"{a}.wq_b", H * hd, ql, "col")
        self.linear(f"{a}.wo_a", c.o_groups * c.o_lora_rank, H * hd // c.o_groups, "col")
        self.linear(f"{a}.wo_b", D, c.o_groups * c.o_lora_rank, "row")
        if ratio:
            coff = 2 if ratio == 4 else 1
            cm = f"{p}.{n.compressor}"
            self.add(f"{cm}.ape", (ratio, coff * hd), "F32")
            self.add(f"{cm}.fused_wkv_wgate.weight", (2 * coff * hd, D), "BF16")
            self.add(f"{cm}.norm.weight", (hd,), "BF16")
        if ratio == 4:
            ix, ih, ihd = f"{a}.indexer", c.index_n_heads, c.index_head_dim
            self.linear(f"{ix}.wq_b", ih * ihd, ql)
            self.add(f"{ix}.weights_proj.weight", (ih, D), "BF16")
            self.add(f"{ix}.compressor.ape", (4, 2 * ihd), "F32")
            self.add(f"{ix}.compressor.fused_wkv_wgate.weight", (4 * ihd, D), "BF16")
            self.add(f"{ix}.compressor.norm.weight", (ihd,), "BF16")
        E, I = c.n_routed_experts, c.moe_intermediate_size
        g = f"{p}.{n.gate}"
        self.add(f"{g}.weight", (E, D), "BF16")
        if hash_layer:
            self.add(f"{g}.tid2eid", (c.vocab_size, c.num_experts_per_tok), n.tid2eid)
        if not hash_layer or c.is_vision:  # nvidia/model.py: "Vision checkpoints ship a gate bias on hash layers too"
            self.add(f"{g}.e_score_correction_bias", (E,), "F32")
        if c.is_vision:  # DeepseekV4MoE.gate.bias_vl, float32, every block (the draft's too)
            self.add(f"{g}.bias_vl", (E,), "F32")
        if c.n_shared_experts and n.shared_pad:
            # DeepseekV4MLP: n_local = cdiv(I // block, tp) blocks a rank, intermediate_size = n_local * block * tp;
            # gate_up_proj = MergedColumnParallelLinear([I_pad] * 2), down_proj = RowParallelLinear(I_pad, D)
            sh = f"{p}.{n.shared}"
            n_local = cdiv(I * c.n_shared_experts // FP8_BLOCK, T)
            self.add(f"{sh}.gate_up_proj.weight", (2 * n_local * FP8_BLOCK, D), "F8_E4M3")
            self.add(f"{sh}.gate_up_proj.weight_scale_inv", (2 * n_local, cdiv(D, FP8_BLOCK)), self.scale_dtype)
            self.add(f"{sh}.down_proj.weight", (D, n_local * FP8_BLOCK), "F8_E4M3")
            self.add(f"{sh}.down_proj.weight_scale_inv", (cdiv(D, FP8_BLOCK), n_local), self.scale_dtype)
        elif c.n_shared_experts:
            sh, Ish = f"{p}.{n.shared}", I * c.n_shared_experts
            # gate_up_proj: MergedColumnParallelLinear of w1 and w3, each split over tp
            self.add(f"{sh}.gate_up_proj.weight", (2 * Ish // T, D), "F8_E4M3")
            self.add(
                f"{sh}.gate_up_proj.weight_scale_inv",
                (2 * cdiv(Ish, FP8_BLOCK) // T, cdiv(D, FP8_BLOCK)),
                self.scale_dtype,
            )
            self.linear(f"{sh}.down_proj", D, Ish, "row")
        self.routed(f"{p}.{n.routed}", src, E)


def engine_params(
    cfg: V4Config,
    profile: str,
    component: str,
    tp: int,
    moe_parallel: str = "tp",
    rank: int = 0,
    vllm_series: str | None = None,
    nvfp4_input_scales: str | None = None,
) -> dict[str, EngineParam]:
    """Every parameter rank ``rank`` of ``component`` (model | mtp | dspark) holds under ``profile`` (the same set
    on every rank; the same shapes too but for V4.1's Engram tables, split unevenly by hash head); for a draft whose
    parameters differ between the series the profile covers, those of ``vllm_series`` (None: the newest); NVFP4
    experts' input scales under ep as ``nvfp4_input_scales`` says (None: "global", the plan's default)."""
    ep = moe_parallel == "ep"
    t = _Table(cfg, get_profile(profile).engine, tp, ep, global_input_scales=not ep or nvfp4_input_scales != "local")
    if cfg.is_v41:
        if component == "model":
            return _v41_target(t, cfg, rank)
        return _v41_dspark(t, cfg, draft_kind_of(cfg).holds_context_wkv(vllm_series))
    D, V, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    t.add("model.embed_tokens.weight", (V // tp, D), "BF16")
    if component == "model":
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}"
            t.block(p, f"layers.{layer}", ratio=cfg.compress_ratio(layer), hash_layer=layer < cfg.num_hash_layers)
        t.add("model.norm.weight", (D,), "BF16")
        t.add("lm_head.weight", (V // tp, D), "BF16")
        head = "model"
        t.add(f"{head}.hc_head_fn", (hc, hc * D), "F32")
        t.add(f"{head}.hc_head_base", (hc,), "F32")
        t.add(f"{head}.hc_head_scale", (1,), "F32")
        if not cfg.is_vision:
            return t.params
        # DeepseekV4ForConditionalGeneration (common/vl_model.py): the text model under language_model., the tower
        prefix = model_class_of(cfg).target_prefix
        params = {prefix + n: EngineParam(prefix + n, p.shape, p.dtype, p.prefix) for n, p in t.params.items()}
        params.update(vision_params(cfg, tp))
        return params
    if component == "dspark":
        _dspark(t, cfg)
        return t.params
    for i, S in enumerate(cfg.mtp_layer_ids):  # MTP blocks never compress and are never hash-routed
        p = f"model.layers.{S}"
        t.add(f"{p}.enorm.weight", (D,), "BF16")
        t.add(f"{p}.hnorm.weight", (D,), "BF16")
        t.linear(f"{p}.e_proj", D, D)
        t.linear(f"{p}.h_proj", D, D)
        t.add(f"{p}.hc_head_fn", (hc, hc * D), "F32")
        t.add(f"{p}.hc_head_base", (hc,), "F32")
        t.add(f"{p}.hc_head_scale", (1,), "F32")
        t.add(f"{p}.shared_head.norm.weight", (D,), "BF16")
        t.add(f"{p}.shared_head.head.weight", (V // tp, D), "BF16")
        t.block(f"{p}.mtp_block", f"mtp.{i}", ratio=0, hash_layer=False)
    return t.params


def _dspark(t: _Table, cfg: V4Config) -> None:
    """DSparkDeepseekV4ForCausalLM (vllm/models/deepseek_v4/nvidia/dspark.py, 0.33.0 and 0.34.0) beside the
    embedding: the target's lm_head (vocab-parallel), main_proj (ReplicatedLinear, block FP8 with the target's quant
    config), the norms, context_wkv_proj (MergedColumnParallelLinear([head_dim] * stages, disable_tp=True)), hc_head,
    the Markov head (nn.Embedding and ParallelLMHead(disable_tp=True), model dtype) and the float32 confidence head;
    every stage a decoder block at ModuleList index i (compress ratio 1, not hash-routed)."""
    D, V, hc, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult, cfg.draft_layers
    r, K = cfg.dspark_markov_rank, len(cfg.dspark_target_layer_ids)
    t.add("lm_head.weight", (V // t.tp, D), "BF16")
    t.linear("model.main_proj", D, K * D)
    t.add("model.main_norm.weight", (D,), "BF16")
    t.add("model.context_wkv_proj.weight", (n * cfg.head_dim, D), "F8_E4M3")
    t.add(
        "model.context_wkv_proj.weight_scale_inv",
        (n * cdiv(cfg.head_dim, FP8_BLOCK), cdiv(D, FP8_BLOCK)),
        t.scale_dtype,
    )
    t.add("model.norm.weight", (D,), "BF16")
    t.add("model.hc_head_fn", (hc, hc * D), "F32")
    t.add("model.hc_head_base", (hc,), "F32")
    t.add("model.hc_head_scale", (1,), "F32")
    t.add("model.markov_head.markov_w1.weight", (V, r), "BF16")
    t.add("model.markov_head.markov_w2.weight", (cfg.draft_vocab_size or V, r), "BF16")
    if cfg.enable_confidence_head:
        t.add("model.confidence_head.proj.weight", (1, D + r), "F32")
    for i in range(n):
        t.block(f"model.layers.{i}", f"mtp.{i}", ratio=0, hash_layer=False)


def _v41_target(t: _Table, cfg: V4Config, rank: int) -> dict[str, EngineParam]:
    """DeepseekV41ForCausalLM (vllm/models/deepseek_v41/nvidia/vl_model.py and model.py, 0.33.0 and 0.34.0, as their
    classes hold it built on CPU: tests/engine/test_engine_v41.py): the text model under language_model., MXFP8
    linears (``weight_scale`` uint8, one row a weight row), compressors and indexers only on their source layers,
    every router's bias_vl, the Engram of its layers, no hc_head; the vision tower and aligner as V4's, image_start /
    image_end / image_newline (no image_pad)."""
    D, V, T, hc = cfg.hidden_size, cfg.vocab_size, t.tp, cfg.hc_mult
    layout = engram_split(cfg)
    t.add("model.embed_tokens.weight", (V // T, D), "BF16")
    t.add("lm_head.weight", (V // T, D), "BF16")
    t.add("model.norm.weight", (D,), "BF16")
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}"
        _v41_block(t, p, f"layers.{layer}", kv=layer in cfg.kv_source_layer_ids,
                   index=layer in cfg.index_source_layer_ids, ratio=cfg.compress_ratio(layer),
                   experts=cfg.n_routed_experts)  # fmt: skip
        if layout is not None and layer in layout.layer_ids:
            e, ed = f"{p}.engram", cfg.engram_head_dim
            lo, hi = layout.rank_rows(layer, T)[rank]
            t.add(f"{e}.embed_tokens.weight", (hi - lo, ed), "F8_E4M3")
            t.add(f"{e}.embed_tokens.weight_scale_inv", (hi - lo, ed // MX_BLOCK), "U8")
            _v41_linear(t, f"{e}.wkv", D * (hc + 1), layout.hash_heads * ed, "col")
            t.add(f"{e}.q_weight", (hc, D), "BF16")
            t.add(f"{e}.k_weight", (hc, D), "BF16")
    params = {f"language_model.{k}": replace(p, name=f"language_model.{k}") for k, p in t.params.items()}
    params.update(vision_params(cfg, T))
    params.pop("image_pad")
    return params


def _v41_dspark(t: _Table, cfg: V4Config, context_wkv: bool) -> dict[str, EngineParam]:
    """V4.1's DSpark draft (vllm/models/deepseek_v41/nvidia/dspark.py ``DSparkDeepseekV4ForCausalLM``, 0.33.0 and
    0.34.0, as their classes hold it built on CPU: tests/engine/test_engine_v41.py): the embedding and the
    vocab-parallel head, MXFP8 main_proj, the norms, the Markov head (model dtype), the float32 confidence head, no
    hc_head; ``context_wkv``: 0.34's context_wkv_proj (MXFP8, [head_dim] a stage, not split); every stage a V4.1 block
    at ModuleList index i with dspark_n_routed_experts experts, never a kv or index source."""
    D, V, T, n = cfg.hidden_size, cfg.vocab_size, t.tp, cfg.draft_layers
    r, K = cfg.dspark_markov_rank, len(cfg.dspark_target_layer_ids)
    t.add("model.embed_tokens.weight", (V // T, D), "BF16")
    t.add("lm_head.weight", (V // T, D), "BF16")
    _v41_linear(t, "model.main_proj", D, K * D)
    t.add("model.main_norm.weight", (D,), "BF16")
    if context_wkv:
        _v41_linear(t, "model.context_wkv_proj", n * cfg.head_dim, D)
    t.add("model.norm.weight", (D,), "BF16")
    t.add("model.markov_head.markov_w1.weight", (V, r), "BF16")
    t.add("model.markov_head.markov_w2.weight", (cfg.draft_vocab_size or V, r), "BF16")
    if cfg.enable_confidence_head:
        t.add("model.confidence_head.proj.weight", (1, D + r), "F32")
    for i in range(n):
        _v41_block(t, f"model.layers.{i}", f"mtp.{i}", kv=False, index=False, ratio=0,
                   experts=cfg.dspark_n_routed_experts)  # fmt: skip
    return t.params


def _v41_linear(t: _Table, name: str, out: int, inp: int, split: str | None = None) -> None:
    """An MXFP8 linear: FP8 weight, uint8 scale with one row a weight row (32-wide blocks along the input)."""
    T = t.tp
    out, inp = (out // T, inp) if split == "col" else (out, inp // T) if split == "row" else (out, inp)
    t.add(f"{name}.weight", (out, inp), "F8_E4M3")
    t.add(f"{name}.weight_scale", (out, inp // MX_BLOCK), "U8")


def _v41_block(t: _Table, p: str, src: str, *, kv: bool, index: bool, ratio: int, experts: int) -> None:
    """One V4.1 decoder block at ``p``: its hyper-connections, attention (a compressor on a kv source, an indexer on
    an index source) and MoE of ``experts`` routed experts."""
    cfg, T, mx = t.cfg, t.tp, MX_BLOCK
    D, H, hd, ql, hc = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.hc_mult
    t.add(f"{p}.attn_norm.weight", (D,), "BF16")
    t.add(f"{p}.ffn_norm.weight", (D,), "BF16")
    for part in ("attn", "ffn"):
        t.add(f"{p}.hc_{part}_fn", ((2 + hc) * hc, hc * D), "F32")
        t.add(f"{p}.hc_{part}_base", ((2 + hc) * hc,), "F32")
        t.add(f"{p}.hc_{part}_scale", (3,), "F32")
    a = f"{p}.attn"
    t.add(f"{a}.attn_sink", (H // T,), "F32", prefix=True)
    t.add(f"{a}.fused_wqa_wkv.weight", (ql + hd, D), "F8_E4M3")
    t.add(f"{a}.fused_wqa_wkv.weight_scale", (ql + hd, D // mx), "U8")
    t.add(f"{a}.q_norm.weight", (ql,), "BF16")
    t.add(f"{a}.kv_norm.weight", (hd,), "BF16")
    _v41_linear(t, f"{a}.wq_b", H * hd, ql, "col")
    _v41_linear(t, f"{a}.wo_a", cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups, "col")
    _v41_linear(t, f"{a}.wo_b", D, cfg.o_groups * cfg.o_lora_rank, "row")
    if kv:  # DeepseekV4CompressorKVScoreLinear: wkv, and wgate at ratio 2
        gate = 2 if ratio > 1 else 1
        t.add(f"{a}.compressor.fused_wkv_wgate.weight", (gate * hd, D), "BF16")
        t.add(f"{a}.compressor.norm.weight", (hd,), "BF16")
    if index:
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        _v41_linear(t, f"{a}.indexer.wq_b", ih * ihd, ql)
        t.add(f"{a}.indexer.weights_proj.weight", (ih, D), "BF16")
        if kv:
            t.add(f"{a}.indexer.wk.weight", (ihd, hd), "BF16")
            t.add(f"{a}.indexer.k_norm.weight", (ihd,), "BF16")
    _v41_moe(t, cfg, p, src, t.n, experts)


def _v41_moe(t: _Table, cfg: V4Config, p: str, src: str, n: EngineNames, experts: int) -> None:
    """A V4.1 MoE: the router with bias_vl, MXFP8 shared experts, MXFP4 (or an NVFP4 export's) routed experts
    (``experts`` of them)."""
    D, I, T = cfg.hidden_size, cfg.moe_intermediate_size, t.tp
    g = f"{p}.{n.gate}"
    t.add(f"{g}.weight", (experts, D), "BF16")
    t.add(f"{g}.e_score_correction_bias", (experts,), "F32")
    t.add(f"{g}.bias_vl", (experts,), "F32")
    sh, Ish = f"{p}.{n.shared}", I * cfg.n_shared_experts
    t.add(f"{sh}.gate_up_proj.weight", (2 * Ish // T, D), "F8_E4M3")
    t.add(f"{sh}.gate_up_proj.weight_scale", (2 * Ish // T, D // MX_BLOCK), "U8")
    _v41_linear(t, f"{sh}.down_proj", D, Ish, "row")
    t.routed(f"{p}.{n.routed}", src, experts)


def vision_params(cfg: V4Config, tp: int) -> dict[str, EngineParam]:
    """One rank's vision tower, aligner and image_* parameters (vllm/models/deepseek_v4/common/vision.py, 0.33.0 and
    0.34.0): BF16 (the tower is cast to the model dtype), image_* float32; the tower's parallel layers split over tp,
    or hold everything whole when vision_n_heads does not divide tp (vllm/model_executor/models/vision.py
    is_vit_use_data_parallel: the tower and the aligner are built with disable_tp)."""
    T = tp if cfg.vision_n_heads % tp == 0 else 1
    D, I, H = cfg.vision_dim, cfg.vision_inter_dim, cfg.hidden_size
    P, r = cfg.vision_patch_size, cfg.vision_downsample_ratio
    out: dict[str, EngineParam] = {}

    def add(name: str, shape: tuple[int, ...], dtype: str = "BF16") -> None:
        out[name] = EngineParam(name, shape, dtype)

    add("vision.patch_embed.proj.weight", (D, 3 * P * P))
    add("vision.patch_embed.proj.bias", (D,))
    for b in range(cfg.vision_n_layers):
        p = f"vision.blocks.{b}"
        add(f"{p}.norm1.weight", (D,))
        add(f"{p}.norm2.weight", (D,))
        add(f"{p}.attn.wqkv.weight", (3 * D // T, D))  # QKVParallelLinear: heads/T of each of q, k, v
        add(f"{p}.attn.wqkv.bias", (3 * D // T,))
        add(f"{p}.attn.wo.weight", (D, D // T))  # RowParallelLinear
        add(f"{p}.attn.wo.bias", (D,))
        add(f"{p}.mlp.w1.weight", (2 * I // T, D))  # MergedColumnParallelLinear [I, I]
        add(f"{p}.mlp.w2.weight", (D, I // T))
    add("vision.norm.weight", (D,))
    add("aligner.w1.weight", (H // T, D * r * r))  # ColumnParallelLinear
    add("aligner.w1.bias", (H // T,))
    add("aligner.w2.weight", (H, H // T))  # RowParallelLinear
    add("aligner.w2.bias", (H,))
    for name in ("image_start", "image_end", "image_newline", "image_pad"):
        add(name, (H,), "F32")
    return out


def compare_with_engine(
    written: dict[str, tuple[tuple[int, ...], str]], expected: dict[str, EngineParam]
) -> list[tuple[str, str]]:
    """(problem, tensor) for every key the engine lacks or misses, and every shape/dtype it would not take."""
    problems: list[tuple[str, str]] = []
    for name in sorted(set(written) - set(expected)):
        problems.append((f"tensor {name!r} is not a parameter of the engine (its loader raises KeyError)", name))
    for name in sorted(set(expected) - set(written)):
        problems.append(
            (f"engine parameter {name!r} is missing from the files (its loader raises 'Missing keys')", name)
        )
    for name in sorted(set(written) & set(expected)):
        shape, dtype = written[name]
        want = expected[name]
        if tuple(shape) != want.shape:
            problems.append(
                (f"tensor {name!r}: shape {list(shape)}, the engine's parameter takes {list(want.shape)}", name)
            )
        elif want.dtype is not None and dtype != want.dtype:
            problems.append(
                (
                    f"tensor {name!r}: dtype {dtype}, the engine's parameter is {want.dtype} (the loader would cast)",
                    name,
                )
            )
    return problems
