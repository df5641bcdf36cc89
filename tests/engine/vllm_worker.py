"""Build vLLM's own DeepSeek V4 classes on CPU and run vLLM's own loaders on them.

Run it with the project venv's python; ``--site`` (default ``<repo>/.engine-site``, see install.py) is put
first on ``sys.path``. Everything vLLM prints goes to stderr; stdout carries one JSON document.

    python tests/engine/vllm_worker.py expect       --config SRC --tp 2 --rank 0 [--ep] --component model|mtp|dspark
    python tests/engine/vllm_worker.py sharded-load --config SRC --tp 2 --rank 0 [--ep] --component model
                                                    --folder OUT/model [--dump F]
    python tests/engine/vllm_worker.py stock-load   --config SRC --tp 2 --rank 0 [--ep] --component mtp
                                                    [--source SRC] [--dump F]
    python tests/engine/vllm_worker.py batch JOBS.json|-      # {"jobs": [{"op": ..., "config": ..., ...}, ...]}
    python tests/engine/vllm_worker.py serve                  # one batch a stdin line, one answer a stdout line

``serve`` keeps one vLLM import for many batches (the engine tests' session worker, tests/engine/conftest.py):
every job builds its own model either way, so a batch answers the same in a fresh process or a served one.

Components: ``model`` (the target, ``nvidia/model.py``, or the vision wrapper the registry resolves), ``mtp`` (the
classic MTP draft, ``nvidia/mtp.py::DeepSeekV4MTP``, speculative method "mtp") and ``dspark`` (the DSpark draft,
``nvidia/dspark.py::DSparkDeepseekV4ForCausalLM``, registry name ``DSparkDraftModel``, speculative method "dspark",
chosen when config.json has ``dspark_target_layer_ids``; built under the draft config vLLM's ``load_dspark_model``
makes, see ``vllm_stubs.component_vllm_config``). A checkpoint has either an ``mtp`` or a ``dspark`` draft.
A DeepSeek V4.1 checkpoint (config.json ``model_type: deepseek_v41``, nested ``text_config``) has ``model`` =
``vllm/models/deepseek_v41/nvidia/vl_model.py::DeepseekV41ForCausalLM`` (the vision wrapper, text model under
``language_model.``) and ``dspark`` = ``vllm/models/deepseek_v41/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM``
(registry name ``DSparkV41DraftModel``); no ``mtp``. Its Engram tables are built with ``cpu_offload`` off (see
``vllm_stubs.engine_config``).

Operations (each builds a fresh model for (config, tp, rank, ep, component)):

* ``expect``: the keys vLLM's ShardedStateLoader wants from rank ``rank``'s files: the model's ``state_dict()``
  passed through ``ShardedStateLoader._filter_subtensors`` (vLLM's own function), with shape and dtype.
* ``sharded-load``: ``ShardedStateLoader.load_weights`` (the ``--load-format sharded_state`` path) on
  ``--folder`` (``model-rank-{rank}-part-*.safetensors``); every vLLM log record and Python warning it emits and
  any exception are reported; on success the filtered state dict is dumped.
* ``stock-load``: ``DefaultModelLoader.load_weights`` (``--load-format auto``) on the original DeepSeek-named
  checkpoint: vLLM reads the whole checkpoint and the model class's own ``load_weights`` (hf_to_vllm_mapper,
  MTP name remapping) places the tensors. For ``mtp`` and ``dspark`` this is how vLLM loads the draft (same
  folder, the class picks the ``mtp.*`` tensors; DSpark also writes ``model.context_wkv_proj`` from every
  ``mtp.{i}.attn.wkv.*``). Also reports which source tensor wrote which state-dict key. ``--save DIR`` then
  writes the loaded model with vLLM's own ``ShardedStateLoader.save_model`` (a reference sharded output).
  The DSpark draft's ``model.embed_tokens`` and ``lm_head`` are written by no source tensor (vLLM replaces them by
  the target's after a real load, v1/worker/gpu/spec_decode/dspark/utils.py): they stay uninitialised here.

Cost: both loads report ``load_cost`` (``ckpt_tool/verify/engine/load_meter.py``): wall and CPU seconds, bytes the
process read from the disk and the tensor bytes the loader's weight iterator handed over, peak RSS during the load.
A job ``{"record": false}`` runs the stock load without the write recorder (a dispatch mode on every op, which
costs time): ``provenance``, ``sources_read`` and ``untouched_keys`` are then None (not known).

Dump: ``--dump F`` writes the filtered state dict to safetensors file F; the JSON always carries dtype, shape
and sha256 of the raw bytes of every key. Weight post-processing (``process_weights_after_loading``, which
repacks for CUDA kernels) is not run: the raw loaded parameters are compared.

What is stubbed, and why (nothing else is changed): see ``ckpt_tool/verify/engine/vllm_stubs.py``, the one module
that ``ckpt-tool verify --engine`` and this worker share (loaded here by path, as the command's probe loads it).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SITE = REPO / ".engine-site"
STUBS_FILE = REPO / "ckpt_tool" / "verify" / "engine" / "vllm_stubs.py"
METER_FILE = REPO / "ckpt_tool" / "verify" / "engine" / "load_meter.py"
DTYPES_FILE = REPO / "ckpt_tool" / "checkpoint" / "dtypes.py"


def _load_by_path(name: str, path: Path):
    """A module of ckpt_tool by path (``vllm_stubs.py``, ``dtypes.py``: each imports only the standard library at
    module level), so that this worker needs no ckpt_tool on ``sys.path``."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


stubs = _load_by_path("ckpt_tool_vllm_stubs", STUBS_FILE)
dtypes = _load_by_path("ckpt_tool_dtypes", DTYPES_FILE)
load_meter = _load_by_path("ckpt_tool_load_meter", METER_FILE)
_REAL_STDOUT = None


def bootstrap(site: Path) -> None:
    """Make ``import vllm`` (from ``site``) work on a CPU-only machine, stubbing only what needs CUDA."""
    try:
        stubs.bootstrap(Path(site))
    except stubs.EngineUnavailable as e:
        if e.kind == "no-vllm":
            raise SystemExit(f"vllm is not installed in {site} (run tests/engine/install.py)") from None
        raise


def _fake_groups(tp: int, rank: int) -> None:
    stubs.fake_groups(tp, rank)


def _engine_config(config_dir: str, tp: int, ep: bool, load_format: str, gpu: str | None = None):
    return stubs.engine_config(config_dir, tp, ep, load_format, gpu=gpu)


def _component_class(component: str, v41: bool = False):
    """The class vLLM serves ``component`` with on an NVIDIA GPU (imported from ``nvidia/`` directly: on a CPU
    platform ``vllm.models.deepseek_v4`` resolves CPU stand-ins). ``v41``: a DeepSeek V4.1 checkpoint
    (config.json ``model_type: deepseek_v41``): ``model`` is the vision wrapper ``DeepseekV41ForCausalLM``
    (registry name the same, ``vllm/models/deepseek_v41/nvidia/vl_model.py``), ``dspark`` its DSpark draft
    (registry name ``DSparkV41DraftModel``, ``vllm/models/deepseek_v41/nvidia/dspark.py``)."""
    if v41:
        if component == "model":
            from vllm.models.deepseek_v41.nvidia.vl_model import DeepseekV41ForCausalLM

            return DeepseekV41ForCausalLM
        if component == "dspark":
            from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM

            return DSparkDeepseekV4ForCausalLM
        raise ValueError(f"a DeepSeek V4.1 checkpoint has the components 'model' and 'dspark', not {component!r}")
    if component == "model":
        from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM

        return DeepseekV4ForCausalLM
    if component == "mtp":
        from vllm.models.deepseek_v4.nvidia.mtp import DeepSeekV4MTP

        return DeepSeekV4MTP
    if component == "dspark":
        from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM

        return DSparkDeepseekV4ForCausalLM
    raise ValueError(f"component must be one of {', '.join(map(repr, stubs.COMPONENTS))}, got {component!r}")


_ModelConfigAt = stubs.ModelConfigAt
_capture = stubs.capture


def _exception(e: BaseException) -> dict:
    return {
        "type": type(e).__name__,
        "message": str(e),
        "traceback": traceback.format_exception(type(e), e, e.__traceback__)[-6:],
    }


def _build(job: dict, load_format: str):
    """(model, vllm_config the component is built and loaded under, its model_config, build report)."""
    import torch
    from vllm.model_executor.model_loader.utils import get_model_architecture, initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    tp, rank, ep, component = int(job["tp"]), int(job["rank"]), bool(job.get("ep")), job["component"]
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in 0..{tp - 1}")
    _fake_groups(tp, rank)
    t0 = time.perf_counter()
    with _capture() as cap:
        cls = _component_class(component, stubs.is_v41(job["config"]))
        cfg = _engine_config(job["config"], tp, ep, load_format, job.get("gpu"))  # gpu: a FAKE_GPUS name
        model_config = stubs.component_model_config(cfg, component)
        # the target's config for model and mtp; for dspark the draft config load_dspark_model builds it under
        cfg = stubs.component_vllm_config(cfg, component)
        registry_cls, registry_arch = get_model_architecture(model_config)
        if component == "model" and registry_cls.__name__ == "DeepseekV4ForConditionalGeneration":
            # a config with vision_n_layers > 0: vLLM's arch convertor rewrites architectures and the registry
            # resolves the vision wrapper (vllm/models/deepseek_v4/common/vl_model.py): build what it serves
            cls = registry_cls
        # BaseModelLoader.load_model builds under the model dtype and the target device (here: the CPU).
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"), stubs.build_runner(cfg):
            model = initialize_model(cfg, model_class=cls, model_config=model_config)
    spec = cfg.speculative_config
    report = {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "registry_class": f"{registry_cls.__module__}.{registry_cls.__qualname__}",
        "registry_architecture": registry_arch,
        "speculative": None
        if spec is None or component == "model"
        else {
            "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "draft_architectures": list(spec.draft_model_config.hf_config.architectures or []),
            "draft_model_type": spec.draft_model_config.hf_config.model_type,
        },
        "gpu": {"name": stubs.current_gpu().name, "sm": stubs.current_gpu().sm},
        "moe_methods": _moe_methods(model),
        "build_seconds": round(time.perf_counter() - t0, 3),
        "build_log": [r for r in cap["log"] if r["level"] != "DEBUG"],
        "build_warnings": cap["warnings"],
    }
    return model, cfg, model_config, report


def _moe_methods(model) -> dict:
    """Per routed-experts module (by its name in the model): the quantization method vLLM built it with and the MoE
    backend that method chose (``nvfp4_backend`` / ``mxfp4_backend`` / ``fp8_backend`` and ``experts_cls`` set in
    its ``__init__``, quantization/modelopt.py and mxfp4.py, 0.33.0 and 0.34.0), and, for NVFP4, whether the backend
    keeps every expert's input scales on each rank (``use_global_sf``)."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    methods = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, FusedMoEMethodBase):
            continue
        backend = next(
            (getattr(method, a) for a in ("nvfp4_backend", "mxfp4_backend", "fp8_backend") if hasattr(method, a)),
            None,
        )
        experts = getattr(method, "experts_cls", None)
        methods[name] = {
            "method": type(method).__name__,
            "backend": getattr(backend, "value", None if backend is None else str(backend)),
            "experts": None if experts is None else experts.__name__,
            "use_global_sf": getattr(method, "use_global_sf", None),
        }
    return methods


def _filtered(model) -> dict:
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    return ShardedStateLoader._filter_subtensors(model.state_dict())


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _table(model) -> tuple[dict, dict]:
    """(filtered key -> {dtype, shape}, dropped state_dict key -> key it aliases)."""
    full = model.state_dict()
    kept = _filtered(model)
    table = {k: {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)} for k, t in kept.items()}
    by_ptr = {}
    for k, t in kept.items():
        by_ptr.setdefault((t.untyped_storage().data_ptr(), t.data_ptr()), k)
    aliases = {}
    for k, t in full.items():
        if k not in kept:
            aliases[k] = by_ptr.get((t.untyped_storage().data_ptr(), t.data_ptr()), None) if t.numel() else None
    return table, aliases


def _raw(t):
    import torch

    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def _dump(model, path: str | None) -> dict:
    kept = _filtered(model)
    out = {}
    tensors = {}
    for k, t in kept.items():
        raw = _raw(t)
        out[k] = {
            "dtype": _dtype_name(t.dtype),
            "shape": list(t.shape),
            "sha256": hashlib.sha256(raw.numpy().tobytes()).hexdigest(),
        }
        if path:
            tensors[k] = t.detach().contiguous().cpu().clone()
    if path:
        from safetensors.torch import save_file

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path))
    return out


def _file_headers(folder: str, rank: int) -> dict:
    """What rank ``rank``'s files hold (read from the safetensors headers): key -> {dtype, shape, file}."""
    import glob

    from safetensors import safe_open

    held = {}
    for path in sorted(glob.glob(os.path.join(folder, f"model-rank-{rank}-part-*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                sl = f.get_slice(key)
                held[key] = {"dtype": sl.get_dtype(), "shape": list(sl.get_shape()), "file": os.path.basename(path)}
    return held


def _precheck(table: dict, held: dict, aliases: dict) -> dict:
    """The harness's own diff of the files against the engine table (vLLM itself stops at the first problem).

    A file key that is not in the table but is another state_dict name of a table key (an alias
    ``_filter_subtensors`` dropped) is listed under ``alias_names`` and its dtype/shape are still compared.
    """
    unexpected = sorted(k for k in held if k not in table)
    alias_names = {k: aliases[k] for k in unexpected if aliases.get(k)}
    missing = sorted(k for k in table if k not in held)
    missing_even_by_alias = sorted(k for k in missing if k not in alias_names.values())
    dtype_diff, smaller, other = {}, {}, {}
    for k in sorted(held):
        ek = k if k in table else alias_names.get(k)
        if ek is None:
            continue
        fd, ed = dtypes.TORCH_NAMES.get(held[k]["dtype"], held[k]["dtype"]), table[ek]["dtype"]
        if fd != ed:
            dtype_diff[k] = {"file": fd, "engine": ed}
        fs, es = held[k]["shape"], table[ek]["shape"]
        if fs != es:
            entry = {"file": fs, "engine": es}
            if len(fs) == len(es) and all(a <= b for a, b in zip(fs, es)):
                smaller[k] = entry
            else:
                other[k] = entry
    return {
        "unexpected_keys": unexpected,
        "missing_keys": missing,
        "alias_names": alias_names,
        "missing_even_by_alias": missing_even_by_alias,
        "dtype_mismatch": dtype_diff,
        "smaller_shape": smaller,
        "other_shape_mismatch": other,
    }


def op_expect(job: dict) -> dict:
    model, _cfg, _mc, report = _build(job, "sharded_state")
    table, aliases = _table(model)
    return {**report, "keys": table, "aliases": aliases}


def op_sharded_load(job: dict) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    model, cfg, model_config, report = _build(job, "sharded_state")
    table, aliases = _table(model)
    folder = job["folder"]
    rank = int(job["rank"])
    load_config = cfg.load_config if job["component"] == "model" else get_draft_load_config(cfg)
    loader = get_model_loader(load_config)
    result = {
        **report,
        "loader": f"{type(loader).__module__}.{type(loader).__qualname__}",
        "keys": table,
        "aliases": aliases,
        "folder": str(folder),
        "files": _file_headers(folder, rank),
    }
    result["precheck"] = _precheck(table, result["files"], aliases)
    meter = load_meter.LoadMeter()
    real_iterate = loader.iterate_over_files  # ShardedStateLoader's own reader of the rank's files, counted
    loader.iterate_over_files = lambda paths: meter.counted(real_iterate(paths))
    t0 = time.perf_counter()
    with _capture() as cap:
        try:
            with set_current_vllm_config(cfg), meter:  # as vLLM's GPU worker holds it while loading
                loader.load_weights(model, _ModelConfigAt(model_config, folder))
            result["exception"] = None
        except Exception as e:  # noqa: BLE001 - reported, not handled
            result["exception"] = _exception(e)
    result["load_seconds"] = round(time.perf_counter() - t0, 3)
    result["load_cost"] = meter.figures()
    result["load_log"] = [r for r in cap["log"] if r["level"] != "DEBUG"]
    result["load_warnings"] = cap["warnings"]
    result["dump"] = _dump(model, job.get("dump")) if result["exception"] is None else None
    return result


class _WriteRecorder:
    """Records, per source tensor being loaded, which filtered state-dict keys an in-place op wrote to.

    The source is the tensor the loader's weight iterator last yielded, or, for a write made after the iterator is
    exhausted (a wrapper that defers part of the stream and loads clones of it afterwards, as vLLM 0.33's
    ``stream_language_model_first`` does for the vision tower of DeepseekV4ForConditionalGeneration and
    DeepseekV41ForCausalLM), the source tensor the written data was computed from: every op's output storage
    inherits the name of a source-derived input's storage."""

    def __init__(self, model):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        kept = _filtered(model)
        self.ranges = []  # (start, end, key)
        for k, t in kept.items():
            if t.numel():
                start = t.data_ptr()
                self.ranges.append((start, start + t.numel() * t.element_size(), k))
        self.current = None
        self.by_storage: dict[int, str] = {}  # storage address of a source tensor (or of data derived from it)
        self.param_storages = {t.untyped_storage().data_ptr() for t in kept.values() if t.numel()}
        self.provenance: dict[str, set] = {}
        self.source_dtypes: dict[str, str] = {}
        self.source_shapes: dict[str, list] = {}
        recorder = self

        def storage_of(t) -> int | None:
            try:
                return t.untyped_storage().data_ptr()
            except Exception:  # noqa: BLE001 - a tensor without storage (sparse, meta wrapper)
                return None

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
                kwargs = kwargs or {}
                schema = getattr(func, "_schema", None)
                written, read = [], []
                if schema is not None:
                    for i, a in enumerate(schema.arguments):
                        val = args[i] if i < len(args) else kwargs.get(a.name)
                        if isinstance(val, torch.Tensor):
                            is_write = a.alias_info is not None and a.alias_info.is_write
                            (written if is_write else read).append(val)
                derived = None
                if recorder.by_storage:
                    derived = next(
                        (recorder.by_storage[p] for a in read if (p := storage_of(a)) in recorder.by_storage), None
                    )
                source = recorder.current if recorder.current is not None else derived
                if source is not None:
                    for val in written:
                        if val.numel():
                            recorder._note(val, source)
                out = func(*args, **kwargs)
                if derived is not None and not written and isinstance(out, torch.Tensor):
                    p = storage_of(out)
                    if p is not None and p not in recorder.param_storages:
                        recorder.by_storage[p] = derived  # a fresh allocation: any older entry is stale
                return out

        self.mode = Mode()

    def _note(self, t, source: str) -> None:
        a = t.data_ptr()
        b = a + t.numel() * t.element_size()  # views written by loaders are contiguous slices or narrows
        for s, e, k in self.ranges:
            if a < e and s < b:
                self.provenance.setdefault(source, set()).add(k)

    def wrap(self, weights):
        for name, tensor in weights:
            self.current = name
            self.source_dtypes[name] = _dtype_name(tensor.dtype)
            self.source_shapes[name] = list(tensor.shape)
            ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else None
            if ptr is not None:
                self.by_storage[ptr] = name
            yield name, tensor
        self.current = None


def op_stock_load(job: dict) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    source = job.get("source") or job["config"]
    job = {**job, "config": source} if not job.get("config") else job
    model, cfg, model_config, report = _build(job, "auto")
    table, aliases = _table(model)
    load_config = cfg.load_config if job["component"] == "model" else get_draft_load_config(cfg)
    loader = get_model_loader(load_config)
    if Path(source).resolve() != Path(model_config.model).resolve():
        model_config = _ModelConfigAt(model_config, source)
    # the write recorder (a dispatch mode on every op of the load) costs time: a timed load can do without it, and
    # then reports no provenance and no untouched keys (None: not known)
    rec = _WriteRecorder(model) if job.get("record", True) else None
    meter = load_meter.LoadMeter()
    real_get_all = loader.get_all_weights
    loader.get_all_weights = lambda mc, m: meter.counted(rec.wrap(real_get_all(mc, m)) if rec else real_get_all(mc, m))
    result = {
        **report,
        "loader": f"{type(loader).__module__}.{type(loader).__qualname__}",
        "keys": table,
        "aliases": aliases,
        "source": str(source),
    }
    t0 = time.perf_counter()
    with _capture() as cap:
        try:
            with set_current_vllm_config(cfg), rec.mode if rec else contextlib.nullcontext(), meter:
                loader.load_weights(model, model_config)
            result["exception"] = None
        except Exception as e:  # noqa: BLE001
            result["exception"] = _exception(e)
    result["load_seconds"] = round(time.perf_counter() - t0, 3)
    result["load_cost"] = meter.figures()
    result["load_log"] = [r for r in cap["log"] if r["level"] != "DEBUG"]
    result["load_warnings"] = cap["warnings"]
    result["recorded"] = rec is not None
    if rec is None:
        result["provenance"] = result["sources_read"] = result["untouched_keys"] = None
    else:
        result["provenance"] = {
            src: {"dtype": rec.source_dtypes.get(src), "shape": rec.source_shapes.get(src), "keys": sorted(keys)}
            for src, keys in sorted(rec.provenance.items())
        }
        result["sources_read"] = {
            src: {"dtype": rec.source_dtypes[src], "shape": rec.source_shapes[src]}
            for src in sorted(rec.source_dtypes)
            if src not in rec.provenance
        }  # read but written nowhere (skipped by the class, e.g. main-model tensors for the MTP)
        touched = set().union(*rec.provenance.values()) if rec.provenance else set()
        result["untouched_keys"] = sorted(k for k in table if k not in touched)
    result["dump"] = _dump(model, job.get("dump")) if result["exception"] is None else None
    if job.get("save") and result["exception"] is None:
        # vLLM's own writer of sharded_state checkpoints (examples/.../save_sharded_state_offline.py uses it)
        from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

        Path(job["save"]).mkdir(parents=True, exist_ok=True)
        ShardedStateLoader.save_model(model, str(job["save"]))
        result["saved"] = sorted(p.name for p in Path(job["save"]).glob(f"model-rank-{job['rank']}-part-*"))
    return result


OPS = {"expect": op_expect, "sharded-load": op_sharded_load, "stock-load": op_stock_load}


def _meta() -> dict:
    import torch
    import vllm

    return {
        "vllm_version": getattr(vllm, "__version__", "?"),
        "torch_version": torch.__version__,
        "stubbed_modules": sorted(set(stubs.STUBBED_MODULES)),
        "stub_calls": sorted(set(stubs.STUB_CALLS)),
    }


def run_job(job: dict) -> dict:
    op = job.get("op")
    if op not in OPS:
        return {"op": op, "error": {"type": "ValueError", "message": f"unknown op {op!r}"}}
    t0 = time.perf_counter()
    try:
        res = OPS[op](job)
        res["error"] = None
    except Exception as e:  # noqa: BLE001 - a failure to build is reported per job
        res = {"error": _exception(e)}
    res["op"] = op
    res["job"] = {k: job[k] for k in job if k != "op"}
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def main(argv: list[str] | None = None) -> int:
    global _REAL_STDOUT
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--site", default=os.environ.get("ENGINE_SITE", str(DEFAULT_SITE)))
    sub = p.add_subparsers(dest="op", required=True)
    for name in OPS:
        s = sub.add_parser(name)
        s.add_argument(
            "--config", required=True, help="folder with the DeepSeek V4/V4.1 config.json (the source checkpoint)"
        )
        s.add_argument("--tp", type=int, required=True)
        s.add_argument("--rank", type=int, default=0)
        s.add_argument("--ep", action="store_true", help="--enable-expert-parallel")
        s.add_argument("--component", choices=list(stubs.COMPONENTS), default="model")
        if name == "sharded-load":
            s.add_argument("--folder", required=True, help="OUT/model, OUT/mtp or OUT/dspark")
        if name == "stock-load":
            s.add_argument("--source", help="original checkpoint folder (default: --config)")
            s.add_argument("--save", help="then write the loaded model with vLLM's ShardedStateLoader.save_model here")
        if name != "expect":
            s.add_argument("--dump", help="write the loaded filtered state dict to this safetensors file")
    b = sub.add_parser("batch")
    b.add_argument("jobs", help="JSON file ({'jobs': [...]}) or - for stdin")
    sub.add_parser("serve", help="answer batches, one JSON line each, until stdin closes")
    args = p.parse_args(argv)

    # Keep stdout for the one JSON answer: everything else (vLLM's logs, prints) goes to stderr.
    sys.stdout.flush()
    _REAL_STDOUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    bootstrap(Path(args.site))
    if args.op == "serve":
        rc = serve()
        sys.stderr.flush()
        os._exit(rc)  # vLLM's exit handlers take seconds and have nothing left to do
    if args.op == "batch":
        text = sys.stdin.read() if args.jobs == "-" else Path(args.jobs).read_text()
        jobs = json.loads(text)["jobs"]
        out = {"results": [run_job(j) for j in jobs]}
    else:
        job = {k: v for k, v in vars(args).items() if k not in ("site",)}
        out = run_job(job)
    out["meta"] = _meta()
    for cache in stubs.TEMP_CACHE:
        shutil.rmtree(cache, ignore_errors=True)
    json.dump(out, _REAL_STDOUT, indent=1)
    _REAL_STDOUT.write("\n")
    _REAL_STDOUT.flush()
    failed = [r for r in out.get("results", [out]) if r.get("error")]
    return 1 if failed else 0


def serve() -> int:
    """Answer ``{"jobs": [...]}`` lines from stdin with one ``{"results": [...], "meta": ...}`` line each."""
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            out = {"results": [run_job(j) for j in json.loads(line)["jobs"]], "meta": _meta()}
            _REAL_STDOUT.write(json.dumps(out) + "\n")
            _REAL_STDOUT.flush()
    finally:
        for cache in stubs.TEMP_CACHE:
            shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
