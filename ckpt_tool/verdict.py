"""The record every verify level writes into: one :class:`Check` per verdict, in a :class:`VerifyReport`.

Its own module so the levels stack without importing each other: ``verify`` (structure, then values)
and ``numeric`` both depend on this record, and ``verify`` calls ``numeric`` last; ``numeric`` never
imports ``verify``. :class:`Progress` is the small protocol a level reports its advance through.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass
class Check:
    """One verdict, reported as one JUnit testcase."""

    name: str
    ok: bool
    message: str = ""
    file: str | None = None
    tensor: str | None = None
    details: dict = field(default_factory=dict)


def problems_check(name: str, where: str, problems: list[tuple[str, str | None]], passed: dict) -> Check:
    """One check over many units: passes with ``passed`` as details, or fails on the first of ``problems``
    ((message, tensor) pairs) with ``where`` before it, saying how many more there are and listing all."""
    if not problems:
        return Check(name, True, details=passed)
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    message, tensor = problems[0]
    return Check(name, False, f"{where}: {message}{more}", tensor=tensor, details={"problems": [m for m, _ in problems]})


@dataclass
class VerifyReport:
    out: str
    source: str | None  # None: no --source (only the engine judged OUT)
    level: str
    checks: list[Check] = field(default_factory=list)
    numeric: list[dict] = field(default_factory=list)
    # numeric coverage: {"checked", "total", "percent", "components": {comp: {"checked", "total", "percent"}}}
    coverage: dict | None = None
    # verify --engine: the vLLM that judged (version, interpreter, ranks), see ckpt_tool.engine_check
    engine: dict | None = None

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        if not check.ok:
            log.info("verify failure: %s: %s", check.name, check.message)
        return check

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "out": self.out,
            "source": self.source,
            "level": self.level,
            "checks": len(self.checks),
            "failed": len(self.failures),
            "failures": [asdict(c) for c in self.failures],
            "passed": [c.name for c in self.checks if c.ok],
            "numeric": self.numeric,
            "coverage": self.coverage,
            "engine": self.engine,
        }


class Progress(Protocol):
    """What a level tells a progress display: a stage with a total, then advances (bytes or items)."""

    def stage(self, name: str, total: int, unit: str = "B") -> None: ...

    def advance(self, n: int = 1, what: str | None = None) -> None: ...


class NoProgress:
    """The silent :class:`Progress` (library default; the CLI passes a rich one on a terminal)."""

    def stage(self, name: str, total: int, unit: str = "B") -> None:
        pass

    def advance(self, n: int = 1, what: str | None = None) -> None:
        pass
