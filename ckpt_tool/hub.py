"""Hub repo ids as sources: ``org/name[@revision]`` or ``hf://org/name[@revision]``.

Header-only: tensor headers come from ``HfApi.get_safetensors_metadata`` (HTTP range reads), the
config from ``hf_hub_download``. huggingface_hub is imported lazily so local use never pays for it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .config import V4Config
from .errors import CheckpointError
from .format import TensorInfo

_REPO_RE = re.compile(r"^(?:hf://)?([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w./-]+))?$")


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def parse_hub_ref(src: str) -> HubRef | None:
    """A hub reference if ``src`` is one (``hf://`` always; ``org/name`` only when no such local path exists)."""
    if not src.startswith("hf://") and Path(src).exists():
        return None
    m = _REPO_RE.match(src)
    if not m:
        return None
    return HubRef(m.group(1), m.group(2))


def hub_headers(ref: HubRef) -> tuple[dict[str, TensorInfo], V4Config | None, str | None]:
    """Tensor headers and config of a hub repo, without downloading any shard."""
    try:
        from huggingface_hub import HfApi, hf_hub_download
        from huggingface_hub import constants as hf_constants
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    except ImportError as exc:  # pragma: no cover - huggingface_hub is a declared dependency
        raise CheckpointError(f"{ref}: reading hub repos needs huggingface_hub ({exc})") from None
    if hf_constants.HF_HUB_OFFLINE:
        raise CheckpointError(
            f"{ref}: HF_HUB_OFFLINE is set, so the repo's headers cannot be read from the hub; "
            "unset it, or point at a local folder (e.g. the snapshot in your HF cache)"
        )
    try:
        meta = HfApi().get_safetensors_metadata(ref.repo_id, revision=ref.revision)
    except (OfflineModeIsEnabled, HfHubHTTPError, OSError, ValueError) as exc:
        raise CheckpointError(f"{ref}: cannot read safetensors headers from the hub ({type(exc).__name__}: {exc})") from None
    tensors: dict[str, TensorInfo] = {}
    for file, fmeta in meta.files_metadata.items():
        for name, t in fmeta.tensors.items():
            begin, end = t.data_offsets
            tensors[name] = TensorInfo(name, t.dtype, tuple(t.shape), file, begin, end)
    config: V4Config | None = None
    config_error: str | None = None
    try:
        path = hf_hub_download(ref.repo_id, "config.json", revision=ref.revision)
        config = V4Config.from_dict(json.loads(Path(path).read_text()), where=f"{ref}/config.json")
    except CheckpointError as exc:
        config_error = str(exc)
    except Exception as exc:  # network and hub errors: report, inspect can still show headers
        config_error = f"{ref}/config.json: could not be read ({type(exc).__name__}: {exc})"
    return tensors, config, config_error
