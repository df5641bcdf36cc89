"""JSON as safetensors headers and indexes need it: no key twice in an object, no floats where integers belong,
fast when the text provably repeats no key, and why a parse failed in words for a user."""

from __future__ import annotations

import json


def json_problem(exc: BaseException) -> str:
    """Why ``json.loads`` failed, in words for a user (not Python's advice to raise interpreter limits)."""
    if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
        return str(exc)
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return "a number has too many digits"  # ValueError from int(): more than sys.get_int_max_str_digits()


def reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads``'s ``object_pairs_hook`` that raises :class:`DuplicateKey` on a repeated key."""
    seen = dict(pairs)  # C speed; the slow search below runs only when a key repeats
    if len(seen) != len(pairs):
        keys: set[str] = set()
        for key, _ in pairs:
            if key in keys:
                raise DuplicateKey(key)
            keys.add(key)
    return seen


class DuplicateKey(Exception):
    """A key appears twice in one JSON object (``key``)."""

    def __init__(self, key: str) -> None:
        self.key = key


class FloatInJSON(Exception):
    """A JSON number with a fraction or exponent where only integers are valid."""


def no_float(text: str) -> float:
    """``json.loads``'s ``parse_float`` that refuses every float."""
    raise FloatInJSON


UNPROVEN = object()


_LEAVES = {str, int, float, bool, type(None)}


def _members(obj: object) -> int:
    """Members of every JSON object in ``obj`` (what the text's ``:`` count must equal)."""
    if type(obj) is dict:
        if set(map(type, obj.values())) <= _LEAVES:  # a flat map (an index's 69k-entry weight_map): at C speed
            return len(obj)
        return len(obj) + sum(_members(v) for v in obj.values() if type(v) is dict or type(v) is list)
    if type(obj) is list:
        return sum(_members(v) for v in obj if type(v) is dict or type(v) is list)
    return 0


def loads_unique(text: str) -> object:
    """``json.loads`` at C speed when the text provably repeats no key, else ``UNPROVEN`` (then parse with
    :func:`reject_duplicates`, which names the repeat). A repeat hides a member, so the parsed members
    fall short of the text's colons; a ``:`` inside a string also makes them differ (slow path, no harm)."""
    doc = json.loads(text)
    return doc if text.count(":") == _members(doc) else UNPROVEN
