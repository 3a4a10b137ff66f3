"""``deltacast keys DIR``: a deployment's CURVE key pairs, and the flags that use them.

Writes ``engine.key`` / ``engine.key_secret`` and ``worker1`` .. ``workerN`` pairs (ZMQ's
certificate format, :func:`zmq.auth.create_certificates`) into DIR, created with mode
0700; secret files are 0600 from the moment they exist.  Keys belong to one deployment:
an existing key file is never overwritten (exit 9, nothing written).  Public files
(``*.key``) go to whoever needs them: the engine's to every worker host, each worker's to
the engine (``--allow-key``); each ``.key_secret`` stays on its own host.
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

from protocol.cli_support import EXIT_CANNOT_WRITE, CliError, int_in

MAX_WORKERS = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR",
                        help="directory for the key files (created 0700 if missing)")
    parser.add_argument("--workers", type=int_in(1, MAX_WORKERS), default=1,
                        help="worker key pairs to write (worker1 .. workerN)")


def names(workers: int) -> list[str]:
    return ["engine", *(f"worker{i}" for i in range(1, workers + 1))]


def write_keys(directory: Path, workers: int) -> list[Path]:
    """Every key pair into ``directory`` (see the module docstring); the secret files.
    CliError (EXIT_CANNOT_WRITE) for a directory that is not ours and private, or a key
    file already there."""
    import zmq.auth

    wanted = names(workers)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.lstat()
    except OSError as exc:
        raise CliError(f"{directory}: cannot create the key directory ({exc.strerror})",
                       EXIT_CANNOT_WRITE) from exc
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() \
            or stat.S_IMODE(info.st_mode) & 0o077:
        raise CliError(f"{directory}: a key directory must be a real directory of yours with "
                       "mode 0700 (not a symlink); choose another or chmod 700 it",
                       EXIT_CANNOT_WRITE)
    taken = [p for n in wanted for p in (directory / f"{n}.key", directory / f"{n}.key_secret")
             if os.path.lexists(p)]
    if taken:
        raise CliError(f"{taken[0]} already exists: keys belong to one deployment and are "
                       "never overwritten; choose a new directory", EXIT_CANNOT_WRITE)
    old = os.umask(0o077)  # secret files are private from the moment they exist
    try:
        made = [zmq.auth.create_certificates(str(directory), n) for n in wanted]
    finally:
        os.umask(old)
    for public, _ in made:
        os.chmod(public, 0o644)  # (public keys travel: readable)
    return [Path(secret) for _, secret in made]


def run(args: argparse.Namespace) -> int:
    d: Path = args.dir
    write_keys(d, args.workers)
    allow = " ".join(f"--allow-key {d / f'worker{i}.key'}" for i in range(1, args.workers + 1))
    print(f"wrote {args.workers + 1} key pairs to {d} (secret files 0600)\n"
          f"engine:   deltacast demo --endpoint tcp://HOST:PORT "
          f"--server-secret-key {d / 'engine.key_secret'} {allow} --workers 0 "
          f"--remote-workers {args.workers}\n"
          f"worker i (1..{args.workers}): deltacast worker --connect tcp://HOST:PORT "
          f"--rank <i - 1> --server-key {d / 'engine.key'} "
          f"--secret-key {d}/worker<i>.key_secret\n"
          "Copy engine.key and one workerN.key_secret to each worker host; keep "
          "engine.key_secret on the engine's.")
    return 0
