"""Pausing cyclic garbage collection while a phase builds many small objects that are never cyclic (headers, plans,
their JSON documents): the collector's passes over the growing heap cost more than the building."""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused():
    """No cyclic garbage collection inside: reading 69k header entries allocates ~300k containers, and
    the collector's passes over the growing heap took longer than parsing them (2-3x). Nothing built
    here is cyclic; collection resumes (if it was on) when the block ends."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
