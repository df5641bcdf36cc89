"""Numeric verification: the reference forward of every MTP layer, from the source and from the output.

Side A (the spec): one rank over the ORIGINAL checkpoint in DeepSeek's names, every linear
dequantized exactly in plain torch (:mod:`ckpt_tool.quant`) and multiplied in float32.
Side B (what the engine holds): T ranks over the CONVERTED checkpoint in the engine's names, linears
run on the still-quantized weights through the fp8-block / MXFP4 GEMM kernels, ranks combined as a
TP engine does (:mod:`ckpt_tool.reference`). Both run on the same seeded tokens and hidden states.

Both sides round activations the same way before each linear (bf16 by default, as the kernels feed
their dot products), so they compute the same math up to float32 summation order (per rank, per
kernel tile). bf16 rounding is discontinuous, though: a 1e-7 difference can flip one element's
rounding (a 2^-8 relative step), so the noise floor is set by bf16, not float32. Measured on the
fixtures at tp 1/2/4: torch backend max_rel <= 4e-7; Triton interpreter max_rel <= 1.3e-3 with
cosine >= 0.99999990 (a few tokens carry one flipped rounding). Without matching the rounding at
all, near-tied expert choices flip and max_rel reaches ~0.4 on a correct conversion. Defaults
(``TOLERANCES``): max_rel <= 2e-2 and cosine >= 0.9999 leave >10x headroom over that floor while
every corruption the self-tests inject (swapped fused halves, wrong rank slice, numeric E8M0) lands
far outside them. Structure and value checks run
first and catch byte-level corruption exactly; this level proves the layout means what the engine
will compute.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from . import quant
from .config import V4Config
from .errors import CheckpointError
from .format import ShardHeader
from .plan import Plan
from .reference import MTPOutput, compare_outputs, mtp_layer_forward
from .source import Checkpoint

log = logging.getLogger(__name__)

# key -> (comparison, bound). Justified in the module docstring; printed in every report.
TOLERANCES: dict[str, tuple[str, float]] = {
    "logits_cosine": (">=", 0.9999),
    "hidden_cosine": (">=", 0.9999),
    "logits_max_rel": ("<=", 2e-2),
    "hidden_max_rel": ("<=", 2e-2),
    "top1_agreement": (">=", 0.9),
    "top5_agreement": (">=", 1.0),
}

# Roles of the reference forward → tensor names. Source side: suffix after ``mtp.{i}.``.
SOURCE_TENSORS = {
    "enorm": "enorm.weight",
    "hnorm": "hnorm.weight",
    "norm": "norm.weight",
    "attn_norm": "attn_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "q_norm": "attn.q_norm.weight",
    "kv_norm": "attn.kv_norm.weight",
    "attn_sink": "attn.attn_sink",
    "gate.weight": "ffn.gate.weight",
    "gate.bias": "ffn.gate.bias",
    **{f"hc_{p}_{t}": f"hc_{p}_{t}" for p in ("attn", "ffn", "head") for t in ("fn", "base", "scale")},
}
SOURCE_LINEARS = {
    "e_proj": "e_proj",
    "h_proj": "h_proj",
    "wq_a": "attn.wq_a",
    "wkv": "attn.wkv",
    "wq_b": "attn.wq_b",
    "wo_a": "attn.wo_a",
    "wo_b": "attn.wo_b",
    "shared.w1": "ffn.shared_experts.w1",
    "shared.w2": "ffn.shared_experts.w2",
    "shared.w3": "ffn.shared_experts.w3",
}

# Converted side, profile vllm-seed ({S} = num_hidden_layers + i). Written out independently of
# the rule table so a wrong rule cannot make both sides agree.
CONVERTED_TENSORS = {
    "vllm-seed": {
        "enorm": "model.layers.{S}.enorm.weight",
        "hnorm": "model.layers.{S}.hnorm.weight",
        "norm": "model.layers.{S}.shared_head.norm.weight",
        "hc_head_fn": "model.layers.{S}.hc_head_fn",
        "hc_head_base": "model.layers.{S}.hc_head_base",
        "hc_head_scale": "model.layers.{S}.hc_head_scale",
        "attn_norm": "model.layers.{S}.mtp_block.attn_norm.weight",
        "ffn_norm": "model.layers.{S}.mtp_block.ffn_norm.weight",
        "q_norm": "model.layers.{S}.mtp_block.attn.q_norm.weight",
        "kv_norm": "model.layers.{S}.mtp_block.attn.kv_norm.weight",
        "attn_sink": "model.layers.{S}.mtp_block.attn.attn_sink",
        "gate.weight": "model.layers.{S}.mtp_block.ffn.gate.weight",
        "gate.bias": "model.layers.{S}.mtp_block.ffn.gate.e_score_correction_bias",
        **{f"hc_{p}_{t}": f"model.layers.{{S}}.mtp_block.hc_{p}_{t}" for p in ("attn", "ffn") for t in ("fn", "base", "scale")},
        "embed": "model.embed_tokens.weight",
        "head": "model.layers.{S}.shared_head.head.weight",
        # linears: (weight name, scale name)
        "e_proj": "model.layers.{S}.e_proj",
        "h_proj": "model.layers.{S}.h_proj",
        "fused_wqa_wkv": "model.layers.{S}.mtp_block.attn.fused_wqa_wkv",
        "wq_b": "model.layers.{S}.mtp_block.attn.wq_b",
        "wo_a": "model.layers.{S}.mtp_block.attn.wo_a",
        "wo_b": "model.layers.{S}.mtp_block.attn.wo_b",
        "gate_up_proj": "model.layers.{S}.mtp_block.ffn.shared_experts.gate_up_proj",
        "down_proj": "model.layers.{S}.mtp_block.ffn.shared_experts.down_proj",
        "experts": "model.layers.{S}.mtp_block.ffn.experts",
    }
}
# Profile vllm-0.33: vLLM 0.33's sharded_state keys (the MoE module's aliases of router and shared
# experts, RoutedExperts) — research/vllm_0_33.md.
CONVERTED_TENSORS["vllm-0.33"] = {
    **CONVERTED_TENSORS["vllm-seed"],
    "gate.weight": "model.layers.{S}.mtp_block.ffn.experts.gate.weight",
    "gate.bias": "model.layers.{S}.mtp_block.ffn.experts.gate.e_score_correction_bias",
    "gate_up_proj": "model.layers.{S}.mtp_block.ffn.experts._shared_experts._layer.gate_up_proj",
    "down_proj": "model.layers.{S}.mtp_block.ffn.experts._shared_experts._layer.down_proj",
    "experts": "model.layers.{S}.mtp_block.ffn.experts.routed_experts",
}


class _TensorFiles:
    """Lazy tensor access by name over a set of safetensors files (safetensors' own reader)."""

    def __init__(self, locate: dict[str, Path], device: torch.device) -> None:
        self.locate = locate
        self.device = device
        self._handles: dict[Path, object] = {}

    def _handle(self, name: str):
        from safetensors import safe_open

        path = self.locate.get(name)
        if path is None:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint")
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name).to(self.device)  # type: ignore[attr-defined]

    def get_index(self, name: str, index: int) -> torch.Tensor:
        """``tensor[index]`` of a stacked tensor without loading the whole stack."""
        return self._handle(name).get_slice(name)[index : index + 1][0].to(self.device)  # type: ignore[attr-defined]


def _dequant(weight: torch.Tensor, scale: torch.Tensor, what: str) -> torch.Tensor:
    if weight.dtype in (torch.int8, torch.uint8):
        return quant.mxfp4_dequant(weight, scale, what=what)
    return quant.fp8_block_dequant(weight, scale, what=what)


class SourceShard:
    """Side A: the original checkpoint, one rank, dequantized in plain torch."""

    def __init__(self, cfg: V4Config, ckpt: Checkpoint, mtp: int, device: torch.device, act: str = "bf16") -> None:
        self.cfg, self.mtp, self.act = cfg, mtp, act
        self.rank, self.tp = 0, 1
        self.local_experts = list(range(cfg.n_routed_experts))
        self.files = _TensorFiles({n: ckpt.root / t.file for n, t in ckpt.tensors.items()}, device)
        self.names = set(ckpt.tensors)
        self._cache: dict[str, torch.Tensor] = {}

    def tensor(self, role: str) -> torch.Tensor:
        p = f"mtp.{self.mtp}."
        if role == "embed":  # the draft model's one embedding is mtp.0's (seed loader), else the main one
            name = "mtp.0.emb.tok_emb.weight" if "mtp.0.emb.tok_emb.weight" in self.names else "embed.weight"
        elif role == "head":
            name = p + "head.weight" if p + "head.weight" in self.names else "head.weight"
        else:
            name = p + SOURCE_TENSORS[role]
        return self.files.get(name).float()

    def _weight(self, base: str) -> torch.Tensor:
        if base not in self._cache:
            w = _dequant(self.files.get(base + ".weight"), self.files.get(base + ".scale"), base)
            if ".experts." in base:
                return w  # not cached: all experts of a real layer would not fit in memory
            self._cache[base] = w
        return self._cache[base]

    def linear(self, role: str, x: torch.Tensor) -> torch.Tensor:
        p = f"mtp.{self.mtp}."
        if role.startswith("expert."):
            _, j, w = role.split(".")
            base = f"{p}ffn.experts.{j}.{w}"
            weight = self._weight(base)
        elif role.startswith("wo_a."):
            g, Or = int(role.split(".")[1]), self.cfg.o_lora_rank
            weight = self._weight(p + SOURCE_LINEARS["wo_a"])[g * Or : (g + 1) * Or]
        else:
            weight = self._weight(p + SOURCE_LINEARS[role])
        # Same activation rounding as the kernels (bf16, or per-token-group fp8; the MXFP4 GEMM always
        # takes bf16): both sides then compute identical math up to summation order, so routing
        # decisions cannot flip on rounding noise and the tolerances can stay tight.
        from .kernels.fp8_gemm import prepare_activation

        fp4_expert = role.startswith("expert.") and self.cfg.expert_dtype == "fp4"
        return prepare_activation(x.float(), "bf16" if fp4_expert else self.act) @ weight.T


class ConvertedShard:
    """Side B: one rank of the converted checkpoint, linears through the quantized GEMM kernels."""

    def __init__(
        self, cfg: V4Config, plan: Plan, out: Path, rank: int, mtp: int, device: torch.device, kernels: str, act: str
    ) -> None:
        opts = plan.options
        self.cfg, self.rank, self.tp = cfg, rank, opts.tp
        self.kernels, self.act = kernels, act
        E = cfg.n_routed_experts
        self.local_experts = (
            list(range(E)) if opts.moe_parallel == "tp" else list(range(rank * E // opts.tp, (rank + 1) * E // opts.tp))
        )
        S = cfg.num_hidden_layers + mtp
        if opts.profile not in CONVERTED_TENSORS:
            raise CheckpointError(f"numeric verify has no name table for profile {opts.profile!r}")
        self.names = {k: v.format(S=S) for k, v in CONVERTED_TENSORS[opts.profile].items()}
        locate = {t.name: out / f.relpath for f in plan.files if f.component == "mtp" and f.rank == rank for t in f.tensors}
        self.files = _TensorFiles(locate, device)
        self.fp4 = cfg.expert_dtype == "fp4"

    def tensor(self, role: str) -> torch.Tensor:
        return self.files.get(self.names[role]).float()

    def _scale_suffix(self, expert: bool) -> str:
        return "weight_scale" if (expert and self.fp4) else "weight_scale_inv"

    def _gemm(self, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, what: str) -> torch.Tensor:
        from .kernels import fp8_block_gemm, mxfp4_gemm

        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).float()
        if w.dtype == torch.uint8 and self.fp4 and s.dtype == torch.uint8 and s.shape[0] == w.shape[0] and s.shape[-1] * 16 == w.shape[-1]:
            y = mxfp4_gemm(x2, w, s, backend=self.kernels, what=what)
        else:
            y = fp8_block_gemm(x2, w, s, act=self.act, backend=self.kernels, what=what)
        return y.reshape(*lead, y.shape[-1])

    def _rows(self, base: str, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [r0, r1) of an FP8 linear and the matching 128-row scale blocks."""
        w = self.files.get(base + ".weight")
        s = self.files.get(base + ".weight_scale_inv")
        if r0 % 128 or (r1 % 128 and r1 != w.shape[0]):
            raise CheckpointError(f"{base}: rows {r0}:{r1} do not fall on 128-row scale blocks")
        return w[r0:r1], s[r0 // 128 : -(-r1 // 128)]

    def linear(self, role: str, x: torch.Tensor) -> torch.Tensor:
        n, cfg = self.names, self.cfg
        if role in ("e_proj", "h_proj", "wq_b", "wo_b"):
            base = n[role]
            return self._gemm(x, self.files.get(base + ".weight"), self.files.get(base + ".weight_scale_inv"), base)
        if role in ("wq_a", "wkv"):
            Qr, Dh = cfg.q_lora_rank, cfg.head_dim
            r0, r1 = (0, Qr) if role == "wq_a" else (Qr, Qr + Dh)
            return self._gemm(x, *self._rows(n["fused_wqa_wkv"], r0, r1), n["fused_wqa_wkv"])
        if role.startswith("wo_a."):
            g, Or = int(role.split(".")[1]), cfg.o_lora_rank
            return self._gemm(x, *self._rows(n["wo_a"], g * Or, (g + 1) * Or), n["wo_a"])
        if role in ("shared.w1", "shared.w3"):
            half = cfg.moe_intermediate_size * cfg.n_shared_experts // self.tp
            r0 = 0 if role == "shared.w1" else half
            return self._gemm(x, *self._rows(n["gate_up_proj"], r0, r0 + half), n["gate_up_proj"])
        if role == "shared.w2":
            base = n["down_proj"]
            return self._gemm(x, self.files.get(base + ".weight"), self.files.get(base + ".weight_scale_inv"), base)
        if role.startswith("expert."):
            _, j, which = role.split(".")
            local = self.local_experts.index(int(j))
            base = n["experts"]
            sfx = self._scale_suffix(expert=True)
            if which == "w2":
                w = self.files.get_index(f"{base}.w2_weight", local)
                s = self.files.get_index(f"{base}.w2_{sfx}", local)
            else:
                w = self.files.get_index(f"{base}.w13_weight", local)
                s = self.files.get_index(f"{base}.w13_{sfx}", local)
                half, shalf = w.shape[0] // 2, s.shape[0] // 2
                w, s = (w[:half], s[:shalf]) if which == "w1" else (w[half:], s[shalf:])
            return self._gemm(x, w, s, f"{base} expert {j} {which}")
        raise KeyError(f"unknown linear role {role!r}")


@dataclass(frozen=True)
class NumericInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    prev_hidden: torch.Tensor


def make_inputs(cfg: V4Config, tokens: int, seed: int, device: torch.device) -> NumericInputs:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    hidden = torch.randn(tokens, cfg.hc_mult * cfg.hidden_size, generator=g)
    return NumericInputs(ids.to(device), torch.arange(tokens, device=device), hidden.to(device))


def within_tolerance(metrics: dict[str, float]) -> list[str]:
    """Names of the metrics outside ``TOLERANCES`` (with their values)."""
    bad = []
    for key, (op, bound) in TOLERANCES.items():
        v = metrics[key]
        ok = v >= bound if op == ">=" else v <= bound
        if not ok:
            bad.append(f"{key}={v:.6g} (needs {op} {bound})")
    return bad


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("--device cuda requested but no CUDA device is available")
    return torch.device(device)


def run_layer(
    cfg: V4Config, plan: Plan, ckpt: Checkpoint, out: Path, mtp: int, inputs: NumericInputs, *, device: torch.device, kernels: str, act: str
) -> tuple[MTPOutput, MTPOutput]:
    """Side A and side B of one MTP layer; B is the worst of the T replica viewpoints (see _ReplicaView)."""
    source = [SourceShard(cfg, ckpt, mtp, device, act)]
    converted = [ConvertedShard(cfg, plan, out, r, mtp, device, kernels, act) for r in range(plan.options.tp)]
    with torch.no_grad():
        a = mtp_layer_forward(cfg, source, inputs.input_ids, inputs.positions, inputs.prev_hidden)
        worst: tuple[float, MTPOutput] | None = None
        for viewpoint in range(len(converted)):
            shards = [_ReplicaView(s, converted[viewpoint]) for s in converted]
            b = mtp_layer_forward(cfg, shards, inputs.input_ids, inputs.positions, inputs.prev_hidden)
            m = compare_outputs(a, b)
            err = max(m["logits_max_rel"], m["hidden_max_rel"])
            if worst is None or err > worst[0]:
                worst = (err, b)
    assert worst is not None
    return a, worst[1]


# Roles every rank holds a full copy of. The reference forward reads them from shards[0]; in an
# engine each rank computes them from its own copy, so each rank's copy is exercised in turn.
_SHARDED_TENSORS = {"attn_sink", "embed", "head"}
_SHARDED_LINEAR_PREFIXES = ("wq_b", "wo_a.", "wo_b", "shared.", "expert.")


class _ReplicaView:
    """Rank ``shard`` whose replicated roles are served by ``replica`` (another rank's copy)."""

    def __init__(self, shard: ConvertedShard, replica: ConvertedShard) -> None:
        self.shard, self.replica = shard, replica
        self.rank, self.tp, self.local_experts = shard.rank, shard.tp, shard.local_experts

    def tensor(self, role: str) -> torch.Tensor:
        return (self.shard if role in _SHARDED_TENSORS else self.replica).tensor(role)

    def linear(self, role: str, x: torch.Tensor) -> torch.Tensor:
        return (self.shard if role.startswith(_SHARDED_LINEAR_PREFIXES) else self.replica).linear(role, x)


def check_numeric(out: Path, plan: Plan, ckpt: Checkpoint, headers: dict[str, ShardHeader], report, *, kernels: str, device: str, tokens: int, seed: int, act: str = "bf16") -> None:
    """Add one check per MTP layer to ``report`` (a verify.VerifyReport)."""
    from .kernels import resolve_backend
    from .verify import Check

    cfg = plan.config
    if plan.options.only == "model":
        report.add(Check("numeric", True, "skipped: --only model has no MTP layers to run"))
        return
    dev = resolve_device(device)
    backend = resolve_backend(kernels, dev)
    inputs = make_inputs(cfg, tokens, seed, dev)
    for i in range(cfg.num_nextn_predict_layers):
        S = cfg.num_hidden_layers + i
        name = f"numeric:mtp.{i}(layer {S})"
        try:
            a, b = run_layer(cfg, plan, ckpt, out, i, inputs, device=dev, kernels=kernels, act=act)
        except (CheckpointError, KeyError, ValueError, RuntimeError) as exc:
            report.add(Check(name, False, f"layer {S}: forward from the converted weights failed: {exc}"))
            continue
        metrics = compare_outputs(a, b)
        bad = within_tolerance(metrics)
        entry = {"layer": S, "mtp": i, "backend": backend, "device": str(dev), "tokens": tokens, "seed": seed, **metrics,
                 "tolerances": {k: f"{op} {v}" for k, (op, v) in TOLERANCES.items()}, "ok": not bad}
        report.numeric.append(entry)
        msg = "" if not bad else f"layer {S}: converted MTP layer disagrees with the source forward: " + ", ".join(bad)
        report.add(Check(name, not bad, msg, details=entry))
