"""The two weight sides of the reference forward: side A, the source checkpoint dequantized in plain torch on one
rank, and side B, one rank of the converted checkpoint through the quantized GEMM kernels; both read a weight a tile
at a time and answer the forward's ``tensor``, ``embedding`` and ``linear`` calls by role
(:mod:`ckpt_tool.verify.forward_names`)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from ckpt_tool.checkpoint.blocks import FP8_BLOCK, cdiv
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.expert_format import layer_format
from ckpt_tool.checkpoint.headers import ShardHeader, TensorInfo
from ckpt_tool.checkpoint.reader import Scratch
from ckpt_tool.checkpoint.source import Checkpoint
from ckpt_tool.errors import CheckpointError
from ckpt_tool.mapping.plan import Plan
from ckpt_tool.verify import tiled_matmul
from ckpt_tool.verify.compute_pool import ComputePool, compute_slot, map_tasks
from ckpt_tool.verify.forward_names import CONVERTED_TENSORS, SOURCE_LINEARS, SOURCE_TENSORS
from ckpt_tool.verify.kernels import fp8_block_gemm, mxfp4_gemm, nvfp4_gemm
from ckpt_tool.verify.kernels.fp8_gemm import prepare_activation
from ckpt_tool.verify.rows import RowReader, read_tile_rows, source_info

_local = threading.local()


def _tile_buffers() -> tuple[Scratch, Scratch]:
    """This thread's buffers for a weight tile and its scales: :func:`_gemm_by_tiles` multiplies each tile
    before it reads the next, and the two sides of the forward are compared by their outputs only."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = (Scratch(), Scratch())
    return bufs


def _gemm_by_tiles(
    x: torch.Tensor, rows: int, row_bytes: int, align: int, tile, gemm, pool: ComputePool | None
) -> torch.Tensor:
    """``x[..., in] @ W.T`` for a weight of ``rows`` output rows of ``row_bytes``, read ``tile(a, b) -> (w, s)`` a
    tile at a time; the tiles on ``pool`` when called outside it (the head), else in this thread (an expert)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float()
    step = read_tile_rows(rows, row_bytes, align)

    def one(a: int) -> torch.Tensor:
        w, s = tile(a, min(a + step, rows))
        with compute_slot(pool):
            return gemm(x2, w, s)

    y = torch.cat(list(map_tasks(pool, one, range(0, rows, step))), dim=-1)
    return y.reshape(*lead, rows)


class SourceShard:
    """Side A: the original checkpoint, one rank, dequantized in plain torch a tile at a time."""

    def __init__(
        self,
        cfg: V4Config,
        ckpt: Checkpoint,
        mtp: int,
        device: torch.device,
        reader: RowReader,
        act: str = "bf16",
        pool: ComputePool | None = None,
    ) -> None:
        self.cfg, self.mtp, self.act, self.pool = cfg, mtp, act, pool
        self.rank, self.tp = 0, 1
        self.local_experts = list(range(cfg.n_routed_experts))
        self.ckpt, self.reader, self.device = ckpt, reader, device
        self.names = set(ckpt.tensors)
        p = f"mtp.{mtp}."
        # the draft model's one embedding is mtp.0's (seed loader), else the main one
        self.embed_name = "mtp.0.emb.tok_emb.weight" if "mtp.0.emb.tok_emb.weight" in self.names else "embed.weight"
        self.head_name = p + "head.weight" if p + "head.weight" in self.names else "head.weight"

    def _info(self, name: str) -> TensorInfo:
        return source_info(self.ckpt, name)

    def _rows(self, name: str, r0: int, r1: int, into: Scratch | None = None) -> torch.Tensor:
        return self.reader.source_rows(self.ckpt, name, r0, r1, into).to(self.device)

    def tensor(self, role: str) -> torch.Tensor:
        info = self._info(f"mtp.{self.mtp}." + SOURCE_TENSORS[role])
        return self.reader.source_whole(self.ckpt, info).to(self.device).float()

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._rows(self.embed_name, int(i), int(i) + 1) for i in ids.tolist()]).float()

    def linear(self, role: str, x: torch.Tensor) -> torch.Tensor:
        p, cfg = f"mtp.{self.mtp}.", self.cfg
        if role == "head":
            return _gemm_by_tiles(
                x,
                cfg.vocab_size,
                2 * x.shape[-1],
                1,
                lambda a, b: (self._rows(self.head_name, a, b, _tile_buffers()[0]), None),
                lambda x2, w, s: tiled_matmul.bf16_matmul(x2, w),
                self.pool,
            )
        r0 = 0
        if role.startswith("expert."):
            _, j, w = role.split(".")
            base = f"{p}ffn.experts.{j}.{w}"
        elif role.startswith("wo_a."):
            r0 = int(role.split(".")[1]) * cfg.o_lora_rank
            base = p + SOURCE_LINEARS["wo_a"]
        else:
            base = p + SOURCE_LINEARS[role]
        # the routed experts' format as vLLM builds this layer's (MXFP4, block FP8, or NVIDIA's NVFP4)
        kind = layer_format(cfg, f"mtp.{self.mtp}").name if role.startswith("expert.") else "fp8"
        fp4 = kind in ("mxfp4", "nvfp4")
        rows = cfg.o_lora_rank if role.startswith("wo_a.") else self._info(base + ".weight").shape[0]
        align = 1 if fp4 else FP8_BLOCK
        scale = base + (".weight_scale" if kind == "nvfp4" else ".scale")  # NVFP4: E4M3 blocks, F32 weight_scale_2
        g = self._rows(base + ".weight_scale_2", 0, 1) if kind == "nvfp4" else None

        def tile(a: int, b: int):
            a, b = r0 + a, r0 + b
            s0, s1 = (a, b) if fp4 else (a // FP8_BLOCK, cdiv(b, FP8_BLOCK))
            w_buf, s_buf = _tile_buffers()
            return self._rows(base + ".weight", a, b, w_buf), self._rows(scale, s0, s1, s_buf)

        # Same activation rounding as the kernels (bf16, or per-token-group fp8; the MXFP4 and NVFP4 GEMMs always
        # take bf16): both sides then compute identical math up to summation order, so routing
        # decisions cannot flip on rounding noise and the tolerances can stay tight.
        def gemm(x2, w, s):
            if kind == "nvfp4":
                return tiled_matmul.nvfp4_matmul(prepare_activation(x2, "bf16"), w, s, g, what=base)
            if fp4:
                return tiled_matmul.mxfp4_matmul(prepare_activation(x2, "bf16"), w, s, what=base)
            return tiled_matmul.fp8_block_matmul(prepare_activation(x2, self.act), w, s, what=base)

        return _gemm_by_tiles(x, rows, x.shape[-1] // 2 if fp4 else x.shape[-1], align, tile, gemm, self.pool)


class ConvertedShard:
    """Side B: one rank of the converted checkpoint, linears through the quantized GEMM kernels a tile at a time."""

    def __init__(
        self,
        cfg: V4Config,
        plan: Plan,
        out: Path,
        headers: dict[str, ShardHeader],
        rank: int,
        mtp: int,
        device: torch.device,
        reader: RowReader,
        kernels: str,
        act: str,
        pool: ComputePool | None = None,
    ) -> None:
        opts = plan.options
        self.cfg, self.rank, self.tp, self.pool = cfg, rank, opts.tp, pool
        self.kernels, self.act, self.reader, self.device = kernels, act, reader, device
        E = cfg.n_routed_experts
        self.local_experts = (
            list(range(E)) if opts.moe_parallel == "tp" else list(range(rank * E // opts.tp, (rank + 1) * E // opts.tp))
        )
        S = cfg.num_hidden_layers + mtp
        if opts.profile not in CONVERTED_TENSORS:
            raise CheckpointError(f"numeric verify has no name table for profile {opts.profile!r}")
        self.names = {k: v.format(S=S) for k, v in CONVERTED_TENSORS[opts.profile].items()}
        self.locate: dict[str, tuple[Path, TensorInfo]] = {}
        for f in plan.files:
            if f.component == "mtp" and f.rank == rank and f.relpath in headers:
                self.locate.update({n: (out / f.relpath, t) for n, t in headers[f.relpath].tensors.items()})
        self.expert_kind = layer_format(cfg, f"mtp.{mtp}").name  # mxfp4 | fp8 | nvfp4, as vLLM builds this layer's

    def _info(self, name: str) -> tuple[Path, TensorInfo]:
        hit = self.locate.get(name)
        if hit is None:
            raise CheckpointError(f"tensor {name!r} is not in rank {self.rank}'s files")
        return hit

    def _rows(self, name: str, r0: int, r1: int, into: Scratch | None = None) -> torch.Tensor:
        path, info = self._info(name)
        return self.reader.rows(path, info, r0, r1, into).to(self.device)

    def tensor(self, role: str) -> torch.Tensor:
        path, info = self._info(self.names[role])
        return self.reader.whole(path, info).to(self.device).float()

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        name = self.names["embed"]
        return torch.cat([self._rows(name, int(i), int(i) + 1) for i in ids.tolist()]).float()

    def _linear(
        self,
        x: torch.Tensor,
        weight: str,
        scale: str,
        r0: int,
        rows: int,
        *,
        mx: bool,
        slot: int | None = None,
        g: torch.Tensor | None = None,
        what: str,
    ) -> torch.Tensor:
        """Rows [r0, r0 + rows) of ``weight`` (of stacked expert ``slot``) through the kernel (``mx``: packed fp4,
        NVFP4 when its global scale ``g`` is given, else MXFP4)."""
        wbase = sbase = 0
        if slot is not None:
            wbase = slot * self._info(weight)[1].shape[1]
            sbase = slot * self._info(scale)[1].shape[1]
        if not mx and (r0 % FP8_BLOCK or (rows % FP8_BLOCK and r0 + rows != self._info(weight)[1].shape[-2])):
            raise CheckpointError(f"{weight}: rows {r0}:{r0 + rows} do not fall on {FP8_BLOCK}-row scale blocks")

        def tile(a: int, b: int):
            a, b = r0 + a, r0 + b
            s0, s1 = (a, b) if mx else (a // FP8_BLOCK, cdiv(b, FP8_BLOCK))
            w_buf, s_buf = _tile_buffers()
            return self._rows(weight, wbase + a, wbase + b, w_buf), self._rows(scale, sbase + s0, sbase + s1, s_buf)

        def gemm(x2, w, s):
            if g is not None:
                return nvfp4_gemm(x2, w, s, g, backend=self.kernels, what=what)
            if mx:
                return mxfp4_gemm(x2, w, s, backend=self.kernels, what=what)
            return fp8_block_gemm(x2, w, s, act=self.act, backend=self.kernels, what=what)

        return _gemm_by_tiles(
            x, rows, x.shape[-1] // 2 if mx else x.shape[-1], 1 if mx else FP8_BLOCK, tile, gemm, self.pool
        )

    def _global_scale(self, name: str, slot: int, part: int | None) -> torch.Tensor | None:
        """An NVFP4 expert's global scale (0-d): ``w13_weight_scale_2[slot, part]`` (part 0: w1, 1: w3) or
        ``w2_weight_scale_2[slot]`` (vLLM 0.34.0 modelopt.py ``ModelOptNvFp4FusedMoE.create_weights``); None unless
        this layer's experts are NVFP4."""
        if self.expert_kind != "nvfp4":
            return None
        shape = self._info(name)[1].shape
        if len(shape) != (1 if part is None else 2) or slot >= shape[0] or (part is not None and part >= shape[1]):
            raise CheckpointError(f"{name}: shape {list(shape)} holds no global scale for expert slot {slot}")
        if part is None:
            return self._rows(name, 0, 1).reshape(-1)[slot]
        return self._rows(name, slot, slot + 1)[0, part]

    def _fp8(self, x: torch.Tensor, base: str, r0: int = 0, rows: int | None = None) -> torch.Tensor:
        if rows is None:
            rows = self._info(base + ".weight")[1].shape[0] - r0
        return self._linear(x, base + ".weight", base + ".weight_scale_inv", r0, rows, mx=False, what=base)

    def linear(self, role: str, x: torch.Tensor) -> torch.Tensor:
        n, cfg = self.names, self.cfg
        if role == "head":
            name = n["head"]
            rows = self._info(name)[1].shape[0]
            return _gemm_by_tiles(
                x,
                rows,
                2 * x.shape[-1],
                1,
                lambda a, b: (self._rows(name, a, b, _tile_buffers()[0]), None),
                lambda x2, w, s: tiled_matmul.bf16_matmul(x2, w),
                self.pool,
            )
        if role in ("e_proj", "h_proj", "wq_b", "wo_b"):
            return self._fp8(x, n[role])
        if role in ("wq_a", "wkv"):
            Qr, Dh = cfg.q_lora_rank, cfg.head_dim
            r0, rows = (0, Qr) if role == "wq_a" else (Qr, Dh)
            return self._fp8(x, n["fused_wqa_wkv"], r0, rows)
        if role.startswith("wo_a."):
            g, Or = int(role.split(".")[1]), cfg.o_lora_rank
            return self._fp8(x, n["wo_a"], g * Or, Or)
        if role in (
            "shared.w1",
            "shared.w3",
        ):  # w1 rows then w3 rows, each the rank's share (zero-padded by the engine)
            half = self._info(n["gate_up_proj"] + ".weight")[1].shape[0] // 2
            return self._fp8(x, n["gate_up_proj"], 0 if role == "shared.w1" else half, half)
        if role == "shared.w2":
            return self._fp8(x, n["down_proj"])
        if role.startswith("expert."):
            _, j, which = role.split(".")
            slot = self.local_experts.index(int(j))
            base = n["experts"]
            sfx = "weight_scale_inv" if self.expert_kind == "fp8" else "weight_scale"
            mx = self.expert_kind != "fp8"
            what = f"{base} expert {j} {which}"
            if which == "w2":
                rows = self._info(f"{base}.w2_weight")[1].shape[1]
                g = self._global_scale(f"{base}.w2_weight_scale_2", slot, None)
                w, s = f"{base}.w2_weight", f"{base}.w2_{sfx}"
                return self._linear(x, w, s, 0, rows, mx=mx, slot=slot, g=g, what=what)
            half = self._info(f"{base}.w13_weight")[1].shape[1] // 2
            r0 = 0 if which == "w1" else half
            g = self._global_scale(f"{base}.w13_weight_scale_2", slot, 0 if which == "w1" else 1)
            w, s = f"{base}.w13_weight", f"{base}.w13_{sfx}"
            return self._linear(x, w, s, r0, half, mx=mx, slot=slot, g=g, what=what)
        raise KeyError(f"unknown linear role {role!r}")
