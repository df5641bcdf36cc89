"""verify side by side with convert on a full-width V4-Flash skeleton (a plain script, not a test).

    python bench/verify_bench.py                      # skeleton + convert tp 2 / tp 8 + verify levels,
                                                      # ~4 min on 2 cores
    python bench/verify_bench.py --src /tmp/vb/src    # reuse a skeleton made by bench/make_skeleton.py
    python bench/verify_bench.py --json verify.json --keep
    python bench/verify_bench.py --model pro          # V4-Pro widths (~17 GiB): memory must stay flat

In one run, on one skeleton (bench/make_skeleton.py: embed/head/norm/hc_head + the MTP layer with 256
MXFP4 experts at real V4-Flash shapes, 5.32 GiB): ``convert --only mtp`` at tp 2 and tp 8, then
``verify --level structure|values|numeric`` of each (numeric: 16 tokens, torch kernels on cpu), each a
subprocess under ``/usr/bin/time`` (wall seconds, peak RSS) after an untimed ``sync``. The numeric level
reports its coverage (output tensors checked numerically / all); the script fails if it is below 100 %
or a verify fails. Targets: values <= 1.5 x convert of the same OUT; numeric at tp 8 <= 60 s;
peak RSS < 2 GiB at tp 2 and tp 8.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_skeleton  # noqa: E402

TIME = "/usr/bin/time"


def timed(cmd: list[str], log) -> dict:
    """Wall seconds and peak RSS of ``cmd`` (after an untimed sync); stdout kept for --json output."""
    subprocess.run(["sync"], check=False)
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as tf:
        proc = subprocess.run([TIME, "-f", "%e %M", "-o", tf.name, *cmd], capture_output=True, text=True)
        wall, rss_kb = tf.read().split()[-2:]
    row = {"cmd": " ".join(cmd), "rc": proc.returncode, "seconds": float(wall), "peak_rss_mib": int(rss_kb) / 1024}
    log(f"{row['seconds']:7.2f} s {row['peak_rss_mib']:8.0f} MiB  rc {proc.returncode}  {row['cmd']}")
    if proc.returncode not in (0, 1):
        log(proc.stderr[-2000:])
    row["stdout"] = proc.stdout
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, help="an existing skeleton (default: make one in a fresh /tmp folder)")
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument(
        "--model",
        choices=("flash", "pro"),
        default="flash",
        help="skeleton dimensions: V4-Flash (5.3 GiB) or V4-Pro (hidden 7168, 384 experts: ~17 GiB) - "
        "numeric verify's memory must not grow with them",
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="verify-bench-", dir="/tmp"))
    log = lambda m: print(m, flush=True)  # noqa: E731
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
        for tp in args.tp:
            out = work / f"out-tp{tp}"
            conv = timed(
                [*ckpt, "convert", str(src), str(out), "--only", "mtp", "--tp", str(tp), "--force", "--json"], log
            )
            rows.append({"tp": tp, "command": "convert", **{k: v for k, v in conv.items() if k != "stdout"}})
            # values first: it reads OUT as convert left it (written with O_DIRECT, so not in the page cache)
            for level in ("values", "structure", "numeric"):
                extra = (
                    ["--tokens", str(args.tokens), "--kernels", "torch", "--device", "cpu"]
                    if level == "numeric"
                    else []
                )
                r = timed([*ckpt, "verify", str(out), "--source", str(src), "--level", level, "--json", *extra], log)
                doc = json.loads(r.pop("stdout") or "{}")
                row = {
                    "tp": tp,
                    "command": f"verify --level {level}",
                    **r,
                    "ok": doc.get("ok"),
                    "coverage": doc.get("coverage"),
                    "per_convert": round(r["seconds"] / conv["seconds"], 2),
                }
                if level == "numeric" and doc.get("numeric"):
                    row["logits_max_rel"] = doc["numeric"][0]["logits_max_rel"]
                rows.append(row)
                failed |= not doc.get("ok") or (
                    level == "numeric" and (doc.get("coverage") or {}).get("percent") != 100.0
                )
            shutil.rmtree(out)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print("\n| tp | command | seconds | x convert | peak RSS | coverage |\n|---:|---|---:|---:|---:|---|")
    for r in rows:
        cov = r.get("coverage")
        cov_txt = f"{cov['checked']}/{cov['total']} ({cov['percent']} %)" if cov else ""
        print(
            f"| {r['tp']} | {r['command']} | {r['seconds']:.2f} | {r.get('per_convert', 1.0):.2f} | "
            f"{r['peak_rss_mib']:.0f} MiB | {cov_txt} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"cpus": os.cpu_count(), "model": args.model, "rows": rows}, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
