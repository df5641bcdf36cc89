"""A pure-torch reference forward of one DeepSeek V4 MTP layer, run over tensor-parallel shards.

The forward is written once against the :class:`RankShard` protocol and combines per-rank
results the way a TP engine does (all-reduce of partial sums, all-gather of vocab slices).
``verify`` runs it twice: with one "rank" backed by the original checkpoint's dequantized
weights (tp=1), and with T ranks backed by the converted per-rank checkpoint. Because the
math is shared, any difference between the two runs comes from the weights and their sharding,
not from two implementations disagreeing.

Everything is computed in float32 on whatever device the shards' tensors live on.

Role names and shapes (full, unsharded) as used by :class:`DenseShard` and
:func:`make_random_layer`:

=================  ==========================  ===============================================
role               full shape                  per-rank view
=================  ==========================  ===============================================
enorm, hnorm,      [D]                         replicated
attn_norm,
ffn_norm, norm
q_norm             [Qr]                        replicated
kv_norm            [Dh]                        replicated
hc_attn_fn,        [(2+hc)*hc, hc*D]           replicated
hc_ffn_fn
hc_attn_base,      [(2+hc)*hc]                 replicated
hc_ffn_base
hc_attn_scale,     [3]                         replicated
hc_ffn_scale
hc_head_fn         [hc, hc*D]                  replicated
hc_head_base       [hc]                        replicated
hc_head_scale      [1]                         replicated
attn_sink          [H]                         heads [r*H/T, (r+1)*H/T)
gate.weight        [E, D]                      replicated
gate.bias          [E]                         replicated
embed              [V, D]                      vocab rows [r*V/T, (r+1)*V/T) (embedding)
head               [V, D]                      vocab rows [r*V/T, (r+1)*V/T) (linear)
e_proj, h_proj     [D, D]                      replicated (linear)
wq_a               [Qr, D]                     replicated (linear)
wkv                [Dh, D]                     replicated (linear)
wq_b               [H*Dh, Qr]                  output rows of this rank's heads (linear)
wo_a               [G*Or, H*Dh/G]              linear role 'wo_a.{g}' = rows of global group
                                               r*G/T+g, i.e. [Or, H*Dh/G]
wo_b               [D, G*Or]                   input columns of this rank's groups (linear)
shared.w1, w3      [I_s, D]                    output rows [r*I_s/T, (r+1)*I_s/T) (linear; a
                                               converted rank's share may end in the engine's
                                               zero padding, which computes 0)
shared.w2          [D, I_s]                    input columns of the same slice (linear)
expert.{j}.w1, w3  [I, D]                      tp: rows slice of I/T; ep: whole, on the
                                               owning rank only (linear)
expert.{j}.w2      [D, I]                      tp: columns slice; ep: whole (linear)
=================  ==========================  ===============================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from ckpt_tool.checkpoint.config import V4Config


@runtime_checkable
class RankShard(Protocol):
    """One tensor-parallel rank's view of an MTP layer's weights.

    ``tensor(role)`` returns a float32 tensor (see the module docstring for roles and shapes).
    ``linear(role, x)`` returns float32 ``x @ W_local.T`` for ``x[..., in]``; an adapter may run
    it through a quantized GEMM kernel, which is why the forward never asks for linear weights.
    ``embedding(ids)`` returns float32 rows ``ids`` (local, in range) of this rank's embedding
    slice: the forward never asks for a whole vocab table either.
    """

    rank: int
    tp: int
    local_experts: list[int]

    def tensor(self, role: str) -> torch.Tensor: ...

    def linear(self, role: str, x: torch.Tensor) -> torch.Tensor: ...

    def embedding(self, ids: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class MTPOutput:
    """Result of one MTP layer: the hyper-connected hidden state and the vocab logits."""

    hidden: torch.Tensor  # [T, hc*D] float32
    logits: torch.Tensor  # [T, V] float32


# ----------------------------------------------------------------------------- building blocks


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32; ``weight=None`` is the weightless variant."""
    x = x.float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, inverse: bool = False) -> torch.Tensor:
    """Rotate the last dim of ``x`` GPT-J style: pairs (2i, 2i+1) turn by ``position * theta^(-2i/d)``.

    ``x`` is ``[T, ..., d]`` and ``positions`` is ``[T]``. ``inverse=True`` rotates backwards,
    which DeepSeek applies to the attention output because V carries the rotated K.
    """
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    # float64 angles so large positions do not lose phase before cos/sin
    angles = positions.to(device=x.device, dtype=torch.float64)[:, None] * freqs[None, :]  # [T, d/2]
    angles = angles.view(angles.shape[0], *([1] * (x.dim() - 2)), d // 2)
    cos, sin = angles.cos().float(), angles.sin().float()
    if inverse:
        sin = -sin
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out0 = x0 * cos - x1 * sin
    out1 = x0 * sin + x1 * cos
    return torch.stack([out0, out1], dim=-1).flatten(-2)


def hc_pre(
    cfg: V4Config, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hyper-connection input mix of ``x[T, hc, D]``.

    Returns ``(y[T, D], post[T, hc], comb[T, hc, hc])``: ``y`` is the pre-weighted sum of the
    streams fed to the sublayer, ``post`` and ``comb`` are consumed by :func:`hc_post`. ``comb``
    is made (approximately) doubly stochastic by Sinkhorn iterations.
    """
    hc = cfg.hc_mult
    T = x.shape[0]
    xf = x.flatten(-2)
    rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
    mix = (xf @ fn.T) * rs  # [T, (2+hc)*hc]
    pre = torch.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
    post = 2 * torch.sigmoid(mix[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mix[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(T, hc, hc)
    comb = torch.softmax(comb, dim=-1) + cfg.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    y = (pre.unsqueeze(-1) * x).sum(1)
    return y, post, comb


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Hyper-connection output: ``out[:, j] = post[:, j] * f + sum_m comb[:, m, j] * residual[:, m]``."""
    return post.unsqueeze(-1) * f.unsqueeze(1) + torch.einsum("tmj,tmd->tjd", comb, residual)


def swiglu(shard: RankShard, prefix: str, x: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU expert ``w2(silu(clamp(w1 x)) * clamp(w3 x))`` on this rank's slice (partial)."""
    g = shard.linear(f"{prefix}.w1", x)
    u = shard.linear(f"{prefix}.w3", x)
    if limit > 0:  # as DeepSeek: a non-positive limit disables the clamp
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return shard.linear(f"{prefix}.w2", F.silu(g) * u)


# ----------------------------------------------------------------------------- layer pieces


def embed(cfg: V4Config, shards: list[RankShard], input_ids: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel embedding: each rank fills the ids in its range, the ranks' rows are summed."""
    out = None
    rows = cfg.vocab_size // len(shards)
    for shard in shards:
        local = input_ids - shard.rank * rows
        inside = (local >= 0) & (local < rows)
        e = shard.embedding(local.clamp(0, rows - 1)) * inside.unsqueeze(-1)
        out = e if out is None else out + e
    return out


def route(cfg: V4Config, shard: RankShard, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: ``(weights[T, topk], ids[T, topk])`` with sqrtsoftplus scores and bias-only selection."""
    if cfg.scoring_func != "sqrtsoftplus":
        raise ValueError(f"reference forward supports scoring_func 'sqrtsoftplus' only, not {cfg.scoring_func!r}")
    logits = x.float() @ shard.tensor("gate.weight").T
    scores = torch.sqrt(F.softplus(logits))
    # the bias steers which experts are picked but does not enter the weights
    ids = torch.topk(scores + shard.tensor("gate.bias"), cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(-1, ids)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * cfg.routed_scaling_factor, ids


def attention(cfg: V4Config, shards: list[RankShard], x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Sliding-window attention with sinks and grouped low-rank output; ``x[T, D] -> [T, D]``.

    Each rank computes its heads and a partial ``wo_b`` output; partials are summed (all-reduce).
    """
    H, Dh, G, rd = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.qk_rope_head_dim
    T = x.shape[0]
    tp = len(shards)
    s0 = shards[0]
    qr = rms_norm(s0.linear("wq_a", x), s0.tensor("q_norm"), cfg.rms_norm_eps)
    kv = rms_norm(s0.linear("wkv", x), s0.tensor("kv_norm"), cfg.rms_norm_eps)  # [T, Dh], K = V
    kv = torch.cat([kv[:, :-rd], apply_rope(kv[:, -rd:], positions, cfg.rope_theta)], dim=-1)

    # key k is visible to query q iff p_k in (p_q - window, p_q]
    pq, pk = positions[:, None], positions[None, :]
    visible = (pk <= pq) & (pk > pq - cfg.sliding_window)  # [Tq, Tk]

    out = None
    for shard in shards:
        q = shard.linear("wq_b", qr).view(T, H // tp, Dh)
        q = rms_norm(q, None, cfg.rms_norm_eps)
        q = torch.cat([q[..., :-rd], apply_rope(q[..., -rd:], positions, cfg.rope_theta)], dim=-1)
        scores = torch.einsum("thd,sd->ths", q, kv) * Dh**-0.5
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        # the sink is an extra logit per head that takes probability mass but contributes no value
        sink = shard.tensor("attn_sink").view(1, -1, 1).expand(T, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        o = torch.einsum("ths,sd->thd", probs, kv)
        o = torch.cat([o[..., :-rd], apply_rope(o[..., -rd:], positions, cfg.rope_theta, inverse=True)], dim=-1)
        o = o.reshape(T, G // tp, (H // G) * Dh)
        z = torch.cat([shard.linear(f"wo_a.{g}", o[:, g]) for g in range(G // tp)], dim=-1)
        part = shard.linear("wo_b", z)
        out = part if out is None else out + part
    return out


def route_every_expert(cfg: V4Config, shard: RankShard, x: torch.Tensor) -> torch.Tensor:
    """Dense routing weights ``[T, E]``: the router's top-k, plus expert ``j`` on token ``j % T`` for every
    expert the top-k left out, weighted like a routed choice of that token (its score over the token's
    top-k score sum, times the scaling factor). A verification mode: on a few tokens the top-k reaches
    few of the routed experts, and an expert no token reaches is an expert the forward never checks.
    The extra pairs depend on positions only, so both sides of a comparison pick the same ones.
    """
    weights, ids = route(cfg, shard, x)
    T, E = x.shape[0], cfg.n_routed_experts
    dense = torch.zeros(T, E, dtype=torch.float32, device=x.device)
    dense.scatter_(1, ids, weights)
    logits = x.float() @ shard.tensor("gate.weight").T
    scores = torch.sqrt(F.softplus(logits))
    norm = scores.gather(-1, ids).sum(-1) if cfg.norm_topk_prob else torch.ones(T, device=x.device)
    j = torch.arange(E, device=x.device)
    t = j % T
    unreached = ~(dense != 0).any(0)
    extra = scores[t, j] / norm[t] * cfg.routed_scaling_factor
    dense[t[unreached], j[unreached]] = extra[unreached]
    return dense


def moe(cfg: V4Config, shards: list[RankShard], x: torch.Tensor, route_all: bool = False, map_fn=map) -> torch.Tensor:
    """Routed experts plus shared expert; ``x[T, D] -> [T, D]``, rank partials summed.

    ``route_all``: every routed expert gets at least one token (:func:`route_every_expert`). ``map_fn`` (like
    the builtin ``map``, results in order) runs the experts' SwiGLUs, e.g. on a thread pool; they are summed
    here in the same order whatever runs them, so the result does not depend on it.
    """
    if route_all:
        dense = route_every_expert(cfg, shards[0], x)
    else:
        weights, ids = route(cfg, shards[0], x)
        dense = torch.zeros(x.shape[0], cfg.n_routed_experts, dtype=torch.float32, device=x.device)
        dense.scatter_(1, ids, weights)
    jobs: list[tuple[RankShard, str, torch.Tensor | None]] = []  # (shard, expert prefix, its tokens; None: all)
    for shard in shards:
        for j in shard.local_experts:
            tok = torch.nonzero(dense[:, j], as_tuple=True)[0]
            if tok.numel():
                jobs.append((shard, f"expert.{j}", tok))
        if cfg.n_shared_experts > 0:
            jobs.append((shard, "shared", None))

    def run(job: tuple[RankShard, str, torch.Tensor | None]) -> torch.Tensor:
        shard, prefix, tok = job
        return swiglu(shard, prefix, x if tok is None else x[tok], cfg.swiglu_limit)

    out = torch.zeros_like(x)
    for (_, prefix, tok), y in zip(jobs, map_fn(run, jobs)):
        if tok is None:
            out = out + y
        else:
            j = int(prefix.split(".")[1])
            out.index_add_(0, tok, y * dense[tok, j].unsqueeze(-1))
    return out


def hc_head_logits(cfg: V4Config, shards: list[RankShard], x: torch.Tensor) -> torch.Tensor:
    """Collapse the ``hc`` streams, final-norm, and gather the vocab-parallel head: ``[T, V]``."""
    s0 = shards[0]
    xf = x.flatten(-2)
    rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
    mix = (xf @ s0.tensor("hc_head_fn").T) * rs  # [T, hc]
    pre = torch.sigmoid(mix * s0.tensor("hc_head_scale") + s0.tensor("hc_head_base")) + cfg.hc_eps
    y = (pre.unsqueeze(-1) * x).sum(1)
    y = rms_norm(y, s0.tensor("norm"), cfg.rms_norm_eps)
    return torch.cat([shard.linear("head", y) for shard in shards], dim=-1)


def _check_shards(cfg: V4Config, shards: list[RankShard]) -> None:
    if not shards:
        raise ValueError("mtp_layer_forward needs at least one rank shard")
    tp = len(shards)
    for i, shard in enumerate(shards):
        if shard.rank != i or shard.tp != tp:
            raise ValueError(f"shard {i} says rank {shard.rank} of tp {shard.tp}; expected rank {i} of tp {tp}")
    sizes = {"vocab_size": cfg.vocab_size, "num_attention_heads": cfg.num_attention_heads, "o_groups": cfg.o_groups}
    for name, n in sizes.items():
        if n % tp:
            raise ValueError(f"{name}={n} is not divisible by tp={tp}")
    covered = set().union(*(set(s.local_experts) for s in shards))
    if covered != set(range(cfg.n_routed_experts)):
        missing = sorted(set(range(cfg.n_routed_experts)) - covered)
        raise ValueError(f"routed experts {missing[:8]} are computed by no rank")


# ----------------------------------------------------------------------------- the layer


def mtp_layer_forward(
    cfg: V4Config,
    shards: list[RankShard],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    prev_hidden: torch.Tensor,
    *,
    route_all: bool = False,
    map_fn=map,
) -> MTPOutput:
    """Run one MTP layer over ``T`` tokens of a single sequence.

    ``shards`` are ranks 0..tp-1 in order; replicated roles are read from ``shards[0]``.
    ``input_ids`` and ``positions`` are ``[T]`` long, ``prev_hidden`` is the main model's
    ``[T, hc*D]`` hidden state. Attention masks by position, so ``positions`` must be the
    tokens' positions in one sequence. ``route_all`` sends every routed expert tokens (see :func:`moe`), whose
    SwiGLUs ``map_fn`` runs.
    """
    _check_shards(cfg, shards)
    hc, D, eps = cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps
    T = input_ids.shape[0]
    s0 = shards[0]

    e = embed(cfg, shards, input_ids)
    # the MTP layer has no previous token for position 0, so its embedding is zeroed
    e = e * (positions != 0).unsqueeze(-1)
    e = rms_norm(e, s0.tensor("enorm"), eps)
    h = rms_norm(prev_hidden.float().view(T, hc, D), s0.tensor("hnorm"), eps)
    x = s0.linear("h_proj", h) + s0.linear("e_proj", e).unsqueeze(-2)  # [T, hc, D]

    r = x
    y, post, comb = hc_pre(cfg, x, s0.tensor("hc_attn_fn"), s0.tensor("hc_attn_scale"), s0.tensor("hc_attn_base"))
    y = attention(cfg, shards, rms_norm(y, s0.tensor("attn_norm"), eps), positions)
    x = hc_post(y, r, post, comb)

    r = x
    y, post, comb = hc_pre(cfg, x, s0.tensor("hc_ffn_fn"), s0.tensor("hc_ffn_scale"), s0.tensor("hc_ffn_base"))
    y = moe(cfg, shards, rms_norm(y, s0.tensor("ffn_norm"), eps), route_all, map_fn)
    x = hc_post(y, r, post, comb)

    return MTPOutput(hidden=x.flatten(1), logits=hc_head_logits(cfg, shards, x))


# ----------------------------------------------------------------------------- comparison


def compare_outputs(a: MTPOutput, b: MTPOutput) -> dict[str, float]:
    """Compare ``b`` against the reference ``a``.

    Keys: ``{hidden,logits}_{max_abs,max_rel,cosine}`` where ``max_rel = max|a-b| / max|a|`` and
    cosine is over the whole flattened tensor; ``top1_agreement`` is the fraction of tokens
    whose argmax logits agree, ``top5_agreement`` the fraction of tokens whose ``b`` top-1 is
    among ``a``'s top-5.
    """
    result: dict[str, float] = {}
    for name in ("hidden", "logits"):
        x, y = getattr(a, name).double().flatten(), getattr(b, name).double().flatten()
        diff = (x - y).abs().max().item()
        result[f"{name}_max_abs"] = diff
        result[f"{name}_max_rel"] = diff / max(x.abs().max().item(), 1e-30)
        result[f"{name}_cosine"] = F.cosine_similarity(x, y, dim=0, eps=1e-30).item()
    top1_b = b.logits.argmax(-1)
    result["top1_agreement"] = (a.logits.argmax(-1) == top1_b).double().mean().item()
    top5_a = a.logits.topk(min(5, a.logits.shape[-1]), dim=-1).indices
    result["top5_agreement"] = (top5_a == top1_b.unsqueeze(-1)).any(-1).double().mean().item()
    return result


# ----------------------------------------------------------------------------- dense shards


class DenseShard:
    """A :class:`RankShard` over a dict of full float32 tensors, sliced here for ``(rank, tp)``.

    ``weights`` uses the full shapes listed in the module docstring (``wo_a`` is one
    ``[G*Or, H*Dh/G]`` matrix; ``expert.{j}.w*`` one entry per routed expert).
    ``moe_parallel='tp'`` splits every expert's intermediate dim over the ranks;
    ``'ep'`` gives each rank whole experts ``[r*E/T, (r+1)*E/T)``.
    """

    _REPLICATED_LINEAR = ("e_proj", "h_proj", "wq_a", "wkv")

    def __init__(
        self, cfg: V4Config, weights: dict[str, torch.Tensor], rank: int = 0, tp: int = 1, moe_parallel: str = "tp"
    ) -> None:
        if moe_parallel not in ("tp", "ep"):
            raise ValueError(f"moe_parallel must be 'tp' or 'ep', not {moe_parallel!r}")
        E = cfg.n_routed_experts
        if moe_parallel == "ep" and E % tp:
            raise ValueError(f"n_routed_experts={E} is not divisible by tp={tp}")
        self.cfg, self.weights = cfg, weights
        self.rank, self.tp, self.moe_parallel = rank, tp, moe_parallel
        per = E // tp
        self.local_experts = list(range(E)) if moe_parallel == "tp" else list(range(rank * per, (rank + 1) * per))

    @classmethod
    def split(
        cls, cfg: V4Config, weights: dict[str, torch.Tensor], tp: int, moe_parallel: str = "tp"
    ) -> list[DenseShard]:
        """All ``tp`` ranks of ``weights``, in rank order."""
        return [cls(cfg, weights, r, tp, moe_parallel) for r in range(tp)]

    def _part(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous 1/tp slice of ``t`` along ``dim``."""
        n = t.shape[dim]
        if n % self.tp:
            raise ValueError(f"dim {dim} of size {n} is not divisible by tp={self.tp}")
        step = n // self.tp
        return t.narrow(dim, self.rank * step, step)

    def tensor(self, role: str) -> torch.Tensor:
        """Float32 tensor for ``role``; sinks and vocab tables are this rank's slice."""
        t = self.weights[role]
        if role in ("attn_sink", "embed", "head"):
            t = self._part(t, 0)
        return t.float()

    def _weight(self, role: str) -> torch.Tensor:
        """This rank's ``[out, in]`` matrix for a linear role."""
        cfg = self.cfg
        if role in self._REPLICATED_LINEAR:
            return self.weights[role]
        if role in ("wq_b", "head"):
            return self._part(self.weights[role], 0)
        if role.startswith("wo_a."):
            g = self.rank * (cfg.o_groups // self.tp) + int(role.split(".")[1])
            return self.weights["wo_a"][g * cfg.o_lora_rank : (g + 1) * cfg.o_lora_rank]
        if role == "wo_b":
            return self._part(self.weights[role], 1)
        if role.startswith("shared."):
            return self._part(self.weights[role], 1 if role.endswith("w2") else 0)
        if role.startswith("expert."):
            j = int(role.split(".")[1])
            if j not in self.local_experts:
                raise KeyError(f"rank {self.rank} does not hold expert {j}")
            w = self.weights[role]
            if self.moe_parallel == "ep":
                return w
            return self._part(w, 1 if role.endswith("w2") else 0)
        raise KeyError(f"unknown linear role {role!r}")

    def linear(self, role: str, x: torch.Tensor) -> torch.Tensor:
        """``x @ W_local.T`` in float32."""
        return x.float() @ self._weight(role).float().T

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of this rank's vocab slice of the embedding."""
        return self.tensor("embed")[ids]


def make_random_layer(cfg: V4Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights of one MTP layer with the full shapes :class:`DenseShard` expects.

    Linear weights are ``N(0, 1/in)`` so activations keep their scale, norms are near 1, the
    hyper-connection projections are small (mixes near their bases), sinks near 0.
    """
    gen = torch.Generator().manual_seed(seed)
    D, H, Dh, Qr = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, Or, E, I = cfg.o_groups, cfg.o_lora_rank, cfg.n_routed_experts, cfg.moe_intermediate_size
    hc, V = cfg.hc_mult, cfg.vocab_size
    Is = I * cfg.n_shared_experts

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def lin(out: int, inp: int) -> torch.Tensor:
        return randn(out, inp, std=1 / math.sqrt(inp))

    def norm(n: int) -> torch.Tensor:
        return 1 + randn(n, std=0.1)

    w: dict[str, torch.Tensor] = {}
    for name, n in (
        ("enorm", D),
        ("hnorm", D),
        ("attn_norm", D),
        ("ffn_norm", D),
        ("norm", D),
        ("q_norm", Qr),
        ("kv_norm", Dh),
    ):
        w[name] = norm(n)
    for kind in ("attn", "ffn"):
        w[f"hc_{kind}_fn"] = randn((2 + hc) * hc, hc * D, std=0.1 / math.sqrt(hc * D))
        w[f"hc_{kind}_base"] = randn((2 + hc) * hc, std=0.5)
        w[f"hc_{kind}_scale"] = norm(3)
    w["hc_head_fn"] = randn(hc, hc * D, std=0.1 / math.sqrt(hc * D))
    w["hc_head_base"] = randn(hc, std=0.5)
    w["hc_head_scale"] = norm(1)
    w["attn_sink"] = randn(H, std=0.1)
    w["gate.weight"] = lin(E, D)
    w["gate.bias"] = randn(E, std=0.1)
    w["embed"] = randn(V, D)
    w["head"] = lin(V, D)
    w["e_proj"], w["h_proj"] = lin(D, D), lin(D, D)
    w["wq_a"], w["wkv"], w["wq_b"] = lin(Qr, D), lin(Dh, D), lin(H * Dh, Qr)
    w["wo_a"], w["wo_b"] = lin(G * Or, H * Dh // G), lin(D, G * Or)
    if Is:
        w["shared.w1"], w["shared.w3"], w["shared.w2"] = lin(Is, D), lin(Is, D), lin(D, Is)
    for j in range(E):
        w[f"expert.{j}.w1"], w[f"expert.{j}.w3"], w[f"expert.{j}.w2"] = lin(I, D), lin(I, D), lin(D, I)
    return w
