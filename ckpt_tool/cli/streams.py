"""The standard streams when their reader goes away: one home for what :mod:`ckpt_tool.cli.common` (the
interrupt path) and :mod:`ckpt_tool.cli.render` (rich's broken-pipe hook) both do. Imports nothing of ours,
so the CLI's imports run one way: entry → common → render → streams."""

from __future__ import annotations

import os
import sys


def drop_stdout() -> None:
    """The reader went away (``| head``): send what is left of stdout to /dev/null so exit is silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a descriptor (captured): nothing to redirect
        pass
