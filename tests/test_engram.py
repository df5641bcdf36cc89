"""DeepSeek V4.1's Engram layout (ckpt_tool.checkpoint.engram): the prime buckets and each rank's rows, against the
fixture generator's own derivation of vLLM's EngramSplit / ParallelEngramEmbedding (written separately, in
ckpt_tool/fixtures/make.py), and vLLM's refusal of a tp that leaves a rank without a hash head."""

from __future__ import annotations

import pytest

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.engram import EngramSplit, is_prime
from ckpt_tool.errors import PlanError
from ckpt_tool.fixtures.make import VARIANTS, make_config, v41_engram_head_sizes, v41_engram_rank_rows


def v41_config() -> V4Config:
    return V4Config.from_dict(make_config(VARIANTS["v41"]))


def test_is_prime_agrees_with_trial_division_far_past_the_bases() -> None:
    def slow(n: int) -> bool:
        return n > 1 and all(n % k for k in range(2, int(n**0.5) + 1))

    for n in list(range(0, 5000)) + list(range(16_000_000, 16_002_000)):
        assert is_prime(n) == slow(n), n


def test_bucket_sizes_are_the_fixtures_primes() -> None:
    layout = EngramSplit.from_config(v41_config())
    assert [list(s) for s in layout.head_sizes] == v41_engram_head_sizes()
    assert list(layout.num_embeddings) == [sum(s) for s in layout.head_sizes]


@pytest.mark.parametrize("tp", range(1, 11))
def test_rank_rows_are_the_fixtures_and_tps_are_refused_as_vllm_refuses_them(tp: int) -> None:
    cfg = v41_config()
    layout = EngramSplit.from_config(cfg)
    want = v41_engram_rank_rows(tp)
    assert layout.accepts(tp) == (want is not None)
    if want is None:
        with pytest.raises(PlanError, match=r"hash heads over tp=.* vLLM refuses"):
            layout.require(tp)
        return
    for k, layer in enumerate(cfg.engram_layer_ids):
        got = layout.rank_rows(layer, tp)
        assert [(lo, hi - lo) for lo, hi in got] == want[k]
        assert got[0][0] == 0 and got[-1][1] == layout.num_embeddings[k]  # every row on exactly one rank
        assert all(a[1] == b[0] for a, b in zip(got, got[1:]))


def test_ranks_hold_different_row_counts_at_tp_4() -> None:
    layout = EngramSplit.from_config(v41_config())
    counts = {hi - lo for lo, hi in layout.rank_rows(layout.layer_ids[0], 4)}
    assert len(counts) > 1
