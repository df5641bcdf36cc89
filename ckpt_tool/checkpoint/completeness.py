"""Completeness against the engine: every source tensor the engine needs (:mod:`.expected`) present in the
checkpoint, and what is missing named, grouped by layer.

The rule table says how a tensor is renamed when it is there; this module says what must be there.
vLLM builds every main layer ``0..num_hidden_layers-1`` with the modules its compress ratio and hash
status imply, every routed expert, the embedding, head, final norm and ``hc_head``, and every MTP
layer; a tensor the checkpoint lacks is a KeyError or an uninitialised parameter at engine start-up.
We find it from the headers, before a byte is written, and name what is missing grouped by layer.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.expected import GLOBAL_GROUP, MARKOV_KEY, TARGETS_KEY, required_tensors
from ckpt_tool.errors import DSPARK_STAGE_MISSING_MESSAGE, MTP_MISSING_MESSAGE, PlanError

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


@dataclass(frozen=True)
class Completeness:
    """What a checkpoint lacks against the engine's needs, for the components being converted."""

    missing_groups: dict[str, list[str]]  # group -> missing names (in required order)
    required_counts: dict[str, int]  # group -> how many names the group requires
    mtp_absent: tuple[int, ...]  # draft layers with no tensor at all (the engine's own message applies)
    mtp_waived: bool  # --only model and no draft layer at all: allowed, with a note
    mismatch: str | None = None  # mtp.* hold another draft kind than config.json describes (nothing is missing)

    @property
    def complete(self) -> bool:
        return not self.missing_groups and not self.mtp_absent and self.mismatch is None

    def message(self, config: V4Config) -> str:
        """The one-line verdict: the draft-kind mismatch alone when there is one; else the engine's own sentence
        for an absent MTP layer (ours for an absent DSpark stage), grouped names otherwise."""
        if self.mismatch is not None:
            return self.mismatch
        absent = [absent_draft_layer(config, i) for i in self.mtp_absent]
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
    lines = None  # the names joined (name_lines) once, for the MTP count and the draft-kind signs
    if mtp_present is None:
        lines = name_lines(list(have))
        mtp_present = set(count_by_index(have, "mtp.", lines))
    components = {"model", "mtp"} if only is None else {only}
    mtp_waived = only == "model" and not mtp_present and config.draft_layers > 0
    if only != "model" and mtp_present:
        mismatch = draft_kind_mismatch(config, have, name_lines(list(have)) if lines is None else lines)
        if mismatch is not None:
            return Completeness({}, {}, (), False, mismatch)
    absent = tuple(i for i in range(config.draft_layers) if i not in mtp_present)
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


# What tells the two draft kinds apart in a checkpoint's names: a classic MTP layer's input projections, a DSpark
# draft's head stack (nvidia/mtp.py and nvidia/dspark.py load them; the other class has no such parameter).
CLASSIC_MTP_SIGNS = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight")
DSPARK_SIGNS = ("main_proj.weight", "main_norm.weight", "markov_head.", "confidence_head.")


def _signs(names: Iterable[str], signs: tuple[str, ...], lines: str | None = None) -> list[str]:
    """The names ``mtp.N.<sign>…``, sorted; found in the names' :func:`name_lines` at C speed when given (a V4-Pro
    checkpoint has 145k names, a few hundred of them ``mtp.``)."""
    sign = r"mtp\.(?:0|[1-9][0-9]*)\.(?:" + "|".join(map(re.escape, signs)) + ")"
    if lines is not None:
        return sorted(re.findall(rf"\n({sign}[^\n]*)", lines))
    pattern = re.compile("^" + sign)
    return sorted(n for n in names if n.startswith("mtp.") and pattern.match(n))


def draft_kind_mismatch(config: V4Config, names: Iterable[str], lines: str | None = None) -> str | None:
    """One line when ``mtp.*`` holds the other draft kind than config.json describes (None when they agree).

    vLLM takes the draft kind from the speculative method the user names, and builds its parameters from
    config.json: DSpark stages served as MTP end in ``KeyError ... mtp_block.main_norm`` (nvidia/mtp.py), and
    classic MTP weights under a DSpark config leave every DSpark head uninitialised. Nothing is missing, so the
    verdict names the config, not a download. ``lines``: the names' :func:`name_lines`, when already joined."""
    if config.is_dspark:
        found = _signs(names, CLASSIC_MTP_SIGNS, lines)
        if found:
            return (
                f"config.json names {TARGETS_KEY} (a DSpark draft), but mtp.* hold a classic MTP head "
                f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}), which vLLM's DSpark draft has no "
                "parameter for; config.json is not the one released with these weights: use that one (it has no "
                "dspark_* keys), or convert the target alone with --only model"
            )
        return None
    found = _signs(names, DSPARK_SIGNS, lines)
    if found:
        return (
            f"mtp.* hold DSpark stages ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}), but config.json "
            f"has no {TARGETS_KEY}, so vLLM would build a classic MTP draft and fail on them (KeyError ... "
            "mtp_block.main_norm); config.json is not the one released with these weights: use that one (it names "
            f"{TARGETS_KEY} and {MARKOV_KEY}), or convert the target alone with --only model"
        )
    return None


def absent_draft_layer(config: V4Config, i: int) -> str:
    """The sentence for draft layer ``i`` without any tensor: vLLM's own for a classic MTP layer."""
    if config.is_dspark:
        return DSPARK_STAGE_MISSING_MESSAGE.format(stage=i, stages=config.draft_layers)
    return MTP_MISSING_MESSAGE.format(layer=config.num_hidden_layers + i)


def require_complete(config: V4Config, names: Iterable[str], only: str | None = None) -> Completeness:
    """:func:`check_completeness`, raising PlanError with its one-line verdict when anything is missing."""
    result = check_completeness(config, names, only)
    if not result.complete:
        raise PlanError(result.message(config))
    return result


def describe_missing(group: str, names: list[str], required: int) -> str:
    """``layers.1.*: all 77 tensors missing`` or ``layers.1.attn.wo_b.weight, .scale missing``."""
    if len(names) == required:
        return (
            f"{group}.*: all {required} tensors missing"
            if group != GLOBAL_GROUP
            else f"all {required} global tensors missing ({', '.join(names)})"
        )
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
