"""``verify OUT --engine`` on a full-width V4-Flash skeleton: time and the largest process's peak RSS
(a script, not a test).

    python bench/engine_check_bench.py --engine-python /opt/serving-venv/bin/python   # one vLLM install
    python bench/engine_check_bench.py --site /tmp/site33 --site /tmp/site34            # vLLM in site folders
    python bench/engine_check_bench.py --src /tmp/skel --site ...                       # reuse a skeleton
    python bench/engine_check_bench.py --model pro --site ...                           # V4-Pro widths (~17 GiB)

Builds the skeleton (bench/make_skeleton.py: embed/head/norm/hc_head + the MTP layer with 256 MXFP4 experts at
real V4-Flash shapes, 5.32 GiB), converts it with ``--only mtp --tp 8`` (``--tp`` to change), then runs
``ckpt-tool verify OUT --engine --engine-python PY --json`` for each vLLM given, as a subprocess timed by
bench/timing.py (wall seconds; peak RSS of the largest process, ckpt-tool or the vLLM probe it runs), ``--rounds``
times, reporting the median and the worst. The rank files are far above the real-load limit, so every rank is
judged from the meta-device build alone: the figure for any OUT too large to load on the CPU. Fails (exit 1) when
a verify does not pass or exceeds the targets: all ranks in <= 60 s and <= 2 GiB.
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
import make_skeleton  # noqa: E402
import timing  # noqa: E402

TARGET_SECONDS = 60.0
TARGET_RSS_MIB = 2048.0


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Wall seconds, the largest process's peak RSS (timing.run_timed: over the waited-for process tree), output."""
    t = timing.run_timed(cmd, env=env)
    return {"rc": t.rc, "seconds": t.seconds, "peak_rss_mib": t.peak_rss_mib, "stdout": t.stdout, "stderr": t.stderr}


def site_python(site: Path, folder: Path) -> Path:
    """An interpreter whose vllm is the one in ``site`` (this python with ``site`` on PYTHONPATH)."""
    py = folder / f"python-{site.name}"
    py.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    return py


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--engine-python", action="append", default=[], metavar="PY", help="an interpreter with vLLM (repeatable)"
    )
    ap.add_argument(
        "--site", action="append", default=[], type=Path, metavar="DIR", help="a folder holding vllm (repeatable)"
    )
    ap.add_argument("--src", type=Path, help="an existing skeleton (default: make one in a fresh /tmp folder)")
    ap.add_argument("--model", choices=("flash", "pro"), default="flash")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="engine-bench-", dir="/tmp"))
    pythons = [Path(p) for p in args.engine_python] + [site_python(s.resolve(), work) for s in args.site]
    if not pythons:
        pythons = [Path(sys.executable)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # ckpt-tool from this checkout; vLLM only in the engine's python
    ckpt = [sys.executable, "-m", "ckpt_tool"]
    rows: list[dict] = []
    failed = False
    try:
        src = args.src
        if src is None:
            src = work / "src"
            if args.model == "pro":
                make_skeleton.use_pro()
            make_skeleton.make_skeleton(src)
        out = work / f"out-tp{args.tp}"
        conv = subprocess.run(
            [*ckpt, "convert", str(src), str(out), "--only", "mtp", "--tp", str(args.tp), "--force"],
            capture_output=True,
            text=True,
            env=env,
        )
        if conv.returncode:
            print(conv.stderr, file=sys.stderr)
            return 1
        for py in pythons:
            runs = []
            for _ in range(args.rounds):
                r = timed([*ckpt, "verify", str(out), "--engine", "--engine-python", str(py), "--json"], env)
                doc = json.loads(r["stdout"] or "{}")
                if r["rc"] or not doc.get("ok"):
                    print(r["stderr"][-3000:], file=sys.stderr)
                    failed = True
                runs.append({**{k: r[k] for k in ("rc", "seconds", "peak_rss_mib")}, "engine": doc.get("engine")})
                e = doc.get("engine") or {}
                print(
                    f"{r['seconds']:7.2f} s {r['peak_rss_mib']:7.0f} MiB  rc {r['rc']}  vLLM {e.get('vllm_version')} "
                    f"({e.get('ranks')} ranks, probe {e.get('seconds')} s)  {py}",
                    flush=True,
                )
            row = {
                "engine_python": str(py),
                "vllm": (runs[0]["engine"] or {}).get("vllm_version"),
                "ranks": (runs[0]["engine"] or {}).get("ranks"),
                "seconds_median": statistics.median(r["seconds"] for r in runs),
                "seconds_max": max(r["seconds"] for r in runs),
                "peak_rss_mib_median": statistics.median(r["peak_rss_mib"] for r in runs),
                "peak_rss_mib_max": max(r["peak_rss_mib"] for r in runs),
                "runs": runs,
            }
            failed |= row["seconds_max"] > TARGET_SECONDS or row["peak_rss_mib_max"] > TARGET_RSS_MIB
            rows.append(row)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\n| vLLM | ranks (mtp, tp {args.tp}) | seconds (median / max) | peak RSS, largest process (median / max) |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['vllm']} | {r['ranks']} | {r['seconds_median']:.1f} / {r['seconds_max']:.1f} "
            f"| {r['peak_rss_mib_median']:.0f} / {r['peak_rss_mib_max']:.0f} MiB |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"cpus": os.cpu_count(), "model": args.model, "tp": args.tp, "rows": rows}, indent=2) + "\n"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
