"""ckpt-tool's count of V4.1's compressed vocabulary (ckpt_tool/checkpoint/engram_vocab.py) against vLLM's own
``build_compressed_token_map`` (vllm/models/deepseek_v41/common/engram.py of each verified release), on tokenizers
that exercise every branch of it: case, accents, compatibility forms, runs of whitespace, a lone space, added
special tokens and byte tokens that are part of a UTF-8 sequence.

vLLM's function is taken from the wheel's file as it stands (its source, executed alone: it needs only the
``tokenizers`` library) and handed what transformers' fast tokenizer gives it: ``backend_tokenizer`` and a length of
``get_vocab_size(with_added_tokens=True)`` (transformers' ``PreTrainedTokenizerFast.__len__``).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from ckpt_tool.checkpoint.engram_vocab import compressed_vocab_size
from ckpt_tool.fixtures.make import serving_files

ENGRAM_FILE = "vllm/models/deepseek_v41/common/engram.py"


def _vllms_builder(site: Path):
    """``build_compressed_token_map`` from the release's engram.py, executed on its own."""
    tree = ast.parse((site / ENGRAM_FILE).read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_compressed_token_map"]
    namespace: dict = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), ENGRAM_FILE, "exec"), namespace)  # noqa: S102
    return namespace["build_compressed_token_map"]


class _FastTokenizer:
    """What build_compressed_token_map reads of transformers' PreTrainedTokenizerFast."""

    def __init__(self, path: Path) -> None:
        self.backend_tokenizer = Tokenizer.from_file(str(path))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the character a byte-level BPE vocabulary stores for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_CHARS = _byte_chars()


def _byte_level(data: bytes) -> str:
    return "".join(BYTE_CHARS[b] for b in data)


def _byte_level_tokenizer(path: Path) -> Path:
    words = ["The", " the", "THE", " The", "café", "cafe", " café", "ﬁ", "fi", " ", "  ", "\t", "\n", " \n ", "Ω", "Ω"]
    pieces = [w.encode() for w in words] + [b"\xc3", b"\xe2\x82", b"\xa9"]  # the last: parts of UTF-8 sequences
    vocab = {_byte_level(p): i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=_byte_level(b"The")))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|end|>", special=True), AddedToken("<|END|>", special=True)])
    tok.save(str(path))
    return path


def _fixture_tokenizer(path: Path) -> Path:
    path.write_text(serving_files()["tokenizer.json"])
    return path


@pytest.mark.parametrize("make", [_byte_level_tokenizer, _fixture_tokenizer], ids=["byte-level", "fixture"])
def test_the_compressed_vocabulary_is_counted_as_vllm_counts_it(engine_site, tmp_path, make) -> None:
    path = make(tmp_path / "tokenizer.json")
    _, vllms = _vllms_builder(engine_site)(_FastTokenizer(path))
    assert compressed_vocab_size(path) == vllms
    if make is _byte_level_tokenizer:  # the cases merge: the count is not simply the vocabulary's size
        assert vllms < len(_FastTokenizer(path)), json.loads(path.read_text())["model"]["vocab"]
