"""The writer's one pass over interleaved source bytes (``write_output_file(..., one_pass=True)``,
``ckpt_tool/output/writer.py``): what a streamed conversion writes, so that a rank's routed experts are read from the
source once, ``w13`` and ``w2`` together, instead of ``w13`` first and ``w2`` from a second pass the stream would
keep on local disk in between."""

from __future__ import annotations

import fcntl
import hashlib
import os

import pytest

from ckpt_tool.checkpoint import reader as reads
from ckpt_tool.checkpoint.reader import DIRECT_ALIGN, LocalFiles
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.mapping.plan import Options
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.output import writer
from ckpt_tool.output.writer import SegmentReader, SourceFiles, interleaved_groups, write_output_file


def _plan(src, tp):
    ckpt = open_checkpoint(src)
    return plan_conversion(ckpt.require_config(), ckpt.tensors, Options(tp=tp))


@pytest.mark.parametrize("direct", [True, False], ids=["direct-io", "page-cache"])
@pytest.mark.parametrize(
    ("variant", "tp"), [("fp4", 1), ("fp4", 4), ("fp8-e8m0-pad", 1), ("v41", 2), ("dspark-fp4", 4), ("vl-fp4", 2)]
)
def test_one_pass_writes_the_same_bytes_and_checksum_with_the_experts_in_one_group(
    fixture_dir, tmp_path, monkeypatch, variant, tp, direct
) -> None:
    """Every planned file, written in one pass and the usual way, is the same file with the same sha256; and the pass
    really is one: a rank's stacked routed experts (``w13_weight`` with ``w2_weight`` and the scales) form one group.
    The tensors after a group's first are written at their offsets, so the pipeline's direct writes start and end
    mid-page around them; ``page-cache``: the same without direct I/O."""
    monkeypatch.setattr(reads, "DIRECT_IO", direct and reads.DIRECT_IO)
    src = fixture_dir(variant)
    plan = _plan(src, tp)
    grouped = 0
    with SourceFiles(src, {}) as files:
        for f in plan.files:
            usual = write_output_file(f, tmp_path / "usual.safetensors", files, plan.sources)
            one = write_output_file(f, tmp_path / "one.safetensors", files, plan.sources, one_pass=True)
            data = (tmp_path / "one.safetensors").read_bytes()
            assert one == usual and data == (tmp_path / "usual.safetensors").read_bytes(), f.relpath
            assert one[1] == hashlib.sha256(data).hexdigest()
            for group in interleaved_groups(f.tensors, SegmentReader(files, plan.sources)):
                names = [t.name.rsplit(".", 1)[-1] for t in group]
                if "w13_weight" in names:
                    assert "w2_weight" in names, names
                    grouped += 1
    assert grouped > 0


def test_one_pass_reads_each_source_file_front_to_back(fixture_dir, tmp_path) -> None:
    """Written in one pass, a rank's file reads every source file from its start to its end, never going back; the
    usual way it goes back (``w2`` after all of ``w13``), which is what a streamed source had to keep."""
    src = fixture_dir("fp4")
    plan = _plan(src, 2)
    made: list[tuple[str, int]] = []

    class Recording(LocalFiles):
        def read_into(self, file, into, offset, *, what=""):
            made.append((str(file), offset))
            super().read_into(file, into, offset, what=what)

    def backwards() -> int:
        last: dict[str, int] = {}
        back = 0
        for file, offset in made:
            back += offset < last.get(file, -1)
            last[file] = offset
        return back

    f = plan.files[0]
    with SourceFiles(src, {}, Recording(src)) as files:
        write_output_file(f, tmp_path / "usual.safetensors", files, plan.sources)
        usual = backwards()
        made.clear()
        write_output_file(f, tmp_path / "one.safetensors", files, plan.sources, one_pass=True)
    assert usual > 0
    assert backwards() == 0


@pytest.mark.skipif(not reads.DIRECT_IO, reason="direct I/O is off (CKPT_TOOL_DIRECT_IO=0 or no O_DIRECT)")
def test_in_one_pass_only_partial_pages_go_through_the_page_cache(fixture_dir, tmp_path, monkeypatch) -> None:
    """The tensors written at their offsets in one pass reach the disk as the pipeline's bytes do: whole pages with
    direct writes, only the partial page at either end of a run through the page cache (every page-cache page
    written cost about 1.7 s of CPU a GiB on the 2-core VM), and no direct write refused and quietly redone through
    the cache (a misaligned one would be)."""
    src = fixture_dir("fp4")
    plan = _plan(src, 1)
    cached: list[int] = []
    real = writer._pwrite_all

    def recording(fd: int, view: memoryview, off: int) -> int:
        if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            cached.append(len(view))
        return real(fd, view, off)

    monkeypatch.setattr(writer, "_pwrite_all", recording)
    monkeypatch.setattr(writer._Pipeline, "_buffered", lambda self: pytest.fail("a direct write was refused"))
    deferred = 0
    with SourceFiles(src, {}) as files:
        for f in plan.files:
            groups = interleaved_groups(f.tensors, SegmentReader(files, plan.sources))
            later = [t for g in groups for t in g[1:]]
            cached.clear()
            write_output_file(f, tmp_path / "one.safetensors", files, plan.sources, one_pass=True)
            edges = 2 * (len(later) + sum(len(g) > 1 for g in groups) + 1)  # the runs' ends, the file's
            assert sum(cached) <= edges * DIRECT_ALIGN, f.relpath
            deferred += sum(t.nbytes for t in later)
    assert deferred > 8 * sum(cached)  # (the fixture's deferred tensors are many pages: the bound says something)
