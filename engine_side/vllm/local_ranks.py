"""The DeltaExecutor ranks on the engine's own host: spawned processes, watched, reaped.

Each rank is a ``spawn``-ed process running ``worker_side.vllm.proc.worker_main`` (by
name: the engine side never imports the worker side), with a death pipe whose closing
end it watches (the engine gone, it exits), under vLLM's per-rank CPU binding.  The
group's lock is kept here: a spawned child opens it by name later.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import multiprocessing
import multiprocessing.connection
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from engine_side.spawn import run_by_name

RANK_MODULE = "worker_side.vllm.proc"  # a rank's entry point, worker_main (by name)


class LocalRanks:
    """``start`` them, ``wait_death`` for one, ``kill`` the rest (the executor's
    finalizer reaps ``procs`` and closes ``deaths``: :func:`engine_side.spawn.reap`)."""

    def __init__(self) -> None:
        self.procs: list[BaseProcess] = []
        self.deaths: list[Connection] = []
        self.lock: Any = None
        self.frozen: dict[int, float] = {}  # rank -> the liveness bound it missed (killed)

    def start(self, vllm_config: Any, ranks: range,
              kwargs: Callable[[int], dict[str, Any]]) -> None:
        """Every rank of ``ranks`` (``kwargs(rank)``: its worker_main arguments but the
        lock and death pipe), before waiting on any: device init is collective."""
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        ctx = multiprocessing.get_context("spawn")
        self.lock = ctx.Lock()
        view = copy.copy(vllm_config)  # vLLM binds each of a host's ranks to an entry
        view.parallel_config = copy.copy(vllm_config.parallel_config)  # of its OMP list:
        view.parallel_config.world_size = len(ranks)  # this host's ranks (nnodes is ours)
        omp = OMPProcessManager(view)
        for rank in ranks:
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=run_by_name, args=(RANK_MODULE, "worker_main"),
                            kwargs={**kwargs(rank), "lock": self.lock, "death": reader},
                            name=f"DeltaWorker-{rank}", daemon=True)
            with omp.configure_omp_envs(rank=rank, local_rank=rank):  # per-rank CPU binding
                p.start()
            reader.close()
            self.procs.append(p)
            self.deaths.append(writer)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def dead(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if not p.is_alive()]

    def wait_death(self) -> tuple[int, int | None]:
        """Block until a rank exits: (rank, exit code)."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        died = multiprocessing.connection.wait(list(sentinels))
        rank = sentinels[died[0]]  # type: ignore[index]
        self.procs[rank].join(1.0)  # reap it, for the exit code
        return rank, self.procs[rank].exitcode

    def kill(self) -> None:
        """SIGKILL every rank still running: after a rank's death the others may wait in a
        collective that never ends (the CPU all-reduce has no timeout)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()


def remove_dist_files(init_method: str) -> None:
    """What vLLM's ranks made for the group that ``init_method`` (a ``file://`` store)
    named and a killed rank leaves behind: the store file and the CPU all-reduce's
    shared-memory segments (``/dev/shm/<store name>-*``)."""
    if not init_method.startswith("file://"):
        return
    store = Path(init_method.removeprefix("file://"))
    for path in [store, *Path("/dev/shm").glob(glob.escape(store.name) + "-*")]:
        with contextlib.suppress(OSError):
            path.unlink()
