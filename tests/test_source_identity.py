"""A source file that changes while ``convert`` runs never ends in a complete OUT.

The change is made for real, mid-run and deterministically: a hook on the progress calls (the writer
reports each buffer once it is in the file, before the file is finished) flips one byte of a source
shard that feeds the file being written. convert must then exit 1 naming the shard and what changed,
with no manifest; the rerun converts again exactly the files that shard fed and ends byte-identical
to a clean conversion of the source as it is now. verify names a source that changed after the
conversion.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import run_cli, snapshot

from ckpt_tool.checkpoint.dtypes import DTYPE_BITS
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.mapping.plan import Options, OutFile, Plan
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.output.layout import JOURNAL, MANIFEST
from ckpt_tool.output.writer import file_size, files_fed

TP, SHARD = 4, "200KB"
OPTS = ["--tp", str(TP), "--max-shard-size", SHARD, "--workers", "1"]  # one file at a time: a file count is a moment
VARIANT = "fp4"
CHANGED_FILE_AT = 30  # the byte flips while this file of the plan (in plan order) is being written


def assert_convert_stops_naming(src: Path, out: Path, capsys, shard: str, *said: str) -> None:
    """convert exits 1 with one line naming ``shard`` and saying each of ``said``; OUT is not complete."""
    code, _stdout, err = run_cli(capsys, "convert", src, out, *OPTS)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert shard in lines[0] and all(s in lines[0] for s in said), lines[0]
    assert not (out / MANIFEST).exists()


def assert_a_clean_conversion_of(src: Path, out: Path, capsys) -> None:
    """OUT holds exactly what an uninterrupted conversion of ``src`` as it is now writes."""
    clean = out.with_name(f"{out.name}-clean")
    assert run_cli(capsys, "convert", src, clean, *OPTS)[0] == 0
    assert snapshot(out) == snapshot(clean)


def the_plan(src: Path) -> Plan:
    ckpt = open_checkpoint(src)
    return plan_conversion(ckpt.require_config(), ckpt.tensors, Options(tp=TP, max_shard_size=200_000))


def byte_read_by(f: OutFile, plan: Plan) -> tuple[str, int]:
    """(source file, absolute offset) of a byte ``f`` copies from a BF16 tensor: flipping its low bit changes
    ``f`` and leaves a finite number (no NaN check rejects it)."""
    for t in f.tensors:
        for seg in t.segments:
            info = plan.sources.get(seg.src)
            if info is None or info.dtype != "BF16" or seg.convert != "copy" or "norm" in info.name:
                continue
            eb = DTYPE_BITS[info.dtype] // 8
            row_bytes = info.nbytes // info.shape[0]
            return info.file, info.start + seg.row0 * row_bytes + seg.col0 * eb
    raise AssertionError(f"{f.relpath} copies no BF16 bytes")


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


def once_written(monkeypatch, after: int, action) -> None:
    """Run ``action`` once, when more than ``after`` bytes of output are in their (temporary) files: the CLI's
    progress display is told of each buffer after it is written and before its file is finished."""
    from ckpt_tool.cli.render import ConvertProgress

    seen = {"bytes": 0, "done": False}
    real = ConvertProgress.advance

    def advance(self, n: int) -> None:
        seen["bytes"] += n
        if not seen["done"] and seen["bytes"] > after:
            seen["done"] = True
            action()
        real(self, n)

    monkeypatch.setattr(ConvertProgress, "advance", advance)


def flip_while_writing(monkeypatch, plan: Plan, src: Path, at: int) -> tuple[str, int]:
    """Flip a byte of the shard file ``at`` reads, once that file's first bytes are in its temporary file."""
    shard, offset = byte_read_by(plan.files[at], plan)
    once_written(monkeypatch, sum(file_size(f) for f in plan.files[:at]), lambda: flip(src / shard, offset))
    return shard, offset


def test_a_byte_flipped_mid_run_fails_and_the_rerun_reconverts_only_what_that_shard_fed(
    fixture_dir, fixture_copy, tmp_path, capsys, monkeypatch
) -> None:
    src = fixture_copy(VARIANT)
    plan = the_plan(src)
    shard, _offset = flip_while_writing(monkeypatch, plan, src, CHANGED_FILE_AT)
    out = tmp_path / "out"

    assert_convert_stops_naming(src, out, capsys, shard, "changed while converting", "modified at")
    assert not (out / plan.files[CHANGED_FILE_AT].relpath).exists()  # the file being written never got its name
    assert not [p for p in out.rglob("*.tmp")]
    journaled = json.loads((out / JOURNAL).read_text())["files"]
    assert set(journaled) == {f.relpath for f in plan.files[:CHANGED_FILE_AT]}

    monkeypatch.undo()  # the source is stable now
    fed_by_shard = {f.relpath for f in plan.files if shard in files_fed(f, plan.sources)}
    earlier_not_fed = {f.relpath for f in plan.files[:CHANGED_FILE_AT]} - fed_by_shard
    assert earlier_not_fed and fed_by_shard & set(journaled)  # the rerun has files to keep and files to redo
    code, stdout, err = run_cli(capsys, "convert", src, out, *OPTS, "--json")
    doc = json.loads(stdout)
    assert code == 0, err
    assert doc["files_skipped"] == len(earlier_not_fed), doc
    assert doc["files_written"] == len(plan.files) - len(earlier_not_fed), doc

    assert_a_clean_conversion_of(src, out, capsys)


def test_a_source_changed_before_the_manifest_leaves_out_incomplete(
    fixture_copy, tmp_path, capsys, monkeypatch
) -> None:
    """Every file finished, then the source changes: the check before the manifest says so."""
    import ckpt_tool.output.convert as conv

    src = fixture_copy(VARIANT)
    plan = the_plan(src)
    shard, offset = byte_read_by(plan.files[0], plan)
    real_index_doc = conv.index_doc

    def index_doc(*a, **k):  # the first thing _write_final does, after every part file is in OUT
        if not getattr(index_doc, "done", False):
            index_doc.done = True
            flip(src / shard, offset)
        return real_index_doc(*a, **k)

    monkeypatch.setattr(conv, "index_doc", index_doc)
    out = tmp_path / "out"
    assert_convert_stops_naming(src, out, capsys, shard, "changed while converting")

    monkeypatch.undo()
    code, stdout, err = run_cli(capsys, "convert", src, out, *OPTS, "--json")
    assert code == 0, err
    fed = [f for f in plan.files if shard in files_fed(f, plan.sources)]
    assert json.loads(stdout)["files_written"] == len(fed)
    assert_a_clean_conversion_of(src, out, capsys)


def test_a_shard_replaced_by_a_new_file_of_the_same_bytes_and_time_is_still_a_change(
    fixture_copy, tmp_path, capsys, monkeypatch
) -> None:
    """Within one run the inode counts too: a download renamed over the path is another file."""
    src = fixture_copy(VARIANT)
    plan = the_plan(src)
    shard = files_fed(plan.files[0], plan.sources)[0]

    def replace_by_a_copy() -> None:
        st = os.stat(src / shard)
        (src / f"{shard}.new").write_bytes((src / shard).read_bytes())
        os.utime(src / f"{shard}.new", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(src / f"{shard}.new", src / shard)

    once_written(monkeypatch, 0, replace_by_a_copy)
    out = tmp_path / "out"
    assert_convert_stops_naming(src, out, capsys, shard, "changed while converting", "replaced by another file")


@pytest.mark.parametrize("change", ["flip", "touch"])
def test_verify_names_a_source_that_changed_since_the_conversion(change: str, fixture_copy, tmp_path, capsys) -> None:
    src = fixture_copy(VARIANT)
    out = tmp_path / "out"
    assert run_cli(capsys, "convert", src, out, "--tp", "2")[0] == 0
    code, stdout, err = run_cli(capsys, "verify", out, "--source", src, "--level", "structure", "--json")
    assert code == 0, err
    shard = sorted(p.name for p in src.glob("*.safetensors"))[1]
    st = os.stat(src / shard)
    if change == "flip":
        flip(src / shard, st.st_size - 1)
    else:  # the same bytes, another modification time: nothing proves they are the converted ones
        os.utime(src / shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    code, stdout, err = run_cli(capsys, "verify", out, "--source", src, "--level", "structure", "--json")
    doc = json.loads(stdout)
    assert code == 1, err
    failed = doc["failures"]
    assert [c["name"] for c in failed] == ["source-identity"], failed
    assert shard in failed[0]["message"] and "modified at" in failed[0]["message"]
    assert failed[0]["file"] == shard


def test_finalize_refuses_a_shard_made_before_the_source_changed(fixture_copy, tmp_path, capsys) -> None:
    """Scale-out: shard 0 ran, then a source file changed, then shard 1 ran. Finalize names a file shard 0 made from
    the old bytes; once shard 0 runs again (redoing only what that file fed) finalize ends as a clean conversion."""
    src = fixture_copy(VARIANT)
    plan = the_plan(src)
    out = tmp_path / "out"
    assert run_cli(capsys, "convert", src, out, *OPTS, "--shard-index", 0, "--shard-count", 2)[0] == 0
    shard, offset = byte_read_by(plan.files[0], plan)  # plan.files[0] is shard 0's (i % 2 == 0)
    flip(src / shard, offset)
    assert run_cli(capsys, "convert", src, out, *OPTS, "--shard-index", 1, "--shard-count", 2)[0] == 0

    code, _stdout, err = run_cli(capsys, "convert", src, out, *OPTS, "--finalize")
    assert code == 1 and "cannot finalize" in err and shard in err and "rerun its shard" in err, err
    assert not (out / MANIFEST).exists()

    code, stdout, err = run_cli(capsys, "convert", src, out, *OPTS, "--shard-index", 0, "--shard-count", 2, "--json")
    assert code == 0, err
    ours = plan.files[0::2]
    assert json.loads(stdout)["files_written"] == sum(shard in files_fed(f, plan.sources) for f in ours)
    assert run_cli(capsys, "convert", src, out, *OPTS, "--finalize")[0] == 0
    assert_a_clean_conversion_of(src, out, capsys)
