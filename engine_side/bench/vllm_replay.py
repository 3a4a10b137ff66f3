"""Offline, side by side: deltacast's frames vs vLLM's own serializer, per step.

A stream is vLLM's per-step objects, recorded from a real run
(``engine_side/bench/objstream.py``, ``vllm_online.py``) or made synthetically here.
:func:`replay` sends each message through a fresh encoder → fresh decoder (ours: the
engine's encode plus one rank's decode up to the plain vLLM object it hands its model
runner) and, in the same loop, through vLLM's own message -- the MultiprocExecutor RPC
tuple ``(method, (obj,), {}, 0)`` or the reply ``(SUCCESS, output)`` -- serialized as
vLLM's ``MessageQueue`` does (:func:`vllm_serialize`, :func:`vllm_deserialize`) and by
bare ``pickle.dumps`` + ``pickle.loads`` (protocol 5: the stricter yardstick, which
omits the Pickler and the dispatch-table copy vLLM makes per message).  Beside them,
the **floor**: a step's SchedulerOutput built in Python from the original's own lists
with fresh containers (:func:`rebuilt_in_python`), the least any Python rank does to hand
its runner a plain object, with nothing decoded and no state kept; and a **minimal
stateful channel** that does a subset of deltacast's work with plain lists
(:mod:`.minimal_stateful`: msgspec body, handles and departures from prediction, no
digest, no checks), on ``execute_model`` only, also timed keeping a state digest from
deltacast's digest terms (``digested``).  The six are timed in an order rotated per
message, so none always pays for first touching a step's objects.

A **step** opens at each ``execute_model``: the request path is its message plus the
``sample_tokens`` message, the reply path their replies; µs are encode + decode
against serialize + deserialize, summed per step.  A **join/leave** step is one where
a request joins, leaves, is preempted or resumes; the others are **same-batch** steps.
With ``passes`` > 1 each step's µs is its median over the passes.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import gc
import io
import pickle
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REQUEST, REPLY = ("execute_model", "sample_tokens"), ("reply", "sample_reply")
PATHS = ("ours", "vllm", "bare", "floor", "minimal", "digested")  # deltacast; vLLM's
# serializer; bare pickle; the Python floor; the minimal stateful channel, without and with
# a state digest
_RPC = {"execute_model": "execute_model", "sample_tokens": "sample_tokens"}


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
    tensor reducer, buffers under 1 MiB in band.  [pickle bytes, *out-of-band buffers]."""
    torch, _reduce_tensor = _vllm_names()
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


def pickled(kind: str, obj: Any, bare: bool = False) -> tuple[int, float]:
    """(bytes, serialize + deserialize seconds) of vLLM's own message for ``obj``, by
    vLLM's serializer or, with ``bare``, by bare ``pickle.dumps`` / ``loads``."""
    msg = vllm_message(kind, obj)
    _vllm_names()  # (imported before anything is timed)
    if bare:
        t0 = time.perf_counter()
        bufs: list[Any] = []
        data = pickle.dumps(msg, protocol=5, buffer_callback=bufs.append)
        pickle.loads(data, buffers=bufs)  # our own bytes, made just above
        took = time.perf_counter() - t0
        return len(data) + sum(memoryview(b).nbytes for b in bufs), took
    t0 = time.perf_counter()
    sent = vllm_serialize(msg)
    vllm_deserialize(sent)
    took = time.perf_counter() - t0
    return sum(memoryview(b).nbytes for b in sent), took


def python_floor(kind: str, obj: Any) -> float:
    """Seconds :func:`rebuilt_in_python` takes for ``obj`` (an ``execute_model``
    record); 0.0 for other kinds."""
    if kind != "execute_model":
        return 0.0
    t0 = time.perf_counter()
    rebuilt_in_python(obj)
    return time.perf_counter() - t0


def minimal_step(kind: str, obj: Any, pair: Any) -> tuple[int, float]:
    """(bytes, seconds) of ``obj`` (an ``execute_model`` record) through the minimal
    stateful channel's encoder and decoder ``pair``; (0, 0.0) for other kinds."""
    if kind != "execute_model":
        return 0, 0.0
    t0 = time.perf_counter()
    data = pair[0].encode(obj)
    pair[1].decode(data)
    return len(data), time.perf_counter() - t0


def rebuilt_in_python(so: Any) -> Any:
    """``so`` (a SchedulerOutput) built again in Python as a rank must hand it over: every
    container fresh (lists, dicts, sets, block tuples), the sampling parameters
    shallow-copied, the rest (strings, multimodal items, connector objects) shared."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = [NewRequestData(
        req_id=r.req_id, prompt_token_ids=None if r.prompt_token_ids is None
        else list(r.prompt_token_ids), mm_features=list(r.mm_features),
        sampling_params=copy.copy(r.sampling_params), pooling_params=r.pooling_params,
        block_ids=tuple([list(b) for b in r.block_ids]),
        num_computed_tokens=r.num_computed_tokens, lora_request=r.lora_request,
        prompt_embeds=r.prompt_embeds, prompt_is_token_ids=None
        if r.prompt_is_token_ids is None else list(r.prompt_is_token_ids),
        prefill_token_ids=None if r.prefill_token_ids is None else list(r.prefill_token_ids),
        replay_start=r.replay_start) for r in so.scheduled_new_reqs]
    c = so.scheduled_cached_reqs
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData(
            req_ids=list(c.req_ids), resumed_req_ids=set(c.resumed_req_ids),
            new_token_ids=[list(t) for t in c.new_token_ids],
            all_token_ids={k: list(v) for k, v in c.all_token_ids.items()},
            new_block_ids=[None if b is None else tuple([list(g) for g in b])
                           for b in c.new_block_ids],
            num_computed_tokens=list(c.num_computed_tokens),
            num_output_tokens=list(c.num_output_tokens)),
        num_scheduled_tokens=dict(so.num_scheduled_tokens),
        total_num_scheduled_tokens=so.total_num_scheduled_tokens,
        scheduled_spec_decode_tokens={k: list(v) for k, v in
                                      so.scheduled_spec_decode_tokens.items()},
        scheduled_encoder_inputs={k: list(v) for k, v in so.scheduled_encoder_inputs.items()},
        num_common_prefix_blocks=list(so.num_common_prefix_blocks),
        finished_req_ids=set(so.finished_req_ids),
        free_encoder_mm_hashes=list(so.free_encoder_mm_hashes),
        scheduled_encoder_input_stats=so.scheduled_encoder_input_stats,
        preempted_req_ids=None if so.preempted_req_ids is None else set(so.preempted_req_ids),
        has_structured_output_requests=so.has_structured_output_requests,
        pending_structured_output_tokens=so.pending_structured_output_tokens,
        num_invalid_spec_tokens=None if so.num_invalid_spec_tokens is None
        else dict(so.num_invalid_spec_tokens),
        kv_connector_metadata=so.kv_connector_metadata, has_sync_kv_loads=so.has_sync_kv_loads,
        aux_output_connector_metadata=so.aux_output_connector_metadata,
        ec_connector_metadata=so.ec_connector_metadata,
        ec_manager_metadata=so.ec_manager_metadata,
        new_block_ids_to_zero=None if so.new_block_ids_to_zero is None
        else list(so.new_block_ids_to_zero),
        kv_cache_block_copies=None if so.kv_cache_block_copies is None
        else list(so.kv_cache_block_copies),
        num_spec_tokens_to_schedule=so.num_spec_tokens_to_schedule)


def load_stream(path: Path) -> list[tuple[str, Any]]:
    """The records of an object stream (``engine_side/bench/objstream.py``)."""
    from engine_side.bench.objstream import read_stream

    return read_stream(path)[1]


# ---------------------------------------------------------------- synthetic streams
def _rid(k: int) -> str:
    return f"chatcmpl-{k:016x}-{k * 7919 % 65536:08x}"[:34]


def synthetic_decode(running: int, steps: int, prompt: int = 500) -> list[tuple[str, Any]]:
    """Steady decode of ``running`` requests (34-byte ids, 1 token each, a block per 32
    steps), all of them joining in the first step."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    ids = [_rid(i) for i in range(running)]
    sp = SamplingParams(temperature=0, max_tokens=steps + 1)
    blocks = {rid: list(range(k * 64, k * 64 + prompt // 32 + 1)) for k, rid in enumerate(ids)}
    first = SchedulerOutput(
        [NewRequestData(rid, list(range(prompt)), [], sp, None, (blocks[rid],), 0, None)
         for rid in ids], CachedRequestData.make_empty(), dict.fromkeys(ids, prompt),
        prompt * running, {}, {}, set(), [], preempted_req_ids=set())
    out: list[tuple[str, Any]] = [("execute_model", first)]
    for t in range(1, steps):
        grow = [(k + t) % 32 == 0 for k in range(running)]
        cached = CachedRequestData(
            list(ids), set(), [], {},
            [([k * 64 + 40 + t],) if g else None for k, g in enumerate(grow)],
            [prompt + t - 1] * running, [t] * running)
        out.append(("execute_model", SchedulerOutput(
            [], cached, dict.fromkeys(ids, 1), running, {}, {}, set(), [],
            preempted_req_ids=set())))
        out.append(("reply", ModelRunnerOutput(list(ids), {r: i for i, r in enumerate(ids)},
                                               [[(t * 31 + k) % 500] for k in range(running)])))
    return out


def synthetic_churn(running: int, steps: int, prompt: int = 500) -> list[tuple[str, Any]]:
    """Continuous batching at ``running`` requests: every step after the first the oldest
    request finishes and a new one (``prompt`` tokens, prefilled in one chunk) joins at
    the end of the batch; the others decode one token each."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    sp = SamplingParams(temperature=0, max_tokens=steps + 1)

    def new(k: int) -> Any:
        table = list(range(k * 64, k * 64 + prompt // 32 + 1))
        return NewRequestData(_rid(k), list(range(prompt)), [], sp, None, (table,), 0, None)

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


# ---------------------------------------------------------------- measuring
def joins_or_leaves(so: Any) -> bool:
    """A request joins, leaves (finished or preempted) or resumes in this step."""
    c = so.scheduled_cached_reqs
    return bool(so.scheduled_new_reqs or so.finished_req_ids or so.preempted_req_ids
                or c.resumed_req_ids)


class _Step:
    """One step's figures: per path (request, reply) [ours B, vLLM B, ours s, vLLM s, bare s,
    floor s, minimal s, minimal B, digested s]."""

    __slots__ = ("running", "churn", "figures")

    def __init__(self, so: Any) -> None:
        self.running = len(so.num_scheduled_tokens)
        self.churn = joins_or_leaves(so)
        self.figures = {"request": [0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0],
                        "reply": [0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0]}


def _route(enc: Any, dec: Any) -> dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]]:
    return {"execute_model": (enc.encode, dec.decode),
            "sample_tokens": (enc.encode_grammar, dec.decode_grammar),
            "reply": (dec.encode_reply, enc.decode_reply),
            "sample_reply": (dec.encode_reply, enc.decode_reply)}


def round_trip(enc: Any, dec: Any, kind: str, obj: Any) -> Any:
    """``obj`` (a record of ``kind``) through our encoder and decoder, as a peer gets it."""
    encode, decode = _route(enc, dec)[kind]
    return decode([bytes(f) for f in encode(obj)])


def _ours(route: tuple[Callable[[Any], Any], Callable[[Any], Any]], obj: Any,
          ) -> tuple[int, float, list[Any]]:
    encode, decode = route
    t0 = time.perf_counter()
    sent = encode(obj)  # the frames as a transport takes them (neither side is timed
    decode(sent)  # copying: pickle's buffers are not copied either)
    took = time.perf_counter() - t0
    return sum(len(memoryview(f)) for f in sent), took, sent


def _one_pass(messages: list[tuple[str, Any]], rotate: int,
              fields: Callable[[str, list[Any]], None] | None) -> tuple[list[_Step], bool]:
    """One replay: per step, each path's figures (the order of the six rotates per
    message, starting at ``rotate``), and whether the minimal channel carried every step (from
    the first it does not carry on, its figures are 0); ``fields`` sees our frames of
    request messages."""
    from engine_side.bench.minimal_stateful import MinimalDecoder, MinimalEncoder, Unsupported
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    gc.collect()
    gc.freeze()
    route = _route(SchedulerOutputEncoder(), SchedulerOutputDecoder())
    minimal: dict[str, tuple[MinimalEncoder, MinimalDecoder]] | None = {
        "minimal": (MinimalEncoder(), MinimalDecoder()),
        "digested": (MinimalEncoder(digest=True), MinimalDecoder(digest=True))}
    steps: list[_Step] = []
    for i, (kind, obj) in enumerate(messages):
        if kind == "execute_model":
            steps.append(_Step(obj))
        got: dict[str, tuple[int, float]] = {}
        for k in range(len(PATHS)):
            path = PATHS[(i + rotate + k) % len(PATHS)]
            if path == "floor":
                got[path] = (0, python_floor(kind, obj))
            elif path in ("minimal", "digested"):
                try:
                    got[path] = minimal_step(kind, obj, minimal[path]) if minimal else (0, 0.0)
                except Unsupported:
                    minimal, got[path] = None, (0, 0.0)
            elif path == "ours":
                size, took, sent = _ours(route[kind], obj)
                got[path] = (size, took)
                if fields is not None and kind in REQUEST:
                    fields(kind, sent)
            else:
                got[path] = pickled(kind, obj, bare=path == "bare")
        if steps:
            acc = steps[-1].figures["request" if kind in REQUEST else "reply"]
            acc[0] += got["ours"][0]
            acc[1] += got["vllm"][0]
            acc[2] += got["ours"][1]
            acc[3] += got["vllm"][1]
            acc[4] += got["bare"][1]
            acc[5] += got["floor"][1]
            acc[6] += got["minimal"][1]
            acc[7] += got["minimal"][0]
            acc[8] += got["digested"][1]
    gc.unfreeze()
    return steps, minimal is not None


def replay(messages: list[tuple[str, Any]], passes: int = 1,
           fields: Counter[str] | None = None) -> dict[str, Any]:
    """Per-step bytes and µs of the four paths, summarised (:func:`summarise`); each
    step's µs the median of ``passes`` replays (bytes are the same in every pass).
    ``fields``: filled with our request bytes per wire field (first pass)."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")

    def count(kind: str, frames: list[Any]) -> None:
        if fields is not None:
            fields.update(request_fields(kind, frames))

    done = [_one_pass(messages, k % len(PATHS), count if k == 0 and fields is not None else None)
            for k in range(passes)]
    runs = [steps for steps, _ in done]
    steps = runs[0]
    for i, step in enumerate(steps):
        for path, acc in step.figures.items():
            for col in (2, 3, 4, 5, 6, 8):
                acc[col] = statistics.median(run[i].figures[path][col] for run in runs)
    return summarise(steps, minimal=all(carried for _, carried in done)) | {"passes": passes}


def _path(steps: list[_Step], path: str, minimal: bool) -> dict[str, Any]:
    cols: list[Any] = list(zip(*(s.figures[path] for s in steps), strict=True)) or [[0]] * 9
    out: dict[str, Any] = {"steps": len(steps), "bytes": int(sum(cols[0])),
                           "vllm_bytes": int(sum(cols[1]))}
    named = [(2, "us"), (3, "vllm_us"), (4, "bare_us"), (5, "floor_us")]
    if minimal and path == "request":
        named += [(6, "minimal_us"), (8, "digested_us")]
        out["minimal_bytes"] = int(sum(cols[7]))
    for col, name in named:
        out[name] = sum(cols[col]) * 1e6
        out[f"median_{name}"] = statistics.median(cols[col]) * 1e6 if steps else 0.0
    return out


def summarise(steps: list[_Step], minimal: bool = True) -> dict[str, Any]:
    """Sums and medians of each path, over all steps, the join/leave ones and the others
    (the minimal channel's with ``minimal``: it carried every step)."""
    running = [s.running for s in steps]
    return {"steps": len(steps), "max_running": max(running, default=0),
            "median_running": statistics.median(running) if running else 0,
            "request": _path(steps, "request", minimal), "reply": _path(steps, "reply", minimal),
            "join_leave": _path([s for s in steps if s.churn], "request", minimal),
            "same_batch": _path([s for s in steps if not s.churn], "request", minimal)}


def request_fields(kind: str, frames: list[Any]) -> dict[str, int]:
    """Exact bytes of one request-path message per wire field."""
    from engine_side.report.accounting import message_fields

    return message_fields(kind, [bytes(f) for f in frames])
