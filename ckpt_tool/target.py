"""``--target auto``: the profile of the vLLM installed beside the tool, read from package metadata.

vLLM itself is never imported here (it takes seconds and may need a GPU): its version comes from the
installed distribution's metadata. No vLLM installed → the newest profile, with a note saying so.
An installed vLLM that no profile covers is an error listing the profiles, so a conversion never
silently targets a layout the user's engine does not load.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError
from .rules import DEFAULT_PROFILE, PROFILES


@dataclass(frozen=True)
class Target:
    profile: str
    vllm: str | None  # the installed vLLM version the choice was made for (None: none installed / explicit)
    note: str | None = None  # one line for the user (e.g. no vLLM installed)


def installed_vllm() -> str | None:
    """The installed vLLM's version from its distribution metadata, or None."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def profile_for_version(version: str) -> str | None:
    """The profile whose ``covers`` holds ``version``'s ``major.minor`` series."""
    series = ".".join(version.split("+")[0].split(".")[:2])
    for p in PROFILES.values():
        if series in p.covers:
            return p.name
    return None


def profile_list() -> str:
    return "; ".join(f"{p.name} ({'vLLM ' + ', '.join(p.verified) if p.verified else p.verified_by})" for p in PROFILES.values())


def resolve_target(name: str, *, vllm_version: str | None = None) -> Target:
    """The profile ``--target name`` means: ``auto`` picks by the installed vLLM (``vllm_version`` overrides)."""
    if name != "auto":
        if name not in PROFILES:
            raise UsageError(f"--target: unknown profile {name!r}; known: auto, {', '.join(PROFILES)}")
        return Target(name, None)
    version = vllm_version if vllm_version is not None else installed_vllm()
    if version is None:
        return Target(
            DEFAULT_PROFILE,
            None,
            f"no vLLM installed here: targeting {DEFAULT_PROFILE}, the newest profile (pass --target to choose another)",
        )
    profile = profile_for_version(version)
    if profile is None:
        raise UsageError(
            f"--target auto: the installed vLLM {version} is not covered by any profile ({profile_list()}); "
            "pass --target PROFILE for the layout your engine loads, or install a vLLM a profile covers"
        )
    return Target(profile, version)
