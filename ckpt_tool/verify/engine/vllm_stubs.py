"""Build an installed vLLM's own DeepSeek V4 classes on a machine without a GPU: what must be stubbed, and nothing else.

This file is loaded BY PATH by ``probe.py`` (run with the serving environment's interpreter, which need not have
ckpt_tool installed) and by ``tests/engine/vllm_worker.py``: it imports only the standard library at module
level; torch and vllm are imported inside the functions, after :func:`bootstrap`.

What is stubbed, and why:

* vLLM's compiled extensions (``vllm._C*``, ``_moe_C``, ``_flashmla*``, flash-attn, ``_deepselect_C``, ... and any
  other extension module under ``vllm.``) and the vendored CUDA-only ``vllm.third_party.deep_gemm``: they need
  CUDA libraries. Stub attributes are objects that raise when called: no kernel runs. ``torch.ops._C`` etc.
  answer the few capability queries made at import as vLLM's CUDA build would for the capability asked, and
  registering fake (meta) kernels for those absent ops is skipped.
* ``vllm.platforms.current_platform``: a CudaPlatform answering as the faked GPU (:data:`H100`, SM90, unless the
  checkpoint is one a user serves on Blackwell: :func:`gpu_for_checkpoint`) whose device type is ``cpu`` (tensors
  vLLM allocates on "the device" land on CPU). :func:`engine_config` picks the GPU for each checkpoint.
* On the faked B200 (SM100) only, the two FlashInfer availability questions vLLM's MoE backend choice asks at build
  time (:func:`_answer_flashinfer`): FlashInfer is a requirement of every vLLM CUDA wheel, absent here.
* ``torch.cuda.Stream`` / ``torch.cuda.Event`` (constructed by the V4 layers, never used without a forward).
* ``torch.cuda.get_device_properties`` (answers as the faked GPU: its SM count and capability) and
  ``torch.accelerator.current_device_index`` (answers 0): DeepSeek V4.1's Engram table (``ParallelEngramEmbedding``)
  reads the current device's SM count while it is built; a CPU build of torch raises "no accelerator" for both.
* DeepSeek V4.1's Engram storage (a config choice, not a stub; :func:`engine_config`): ``--engram-config
  '{"cpu_offload": false}'``. vLLM's default keeps the tables in pinned host memory read through UVA, which needs a
  GPU; with it off they are ordinary device tensors of the very same names, shapes and dtypes (the sharded_state
  keys do not depend on it).
* vLLM's process groups (world, TP, PP, DP, EP, PCP, DCP): fake GroupCoordinators of the sizes vLLM would make
  for one node with ``--tensor-parallel-size T`` (EP group = TP ranks, as vLLM builds it), no communication.
* The model registry's "inspect the model class in a subprocess" is run in-process (the subprocess would not
  have the stubs).
* Config: ``kernel_config.enable_jit_warmup = False`` where the release has it (it only registers TileLang/Triton
  JIT warmups, which need the CUDA-only ``tilelang``); this does not change any parameter.
* Log capture (not a stub): vLLM re-applies its logging ``dictConfig`` when the first engine config of a process is
  made, which drops the handler :func:`capture` put on the "vllm" logger; it is put back after that call.
* Model runner choice, for a DSpark draft only (:func:`gpu_model_runner`): vLLM 0.33's ``VllmConfig`` falls back to
  Model Runner V1 when Triton is not importable (``vllm.config.vllm.HAS_TRITON``; a CUDA install always has it,
  torch's CUDA wheels require it), and V1 refuses ``method="dspark"``. While a DSpark engine config (or the draft's
  own config) is made, that one name answers True, as on the GPU; ``vllm.triton_utils`` is left alone, so no Triton
  kernel is imported. Releases without that fallback (0.34) are not touched; model and MTP configs never are.
  DeepSeek V4.1 classes are also built under it (:func:`build_runner`): their layers ask which runner they serve.

Every failure to import or build is raised as :class:`EngineUnavailable` naming the stage that failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import sys
import tempfile
import types
import warnings
from pathlib import Path

# Names of what was stubbed (reported with every answer).
STUBBED_MODULES: list[str] = []
STUB_CALLS: list[str] = []

# Compiled extensions of the vLLM wheel (need libcudart/libtorch_cuda) and CUDA-only packages. Any other
# extension module under ``vllm.`` (a newer release's) is stubbed too, see _StubFinder.
STUB_EXACT = (
    "vllm._C",
    "vllm._C_stable_libtorch",
    "vllm._moe_C",
    "vllm._moe_C_stable_libtorch",
    "vllm._qutlass_C",
    "vllm._flashmla_C",
    "vllm._flashmla_extension_C",
    "vllm._flashkda_C",
    "vllm._deepselect_C",
    "vllm.cumem_allocator",
    "vllm.fs_io_C",
    "vllm.spinloop",
    "vllm.vllm_flash_attn._vllm_fa2_C",
    "vllm.vllm_flash_attn._vllm_fa3_C",
)
STUB_PACKAGES = ("vllm.third_party.deep_gemm",)  # vendored DeepGEMM: imports its CUDA extension at import time
STUB_OP_NAMESPACES = (
    "_C",
    "_moe_C",
    "_C_cache_ops",
    "_C_custom_ar",
    "_rocm_C",
    "_qutlass_C",
    "_flashmla_C",
    "_flashmla_extension_C",
    # vllm._deepselect_C (vLLM 0.34.0 model_executor/layers/indexer_topk.py): asked on the SM100 family while the
    # config of a DeepSeek V4 / V4.1 with an indexer is checked (models/config.py _indexer_sparse_logits_supported);
    # it decides a runtime kernel, no parameter
    "deep_select",
)


class EngineUnavailable(Exception):
    """vLLM is absent, or its classes cannot be built on this machine; ``stage`` names the step that failed,
    ``hint`` (or None) what to install where the cause is a module missing from the environment."""

    def __init__(self, stage: str, message: str, kind: str = "build", hint: str | None = None) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.kind = kind  # "no-vllm" | "build"
        self.hint = hint


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _innermost(exc: BaseException) -> BaseException:
    """The exception at the bottom of ``exc``'s chain (``raise ... from``, or raised while handling another)."""
    seen = {id(exc)}
    while True:
        below = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if below is None or id(below) in seen:
            return exc
        seen.add(id(below))
        exc = below


def _root_cause(exc: BaseException, logged: list[BaseException]) -> BaseException:
    """What made a step fail. vLLM catches some failures, logs them and fails later for want of the result: its
    model registry (``_try_inspect_model_cls`` in vllm/model_executor/models/registry.py, 0.33.0 and 0.34.0) logs the
    import error of the model class and returns None, and ``ModelConfig``'s validator then raises "Model
    architectures [...] failed to be inspected. Please check the logs", which pydantic wraps in a ValidationError.
    Behind such a wrapper the first exception vLLM logged during the step is the cause; else pydantic's own error."""
    inner = _innermost(exc)
    wrapper = type(inner).__name__ == "ValidationError" or "check the logs" in str(inner).lower()
    if wrapper and logged:
        return _innermost(logged[0])
    if type(inner).__name__ == "ValidationError" and hasattr(inner, "errors"):
        try:
            wrapped = (inner.errors()[0].get("ctx") or {}).get("error")
        except Exception:  # noqa: BLE001 - another pydantic: keep its own message
            wrapped = None
        if isinstance(wrapped, BaseException):
            return _innermost(wrapped)
    return inner


# Top-level modules vLLM imports whose distribution (in vLLM's Requires-Dist) has another name.
_DISTRIBUTION_OF = {
    "cpuinfo": "py-cpuinfo",
    "cv2": "opencv-python-headless",
    "google": "protobuf",
    "lmformatenforcer": "lm-format-enforcer",
    "PIL": "pillow",
    "pythonjsonlogger": "python-json-logger",
    "yaml": "pyyaml",
    "zmq": "pyzmq",
}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install_hint(cause: BaseException) -> str | None:
    """What to install, and where, when ``cause`` is a module missing from this environment (None: it is not)."""
    if not isinstance(cause, ImportError) or not getattr(cause, "name", None):
        return None
    module = cause.name.split(".")[0]
    if module in ("vllm", "torch"):
        return None  # not one package missing: the installation itself is broken
    want = _normal(_DISTRIBUTION_OF.get(module, module))
    try:
        version = importlib.metadata.version("vllm")
        requires = importlib.metadata.requires("vllm") or []
    except importlib.metadata.PackageNotFoundError:
        version, requires = None, []
    for req in requires:
        spec = req.split(";")[0].strip()
        name = re.match(r"[A-Za-z0-9._-]+", spec)
        if name and _normal(name.group(0)) == want and "extra ==" not in req:
            spec = re.sub(r"\[[^]]*\]", "", spec).replace(" ", "")  # the package itself, not its extras
            return (
                f"vLLM {version} requires {spec}, missing from {sys.executable}'s environment: install it there "
                f"({sys.executable} -m pip install '{spec}')"
            )
    again = f"'vllm=={version}'" if version else "vllm"
    return (
        f"module {module!r} is missing from {sys.executable}'s environment: install vLLM's requirements there "
        f"({sys.executable} -m pip install {again})"
    )


class _LoggedExceptions(logging.Handler):
    """The exceptions vLLM logs (``logger.exception``) while a step runs."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.exceptions: list[BaseException] = []

    def emit(self, record):
        if record.exc_info and record.exc_info[1] is not None:
            self.exceptions.append(record.exc_info[1])


@contextlib.contextmanager
def stage(name: str):
    """Run a bootstrap/build step; any exception becomes :class:`EngineUnavailable` naming the step and the innermost
    cause (:func:`_root_cause`), with what to install when that is a missing module."""
    logged = _LoggedExceptions()
    logger = logging.getLogger("vllm")
    logger.addHandler(logged)
    _CAPTURING.append(logged)  # kept across vLLM's own logging setup, as capture()'s handlers are
    try:
        yield
    except EngineUnavailable:
        raise
    except BaseException as exc:  # noqa: BLE001 - vLLM may raise anything (SystemExit, ImportError, ...)
        if isinstance(exc, KeyboardInterrupt):
            raise
        cause = _root_cause(exc, logged.exceptions)
        said = _describe(cause)
        if cause is not exc:
            said += f" (vLLM then raised {type(exc).__name__})"
        raise EngineUnavailable(name, said, hint=install_hint(cause)) from exc
    finally:
        _CAPTURING.remove(logged)
        logger.removeHandler(logged)


class _Stub:
    """An attribute of a stubbed extension: attribute access gives more stubs, a call raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        STUB_CALLS.append(self._name)
        raise RuntimeError(f"stubbed CUDA kernel/extension called on CPU: {self._name}")

    def __repr__(self):
        return f"<stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of vLLM's compiled extensions (listed, or found as an extension module) with stubs."""

    def _match(self, name: str, path) -> bool:
        if name in STUB_EXACT or any(name == p or name.startswith(p + ".") for p in STUB_PACKAGES):
            return True
        if not name.startswith("vllm.") or path is None:
            return False
        found = importlib.machinery.PathFinder.find_spec(name, path)
        return found is not None and isinstance(found.loader, importlib.machinery.ExtensionFileLoader)

    def find_spec(self, name, path=None, target=None):
        if self._match(name, path):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        STUBBED_MODULES.append(spec.name)
        return mod

    def exec_module(self, module):
        pass


class _OpsNamespace:
    """``torch.ops.<ns>`` of a compiled extension that is not loaded.

    Capability queries made while importing/building answer as vLLM's CUDA build would for the capability they
    pass; any other op is a stub that raises when called.
    """

    ANSWERS = {
        "cutlass_scaled_mm_supports_fp8": lambda cap: cap >= 89,
        "cutlass_scaled_mm_supports_block_fp8": lambda cap: cap >= 90,
        "cutlass_scaled_mm_supports_fp4": lambda cap: cap >= 100,
        "cutlass_group_gemm_supported": lambda cap: cap in (90, 100),
        # the row-stride alignment DeepSelect needs, (input, output) bytes: "1024B / 32B on SM100" (vLLM 0.34.0
        # model_executor/kernels/attention/dsa/sparse_mqa_logits.py check_deep_select_layout)
        "get_alignment_requirement": lambda: (1024, 32),
    }

    def __init__(self, ns: str):
        self._ns = ns

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr in self.ANSWERS:
            fn = self.ANSWERS[attr]

            def answer(*args, **kwargs):
                STUB_CALLS.append(f"torch.ops.{self._ns}.{attr} (answered)")
                return fn(*args, **kwargs)

            return answer
        return _Stub(f"torch.ops.{self._ns}.{attr}")


class _CudaObject:
    """torch.cuda.Stream / Event stand-in (a CPU machine cannot construct them)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"torch.cuda.{type(self).__name__}.{attr}")


@dataclasses.dataclass(frozen=True)
class FakeGpu:
    """The GPU the stubs answer as: what vLLM's platform and ``torch.cuda.get_device_properties`` report."""

    name: str
    major: int
    minor: int
    multi_processor_count: int
    total_memory: int
    l2_cache_size: int

    @property
    def sm(self) -> str:
        return f"SM{self.major}{self.minor}"


H100 = FakeGpu("NVIDIA H100 80GB HBM3", 9, 0, 132, 80 << 30, 50 << 20)
# Blackwell, what NVIDIA's NVFP4 exports are made for: vLLM picks its FlashInfer NVFP4 MoE backends only on the
# SM100 family (TrtLlmNvFp4Experts*._supports_current_device, fused_moe/experts/trtllm_nvfp4_moe.py, 0.33 and 0.34).
B200 = FakeGpu("NVIDIA B200", 10, 0, 148, 180 << 30, 126 << 20)
FAKE_GPUS = {"H100": H100, "B200": B200}
_GPU = [H100]  # the GPU answered now (use_gpu); bootstrap starts as an H100


def current_gpu() -> FakeGpu:
    """The GPU the stubs answer as now."""
    return _GPU[0]


def _device_properties(device=None):
    """``torch.cuda.get_device_properties`` of the faked GPU: what a CPU machine cannot query."""
    gpu = current_gpu()
    STUB_CALLS.append(f"torch.cuda.get_device_properties (answered as an {gpu.sm} {gpu.name})")
    return types.SimpleNamespace(
        name=gpu.name,
        major=gpu.major,
        minor=gpu.minor,
        multi_processor_count=gpu.multi_processor_count,
        total_memory=gpu.total_memory,
        L2_cache_size=gpu.l2_cache_size,
        warp_size=32,
        is_integrated=False,
        is_multi_gpu_board=False,
    )


def _current_device_index() -> int:
    """``torch.accelerator.current_device_index``: device 0 (a CPU build raises "no accelerator")."""
    STUB_CALLS.append("torch.accelerator.current_device_index (answered 0)")
    return 0


_BOOTED = False
TEMP_CACHE: list[str] = []  # VLLM_CACHE_ROOT folders bootstrap made (the caller removes them when done)


def bootstrap(site: str | Path | None = None) -> None:
    """Make ``import vllm`` work on a machine without a GPU, stubbing only what needs CUDA.

    ``site``: a folder holding vllm (put first on ``sys.path``); None: the interpreter's own vllm.
    Raises :class:`EngineUnavailable` (``kind`` "no-vllm" when there is no vllm to import).
    """
    global _BOOTED
    if _BOOTED:
        return
    _find_vllm(site)
    _set_environment()
    sys.meta_path.insert(0, _StubFinder())
    # the bootstrap itself: torch and vLLM are imported here, after the finder and the environment they need
    with stage("import torch"):
        import torch
    _stub_torch(torch)

    with stage("import vllm"):
        import vllm
        import vllm.platforms

    with stage("stub vLLM's CUDA platform (vllm.platforms.cuda.CudaPlatformBase as the faked GPU on cpu)"):
        vllm.platforms._current_platform = _fake_platform()

    with stage("run vLLM's model registry in-process (vllm.model_executor.models.registry)"):
        import vllm.model_executor.models.registry as registry

        registry._run_in_subprocess = lambda fn: fn()

    import vllm.logger as vllm_logger  # the bootstrap: see above

    if hasattr(vllm_logger, "dictConfig"):  # keep capture() collecting across vLLM's own logging setup
        vllm_logger.dictConfig = _keep_capturing(vllm_logger.dictConfig)
    _BOOTED = True


def _find_vllm(site: str | Path | None) -> None:
    """Put ``site`` first on ``sys.path`` (when given) and make sure a vllm is importable."""
    if site is not None:
        site = Path(site)
        if not (site / "vllm" / "__init__.py").is_file():
            raise EngineUnavailable("find vllm", f"vllm is not installed in {site}", kind="no-vllm")
        sys.path.insert(0, str(site))
    if importlib.util.find_spec("vllm") is None:
        raise EngineUnavailable("find vllm", f"no vllm importable by {sys.executable}", kind="no-vllm")


def _set_environment() -> None:
    """vLLM's environment for a judge: its log on stderr at INFO, nothing fetched or reported over the network."""
    # The loader's warnings are part of the result: vLLM logs at INFO, to stderr (stdout carries the answer).
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_LEVEL"] = "INFO"
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "VLLM_CACHE_ROOT" not in os.environ:
        os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="vllm-cache-")
        TEMP_CACHE.append(os.environ["VLLM_CACHE_ROOT"])


def _stub_torch(torch) -> None:
    """The CUDA-only corners of torch that vLLM's model modules touch at import and build time."""
    for ns in STUB_OP_NAMESPACES:
        setattr(torch.ops, ns, _OpsNamespace(ns))
    real_register_fake = torch.library.register_fake

    def register_fake(op, *args, **kwargs):
        if isinstance(op, str) and op.split("::")[0] in STUB_OP_NAMESPACES:
            return args[0] if args else (lambda fn: fn)
        return real_register_fake(op, *args, **kwargs)

    torch.library.register_fake = register_fake
    torch.cuda.Stream = type("Stream", (_CudaObject,), {})
    torch.cuda.Event = type("Event", (_CudaObject,), {})
    # Queried while building DeepSeek V4.1's Engram tables (ParallelEngramEmbedding reads the SM count of the current
    # device to size its lookup grid): answered as the GPU the platform below stands for, device 0.
    torch.cuda.get_device_properties = _device_properties
    torch.accelerator.current_device_index = _current_device_index


def _fake_platform():
    """vLLM's CUDA platform answering as the faked GPU (:func:`current_gpu`), with allocations on the CPU."""
    # after bootstrap(): vLLM (and torch) import only once its stubs and environment are in place
    from vllm.platforms import cuda as vllm_cuda
    from vllm.platforms.interface import DeviceCapability

    class FakeCudaPlatform(vllm_cuda.CudaPlatformBase):
        """A CUDA platform that answers as the faked GPU (H100 or B200); allocations go to the CPU."""

        device_type = "cpu"

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            gpu = current_gpu()
            return DeviceCapability(major=gpu.major, minor=gpu.minor)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return current_gpu().name

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return current_gpu().total_memory

        @classmethod
        def is_fully_connected(cls, physical_device_ids) -> bool:
            return True

        @classmethod
        def device_count(cls) -> int:
            return 8

    return FakeCudaPlatform()


def gpu_for_checkpoint(config_dir: str | Path) -> FakeGpu:
    """The GPU a user serves this checkpoint on: a B200 (SM100) for NVIDIA's NVFP4 exports (config.json's
    ``quantization_config.moe_quant_algo`` is ``NVFP4``, read as vLLM reads it: ``DeepseekV4FP8Config.
    _resolve_moe_overrides``, models/deepseek_v41/quant_config.py:95-104, 0.33.0 and 0.34.0), whose experts run
    natively on Blackwell; an H100 (SM90) for every other checkpoint."""
    quant = text_config(config_dir).get("quantization_config") or {}
    algo = quant.get("moe_quant_algo") if isinstance(quant, dict) else None
    return B200 if str(algo or "").upper() == "NVFP4" else H100


def use_gpu(gpu: FakeGpu) -> None:
    """Answer as ``gpu`` from now on (:func:`engine_config` calls it for each checkpoint).

    A change forgets what vLLM cached about the GPU before (:func:`_forget_cached_answers`), so that a served worker
    builds each job as a fresh process on that GPU would; on the SM100 family the FlashInfer questions of the MoE
    backend choice are answered (:func:`_answer_flashinfer`)."""
    if gpu == current_gpu():
        return
    _GPU[0] = gpu
    _forget_cached_answers()
    if gpu.major == 10:
        _answer_flashinfer()
    STUB_CALLS.append(f"faked GPU: {gpu.sm} {gpu.name}")


def _forget_cached_answers() -> None:
    """Clear every ``functools.cache`` / ``lru_cache`` of a function defined in a loaded vLLM module.

    vLLM caches answers that depend on the GPU for the life of the process (``is_deep_gemm_supported`` and
    ``is_deep_gemm_e8m0_used`` in utils/deep_gemm.py, ``is_flashinfer_fp8_blockscale_gemm_supported`` in
    utils/flashinfer.py, ...): a real process never changes GPU. Clearing them makes vLLM ask again; no cached value
    is a parameter, so nothing it builds depends on the clearing beyond that."""
    import functools

    for name, module in list(sys.modules.items()):
        if module is None or not (name == "vllm" or name.startswith("vllm.")):
            continue
        for value in list(vars(module).values()):
            # isinstance, not hasattr: an attribute check can trigger a lazy module's import
            if isinstance(value, functools._lru_cache_wrapper) and getattr(value, "__module__", None) == name:
                value.cache_clear()


# (module, function it imports from vllm.utils.flashinfer, vLLM code that asks it while a model is built)
_FLASHINFER_QUESTIONS = (
    (
        "vllm.model_executor.layers.fused_moe.experts.trtllm_nvfp4_moe",
        "has_flashinfer_trtllm_fused_moe",
        "TrtLlmNvFp4ExpertsBase._supports_current_device (0.33.0 :204-211, 0.34.0 :227-234): the NVFP4 MoE backend "
        "FLASHINFER_TRTLLM, which select_nvfp4_moe_backend (fused_moe/oracle/nvfp4.py) tries first",
    ),
    (
        "vllm.model_executor.layers.fused_moe.experts.trtllm_mxfp4_moe",
        "has_flashinfer",
        "TrtLlmMxfp4ExpertsBase._supports_current_device (0.33.0 :121-123, 0.34.0 :123-125): the MXFP4 MoE backend "
        "FLASHINFER_TRTLLM_MXFP4_MXFP8 of the experts an NVFP4 export leaves MXFP4 (its `ignore`), which "
        "select_deepseek_v4_mxfp4_moe_backend (fused_moe/oracle/mxfp4.py) tries first",
    ),
)


def _answer_flashinfer() -> None:
    """FlashInfer is a requirement of every vLLM CUDA wheel (``Requires-Dist: flashinfer-python`` in 0.33.0 and
    0.34.0) and absent here: vLLM's own check (``vllm.utils.flashinfer.has_flashinfer``, a ``find_spec``) says no,
    and its MoE backend choice would then fall past the FlashInfer backends a B200 gets. The two questions that
    choice asks at build time (:data:`_FLASHINFER_QUESTIONS`) answer yes on the SM100 family, in the module that asks
    each, and fall through to vLLM's own answer on any other GPU; nothing else sees FlashInfer (no kernel of it runs
    while a model is built or loaded: ``process_weights_after_loading`` is not run)."""
    for module_name, function, _asked_by in _FLASHINFER_QUESTIONS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # a release without that backend: vLLM cannot ask
        asked = getattr(module, function, None)
        if asked is None or getattr(asked, "_ckpt_tool_answer", False):
            continue

        def answer(*args, _own=asked, _name=f"{module_name}.{function}", **kwargs):
            if current_gpu().major == 10:
                STUB_CALLS.append(f"{_name} (answered True on the faked SM100)")
                return True
            return _own(*args, **kwargs)

        answer._ckpt_tool_answer = True
        setattr(module, function, answer)


def fake_groups(tp: int, rank: int) -> None:
    """vLLM's process groups as one node with ``--tensor-parallel-size tp`` would make them, seen from ``rank``."""
    # after bootstrap(): vLLM (and torch) import only once its stubs and environment are in place
    import torch
    import vllm.distributed.parallel_state as ps

    class FakeGroup(ps.GroupCoordinator):
        def __init__(self, name: str, world: int, rank_in_group: int):  # no torch.distributed, no communicator
            self.unique_name = name
            self.world_size = world
            self.rank_in_group = rank_in_group
            self.ranks = list(range(world))
            self.group_ranks = [self.ranks]
            self.rank = rank_in_group
            self.local_rank = rank_in_group
            self.device_index = rank_in_group
            self.device = torch.device("cpu")
            self.cpu_group = None
            self.device_group = None
            self.use_device_communicator = False
            self.device_communicator = None
            self.mq_broadcaster = None

    sizes = {
        "_WORLD": (tp, rank),
        "_INNER_DP_WORLD": (1, 0),
        "_TP": (tp, rank),
        "_ETP": (tp, rank),
        "_PP": (1, 0),
        "_DP": (1, 0),
        "_EP": (tp, rank),  # vLLM's EP group spans DP x PCP x TP ranks, enabled or not
        "_PCP": (1, 0),
        "_DCP": (1, 0),
    }
    for attr, (world, r) in sizes.items():
        setattr(ps, attr, FakeGroup(attr.strip("_").lower(), world, r))


def text_config(config_dir: str | Path) -> dict:
    """config.json's text-model keys: the top level, and for a nested config (DeepSeek V4.1, ``model_type:
    deepseek_v41``) its ``text_config`` on top, as vLLM's DeepseekV41Config flattens them
    (transformers_utils/configs/deepseek_v41.py)."""
    with open(Path(config_dir) / "config.json") as fh:
        config = json.load(fh)
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def is_v41(config_dir: str | Path) -> bool:
    """config.json is DeepSeek V4.1's (``model_type: deepseek_v41``: DeepseekV41ForCausalLM, DSparkV41DraftModel)."""
    with open(Path(config_dir) / "config.json") as fh:
        return json.load(fh).get("model_type") == "deepseek_v41"


def speculative_method(config_dir: str | Path) -> str | None:
    """The draft ``vllm serve`` is asked for with this checkpoint: ``"dspark"`` when config.json names the DSpark
    draft's target layers (``dspark_target_layer_ids``), ``"mtp"`` when it has MTP layers, else None (a nested V4.1
    config: its ``text_config`` keys)."""
    config = text_config(config_dir)
    if config.get("dspark_target_layer_ids"):
        return "dspark"
    return "mtp" if int(config.get("num_nextn_predict_layers") or 0) else None


@contextlib.contextmanager
def gpu_model_runner():
    """Make a DSpark config as on a GPU: vLLM 0.33 picks Model Runner V1 when Triton is not importable (it is on
    every CUDA install) and V1 refuses ``method="dspark"``; ``vllm.config.vllm.HAS_TRITON`` answers True meanwhile
    (only that module's name: no Triton kernel is imported). A release without the name (0.34) is not touched."""
    import vllm.config.vllm as vllm_config_module  # after bootstrap(): see build_model

    if getattr(vllm_config_module, "HAS_TRITON", True):
        yield
        return
    STUB_CALLS.append("vllm.config.vllm.HAS_TRITON (answered True: model runner choice for DSpark)")
    vllm_config_module.HAS_TRITON = True
    try:
        yield
    finally:
        vllm_config_module.HAS_TRITON = False


def build_runner(cfg):
    """The model runner a class is built for, as on a GPU: DeepSeek V4.1's layers ask ``use_v2_model_runner`` while
    they are built (attention's eager-region choice and SWA bounded replay, the Engram hash's slot cache; no
    parameter depends on it), which vLLM 0.33 answers False without Triton: :func:`gpu_model_runner` for a V4.1
    config, nothing for any other."""
    hf_config = getattr(cfg.model_config, "hf_config", None)
    if getattr(hf_config, "model_type", None) == "deepseek_v41":
        return gpu_model_runner()
    return contextlib.nullcontext()


def engine_config(
    config_dir: str | Path,
    tp: int,
    ep: bool,
    load_format: str,
    draft_dir: str | Path | None = None,
    gpu: str | None = None,
):
    """vLLM's engine config for ``vllm serve config_dir --tensor-parallel-size tp [--enable-expert-parallel]
    --load-format load_format --speculative-config SPEC``, SPEC being ``{"method": "mtp", "model": draft_dir,
    "num_speculative_tokens": 1}`` when config.json has MTP layers, ``{"method": "dspark", "model": draft_dir}``
    (num_speculative_tokens left out: 0.33.0 and 0.34.0 both take dspark_block_size) when it has
    ``dspark_target_layer_ids``, none otherwise; ``draft_dir`` defaults to ``config_dir``. Made (and the model then
    built) on the GPU a user serves the checkpoint on (:func:`gpu_for_checkpoint`, :func:`use_gpu`), or on ``gpu``
    (a :data:`FAKE_GPUS` name: an NVFP4 export served on Hopper, whose NVFP4 MoE backend keeps only the local
    experts' input scales)."""
    from vllm.engine.arg_utils import EngineArgs  # after bootstrap(): see build_model

    # before vLLM asks the platform anything about this checkpoint
    use_gpu(FAKE_GPUS[gpu] if gpu else gpu_for_checkpoint(config_dir))
    method = speculative_method(config_dir)
    draft = str(draft_dir or config_dir)
    speculative = None
    if method == "mtp":
        speculative = {"method": "mtp", "model": draft, "num_speculative_tokens": 1}
    elif method == "dspark":
        speculative = {"method": "dspark", "model": draft}
    kwargs = dict(
        model=str(config_dir),
        tokenizer=str(config_dir),
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        load_format=load_format,
        max_model_len=1024,
        kernel_config={"enable_jit_warmup": False},
        speculative_config=speculative,
    )
    if text_config(config_dir).get("engram_layer_ids"):
        # DeepSeek V4.1's Engram tables: vLLM's default EngramConfig (cpu_offload=True) puts them in pinned host
        # memory read through UVA, which a machine without a GPU cannot allocate; on the device (cpu_offload=False)
        # they are the very same parameters (names, per-rank shapes, dtypes: ParallelEngramEmbedding).
        kwargs["engram_config"] = {"cpu_offload": False}
    fields = {f.name for f in dataclasses.fields(EngineArgs)} if dataclasses.is_dataclass(EngineArgs) else set(kwargs)
    if "kernel_config" not in fields:  # a release without it has no JIT warmup to switch off
        kwargs.pop("kernel_config")
    with gpu_model_runner() if method == "dspark" else contextlib.nullcontext():
        return EngineArgs(**kwargs).create_engine_config()


class ModelConfigAt:
    """The model config with ``model`` pointing at another folder (what vLLM's loader reads the files from)."""

    def __init__(self, base, folder: str | Path):
        self._base = base
        self.model = str(folder)
        self.model_weights = ""

    def __getattr__(self, attr):
        return getattr(self._base, attr)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[dict] = []

    def emit(self, record):
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            msg = str(record.msg)
        self.records.append({"level": record.levelname, "logger": record.name, "message": msg})


_CAPTURING: list[logging.Handler] = []  # the handlers of the capture() blocks now open


def _keep_capturing(dict_config):
    """vLLM's logging setup (``vllm.logger`` applies a ``logging.config.dictConfig`` when an engine config is first
    made in the process) replaces the "vllm" logger's handlers: put the open capture() handlers back after it."""

    def configure(config):
        dict_config(config)
        logger = logging.getLogger("vllm")
        for handler in _CAPTURING:
            if handler not in logger.handlers:
                logger.addHandler(handler)

    return configure


@contextlib.contextmanager
def capture():
    """Collect vLLM's log records and Python warnings: ``box["log"]``, ``box["warnings"]``."""
    handler = _Capture()
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    _CAPTURING.append(handler)
    box: dict = {"log": handler.records, "warnings": []}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield box
    finally:
        _CAPTURING.remove(handler)
        logger.removeHandler(handler)
        box["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]


COMPONENTS = ("model", "mtp", "dspark")


def _draft_method(cfg) -> str | None:
    spec = cfg.speculative_config
    return None if spec is None else spec.method


def component_model_config(cfg, component: str):
    """The model config vLLM builds (and loads) ``component`` with: the target's, the MTP draft's, or the DSpark
    draft's (``speculative_config.draft_model_config``, architectures ``["DSparkDraftModel"]``)."""
    if component == "model":
        return cfg.model_config
    if component in ("mtp", "dspark"):
        method = _draft_method(cfg)
        if method != component:
            if method is None and component == "mtp":
                raise ValueError("config.json has no MTP layer (num_nextn_predict_layers is 0)")
            have = {
                None: "config.json has no dspark_target_layer_ids (no DSpark draft)",
                "mtp": "config.json has an MTP draft, no dspark_target_layer_ids: its component is 'mtp'",
                "dspark": "config.json has dspark_target_layer_ids: its draft is the component 'dspark'",
            }.get(method, f"the speculative method is {method!r}")
            raise ValueError(f"no {component!r} component: {have}")
        return cfg.speculative_config.draft_model_config
    raise ValueError(f"component must be one of {', '.join(map(repr, COMPONENTS))}, got {component!r}")


def component_vllm_config(cfg, component: str):
    """The engine config vLLM builds and loads ``component`` under: ``cfg`` for the target and the MTP draft; for
    the DSpark draft, the draft config of vLLM's ``load_dspark_model`` (v1/worker/gpu/spec_decode/dspark/utils.py):
    the target's config (target model_config kept: the class reads ``speculative_config.draft_model_config``) with
    the draft's parallel, attention, cache and load configs and ``get_draft_quant_config``'s quant config.

    Mirrored, not imported: that module imports the V2 GPU runner's utilities, whose import chain reaches Triton
    kernels (mamba ssd ops) that do not import without Triton under an SM90 platform. What it computes here: PP 1
    at the draft's TP size with EPLB off and no redundant experts (the EPLB branch needs ``--enable-eplb``, which
    ``engine_config`` never sets), ``use_non_causal`` from ``dflash_has_any_non_causal``, the draft attention backend
    (else the target's, for a deepseek_v4 draft), the draft's KV cache dtype if set, ``get_draft_load_config``
    (``get_pp_safe_draft_load_config`` changes nothing at PP 1)."""
    component_model_config(cfg, component)  # checks the component exists
    if component != "dspark":
        return cfg
    # after bootstrap(): vLLM (and torch) import only once its stubs and environment are in place
    from vllm.config import replace
    from vllm.model_executor.model_loader.utils import get_draft_load_config
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.model_executor.models.utils import get_draft_quant_config

    spec = cfg.speculative_config
    draft_model_config = spec.draft_model_config
    if cfg.parallel_config.enable_eplb or cfg.parallel_config.pipeline_parallel_size != 1:
        raise ValueError("the DSpark draft config is mirrored for PP 1 without EPLB only")
    backend = spec.attention_backend
    if backend is None and draft_model_config.hf_config.model_type in ("deepseek_v4", "deepseek_v41"):
        backend = cfg.attention_config.backend
    with gpu_model_runner():
        draft = replace(
            cfg,
            parallel_config=replace(
                cfg.parallel_config,
                pipeline_parallel_size=1,
                tensor_parallel_size=spec.draft_parallel_config.tensor_parallel_size,
                enable_eplb=False,
                eplb_config=replace(cfg.parallel_config.eplb_config, num_redundant_experts=0),
                enable_elastic_ep=False,
            ),
            attention_config=replace(
                cfg.attention_config,
                use_non_causal=dflash_has_any_non_causal(draft_model_config.hf_config),
                backend=backend,
            ),
            cache_config=(
                replace(cfg.cache_config, cache_dtype=spec.kv_cache_dtype)
                if spec.kv_cache_dtype is not None
                else cfg.cache_config
            ),
            load_config=get_draft_load_config(cfg),
        )
    # load_dspark_model: "VllmConfig post-init restores the target's quant config ... so we must override it"
    draft.quant_config = get_draft_quant_config(cfg)
    return draft


def build_model(cfg, model_config, device: str, model_class=None):
    """The model as vLLM's ``BaseModelLoader.load_model`` creates it: under the model dtype and ``device``.

    ``device="meta"`` allocates nothing for the weights (tensors a module places explicitly land on the
    platform's device, the CPU here). ``model_class=None``: the class vLLM's registry picks for the config.
    The DSpark draft (``model_config`` is a dspark speculative config's draft model config) is built under
    :func:`component_vllm_config`'s draft config, as ``load_dspark_model`` builds it."""
    # after bootstrap(): vLLM (and torch) import only once its stubs and environment are in place
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    if _draft_method(cfg) == "dspark" and model_config is cfg.speculative_config.draft_model_config:
        cfg = component_vllm_config(cfg, "dspark")
    with set_default_torch_dtype(model_config.dtype), torch.device(device), build_runner(cfg):
        if model_class is None:
            return initialize_model(vllm_config=cfg, model_config=model_config)
        return initialize_model(cfg, model_class=model_class, model_config=model_config)


class _Placed:
    """A tensor with the address it would have on the device: what vLLM's ``_filter_subtensors`` reads.

    Meta tensors have no addresses (every storage's ``data_ptr()`` is 0). Each distinct storage (by identity)
    gets its own base address, far from the others as separate allocations are; a view's ``data_ptr()`` is the
    base plus its storage offset in bytes, as on a device. Anything else is the tensor's own answer (tensor
    results, such as ``view(-1)[-1]``, stay placed on the same storage).
    """

    __slots__ = ("_t", "_base")

    def __init__(self, t, base: int):
        self._t = t
        self._base = base

    def data_ptr(self) -> int:
        return self._base + self._t.storage_offset() * self._t.element_size()

    def untyped_storage(self):
        return _PlacedStorage(self._base)

    def __getitem__(self, index):
        return self._wrap(self._t[index])

    def _wrap(self, value):
        import torch  # after bootstrap(): see build_model

        return _Placed(value, self._base) if isinstance(value, torch.Tensor) else value

    def __getattr__(self, name):
        value = getattr(self._t, name)
        if callable(value):
            return lambda *a, **k: self._wrap(value(*a, **k))
        return value


class _PlacedStorage:
    __slots__ = ("_base",)

    def __init__(self, base: int):
        self._base = base

    def data_ptr(self) -> int:
        return self._base


STORAGE_SPACING = 1 << 44  # 16 TiB between placed storages: no storage is that large


def storage_key(t) -> tuple:
    """Identity of ``t``'s storage (device, the storage object's address): shared by every view of it."""
    return (str(t.device), t.untyped_storage()._cdata)


def filter_state_dict(model) -> tuple[dict, dict]:
    """:func:`filter_tensors` of ``model.state_dict()``: what vLLM's sharded_state loader wants from a rank."""
    return filter_tensors(model.state_dict())


def filter_tensors(full: dict) -> tuple[dict, dict]:
    """``(kept, aliases)``: vLLM's own ``ShardedStateLoader._filter_subtensors`` run on ``full`` with every
    storage placed at its own address (:class:`_Placed`), so meta tensors give the keys device tensors give;
    ``kept`` maps each kept key to its real tensor, ``aliases`` each dropped key to the kept key whose memory
    covers it (None if none: an empty tensor)."""
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader  # after bootstrap()

    bases: dict[tuple, int] = {}
    placed = {}
    for k, t in full.items():
        base = bases.setdefault(storage_key(t), (len(bases) + 1) * STORAGE_SPACING)
        placed[k] = _Placed(t, base)
    kept_placed = ShardedStateLoader._filter_subtensors(placed)
    kept = {k: full[k] for k in kept_placed}
    spans: dict[tuple, list] = {}
    for k, t in kept.items():
        start = t.storage_offset() * t.element_size()
        spans.setdefault(storage_key(t), []).append((start, start + t.numel() * t.element_size(), k))
    aliases = {}
    for k, t in full.items():
        if k in kept:
            continue
        start = t.storage_offset() * t.element_size()
        end = start + t.numel() * t.element_size()
        cover = [kk for a, b, kk in spans.get(storage_key(t), []) if a <= start and end <= b] if t.numel() else []
        aliases[k] = min(cover) if cover else None
    return kept, aliases


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def versions() -> dict:
    """vLLM and torch versions, where vLLM lives, and what was stubbed."""
    # after bootstrap(): vLLM (and torch) import only once its stubs and environment are in place
    import torch
    import vllm

    return {
        "vllm_version": getattr(vllm, "__version__", "?"),
        "vllm_location": str(Path(vllm.__file__).resolve().parent),
        "torch_version": torch.__version__,
        "python": sys.executable,
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "stubbed_modules": sorted(set(STUBBED_MODULES)),
        "stub_calls": sorted(set(STUB_CALLS)),
    }
