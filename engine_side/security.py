"""Endpoint policy, private ipc directories, CURVE keys and the ZAP allow list.

Rules (SPEC.md, security section):

* The default endpoint is ``ipc://`` inside a private directory: mode 0700, one
  per run, holding a lock file so a second engine cannot take the socket paths
  over (a zmq ipc bind silently unlinks an existing socket file).  An explicit
  ``ipc://DIR`` must be such a directory too (no symlink, ours, 0700:
  :mod:`protocol.ipc_dir`, whose checks the workers run before connecting).
* Any ``tcp://`` endpoint, loopback included, needs CURVE *and* an allow list of
  worker public keys enforced by a ZAP authenticator (CURVE alone accepts any
  client key).  ``insecure=True`` skips this, with a warning.  Anything else is
  refused with :class:`InsecureEndpoint`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import random
import shutil
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

from protocol.ipc_dir import EndpointError, open_private_dir
from protocol.stale_dirs import sweep_stale_dirs

log = logging.getLogger("deltacast.security")

IPC_PATH_MAX = 107  # sun_path is 108 bytes including the NUL
SOCKET_NAMES = ("pub", "ctl")  # PUB and ROUTER socket files in an ipc directory


class InsecureEndpoint(EndpointError):
    """A tcp endpoint without CURVE keys and without the explicit insecure flag."""


class EndpointInUse(EndpointError):
    """Another engine holds the lock of this ipc directory."""


@dataclass(frozen=True)
class CurveKeys:
    """The engine's key pair and the public keys of the workers allowed in (z85 bytes).

    ``pinned`` maps an allowed key to the ranks it may speak for (a key shared by several
    local workers); any other allowed key is bound to the first rank it names
    (:mod:`engine_side.peers`)."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes] = field(default_factory=frozenset)
    pinned: Mapping[bytes, frozenset[int]] = field(default_factory=dict)


def generate_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``name.key`` (public) and ``name.key_secret`` into ``directory`` (0700)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    return Path(public), Path(secret)


def load_public(path: Path) -> bytes:
    public, _ = zmq.auth.load_certificate(str(path))
    return public


def load_keypair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file; refuses a file without a secret."""
    public, secret = zmq.auth.load_certificate(str(path))
    if secret is None:
        raise EndpointError(f"{path} holds no secret key (pass the .key_secret file)")
    return public, secret


def free_tcp_endpoint(host: str = "127.0.0.1", tries: int = 100) -> str:
    """A ``tcp://HOST:PORT`` whose PORT and PORT+1 (PUB and ROUTER) are free right now."""
    for _ in range(tries):
        port = random.randrange(20000, 60000, 2)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind((host, port))
                b.bind((host, port + 1))
        except OSError:
            continue
        return f"tcp://{host}:{port}"
    raise RuntimeError(f"no free tcp port pair on {host}")


def check_tcp_policy(endpoint: str, keys: CurveKeys | None, insecure: bool) -> None:
    """Refuse a tcp endpoint without CURVE keys unless ``insecure`` (which warns)."""
    if not endpoint.startswith("tcp://"):
        return
    if keys is not None:
        if not keys.allowed:
            raise InsecureEndpoint(f"refusing {endpoint}: CURVE needs at least one allowed "
                                   "worker public key (the ZAP allow list is empty)")
        return
    if not insecure:
        raise InsecureEndpoint(
            f"refusing to bind {endpoint} without CURVE: anyone who can reach the port could "
            "read the schedule and inject replies. Pass CURVE keys (--curve) or, for a trusted "
            "network only, --insecure.")
    log.warning("binding %s WITHOUT authentication or encryption (--insecure)", endpoint)


class PrivateDir:
    """A 0700 directory for ipc sockets, locked by one engine for its lifetime.

    Args:
        path: an explicit directory (created 0700 if missing, or reused when unlocked
            and private); None makes a fresh one under $XDG_RUNTIME_DIR or /tmp.

    Directories that dead engines left behind are removed first
    (:func:`protocol.stale_dirs.sweep_stale_dirs`: a ``kill -9`` frees the lock).

    Raises EndpointInUse if another engine holds the lock, EndpointError if the
    directory is not private (a symlink, a file, another user's, not 0700:
    :func:`protocol.ipc_dir.open_private_dir`), its lock file is a symlink, or the
    socket paths would exceed 107 bytes.  Everything in it is reached through the
    checked descriptor of the directory, never by following a name again.
    """

    def __init__(self, path: Path | None = None) -> None:
        self._lock_fd = self._dir_fd = -1
        sweep_stale_dirs()  # what killed engines left behind (their locks are free)
        if path is None:
            base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
            path, self.created = Path(tempfile.mkdtemp(prefix="dc-", dir=base)), True
        else:
            path = Path(os.path.abspath(path))
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(path, 0o700)  # never follows a symlink: an existing name fails
                self.created = True
            except FileExistsError:
                self.created = False  # checked below, as it is
        self.path = path
        self._dir_fd = open_private_dir(path)  # then verified: ours, a directory, 0700
        try:
            self._check_lengths()
            self._lock_fd = self._lock()
        except BaseException:
            os.close(self._dir_fd)
            if self.created:
                shutil.rmtree(path, ignore_errors=True)
            raise
        for name in SOCKET_NAMES:  # stale sockets of a dead engine (we hold the lock)
            self._unlink(name)

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._dir_fd)

    def _check_lengths(self) -> None:
        longest = max(len(str(self.path / n).encode()) for n in SOCKET_NAMES)
        if longest > IPC_PATH_MAX:
            raise EndpointError(f"ipc socket paths under {self.path} are {longest} bytes; "
                                f"the limit is {IPC_PATH_MAX}: choose a shorter directory")

    def _lock(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open("lock", flags, 0o600, dir_fd=self._dir_fd)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise EndpointError(f"refusing {self.path}: its lock file is a symlink; remove "
                                f"{self.path / 'lock'} or choose another directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise EndpointInUse(f"another engine is serving {self.path} (its lock is held); "
                                "stop it or choose another --endpoint") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.path}"

    def close(self) -> None:
        """Remove the sockets, the lock and (if we made it) the directory."""
        if self._lock_fd < 0:
            return
        for name in (*SOCKET_NAMES, "lock"):
            self._unlink(name)
        os.close(self._lock_fd)
        os.close(self._dir_fd)
        self._lock_fd = self._dir_fd = -1
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
