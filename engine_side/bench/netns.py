"""Two "hosts" on one machine for tests and benchmarks: network namespaces and a veth pair.

:func:`two_hosts` makes namespaces A (10.231.N.1) and B (10.231.N.2), each with its end
of the veth up, lo up and the link shaped to 1 Gbit/s (``tbf``: this kernel has no
``netem``, so no added delay), and removes them on exit -- SIGTERM included; those of a
run killed outright (SIGKILL) go when the next one starts.  :func:`unavailable` says why
a test must skip (not root, no ``ip``, namespaces not permitted).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from engine_side.bench.children import exits_on_sigterm


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = subprocess.run(["ip", "netns", "add", "dct-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns not permitted here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "dct-probe"], capture_output=True)
    return None


@dataclass(frozen=True)
class Host:
    ns: str
    dev: str
    addr: str

    def run(self, *argv: str) -> list[str]:
        """``argv`` as a command line run in this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def pids(self) -> list[int]:
        """Processes still running in this namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_all(self) -> None:
        """SIGKILL every process still in this namespace."""
        for pid in self.pids():
            with suppress(OSError):
                os.kill(pid, 9)

    def tx_bytes(self) -> int:
        out = subprocess.run(self.run("cat", f"/sys/class/net/{self.dev}/statistics/tx_bytes"),
                             capture_output=True, text=True, check=True)
        return int(out.stdout)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


_OURS = re.compile(r"dct[a-z]*[ab](\d+)")  # two_hosts' names: dct, a tag, a or b, the pid


def sweep() -> list[str]:
    """Remove the namespaces of runs whose process is gone; their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    gone = []
    for line in out.splitlines():
        name = line.split(" ", 1)[0]
        m = _OURS.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            gone.append(name)
        except PermissionError:  # (alive, another user's)
            pass
    return gone


@contextmanager
def two_hosts(tag: str = "") -> Iterator[tuple[Host, Host]]:
    """The two hosts (``tag``: lower-case letters naming the user); the namespaces and
    their processes go on exit, on SIGTERM in the main thread too."""
    sweep()
    n = os.getpid() % 200 + 20
    a = Host(f"dct{tag}a{os.getpid()}", f"va{os.getpid()}", f"10.231.{n}.1")
    b = Host(f"dct{tag}b{os.getpid()}", f"vb{os.getpid()}", f"10.231.{n}.2")
    with exits_on_sigterm(), _removed(a, b):
        _ip("netns", "add", a.ns)
        _ip("netns", "add", b.ns)
        _ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for h in (a, b):
            _ip("link", "set", h.dev, "netns", h.ns)
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.dev)
            _ip("-n", h.ns, "link", "set", h.dev, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            subprocess.run(h.run("tc", "qdisc", "add", "dev", h.dev, "root", "tbf", "rate",
                                 "1gbit", "burst", "64kb", "latency", "5ms"),
                           capture_output=True)  # shaping is best effort
        yield a, b


@contextmanager
def _removed(*hosts: Host) -> Iterator[None]:
    """The hosts' processes and namespaces go when the block ends, however it ends."""
    try:
        yield
    finally:
        for h in hosts:
            h.kill_all()
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)

