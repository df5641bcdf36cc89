"""The values level of ``verify``: every output tensor re-derived from the source bytes and compared exactly.

Byte-equal for renames/slices/fusions/stacks, value-equal for E8M0 → float32; the engine's zero padding (shared
experts at a tp their blocks do not divide) must hold the zero element. The source side is read through its own
reader (``pread`` in bounded row blocks, cut with numpy), not the writer's gather code; each output file is read once,
sequentially, and hashed while it is compared. The ranks cut from the same source tensors are compared in lockstep,
and each source block is read once for all of them (``ckpt_tool.verify.shared_rows``; in one pass, through the page
cache, where the numeric level's workers read it again).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from itertools import islice
from pathlib import Path

import numpy as np

from ckpt_tool.checkpoint.dtypes import DTYPE_BITS
from ckpt_tool.checkpoint.headers import ShardHeader, TensorInfo
from ckpt_tool.checkpoint.lockstep import Lockstep
from ckpt_tool.checkpoint.reader import ByteSource, SequentialRead
from ckpt_tool.mapping import conversions
from ckpt_tool.mapping.plan import ZERO, OutFile, OutTensor, Plan, Segment
from ckpt_tool.processes import stop_signals_to_main
from ckpt_tool.verify.one_pass import OnePass, Walk
from ckpt_tool.verify.shared_rows import Key, SharedRows
from ckpt_tool.verify.verdict import Check, Progress, VerifyReport

VALUE_BLOCK_BYTES = 8 * 1024 * 1024  # bytes compared at once per worker (a few copies live at a time)
# the source bytes a group's ranks may be apart by: a source block read for the first rank is kept in memory for the
# others (ckpt_tool.verify.shared_rows) until the last one has cut from it. One OUT byte of a row-parallel weight is
# cut from tp source bytes, so the ranks are kept within LOCKSTEP_WINDOW / tp bytes of their own files of each other
# (at tp 8: 32 MiB, four 8 MiB blocks, enough for the ranks' threads to take turns on the cores without waiting on
# each other's every block) and a group keeps at most twice this (``SharedRows(most=...)``: the slack for ep, whose
# ranks meet a block at different places of their files).
LOCKSTEP_WINDOW = 256 * 1024 * 1024

SMALL_TENSORS = 8  # a source tensor of at most 1/8 of a read block is read whole, once for every rank (_seg_blocks)


def _out_width(t: OutTensor) -> int:
    return t.segments[0].width


def check_values(
    out: Path,
    plan: Plan,
    source: ByteSource,
    headers: dict[str, ShardHeader],
    report: VerifyReport,
    progress: Progress,
    *,
    workers: int = 1,
    manifest: dict | None = None,
    window: int | None = None,
    pace: OnePass | None = None,
) -> None:
    """Re-derive every output tensor from the source and compare exactly.

    Each output file is read once, sequentially in 8 MiB blocks, and hashed while it is compared; with
    ``manifest`` the digest is checked against it here (check_structure then skipped hashing). The source
    is read with ``pread`` in row blocks and cut with numpy, independently of the writer's gather code.

    The ranks' files cut from the same source tensors (:func:`_lockstep_groups`) are compared at once, one thread
    each, kept within ``window`` (default ``LOCKSTEP_WINDOW`` divided among the group's members) bytes of their own
    files of each other (ckpt_tool.checkpoint.lockstep): each rank asks for the source rows it cuts its slice from,
    and the first rank's read is kept for the others (ckpt_tool.verify.shared_rows), so each source block is read
    once for all the ranks checked. ``workers`` files are compared at once where a group has fewer files than that
    (pread, sha256 and the comparisons release the GIL).

    ``source`` is read as it was opened: verify opens it with ``O_DIRECT`` for this level alone (no copy through the
    page cache, except of what the cache already holds: a source just converted is read from there, not from the
    disk again; ckpt_tool.checkpoint.page_cache), buffered under ``pace``.

    ``pace`` (verify --level numeric, ckpt_tool.verify.one_pass): every thread reports its progress to it before each
    block and may be held there, and OUT is read through the page cache (the numeric workers read it again from
    there, and the source too); without it OUT is read with ``O_DIRECT``, as nothing reads it again.
    """
    jobs = [f for f in plan.files if f.relpath in headers]
    progress.stage("values", sum(f.data_bytes for f in jobs))
    groups = _lockstep_groups(jobs)
    threads = max(1, workers, *(len(g) for g in groups))
    # each thread holds its file's read-ahead (SequentialRead.DEPTH + 1 blocks) and a few block-sized copies of
    # source rows and their cut: blocks shrink so that many ranks at once stay within what 8 threads hold
    block = max(min(VALUE_BLOCK_BYTES, 1 << 20), min(VALUE_BLOCK_BYTES, (8 * VALUE_BLOCK_BYTES // threads) >> 12 << 12))

    wanted = [
        Counter(key for member in g for f in member for t in f.tensors for key in _tensor_reads(t, plan, block))
        for g in groups
    ]
    groups_of = Counter(key for reads in wanted for key in reads)
    again = {key for key, n in groups_of.items() if n > 1}  # blocks more than one group reads
    shared: dict[int, SharedRows] = {}
    running = [len(g) for g in groups]  # members of each group not finished
    lock = threading.Lock()

    def group_rows(g: int) -> SharedRows:
        """Group ``g``'s shared source blocks, made when its first member starts, let go when its last ends."""
        with lock:
            if g not in shared:
                shared[g] = SharedRows(source, wanted[g], most=2 * LOCKSTEP_WINDOW, again=again)
                wanted[g] = Counter()
            return shared[g]

    def member(files: list, group: Lockstep, g: int, m: int) -> list[tuple[list[str], str | None, str]]:
        rows = group_rows(g)

        def at(pos: int) -> None:
            if pace is not None:
                pace.advance(g, m, pos)
            group.advance(m, pos)

        try:
            done, results = 0, []
            for f in files:  # a rank's parts one after another: its position runs on across them
                results.append(
                    _values_of_file(
                        out,
                        f,
                        headers[f.relpath],
                        plan,
                        rows,
                        progress,
                        block,
                        lambda pos, done=done: at(done + pos),
                        direct=pace is None,
                    )
                )
                done += headers[f.relpath].file_size
            return results
        finally:
            group.done(m)
            if pace is not None:
                pace.done(g, m)
            with lock:
                running[g] -= 1
                if not running[g]:
                    del shared[g]  # (and the memory it kept for blocks)

    # one pool, the members of a group submitted together: the pool has a thread for every member of the largest
    # group and takes tasks in order, so a group's members all run once the groups before it are done (a member
    # waiting for one not yet started is never stuck: that one starts when an earlier group's thread frees)
    results: dict[str, tuple[list[str], str | None, str]] = {}
    with ThreadPoolExecutor(threads, initializer=stop_signals_to_main) as pool:
        futures = []
        for gi, g in enumerate(groups):
            lockstep = Lockstep(len(g), window or max(4 * block, LOCKSTEP_WINDOW // len(g)))
            futures += [(files, pool.submit(member, files, lockstep, gi, m)) for m, files in enumerate(g)]
        for files, fut in futures:
            results.update(zip((f.relpath for f in files), fut.result()))
    _report_values(jobs, results, manifest, report)


def _report_values(
    jobs: list[OutFile],
    results: dict[str, tuple[list[str], str | None, str]],
    manifest: dict | None,
    report: VerifyReport,
) -> None:
    """One values check per file compared (its first problem, the rest in its details), and a structure failure for
    a file whose sha256, taken while it was compared, is not the manifest's."""
    outputs = (manifest or {}).get("outputs") or {}
    for f in jobs:
        bad, first_tensor, digest = results[f.relpath]
        if manifest is not None and (outputs.get(f.relpath) or {}).get("sha256") != digest:
            report.add(
                Check(
                    f"structure:{f.relpath}",
                    False,
                    f"{f.relpath}: sha256 differs from the manifest; the file changed after conversion",
                    file=f.relpath,
                )
            )
        if bad:
            more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
            report.add(
                Check(
                    f"values:{f.relpath}",
                    False,
                    bad[0] + more,
                    file=f.relpath,
                    tensor=first_tensor,
                    details={"problems": bad},
                )
            )
        else:
            report.add(Check(f"values:{f.relpath}", True, file=f.relpath))


def values_walk(plan: Plan, headers: dict[str, ShardHeader]) -> Walk:
    """The files :func:`check_values` walks, as its threads walk them: groups in order, each a list of members, each
    the ``(relpath, file size)`` of the files one thread reads in turn."""
    jobs = [f for f in plan.files if f.relpath in headers]
    return [
        [[(f.relpath, headers[f.relpath].file_size) for f in files] for files in group]
        for group in _lockstep_groups(jobs)
    ]


def _lockstep_groups(files: list[OutFile]) -> list[list[list[OutFile]]]:
    """The files to compare at once, in lockstep: groups of members, each member the files one thread walks.

    Under tensor parallelism part ``p`` of every rank of a component holds the same tensors in the same order with
    the same sizes (``packing.pack_files`` packs each rank's tensors by the position of their first source byte,
    and a split gives every rank the same shape): the ranks' part ``p`` form a group, one file a member, and their
    byte positions match. Where they do not (``--moe-parallel ep``: a rank's expert stack sorts by its own first expert,
    so parts can hold different tensors) the group is the component, a member one rank's parts in order, its
    position running on across them.

    The MTP component comes first: the numeric level's forward reads all of it again once the walk has passed it
    (ckpt_tool.verify.one_pass), and first, with little else read yet, it is still in the page cache then; last, it
    was partly pushed out by the main model's bytes, which the per-tensor checks had read twice.
    """
    by_comp: dict[str, dict[int, list[OutFile]]] = {}
    for f in sorted(files, key=lambda f: f.component != "mtp"):  # (a stable sort: the plan's order otherwise)
        by_comp.setdefault(f.component, {}).setdefault(f.rank, []).append(f)
    groups: list[list[list[OutFile]]] = []
    for ranks in by_comp.values():
        members = [sorted(fs, key=lambda f: f.part) for fs in ranks.values()]

        def layout(fs: list[OutFile]) -> list[tuple[int, tuple[tuple[str, int], ...]]]:
            return [(f.part, tuple((t.name, t.nbytes) for t in f.tensors)) for f in fs]

        if all(layout(m) == layout(members[0]) for m in members):
            for k in range(len(members[0])):
                groups.append([[m[k]] for m in members])
        else:
            groups.append(members)
    return groups


def _values_of_file(
    out: Path,
    f: OutFile,
    header: ShardHeader,
    plan: Plan,
    rows: SharedRows,
    progress: Progress,
    block: int = VALUE_BLOCK_BYTES,
    at: Callable[[int], None] = lambda pos: None,
    *,
    direct: bool = True,
) -> tuple[list[str], str | None, str]:
    """Compare one output file (``at(pos)``: called with the file position before each block is worked on; ``direct``:
    read it with ``O_DIRECT``, else through the page cache)."""
    reader = SequentialRead(out / f.relpath, header.file_size, block, direct=direct)
    try:
        found: list[tuple[int, str, str]] = []
        order = {t.name: i for i, t in enumerate(f.tensors)}
        for t in sorted(f.tensors, key=lambda t: header.tensors[t.name].start):  # read in file order
            msg = _compare_tensor(t, header.tensors[t.name], reader, plan, rows, block, at)
            if msg:
                found.append((order[t.name], msg, t.name))
            progress.advance(t.nbytes, f.relpath)
        at(header.file_size)
        found.sort()  # report in plan order (a fused weight before its scale)
        return [m for _, m, _ in found], (found[0][2] if found else None), reader.hexdigest()
    finally:
        reader.close()


def _compare_tensor(
    t: OutTensor,
    got: TensorInfo,
    reader: SequentialRead,
    plan: Plan,
    rows: SharedRows,
    block: int = VALUE_BLOCK_BYTES,
    at: Callable[[int], None] = lambda pos: None,
) -> str | None:
    """``t`` compared with the source rows it is cut from: None, or what differs first. The source reads are
    ``_tensor_reads(t)``, through ``rows``; those a mismatch leaves unmade are given up there."""
    made = 0

    @contextmanager
    def take(key: Key, what: str) -> Iterator[memoryview]:
        nonlocal made
        made += 1
        with rows.rows(key, what=what) as view:
            yield view

    finished = False  # every read made: nothing to give up (the reads are listed again only after a mismatch)
    try:
        found = _compare_segments(t, got, reader, take, block, at, plan)
        finished = found is None
        return found
    finally:
        if not finished:
            rows.skip(islice(_tensor_reads(t, plan, block), made, None))


def _compare_segments(
    t: OutTensor,
    got: TensorInfo,
    reader: SequentialRead,
    take: Callable[[Key, str], AbstractContextManager[memoryview]],
    block: int,
    at: Callable[[int], None],
    plan: Plan,
) -> str | None:
    width = _out_width(t)
    out_eb = DTYPE_BITS[t.dtype] // 8
    pos = got.start
    out_row = 0  # rows of the output tensor (seen as 2-D [rows, width]) before the segment
    for seg in t.segments:
        first_row, out_row = out_row, out_row + seg.rows
        zero = np.frombuffer(conversions.zero_element(seg.convert, t.dtype), np.uint8)
        if seg.src == ZERO:  # the engine's zero padding: nothing to read from the source
            rows_per_block = max(1, block // max(1, width * out_eb))
            for r in range(seg.row0, seg.row1, rows_per_block):
                n = min(rows_per_block, seg.row1 - r)
                at(pos)
                actual = reader.read(pos, n * width * out_eb)
                if len(actual) != n * width * out_eb:
                    return f"{t.name}: output file ended early"
                a = np.frombuffer(actual, np.uint8).reshape(-1, out_eb)
                bad = np.flatnonzero((a != zero).any(axis=1))
                if bad.size:
                    row, col = divmod(int(bad[0]), width)
                    return _pad_message(t, seg, first_row + r - seg.row0 + row, col)
                pos += len(actual)
            continue
        info = plan.sources[seg.src]  # a materialized alias carries the offsets of the tensor it aliases
        src_eb = DTYPE_BITS[info.dtype] // 8
        src_row = _source_row_bytes(info)
        whole_rows = seg.col0 == 0 and seg.col1 * src_eb == src_row
        for r, n, key in _seg_blocks(seg, info, width * out_eb, block):
            at(pos)  # (held back here while more than the window ahead of the group's slowest file)
            with take(key, f"tensor {info.name!r}") as block_rows:
                skip = info.start + r * src_row - key[1]  # (a small tensor's block is the whole tensor)
                raw = block_rows[skip : skip + n * src_row]
                want = (
                    bytes(raw)
                    if whole_rows
                    else np.frombuffer(raw, np.uint8)
                    .reshape(n, src_row)[:, seg.col0 * src_eb : seg.col1 * src_eb]
                    .tobytes()
                )
            if seg.convert not in conversions.BYTEWISE:
                want = conversions.forward(seg.convert, want, info)
            if seg.pad:  # each row followed by the engine's zero padding
                padded = np.empty((n, width * out_eb), np.uint8)
                padded[:, : (width - seg.pad) * out_eb] = np.frombuffer(want, np.uint8).reshape(n, -1)
                padded[:, (width - seg.pad) * out_eb :] = np.tile(zero, seg.pad)
                want = padded.tobytes()
            if seg.repeat > 1:  # each source row written repeat times (an expanded MXFP8 scale)
                want = np.repeat(np.frombuffer(want, np.uint8).reshape(n, -1), seg.repeat, axis=0).tobytes()
            nbytes = n * seg.repeat * width * out_eb
            assert len(want) == nbytes, (t.name, len(want), nbytes)
            if pos + nbytes > reader.size:
                return f"{t.name}: output file ended early"
            differs = reader.mismatch(pos, want)  # (compared where the file's bytes were read to: no copy of them)
            if differs is not None:
                row, col = divmod(differs // out_eb, width)
                row //= seg.repeat
                if col >= width - seg.pad:
                    return _pad_message(t, seg, first_row + r - seg.row0 + row, col)
                what = "bytes" if seg.convert in conversions.BYTEWISE else "value"
                return (
                    f"tensor {t.name!r}: {what} differ from source {seg.src} "
                    f"(rows {seg.row0}:{seg.row1}, cols {seg.col0}:{seg.col1}) first at source element "
                    f"[{r + row}, {seg.col0 + col}]"
                )
            pos += nbytes
    return None


def _source_row_bytes(info: TensorInfo) -> int:
    """Bytes of one row of source tensor ``info`` seen as 2-D (its first dimension the rows)."""
    return (info.numel // info.shape[0] if info.shape else 1) * (DTYPE_BITS[info.dtype] // 8)


def _seg_blocks(seg: Segment, info: TensorInfo, out_row: int, block: int) -> Iterator[tuple[int, int, Key]]:
    """The source reads a segment is compared in: ``(first row, rows, (file, offset, length))``, whole source rows of
    about ``block`` bytes (and about ``block`` bytes of output rows ``out_row`` bytes long). A tensor of at most
    ``block / SMALL_TENSORS`` bytes (1 MiB at tp 8) is one block, whole, whatever rows the segment takes: the ranks'
    row slices of an expert's scale (32 KiB each at tp 8) are one read shared by all of them, large enough to go
    around the page cache (``reader.DIRECT_FROM``), instead of eight small ones."""
    src_row = _source_row_bytes(info)
    if info.nbytes <= block // SMALL_TENSORS:
        yield seg.row0, seg.row1 - seg.row0, (info.file, info.start, info.nbytes)
        return
    step = max(1, block // max(1, src_row, out_row))
    for r in range(seg.row0, seg.row1, step):
        n = min(step, seg.row1 - r)
        yield r, n, (info.file, info.start + r * src_row, n * src_row)


def _tensor_reads(t: OutTensor, plan: Plan, block: int) -> Iterator[Key]:
    """Every source read :func:`_compare_tensor` makes for ``t``, in order."""
    out_row = _out_width(t) * (DTYPE_BITS[t.dtype] // 8)  # as _compare_segments computes it
    for seg in t.segments:
        if seg.src != ZERO:
            for _, _, key in _seg_blocks(seg, plan.sources[seg.src], out_row, block):
                yield key


def _pad_message(t: OutTensor, seg: Segment, row: int, col: int) -> str:
    """A byte of the engine's zero padding that is not the zero element, at ``[row, col]`` of the segment's output."""
    where = "after " + (
        f"source {seg.src} (rows {seg.row0}:{seg.row1}, cols {seg.col0}:{seg.col1})" if seg.pad else "the source rows"
    )
    zero = "0" if seg.convert != "e8m0_to_f32" else "2^-127 (the float32 value of E8M0 byte 0)"
    return (
        f"tensor {t.name!r}: the engine's zero padding ({seg.zeros} elements {where}) holds something other than "
        f"{zero}, "
        f"first at element [{row}, {col}] of the output seen as 2-D; reconvert"
    )
