"""Mutational fuzzer for the safetensors header parser (``parse_header`` and ``read_shard_header``).

    python bench/fuzz_header.py                       # 100 000 inputs, seed 0
    python bench/fuzz_header.py --n 1000000 --seed 7
    python bench/fuzz_header.py --fixture /tmp/fx/fp4   # also mutate the real headers of a fixture

Seeds are valid headers: synthetic ones with DeepSeek V4 names and every dtype, plus (with
``--fixture``) the headers of a generated checkpoint. Each input applies 1-4 seeded mutations: bit
flips, interesting bytes, truncation, extension, deletion, duplication of a slice, splicing two
seeds, number tweaks (0, -1, 2^63, 2^64, 1e999, NaN, 4000- and 5000-digit integers, n±1, ...),
whole shape/data_offsets lists replaced, dtype/key swaps, duplicated entries, nesting bombs and
invalid UTF-8. The file size handed to the parser is
the consistent one, one near it, or a random one. Every 50th input goes through a real file and
``read_shard_header`` with a mutated 8-byte length prefix.

The oracle: the parser may only raise :class:`ckpt_tool.errors.CheckpointError` (``HeaderError``
for a header), with a one-line message; a header it accepts must tile the data buffer exactly
(contiguous from 0, each tensor shape x dtype bytes, ending at EOF). Anything else is a crash:
printed, saved under ``--crash-dir`` and reported in the exit code (1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import shutil
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_tool.checkpoint.dtypes import DTYPE_BITS  # noqa: E402
from ckpt_tool.checkpoint.headers import ShardHeader, expected_nbytes, parse_header, read_shard_header  # noqa: E402
from ckpt_tool.errors import CheckpointError  # noqa: E402

FILE = "fuzz.safetensors"
NUMBER_RE = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"')
INTERESTING_NUMBERS = [
    b"0",
    b"1",
    b"-1",
    b"7",
    b"-0",
    b"0.5",
    b"1e3",
    b"1e308",
    b"1e999",
    b"-1e999",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    str(2**31).encode(),
    str(2**32).encode(),
    str(2**63 - 1).encode(),
    str(2**63).encode(),
    str(2**64 - 1).encode(),
    str(2**64).encode(),
    str(10**30).encode(),
    b"9" * 4000,
    b"9" * 5000,
    b"00",
    b"01",
    b"1.",
    b"--1",
    b"true",
    b"null",
]
INTERESTING_BYTES = b'\x00\xff{}[]",:\\-09 \t\n\x80\xc0\xed\xf4e.'
WEIRD_STRINGS = [
    b'"BF16"',
    b'"F8_E4M3"',
    b'"F4"',
    b'"F6_E2M3"',
    b'"bf16"',
    b'""',
    b'"F7"',
    b'"\\ud800"',
    b'"\\u0000"',
    b'"__metadata__"',
    b'"dtype"',
    b'"shape"',
    b'"data_offsets"',
    b"[]",
    b"{}",
    b"null",
    b"[0]",
    b"[0,0,0]",
    b'["BF16"]',
    b'"\xff"',
]
NAMES = [
    "embed.weight",
    "head.weight",
    "norm.weight",
    "layers.0.attn.wq_a.weight",
    "layers.0.attn.wq_a.scale",
    "layers.1.ffn.experts.3.w1.weight",
    "layers.1.ffn.experts.3.w1.scale",
    "mtp.0.enorm.weight",
    "mtp.0.hc_head_fn",
    "layers.2.attn.compressor.ape",
    "layers.0.ffn.gate.tid2eid",
    "x",
    "ünï€ødé",
    'a"b',
    "tab\tname",
]


def synthetic_seed(rng: random.Random) -> tuple[bytes, int]:
    """A valid header (JSON bytes, spaces-padded like real writers do) and its data length."""
    n = rng.choice([0, 1, 1, 2, 3, 5, 8, 13, 20])
    doc: dict[str, object] = {}
    if rng.random() < 0.7:
        doc["__metadata__"] = {"format": "pt", **({"k": "v"} if rng.random() < 0.3 else {})}
    entries = []
    offset = 0
    names = rng.sample(NAMES, min(n, len(NAMES))) + [f"t{i}" for i in range(max(0, n - len(NAMES)))]
    for name in names:
        dtype = rng.choice(list(DTYPE_BITS))
        shape = [rng.choice([0, 1, 2, 3, 4, 8, 16, 128]) for _ in range(rng.choice([0, 1, 1, 2, 2, 3]))]
        while True:
            try:
                nb = expected_nbytes(dtype, tuple(shape))
                break
            except ValueError:
                shape.append(8)
        entries.append((name, {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nb]}))
        offset += nb
    rng.shuffle(entries)  # file order need not be header order
    doc.update(entries)
    raw = json.dumps(doc, separators=(",", ":") if rng.random() < 0.7 else None).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return raw, offset


def fixture_seeds(root: Path) -> list[tuple[bytes, int]]:
    seeds = []
    for path in sorted(root.glob("*.safetensors")):
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            raw = fh.read(n)
        seeds.append((raw, path.stat().st_size - 8 - n))
    return seeds


# ---------------------------------------------------------------------------------------------
# Mutations: each takes (rng, data: bytearray, seeds) and returns new bytes


def m_bitflip(rng, d, _s):
    for _ in range(rng.randint(1, 8)):
        if d:
            i = rng.randrange(len(d))
            d[i] ^= 1 << rng.randrange(8)
    return bytes(d)


def m_byte(rng, d, _s):
    if d:
        d[rng.randrange(len(d))] = rng.choice(INTERESTING_BYTES)
    return bytes(d)


def m_truncate(rng, d, _s):
    return bytes(d[: rng.randrange(len(d) + 1)])


def m_extend(rng, d, _s):
    tail = rng.choice([rng.randbytes(rng.randint(1, 64)), b" " * rng.randint(1, 16), b"}", b",", b"\x00" * 8])
    return bytes(d) + tail


def m_delete(rng, d, _s):
    if len(d) < 2:
        return bytes(d)
    i = rng.randrange(len(d))
    j = min(len(d), i + rng.randint(1, 32))
    return bytes(d[:i] + d[j:])


def m_duplicate_slice(rng, d, _s):
    if not d:
        return bytes(d)
    i = rng.randrange(len(d))
    j = min(len(d), i + rng.randint(1, 64))
    k = rng.randrange(len(d))
    return bytes(d[:k] + d[i:j] + d[k:])


def m_splice(rng, d, seeds):
    other = rng.choice(seeds)[0]
    i = rng.randrange(len(d) + 1)
    j = rng.randrange(len(other) + 1)
    return bytes(d[:i]) + other[j:]


def m_number(rng, d, _s):
    nums = list(NUMBER_RE.finditer(d))
    if not nums:
        return bytes(d)
    m = rng.choice(nums)
    try:
        n = int(m.group())
        choices = INTERESTING_NUMBERS + [
            str(n + 1).encode(),
            str(n - 1).encode(),
            str(n * 2).encode(),
            str(-n).encode(),
            str(n + 8).encode(),
        ]
    except ValueError:
        choices = INTERESTING_NUMBERS
    return bytes(d[: m.start()]) + rng.choice(choices) + bytes(d[m.end() :])


def m_string(rng, d, _s):
    strs = list(STRING_RE.finditer(d))
    if not strs:
        return bytes(d)
    m = rng.choice(strs)
    repl = rng.choice(
        WEIRD_STRINGS + [f'"{rng.choice(list(DTYPE_BITS))}"'.encode(), m.group() + b":1,", m.group()[:-1] + b'x"']
    )
    return bytes(d[: m.start()]) + repl + bytes(d[m.end() :])


SHAPE_RE = re.compile(rb'"(?:shape|data_offsets)":\s*\[[^\]]*\]')


def m_shape(rng, d, _s):
    """Replace a whole shape or data_offsets list with 0-4 interesting numbers."""
    lists = list(SHAPE_RE.finditer(d))
    if not lists:
        return bytes(d)
    m = rng.choice(lists)
    key = m.group().split(b":")[0]
    nums = b",".join(rng.choice(INTERESTING_NUMBERS[:20] + [b"9" * 4000, b"2", b"3"]) for _ in range(rng.randint(0, 4)))
    return bytes(d[: m.start()]) + key + b":[" + nums + b"]" + bytes(d[m.end() :])


def m_duplicate_entry(rng, d, _s):
    """Insert a copy of one '"name":{...}' entry: a duplicate key."""
    text = bytes(d)
    starts = [m.start() for m in re.finditer(rb'"[^"]*":\{"', text)]
    if not starts:
        return text
    s = rng.choice(starts)
    e = text.find(b"}", s)
    if e < 0:
        return text
    entry = text[s : e + 1]
    k = text.rfind(b"}")
    return text[:k] + b"," + entry + text[k:] if k > 0 else text


def m_nest(rng, d, _s):
    k = rng.choice([10, 1000, 100_000])
    i = rng.randrange(len(d) + 1)
    return bytes(d[:i]) + rng.choice([b"[", b'{"a":']) * k + bytes(d[i:])


def m_utf8(rng, d, _s):
    i = rng.randrange(len(d) + 1)
    bad = rng.choice(
        [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\\ud800", b"\\udc00\\ud800"]
    )
    return bytes(d[:i]) + bad + bytes(d[i:])


def m_swap(rng, d, _s):
    if len(d) < 4:
        return bytes(d)
    a, b = sorted(rng.sample(range(len(d)), 2))
    n = rng.randint(1, min(16, b - a))
    d[a : a + n], d[b : b + n] = d[b : b + n], d[a : a + n]
    return bytes(d)


# structure-preserving mutations are weighted up so more inputs get past the JSON parser
MUTATORS = [
    m_bitflip,
    m_byte,
    m_truncate,
    m_extend,
    m_delete,
    m_duplicate_slice,
    m_splice,
    m_number,
    m_number,
    m_number,
    m_number,
    m_string,
    m_string,
    m_string,
    m_shape,
    m_shape,
    m_duplicate_entry,
    m_nest,
    m_utf8,
    m_swap,
]
CATEGORIES = [  # rejection reasons, for the summary (first match wins)
    "too small",
    "exceeds the",
    "points past the end",
    "not valid UTF-8",
    "not valid JSON",
    "not a JSON object",
    "appears twice",
    "__metadata__",
    "header entry is not an object",
    "exactly dtype, shape, data_offsets",
    "unknown dtype",
    "is not a list of non-negative",
    "is not two non-negative",
    "more than 2^64",
    "end before they begin",
    "whole number of bytes",
    "needs",
    "leaves a gap",
    "overlaps",
    "truncated",
    "trailing bytes",
]


# ---------------------------------------------------------------------------------------------


def check_accepted(h: ShardHeader, header_len: int, file_size: int) -> str | None:
    cursor = 8 + header_len
    if h.data_start != cursor:
        return "data_start wrong"
    for t in h.tensors.values():
        if t.start != cursor:
            return f"tensor {t.name!r} not contiguous"
        if t.nbytes != expected_nbytes(t.dtype, t.shape):
            return f"tensor {t.name!r} size != shape x dtype"
        cursor = t.end
    if cursor != file_size:
        return "tensors do not end at EOF"
    return None


def run(n: int, seed: int, fixture: Path | None, crash_dir: Path, files_every: int, seconds: float | None) -> int:
    rng = random.Random(seed)
    seeds = [synthetic_seed(rng) for _ in range(200)]
    if fixture is not None:
        seeds += fixture_seeds(fixture)
    outcomes: Counter[str] = Counter()
    crashes: dict[str, tuple[str, bytes]] = {}
    tmpdir = Path(tempfile.mkdtemp(prefix="fuzz-header-"))
    path = tmpdir / FILE
    t0 = time.perf_counter()
    done = 0
    for i in range(n):
        if seconds is not None and time.perf_counter() - t0 > seconds:
            break
        raw, data_len = rng.choice(seeds)
        for _ in range(rng.choice([0, 1, 1, 1, 2, 2, 3, 4]) if i % 97 else 0):  # every 97th input is a clean seed
            raw = rng.choice(MUTATORS)(rng, bytearray(raw), seeds)
            if len(raw) > 2_000_000:
                raw = raw[:2_000_000]
        consistent = 8 + len(raw) + data_len
        size = rng.choice(
            [consistent, consistent, consistent + rng.randint(-16, 16), rng.randint(0, consistent * 2 + 16)]
        )
        size = max(0, size)
        via_file = files_every > 0 and i % files_every == 0
        try:
            if via_file:
                prefix_len = rng.choice(
                    [len(raw), len(raw), len(raw) + rng.randint(-8, 8), rng.randrange(2**64), 100_000_001]
                )
                prefix_len = min(max(prefix_len, 0), 2**64 - 1)
                with open(path, "wb") as fh:
                    fh.write(struct.pack("<Q", prefix_len)[: rng.choice([8, 8, 8, rng.randrange(9)])])
                    fh.write(raw)
                    fh.truncate(max(size, fh.tell()) if rng.random() < 0.9 else fh.tell())
                file_size = path.stat().st_size
                h = read_shard_header(path, FILE)
                bad = check_accepted(h, h.header_len, file_size)
            else:
                h = parse_header(raw, FILE, size)
                bad = check_accepted(h, len(raw), size)
            if bad:
                raise AssertionError(f"accepted an invalid header: {bad}")
            outcomes["accepted"] += 1
        except CheckpointError as exc:
            msg = str(exc)
            if "\n" in msg or not msg.startswith(FILE):
                key = f"bad message: {msg[:80]!r}"
                crashes.setdefault(key, (key, raw))
            outcomes[next((c for c in CATEGORIES if c in msg), "other: " + msg[:60])] += 1
        except Exception as exc:  # noqa: BLE001 - the point of a fuzzer
            key = f"{type(exc).__name__}: {re.sub(r'[0-9]+', 'N', str(exc))[:120]}"  # one entry per kind of crash
            crashes.setdefault(key, (key, raw))
        done += 1
    elapsed = time.perf_counter() - t0
    shutil.rmtree(tmpdir, ignore_errors=True)  # the one file the inputs went through

    print(
        f"fuzz_header: {done} inputs in {elapsed:.1f} s ({done / elapsed:,.0f} inputs/s), seed {seed}, "
        f"{len(seeds)} seeds, every {files_every}th through a file"
    )
    print(
        f"  accepted {outcomes['accepted']}, rejected {sum(outcomes.values()) - outcomes['accepted']}, "
        f"crashed {done - sum(outcomes.values())}"
    )
    for what, count in outcomes.most_common(15):
        if what != "accepted":
            print(f"  {count:7d}  {what}")
    if crashes:
        crash_dir.mkdir(parents=True, exist_ok=True)
        print(f"CRASHES: {len(crashes)} distinct")
        for key, (_, raw) in crashes.items():
            name = hashlib.sha256(raw).hexdigest()[:16]
            (crash_dir / f"{name}.json").write_bytes(raw)
            print(f"  {key}  -> {crash_dir / name}.json")
        return 1
    print("crashes: 0")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100_000, help="inputs to try (default 100000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=None, help="stop after this long even if --n is not reached")
    p.add_argument("--fixture", type=Path, default=None, help="a generated checkpoint whose headers join the seeds")
    p.add_argument(
        "--files-every",
        type=int,
        default=50,
        help="every Nth input goes through a file and read_shard_header (0: never)",
    )
    p.add_argument("--crash-dir", type=Path, default=Path("bench/fuzz-crashes"))
    a = p.parse_args(argv)
    return run(a.n, a.seed, a.fixture, a.crash_dir, a.files_every, a.seconds)


if __name__ == "__main__":
    raise SystemExit(main())
