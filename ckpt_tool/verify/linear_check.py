"""Numeric check of every output tensor: each converted linear against the source linear(s), by the engine's names
(the units it runs: :mod:`ckpt_tool.verify.tensor_units`; what they count for: :mod:`ckpt_tool.verify.coverage`).

The MTP forward (mtp_forward.py) proves one layer computes what the source computes, but on a handful
of tokens it reaches few routed experts and it never runs a main-model layer. This check covers the
rest: every linear of every layer, target model and MTP alike (each routed expert, each part of a
fused weight, each TP rank), runs through the fp8-block / MXFP4 GEMM kernels on seeded probe inputs,
ranks recombined as the engine does (column-parallel outputs concatenated, row-parallel partial sums
added, expert-parallel ranks each holding their own experts; where the engine zero-pads a split, the
padded rows must compute exactly zero and the padded inputs carry probe values that must add
nothing), and is compared with the source
linear dequantized in torch (:mod:`ckpt_tool.verify.quant`). Tensors no quantized kernel runs are compared
exactly by value, tile by tile: bf16 linears (embedding, heads, router, compressor, indexer
projections) and non-linear tensors (norms, ``hc_*``, sinks, biases, ``tid2eid``, ``ape``).

DeepSeek V4.1 (``DeepseekV41ForCausalLM`` and its DSpark draft): its MXFP8 linears run as kind ``mxfp8``, the
source with its checkpoint's 32x32 E8M0 blocks in torch and each rank through the kernel with the scale as vLLM
holds it, one row a weight row (1x32 blocks), so a scale row expanded to the wrong weight rows fails; its routed
experts as V4's MXFP4; each Engram table and its per-row scale byte for byte, each rank against the source rows of
its hash heads (``EngramSplit.rank_rows``: uneven), a tile of rows at a time.

Independence: the engine side is named from :mod:`ckpt_tool.mapping.engine_table` (the engine's parameter table,
tested against vLLM itself) and the source side from DeepSeek's names written out below; the rule
table is never consulted, so a rule that maps the wrong bytes (swapped fused parts, a wrong expert,
a wrong rank slice) makes the two sides disagree.

Work and memory: weights are read with ``pread`` a tile of rows at a time (``rows.read_tile_rows``,
4 MiB of weight bytes) on both sides and dequantized in smaller tiles that stay in cache
(``tiled_matmul.dequant_matmul``), so the peak does not grow with hidden size or expert count. Each source tile is
multiplied once and compared with every rank's piece of it. Units run in ``verify --workers`` forked
processes (``verify.compute_pool.fan_out``; threads of one :class:`~ckpt_tool.verify.compute_pool.ComputePool` where
forking is not safe), each computing one tile at a time while a second thread reads its next.

Tolerance: both sides round the probe activation the same way and differ only by float32
summation order (row-parallel partial sums, kernel tiles): ``max|a - b| / max|a| <= 1e-3`` per part
and rank (measured <= 1e-6 on the torch path); a mapping bug moves it to O(1).
"""

from __future__ import annotations

import logging
import math
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ckpt_tool.checkpoint.blocks import FP8_BLOCK, MX_BLOCK, cdiv
from ckpt_tool.checkpoint.headers import ShardHeader, TensorInfo
from ckpt_tool.checkpoint.reader import Scratch
from ckpt_tool.checkpoint.source import Checkpoint
from ckpt_tool.errors import CheckpointError
from ckpt_tool.mapping.plan import Plan
from ckpt_tool.processes import TaskQueue
from ckpt_tool.verify import quant, tiled_matmul
from ckpt_tool.verify.compute_pool import ComputePool, compute_slot, map_tasks
from ckpt_tool.verify.coverage import Coverage
from ckpt_tool.verify.kernels import fp8_block_gemm, mxfp4_gemm, nvfp4_gemm
from ckpt_tool.verify.kernels.fp8_gemm import prepare_activation
from ckpt_tool.verify.rows import RowReader, read_tile_rows, row_count, source_info
from ckpt_tool.verify.tensor_units import ExactUnit, LinearUnit, Part, Unit, tensor_units, unit_label, unit_tensors
from ckpt_tool.verify.verdict import NoProgress, Progress, VerifyReport, problems_check

log = logging.getLogger(__name__)

PROBE_ROWS = 4
LINEAR_MAX_REL = 1e-3


# ---------------------------------------------------------------------------------------------
# running the units


def probe(unit: LinearUnit, seed: int, device: torch.device) -> torch.Tensor:
    """Seeded ``[PROBE_ROWS, in]`` inputs, distinct per unit (and expert); a row-parallel split the engine
    zero-pads gets probe values on the padded inputs too (``[PROBE_ROWS, per_rank * tp]``)."""
    key = zlib.crc32(f"{unit.label}".encode()) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF)
    g = torch.Generator().manual_seed(key)
    width = unit.share(unit.inp) * len(unit.ranks) if unit.layout == "row" else unit.inp
    return torch.randn(PROBE_ROWS, width, generator=g).to(device)


class _Sides:
    """Row reads of source tensors (DeepSeek names) and of each output rank's tensors (engine names)."""

    def __init__(
        self,
        ckpt: Checkpoint,
        out: Path,
        plan: Plan,
        headers: dict[str, ShardHeader],
        component: str,
        reader: RowReader,
        device: torch.device,
    ) -> None:
        self.ckpt, self.reader, self.device = ckpt, reader, device
        self.locate: dict[int, dict[str, tuple[Path, TensorInfo]]] = {}
        for f in plan.files:
            if f.component != component or f.relpath not in headers:
                continue
            where = self.locate.setdefault(f.rank, {})
            for name, info in headers[f.relpath].tensors.items():
                where[name] = (out / f.relpath, info)

    def source_info(self, name: str) -> TensorInfo:
        return source_info(self.ckpt, name)

    def source_rows(self, name: str, r0: int, r1: int, into: Scratch | None = None) -> torch.Tensor:
        return self.reader.source_rows(self.ckpt, name, r0, r1, into).to(self.device)

    def engine_info(self, rank: int, name: str) -> tuple[Path, TensorInfo]:
        hit = self.locate.get(rank, {}).get(name)
        if hit is None:
            raise CheckpointError(f"tensor {name!r} is not in rank {rank}'s files")
        return hit

    def engine_rows(self, rank: int, name: str, r0: int, r1: int, into: Scratch | None = None) -> torch.Tensor:
        path, info = self.engine_info(rank, name)
        return self.reader.rows(path, info, r0, r1, into).to(self.device)


def _block_rows(kind: str, side: str) -> int:
    """Weight rows one scale row covers on ``side`` (source | engine): 128 for block FP8; for MXFP8 32 in the
    checkpoint, 1 in the engine (vLLM repeats each scale row once per weight row); 1 for MXFP4's and NVFP4's per-row
    groups."""
    if kind == "fp8":
        return FP8_BLOCK
    if kind == "mxfp8":
        return quant.MXFP8_BLOCK[0] if side == "source" else quant.MXFP8_ROW_BLOCK[0]
    return 1


def _scale_rows(kind: str, r0: int, r1: int, side: str) -> tuple[int, int]:
    """The scale rows holding the scales of weight rows ``[r0, r1)`` (``r0`` a multiple of the block rows)."""
    bn = _block_rows(kind, side)
    return r0 // bn, cdiv(r1, bn)


def _row_bytes(kind: str, inp: int) -> int:
    """Bytes of one weight row of ``inp`` inputs (packed fp4: two a byte)."""
    return {"fp8": inp, "mxfp8": inp, "mxfp4": inp // 2, "nvfp4": inp // 2, "bf16": 2 * inp}[kind]


_SOURCE_SCALE = {"nvfp4": "weight_scale"}
"""A source linear's block-scale suffix where it is not DeepSeek's ``.scale``: NVIDIA's NVFP4 experts (Model
Optimizer's ``quantize_to_nvfp4.py``: ``.weight_scale`` E4M3 and the global ``.weight_scale_2`` F32 scalar)."""


def _unit_bytes(u: Unit) -> int:
    """Roughly what a unit reads, to schedule the largest first (exact units: small, counted as one byte)."""
    if isinstance(u, ExactUnit):  # an Engram table's rows: at least one 32-wide block of FP8 a row
        return sum(hi - lo for lo, hi in u.rows) * MX_BLOCK if u.layout == "rows" else 1
    return sum(p.rows for p in u.parts) * _row_bytes(u.kind, u.inp) * 2


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and dtype and the same bytes (numpy's compare runs several times faster than torch.equal on
    bf16; bytes, not values, because the converter copies these tensors verbatim)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(a.contiguous().view(torch.uint8).numpy(), b.contiguous().view(torch.uint8).numpy()))


class LinearRunner:
    """Runs units; keeps the worst disagreement per unit for the report, and in ``computed`` what it ran:
    ``(unit label, source part) -> bit r set`` once that part's rows on rank r were all compared with the source."""

    def __init__(self, sides: _Sides, *, kernels: str, act: str, seed: int, pool: ComputePool | None = None) -> None:
        self.sides, self.kernels, self.act, self.seed, self.pool = sides, kernels, act, seed, pool
        self.computed: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()  # units run on several threads
        self._local = threading.local()  # each thread's read buffers

    def _buffers(self) -> dict[str, Scratch]:
        """This thread's read buffers: one per role, so a source tile and a rank's tile never share memory."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {role: Scratch() for role in ("source", "source scale", "engine", "engine scale")}
        return bufs

    def take_computed(self) -> dict[tuple[str, str], int]:
        """What :attr:`computed` holds now, emptied (a forked worker hands each batch to the parent)."""
        with self._lock:
            taken, self.computed = self.computed, {}
        return taken

    def _done(self, u: Unit, source: str, ranks) -> None:
        key = (unit_label(u), source)
        with self._lock:
            self.computed[key] = self.computed.get(key, 0) | sum(1 << r for r in set(ranks))

    # the two GEMMs: source = torch reference, engine = the kernels (g: an NVFP4 weight's global scale)
    def _reference(
        self,
        kind: str,
        x: torch.Tensor,
        w: torch.Tensor,
        s: torch.Tensor | None,
        what: str,
        g: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with compute_slot(self.pool):
            if kind == "bf16":
                return x @ w.float().T
            if kind == "mxfp4":
                return tiled_matmul.mxfp4_matmul(prepare_activation(x, "bf16"), w, s, what=what)
            if kind == "nvfp4":
                return tiled_matmul.nvfp4_matmul(prepare_activation(x, "bf16"), w, s, g, what=what)
            if kind == "mxfp8":  # the checkpoint's 32x32 blocks; fp8 activations in the block's 32-input groups
                block = quant.MXFP8_BLOCK
                return tiled_matmul.fp8_block_matmul(prepare_activation(x, self.act, block[1]), w, s, block, what=what)
            return tiled_matmul.fp8_block_matmul(prepare_activation(x, self.act), w, s, what=what)

    def _kernel(
        self,
        kind: str,
        x: torch.Tensor,
        w: torch.Tensor,
        s: torch.Tensor | None,
        what: str,
        g: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with compute_slot(self.pool):
            if kind == "bf16":
                return x @ w.float().T
            if kind == "mxfp4":
                return mxfp4_gemm(x, w, s, backend=self.kernels, what=what)
            if kind == "nvfp4":
                return nvfp4_gemm(x, w, s, g, backend=self.kernels, what=what)
            block = quant.MXFP8_ROW_BLOCK if kind == "mxfp8" else quant.FP8_BLOCK  # vLLM's one scale row a weight row
            return fp8_block_gemm(x, w, s, act=self.act, block=block, backend=self.kernels, what=what)

    def _source_reference(self, u: LinearUnit, part: Part, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of the source part's output on ``x``, the source dequantized in torch. A tile that starts
        inside a scale block (a rank's share of an MXFP8 part may end anywhere) is computed from the block's first
        row and the rows before ``a`` dropped."""
        lead = a % _block_rows(u.kind, "source")
        w, s = self._source_tile(u, part, a - lead, b)
        g = self.sides.source_rows(f"{part.source}.weight_scale_2", 0, 1) if u.kind == "nvfp4" else None
        return self._reference(u.kind, x, w, s, f"source {part.source}", g)[:, lead:]

    def _source_tile(self, u: LinearUnit, part: Part, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows [a, b) of the source part (valid until this thread's next source tile)."""
        bufs = self._buffers()
        if u.kind == "bf16":
            return self.sides.source_rows(part.source, part.row0 + a, part.row0 + b, bufs["source"]), None
        s0, s1 = _scale_rows(u.kind, a, b, "source")
        scale = f"{part.source}.{_SOURCE_SCALE.get(u.kind, 'scale')}"
        return (
            self.sides.source_rows(f"{part.source}.weight", a, b, bufs["source"]),
            self.sides.source_rows(scale, s0, s1, bufs["source scale"]),
        )

    def _engine_tile(
        self, u: LinearUnit, rank: int, slot: int, a: int, b: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows [a, b) of the rank's matrix (of stacked expert ``slot``; valid until this thread's next engine tile)."""
        bufs = self._buffers()
        _, info = self.sides.engine_info(rank, u.weight)
        base = slot * info.shape[1] if u.expert is not None else 0
        w = self.sides.engine_rows(rank, u.weight, base + a, base + b, bufs["engine"])
        if u.scale is None:
            return w, None
        s0, s1 = _scale_rows(u.kind, a, b, "engine")
        sbase = 0
        if u.expert is not None:
            sbase = slot * self.sides.engine_info(rank, u.scale)[1].shape[1]
        return w, self.sides.engine_rows(rank, u.scale, sbase + s0, sbase + s1, bufs["engine scale"])

    def _engine_global(self, u: LinearUnit, rank: int, slot: int, part: int) -> torch.Tensor | None:
        """An NVFP4 unit's global scale on ``rank`` for stacked expert ``slot`` and the unit's ``part`` (0-d), from
        ``w13_weight_scale_2 [E_local, 2]`` (w1's, w3's) or ``w2_weight_scale_2 [E_local]``; None for other kinds."""
        if u.global_scale is None:
            return None
        _, info = self.sides.engine_info(rank, u.global_scale)
        return self._engine_element(rank, u.global_scale, (slot, part) if len(info.shape) == 2 else (slot,))

    def _engine_element(self, rank: int, name: str, index: tuple[int, ...]) -> torch.Tensor:
        """One element (0-d) of a rank's 1-D or 2-D tensor, read as the row reader reads rows (a 1-D tensor is one)."""
        _, info = self.sides.engine_info(rank, name)
        if len(info.shape) != len(index) or not all(0 <= i < n for i, n in zip(index, info.shape)):
            raise CheckpointError(
                f"tensor {name!r} (rank {rank}): shape {list(info.shape)} has no element {list(index)}"
            )
        if len(index) == 2:
            return self.sides.engine_rows(rank, name, index[0], index[0] + 1)[0, index[1]]
        return self.sides.engine_rows(rank, name, 0, 1).reshape(-1)[index[0]]

    def _tiles(self, u: LinearUnit, part_rows: int) -> Iterator[tuple[int, int, int | None]]:
        """(a, b, rank) source row tiles of one part; rank is the column-parallel owner, else None."""
        # the source tile [step, in] is the largest piece either side holds
        step = read_tile_rows(part_rows, _row_bytes(u.kind, u.inp), _block_rows(u.kind, "source"))
        if u.layout == "col":
            n_r = u.share(part_rows)
            for i, r in enumerate(u.ranks):
                for a in range(i * n_r, min((i + 1) * n_r, part_rows), step):
                    yield a, min(a + step, (i + 1) * n_r, part_rows), r
        else:
            for a in range(0, part_rows, step):
                yield a, min(a + step, part_rows), None

    def _pad_tiles(self, u: LinearUnit, part_rows: int) -> Iterator[tuple[int, int, int]]:
        """(a, b, rank): rows [a, b) of the rank's share of one column-parallel part that are the engine's
        zero padding (past the end of the source part)."""
        n_r = u.share(part_rows)
        step = read_tile_rows(n_r, _row_bytes(u.kind, u.inp), _block_rows(u.kind, "engine"))
        for i, r in enumerate(u.ranks):
            real = max(0, min(n_r, part_rows - i * n_r))
            for a in range(real, n_r, step):
                yield a, min(a + step, n_r), r

    def run(self, u: LinearUnit) -> str | None:
        """None when every part on every rank agrees; else one line naming the engine tensor, rank and part."""
        x = probe(u, self.seed, self.sides.device)
        x_src = x[:, : u.inp]  # the source linear's inputs (a padded row-parallel probe is wider)
        slots = dict(zip(u.ranks, u.local)) if u.expert is not None else {r: 0 for r in u.ranks}
        off = 0  # the part's first row in the source's stacked parts
        local_off = 0  # ... and in a column-parallel rank's tensor
        for pi, part in enumerate(u.parts):
            worst: dict[int | str, list[float]] = {}  # holder -> [max |a-b|, max |a|]
            ran: set[int] = set()  # ranks whose rows of the part were compared

            def note(holder, ref: torch.Tensor, got: torch.Tensor, worst: dict = worst) -> None:
                w = worst.setdefault(holder, [0.0, 0.0])
                d = (ref - got).abs().max().item() if ref.numel() else 0.0
                w[0] = max(w[0], d) if not math.isnan(d) else math.inf
                w[1] = max(w[1], ref.abs().max().item() if ref.numel() else 0.0)

            for a, b, owner in self._tiles(u, part.rows):
                if u.kind == "bf16":  # not quantized: no kernel runs it, and equal values are the stronger check
                    bad = self._compare_bf16_tile(u, part, a, b, owner, slots, (off, local_off), ran)
                    if bad is not None:
                        return bad
                    continue
                ref = self._source_reference(u, part, x_src, a, b)
                if u.layout == "row":
                    got = None
                    kr = u.share(u.inp)
                    for i, r in enumerate(u.ranks):
                        w, s = self._engine_tile(u, r, slots[r], a, b)
                        g = self._engine_global(u, r, slots[r], pi)
                        xr = x[:, i * kr : (i + 1) * kr].contiguous()
                        y = self._kernel(u.kind, xr, w, s, f"{u.label} rank {r}", g)
                        got = y if got is None else got + y
                    note("sum", ref, got)
                    ran.update(u.ranks)
                elif u.layout == "col":
                    i = u.ranks.index(owner)
                    local = local_off + a - i * u.share(part.rows)
                    w, s = self._engine_tile(u, owner, slots[owner], local, local + (b - a))
                    g = self._engine_global(u, owner, slots[owner], pi)
                    note(owner, ref, self._kernel(u.kind, x, w, s, f"{u.label} rank {owner}", g))
                    ran.add(owner)
                else:
                    for r in u.ranks:
                        w, s = self._engine_tile(u, r, slots[r], off + a, off + b)
                        g = self._engine_global(u, r, slots[r], pi)
                        note(r, ref, self._kernel(u.kind, x, w, s, f"{u.label} rank {r}", g))
                        ran.add(r)
            self._done(u, part.key, ran)
            for holder, (d, amax) in worst.items():
                rel = d / max(amax, 1e-30)
                if not rel <= LINEAR_MAX_REL:
                    where = "ranks summed" if holder == "sum" else f"rank {holder}"
                    scale = f" (scale {u.scale!r})" if u.scale else ""
                    expert = "" if u.expert is None else f" expert {u.expert}"
                    return (
                        f"tensor {u.weight!r}{scale}{expert} ({where}): output of part {part.source} disagrees with "
                        f"the source linear: max_rel {rel:.3g} (needs <= {LINEAR_MAX_REL:g})"
                    )
            if u.layout == "col" and u.per_rank is not None:
                for a, b, r in self._pad_tiles(u, part.rows):
                    w, s = self._engine_tile(u, r, slots[r], local_off + a, local_off + b)
                    y = self._kernel(u.kind, x, w, s, f"{u.label} rank {r}", self._engine_global(u, r, slots[r], pi))
                    if y.count_nonzero():
                        return (
                            f"tensor {u.weight!r} (rank {r}): rows {local_off + a}:{local_off + b} are the engine's "
                            "zero "
                            f"padding after part {part.source} but compute nonzero output (max |y| "
                            f"{y.abs().max().item():.3g})"
                        )
                    self._done(u, part.key, [r])
            off += part.rows
            local_off += u.share(part.rows) if u.layout == "col" else part.rows
        return None

    def _compare_bf16_tile(
        self,
        u: LinearUnit,
        part: Part,
        a: int,
        b: int,
        owner: int | None,
        slots: dict[int, int],
        offsets: tuple[int, int],
        ran: set[int],
    ) -> str | None:
        """Rows ``[a, b)`` of a bf16 part equal, byte for byte, on every rank holding them (``offsets``: the part's
        first row in the source's stacked parts and in a column-parallel rank's tensor); the ranks compared go into
        ``ran``. None, or one line naming the tensor, rank and rows that differ."""
        off, local_off = offsets
        w_src, _ = self._source_tile(u, part, a, b)
        i = u.ranks.index(owner) if owner is not None else 0
        if u.layout == "row":  # each rank holds its columns of every row
            kr = u.share(u.inp)
            for j, r in enumerate(u.ranks):
                got, _ = self._engine_tile(u, r, slots[r], off + a, off + b)
                if not torch.equal(got, w_src[:, j * kr : (j + 1) * kr].to(got.dtype)):
                    return (
                        f"tensor {u.weight!r} (rank {r}): values differ from source {part.source} "
                        f"(rows {a}:{b}, columns {j * kr}:{(j + 1) * kr})"
                    )
                ran.add(r)
            return None
        holders = (
            [(owner, local_off + a - i * u.share(part.rows))] if u.layout == "col" else [(r, off + a) for r in u.ranks]
        )
        for r, local in holders:
            got, _ = self._engine_tile(u, r, slots[r], local, local + (b - a))
            with compute_slot(self.pool):
                same = _same_bytes(got, w_src.to(got.dtype))  # a float32 tower lands rounded to bf16
            if not same:
                return f"tensor {u.weight!r} (rank {r}): values differ from source {part.source} (rows {a}:{b})"
            ran.add(r)
        return None

    def run_exact(self, u: ExactUnit) -> str | None:
        if u.layout == "rows":
            return self._run_rows(u)
        if u.layout == "element":
            return self._run_element(u)
        info = self.sides.source_info(u.source)
        src = self.sides.reader.source_whole(self.sides.ckpt, info)
        T = len(u.ranks)
        for i, r in enumerate(u.ranks):
            path, einfo = self.sides.engine_info(r, u.name)
            got = self.sides.reader.whole(path, einfo)
            want = src
            if u.layout == "col":
                n = src.shape[0] // u.sections // T
                want = torch.cat([sec[i * n : (i + 1) * n] for sec in src.chunk(u.sections)])
            if want.dtype.is_floating_point and got.dtype.is_floating_point:
                want = want.to(got.dtype)  # the engine's parameter dtype, as its loader casts (vision tower, image_*)
            same = tuple(got.shape) == tuple(want.shape) and _same_values(want, got)
            self._done(u, u.source, [r])
            if not same:
                return f"tensor {u.name!r} (rank {r}): values differ from source {u.source}"
        return None

    def _run_element(self, u: ExactUnit) -> str | None:
        """A source scalar against its element of each rank's tensor (an NVFP4 expert's input_scale in the stacked
        ``w13_input_scale`` / ``w2_input_scale``), bit for bit: the converter copies the float32."""
        want = self.sides.source_rows(u.source, 0, 1).reshape(())
        for r, index in zip(u.ranks, u.element):
            got = self._engine_element(r, u.name, index)
            if got.dtype != want.dtype or not _same_bytes(got.reshape(1), want.reshape(1)):
                return (
                    f"tensor {u.name!r} (rank {r}): element {list(index)} is {got.item()!r} ({got.dtype}), but source "
                    f"{u.source} is {want.item()!r} ({want.dtype})"
                )
            self._done(u, u.source, [r])
        return None

    def _run_rows(self, u: ExactUnit) -> str | None:
        """Each rank's row range of the source against the rank's whole tensor, byte for byte (FP8 and E8M0 both
        read as raw bytes), a tile of rows at a time: an Engram table is ~100 GB."""
        info = self.sides.source_info(u.source)
        bufs = self._buffers()
        for r, (lo, hi) in zip(u.ranks, u.rows):
            path, einfo = self.sides.engine_info(r, u.name)
            if einfo.shape[0] != hi - lo:
                return (
                    f"tensor {u.name!r} (rank {r}): {einfo.shape[0]} rows, but the rank's hash heads are source rows "
                    f"{lo}:{hi} of {u.source} ({hi - lo} rows)"
                )
            step = read_tile_rows(hi - lo, info.nbytes // max(row_count(info), 1), 1)
            for a in range(lo, hi, step):
                b = min(hi, a + step)
                want = self.sides.source_rows(u.source, a, b, bufs["source"])
                got = self.sides.engine_rows(r, u.name, a - lo, b - lo, bufs["engine"])
                if not _same_bytes(got.view(torch.uint8), want.view(torch.uint8)):
                    return f"tensor {u.name!r} (rank {r}): bytes differ from source {u.source} rows {a}:{b}"
            self._done(u, u.source, [r])
        return None


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point or b.dtype.is_floating_point:
        return torch.equal(a.to(torch.float64), b.to(torch.float64))
    return torch.equal(a.to(torch.int64), b.to(torch.int64))


class TensorCheck:
    """The per-tensor check of every output tensor, prepared to run: one check per layer (and one for embed/head)
    per component, and the coverage (every unit expected, those run computed).

    The units run in batches: :meth:`task` runs one (in a forked child of ``compute_pool.fan_out``, where the caller
    may schedule other work beside them, or here), :meth:`absorb` takes a batch's answers back, and :meth:`finish`
    runs whatever no child answered, adds the checks to the report and returns the coverage.

    ``skip_mtp_experts``: leave the MTP layers' routed experts to the forward's probe rows (expert_probes.py; numeric.py
    credits them to the coverage); they stay expected. ``pool``: run the units left to :meth:`finish` on it."""

    def __init__(
        self,
        out: Path,
        plan: Plan,
        ckpt: Checkpoint,
        headers: dict[str, ShardHeader],
        reader: RowReader,
        *,
        kernels: str,
        device: torch.device,
        seed: int,
        act: str = "bf16",
        progress: Progress | None = None,
        skip_mtp_experts: bool = False,
        pool: ComputePool | None = None,
    ) -> None:
        self.progress = progress or NoProgress()
        opts, cfg = plan.options, plan.config
        self.components = sorted({f.component for f in plan.files})
        global_scales = opts.nvfp4_input_scales == "global"  # the plan's layout (set only for NVFP4 experts under ep)
        plans = {
            comp: tensor_units(
                cfg, opts.profile, comp, opts.tp, opts.moe_parallel, set(ckpt.tensors), opts.vllm_series, global_scales
            )
            for comp in self.components
        }
        self.coverage = Coverage(plan, headers, plans)
        if skip_mtp_experts and "mtp" in plans:
            plans["mtp"] = [u for u in plans["mtp"] if not (isinstance(u, LinearUnit) and u.expert is not None)]
        self.runners = {
            comp: LinearRunner(
                _Sides(ckpt, out, plan, headers, comp, reader, device), kernels=kernels, act=act, seed=seed, pool=pool
            )
            for comp in self.components
        }
        self.jobs = [(comp, u) for comp in self.components for u in plans[comp]]
        self.per = max(1, -(-len(self.jobs) // TaskQueue.LIMIT))  # units per batch: a queue holds at most LIMIT
        # largest units first (the 1 GiB vocab tables), so that no process is left with one at the end
        self.order = sorted(range(len(self.jobs)), key=lambda i: -_unit_bytes(self.jobs[i][1]))
        self.found: dict[int, str | None] = {}  # job -> its problem (None: agrees)

    def stage(self) -> None:
        """Start this check's progress stage; its workers may have run before, beside another level."""
        self.progress.stage("numeric: tensors", len(self.jobs), unit="tensors")

    @property
    def tasks(self) -> int:
        """Batches of units, for :meth:`task`."""
        return -(-len(self.jobs) // self.per)

    def _run(self, i: int) -> str | None:
        comp, u = self.jobs[i]
        runner = self.runners[comp]
        try:
            with torch.no_grad():
                return runner.run_exact(u) if isinstance(u, ExactUnit) else runner.run(u)
        except (CheckpointError, ValueError, RuntimeError) as exc:
            return f"tensor {unit_tensors(u)[0]!r}: {exc}"

    def task(self, task: int, pool: ComputePool | None) -> tuple[list, dict]:
        """Batch ``task`` (largest units first): ``(answers, computed)`` for :meth:`absorb`, marshal-able."""
        for runner in self.runners.values():
            runner.pool = pool
        answers = [(i, self._run(i)) for i in self.order[task * self.per : (task + 1) * self.per]]
        return answers, {comp: runner.take_computed() for comp, runner in self.runners.items()}

    def absorb(self, result: tuple[list, dict]) -> None:
        answers, computed = result
        for i, msg in answers:
            self._answer(i, msg)
        for comp, records in computed.items():
            self.coverage.add(comp, {tuple(key): bits for key, bits in records.items()})

    def _answer(self, i: int, msg: str | None) -> None:
        self.found[i] = msg
        self.progress.advance(1, f"{self.jobs[i][0]} {self.jobs[i][1].group}")

    def finish(self, report: VerifyReport, pool: ComputePool | None) -> Coverage:
        """Run the units nothing answered (all of them, without children) on ``pool``; add the checks."""
        for runner in self.runners.values():
            runner.pool = pool
        todo = [i for i in range(len(self.jobs)) if i not in self.found]
        for i, msg in zip(todo, map_tasks(pool, self._run, todo)):
            self._answer(i, msg)
        for comp in self.components:
            self.coverage.add(comp, self.runners[comp].take_computed())
        checks: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (component, group) -> problems, in unit order
        sizes: dict[tuple[str, str], int] = {}
        for i, (comp, u) in enumerate(self.jobs):
            sizes[comp, u.group] = sizes.get((comp, u.group), 0) + 1
            bad = checks.setdefault((comp, u.group), [])
            if self.found[i]:
                bad.append((self.found[i], unit_tensors(u)[0]))
        for (comp, group), bad in checks.items():
            report.add(problems_check(f"numeric:{comp}/{group}", f"{comp}/{group}", bad, {"units": sizes[comp, group]}))
        return self.coverage
