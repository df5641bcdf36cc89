"""``convert hf://... --stream`` against a local ``convert`` of the same files (a plain script, not a test).

    python bench/stream_bench.py                      # 1 main layer + MTP at V4-Flash widths, --tp 8
    python bench/stream_bench.py --layers 3 --tp 8 --json stream.json
    python bench/stream_bench.py --src /work/bench-data/skel --keep

In one run, on one full-width skeleton (``bench/make_skeleton.py``: the real config, names, shapes and dtypes,
random valid bytes), each from a cold page cache (``timing.drop_caches``):

1. the server's own read: every shard fetched whole from the local hub imitation (``tests/hub_server.py``, serving
   the skeleton from this disk; the CDN redirect included) by huggingface_hub's HTTP client, bytes discarded — the
   fastest the network path here can deliver the source;
2. ``convert SRC OUT --tp T`` from the folder;
3. ``convert hf://bench/skeleton OUT --tp T --stream`` against that server (``HF_ENDPOINT``), the real client.

Reported: seconds, peak RSS, bytes read from and written to disk (the stream's writes beyond the local
convert's, the same OUT, are its spool's); for the stream also bytes fetched and range requests (its ``--json``)
against the bytes the plan reads and ``ceil(bytes / 64 MiB)`` plus one header read a shard. The two
OUTs must be byte-identical (every file's sha256 in the two manifests). Targets (issue 32): stream <= 1.3 x the
local convert, peak RSS <= 1 GiB, fetched <= 1.02 x what the plan reads, requests <= one per 64 MiB + headers.
The server runs in this process (its threads share the 2 cores with the conversion, as a local hub would).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
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
    ap.add_argument("--work", type=Path, default=None, help="folder for the skeleton and the OUTs (default: /tmp)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep what was written")
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
        with HubServer() as hub:
            hub.push(REPO_ID, src)
            how = drop_caches(src)
            served = server_read(hub, sorted(sizes))
            print(f"server read: {served:.1f} s ({sum(sizes.values()) / served / MiB:.0f} MiB/s)", flush=True)

            env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
            env.update(PYTHONPATH=str(REPO), HF_HOME=str(work / "hf"), HF_HUB_DISABLE_TELEMETRY="1")
            drop_caches(src)
            local = run_timed(
                [sys.executable, "-m", "ckpt_tool", "convert", str(src), str(work / "local"), "--tp", str(args.tp)],
                cwd=REPO,
                env=env,
            )
            assert local.rc == 0, local.stderr
            drop_caches(src)
            streamed = run_timed(
                [
                    sys.executable,
                    "-m",
                    "ckpt_tool",
                    "convert",
                    f"hf://{REPO_ID}",
                    str(work / "stream"),
                    "--tp",
                    str(args.tp),
                    "--stream",
                    "--json",
                ],
                cwd=REPO,
                env={**env, "HF_ENDPOINT": hub.url},
            )
            assert streamed.rc == 0, streamed.stderr
        doc = json.loads(streamed.stdout)
        same = outputs(work / "local") == outputs(work / "stream")
        fetched, requests = doc["fetched_bytes"], doc["fetch_requests"]
        budget = sum(math.ceil(n / (64 * MiB)) for n in sizes.values()) + len(sizes)
        rows = {
            "cache": how,
            "source_gib": round(sum(sizes.values()) / GiB, 3),
            "plan_reads_gib": round(need / GiB, 3),
            "server_read_s": round(served, 2),
            "local_convert_s": round(local.seconds, 2),
            "stream_convert_s": round(streamed.seconds, 2),
            "stream_vs_local": round(streamed.seconds / local.seconds, 3),
            "stream_vs_server_read": round(streamed.seconds / served, 3),
            "local_peak_rss_mib": round(local.peak_rss_mib),
            "stream_peak_rss_mib": round(streamed.peak_rss_mib),
            "local_disk_read_gib": round(local.disk_read_bytes / GiB, 3),
            "stream_disk_read_gib": round(streamed.disk_read_bytes / GiB, 3),
            "local_disk_write_gib": round(local.disk_write_bytes / GiB, 3),
            "stream_disk_write_gib": round(streamed.disk_write_bytes / GiB, 3),
            # the same OUT either way: what the stream wrote beyond it went to its spool file
            "spooled_gib": round((streamed.disk_write_bytes - local.disk_write_bytes) / GiB, 3),
            "fetched_gib": round(fetched / GiB, 3),
            "fetched_vs_plan": round(fetched / need, 4),
            "requests": requests,
            "request_budget": budget,
            "byte_identical": same,
        }
        for k, v in rows.items():
            print(f"  {k:24} {v}")
        verdicts = {
            "stream <= 1.3 x local convert": rows["stream_vs_local"] <= 1.3,
            "stream peak RSS <= 1 GiB": rows["stream_peak_rss_mib"] <= 1024,
            "fetched <= 1.02 x plan": rows["fetched_vs_plan"] <= 1.02,
            "requests <= one per 64 MiB + headers": requests <= budget,
            "byte-identical": same,
        }
        for what, ok in verdicts.items():
            print(f"  {'PASS' if ok else 'FAIL'}  {what}")
        if args.json:
            args.json.write_text(json.dumps({"figures": rows, "targets": verdicts}, indent=2) + "\n")
        return 0 if all(verdicts.values()) else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
