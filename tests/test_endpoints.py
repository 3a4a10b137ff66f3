"""Explicit ``ipc://DIR`` endpoints: only a private directory is used, by either end.

An engine given ``--endpoint ipc:///tmp/NAME`` must not follow a symlink another user
planted (they could re-point it later and receive the restarted workers' check-ins),
nor use a directory that is another user's, open to others, or not a directory; a
worker must not connect into such a directory either.  Each refusal is one clear
EndpointError line.  (The tests run as root; a foreign owner is made with chown.)
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_side.security import EndpointError, EndpointInUse, PrivateDir
from engine_side.transport import EngineTransport
from protocol.ipc_dir import check_private_dir
from worker_side.transport import CheckInThread, WorkerTransport

NOBODY = 65534


@pytest.fixture
def base() -> Iterator[Path]:  # short: ipc socket paths must stay under 107 bytes
    path = Path(tempfile.mkdtemp(prefix="dce-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _refused_by_both_ends(path: Path, match: str) -> None:
    with pytest.raises(EndpointError, match=match):
        PrivateDir(path)
    with pytest.raises(EndpointError, match=match):
        WorkerTransport(f"ipc://{path}")
    with pytest.raises(EndpointError, match=match):
        CheckInThread(f"ipc://{path}", lambda: None)  # type: ignore[arg-type, return-value]


def test_a_fresh_path_is_created_0700_and_locked(base: Path) -> None:
    path = base / "fresh"
    private = PrivateDir(path)
    try:
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.getuid() and (path / "lock").is_file()
        check_private_dir(path)  # what a worker checks before it connects
        with pytest.raises(EndpointInUse):
            PrivateDir(path)
    finally:
        private.close()
    assert not path.exists()  # made by us: removed


def test_an_existing_private_dir_is_reused_and_kept(base: Path) -> None:
    path = base / "mine"
    path.mkdir(mode=0o700)
    PrivateDir(path).close()
    assert path.is_dir() and not (path / "lock").exists()


def test_a_symlink_to_a_private_dir_is_refused(base: Path) -> None:
    target = base / "real"
    target.mkdir(mode=0o700)
    link = base / "link"
    link.symlink_to(target)
    _refused_by_both_ends(link, "symlink")
    assert not (target / "lock").exists()  # nothing was made through the link


def test_a_symlink_to_a_missing_path_is_refused_not_followed(base: Path) -> None:
    link = base / "dangling"
    link.symlink_to(base / "elsewhere")
    with pytest.raises(EndpointError, match="symlink"):
        PrivateDir(link)
    assert not (base / "elsewhere").exists()


def test_a_dir_open_to_others_is_refused(base: Path) -> None:
    for mode in (0o755, 0o750, 0o701):
        shared = base / f"shared{mode:o}"
        shared.mkdir()
        shared.chmod(mode)
        _refused_by_both_ends(shared, "0700")


def test_a_regular_file_is_refused(base: Path) -> None:
    file = base / "passwd"
    file.write_text("root:x:0:0\n")
    _refused_by_both_ends(file, "not a directory")
    assert file.read_text() == "root:x:0:0\n"
    with pytest.raises(EndpointError, match="not a directory"):
        EngineTransport("ipc:///etc/passwd")


def test_a_dir_of_another_user_is_refused(base: Path) -> None:
    foreign = base / "theirs"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, NOBODY, NOBODY)
    _refused_by_both_ends(foreign, f"owned by uid {NOBODY}")


def test_a_dir_under_another_users_dir_is_refused(base: Path) -> None:
    parent = base / "theirs"
    parent.mkdir(mode=0o755)
    (parent / "mine").mkdir(mode=0o700)
    os.chown(parent, NOBODY, NOBODY)  # they could rename ours and plant their own
    _refused_by_both_ends(parent / "mine", "ancestor")
    link = base / "their-link"
    os.symlink(base, link)
    os.lchown(link, NOBODY, NOBODY)
    (base / "ok").mkdir(mode=0o700)
    with pytest.raises(EndpointError, match="ancestor .* symlink"):
        PrivateDir(link / "ok")


def test_a_planted_lock_symlink_is_refused_and_not_followed(base: Path) -> None:
    path = base / "dir"
    path.mkdir(mode=0o700)
    victim = base / "victim"
    victim.write_text("precious\n")
    (path / "lock").symlink_to(victim)
    with pytest.raises(EndpointError, match="lock file is a symlink"):
        PrivateDir(path)
    assert victim.read_text() == "precious\n"  # neither truncated nor written


def test_the_messages_are_one_line_saying_what_to_do(base: Path) -> None:
    (base / "f").write_text("")
    (base / "open").mkdir(mode=0o777)
    (base / "open").chmod(0o777)
    for path, hint in ((base / "f", "e.g. ipc:///tmp/NAME"), (base / "open", "chmod 700")):
        with pytest.raises(EndpointError) as caught:
            PrivateDir(path)
        assert "\n" not in str(caught.value) and hint in str(caught.value)
