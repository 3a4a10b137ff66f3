"""A rank dies, no request is lost: what DeltaExecutor needs to restart its group.

When a rank on the engine's host dies, the executor stops the whole group, starts it
again, replays the calls that built it (device, model, KV layout, warm-up: the same
number of blocks), and asks vLLM's own scheduler to recompute: every running request
is preempted with its in-flight output dropped (``Scheduler.reset_prefix_cache(
reset_running_requests=True)``, the path vLLM's ``reset_prefix_cache`` utility takes),
and the prefix cache is emptied, since no block's KV survived.  The scheduler then
resumes those requests, prompt and sampled tokens, through its ordinary preemption
path; the restarted ranks never saw them, so each such resumed request is sent as a
new one carrying its sampled tokens (:func:`renew`, SPEC §16 ``ro``).

The executor gets the scheduler through ``scheduler_cls``: EngineCore builds its
scheduler after the executor, from the class the config names, so the executor names
a subclass of that class whose constructor hands the instance over
(:class:`SchedulerHook`).

Restarts are bounded (:class:`RestartPolicy`): more than ``deltacast_restarts`` within
``deltacast_restart_window_s`` seconds and the death fails the executor as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("deltacast.vllm.executor")
RESTARTS = 3  # restarts allowed within the window (0: a dead rank fails the executor)
WINDOW_S = 600.0


class GroupDied(Exception):
    """A rank of the group died and the group may restart (the executor's drain restarts
    it and answers what was in flight)."""

    def __init__(self, rank: int, code: int | None, frozen_s: float | None = None,
                 cause: str | None = None) -> None:
        super().__init__(cause if cause is not None else
                         f"rank {rank} died ({describe_exit(code)})" if frozen_s is None else
                         f"rank {rank} froze (no heartbeat for {frozen_s:g} s) and was killed")
        self.rank, self.code = rank, code
        self.at = time.monotonic()  # when the death was noticed


def describe_exit(code: int | None) -> str:
    """A process's exit code as words: ``signal 9 (SIGKILL)``, ``exit code 1``."""
    import signal

    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class RestartPolicy:
    """At most ``limit`` restarts within any ``window_s`` seconds."""

    def __init__(self, limit: int = RESTARTS, window_s: float = WINDOW_S) -> None:
        if limit < 0 or window_s <= 0:
            raise ValueError(f"deltacast_restarts must be >= 0 and deltacast_restart_window_s "
                             f"> 0, got {limit} and {window_s}")
        self.limit, self.window_s = limit, window_s
        self.times: deque[float] = deque()
        self.count = 0  # restarts so far (the metric)

    @classmethod
    def from_config(cls, extra: dict[str, Any]) -> RestartPolicy:
        try:
            return cls(int(extra.get("deltacast_restarts", RESTARTS)),
                       float(extra.get("deltacast_restart_window_s", WINDOW_S)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad restart settings: {exc}") from None

    def allow(self, now: float | None = None) -> bool:
        """Whether one more restart is within the bound (and, if so, record it)."""
        now = time.monotonic() if now is None else now
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        self.count += 1
        return True

    def refusal(self) -> str:
        if self.limit == 0:
            return "restarts are off (deltacast_restarts: 0)"
        return (f"{self.limit} restart(s) within {self.window_s:g} s already "
                f"(deltacast_restarts, deltacast_restart_window_s)")


class SchedulerHook:
    """Holds EngineCore's scheduler once built (see the module docstring).  The config
    names the hooked class only while ranks are not being spawned: a spawned rank gets
    the config pickled, and the class is made here, at run time."""

    def __init__(self, vllm_config: Any) -> None:
        self.scheduler: Any = None
        self.config = vllm_config.scheduler_config
        self.named = self.config.scheduler_cls  # what the config names (None: vLLM's)
        base = self.config.get_scheduler_cls()

        def __init__(scheduler: Any, *args: Any, **kwargs: Any) -> None:
            base.__init__(scheduler, *args, **kwargs)
            self.scheduler = scheduler

        self.hooked = type(base.__name__, (base,), {"__init__": __init__,
                                                    "__module__": base.__module__})
        _quiet_custom_scheduler_warning()

    def install(self) -> None:
        self.config.scheduler_cls = self.hooked

    @contextlib.contextmanager
    def removed(self) -> Iterator[None]:
        """The config as it was (to spawn ranks with it)."""
        now, self.config.scheduler_cls = self.config.scheduler_cls, self.named
        try:
            yield
        finally:
            self.config.scheduler_cls = now


def _quiet_custom_scheduler_warning() -> None:
    """vLLM warns about any scheduler class outside ``vllm.``; ours is vLLM's own class
    (subclassed only to be found), so that one warning is dropped."""
    import vllm.config.scheduler as module

    logger = getattr(module, "logger", None)
    if logger is None or getattr(logger, "_deltacast_quiet", False):
        return

    def keep(record: logging.LogRecord) -> bool:
        return "custom scheduler class" not in str(record.msg)

    logger.addFilter(keep)
    logger._deltacast_quiet = True


def recompute(scheduler: Any) -> int:
    """Preempt every running request (in-flight output dropped) and empty the prefix
    cache; the number preempted."""
    running = len(scheduler.running)
    scheduler.reset_prefix_cache(reset_running_requests=True)
    return running


def renew(so: Any, scheduler: Any, unsent: set[str]) -> tuple[Any, dict[str, list[int]]]:
    """``so`` with the resumed requests of ``unsent`` (preempted by a restart, not yet
    sent to the new group) moved from the cached requests to the new ones, built from
    the scheduler's requests; and their sampled tokens by id.  ``unsent`` loses them."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    cached = so.scheduled_cached_reqs
    unseen = {"finished_req_ids": so.finished_req_ids & unsent,  # the group never saw them
              "preempted_req_ids": (so.preempted_req_ids or set()) & unsent}
    unseen = {name: getattr(so, name) - ids for name, ids in unseen.items() if ids}
    unsent.difference_update(so.finished_req_ids)
    unsent.difference_update(nr.req_id for nr in so.scheduled_new_reqs)  # seen from now on
    move = [k for k, r in enumerate(cached.req_ids) if r in unsent and r in cached.resumed_req_ids]
    if not move:
        return (dataclasses.replace(so, **unseen) if unseen else so), {}
    new, tokens = [], {}
    for k in move:
        rid = cached.req_ids[k]
        request = scheduler.requests[rid]
        data = NewRequestData.from_request(request, cached.new_block_ids[k])
        data.num_computed_tokens = cached.num_computed_tokens[k]
        data.mm_features = request.mm_features  # whole: the group computes from its start
        new.append(data)
        every = cached.all_token_ids.get(rid)
        tokens[rid] = list(request.output_token_ids if every is None
                           else every[request.num_prompt_tokens:])
        unsent.discard(rid)
    keep = [k for k in range(len(cached.req_ids)) if cached.req_ids[k] not in tokens]
    rest = CachedRequestData(
        req_ids=[cached.req_ids[k] for k in keep],
        resumed_req_ids=cached.resumed_req_ids - tokens.keys(),
        new_token_ids=[cached.new_token_ids[k] for k in keep] if cached.new_token_ids else [],
        all_token_ids={r: t for r, t in cached.all_token_ids.items() if r not in tokens},
        new_block_ids=[cached.new_block_ids[k] for k in keep],
        num_computed_tokens=[cached.num_computed_tokens[k] for k in keep],
        num_output_tokens=[cached.num_output_tokens[k] for k in keep])
    return dataclasses.replace(so, scheduled_new_reqs=[*so.scheduled_new_reqs, *new],
                               scheduled_cached_reqs=rest, **unseen), tokens
