"""Ask an installed vLLM which parameters its DeepSeek V4 classes hold per rank, and let its loader load OUT.

Run BY PATH with the interpreter of the environment that has vLLM (the serving venv); it needs only the
standard library, torch and vllm there, not ckpt_tool:

    PY ckpt_tool/verify/engine/probe.py < request.json > answer.json     # vLLM's own logs go to stderr

Request: ``{"protocol": 1, "config_dir": OUT/model, "draft_dir": OUT/mtp or null, "tp": T, "ep": bool,
"site": a folder to put first on sys.path (tests) or null, "jobs": [{"component": "model"|"mtp", "rank": r, "folder":
OUT/<component>, "real_load": bool}, ...]}``; a job may carry its own
``config_dir``, ``draft_dir``, ``tp`` and ``ep`` (several OUTs judged by one vLLM import).

Answer: ``{"protocol": 1, "fatal": null | {"kind": "no-vllm"|"build", "stage", "message", "hint", "traceback"},
"versions": {...}, "results": [{"component", "rank", "class", "seconds", "table": {key: [dtype, shape]},
"aliases": {dropped key: kept key}, "on_cpu": [keys], "load": null | {...}}]}``.

Per job (component, rank): vLLM's model class is built the way ``BaseModelLoader.load_model`` builds it, on the
meta device (no memory for the weights), with the engine config ``vllm serve`` makes for OUT's tp and
expert-parallel setting. ``table`` is its ``state_dict()`` after vLLM's own ``ShardedStateLoader._filter_subtensors``
(storages placed at distinct addresses, vllm_stubs.filter_state_dict). With ``real_load`` the class is built
again on the CPU and vLLM's ``ShardedStateLoader.load_weights`` loads ``folder`` into it: ``load`` holds its
exception, its log records at WARNING and above, Python warnings, the filtered table of the CPU build
(``cpu_table``: the meta table must equal it), its ``seconds`` and ``cost`` (``load_meter.py``: the tensor bytes the
loader read from the rank's files, the bytes the disk gave, CPU seconds and peak RSS during the load).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOCOL = 1


def _load_by_path(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, HERE / file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _load_stubs():
    return _load_by_path("ckpt_tool_vllm_stubs", "vllm_stubs.py")


def _table(kept: dict, stubs) -> dict:
    return {k: [stubs.dtype_name(t.dtype), list(t.shape)] for k, t in kept.items()}


def _engine(setting: dict, component: str, rank: int, stubs):
    """(vLLM's engine config as ``vllm serve`` makes it for OUT, the model config ``component`` is built with)."""
    tp, ep = int(setting["tp"]), bool(setting.get("ep"))
    with stubs.stage(
        f"build vLLM's engine config for {setting['config_dir']} (tp {tp}{', expert parallel' if ep else ''})"
    ):
        stubs.fake_groups(tp, rank)
        cfg = stubs.engine_config(setting["config_dir"], tp, ep, "sharded_state", setting.get("draft_dir"))
        return cfg, stubs.component_model_config(cfg, component)


def run_job(request: dict, job: dict, stubs) -> dict:
    """One (component, rank): the meta-built table, and with ``real_load`` vLLM's own load of the rank's files."""
    component, rank = job["component"], int(job["rank"])
    setting = {k: job.get(k, request.get(k)) for k in ("config_dir", "draft_dir", "tp", "ep")}
    where = f"{component}/rank-{rank}"
    t0 = time.perf_counter()
    cfg, model_config = _engine(setting, component, rank, stubs)
    with stubs.capture(), stubs.stage(f"build vLLM's {component} class on the meta device ({where})"):
        model = stubs.build_model(cfg, model_config, "meta")
    cls = type(model)
    with stubs.stage(f"filter the state dict with vLLM's ShardedStateLoader._filter_subtensors ({where})"):
        kept, aliases = stubs.filter_state_dict(model)
    result = {
        "component": component,
        "rank": rank,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "table": _table(kept, stubs),
        "aliases": {k: v for k, v in aliases.items() if v is not None},
        "on_cpu": sorted(k for k, t in kept.items() if t.device.type != "meta"),
        "load": None,
    }
    del model, kept
    gc.collect()
    if job.get("real_load"):
        cfg, model_config = _engine(setting, component, rank, stubs)  # a fresh config: it records the layers built
        result["load"] = _real_load(cfg, model_config, component, job["folder"], where, stubs)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def _real_load(cfg, model_config, component: str, folder: str, where: str, stubs) -> dict:
    """vLLM's ``ShardedStateLoader.load_weights`` on ``folder`` into the class built on the CPU."""
    # vLLM imports only after vllm_stubs.bootstrap() has run (answer() runs it first)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    with stubs.capture(), stubs.stage(f"build vLLM's {component} class on the CPU ({where})"):
        model = stubs.build_model(cfg, model_config, "cpu")
    with stubs.stage(f"filter the CPU-built state dict ({where})"):
        from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader  # see above

        cpu_table = _table(ShardedStateLoader._filter_subtensors(model.state_dict()), stubs)
    load_config = cfg.load_config if component == "model" else get_draft_load_config(cfg)
    loader = get_model_loader(load_config)
    out = {"loader": f"{type(loader).__module__}.{type(loader).__qualname__}", "cpu_table": cpu_table}
    meter = _load_by_path("ckpt_tool_load_meter", "load_meter.py").LoadMeter()
    # ShardedStateLoader.load_weights reads the rank's files through its own iterate_over_files (vLLM 0.33.0 and
    # 0.34.0, sharded_state_loader.py): counted as it hands the tensors over, unchanged
    real_iterate = loader.iterate_over_files
    loader.iterate_over_files = lambda paths: meter.counted(real_iterate(paths))
    t0 = time.perf_counter()
    with stubs.capture() as cap:
        try:
            with set_current_vllm_config(cfg), meter:  # as vLLM's GPU worker holds it while loading
                loader.load_weights(model, stubs.ModelConfigAt(model_config, folder))
            out["exception"] = None
        except Exception as e:  # noqa: BLE001 - the loader's verdict on these files
            out["exception"] = {"type": type(e).__name__, "message": str(e)[:4000]}
    out["seconds"] = round(time.perf_counter() - t0, 6)
    out["cost"] = meter.figures()
    out["log"] = [r for r in cap["log"] if r["level"] in ("WARNING", "ERROR", "CRITICAL")]
    out["warnings"] = cap["warnings"]
    del model
    gc.collect()
    return out


def answer(request: dict, stubs) -> dict:
    doc: dict = {"protocol": PROTOCOL, "fatal": None, "versions": None, "results": []}
    try:
        if request.get("protocol") != PROTOCOL:
            raise stubs.EngineUnavailable(
                "read the request", f"protocol {request.get('protocol')!r}, this probe speaks {PROTOCOL}"
            )
        stubs.bootstrap(request.get("site"))
        for job in request["jobs"]:
            doc["results"].append(run_job(request, job, stubs))
        doc["versions"] = stubs.versions()
    except stubs.EngineUnavailable as e:
        doc["fatal"] = {
            "kind": e.kind,
            "stage": e.stage,
            "message": str(e),
            "hint": e.hint,  # what to install, where the cause is a missing module (None: not that)
            "traceback": traceback.format_exception(type(e), e, e.__traceback__)[-12:],
        }
    if doc["versions"] is None and doc["fatal"] and doc["fatal"]["kind"] != "no-vllm":
        try:
            doc["versions"] = stubs.versions()
        except Exception:  # noqa: BLE001 - vllm did not even import
            pass
    return doc


def main() -> int:
    if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
        sys.path.pop(0)  # this folder's modules must not shadow anything vLLM imports
    request = json.loads(sys.stdin.read())
    # stdout carries the one JSON answer: everything else (vLLM's logs, prints, C libraries) goes to stderr
    sys.stdout.flush()
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    stubs = _load_stubs()
    doc = answer(request, stubs)
    for cache in stubs.TEMP_CACHE:
        shutil.rmtree(cache, ignore_errors=True)
    json.dump(doc, real_stdout)
    real_stdout.write("\n")
    real_stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
