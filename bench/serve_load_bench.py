"""The start a user saves: vLLM's stock load of the original checkpoint against ShardedStateLoader on OUT, per rank.

    python bench/serve_load_bench.py --small                   # the fp4 fixture at tp 4 (~2 min; checks the bench)
    python bench/serve_load_bench.py                           # full-width V4-Flash skeleton, 1 main layer + MTP,
                                                               # tp 8 and tp 8 with ep, both releases (~28 GB free)
    python bench/serve_load_bench.py --layers 1 --releases 0.34.0 --cases tp8 --json load.json --markdown load.md

What runs is vLLM's own code, on the CPU, as the engine tests run it (``tests/engine/vllm_worker.py``, one ``serve``
process a release, so vLLM is imported once): for every (release, case, component, rank) the worker builds vLLM's
DeepSeek V4 class with vLLM's ``initialize_model`` and loads it twice, each from a cold page cache:

- ``stock``: ``DefaultModelLoader.load_weights`` on the original checkpoint, what ``vllm serve SRC`` runs (every
  file the class does not declare unused, vLLM's name remapping, slicing and scale reinterpretation; with
  expert parallelism, vLLM's EP weight filter skips the other ranks' experts before reading them), without the
  engine tests' write recorder (``{"record": false}``);
- ``sharded``: ``ShardedStateLoader.load_weights`` on ``OUT/<component>`` (``ckpt-tool convert``'s output).

Each load's figures come from the worker (``ckpt_tool/verify/engine/load_meter.py``): wall and CPU seconds of the
process during the load, bytes it made the disk read (``/proc/self/io`` read_bytes), tensor bytes the loader's
iterator handed over, peak RSS during the load (VmHWM, reset before it). Weight post-processing (CUDA repacking) and
the host-to-GPU copy are not run: on a GPU node the copy is the same bytes for both loads.

Two modes, in this order for every (release, case, component):

- ``cold``: every load alone from a cold page cache: ``sync``, then ``posix_fadvise(DONTNEED)`` on every file of
  SRC and OUT (``bench/timing.py``'s ``evict``; our files only, not other tenants' cache), checked with ``fincore``
  (no page resident, else the bench stops), the order of the two loads swapped every rank. Before the sharded
  load the worker reads the rank's headers (its precheck): that read-ahead, a few MiB a file, is then cached;
- ``node``: the ranks of one node one after another, the cache dropped once before rank 0: what a node's ranks
  read together (a real node runs them at once; here they share 2 cores, so their seconds add up).

Every load is checked, so the bench cannot time a wrong one: the two builds' engine tables are equal and every
key's sha256 of its raw bytes (the worker's dump digests) is equal between the stock and the sharded load of the
same rank and mode; the only exception is a draft key the manifest lists as materialized (the MTP draft's
embedding and head, which vLLM's stock load leaves uninitialised), which must then equal the target model's stock
key of the same rank. A mismatch, an exception or a cast warning stops the bench with the keys. With ``--small``
the stock load also runs once recorded (untimed): the keys the digest rule let differ must be exactly the
recorder's ``untouched_keys``.

Reported: per rank and summed over the ranks (peak RSS: the largest rank), per mode, stock against sharded; the
one-off ``ckpt-tool convert`` that made OUT (cold source, ``bench/timing.py``); and ``--project``: V4-Flash and
V4-Pro at tp 8 / 16 from the measured per-tensor and per-byte CPU costs (see :func:`project`). Everything the bench
writes (skeleton, OUTs) goes under ``--workdir`` and is removed unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
from timing import evict, run_timed  # noqa: E402

WORKER = REPO / "tests" / "engine" / "vllm_worker.py"
SITES = REPO / ".engine-site"
GiB = 1024**3
MiB = 1024**2
OPS = {"stock": "stock-load", "sharded": "sharded-load"}
CAST_WARNING = "Attempted to load weight"  # ShardedStateLoader's dtype-cast warning (sharded_state_loader.py)


class BenchError(RuntimeError):
    """A load that failed or gave other bytes than its counterpart: the figures would time a wrong load."""


# ---------------------------------------------------------------------------------------------------------------
# The worker: one vllm_worker.py serve process a release


class Worker:
    """``vllm_worker.py --site SITE serve``: one job a line; vLLM's logs go to ``log``.

    A served worker's anonymous memory grows from job to job on the full-width skeleton (0.4-0.7 GiB a job, about
    a rank's parameters), although only the last job's model is still alive after it (``gc``): freed memory the
    C allocator keeps. The engine tests' small fixtures never notice. Once its anonymous RSS passes
    ``RECYCLE_BYTES`` the worker is replaced by a fresh one between jobs, which leaves the page cache as it is.
    Each load's peak is reported as what it added to the process."""

    RECYCLE_BYTES = 3 * GiB

    def __init__(self, site: Path, log: Path) -> None:
        self.site = site
        self.log = open(log, "ab")  # noqa: SIM115 - closed in close()
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # vLLM's multiproc executor gives each GPU worker few threads
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "--site", str(self.site), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )

    def _anon_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        return 0

    def run(self, job: dict) -> dict:
        if self._anon_bytes() > self.RECYCLE_BYTES:
            self.close(keep_log=True)
            self._start()
            self.restarts += 1
        self.proc.stdin.write(json.dumps({"jobs": [job]}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise BenchError(f"the vLLM worker died (its log: {self.log.name})")
        answer = json.loads(line)
        (res,) = answer["results"]
        if res.get("error"):
            raise BenchError(f"the worker could not run {job['op']} {job}: {res['error']['message']}")
        res["vllm_version"] = answer["meta"]["vllm_version"]
        return res

    def close(self, keep_log: bool = False) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        if not keep_log:
            self.log.close()


# ---------------------------------------------------------------------------------------------------------------
# Checking the two loads against each other


def materialized_keys(manifest: dict, num_hidden_layers: int) -> dict[str, str]:
    """Engine key of the MTP draft -> engine key of the target it was materialized from (the manifest's
    ``materialized``: ``mtp.{i}.emb.tok_emb.weight`` / ``mtp.{i}.head.weight``; vLLM's V4 MTP class names them
    ``model.embed_tokens.weight`` and ``model.layers.{num_hidden_layers + i}.shared_head.head.weight``,
    vllm/models/deepseek_v4/nvidia/mtp.py)."""
    target = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight"}
    out = {}
    for alias, real in (manifest.get("materialized") or {}).items():
        m = re.fullmatch(r"mtp\.(\d+)\.(emb\.tok_emb|head)\.weight", alias)
        if not m or real not in target:
            raise BenchError(f"the manifest materializes {alias} from {real}: this bench knows only the MTP's")
        head = f"model.layers.{num_hidden_layers + int(m.group(1))}.shared_head.head.weight"
        out["model.embed_tokens.weight" if m.group(2) == "emb.tok_emb" else head] = target[real]
    return out


def check_pair(stock: dict, sharded: dict, where: str, materialized: dict[str, str], target_stock: dict | None) -> list:
    """The keys of ``sharded`` that may differ from ``stock`` (materialized ones equal to the target's); raises
    :class:`BenchError` on anything else."""
    for name, res in (("stock", stock), ("sharded", sharded)):
        if exc := res.get("exception"):
            raise BenchError(f"{where}: the {name} load raised {exc['type']}: {exc['message']}")
        if not res["load_cost"]["tensor_bytes"]:
            raise BenchError(f"{where}: the {name} load read no tensor")
    casts = [r["message"] for r in sharded["load_log"] if r["message"].startswith(CAST_WARNING)]
    if casts:
        raise BenchError(f"{where}: ShardedStateLoader cast tensors: {casts[:3]}")
    if stock["keys"] != sharded["keys"]:
        raise BenchError(f"{where}: the two builds disagree on the engine table")
    a, b = stock["dump"], sharded["dump"]
    if set(a) != set(b) or set(a) != set(stock["keys"]):
        raise BenchError(f"{where}: the loads' dumps hold other keys than the engine table")
    accepted, wrong = [], []
    for key in sorted(a):
        if a[key]["sha256"] == b[key]["sha256"]:
            continue
        ref = materialized.get(key)
        if ref is not None and target_stock is not None and target_stock["dump"][ref]["sha256"] == b[key]["sha256"]:
            accepted.append(key)
            continue
        wrong.append(key)
    if wrong:
        raise BenchError(f"{where}: {len(wrong)} key(s) differ between the stock and the sharded load: {wrong[:8]}")
    return accepted


# ---------------------------------------------------------------------------------------------------------------
# The runs


def cold(paths: list[Path]) -> None:
    """Our files out of the page cache (``sync``, then ``posix_fadvise(DONTNEED)``), and proof that they are:
    ``fincore`` (util-linux, mincore(2)) counts no page of them resident."""
    os.sync()
    evict(*paths)
    files = [str(f) for p in paths for f in sorted(Path(p).rglob("*.safetensors"))]
    proc = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files], capture_output=True)
    resident = sum(int(x) for x in proc.stdout.split()) if proc.returncode == 0 else None
    if resident:
        raise BenchError(f"{resident} bytes of {', '.join(map(str, paths))} still cached after eviction: not cold")


def figures(res: dict) -> dict:
    c = res["load_cost"]
    return {
        "seconds": c["seconds"],
        "cpu_seconds": c["cpu_seconds"],
        "disk_read_bytes": c["disk_read_bytes"],
        "tensor_bytes": c["tensor_bytes"],
        "tensors": c["tensors"],
        "peak_rss_bytes": c["peak_rss_bytes"],
        "rss_before_bytes": c["rss_before_bytes"],
        # what the load added to the process: the parameters it wrote, its buffers, the checkpoint pages it mapped
        "peak_rss_added_bytes": c["peak_rss_bytes"] - c["rss_before_bytes"],
        "build_seconds": res["build_seconds"],
    }


def run_component(worker: Worker, setting: dict, component: str, target: dict | None, log=print) -> dict:
    """Both modes of one component on every rank; ``target``: the model component's stock results (by mode and
    rank), for the draft's materialized keys. Returns {"cold"|"node": {"stock"|"sharded": [per rank]}} and, under
    "_stock", the raw stock results of the model component (for its draft)."""
    tp, ep, src, out = setting["tp"], setting["ep"], setting["src"], setting["out"]
    materialized = materialized_keys(setting["manifest"], setting["layers"]) if component != "model" else {}
    drop = [src, out]

    def job(op: str, rank: int, record: bool = False) -> dict:
        base = {"op": OPS[op], "config": str(src), "tp": tp, "rank": rank, "ep": ep, "component": component}
        if op == "sharded":
            return {**base, "folder": str(out / component)}
        return {**base, "source": str(src), "record": record}

    result = {"cold": {"stock": [], "sharded": []}, "node": {"stock": [], "sharded": []}}
    raw = {"cold": {}, "node": {}}
    for rank in range(tp):
        order = ("stock", "sharded") if rank % 2 == 0 else ("sharded", "stock")
        got = {}
        for op in order:
            cold(drop)
            got[op] = worker.run(job(op, rank))
        where = f"{component} rank {rank} (cold)"
        tgt = target["cold"][rank] if target else None
        accepted = check_pair(got["stock"], got["sharded"], where, materialized, tgt)
        if setting["record_check"]:
            recorded = worker.run(job("stock", rank, record=True))
            if sorted(accepted) != sorted(recorded["untouched_keys"]):
                raise BenchError(
                    f"{where}: the digest rule let {accepted} differ; the recorder says vLLM's stock load leaves "
                    f"{recorded['untouched_keys']} uninitialised"
                )
        for op in OPS:
            result["cold"][op].append(figures(got[op]))
        raw["cold"][rank] = got["stock"]
        log(
            f"  {component} rank {rank} cold: stock {got['stock']['load_cost']['seconds']:.2f} s, "
            f"sharded {got['sharded']['load_cost']['seconds']:.2f} s (equal; {len(accepted)} materialized key(s))"
        )
    node = {"stock": {}, "sharded": {}}
    for op in ("stock", "sharded"):
        cold(drop)
        for rank in range(tp):
            node[op][rank] = worker.run(job(op, rank))
            result["node"][op].append(figures(node[op][rank]))
    for rank in range(tp):
        tgt = target["node"][rank] if target else None
        check_pair(node["stock"][rank], node["sharded"][rank], f"{component} rank {rank} (node)", materialized, tgt)
        raw["node"][rank] = node["stock"][rank]
    log(
        f"  {component} node: stock {sum(f['seconds'] for f in result['node']['stock']):.2f} s, "
        f"sharded {sum(f['seconds'] for f in result['node']['sharded']):.2f} s"
    )
    # keep only the digests the draft needs of the target's stock loads
    result["_stock"] = {m: {r: {"dump": res["dump"]} for r, res in raw[m].items()} for m in raw}
    return result


def summed(ranks: list[dict]) -> dict:
    return {
        "seconds": round(sum(f["seconds"] for f in ranks), 3),
        "cpu_seconds": round(sum(f["cpu_seconds"] for f in ranks), 3),
        "disk_read_bytes": sum(f["disk_read_bytes"] or 0 for f in ranks),
        "tensor_bytes": sum(f["tensor_bytes"] for f in ranks),
        "tensors": sum(f["tensors"] for f in ranks),
        "peak_rss_bytes": max(f["peak_rss_bytes"] or 0 for f in ranks),
        "peak_rss_added_bytes": max(f["peak_rss_added_bytes"] for f in ranks),
    }


def convert(src: Path, out: Path, tp: int, ep: bool, profile: str) -> dict:
    """``ckpt-tool convert`` from a cold page cache, timed by bench/timing.py (the one-off cost of OUT)."""
    cold([src])
    cmd = [sys.executable, "-m", "ckpt_tool", "convert", str(src), str(out), "--tp", str(tp), "--target", profile]
    t = run_timed(cmd + (["--moe-parallel", "ep"] if ep else []), cwd=REPO)
    if t.rc != 0:
        raise BenchError(f"{t.cmd} failed ({t.rc}): {t.stderr[-2000:]}")
    return {"seconds": round(t.seconds, 2), "cpu_seconds": round(t.cpu_seconds, 2), "peak_rss_mib": t.peak_rss_mib}


def make_source(work: Path, small: bool, layers: int) -> Path:
    src = work / "src"
    if small:
        from ckpt_tool.fixtures.make import make_checkpoint

        make_checkpoint(src, "fp4")
    else:
        subprocess.run(
            [sys.executable, str(HERE / "make_skeleton.py"), str(src), "--layers", str(layers)], check=True, cwd=REPO
        )
    return src


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------------------------
# Projection


def fit_costs(doc: dict) -> dict:
    """The run's per-byte CPU costs, over every cold rank: ``write``, CPU seconds per GiB of the rank's parameters
    (the sharded load: reading its files and copying every byte into a parameter, fresh pages included); ``walk``,
    what the stock load costs beyond that, per GiB it is handed (the whole checkpoint, memory-mapped, names
    remapped; both loads write the same parameters). Per tensor, for reference: on a skeleton of one layer kind,
    bytes and tensors grow together, so the two cannot be told apart here, and the projection charges per GiB."""
    pairs = [
        (st, sh)
        for rd in doc["releases"].values()
        for cd in rd["cases"].values()
        for comp in cd["components"].values()
        for st, sh in zip(comp["cold"]["stock"], comp["cold"]["sharded"])
    ]
    written = sum(sh["tensor_bytes"] for _, sh in pairs) / GiB
    handed = sum(st["tensor_bytes"] for st, _ in pairs) / GiB
    return {
        "write_cpu_s_per_gib": sum(sh["cpu_seconds"] for _, sh in pairs) / written,
        "walk_cpu_s_per_gib": max(0.0, sum(st["cpu_seconds"] - sh["cpu_seconds"] for st, sh in pairs) / handed),
        "stock_cpu_s_per_tensor": sum(st["cpu_seconds"] for st, _ in pairs) / sum(st["tensors"] for st, _ in pairs),
        "sharded_cpu_s_per_tensor": sum(sh["cpu_seconds"] for _, sh in pairs) / sum(sh["tensors"] for _, sh in pairs),
        "ranks": len(pairs),
    }


def plan_shapes(model: str, tp: int, ep: bool, work: Path, ep_filter: bool = False) -> dict:
    """What a rank of V4-Flash / V4-Pro holds and reads, from a headers-only skeleton (no data on disk) and
    ``convert --dry-run``: per component, OUT bytes and tensors of rank 0, and the source bytes and tensors vLLM's
    stock load reads for rank 0 (every tensor of its component's files; only the rank's experts with ep and
    ``ep_filter``, vLLM's opt-in ``--enable-ep-weight-filter``)."""
    skel = work / f"hdr-{model}"
    if not skel.exists():
        subprocess.run(
            [sys.executable, str(HERE / "make_skeleton.py"), str(skel), "--headers-only", "--model", model],
            check=True,
            cwd=REPO,
            capture_output=True,
        )
    cmd = [sys.executable, "-m", "ckpt_tool", "convert", str(skel), str(work / "o"), "--tp", str(tp), "--dry-run"]
    proc = subprocess.run(cmd + ["--json"] + (["--moe-parallel", "ep"] if ep else []), capture_output=True, text=True)
    doc = json.loads(proc.stdout)
    if not doc["ok"]:
        raise BenchError(f"{' '.join(cmd)}: {doc['error']}")
    out = {}
    for comp in ("model", "mtp"):
        files = [f for f in doc["files"] if f["file"].startswith(comp + "/") and f["rank"] == 0]
        out[comp] = {
            "out_bytes": sum(f["bytes"] for f in files),
            "out_tensors": sum(len(f["tensors"]) for f in files),
            "out_bytes_all_ranks": sum(f["bytes"] for f in doc["files"] if f["file"].startswith(comp + "/")),
        }
    index = json.loads((skel / "model.safetensors.index.json").read_text())["weight_map"]
    sizes = _tensor_sizes(skel)
    experts = int(json.loads((skel / "config.json").read_text())["n_routed_experts"])
    # rank 0's experts (vLLM's linear EP placement) only with --enable-ep-weight-filter, which is off by default
    # (ParallelConfig.enable_ep_weight_filter = False, vllm/config/parallel.py, 0.33.0 and 0.34.0)
    local = set(range(experts // tp)) if ep and ep_filter else None
    picks = {"model": lambda n: not n.startswith("mtp."), "mtp": lambda n: n.startswith("mtp."), "all": bool}
    out["all"] = {}
    for comp, pick in picks.items():  # "all": the files target and draft read together (one node's cache)
        read_files = {index[n] for n in index if pick(n)}  # vLLM skips a file none of whose tensors the class uses
        names = [n for n in index if index[n] in read_files]
        if local is not None:
            names = [n for n in names if (m := re.search(r"\.experts\.(\d+)\.", n)) is None or int(m[1]) in local]
        out[comp]["stock_bytes"] = sum(sizes[n] for n in names)
        out[comp]["stock_tensors"] = len(names)
        in_files = [n for n in index if index[n] in read_files]
        expert_bytes = sum(sizes[n] for n in in_files if ".experts." in n)
        # what the 8 ranks of one node read together: every tensor of those files (with the filter, their experts)
        share = 1.0 if local is None else min(1.0, 8 / tp)
        out[comp]["node_stock_bytes"] = sum(sizes[n] for n in in_files) - expert_bytes * (1 - share)
    return out


def _tensor_sizes(skel: Path) -> dict[str, int]:
    import struct

    sizes = {}
    for p in skel.glob("*.safetensors"):
        with open(p, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            head = json.loads(fh.read(n))
        for k, v in head.items():
            if k != "__metadata__":
                sizes[k] = v["data_offsets"][1] - v["data_offsets"][0]
    return sizes


def disk_rate(doc: dict) -> float:
    """GiB/s of this machine's disk as the run saw it: every cold load's bytes from disk over its wall time (their
    CPU time makes it a lower bound)."""
    loads = [
        f
        for rd in doc["releases"].values()
        for cd in rd["cases"].values()
        for comp in cd["components"].values()
        for op in OPS
        for f in comp["cold"][op]
    ]
    return sum(f["disk_read_bytes"] or 0 for f in loads) / GiB / sum(f["seconds"] for f in loads)


def touched_share(doc: dict) -> float:
    """Of the tensor bytes vLLM's stock loader hands over (memory-mapped, read when touched), the share a rank's
    cold load made the disk read: its own slices of the split weights and the read-ahead around them."""
    loads = [
        f
        for rd in doc["releases"].values()
        for cd in rd["cases"].values()
        for comp in cd["components"].values()
        for f in comp["cold"]["stock"]
    ]
    return sum(f["disk_read_bytes"] or 0 for f in loads) / sum(f["tensor_bytes"] for f in loads)


# Scenarios of the projection: (name, cores a node, disk GB/s (None: this run's), the node's page cache holds what
# its ranks read (each byte read from the disk once a node) or not (each rank reads what it touches))
SCENARIOS = [
    ("this VM: 2 cores, this run's disk", 2, None, True),
    ("32 cores, 3 GB/s local disk", 32, 3.0, True),
    ("32 cores, 3 GB/s local disk, page cache smaller than the checkpoint", 32, 3.0, False),
    ("32 cores, network file system at 200 MB/s", 32, 0.2, True),
    ("32 cores, network file system at 200 MB/s, page cache smaller than the checkpoint", 32, 0.2, False),
]


def project(doc: dict, work: Path) -> list[dict]:
    """Start-up load time of V4-Flash / V4-Pro (model + MTP draft) at tp 8 (one node) and tp 16 (two nodes of 8).

    Per rank, CPU (:func:`fit_costs`, this run's costs) = ``write`` x the rank's parameter GiB (its OUT), and for
    the stock load also ``walk`` x the GiB it is handed (every tensor of every file its component reads; with ep
    too, as vLLM's EP weight filter is opt-in). Per node, its 8 ranks load at once, one a core: the time is
    max(disk bytes / rate, CPU of one rank x ceil(8 / cores)). Disk bytes of a node: where its page cache holds
    what its ranks read, each byte once (stock: the files its ranks read for target and draft; sharded: its ranks'
    OUT files); where it does not, every rank reads what it touches (stock: :func:`touched_share` of what it is
    handed; sharded: its files). On the VM the rate is :func:`disk_rate`. Two nodes load at once, each its half.
    GPU copies, weight post-processing, kernel warm-up and the rest of vLLM's start are not counted."""
    fits = fit_costs(doc)
    share = touched_share(doc)
    rows = []
    for model in ("flash", "pro"):
        for tp in (8, 16):
            # Pro's 3072 expert rows over 16 ranks are no multiple of 128: convert (and vLLM) need expert parallelism
            ep = model == "pro" and tp == 16
            shapes = plan_shapes(model, tp, ep, work)
            nodes = tp // 8
            for name, cores, rate, shared in SCENARIOS:
                gib_s = doc["disk_gib_s"] if rate is None else rate * 1e9 / GiB
                row = {"model": model, "tp": tp, "ep": ep, "machine": name, "shared_cache": shared}
                for op in OPS:
                    stock = op == "stock"
                    cpu, disk = 0.0, 0.0
                    for comp in ("model", "mtp"):
                        sh = shapes[comp]
                        cpu += fits["write_cpu_s_per_gib"] * sh["out_bytes"] / GiB
                        if stock:
                            cpu += fits["walk_cpu_s_per_gib"] * sh["stock_bytes"] / GiB
                        if not shared:  # every rank reads what it touches
                            disk += 8 * (share * sh["stock_bytes"] if stock else sh["out_bytes"])
                        elif not stock:
                            disk += sh["out_bytes_all_ranks"] / nodes
                    if shared and stock:  # the files target and draft read, once a node
                        disk = shapes["all"]["node_stock_bytes"]
                    waves = -(-8 // cores)
                    row[op] = {
                        "rank_cpu_s": round(cpu, 1),
                        "node_disk_gib": round(disk / GiB, 1),
                        "seconds": round(max(disk / GiB / gib_s, cpu * waves), 1),
                    }
                row["ratio"] = round(row["stock"]["seconds"] / row["sharded"]["seconds"], 2)
                rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Output


def fmt_b(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def markdown(doc: dict) -> str:
    lines = []
    for rel, rd in doc["releases"].items():
        for case, cd in rd["cases"].items():
            conv = cd["convert"]
            lines += [
                "",
                f"vLLM {rel}, {case} (OUT {fmt_b(cd['out_bytes'])}, made by `ckpt-tool convert` in {conv['seconds']} s"
                f" from a cold cache, {conv['cpu_seconds']} CPU s):",
                "",
                "| component, mode | load | wall s | CPU s | from disk | tensors handed over "
                "| RSS the load added (largest) | wall stock ÷ sharded |",
                "|---|---|---:|---:|---:|---:|---:|---:|",
            ]
            for comp, comp_d in cd["components"].items():
                for mode in ("cold", "node"):
                    s = {op: summed(comp_d[mode][op]) for op in OPS}
                    for op in OPS:
                        ratio = f"{s['stock']['seconds'] / s['sharded']['seconds']:.1f} ×" if op == "stock" else ""
                        lines.append(
                            f"| {comp}, {'each rank cold, summed' if mode == 'cold' else 'node: ranks in turn'} "
                            f"| {op} | {s[op]['seconds']:.2f} | {s[op]['cpu_seconds']:.2f} "
                            f"| {fmt_b(s[op]['disk_read_bytes'])} | {fmt_b(s[op]['tensor_bytes'])} "
                            f"| {fmt_b(s[op]['peak_rss_added_bytes'])} | {ratio} |"
                        )
            lines += ["", "Per rank, cold (wall s stock / sharded; from disk stock / sharded):", ""]
            for comp, comp_d in cd["components"].items():
                cells = [
                    f"r{r}: {a['seconds']:.2f}/{b['seconds']:.2f} s, {fmt_b(a['disk_read_bytes'])}/"
                    f"{fmt_b(b['disk_read_bytes'])}"
                    for r, (a, b) in enumerate(zip(comp_d["cold"]["stock"], comp_d["cold"]["sharded"]))
                ]
                lines.append(f"- {comp}: " + "; ".join(cells))
    if doc.get("projection"):
        lines += [
            "",
            "| model, tp | machine | stock: rank CPU s, node GiB read, s | sharded: rank CPU s, node GiB read, s "
            "| stock ÷ sharded |",
            "|---|---|---:|---:|---:|",
        ]
        for r in doc["projection"]:
            st, sh = r["stock"], r["sharded"]
            lines.append(
                f"| V4-{r['model'].title()}, tp {r['tp']}{' ep' if r['ep'] else ''} | {r['machine']} "
                f"| {st['rank_cpu_s']} / "
                f"{st['node_disk_gib']} / {st['seconds']} | {sh['rank_cpu_s']} / {sh['node_disk_gib']} / "
                f"{sh['seconds']} | {r['ratio']} × |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="the fp4 test fixture at tp 4 (checks the bench in minutes)")
    p.add_argument("--layers", type=int, default=1, help="main layers of the full-width skeleton (default 1)")
    p.add_argument(
        "--releases",
        default="0.33.0,0.34.0",
        help="vLLM releases under .engine-site, each optionally with its own cases: 0.34.0:tp8+tp8-ep,0.33.0:tp8",
    )
    p.add_argument("--cases", default=None, help="tp8,tp8-ep (default; --small: tp4,tp4-ep)")
    p.add_argument("--components", default="model,mtp")
    p.add_argument("--project", action=argparse.BooleanOptionalAction, default=None, help="default: not with --small")
    p.add_argument("--workdir", type=Path, default=None, help="default: a fresh /work/bench-load-* (removed)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--src", type=Path, help="an existing skeleton (make_skeleton.py --layers K), kept")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--from-json", type=Path, help="no loads: the projection and tables from an earlier --json")
    args = p.parse_args(argv)
    cases = (args.cases or ("tp4,tp4-ep" if args.small else "tp8,tp8-ep")).split(",")
    components = args.components.split(",")
    project_too = (not args.small) if args.project is None else args.project
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        with tempfile.TemporaryDirectory(prefix="bench-load-", dir="/work") as tmp:
            doc["disk_gib_s"] = disk_rate(doc)
            doc["fits"] = fit_costs(doc)
            doc["projection"] = project(doc, Path(tmp))
        return finish(doc, args)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-load-", dir="/work"))
    work.mkdir(parents=True, exist_ok=True)
    from ckpt_tool.mapping.profiles import verified_releases

    profiles = dict(verified_releases())
    t_start = time.perf_counter()
    doc: dict = {"small": args.small, "layers": None if args.small else args.layers, "releases": {}}
    try:
        src = args.src or make_source(work, args.small, args.layers)
        config = json.loads((src / "config.json").read_text())
        doc["source_bytes"] = folder_bytes(src)
        print(f"source {src}: {fmt_b(doc['source_bytes'])}", flush=True)
        outs: dict[tuple, tuple[Path, dict]] = {}
        for item in args.releases.split(","):
            rel, _, own_cases = item.partition(":")
            profile = profiles[rel]
            worker = Worker(SITES / f"vllm-{rel}", work / f"worker-{rel}.log")
            rd = doc["releases"][rel] = {"profile": profile, "cases": {}}
            try:
                for case in own_cases.split("+") if own_cases else cases:
                    m = re.fullmatch(r"tp(\d+)(-ep)?", case)
                    tp, ep = int(m[1]), bool(m[2])
                    key = (profile, tp, ep)
                    if key not in outs:
                        out = work / f"out-{case}-{profile}"
                        outs[key] = (out, convert(src, out, tp, ep, profile))
                    out, conv = outs[key]
                    setting = {
                        "tp": tp,
                        "ep": ep,
                        "src": src,
                        "out": out,
                        "layers": config["num_hidden_layers"],
                        "manifest": json.loads((out / "ckpt-tool.json").read_text()),
                        "record_check": args.small,
                    }
                    print(f"vLLM {rel} {case}: OUT {fmt_b(folder_bytes(out))}, convert {conv['seconds']} s", flush=True)
                    cd = rd["cases"][case] = {"convert": conv, "out_bytes": folder_bytes(out), "components": {}}
                    target = None
                    for comp in components:
                        res = run_component(worker, setting, comp, target, log=lambda s: print(s, flush=True))
                        stock_raw = res.pop("_stock")
                        if comp == "model":
                            target = stock_raw
                        cd["components"][comp] = res
                    if args.json:  # what is measured so far survives a run cut short
                        args.json.write_text(json.dumps(doc, indent=1) + "\n")
            finally:
                rd["worker_restarts"] = worker.restarts
                worker.close()
        doc["disk_gib_s"] = disk_rate(doc)
        doc["seconds"] = round(time.perf_counter() - t_start, 1)
        if args.json:  # the measurements are kept before the projection (--from-json redoes it)
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
        if project_too:
            doc["fits"] = fit_costs(doc)
            doc["projection"] = project(doc, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return finish(doc, args)


def finish(doc: dict, args) -> int:
    text = markdown(doc)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"serve_load_bench: FAILED: {e}", file=sys.stderr)
        sys.exit(1)
