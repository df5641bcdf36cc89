"""``verify``: prove a converted checkpoint right, level by level.

1. structure — from headers and the manifest: the output files, tensor names, dtypes, shapes and rank
   sets are exactly what the rules give for the source and the recorded options; index.json agrees;
   every file's size and sha256 match the manifest; the source is the one that was converted.
2. values — every output tensor re-derived from the source bytes and compared exactly: byte-equal for
   renames/slices/fusions/stacks, value-equal for E8M0 → float32. The source side is read through
   safetensors' own slicing (not the writer's gather code), in bounded row blocks.
3. numeric — a reference forward of every MTP layer from the source (dequantized torch) and from the
   converted ranks (through the GEMM kernels), compared within stated tolerances (see numeric.py).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import conversions
from .convert import COMPONENTS, MANIFEST, index_doc, options_from_manifest, source_fingerprint
from .errors import CkptToolError
from .format import DTYPE_BITS, ShardHeader, TensorInfo, read_shard_header
from .plan import OutTensor, Plan, plan_conversion
from .source import Checkpoint, open_checkpoint
from .writer import sha256_file

log = logging.getLogger(__name__)

LEVELS = ("structure", "values", "numeric")
VALUE_BLOCK_BYTES = 8 * 1024 * 1024  # bound on the bytes compared at once (a few copies live at a time)


@dataclass
class Check:
    """One verdict, reported as one JUnit testcase."""

    name: str
    ok: bool
    message: str = ""
    file: str | None = None
    tensor: str | None = None
    details: dict = field(default_factory=dict)


@dataclass
class VerifyReport:
    out: str
    source: str
    level: str
    checks: list[Check] = field(default_factory=list)
    numeric: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        if not check.ok:
            log.info("verify failure: %s: %s", check.name, check.message)
        return check

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "out": self.out,
            "source": self.source,
            "level": self.level,
            "checks": len(self.checks),
            "failed": len(self.failures),
            "failures": [asdict(c) for c in self.failures],
            "passed": [c.name for c in self.checks if c.ok],
            "numeric": self.numeric,
        }


def verify(
    out: Path,
    source: Path | Checkpoint,
    *,
    level: str = "numeric",
    kernels: str = "auto",
    device: str = "auto",
    tokens: int = 16,
    seed: int = 0,
    progress=None,
) -> VerifyReport:
    """Run the checks up to ``level``. Never raises for a failed check: failures are in the report."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}")
    report = VerifyReport(str(out), str(source.root if isinstance(source, Checkpoint) else source), level)
    manifest_path = out / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        report.add(Check("manifest", False, f"{manifest_path}: missing; OUT is not a finished ckpt-tool conversion", file=str(manifest_path)))
        return report
    except (OSError, json.JSONDecodeError) as exc:
        report.add(Check("manifest", False, f"{manifest_path}: unreadable ({exc})", file=str(manifest_path)))
        return report
    if manifest.get("complete") is not True:
        report.add(Check("manifest", False, f"{manifest_path}: conversion is not complete; rerun convert to finish it", file=str(manifest_path)))
        return report
    report.add(Check("manifest", True))

    try:
        ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(source)
        config = ckpt.require_config()
        opts = options_from_manifest(manifest)
        plan = plan_conversion(config, ckpt.tensors, opts)
        ranks = manifest.get("ranks")
        if ranks is not None:  # a --ranks run: only those ranks were written
            from .convert import select_files

            plan = replace(plan, files=tuple(select_files(plan, [int(r) for r in ranks])))
    except CkptToolError as exc:
        report.add(Check("plan", False, str(exc)))
        return report
    report.add(Check("plan", True, details={"tensors": plan.tensor_count, "files": len(plan.files)}))

    recorded_source = manifest.get("source") or {}
    recorded = recorded_source.get("files")
    fingerprint = source_fingerprint(ckpt)
    current = fingerprint["files"]
    if recorded != current:
        changed = sorted(f for f in set(recorded or {}) | set(current) if (recorded or {}).get(f) != current.get(f))
        report.add(Check("source-fingerprint", False, f"source differs from the one converted (files: {', '.join(changed[:5])}); reconvert", file=changed[0] if changed else None))
    elif recorded_source.get("config_sha256") != fingerprint["config_sha256"]:
        report.add(Check("source-fingerprint", False, "source config.json differs from the one converted; reconvert", file="config.json"))
    else:
        report.add(Check("source-fingerprint", True))

    headers = check_structure(out, plan, manifest, report, ckpt.root)
    check_engine(plan, headers, report)
    if level in ("values", "numeric") and report.ok:
        check_values(out, plan, ckpt.root, headers, report, progress)
    if level == "numeric" and report.ok and manifest.get("ranks") is not None and len(manifest["ranks"]) < opts.tp:
        report.add(Check("numeric", True, f"skipped: only ranks {manifest['ranks']} of tp={opts.tp} were converted; the forward needs all"))
    elif level == "numeric" and report.ok:
        from .numeric import check_numeric

        check_numeric(out, plan, ckpt, headers, report, kernels=kernels, device=device, tokens=tokens, seed=seed)
    return report


def check_engine(plan: Plan, headers: dict[str, ShardHeader], report: VerifyReport) -> None:
    """Each written rank against the target engine's parameter table (ckpt_tool.engine): the keys its
    loader expects, their shapes and dtypes. A rule table gone stale against the engine fails here."""
    from .engine import ENGINES, compare_with_engine, engine_params

    opts = plan.options
    if opts.profile not in ENGINES:
        report.add(Check("engine", False, f"profile {opts.profile!r} has no engine table; add one to ckpt_tool/engine.py"))
        return
    ranks = sorted({(f.component, f.rank) for f in plan.files})
    for comp, rank in ranks:
        written: dict[str, tuple[tuple[int, ...], str]] = {}
        files = [f.relpath for f in plan.files if (f.component, f.rank) == (comp, rank)]
        if not all(rel in headers for rel in files):
            continue  # a structure failure already names the unreadable or missing file
        for rel in files:
            written.update({n: (t.shape, t.dtype) for n, t in headers[rel].tensors.items()})
        expected = engine_params(plan.config, opts.profile, comp, opts.tp, opts.moe_parallel)
        problems = compare_with_engine(written, expected)
        name = f"engine:{comp}/rank-{rank}"
        where = f"{comp}/model-rank-{rank}-part-*.safetensors"
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            msg = f"{where} vs the {opts.profile} engine: {problems[0][0]}{more}"
            report.add(Check(name, False, msg, file=where, tensor=problems[0][1], details={"problems": [p for p, _ in problems]}))
        else:
            report.add(Check(name, True, file=where, details={"parameters": len(expected)}))


def check_structure(out: Path, plan: Plan, manifest: dict, report: VerifyReport, src_root: Path) -> dict[str, ShardHeader]:
    """Files, names, dtypes, shapes per rank; index.json; manifest checksums. Returns parsed headers."""
    planned = {f.relpath: f for f in plan.files}
    present = {
        f"{comp}/{p.name}" for comp in COMPONENTS if (out / comp).is_dir() for p in (out / comp).glob("*.safetensors")
    }
    for rel in sorted(set(planned) - present):
        report.add(Check(f"structure:{rel}", False, f"{rel}: planned output file is missing", file=rel))
    for rel in sorted(present - set(planned)):
        report.add(Check(f"structure:{rel}", False, f"{rel}: file is not part of the plan for these options", file=rel))

    outputs = manifest.get("outputs") or {}
    headers: dict[str, ShardHeader] = {}
    for rel, f in planned.items():
        if rel not in present:
            continue
        problems: list[tuple[str, str | None]] = []
        try:
            header = read_shard_header(out / rel, rel)
        except CkptToolError as exc:
            report.add(Check(f"structure:{rel}", False, str(exc), file=rel))
            continue
        headers[rel] = header
        want = {t.name: t for t in f.tensors}
        for name in sorted(set(want) - set(header.tensors)):
            problems.append((f"{rel}: tensor {name!r} missing (from {', '.join(want[name].sources[:2])})", name))
        for name in sorted(set(header.tensors) - set(want)):
            problems.append((f"{rel}: tensor {name!r} is not in the plan", name))
        for name in sorted(set(want) & set(header.tensors)):
            got, exp = header.tensors[name], want[name]
            if got.dtype != exp.dtype or tuple(got.shape) != tuple(exp.shape):
                problems.append(
                    (f"{rel}: tensor {name!r} is {got.dtype}{list(got.shape)}, expected {exp.dtype}{list(exp.shape)}", name)
                )
        rec = outputs.get(rel)
        if rec is None:
            problems.append((f"{rel}: not recorded in {MANIFEST}", None))
        elif rec.get("size") != header.file_size:
            problems.append((f"{rel}: size {header.file_size} differs from the manifest's {rec.get('size')}", None))
        elif rec.get("sha256") != sha256_file(out / rel):
            problems.append((f"{rel}: sha256 differs from the manifest; the file changed after conversion", None))
        if problems:
            msg = problems[0][0] + (f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else "")
            report.add(Check(f"structure:{rel}", False, msg, file=rel, tensor=problems[0][1], details={"problems": [p for p, _ in problems]}))
        else:
            report.add(Check(f"structure:{rel}", True, file=rel))

    for comp in COMPONENTS:
        if not any(f.component == comp for f in plan.files):
            continue
        path = out / comp / "index.json"
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            report.add(Check(f"index:{comp}", False, f"{path}: unreadable ({exc})", file=str(path)))
            continue
        ok = doc == index_doc(plan, comp)
        report.add(Check(f"index:{comp}", ok, "" if ok else f"{path}: does not match the plan (tensors, ranks or total_size)", file=f"{comp}/index.json"))
        cfg_path = out / comp / "config.json"
        want = (src_root / "config.json").read_bytes()
        got = cfg_path.read_bytes() if cfg_path.is_file() else None
        msg = "" if got == want else f"{cfg_path}: {'missing' if got is None else 'differs from the source config.json'}; reconvert"
        report.add(Check(f"config:{comp}", got == want, msg, file=f"{comp}/config.json"))
    if any(f.component == "model" for f in plan.files):
        _check_serving_files(out, src_root, report)
    return headers


def _check_serving_files(out: Path, src_root: Path, report: VerifyReport) -> None:
    """OUT/model carries the source's tokenizer, generation config, chat template, ... byte for byte."""
    from .convert import serving_files

    problems = []
    for name in serving_files(src_root):
        dest = out / "model" / name
        if not dest.is_file():
            problems.append(f"{dest}: missing (vllm serve OUT/model needs the source's {name})")
        elif dest.read_bytes() != (src_root / name).read_bytes():
            problems.append(f"{dest}: differs from the source's {name}")
    msg = f"{problems[0]}; reconvert" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "") if problems else ""
    report.add(Check("serving-files:model", not problems, msg, file="model", details={"problems": problems} if problems else {}))


def _out_width(t: OutTensor) -> int:
    return t.segments[0].col1 - t.segments[0].col0


def check_values(out: Path, plan: Plan, src_root: Path, headers: dict[str, ShardHeader], report: VerifyReport, progress=None) -> None:
    """Re-derive every output tensor from the source and compare exactly."""
    import torch

    fds: dict[str, int] = {}

    def source_slice(info: TensorInfo, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Rows [r0, r1) x columns [c0, c1) of a source tensor as raw bytes [rows, cols * element size].

        Read with pread (not safetensors' mmap, whose touched pages would count against RSS for the
        whole checkpoint) and cut with torch indexing: independent of the writer's gather code.
        """
        real = plan.sources[info.name]  # a materialized alias carries the offsets of the tensor it aliases
        fd = fds.get(real.file)
        if fd is None:
            fd = fds[real.file] = os.open(src_root / real.file, os.O_RDONLY)
        eb = DTYPE_BITS[real.dtype] // 8
        row_bytes = (real.numel // real.shape[0] if real.shape else 1) * eb
        raw = os.pread(fd, (r1 - r0) * row_bytes, real.start + r0 * row_bytes)
        if len(raw) != (r1 - r0) * row_bytes:
            raise CkptToolError(f"{real.file}: tensor {real.name!r}: source file ended early; was it modified?")
        rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(r1 - r0, row_bytes)
        return rows[:, c0 * eb : c1 * eb]

    try:
        for f in plan.files:
            header = headers.get(f.relpath)
            if header is None:
                continue
            fd = os.open(out / f.relpath, os.O_RDONLY)
            try:
                bad: list[str] = []
                first_tensor: str | None = None
                for t in f.tensors:
                    msg = _compare_tensor(t, header.tensors[t.name], fd, plan, source_slice)
                    if msg:
                        bad.append(msg)
                        first_tensor = first_tensor or t.name
                    if progress:
                        progress(t.nbytes)
            finally:
                os.close(fd)
            if bad:
                more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
                report.add(Check(f"values:{f.relpath}", False, bad[0] + more, file=f.relpath, tensor=first_tensor, details={"problems": bad}))
            else:
                report.add(Check(f"values:{f.relpath}", True, file=f.relpath))
    finally:
        for fd in fds.values():
            os.close(fd)


def _compare_tensor(t: OutTensor, got: TensorInfo, fd: int, plan: Plan, source_slice) -> str | None:
    import torch

    width = _out_width(t)
    out_eb = DTYPE_BITS[t.dtype] // 8
    out_row = 0
    for seg in t.segments:
        src = plan.sources[seg.src]
        src_eb = DTYPE_BITS[src.dtype] // 8
        src_row = (src.numel // src.shape[0] if src.shape else 1) * src_eb
        rows_per_block = max(1, VALUE_BLOCK_BYTES // max(1, src_row, width * out_eb))
        r = seg.row0
        while r < seg.row1:
            n = min(rows_per_block, seg.row1 - r)
            expected = source_slice(src, r, r + n, seg.col0, seg.col1).contiguous()
            nbytes = n * width * out_eb
            raw = os.pread(fd, nbytes, got.start + out_row * width * out_eb)
            if len(raw) != nbytes:
                return f"{t.name}: output file ended early"
            actual = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            want = expected.reshape(-1).view(torch.uint8)
            if seg.convert not in conversions.BYTEWISE:
                want = torch.frombuffer(bytearray(conversions.forward(seg.convert, want.numpy().tobytes(), src)), dtype=torch.uint8)
            if not torch.equal(want, actual):
                diff = int((want != actual).nonzero()[0, 0]) // out_eb
                row, col = divmod(diff, width)
                what = "bytes" if seg.convert in conversions.BYTEWISE else "value"
                return (
                    f"tensor {t.name!r}: {what} differ from source {seg.src} "
                    f"(rows {seg.row0}:{seg.row1}, cols {seg.col0}:{seg.col1}) first at source element "
                    f"[{r + row}, {seg.col0 + col}]"
                )
            out_row += n
            r += n
    return None
