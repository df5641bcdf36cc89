"""The structure level of ``verify``: from headers and the manifest alone, OUT's files, tensor names, dtypes, shapes
and rank sets are exactly what the plan gives; index.json, config.json and the serving files agree; each file's size
and sha256 match the manifest; and each rank holds what the target engine's parameter table expects."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpt_tool.checkpoint.headers import ShardHeader, read_shard_header
from ckpt_tool.checkpoint.reader import sha256_file
from ckpt_tool.errors import CkptToolError
from ckpt_tool.mapping.engine_table import ENGINES, compare_with_engine, engine_params
from ckpt_tool.mapping.plan import OutFile, Plan
from ckpt_tool.output.convert import serving_files
from ckpt_tool.output.layout import COMPONENTS, MANIFEST, index_doc
from ckpt_tool.processes import stop_signals_to_main
from ckpt_tool.verify.verdict import Check, VerifyReport


def check_engine(plan: Plan, headers: dict[str, ShardHeader], report: VerifyReport) -> None:
    """Each written rank against the target engine's parameter table (ckpt_tool.mapping.engine_table): the keys its
    loader expects, their shapes and dtypes. A rule table gone stale against the engine fails here."""
    opts = plan.options
    if opts.profile not in ENGINES:
        report.add(
            Check(
                "engine",
                False,
                f"profile {opts.profile!r} has no engine table; add one to its profile module in "
                "ckpt_tool/mapping/profiles/",
            )
        )
        return
    ranks = sorted({(f.component, f.rank) for f in plan.files})
    for comp, rank in ranks:
        written: dict[str, tuple[tuple[int, ...], str]] = {}
        files = [f.relpath for f in plan.files if (f.component, f.rank) == (comp, rank)]
        if not all(rel in headers for rel in files):
            continue  # a structure failure already names the unreadable or missing file
        for rel in files:
            written.update({n: (t.shape, t.dtype) for n, t in headers[rel].tensors.items()})
        expected = engine_params(
            plan.config, opts.profile, comp, opts.tp, opts.moe_parallel, rank, opts.vllm_series, opts.nvfp4_input_scales
        )
        problems = compare_with_engine(written, expected)
        name = f"engine:{comp}/rank-{rank}"
        where = f"{comp}/model-rank-{rank}-part-*.safetensors"
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            msg = f"{where} vs the {opts.profile} engine: {problems[0][0]}{more}"
            report.add(
                Check(
                    name, False, msg, file=where, tensor=problems[0][1], details={"problems": [p for p, _ in problems]}
                )
            )
        else:
            report.add(Check(name, True, file=where, details={"parameters": len(expected)}))


def check_structure(
    out: Path,
    plan: Plan,
    manifest: dict,
    report: VerifyReport,
    src_root: Path,
    *,
    hash_files: bool = True,
    workers: int = 1,
) -> dict[str, ShardHeader]:
    """Files, names, dtypes, shapes per rank; index.json; manifest checksums (``hash_files=False``: the
    values level hashes each file while it compares it, one read instead of two). Returns parsed headers."""
    planned = {f.relpath: f for f in plan.files}
    present = {
        f"{comp}/{p.name}" for comp in COMPONENTS if (out / comp).is_dir() for p in (out / comp).glob("*.safetensors")
    }
    for rel in sorted(set(planned) - present):
        report.add(Check(f"structure:{rel}", False, f"{rel}: planned output file is missing", file=rel))
    for rel in sorted(present - set(planned)):
        report.add(Check(f"structure:{rel}", False, f"{rel}: file is not part of the plan for these options", file=rel))

    outputs = manifest.get("outputs") or {}
    headers: dict[str, ShardHeader] = {}
    digests: dict[str, str] = {}
    if hash_files:  # files hashed in parallel (hashlib and reads release the GIL)
        todo = [rel for rel in planned if rel in present]
        with ThreadPoolExecutor(max(1, workers), initializer=stop_signals_to_main) as pool:
            digests = dict(zip(todo, pool.map(lambda rel: sha256_file(out / rel), todo)))
    for rel, f in planned.items():
        if rel not in present:
            continue
        try:
            header = read_shard_header(out / rel, rel)
        except CkptToolError as exc:
            report.add(Check(f"structure:{rel}", False, str(exc), file=rel))
            continue
        headers[rel] = header
        problems = _file_problems(rel, f, header, outputs.get(rel), digests.get(rel) if hash_files else None)
        if problems:
            msg = problems[0][0] + (f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else "")
            report.add(
                Check(
                    f"structure:{rel}",
                    False,
                    msg,
                    file=rel,
                    tensor=problems[0][1],
                    details={"problems": [p for p, _ in problems]},
                )
            )
        else:
            report.add(Check(f"structure:{rel}", True, file=rel))

    _check_index_and_config(out, plan, report, src_root)
    if any(f.component == "model" for f in plan.files):
        _check_serving_files(out, src_root, report)
    return headers


def _file_problems(
    rel: str, f: OutFile, header: ShardHeader, rec: dict | None, digest: str | None
) -> list[tuple[str, str | None]]:
    """What is wrong with one output file against its plan and its manifest record (``digest``: its sha256, when
    hashed here): (message, tensor named or None) each."""
    problems: list[tuple[str, str | None]] = []
    want = {t.name: t for t in f.tensors}
    for name in sorted(set(want) - set(header.tensors)):
        problems.append((f"{rel}: tensor {name!r} missing (from {', '.join(want[name].sources[:2])})", name))
    for name in sorted(set(header.tensors) - set(want)):
        problems.append((f"{rel}: tensor {name!r} is not in the plan", name))
    for name in sorted(set(want) & set(header.tensors)):
        got, exp = header.tensors[name], want[name]
        if got.dtype != exp.dtype or tuple(got.shape) != tuple(exp.shape):
            problems.append(
                (f"{rel}: tensor {name!r} is {got.dtype}{list(got.shape)}, expected {exp.dtype}{list(exp.shape)}", name)
            )
    if rec is None:
        problems.append((f"{rel}: not recorded in {MANIFEST}", None))
    elif rec.get("size") != header.file_size:
        problems.append((f"{rel}: size {header.file_size} differs from the manifest's {rec.get('size')}", None))
    elif digest is not None and rec.get("sha256") != digest:
        problems.append((f"{rel}: sha256 differs from the manifest; the file changed after conversion", None))
    return problems


def _check_index_and_config(out: Path, plan: Plan, report: VerifyReport, src_root: Path) -> None:
    """Each component's index.json is the plan's, its config.json the source's, byte for byte."""
    for comp in COMPONENTS:
        if not any(f.component == comp for f in plan.files):
            continue
        path = out / comp / "index.json"
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            report.add(Check(f"index:{comp}", False, f"{path}: unreadable ({exc})", file=str(path)))
            continue
        ok = doc == index_doc(plan, comp)
        report.add(
            Check(
                f"index:{comp}",
                ok,
                "" if ok else f"{path}: does not match the plan (tensors, ranks or total_size)",
                file=f"{comp}/index.json",
            )
        )
        cfg_path = out / comp / "config.json"
        want = (src_root / "config.json").read_bytes()
        got = cfg_path.read_bytes() if cfg_path.is_file() else None
        msg = (
            ""
            if got == want
            else f"{cfg_path}: {'missing' if got is None else 'differs from the source config.json'}; reconvert"
        )
        report.add(Check(f"config:{comp}", got == want, msg, file=f"{comp}/config.json"))


def _check_serving_files(out: Path, src_root: Path, report: VerifyReport) -> None:
    """OUT/model carries the source's tokenizer, generation config, chat template, ... byte for byte."""
    problems = []
    for name in serving_files(src_root):
        dest = out / "model" / name
        if not dest.is_file():
            problems.append(f"{dest}: missing (vllm serve OUT/model needs the source's {name})")
        elif dest.read_bytes() != (src_root / name).read_bytes():
            problems.append(f"{dest}: differs from the source's {name}")
    msg = (
        f"{problems[0]}; reconvert" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        if problems
        else ""
    )
    report.add(
        Check(
            "serving-files:model", not problems, msg, file="model", details={"problems": problems} if problems else {}
        )
    )
