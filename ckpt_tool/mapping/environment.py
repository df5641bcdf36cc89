"""The facts ``ckpt-tool env`` reports for a bug report, and what ``--target auto`` picks here: versions of the tool
and its stack, the installed vLLM and the profile chosen for it, the HF cache in use, CUDA and Triton's interpreter
setting. Each read without importing more than needed (vLLM is never imported). It lives beside ``target.py``, whose
question (which profile the installed vLLM wants) is most of the answer."""

from __future__ import annotations

import os
import platform

from ckpt_tool import __version__
from ckpt_tool.checkpoint.expert_format import EXPERT_FORMATS
from ckpt_tool.errors import CkptToolError
from ckpt_tool.mapping.profiles import DRAFT_KINDS, get_profile
from ckpt_tool.mapping.target import installed_vllm, is_verified, resolve_target

STACK = ("torch", "triton", "safetensors", "huggingface_hub", "numpy", "typer", "rich")


def auto_target() -> dict:
    """What --target auto picks here: ``auto`` (the profile, or None), ``auto_verified`` (whether that
    profile is verified for the installed vLLM; None with no vLLM), ``auto_error`` (why it picks none)."""
    try:
        chosen = resolve_target("auto")
    except CkptToolError as exc:
        return {"auto": None, "auto_verified": None, "auto_error": str(exc)}
    return {"auto": chosen.profile, "auto_verified": is_verified(chosen.profile, chosen.vllm), "auto_error": None}


def auto_drafts(profile: str | None) -> str | None:
    """The draft kinds ``profile`` builds: ``mtp (method mtp, OUT/mtp), dspark (...)``."""
    if profile is None:
        return None
    kinds = [DRAFT_KINDS[k] for k in get_profile(profile).drafts]
    return ", ".join(f"{k.name} ({k.architecture}, method {k.method}, OUT/{k.component})" for k in kinds)


def auto_expert_formats(profile: str | None) -> str | None:
    """The formats of routed experts ``profile`` builds: ``mxfp4 (Mxfp4MoEMethod), ...``."""
    if profile is None:
        return None
    formats = [EXPERT_FORMATS[f] for f in get_profile(profile).expert_formats]
    return ", ".join(f"{f.name} ({f.vllm_method})" for f in formats)


def environment_facts() -> dict:
    """Versions and settings, then what --target auto picks for the installed vLLM (``env``'s document)."""
    facts: dict = {
        "ckpt_tool": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for dist in STACK:
        facts[dist] = _version(dist)
    try:
        import torch  # only here: the rest of the tool's start-up never needs it

        facts["cuda"] = torch.version.cuda if torch.cuda.is_available() else None
        facts["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover - torch is a dependency
        facts["cuda"], facts["cuda_devices"] = None, 0
    facts["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
    try:
        from huggingface_hub import constants  # only here: reading its settings imports it

        facts["hf_hub_cache"] = constants.HF_HUB_CACHE
        facts["hf_hub_offline"] = bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover
        facts["hf_hub_cache"], facts["hf_hub_offline"] = None, None
    auto = auto_target()
    facts["target_auto"] = auto["auto"] or f"error: {auto['auto_error']}"
    facts["target_auto_verified"] = auto["auto_verified"]
    facts["installed_vllm"] = installed_vllm()
    facts["target_auto_drafts"] = auto_drafts(auto["auto"])
    facts["target_auto_expert_formats"] = auto_expert_formats(auto["auto"])
    return facts


def _version(dist: str) -> str | None:
    from importlib import metadata  # ~45 ms (email, zipfile, csv): only env asks for versions

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
