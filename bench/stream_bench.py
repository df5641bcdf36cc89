"""``convert hf://... --stream`` against a local ``convert`` of the same files (a plain script, not a test).

    python bench/stream_bench.py                      # 1 main layer + MTP at V4-Flash widths, --tp 8
    python bench/stream_bench.py --layers 3 --tp 8 --json stream.json
    python bench/stream_bench.py --src /work/bench-data/skel --keep

In one run, on one full-width skeleton (``bench/make_skeleton.py``: the real config, names, shapes and dtypes,
random valid bytes), ``--rounds`` rounds (default 3) of three commands, each from a cold page cache
(``timing.drop_caches``), the convert order swapped every round (this VM's disk and CPU move by a third within
minutes, and the second command of a pair runs on a disk the first has just filled):

1. the server's own read: every shard fetched whole from the local hub imitation (``tests/hub_server.py``, serving
   the skeleton from this disk; the CDN redirect included) by huggingface_hub's HTTP client, bytes discarded — the
   fastest the network path here can deliver the source;
2. ``convert SRC OUT --tp T`` from the folder;
3. ``convert hf://bench/skeleton OUT --tp T --stream`` against that server (``HF_ENDPOINT``), the real client.

Reported for every round: seconds, peak RSS, bytes read from and written to disk (the stream's writes beyond the
local convert's, the same OUT, are its spool's); for the stream also bytes fetched and range requests (its
``--json``) against the bytes the plan reads and ``ceil(bytes / 64 MiB)`` plus one header read a shard; and the
stream's time over the local convert's of the same round. The two OUTs of a round must be byte-identical (every
file's sha256 in the two manifests). Targets (issue 32), over the rounds: the median of stream / local <= 1.3,
peak RSS <= 1 GiB, fetched <= 1.02 x what the plan reads, requests <= one per 64 MiB + headers, every round
byte-identical. The server runs in this process (its threads share the 2 cores with the conversion, as a local
hub would; it reads the disk with O_DIRECT, as the local convert does, not through this machine's page cache).
"""

from __future__ import annotations

import argparse
import json
import math
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
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from timing import drop_caches, run_timed  # noqa: E402

GiB = 1024**3
MiB = 1024**2
REPO_ID = "bench/skeleton"


def needed_bytes(src: Path, tp: int) -> tuple[int, dict[str, int]]:
    """Bytes of the source tensors the plan reads, and every shard's size."""
    from ckpt_tool.checkpoint.source import open_checkpoint
    from ckpt_tool.mapping.plan import Options
    from ckpt_tool.mapping.planner import plan_conversion

    ckpt = open_checkpoint(src)
    plan = plan_conversion(ckpt.require_config(), ckpt.tensors, Options(tp=tp))
    ranges = {(info.file, info.start): info.nbytes for info in plan.sources.values()}  # an alias reads its original
    return sum(ranges.values()), {f: h.file_size for f, h in ckpt.shards.items()}


def server_read(hub, files: list[str]) -> float:
    """Seconds to fetch every file whole from ``hub`` through huggingface_hub's client, bytes discarded (the client
    reading its socket in the pieces a range reader has it read in: ``read_sockets_in_larger_pieces``)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import get_session

    from ckpt_tool.checkpoint.hub_ranges import read_sockets_in_larger_pieces

    read_sockets_in_larger_pieces()

    t0 = time.perf_counter()
    for f in files:
        url = hf_hub_url(REPO_ID, f, endpoint=hub.url)
        with get_session().stream("GET", url, headers={"Accept-Encoding": "identity"}, timeout=60) as r:
            r.raise_for_status()
            for _ in r.iter_bytes():  # the pieces as they arrive, as the range reader takes them
                pass
    return time.perf_counter() - t0


def outputs(out: Path) -> dict[str, str]:
    return {k: v["sha256"] for k, v in json.loads((out / "ckpt-tool.json").read_text())["outputs"].items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, help="an existing skeleton (default: make one)")
    ap.add_argument("--layers", type=int, default=1, help="main layers of the skeleton made (default 1)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three commands (default 3)")
    ap.add_argument("--work", type=Path, default=None, help="folder for the skeleton and the OUTs (default: /tmp)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep what was written (the last round's OUTs)")
    args = ap.parse_args(argv)

    from hub_server import HubServer

    work = Path(tempfile.mkdtemp(prefix="stream-bench-", dir=args.work))
    try:
        src = args.src
        if src is None:
            src = work / "src"
            subprocess.run(
                [sys.executable, str(HERE / "make_skeleton.py"), str(src), "--layers", str(args.layers)], check=True
            )
        need, sizes = needed_bytes(src, args.tp)
        print(
            f"skeleton {src}: {sum(sizes.values()) / GiB:.2f} GiB in {len(sizes)} shard(s); the plan reads "
            f"{need / GiB:.2f} GiB (--tp {args.tp}); load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        budget = sum(math.ceil(n / (64 * MiB)) for n in sizes.values()) + len(sizes)
        rounds = []
        with HubServer() as hub:
            hub.push(REPO_ID, src)
            for r in range(args.rounds):
                last = r == args.rounds - 1
                row = one_round(
                    hub, src, sorted(sizes), work, args.tp, stream_first=r % 2 == 1, keep=args.keep and last
                )
                row.update(fetched_vs_plan=round(row.pop("fetched") / need, 4), request_budget=budget)
                print(f"round {r + 1}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
                rounds.append(row)
        ratios = [row["stream_vs_local"] for row in rounds]
        rows = {
            "cache": rounds[0]["cache"],
            "source_gib": round(sum(sizes.values()) / GiB, 3),
            "plan_reads_gib": round(need / GiB, 3),
            "rounds": len(rounds),
            **{f"median_{k}": round(statistics.median(row[k] for row in rounds), 3) for k in MEDIANS},
            "stream_vs_local_each": ratios,
            "stream_peak_rss_mib_max": max(row["stream_peak_rss_mib"] for row in rounds),
            "fetched_vs_plan_max": max(row["fetched_vs_plan"] for row in rounds),
            "requests_max": max(row["requests"] for row in rounds),
            "request_budget": budget,
            "byte_identical_every_round": all(row["byte_identical"] for row in rounds),
        }
        for k, v in rows.items():
            print(f"  {k:32} {v}")
        verdicts = {
            "stream <= 1.3 x local convert (median of the rounds)": rows["median_stream_vs_local"] <= 1.3,
            "stream peak RSS <= 1 GiB": rows["stream_peak_rss_mib_max"] <= 1024,
            "fetched <= 1.02 x plan": rows["fetched_vs_plan_max"] <= 1.02,
            "requests <= one per 64 MiB + headers": rows["requests_max"] <= budget,
            "byte-identical": rows["byte_identical_every_round"],
        }
        for what, ok in verdicts.items():
            print(f"  {'PASS' if ok else 'FAIL'}  {what}")
        if args.json:
            doc = {"figures": rows, "rounds": rounds, "targets": verdicts}
            args.json.write_text(json.dumps(doc, indent=2) + "\n")
        return 0 if all(verdicts.values()) else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


MEDIANS = ("server_read_s", "local_convert_s", "stream_convert_s", "stream_vs_local", "stream_vs_server_read")


def one_round(hub, src: Path, files: list[str], work: Path, tp: int, *, stream_first: bool, keep: bool) -> dict:
    """The server's read, then the two converts (the stream first if ``stream_first``), each from a cold cache;
    the two OUTs compared and removed (unless ``keep``)."""
    how = drop_caches(src)
    served = server_read(hub, files)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(PYTHONPATH=str(REPO), HF_HOME=str(work / "hf"), HF_HUB_DISABLE_TELEMETRY="1")
    local_cmd = [sys.executable, "-m", "ckpt_tool", "convert", str(src), str(work / "local"), "--tp", str(tp)]
    stream_cmd = [sys.executable, "-m", "ckpt_tool", "convert", f"hf://{REPO_ID}", str(work / "stream")]
    stream_cmd += ["--tp", str(tp), "--stream", "--json"]
    timed = {}
    for name in ("stream", "local") if stream_first else ("local", "stream"):
        drop_caches(src)
        cmd, extra = (stream_cmd, {"HF_ENDPOINT": hub.url}) if name == "stream" else (local_cmd, {})
        timed[name] = run_timed(cmd, cwd=REPO, env={**env, **extra})
        assert timed[name].rc == 0, timed[name].stderr
    local, streamed = timed["local"], timed["stream"]
    doc = json.loads(streamed.stdout)
    same = outputs(work / "local") == outputs(work / "stream")
    if not keep:
        for name in ("local", "stream", "hf"):
            shutil.rmtree(work / name, ignore_errors=True)
    return {
        "cache": how,
        "order": "stream, local" if stream_first else "local, stream",
        "server_read_s": round(served, 2),
        "local_convert_s": round(local.seconds, 2),
        "stream_convert_s": round(streamed.seconds, 2),
        "stream_vs_local": round(streamed.seconds / local.seconds, 3),
        "stream_vs_server_read": round(streamed.seconds / served, 3),
        "local_peak_rss_mib": round(local.peak_rss_mib),
        "stream_peak_rss_mib": round(streamed.peak_rss_mib),
        "local_cpu_s": round(local.cpu_seconds, 1),
        "stream_cpu_s": round(streamed.cpu_seconds, 1),
        "local_disk_read_gib": round(local.disk_read_bytes / GiB, 3),
        "stream_disk_read_gib": round(streamed.disk_read_bytes / GiB, 3),
        "local_disk_write_gib": round(local.disk_write_bytes / GiB, 3),
        "stream_disk_write_gib": round(streamed.disk_write_bytes / GiB, 3),
        # the same OUT either way: what the stream wrote beyond it went to its spool file
        "spooled_gib": round((streamed.disk_write_bytes - local.disk_write_bytes) / GiB, 3),
        "fetched_gib": round(doc["fetched_bytes"] / GiB, 3),
        "fetched": doc["fetched_bytes"],
        "requests": doc["fetch_requests"],
        "byte_identical": same,
    }


if __name__ == "__main__":
    raise SystemExit(main())
