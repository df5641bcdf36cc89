"""The OUT format, in one place: what a conversion leaves in OUT and how to read it back (the name of each rank's
safetensors files is the plan's: ``OutFile.name`` in :mod:`ckpt_tool.mapping.plan`).

    OUT/
      model/  model-rank-{r}-part-{p}.safetensors, index.json, config.json (+ the source's serving files)
      mtp/    the same for a classic MTP draft (model.layers.{N+i}.*), or
      dspark/ the same for a DSpark draft (model.layers.{i}.*, main_proj, the heads); vLLM detects DSpark by "dspark"
              in the draft's path when the speculative config names no method
      ckpt-tool.json          the manifest, written last with "complete": true
      ckpt-tool-source.json   the source's raw safetensors headers (unconvert rebuilds the source from OUT alone)
      .ckpt-tool-journal[-K-of-M].json, .ckpt-tool[-K-of-M].lock   while a conversion runs

The manifest records the tool version, options, profile and target (the vLLM releases the profile is
verified against, the vLLM installed at convert time and whether the profile is verified for it), the
source's fingerprint (shard sizes and header hashes, config hash; for a local source ``identity``: each file's
size, mtime_ns, inode and device when converted), every output file's size and sha256,
materialized tensors and deviations. ``index.json`` is ``{"tp", "ranks": {rank: {tensor: file}}, "total_size"}``.
convert writes this format (:mod:`ckpt_tool.output.convert`); verify, unconvert and the hub input read it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
from pathlib import Path

from ckpt_tool import __version__
from ckpt_tool.checkpoint.source import Checkpoint
from ckpt_tool.errors import OutputError
from ckpt_tool.mapping import target as engine_target
from ckpt_tool.mapping.plan import Options, Plan
from ckpt_tool.mapping.profiles import DRAFT_COMPONENTS, get_profile

MANIFEST = "ckpt-tool.json"
SOURCE_LAYOUT = "ckpt-tool-source.json"
JOURNAL = ".ckpt-tool-journal.json"
LOCK = ".ckpt-tool.lock"
COMPONENTS = ("model", *DRAFT_COMPONENTS)  # the folders of OUT: the target, then each draft kind's
JOURNAL_RE = re.compile(r"^\.ckpt-tool-journal(?:-\d+-of-\d+)?\.json$")
SHARD_LOCK_RE = re.compile(r"^\.ckpt-tool-\d+-of-\d+\.lock$")


def journal_name(shard: tuple[int, int] | None) -> str:
    if shard is None or shard[1] == 1:
        return JOURNAL
    return f".ckpt-tool-journal-{shard[0]}-of-{shard[1]}.json"


def lock_name(shard: tuple[int, int] | None) -> str:
    if shard is None or shard[1] == 1:
        return LOCK
    return f".ckpt-tool-{shard[0]}-of-{shard[1]}.lock"


def source_fingerprint(ckpt: Checkpoint) -> dict:
    files = {f: {"size": h.file_size, "header_sha256": h.header_sha256} for f, h in sorted(ckpt.shards.items())}
    cfg = (ckpt.root / "config.json").read_bytes()
    doc = {"root": str(ckpt.root), "files": files, "config_sha256": hashlib.sha256(cfg).hexdigest()}
    if ckpt.remote is not None:  # a streamed hub source: its bytes are the commit's (a resume of another is refused)
        doc["commit"] = ckpt.remote.commit
    return doc


def run_fingerprint(source: dict, opts: Options) -> str:
    doc = {"tool": __version__, "files": source["files"], "config": source["config_sha256"], "options": opts.as_dict()}
    if "commit" in source:
        doc["commit"] = source["commit"]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def source_layout(ckpt: Checkpoint) -> dict:
    """The source's raw safetensors headers, per shard: with config.json (copied into OUT) enough to
    re-plan the conversion and rebuild every source file (``unconvert``) without the source."""
    files = {}
    for name, h in sorted(ckpt.shards.items()):
        if ckpt.remote is not None:
            raw = ckpt.remote.header_bytes(name)
        else:
            with open(ckpt.root / name, "rb") as fh:
                fh.seek(8)
                raw = fh.read(h.header_len)
        if hashlib.sha256(raw).hexdigest() != h.header_sha256:
            raise OutputError(f"{name}: header changed while converting; rerun")
        files[name] = {"size": h.file_size, "header": raw.decode("utf-8")}
    index_text = None
    if ckpt.index_file and (ckpt.root / ckpt.index_file).is_file():
        index_text = (ckpt.root / ckpt.index_file).read_text(encoding="utf-8")
    return {"format": 1, "index_file": ckpt.index_file, "index": index_text, "files": files}


class OutputLock:
    """Locks on OUT so two converts never interleave their writes.

    A plain convert and ``--finalize`` hold ``.ckpt-tool.lock`` exclusively. A ``--shard-index`` run
    holds it shared (other shards may run beside it, a plain convert may not) plus its own shard
    lock exclusively (the same shard cannot run twice).
    """

    def __init__(self, out: Path, name: str = LOCK) -> None:
        self.out = out
        self.locks = [(LOCK, fcntl.LOCK_EX)] if name == LOCK else [(LOCK, fcntl.LOCK_SH), (name, fcntl.LOCK_EX)]
        self.path = out / self.locks[-1][0]
        self.handles: list = []

    def __enter__(self) -> OutputLock:
        for name, mode in self.locks:
            fh = open(self.out / name, "a+")
            try:
                fcntl.flock(fh.fileno(), mode | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                self.__exit__()
                raise OutputError(
                    f"{self.out}: another ckpt-tool convert is writing this folder (lock {name} is held); wait for it "
                    "to finish"
                ) from None
            self.handles.append(fh)
        return self

    def __exit__(self, *exc: object) -> None:
        for fh in reversed(self.handles):
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            fh.close()
        self.handles.clear()


def read_manifest(out: Path) -> dict | None:
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def options_from_manifest(manifest: dict) -> Options:
    o = manifest.get("options") or {}
    return Options(
        tp=int(o.get("tp", 1)),
        moe_parallel=str(o.get("moe_parallel", "tp")),
        only=o.get("only"),
        max_shard_size=int(o.get("max_shard_size", 5 * 1024**3)),
        profile=str(o.get("profile", manifest.get("profile", "vllm-seed"))),  # an earlier name resolves in Options
        vllm_series=o.get("vllm_series"),
        nvfp4_input_scales=o.get("nvfp4_input_scales"),
    )


def journals(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if JOURNAL_RE.match(p.name)) if out.is_dir() else []


def index_doc(plan: Plan, component: str) -> dict:
    ranks: dict[str, dict[str, str]] = {}
    total = 0
    for f in plan.files:
        if f.component != component:
            continue
        ranks.setdefault(str(f.rank), {})
        for t in f.tensors:
            ranks[str(f.rank)][t.name] = f.name
            total += t.nbytes
    return {"tp": plan.options.tp, "ranks": ranks, "total_size": total}


def read_journal(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a torn journal: start over, files get rewritten
    return doc if isinstance(doc, dict) and "files" in doc else None


def target_doc(profile: str) -> dict:
    """The engine a conversion targets: its profile, the vLLM releases that profile is verified against,
    the vLLM installed where it ran (None: none), and whether the profile is verified for that vLLM's
    series (``verified``: false for a vLLM newer than every verified release; None with no vLLM)."""
    p = get_profile(profile)
    installed = engine_target.installed_vllm()  # looked up when called: tests stand in for the installed vLLM
    return {
        "profile": p.name,
        "vllm_verified": list(p.verified),
        "vllm_covers": list(p.covers),
        "installed_vllm": installed,
        "verified": engine_target.is_verified(p.name, installed),
    }


def manifest_doc(plan: Plan, source: dict, fingerprint: str, outputs: dict) -> dict:
    return {
        "tool": "ckpt-tool",
        "version": __version__,
        "profile": plan.options.profile,
        "target": target_doc(plan.options.profile),
        "options": plan.options.as_dict(),
        "fingerprint": fingerprint,
        "source": source,
        "outputs": {f.relpath: {**outputs[f.relpath], "rank": f.rank, "tensors": len(f.tensors)} for f in plan.files},
        "tensor_count": plan.tensor_count,
        "total_bytes": plan.total_bytes,
        "materialized": plan.materialized,
        "dropped": plan.dropped,
        "deviations": list(plan.deviations),
        "notes": list(plan.notes),
        "complete": True,
    }
