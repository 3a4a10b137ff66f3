"""Run directories that outlive their owner, and their removal once proven dead.

An engine's private ipc directory (``dc-*`` under $XDG_RUNTIME_DIR or the temp dir,
:class:`engine_side.security.PrivateDir`), a node's (``dc-node-*``: its ranks' and
relay's endpoints and its ring, :mod:`worker_side.vllm.rank_watch`) and the demo's key
directory (``dc-keys-*``) each hold a ``lock`` file that their owner flocks for its
whole life and writes its pid into once locked (:class:`LockedTempDir`).  A clean exit
removes the directory; a ``kill -9`` (or Ray ending an actor and its children) leaves it
behind, but the kernel drops the flock with the process.  Every engine and every node
sweeps at its start, so what one left on a host goes when the next starts there.  A
directory is *proven dead* when

* it is a real directory (not a symlink) owned by this user, named ``dc-*``,
* its ``lock`` is a regular file (opened without following a symlink) holding a pid
  (written only after a successful flock: an empty one may be an engine between
  creating the file and locking it), and
* we can take the flock ourselves.

:func:`sweep_stale_dirs` removes exactly those, holding the flock while it does (an
engine starting meanwhile cannot take the directory over).  Anything it cannot prove
dead is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path
from types import TracebackType

log = logging.getLogger("deltacast.stale_dirs")

PREFIX = "dc-"
LOCK_NAME = "lock"


def run_dir_bases() -> list[Path]:
    """Where run directories are made: $XDG_RUNTIME_DIR (when set) and the temp dir."""
    bases = [os.environ.get("XDG_RUNTIME_DIR") or "", tempfile.gettempdir()]
    return [Path(b) for b in dict.fromkeys(b for b in bases if b)]


def sweep_stale_dirs(bases: list[Path] | None = None) -> list[Path]:
    """Remove every ``dc-*`` directory under ``bases`` proven dead (module docstring);
    returns those removed."""
    removed = []
    for base in run_dir_bases() if bases is None else bases:
        try:
            names = [e.name for e in os.scandir(base) if e.name.startswith(PREFIX)]
        except OSError:
            continue
        for name in names:
            if remove_if_dead(base / name):
                removed.append(base / name)
    if removed:
        log.info("removed %d run director%s of dead owners: %s", len(removed),
                 "y" if len(removed) == 1 else "ies", ", ".join(map(str, removed)))
    return removed


def remove_if_dead(path: Path) -> bool:
    """Remove ``path`` if it is proven dead (module docstring); True if removed."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=dir_fd)
        except OSError:
            return False  # no lock file (or a symlink): nothing proves it dead
        try:
            lock_st = os.fstat(lock_fd)
            if not stat.S_ISREG(lock_st.st_mode) or lock_st.st_size == 0:
                return False
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # held: its owner is alive
            shutil.rmtree(path, ignore_errors=True)
            return not os.path.lexists(path)
        finally:
            os.close(lock_fd)
    finally:
        os.close(dir_fd)


class LockedTempDir:
    """A fresh 0700 ``dc-<what>-*`` temp directory with a held lock (so a sweep after a
    ``kill -9`` of its owner can remove it); removed by :meth:`close` / ``with``."""

    def __init__(self, what: str) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{what}-"))
        try:
            self._fd = os.open(self.path / LOCK_NAME,
                               os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                               | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(self._fd, f"{os.getpid()}\n".encode())
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def close(self) -> None:
        if self._fd >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
