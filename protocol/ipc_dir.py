"""The private-directory check of an ``ipc://DIR`` endpoint, for both ends.

The engine binds its sockets in DIR (``engine_side.security.PrivateDir``); a worker
connects there and sends its check-ins.  Were DIR another user's -- or a symlink
another user planted, which they can re-point later -- that user would receive the
engine's sockets or a worker's check-ins.  So both ends accept DIR only when it is:

* a real directory: not a symlink (its last component is opened with O_NOFOLLOW),
  and not a file;
* owned by this user, with no group or other permission bits (mode 0700);
* under ancestors that another user cannot swap it from under us: each one owned by
  root or this user (a symlink included), and writable by no one else unless sticky
  (as /tmp is).

The checks run on the opened descriptor, so what was checked is what the caller uses
(``dir_fd``).  Every refusal is an :class:`EndpointError` whose one-line message says
what to do.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class EndpointError(Exception):
    """An endpoint cannot be used as asked; the message says what to do instead."""


def open_private_dir(path: Path) -> int:
    """A descriptor (O_CLOEXEC; the caller closes it) of the private directory ``path``;
    EndpointError if it is not one (see the module docstring)."""
    path = Path(os.path.abspath(path))
    _check_ancestors(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise EndpointError(f"{path} does not exist: start the engine first, or check the "
                            "ipc:// endpoint") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise EndpointError(f"refusing {path}: it is a symlink (another user could "
                                "re-point it); pass the real directory") from None
        if exc.errno == errno.ENOTDIR:
            raise EndpointError(f"refusing {path}: it is not a directory; an ipc endpoint "
                                "names a private directory (e.g. ipc:///tmp/NAME)") from None
        raise EndpointError(f"cannot open {path} ({exc.strerror}); choose another "
                            "directory") from None
    try:
        _check_owned(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_private_dir(path: Path) -> None:
    """Raise EndpointError unless ``path`` is a private directory (a worker's check
    before it connects)."""
    os.close(open_private_dir(path))


def _check_owned(path: Path, st: os.stat_result) -> None:
    uid, mode = os.getuid(), stat.S_IMODE(st.st_mode)
    if st.st_uid != uid:
        raise EndpointError(f"refusing {path}: it is owned by uid {st.st_uid}, not by this "
                            f"user ({uid}); choose a directory of your own, or no endpoint "
                            "(a fresh private one)")
    if mode & 0o077:
        raise EndpointError(f"refusing {path}: its mode is {oct(mode)}, not 0700 (others "
                            f"could reach the sockets); run chmod 700 {path} or choose "
                            "another directory")


def _check_ancestors(path: Path) -> None:
    """Each existing ancestor of ``path``: owned by root or us (lstat: a symlink too),
    and if writable by others, sticky."""
    uid = os.getuid()
    for parent in reversed(path.parents):
        try:
            st = os.lstat(parent)
        except FileNotFoundError:
            return  # (the engine creates the rest, owned by itself)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (0, uid):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a directory"
            raise EndpointError(f"refusing {path}: its ancestor {parent} is {kind} of uid "
                                f"{st.st_uid}, who could swap the directory; choose a "
                                "directory under one of your own (or /tmp)")
        if stat.S_ISDIR(st.st_mode) and mode & 0o022 and not mode & stat.S_ISVTX:
            raise EndpointError(f"refusing {path}: its ancestor {parent} is writable by "
                                "others and not sticky (anyone could swap the directory); "
                                "choose a directory under one of your own (or /tmp)")
