"""Replay a stream of full requests through every format, step by step, side by side.

Formats (the bench's names): ``deltacast`` (encode = ``EngineMirror.step`` of the
step's changes + codec, the changes found untimed by :class:`RequestDiffer` as an
engine's scheduler knows them; decode = decode + a replica's apply; the request
rebuilt by :func:`rebuild_request` and checked equal to the engine's, untimed),
``msgspec_full`` (the full request in msgspec, no deltas; arrays as zero-copy
frames), ``pickle_v1`` (vLLM v1 SchedulerOutput RPC tuple, real classes when vLLM is
importable, else the stand-in -- labelled), ``pickle`` (the full request pickled: the
old v0 path).  Every step is measured in every
format, interleaved, so machine noise hits all formats alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from engine_side.bench import baselines
from engine_side.mirror import EngineMirror
from engine_side.report.accounting import delta_breakdown, pickle_v1_breakdown
from engine_side.request_diff import RequestDiffer
from protocol import codec
from protocol.messages import NewRequest
from protocol.rebuild import rebuild_request
from protocol.request import ExecuteModelRequest, RequestSpec, request_differences
from protocol.state import ReplicaState
from protocol.tensors import make_enc_hook, make_ext_hook
from worker_side.events import Applied
from worker_side.replica import WorkerReplica

FORMATS = ("deltacast", "msgspec_full", "pickle_v1", "pickle")


@dataclass
class StepRecord:
    bytes: int
    encode_us: float
    decode_us: float
    breakdown: dict[str, int] | None = None


@dataclass
class Replay:
    """Per-format step records of one workload."""

    name: str
    batch: int
    steps: dict[str, list[StepRecord]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter_ns()
    out = fn()
    return out, (time.perf_counter_ns() - t0) / 1e3


class _Deltacast:
    def __init__(self, token_mode: int, kv_groups: int) -> None:
        self.mirror = EngineMirror(token_mode=token_mode, kv_groups=kv_groups)
        self.differ = RequestDiffer(self.mirror)
        self.replica = WorkerReplica(silence_timeout=float("inf"), start=(
            self.mirror.epoch, ReplicaState(token_mode, kv_groups)))
        self.specs: dict[int, tuple[NewRequest, RequestSpec]] = {}  # rebuild_request's cache

    def _rebuilt(self, events: list[Any]) -> ExecuteModelRequest | None:
        """The step's whole request, rebuilt (None: the replica did not apply)."""
        replica = self.replica
        data, last, applied = replica.data, replica.last, replica.applied
        if not events or not isinstance(events[-1], Applied) or applied is None \
                or data is None or last is None:
            return None
        return rebuild_request(data, last.body, applied, self.specs)

    def step(self, req: ExecuteModelRequest) -> StepRecord:
        # untimed: what the step changed, found by comparing the whole request with the
        # mirror (an engine knows its changes, as vLLM's scheduler output is them; the
        # pickle lanes' conversions are untimed likewise); timed: the mirror's step and
        # the encode, the worker's decode and apply (its replica then holds the step, as
        # pickle_v1's worker holds the unpickled SchedulerOutput); untimed: the whole
        # request rebuilt and compared with the engine's
        changes = self.differ.changes(req)
        (delta, frames), enc_us = _timed(lambda: (d := self.differ.step(changes),
                                                  codec.encode(d)))
        events, dec_us = _timed(lambda: self.replica.receive(codec.decode(frames), 0.0))
        got = self._rebuilt(events)
        if got is None:
            raise RuntimeError(f"replica did not apply step {delta.seq}")
        differ = request_differences(got, req)
        if differ:
            raise RuntimeError(f"rebuilt request differs at step {delta.seq}: {differ}")
        return StepRecord(codec.encoded_size(frames), enc_us, dec_us,
                          delta_breakdown(delta, frames))


def _dec_hook(kind: type, obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"cannot decode {kind}")


class _MsgspecFull:
    def step(self, req: ExecuteModelRequest) -> StepRecord:
        aux: list[Any] = []
        encoder = msgspec.msgpack.Encoder(enc_hook=make_enc_hook(aux))
        body, enc_us = _timed(lambda: encoder.encode(req))
        frames = [body, *aux]
        decoder = msgspec.msgpack.Decoder(ExecuteModelRequest, dec_hook=_dec_hook,
                                          ext_hook=make_ext_hook(frames[1:]))
        _, dec_us = _timed(lambda: decoder.decode(body))
        return StepRecord(codec.encoded_size(frames), enc_us, dec_us)


class _Pickle:
    def __init__(self, convert: Callable[[ExecuteModelRequest], Any], account: bool) -> None:
        self.convert, self.account = convert, account

    def step(self, req: ExecuteModelRequest) -> StepRecord:
        obj = self.convert(req)
        frames, enc_us = _timed(lambda: baselines.pickle_frames(obj))
        _, dec_us = _timed(lambda: baselines.unpickle_frames(frames))
        size = baselines.frames_size(frames)
        split = pickle_v1_breakdown(obj[1][0], size) if self.account else None
        return StepRecord(size, enc_us, dec_us, split)


def replay(name: str, requests: Iterable[ExecuteModelRequest], batch: int, token_mode: int,
           kv_groups: int = 1, on_step: Callable[[], None] | None = None) -> Replay:
    """Run every step of ``requests`` through every format (interleaved per step)."""
    v1 = baselines.V1Scheduler()
    lanes: dict[str, Any] = {
        "deltacast": _Deltacast(token_mode, kv_groups),
        "msgspec_full": _MsgspecFull(),
        "pickle_v1": _Pickle(lambda r: baselines.rpc_message(v1.convert(r)), account=True),
        "pickle": _Pickle(lambda r: r, account=False),
    }
    result = Replay(name, batch, {f: [] for f in FORMATS},
                    {"pickle_v1": f"vLLM SchedulerOutput ({v1.label})"})
    for i, req in enumerate(requests):
        order = FORMATS[i % len(FORMATS):] + FORMATS[: i % len(FORMATS)]
        for fmt in order:
            result.steps[fmt].append(lanes[fmt].step(req))
        if on_step is not None:
            on_step()
    return result
