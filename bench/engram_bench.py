"""DeepSeek V4.1 Engram tables at their real row width: convert against dd, and peak RSS against table size.

    python bench/engram_bench.py                         # 2 tables of ~3 GiB; 3 rounds; RSS again at 2x; ~6 min
    python bench/engram_bench.py --gib 1 --rounds 1      # quick look (~1.5 min)
    python bench/engram_bench.py --tp 1,2,4 --json engram.json --workdir /big/disk
    python bench/engram_bench.py --width full --tp 1,8   # a full-width V4.1 layer with its Engram table (~10 min)

The checkpoint is the ``v41`` fixture of ``ckpt_tool/fixtures/make.py`` (DeepseekV41ForCausalLM: 4 main layers,
hidden 256, DSpark stages, vision tower; Engram tables on layers 1 and 2, 2-grams and 3-grams x 5 heads = 10 hash
heads) with V4.1-Flash's Engram row: ``engram_head_dim`` 256, a table row of 256 F8_E4M3 bytes and 8 F8_E8M0
per-row scales (V4.1-Flash: [384,006,168, 256] + [384,006,168, 8] per Engram layer, ~101 GB). Only the row count
is scaled down: ``engram_vocab_size`` is chosen so that each table holds ``--gib`` GiB. The config and every
tensor but the two tables come from make.py (its module constants overridden in this process; the prime search
uses ckpt-tool's Miller-Rabin, so ``engram_num_embeddings`` is the sum of the bucket primes as vLLM computes them,
and the Engram ``wkv`` takes n_hash_cols * 256 inputs); the tables are streamed to disk in 32 MiB chunks of a
cheap deterministic pattern (a seeded random block per tensor read at a shifting offset; E4M3 without the NaN
codes 0x7F/0xFF, E8M0 scales in 0x70..0x8F, never the NaN 0xFF that convert rejects), never whole in memory.

``--width full`` makes the one layer around the table full width instead: hidden 5120 (V4.1-Flash's reported
``hidden_size``) with V4-Flash's other widths (bench/make_skeleton.py: 64 heads of 512, q_lora 1024, 8 o_groups of
1024, 256 MXFP4 routed experts of 2048, an indexer of 64 x 128), MXFP8 linears with 32x32 scales, the layer a kv
and index source with a ratio-2 compressor, V4.1-Flash's Engram shape (24 hash heads: max n-gram 4 x 8 heads, so
tp 8 is accepted; ``wkv`` [25600, 6144]) on it, one DSpark stage with 4 experts, the fixture's small vocab and
vision tower. Every tensor, not only the tables, is then streamed from the byte patterns (valid FP8 and E8M0 codes;
convert copies bytes, no value is computed), and the shard holding the layer is ~4.3 GiB + the table.

In one process, ``--rounds`` rounds (the order rotated each round), each command a subprocess timed by
bench/timing.py from a cold page cache (``sync``, then ``posix_fadvise(DONTNEED)`` on every file of the
source; ``--drop-caches global`` writes 3 to /proc/sys/vm/drop_caches instead, where allowed):

- ``dd bs=64M conv=fsync`` of every source shard into the output folder (buffered writes, one fsync per file);
- ``dd bs=64M oflag=direct conv=fsync`` the same, writing past the page cache as ckpt-tool's writer does;
- ``ckpt-tool convert SRC OUT --tp T --only model --force`` for each ``--tp`` (default 1 and 4; a tp the hash
  heads do not split as vLLM requires is refused before the run).

Reported: bytes read and written, seconds, GiB/s, s/GiB against each dd of the same round, peak RSS, CPU
seconds, bytes read from the disk (the block reads: show the cache was cold). After every convert the output headers are
read: each rank's ``engram.embed_tokens.weight`` / ``.weight_scale_inv`` must hold exactly the rows
``EngramSplit.rank_rows`` gives it, and its first and last rows must be the source's bytes. Then the source is
rebuilt with tables twice as large (``--flat-factor``) and each convert runs once more: peak RSS must not grow
with the table (the writer streams it through a fixed ring of buffers). The projection to V4.1-Flash's two
tables uses the measured s/GiB. Every file goes under a fresh folder (``--workdir``, default /tmp), removed at
the end, on failure and on SIGTERM too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import timing  # noqa: E402

from ckpt_tool.checkpoint import engram  # noqa: E402
from ckpt_tool.checkpoint.config import V4Config  # noqa: E402
from ckpt_tool.checkpoint.headers import expected_nbytes  # noqa: E402

GiB = 1024**3
MiB = 1024**2
CHUNK = 32 * MiB  # bytes per write of a table
SHIFT = 1 * MiB  # the pattern block is CHUNK + SHIFT bytes; chunk i starts at (i * 4099) % SHIFT
HEAD_DIM = 256  # V4.1-Flash's engram_head_dim
ROW_BYTES = HEAD_DIM + HEAD_DIM // 32  # F8_E4M3 row + its F8_E8M0 per-32 scales
FLASH_ROWS = 384_006_168  # V4.1-Flash: rows of each Engram table
FLASH_TABLES = 2
TABLE_KINDS = ("engram", "engram_scale")
# --width full: make.py's V4.1 constants for one full-width layer (see the module docstring)
FULL_WIDTH = {
    "V41_HIDDEN": 5120,
    "V41_LAYERS": 1,
    "V41_HEADS": 64,
    "V41_Q_LORA": 1024,
    "V41_O_GROUPS": 8,
    "V41_O_LORA": 1024,
    "V41_INDEX_HEADS": 64,
    "V41_INDEX_HEAD_DIM": 128,
    "V41_EXPERTS": 256,
    "V41_TOPK": 6,
    "V41_MOE_INTER": 2048,
    "V41_COMPRESS_RATIOS": [2],
    "V41_KV_SOURCES": [0],
    "V41_INDEX_SOURCES": [0],
    "V41_ENGRAM_LAYERS": [0],
    "V41_ENGRAM_MAX_NGRAM": 4,
    "V41_ENGRAM_HEADS": 8,
    "V41_STAGES": 1,
    "V41_DSPARK_EXPERTS": 4,
    "V41_DSPARK_TARGET_LAYERS": [0],
}


# ---------------------------------------------------------------------------------------------
# The checkpoint


def _make():
    """ckpt_tool.fixtures.make, imported on first use (it imports torch)."""
    from ckpt_tool.fixtures import make

    return make


def configure(vocab: int):
    """Override make.py's V4.1 Engram constants for ``vocab`` (restore with the returned dict)."""
    make = _make()
    saved = {k: getattr(make, k) for k in ("V41_ENGRAM_HEAD_DIM", "V41_ENGRAM_VOCAB", "_is_prime")}
    make.V41_ENGRAM_HEAD_DIM = HEAD_DIM
    make.V41_ENGRAM_VOCAB = vocab
    make._is_prime = engram.is_prime  # trial division walks ~sqrt(n) a candidate; the same answers
    return saved


def use_full_width() -> None:
    """Switch make.py's V4.1 dimensions to one full-width layer for the rest of this process."""
    make = _make()
    for k, v in FULL_WIDTH.items():
        setattr(make, k, v)


def full_width_shard_plan(make, variant) -> list[list]:
    """embed + the full-width layer (its Engram table inside), then the stage, norm and head, then the tower."""
    first = [make.Spec("embed.weight", "BF16", (make.VOCAB, make.V41_HIDDEN), "embed")]
    first += make.v41_block_specs("layers.0", 0, variant)
    second = make.v41_stage_specs(0, variant) + [
        make.Spec("norm.weight", "BF16", (make.V41_HIDDEN,), "norm"),
        make.Spec("head.weight", "BF16", (make.VOCAB, make.V41_HIDDEN), "dense", make.V41_HIDDEN),
    ]
    return [first, second, make.v41_vision_specs()]


def restore(saved: dict) -> None:
    make = _make()
    for k, v in saved.items():
        setattr(make, k, v)


def hash_heads() -> int:
    make = _make()
    return (make.V41_ENGRAM_MAX_NGRAM - 1) * make.V41_ENGRAM_HEADS


def vocab_for(gib_per_table: float) -> int:
    """engram_vocab_size whose table (n_hash_cols prime buckets just above it) holds ~``gib_per_table`` GiB."""
    return max(64, int(gib_per_table * GiB / ROW_BYTES / hash_heads()))


_PATTERNS: dict[tuple[str, int], np.ndarray] = {}


def _pattern(dtype: str, seed: int) -> np.ndarray:
    """CHUNK + SHIFT valid bytes of ``dtype`` (one block a dtype, each tensor read from it at its own offsets): E4M3
    with no NaN code (0x7F/0xFF), E8M0 scales in 0x70..0x8F (2^-15 .. 2^16, never NaN), other dtypes any byte."""
    if (dtype, seed) not in _PATTERNS:
        rng = np.random.default_rng(seed ^ zlib.crc32(dtype.encode()))
        if dtype == "F8_E8M0":
            b = rng.integers(0x70, 0x90, CHUNK + SHIFT, dtype=np.uint8)
        else:
            b = rng.integers(0, 256, CHUNK + SHIFT, dtype=np.uint8)
            if dtype == "F8_E4M3":
                b[(b & 0x7F) == 0x7F] ^= 1
        _PATTERNS[(dtype, seed)] = b
    return _PATTERNS[(dtype, seed)]


def stream_table(fh, name: str, dtype: str, nbytes: int, seed: int) -> None:
    """Write ``nbytes`` of the pattern for ``name`` in CHUNK pieces (never the tensor in memory)."""
    block = memoryview(_pattern(dtype, seed))
    i = zlib.crc32(name.encode()) % 4096  # where this tensor starts in the pattern's walk
    done = 0
    while done < nbytes:
        n = min(CHUNK, nbytes - done)
        at = (i * 4099) % SHIFT
        fh.write(block[at : at + n])
        done += n
        i += 1


_SMALL: dict = {}  # (Spec, seed) -> bytes of every tensor but the tables


def write_checkpoint(dst: Path, vocab: int, seed: int, log, *, full_width: bool = False) -> dict:
    """The v41 fixture with 256-wide Engram rows and ``vocab`` buckets a head, into ``dst`` (``full_width``: the
    one-layer full-width checkpoint, every tensor streamed). Returns its figures."""
    import torch

    make = _make()
    saved = configure(vocab)
    try:
        variant = make.VARIANTS["v41"]
        config = make.v41_config(variant)
        groups = full_width_shard_plan(make, variant) if full_width else make.v41_shard_plan(variant)
    finally:
        restore(saved)
    streamed = {s.name for g in groups for s in g if full_width or s.kind in TABLE_KINDS}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, text in make.serving_files().items():
        (dst / name).write_text(text)
    # ckpt-tool's own reading of that config must agree with make.py's sums of primes
    layout = engram.EngramSplit.from_config(V4Config.load(dst / "config.json"))
    got = [sum(s) for s in layout.head_sizes]
    if got != config["text_config"]["engram_num_embeddings"]:
        raise SystemExit(f"engram_num_embeddings {config['text_config']['engram_num_embeddings']} != EngramSplit {got}")
    n = len(groups)
    weight_map: dict[str, str] = {}
    total = table_bytes = 0
    for k, specs in enumerate(groups, start=1):
        file = f"model-{k:05d}-of-{n:05d}.safetensors"
        small = [s for s in specs if s.name not in streamed and (s, seed) not in _SMALL]
        if small:  # everything but the tables is the same at every table size: made once
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as make_checkpoint does: small tensors, one thread is faster
            try:
                for name, t in make.generate_tensors(small, variant, seed).items():
                    _SMALL[(next(s for s in small if s.name == name), seed)] = make.tensor_bytes(t)
            finally:
                torch.set_num_threads(threads)
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for s in specs:
            nb = expected_nbytes(s.dtype, s.shape)
            header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + nb]}
            offset += nb
            weight_map[s.name] = file
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((8 - len(raw) % 8) % 8)
        with open(dst / file, "wb", buffering=0) as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            for s in specs:
                nb = expected_nbytes(s.dtype, s.shape)
                if s.name in streamed:
                    stream_table(fh, s.name, s.dtype, nb, seed)
                    table_bytes += nb if s.kind in TABLE_KINDS else 0
                else:
                    data = _SMALL[(s, seed)]
                    assert len(data) == nb, s.name
                    fh.write(data)
            os.fsync(fh.fileno())
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tc = config["text_config"]
    return {
        "engram_vocab_size": vocab,
        "engram_head_dim": tc["engram_head_dim"],
        "engram_num_embeddings": tc["engram_num_embeddings"],
        "hash_heads": layout.hash_heads,
        "table_bytes": table_bytes,
        "tensor_bytes": total,
        "file_bytes": safetensors_bytes(dst),
    }


# ---------------------------------------------------------------------------------------------
# Measuring


def safetensors_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.safetensors") if p.is_file())


def drop_cache(folders: list[Path], mode: str) -> None:
    """Out of the page cache: every file under ``folders`` (fadvise), or everything (global)."""
    if mode == "global":
        timing.drop_caches(*folders)
    else:
        subprocess.run(["sync"], check=False)
        timing.evict(*folders)


def timed(cmd: list[str], label: str, cold: list[Path], mode: str, log) -> dict:
    """Wall and CPU seconds, peak RSS, disk reads/writes of ``cmd``, started with ``cold`` out of the page cache."""
    drop_cache(cold, mode)
    t = timing.run_timed(cmd, cwd=REPO)
    if t.rc != 0:
        raise SystemExit(f"{label}: {t.cmd} exited {t.rc}\n{t.stderr[-3000:]}{t.stdout[-2000:]}")
    row = {
        "label": label,
        "cmd": t.cmd,
        "seconds": t.seconds,
        "cpu_seconds": t.cpu_seconds,
        "user_seconds": t.user_seconds,
        "sys_seconds": t.sys_seconds,
        "peak_rss_mib": t.peak_rss_mib,
        "disk_read_gib": t.disk_read_bytes / GiB,
        "disk_write_gib": t.disk_write_bytes / GiB,
        "stdout": t.stdout,
    }
    log(
        f"  {label:22s} {t.seconds:7.2f} s  CPU {t.user_seconds:5.1f} user + {t.sys_seconds:5.1f} sys s  "
        f"peak RSS {t.peak_rss_mib:7.1f} MiB  "
        f"read {row['disk_read_gib']:5.2f} GiB from disk"
    )
    return row


def read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n)), 8 + n


def source_tensors(src: Path) -> dict[str, tuple[Path, int, dict]]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        header, base = read_header(f)
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = (f, base, meta)
    return out


ENGRAM_OUT = re.compile(r"layers\.(\d+)\.engram\.embed_tokens\.(weight|weight_scale_inv)$")
RANK_FILE = re.compile(r"model-rank-(\d+)-part-\d+\.safetensors$")


def check_rank_rows(out: Path, src: Path, tp: int) -> dict:
    """Each rank's Engram rows (weight and scale) against EngramSplit.rank_rows, and its first and last rows
    against the source's bytes. Raises SystemExit on a mismatch."""
    layout = engram.EngramSplit.from_config(V4Config.load(src / "config.json"))
    srcs = source_tensors(src)
    found: dict[tuple[int, str, int], int] = {}
    for f in sorted(out.rglob("*.safetensors")):
        m = RANK_FILE.search(f.name)
        if not m:
            continue
        rank = int(m.group(1))
        header, base = read_header(f)
        for name, meta in header.items():
            e = ENGRAM_OUT.search(name)
            if not e:
                continue
            layer, kind = int(e.group(1)), e.group(2)
            rows, width = meta["shape"][0], meta["shape"][1]
            sname = f"layers.{layer}.engram.embed.{'weight' if kind == 'weight' else 'scale'}"
            sfile, sbase, smeta = srcs[sname]
            lo, hi = layout.rank_rows(layer, tp)[rank]
            if (rows, width) != (hi - lo, smeta["shape"][1]):
                raise SystemExit(
                    f"{f}: {name} is {meta['shape']}, EngramSplit says rows {lo}..{hi} of {smeta['shape']}"
                )
            row_bytes = width  # 1-byte dtypes
            with open(f, "rb") as a, open(sfile, "rb") as b:
                for r in (0, rows - 1):
                    a.seek(base + meta["data_offsets"][0] + r * row_bytes)
                    b.seek(sbase + smeta["data_offsets"][0] + (lo + r) * row_bytes)
                    if a.read(row_bytes) != b.read(row_bytes):
                        raise SystemExit(f"{f}: {name} row {r} differs from source row {lo + r}")
            found[(layer, kind, rank)] = rows
    want = {(layer, k, r) for layer in layout.layer_ids for k in ("weight", "weight_scale_inv") for r in range(tp)}
    if set(found) != want:
        raise SystemExit(f"{out}: Engram tensors found for {sorted(found)}, expected {sorted(want)}")
    return {str(layer): [found[(layer, "weight", r)] for r in range(tp)] for layer in layout.layer_ids}


# ---------------------------------------------------------------------------------------------
# The run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=3.0, help="GiB of each of the two Engram tables (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of dd / dd direct / convert per tp (default 3)")
    ap.add_argument("--tp", default="1,4", help="comma-separated tp sizes to convert for (default 1,4)")
    ap.add_argument("--flat-factor", type=float, default=2.0, help="table size of the RSS check, x --gib (default 2)")
    ap.add_argument("--no-flat", action="store_true", help="skip the larger-table RSS runs")
    ap.add_argument("--workers", type=int, help="convert --workers (default: the tool's own)")
    ap.add_argument("--drop-caches", choices=("fadvise", "global"), default="fadvise", help="how to cold-start")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"), help="a fresh folder is made (and removed) in it")
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument(
        "--width",
        choices=("fixture", "full"),
        default="fixture",
        help="the model around the tables: the v41 fixture's (default) or one full-width V4.1 layer",
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    tps = [int(t) for t in args.tp.split(",") if t.strip()]
    log = lambda m: print(m, flush=True)  # noqa: E731
    full = args.width == "full"
    if full:
        use_full_width()

    probe = engram.EngramSplit(layer_ids=(0,), num_embeddings=(0,), head_sizes=((1,) * hash_heads(),))
    refused = [t for t in tps if not probe.accepts(t)]
    if refused:
        ap.error(f"--tp {refused}: {hash_heads()} hash heads; vLLM accepts {probe.accepted_tps(16)}")
    tables = 1 if full else 2
    layer = 4.5 if full else 0.0  # GiB of the full-width layer, source and OUT each
    need = (2.1 * tables * args.gib * max(1.0, 0 if args.no_flat else args.flat_factor) + 2 * layer) * GiB
    args.workdir.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(args.workdir)
    if st.f_bavail * st.f_frsize < need:
        raise SystemExit(f"{args.workdir}: {st.f_bavail * st.f_frsize / GiB:.1f} GiB free, need ~{need / GiB:.0f} GiB")

    work = Path(tempfile.mkdtemp(prefix="engram-bench-", dir=args.workdir))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    started = time.perf_counter()
    py = sys.executable
    wflag = ["--workers", str(args.workers)] if args.workers else []
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {
            "cpus": os.cpu_count(),
            "mem_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GiB, 1),
            "load_at_start": os.getloadavg()[0],
        },
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    try:
        log(f"scratch: {work}")
        src, out = work / "src", work / "out"

        def build(vocab: int, label: str) -> dict:
            t = time.perf_counter()
            info = write_checkpoint(src, vocab, args.seed, log, full_width=full)
            info["seconds"] = time.perf_counter() - t
            log(
                f"{label}: engram_vocab_size {vocab}, tables {info['engram_num_embeddings']} rows x {HEAD_DIM} "
                f"(+ {HEAD_DIM // 32} scales), {info['table_bytes'] / GiB:.2f} GiB of tables, "
                f"{info['file_bytes'] / GiB:.2f} GiB in shards, written in {info['seconds']:.1f} s"
            )
            return info

        def commands() -> list[tuple[str, list[str]]]:
            def dd(flags: str) -> list[str]:
                return [
                    "sh",
                    "-c",
                    f"mkdir -p '{out}' && for f in '{src}'/*.safetensors; do "
                    f'dd if="$f" of=\'{out}\'/"${{f##*/}}" bs=64M {flags}conv=fsync status=none || exit 1; done',
                ]

            cmds = [("dd", dd("")), ("dd oflag=direct", dd("oflag=direct "))]
            for t in tps:
                cmds.append(
                    (
                        f"convert tp{t}",
                        [py, "-m", "ckpt_tool", "convert", str(src), str(out), "--tp", str(t)]
                        + ["--only", "model", "--force", "--json", *wflag],
                    )
                )
            return cmds

        def run_one(label: str, cmd: list[str]) -> dict:
            shutil.rmtree(out, ignore_errors=True)
            r = timed(cmd, label, [src], args.drop_caches, log)
            r["bytes_written"] = safetensors_bytes(out)
            r["bytes_read"] = res["checkpoint"]["file_bytes"]
            if label.startswith("convert"):
                doc = json.loads(r["stdout"])
                if not doc.get("ok"):
                    raise SystemExit(f"{label}: {doc.get('error')}")
                r["rank_rows"] = check_rank_rows(out, src, int(label.removeprefix("convert tp")))
                r["bytes_read"] = doc.get("total_bytes") or r["bytes_read"]
            r.pop("stdout", None)
            shutil.rmtree(out, ignore_errors=True)
            return r

        res["checkpoint"] = build(vocab_for(args.gib), "checkpoint")
        rows: list[dict] = []
        cmds = commands()
        for rnd in range(args.rounds):
            log(f"round {rnd + 1}")
            order = cmds[rnd % len(cmds) :] + cmds[: rnd % len(cmds)]
            for label, cmd in order:
                rows.append({"round": rnd + 1, **run_one(label, cmd)})
        res["runs"] = rows

        if not args.no_flat:
            shutil.rmtree(src, ignore_errors=True)
            res["checkpoint_large"] = build(vocab_for(args.gib * args.flat_factor), "larger checkpoint")
            res["checkpoint_large"]["runs"] = [run_one(label, cmd) for label, cmd in commands() if "convert" in label]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        log(f"removed {work}")
    res["bench_seconds"] = time.perf_counter() - started
    report(res, tps, log)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def report(res: dict, tps: list[int], log) -> None:
    ck = res["checkpoint"]
    rows = res["runs"]
    for r in rows:
        r["gib_written"] = r["bytes_written"] / GiB
        r["s_per_gib"] = r["seconds"] / r["gib_written"]
    by_round = {}
    for r in rows:
        by_round.setdefault(r["round"], {})[r["label"]] = r
    for r in rows:
        base = by_round[r["round"]]
        r["x_dd"] = r["s_per_gib"] / base["dd"]["s_per_gib"]
        r["x_dd_direct"] = r["s_per_gib"] / base["dd oflag=direct"]["s_per_gib"]
    m = res["machine"]
    log(
        f"\n{res['date']}, {m['cpus']} CPUs, {m['mem_gib']} GiB RAM, load {m['load_at_start']:.1f} at start; "
        f"checkpoint ({res['options']['width']} width) {ck['file_bytes'] / GiB:.2f} GiB: "
        f"{len(ck['engram_num_embeddings'])} Engram table(s) of {ck['engram_num_embeddings']} rows x "
        f"{ck['engram_head_dim']} F8_E4M3 + {ck['engram_head_dim'] // 32} F8_E8M0 ({ck['table_bytes'] / GiB:.2f} "
        f"GiB), engram_vocab_size {ck['engram_vocab_size']}, {ck['hash_heads']} hash heads; "
        f"{len(by_round)} rounds, each command from a cold page cache\n"
    )
    log(
        "| round | command | GiB written | seconds | GiB/s | s/GiB ÷ dd | s/GiB ÷ dd direct | peak RSS "
        "| CPU s, user + sys | read from disk |"
    )
    log("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["round"], r["label"])):
        log(
            f"| {r['round']} | {r['label']} | {r['gib_written']:.2f} | {r['seconds']:.2f} | "
            f"{r['gib_written'] / r['seconds']:.2f} | {r['x_dd']:.2f} | {r['x_dd_direct']:.2f} | "
            f"{r['peak_rss_mib']:.0f} MiB | {r['user_seconds']:.1f} + {r['sys_seconds']:.1f} | "
            f"{r['disk_read_gib']:.2f} GiB |"
        )
    labels = list(dict.fromkeys(r["label"] for r in rows))
    summary = {}
    log(
        "\n| command | seconds, median (min–max) | GiB/s, median | s/GiB | ÷ dd, median (min–max) "
        "| ÷ dd direct, median (min–max) | peak RSS (max) |"
    )
    log("|---|---:|---:|---:|---:|---:|---:|")
    for label in labels:
        rs = [r for r in rows if r["label"] == label]
        secs = [r["seconds"] for r in rs]
        s = {
            "seconds": statistics.median(secs),
            "all_seconds": [round(x, 2) for x in secs],
            "gib_s": statistics.median(r["gib_written"] / r["seconds"] for r in rs),
            "s_per_gib": statistics.median(r["s_per_gib"] for r in rs),
            "x_dd": statistics.median(r["x_dd"] for r in rs),
            "x_dd_all": [round(r["x_dd"], 2) for r in rs],
            "x_dd_direct": statistics.median(r["x_dd_direct"] for r in rs),
            "x_dd_direct_all": [round(r["x_dd_direct"], 2) for r in rs],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
        }
        summary[label] = s
        log(
            f"| {label} | {s['seconds']:.2f} ({spread(secs)}) | {s['gib_s']:.2f} | {s['s_per_gib']:.2f} | "
            f"{s['x_dd']:.2f} ({spread([r['x_dd'] for r in rs])}) | "
            f"{s['x_dd_direct']:.2f} ({spread([r['x_dd_direct'] for r in rs])}) | {s['peak_rss_mib']:.0f} MiB |"
        )
    res["summary"] = summary
    for t in tps:
        rr = next(r["rank_rows"] for r in rows if r["label"] == f"convert tp{t}")
        log(f"tp {t}: Engram rows a rank, per layer (= EngramSplit.rank_rows, first/last rows = source): {rr}")

    large = res.get("checkpoint_large")
    if large:
        log(
            f"\npeak RSS against table size ({ck['table_bytes'] / GiB:.2f} GiB of tables vs "
            f"{large['table_bytes'] / GiB:.2f} GiB):"
        )
        flat = {}
        for r in large["runs"]:
            small = summary[r["label"]]
            rss_small = [x["peak_rss_mib"] for x in rows if x["label"] == r["label"]]
            d = r["peak_rss_mib"] / statistics.median(rss_small) - 1
            flat[r["label"]] = {
                "rss_mib": r["peak_rss_mib"],
                "rss_mib_small": rss_small,
                "change": d,
                "seconds": r["seconds"],
                "s_per_gib": r["seconds"] / (r["bytes_written"] / GiB),
                "s_per_gib_small": small["s_per_gib"],
            }
            log(
                f"  {r['label']}: {spread(rss_small)} MiB at 1x, {r['peak_rss_mib']:.0f} MiB at "
                f"{large['table_bytes'] / ck['table_bytes']:.1f}x ({100 * d:+.1f} % against the median); "
                f"{flat[r['label']]['s_per_gib']:.2f} s/GiB at the larger size, {small['s_per_gib']:.2f} at 1x"
            )
        res["flatness"] = flat

    # projection: V4.1-Flash's two tables at the measured s/GiB (this machine's disk)
    flash_gib = FLASH_TABLES * FLASH_ROWS * ROW_BYTES / GiB
    proj = {label: s["s_per_gib"] * flash_gib for label, s in summary.items()}
    res["projection"] = {"flash_tables_gib": flash_gib, "seconds": proj}
    log(
        f"\nprojection: V4.1-Flash's {FLASH_TABLES} tables ({FLASH_ROWS:,} rows x {ROW_BYTES} bytes each, "
        f"{flash_gib:.1f} GiB) at the median s/GiB above: "
        + ", ".join(f"{label} {s / 60:.1f} min" for label, s in proj.items())
    )
    log(f"bench took {res['bench_seconds'] / 60:.1f} min")


if __name__ == "__main__":
    raise SystemExit(main())
