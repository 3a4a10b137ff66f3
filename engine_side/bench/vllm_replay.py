"""Offline, side by side: our frames vs vLLM's pickling of the same recorded objects.

A recording (``engine_side/vllm/record.py``) is rebuilt into the run's original
SchedulerOutput / GrammarOutput / ModelRunnerOutput objects by fresh decoders;
:func:`replay` then sends each through a fresh encoder → fresh decoder and, in
the same loop, through vLLM's own message: the MultiprocExecutor RPC tuple
``(method, (obj,), {}, 0)`` or the reply ``(SUCCESS, output)``, serialized by the lines
vLLM's ``MessageQueue`` runs (:func:`vllm_serialize`, :func:`vllm_deserialize`),
out-of-band buffers counted; with ``bare``, by bare ``pickle.dumps`` + ``pickle.loads``
(protocol 5), the baseline until the twenty-fourth session, which omits the Pickler,
BytesIO and dispatch-table copy vLLM makes per message.  The side timed first
alternates per message kind (a step holds an even number of messages): the first
to touch a recorded object pays for its cache misses (15-25 % of a small step),
so neither side always does.

A **step** opens at each ``execute_model``: the request path is its message plus
the ``sample_tokens`` message, the reply path their two replies.  µs are
encode + decode against serialize + deserialize, summed per step; medians are over steps.  The
decoder takes the frames as the encoder returns them, as pickle.loads takes dumps' bytes
and buffers: neither side is timed copying them (until the sixteenth session ours were
timed through a list of bytes copies, ~0.8 µs a message).

With an :class:`Eviction`, each path's turn at each message follows a write of N MB that
evicts the caches (and, with ``warm_step``, a read of the message's objects, as the
engine's scheduler leaves a step it has just built): the steps as a server runs them,
with other work between, instead of back to back.
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import gc
import io
import pickle
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

REQUEST, REPLY = ("execute_model", "sample_tokens"), ("reply", "sample_reply")
_RPC = {"execute_model": "execute_model", "sample_tokens": "sample_tokens"}
Row = tuple[str, int, float, float]  # kind, bytes, encode s, decode s


@functools.cache
def _vllm_names() -> tuple[Any, Any]:
    """(torch, vLLM's tensor reducer), imported once."""
    import torch
    from vllm.distributed.device_communicators.shm_broadcast import _reduce_tensor

    return torch, _reduce_tensor


def vllm_serialize(obj: Any) -> list[Any]:
    """``obj`` serialized as vLLM 0.32's ``MessageQueue.enqueue`` serializes every
    executor message, line for line (``vllm/distributed/device_communicators/
    shm_broadcast.py``, the default branch without a tensor arena): a protocol-5
    Pickler writing to a BytesIO, with a copy of copyreg's dispatch table plus vLLM's
    tensor reducer, buffers under 1 MiB in band.  [pickle bytes, *out-of-band buffers];
    ``tests/test_vllm_streams_bench.py`` holds these lines to vLLM's source."""
    torch, _reduce_tensor = _vllm_names()  # (module globals in vLLM: no import timed)
    all_buffers: list[Any] = [b""]

    def oob_callback(buf: pickle.PickleBuffer) -> bool:
        raw_buf = buf.raw()
        if len(raw_buf) < 1024 * 1024:
            return True  # in band
        all_buffers.append(raw_buf)
        return False

    dispatch_table = dict(copyreg.dispatch_table)
    dispatch_table[torch.Tensor] = _reduce_tensor
    with io.BytesIO() as bio:
        pickler = pickle.Pickler(bio, protocol=pickle.HIGHEST_PROTOCOL,
                                 buffer_callback=oob_callback)
        pickler.dispatch_table = dispatch_table
        pickler.dump(obj)
        all_buffers[0] = bio.getvalue()
    return all_buffers


def vllm_deserialize(all_buffers: list[Any]) -> Any:
    """The message of :func:`vllm_serialize`'s buffers, as ``MessageQueue.dequeue``
    loads it (our own bytes, made just before)."""
    return pickle.loads(all_buffers[0], buffers=all_buffers[1:])  # our own bytes


def vllm_message(kind: str, obj: Any) -> tuple[Any, ...]:
    """The tuple vLLM's MultiprocExecutor sends for ``obj``: an RPC to the workers or
    a worker's reply."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    return (_RPC[kind], (obj,), {}, 0) if kind in _RPC else \
        (WorkerProc.ResponseStatus.SUCCESS, obj)


def pickled(kind: str, obj: Any, bare: bool = False) -> tuple[int, float, float]:
    """Bytes, serialize s, deserialize s of vLLM's own message for ``obj``, by vLLM's
    serializer (:func:`vllm_serialize`), or by bare ``pickle.dumps`` / ``loads``
    (protocol 5, every buffer out of band) when ``bare``."""
    msg = vllm_message(kind, obj)
    _vllm_names()  # (imported before anything is timed)
    t0 = time.perf_counter()
    if bare:
        bufs: list[Any] = []
        data = pickle.dumps(msg, protocol=5, buffer_callback=bufs.append)
        t1 = time.perf_counter()
        pickle.loads(data, buffers=bufs)  # our own bytes, made just above
        t2 = time.perf_counter()
        return len(data) + sum(memoryview(b).nbytes for b in bufs), t1 - t0, t2 - t1
    sent = vllm_serialize(msg)
    t1 = time.perf_counter()
    vllm_deserialize(sent)
    t2 = time.perf_counter()
    return sum(memoryview(b).nbytes for b in sent), t1 - t0, t2 - t1


def load_recording(path: Path) -> list[tuple[str, Any]]:
    """The original objects of a recording, rebuilt by fresh decoders."""
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from engine_side.vllm.record import RecordReader
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    enc, dec = SchedulerOutputEncoder(), SchedulerOutputDecoder()
    decode = {"execute_model": dec.decode, "sample_tokens": dec.decode_grammar,
              "reply": enc.decode_reply, "sample_reply": enc.decode_reply}
    out = []
    for kind, frames in RecordReader(path):
        out.append((kind, decode[kind](list(frames))))
        if kind == "execute_model":
            enc.encode(out[-1][1])  # the engine side learns the step's batch
    return out


def synthetic_decode(running: int, steps: int, prompt: int = 500) -> list[tuple[str, Any]]:
    """Steady decode of ``running`` requests (34-byte ids, 1 token each, a block per 32 steps)."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    ids = [f"chatcmpl-{i:016x}-{i * 7919 % 65536:08x}"[:34] for i in range(running)]
    sp = SamplingParams(temperature=0, max_tokens=steps + 1)
    blocks = {rid: list(range(k * 64, k * 64 + prompt // 32 + 1)) for k, rid in enumerate(ids)}
    first = SchedulerOutput(
        [NewRequestData(rid, list(range(prompt)), [], sp, None, (blocks[rid],), 0, None)
         for rid in ids], CachedRequestData.make_empty(), dict.fromkeys(ids, prompt),
        prompt * running, {}, {}, set(), [], preempted_req_ids=set())
    out: list[tuple[str, Any]] = [("execute_model", first)]
    for t in range(1, steps):
        computed = prompt + t - 1
        grow = [(k + t) % 32 == 0 for k in range(running)]
        cached = CachedRequestData(
            list(ids), set(), [], {},
            [([k * 64 + 40 + t],) if g else None for k, g in enumerate(grow)],
            [computed] * running, [t] * running)
        out.append(("execute_model", SchedulerOutput(
            [], cached, dict.fromkeys(ids, 1), running, {}, {}, set(), [],
            preempted_req_ids=set())))
        out.append(("reply", ModelRunnerOutput(list(ids), {r: i for i, r in enumerate(ids)},
                                               [[(t * 31 + k) % 500] for k in range(running)])))
    return out


def synthetic_churn(running: int, steps: int, prompt: int = 500) -> list[tuple[str, Any]]:
    """Continuous batching at ``running`` requests: every step after the first, the
    oldest request finishes and a new one (``prompt`` tokens, prefilled in one
    chunk) joins at the end of the batch; the others decode one token each.  Every
    step is a general one (a request leaves and one enters)."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    sp = SamplingParams(temperature=0, max_tokens=steps + 1)

    def new(k: int) -> Any:
        rid = f"chatcmpl-{k:016x}-{k * 7919 % 65536:08x}"[:34]
        table = list(range(k * 64, k * 64 + prompt // 32 + 1))
        return NewRequestData(rid, list(range(prompt)), [], sp, None, (table,), 0, None)

    adds = [new(k) for k in range(running)]
    live = {nr.req_id: [prompt, 0] for nr in adds}  # req id -> [computed, outputs]
    out: list[tuple[str, Any]] = [("execute_model", SchedulerOutput(
        adds, CachedRequestData.make_empty(), dict.fromkeys(live, prompt), prompt * running,
        {}, {}, set(), [], preempted_req_ids=set()))]
    for t in range(1, steps):
        gone = next(iter(live))
        del live[gone]
        joined, ids = new(running + t - 1), list(live)
        cached = CachedRequestData(ids, set(), [], {}, [None] * len(ids),
                                   [live[r][0] for r in ids], [live[r][1] + 1 for r in ids])
        nsched = {**dict.fromkeys(ids, 1), joined.req_id: prompt}
        out.append(("execute_model", SchedulerOutput(
            [joined], cached, nsched, len(ids) + prompt, {}, {}, {gone}, [],
            preempted_req_ids=set())))
        for r in ids:
            live[r][0] += 1
            live[r][1] += 1
        live[joined.req_id] = [prompt, 0]
        order = list(nsched)
        out.append(("reply", ModelRunnerOutput(order, {r: i for i, r in enumerate(order)},
                                               [[(t * 31 + k) % 500] for k in range(running)])))
    return out


# ---------------------------------------------------------------- step shapes
def new_blocks(so: Any) -> int:
    """Block ids a step adds (new requests' tables and cached requests' new blocks)."""
    n = sum(len(ids) for nr in so.scheduled_new_reqs for ids in nr.block_ids)
    return n + sum(len(ids) for g in so.scheduled_cached_reqs.new_block_ids if g for ids in g)


def is_steady(so: Any, prev: dict[str, int]) -> bool:
    """A steady decode step: the previous decode batch again, one token each, nothing else."""
    c = so.scheduled_cached_reqs
    return (not so.scheduled_new_reqs and not so.finished_req_ids and not so.preempted_req_ids
            and not c.resumed_req_ids and not so.scheduled_spec_decode_tokens
            and list(so.num_scheduled_tokens.items()) == list(prev.items())
            and set(prev.values()) == {1})


def changes_batch(so: Any) -> bool:
    """A request joins, leaves (finished or preempted) or resumes in this step."""
    c = so.scheduled_cached_reqs
    return bool(so.scheduled_new_reqs or so.finished_req_ids or so.preempted_req_ids
                or c.resumed_req_ids)


class _Step:
    """Accumulated figures of one step (request and reply paths)."""

    def __init__(self, so: Any, prev: dict[str, int]) -> None:
        self.running = len(so.num_scheduled_tokens)
        self.steady = is_steady(so, prev)
        self.churn = changes_batch(so)
        self.blocks = new_blocks(so)
        self.figures: dict[str, list[float]] = {p: [0, 0, 0, 0] for p in ("request", "reply")}
        self.grammar = False

    def add(self, kind: str, ours: Row, theirs: tuple[int, float, float]) -> None:
        acc = self.figures["request" if kind in REQUEST else "reply"]
        acc[0] += ours[1]
        acc[1] += theirs[0]
        acc[2] += (ours[2] + ours[3]) * 1e6
        acc[3] += (theirs[1] + theirs[2]) * 1e6


def _ours(kind: str, obj: Any, route: tuple[Any, Any]) -> tuple[Row, list[bytes]]:
    encode, decode = route
    t0 = time.perf_counter()
    sent = encode(obj)  # the frames as a transport takes them (pickle's buffers are
    t1 = time.perf_counter()  # not copied either: neither side is timed copying them)
    decode(sent)
    t2 = time.perf_counter()
    frames = [bytes(f) for f in sent]
    return (kind, sum(map(len, frames)), t1 - t0, t2 - t1), frames


@dataclasses.dataclass(frozen=True)
class Eviction:
    """What runs, untimed, before each path's turn at each message: ``mb`` megabytes
    written (one byte a cache line of a buffer made once), then with ``warm_step`` the
    message's object graph read (``repr``: its fields and lists; large buffers are
    summarised, not read)."""

    mb: int
    warm_step: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.mb <= 4096:
            raise ValueError(f"eviction must be 1..4096 MB, got {self.mb}")

    def evictor(self) -> Any:
        """The callable that evicts before a turn (``evictor()(obj)``)."""
        buffer = bytearray(self.mb << 20)
        zeros = bytes(len(range(0, len(buffer), 64)))  # one byte a cache line

        def evict(obj: Any) -> None:
            buffer[::64] = zeros
            if self.warm_step:
                repr(obj)

        return evict


def _route(enc: Any, dec: Any) -> dict[str, tuple[Any, Any]]:
    return {"execute_model": (enc.encode, dec.decode),
            "sample_tokens": (enc.encode_grammar, dec.decode_grammar),
            "reply": (dec.encode_reply, enc.decode_reply),
            "sample_reply": (dec.encode_reply, enc.decode_reply)}


def replay(messages: list[tuple[str, Any]], breakdown: bool = False,
           passes: int = 1, bare: bool = False,
           eviction: Eviction | None = None) -> dict[str, Any]:
    """Per-step bytes and µs, ours (fresh encoder → fresh decoder) vs pickle, summarised.
    With ``passes`` > 1 the stream is replayed that many times, each pass with a fresh
    encoder and decoder and the other path first at every step, and each step's µs on
    either path is its median over the passes (a noisy machine's outliers then move no
    median; bytes are the same in every pass).  ``bare``: pickle's figures are bare
    ``pickle.dumps`` + ``loads`` instead of vLLM's serializer (:func:`pickled`);
    ``eviction``: what runs before each path's turn (None: nothing, steps back to back)."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    runs = [_one_pass(messages, breakdown and k == 0, ours_first=k % 2 == 1, bare=bare,
                      eviction=eviction)
            for k in range(passes)]
    steps, fields = runs[0]
    for i, step in enumerate(steps):
        for path, acc in step.figures.items():
            for col in (2, 3):
                acc[col] = statistics.median(run[0][i].figures[path][col] for run in runs)
    out = summarise(steps)
    out["passes"] = passes
    if breakdown:
        out["request_fields"] = dict(fields.most_common())
    return out


def _one_pass(messages: list[tuple[str, Any]], breakdown: bool, ours_first: bool,
              bare: bool = False, eviction: Eviction | None = None,
              ) -> tuple[list[_Step], Counter[str]]:
    """One replay of ``messages``: per step the figures of both paths (which one goes
    first alternates per message kind, starting with pickle unless ``ours_first``; each
    after ``eviction``'s work when there is one), and the request fields' byte counts
    when ``breakdown``."""
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    gc.collect()
    gc.freeze()
    enc, dec = SchedulerOutputEncoder(), SchedulerOutputDecoder()
    route = _route(enc, dec)
    steps: list[_Step] = []
    fields: Counter[str] = Counter()
    prev: dict[str, int] = {}
    seen: Counter[str] = Counter()  # alternate per kind: a step holds an even number of messages
    evict = eviction.evictor() if eviction is not None else _nothing
    for kind, obj in messages:
        if kind == "execute_model":
            steps.append(_Step(obj, prev))
            prev = dict(obj.num_scheduled_tokens)
        seen[kind] += 1
        theirs = None
        if (seen[kind] + ours_first) % 2:
            evict(obj)
            theirs = pickled(kind, obj, bare)
        evict(obj)
        ours, frames = _ours(kind, obj, route[kind])
        if theirs is None:
            evict(obj)
            theirs = pickled(kind, obj, bare)
        if steps:
            steps[-1].add(kind, ours, theirs)
            steps[-1].grammar |= kind == "sample_tokens" and obj is not None
        if breakdown and kind in REQUEST:
            fields.update(request_fields(kind, frames))
    gc.unfreeze()
    return steps, fields


def _nothing(obj: Any) -> None:
    """No eviction: the steps back to back."""


def summarise(steps: list[_Step]) -> dict[str, Any]:
    """Totals, per-step means and medians for both paths; the steady-decode check."""
    out: dict[str, Any] = {"steps": len(steps),
                           "max_running": max((s.running for s in steps), default=0)}
    for path in ("request", "reply"):
        cols: list[Any] = list(zip(*(s.figures[path] for s in steps), strict=True)) \
            or [[0.0]] * 4
        out[path] = {"bytes": int(sum(cols[0])), "pickle_bytes": int(sum(cols[1])),
                     "us": sum(cols[2]), "pickle_us": sum(cols[3]),
                     "median_bytes": statistics.median(cols[0]),
                     "pickle_median_bytes": statistics.median(cols[1]),
                     "median_us": statistics.median(cols[2]),
                     "pickle_median_us": statistics.median(cols[3])}
    steady = [s for s in steps if s.steady and not s.grammar]
    over = [s.figures["request"][0] - 4 * s.blocks for s in steady]
    out["steady"] = {"steps": len(steady), "max_over_blocks": max(over, default=None),
                     "within_32": sum(1 for o in over if o <= 32),
                     "median_bytes": statistics.median([s.figures["request"][0] for s in steady])
                     if steady else None}
    for kind, chosen in (("churn", [s for s in steps if s.churn]),
                         ("same_batch", [s for s in steps if not s.churn])):
        out[kind] = {"steps": len(chosen),  # request-path µs summed over these steps
                     "us": sum(s.figures["request"][2] for s in chosen),
                     "pickle_us": sum(s.figures["request"][3] for s in chosen)}
    full = [s for s in steps if s.running == out["max_running"]]
    out["reply_at_max_running"] = {
        "steps": len(full),
        "median_bytes": statistics.median([s.figures["reply"][0] for s in full]) if full else 0,
        "pickle_median_bytes": statistics.median([s.figures["reply"][1] for s in full])
        if full else 0}
    return out


def request_fields(kind: str, frames: list[bytes]) -> dict[str, int]:
    """Exact bytes of one request-path message per field (``engine_side/report/accounting``)."""
    import msgspec

    from engine_side.report.accounting import delta_breakdown, field_sizes
    from engine_side.vllm.schema import StepExt
    from protocol import codec
    from protocol.messages import Delta

    if kind == "sample_tokens":
        return {"sample_tokens": sum(map(len, frames))}
    msg = codec.decode(frames)
    if not isinstance(msg, Delta):
        return {type(msg).__name__: sum(map(len, frames))}
    sizes = {k: v for k, v in delta_breakdown(msg, frames).items() if v}
    ext = msg.body.extension.get("v")
    if ext is not None:  # split the adapter's StepExt out of the extension slot
        parts = field_sizes(msgspec.msgpack.decode(ext, type=StepExt))
        sizes["extension slot"] -= sum(parts.values())
        sizes.update({f"ext.{k}": v for k, v in parts.items()})
    return sizes
