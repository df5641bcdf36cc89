"""Twins (``ckpt_tool/output/twins.py``): a tensor a streamed conversion copies from a file an earlier rank group of
the same run wrote, instead of reading its source bytes again (the MTP draft's embedding and head)."""

from __future__ import annotations

import pytest

from ckpt_tool.checkpoint.hub_ranges import block_counts
from ckpt_tool.checkpoint.reader import LocalFiles
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.mapping.plan import Options
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.output.convert import rank_groups
from ckpt_tool.output.twins import find_twins, twins_of
from ckpt_tool.output.writer import SourceFiles, source_reads, write_output_file


def _plan(src, tp):
    ckpt = open_checkpoint(src)
    return plan_conversion(ckpt.require_config(), ckpt.tensors, Options(tp=tp))


@pytest.mark.parametrize("tp", [1, 2])
def test_the_drafts_embedding_and_head_are_twins_of_the_targets_of_the_same_rank(fixture_dir, tp) -> None:
    """The draft's rank r holds the rows of the embedding and the head that the target's rank r holds: those two
    tensors, and nothing else, are twins, each of the target file of its rank (an earlier group); the ranks of one
    group, which are written at once, are never each other's twins (a norm every rank replicates)."""
    plan = _plan(fixture_dir("fp4"), tp)
    groups = rank_groups(plan.files)
    assert [g[0].component for g in groups] == ["model", "mtp"]
    twins = find_twins(groups, plan.sources)
    expected = {}
    for r, (target, draft) in enumerate(zip(groups[0], groups[1], strict=True)):
        assert target.relpath.endswith(f"rank-{r}-part-0.safetensors")
        head = next(t.name for t in draft.tensors if t.name.endswith(".head.weight"))
        for name in ("model.embed_tokens.weight", head):
            expected[draft.relpath, name] = target.relpath
    assert {key: twin.relpath for key, twin in twins.items()} == expected


def test_a_draft_with_its_own_embedding_and_head_has_no_twins(fixture_dir) -> None:
    plan = _plan(fixture_dir("fp4-mtp-emb"), 2)
    assert find_twins(rank_groups(plan.files), plan.sources) == {}


def test_files_written_with_twins_are_the_same_and_read_the_announced_bytes_only(fixture_dir, tmp_path) -> None:
    """Written group after group, twins copied from the files before: every file is the file written from the
    source (same bytes, same sha256); the source reads made are those ``source_reads`` announces with the twins
    skipped (what the stream's spool counts), so the twins' source bytes are read once, by the target's ranks."""
    src = fixture_dir("fp4")
    plan = _plan(src, 2)
    groups = rank_groups(plan.files)
    twins = find_twins(groups, plan.sources)
    made: list[tuple[str, int, int]] = []

    class Recording(LocalFiles):
        def read_into(self, file, into, offset, *, what=""):
            made.append((str(file), offset, len(into)))
            super().read_into(file, into, offset, what=what)

    out, plain = tmp_path / "out", tmp_path / "plain"
    with SourceFiles(src, {}, Recording(src)) as files:
        for group in groups:
            for f in group:
                (out / f.relpath).parent.mkdir(parents=True, exist_ok=True)
                copies = {name: (out / t.relpath, t.offset) for name, t in twins_of(f, twins).items()}
                got = write_output_file(f, out / f.relpath, files, plan.sources, one_pass=True, twins=copies)
                (plain / f.relpath).parent.mkdir(parents=True, exist_ok=True)
                want = write_output_file(f, plain / f.relpath, SourceFiles(src, {}), plan.sources, one_pass=True)
                assert got == want and (out / f.relpath).read_bytes() == (plain / f.relpath).read_bytes(), f.relpath
    assert block_counts(source_reads(plan.files, plan.sources, twins), 4096) == block_counts(made, 4096)
    assert block_counts(source_reads(plan.files, plan.sources), 4096) != block_counts(made, 4096)
