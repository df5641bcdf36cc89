"""``ckpt-tool inspect``'s library call: the checkpoint stage's header-only report on a source (a folder, an index,
one shard or a hub repo), with the model class vLLM builds for its config.json named, which only this stage knows
(``profiles.model_class``)."""

from __future__ import annotations

from dataclasses import replace

from ckpt_tool.checkpoint.hub import hub_headers, parse_hub_ref
from ckpt_tool.checkpoint.summary import InspectReport, inspect_local, inspect_tensors
from ckpt_tool.mapping.profiles.model_class import model_class_of


def inspect_source(
    src: str, *, revision: str | None = None, token: str | None = None, cache_dir: str | None = None
) -> InspectReport:
    """The report on ``src`` from its headers and config.json alone (raises CkptToolError)."""
    ref = parse_hub_ref(src, revision=revision, token=token, cache_dir=cache_dir)
    if ref is not None:
        tensors, config, config_error = hub_headers(ref)
        report = inspect_tensors(src, tensors, config, config_error, whole=not src.endswith(".safetensors"))
    else:
        report = inspect_local(src)
    if report.config is None:
        return report
    return replace(report, model=model_class_of(report.config).describe(report.config))
