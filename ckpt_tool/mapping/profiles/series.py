"""vLLM release series: a version string read as its ``(major, minor)``, the unit profiles cover."""

from __future__ import annotations


def series_of(version: str) -> tuple[int, int] | None:
    """``"0.34.1+cu130"`` / ``"0.35.0rc1.dev12+gabc"`` / ``"0.34"`` → (0, 34); None when it does not start
    with two dot-separated numbers."""
    head = version.strip().split(".")
    if len(head) < 2 or not head[0].isdigit():
        return None
    minor = ""
    for ch in head[1]:
        if not ch.isdigit():
            break
        minor += ch
    return (int(head[0]), int(minor)) if minor else None


def series_text(series: tuple[int, int]) -> str:
    """(0, 34) → ``"0.34"``."""
    return f"{series[0]}.{series[1]}"
