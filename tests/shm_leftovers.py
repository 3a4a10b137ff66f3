"""Removing what a test's processes leave in /dev/shm on this one machine: vLLM's
segments and semaphores from a process SIGKILLed with its resource tracker (on a real
host they go with the host), or from vLLM's own default executor; and finding the
private directories engines and nodes make."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from protocol.stale_dirs import LOCK_NAME, PREFIX, run_dir_bases

SHM = "/dev/shm"


@contextlib.contextmanager
def removing_shm(*prefixes: str) -> Iterator[None]:
    """Remove the /dev/shm entries named with one of ``prefixes`` that appear while the
    block runs (whether it passes or fails)."""
    before = set(os.listdir(SHM))
    try:
        yield
    finally:
        for name in set(os.listdir(SHM)) - before:
            if name.startswith(prefixes):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM, name))


def node_dirs() -> set[Path]:
    """The nodes' private directories (``worker_side.vllm.rank_watch``) in the temp dir."""
    return set(Path(tempfile.gettempdir()).glob(f"{PREFIX}node-*"))


def run_dirs() -> set[Path]:
    """The engines' locked private directories (``engine_side.security.PrivateDir``)."""
    return {p for base in run_dir_bases() for p in base.glob(f"{PREFIX}*")
            if (p / LOCK_NAME).exists()}
