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


PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass
class Check:
    """One verdict, reported as one JUnit testcase: ``status`` passed, failed or skipped.

    ``ok`` is what the exit code reads: false only for a failure. A skipped check (one that does not apply
    here, or could not run because an earlier one failed) is ok and says why in ``message``; a check the
    user asked for that cannot run in full is a failure, not a skip. Build skips with :func:`skipped_check`.
    """

    name: str
    ok: bool
    message: str = ""  # failed: what is wrong and where; skipped: the reason; passed: usually empty
    file: str | None = None
    tensor: str | None = None
    details: dict = field(default_factory=dict)
    status: str = ""  # "" = from ok (passed or failed)

    def __post_init__(self) -> None:
        if not self.status:
            self.status = PASSED if self.ok else FAILED
        assert self.status in (PASSED, FAILED, SKIPPED) and (self.status == FAILED) == (not self.ok), (
            self.status,
            self.ok,
        )
        assert self.status != SKIPPED or self.message, f"{self.name}: a skipped check needs its reason"


def skipped_check(name: str, reason: str, **fields) -> Check:
    """A check that did not run, and why (not a failure: the exit code ignores it)."""
    return Check(name, True, reason, status=SKIPPED, **fields)


def problems_check(name: str, where: str, problems: list[tuple[str, str | None]], passed: dict) -> Check:
    """One check over many units: passes with ``passed`` as details, or fails on the first of ``problems``
    ((message, tensor) pairs) with ``where`` before it, saying how many more there are and listing all."""
    if not problems:
        return Check(name, True, details=passed)
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    message, tensor = problems[0]
    return Check(
        name, False, f"{where}: {message}{more}", tensor=tensor, details={"problems": [m for m, _ in problems]}
    )


@dataclass
class VerifyReport:
    out: str
    source: str | None  # None: no --source (only the engine judged OUT)
    level: str
    checks: list[Check] = field(default_factory=list)
    numeric: list[dict] = field(default_factory=list)
    # numeric coverage: {"checked", "total", "percent", "components": {comp: {"checked", "total", "percent"}}}
    coverage: dict | None = None
    # the manifest's target: profile, the vLLM releases it is verified against, the vLLM installed at convert
    # time and whether the profile is verified for it ("verified": false is repeated as a warning)
    target: dict | None = None
    # verify --engine: the vLLM that judged (version, interpreter, ranks), see ckpt_tool.verify.engine
    engine: dict | None = None

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAILED]

    @property
    def passed(self) -> list[Check]:
        return [c for c in self.checks if c.status == PASSED]

    @property
    def skipped(self) -> list[Check]:
        return [c for c in self.checks if c.status == SKIPPED]

    def counts(self) -> str:
        """``"40 passed, 1 skipped, 0 failed"``: the tally every rendering shows."""
        return f"{len(self.passed)} passed, {len(self.skipped)} skipped, {len(self.failures)} failed"

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        if check.status != PASSED:
            log.info("verify %s: %s: %s", check.status, check.name, check.message)
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
            "passed": [c.name for c in self.passed],
            "skipped": [asdict(c) for c in self.skipped],
            "results": [{"name": c.name, "status": c.status, "message": c.message} for c in self.checks],
            "numeric": self.numeric,
            "coverage": self.coverage,
            "target": self.target,
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
