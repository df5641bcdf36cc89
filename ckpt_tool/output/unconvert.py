"""``unconvert``: a converted OUT back into the original checkpoint (DeepSeek's names, one copy of each tensor).

Nothing is guessed from names: the manifest gives the options and profile, OUT/ckpt-tool-source.json
(hashed in the manifest) gives the source's raw safetensors headers (or ``--source SRC`` gives them
for an OUT written before that file existed), and config.json is OUT's copy of the source's. Re-planning
the conversion from those yields, for every output tensor, the exact source rows × columns each of its
byte runs came from; unconvert runs that map backwards: TP ranks are concatenated along their split
dims, stacked experts unstacked, fused tensors unfused, uint8 views written back as I8 / F8_E8M0 (the
dtypes in the recorded headers) and float32 ``2^(b-127)`` scales back to their E8M0 byte ``b``. The
engine's zero padding (shared experts at a tp their blocks do not divide) came from no source byte and
is left behind (verify checks that it is zero).

Every source byte must be covered by the outputs (dropped tensors and those a ``--only`` / ``--ranks``
conversion did not write cannot come back: that is an error unless ``partial``); copies of one source
region (replicated tensors on every rank, materialized MTP embedding/head) must agree byte for byte.
A source file whose tensors all come back is written with its original header, so it is
byte-identical to the original file; the index and config.json are restored verbatim as well.

Memory is bounded: each source tensor is rebuilt in row blocks of at most ``BLOCK_BYTES``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.dtypes import DTYPE_BITS
from ckpt_tool.checkpoint.headers import ShardHeader, TensorInfo, parse_header, read_shard_header
from ckpt_tool.checkpoint.reader import LocalFiles, sha256_file
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.errors import CheckpointError, OutputError
from ckpt_tool.mapping import conversions
from ckpt_tool.mapping.hub_needs import needed_sources
from ckpt_tool.mapping.plan import ZERO, Plan
from ckpt_tool.mapping.selection import plan_run
from ckpt_tool.output.layout import (
    COMPONENTS,
    MANIFEST,
    SOURCE_LAYOUT,
    options_from_manifest,
    read_manifest,
    source_layout,
)

BLOCK_BYTES = 16 * 1024 * 1024


@dataclass
class UnconvertResult:
    dest: Path
    files: list[str] = field(default_factory=list)  # source files written
    identical_files: list[str] = field(default_factory=list)  # written with the original header (whole file identical)
    tensors: int = 0
    bytes: int = 0
    missing: list[str] = field(default_factory=list)  # source tensors that could not be recovered (partial)


@dataclass(frozen=True)
class _Piece:
    """One copy of the source region [row0,row1) x [col0,col1), stored row-major in an output file."""

    path: Path
    offset: int  # absolute byte offset of the region's first element in the output file
    convert: str
    out_eb: int
    stride: (
        int  # output bytes from one row of the region to the next (more than its width: zero padding after each row)
    )


@dataclass
class _Regions:
    rows: int
    cols: int
    pieces: dict[tuple[int, int, int, int], list[_Piece]] = field(default_factory=dict)

    def covered(self) -> bool:
        rects = sorted(self.pieces)
        area = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in rects)
        if area != self.rows * self.cols:
            return False
        for i, a in enumerate(rects):
            for b in rects[i + 1 :]:
                if a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]:
                    return False
        return True


def _load_layout(out: Path, manifest: dict, source: Path | None) -> dict:
    if source is not None:
        return source_layout(open_checkpoint(source))
    rec = manifest.get("source_layout")
    path = out / SOURCE_LAYOUT
    if not rec or not path.is_file():
        raise CheckpointError(
            f"{out}: has no {SOURCE_LAYOUT} (converted by an older ckpt-tool); pass --source SRC, the checkpoint it "
            "was converted from"
        )
    if sha256_file(path) != rec.get("sha256"):
        raise CheckpointError(f"{path}: sha256 differs from the manifest's; the file changed after conversion")
    return json.loads(path.read_text(encoding="utf-8"))


def _source_headers(layout: dict, manifest: dict) -> dict[str, tuple[bytes, ShardHeader]]:
    recorded = (manifest.get("source") or {}).get("files") or {}
    headers: dict[str, tuple[bytes, ShardHeader]] = {}
    for file, rec in layout["files"].items():
        raw = rec["header"].encode("utf-8")
        want = (recorded.get(file) or {}).get("header_sha256")
        if want != hashlib.sha256(raw).hexdigest():
            raise CheckpointError(
                f"{file}: its recorded header does not match the manifest's source fingerprint (another source?)"
            )
        headers[file] = (raw, parse_header(raw, file, int(rec["size"]), len(raw)))
    if set(headers) != set(recorded):
        raise CheckpointError(
            "the source headers and the manifest name different source files: "
            + ", ".join(sorted(set(headers) ^ set(recorded)))
        )
    return headers


def _config(out: Path, manifest: dict) -> tuple[bytes, V4Config]:
    for comp in COMPONENTS:
        path = out / comp / "config.json"
        if path.is_file():
            raw = path.read_bytes()
            if hashlib.sha256(raw).hexdigest() != (manifest.get("source") or {}).get("config_sha256"):
                raise CheckpointError(f"{path}: differs from the source config.json recorded in the manifest")
            return raw, V4Config.load(path)
    raise CheckpointError(f"{out}: no config.json in any of {', '.join(COMPONENTS)}; OUT is incomplete")


def _check_dest(out: Path, dest: Path, force: bool) -> None:
    o, d = out.resolve(), dest.resolve()
    if o == d or o in d.parents or d in o.parents:
        raise OutputError(f"{dest}: DEST must lie outside OUT (and OUT outside DEST)")
    if dest.exists() and not dest.is_dir():
        raise OutputError(f"{dest}: exists and is not a folder")
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise OutputError(f"{dest}: is not empty; choose a new DEST or pass --force to overwrite files in it")


def plan_from_out(out: Path, manifest: dict, headers: dict[str, tuple[bytes, ShardHeader]], config: V4Config) -> Plan:
    """The conversion's plan, re-made from the recorded source headers and options, restricted to the
    files the manifest lists (a ``--ranks`` conversion wrote only some ranks)."""
    opts = options_from_manifest(manifest)
    tensors: dict[str, TensorInfo] = {}
    for _raw, h in headers.values():
        tensors.update(h.tensors)
    if opts.only == "mtp":  # as a hub --only mtp conversion opened it (a local one plans the same files)
        keep = needed_sources(set(tensors), config, opts)
        tensors = {n: t for n, t in tensors.items() if n in keep}
    plan = plan_run(config, tensors, opts).whole
    outputs = manifest.get("outputs") or {}
    files = tuple(f for f in plan.files if f.relpath in outputs)
    unknown = sorted(set(outputs) - {f.relpath for f in files})
    if unknown:
        raise CheckpointError(
            f"{unknown[0]}: recorded in {MANIFEST} but not part of the re-made plan; OUT and its manifest disagree"
        )
    return replace(plan, files=files)


def _regions(out: Path, plan: Plan, manifest: dict, check_checksums: bool) -> dict[str, _Regions]:
    outputs = manifest.get("outputs") or {}
    regions: dict[str, _Regions] = {}
    for f in plan.files:
        path = out / f.relpath
        if not path.is_file():
            raise CheckpointError(f"{f.relpath}: output file is missing from {out}")
        header = read_shard_header(path, f.relpath)
        if header.file_size != outputs[f.relpath].get("size"):
            raise CheckpointError(
                f"{f.relpath}: size {header.file_size} differs from the manifest's {outputs[f.relpath].get('size')}"
            )
        if check_checksums and sha256_file(path) != outputs[f.relpath].get("sha256"):
            raise CheckpointError(f"{f.relpath}: sha256 differs from the manifest; the file changed after conversion")
        for t in f.tensors:
            got = header.tensors.get(t.name)
            if got is None or got.dtype != t.dtype or tuple(got.shape) != tuple(t.shape):
                have = f"{got.dtype}{list(got.shape)}" if got else "absent"
                raise CheckpointError(
                    f"{f.relpath}: tensor {t.name!r} is {have}, the plan says {t.dtype}{list(t.shape)}"
                )
            out_eb = DTYPE_BITS[t.dtype] // 8
            offset = got.start
            for seg in t.segments:
                if seg.src == ZERO:  # the engine's zero padding: no source region
                    offset += seg.numel * out_eb
                    continue
                real = plan.materialized.get(seg.src, seg.src)
                info = plan.sources[real]
                rows = info.shape[0] if info.shape else 1
                cols = info.numel // rows if rows else 0
                reg = regions.setdefault(real, _Regions(rows, cols))
                # a repeated row (an expanded MXFP8 scale): the stride spans its copies, the first is read back
                piece = _Piece(path, offset, seg.convert, out_eb, seg.width * out_eb * seg.repeat)
                reg.pieces.setdefault((seg.row0, seg.row1, seg.col0, seg.col1), []).append(piece)
                offset += seg.numel * out_eb
            if offset != got.end:
                raise CheckpointError(
                    f"{f.relpath}: tensor {t.name!r} holds {got.end - got.start} bytes, its segments "
                    f"{offset - got.start}"
                )
    return regions


def _rebuild(info: TensorInfo, reg: _Regions, reader: LocalFiles, fd: int, dest_start: int, progress) -> None:
    """Write source tensor ``info`` at ``dest_start`` of ``fd``, in blocks of whole rows."""
    eb = DTYPE_BITS[info.dtype] // 8
    row_bytes = reg.cols * eb
    if reg.rows == 0 or row_bytes == 0:
        return
    block_rows = max(1, BLOCK_BYTES // row_bytes)
    for R0 in range(0, reg.rows, block_rows):
        R1 = min(reg.rows, R0 + block_rows)
        buf = np.empty((R1 - R0, row_bytes), dtype=np.uint8)
        for (r0, r1, c0, c1), pieces in reg.pieces.items():
            a, b = max(R0, r0), min(R1, r1)
            if a >= b:
                continue
            width = c1 - c0
            first: np.ndarray | None = None
            for p in pieces:
                raw = reader.read(p.path, p.offset + (a - r0) * p.stride, (b - a) * p.stride)
                if p.stride != width * p.out_eb:  # drop the zero padding after each row
                    raw = np.frombuffer(raw, np.uint8).reshape(b - a, p.stride)[:, : width * p.out_eb].tobytes()
                data = conversions.inverse(p.convert, raw, f"{p.path.name}: {info.name}")
                data = data.reshape(b - a, width * eb)
                if first is None:
                    first = data
                elif not np.array_equal(first, data):
                    raise CheckpointError(
                        f"{info.name}: copies disagree (rows {a}:{b}, cols {c0}:{c1}) between {pieces[0].path.name} "
                        f"and {p.path.name}; "
                        "replicated tensors must be identical on every rank"
                    )
            buf[a - R0 : b - R0, c0 * eb : c1 * eb] = first
        data = buf.tobytes()
        view = memoryview(data)
        pos = dest_start + R0 * row_bytes
        while view:
            k = os.pwrite(fd, view, pos)
            view, pos = view[k:], pos + k
        if progress:
            progress(len(data))


def _header_for(tensors: list[TensorInfo], metadata: dict[str, str]) -> bytes:
    doc: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in tensors:
        doc[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    return raw + b" " * ((8 - len(raw) % 8) % 8)


def _index_map(text: str | None) -> dict[str, str] | None:
    try:
        doc = json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    return wm if isinstance(wm, dict) else None


def _recoverable(
    headers: dict[str, tuple[bytes, ShardHeader]],
    regions: dict[str, _Regions],
    plan: Plan,
    manifest: dict,
    partial: bool,
    result: UnconvertResult,
) -> set[str]:
    """The source tensors OUT covers whole (the rest noted in ``result.missing``); without ``partial`` a missing one
    is an error that says why it is missing."""
    recoverable: set[str] = set()
    for _raw, h in headers.values():
        for name in h.tensors:
            reg = regions.get(name)
            if reg is not None and reg.covered():
                recoverable.add(name)
            else:
                result.missing.append(name)
    if result.missing and not partial:
        why = []
        if plan.dropped:
            why.append("dropped by the profile")
        if plan.options.only:
            why.append(f"not converted (--only {plan.options.only})")
        if manifest.get("ranks") is not None:
            why.append(f"only ranks {manifest['ranks']} were converted")
        shown = ", ".join(sorted(result.missing)[:5])
        raise CheckpointError(
            f"{len(result.missing)} source tensor(s) are not in OUT ({'; '.join(why) or 'not written'}), e.g. {shown}; "
            "pass --partial to write the ones that are"
        )
    return recoverable


def _write_source_file(
    target: Path,
    header: bytes,
    keep: list[TensorInfo],
    starts: dict[str, int],
    size: int,
    regions: dict[str, _Regions],
    reader: LocalFiles,
    progress,
    result: UnconvertResult,
) -> None:
    """One source file rebuilt: ``header``, then each tensor of ``keep`` at its start, written to a temporary that
    is renamed into place once complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, struct.pack("<Q", len(header)) + header, 0)
        for t in keep:
            _rebuild(t, regions[t.name], reader, fd, starts[t.name], progress)
            result.tensors += 1
            result.bytes += t.nbytes
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)


def unconvert(
    out: Path,
    dest: Path,
    *,
    source: Path | None = None,
    partial: bool = False,
    force: bool = False,
    check_checksums: bool = True,
    progress=None,
) -> UnconvertResult:
    """Rebuild the original checkpoint of converted folder ``out`` in ``dest``."""
    manifest = read_manifest(out)
    if manifest is None or manifest.get("complete") is not True:
        raise CheckpointError(f"{out / MANIFEST}: missing or not complete; OUT is not a finished ckpt-tool conversion")
    config_raw, config = _config(out, manifest)
    layout = _load_layout(out, manifest, source)
    headers = _source_headers(layout, manifest)
    plan = plan_from_out(out, manifest, headers, config)
    regions = _regions(out, plan, manifest, check_checksums)

    result = UnconvertResult(dest)
    recoverable = _recoverable(headers, regions, plan, manifest, partial, result)
    _check_dest(out, dest, force)
    dest.mkdir(parents=True, exist_ok=True)

    reader = LocalFiles()
    written_names: dict[str, str] = {}
    if hasattr(progress, "stage"):  # a verdict.Progress: one stage, bytes, the file being written as description
        total = sum(t.nbytes for _raw, h in headers.values() for t in h.tensors.values() if t.name in recoverable)
        progress.stage("unconvert", total)
    try:
        for file in sorted(headers):
            raw, h = headers[file]
            keep = [t for t in h.tensors.values() if t.name in recoverable]
            if not keep:
                continue
            if hasattr(progress, "advance"):
                progress.advance(0, file)
            whole = len(keep) == len(h.tensors)
            if whole:
                header = raw
                starts = {t.name: t.start for t in keep}
                size = h.file_size
            else:
                header = _header_for(sorted(keep, key=lambda t: t.start), h.metadata)
                starts, pos = {}, 8 + len(header)
                for t in sorted(keep, key=lambda t: t.start):
                    starts[t.name] = pos
                    pos += t.nbytes
                size = pos
            _write_source_file(dest / file, header, keep, starts, size, regions, reader, progress, result)
            written_names.update((t.name, file) for t in keep)
            result.files.append(file)
            if whole:
                result.identical_files.append(file)
    finally:
        reader.close()

    (dest / "config.json").write_bytes(config_raw)
    for rel in manifest.get("serving_files") or {}:  # tokenizer, generation config, ...: copied verbatim
        comp, _, name = str(rel).partition("/")
        if comp == "model" and name not in ("", ".", "..") and "/" not in name and (out / comp / name).is_file():
            shutil.copyfile(out / comp / name, dest / name)
    index_file = layout.get("index_file")
    if index_file:
        original = _index_map(layout.get("index"))
        if original is not None and original == written_names:  # every tensor the index names came back
            (dest / index_file).write_text(layout["index"], encoding="utf-8")
        else:
            doc = {"metadata": {"total_size": result.bytes}, "weight_map": dict(sorted(written_names.items()))}
            (dest / index_file).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return result
