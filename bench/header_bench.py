"""The header path at interactive speed: ``inspect`` and ``convert --dry-run`` of full-size header sets.

    python bench/header_bench.py                       # builds /tmp/hbench-*/{flash,pro} (headers only, ~40 MB)
    python bench/header_bench.py --rounds 7 --keep     # keep the header sets (their folder is printed)
    python bench/header_bench.py --sets /tmp/hbench-x  # reuse header sets kept before
    python bench/header_bench.py --before /tmp/ckpt-tool-before   # and each command from another checkout too

Each command runs as a subprocess (interpreter start included) on V4-Flash (43 layers, 69,187 tensors;
tp 8, and tp 8 with --moe-parallel ep) and V4-Pro-sized (61 layers, 384 experts, 145,108 tensors; tp 8, and
tp 16 with --moe-parallel ep: its 24-block shared experts zero-padded to 2 blocks a rank, as vLLM does) header
sets from ``make_skeleton.py --headers-only``: ``inspect SRC`` and ``convert SRC OUT --dry-run`` as people type
them (output piped), and each with ``--json``.

Targets, as ratios to the floor of the same run (interpreter start + ``json.loads`` of every header, what no
header tool in Python can beat), so that a busy or slower machine moves both sides: ``convert --dry-run`` at
most 5x, ``inspect`` at most 2.5x. inspect also runs with ``CKPT_TOOL_NO_FORK=1`` (every shard parsed in one
process) to show what the forked helpers bring (no target). Each figure is the median of ``--rounds`` runs, the
commands of one header set (the floor among them) taking turns round by round, so that a load that comes and
goes on a shared machine falls on all of them alike; the load average is printed before and after.

``--before DIR`` runs every tool command a second time from the ckpt-tool checkout at DIR (``PYTHONPATH``), in
the same rounds: a before/after table from one run, under one load (``git archive BASE | tar -x -C DIR``).

The commands run as an installed tool does: with compiled bytecode (written to a cache in the bench's
temporary folder, ``PYTHONPYCACHEPREFIX``, even where ``PYTHONDONTWRITEBYTECODE`` is set), warmed by one
untimed run of each, and the page cache holding the headers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SERIAL = {"CKPT_TOOL_NO_FORK": "1"}  # inspect with every shard parsed in this process
FLOOR_RATIO = {"plan": 5.0, "inspect": 2.5}  # the most each command may take, in floors of the same run
# What no header tool in Python can beat: start the interpreter, read every header, json.loads it (no checks).
FLOOR = (
    "import json, struct, sys, pathlib\n"
    "for p in sorted(pathlib.Path(sys.argv[1]).glob('*.safetensors')):\n"
    "    with open(p, 'rb') as fh:\n"
    "        json.loads(fh.read(struct.unpack('<Q', fh.read(8))[0]))\n"
)
SETS = {
    # Pro at tp 16 plans with --moe-parallel ep only: under tp its MXFP4 experts would leave 192 rows a rank,
    # which vLLM's MoE backends round up (convert refuses); tp 8 (384 rows) shows the tp layout instead
    "flash": ((8, "tp"), (8, "ep")),
    "pro": ((8, "tp"), (16, "ep")),
}


def median_times(cmds: dict, rounds: int, cwd: Path) -> dict:
    """Median wall time and last exit code of each ``key -> (argv, env)``, the commands taking turns round by round
    (one untimed run each first: bytecode written, headers in the page cache).

    They run in ``cwd``, a folder holding no ckpt_tool: ``python -m`` puts the working folder first on
    ``sys.path``, so run from a checkout every tree would import that checkout, not its ``PYTHONPATH``."""
    times: dict = {key: [] for key in cmds}
    rcs: dict = {}
    for timed in [False] + [True] * rounds:
        for key, (argv, env) in cmds.items():
            t = time.perf_counter()
            rcs[key] = subprocess.run(
                argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd
            ).returncode
            if timed:
                times[key].append(time.perf_counter() - t)
    return {key: (statistics.median(times[key]), rcs[key]) for key in cmds}


def cases(src: Path, out: Path, plans: tuple) -> list[tuple[str, str, list[str], dict[str, str]]]:
    """(kind, label, arguments after ``ckpt-tool``, extra environment) of every timed command on one header set."""
    rows = [
        ("inspect", "inspect", ["inspect", str(src)], {}),
        ("inspect", "inspect --json", ["inspect", str(src), "--json"], {}),
        ("serial", "  same, one process (CKPT_TOOL_NO_FORK=1)", ["inspect", str(src), "--json"], SERIAL),
    ]
    for tp, moe in plans:
        opts = ["--tp", str(tp)] + (["--moe-parallel", "ep"] if moe == "ep" else [])
        label = f"convert --tp {tp}{' --moe-parallel ep' if moe == 'ep' else ''} --dry-run"
        argv = ["convert", str(src), str(out), *opts, "--dry-run"]
        rows += [("plan", label, argv, {}), ("plan", f"{label} --json", [*argv, "--json"], {})]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="timed runs of each command (the median is reported)")
    p.add_argument("--keep", action="store_true", help="keep the header sets")
    p.add_argument("--sets", type=Path, help="a folder of header sets kept by an earlier run (--keep)")
    p.add_argument("--before", type=Path, help="also run every command from the ckpt-tool checkout in this folder")
    p.add_argument("--only", choices=tuple(SETS), help="one header set")
    args = p.parse_args(argv)
    root = args.sets or Path(tempfile.mkdtemp(prefix="hbench-"))
    pycache = Path(tempfile.mkdtemp(prefix="hbench-pyc-"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    trees = {"after": REPO} | ({"before": args.before.resolve()} if args.before else {})
    envs = {
        tree: {**env, "PYTHONPATH": str(path), "PYTHONPYCACHEPREFIX": str(pycache / tree)}
        for tree, path in trees.items()
    }
    tool = [sys.executable, "-m", "ckpt_tool"]
    loads = [os.getloadavg()]
    results: dict[str, dict] = {}
    try:
        for model, plans in SETS.items():
            if args.only and model != args.only:
                continue
            src = root / model
            if not (src / "config.json").exists():
                subprocess.run(
                    [sys.executable, str(HERE / "make_skeleton.py"), str(src), "--headers-only", "--model", model],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
            cmds: dict = {("floor", "floor", "after"): ([sys.executable, "-c", FLOOR, str(src)], env)}
            for kind, label, tool_args, extra in cases(src, root / "out", plans):
                for tree in trees:
                    cmds[(kind, label, tree)] = ([*tool, *tool_args], {**envs[tree], **extra})
            results[model] = median_times(cmds, args.rounds, pycache)
            loads.append(os.getloadavg())
    finally:
        if args.keep or args.sets:
            print(f"header sets kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(pycache, ignore_errors=True)
    print(
        f"{os.cpu_count()} CPUs; median of {args.rounds} rounds; load average (1 min) "
        + " -> ".join(f"{load[0]:.1f}" for load in loads)
        + f" (5 min {loads[-1][1]:.1f})"
    )
    print(report(results, list(trees)))
    return 0


def report(results: dict[str, dict], trees: list[str]) -> str:
    """The table: per header set and command, seconds and floors (per tree), the target and the verdict."""
    head = f"{'set':6} {'command':52}"
    for tree in reversed(trees):
        head += f" {tree + ' s':>9} {'/floor':>7}"
    lines = [head + f" {'target':>7}  verdict"]
    for model, res in results.items():
        floor = res[("floor", "floor", "after")][0]
        lines.append(
            f"{model:6} {'floor: interpreter + json.loads of every header':52}" + f" {floor:9.3f} {1:7.2f}" * len(trees)
        )
        for kind, label, tree in res:
            if kind == "floor" or tree != "after":
                continue
            line = f"{model:6} {label:52}"
            verdicts = []
            for t in reversed(trees):
                secs, rc = res[(kind, label, t)]
                ratio = secs / floor
                line += f" {secs:9.3f} {ratio:7.2f}"
                if kind in FLOOR_RATIO:
                    ok = rc == 0 and ratio <= FLOOR_RATIO[kind]
                    verdicts.append(("PASS" if ok else "FAIL") + ("" if rc == 0 else f" (exit {rc})"))
            if kind in FLOOR_RATIO:
                line += f" {FLOOR_RATIO[kind]:6.1f}x  {verdicts[-1]}"
                if len(verdicts) > 1:
                    line += f" (before: {verdicts[0]})"
            else:
                line += f" {'':>7}  (reference: the helpers' gain)"
            lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
