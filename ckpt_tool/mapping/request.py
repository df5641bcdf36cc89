"""What a ``convert`` command asks for, settled before any byte is read: the target profile, the options, the ranks
and scale-out part, and the opened source (a local folder, or a hub repo whose headers were read and plan checked).

``convert`` and its dry run (both ways into the command line: the typer app and the typer-free header path) make
one :func:`convert_request`; a dry run then prints :meth:`ConvertRequest.plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckpt_tool.checkpoint.hub import open_hub_source, parse_hub_ref
from ckpt_tool.checkpoint.source import Checkpoint, open_checkpoint
from ckpt_tool.errors import UsageError
from ckpt_tool.mapping.hub_needs import HubNeeds
from ckpt_tool.mapping.plan import Options, Plan
from ckpt_tool.mapping.selection import parse_ranks, plan_run
from ckpt_tool.mapping.target import Target, resolve_target


@dataclass(frozen=True)
class ConvertRequest:
    """A convert command's source (a local path, or an opened hub checkpoint), options, ``--target`` choice, ranks
    (None: all) and scale-out part (index, count)."""

    source: Path | Checkpoint
    opts: Options
    target: Target
    ranks: tuple[int, ...] | None = None
    shard: tuple[int, int] = (0, 1)

    @property
    def fetched(self) -> Callable[[], tuple[int, int]] | None:
        """A streamed hub source's (bytes fetched, range requests) so far, as a function; None for any other."""
        return getattr(getattr(self.source, "remote", None), "fetched", None)

    def plan(self) -> Plan:
        """What ``convert --dry-run`` prints: the plan of the files this run (its ranks, its part) would write."""
        ckpt = open_checkpoint(self.source) if isinstance(self.source, Path) else self.source
        return plan_run(ckpt.require_config(), ckpt.tensors, self.opts, ranks=self.ranks, shard=self.shard).part


def convert_request(
    src: str,
    *,
    tp: int = 1,
    moe_parallel: str = "tp",
    nvfp4_input_scales: str = "global",
    only: str | None = None,
    max_shard_size: int | None = None,
    target: str = "auto",
    vllm: str | None = None,
    ranks: str | None = None,
    shard: tuple[int, int] = (0, 1),
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
    stream: bool = False,
    download: bool = True,
    warn: Callable[[str], None] | None = None,
) -> ConvertRequest:
    """Settle a convert command line: ``--target`` resolved (its warning handed to ``warn`` before any other work),
    the options, ``--ranks`` parsed and checked against ``--tp``, and the source opened: a hub ``src``'s headers read
    and its plan checked, its shards fetched unless ``download`` is False (a dry run) or ``stream``."""
    chosen = resolve_target(target, vllm_version=vllm)
    if chosen.warning and warn is not None:
        warn(chosen.warning)
    sizes = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    opts = Options(
        tp=tp,
        moe_parallel=moe_parallel,
        only=only,
        profile=chosen.profile,
        vllm_series=vllm or chosen.vllm,
        nvfp4_input_scales=nvfp4_input_scales,
        **sizes,
    )
    rank_list = parse_ranks(ranks, tp) if ranks is not None else None
    ref = parse_hub_ref(src, revision=revision, token=token, cache_dir=cache_dir)
    if stream and ref is None:
        raise UsageError(f"--stream reads a hub repo; {src} is a local path (convert reads it directly)")
    source = open_hub_source(ref, HubNeeds(opts), download=download, stream=stream) if ref is not None else Path(src)
    return ConvertRequest(source, opts, chosen, rank_list, shard)
