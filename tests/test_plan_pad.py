"""Shared experts whose 128-blocks do not divide tp: planned, written and shown as vLLM 0.33 loads them.

vLLM 0.33 (``DeepseekV4MLP``, ``_pad_shared_expert_weight``) gives each rank cdiv(blocks, tp) blocks of the
shared experts' intermediate dim and zero-pads the checkpoint's weights (scales) to that before its even TP
split: ranks hold their real blocks first, then zeros. The fixtures' ``-pad`` variants have 3 blocks
(moe_intermediate_size 384). That the bytes are what vLLM's own loader holds is proven in tests/engine.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from cli_helpers import run_cli

from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.errors import PlanError
from ckpt_tool.fixtures.make import HIDDEN
from ckpt_tool.mapping.plan import ZERO, Options, OutFile, OutTensor, Segment
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.output.writer import CHUNK, SourceFiles, write_output_file

SHARED = "model.layers.0.ffn.experts._shared_experts._layer."
SRC = "layers.0.ffn.shared_experts."
E8M0_ZERO_AS_F32 = struct.pack("<I", 0x00400000)  # 2^-127


def shared_tensors(
    variant_dir: Path, tp: int, moe: str = "ep", profile: str = "vllm-0.33+"
) -> dict[int, dict[str, OutTensor]]:
    ck = open_checkpoint(variant_dir)
    plan = plan_conversion(ck.require_config(), ck.tensors, Options(tp=tp, moe_parallel=moe, profile=profile))
    out: dict[int, dict[str, OutTensor]] = {}
    for f in plan.files:
        if f.component == "model":
            out.setdefault(f.rank, {}).update(
                {t.name[len(SHARED) :]: t for t in f.tensors if t.name.startswith(SHARED)}
            )
    return out


def test_three_blocks_at_tp4_give_every_rank_one_block_and_rank_3_zeros_only(fixture_dir) -> None:
    ranks = shared_tensors(fixture_dir("fp4-pad"), 4)
    H, hb = HIDDEN, HIDDEN // 128
    for r in range(3):  # one real block of w1 and of w3 each, no padding
        t = ranks[r]
        assert t["gate_up_proj.weight"].shape == (256, H) and t["gate_up_proj.weight"].padding == 0
        assert list(t["gate_up_proj.weight"].segments) == [
            Segment(SRC + "w1.weight", 128 * r, 128 * (r + 1), 0, H),
            Segment(SRC + "w3.weight", 128 * r, 128 * (r + 1), 0, H),
        ]
        assert list(t["gate_up_proj.weight_scale_inv"].segments) == [
            Segment(SRC + "w1.scale", r, r + 1, 0, hb),
            Segment(SRC + "w3.scale", r, r + 1, 0, hb),
        ]
        assert list(t["down_proj.weight"].segments) == [Segment(SRC + "w2.weight", 0, H, 128 * r, 128 * (r + 1))]
        assert list(t["down_proj.weight_scale_inv"].segments) == [Segment(SRC + "w2.scale", 0, hb, r, r + 1)]
    t = ranks[3]  # past the end: the engine's zeros, in the shapes every rank has
    assert list(t["gate_up_proj.weight"].segments) == [Segment(ZERO, 0, 128, 0, H), Segment(ZERO, 0, 128, 0, H)]
    assert list(t["gate_up_proj.weight_scale_inv"].segments) == [Segment(ZERO, 0, 1, 0, hb), Segment(ZERO, 0, 1, 0, hb)]
    assert list(t["down_proj.weight"].segments) == [Segment(ZERO, 0, H, 0, 128)]
    assert list(t["down_proj.weight_scale_inv"].segments) == [Segment(ZERO, 0, hb, 0, 1)]
    assert {n: x.shape for n, x in t.items()} == {
        "gate_up_proj.weight": (256, H),
        "gate_up_proj.weight_scale_inv": (2, hb),
        "down_proj.weight": (H, 128),
        "down_proj.weight_scale_inv": (hb, 1),
    }
    assert {n: x.padding for n, x in t.items()} == {
        "gate_up_proj.weight": 256 * H,
        "gate_up_proj.weight_scale_inv": 2 * hb,
        "down_proj.weight": H * 128,
        "down_proj.weight_scale_inv": hb,
    }


def test_three_blocks_at_tp2_give_rank_1_one_real_block_then_zeros(fixture_dir) -> None:
    ranks = shared_tensors(fixture_dir("fp4-pad"), 2)
    H, hb = HIDDEN, HIDDEN // 128
    assert [x.padding for x in ranks[0].values()] == [0, 0, 0, 0]
    t = ranks[1]
    assert t["gate_up_proj.weight"].shape == (512, H)
    assert list(t["gate_up_proj.weight"].segments) == [  # w1's share (its last block, then a zero block), then w3's
        Segment(SRC + "w1.weight", 256, 384, 0, H),
        Segment(ZERO, 0, 128, 0, H),
        Segment(SRC + "w3.weight", 256, 384, 0, H),
        Segment(ZERO, 0, 128, 0, H),
    ]
    # row parallel: every row holds the last real block's columns, then a block of zero columns
    assert t["down_proj.weight"].shape == (H, 256)
    assert list(t["down_proj.weight"].segments) == [Segment(SRC + "w2.weight", 0, H, 256, 384, pad=128)]
    assert list(t["down_proj.weight_scale_inv"].segments) == [Segment(SRC + "w2.scale", 0, hb, 2, 3, pad=1)]
    assert t["down_proj.weight"].padding == H * 128


def test_float32_scale_padding_is_the_e8m0_zero_byte_converted(fixture_dir) -> None:
    """vLLM pads in the loaded dtype, then loads: E8M0 byte 0 in a float32 parameter is 2^-127, not 0.0."""
    t = shared_tensors(fixture_dir("fp8-e8m0-pad"), 2, moe="ep")[1]
    assert t["gate_up_proj.weight_scale_inv"].dtype == "F32"
    zero = [s for s in t["gate_up_proj.weight_scale_inv"].segments if s.src == ZERO]
    assert zero and all(s.convert == "e8m0_to_f32" for s in zero)
    assert {s.convert for s in t["gate_up_proj.weight"].segments} == {"copy"}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("variant", ["fp4", "fp8"])
def test_splits_that_divide_plan_no_padding(fixture_dir, variant: str, tp: int) -> None:
    ck = open_checkpoint(fixture_dir(variant))
    plan = plan_conversion(ck.require_config(), ck.tensors, Options(tp=tp))
    assert not [t.name for f in plan.files for t in f.tensors if t.padding]
    assert all(s.src != ZERO and s.pad == 0 for f in plan.files for t in f.tensors for s in t.segments)
    assert not any("zero-filled" in n for n in plan.notes)


def test_the_seed_profile_keeps_refusing_what_its_loader_cannot_split(fixture_dir) -> None:
    with pytest.raises(
        PlanError,
        match=r"shared_experts\.w1\.scale': 3 scale blocks on dim 0 do not split evenly over tp=4.*choose a smaller tp",
    ):
        shared_tensors(fixture_dir("fp4-pad"), 4, profile="vllm-seed")


def test_attention_and_routed_experts_still_refuse_a_tp_their_blocks_do_not_divide(fixture_dir) -> None:
    ck = open_checkpoint(fixture_dir("fp4"))  # 4-block shared experts would pad at tp 8; wq_b's 4 blocks refuse
    with pytest.raises(
        PlanError, match=r"'layers\.0\.attn\.wq_b\.scale': 4 scale blocks on dim 0 do not split evenly over tp=8"
    ):
        plan_conversion(ck.require_config(), ck.tensors, Options(tp=8))
    ck = open_checkpoint(fixture_dir("fp8-e8m0-pad"))  # 3-block fp8 routed experts under --moe-parallel tp
    with pytest.raises(
        PlanError, match=r"'layers\.0\.ffn\.experts\.0\.w1\.scale': 3 scale blocks.*choose a smaller tp"
    ):
        plan_conversion(ck.require_config(), ck.tensors, Options(tp=2))


@pytest.mark.parametrize("tp", [2, 4])
def test_mxfp4_experts_with_rows_vllm_rounds_up_are_refused_under_tp_moe(fixture_dir, tp: int) -> None:
    """fp4-pad's routed experts leave 192 / 96 intermediate rows a rank under --moe-parallel tp; most of vLLM's
    MXFP4 MoE backends round that up to 256 / 128 at load (a backend-dependent layout the sharded loader would
    fill by copying our rows into the wrong places): refused, pointing at --moe-parallel ep, which plans."""
    ck = open_checkpoint(fixture_dir("fp4-pad"))
    with pytest.raises(
        PlanError,
        match=rf"moe_intermediate_size=384 over tp={tp} leaves {384 // tp} rows a rank, "
        r"not a multiple of 128.*--moe-parallel ep",
    ):
        plan_conversion(ck.require_config(), ck.tensors, Options(tp=tp))
    assert plan_conversion(ck.require_config(), ck.tensors, Options(tp=tp, moe_parallel="ep")).files


def test_dry_run_shows_the_padding(fixture_dir, tmp_path, capsys) -> None:
    src, out = fixture_dir("fp4-pad"), tmp_path / "out"
    code, stdout, err = run_cli(capsys, "convert", src, out, "--tp", "4", "--moe-parallel", "ep", "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert any("zero-filled" in n and "rank 3" in n for n in doc["notes"]), doc["notes"]
    tensors = {(f["rank"], t["name"]): t for f in doc["files"] for t in f["tensors"]}
    t = tensors[(3, SHARED + "down_proj.weight")]
    assert t["padding"] == HIDDEN * 128 and t["segments"] == [
        {"kind": "zero", "rows": HIDDEN, "cols": 128, "convert": "copy"}
    ]
    assert "segments" not in tensors[(0, SHARED + "down_proj.weight")]  # no padding: plain slices, not listed
    code, stdout, err = run_cli(capsys, "convert", src, out, "--tp", "2", "--moe-parallel", "ep", "--dry-run")
    assert code == 0, err
    lines = [line.split("\t") for line in stdout.splitlines()]
    assert [
        "zero-pad",
        "model/model-rank-1-part-0.safetensors",
        SHARED + "down_proj.weight",
        str(HIDDEN * 128),
    ] in lines
    assert any(line[0] == "note" and "zero-filled" in line[1] for line in lines)
    assert not out.exists()


def test_writer_streams_a_zero_fill_larger_than_its_buffers_keeping_the_float32_pattern(tmp_path) -> None:
    """A zero segment after a 3-byte tensor (so buffers end inside an element), longer than one CHUNK."""
    src = tmp_path / "src.safetensors"
    header = json.dumps({"s": {"dtype": "F8_E8M0", "shape": [3], "data_offsets": [0, 3]}}).encode()
    header += b" " * (-len(header) % 8)
    src.write_bytes(struct.pack("<Q", len(header)) + header + bytes([127, 0, 128]))
    info = TensorInfo("s", "F8_E8M0", (3,), src.name, 8 + len(header), 8 + len(header) + 3)
    n = CHUNK // 4 + 5
    out = OutFile(
        "model",
        0,
        0,
        (
            OutTensor("a", "U8", (3,), (Segment("s", 0, 3, 0, 1, "raw_uint8"),), "r", ("s",)),
            OutTensor("b", "F32", (n, 1), (Segment(ZERO, 0, n, 0, 1, "e8m0_to_f32"),), "r", ("s",), n),
        ),
    )
    files = SourceFiles(tmp_path)
    try:
        size, _digest = write_output_file(out, tmp_path / "out.safetensors", files, {"s": info})
    finally:
        files.close()
    data = (tmp_path / "out.safetensors").read_bytes()
    assert len(data) == size
    assert data[-(3 + 4 * n) :] == bytes([127, 0, 128]) + E8M0_ZERO_AS_F32 * n
