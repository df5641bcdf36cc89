"""jsondoc.json_pieces_sharing: pieces that join to the text of json.dumps, with repeated lists encoded once."""

from __future__ import annotations

import json

import pytest

from ckpt_tool.cli.jsondoc import json_pieces_sharing


def dumps_sharing(doc: dict, lists: tuple[str, ...], key: str) -> str:
    return "".join(json_pieces_sharing(doc, lists, key))


def test_dumps_sharing_is_byte_for_byte_json_dumps() -> None:
    shared = ("a.weight", "b.weight")
    doc = {
        "sources": 7,  # the same key outside the holders: left alone
        "files": [
            {
                "file": "x",
                "tensors": [{"name": 'n "sources": null', "sources": shared}, {"name": "é\n", "sources": list(shared)}],
            },
            {"file": "y", "tensors": []},
            {"file": "z", "tensors": [{"sources": ()}, {"sources": ('"sources": null', "ü")}, {"sources": shared}]},
        ],
        "notes": ['"sources": null'],
    }
    before = json.dumps(doc)
    assert dumps_sharing(doc, ("files", "tensors"), "sources") == before
    assert json.dumps(doc) == before  # the holders got their lists back


def test_dumps_sharing_restores_the_document_when_encoding_fails() -> None:
    class Boom:
        def __str__(self) -> str:
            raise RuntimeError("no")

    doc = {"files": [{"tensors": [{"sources": ["a"], "bad": Boom()}]}]}
    with pytest.raises(RuntimeError):
        dumps_sharing(doc, ("files", "tensors"), "sources")
    assert doc["files"][0]["tensors"][0]["sources"] == ["a"]
