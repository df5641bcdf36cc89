"""Completeness against the engine: every source tensor the engine needs, derived from config.json alone.

The rule table says how a tensor is renamed when it is there; this module says what must be there.
vLLM builds every main layer ``0..num_hidden_layers-1`` with the modules its compress ratio and hash
status imply, every routed expert, the embedding, head, final norm and ``hc_head``, and every MTP
layer; a tensor the checkpoint lacks is a KeyError or an uninitialised parameter at engine start-up.
We find it from the headers, before a byte is written, and name what is missing grouped by layer.

Layout (research/v4_format.md §2): compress ratio 0 → sliding-window only; ratio > 0 → a compressor;
ratio 4 → also the indexer (with its own compressor). Hash layers (``L < num_hash_layers``) route
through ``ffn.gate.tid2eid`` and have no gate bias; the others carry ``ffn.gate.bias`` (noaux_tc).
MTP blocks never compress and always carry the bias. An MTP layer's own embedding/head are optional:
the plan materializes them from ``embed.weight`` / ``head.weight`` when absent.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .config import V4Config
from .errors import MTP_MISSING_MESSAGE, PlanError

GLOBAL_GROUP = "globals"
# A group whose missing names exceed this is summarised instead of listed.
_MAX_LISTED = 8


def name_lines(names: list[str]) -> str | None:
    """``names`` as one text, each after a newline (``"\\nA\\nB"``): what the regex counts below scan at
    C speed. None when a name holds a newline itself (then the lines would not be the names)."""
    joined = "\n" + "\n".join(names)
    return joined if joined.count("\n") == len(names) else None


def count_by_index(names: Iterable[str], head: str, lines: str | None = None) -> dict[int, int]:
    """Tensor count per ``N`` of the names ``{head}N.…`` (``head`` like ``layers.`` or ``mtp.``).

    One regex pass over the names' :func:`name_lines` (pass ``lines`` when already joined): a pattern
    that starts with a literal (``\\nmtp.``) lets the regex engine skip to candidates at C speed
    (inspect counts 69k names this way); without lines each name is matched on its own.
    """
    names = list(names)
    lines = name_lines(names) if lines is None else lines
    index = rf"{re.escape(head)}(0|[1-9][0-9]*)\."  # an index as the engine writes it
    if lines is not None:
        found = re.findall("\n" + index, lines)
    else:
        found = [m.group(1) for n in names if (m := re.match(index, n))]
    return {int(i): count for i, count in Counter(found).items()}


def layer_indices(names: Iterable[str], head: str = "layers.", lines: str | None = None) -> set[int]:
    """Every ``N`` of the names ``{head}N.…``, without a match per name.

    A regex run matches a whole stretch of consecutive names under one index (``\\1`` repeats the
    index just read), so a shard listing its layers in order costs one match per layer, not per name
    (inspect reads 66k layer names).
    """
    names = list(names)
    lines = name_lines(names) if lines is None else lines
    if lines is None:
        return set(count_by_index(names, head))
    index = rf"{re.escape(head)}(0|[1-9][0-9]*)\."
    run = re.compile(rf"\n{index}[^\n]*(?:\n{re.escape(head)}\1\.[^\n]*)*")
    return set(map(int, run.findall(lines)))


def _linear(prefix: str) -> list[str]:
    return [f"{prefix}.weight", f"{prefix}.scale"]


def block_tensors(prefix: str, config: V4Config, *, ratio: int, hash_layer: bool) -> list[str]:
    """Source names of one decoder block (a main layer or an MTP block) under ``prefix``."""
    names = [f"{prefix}.attn_norm.weight", f"{prefix}.ffn_norm.weight"]
    names += [f"{prefix}.hc_{part}_{t}" for part in ("attn", "ffn") for t in ("fn", "base", "scale")]
    a = f"{prefix}.attn"
    for lin in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
        names += _linear(f"{a}.{lin}")
    names += [f"{a}.q_norm.weight", f"{a}.kv_norm.weight", f"{a}.attn_sink"]
    if ratio:
        c = f"{a}.compressor"
        names += [f"{c}.wkv.weight", f"{c}.wgate.weight", f"{c}.ape", f"{c}.norm.weight"]
    if ratio == 4:
        i = f"{a}.indexer"
        names += _linear(f"{i}.wq_b") + [f"{i}.weights_proj.weight"]
        names += [f"{i}.compressor.wkv.weight", f"{i}.compressor.wgate.weight", f"{i}.compressor.ape", f"{i}.compressor.norm.weight"]
    f = f"{prefix}.ffn"
    names += [f"{f}.gate.weight", f"{f}.gate.tid2eid" if hash_layer else f"{f}.gate.bias"]
    if config.n_shared_experts:
        for w in ("w1", "w2", "w3"):
            names += _linear(f"{f}.shared_experts.{w}")
    # 6 names per routed expert, 66k in a V4 checkpoint: the same suffixes for every block, joined by concatenation
    names += map(f"{f}.experts".__add__, _expert_suffixes(config.n_routed_experts))
    return names


@functools.lru_cache(maxsize=4)
def _expert_suffixes(experts: int) -> tuple[str, ...]:
    return tuple(f".{j}.{w}.{k}" for j in range(experts) for w in ("w1", "w2", "w3") for k in ("weight", "scale"))


def mtp_tensors(i: int, config: V4Config) -> list[str]:
    """Source names MTP layer ``i`` must hold (its own embedding/head are optional: materialized)."""
    p = f"mtp.{i}"
    names = [f"{p}.enorm.weight", f"{p}.hnorm.weight", *_linear(f"{p}.e_proj"), *_linear(f"{p}.h_proj")]
    names += block_tensors(p, config, ratio=0, hash_layer=False)
    names += [f"{p}.norm.weight", f"{p}.hc_head_fn", f"{p}.hc_head_base", f"{p}.hc_head_scale"]
    return names


def required_tensors(config: V4Config, components: Iterable[str]) -> dict[str, list[str]]:
    """Group (``globals``, ``layers.L``, ``mtp.i``) → the source names the engine needs, for ``components``."""
    components = set(components)
    groups: dict[str, list[str]] = {}
    if "model" in components:
        groups[GLOBAL_GROUP] = ["embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"]
        for layer in range(config.num_hidden_layers):
            groups[f"layers.{layer}"] = block_tensors(
                f"layers.{layer}",
                config,
                ratio=config.compress_ratio(layer),
                hash_layer=layer < config.num_hash_layers,
            )
    if "mtp" in components:
        for i in range(config.num_nextn_predict_layers):
            groups[f"mtp.{i}"] = mtp_tensors(i, config)
    return groups


@dataclass(frozen=True)
class Completeness:
    """What a checkpoint lacks against the engine's needs, for the components being converted."""

    missing_groups: dict[str, list[str]]  # group -> missing names (in required order)
    required_counts: dict[str, int]  # group -> how many names the group requires
    mtp_absent: tuple[int, ...]  # MTP layers with no tensor at all (the engine's own message applies)
    mtp_waived: bool  # --only model and no MTP layer at all: allowed, with a note

    @property
    def complete(self) -> bool:
        return not self.missing_groups and not self.mtp_absent

    def message(self, config: V4Config) -> str:
        """The one-line verdict: the engine's own sentence for an absent MTP layer, grouped names otherwise."""
        absent = [MTP_MISSING_MESSAGE.format(layer=config.num_hidden_layers + i) for i in self.mtp_absent]
        if not self.missing_groups:
            return " ".join(absent)
        groups = [describe_missing(g, names, self.required_counts[g]) for g, names in self.missing_groups.items()]
        return (
            " ".join(absent + ["checkpoint lacks tensors the engine needs: " + "; ".join(groups)])
            + " — the checkpoint is incomplete: download the missing files again, or use a checkpoint that has them"
        )


def check_completeness(
    config: V4Config, names: Iterable[str], only: str | None = None, *, mtp_present: set[int] | None = None
) -> Completeness:
    """Compare source tensor ``names`` with what the engine needs for the components ``only`` selects.

    ``only="model"`` allows a checkpoint without any MTP layer (re-quantized uploads often drop them):
    the target model converts and the draft must come from elsewhere. ``mtp_present``: the MTP indices
    with any tensor, when the caller has counted them already.
    """
    have = names if isinstance(names, (set, frozenset, dict)) else set(names)  # a headers dict as it is: no copy
    if mtp_present is None:
        mtp_present = set(count_by_index(have, "mtp."))
    components = {"model", "mtp"} if only is None else {only}
    mtp_waived = only == "model" and not mtp_present and config.num_nextn_predict_layers > 0
    absent = tuple(i for i in range(config.num_nextn_predict_layers) if i not in mtp_present)
    if only == "model":
        absent = ()  # MTP layers are not converted: none need be there (a partial one still fails the plan)
    groups = required_tensors(config, components)
    missing: dict[str, list[str]] = {}
    for group, required in groups.items():
        if group.startswith("mtp.") and int(group[4:]) in absent:
            continue  # reported with the engine's own message
        if all(map(have.__contains__, required)):
            continue
        lack = [n for n in required if n not in have]
        if lack:
            missing[group] = lack
    return Completeness(missing, {g: len(r) for g, r in groups.items()}, absent, mtp_waived)


def require_complete(config: V4Config, names: Iterable[str], only: str | None = None) -> Completeness:
    """:func:`check_completeness`, raising PlanError with its one-line verdict when anything is missing."""
    result = check_completeness(config, names, only)
    if not result.complete:
        raise PlanError(result.message(config))
    return result


def describe_missing(group: str, names: list[str], required: int) -> str:
    """``layers.1.*: all 77 tensors missing`` or ``layers.1.attn.wo_b.weight, .scale missing``."""
    if len(names) == required:
        return f"{group}.*: all {required} tensors missing" if group != GLOBAL_GROUP else f"all {required} global tensors missing ({', '.join(names)})"
    items = _collapse_experts(names)
    items = _collapse_linears(items)
    shown = items[:_MAX_LISTED]
    more = f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return ", ".join(shown) + more + " missing"


_EXPERT_RE = re.compile(r"^(?P<head>.+\.ffn\.experts)\.(?P<j>\d+)\.(?P<tail>w[123]\.(?:weight|scale))$")


def _collapse_experts(names: list[str]) -> list[str]:
    """Routed experts lacking the same tensor collapse to ``...experts.{3,5}.w1.weight``, in first-seen order."""
    ids: dict[str, list[str]] = {}  # display template (or plain name) -> expert ids
    for n in names:
        m = _EXPERT_RE.match(n)
        key = f"{m.group('head')}.{{}}.{m.group('tail')}" if m else n
        ids.setdefault(key, []).append(m.group("j") if m else "")
    out = []
    for key, js in ids.items():
        if js == [""]:
            out.append(key)
        else:
            out.append(key.format(js[0] if len(js) == 1 else "{" + ",".join(js) + "}"))
    return out


def _collapse_linears(items: list[str]) -> list[str]:
    """``X.weight`` followed by ``X.scale`` reads ``X.weight, .scale``."""
    out: list[str] = []
    for item in items:
        if out and item.endswith(".scale") and out[-1] == item[: -len(".scale")] + ".weight":
            out[-1] += ", .scale"
        else:
            out.append(item)
    return out
