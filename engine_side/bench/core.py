"""``deltacast bench core``: bytes and CPU time per step, deltacast vs vLLM-style pickling.

Method.  For each scenario and batch size, a seeded :class:`Workload` is warmed
up untimed (admission, prefill, a few decodes) and every format's state (the
mirror and a worker replica; the v1 scheduler's per-request cache) is fed the
same warm-up steps.  Then ``steps`` steps are timed; each step is measured in
every format, in an order rotated per step so drift and noise hit all alike,
and the median per step is reported.  Formats:

* ``deltacast``: encode = ``mirror.step`` of the changes the workload's scheduler
  knows (:attr:`Workload.changes`) + ``codec.encode``; decode = ``codec.decode`` +
  ``replica.receive`` (the replicated state applied: what a runner reads); bytes =
  ``codec.encoded_size``.  The last step's request rebuilt from the replica is checked
  equal to the engine's, untimed.
* ``pickle_v1``: pickle dumps / loads of vLLM's ``execute_model`` RPC tuple
  holding the v1 ``SchedulerOutput`` for the same step (see ``baselines``).
* ``pickle``: pickle dumps / loads of the full ``ExecuteModelRequest``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine_side.bench import baselines
from engine_side.bench.rows import Row, dumps, make_row
from engine_side.mirror import EngineMirror
from engine_side.workloads import Workload
from protocol import codec
from protocol.request import ExecuteModelRequest
from protocol.state import ReplicaState
from worker_side.events import Applied
from worker_side.replica import WorkerReplica

FORMATS = ("deltacast", "pickle_v1", "pickle")
SCENARIOS = ("steady_decode", "decode_tokens_blocks")
DEFAULT_BATCHES = (1, 32, 256, 1024, 4096)
QUICK_BATCHES = (1, 32, 256)
QUICK_STEPS = 6


def default_steps(batch: int) -> int:
    """Timed steps per case: many at small batch, fewer where a step is slow."""
    return 200 if batch <= 32 else 100 if batch <= 256 else 50 if batch <= 1024 else 30


@dataclass(frozen=True)
class Sample:
    bytes: int
    encode_ns: int
    decode_ns: int


class Lane(Protocol):
    """One wire format: untimed ``prepare``, then a timed round trip in ``measure``."""

    name: str
    extra: dict[str, Any]

    def prepare(self, req: ExecuteModelRequest) -> Any: ...

    def measure(self, prepared: Any) -> Sample: ...


class DeltacastLane:
    name = "deltacast"

    def __init__(self, workload: Workload) -> None:
        self.extra: dict[str, Any] = {}
        self.workload = workload
        self.mirror = EngineMirror(token_mode=workload.token_mode, keep_tables=False)
        self.replica = WorkerReplica(silence_timeout=float("inf"), start=(
            self.mirror.epoch, ReplicaState(workload.token_mode)))

    def prepare(self, req: ExecuteModelRequest) -> dict[str, Any]:
        return self.workload.changes

    def measure(self, prepared: dict[str, Any]) -> Sample:
        t0 = time.perf_counter_ns()
        frames = codec.encode(self.mirror.step(**prepared)[0])
        t1 = time.perf_counter_ns()
        events = self.replica.receive(codec.decode(frames), 0.0)
        t2 = time.perf_counter_ns()
        if not isinstance(events[-1], Applied):
            raise RuntimeError(f"replica did not apply the delta: {events}")
        return Sample(codec.encoded_size(frames), t1 - t0, t2 - t1)


class PickleLane:
    """Pickle round trip of what ``convert`` makes of each step's request."""

    def __init__(self, name: str, convert: Callable[[ExecuteModelRequest], Any],
                 extra: dict[str, Any]) -> None:
        self.name, self.convert, self.extra = name, convert, extra

    def prepare(self, req: ExecuteModelRequest) -> Any:
        return self.convert(req)

    def measure(self, prepared: Any) -> Sample:
        t0 = time.perf_counter_ns()
        frames = baselines.pickle_frames(prepared)
        t1 = time.perf_counter_ns()
        baselines.unpickle_frames(frames)
        t2 = time.perf_counter_ns()
        return Sample(baselines.frames_size(frames), t1 - t0, t2 - t1)


def make_lanes(workload: Workload) -> list[Lane]:
    v1 = baselines.V1Scheduler()
    return [
        DeltacastLane(workload),
        PickleLane("pickle_v1", lambda r: baselines.rpc_message(v1.convert(r)),
                   {"baseline": v1.label}),
        PickleLane("pickle", lambda r: r, {"baseline": "ExecuteModelRequest"}),
    ]


def bench_case(scenario: str, batch: int, steps: int, seed: int = 0,
               on_step: Callable[[], None] | None = None) -> list[Row]:
    """Rows (one per format) for one scenario at one batch size."""
    workload = Workload(scenario, batch, seed=seed)
    lanes = make_lanes(workload)
    for req in workload.warmup():
        for lane in lanes:
            lane.measure(lane.prepare(req))
    samples: list[list[Sample]] = [[] for _ in lanes]
    for i in range(steps):
        req = workload.step()
        prepared = [lane.prepare(req) for lane in lanes]
        for j in [(i + k) % len(lanes) for k in range(len(lanes))]:
            samples[j].append(lanes[j].measure(prepared[j]))
        if on_step is not None:
            on_step()
    _check_rebuild(lanes[0], req)
    return [_row(scenario, batch, lane, s) for lane, s in zip(lanes, samples, strict=True)]


def _check_rebuild(lane: Lane, req: ExecuteModelRequest) -> None:
    """The replica holds the engine's last request (whole tables on both ends: the
    mirror kept none, so the check rebuilds through a replay; O(run), untimed)."""
    assert isinstance(lane, DeltacastLane)
    replica = lane.replica
    assert replica.data is not None and replica.last is not None and replica.applied is not None
    got = request_summary(replica.data)
    want = (list(req.req_ids), req.num_scheduled_tokens.tolist(),
            req.num_computed_tokens.tolist())
    if got != want:
        raise RuntimeError("deltacast's replica differs from the engine's request")


def request_summary(state: Any) -> tuple[list[str], list[int], list[int]]:
    """(batch ids, scheduled counts, computed counts) a replica state holds."""
    sched = state.schedule
    return ([state.spec_of(h).req_id for h in sched.tolist()], state.nsched.tolist(),
            state.cols.computed[sched].tolist())


def _row(scenario: str, batch: int, lane: Lane, samples: list[Sample]) -> Row:
    sizes = [s.bytes for s in samples]
    return make_row(scenario, batch, 1, lane.name, int(statistics.median_low(sizes)),
                    statistics.median(s.encode_ns for s in samples) / 1e3,
                    statistics.median(s.decode_ns for s in samples) / 1e3,
                    **lane.extra, bytes_max=max(sizes), steps=len(samples))


def run_core(batches: Sequence[int], steps: int | None = None,
             scenarios: Sequence[str] = SCENARIOS, seed: int = 0,
             on_step: Callable[[], None] | None = None) -> Iterator[Row]:
    """Every row of a core run, case by case (scenarios side by side per batch)."""
    for batch in batches:
        for scenario in scenarios:
            yield from bench_case(scenario, batch, steps or default_steps(batch), seed, on_step)


# -- targets (issue 2) -------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    what: str
    value: float
    limit: float

    @property
    def met(self) -> bool:
        return self.value <= self.limit


def check_targets(rows: Sequence[Row]) -> list[Target]:
    """The issue's targets, for the batch sizes present in ``rows``."""
    by = {(r["scenario"], r["batch"], r["format"]): r for r in rows}
    out: list[Target] = []
    for (scenario, batch, fmt), r in sorted(by.items(), key=lambda kv: kv[0][1]):
        if scenario == "steady_decode" and fmt == "deltacast":
            out.append(Target(f"steady_decode bytes/step, batch {batch}", r["bytes_max"], 32))
    blocks = by.get(("decode_tokens_blocks", 256, "deltacast"))
    if blocks is not None:
        out.append(Target("decode_tokens_blocks bytes/step, batch 256", blocks["bytes_max"], 900))
    for batch, limit in ((256, 1 / 2), (4096, 1 / 3)):
        ours = by.get(("steady_decode", batch, "deltacast"))
        theirs = by.get(("steady_decode", batch, "pickle_v1"))
        if ours is not None and theirs is not None:
            out.append(Target(f"steady_decode time vs pickle_v1, batch {batch}",
                              ours["total_us"] / theirs["total_us"], limit))
    return out


# -- command ----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """``deltacast bench core``; returns 0 (targets are reported, not enforced)."""
    batches = args.batches or (QUICK_BATCHES if args.quick else DEFAULT_BATCHES)
    steps = args.steps or (QUICK_STEPS if args.quick else None)
    total = sum((steps or default_steps(b)) * len(SCENARIOS) for b in batches)
    rows: list[Row] = []
    with _progress(total, enabled=not args.json and sys.stderr.isatty()) as tick:
        for row in run_core(batches, steps, seed=args.seed, on_step=tick):
            rows.append(row)
            if args.json:
                print(dumps(row), flush=True)
    if not args.json:
        print_summary(rows, check_targets(rows))
    return 0


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[], None]]:
    """A rich progress bar on stderr (or nothing); yields the per-step tick."""
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("bench core", total=total)
        yield lambda: bar.advance(task)


def print_summary(rows: Sequence[Row], targets: Sequence[Target]) -> None:
    """A rich table of the rows (ratios against pickle_v1, and a plain verdict on each
    deltacast row: smaller or larger, faster or slower), the cases where deltacast is
    slower in a sentence, then the targets."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="deltacast bench core (median per step)")
    for name in ("scenario", "batch", "format", "bytes", "encode µs", "decode µs", "total µs",
                 "bytes ÷ v1", "time ÷ v1", "deltacast vs pickle_v1"):
        table.add_column(name, justify="left" if name in ("scenario", "format",
                                                          "deltacast vs pickle_v1") else "right")
    ref = {(r["scenario"], r["batch"]): r for r in rows if r["format"] == "pickle_v1"}
    for r in rows:
        v1 = ref.get((r["scenario"], r["batch"]))
        table.add_row(r["scenario"], str(r["batch"]), r["format"], f"{r['bytes']:,}",
                      f"{r['encode_us']:,.1f}", f"{r['decode_us']:,.1f}", f"{r['total_us']:,.1f}",
                      _ratio(r, v1, "bytes"), _ratio(r, v1, "total_us"),
                      verdict(r, v1) if r["format"] == "deltacast" else "",
                      end_section=r["format"] == FORMATS[-1])
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 150))  # files and pipes: no truncation
    console.print(table)
    slower = slower_cases(rows)
    if slower:
        console.print(f"[yellow]deltacast is slower than pickle_v1[/yellow] on {len(slower)} "
                      f"of {len(ref)} cases (total µs per step): {'; '.join(slower)}",
                      highlight=False)
    for t in targets:
        mark = "[green]met[/green]" if t.met else "[red]MISSED[/red]"
        console.print(f"{mark}  {t.what}: {t.value:,.3g} (target ≤ {t.limit:.3g})")


def verdict(ours: Row, v1: Row | None) -> str:
    """Plain words for a deltacast row against pickle_v1: '66× smaller, 2.8× slower'."""
    if v1 is None or not v1["bytes"] or not v1["total_us"] or not ours["total_us"]:
        return ""
    size = ours["bytes"] / v1["bytes"]
    time_ = ours["total_us"] / v1["total_us"]
    words = (f"{1 / size:.3g}× smaller" if size <= 1 else f"{size:.3g}× larger",
             f"{1 / time_:.3g}× faster" if time_ <= 1 else f"[red]{time_:.3g}× slower[/red]")
    return ", ".join(words)


def slower_cases(rows: Sequence[Row]) -> list[str]:
    """'scenario batch N (2.8×)' for each case where deltacast takes longer than pickle_v1."""
    ref = {(r["scenario"], r["batch"]): r for r in rows if r["format"] == "pickle_v1"}
    out = []
    for r in rows:
        v1 = ref.get((r["scenario"], r["batch"]))
        if r["format"] == "deltacast" and v1 and v1["total_us"] and \
                r["total_us"] > v1["total_us"]:
            out.append(f"{r['scenario']} batch {r['batch']} "
                       f"({r['total_us'] / v1['total_us']:.3g}×)")
    return out


def _ratio(ours: Row, theirs: Row | None, key: str) -> str:
    return f"{ours[key] / theirs[key]:.3g}" if theirs and theirs[key] else ""
