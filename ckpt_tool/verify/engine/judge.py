"""The rules of vLLM's ``ShardedStateLoader.load_weights``, applied to one rank's files and the engine's table.

Pure functions over plain data (the table the probe reports, the headers ckpt-tool reads): no vLLM here.
The rules, from ``vllm/model_executor/model_loader/sharded_state_loader.py`` (vLLM 0.33.0 and 0.34.0):

* each rank reads every ``model-rank-{rank}-part-*.safetensors`` in the folder; none: "Could not find checkpoint files";
* every file key must be a key of the filtered ``state_dict()`` (``state_dict[key]``: KeyError otherwise), and
  is popped once loaded, so a key held by two files raises KeyError at the second;
* a dtype other than the parameter's is cast, with the warning "Attempted to load weight ...": a failure here;
* a tensor smaller than the parameter in some dims (same rank of dims) is copied into the leading slice, with the
  warning "loading tensor of shape ... into parameter ...": allowed only where the profile documents it
  (``attn_sink``); any other shape does not fit;
* a parameter no file holds: "Missing keys".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckpt_tool.checkpoint.dtypes import TORCH_NAMES

CAST_WARNING = "Attempted to load weight "
SLICE_WARNING = re.compile(r"^loading tensor of shape .* into parameter '(?P<key>[^']+)' of shape ")


@dataclass(frozen=True)
class HeldTensor:
    """A tensor as one of the rank's files holds it (from the safetensors header)."""

    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    file: str


def judge_files(
    table: dict[str, tuple[str, list[int]]],
    held: dict[str, HeldTensor],
    duplicates: list[tuple[str, str, str]],
    aliases: dict[str, str],
    allowed_prefix: set[str],
) -> tuple[list[tuple[str, str | None]], list[str]]:
    """(problems, documented prefix loads) of one rank's files against the engine's filtered table
    (key -> (torch dtype, shape)). ``aliases``: state_dict keys the filter dropped -> the key it kept."""
    problems: list[tuple[str, str | None]] = []
    prefix: list[str] = []
    for key, first, second in duplicates:
        problems.append((f"{key!r} is in both {first} and {second}: the loader raises KeyError at the second", key))
    for key in sorted(set(held) - set(table)):
        hint = f" ({aliases[key]!r} is the key _filter_subtensors keeps for that parameter)" if key in aliases else ""
        problems.append((f"{key!r} in {held[key].file} is not a parameter key: the loader raises KeyError{hint}", key))
    for key in sorted(set(held) & set(table)):
        have, (want_dtype, want_shape) = held[key], table[key]
        dtype = TORCH_NAMES.get(have.dtype)
        if dtype != want_dtype:
            problems.append(
                (
                    f"{key!r}: dtype {have.dtype} ({dtype or 'unknown to torch'}), the parameter is {want_dtype}: "
                    "the loader casts it, with a warning",
                    key,
                )
            )
        shape, want = list(have.shape), list(want_shape)
        if shape == want:
            continue
        if len(shape) == len(want) and all(a <= b for a, b in zip(shape, want)):
            if key in allowed_prefix:
                prefix.append(key)
                continue
            problems.append(
                (
                    f"{key!r}: shape {shape}, the parameter is {want}: the loader copies it into a slice, which the "
                    "profile documents only for attn_sink",
                    key,
                )
            )
        else:
            problems.append((f"{key!r}: shape {shape} does not fit the parameter's {want}", key))
    for key in sorted(set(table) - set(held)):
        dtype, shape = table[key]
        problems.append(
            (f"parameter {key!r} ({dtype}{list(shape)}) is in no file: the loader raises 'Missing keys'", key)
        )
    return problems, prefix


def judge_load(load: dict, table: dict, allowed_prefix: set[str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """(problems, other warnings) of vLLM's own ``load_weights`` run (the probe's ``load`` record)."""
    problems: list[tuple[str, str | None]] = []
    others: list[str] = []
    if load.get("cpu_table") is not None and load["cpu_table"] != table:
        cpu = load["cpu_table"]
        differ = sorted(k for k in set(cpu) | set(table) if cpu.get(k) != table.get(k))
        problems.append(
            (
                f"the meta-device build and the CPU build of the class disagree on {len(differ)} key(s), e.g. "
                f"{differ[0]!r}; "
                "the table check cannot be trusted for this vLLM",
                differ[0],
            )
        )
    exc = load.get("exception")
    if exc:
        message = " ".join(str(exc["message"]).split())
        problems.append((f"vLLM's ShardedStateLoader.load_weights raised {exc['type']}: {message[:400]}", None))
    for rec in load.get("log", []):
        text = rec["message"]
        m = SLICE_WARNING.match(text)
        if text.startswith(CAST_WARNING):
            problems.append((f"vLLM's loader cast a tensor: {text}", text[len(CAST_WARNING) :].split(" ")[0]))
        elif m and m.group("key") in allowed_prefix:
            continue  # documented: the profile writes the real heads, the engine pads its parameter
        elif m:
            problems.append((f"vLLM's loader copied a smaller tensor into a slice: {text}", m.group("key")))
        else:
            others.append(f"{rec['level']}: {text}")
    others += list(load.get("warnings", []))
    return problems, others
