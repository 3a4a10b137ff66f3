"""protocol.stale_dirs: only run directories proven dead are removed."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

from engine_side.security import PrivateDir
from protocol.stale_dirs import LockedTempDir, remove_if_dead, sweep_stale_dirs


def _run_dir(base: Path, name: str, lock: str | None = "12345\n") -> Path:
    path = base / name
    path.mkdir(mode=0o700)
    (path / "pub").write_bytes(b"")  # (stands for the sockets and the ring)
    if lock is not None:
        (path / "lock").write_text(lock)
    return path


def test_a_dead_run_directory_is_removed(tmp_path: Path) -> None:
    dead = _run_dir(tmp_path, "dc-dead")
    assert sweep_stale_dirs([tmp_path]) == [dead]
    assert not dead.exists()


def test_what_cannot_be_proven_dead_stays(tmp_path: Path) -> None:
    held = _run_dir(tmp_path, "dc-held")
    no_lock = _run_dir(tmp_path, "dc-nolock", lock=None)
    empty_lock = _run_dir(tmp_path, "dc-starting", lock="")  # created, not yet locked
    not_ours = _run_dir(tmp_path, "other-name")
    target = _run_dir(tmp_path, "target")
    (tmp_path / "dc-link").symlink_to(target)
    symlinked_lock = tmp_path / "dc-symlock"
    symlinked_lock.mkdir()
    (symlinked_lock / "lock").symlink_to(target / "lock")
    fd = os.open(held / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live engine holds it
        assert sweep_stale_dirs([tmp_path]) == []
    finally:
        os.close(fd)
    for path in (held, no_lock, empty_lock, not_ours, target, symlinked_lock):
        assert path.exists(), path
    assert (tmp_path / "dc-link").is_symlink()
    assert remove_if_dead(held)  # released: now provably dead


def test_a_private_dir_and_a_locked_temp_dir_survive_a_sweep_while_alive(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # (gettempdir reads TMPDIR again)
    keys = LockedTempDir("keys")
    private = PrivateDir()
    try:
        assert keys.path.parent == tmp_path and private.path.parent == tmp_path
        assert sweep_stale_dirs([tmp_path]) == []
        assert keys.path.exists() and private.path.exists()
    finally:
        private.close()
        keys.close()
    assert list(tmp_path.iterdir()) == []
