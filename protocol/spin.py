"""A bounded spin over non-blocking polls, sans-I/O: the caller passes the poller, the
clock and the pause, so this holds only the loop both ends wait with (SPEC §7.6: a
reader spins while steps flow, then announces it sleeps and blocks).

Each end binds its clock once: ``spin_poll = partial(spin, clock=time.perf_counter,
pause=os.sched_yield)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

SOCKET_POLL_S = 200e-6  # sockets' poll period while spinning on a ring


class Poller(Protocol):
    """What is polled: ``poll(0)`` returns the ready entries at once (e.g. zmq's Poller)."""

    def poll(self, timeout: int) -> list[Any]: ...


def spin(poller: Poller, spin_s: float, elsewhere: Callable[[], bool] | None = None, *,
         clock: Callable[[], float], pause: Callable[[], object]) -> list[Any]:
    """``poller.poll(0)`` for up to ``spin_s`` seconds of ``clock()``, ``pause()`` between
    polls (e.g. ``sched_yield``: a spinning process gives way to runnable ones, such as
    zmq's I/O threads, on a busy CPU).  Returns the ready entries, or [] when the spin ran
    out or ``elsewhere()`` (e.g. a shared-memory ring has records) became true.  With
    ``elsewhere`` (a microsecond check), the poller (several microseconds a poll) is
    polled only every ``SOCKET_POLL_S``: it carries the rarer messages."""
    if spin_s <= 0:
        return []
    now = clock()
    deadline, next_poll = now + spin_s, now
    while True:
        if elsewhere is None or now >= next_poll:
            ready = poller.poll(0)
            if ready:
                return ready
            next_poll = now + SOCKET_POLL_S
        if (elsewhere is not None and elsewhere()) or now >= deadline:
            return []
        pause()
        now = clock()
