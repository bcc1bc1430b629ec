"""The reference backend, loaded by name on first use.

camkv.reference is the oracle the kernels are checked against (docs/algorithm.md is what
it computes, one step at a time). Production code does not import it: the registry
hands it out when a cache asks for it (backend="reference", or a merge rule only it
runs), and a GPU kernel's self-check runs it for a probe or a fallback. Loading it by
name keeps it out of a process that never asks (tests/test_imports.py checks both).
"""

from __future__ import annotations

import importlib

MODULE = "camkv.reference"


def reference():
    """The reference backend module (imported on the first call, cached by Python after)."""
    return importlib.import_module(MODULE)
