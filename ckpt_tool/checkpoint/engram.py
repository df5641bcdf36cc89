"""DeepSeek V4.1's Engram tables: their bucket layout, and which rows each tensor-parallel rank holds.

Facts from vLLM 0.33.0 / 0.34.0, ``vllm/models/deepseek_v41/common/engram.py`` (the same in both):

- ``EngramLayout`` (vLLM's; :class:`EngramSplit` here): a position is hashed as ``engram_max_ngram_size - 1``
  n-grams, each over ``engram_n_heads`` heads; every (n-gram, head) pair owns a prime-sized bucket range of its
  layer's table. The primes are drawn layer by layer, n-gram by n-gram, head by head: each the smallest prime above
  the previous one (starting from ``engram_vocab_size - 1`` for every n-gram) that no earlier pair took (one set
  across all layers).
- ``ParallelEngramEmbedding``: the table is split over TP ranks by hash head, not by rows: with
  ``n = (max_ngram_size - 1) * n_heads`` heads and ``p = ceil(n / tp)``, rank ``r`` holds heads
  ``[r*p, min((r+1)*p, n))``, i.e. rows ``[sum(sizes[:r*p]), sum(sizes[:(r+1)*p]))`` of the checkpoint table
  (its weight loader narrows at that start), so ranks hold different row counts. vLLM asserts
  ``(tp - 1) * p < n`` (no rank without a head): 24 heads refuse tp 7, 9, 10, 16, ...
- The table's E8M0 scale ([rows, dim / 32]) is split by the same rows and kept as raw bytes (uint8).

Pure Python (no torch): ``inspect`` and the planner use it on the header path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ckpt_tool.errors import PlanError


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 4,759,123,141 (bases 2, 7, 61), exact trial division below 64."""
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61):
        if n % p == 0:
            return n == p
    if n < 64:
        return True
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in (2, 7, 61):
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(frozen=True)
class EngramSplit:
    """Every Engram layer's hash-head bucket sizes (in table rows), from config.json."""

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]
    head_sizes: tuple[tuple[int, ...], ...]  # per Engram layer, per hash head (n-gram major): its bucket rows

    @classmethod
    def from_config(cls, config) -> EngramSplit | None:
        """The split of ``config`` (a V4Config); None without ``engram_layer_ids``."""
        if not config.engram_layer_ids:
            return None
        # vLLM restarts every n-gram's run at engram_vocab_size - 1 and skips the primes taken before; the primes
        # taken are then always the first ones from engram_vocab_size on (each run takes the next in order), so the
        # buckets are consecutive primes dealt out layer by layer, n-gram by n-gram, head by head: one pass, not a
        # walk over every taken prime again for each run (quadratic: a minute for 8k heads)
        heads = max(config.engram_max_ngram_size - 1, 0) * max(config.engram_n_heads, 0)
        primes: list[int] = []
        current = config.engram_vocab_size - 1
        for _ in range(len(config.engram_layer_ids) * heads):
            current += 1
            while not is_prime(current):
                current += 1
            primes.append(current)
        layers = tuple(tuple(primes[k * heads : (k + 1) * heads]) for k in range(len(config.engram_layer_ids)))
        return cls(tuple(config.engram_layer_ids), tuple(config.engram_num_embeddings), layers)

    @property
    def hash_heads(self) -> int:
        return len(self.head_sizes[0]) if self.head_sizes else 0

    def heads_per_rank(self, tp: int) -> int:
        return -(-self.hash_heads // tp)

    def accepts(self, tp: int) -> bool:
        """Whether vLLM can split the tables over ``tp`` ranks (no rank left without a hash head)."""
        return (tp - 1) * self.heads_per_rank(tp) < self.hash_heads

    def accepted_tps(self, up_to: int = 64) -> list[int]:
        return [t for t in range(1, up_to + 1) if self.accepts(t)]

    def require(self, tp: int) -> None:
        """PlanError naming vLLM's rule when ``tp`` leaves a rank without a hash head."""
        if not self.accepts(tp):
            n, p = self.hash_heads, self.heads_per_rank(tp)
            ok = ", ".join(map(str, self.accepted_tps(max(tp, 32))))
            empty = -(-n // p)  # the first rank left without a head
            ranks = f"rank {empty}" if empty == tp - 1 else f"ranks {empty}-{tp - 1}"
            raise PlanError(
                f"Engram tables: {n} hash heads over tp={tp} give {p} a rank, leaving {ranks} none; vLLM "
                f"refuses that (vllm/models/deepseek_v41/common/engram.py ParallelEngramEmbedding: "
                f"(tp - 1) * ceil(heads / tp) < heads); choose a tp it accepts: {ok}"
            )

    def rank_rows(self, layer: int, tp: int) -> list[tuple[int, int]]:
        """[start, end) table rows each rank holds of Engram layer ``layer`` (a model layer id)."""
        sizes = self.head_sizes[self.layer_ids.index(layer)]
        p = self.heads_per_rank(tp)
        out = []
        for r in range(tp):
            lo, hi = min(r * p, len(sizes)), min((r + 1) * p, len(sizes))
            out.append((sum(sizes[:lo]), sum(sizes[:hi])))
        return out


@functools.lru_cache(maxsize=8)
def engram_split(config) -> EngramSplit | None:
    """:meth:`EngramSplit.from_config`, computed once per config (the prime search walks ~10^3 candidates a head)."""
    return EngramSplit.from_config(config)
