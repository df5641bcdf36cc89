"""verify --level values against --level numeric on a full-width V4-Flash skeleton (a plain script, not a test).

    python bench/verify_bench.py                          # 3 main layers + MTP (15.3 GiB), convert --tp 8,
                                                          # 2 rounds of values and numeric; ~8 min on 2 cores
    python bench/verify_bench.py --src /tmp/vb/src        # reuse a skeleton made by bench/make_skeleton.py --layers K
    python bench/verify_bench.py --layers 0 --model pro   # the MTP layer alone at V4-Pro widths (memory must stay flat)
    python bench/verify_bench.py --rounds 3 --json verify.json --keep
    python bench/verify_bench.py --warm --layers 0 --tp 2 --rounds 5   # values against convert, page cache warm

In one run, on one skeleton (bench/make_skeleton.py: the real config, names, shapes and dtypes, random valid
bytes; by default 3 main layers and the MTP layer, 256 MXFP4 experts each): ``convert --tp 8``, then rounds of
``verify --level values`` and ``verify --level numeric`` (which runs the values level too, its own workers
computing on the bytes the values walk reads, in one pass; 16 tokens, torch kernels on cpu). Each is a subprocess
timed by bench/timing.py: wall seconds, CPU seconds (user + sys, forked workers included), peak RSS of the largest
process, bytes the process tree read from the disk (also as a multiple of what the plan needs: the source rows its
segments name, once, plus OUT); plus the numeric coverage.

Cold start: before every timed command the page cache is emptied (``drop_caches``; where not allowed, every file of
the source and OUT is evicted with ``posix_fadvise(DONTNEED)``, and the output says so), as a whole checkpoint never
fits there. Targets (issue 31): numeric reads <= 1.05 x (the source the plan needs + OUT) from the disk and takes
<= 1.25 x values; coverage 100 %; peak RSS <= 2 GiB.

Figures per GiB of the source, and against the values level of the same round (the VM's speed moves over the
day: only ratios within a round compare). The script fails if a verify fails or coverage is below 100 %.
Targets (issue 22): numeric <= 2 x values, coverage 100 %, peak RSS <= 2 GiB; values <= 1.5 x convert.

Warm (``--warm``, issue 46): the page cache as a user has it right after converting: the source read into it just
before each command (the bench reads it and says how much of it the cache then held), OUT not cached (convert writes
it with O_DIRECT). Rounds of ``convert`` then ``verify --level values`` (``--levels``), each level's time against the
convert of its own round; the median of those ratios is the figure (target: values <= 1.5 x convert). A level that
read more from the disk than OUT plus the part of the source the cache did not hold had its cache dropped under it
(another process's ``drop_caches``): the row says so.

Projection to V4-Flash (148.6 GiB) and V4-Pro (805 GiB, make_skeleton's specs): a level takes
max(CPU seconds / cores, bytes it asks to read / disk rate). CPU seconds scale with the source from this run;
the bytes read are counted from the plan (values reads the source rows the plan needs once — the ranks of a
part keep within a window of each other, so the first rank's read serves the rest from the page cache — and OUT
once; numeric reads the same, its workers served from the page cache in one pass); the disk rate is a direct read
measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
import make_skeleton  # noqa: E402
from timing import drop_caches, evicting, run_timed  # noqa: E402

GiB = 1024**3
PROJECTED = ((2, None), (32, 3e9 / GiB))
"""(cores, disk GiB/s) of each machine projected: this one (its disk as measured), and a 32-core runner with a
3 GB/s disk."""


def timed(
    cmd: list[str], log, cold: list[Path], needed: int | None = None, evict: list[Path] = (), every: float = 0
) -> dict:
    """Wall and CPU seconds, peak RSS and disk reads of ``cmd`` started from a cold page cache (``cold``: the
    folders to evict where the whole cache cannot be dropped); ``needed``: the bytes it has to read at least;
    ``evict``: folders dropped from the page cache again ``every`` seconds while it runs."""
    how = drop_caches(*cold)
    log(f"load {Path('/proc/loadavg').read_text().strip()}")
    with evicting(list(evict), every):
        t = run_timed(cmd, cwd=REPO)
    if every:
        how += f", the source evicted every {every:g} s"
    row = {
        "cmd": t.cmd,
        "rc": t.rc,
        "seconds": t.seconds,
        "cpu_seconds": t.cpu_seconds,
        "peak_rss_mib": t.peak_rss_mib,
        "disk_read_gib": t.disk_read_bytes / GiB,
        "disk_read_x_needed": t.disk_read_bytes / needed if needed else None,
        "io_cross_check_gib": None if t.io_cross_check_bytes is None else t.io_cross_check_bytes / GiB,
        "cold": how,
    }
    x = f" ({row['disk_read_x_needed']:.2f} x needed)" if needed else ""
    log(
        f"{row['seconds']:8.2f} s {row['cpu_seconds']:7.1f} CPU s {row['peak_rss_mib']:6.0f} MiB "
        f"{row['disk_read_gib']:6.2f} GiB from disk{x}  rc {t.rc}  [{how}]  {row['cmd']}"
    )
    if t.rc not in (0, 1):
        log(t.stderr[-2000:])
    row["stdout"] = t.stdout
    return row


def direct_read_rate(path: Path, limit: int = 4 * GiB) -> float:
    """GiB/s of reading ``path`` (up to ``limit`` bytes) with O_DIRECT in 16 MiB blocks: the disk, not the cache."""
    import mmap
    import time

    block = 16 * 1024 * 1024
    buf = mmap.mmap(-1, block)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        t, done = time.perf_counter(), 0
        while done < limit:
            n = os.preadv(fd, [buf], done)
            if n <= 0:
                break
            done += n
        return done / GiB / (time.perf_counter() - t)
    finally:
        os.close(fd)
        buf.close()


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.safetensors"))


def checkpoint_gib(model: str) -> float:
    """Bytes of the whole checkpoint make_skeleton describes, in GiB."""
    saved = {k: getattr(make_skeleton, k) for k in make_skeleton.PRO}
    try:
        if model == "pro":
            make_skeleton.use_pro()
        return sum(s.nbytes for s in make_skeleton.all_specs(make_skeleton.NUM_LAYERS)) / GiB
    finally:
        for k, v in saved.items():
            setattr(make_skeleton, k, v)


def source_reads(out: Path, src: Path) -> tuple[int, int]:
    """Source bytes the plan of OUT needs — every source row a segment names, once — and the bytes the values level
    reads: the rows of each lockstep group (the ranks' same part, ``values._lockstep_groups``) once for all its ranks
    (``ckpt_tool/verify/shared_rows.py``), so a row two groups cut from (the MTP draft's copy of the embedding and
    head) is read once by each, the second time from the page cache."""
    from ckpt_tool.checkpoint.source import open_checkpoint
    from ckpt_tool.mapping.plan import ZERO
    from ckpt_tool.mapping.planner import plan_conversion
    from ckpt_tool.output.layout import options_from_manifest, read_manifest
    from ckpt_tool.verify.values import _lockstep_groups

    ckpt = open_checkpoint(src)
    plan = plan_conversion(ckpt.require_config(), ckpt.tensors, options_from_manifest(read_manifest(out)))

    def rows_bytes(files) -> int:
        """Bytes of the source rows the segments of ``files`` name, each row once."""
        rows: dict[tuple[str, int], set[tuple[int, int]]] = {}  # (file, start) of a source tensor -> row ranges
        row_bytes: dict[tuple[str, int], int] = {}
        for f in files:
            for t in f.tensors:
                for seg in t.segments:
                    if seg.src == ZERO:
                        continue
                    info = plan.sources[seg.src]
                    key = (info.file, info.start)  # a materialized alias is the bytes of the tensor it aliases
                    rows.setdefault(key, set()).add((seg.row0, seg.row1))
                    row_bytes[key] = info.nbytes // info.shape[0] if info.shape else info.nbytes
        total = 0
        for key, ranges in rows.items():
            end = 0
            for r0, r1 in sorted(ranges):
                total += max(0, r1 - max(r0, end)) * row_bytes[key]
                end = max(end, r1)
        return total

    groups = _lockstep_groups(list(plan.files))
    return rows_bytes(plan.files), sum(rows_bytes([f for member in g for f in member]) for g in groups)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, help="an existing skeleton (default: make one in the work folder)")
    ap.add_argument("--work", type=Path, default=Path("/tmp"), help="where the temporary folder goes (default /tmp)")
    ap.add_argument("--layers", type=int, default=3, help="main layers of the skeleton made (default 3)")
    ap.add_argument("--model", choices=("flash", "pro"), default="flash", help="skeleton dimensions (default V4-Flash)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of values then numeric (default 2)")
    ap.add_argument("--workers", type=int, help="verify --workers (default: its own, one per CPU)")
    ap.add_argument("--levels", default="values,numeric", help="verify levels timed each round (default both)")
    ap.add_argument(
        "--evict-source-every",
        type=float,
        default=0,
        metavar="S",
        help="while verify runs, drop the source from the page cache every S seconds: a cache smaller than the "
        "source, as at V4-Flash scale (default: never)",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="the source in the page cache before each command, rounds of convert then the levels (default values), "
        "each against its round's convert",
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)

    sizes = {"V4-Flash": checkpoint_gib("flash"), "V4-Pro": checkpoint_gib("pro")}  # before --model pro
    work = Path(tempfile.mkdtemp(prefix="verify-bench-", dir=args.work))
    log = lambda m: print(m, flush=True)  # noqa: E731
    ckpt = [sys.executable, "-m", "ckpt_tool"]
    rows: list[dict] = []
    failed = False
    try:
        src = args.src.resolve() if args.src else None
        if src is None:
            src = work / "src"
            if args.model == "pro":
                make_skeleton.use_pro()
            make_skeleton.make_skeleton(src, layers=args.layers)
        out = work / f"out-tp{args.tp}"
        only = ["--only", "mtp"] if args.layers == 0 else []  # a skeleton without main layers converts its draft
        if args.warm:
            levels = args.levels if args.levels != "values,numeric" else "values"
            return warm_rounds(src, out, [*only, "--tp", str(args.tp)], levels, args, log)
        conv = timed(
            [*ckpt, "convert", str(src), str(out), "--tp", str(args.tp), *only, "--force", "--json"], log, [src]
        )
        if conv["rc"] != 0:
            log(conv["stdout"][-2000:])
            return 1
        src_gib, out_gib = folder_bytes(src) / GiB, folder_bytes(out) / GiB
        disk_rate = direct_read_rate(max(out.rglob("*.safetensors"), key=lambda p: p.stat().st_size))
        needed, asked = source_reads(out, src)
        needed_gib, values_src_gib = needed / GiB, asked / GiB
        conv["disk_read_x_needed"] = conv["disk_read_gib"] / needed_gib
        log(f"disk: {disk_rate:.2f} GiB/s direct read of OUT's largest file")
        log(
            f"the plan needs {needed_gib:.2f} GiB of the source (convert read {conv['disk_read_x_needed']:.2f} x "
            f"that); the values level reads {values_src_gib:.2f} GiB of it (each row once per lockstep group); "
            f"OUT {out_gib:.2f} GiB; convert's disk reads by /proc/self/io: {conv['io_cross_check_gib']:.2f} GiB"
        )
        extra = ["--workers", str(args.workers)] if args.workers else []
        for rnd in range(args.rounds):
            for level in args.levels.split(","):
                numeric = ["--tokens", str(args.tokens), "--kernels", "torch", "--device", "cpu"]
                cmd = [*ckpt, "verify", str(out), "--source", str(src), "--level", level, "--json", *extra]
                r = timed(
                    cmd + (numeric if level == "numeric" else []),
                    log,
                    [src, out],
                    needed + out_gib * GiB,
                    [src],
                    args.evict_source_every,
                )
                doc = json.loads(r.pop("stdout") or "{}")
                rows.append(
                    {"round": rnd + 1, "level": level, **r, "ok": doc.get("ok"), "coverage": doc.get("coverage")}
                )
                failed |= not doc.get("ok")
                failed |= level == "numeric" and (doc.get("coverage") or {}).get("percent") != 100.0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(
        f"\nskeleton {src_gib:.2f} GiB ({args.model}, {args.layers} main layers + MTP), OUT at tp {args.tp}: "
        f"{out_gib:.2f} GiB; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        "each command from a cold page cache\n"
    )
    print(
        f"convert: {conv['seconds']:.1f} s, {conv['cpu_seconds']:.0f} CPU s, {conv['peak_rss_mib']:.0f} MiB, "
        f"{conv['disk_read_gib']:.2f} GiB from disk ({conv['disk_read_x_needed']:.2f} x the {needed_gib:.2f} GiB of "
        f"source the plan needs); cold page cache by {conv['cold']}\n"
    )
    print(
        "| round | verify | seconds | s/GiB | x values | x convert | CPU s | peak RSS | from disk | x (needed + OUT) "
        "| coverage |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    ratios = []
    for r in rows:
        values = next(v for v in rows if v["round"] == r["round"] and v["level"] == "values")
        cov = r.get("coverage")
        cov_txt = f"{cov['checked']}/{cov['total']} ({cov['percent']} %)" if cov else ""
        r["s_per_gib"], r["x_values"] = r["seconds"] / src_gib, r["seconds"] / values["seconds"]
        r["x_convert"] = r["seconds"] / conv["seconds"]
        if r["level"] == "numeric":
            ratios.append(r["x_values"])
        print(
            f"| {r['round']} | --level {r['level']} | {r['seconds']:.1f} | {r['s_per_gib']:.2f} | "
            f"{r['x_values']:.2f} | {r['x_convert']:.2f} | {r['cpu_seconds']:.0f} | {r['peak_rss_mib']:.0f} MiB | "
            f"{r['disk_read_gib']:.2f} GiB | {r['disk_read_x_needed']:.2f} | "
            f"{cov_txt} |"
        )
    print(
        f"\nconvert: {conv['seconds']:.1f} s, {conv['peak_rss_mib']:.0f} MiB; numeric / values, median: "
        + (f"{statistics.median(ratios):.2f}" if ratios else "(not timed)")
    )
    projection = {}
    if ratios:
        projection = project(rows, conv, sizes, src_gib, out_gib, needed_gib, disk_rate)
    if args.json:
        doc = {
            "cpus": os.cpu_count(),
            "model": args.model,
            "layers": args.layers,
            "tp": args.tp,
            "source_gib": src_gib,
            "out_gib": out_gib,
            "disk_gib_per_s": disk_rate,
            "source_needed_gib": needed_gib,
            "values_source_read_gib": values_src_gib,
            "convert": {k: v for k, v in conv.items() if k != "stdout"},
            "rows": rows,
            "projection": projection,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if failed else 0


def warm(folder: Path) -> float:
    """Read every safetensors file under ``folder`` through the page cache; the fraction of their bytes the cache
    then holds (``ckpt_tool.checkpoint.page_cache``; None where it cannot be asked)."""
    from ckpt_tool.checkpoint import page_cache

    total = held = 0
    for p in sorted(folder.rglob("*.safetensors")):
        fd = os.open(p, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            pos = 0
            while pos < size:
                pos += len(os.pread(fd, 16 * 1024 * 1024, pos)) or size
            end = -(-size // page_cache.PAGE) * page_cache.PAGE
            runs = page_cache.cached_runs(fd, 0, end, page_cache.PAGE)
            total += size
            held += sum(min(b, size) - a for a, b, cached in runs or [] if cached) if runs is not None else 0
        finally:
            os.close(fd)
    return held / total if total else 0.0


def warm_rounds(src: Path, out: Path, convert_opts: list[str], levels: str, args, log) -> int:
    """``--warm``: rounds of convert then each level, the source warm before each, each level against its round's
    convert; the table and the median ratio printed (and written with ``--json``). 1 if a verify failed."""
    ckpt = [sys.executable, "-m", "ckpt_tool"]
    extra = ["--workers", str(args.workers)] if args.workers else []
    rows, failed = [], False
    src_bytes = folder_bytes(src)
    for rnd in range(args.rounds):
        cmds = [("convert", [*ckpt, "convert", str(src), str(out), *convert_opts, "--force", "--json"])]
        cmds += [
            (lv, [*ckpt, "verify", str(out), "--source", str(src), "--level", lv, "--json", *extra])
            for lv in levels.split(",")
        ]
        for what, cmd in cmds:
            held = warm(src)
            log(f"round {rnd + 1}: source {held * 100:.1f} % in the page cache")
            t = run_timed(cmd, cwd=REPO)
            if t.rc != 0:
                log(t.stderr[-2000:])
                failed = True
            out_bytes = folder_bytes(out)
            # what a level must read from the disk: OUT, and the source the cache did not hold (+ 2 % slack)
            dropped = what != "convert" and t.disk_read_bytes > 1.02 * (out_bytes + (1 - held) * src_bytes)
            rows.append(
                {
                    "round": rnd + 1,
                    "command": what,
                    "seconds": t.seconds,
                    "cpu_seconds": t.cpu_seconds,
                    "peak_rss_mib": t.peak_rss_mib,
                    "disk_read_gib": t.disk_read_bytes / GiB,
                    "source_cached": held,
                    "cache_dropped_under_it": dropped,
                    "load": os.getloadavg()[0],
                    "rc": t.rc,
                }
            )
            log(
                f"{what:8s} {t.seconds:7.2f} s {t.cpu_seconds:6.1f} CPU s {t.peak_rss_mib:5.0f} MiB "
                f"{t.disk_read_bytes / GiB:6.2f} GiB from disk  rc {t.rc}" + ("  (cache dropped under it)" * dropped)
            )
    conv = {r["round"]: r["seconds"] for r in rows if r["command"] == "convert"}
    for r in rows:
        r["x_convert"] = r["seconds"] / conv[r["round"]]
    print(
        f"\nwarm page cache: skeleton {src_bytes / GiB:.2f} GiB ({args.model}, {args.layers} main layers + MTP), "
        f"convert {' '.join(convert_opts)}, OUT {folder_bytes(out) / GiB:.2f} GiB; {os.cpu_count()} CPUs\n"
    )
    print("| round | command | seconds | x convert (its round) | CPU s | peak RSS | from disk | source cached | load |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        name = r["command"] if r["command"] == "convert" else f"verify --level {r['command']}"
        note = " (cache dropped under it)" if r["cache_dropped_under_it"] else ""
        print(
            f"| {r['round']} | {name} | {r['seconds']:.2f} | {r['x_convert']:.2f}{note} | {r['cpu_seconds']:.1f} | "
            f"{r['peak_rss_mib']:.0f} MiB | {r['disk_read_gib']:.2f} GiB | {r['source_cached'] * 100:.0f} % | "
            f"{r['load']:.1f} |"
        )
    medians = {}
    for lv in levels.split(","):
        ratios = [r["x_convert"] for r in rows if r["command"] == lv and not r["cache_dropped_under_it"]]
        medians[lv] = statistics.median(ratios) if ratios else None
        shown = f"{medians[lv]:.2f}" if ratios else "(no round with the cache kept)"
        print(f"\nverify --level {lv} / convert, median of {len(ratios)} rounds: {shown} (target <= 1.5)")
    if args.json:
        doc = {"warm": True, "cpus": os.cpu_count(), "tp": args.tp, "layers": args.layers, "model": args.model}
        args.json.write_text(json.dumps({**doc, "rows": rows, "median_x_convert": medians}, indent=2) + "\n")
    return 1 if failed else 0


def project(rows, conv, sizes, src_gib, out_gib, needed_gib, disk_rate) -> dict:
    """Per model of ``sizes``, command (convert, each verify level) and machine of ``PROJECTED``: max(CPU s / cores,
    bytes the disk moves / disk rate), printed and returned. Convert reads the source and writes OUT; each level reads
    both once (numeric: one pass, ckpt_tool/verify/one_pass.py)."""
    reads = {"convert": needed_gib + out_gib, "values": needed_gib + out_gib, "numeric": needed_gib + out_gib}
    cpu = {
        lv: statistics.median(r["cpu_seconds"] for r in rows if r["level"] == lv) / src_gib
        for lv in reads
        if lv != "convert"
    }
    cpu["convert"] = conv["cpu_seconds"] / src_gib
    machines = [(cores, rate or disk_rate) for cores, rate in PROJECTED]
    print(
        f"\nprojection: max(CPU s/GiB x size / cores, GiB moved x size / disk GiB/s); per GiB of source: convert "
        f"{cpu['convert']:.2f} CPU s, values {cpu['values']:.2f}, numeric {cpu['numeric']:.2f}; each moves "
        f"{reads['values'] / src_gib:.2f} GiB\n"
    )
    cols = " | ".join(f"{c} cores, {r:.2f} GiB/s" for c, r in machines)
    print(f"| model | GiB | command | {cols} |\n|---|---:|---|" + "---:|" * len(machines))
    projection = {}
    for model, gib in sizes.items():
        per = {}
        for lv in reads:
            per[lv] = [max(cpu[lv] * gib / c, reads[lv] / src_gib * gib / r) for c, r in machines]
            what = "convert" if lv == "convert" else f"verify --level {lv}"
            print(f"| {model} | {gib:.0f} | {what} | " + " | ".join(f"{s / 60:.1f} min" for s in per[lv]) + " |")
        ratio = [n / v for n, v in zip(per["numeric"], per["values"])]
        print(f"| {model} | | numeric / values | " + " | ".join(f"{x:.2f}" for x in ratio) + " |")
        projection[model] = {
            "gib": gib,
            "machines": [{"cores": c, "disk_gib_per_s": r} for c, r in machines],
            **{f"{lv}_seconds": s for lv, s in per.items()},
        }
    return projection


if __name__ == "__main__":
    raise SystemExit(main())
