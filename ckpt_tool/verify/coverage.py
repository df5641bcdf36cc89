"""Coverage of the numeric level: the units expected (the unit table on every rank written, and whatever a rank's
header holds that no unit names) against the units the code that ran them recorded as computed."""

from __future__ import annotations

import math

from ckpt_tool.checkpoint.headers import ShardHeader
from ckpt_tool.mapping.plan import Plan
from ckpt_tool.verify.tensor_units import LinearUnit, Unit, unit_label, unit_parts, unit_tensors


class Coverage:
    """What the numeric level computed, counted in units of one source part of one engine tensor on one rank:
    a fused weight counts once per part (``fused_wqa_wkv``: wq_a and wkv; ``gate_up_proj``: w1 and w3), a
    stacked routed-expert tensor once per expert and part (w13: w1 and w3; w2), weight and scale together.

    Expected: every unit of the unit table on every rank the plan writes, plus whatever a rank's header holds
    that no unit names (a tensor, a stacked expert slot) — nothing can compute those, so they count against
    coverage. Computed: only what the code that ran a part records (:class:`LinearRunner`, the MTP forward's
    expert probes via :meth:`credit`), never inferred from names. Nothing to cover is n/a, never 100 %.
    """

    SHOWN = 50  # units not computed listed by name in the report

    def __init__(self, plan: Plan, headers: dict[str, ShardHeader], units: dict[str, list[Unit]]) -> None:
        self.units = dict(units)  # the caller may narrow what it runs; what is expected stays
        self.ranks = {comp: sorted({f.rank for f in plan.files if f.component == comp}) for comp in units}
        self.computed: dict[str, dict[tuple[str, str], int]] = {comp: {} for comp in units}
        self.unnamed: dict[str, list[tuple[int, str]]] = {
            comp: _unnamed(plan, headers, comp, us) for comp, us in units.items()
        }

    def add(self, component: str, computed: dict[tuple[str, str], int]) -> None:
        """A runner's record: ``(unit label, source part) -> bits of the ranks computed``."""
        done = self.computed[component]
        for key, bits in computed.items():
            done[key] = done.get(key, 0) | bits

    def credit(self, component: str, records: set[tuple[int, str]]) -> None:
        """``(rank, source part)`` pairs another computation compared with the source (the MTP forward's expert
        probes): the unit holding that part counts as computed on that rank."""
        holders: dict[str, list[str]] = {}
        for u in self.units[component]:
            for src in unit_parts(u):
                holders.setdefault(src, []).append(unit_label(u))
        done = self.computed[component]
        for rank, src in records:
            for label in holders.get(src, ()):
                done[label, src] = done.get((label, src), 0) | 1 << rank

    def summary(self) -> tuple[dict, list[str]]:
        """The report's coverage (``checked`` / ``total`` units, ``percent`` or None when there is nothing to
        cover; per component and rank), and the first :attr:`SHOWN` units not computed, named."""
        components: dict[str, dict] = {}
        missed: list[str] = []
        for comp, units in self.units.items():
            tally = {r: [0, 0] for r in self.ranks[comp]}  # rank -> [checked, total]
            done = self.computed[comp]
            for u in units:
                label = unit_label(u)
                for src in unit_parts(u):
                    bits = done.get((label, src), 0)
                    for r in u.ranks:
                        if r not in tally:
                            continue  # a rank the plan does not write (convert --ranks)
                        tally[r][1] += 1
                        if bits >> r & 1:
                            tally[r][0] += 1
                        elif len(missed) < self.SHOWN:
                            missed.append(f"{comp} rank {r}: {label} part {src}")
            for r, what in self.unnamed[comp]:
                tally[r][1] += 1
                if len(missed) < self.SHOWN:
                    missed.append(f"{comp} rank {r}: {what} (no numeric check computes it)")
            ranks = {str(r): _tally(c, t) for r, (c, t) in tally.items()}
            components[comp] = {
                **_tally(sum(c for c, _ in tally.values()), sum(t for _, t in tally.values())),
                "ranks": ranks,
            }
        whole = _tally(sum(c["checked"] for c in components.values()), sum(c["total"] for c in components.values()))
        return {"unit": "one source part of one engine tensor on one rank", **whole, "components": components}, missed


def _tally(checked: int, total: int) -> dict:
    """``percent`` floored (99.996 % shows 99.99, never 100), None for 0 of 0."""
    return {"checked": checked, "total": total, "percent": math.floor(10000 * checked / total) / 100 if total else None}


def _unnamed(plan: Plan, headers: dict[str, ShardHeader], comp: str, units: list[Unit]) -> list[tuple[int, str]]:
    """``(rank, what)`` for each tensor in the rank's headers that no unit names, and each stacked expert slot
    of a named tensor that no unit computes."""
    named: dict[int, set[str]] = {}
    slots: dict[tuple[int, str], set[int]] = {}
    for u in units:
        for i, r in enumerate(u.ranks):
            named.setdefault(r, set()).update(unit_tensors(u))
            if isinstance(u, LinearUnit) and u.expert is not None:
                for name in unit_tensors(u):
                    slots.setdefault((r, name), set()).add(u.local[i])
    found: list[tuple[int, str]] = []
    for f in plan.files:
        if f.component != comp or f.relpath not in headers:
            continue
        for name, info in headers[f.relpath].tensors.items():
            if name not in named.get(f.rank, ()):
                found.append((f.rank, f"{f.relpath}: {name}"))
            elif (f.rank, name) in slots and info.shape:
                found += [
                    (f.rank, f"{f.relpath}: {name} slot {k}")
                    for k in range(info.shape[0])
                    if k not in slots[f.rank, name]
                ]
    return found
