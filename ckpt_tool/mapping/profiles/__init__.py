"""Target profiles: one module per engine release series whose parameters differ, registered here.

Adding a vLLM release whose layout is unchanged is one version in an existing profile's ``covers`` and
``verified``; a release that changes the layout is one new module beside these and one entry in
``_MODULES`` (docs/adding-a-vllm-release.md is the checklist). The model class (text or vision,
:mod:`.model_class`) is a second dimension applied on top of any profile, and so is the draft kind (classic MTP
or DSpark, :mod:`.draft_kind`), among those a profile's engine builds (``Profile.drafts``). Everything else — the engine
table verify holds OUT against, the names numeric verification reads, ``--target auto``, the engine test matrix —
derives from these records.
"""

from __future__ import annotations

from ckpt_tool.mapping.profiles import vllm_0_33_plus, vllm_seed
from ckpt_tool.mapping.profiles.draft_kind import (
    DRAFT_COMPONENTS,
    DRAFT_KINDS,
    DSPARK,
    MTP,
    DraftKind,
    draft_kind_of,
)
from ckpt_tool.mapping.profiles.model_class import MODEL_CLASSES, TEXT, VISION, ModelClass, model_class_of
from ckpt_tool.mapping.profiles.profile import ConvertOverride, EngineNames, Profile
from ckpt_tool.mapping.profiles.series import series_of, series_text

__all__ = [
    "ALIASES", "DEFAULT_PROFILE", "DRAFT_COMPONENTS", "DRAFT_KINDS", "DSPARK", "MODEL_CLASSES", "MTP", "DraftKind",
    "draft_kind_of", "PROFILES", "TEXT", "VISION", "ConvertOverride", "EngineNames",
    "ModelClass", "Profile", "model_class_of",
    "canonical_name", "get_profile", "known_names", "newest_profile", "series_of", "series_text", "verified_releases",
]  # fmt: skip

_MODULES = (vllm_seed, vllm_0_33_plus)

PROFILES: dict[str, Profile] = {m.PROFILE.name: m.PROFILE for m in _MODULES}
ALIASES: dict[str, str] = {alias: p.name for p in PROFILES.values() for alias in p.aliases}


def canonical_name(name: str) -> str:
    """The profile's current name for ``name`` (an alias resolves; anything else is returned unchanged)."""
    return ALIASES.get(name, name)


def get_profile(name: str) -> Profile:
    """The profile called ``name`` (or an alias of it); KeyError naming the known ones otherwise."""
    try:
        return PROFILES[canonical_name(name)]
    except KeyError:
        raise KeyError(f"unknown target profile {name!r}; known: {', '.join(known_names())}") from None


def known_names() -> list[str]:
    """Every name ``--target`` takes besides ``auto``: the profiles, then their aliases."""
    return [*PROFILES, *ALIASES]


def newest_profile() -> Profile:
    """The profile covering the newest vLLM series (what ``--target auto`` takes without a covered vLLM)."""
    covering = [p for p in PROFILES.values() if p.newest_series is not None]
    return max(covering, key=lambda p: p.newest_series)


def verified_releases() -> list[tuple[str, str]]:
    """(vLLM release, profile name) for every release a profile is verified against, oldest first: the
    columns of the engine test matrix."""
    pairs = [(release, p.name) for p in PROFILES.values() for release in p.verified]
    return sorted(pairs, key=lambda rp: tuple(int(x) if x.isdigit() else 0 for x in rp[0].split(".")))


DEFAULT_PROFILE = newest_profile().name
