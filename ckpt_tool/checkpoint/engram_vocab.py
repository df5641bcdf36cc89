"""V4.1's ``engram_compressed_vocab_size`` against the tokenizer served beside the weights.

The Engram hashes n-grams of *compressed* token ids: every token is decoded, normalized (NFKC, NFD, accents
stripped, lower case, runs of whitespace as one space, stripped) and tokens that normalize alike share an id. vLLM
0.33.0 and 0.34.0 build that map from the tokenizer when the model starts (``build_compressed_token_map`` in
vllm/models/deepseek_v41/common/engram.py, the same in both) and refuse to start when its size differs from
``engram_compressed_vocab_size``: every hash multiplier derives from it. No tensor shows the size, so only the
tokenizer can: :func:`compressed_vocab_size` makes the same map, with the same ``tokenizers`` normalizers, from the
source's ``tokenizer.json`` (what ``convert`` copies into OUT/model and vLLM then loads).
"""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
ENGRAM_VOCAB_SRC = "vllm/models/deepseek_v41/common/engram.py build_compressed_token_map, NgramHashState"


def compressed_vocab_size(tokenizer_json: Path) -> int:
    """How many compressed ids the tokenizer in ``tokenizer_json`` makes, as vLLM counts them."""
    from tokenizers import Regex, Tokenizer, normalizers

    # a private-use character keeps a token that is one space from stripping to "" (vLLM does the same)
    sentinel = "\ue000"
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    backend = Tokenizer.from_file(str(tokenizer_json))
    keys: set[str] = set()
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):  # transformers' len(tokenizer)
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # part of a UTF-8 sequence: keyed by its raw form
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        keys.add(key)
    return len(keys)


def engram_vocab_problem(config, root: Path) -> str | None:
    """One line when ``config`` (a V4Config with an Engram) gives an ``engram_compressed_vocab_size`` other than the
    one the tokenizer in ``root`` makes; None when they agree, or there is no Engram or no tokenizer.json there
    (vLLM then loads whatever tokenizer the serve command names)."""
    tokenizer = root / TOKENIZER_FILE
    if not config.is_v41 or not config.engram_layer_ids or not tokenizer.is_file():
        return None
    try:
        built = compressed_vocab_size(tokenizer)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library's own errors, e.g. an unreadable file
        return f"{tokenizer}: cannot be read as a tokenizer ({exc}); vLLM builds the Engram's token map from it"
    if built == config.engram_compressed_vocab_size:
        return None
    from ckpt_tool.checkpoint.config_keys import key_in_file

    key = key_in_file(config.raw, "engram_compressed_vocab_size")
    return (
        f"{root / 'config.json'}: {key} is {config.engram_compressed_vocab_size} in config.json, but the tokenizer "
        f"beside it ({TOKENIZER_FILE}) compresses to {built} ids, and vLLM refuses to start on the difference "
        f"({ENGRAM_VOCAB_SRC}); use the config.json and tokenizer released with these weights"
    )
