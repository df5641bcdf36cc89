"""Probe rows on the routed experts' linears: each expert part's seeded probe rows ride on the forward's GEMMs (so
every MTP expert is dequantized once per side), and the source's probe outputs are compared with the ranks'."""

from __future__ import annotations

import zlib

import torch

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.expert_format import layer_format
from ckpt_tool.mapping.plan import Plan
from ckpt_tool.verify.forward_names import CONVERTED_TENSORS
from ckpt_tool.verify.linear_check import LINEAR_MAX_REL, PROBE_ROWS


class ProbedShard:
    """A rank shard whose routed-expert linears also carry seeded probe rows (the per-linear check of
    every MTP expert, riding on the forward's GEMMs so each expert is dequantized once per side)."""

    def __init__(self, shard, seed: int, sliced: bool, device: torch.device) -> None:
        self.shard, self.seed, self.sliced, self.device = shard, seed, sliced, device
        self.rank, self.tp, self.local_experts = shard.rank, shard.tp, shard.local_experts
        self.outputs: dict[str, torch.Tensor] = {}

    def tensor(self, role: str) -> torch.Tensor:
        return self.shard.tensor(role)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return self.shard.embedding(ids)

    def probe(self, role: str, width: int) -> torch.Tensor:
        """This rank's columns of the role's seeded ``[PROBE_ROWS, in]`` probe (w2 under tp: its input slice)."""
        full = width * (self.tp if self.sliced and role.endswith(".w2") else 1)
        g = torch.Generator().manual_seed(zlib.crc32(role.encode()) ^ (self.seed * 0x9E3779B1 & 0xFFFFFFFF))
        x = torch.randn(PROBE_ROWS, full, generator=g).to(self.device)
        if full != width:
            x = x[:, self.rank * width : (self.rank + 1) * width]
        return x

    def linear(self, role: str, x: torch.Tensor) -> torch.Tensor:
        if not role.startswith("expert."):
            return self.shard.linear(role, x)
        x2 = x.reshape(-1, x.shape[-1]).float()
        y = self.shard.linear(role, torch.cat([x2, self.probe(role, x2.shape[-1])]))
        n = x2.shape[0]
        self.outputs[role] = y[n:]
        return y[:n].reshape(*x.shape[:-1], y.shape[-1])


def compare_expert_probes(
    cfg: V4Config,
    plan: Plan,
    source: ProbedShard,
    converted: list[ProbedShard],
    mtp: int,
) -> tuple[list[tuple[str, str]], set[tuple[int, str]]]:
    """Each routed expert's probe outputs: the source linear against the ranks recombined (tp: w1/w3 rows
    concatenated, w2 partial sums added; ep: the owner's). Returns (message, tensor) failures and what was
    compared, for the coverage to credit: ``(rank, source part)`` for each part of each expert whose probe
    output every side computed, e.g. ``(1, "mtp.0.ffn.experts.5.w3")``."""
    opts = plan.options
    S = cfg.num_hidden_layers + mtp
    base = CONVERTED_TENSORS[opts.profile]["experts"].format(S=S)
    sfx = "weight_scale_inv" if layer_format(cfg, f"mtp.{mtp}").name == "fp8" else "weight_scale"
    bad: list[tuple[str, str]] = []
    compared: set[tuple[int, str]] = set()
    for j in range(cfg.n_routed_experts):
        holders = [c for c in converted if j in c.local_experts]
        for which in ("w1", "w3", "w2"):
            role = f"expert.{j}.{which}"
            want = source.outputs.get(role)
            outs = [c.outputs.get(role) for c in holders]
            if want is None or any(o is None for o in outs):
                continue  # not computed: the coverage counts it missing
            compared.update((c.rank, f"mtp.{mtp}.ffn.experts.{j}.{which}") for c in holders)
            if which == "w2" or len(holders) == 1:  # row parallel: partial sums added; ep: the owner's
                pairs = [
                    ("ranks summed" if len(outs) > 1 else f"rank {holders[0].rank}", want, torch.stack(outs).sum(0))
                ]
            else:  # column parallel: each rank's output columns are its slice of the source rows
                n = want.shape[-1] // len(outs)
                pairs = [
                    (f"rank {c.rank}", want[:, i * n : (i + 1) * n], o) for i, (c, o) in enumerate(zip(holders, outs))
                ]
            for where, ref, got in pairs:
                rel = (ref - got).abs().max().item() / max(ref.abs().max().item(), 1e-30)
                if rel <= LINEAR_MAX_REL:
                    continue
                w = f"{base}.{'w2' if which == 'w2' else 'w13'}_weight"
                bad.append(
                    (
                        f"tensor {w!r} (scale {w.replace('_weight', '_' + sfx)!r}) expert {j} ({where}): output of "
                        "part "
                        f"mtp.{mtp}.ffn.experts.{j}.{which} disagrees with the source linear: max_rel {rel:.3g} "
                        f"(needs <= {LINEAR_MAX_REL:g})",
                        w,
                    )
                )
                break
    return bad, compared
