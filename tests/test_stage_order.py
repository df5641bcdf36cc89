"""The package reads top to bottom: no module imports from a later stage.

The stages, in order: ``checkpoint`` (read) < ``mapping`` (plan) < ``output`` (write) < ``verify`` < ``cli``. A module
may import from its own stage and from earlier ones, never from a later one. Besides the stages:

- ``ckpt_tool/__init__.py`` (the version), ``errors.py`` and ``processes.py`` are shared base modules: any module may
  import them, and they import only each other.
- ``ckpt_tool/__main__.py`` is the command line's entry point: it belongs to ``cli``.
- ``fixtures/`` generates test inputs beside the pipeline: it may import ``checkpoint``, ``mapping`` and ``output``
  (``broken.py``'s ``finished-without-force`` case needs a real finished OUT, made by the library's convert), never
  ``verify`` or ``cli``; and no module of the pipeline imports it.
- Files run by path in another interpreter, where ckpt_tool may not import (``verify/engine/probe.py`` and
  ``vllm_stubs.py`` in the user's vLLM venv, ``checkpoint/dtypes.py`` in tests/engine/vllm_worker.py), import no
  ckpt_tool module at all.

Every import counts: module level, inside functions, under ``if TYPE_CHECKING``. The files are parsed (``ast``),
not imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ckpt_tool"
STAGES = ("checkpoint", "mapping", "output", "verify", "cli")
BASE = {"ckpt_tool", "ckpt_tool.errors", "ckpt_tool.processes"}
FIXTURES_MAY_IMPORT = {"checkpoint", "mapping", "output"}
STANDALONE = {"ckpt_tool.verify.engine.probe", "ckpt_tool.verify.engine.vllm_stubs", "ckpt_tool.checkpoint.dtypes"}

# Imports from a later stage not yet moved, each with why it is there; a new one fails the test, and an entry here
# that no longer matches an import fails too, so the list only shrinks.
KNOWN_LATER_IMPORTS: set[tuple[str, str]] = set()  # (importer, imported) pairs waiting to move, each with its reason


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every ckpt_tool module ``path`` imports, anywhere in the file (``from X import y`` counts as X)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
    return {m for m in found if m == "ckpt_tool" or m.startswith("ckpt_tool.")}


def part_of(module: str) -> str:
    """The stage of ``module`` ("checkpoint" .. "cli"), or "base" or "fixtures"."""
    if module in BASE:
        return "base"
    if module == "ckpt_tool.__main__":
        return "cli"
    top = module.split(".")[1]
    assert top in (*STAGES, "fixtures"), f"{module}: {top!r} is in no stage: place it in STAGES or BASE here"
    return top


def allowed(importer: str, imported: str) -> bool:
    """Whether module ``importer`` may import module ``imported`` under the rules above."""
    if importer in STANDALONE:
        return False
    mine, theirs = part_of(importer), part_of(imported)
    if theirs == "base":
        return True
    if mine == "base":
        return False
    if theirs == "fixtures":
        return mine == "fixtures"
    if mine == "fixtures":
        return theirs in FIXTURES_MAY_IMPORT
    return STAGES.index(theirs) <= STAGES.index(mine)


def all_imports() -> list[tuple[str, str]]:
    return sorted(
        (module_name(path), imported) for path in PACKAGE.rglob("*.py") for imported in imported_modules(path)
    )


def test_no_module_imports_from_a_later_stage() -> None:
    bad = [
        f"{importer} imports {imported}"
        for importer, imported in all_imports()
        if not allowed(importer, imported) and (importer, imported) not in KNOWN_LATER_IMPORTS
    ]
    assert not bad, "imports against the stage order (" + " < ".join(STAGES) + "):\n" + "\n".join(bad)


def test_known_later_imports_are_still_there() -> None:
    imports = set(all_imports())
    gone = sorted(pair for pair in KNOWN_LATER_IMPORTS if pair not in imports)
    assert not gone, f"moved: remove these from KNOWN_LATER_IMPORTS: {gone}"
    assert all(not allowed(*pair) for pair in KNOWN_LATER_IMPORTS)


def test_every_standalone_file_exists() -> None:
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    assert STANDALONE <= modules, STANDALONE - modules


@pytest.mark.parametrize(
    ("importer", "imported", "ok"),
    [
        ("ckpt_tool.mapping.plan", "ckpt_tool.checkpoint.headers", True),
        ("ckpt_tool.checkpoint.headers", "ckpt_tool.mapping.plan", False),
        ("ckpt_tool.output.writer", "ckpt_tool.verify.rows", False),
        ("ckpt_tool.verify.levels", "ckpt_tool.cli.render", False),
        ("ckpt_tool.cli.app", "ckpt_tool.verify.levels", True),
        ("ckpt_tool.__main__", "ckpt_tool.cli.entry", True),
        ("ckpt_tool.errors", "ckpt_tool.checkpoint.headers", False),
        ("ckpt_tool.checkpoint.headers", "ckpt_tool.errors", True),
        ("ckpt_tool.fixtures.broken", "ckpt_tool.output.convert", True),
        ("ckpt_tool.fixtures.make", "ckpt_tool.verify.quant", False),
        ("ckpt_tool.verify.numeric", "ckpt_tool.fixtures.make", False),
        ("ckpt_tool.verify.engine.probe", "ckpt_tool.errors", False),
    ],
)
def test_the_rules_judge_an_import_as_the_docstring_says(importer: str, imported: str, ok: bool) -> None:
    assert allowed(importer, imported) is ok


def test_config_keys_names_the_model_class_and_draft_kind_the_mapping_stage_chooses() -> None:
    """checkpoint.config_keys says which model class and draft kind a config is without importing mapping (a later
    stage): its answer is mapping.profiles' for every fixture config."""
    from ckpt_tool.checkpoint.config import V4Config
    from ckpt_tool.checkpoint.config_keys import config_classes, draft_of
    from ckpt_tool.fixtures.make import VARIANTS, make_config
    from ckpt_tool.mapping.profiles import draft_kind_of, model_class_of

    for name, variant in VARIANTS.items():
        if variant.broken:
            continue
        config = V4Config.from_dict(make_config(variant))
        kind = draft_kind_of(config)
        assert config_classes(config) == {model_class_of(config).name, kind.name}, name
        facts = draft_of(config)
        assert (facts.name, facts.layer_word) == (kind.name, kind.layer_word), name
        assert kind.vllm_class.startswith(facts.vllm_file + ":"), name
