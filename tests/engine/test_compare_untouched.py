"""The engine harness's comparison (``test_engine_matrix.compare``) judges a parameter the stock load never wrote by
what was written, not by the bytes the stock model happens to hold there.

vLLM's stock load leaves the classic MTP draft's embedding and head uninitialised when the checkpoint has none
(ckpt-tool materializes them from the target's): ``torch.empty`` may hand the draft the memory the target model
just freed, holding the very bytes they are compared with. These results are made by hand (no vLLM: this runs
with the unit tests), with the stock draft holding the target's bytes, other bytes, and zeros.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_engine_matrix import compare

LAYERS = 1  # the draft's head is model.layers.{LAYERS}.shared_head.head.weight
TP = 2
EMBED, LM_HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
DRAFT_HEAD = f"model.layers.{LAYERS}.shared_head.head.weight"
DRAFT_NORM = f"model.layers.{LAYERS}.enorm.weight"
MANIFEST = {"materialized": {"mtp.0.emb.tok_emb.weight": "embed.weight", "mtp.0.head.weight": "head.weight"}}


def _tensor(seed: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _result(op: str, component: str, rank: int, tensors: dict, dumps: Path, untouched=()) -> dict:
    path = dumps / f"{op}-{component}-{rank}.safetensors"
    save_file(tensors, str(path))
    keys = {k: {"dtype": "bfloat16", "shape": list(t.shape)} for k, t in tensors.items()}
    result = {
        "op": op,
        "job": {"component": component, "rank": rank, "dump": str(path)},
        "error": None,
        "exception": None,
        "load_log": [],
        "load_warnings": [],
        "keys": keys,
    }
    if op == "stock-load":
        written = sorted(k for k in tensors if k not in untouched)
        result["untouched_keys"] = sorted(untouched)
        result["provenance"] = {f"source.{k}": {"dtype": "bfloat16", "keys": [k]} for k in written}
    return result


def _results(tmp_path: Path, stock_draft: str, sharded_draft_embed_from_target: bool = True) -> list[dict]:
    """Both loads of both components on every rank. ``stock_draft``: what the stock draft's never-written embedding
    and head hold: ``"target"`` (the target's bytes: freed memory handed out again), ``"other"`` or ``"zeros"``."""
    results = []
    for rank in range(TP):
        embed, head, norm, enorm = (_tensor(10 * rank + i) for i in range(4))
        target = {EMBED: embed, LM_HEAD: head, NORM: norm}
        results.append(_result("sharded-load", "model", rank, target, tmp_path))
        results.append(_result("stock-load", "model", rank, target, tmp_path))
        sharded_embed = embed if sharded_draft_embed_from_target else _tensor(99)
        results.append(
            _result("sharded-load", "mtp", rank, {EMBED: sharded_embed, DRAFT_HEAD: head, DRAFT_NORM: enorm}, tmp_path)
        )
        held = {
            "target": (embed, head),
            "other": (_tensor(50 + rank), _tensor(60 + rank)),
            "zeros": (torch.zeros_like(embed), torch.zeros_like(head)),
        }[stock_draft]
        stock = {EMBED: held[0].clone(), DRAFT_HEAD: held[1].clone(), DRAFT_NORM: enorm}
        results.append(_result("stock-load", "mtp", rank, stock, tmp_path, untouched=(EMBED, DRAFT_HEAD)))
    return results


@pytest.mark.parametrize("stock_draft", ["target", "other", "zeros"])
def test_declared_materializations_are_counted_whatever_the_stock_memory_holds(stock_draft, tmp_path):
    problems, allowed, _ = compare(_results(tmp_path, stock_draft), TP, MANIFEST, LAYERS)
    assert problems == []
    assert sorted(allowed) == sorted(
        f"mtp rank {rank}: {key} materialized from the target's {ref} (stock leaves it uninitialised)"
        for rank in range(TP)
        for key, ref in ((EMBED, EMBED), (DRAFT_HEAD, LM_HEAD))
    )


@pytest.mark.parametrize("stock_draft", ["target", "other"])
def test_undeclared_materializations_are_problems_whatever_the_stock_memory_holds(stock_draft, tmp_path):
    problems, allowed, _ = compare(_results(tmp_path, stock_draft), TP, {}, LAYERS)
    assert allowed == []
    assert len(problems) == 2 * TP and all("the manifest lists no materialization" in p for p in problems), problems


@pytest.mark.parametrize("stock_draft", ["target", "other"])
def test_a_materialization_that_is_not_the_targets_bytes_is_a_problem(stock_draft, tmp_path):
    results = _results(tmp_path, stock_draft, sharded_draft_embed_from_target=False)
    problems, allowed, _ = compare(results, TP, MANIFEST, LAYERS)
    assert sorted(problems) == [
        f"mtp rank {rank}: {EMBED} is materialized but differs from the target's {EMBED}" for rank in range(TP)
    ]
    assert len(allowed) == TP  # the heads


def test_a_written_key_that_differs_is_still_a_problem(tmp_path):
    results = _results(tmp_path, "other")
    stock_draft = next(r for r in results if r["op"] == "stock-load" and r["job"]["component"] == "mtp")
    tensors = {k: _tensor(7) if k == DRAFT_NORM else _tensor(8) for k in (EMBED, DRAFT_HEAD, DRAFT_NORM)}
    save_file(tensors, stock_draft["job"]["dump"])
    problems, _, _ = compare(results, TP, MANIFEST, LAYERS)
    assert [p for p in problems if DRAFT_NORM in p] and all("differs from the stock load" in p for p in problems)
