"""Agreement of the headers with config.json: every stored tensor's shape and dtype against what the config implies
(:mod:`.expected`).

vLLM builds its parameters from config.json, and its sharded loader copies a smaller tensor into a slice of a larger
parameter with only a warning, so a checkpoint whose config.json is another's (the wrong variant's, one edited for
another expert count) would start as a wrong model. :func:`require_agreement` refuses it in one line naming the
config key, a tensor and expected vs actual.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Any

from ckpt_tool.checkpoint.completeness import name_lines
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.expected import (
    BLOCK_KEY,
    EXPERT_DTYPE,
    EXPERT_ROLE,
    RATIO_KEY,
    Expected,
    expected_shapes,
    union_keys,
)
from ckpt_tool.checkpoint.expert_format import MOE_QUANT_KEY
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.errors import PlanError

_EXPERT_INDEX = re.compile(
    r"\.ffn\.experts\.[0-9]+\."
)  # any digits: the plain pattern substitutes 69k names ~1.5x faster


def tensor_roles(names: list[str], lines: str | None = None) -> list[str]:
    """Each name with its routed-expert index as ``*`` (``layers.3.ffn.experts.*.w1.weight``): the key of
    :func:`expected_shapes`. One substitution over the names' :func:`name_lines` (pass ``lines`` when
    already joined), not a match per name."""
    lines = name_lines(names) if lines is None else lines
    if lines is None:
        return [_EXPERT_INDEX.sub(EXPERT_ROLE, n) for n in names]
    roles = _EXPERT_INDEX.sub(EXPERT_ROLE, lines).split("\n")
    del roles[0]
    return roles


Kind = tuple[str, str, tuple[int, ...]]  # (role, dtype, shape)
DtypeShape = tuple[str, tuple[int, ...]]


def shape_kinds(
    names: list[str],
    kinds: Iterable[Hashable],
    kind_of: Callable[[Any], DtypeShape] | None = None,
    lines: str | None = None,
) -> set[Kind]:
    """The distinct (role, dtype, shape) of tensors ``names``: what :func:`kinds_agree` checks. A few
    thousand for a V4 checkpoint's 69k tensors, whose routed experts share a handful; plain builtins,
    so a forked helper can hand them back.

    ``kinds``: each tensor's (dtype, shape), or a key ``kind_of`` turns into one (a parsed header's kind
    numbers: pairing 69k names with small ints, then looking up the few distinct ones, costs less).
    """
    pairs = set(zip(tensor_roles(names, lines), kinds))
    if kind_of is None:
        return {(role, dtype, shape) for role, (dtype, shape) in pairs}
    return {(role, *kind_of(kind)) for role, kind in pairs}


def kinds_agree(config: V4Config, kinds: Iterable[Kind]) -> bool:
    """Whether every tensor behind ``kinds`` that config.json implies has the shape and dtype it implies
    (names it does not imply are not judged here: completeness and the plan's rules are)."""
    expected = expected_shapes(config)
    for role, dtype, shape in kinds:
        e = expected.get(role)
        if e is not None and not e.agrees(dtype, shape):
            return False
    return True


# what a routed expert's weight dtype says its format is
STORED_FORMAT = {"I8": "fp4", "U8": "fp4", "F8_E4M3": "fp8"}


@dataclass(frozen=True)
class Disagreement:
    """Tensors whose headers disagree with config.json: the key to blame (None where no key explains
    them), the first tensor that shows it, and how many tensors disagree in all."""

    key: str | None
    tensor: TensorInfo
    expected: Expected
    count: int

    def message(self, config: V4Config) -> str:
        """One line: the key and its value, the tensor and its file, expected vs actual, the count, the fix."""
        t = self.tensor
        actual = f"{t.dtype} {list(t.shape)}"
        if self.key == EXPERT_DTYPE and t.dtype in STORED_FORMAT and _EXPERT_INDEX.search(t.name):
            actual += f" ({STORED_FORMAT[t.dtype]})"
        more = self.count - 1
        more = f" (and {more:,} more tensor{'s disagree' if more > 1 else ' disagrees'})" if more else ""
        if self.key is None:
            return (
                f"tensor {t.name!r} in {t.file} is {actual}, but config.json implies {self.expected.describe()}{more}; "
                "the checkpoint does not have DeepSeek V4's layout: convert the original checkpoint with its own "
                "config.json"
            )
        return (
            f"{_key_value(config, self.key, t.name)} in config.json, but tensor {t.name!r} in {t.file} is {actual}, "
            f"not the {self.expected.describe()} it implies{more}; config.json is not the one released with these "
            f"weights: use that one, or fix {self.key.split('.')[-1]}"
        )


def _key_value(config: V4Config, key: str, name: str) -> str:
    """``hidden_size 640``, ``expert_dtype 'fp8'``, ``compress_ratios[1] 128`` (the layer of ``name``)."""
    if key == RATIO_KEY:
        layer = re.match(r"layers\.(\d+)\.", name)
        if layer:
            return f"{key}[{layer.group(1)}] {config.compress_ratio(int(layer.group(1)))}"
        return f"{key} {list(config.compress_ratios)}"
    if key == BLOCK_KEY:
        return f"{key} {list(config.weight_block_size)}"
    if key == MOE_QUANT_KEY:  # NVIDIA's NVFP4 exports (checkpoint.expert_format): it chooses the experts' format
        return f"{key} {config.moe_quant.algo!r}"
    return f"{key} {getattr(config, key)!r}"


def config_disagreement(config: V4Config, tensors: Iterable[TensorInfo]) -> Disagreement | None:
    """Every tensor config.json implies against what it implies, one by one, in checkpoint order (file, then
    offset: the same first tensor whether the headers came from local shards or the hub's metadata).

    The key to blame is the one most disagreeing tensors could be explained by: an edited ``hidden_size``
    shows in nearly every tensor, ``num_attention_heads`` in a few per layer that all involve it, while
    ``head_dim`` or ``o_groups`` share only some of them. On a tie, the key whose tensors disagree the
    most often (``n_shared_experts`` over ``moe_intermediate_size``, which the routed experts share too),
    then the first seen.
    """
    expected = expected_shapes(config)
    infos = sorted(tensors, key=_PLACE)
    roles = tensor_roles([t.name for t in infos])
    found: list[tuple[TensorInfo, Expected, tuple[str, ...]]] = []
    for info, role in zip(infos, roles):
        e = expected.get(role)
        if e is not None and not e.agrees(info.dtype, info.shape):
            found.append((info, e, e.blame(info.dtype, info.shape)))
    if not found:
        return None
    votes = Counter(key for *_, keys in found for key in keys)
    involved: Counter[str] = Counter()  # tensors checked whose shape or dtype a key takes part in
    for role, n in Counter(roles).items():
        if (e := expected.get(role)) is not None:
            for key in union_keys(*e.dim_keys, (e.dtype_key,) if e.dtype_key else ()):
                involved[key] += n
    key = max(votes, key=lambda k: (votes[k], votes[k] / involved[k])) if votes else None
    info, e, _ = next(f for f in found if key is None or key in f[2])
    return Disagreement(key, info, e, len(found))


_DTYPE_SHAPE = itemgetter(1, 2)
_PLACE = attrgetter("file", "start")


def require_agreement(config: V4Config, tensors: dict[str, TensorInfo]) -> None:
    """Raise PlanError naming the key, a tensor and expected vs actual when a header disagrees with what
    config.json implies. The distinct kinds are checked first; tensors one by one only when one disagrees."""
    infos = tensors.values()
    if kinds_agree(config, shape_kinds(list(tensors), map(_DTYPE_SHAPE, infos))):
        return
    found = config_disagreement(config, infos)
    if found is not None:
        raise PlanError(found.message(config))
