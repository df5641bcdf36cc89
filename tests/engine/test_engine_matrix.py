"""The engine matrix: for every vLLM release a profile is verified against, ckpt-tool's output for that profile,
loaded by the release's own ShardedStateLoader into the release's own DeepSeek V4 classes (``nvidia/`` model and
MTP), must give the very parameters that release's stock load of the original checkpoint gives, byte for byte, on
every rank of model and draft, except where the manifest (``OUT/ckpt-tool.json``) lists a deviation.

Run: ``pytest -m engine tests/engine -s`` (``-s`` prints timings and the loader warnings that remain); one release:
``-k vllm-0.34.0``. The first run installs each release into ``.engine-site/vllm-<release>/``
(tests/engine/install.py); without the wheel the tests fail. ``ENGINE_TARGET=vllm-seed`` runs the same checks
against another ckpt-tool profile than the one verified against the release.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from cases import CASES
from safetensors.torch import load_file

from ckpt_tool.checkpoint.dtypes import TORCH_NAMES

pytestmark = pytest.mark.engine


def target_of(release) -> str:
    """The profile converted for ``release``: the one verified against it, unless ENGINE_TARGET names another."""
    return os.environ.get("ENGINE_TARGET") or release.profile


COMPONENTS = ("model", "mtp")
CAST_WARNING = "Attempted to load weight"  # ShardedStateLoader: file dtype != parameter dtype (it casts)
EXPERT_SCALE_SRC = re.compile(r"(^|\.)experts\.\d+\.w[123]\.scale$")


def manifest_of(out: Path) -> dict:
    return json.loads((out / "ckpt-tool.json").read_text())


def _jobs(
    src: Path, out: Path, tp: int, ep: bool, dumps: Path, *, ops=("sharded-load", "stock-load"), components=COMPONENTS
) -> list[dict]:
    jobs = []
    for component in components:
        for rank in range(tp):
            base = {"config": str(src), "tp": tp, "rank": rank, "ep": ep, "component": component}
            if "sharded-load" in ops:
                jobs.append(
                    {
                        **base,
                        "op": "sharded-load",
                        "folder": str(out / component),
                        "dump": str(dumps / f"sharded-{component}-{rank}.safetensors"),
                    }
                )
            if "stock-load" in ops:
                jobs.append(
                    {
                        **base,
                        "op": "stock-load",
                        "source": str(src),
                        "dump": str(dumps / f"stock-{component}-{rank}.safetensors"),
                    }
                )
    return jobs


def _summary_of_precheck(pre: dict) -> str:
    lines = []
    for k, v in pre.items():
        if v:
            shown = list(v)[:8]
            lines.append(f"  {k} ({len(v)}): {shown}{' ...' if len(v) > 8 else ''}")
    return "\n".join(lines)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _mtp_materialized_keys(manifest: dict, num_hidden_layers: int, target_prefix: str = "") -> dict[str, str]:
    """Engine key of a draft component -> engine key of the model component it was materialized from
    (``target_prefix``: the vision model holds the text model's keys under ``language_model.``). A DSpark draft's
    embedding and head are the target's; its other aliases (every stage's wkv, read again for context_wkv_proj)
    write keys vLLM's stock load writes too, compared as any other."""
    real_to_key = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight"}
    real_to_key = {real: target_prefix + key for real, key in real_to_key.items()}
    out = {}
    for alias, real in manifest.get("materialized", {}).items():
        if alias.startswith("dspark.context_wkv."):
            continue
        if alias in ("dspark.embed.weight", "dspark.head.weight"):
            out["model.embed_tokens.weight" if alias == "dspark.embed.weight" else "lm_head.weight"] = real_to_key[real]
            continue
        m = re.fullmatch(r"mtp\.(\d+)\.(emb\.tok_emb|head)\.weight", alias)
        assert m and real in real_to_key, f"manifest materializes {alias} from {real}: unknown to this test"
        i, what = int(m.group(1)), m.group(2)
        key = (
            "model.embed_tokens.weight"
            if what == "emb.tok_emb"
            else f"model.layers.{num_hidden_layers + i}.shared_head.head.weight"
        )
        out[key] = real_to_key[real]
    return out


def _judge_untouched(
    where: str, key: str, loaded: torch.Tensor, component: str, rank: int, materialized: dict[str, str], by: dict
) -> tuple[bool, str]:
    """(allowed?, line) for ``key``, a key the stock load wrote from no source tensor: it is allowed only as a
    materialization the manifest declares, holding exactly the target's ``ref`` as both loads of the target hold it
    on this rank; anything else is a deviation the manifest does not declare."""
    if component == "model" or key not in materialized:
        return False, f"{where}: {key}: stock load leaves it uninitialised and the manifest lists no materialization"
    ref = materialized[key]
    target_sharded = load_file(by[("sharded-load", "model", rank)]["job"]["dump"])[ref]
    target_stock = load_file(by[("stock-load", "model", rank)]["job"]["dump"])[ref]
    if _bits_equal(loaded, target_sharded) and _bits_equal(loaded, target_stock):
        return True, f"{where}: {key} materialized from the target's {ref} (stock leaves it uninitialised)"
    return False, f"{where}: {key} is materialized but differs from the target's {ref}"


def compare(
    results: list[dict],
    tp: int,
    manifest: dict,
    num_hidden_layers: int,
    *,
    components=COMPONENTS,
    target_prefix: str = "",
) -> tuple[list, list, list]:
    """(problems, allowed deviations seen, remaining loader warnings) of sharded-load vs stock-load, all ranks."""
    by = {(r["op"], r["job"]["component"], r["job"]["rank"]): r for r in results}
    for r in results:
        assert r["error"] is None, f"worker could not run {r['op']} {r['job']}: {r['error']}"
    materialized = _mtp_materialized_keys(manifest, num_hidden_layers, target_prefix)
    e8m0_deviation = any("E8M0" in d for d in manifest.get("deviations", []))
    problems: list[str] = []
    allowed: list[str] = []
    warnings_left: list[str] = []

    for component in components:
        for rank in range(tp):
            where = f"{component} rank {rank}"
            sh = by[("sharded-load", component, rank)]
            st = by[("stock-load", component, rank)]
            if sh["exception"]:
                problems.append(
                    f"{where}: ShardedStateLoader raised {sh['exception']['type']}: "
                    f"{sh['exception']['message'][:400]}\n"
                    f"  (harness precheck of {sh['folder']} against the engine table:)\n"
                    f"{_summary_of_precheck(sh['precheck'])}"
                )
                continue
            for rec in sh["load_log"]:
                if rec["level"] in ("WARNING", "ERROR", "CRITICAL"):
                    if rec["message"].startswith(CAST_WARNING):
                        problems.append(f"{where}: dtype cast on load: {rec['message']}")
                    else:
                        warnings_left.append(f"{where}: {rec['message']}")
            warnings_left += [f"{where}: {w}" for w in sh["load_warnings"]]
            if st["exception"]:
                problems.append(
                    f"{where}: stock load raised {st['exception']['type']}: {st['exception']['message'][:400]}"
                )
                continue
            assert sh["keys"] == st["keys"], f"{where}: the two builds disagree on the engine table"

            sharded = load_file(sh["job"]["dump"])
            stock = load_file(st["job"]["dump"])
            assert set(sharded) == set(stock) == set(sh["keys"])
            untouched = set(st["untouched_keys"])
            sources_of: dict[str, list[tuple[str, str]]] = {}
            for src_name, info in st["provenance"].items():
                for key in info["keys"]:
                    sources_of.setdefault(key, []).append((src_name, info["dtype"]))

            for key in sorted(sharded):
                a, b = sharded[key], stock[key]
                if key in untouched:
                    # No source tensor wrote it in the stock load (the worker's write recorder says so), so what the
                    # stock model holds there is whatever memory torch.empty handed out: possibly the very bytes
                    # compared with (the allocator may reuse what the target model just freed). Judged by what
                    # was written, never by those bytes.
                    is_allowed, line = _judge_untouched(where, key, a, component, rank, materialized, by)
                    (allowed if is_allowed else problems).append(line)
                    continue
                if _bits_equal(a, b):
                    continue
                srcs = sources_of.get(key, [])
                if (
                    e8m0_deviation
                    and srcs
                    and all(EXPERT_SCALE_SRC.search(n) and d == "float8_e8m0fnu" for n, d in srcs)
                    and a.dtype == b.dtype == torch.float32
                ):
                    want = torch.exp2(b - 127.0)  # stock keeps the raw E8M0 byte b as a float; the value is 2^(b-127)
                    if _bits_equal(a, want):
                        allowed.append(f"{where}: {key} holds 2^(b-127) where stock load holds the raw byte b")
                        continue
                    problems.append(f"{where}: {key}: E8M0 expert scale is neither stock's byte b nor 2^(b-127)")
                    continue
                same_kind = a.shape == b.shape and a.dtype == b.dtype
                diff = (
                    int((a.float() != b.float()).sum())
                    if same_kind
                    else f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
                )
                problems.append(
                    f"{where}: {key} differs from the stock load ({diff}); sources {[n for n, _ in srcs][:4]}"
                )
    return problems, allowed, warnings_left


ST_DTYPE = {torch_name: name for name, torch_name in TORCH_NAMES.items()}  # vLLM reports torch dtypes by name


def engine_table_problems(
    results: list[dict],
    src: Path,
    tp: int,
    ep: bool,
    target: str,
    vllm_series: str | None = None,
    nvfp4_input_scales: str | None = None,
) -> list[str]:
    """ckpt_tool.mapping.engine_table's table (what verify checks OUT against, for ``vllm_series``) vs the keys vLLM's
    own classes hold, every rank."""
    from ckpt_tool.checkpoint.config import V4Config
    from ckpt_tool.mapping.engine_table import engine_params

    cfg = V4Config.load(src / "config.json")
    problems = []
    for r in results:
        if r["op"] != "sharded-load":
            continue
        comp, rank = r["job"]["component"], r["job"]["rank"]
        ours = engine_params(cfg, target, comp, tp, "ep" if ep else "tp", rank, vllm_series, nvfp4_input_scales)
        vllm = {k: (tuple(v["shape"]), ST_DTYPE.get(v["dtype"], v["dtype"])) for k, v in r["keys"].items()}
        where = f"{comp} rank {rank}"
        for k in sorted(set(ours) ^ set(vllm)):
            problems.append(
                f"{where}: {k} is {'only in ckpt_tool.mapping.engine_table' if k in ours else 'only in vLLM'}"
            )
        for k in sorted(set(ours) & set(vllm)):
            p, (shape, dtype) = ours[k], vllm[k]
            shape_ok = p.shape == shape or (
                p.prefix and len(shape) == len(p.shape) and all(a <= b for a, b in zip(p.shape, shape))
            )
            if not shape_ok or (p.dtype is not None and p.dtype != dtype):
                problems.append(
                    f"{where}: {k}: ckpt_tool.mapping.engine_table says {p.dtype}{list(p.shape)}, "
                    f"vLLM holds {dtype}{list(shape)}"
                )
    return problems


def _report(title: str, allowed: list[str], warnings_left: list[str]) -> None:
    print(f"\n{title}")
    for line in allowed:
        print(f"  allowed deviation: {line}")
    for line in warnings_left:
        print(f"  loader warning: {line}")


@pytest.mark.parametrize(("variant", "tp", "ep"), CASES, ids=[f"{v}-tp{t}{'-ep' if e else ''}" for v, t, e in CASES])
def test_sharded_load_matches_stock_load(variant, tp, ep, vllm_release, fixture_dir, converted, run_worker, tmp_path):
    t0 = time.perf_counter()
    target = target_of(vllm_release)
    src = fixture_dir(variant)
    config = json.loads((src / "config.json").read_text())
    out = converted(variant, tp, ep, target)
    manifest = manifest_of(out)
    t_convert = time.perf_counter() - t0
    results = run_worker(_jobs(src, out, tp, ep, tmp_path / "dumps"))
    t_engine = time.perf_counter() - t0 - t_convert
    problems, allowed, warnings_left = compare(results, tp, manifest, config["num_hidden_layers"])
    problems += engine_table_problems(results, src, tp, ep, target)
    _report(
        f"[{vllm_release.id} {variant} tp{tp}{' ep' if ep else ''} --target {target}] convert {t_convert:.1f}s, "
        f"vLLM {t_engine:.1f}s ({len(results)} builds)",
        allowed,
        warnings_left,
    )
    assert not problems, "\n".join(problems)


# The vision model (DeepseekV4ForConditionalGeneration, vllm/models/deepseek_v4/common/vl_model.py): the worker builds
# the class vLLM's registry resolves for a config with vision_n_layers > 0. (variant, tp, expert parallel)
VISION_CASES = [
    ("vl-fp4", 1, False),
    ("vl-fp4", 2, False),
    ("vl-fp4", 4, False),
    ("vl-fp4", 2, True),
    ("vl-fp4-nomtp", 2, False),  # no draft: the target model only
    ("vl-fp4-h2", 2, False),  # 2 vision heads: the tower splits at tp 2 ...
    ("vl-fp4-h2", 4, False),  # ... and vLLM replicates it (and the aligner) at tp 4
    ("vl-fp4-f32", 2, False),  # a float32 tower: OUT holds what vLLM's stock load casts it to
]


@pytest.mark.parametrize(
    ("variant", "tp", "ep"), VISION_CASES, ids=[f"{v}-tp{t}{'-ep' if e else ''}" for v, t, e in VISION_CASES]
)
def test_vision_sharded_load_matches_stock_load(
    variant, tp, ep, vllm_release, fixture_dir, converted, run_worker, tmp_path
):
    t0 = time.perf_counter()
    target = target_of(vllm_release)
    src = fixture_dir(variant)
    config = json.loads((src / "config.json").read_text())
    components = COMPONENTS if config["num_nextn_predict_layers"] else ("model",)
    out = converted(variant, tp, ep, target)
    manifest = manifest_of(out)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(components)
    results = run_worker(_jobs(src, out, tp, ep, tmp_path / "dumps", components=components))
    classes = {r["job"]["component"]: r.get("class") for r in results}
    assert classes["model"].endswith("vl_model.DeepseekV4ForConditionalGeneration"), classes
    problems, allowed, warnings_left = compare(
        results, tp, manifest, config["num_hidden_layers"], components=components, target_prefix="language_model."
    )
    problems += engine_table_problems(results, src, tp, ep, target)
    _report(
        f"[{vllm_release.id} {variant} tp{tp}{' ep' if ep else ''} --target {target}] "
        f"{time.perf_counter() - t0:.1f}s ({len(results)} builds)",
        allowed,
        warnings_left,
    )
    assert not problems, "\n".join(problems)


MATERIALIZED_DRAFT = {"mtp.0.emb.tok_emb.weight": "embed.weight", "mtp.0.head.weight": "head.weight"}
SELF_TESTS = {
    # variant: (what is changed in vLLM's own sharded save, manifest that declares it). A source without the MTP
    # embedding/head (fp4, fp8-e8m0) leaves them uninitialised in the stock load: the save gets the target's, as
    # ckpt-tool writes them, and the manifest declares them.
    "fp4-mtp-emb": ("nothing", {}),
    "fp4": ("MTP embedding/head replaced by the target's (the source has none)", {"materialized": MATERIALIZED_DRAFT}),
    "fp8-e8m0": (
        "routed-expert E8M0 scales written as 2^(b-127); MTP embedding/head replaced by the target's",
        {
            "materialized": MATERIALIZED_DRAFT,
            "deviations": ["fp8 routed-expert E8M0 scales written as float32 2^(b-127)"],
        },
    ),
}


def _patch_saved(variant: str, out: Path, tp: int, stock: dict, num_hidden_layers: int) -> None:
    from safetensors.torch import save_file

    manifest = SELF_TESTS[variant][1]
    for rank in range(tp):
        for component in ("model", "mtp"):
            files = sorted((out / component).glob(f"model-rank-{rank}-part-*.safetensors"))
            assert len(files) == 1
            t = load_file(files[0])
            if manifest.get("materialized") and component == "mtp":
                target = load_file(sorted((out / "model").glob(f"model-rank-{rank}-part-*.safetensors"))[0])
                t["model.embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
                head = f"model.layers.{num_hidden_layers}.shared_head.head.weight"
                t[head] = target["lm_head.weight"].clone()
            if manifest.get("deviations"):
                prov = stock[(component, rank)]["provenance"]
                keys = {k for src, info in prov.items() if EXPERT_SCALE_SRC.search(src) for k in info["keys"]}
                assert keys and all(t[k].dtype == torch.float32 for k in keys), keys
                for k in keys:
                    t[k] = torch.exp2(t[k] - 127.0)
            save_file(t, str(files[0]))


@pytest.mark.parametrize("variant", list(SELF_TESTS))
def test_harness_on_vllms_own_sharded_save(variant, vllm_release, fixture_dir, run_worker, tmp_path):
    """Self-test of the harness, no ckpt-tool involved: what vLLM's own ``ShardedStateLoader.save_model`` writes
    after a stock load loads back warning-free and byte-identical; the two manifest deviations, applied to it,
    are accepted only when the manifest declares them."""
    tp, ep = 2, False
    change, manifest = SELF_TESTS[variant]
    src = fixture_dir(variant)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    out = tmp_path / "vllm-saved"
    stock_jobs = _jobs(src, out, tp, ep, tmp_path / "dumps", ops=("stock-load",))
    for j in stock_jobs:
        j["save"] = str(out / j["component"])
    stock = run_worker(stock_jobs)
    assert all(r["error"] is None and r["exception"] is None and r["saved"] for r in stock), stock
    _patch_saved(variant, out, tp, {(r["job"]["component"], r["job"]["rank"]): r for r in stock}, layers)
    sharded = run_worker(_jobs(src, out, tp, ep, tmp_path / "dumps", ops=("sharded-load",)))
    assert all(not any(r["precheck"].values()) for r in sharded), [r["precheck"] for r in sharded]

    problems, allowed, warnings_left = compare(stock + sharded, tp, manifest, layers)
    _report(f"[{vllm_release.id} harness self-test {variant}: {change}]", allowed, warnings_left)
    assert not problems and not warnings_left, (problems, warnings_left)
    if variant == "fp4-mtp-emb":
        assert not allowed
        return
    if variant == "fp4":  # each rank's draft: embedding and head, materialized from the target
        assert len(allowed) == 2 * tp, allowed
    else:
        assert len(allowed) > 2 * tp, allowed  # and the expert scales
    if manifest.get("materialized"):
        # The allocator may hand the stock draft the memory the target just freed, holding the very bytes compared
        # with: made to happen here. The deviations are counted all the same.
        _stock_draft_holds_targets_bytes(stock, layers)
        forced_problems, forced_allowed, _ = compare(stock + sharded, tp, manifest, layers)
        assert not forced_problems and forced_allowed == allowed, (forced_problems, forced_allowed)
    undeclared, _, _ = compare(stock + sharded, tp, {}, layers)  # the same bytes without the manifest entry
    assert len(undeclared) == len(allowed), undeclared


def _stock_draft_holds_targets_bytes(stock: list[dict], num_hidden_layers: int) -> None:
    """Rewrite each rank's stock-load dump of the draft so that its embedding and head hold the bytes of the target's
    (what an uninitialised parameter holds when torch.empty returns the memory the target model freed)."""
    from safetensors.torch import save_file

    dumps = {(r["job"]["component"], r["job"]["rank"]): Path(r["job"]["dump"]) for r in stock}
    for (component, rank), path in dumps.items():
        if component != "mtp":
            continue
        draft, target = load_file(path), load_file(dumps[("model", rank)])
        draft["model.embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
        draft[f"model.layers.{num_hidden_layers}.shared_head.head.weight"] = target["lm_head.weight"].clone()
        save_file(draft, str(path))
