"""``deltacast bench core``: bytes and CPU time per step, deltacast vs vLLM-style pickling.

Method.  For each scenario and batch size, a seeded :class:`Workload` is warmed
up untimed (admission, prefill, a few decodes) and every format's state (the
mirror and a worker replica; the v1 scheduler's per-request cache) is fed the
same warm-up steps.  Then ``steps`` steps are timed; each step is measured in
every format, in an order rotated per step so drift and noise hit all alike,
and the median per step is reported.  Formats:

* ``deltacast``: encode = ``mirror.diff`` + ``codec.encode``; decode =
  ``codec.decode`` + ``replica.receive`` + ``replica.request()`` (the rebuild);
  bytes = ``codec.encoded_size``.  The last rebuilt request is checked equal to
  the engine's, untimed.
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
from protocol.request import ExecuteModelRequest, request_differences
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

    def __init__(self, token_mode: int) -> None:
        self.extra: dict[str, Any] = {}
        self.mirror = EngineMirror(token_mode=token_mode)
        self.replica = WorkerReplica(silence_timeout=float("inf"))
        self.replica.receive(codec.decode(codec.encode(self.mirror.snapshot())), 0.0)
        self.last: ExecuteModelRequest | None = None

    def prepare(self, req: ExecuteModelRequest) -> ExecuteModelRequest:
        return req

    def measure(self, prepared: ExecuteModelRequest) -> Sample:
        t0 = time.perf_counter_ns()
        frames = codec.encode(self.mirror.diff(prepared))
        t1 = time.perf_counter_ns()
        events = self.replica.receive(codec.decode(frames), 0.0)
        self.last = self.replica.request()
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


def make_lanes(token_mode: int) -> list[Lane]:
    v1 = baselines.V1Scheduler()
    return [
        DeltacastLane(token_mode),
        PickleLane("pickle_v1", lambda r: baselines.rpc_message(v1.convert(r)),
                   {"baseline": v1.label}),
        PickleLane("pickle", lambda r: r, {"baseline": "ExecuteModelRequest"}),
    ]


def bench_case(scenario: str, batch: int, steps: int, seed: int = 0,
               on_step: Callable[[], None] | None = None) -> list[Row]:
    """Rows (one per format) for one scenario at one batch size."""
    workload = Workload(scenario, batch, seed=seed)
    lanes = make_lanes(workload.token_mode)
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
    assert isinstance(lane, DeltacastLane) and lane.last is not None
    differ = request_differences(lane.last, req)
    if differ:
        raise RuntimeError(f"deltacast rebuild differs from the engine's request: {differ}")


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
    """A rich table of the rows (ratios against pickle_v1), then the targets."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="deltacast bench core (median per step)")
    for name in ("scenario", "batch", "format", "bytes", "encode µs", "decode µs", "total µs",
                 "bytes ÷ v1", "time ÷ v1"):
        table.add_column(name, justify="left" if name in ("scenario", "format") else "right")
    ref = {(r["scenario"], r["batch"]): r for r in rows if r["format"] == "pickle_v1"}
    for r in rows:
        v1 = ref.get((r["scenario"], r["batch"]))
        table.add_row(r["scenario"], str(r["batch"]), r["format"], f"{r['bytes']:,}",
                      f"{r['encode_us']:,.1f}", f"{r['decode_us']:,.1f}", f"{r['total_us']:,.1f}",
                      _ratio(r, v1, "bytes"), _ratio(r, v1, "total_us"),
                      end_section=r["format"] == FORMATS[-1])
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 132))  # files and pipes: no truncation
    console.print(table)
    for t in targets:
        mark = "[green]met[/green]" if t.met else "[red]MISSED[/red]"
        console.print(f"{mark}  {t.what}: {t.value:,.3g} (target ≤ {t.limit:.3g})")


def _ratio(ours: Row, theirs: Row | None, key: str) -> str:
    return f"{ours[key] / theirs[key]:.3g}" if theirs and theirs[key] else ""
