"""Grouping of sources: every source tensor bound to the rule instance (rule, layer, MTP layer) that consumes it,
and the checks that each group is whole and consistent (every fused part, every expert, one dtype, one shape).

Source names are looked up in a table of the names the config implies (every rule instance expanded, experts by
string concatenation) instead of trying rule regexes per tensor; the regexes still match whatever the table does
not hold (extra layers, strays, unknowns).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.errors import PlanError
from ckpt_tool.mapping.rules import Rule, indexable

MTP_RE = re.compile(r"^mtp\.(0|[1-9][0-9]*)\.")


@dataclass
class SourceGroup:
    """Sources bound to one rule instance (fixed layer/mtp), before splitting."""

    rule: Rule
    bind: dict[str, int]
    parts: dict[tuple[int, int | None], TensorInfo] = field(default_factory=dict)  # (source idx, expert) -> info
    first: int = 0  # position of its first source in the checkpoint's order: groups are planned in that order
    # names[idx][j] / infos[idx][j]: source idx of expert j (one name for non-stack rules), when the parts
    # are exactly the names the config implies (built from the name table, nothing added); else None
    names: list[list[str]] | None = None
    infos: list[list[TensorInfo]] | None = None
    kinds: list[set[tuple[str, tuple[int, ...]]]] | None = None  # per source idx: its (dtype, shape)s


DTYPE_SHAPE = attrgetter("dtype", "shape")


def match_rule(rules: list[Rule], name: str) -> tuple[Rule, int, dict[str, int]] | None:
    mtp = MTP_RE.match(name)
    for rule in rules:
        if rule.when_mtp and mtp:
            first = mtp.group(1) == "0"
            if (rule.when_mtp == "first") != first:
                continue
        for idx, rx in enumerate(rule.regexes):
            m = rx.match(name)
            if m:
                return rule, idx, {k: int(v) for k, v in m.groupdict().items()}
    return None


def _binds(rule: Rule, cfg: V4Config) -> list[dict[str, int]]:
    """Every layer/mtp binding of ``rule`` the config implies (``{expert}`` is expanded by the caller)."""
    text = "".join(rule.sources)
    binds: list[dict[str, int]] = [{}]
    if "{layer}" in text:
        binds = [{**b, "layer": i} for b in binds for i in range(cfg.num_hidden_layers)]
    if "{vblock}" in text:
        binds = [{**b, "vblock": i} for b in binds for i in range(cfg.vision_n_layers)]
    if "{mtp}" in text:
        mtps = range(cfg.draft_layers)
        if rule.when_mtp == "first":
            mtps = range(min(1, cfg.draft_layers))
        elif rule.when_mtp == "rest":
            mtps = range(1, cfg.draft_layers)
        binds = [{**b, "mtp": i} for b in binds for i in mtps]
    return binds


def _expand(pattern: str, bind: dict[str, int], experts: range) -> list[str]:
    if "{expert}" not in pattern:
        return [pattern.format(**bind)]
    pre, post = pattern.format(**bind, expert="\0").split("\0")
    return [f"{pre}{j}{post}" for j in experts]


def group_sources(
    rules: list[Rule], sources: dict[str, TensorInfo], cfg: V4Config
) -> tuple[list[SourceGroup], dict[str, str], list[str]]:
    """Bind every source to its rule instance: (groups in order of their first source, dropped, unknown).

    The result is what matching every name against the rules in table order gives: the names the
    config implies come from the expanded table (a name matches at most one rule there, see
    :func:`rules.indexable`), the rest from the regexes.
    """
    pos = {name: i for i, name in enumerate(sources)}
    groups: dict[tuple[str, tuple], SourceGroup] = {}
    dropped: list[tuple[int, str, str]] = []
    found = _bind_by_table(rules, sources, cfg, pos, groups, dropped) if indexable(rules) else []
    unknown = _bind_by_regex(rules, _unclaimed(sources, found), sources, pos, groups, dropped)
    dropped.sort()
    return sorted(groups.values(), key=lambda g: g.first), {n: note for _p, n, note in dropped}, unknown


Groups = dict[tuple[str, tuple], SourceGroup]  # (rule id, sorted binding) -> its group
Parts = dict[tuple[int, int | None], TensorInfo]  # (source idx, expert) -> info


def _bind_by_table(
    rules: list[Rule],
    sources: dict[str, TensorInfo],
    cfg: V4Config,
    pos: dict[str, int],
    groups: Groups,
    dropped: list[tuple[int, str, str]],
) -> list[list[str]]:
    """Bind the sources the config implies (every rule instance expanded) into ``groups`` and ``dropped``;
    returns the names bound, per rule instance."""
    found: list[list[str]] = []
    expert_keys: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for rule in rules:
        experts = range(getattr(cfg, rule.experts_key) or 0)
        for bind in _binds(rule, cfg):
            per_idx = [_expand(p, bind, experts) for p in rule.sources]
            if rule.kind == "drop":
                hits = [n for n in per_idx[0] if n in pos]
                dropped += [(pos[n], n, rule.note) for n in hits]
                found.append(hits)
                continue
            parts, have, per_idx_infos = _instance_parts(rule, per_idx, sources, experts, expert_keys)
            if not parts:
                continue
            key = (rule.id, tuple(sorted(bind.items())))
            if key in groups:  # two rules with one id (never in the shipped tables): merge, old-style
                g = groups[key]
                g.parts.update(parts)
                g.first = min(g.first, min(map(pos.__getitem__, have)))
                g.names = g.infos = None
            else:
                first = min(map(pos.__getitem__, have))
                complete = per_idx_infos is not None
                groups[key] = SourceGroup(
                    rule, dict(bind), parts, first, *((per_idx, per_idx_infos) if complete else (None, None))
                )
            found.append(have)
    return found


def _instance_parts(
    rule: Rule,
    per_idx: list[list[str]],
    sources: dict[str, TensorInfo],
    experts: range,
    expert_keys: dict[tuple[int, int], list[tuple[int, int]]],
) -> tuple[Parts, list[str], list[list[TensorInfo]] | None]:
    """The parts of one rule instance the checkpoint holds, their names, and per source idx its infos (None when
    some name the config implies is missing)."""
    get = sources.get
    parts: Parts = {}
    complete = True
    have: list[str] = []
    per_idx_infos = []
    for idx, names in enumerate(per_idx):
        lacking = False
        try:
            infos = list(map(sources.__getitem__, names))
        except KeyError:  # (``None in infos`` would call TensorInfo.__eq__ per element)
            infos, lacking = list(map(get, names)), True
        per_idx_infos.append(infos)
        if len(names) == 1 and "{expert}" not in rule.sources[idx]:
            keys: Sequence = ((idx, None),)
        else:
            ek = (idx, len(experts))
            keys = expert_keys.get(ek) or expert_keys.setdefault(ek, [(idx, j) for j in experts])
        if lacking:
            complete = False
            hit = [(k, n, i) for k, n, i in zip(keys, names, infos) if i is not None]
            parts.update((k, i) for k, _n, i in hit)
            have += [n for _k, n, _i in hit]
        else:
            parts.update(zip(keys, infos))
            have += names
    return parts, have, per_idx_infos if complete else None


def _unclaimed(sources: dict[str, TensorInfo], found: list[list[str]]) -> Sequence[str]:
    """The source names, in checkpoint order, that no expanded rule instance bound."""
    claimed = sum(map(len, found))
    if not claimed:
        return sources  # type: ignore[return-value]
    if claimed == len(sources):
        return ()
    taken = set(chain.from_iterable(found))
    return [n for n in sources if n not in taken]


def _bind_by_regex(
    rules: list[Rule],
    rest: Sequence[str],
    sources: dict[str, TensorInfo],
    pos: dict[str, int],
    groups: Groups,
    dropped: list[tuple[int, str, str]],
) -> list[str]:
    """Bind ``rest`` by matching each name against the rule regexes in table order; returns the names none match."""
    unknown: list[str] = []
    for name in rest:
        hit = match_rule(rules, name)
        if hit is None:
            unknown.append(name)
            continue
        rule, idx, bind = hit
        if rule.kind == "drop":
            dropped.append((pos[name], name, rule.note))
            continue
        expert = bind.pop("expert", None)
        key = (rule.id, tuple(sorted(bind.items())))
        g = groups.get(key)
        if g is None:
            g = groups[key] = SourceGroup(rule, bind, first=pos[name])
        g.parts[(idx, expert)] = sources[name]
        g.first = min(g.first, pos[name])
        g.names = g.infos = None
    return unknown


def group_ok(g: SourceGroup, cfg: V4Config) -> bool:
    """Whether :func:`check_group` would pass, decided with set operations (no names formatted)."""
    rule, n = g.rule, len(g.rule.sources)
    if g.infos is None:
        return False  # irregular or incomplete: the full check decides
    if rule.kind == "stack":
        kinds = g.kinds if g.kinds is not None else _kinds(g)
        if any(len(k) != 1 for k in kinds):
            return False  # experts of one source disagree
        reps = [next(iter(k)) for k in kinds]
        return len({d for d, _s in reps}) == 1 and len({s[1:] for _d, s in reps}) == 1
    infos = g.parts.values()
    return len(g.parts) == n and len({t.dtype for t in infos}) == 1 and len({t.shape[1:] for t in infos}) == 1


def _kinds(g: SourceGroup) -> list[set[tuple[str, tuple[int, ...]]]]:
    assert g.infos is not None
    return [set(map(DTYPE_SHAPE, infos)) for infos in g.infos]


def find_uniform_stacks(groups: list[SourceGroup]) -> dict[tuple[str, tuple], tuple[str, tuple[int, ...]]]:
    """(source pattern, binding) → (dtype, shape) for every complete stack source whose experts all agree.

    A stacked weight's split check looks at each expert's scale (and the other way round); when that
    sibling source is in here, all experts' siblings look alike and expert 0 speaks for all.
    """
    out = {}
    for g in groups:
        if g.rule.kind == "stack" and g.infos is not None:
            g.kinds = _kinds(g)
            bind = tuple(sorted(g.bind.items()))
            for pattern, kinds in zip(g.rule.sources, g.kinds):
                if len(kinds) == 1:
                    out[(pattern, bind)] = next(iter(kinds))
    return out


def in_source_order(g: SourceGroup, sources: dict[str, TensorInfo]) -> SourceGroup:
    """``g`` with its parts in the order matching met them (what :func:`check_group` messages list)."""
    pos = {name: i for i, name in enumerate(sources)}
    parts = dict(sorted(g.parts.items(), key=lambda kv: pos[kv[1].name]))
    return SourceGroup(g.rule, g.bind, parts, g.first, None)


def check_group(g: SourceGroup, cfg: V4Config) -> None:
    rule = g.rule
    where = rule.target.format(**{**g.bind, "spec": cfg.num_hidden_layers + g.bind.get("mtp", 0)})  # type: ignore[union-attr]
    if rule.kind == "stack":
        E = getattr(cfg, rule.experts_key)
        for idx, pat in enumerate(rule.sources):
            have = sorted(e for (i, e) in g.parts if i == idx)
            if have != list(range(E)):
                missing = sorted(set(range(E)) - set(have))
                extra = sorted(set(have) - set(range(E)))
                raise PlanError(
                    f"{where}: routed experts incomplete for {pat.format(**g.bind, expert='{j}')}: "
                    f"missing {missing or '-'}, unexpected {extra or '-'} (config {rule.experts_key}={E}); "
                    f"the checkpoint is incomplete — download it again or fix {rule.experts_key} in config.json"
                )
    else:
        missing = [
            s.format(**g.bind)
            for i, s in enumerate(rule.sources)
            if (i, None) not in g.parts and i not in rule.optional
        ]
        if missing:
            raise PlanError(
                f"{where}: fused parts missing from the checkpoint: {', '.join(missing)}; the checkpoint is incomplete "
                "— "
                "download it again"
            )
    infos = list(g.parts.values())
    dtypes = {t.dtype for t in infos}
    if len(dtypes) > 1:
        raise PlanError(f"{where}: parts have different dtypes: " + ", ".join(f"{t.name}={t.dtype}" for t in infos))
    tails = {t.shape[1:] for t in infos}
    if len(tails) > 1:
        raise PlanError(
            f"{where}: parts disagree in trailing shape: " + ", ".join(f"{t.name}={list(t.shape)}" for t in infos)
        )
    if rule.kind == "stack":
        shapes = {}
        for (idx, _e), t in g.parts.items():
            shapes.setdefault(idx, set()).add(t.shape)
        for idx, s in shapes.items():
            if len(s) > 1:
                raise PlanError(f"{where}: experts disagree in shape for {rule.sources[idx]}: {sorted(s)}")
