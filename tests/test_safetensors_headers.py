"""The safetensors header reader (ckpt_tool.checkpoint.headers) and the index/shard cross-checks
(ckpt_tool.checkpoint.source).

Files here are built by hand, byte by byte, so every validation rule is hit with exactly one defect.
"""

from __future__ import annotations

import json
import marshal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.checkpoint.dtypes import DTYPE_BITS, TORCH_NAMES
from ckpt_tool.checkpoint.headers import (
    MAX_HEADER_SIZE,
    ShardHeader,
    TensorInfo,
    parse_header,
    read_shard_header,
)
from ckpt_tool.checkpoint.index import read_index, safe_relative_name
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.errors import CheckpointError, HeaderError
from ckpt_tool.fixtures.safetensors_file import write_safetensors

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# Helpers


def write_raw(path: Path, header: bytes | str | dict, data: bytes = b"", header_len: int | None = None) -> Path:
    """Write ``u64 header_len`` + header bytes + data, with no padding or checks of our own."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8")
    n = len(header) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + header + data)
    return path


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def header_error(path: Path) -> HeaderError:
    with pytest.raises(HeaderError) as info:
        read_shard_header(path)
    exc = info.value
    assert isinstance(exc, CheckpointError)
    assert path.name in str(exc), f"error does not name the file: {exc}"
    assert exc.file == path.name
    return exc


def names_tensor(exc: HeaderError, tensor: str) -> None:
    assert exc.tensor == tensor
    assert repr(tensor) in str(exc), f"error does not name tensor {tensor!r}: {exc}"


# ---------------------------------------------------------------------------------------------
# A valid file


def test_valid_file_parses_with_absolute_offsets_in_file_order(tmp_path: Path) -> None:
    # Header lists tensors out of file order; the reader must sort them by offset.
    data_a = struct.pack("<2f", 1.5, -2.0)  # F32 [2] at [0, 8)
    data_b = bytes([1, 2, 3])  # U8 [3] at [8, 11)
    header = {
        "b": entry("U8", [3], 8, 11),
        "__metadata__": {"format": "pt", "k": "v"},
        "a": entry("F32", [2], 0, 8),
    }
    raw = json.dumps(header).encode()
    path = write_raw(tmp_path / "ok.safetensors", raw, data_a + data_b)

    h = read_shard_header(path)
    assert isinstance(h, ShardHeader)
    assert h.file == "ok.safetensors"
    assert h.header_len == len(raw)
    assert h.data_start == 8 + len(raw)
    assert h.file_size == path.stat().st_size
    assert h.metadata == {"format": "pt", "k": "v"}
    assert list(h.tensors) == ["a", "b"]
    a, b = h.tensors["a"], h.tensors["b"]
    assert a == TensorInfo("a", "F32", (2,), "ok.safetensors", h.data_start, h.data_start + 8)
    assert b == TensorInfo("b", "U8", (3,), "ok.safetensors", h.data_start + 8, h.data_start + 11)
    assert (a.nbytes, a.numel, b.nbytes, b.numel) == (8, 2, 3, 3)
    blob = path.read_bytes()
    assert blob[a.start : a.end] == data_a
    assert blob[b.start : b.end] == data_b
    assert len(h.header_sha256) == 64


def test_file_name_argument_overrides_path_name_in_results_and_errors(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "x.safetensors", {"t": entry("U8", [1], 0, 1)}, b"\0")
    assert read_shard_header(path, "sub/shard.safetensors").tensors["t"].file == "sub/shard.safetensors"
    bad = write_raw(tmp_path / "y.safetensors", "[]")
    with pytest.raises(HeaderError, match=r"^sub/y\.safetensors: "):
        read_shard_header(bad, "sub/y.safetensors")


def test_header_padding_spaces_and_fixture_writer_output_parse(tmp_path: Path) -> None:
    # write_safetensors pads the JSON with spaces to a multiple of 8, like the Rust writer.
    path = tmp_path / "w.safetensors"
    write_safetensors(path, [("x", "BF16", (2, 2), bytes(range(8))), ("y", "I64", (1,), bytes(8))])
    h = read_shard_header(path)
    assert h.header_len % 8 == 0
    assert h.metadata == {"format": "pt"}
    assert path.read_bytes()[h.tensors["x"].start : h.tensors["x"].end] == bytes(range(8))
    assert h.tensors["y"].end == h.file_size


def test_headers_as_writers_emit_them_take_the_quick_path(tmp_path: Path) -> None:
    """The quick parse is what makes inspect interactive: a header from the safetensors library (and from
    our fixture writer) must not fall through to the careful path."""
    import torch
    from safetensors.torch import save_file

    from ckpt_tool.checkpoint.headers import _quick_tensors

    lib = tmp_path / "lib.safetensors"
    save_file(
        {"b": torch.zeros(3, 2, dtype=torch.bfloat16), "a": torch.zeros(5, dtype=torch.float8_e4m3fn)},
        str(lib),
        metadata={"format": "pt"},
    )
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, [("x", "BF16", (2, 2), bytes(8)), ("y", "I64", (1,), bytes(8))])
    for path in (lib, ours):
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        quick = _quick_tensors(data[8 : 8 + n], path.name, 8 + n, len(data) - 8 - n)
        assert quick is not None, path.name
        _, names, dtypes, _, totals = quick
        header = read_shard_header(path)
        tensors = header.tensors
        assert (header.names, header.dtypes, header.dtype_totals) == (names, dtypes, totals)
        assert tensors == ShardHeader.from_wire(marshal.loads(marshal.dumps(header.to_wire()))).tensors
        assert (names, dtypes) == (list(tensors), [t.dtype for t in tensors.values()])
        assert totals == {
            d: (sum(t.dtype == d for t in tensors.values()), sum(t.nbytes for t in tensors.values() if t.dtype == d))
            for d in totals
        }


@pytest.mark.parametrize(
    "entries, field",
    [
        (
            '"a":{"dtype":"F32","shape":[1,4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[true,4],"data_offsets":[16,32]}',
            "shape",
        ),
        (
            '"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[true,2]}',
            "data_offsets",
        ),
        (
            '"a":{"dtype":"U8","shape":[1],"data_offsets":[0,true]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}',
            "data_offsets",
        ),
    ],
    ids=["true-in-a-later-shape", "true-as-a-later-begin", "true-as-an-end"],
)
def test_json_booleans_are_not_numbers_even_where_they_equal_one(entries: str, field: str) -> None:
    """``true == 1`` in Python: a boolean where an integer belongs must be refused on the quick path too,
    not read as 1 or 0 (the Rust reference refuses it)."""
    raw = ("{" + entries + "}").encode()
    data_len = 32 if "[16,32]" in entries else 2
    with pytest.raises(HeaderError, match=field):
        parse_header(raw, "b.safetensors", file_size=8 + len(raw) + data_len)


def test_parse_header_directly_with_explicit_header_len() -> None:
    raw = b'{"t":{"dtype":"I16","shape":[2],"data_offsets":[0,4]}}    '
    h = parse_header(raw, "mem.safetensors", file_size=8 + len(raw) + 4)
    assert h.tensors["t"].start == 8 + len(raw)
    h2 = parse_header(raw, "mem.safetensors", file_size=8 + 100 + 4, header_len=100)
    assert h2.tensors["t"].start == 108


def test_empty_header_with_no_data_is_a_valid_empty_file(tmp_path: Path) -> None:
    h = read_shard_header(write_raw(tmp_path / "e.safetensors", "{}"))
    assert h.tensors == {} and h.metadata == {}


def test_null_metadata_is_accepted_like_the_reference(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "m.safetensors", {"__metadata__": None, "t": entry("U8", [1], 0, 1)}, b"\0")
    assert read_shard_header(path).metadata == {}


# ---------------------------------------------------------------------------------------------
# The 8-byte prefix and the header bytes


@pytest.mark.parametrize("size", [0, 1, 7])
def test_file_shorter_than_8_bytes_is_rejected(tmp_path: Path, size: int) -> None:
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01" * size)
    exc = header_error(path)
    assert "too small" in str(exc) and f"{size} bytes" in str(exc)


@pytest.mark.parametrize("n", [MAX_HEADER_SIZE + 1, 2**64 - 1])
def test_header_length_over_the_limit_is_rejected(tmp_path: Path, n: int) -> None:
    exc = header_error(write_raw(tmp_path / "huge.safetensors", "{}", header_len=n))
    assert str(n) in str(exc) and "limit" in str(exc)


def test_header_length_exactly_at_the_limit_is_not_the_limit_error(tmp_path: Path) -> None:
    exc = header_error(write_raw(tmp_path / "at.safetensors", "{}", header_len=MAX_HEADER_SIZE))
    assert "limit" not in str(exc) and "past the end" in str(exc)


def test_header_length_past_eof_is_rejected(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "short.safetensors", "{}", header_len=50)
    exc = header_error(path)
    assert "header length 50 points past the end" in str(exc)
    assert f"{path.stat().st_size}-byte file" in str(exc)


def test_header_not_utf8_is_rejected(tmp_path: Path) -> None:
    exc = header_error(write_raw(tmp_path / "latin.safetensors", b'{"caf\xe9": 1}'))
    assert "UTF-8" in str(exc)


@pytest.mark.parametrize("text", ["[1, 2]", "123", '"str"', "null", "true", "", "\ufeff{}"])
def test_header_not_starting_with_brace_is_rejected(tmp_path: Path, text: str) -> None:
    exc = header_error(write_raw(tmp_path / "notobj.safetensors", text))
    assert "not a JSON object" in str(exc) and "'{'" in str(exc)


@pytest.mark.parametrize(
    "text",
    ['{"a": ', '{"a": 1,}', "{'a': 1}", '{"a": 1} trailing', '{"a":' + "[" * 100_000 + "]" * 100_000 + "}"],
    ids=["unterminated", "trailing-comma", "single-quotes", "junk-after", "deeply-nested"],
)
def test_invalid_json_header_is_rejected(tmp_path: Path, text: str) -> None:
    exc = header_error(write_raw(tmp_path / "badjson.safetensors", text))
    assert "not valid JSON" in str(exc)


def test_duplicate_tensor_names_are_rejected_naming_the_tensor(tmp_path: Path) -> None:
    raw = '{"w": {"dtype":"U8","shape":[1],"data_offsets":[0,1]}, "w": {"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    exc = header_error(write_raw(tmp_path / "dup.safetensors", raw, b"\0\0"))
    names_tensor(exc, "w")
    assert "appears twice" in str(exc)


# ---------------------------------------------------------------------------------------------
# Tensor entries


def test_header_entry_not_an_object_is_rejected(tmp_path: Path) -> None:
    exc = header_error(write_raw(tmp_path / "e.safetensors", {"w": [1, 2]}))
    names_tensor(exc, "w")


@pytest.mark.parametrize(
    "ent",
    [
        {"dtype": "U8", "shape": [1]},
        {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "extra": 1},
        {"shape": [1], "data_offsets": [0, 1]},
    ],
    ids=["missing-offsets", "extra-key", "missing-dtype"],
)
def test_header_entry_with_wrong_keys_is_rejected(tmp_path: Path, ent: dict) -> None:
    exc = header_error(write_raw(tmp_path / "k.safetensors", {"w": ent}, b"\0"))
    names_tensor(exc, "w")
    assert "exactly dtype, shape, data_offsets" in str(exc)


@pytest.mark.parametrize("dtype", ["F7", "f32", "FLOAT32", "F8_E4M3FN", "", 32, None])
def test_unknown_dtype_is_rejected(tmp_path: Path, dtype: object) -> None:
    exc = header_error(
        write_raw(tmp_path / "dt.safetensors", {"w": {"dtype": dtype, "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    )
    names_tensor(exc, "w")
    assert "unknown dtype" in str(exc)


@pytest.mark.parametrize(
    "shape",
    ["abc", 4, None, {"0": 4}, [1.0], [4.0], [-1], [2, -2], [True], [None], [[2]], ["2"]],
)
def test_shape_not_a_list_of_non_negative_ints_is_rejected(tmp_path: Path, shape: object) -> None:
    exc = header_error(
        write_raw(tmp_path / "sh.safetensors", {"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, 1]}}, b"\0")
    )
    names_tensor(exc, "w")
    assert "shape" in str(exc) and "non-negative integers" in str(exc)


@pytest.mark.parametrize(
    "offsets",
    [[0], [0, 1, 2], [], "0,1", None, 1, [0.0, 1.0], [0, 1.0], [-1, 0], [0, -1], [True, 1], [0, "1"]],
)
def test_malformed_data_offsets_are_rejected(tmp_path: Path, offsets: object) -> None:
    exc = header_error(
        write_raw(tmp_path / "off.safetensors", {"w": {"dtype": "U8", "shape": [1], "data_offsets": offsets}}, b"\0")
    )
    names_tensor(exc, "w")
    assert "data_offsets" in str(exc) and "two non-negative integers" in str(exc)


def test_data_offsets_ending_before_they_begin_are_rejected(tmp_path: Path) -> None:
    exc = header_error(write_raw(tmp_path / "rev.safetensors", {"w": entry("U8", [4], 4, 0)}, b"\0" * 4))
    names_tensor(exc, "w")
    assert "end before they begin" in str(exc)


def test_size_mismatch_between_shape_dtype_and_offsets_is_rejected(tmp_path: Path) -> None:
    exc = header_error(write_raw(tmp_path / "sz.safetensors", {"w": entry("F32", [2], 0, 4)}, b"\0" * 4))
    names_tensor(exc, "w")
    assert "needs 8 bytes" in str(exc) and "hold 4" in str(exc)


@pytest.mark.parametrize("dtype", sorted(DTYPE_BITS))
def test_every_known_dtype_parses_with_its_bit_width(tmp_path: Path, dtype: str) -> None:
    nbytes = DTYPE_BITS[dtype]  # 8 elements of b bits occupy b bytes: whole bytes for every width
    path = write_raw(tmp_path / "d.safetensors", {"w": entry(dtype, [2, 4], 0, nbytes)}, b"\0" * nbytes)
    info = read_shard_header(path).tensors["w"]
    assert (info.dtype, info.shape, info.nbytes) == (dtype, (2, 4), nbytes)


# ---------------------------------------------------------------------------------------------
# Specs of the data buffer


def test_gap_between_tensors_is_rejected(tmp_path: Path) -> None:
    path = write_raw(
        tmp_path / "gap.safetensors", {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 6, 10)}, b"\0" * 10
    )
    exc = header_error(path)
    names_tensor(exc, "b")
    assert "gap" in str(exc)


def test_overlapping_tensors_are_rejected(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "ov.safetensors", {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}, b"\0" * 6)
    exc = header_error(path)
    names_tensor(exc, "b")
    assert "overlaps" in str(exc)


def test_identical_offsets_for_two_tensors_are_an_overlap(tmp_path: Path) -> None:
    path = write_raw(
        tmp_path / "same.safetensors", {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 0, 4)}, b"\0" * 4
    )
    exc = header_error(path)
    assert "overlaps" in str(exc) and exc.tensor in ("a", "b")


def test_offsets_not_starting_at_zero_are_rejected(tmp_path: Path) -> None:
    exc = header_error(write_raw(tmp_path / "nz.safetensors", {"a": entry("U8", [4], 2, 6)}, b"\0" * 6))
    names_tensor(exc, "a")
    assert "start at 2" in str(exc) and "gap" in str(exc)


def test_offsets_past_eof_report_truncation_naming_the_last_tensor(tmp_path: Path) -> None:
    path = write_raw(
        tmp_path / "trunc.safetensors", {"a": entry("U8", [4], 0, 4), "b": entry("U8", [8], 4, 12)}, b"\0" * 10
    )
    exc = header_error(path)
    names_tensor(exc, "b")
    assert "truncated" in str(exc) and "2 bytes missing" in str(exc)


def test_trailing_bytes_after_last_tensor_are_rejected(tmp_path: Path) -> None:
    exc = header_error(write_raw(tmp_path / "tail.safetensors", {"a": entry("U8", [4], 0, 4)}, b"\0" * 7))
    assert "3 trailing bytes" in str(exc)


def test_trailing_bytes_with_no_tensors_are_rejected(tmp_path: Path) -> None:
    exc = header_error(write_raw(tmp_path / "tail0.safetensors", {"__metadata__": {"a": "b"}}, b"xyz"))
    assert "3 trailing bytes" in str(exc)


def test_zero_size_tensors_are_accepted_anywhere_in_the_buffer(tmp_path: Path) -> None:
    header = {
        "z0": entry("F32", [0], 0, 0),
        "a": entry("U8", [4], 0, 4),
        "z1": entry("BF16", [3, 0], 4, 4),
        "b": entry("U8", [2], 4, 6),
        "z2": entry("I64", [0, 5, 7], 6, 6),
    }
    h = read_shard_header(write_raw(tmp_path / "zero.safetensors", header, b"\0" * 6))
    assert set(h.tensors) == set(header)
    assert all(h.tensors[z].nbytes == 0 and h.tensors[z].numel == 0 for z in ("z0", "z1", "z2"))
    assert h.tensors["b"].end == h.file_size


def test_file_with_only_zero_size_tensors_and_no_data_is_valid(tmp_path: Path) -> None:
    h = read_shard_header(write_raw(tmp_path / "z.safetensors", {"z": entry("U8", [0], 0, 0)}))
    assert h.tensors["z"].nbytes == 0


def test_zero_size_tensor_placed_past_the_data_is_rejected(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "zp.safetensors", {"a": entry("U8", [2], 0, 2), "z": entry("U8", [0], 9, 9)}, b"\0\0")
    exc = header_error(path)
    names_tensor(exc, "z")


def test_scalar_tensor_with_empty_shape_holds_one_element(tmp_path: Path) -> None:
    h = read_shard_header(write_raw(tmp_path / "s.safetensors", {"s": entry("F32", [], 0, 4)}, b"\0" * 4))
    assert h.tensors["s"].shape == () and h.tensors["s"].numel == 1


# ---------------------------------------------------------------------------------------------
# Sub-byte dtypes


def test_f4_packs_two_elements_per_byte(tmp_path: Path) -> None:
    h = read_shard_header(write_raw(tmp_path / "f4.safetensors", {"q": entry("F4", [2, 3], 0, 3)}, b"\0" * 3))
    assert h.tensors["q"].nbytes == 3 and h.tensors["q"].numel == 6


def test_f4_with_byte_per_element_size_is_a_mismatch(tmp_path: Path) -> None:
    exc = header_error(write_raw(tmp_path / "f4b.safetensors", {"q": entry("F4", [4], 0, 4)}, b"\0" * 4))
    names_tensor(exc, "q")
    assert "needs 2 bytes" in str(exc)


@pytest.mark.parametrize("dtype,shape", [("F4", [3]), ("F4", [1, 1]), ("F6_E2M3", [2]), ("F6_E3M2", [5])])
def test_sub_byte_tensor_not_filling_whole_bytes_is_rejected(tmp_path: Path, dtype: str, shape: list) -> None:
    exc = header_error(write_raw(tmp_path / "odd.safetensors", {"q": entry(dtype, shape, 0, 1)}, b"\0"))
    names_tensor(exc, "q")
    assert "whole number of bytes" in str(exc)


def test_f6_packs_four_elements_into_three_bytes(tmp_path: Path) -> None:
    h = read_shard_header(write_raw(tmp_path / "f6.safetensors", {"q": entry("F6_E2M3", [2, 4], 0, 6)}, b"\0" * 6))
    assert h.tensors["q"].nbytes == 6


# ---------------------------------------------------------------------------------------------
# __metadata__


@pytest.mark.parametrize(
    "meta",
    [{"a": 1}, {"a": None}, {"a": ["b"]}, {"a": {"b": "c"}}, "text", [["a", "b"]], 7, True],
    ids=["int-value", "null-value", "list-value", "dict-value", "string", "pairs-list", "int", "true"],
)
def test_metadata_not_a_string_to_string_map_is_rejected(tmp_path: Path, meta: object) -> None:
    path = write_raw(tmp_path / "meta.safetensors", {"__metadata__": meta, "t": entry("U8", [1], 0, 1)}, b"\0")
    exc = header_error(path)
    assert "__metadata__ must map strings to strings" in str(exc)


@pytest.mark.parametrize("meta", [[], "", 0, False], ids=["empty-list", "empty-string", "zero", "false"])
def test_falsy_non_map_metadata_is_rejected_like_the_reference(tmp_path: Path, meta: object) -> None:
    path = write_raw(tmp_path / "meta0.safetensors", {"__metadata__": meta, "t": entry("U8", [1], 0, 1)}, b"\0")
    header_error(path)


# ---------------------------------------------------------------------------------------------
# Files that cannot be read


def test_missing_shard_file_is_a_checkpoint_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"gone\.safetensors: file not found"):
        read_shard_header(tmp_path / "gone.safetensors")


def test_directory_instead_of_shard_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"dir\.safetensors: is a folder, expected a safetensors file"):
        read_shard_header(tmp_path / "dir.safetensors")


# ---------------------------------------------------------------------------------------------
# Index files


def write_index(path: Path, weight_map: object, **extra: object) -> Path:
    doc = {"metadata": {"total_size": 0}, **extra}
    if weight_map is not None:
        doc["weight_map"] = weight_map
    path.write_text(json.dumps(doc))
    return path


def test_read_index_returns_the_weight_map_with_names_normalised(tmp_path: Path) -> None:
    idx = write_index(
        tmp_path / "model.safetensors.index.json",
        {
            "a": "model-1.safetensors",
            "b": "sub/model-2.safetensors",
            "c": "./m3.safetensors",
            "d": "sub//m4.safetensors",
        },
    )
    assert read_index(idx) == {
        "a": "model-1.safetensors",
        "b": "sub/model-2.safetensors",
        "c": "m3.safetensors",
        "d": "sub/m4.safetensors",
    }


@pytest.mark.parametrize(
    "name",
    [
        "../x.safetensors",
        "/abs/x.safetensors",
        "a/../../x.safetensors",
        "a/../x.safetensors",
        "..",
        "a\\b.safetensors",
        "..\\x.safetensors",
        "C:\\x.safetensors",
        "C:x.safetensors",
        "x\x00.safetensors",
        "",
        5,
        None,
        ["x.safetensors"],
        {"f": "x.safetensors"},
        True,
    ],
)
def test_read_index_rejects_unsafe_or_non_string_file_names(tmp_path: Path, name: object) -> None:
    idx = write_index(tmp_path / "model.safetensors.index.json", {"ok": "m.safetensors", "layers.0.w": name})
    with pytest.raises(CheckpointError) as info:
        read_index(idx)
    assert "model.safetensors.index.json" in str(info.value)
    assert "'layers.0.w'" in str(info.value)
    assert not isinstance(info.value, HeaderError)


@pytest.mark.parametrize("name", [".", "./", "./."])
def test_read_index_rejects_dot_as_a_file_name(tmp_path: Path, name: str) -> None:
    idx = write_index(tmp_path / "model.safetensors.index.json", {"w": name})
    with pytest.raises(CheckpointError):
        read_index(idx)


def test_safe_relative_name_message_names_the_location() -> None:
    with pytest.raises(CheckpointError, match=r"^here: shard file '\.\./x' points outside"):
        safe_relative_name("../x", "here")


@pytest.mark.parametrize(
    "doc",
    [{"metadata": {}}, {"weight_map": ["a", "b"]}, {"weight_map": "x"}, {"weight_map": None}, ["weight_map"], 3],
    ids=["missing", "list", "string", "null", "top-level-list", "number"],
)
def test_read_index_without_a_weight_map_object_is_rejected(tmp_path: Path, doc: object) -> None:
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="no 'weight_map' object"):
        read_index(idx)


def test_read_index_rejects_duplicate_tensor_keys(tmp_path: Path) -> None:
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text('{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}')
    with pytest.raises(CheckpointError, match=r"index\.json: tensor 'w' appears twice in the index"):
        read_index(idx)


def test_read_index_rejects_invalid_json_and_missing_file(tmp_path: Path) -> None:
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text('{"weight_map": {')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_index(idx)
    idx.write_bytes(b'{"weight_map": {"\xff": "a"}}')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_index(idx)
    with pytest.raises(CheckpointError, match="index file not found"):
        read_index(tmp_path / "nope.index.json")


# ---------------------------------------------------------------------------------------------
# open_checkpoint: index and shards must agree


def shard(path: Path, *names: str) -> Path:
    write_safetensors(path, [(n, "U8", (2,), b"\1\2") for n in names])
    return path


def make_ckpt(root: Path, shards: dict[str, tuple[str, ...]], weight_map: dict[str, str] | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for file, names in shards.items():
        shard(root / file, *names)
    if weight_map is not None:
        write_index(root / "model.safetensors.index.json", weight_map)
    return root


def test_open_checkpoint_with_consistent_index_succeeds(tmp_path: Path) -> None:
    root = make_ckpt(
        tmp_path / "ck",
        {"s1.safetensors": ("a", "b"), "s2.safetensors": ("c",)},
        {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"},
    )
    ck = open_checkpoint(root, need_config=False)
    assert ck.config is None and "config.json not found" in (ck.config_error or "")
    assert ck.index_file == "model.safetensors.index.json"
    assert {n: t.file for n, t in ck.tensors.items()} == {
        "a": "s1.safetensors",
        "b": "s1.safetensors",
        "c": "s2.safetensors",
    }
    assert ck.total_bytes == 6
    with pytest.raises(CheckpointError, match="config.json not found"):
        ck.require_config()


def test_open_checkpoint_requires_config_by_default(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "ck", {"s.safetensors": ("a",)}, None)
    with pytest.raises(CheckpointError, match="config.json not found"):
        open_checkpoint(root)


def test_open_checkpoint_rejects_index_naming_a_missing_file(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "ck", {"s1.safetensors": ("a",)}, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(
        CheckpointError, match=r"^s2\.safetensors: named by model\.safetensors\.index\.json but missing"
    ):
        open_checkpoint(root, need_config=False)


def test_open_checkpoint_rejects_tensor_in_index_but_not_in_shard(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "ck", {"s1.safetensors": ("a",)}, {"a": "s1.safetensors", "ghost": "s1.safetensors"})
    with pytest.raises(
        CheckpointError, match=r"tensor 'ghost' is mapped to s1\.safetensors but that shard does not contain it"
    ):
        open_checkpoint(root, need_config=False)


def test_open_checkpoint_rejects_tensor_in_shard_but_not_in_index(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "ck", {"s1.safetensors": ("a", "extra")}, {"a": "s1.safetensors"})
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(root, need_config=False)
    msg = str(info.value)
    assert "absent from the index" in msg and "'extra'" in msg and "s1.safetensors" in msg


def test_open_checkpoint_rejects_tensor_mapped_to_the_wrong_file(tmp_path: Path) -> None:
    root = make_ckpt(
        tmp_path / "ck",
        {"s1.safetensors": ("a", "c"), "s2.safetensors": ("b",)},
        {"a": "s2.safetensors", "b": "s2.safetensors", "c": "s1.safetensors"},
    )
    with pytest.raises(
        CheckpointError, match=r"tensor 'a' is mapped to s2\.safetensors but is stored in s1\.safetensors"
    ):
        open_checkpoint(root, need_config=False)


@pytest.mark.parametrize("with_index", [True, False])
def test_open_checkpoint_rejects_a_tensor_stored_in_two_shards(tmp_path: Path, with_index: bool) -> None:
    wm = {"a": "s1.safetensors", "b": "s2.safetensors"} if with_index else None
    root = make_ckpt(tmp_path / "ck", {"s1.safetensors": ("a",), "s2.safetensors": ("a", "b")}, wm)
    with pytest.raises(CheckpointError, match=r"s2\.safetensors: tensor 'a' is also stored in s1\.safetensors"):
        open_checkpoint(root, need_config=False)


def test_open_checkpoint_without_index_reads_every_shard_in_the_folder(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "ck", {"b.safetensors": ("y",), "a.safetensors": ("x",)}, None)
    ck = open_checkpoint(root, need_config=False)
    assert ck.index_file is None
    assert list(ck.shards) == ["a.safetensors", "b.safetensors"]
    assert set(ck.tensors) == {"x", "y"}


def test_open_checkpoint_of_one_safetensors_file_reads_only_it(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "ck", {"a.safetensors": ("x",), "b.safetensors": ("y",)}, None)
    ck = open_checkpoint(root / "b.safetensors", need_config=False)
    assert list(ck.shards) == ["b.safetensors"] and set(ck.tensors) == {"y"}
    assert ck.root == root


def test_open_checkpoint_rejects_empty_folder_and_nonexistent_path(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        open_checkpoint(tmp_path / "empty", need_config=False)
    with pytest.raises(CheckpointError, match="no such file or folder"):
        open_checkpoint(tmp_path / "nowhere", need_config=False)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="not a folder, an index .json or a .safetensors file"):
        open_checkpoint(tmp_path / "notes.txt", need_config=False)


def test_open_checkpoint_propagates_a_shard_header_error_naming_the_shard(tmp_path: Path) -> None:
    root = make_ckpt(tmp_path / "ck", {"s1.safetensors": ("a",)}, {"a": "s1.safetensors", "b": "bad.safetensors"})
    write_raw(root / "bad.safetensors", "[]")
    with pytest.raises(HeaderError, match=r"^bad\.safetensors: "):
        open_checkpoint(root, need_config=False)


def test_open_checkpoint_rejects_index_escaping_the_folder(tmp_path: Path) -> None:
    shard(tmp_path / "outside.safetensors", "a")
    root = make_ckpt(tmp_path / "ck", {}, {"a": "../outside.safetensors"})
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        open_checkpoint(root, need_config=False)


# ---------------------------------------------------------------------------------------------
# Compatibility with the reference implementation


def test_file_written_by_safetensors_reads_back_the_same_bytes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "e4m3": (torch.randn(4, 16, generator=g) * 10).to(torch.float8_e4m3fn),
        "e8m0": torch.randint(100, 150, (4, 2), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "i8": torch.randint(-128, 127, (7, 3), generator=g, dtype=torch.int8),
        "f32": torch.randn(2, generator=g),
        "i64": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    path = tmp_path / "ref.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})

    h = read_shard_header(path)
    assert set(h.tensors) == set(tensors)
    assert h.metadata == {"format": "pt", "note": "x"}
    expected_dtype = {
        "bf16": "BF16",
        "e4m3": "F8_E4M3",
        "e8m0": "F8_E8M0",
        "i8": "I8",
        "f32": "F32",
        "i64": "I64",
        "empty": "BF16",
    }
    blob = path.read_bytes()
    with safe_open(str(path), framework="pt") as f:
        for name, info in h.tensors.items():
            ref = f.get_tensor(name)
            assert info.dtype == expected_dtype[name] == f.get_slice(name).get_dtype()
            assert info.shape == tuple(ref.shape) == tuple(tensors[name].shape)
            assert blob[info.start : info.end] == ref.contiguous().view(torch.uint8).numpy().tobytes()
            assert info.nbytes == ref.numel() * ref.element_size()


def test_fnuz_fp8_files_written_by_safetensors_parse(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    path = tmp_path / "fnuz.safetensors"
    save_file(
        {"a": torch.zeros(4, dtype=torch.float8_e4m3fnuz), "b": torch.zeros(4, dtype=torch.float8_e5m2fnuz)}, str(path)
    )
    h = read_shard_header(path)
    assert {t.dtype for t in h.tensors.values()} == {"F8_E4M3FNUZ", "F8_E5M2FNUZ"}


@pytest.mark.parametrize("dtype", sorted(TORCH_NAMES))
def test_dtype_table_names_the_torch_dtype_safetensors_writes_and_loads(tmp_path: Path, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    tensor = torch.zeros(2, 4, dtype=getattr(torch, TORCH_NAMES[dtype]))
    path = tmp_path / "d.safetensors"
    save_file({"w": tensor}, str(path))
    info = read_shard_header(path).tensors["w"]
    assert info.dtype == dtype and tensor.element_size() * 8 == DTYPE_BITS[dtype]
    assert load_file(str(path))["w"].dtype == tensor.dtype


@pytest.mark.parametrize(
    "module",
    [
        "ckpt_tool.checkpoint.dtypes",
        "ckpt_tool.checkpoint.headers",
        "ckpt_tool.checkpoint.source",
        "ckpt_tool.checkpoint.summary",
    ],
)
def test_header_modules_do_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"importing {module} imported torch\n{res.stderr}"
