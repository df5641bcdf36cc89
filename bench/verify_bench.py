"""verify --level values against --level numeric on a full-width V4-Flash skeleton (a plain script, not a test).

    python bench/verify_bench.py                          # 3 main layers + MTP (15.3 GiB), convert --tp 8,
                                                          # 2 rounds of values and numeric; ~8 min on 2 cores
    python bench/verify_bench.py --src /tmp/vb/src        # reuse a skeleton made by bench/make_skeleton.py --layers K
    python bench/verify_bench.py --layers 0 --model pro   # the MTP layer alone at V4-Pro widths (memory must stay flat)
    python bench/verify_bench.py --rounds 3 --json verify.json --keep

In one run, on one skeleton (bench/make_skeleton.py: the real config, names, shapes and dtypes, random valid
bytes; by default 3 main layers and the MTP layer, 256 MXFP4 experts each): ``convert --tp 8``, then rounds of
``verify --level values`` and ``verify --level numeric`` (which runs the values level too, its own workers
computing beside it; 16 tokens, torch kernels on cpu). Each is a subprocess under ``/usr/bin/time``: wall
seconds, CPU seconds (user + sys, forked workers included), peak RSS of the largest process, bytes read from the
disk; plus the numeric coverage.

Cold start: before every timed command the source and OUT are dropped from the page cache
(``posix_fadvise(DONTNEED)`` per file), as a whole checkpoint never fits there. Within one numeric run the
values pass may leave the source cached for its own later reads on this 24 GiB VM; at V4-Flash scale it could
not, so the projection below models reads instead of scaling this run's seconds.

Figures per GiB of the source, and against the values level of the same round (the VM's speed moves over the
day: only ratios within a round compare). The script fails if a verify fails or coverage is below 100 %.
Targets (issue 22): numeric <= 2 x values, coverage 100 %, peak RSS <= 2 GiB; values <= 1.5 x convert.

Projection to V4-Flash (148.6 GiB) and V4-Pro (805 GiB, make_skeleton's specs): a level takes
max(CPU seconds / cores, bytes it asks to read / disk rate). CPU seconds scale with the source from this run;
the bytes asked for are counted from the plan (values reads whole source rows for each rank's column slice;
numeric reads the source and OUT once more beside values); the disk rate is a direct read measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
import make_skeleton  # noqa: E402

TIME = "/usr/bin/time"
GiB = 1024**3
PROJECTED_CORES = (2, 32)


def drop_from_page_cache(*folders: Path) -> None:
    """Evict every file under ``folders`` from the page cache (clean pages only: ``sync`` first)."""
    subprocess.run(["sync"], check=False)
    for folder in folders:
        for p in folder.rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def timed(cmd: list[str], log, cold: list[Path]) -> dict:
    """Wall and CPU seconds, peak RSS and disk reads of ``cmd`` started with ``cold`` out of the page cache."""
    drop_from_page_cache(*cold)
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as tf:
        proc = subprocess.run(
            [TIME, "-f", "%e %U %S %M %I", "-o", tf.name, *cmd], capture_output=True, text=True, cwd=REPO
        )
        wall, user, sys_s, rss_kb, blocks = tf.read().split()[-5:]
    row = {
        "cmd": " ".join(cmd),
        "rc": proc.returncode,
        "seconds": float(wall),
        "cpu_seconds": float(user) + float(sys_s),
        "peak_rss_mib": int(rss_kb) / 1024,
        "disk_read_gib": int(blocks) * 512 / GiB,
    }
    log(
        f"{row['seconds']:8.2f} s {row['cpu_seconds']:7.1f} CPU s {row['peak_rss_mib']:6.0f} MiB "
        f"{row['disk_read_gib']:6.1f} GiB from disk  rc {proc.returncode}  {row['cmd']}"
    )
    if proc.returncode not in (0, 1):
        log(proc.stderr[-2000:])
    row["stdout"] = proc.stdout
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


def values_source_reads(out: Path, src: Path) -> int:
    """Source bytes the values level asks for: for every segment of every output tensor, its source rows whole
    (``levels._compare_tensor`` reads whole rows and cuts a rank's columns out of them)."""
    from ckpt_tool.checkpoint.source import open_checkpoint
    from ckpt_tool.mapping.plan import ZERO, plan_conversion
    from ckpt_tool.output.layout import options_from_manifest, read_manifest

    ckpt = open_checkpoint(src)
    plan = plan_conversion(ckpt.require_config(), ckpt.tensors, options_from_manifest(read_manifest(out)))
    total = 0
    for f in plan.files:
        for t in f.tensors:
            for seg in t.segments:
                if seg.src == ZERO:
                    continue
                info = plan.sources[seg.src]
                row = info.nbytes // info.shape[0] if info.shape else info.nbytes
                total += (seg.row1 - seg.row0) * row
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, help="an existing skeleton (default: make one in a fresh /tmp folder)")
    ap.add_argument("--layers", type=int, default=3, help="main layers of the skeleton made (default 3)")
    ap.add_argument("--model", choices=("flash", "pro"), default="flash", help="skeleton dimensions (default V4-Flash)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of values then numeric (default 2)")
    ap.add_argument("--workers", type=int, help="verify --workers (default: its own, one per CPU)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)

    sizes = {"V4-Flash": checkpoint_gib("flash"), "V4-Pro": checkpoint_gib("pro")}  # before --model pro
    work = Path(tempfile.mkdtemp(prefix="verify-bench-", dir="/tmp"))
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
        conv = timed(
            [*ckpt, "convert", str(src), str(out), "--tp", str(args.tp), *only, "--force", "--json"], log, [src]
        )
        if conv["rc"] != 0:
            log(conv["stdout"][-2000:])
            return 1
        src_gib, out_gib = folder_bytes(src) / GiB, folder_bytes(out) / GiB
        disk_rate = direct_read_rate(max(out.rglob("*.safetensors"), key=lambda p: p.stat().st_size))
        values_src_gib = values_source_reads(out, src) / GiB
        log(f"disk: {disk_rate:.2f} GiB/s direct read of OUT's largest file")
        extra = ["--workers", str(args.workers)] if args.workers else []
        for rnd in range(args.rounds):
            for level in ("values", "numeric"):
                numeric = ["--tokens", str(args.tokens), "--kernels", "torch", "--device", "cpu"]
                cmd = [*ckpt, "verify", str(out), "--source", str(src), "--level", level, "--json", *extra]
                r = timed(cmd + (numeric if level == "numeric" else []), log, [src, out])
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
    print("| round | verify | seconds | s/GiB | x values | x convert | CPU s | peak RSS | from disk | coverage |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
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
            f"{r['disk_read_gib']:.1f} GiB | "
            f"{cov_txt} |"
        )
    print(
        f"\nconvert: {conv['seconds']:.1f} s, {conv['peak_rss_mib']:.0f} MiB; numeric / values, median: "
        f"{statistics.median(ratios):.2f}"
    )

    # projection: max(CPU / cores, bytes asked for / disk rate), per level
    reads = {"values": values_src_gib + out_gib, "numeric": values_src_gib + 2 * out_gib + src_gib}
    cpu = {lv: statistics.median(r["cpu_seconds"] for r in rows if r["level"] == lv) / src_gib for lv in reads}
    print(
        f"\nprojection: max(CPU s/GiB x size / cores, GiB asked for x size / {disk_rate:.2f} GiB/s); per GiB of "
        f"source: values {cpu['values']:.2f} CPU s and {reads['values'] / src_gib:.2f} GiB read, numeric "
        f"{cpu['numeric']:.2f} CPU s and {reads['numeric'] / src_gib:.2f} GiB read\n"
    )
    cols = " | ".join(f"{c} cores" for c in PROJECTED_CORES)
    print(f"| model | GiB | verify | {cols} |\n|---|---:|---|" + "---:|" * len(PROJECTED_CORES))
    projection = {}
    for model, gib in sizes.items():
        per = {}
        for lv in reads:
            per[lv] = [max(cpu[lv] * gib / c, reads[lv] / src_gib * gib / disk_rate) for c in PROJECTED_CORES]
            print(f"| {model} | {gib:.0f} | --level {lv} | " + " | ".join(f"{s / 60:.1f} min" for s in per[lv]) + " |")
        ratio = [n / v for n, v in zip(per["numeric"], per["values"])]
        print(f"| {model} | | numeric / values | " + " | ".join(f"{x:.2f}" for x in ratio) + " |")
        projection[model] = {
            "gib": gib,
            "cores": list(PROJECTED_CORES),
            **{f"{lv}_seconds": s for lv, s in per.items()},
        }
    if args.json:
        doc = {
            "cpus": os.cpu_count(),
            "model": args.model,
            "layers": args.layers,
            "tp": args.tp,
            "source_gib": src_gib,
            "out_gib": out_gib,
            "disk_gib_per_s": disk_rate,
            "values_source_reads_gib": values_src_gib,
            "convert": {k: v for k, v in conv.items() if k != "stdout"},
            "rows": rows,
            "projection": projection,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
