"""The header path at interactive speed: ``inspect`` and ``convert --dry-run`` of full-size header sets.

    python bench/header_bench.py                 # builds /tmp/hbench-*/{flash,pro} (headers only, ~30 MB), best of 3
    python bench/header_bench.py --rounds 5 --keep

Each command runs as a subprocess (interpreter start included) on V4-Flash (43 layers, 69,187 tensors,
tp 8) and V4-Pro-sized (61 layers, 384 experts, 145,108 tensors, tp 16 with --moe-parallel ep: its
24-block shared experts zero-padded to 2 blocks a rank, as vLLM does; and tp 8) header sets from
``make_skeleton.py --headers-only``.
Targets: plan < 1 s (Flash) / < 2 s (Pro), inspect < 0.3 s / < 0.5 s. inspect also runs with
``CKPT_TOOL_NO_FORK=1`` (every shard parsed in one process) to show what the forked helpers bring.
Timings are the best of N rounds: on a shared machine the minimum is the one that says what the code costs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = {("flash", "plan"): 1.0, ("flash", "inspect"): 0.3, ("pro", "plan"): 2.0, ("pro", "inspect"): 0.5}
# What no header tool in Python can beat: start the interpreter, read every header, json.loads it (no checks).
FLOOR = (
    "import json, struct, sys, pathlib\n"
    "for p in sorted(pathlib.Path(sys.argv[1]).glob('*.safetensors')):\n"
    "    with open(p, 'rb') as fh:\n"
    "        json.loads(fh.read(struct.unpack('<Q', fh.read(8))[0]))\n"
)


def best(cmd: list[str], rounds: int, env: dict[str, str] | None = None) -> tuple[float, int]:
    times, rc = [], 0
    for _ in range(rounds):
        t = time.perf_counter()
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env).returncode
        times.append(time.perf_counter() - t)
    return min(times), rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--keep", action="store_true", help="keep the header sets")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="hbench-"))
    tool = [sys.executable, "-m", "ckpt_tool"]
    rows = []
    try:
        # Pro at tp 16 plans with --moe-parallel ep only: under tp its MXFP4 experts would leave 192 rows a rank,
        # which vLLM's MoE backends round up (convert refuses); tp 8 (384 rows) shows the tp layout instead
        for model, plans in (("flash", ((8, "tp"), (8, "ep"))), ("pro", ((16, "ep"), (8, "tp")))):
            src = root / model
            subprocess.run(
                [sys.executable, str(HERE / "make_skeleton.py"), str(src), "--headers-only", "--model", model],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            secs, rc = best([sys.executable, "-c", FLOOR, str(src)], args.rounds)
            rows.append((model, "floor", f"floor: interpreter + json.loads of every header ({model})", secs, rc))
            secs, rc = best([*tool, "inspect", str(src), "--json"], args.rounds)
            rows.append((model, "inspect", f"ckpt-tool inspect {model} --json", secs, rc))
            secs, rc = best(
                [*tool, "inspect", str(src), "--json"], args.rounds, env={**os.environ, "CKPT_TOOL_NO_FORK": "1"}
            )
            rows.append((model, "serial", "  same, one process (CKPT_TOOL_NO_FORK=1)", secs, rc))
            for tp, moe in plans:
                cmd = [
                    *tool,
                    "convert",
                    str(src),
                    str(root / "out"),
                    "--tp",
                    str(tp),
                    "--moe-parallel",
                    moe,
                    "--dry-run",
                    "--json",
                ]
                secs, rc = best(cmd, args.rounds)
                rows.append(
                    (model, "plan", f"convert {model} --tp {tp} --moe-parallel {moe} --dry-run --json", secs, rc)
                )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    floors = {model: secs for model, kind, _, secs, _ in rows if kind == "floor"}
    print(f"{'command':62} {'best s':>7} {'target':>7} {'ratio':>6} {'/floor':>6}  exit")
    for model, kind, label, secs, rc in rows:
        if kind == "floor":
            print(f"{label:62} {secs:7.2f} {'':>7} {'':>6} {1.0:6.2f}  {rc}")
            continue
        target = TARGETS[(model, "inspect" if kind == "serial" else kind)]
        verdict = (
            ("PASS" if rc == 0 and secs < target else "FAIL") if kind != "serial" else "(reference: the helpers' gain)"
        )
        print(f"{label:62} {secs:7.2f} {target:7.2f} {secs / target:6.2f} {secs / floors[model]:6.2f}  {rc}  {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
