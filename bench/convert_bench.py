"""Side-by-side performance of ckpt-tool on a full-width V4-Flash skeleton (a plain script, not a test).

    python bench/convert_bench.py                 # everything, 3 interleaved rounds (medians), ~6 min on 2 cores
    python bench/convert_bench.py --quick         # one round, flatness at 1 vs 2 layers, ~3 min
    python bench/convert_bench.py --json results.json --keep
    python bench/convert_bench.py --nvfp4         # NVIDIA's NVFP4 export: convert tp 8 / tp 8 ep vs dd, cold cache

In one run, on the same generated skeleton (bench/make_skeleton.py: embed/head/norm/hc_head + the
MTP layer at real V4-Flash shapes and dtypes, ~5.7 GB), every command runs as a subprocess timed by
bench/timing.py (wall and CPU seconds, peak RSS of the largest process), after an untimed ``sync`` so that no
run pays for the previous one's dirty pages:

- ``cp -r SRC DST && sync DST/*`` — the ceiling (ckpt-tool fsyncs its files, so the copy is synced too);
- ``dd bs=16M oflag=direct conv=fsync`` per file — a copy that bypasses the page cache on the write side
  like ckpt-tool does (but reads and writes in turn, without overlap);
- ``ckpt-tool convert SRC OUT --only mtp`` at ``--tp 1`` and ``--tp 8`` with the default ``--workers`` (one per
  core), and tp 1 with ``--workers 1``;
- ``bench/naive_convert.py`` — load_file every shard, map in memory, save_file (tp 1);
- ``ckpt-tool inspect`` of the full 46-shard, 69k-tensor checkpoint as headers only (sparse files);
- RSS flatness: ``ckpt-tool convert --only model`` of sparse skeletons with 1 and 3 main layers (their
  data are holes that read back as zeros: the real byte count flows through the writer, but their
  throughput says nothing about disk speed).

The page cache cannot be dropped here (no root on the host), so the source is read from a warm cache
by every command (it was just written; ``cp`` runs first). Timings on a shared machine are noisy:
compare ratios within one run, and use --repeat for medians.

``--nvfp4`` runs instead, once, on skeletons with ``--data-layers`` main layers (default 1) + the MTP layer: NVIDIA's
NVFP4 export (``make_skeleton.py --nvfp4``: NVFP4 main-layer experts, the MTP layer's MXFP4) and then, for the
peak RSS beside it, the MXFP4 skeleton of the same layers (``--no-mxfp4`` skips it). On each, from a cold page
cache (``timing.drop_caches``: ``sync``, then drop_caches or ``posix_fadvise(DONTNEED)`` on the source; the block
reads show it): ``dd bs=16M oflag=direct conv=fsync`` of every source file, ``ckpt-tool convert SRC OUT --tp 8``
and ``--tp 8 --moe-parallel ep``; convert's seconds over dd's, bytes read and written, peak RSS. Each OUT's rank 0
headers are checked for the NVFP4 parameters (``w13_weight_scale_2``, ``w2_input_scale``) where the source has them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import make_skeleton  # noqa: E402
import timing  # noqa: E402

GiB = 1024**3
MB = 1e6


def du_bytes(path: Path) -> int:
    """Apparent size of the safetensors files under ``path`` (what a command wrote)."""
    return sum(p.stat().st_size for p in path.rglob("*.safetensors") if p.is_file())


def run_timed(cmd: list[str], label: str, log) -> dict:
    """Run ``cmd`` after an untimed sync (timing.run_timed); wall seconds, peak RSS, CPU times."""
    subprocess.run(["sync"], check=False)
    t = timing.run_timed(cmd, cwd=REPO)
    if t.rc != 0:
        raise SystemExit(f"{label}: {' '.join(cmd)} exited {t.rc}\n{t.stderr[-3000:]}")
    res = {
        "label": label,
        "cmd": t.cmd,
        "seconds": t.seconds,
        "rss_kb": round(t.peak_rss_mib * 1024),
        "user": t.user_seconds,
        "sys": t.sys_seconds,
        "stdout": t.stdout,
    }
    log(
        f"  {label:28s} {t.seconds:7.2f} s  peak RSS {t.peak_rss_mib:8.1f} MiB  "
        f"user {t.user_seconds:.1f} s sys {t.sys_seconds:.1f} s"
    )
    return res


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--work", type=Path, default=None, help="scratch folder (default: a new /tmp/bench-*; deleted at the end)"
    )
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument("--quick", action="store_true", help="flatness at 1 vs 2 layers, inspect once, no repeats")
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="interleaved rounds of cp / tp1 / tp8 / naive, medians reported (default 3; --quick 1)",
    )
    p.add_argument(
        "--layers",
        type=int,
        nargs=2,
        default=None,
        metavar=("A", "B"),
        help="main layers of the flatness skeletons (default 1 3; --quick 1 2)",
    )
    p.add_argument("--no-naive", action="store_true", help="skip the naive baseline (it needs RAM ~1.6x the skeleton)")
    p.add_argument("--no-flat", action="store_true", help="skip the RSS flatness runs")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="--workers for the ckpt-tool converts (default: the tool's own, one per core)",
    )
    p.add_argument("--json", type=Path, default=None, help="write all figures to this file")
    p.add_argument(
        "--nvfp4",
        action="store_true",
        help="instead: NVIDIA's NVFP4 export vs the MXFP4 skeleton, convert tp 8 / tp 8 ep vs dd, cold cache, once",
    )
    p.add_argument(
        "--data-layers",
        type=int,
        default=1,
        help="--nvfp4: main layers with data (default 1; each +3.6 GiB NVFP4, +3.4 GiB MXFP4)",
    )
    p.add_argument("--no-mxfp4", action="store_true", help="--nvfp4: skip the MXFP4 skeleton run beside it")
    args = p.parse_args(argv)
    layers_a, layers_b = args.layers or ((1, 2) if args.quick else (1, 3))
    log = lambda s: print(s, flush=True)  # noqa: E731

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    py = sys.executable
    tool = [py, "-m", "ckpt_tool"]
    wflag = [] if args.workers is None else ["--workers", str(args.workers)]
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "mem_available_gib": round(mem_available() / GiB, 1)},
        "runs": {},
    }
    if args.nvfp4:
        results["machine"]["load_average"] = os.getloadavg()
        try:
            forms = ("nvfp4",) if args.no_mxfp4 else ("nvfp4", "mxfp4")
            results["nvfp4"] = nvfp4_bench(work, args.data_layers, forms, [*tool, "convert"], wflag, log)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        results["machine"]["load_average_after"] = os.getloadavg()
        results["bench_seconds"] = time.perf_counter() - started
        report_nvfp4(results, log)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
        return 0
    try:
        need = 3 * 5.8e9
        if free_bytes(work) < need:
            raise SystemExit(f"{work}: {free_bytes(work) / GiB:.1f} GiB free; the bench needs ~{need / GiB:.0f} GiB")
        log(f"scratch: {work}")

        # 1. the skeleton (its generator's own RSS is reported too)
        src = work / "src"
        gen = run_timed([py, str(HERE / "make_skeleton.py"), str(src)], "make_skeleton (data)", log)
        src_bytes = du_bytes(src)
        results["skeleton"] = {"bytes": src_bytes, "seconds": gen["seconds"], "generator_rss_kb": gen["rss_kb"]}

        # 2. cp / convert tp1 / convert tp8 / naive, interleaved rounds
        variants = [
            ("cp", lambda d: ["sh", "-c", f"cp -r '{src}' '{d}' && sync '{d}'/*"]),
            (
                "dd oflag=direct",
                lambda d: [
                    "sh",
                    "-c",
                    f"mkdir -p '{d}' && for f in '{src}'/*; do "
                    f'dd if="$f" of=\'{d}\'/"${{f##*/}}" bs=16M oflag=direct conv=fsync status=none; done',
                ],
            ),
            (
                "ckpt-tool tp1",
                lambda d: [*tool, "convert", str(src), str(d), "--only", "mtp", "--tp", "1", *wflag, "--json"],
            ),
            (
                "ckpt-tool tp8",
                lambda d: [*tool, "convert", str(src), str(d), "--only", "mtp", "--tp", "8", *wflag, "--json"],
            ),
        ]
        if args.workers is None:  # one file at a time, as before the default used the cores
            variants.append(
                (
                    "ckpt-tool tp1 w1",
                    lambda d: [
                        *tool,
                        "convert",
                        str(src),
                        str(d),
                        "--only",
                        "mtp",
                        "--tp",
                        "1",
                        "--workers",
                        "1",
                        "--json",
                    ],
                )
            )
        if not args.no_naive:
            if mem_available() < 1.8 * src_bytes:
                log(
                    f"  (naive baseline skipped: {mem_available() / GiB:.1f} GiB available, "
                    f"it needs ~{1.8 * src_bytes / GiB:.1f})"
                )
            else:
                variants.append(("naive", lambda d: [py, str(HERE / "naive_convert.py"), str(src), str(d)]))
        runs: dict[str, list[dict]] = {name: [] for name, _ in variants}
        for rnd in range(1 if args.quick else max(1, args.repeat)):
            log(f"round {rnd + 1}")
            for name, make_cmd in variants:
                dst = work / "out"
                shutil.rmtree(dst, ignore_errors=True)
                subprocess.run(["sync"], check=False)
                r = run_timed(make_cmd(dst), name, log)
                r["bytes"] = du_bytes(dst)
                r.pop("stdout", None)
                runs[name].append(r)
                shutil.rmtree(dst, ignore_errors=True)
        summary: dict[str, dict] = {}
        for name, rs in runs.items():
            secs = median([r["seconds"] for r in rs])
            summary[name] = {
                "seconds": secs,
                "all_seconds": [round(r["seconds"], 2) for r in rs],
                "bytes": rs[0]["bytes"],
                "mb_s": rs[0]["bytes"] / secs / MB,
                "rss_mib": max(r["rss_kb"] for r in rs) / 1024,
                "user": median([r["user"] for r in rs]),
                "sys": median([r["sys"] for r in rs]),
                "cpu_s_per_gib": median([(r["user"] + r["sys"]) / (r["bytes"] / GiB) for r in rs])
                if rs[0]["bytes"]
                else float("nan"),
                "cmd": rs[0]["cmd"],
            }
        results["runs"] = summary

        # 3. inspect of the full checkpoint, headers only
        full = work / "full"
        run_timed([py, str(HERE / "make_skeleton.py"), str(full), "--headers-only"], "make_skeleton (headers)", log)
        ins = [
            run_timed([*tool, "inspect", str(full), "--json"], "ckpt-tool inspect", log)
            for _ in range(1 if args.quick else 3)
        ]
        doc = json.loads(ins[0]["stdout"]) if ins[0]["stdout"].strip().startswith("{") else {}
        for r in ins:
            r.pop("stdout", None)
        code = (
            "import sys,time; t=time.perf_counter(); from ckpt_tool.checkpoint.summary import inspect_local; "
            "r=inspect_local(sys.argv[1]); print(time.perf_counter()-t)"
        )
        inproc = [
            float(subprocess.run([py, "-c", code, str(full)], capture_output=True, text=True, cwd=REPO).stdout)
            for _ in range(len(ins))
        ]
        results["inspect"] = {
            "seconds": min(r["seconds"] for r in ins),
            "all_seconds": [round(r["seconds"], 2) for r in ins],
            "in_process_seconds": min(inproc),
            "rss_mib": max(r["rss_kb"] for r in ins) / 1024,
            "tensors": doc.get("tensor_count"),
            "files": len(doc.get("files", [])),
        }
        shutil.rmtree(full, ignore_errors=True)

        # 4. RSS flatness: --only model of sparse skeletons with A and B main layers
        if not args.no_flat:
            flat = {}
            for k in (layers_a, layers_b):
                sk = work / f"flat{k}"
                make_skeleton.make_skeleton(sk, layers=k, headers_only=True, log=None)
                dst = work / "out"
                shutil.rmtree(dst, ignore_errors=True)
                if free_bytes(work) < 1.1 * sum(s.nbytes for s in make_skeleton.all_specs(k)):
                    log(f"  (flatness at {k} layers skipped: not enough disk)")
                    continue
                r = run_timed(
                    [*tool, "convert", str(sk), str(dst), "--only", "model", *wflag, "--json"],
                    f"convert --only model, {k} layer(s)",
                    log,
                )
                r["bytes"] = du_bytes(dst)
                flat[k] = {
                    "rss_mib": r["rss_kb"] / 1024,
                    "seconds": r["seconds"],
                    "bytes": r["bytes"],
                    "mb_s": r["bytes"] / r["seconds"] / MB,
                }
                shutil.rmtree(dst, ignore_errors=True)
                shutil.rmtree(sk, ignore_errors=True)
            results["flatness"] = flat
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    results["bench_seconds"] = time.perf_counter() - started
    report(results, log)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def dd_cmd(src: Path, dst: Path) -> list[str]:
    """A direct-I/O copy of every source file (the bytes convert reads), fsynced like ckpt-tool's files."""
    return [
        "sh",
        "-c",
        f"mkdir -p '{dst}' && for f in '{src}'/*.safetensors; do "
        f'dd if="$f" of=\'{dst}\'/"${{f##*/}}" bs=16M oflag=direct conv=fsync status=none; done',
    ]


def header_names(path: Path) -> list[str]:
    """The tensor names of one safetensors file (its JSON header only)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def nvfp4_params(out: Path) -> dict[str, int]:
    """How many of rank 0's tensors are NVFP4 expert parameters (vLLM's ModelOptNvFp4FusedMoE names), by kind."""
    names = [n for p in sorted(out.rglob("model-rank-0-*.safetensors")) for n in header_names(p)]
    return {k: sum(n.endswith(k) for n in names) for k in ("w13_weight_scale_2", "w2_weight_scale_2", "w2_input_scale")}


def nvfp4_bench(work: Path, layers: int, forms: tuple[str, ...], convert: list[str], wflag: list[str], log) -> dict:
    """Per form (the NVFP4 export, the MXFP4 skeleton): its skeleton, then dd / convert tp 8 / convert tp 8 ep,
    each from a cold page cache; the skeleton is removed before the next form's is written."""
    if layers < 1:  # the NVFP4 experts are the main layers' (a skeleton of 0 layers has the MTP layer's only)
        raise SystemExit("--nvfp4 needs --data-layers 1 or more")
    out: dict = {"layers": layers, "forms": {}}
    for form in forms:
        nvfp4 = form == "nvfp4"
        src, dst = work / f"src-{form}", work / "out"
        src_bytes = sum(s.nbytes for s in make_skeleton.all_specs(layers, nvfp4=nvfp4))
        need = 2.3 * src_bytes  # the source and one OUT (tp 8 repeats the replicated tensors on every rank)
        if free_bytes(work) < need:
            raise SystemExit(f"{work}: {free_bytes(work) / GiB:.1f} GiB free; --nvfp4 needs ~{need / GiB:.0f} GiB")
        gen_cmd = [sys.executable, str(HERE / "make_skeleton.py"), str(src), "--layers", str(layers)]
        gen = run_timed(gen_cmd + (["--nvfp4"] if nvfp4 else []), f"make_skeleton ({form})", log)
        figures: dict = {"skeleton_bytes": du_bytes(src), "generator_rss_kb": gen["rss_kb"], "runs": {}}
        commands = {
            "dd oflag=direct": dd_cmd(src, dst),
            "convert tp8": [*convert, str(src), str(dst), "--tp", "8", *wflag, "--json"],
            "convert tp8 ep": [*convert, str(src), str(dst), "--tp", "8", "--moe-parallel", "ep", *wflag, "--json"],
        }
        try:
            for label, cmd in commands.items():
                shutil.rmtree(dst, ignore_errors=True)
                how = timing.drop_caches(src)
                t = timing.run_timed(cmd, cwd=REPO)
                if t.rc != 0:
                    raise SystemExit(f"{form} {label}: {' '.join(cmd)} exited {t.rc}\n{t.stderr[-3000:]}")
                r = {
                    "seconds": t.seconds,
                    "rss_mib": t.peak_rss_mib,
                    "user": t.user_seconds,
                    "sys": t.sys_seconds,
                    "bytes_written": du_bytes(dst),
                    "disk_read_bytes": t.disk_read_bytes,
                    "cold_cache": how,
                }
                if label.startswith("convert"):
                    # rank 0 holds each NVFP4 layer's parameters once (the MTP layer's experts stay MXFP4)
                    r["rank0_nvfp4_params"] = found = nvfp4_params(dst)
                    if set(found.values()) != {layers if nvfp4 else 0}:
                        raise SystemExit(f"{form} {label}: rank 0 of {dst} holds NVFP4 parameters {found}")
                figures["runs"][label] = r
                log(
                    f"  {form} {label:16s} {t.seconds:7.2f} s  peak RSS {t.peak_rss_mib:6.1f} MiB  "
                    f"read from disk {t.disk_read_bytes / GiB:5.2f} GiB  wrote {r['bytes_written'] / GiB:5.2f} GiB"
                    + (f"  rank 0 NVFP4 params {r['rank0_nvfp4_params']}" if "rank0_nvfp4_params" in r else "")
                )
        finally:
            shutil.rmtree(dst, ignore_errors=True)
            shutil.rmtree(src, ignore_errors=True)
        out["forms"][form] = figures
    return out


def report_nvfp4(res: dict, log) -> None:
    nv = res["nvfp4"]
    forms = nv["forms"]
    load = res["machine"]["load_average"]
    log("")
    log(
        f"--nvfp4: {nv['layers']} main layer(s) + the MTP layer, one run, cold cache "
        f"({next(iter(next(iter(forms.values()))['runs'].values()))['cold_cache']}); "
        f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the start, "
        f"{res['machine']['load_average_after'][0]:.1f} at the end"
    )
    log(
        f"{'form':6s} {'command':16s} {'seconds':>8s} {'÷ dd':>6s} {'GiB read':>9s} {'GiB written':>11s} "
        f"{'peak RSS':>9s}"
    )
    for form, f in forms.items():
        dd = f["runs"]["dd oflag=direct"]["seconds"]
        for label, r in f["runs"].items():
            log(
                f"{form:6s} {label:16s} {r['seconds']:8.2f} {r['seconds'] / dd:6.2f} "
                f"{r['disk_read_bytes'] / GiB:9.2f} {r['bytes_written'] / GiB:11.2f} {r['rss_mib']:5.0f} MiB"
            )
        log(
            f"       skeleton {f['skeleton_bytes'] / GiB:.2f} GiB, "
            f"generator peak RSS {f['generator_rss_kb'] / 1024:.0f} MiB"
        )
    if len(forms) == 2:
        a, b = forms["nvfp4"]["runs"], forms["mxfp4"]["runs"]
        for label in ("convert tp8", "convert tp8 ep"):
            log(
                f"peak RSS {label}: NVFP4 {a[label]['rss_mib']:.0f} MiB vs MXFP4 {b[label]['rss_mib']:.0f} MiB "
                f"({100 * (a[label]['rss_mib'] / b[label]['rss_mib'] - 1):+.1f} %)"
            )
    log(f"bench took {res['bench_seconds'] / 60:.1f} min")


def report(res: dict, log) -> None:
    runs = res["runs"]
    cp, t1, t8, nv = (runs.get(k) for k in ("cp", "ckpt-tool tp1", "ckpt-tool tp8", "naive"))
    sk = res["skeleton"]
    log("")
    log(
        f"skeleton: {sk['bytes'] / GiB:.2f} GiB in {sk['seconds']:.1f} s, "
        f"generator peak RSS {sk['generator_rss_kb'] / 1024:.0f} MiB; page cache warm for every run"
    )
    log(
        f"{'command':18s} {'seconds':>8s} {'MB/s':>7s} {'peak RSS':>12s} {'CPU s/GiB':>9s} "
        f"{'time/cp':>8s} {'RSS/cp':>8s} {'CPU/cp':>7s} {'time/naive':>10s} {'RSS/naive':>9s}"
    )
    for name, r in runs.items():
        ratio = lambda a, b: f"{a / b:.2f}" if b else "-"  # noqa: E731
        log(
            f"{name:18s} {r['seconds']:8.2f} {r['mb_s']:7.0f} {r['rss_mib']:8.0f} MiB {r['cpu_s_per_gib']:9.2f} "
            f"{ratio(r['seconds'], cp['seconds'] if cp else 0):>8s} "
            f"{ratio(r['rss_mib'], cp['rss_mib'] if cp else 0):>8s} "
            f"{ratio(r['cpu_s_per_gib'], cp['cpu_s_per_gib'] if cp else 0):>7s} "
            f"{ratio(r['seconds'], nv['seconds'] if nv else 0):>10s} "
            f"{ratio(r['rss_mib'], nv['rss_mib'] if nv else 0):>9s}"
        )
    if len(next(iter(runs.values()))["all_seconds"]) > 1:
        log("  (medians of " + ", ".join(f"{k}: {v['all_seconds']}" for k, v in runs.items()) + ")")
    ins = res.get("inspect", {})
    log(
        f"inspect: {ins.get('tensors')} tensors in {ins.get('files')} files: {ins.get('seconds', 0):.2f} s wall "
        f"({ins.get('in_process_seconds', 0):.2f} s of it reading headers + summarising), "
        f"peak RSS {ins.get('rss_mib', 0):.0f} MiB"
    )
    flat = res.get("flatness", {})
    if len(flat) == 2:
        (a, fa), (b, fb) = sorted(flat.items())
        log(
            f"flatness: --only model peak RSS {fa['rss_mib']:.0f} MiB at {a} layer(s) "
            f"({fa['bytes'] / GiB:.1f} GiB out), "
            f"{fb['rss_mib']:.0f} MiB at {b} ({fb['bytes'] / GiB:.1f} GiB out): "
            f"{100 * (fb['rss_mib'] / fa['rss_mib'] - 1):+.1f} %"
        )
    log("targets:")
    checks = []
    if cp and t1:
        checks.append(("convert tp1 throughput >= 0.9 x cp", t1["mb_s"] / cp["mb_s"], t1["mb_s"] / cp["mb_s"] >= 0.9))
    if t1:
        checks.append(
            (
                "convert peak RSS <= 1 GiB (MiB)",
                max(t1["rss_mib"], t8["rss_mib"] if t8 else 0),
                max(t1["rss_mib"], t8["rss_mib"] if t8 else 0) <= 1024,
            )
        )
    if len(flat) == 2:
        (a, fa), (b, fb) = sorted(flat.items())
        d = fb["rss_mib"] / fa["rss_mib"] - 1
        checks.append((f"RSS flat 1->{b} layers (+-10 %)", d, abs(d) <= 0.10))
    if nv:
        checks.append(
            (
                "naive RSS >= checkpoint size (ratio)",
                nv["rss_mib"] * 1024**2 / sk["bytes"],
                nv["rss_mib"] * 1024**2 >= sk["bytes"],
            )
        )
    if ins:
        checks.append(("inspect 69k tensors < 0.3 s (s)", ins["seconds"], ins["seconds"] < 0.3))
    if t1 and t8:
        checks.append(("tp8 time <= 1.3 x tp1", t8["seconds"] / t1["seconds"], t8["seconds"] / t1["seconds"] <= 1.3))
    dd = runs.get("dd oflag=direct")
    if dd and t1:
        log(
            f"  info  convert tp1 throughput vs dd oflag=direct: {t1['mb_s'] / dd['mb_s']:.3f}"
            + (
                f" (tp1 --workers 1: {runs['ckpt-tool tp1 w1']['mb_s'] / dd['mb_s']:.3f})"
                if "ckpt-tool tp1 w1" in runs
                else ""
            )
        )
    if cp and t1:
        log(
            f"  info  CPU seconds per GiB converted (user + sys): ckpt-tool tp1 {t1['cpu_s_per_gib']:.2f}, tp8 "
            f"{t8['cpu_s_per_gib'] if t8 else float('nan'):.2f}, cp {cp['cpu_s_per_gib']:.2f} "
            f"({t1['cpu_s_per_gib'] / cp['cpu_s_per_gib']:.1f} x cp); "
            f"storage faster than {1 / t1['cpu_s_per_gib']:.2f} GiB/s per core makes convert CPU-bound "
            "(it uses the cores: default --workers)"
        )
    for name, value, ok in checks:
        log(f"  {'PASS' if ok else 'FAIL'}  {name}: {value:.3f}")
    res["targets"] = [{"target": n, "value": v, "ok": ok} for n, v, ok in checks]
    log(f"bench took {res['bench_seconds'] / 60:.1f} min")


if __name__ == "__main__":
    raise SystemExit(main())
