"""Tests of the pure-torch MTP reference forward and its tensor-parallel combining."""

from __future__ import annotations

import math

import pytest
import torch

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.verify.reference import (
    DenseShard,
    MTPOutput,
    RankShard,
    apply_rope,
    attention,
    compare_outputs,
    hc_post,
    hc_pre,
    make_random_layer,
    mtp_layer_forward,
)

T = 12


def tiny_config(**overrides) -> V4Config:
    fields = dict(
        vocab_size=64,
        hidden_size=256,
        num_hidden_layers=2,
        num_nextn_predict_layers=1,
        num_attention_heads=8,
        head_dim=128,
        qk_rope_head_dim=64,
        q_lora_rank=128,
        o_groups=4,
        o_lora_rank=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        num_hash_layers=0,
        compress_ratios=(0, 0),
        hc_mult=4,
        rms_norm_eps=1e-6,
        sliding_window=8,
    )
    fields.update(overrides)
    return V4Config(**fields)


@pytest.fixture(scope="module")
def cfg() -> V4Config:
    return tiny_config()


@pytest.fixture(scope="module")
def weights(cfg: V4Config) -> dict[str, torch.Tensor]:
    return make_random_layer(cfg, seed=0)


@pytest.fixture(scope="module")
def inputs(cfg: V4Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen)
    positions = torch.arange(T)
    prev_hidden = torch.randn(T, cfg.hc_mult * cfg.hidden_size, generator=gen)
    return ids, positions, prev_hidden


@pytest.fixture(scope="module")
def ref(cfg, weights, inputs) -> MTPOutput:
    return mtp_layer_forward(cfg, DenseShard.split(cfg, weights, 1), *inputs)


def test_dense_shard_is_a_rank_shard(cfg, weights):
    assert isinstance(DenseShard(cfg, weights), RankShard)


def test_shapes_and_finite(cfg, ref):
    assert ref.hidden.shape == (T, cfg.hc_mult * cfg.hidden_size)
    assert ref.logits.shape == (T, cfg.vocab_size)
    assert ref.hidden.dtype == ref.logits.dtype == torch.float32
    assert torch.isfinite(ref.hidden).all() and torch.isfinite(ref.logits).all()
    # random weights of sensible magnitude keep activations O(1), neither exploding nor vanishing
    assert 0.01 < ref.hidden.std().item() < 100


def test_deterministic(cfg, weights, inputs, ref):
    again = mtp_layer_forward(cfg, DenseShard.split(cfg, weights, 1), *inputs)
    assert torch.equal(again.hidden, ref.hidden) and torch.equal(again.logits, ref.logits)


@pytest.mark.parametrize("tp,moe_parallel", [(2, "tp"), (4, "tp"), (2, "ep"), (4, "ep")])
def test_tensor_parallel_matches_tp1(cfg, weights, inputs, ref, tp, moe_parallel):
    out = mtp_layer_forward(cfg, DenseShard.split(cfg, weights, tp, moe_parallel), *inputs)
    m = compare_outputs(ref, out)
    assert m["hidden_max_rel"] < 1e-5 and m["logits_max_rel"] < 1e-5, m
    assert m["top1_agreement"] == 1.0 and m["top5_agreement"] == 1.0


def test_compare_outputs_detects_difference(ref):
    worse = MTPOutput(hidden=ref.hidden * 1.1, logits=-ref.logits)
    m = compare_outputs(ref, worse)
    assert m["hidden_max_rel"] == pytest.approx(0.1, rel=1e-6)
    assert m["hidden_cosine"] == pytest.approx(1.0, abs=1e-9)
    assert m["logits_cosine"] == pytest.approx(-1.0, abs=1e-9)
    assert m["top1_agreement"] == 0.0
    same = compare_outputs(ref, ref)
    assert same["hidden_max_abs"] == 0.0 and same["top1_agreement"] == same["top5_agreement"] == 1.0


def test_shards_out_of_order_rejected(cfg, weights, inputs):
    shards = DenseShard.split(cfg, weights, 2)
    with pytest.raises(ValueError, match="rank"):
        mtp_layer_forward(cfg, shards[::-1], *inputs)
    only_half = DenseShard.split(cfg, weights, 2, "ep")
    only_half[1].local_experts = []
    with pytest.raises(ValueError, match="no rank"):
        mtp_layer_forward(cfg, only_half, *inputs)


def test_position_zero_embedding_is_masked(cfg, weights, inputs, ref):
    ids, positions, prev_hidden = inputs
    other = ids.clone()
    other[0] = (ids[0] + 1) % cfg.vocab_size
    out = mtp_layer_forward(cfg, DenseShard.split(cfg, weights, 1), other, positions, prev_hidden)
    assert torch.equal(out.hidden, ref.hidden) and torch.equal(out.logits, ref.logits)
    # the same change away from position 0 does alter the result, so the mask is what hid it
    shifted = positions + 5
    a = mtp_layer_forward(cfg, DenseShard.split(cfg, weights, 1), ids, shifted, prev_hidden)
    b = mtp_layer_forward(cfg, DenseShard.split(cfg, weights, 1), other, shifted, prev_hidden)
    assert not torch.allclose(a.hidden[0], b.hidden[0])


def test_sliding_window_hides_old_keys(cfg, weights, inputs, ref):
    ids, positions, prev_hidden = inputs
    perturbed = prev_hidden.clone()
    perturbed[0] += torch.randn(perturbed.shape[1], generator=torch.Generator().manual_seed(7))
    out = mtp_layer_forward(cfg, DenseShard.split(cfg, weights, 1), ids, positions, perturbed)
    W = cfg.sliding_window
    # queries at positions >= W cannot see key 0 (only float rounding differs); queries 1..W-1 can
    torch.testing.assert_close(out.hidden[W:], ref.hidden[W:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits[W:], ref.logits[W:], rtol=1e-5, atol=1e-5)
    for t in range(1, W):
        assert (out.hidden[t] - ref.hidden[t]).abs().max() > 1e-3, t


def test_attention_is_causal(cfg, weights):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, cfg.hidden_size, generator=gen)
    shards = DenseShard.split(cfg, weights, 1)
    base = attention(cfg, shards, x, torch.arange(T))
    x2 = x.clone()
    x2[-1] += 1.0
    changed = attention(cfg, shards, x2, torch.arange(T))
    torch.testing.assert_close(changed[:-1], base[:-1], rtol=1e-5, atol=1e-5)
    assert (changed[-1] - base[-1]).abs().max() > 1e-3


def test_sink_absorbs_attention(cfg, weights):
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(T)
    plain = attention(cfg, DenseShard.split(cfg, weights, 1), x, positions)
    lowered = dict(weights, attn_sink=torch.full_like(weights["attn_sink"], 2.0))
    smaller = attention(cfg, DenseShard.split(cfg, lowered, 1), x, positions)
    huge = dict(weights, attn_sink=torch.full_like(weights["attn_sink"], 1e4))
    gone = attention(cfg, DenseShard.split(cfg, huge, 2), x, positions)
    assert smaller.norm() < plain.norm()
    assert gone.abs().max().item() < 1e-6 * plain.abs().max().item()


def test_rope_is_gptj_interleaved():
    x = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    out = apply_rope(x, torch.tensor([1]), theta=10000.0)
    # pairs (0,1) and (2,3) turn by 1 and 10000^(-1/2) = 0.01 radians
    expected = torch.tensor([[math.cos(1), math.sin(1), -math.sin(0.01), math.cos(0.01)]])
    torch.testing.assert_close(out, expected)
    # per-head broadcast, inverse, and position 0 as identity
    y = torch.randn(3, 2, 64)
    pos = torch.tensor([0, 5, 1000])
    rotated = apply_rope(y, pos, 10000.0)
    torch.testing.assert_close(rotated[0], y[0])
    torch.testing.assert_close(apply_rope(rotated, pos, 10000.0, inverse=True), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotated.norm(dim=-1), y.norm(dim=-1))


def test_hc_pre_comb_is_doubly_stochastic(cfg):
    gen = torch.Generator().manual_seed(5)
    hc, D = cfg.hc_mult, cfg.hidden_size
    x = torch.randn(T, hc, D, generator=gen)
    fn = torch.randn((2 + hc) * hc, hc * D, generator=gen) / math.sqrt(hc * D)
    base = torch.randn((2 + hc) * hc, generator=gen)
    y, post, comb = hc_pre(cfg, x, fn, torch.ones(3), base)
    assert y.shape == (T, D) and post.shape == (T, hc) and comb.shape == (T, hc, hc)
    assert (comb > 0).all()
    torch.testing.assert_close(comb.sum(-1), torch.ones(T, hc), rtol=0, atol=1e-3)
    torch.testing.assert_close(comb.sum(-2), torch.ones(T, hc), rtol=0, atol=1e-3)
    assert ((post > 0) & (post < 2)).all()


def test_hc_post_formula():
    f = torch.tensor([[1.0, 2.0]])  # [T=1, D=2]
    residual = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # [1, hc=2, 2]
    post = torch.tensor([[0.5, 1.5]])
    comb = torch.tensor([[[0.25, 0.75], [0.75, 0.25]]])  # comb[m, j]
    out = hc_post(f, residual, post, comb)
    expected = torch.tensor([[[0.5 + 0.25, 1.0 + 0.75], [1.5 + 0.75, 3.0 + 0.25]]])
    torch.testing.assert_close(out, expected)
