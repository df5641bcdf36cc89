"""Property tests (hypothesis): the header parser only ever raises our errors; plans cover every byte once;
TP split then merge reproduces the unsplit tensors.

Example counts are kept small (<= 50 per test) so the file runs in a few seconds.
"""

from __future__ import annotations

import json
import marshal
import math
import struct
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from ckpt_tool.checkpoint.dtypes import DTYPE_BITS
from ckpt_tool.checkpoint.headers import (
    MAX_HEADER_SIZE,
    ShardHeader,
    _parse_careful,
    expected_nbytes,
    parse_header,
    read_shard_header,
)
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.errors import CheckpointError, HeaderError
from ckpt_tool.mapping.plan import ZERO, Options
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.output.convert import convert

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FILE = "p.safetensors"

# ---------------------------------------------------------------------------------------------
# Header parser


def check_accepted(h: ShardHeader, header_len: int, file_size: int) -> None:
    """What acceptance promises: the tensors tile the data buffer exactly, each sized by shape x dtype."""
    assert h.data_start == 8 + header_len
    cursor = h.data_start
    for t in h.tensors.values():  # ordered by offset
        assert t.start == cursor
        assert t.nbytes == expected_nbytes(t.dtype, t.shape)
        cursor = t.end
    assert cursor == file_size


def parse_or_header_error(raw: bytes, file_size: int) -> None:
    """Accepted headers tile the file; rejected ones raise one worded line; the quick path and the careful
    one agree on every input (same header, or both reject)."""
    try:
        h = parse_header(raw, FILE, file_size)
    except HeaderError as exc:
        assert str(exc).startswith(f"{FILE}: "), str(exc)
        assert "\n" not in str(exc)
        with pytest.raises(HeaderError):
            _parse_careful(raw, FILE, file_size, len(raw))
    else:
        check_accepted(h, len(raw), file_size)
        careful = _parse_careful(raw, FILE, file_size, len(raw))
        assert (h.tensors, list(h.tensors), h.names, h.dtypes, h.metadata, h.header_sha256, h.dtype_totals) == (
            careful.tensors,
            list(careful.tensors),
            careful.names,
            careful.dtypes,
            careful.metadata,
            careful.header_sha256,
            careful.dtype_totals,
        )
        assert h.names == list(h.tensors) and h.dtypes == [t.dtype for t in h.tensors.values()]
        for parsed in (h, careful):  # what a forked helper hands back builds the same records
            again = ShardHeader.from_wire(marshal.loads(marshal.dumps(parsed.to_wire())))
            assert (again.tensors, again.names, again.header_sha256) == (
                parsed.tensors,
                parsed.names,
                parsed.header_sha256,
            )


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
json_value = st.recursive(
    json_leaf,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)


@SETTINGS
@given(raw=st.binary(max_size=400), size=st.integers(0, 1 << 16))
@example(raw=b'{"a":' + b"9" * 5000 + b"}", size=100)  # more digits than int() takes: once a raw ValueError
@example(raw=b'{"a":{"dtype":["BF16"],"shape":[],"data_offsets":[0,0]}}', size=100)  # once a TypeError
@example(raw=b'{"a":{"dtype":"U8","shape":[' + b"9" * 4000 + b"," + b"9" * 4000 + b'],"data_offsets":[0,1]}}', size=100)
@example(raw=b"{" + b"[" * 100_000, size=100)
def test_parse_header_arbitrary_bytes(raw: bytes, size: int) -> None:
    parse_or_header_error(raw, size)


@SETTINGS
@given(doc=json_value, size=st.integers(0, 1 << 12), pad=st.integers(0, 7))
def test_parse_header_arbitrary_json(doc: object, size: int, pad: int) -> None:
    raw = json.dumps(doc).encode() + b" " * pad
    parse_or_header_error(raw, size)


dtype_st = st.one_of(
    st.sampled_from(sorted(DTYPE_BITS)),
    st.sampled_from(["bf16", "F7", "", "U8 "]),
    st.lists(st.sampled_from(["BF16", "U8"]), max_size=2),
    st.dictionaries(st.just("BF16"), st.integers(0, 1), max_size=1),
    json_leaf,
)
dim_st = st.one_of(
    st.integers(0, 6), st.integers(-2, 2**65), st.floats(0, 4), st.text(max_size=2), st.booleans(), st.none()
)
entry_st = st.fixed_dictionaries(
    {
        "dtype": dtype_st,
        "shape": st.one_of(st.lists(dim_st, max_size=4), dim_st),
        "data_offsets": st.one_of(st.lists(dim_st, min_size=0, max_size=3), dim_st),
    },
    optional={"extra": json_leaf},
)
header_st = st.dictionaries(st.text(max_size=8), st.one_of(entry_st, entry_st, entry_st, json_value), max_size=5)


@SETTINGS
@given(
    header=header_st,
    metadata=st.one_of(st.none(), st.dictionaries(st.text(max_size=4), json_leaf, max_size=3)),
    extra=st.integers(-64, 64),
)
def test_parse_header_structured_but_wrong(header: dict, metadata: object, extra: int) -> None:
    if metadata is not None:
        header = {"__metadata__": metadata, **header}
    raw = json.dumps(header).encode()
    # a file size near the one the entries claim, so the layout checks get exercised too
    claimed = 0
    for e in header.values():
        if isinstance(e, dict) and isinstance(e.get("data_offsets"), list) and e["data_offsets"]:
            last = e["data_offsets"][-1]
            if type(last) is int and 0 <= last < 2**40:
                claimed = max(claimed, last)
    parse_or_header_error(raw, max(0, 8 + len(raw) + claimed + extra))


@st.composite
def valid_then_mutated(draw):
    """A valid header, then (usually) one field of one entry changed to a plausible wrong value."""
    n = draw(st.integers(1, 5))
    entries, offset = {}, 0
    for i in range(n):
        dtype = draw(st.sampled_from(["BF16", "F32", "F8_E4M3", "F8_E8M0", "I8", "I64", "F4", "U8"]))
        shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=3))
        if dtype == "F4" and math.prod(shape) % 2:  # 4-bit values pack two to a byte
            shape = shape + [2]
        nb = expected_nbytes(dtype, tuple(shape))
        entries[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nb]}
        offset += nb
    size_delta = 0
    mutation = draw(
        st.sampled_from(
            [
                "none",
                "dtype",
                "shape",
                "begin",
                "end",
                "swap",
                "size",
                "drop",
                "dup-offsets",
                "dup-name",
                "colon-name",
                "reorder",
                "bool",
                "metadata",
                "nested",
                "newline",
            ]
        )
    )
    victim = entries[f"t{draw(st.integers(0, n - 1))}"]
    delta = draw(st.sampled_from([-(2**64), -9, -1, 1, 2, 7, 2**64]))
    if mutation == "dtype":
        victim["dtype"] = draw(st.sampled_from(sorted(DTYPE_BITS)))
    elif mutation == "shape":
        victim["shape"] = victim["shape"] + [draw(st.integers(0, 3))] if draw(st.booleans()) else victim["shape"][:-1]
    elif mutation == "begin":
        victim["data_offsets"][0] += delta
    elif mutation == "end":
        victim["data_offsets"][1] += delta
    elif mutation == "swap":
        victim["data_offsets"].reverse()
    elif mutation == "size":
        size_delta = delta if abs(delta) < 100 else 0
    elif mutation == "drop":
        victim.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])))
    elif mutation == "dup-offsets" and n > 1:
        entries["t1"]["data_offsets"] = list(entries["t0"]["data_offsets"])
    elif mutation == "colon-name":  # valid: a ':' inside a name only sends the quick path to the careful one
        entries = {("a:b" if k == "t0" else k): v for k, v in entries.items()}
    elif mutation == "reorder":  # valid: entries listed out of offset order
        entries = dict(reversed(list(entries.items())))
    elif mutation == "bool" and victim["shape"]:
        victim["shape"][0] = victim["shape"][0] == 1
    elif mutation == "metadata":
        entries = {
            "__metadata__": draw(st.sampled_from([{"format": "pt"}, {"a": 1}, {"k:v": "x:y"}, [], None])),
            **entries,
        }
    elif mutation == "nested":
        victim["shape"] = [{"n": d} for d in victim["shape"]] or [{}]
    raw = json.dumps(entries).encode()
    if mutation == "dup-name" and n > 1:  # the same tensor name twice (json.dumps cannot write that)
        raw = raw.replace(b'"t1"', b'"t0"')
    elif mutation == "newline":
        raw = b"\n" + raw[:-1]
    return raw, 8 + len(raw) + offset + size_delta, mutation


@SETTINGS
@given(case=valid_then_mutated())
def test_parse_header_valid_then_mutated(case) -> None:
    raw, size, mutation = case
    if mutation in ("none", "colon-name", "reorder"):
        check_accepted(parse_header(raw, FILE, size), len(raw), size)
    parse_or_header_error(raw, size)


@pytest.fixture(scope="module")
def scratch_dir(tmp_path_factory) -> Path:
    """One folder for the whole module (hypothesis runs a test many times per fixture), removed with pytest's."""
    return tmp_path_factory.mktemp("props")


@SETTINGS
@given(
    prefix=st.one_of(st.integers(0, 2**64 - 1).map(lambda n: struct.pack("<Q", n)), st.binary(max_size=8)),
    body=st.binary(max_size=300),
)
def test_read_shard_header_arbitrary_files(scratch_dir: Path, prefix: bytes, body: bytes) -> None:
    path = scratch_dir / "f.safetensors"
    path.write_bytes(prefix + body)
    try:
        h = read_shard_header(path)
    except CheckpointError as exc:  # HeaderError, or CheckpointError for an unreadable file
        assert "\n" not in str(exc)
    else:
        (n,) = struct.unpack("<Q", (prefix + body)[:8])
        assert n <= MAX_HEADER_SIZE
        check_accepted(h, n, len(prefix) + len(body))


# ---------------------------------------------------------------------------------------------
# Plans: every byte of every non-dropped source lands exactly once per rank set


@pytest.fixture(scope="module")
def fp4_ckpt(fixture_dir):
    return open_checkpoint(fixture_dir("fp4"))


@pytest.fixture(scope="module")
def fp4_pad_ckpt(fixture_dir):
    return open_checkpoint(fixture_dir("fp4-pad"))


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    tp=st.sampled_from([1, 2, 4]),
    moe=st.sampled_from(["tp", "ep"]),
    max_shard=st.integers(16 * 1024, 16 * 2**20),
    only=st.sampled_from([None, None, "model", "mtp"]),
    padded=st.booleans(),
)
def test_plan_places_every_source_byte_once_per_rank_set(
    fp4_ckpt, fp4_pad_ckpt, tp: int, moe: str, max_shard: int, only, padded
) -> None:
    """(``padded``: fp4-pad, whose shared experts the engine zero-pads at tp 2 and 4: zeros come from no source.)"""
    ckpt = fp4_pad_ckpt if padded else fp4_ckpt
    if padded and tp > 1:
        moe = "ep"  # its MXFP4 routed experts leave 192 / 96 rows a rank under tp: refused (see test_plan_pad)
    cfg = ckpt.require_config()
    opts = Options(tp=tp, moe_parallel=moe, only=only, max_shard_size=max_shard)
    plan = plan_conversion(cfg, ckpt.tensors, opts)

    rects: dict[str, dict[int, list[tuple[int, int, int, int]]]] = defaultdict(lambda: defaultdict(list))
    shapes: dict[tuple[str, str], set[tuple[int, tuple[int, ...]]]] = defaultdict(set)
    names_per_file: set[str] = set()
    for f in plan.files:
        assert f.relpath not in names_per_file
        names_per_file.add(f.relpath)
        assert only is None or f.component == only
        assert f.data_bytes <= max_shard or len(f.tensors) == 1, f"{f.relpath} over --max-shard-size"
        for t in f.tensors:
            out_bits = DTYPE_BITS[t.dtype]
            assert sum(s.numel for s in t.segments) * out_bits // 8 == t.nbytes, t.name
            shapes[(f.component, t.name)].add((f.rank, t.shape))
            for s in t.segments:
                if s.src == ZERO:
                    continue
                rows, cols = _rows_cols(plan.sources[s.src].shape)
                assert 0 <= s.row0 < s.row1 <= rows and 0 <= s.col0 < s.col1 <= cols, (t.name, s)
                rects[s.src][f.rank].append((s.row0, s.row1, s.col0, s.col1))

    # every output tensor exists on every rank (TP ranks are symmetric)
    for key, per_rank in shapes.items():
        assert sorted(r for r, _ in per_rank) == list(range(tp)), key
        assert len({s for _, s in per_rank}) == 1, (key, per_rank)

    expected = set(plan.sources) - set(plan.dropped) - set(plan.unused_by_selection)
    assert set(rects) == expected
    for name, per_rank in rects.items():
        rows, cols = _rows_cols(plan.sources[name].shape)
        full = [(0, rows, 0, cols)]
        counts = np.zeros((rows, cols), dtype=np.int16)
        for rs in per_rank.values():
            for r0, r1, c0, c1 in rs:
                counts[r0:r1, c0:c1] += 1
        if len(per_rank) == tp and all(per_rank[r] == full for r in range(tp)):
            assert (counts == tp).all(), name  # replicated: whole, once on every rank
        else:
            assert (counts == 1).all(), f"{name}: split pieces do not tile the tensor exactly once (tp={tp} {moe})"


# ---------------------------------------------------------------------------------------------
# TP split / merge round trip through real files


SPLITS = [(2, "tp"), (4, "tp"), (2, "ep"), (4, "ep")]


@pytest.fixture(scope="module")
def converted(fixture_dir, tmp_path_factory):
    src = fixture_dir("fp4")
    root = tmp_path_factory.mktemp("roundtrip")
    runs = {(1, "tp"): convert(src, root / "tp1", Options())}
    for tp, moe in SPLITS:
        runs[(tp, moe)] = convert(
            src, root / f"tp{tp}-{moe}", Options(tp=tp, moe_parallel=moe, max_shard_size=1_000_000)
        )
    return runs


def read_ranks(out: Path, component: str) -> dict[int, dict[str, torch.Tensor]]:
    idx = json.loads((out / component / "index.json").read_text())
    ranks: dict[int, dict[str, torch.Tensor]] = {}
    for r, names in idx["ranks"].items():
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(set(names.values())):
            with safe_open(str(out / component / file), framework="pt") as fh:
                for k in fh.keys():
                    tensors[k] = fh.get_tensor(k)
        assert set(tensors) == set(names)
        ranks[int(r)] = tensors
    return ranks


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view (last dim scaled by the element size): concatenation and equality work for every dtype."""
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8)


@pytest.mark.parametrize("tp,moe", SPLITS)
@pytest.mark.parametrize("component", ["model", "mtp"])
def test_concatenating_ranks_reproduces_the_unsplit_tensors(converted, tp: int, moe: str, component: str) -> None:
    full_run, split_run = converted[(1, "tp")], converted[(tp, moe)]
    full = read_ranks(full_run.out, component)[0]
    ranks = read_ranks(split_run.out, component)
    assert sorted(ranks) == list(range(tp))
    full_plan = {t.name: t for f in full_run.plan.files if f.component == component for t in f.tensors}
    E = full_run.plan.config.n_routed_experts
    split_count = 0
    for name, F in full.items():
        pieces = [ranks[r][name] for r in range(tp)]
        assert all(p.dtype == F.dtype for p in pieces), name
        if all(p.shape == F.shape for p in pieces):
            for p in pieces:
                assert torch.equal(as_bytes(p), as_bytes(F)), f"{name}: replicated tensor differs on a rank"
            continue
        split_count += 1
        dims = [d for d in range(F.dim()) if pieces[0].shape[d] != F.shape[d]]
        assert len(dims) == 1, (name, F.shape, pieces[0].shape)
        d = dims[0]
        assert pieces[0].shape[d] * tp == F.shape[d], (name, d)
        segs = full_plan[name].segments
        if d == F.dim() - 1 and F.dim() > 1 or (F.dim() == 3 and d == 0):
            parts = [F.shape[d]]  # column split, or whole experts (ep): one contiguous part
        elif F.dim() == 3:  # stacked experts split inside each expert: the fused parts of one expert
            per_expert = len(segs) // E
            parts = [s.row1 - s.row0 for s in segs[:per_expert]]
        else:  # rows of a (possibly fused) tensor: each fused part is split on its own
            parts = [s.row1 - s.row0 for s in segs]
        assert sum(parts) == F.shape[d]
        scale = as_bytes(F).shape[d] // F.shape[d]  # element size when d is the last dim, else 1
        chunks = [torch.split(as_bytes(p), [n * scale // tp for n in parts], dim=d) for p in pieces]
        merged = torch.cat([torch.cat([chunks[r][i] for r in range(tp)], dim=d) for i in range(len(parts))], dim=d)
        assert torch.equal(merged, as_bytes(F)), f"{name}: ranks concatenated do not give the tp=1 tensor"
    assert split_count > 0


def test_fuzz_harness_smoke(tmp_path: Path, capsys) -> None:
    """bench/fuzz_header.py keeps working (a few thousand inputs; the full 10^5 run is a manual benchmark)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fuzz_header", Path(__file__).resolve().parents[1] / "bench" / "fuzz_header.py"
    )
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    assert fuzz.run(n=3000, seed=1, fixture=None, crash_dir=tmp_path / "crashes", files_every=20, seconds=20) == 0
    assert "crashes: 0" in capsys.readouterr().out
