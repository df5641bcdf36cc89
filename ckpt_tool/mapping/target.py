"""``--target auto``: the profile of the vLLM installed beside the tool, read from package metadata.

vLLM itself is never imported here (it takes seconds and may need a GPU): its version comes from the
installed distribution's metadata.

- A vLLM whose ``major.minor`` series a profile covers: that profile.
- A vLLM newer than every covered series (next month's release, a nightly): the newest profile, with one
  warning that it is not verified and how to check OUT against it (``verify --engine``); the manifest
  records ``"verified": false``. vLLM ships about monthly and rarely changes this layout, so stopping
  users would cost more than it protects; the engine check is there to prove it.
- A vLLM older than every covered series, or one whose version cannot be read: a usage error listing the
  profiles (no profile describes what it loads).
- No vLLM installed: the newest profile, with one note saying so.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ckpt_tool.errors import UsageError
from ckpt_tool.mapping.profiles import PROFILES, canonical_name, get_profile, known_names, newest_profile, series_of


@dataclass(frozen=True)
class Target:
    profile: str
    vllm: str | None  # the installed vLLM version the choice was made for (None: none installed / explicit)
    note: str | None = None  # one line for the user (e.g. no vLLM installed)
    warning: str | None = None  # one line for the user: the installed vLLM is not verified with this profile


def installed_vllm() -> str | None:
    """The installed vLLM's version from its distribution metadata, or None.

    What ``importlib.metadata.version("vllm")`` answers, found the way it looks: the first ``sys.path`` folder
    holding a ``vllm-<version>.dist-info`` (or ``.egg-info``) folder, whose name carries the version (PEP 427's
    naming; pip reads it the same way). Importing ``importlib.metadata`` costs ~45 ms (email, zipfile, csv), a
    tenth of a V4-Flash dry run; where ``sys.path`` holds something that is not a folder (a zip, an egg), that
    lookup answers instead.
    """
    for entry in sys.path:
        folder = entry or "."
        if not os.path.isdir(folder):
            if os.path.exists(folder):  # a zip or egg on sys.path: the full lookup reads inside it
                return _metadata_version()
            continue
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            for suffix in (".dist-info", ".egg-info"):
                if name.endswith(suffix) and name.lower().startswith("vllm-"):
                    version = name[len("vllm-") : -len(suffix)].split("-", 1)[0]  # (an egg-info may add "-py3.11")
                    if version:
                        return version
    return None


def _metadata_version() -> str | None:
    from importlib import metadata  # ~45 ms (email, zipfile, csv): only where sys.path holds a zip or an egg

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def profile_for_version(version: str) -> str | None:
    """The profile whose ``covers`` holds ``version``'s ``major.minor`` series."""
    series = series_of(version)
    for p in PROFILES.values():
        if series is not None and series in {series_of(c) for c in p.covers}:
            return p.name
    return None


def is_verified(profile: str, version: str | None) -> bool | None:
    """Whether ``profile`` is verified against vLLM ``version``'s series; None when no vLLM is installed."""
    if version is None:
        return None
    series = series_of(version)
    return series is not None and series in {series_of(c) for c in get_profile(profile).covers}


def profile_list() -> str:
    return "; ".join(
        f"{p.name} ({'vLLM ' + ', '.join(p.verified) if p.verified else p.verified_by})" for p in PROFILES.values()
    )


def resolve_target(name: str, *, vllm_version: str | None = None) -> Target:
    """The profile ``--target name`` means: ``auto`` picks by the installed vLLM (``vllm_version`` overrides)."""
    if name != "auto":
        if canonical_name(name) not in PROFILES:
            raise UsageError(f"--target: unknown profile {name!r}; known: auto, {', '.join(known_names())}")
        return Target(canonical_name(name), None)
    version = vllm_version if vllm_version is not None else installed_vllm()
    newest = newest_profile()
    if version is None:
        return Target(
            newest.name,
            None,
            f"no vLLM installed here: targeting {newest.name}, the newest profile (pass --target to choose another)",
        )
    profile = profile_for_version(version)
    if profile is not None:
        return Target(profile, version)
    series = series_of(version)
    if series is not None and series > newest.newest_series:
        return Target(
            newest.name,
            version,
            warning=(
                f"the installed vLLM {version} is newer than every release ckpt-tool is verified against "
                f"(newest: {newest.verified[-1]}); targeting {newest.name}, the newest profile. It is not verified "
                f"for {version}: check the output with `ckpt-tool verify OUT --engine`, which loads it with this vLLM"
            ),
        )
    which = f"vLLM {version} (--vllm)" if vllm_version is not None else f"the installed vLLM {version}"
    raise UsageError(
        f"--target auto: {which} is not covered by any profile ({profile_list()}); "
        "pass --target PROFILE for the layout your engine loads, or install a vLLM a profile covers"
    )


def unverified_warning(target: dict | None) -> str | None:
    """The warning verify repeats for an OUT whose manifest ``target`` says it was converted beside a vLLM
    the profile is not verified for (``"verified": false``); None otherwise (older manifests lack the mark)."""
    if not target or target.get("verified") is not False:
        return None
    return (
        f"OUT was converted with profile {target.get('profile')} beside vLLM {target.get('installed_vllm')}, which "
        "that "
        f"profile is not verified against (verified: {', '.join(target.get('vllm_verified') or []) or 'none'}); "
        "`ckpt-tool verify OUT --engine` checks it with the vLLM you serve with"
    )
