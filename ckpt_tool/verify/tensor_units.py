"""The unit table of the per-tensor numeric check: every engine tensor of one component, as units naming its source
parts (a linear's fused parts, one routed expert's slot of a stacked tensor, a tensor compared by value), by the
engine's names (:mod:`ckpt_tool.mapping.engine_table`) against DeepSeek's source names written out here; the rule
table is never consulted, so a rule that maps the wrong bytes makes the two sides disagree."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ckpt_tool.checkpoint.blocks import FP8_BLOCK, cdiv
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.engram import EngramSplit, engram_split
from ckpt_tool.checkpoint.expert_format import layer_format
from ckpt_tool.errors import UsageError
from ckpt_tool.mapping.engine_table import ENGINES, EngineNames
from ckpt_tool.mapping.profiles import draft_kind_of, model_class_of


@dataclass(frozen=True)
class Part:
    """One source linear inside an engine linear: ``source`` is a DeepSeek base name (quantized:
    ``.weight`` + ``.scale``) or a full tensor name (bf16); ``rows`` its output features."""

    source: str
    rows: int
    row0: int = 0  # the part's first row in the source tensor (a section of a tensor fused on disk: q|k|v)
    section: str = ""  # that section's name, which tells its coverage unit apart

    @property
    def key(self) -> str:
        """What coverage counts this part as: the source, or one section of it."""
        return f"{self.source} ({self.section})" if self.section else self.source


@dataclass(frozen=True)
class LinearUnit:
    """An engine linear (or one routed expert's slot of a stacked one) and the source parts it holds.

    ``layout``: ``full`` — every rank in ``ranks`` holds all parts stacked by rows (replicated, or an
    expert-parallel expert on its owner); ``col`` — each part's rows split over the ranks, a rank
    holding its slice of every part in order (column parallel); ``row`` — the input features split
    over the ranks, partial outputs summed (row parallel).
    """

    group: str
    weight: str
    scale: str | None
    kind: str  # fp8 | mxfp8 | mxfp4 | nvfp4 | bf16 (mxfp8: V4.1, 32x32 scale blocks in the source, 1x32 in OUT)
    parts: tuple[Part, ...]
    inp: int
    layout: str
    ranks: tuple[int, ...]
    expert: int | None = None  # global routed expert (the engine tensor is stacked)
    local: tuple[int, ...] = ()  # per entry of ranks: the expert's slot in that rank's stack
    # col/row: each part's rows (col) or the inputs (row) a rank holds when the engine zero-pads the split to
    # whole blocks (real ones first, a rank past the end all zeros); None: an even split
    per_rank: int | None = None
    # nvfp4: the engine's per-expert float32 global scales, ``w13_weight_scale_2 [E_local, 2]`` (one per part: w1,
    # w3) or ``w2_weight_scale_2 [E_local]`` (vLLM 0.34.0 modelopt.py ModelOptNvFp4FusedMoE.create_weights); each
    # source part has its own ``.weight_scale_2``
    global_scale: str | None = None

    def share(self, size: int) -> int:
        """What one rank holds of a split dim of ``size``."""
        return self.per_rank if self.per_rank is not None else size // len(self.ranks)

    @property
    def label(self) -> str:
        return self.weight if self.expert is None else f"{self.weight}[expert {self.expert}]"


@dataclass(frozen=True)
class ExactUnit:
    """A non-linear tensor compared by value: whole on every rank, split evenly by rows (``col``), each rank its own
    row range (``rows``), or one element of each rank's tensor equal to a source scalar (``element``: an NVFP4
    expert's ``input_scale`` in the stacked ``w13_input_scale`` / ``w2_input_scale``)."""

    group: str
    name: str
    source: str
    layout: str
    ranks: tuple[int, ...]
    sections: int = 1  # col: the source is this many equal sections, each split over the ranks (a q|k|v bias)
    # layout "rows": per entry of ranks, the [start, end) source rows the rank holds (an Engram table's hash heads),
    # compared byte for byte a tile of rows at a time
    rows: tuple[tuple[int, int], ...] = ()
    # layout "element": per entry of ranks, the index of the element of the rank's tensor that holds the source scalar
    element: tuple[tuple[int, ...], ...] = ()


Unit = LinearUnit | ExactUnit


class _Builder:
    """The unit table of one component: engine names (engine.py) against DeepSeek source names."""

    def __init__(
        self,
        cfg: V4Config,
        names: EngineNames,
        tp: int,
        ep: bool,
        source_names: set[str],
        global_input_scales: bool = False,
    ) -> None:
        self.cfg, self.n, self.tp, self.ep = cfg, names, tp, ep
        self.global_input_scales = global_input_scales
        self.source_names = source_names
        self.units: list[Unit] = []
        self.group = ""
        self.all_ranks = tuple(range(tp))

    def exact(self, name: str, source: str, layout: str = "full", sections: int = 1) -> None:
        self.units.append(ExactUnit(self.group, name, source, layout, self.all_ranks, sections))

    def fp8(self, base: str, parts: list[tuple[str, int]], inp: int, layout: str, per_rank: int | None = None) -> None:
        self.units.append(
            LinearUnit(
                self.group,
                f"{base}.weight",
                f"{base}.weight_scale_inv",
                "fp8",
                tuple(Part(s, r) for s, r in parts),
                inp,
                layout,
                self.all_ranks,
                per_rank=per_rank,
            )
        )

    def mxfp8(self, base: str, parts: list[tuple[str, int]], inp: int, layout: str) -> None:
        """A V4.1 MXFP8 linear: the source's ``.weight`` + ``.scale`` (32x32 blocks) against the engine's ``.weight``
        + ``.weight_scale`` (one scale row a weight row)."""
        ps = tuple(Part(s, r) for s, r in parts)
        self.units.append(
            LinearUnit(self.group, f"{base}.weight", f"{base}.weight_scale", "mxfp8", ps, inp, layout, self.all_ranks)
        )

    def bf16(self, name: str, parts: list[tuple[str, int]] | list[Part], inp: int, layout: str = "full") -> None:
        ps = tuple(p if isinstance(p, Part) else Part(*p) for p in parts)
        self.units.append(LinearUnit(self.group, name, None, "bf16", ps, inp, layout, self.all_ranks))

    def rows(self, name: str, source: str, ranges: list[tuple[int, int]]) -> None:
        """A tensor each rank holds its own row range of (``ranges``, one per rank), compared byte for byte: a unit
        per rank, so that the ranks of a ~100 GB table are read by several workers at once."""
        for r, rows in zip(self.all_ranks, ranges, strict=True):
            self.units.append(ExactUnit(self.group, name, source, "rows", (r,), rows=(rows,)))

    def vision(self, image_pad: bool = True) -> None:
        """The vision tower, aligner and image_* (vllm/models/deepseek_v4/common/vision.py): BF16 linears compared
        by value, split as the engine splits them (q|k|v and gate|up per section), or whole on every rank when
        vision_n_heads does not divide tp."""
        c = self.cfg
        D, I, H, P, r = c.vision_dim, c.vision_inter_dim, c.hidden_size, c.vision_patch_size, c.vision_downsample_ratio
        split = c.vision_n_heads % self.tp == 0
        col, row = ("col", "row") if split else ("full", "full")
        self.group = "vision"
        self.bf16("vision.patch_embed.proj.weight", [("vision.patch_embed.proj.weight", D)], 3 * P * P)
        self.exact("vision.patch_embed.proj.bias", "vision.patch_embed.proj.bias")
        for b in range(c.vision_n_layers):
            p = f"vision.blocks.{b}"
            self.group = p
            self.exact(f"{p}.norm1.weight", f"{p}.norm1.weight")
            self.exact(f"{p}.norm2.weight", f"{p}.norm2.weight")
            qkv = f"{p}.attn.wqkv.weight"
            self.bf16(qkv, [Part(qkv, D, k * D, sec) for k, sec in enumerate("qkv")], D, col)
            self.exact(f"{p}.attn.wqkv.bias", f"{p}.attn.wqkv.bias", col, sections=3 if split else 1)
            self.bf16(f"{p}.attn.wo.weight", [(f"{p}.attn.wo.weight", D)], D, row)
            self.exact(f"{p}.attn.wo.bias", f"{p}.attn.wo.bias")
            w1 = f"{p}.mlp.w1.weight"
            self.bf16(w1, [Part(w1, I, 0, "gate"), Part(w1, I, I, "up")], D, col)
            self.bf16(f"{p}.mlp.w2.weight", [(f"{p}.mlp.w2.weight", D)], I, row)
        self.group = "vision"
        self.exact("vision.norm.weight", "vision.norm.weight")
        self.bf16("aligner.w1.weight", [("aligner.w1.weight", H)], D * r * r, col)
        self.exact("aligner.w1.bias", "aligner.w1.bias", col)
        self.bf16("aligner.w2.weight", [("aligner.w2.weight", H)], H, row)
        self.exact("aligner.w2.bias", "aligner.w2.bias")
        for name in ("image_start", "image_end", "image_newline", "image_pad")[: 4 if image_pad else 3]:
            self.exact(name, name)

    def attention(self, p: str, sp: str, linear: Callable[..., None]) -> tuple[str, str]:
        """A block's norms, hyper-connections and the attention every V4 and V4.1 block has, its quantized linears
        added by ``linear`` (:meth:`fp8` or :meth:`mxfp8`); returns the engine's and the source's attention prefix."""
        c = self.cfg
        D, H, Dh, Qr = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank
        G, Or = c.o_groups, c.o_lora_rank
        self.exact(f"{p}.attn_norm.weight", f"{sp}.attn_norm.weight")
        self.exact(f"{p}.ffn_norm.weight", f"{sp}.ffn_norm.weight")
        for part in ("attn", "ffn"):
            for t in ("fn", "base", "scale"):
                self.exact(f"{p}.hc_{part}_{t}", f"{sp}.hc_{part}_{t}")
        a, sa = f"{p}.attn", f"{sp}.attn"
        self.exact(f"{a}.attn_sink", f"{sa}.attn_sink", "col")
        linear(f"{a}.fused_wqa_wkv", [(f"{sa}.wq_a", Qr), (f"{sa}.wkv", Dh)], D, "full")
        self.exact(f"{a}.q_norm.weight", f"{sa}.q_norm.weight")
        self.exact(f"{a}.kv_norm.weight", f"{sa}.kv_norm.weight")
        linear(f"{a}.wq_b", [(f"{sa}.wq_b", H * Dh)], Qr, "col")
        linear(f"{a}.wo_a", [(f"{sa}.wo_a", G * Or)], H * Dh // G, "col")
        linear(f"{a}.wo_b", [(f"{sa}.wo_b", D)], G * Or, "row")
        return a, sa

    def block(self, p: str, sp: str, *, ratio: int, hash_layer: bool) -> None:
        c, n = self.cfg, self.n
        D, Dh, Qr = c.hidden_size, c.head_dim, c.q_lora_rank
        a, sa = self.attention(p, sp, self.fp8)
        if ratio:
            coff = 2 if ratio == 4 else 1
            cm, sc = f"{p}.{n.compressor}", f"{sa}.compressor"
            self.exact(f"{cm}.ape", f"{sc}.ape")
            self.bf16(
                f"{cm}.fused_wkv_wgate.weight", [(f"{sc}.wkv.weight", coff * Dh), (f"{sc}.wgate.weight", coff * Dh)], D
            )
            self.exact(f"{cm}.norm.weight", f"{sc}.norm.weight")
        if ratio == 4:
            ix, si, ihd = f"{a}.indexer", f"{sa}.indexer", c.index_head_dim
            self.fp8(f"{ix}.wq_b", [(f"{si}.wq_b", c.index_n_heads * ihd)], Qr, "full")
            self.bf16(f"{ix}.weights_proj.weight", [(f"{si}.weights_proj.weight", c.index_n_heads)], D)
            self.exact(f"{ix}.compressor.ape", f"{si}.compressor.ape")
            self.bf16(
                f"{ix}.compressor.fused_wkv_wgate.weight",
                [(f"{si}.compressor.wkv.weight", 2 * ihd), (f"{si}.compressor.wgate.weight", 2 * ihd)],
                D,
            )
            self.exact(f"{ix}.compressor.norm.weight", f"{si}.compressor.norm.weight")
        E, I = c.n_routed_experts, c.moe_intermediate_size
        g, sf = f"{p}.{n.gate}", f"{sp}.ffn"
        self.bf16(f"{g}.weight", [(f"{sf}.gate.weight", E)], D)
        if hash_layer:
            self.exact(f"{g}.tid2eid", f"{sf}.gate.tid2eid")
        if not hash_layer or c.is_vision:  # the vision model's hash layers have a gate bias too
            self.exact(f"{g}.e_score_correction_bias", f"{sf}.gate.bias")
        if c.is_vision:
            self.exact(f"{g}.bias_vl", f"{sf}.gate.bias_vl")
        if c.n_shared_experts:
            sh, ss, Ish = f"{p}.{n.shared}", f"{sf}.shared_experts", I * c.n_shared_experts
            per_rank = None
            if n.shared_pad and (Ish // FP8_BLOCK) % self.tp:  # the engine's whole blocks a rank (engine.py)
                per_rank = cdiv(Ish // FP8_BLOCK, self.tp) * FP8_BLOCK
            self.fp8(f"{sh}.gate_up_proj", [(f"{ss}.w1", Ish), (f"{ss}.w3", Ish)], D, "col", per_rank)
            self.fp8(f"{sh}.down_proj", [(f"{ss}.w2", D)], Ish, "row", per_rank)
        self.routed(p, sp, E)

    def routed(self, p: str, sp: str, E: int) -> None:
        """The ``E`` routed experts of block ``p`` (source ``sp``) in the format vLLM builds them in
        (:func:`~ckpt_tool.checkpoint.expert_format.layer_format`), one unit per expert and stacked tensor: split
        over the ranks (tp), or each expert whole on its owner (ep); NVFP4's global scales ride on their linear's
        units, its activation scales are compared by value (:meth:`input_scales`)."""
        D, I, n = self.cfg.hidden_size, self.cfg.moe_intermediate_size, self.n
        kind = layer_format(self.cfg, sp).name
        r, sf = f"{p}.{n.routed}", f"{sp}.ffn"
        sfx = "weight_scale_inv" if kind == "fp8" else "weight_scale"
        g13, g2 = (f"{r}.w13_weight_scale_2", f"{r}.w2_weight_scale_2") if kind == "nvfp4" else (None, None)
        per = E // self.tp
        for j in range(E):
            if self.ep:
                ranks, local, lay13, lay2 = (j // per,), (j % per,), "full", "full"
            else:
                ranks, local, lay13, lay2 = self.all_ranks, (j,) * self.tp, "col", "row"
            se = f"{sf}.experts.{j}"
            self.units.append(
                LinearUnit(
                    self.group,
                    f"{r}.w13_weight",
                    f"{r}.w13_{sfx}",
                    kind,
                    (Part(f"{se}.w1", I), Part(f"{se}.w3", I)),
                    D,
                    lay13,
                    ranks,
                    j,
                    local,
                    global_scale=g13,
                )
            )
            self.units.append(
                LinearUnit(
                    self.group,
                    f"{r}.w2_weight",
                    f"{r}.w2_{sfx}",
                    kind,
                    (Part(f"{se}.w2", D),),
                    I,
                    lay2,
                    ranks,
                    j,
                    local,
                    global_scale=g2,
                )
            )
            if kind == "nvfp4":
                self.input_scales(r, se, j, ranks, local)

    def input_scales(self, r: str, se: str, j: int, ranks: tuple[int, ...], local: tuple[int, ...]) -> None:
        """Routed expert ``j``'s activation scales (source ``{se}.w{1,3,2}.input_scale``, F32 scalars) in the ranks'
        ``w13_input_scale [E_x, 2]`` (w1's, w3's) and ``w2_input_scale [E_x]`` (vLLM 0.34.0 modelopt.py
        ``ModelOptNvFp4FusedMoE.create_weights``): under tp every rank holds every expert's, under ep the owner its
        own at the expert's slot, unless the OUT was written for an NVFP4 MoE backend that keeps every expert's
        (``global_input_scales``, FlashInfer's: fused_moe/oracle/nvfp4.py ``is_global_sf_supported_for_nvfp4_backend``):
        then every rank holds all of them at the global expert id."""
        if self.ep and self.global_input_scales:
            ranks, rows = self.all_ranks, (j,) * self.tp
        else:
            rows = local
        for name, which, col in (
            ("w13_input_scale", "w1", (0,)),
            ("w13_input_scale", "w3", (1,)),
            ("w2_input_scale", "w2", ()),
        ):
            element = tuple((row, *col) for row in rows)
            self.units.append(
                ExactUnit(self.group, f"{r}.{name}", f"{se}.{which}.input_scale", "element", ranks, element=element)
            )

    def v41_block(self, p: str, sp: str, *, kv: bool, index: bool, ratio: int, experts: int) -> None:
        """One DeepSeek V4.1 decoder block (vllm/models/deepseek_v41/nvidia/model.py, attention.py): MXFP8 attention
        and shared experts, a bf16 compressor (wkv, and wgate at ratio 2) only on a kv source, an indexer (MXFP8 wq_b,
        bf16 weights_proj; wk and k_norm on a kv source too) only on an index source, every router's bias_vl, MXFP4
        routed experts."""
        c = self.cfg
        D, Dh, Qr = c.hidden_size, c.head_dim, c.q_lora_rank
        a, sa = self.attention(p, sp, self.mxfp8)
        if kv:
            cm, sc = f"{a}.compressor", f"{sa}.compressor"
            parts = [(f"{sc}.wkv.weight", Dh)] + ([(f"{sc}.wgate.weight", Dh)] if ratio > 1 else [])
            self.bf16(f"{cm}.fused_wkv_wgate.weight", parts, D)
            self.exact(f"{cm}.norm.weight", f"{sc}.norm.weight")
        if index:
            ix, si, ihd = f"{a}.indexer", f"{sa}.indexer", c.index_head_dim
            self.mxfp8(f"{ix}.wq_b", [(f"{si}.wq_b", c.index_n_heads * ihd)], Qr, "full")
            self.bf16(f"{ix}.weights_proj.weight", [(f"{si}.weights_proj.weight", c.index_n_heads)], D)
            if kv:
                self.bf16(f"{ix}.wk.weight", [(f"{si}.wk.weight", ihd)], Dh)
                self.exact(f"{ix}.k_norm.weight", f"{si}.k_norm.weight")
        g, sf = f"{p}.{self.n.gate}", f"{sp}.ffn"
        self.bf16(f"{g}.weight", [(f"{sf}.gate.weight", experts)], D)
        self.exact(f"{g}.e_score_correction_bias", f"{sf}.gate.bias")
        self.exact(f"{g}.bias_vl", f"{sf}.gate.bias_vl")
        sh, ss, Ish = f"{p}.{self.n.shared}", f"{sf}.shared_experts", c.moe_intermediate_size * c.n_shared_experts
        self.mxfp8(f"{sh}.gate_up_proj", [(f"{ss}.w1", Ish), (f"{ss}.w3", Ish)], D, "col")
        self.mxfp8(f"{sh}.down_proj", [(f"{ss}.w2", D)], Ish, "row")
        self.routed(p, sp, experts)

    def engram(self, p: str, sp: str, layer: int, layout: EngramSplit) -> None:
        """The Engram of layer ``layer`` (vllm/models/deepseek_v41/common/engram.py): its FP8 table and per-row E8M0
        scale, each rank the rows of its hash heads (uneven), byte for byte; the MXFP8 ``wkv`` column-parallel; the
        bf16 ``q_weight`` / ``k_weight`` whole."""
        c = self.cfg
        e, se = f"{p}.engram", f"{sp}.engram"
        ranges = layout.rank_rows(layer, self.tp)
        self.rows(f"{e}.embed_tokens.weight", f"{se}.embed.weight", ranges)
        self.rows(f"{e}.embed_tokens.weight_scale_inv", f"{se}.embed.scale", ranges)
        inp = layout.hash_heads * c.engram_head_dim
        self.mxfp8(f"{e}.wkv", [(f"{se}.wkv", c.hidden_size * (c.hc_mult + 1))], inp, "col")
        self.exact(f"{e}.q_weight", f"{se}.q_weight")
        self.exact(f"{e}.k_weight", f"{se}.k_weight")


def tensor_units(
    cfg: V4Config,
    profile: str,
    component: str,
    tp: int,
    moe_parallel: str,
    source_names: set[str],
    vllm_series: str | None = None,
    nvfp4_global_input_scales: bool = False,
) -> list[Unit]:
    """Every engine tensor of one rank set of ``component`` as check units (see the module docstring);
    ``vllm_series``: the series a draft whose parameters differ by series was written for (the manifest's
    ``options.vllm_series``; None: the newest); ``nvfp4_global_input_scales``: under ep, the OUT holds every NVFP4
    expert's activation scales on every rank (written for a FlashInfer NVFP4 MoE backend: ``_Builder.input_scales``)."""
    if profile not in ENGINES:
        raise UsageError(
            f"profile {profile!r} has no engine table; add one to its profile module in ckpt_tool/mapping/profiles/"
        )
    b = _Builder(cfg, ENGINES[profile], tp, moe_parallel == "ep", source_names, nvfp4_global_input_scales)
    if cfg.is_v41:
        if component == "model":
            _v41_target_units(b, cfg)
        else:
            b.group = "embed/head"
            _dspark_units(b, cfg, source_names, draft_kind_of(cfg).holds_context_wkv(vllm_series))
        return b.units
    D, V = cfg.hidden_size, cfg.vocab_size
    b.group = "embed/head"
    if component == "model":
        b.bf16("model.embed_tokens.weight", [("embed.weight", V)], D, "col")
        b.bf16("lm_head.weight", [("head.weight", V)], D, "col")
        b.exact("model.norm.weight", "norm.weight")
        for t in ("fn", "base", "scale"):
            b.exact(f"model.hc_head_{t}", f"hc_head_{t}")
        for layer in range(cfg.num_hidden_layers):
            b.group = f"layers.{layer}"
            b.block(
                f"model.layers.{layer}",
                f"layers.{layer}",
                ratio=cfg.compress_ratio(layer),
                hash_layer=layer < cfg.num_hash_layers,
            )
        if cfg.is_vision:  # DeepseekV4ForConditionalGeneration: the text model under language_model., the tower
            prefix = model_class_of(cfg).target_prefix
            b.units = [_prefixed(u, prefix) for u in b.units]
            b.vision()
        return b.units
    if component == "dspark":
        _dspark_units(b, cfg, source_names)
        return b.units
    # the draft's one embedding: mtp.0's own if stored, else the target's (as the converter materializes it)
    emb = "mtp.0.emb.tok_emb.weight" if "mtp.0.emb.tok_emb.weight" in source_names else "embed.weight"
    b.bf16("model.embed_tokens.weight", [(emb, V)], D, "col")
    for i, S in enumerate(cfg.mtp_layer_ids):
        p, sp = f"model.layers.{S}", f"mtp.{i}"
        b.group = f"mtp.{i} (layer {S})"
        b.exact(f"{p}.enorm.weight", f"{sp}.enorm.weight")
        b.exact(f"{p}.hnorm.weight", f"{sp}.hnorm.weight")
        b.fp8(f"{p}.e_proj", [(f"{sp}.e_proj", D)], D, "full")
        b.fp8(f"{p}.h_proj", [(f"{sp}.h_proj", D)], D, "full")
        for t in ("fn", "base", "scale"):
            b.exact(f"{p}.hc_head_{t}", f"{sp}.hc_head_{t}")
        b.exact(f"{p}.shared_head.norm.weight", f"{sp}.norm.weight")
        head = f"{sp}.head.weight" if f"{sp}.head.weight" in source_names else "head.weight"
        b.bf16(f"{p}.shared_head.head.weight", [(head, V)], D, "col")
        b.block(f"{p}.mtp_block", sp, ratio=0, hash_layer=False)
    return b.units


def _dspark_units(b: _Builder, cfg: V4Config, source_names: set[str], context_wkv: bool = True) -> None:
    """The DSpark draft against DeepSeek's mtp.* names: V4's (vllm/models/deepseek_v4/nvidia/dspark.py) or V4.1's
    (vllm/models/deepseek_v41/nvidia/dspark.py). The target's embedding and head (the draft holds the target's),
    main_proj and (``context_wkv``: V4's in every series, V4.1's from vLLM 0.34) every stage's wkv again as
    context_wkv_proj through the fp8 (V4) or MXFP8 (V4.1) kernel, the Markov head as bf16 linears (``markov_w1`` /
    ``markov_w2`` in a V4 checkpoint, ``markov_head.embed`` / ``.head`` in V4.1's), the norms, hc_head (V4 only) and
    the confidence head by value, every stage's decoder block as a target layer's (V4.1: with
    ``dspark_n_routed_experts`` experts, never a kv or index source)."""
    D, V, n, r = cfg.hidden_size, cfg.vocab_size, cfg.draft_layers, cfg.dspark_markov_rank
    stage_of = _stage_finder(n, source_names)
    linear = b.mxfp8 if cfg.is_v41 else b.fp8
    b.bf16("model.embed_tokens.weight", [("embed.weight", V)], D, "col")
    b.bf16("lm_head.weight", [("head.weight", V)], D, "col")
    b.group = "dspark heads"
    first = stage_of("main_proj.weight", 0)
    linear("model.main_proj", [(f"{first}.main_proj", D)], D * len(cfg.dspark_target_layer_ids), "full")
    b.exact("model.main_norm.weight", f"{stage_of('main_norm.weight', 0)}.main_norm.weight")
    if context_wkv:
        linear("model.context_wkv_proj", [(f"mtp.{i}.attn.wkv", cfg.head_dim) for i in range(n)], D, "full")
    b.exact("model.norm.weight", f"{stage_of('norm.weight', n - 1)}.norm.weight")
    if not cfg.is_v41:  # V4.1 has no hc_head
        for t in ("fn", "base", "scale"):
            b.exact(f"model.hc_head_{t}", f"{stage_of(f'hc_head_{t}', n - 1)}.hc_head_{t}")
    markov = ("embed", "head") if cfg.is_v41 else ("markov_w1", "markov_w2")
    w1, w2 = (f"{stage_of(f'markov_head.{m}.weight', n - 1)}.markov_head.{m}.weight" for m in markov)
    b.bf16("model.markov_head.markov_w1.weight", [(w1, V)], r)
    b.bf16("model.markov_head.markov_w2.weight", [(w2, cfg.draft_vocab_size or V)], r)
    if cfg.enable_confidence_head:
        conf = stage_of("confidence_head.proj.weight", n - 1)
        b.exact("model.confidence_head.proj.weight", f"{conf}.confidence_head.proj.weight")
    for i in range(n):
        b.group = f"dspark stage mtp.{i}"
        p, sp = f"model.layers.{i}", f"mtp.{i}"
        if cfg.is_v41:
            b.v41_block(p, sp, kv=False, index=False, ratio=0, experts=cfg.dspark_n_routed_experts)
        else:
            b.block(p, sp, ratio=0, hash_layer=False)


def _v41_target_units(b: _Builder, cfg: V4Config) -> None:
    """DeepseekV41ForCausalLM (vllm/models/deepseek_v41/nvidia/vl_model.py): the text model under ``language_model.``
    (no hc_head), every layer's block and Engram, the vision tower as V4's without image_pad."""
    D, V = cfg.hidden_size, cfg.vocab_size
    layout = engram_split(cfg)
    b.group = "embed/head"
    b.bf16("model.embed_tokens.weight", [("embed.weight", V)], D, "col")
    b.bf16("lm_head.weight", [("head.weight", V)], D, "col")
    b.exact("model.norm.weight", "norm.weight")
    for layer in range(cfg.num_hidden_layers):
        b.group = f"layers.{layer}"
        p, sp = f"model.layers.{layer}", f"layers.{layer}"
        b.v41_block(
            p,
            sp,
            kv=layer in cfg.kv_source_layer_ids,
            index=layer in cfg.index_source_layer_ids,
            ratio=cfg.compress_ratio(layer),
            experts=cfg.n_routed_experts,
        )
        if layout is not None and layer in layout.layer_ids:
            b.engram(p, sp, layer, layout)
    b.units = [_prefixed(u, "language_model.") for u in b.units]  # vl_model.py's outer mapper
    b.vision(image_pad=False)


def _stage_finder(n: int, source_names: set[str]):
    """``stage_of(suffix, default)``: the DSpark stage holding a head-stack tensor (vLLM takes it from any stage),
    ``mtp.{default}`` (where DeepSeek ships it) when none does."""

    def stage_of(suffix: str, default: int) -> str:
        held = [i for i in range(n) if f"mtp.{i}.{suffix}" in source_names]
        return f"mtp.{held[0] if held else default}"

    return stage_of


def _prefixed(u: Unit, prefix: str) -> Unit:
    if isinstance(u, ExactUnit):
        return replace(u, name=prefix + u.name)
    return replace(
        u,
        weight=prefix + u.weight,
        scale=None if u.scale is None else prefix + u.scale,
        global_scale=None if u.global_scale is None else prefix + u.global_scale,
    )


def unit_tensors(u: Unit) -> list[str]:
    """Engine tensor names a unit checks."""
    if isinstance(u, ExactUnit):
        return [u.name]
    return [u.weight] + ([u.scale] if u.scale else []) + ([u.global_scale] if u.global_scale else [])


def unit_label(u: Unit) -> str:
    """The unit's engine tensor (``[expert j]`` for one routed expert of a stacked tensor)."""
    return u.name if isinstance(u, ExactUnit) else u.label


def unit_parts(u: Unit) -> list[str]:
    """The source tensors (quantized linears: base names) a unit holds, in order."""
    return [u.source] if isinstance(u, ExactUnit) else [p.key for p in u.parts]
