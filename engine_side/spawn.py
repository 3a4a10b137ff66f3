"""Starting a process by module path: the engine names what a child runs without
importing it (engine_side never imports worker_side; the child does)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any


def run_by_name(module: str, function: str, /, **kwargs: Any) -> Any:
    """``module.function(**kwargs)``, importing ``module`` here: a spawned child's
    ``Process`` target (it pickles by reference to this small module)."""
    return getattr(importlib.import_module(module), function)(**kwargs)


def reap(procs: Sequence[BaseProcess], deaths: Sequence[Connection], join_s: float) -> None:
    """Join ``procs`` for up to ``join_s`` in all, then terminate and kill stragglers;
    close the death pipes (their children exit when the pipe closes)."""
    end = time.monotonic() + join_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(4.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for d in deaths:
        d.close()
