"""SPEC.md's §5 and §8.3 executed as written.

§5's digest is recomputed from its written definition (constants and ``mix64``
parsed from the text), and §8.3's transition (with §6.2's Snapshot rules) is written
here as a plain-Python model of the text (:class:`TextState`), which replays generated
engine streams and refusals next to :class:`ReplicaState`.  The last test shows that
the digest checker notices an edited copy of the text.
"""

from __future__ import annotations

import copy
import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
from engine_model import EngineModel
from spec_text import (
    MASK64,
    digest_text_problems,
    read_spec,
    text_constants,
    text_mix64,
)

from engine_side.mirror import EngineMirror
from engine_side.request_diff import RequestDiffer
from protocol import digest as dg
from protocol import messages as wire
from protocol.codec import decode, encode
from protocol.errors import InvalidDelta, MalformedMessage
from protocol.messages import (
    MAX_BLOCK_ID,
    MAX_HANDLE,
    TOKEN_MODE_ENGINE,
    TOKEN_MODE_WORKER,
    Delta,
    DeltaBody,
    NewRequest,
    RareBody,
    Rows,
    Snapshot,
    SnapshotBody,
    decode_spec,
)
from protocol.packing import pack_sints, pack_uints, unpack_sint_list, unpack_uint_list
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec
from protocol.snapshot import load_snapshot
from protocol.state import ReplicaState


@pytest.fixture(scope="module")
def spec() -> str:
    return read_spec()


# -- §5: constants and the definition, recomputed from the text ----------------------------
def test_digest_text_matches_code(spec: str) -> None:
    assert digest_text_problems(spec) == []
    mix = text_mix64(spec)
    for x in (0, 1, 2**63 + 12345, 2**64 - 1):
        assert mix(x) == dg.mix64_int(x)


# -- §8.3 as written, and §5 over it --------------------------------------------------------
@dataclass
class Entry:
    spec: bytes  # the spec bytes of §5
    computed: int
    blocks: list[list[int]]
    tokens: list[int] = field(default_factory=list)


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise InvalidDelta(what)


def _distinct(values: list[int]) -> bool:
    return len(set(values)) == len(values)


def _read_rows(rows: Rows, n: int) -> list[tuple[int, list[int]]]:
    """§6.2: `ba`, `br`, `ot` (and `sp`, `ei`): (position, values) per row."""
    keys = unpack_uint_list(rows.keys) if rows.keys else list(range(n))
    counts = unpack_uint_list(rows.counts) if rows.counts else [1] * len(keys)
    values = unpack_uint_list(rows.values) if rows.values else []
    _require(len(counts) == len(keys) and sum(counts) == len(values), "rows do not add up")
    _require(_distinct(keys) and all(k < n for k in keys), "row keys")
    out, at = [], 0
    for k, c in zip(keys, counts, strict=True):
        out.append((k, values[at:at + c]))
        at += c
    return out


def _read_exceptions(rows: Rows, n: int, signed: bool = False) -> list[tuple[int, int]]:
    """§6.2: `nt`, `nc`, `tr`: (position, value); `h` absent = no rows, `n` ignored."""
    keys = unpack_uint_list(rows.keys) if rows.keys else []
    values = (unpack_sint_list if signed else unpack_uint_list)(rows.values) \
        if rows.values else []
    _require(len(keys) == len(values) and _distinct(keys) and all(k < n for k in keys),
             "exception rows")
    return list(zip(keys, values, strict=True))


class TextState:
    """§4.1's state, changed only by §8.3's steps exactly as SPEC.md writes them."""

    def __init__(self, token_mode: int = TOKEN_MODE_WORKER, groups: int = 1) -> None:
        self.engine, self.groups = token_mode == TOKEN_MODE_ENGINE, groups
        self.entries: dict[int, Entry] = {}
        self.schedule: list[int] = []
        self.counts: list[int] = []

    def apply(self, body: DeltaBody) -> TextState:
        """The state after ``body``; raises (InvalidDelta, MalformedMessage) instead."""
        new = copy.deepcopy(self)
        new._steps(body)
        return new

    def _steps(self, body: DeltaBody) -> None:
        rare, entries = body.rare, self.entries
        prev, prev_counts = list(self.schedule), list(self.counts)
        # 1. finishes
        fin = unpack_uint_list(body.finished) if body.finished else []
        _require(_distinct(fin) and all(h in entries for h in fin), "finishes")
        for h in fin:
            del entries[h]
        # 2. adds
        added = [a.handle for a in body.added]
        _require(_distinct(added), "added handles")
        for a in body.added:
            _require(0 <= a.handle <= MAX_HANDLE and a.computed >= 0, "add")
            try:
                spec = decode_spec(a.spec)
            except (msgspec.DecodeError, ValueError, TypeError) as exc:
                raise MalformedMessage("spec") from exc
            if not spec.prompt_none:
                unpack_uint_list(spec.prompt)  # present: MalformedMessage when absent
            _require(not a.mm_data or len(a.mm_data) == len(spec.mm), "mm data")
            _require(self.engine or not a.output, "tokens in worker-token mode")
            tokens = unpack_uint_list(a.output) if self.engine and a.output else []
            entries[a.handle] = Entry(bytes(a.spec), a.computed,
                                      [[] for _ in range(self.groups)], tokens)
        reset = set(fin) | set(added)
        # 3. the schedule
        if rare.schedule_full:
            _require(not body.schedule_drop and not body.schedule_append, "sf with sd/sa")
            new = unpack_uint_list(rare.schedule_full)
            _require(_distinct(new) and all(h <= MAX_HANDLE and h in entries for h in new),
                     "sf")
        else:
            drop = unpack_uint_list(body.schedule_drop) if body.schedule_drop else []
            _require(_distinct(drop) and all(q < len(prev) for q in drop), "sd")
            kept = [h for q, h in enumerate(prev) if q not in drop]
            _require(all(h in entries for h in kept), "a finished handle kept")
            tail = unpack_uint_list(body.schedule_append) if body.schedule_append else []
            _require(_distinct(tail) and all(h in entries and h not in kept for h in tail),
                     "sa")
            new = kept + tail
        where = {h: q for q, h in enumerate(prev)}
        predicted = [prev_counts[where[h]] if h in where and h not in reset else 1
                     for h in new]
        n = len(new)
        # 4. tokens
        if rare.truncate is not None or body.tokens is not None:
            _require(self.engine, "tokens in worker-token mode")
        if rare.truncate is not None:
            for p, v in _read_exceptions(rare.truncate, n):
                history = entries[new[p]].tokens
                _require(v <= len(history) and v <= MAX_BLOCK_ID, "truncation")
                del history[v:]
        if body.tokens is not None:
            for p, values in _read_rows(body.tokens, n):
                entries[new[p]].tokens += values
        # 5. blocks
        for per_group in (rare.block_replace, body.block_append):
            _require(len(per_group) in (0, self.groups), "block rows per group")
        for g in range(self.groups):
            for per_group, replace in ((rare.block_replace, True), (body.block_append, False)):
                if not per_group:
                    continue
                for p, ids in _read_rows(per_group[g], n):
                    _require(all(b <= MAX_BLOCK_ID for b in ids), "block id")
                    table = entries[new[p]].blocks[g]
                    if replace:
                        table[:] = ids
                    else:
                        table += ids
        # 6a. the computed advance
        for q, h in enumerate(prev):
            if h not in reset:
                entries[h].computed += prev_counts[q]
        # 6b. computed-count exceptions
        if body.computed_tokens is not None:
            for p, d in _read_exceptions(body.computed_tokens, n, signed=True):
                entries[new[p]].computed += d
                _require(entries[new[p]].computed >= 0, "negative computed count")
        # 7. scheduled counts
        counts = predicted
        if body.scheduled_tokens is not None:
            for p, v in _read_exceptions(body.scheduled_tokens, n):
                _require(v <= MAX_BLOCK_ID, "scheduled count")
                counts[p] = v
        self.schedule, self.counts = new, counts

    @staticmethod
    def load(body: SnapshotBody) -> TextState:
        """§6.2's Snapshot, as written."""
        _require(body.token_mode in (0, 1) and 1 <= body.kv_groups <= 64, "parameters")
        _require(len(body.blocks) in (0, body.kv_groups), "blocks per group")
        handles = [r.handle for r in body.requests]
        _require(handles == sorted(set(handles)), "ascending handles")
        state = TextState(body.token_mode, body.kv_groups)
        state = state.apply(DeltaBody(added=body.requests))  # §8.3 step 2's checks
        for g, rows in enumerate(body.blocks):
            keys = unpack_uint_list(rows.keys) if rows.keys else []
            counts = unpack_uint_list(rows.counts) if rows.counts else [1] * len(keys)
            values = unpack_uint_list(rows.values) if rows.values else []
            _require(_distinct(keys) and all(k in state.entries for k in keys), "block keys")
            _require(len(counts) == len(keys) and sum(counts) == len(values), "block rows")
            _require(all(b <= MAX_BLOCK_ID for b in values), "block id")
            at = 0
            for k, c in zip(keys, counts, strict=True):
                state.entries[k].blocks[g] = values[at:at + c]
                at += c
        sched = unpack_uint_list(body.schedule) if body.schedule else []
        nsched = unpack_uint_list(body.scheduled_tokens) if body.scheduled_tokens else []
        _require(len(sched) == len(nsched) and _distinct(sched)
                 and all(h in state.entries for h in sched), "schedule")
        _require(all(v <= MAX_BLOCK_ID for v in nsched), "scheduled count")
        state.schedule, state.counts = sched, nsched
        return state

    def digest(self, text: str) -> int:
        """§5, with the constants and mix64 of ``text``."""
        k, mix64 = text_constants(text), text_mix64(text)
        total = 0
        for h, e in self.entries.items():
            b = int.from_bytes(hashlib.blake2b(e.spec, digest_size=8).digest(), "little")
            total += mix64(b ^ (h * k["K_SPEC"]))
            total += e.computed * (mix64(h * k["K_COMP"] + k["K_HANDLE"]) | 1)
            for g, table in enumerate(e.blocks):
                for i, block in enumerate(table):
                    total += mix64(block * k["K_SPEC"] + i * k["K_POS"] + h * k["K_HANDLE"]
                                   + g * k["K_GROUP"] + k["K_ROW"])
            for i, token in enumerate(e.tokens):
                total += mix64(token * k["K_TOKEN"] + i * k["K_POS"] + h * k["K_SPEC"]
                               + k["K_ROW"])
        for i, (h, c) in enumerate(zip(self.schedule, self.counts, strict=True)):
            total += (c + 1) * (mix64(h * k["K_SCHED"] + i * k["K_POS"]) | 1)
        return total & MASK64


def state_differences(text: TextState, state: ReplicaState) -> list[str]:
    """Where the text's model and the code's state differ (a state keeping tables)."""
    out = []
    live = state.live_handles().tolist()
    if sorted(text.entries) != live:
        return [f"live handles: text {sorted(text.entries)}, code {live}"]
    if text.schedule != state.schedule.tolist() or text.counts != state.nsched.tolist():
        out.append("schedule or counts")
    assert state.tables is not None
    for h, e in text.entries.items():
        request = state.requests[h]
        assert request is not None
        if e.spec != bytes(request.spec):
            out.append(f"spec bytes of {h}")
        if e.computed != int(state.cols.computed[h]):
            out.append(f"computed of {h}")
        if [t.row(h).tolist() for t in state.tables] != e.blocks:
            out.append(f"blocks of {h}")
        if e.tokens != state.token_history(h).tolist():
            out.append(f"tokens of {h}")
    return out


def _stream(token_mode: int, groups: int, seed: int, steps: int) -> list[list[Any]]:
    """Frames of the Deltas (and of a Snapshot every few steps) of a generated workload."""
    model = EngineModel(token_mode, groups)
    mirror = EngineMirror(epoch=3, token_mode=token_mode, kv_groups=groups)
    differ = RequestDiffer(mirror)
    rng = random.Random(seed)
    out: list[list[Any]] = []
    for i in range(steps):
        model.churn(rng.getrandbits(32))
        out.append(encode(differ.diff(model.step(rng.getrandbits(32)))))
        if i % 7 == 6:
            out.append(encode(mirror.snapshot()))
    return out


@pytest.mark.parametrize(("token_mode", "groups", "seed"), [
    (TOKEN_MODE_WORKER, 1, 1), (TOKEN_MODE_ENGINE, 1, 2), (TOKEN_MODE_ENGINE, 2, 3),
    (TOKEN_MODE_WORKER, 2, 4)])
def test_text_model_replays_generated_streams(spec: str, token_mode: int, groups: int,
                                              seed: int) -> None:
    """§8.3 and the Snapshot rules of §6.2, executed as written, give the code's state,
    and §5 computed from the text gives every stamped digest."""
    text, state = TextState(token_mode, groups), ReplicaState(token_mode, groups)
    features: set[str] = set()
    for frames in _stream(token_mode, groups, seed, 40):
        msg = decode(frames)
        if isinstance(msg, Snapshot):
            loaded = TextState.load(msg.body)
            assert loaded.digest(spec) == msg.digest
            assert state_differences(loaded, load_snapshot(msg)) == []
            continue
        assert isinstance(msg, Delta)
        text = text.apply(msg.body)
        state.apply(msg.body, expected_digest=msg.digest)
        assert text.digest(spec) == msg.digest == state.digest
        assert state_differences(text, state) == []
        b, r = msg.body, msg.body.rare
        features |= {name for name, on in (
            ("finishes", b.finished), ("adds", b.added), ("drops", b.schedule_drop),
            ("appends", b.schedule_append), ("full schedules", r.schedule_full),
            ("count exceptions", b.scheduled_tokens), ("computed exceptions",
                                                       b.computed_tokens),
            ("replacements", r.block_replace), ("truncations", r.truncate)) if on}
    assert {"finishes", "adds", "appends", "full schedules", "count exceptions",
            "computed exceptions"} <= features
    assert "truncations" in features or token_mode == TOKEN_MODE_WORKER


def _refusal_base(token_mode: int) -> tuple[ReplicaState, TextState, Delta]:
    """Two requests scheduled, two KV groups, histories of 3 tokens (engine mode)."""
    mirror = EngineMirror(epoch=1, token_mode=token_mode, kv_groups=2)
    engine = token_mode == TOKEN_MODE_ENGINE
    request = ExecuteModelRequest(
        ["a", "b"], [RequestSpec("a", np.arange(4)), RequestSpec("b", np.arange(5))],
        np.array([2, 3]), np.array([1, 0]),
        (Ragged.from_lists([[4], [5]]), Ragged.from_lists([[6], []])),
        Ragged.empty(2), Ragged.empty(2),
        output_token_ids=[np.array([7, 8, 9]), np.array([1, 2, 3])] if engine else None)
    delta = RequestDiffer(mirror).diff(request)
    state = ReplicaState(token_mode, 2)
    state.apply(delta.body, expected_digest=delta.digest)
    return state, TextState(token_mode, 2).apply(delta.body), delta


def _raw_spec(req_id: str, prompt: bytes = b"\x00\x00") -> msgspec.Raw:
    return wire.encode_spec(wire.Spec(req_id=req_id, prompt=prompt))


P = pack_uints
REFUSALS: list[tuple[str, int, DeltaBody, type[Exception]]] = [
    ("finish a handle that is not live", 0, DeltaBody(finished=P([7])), InvalidDelta),
    ("finish a scheduled handle and keep it", 0, DeltaBody(finished=P([0])), InvalidDelta),
    ("finish a handle twice", 0, DeltaBody(finished=P([1, 1]), schedule_drop=P([1])),
     InvalidDelta),
    ("add a handle above 2^24", 0,
     DeltaBody(added=(NewRequest(MAX_HANDLE + 1, _raw_spec("c")),)), InvalidDelta),
    ("add a negative computed count", 0,
     DeltaBody(added=(NewRequest(5, _raw_spec("c"), computed=-1),)), InvalidDelta),
    ("add one handle twice", 0,
     DeltaBody(added=(NewRequest(5, _raw_spec("c")), NewRequest(5, _raw_spec("d")))),
     InvalidDelta),
    ("add a spec that does not decode", 0,
     DeltaBody(added=(NewRequest(5, msgspec.Raw(b"\x93\x01\x02\x03")),)), MalformedMessage),
    ("add a spec without prompt ids and without pn", 0,
     DeltaBody(added=(NewRequest(5, _raw_spec("c", prompt=b"")),)), MalformedMessage),
    ("add item data that do not match the spec's items", 0,
     DeltaBody(added=(NewRequest(5, _raw_spec("c"), mm_data=(None,)),)), InvalidDelta),
    ("add tokens in worker-token mode", 0,
     DeltaBody(added=(NewRequest(5, _raw_spec("c"), output=P([1])),)), InvalidDelta),
    ("sf with sd", 0, DeltaBody(schedule_drop=P([0]), rare=RareBody(schedule_full=P([1]))),
     InvalidDelta),
    ("sf naming a handle that is not live", 0, DeltaBody(rare=RareBody(
        schedule_full=P([0, 1, 9]))), InvalidDelta),
    ("sd out of range", 0, DeltaBody(schedule_drop=P([2])), InvalidDelta),
    ("sa of a kept handle", 0, DeltaBody(schedule_append=P([1])), InvalidDelta),
    ("nt without keys", 0, DeltaBody(scheduled_tokens=Rows(values=P([1, 1]))), InvalidDelta),
    ("nt key out of range", 0, DeltaBody(scheduled_tokens=Rows(keys=P([2]), values=P([1]))),
     InvalidDelta),
    ("nt count above 2^31 - 1", 0, DeltaBody(scheduled_tokens=Rows(
        keys=P([0]), values=P([MAX_BLOCK_ID + 1]))), InvalidDelta),
    ("nc making a count negative", 0, DeltaBody(computed_tokens=Rows(
        keys=P([1]), values=pack_sints([-4]))), InvalidDelta),
    ("ba for one group of two", 0, DeltaBody(block_append=(Rows(keys=P([0]), values=P([1])),)),
     InvalidDelta),
    ("ba rows that do not add up", 0, DeltaBody(block_append=(
        Rows(keys=P([0]), counts=P([2]), values=P([1])), Rows(keys=P([])))), InvalidDelta),
    ("ba without keys: every position, too few ids", 0, DeltaBody(block_append=(
        Rows(values=P([1])), Rows(keys=P([])))), InvalidDelta),
    ("br block id above 2^31 - 1", 0, DeltaBody(rare=RareBody(block_replace=(
        Rows(keys=P([0]), values=P([MAX_BLOCK_ID + 1])), Rows(keys=P([]))))), InvalidDelta),
    ("tokens in worker-token mode", 0, DeltaBody(tokens=Rows()), InvalidDelta),
    ("a truncation beyond the history", 1, DeltaBody(rare=RareBody(truncate=Rows(
        keys=P([0]), values=P([4])))), InvalidDelta),
    ("token rows keyed twice", 1, DeltaBody(tokens=Rows(keys=P([1, 1]), values=P([5, 6]))),
     InvalidDelta),
    ("a packed array 65 bits wide", 0, DeltaBody(finished=b"\x41\x01" + bytes(9)),
     MalformedMessage),
]


@pytest.mark.parametrize(("what", "mode", "body", "error"), REFUSALS,
                         ids=[r[0] for r in REFUSALS])
def test_text_model_and_code_refuse_alike(spec: str, what: str, mode: int, body: DeltaBody,
                                          error: type[Exception]) -> None:
    """§8.3's refusals: the model of the text and the code raise the class the text
    names, and the code's state is unchanged."""
    state, text, _ = _refusal_base(mode)
    before = (state.digest, state.schedule.tolist(), state.nsched.tolist(),
              state.cols.computed.tolist(), state.live_handles().tolist())
    with pytest.raises(error):
        text.apply(body)
    with pytest.raises(error):
        state.apply(body)
    assert (state.digest, state.schedule.tolist(), state.nsched.tolist(),
            state.cols.computed.tolist(), state.live_handles().tolist()) == before
    assert state.digest == state.recompute_digest() == text.digest(spec)


def test_a_digest_mismatch_is_refused_unchanged() -> None:
    state, _, _ = _refusal_base(TOKEN_MODE_WORKER)
    before = state.digest
    with pytest.raises(InvalidDelta):
        state.apply(DeltaBody(), expected_digest=before ^ 1)
    assert state.digest == before


# -- the checkers notice an edited text ------------------------------------------------------
def test_digest_checker_notices_an_edit(spec: str) -> None:
    """An edited constant or formula is found; the text's digest then differs too."""
    k_pos = f"`K_POS = {dg.K_POS:#018X}`".replace("0X", "0x")
    edited = spec.replace(k_pos, k_pos.replace("F9`", "F8`"))
    assert edited != spec and digest_text_problems(edited) != []
    state, text, delta = _refusal_base(TOKEN_MODE_WORKER)
    assert text.digest(spec) == delta.digest != text.digest(edited)
    formula = spec.replace("h * K_SPEC + K_ROW)", "h * K_SPEC)")
    assert formula != spec and digest_text_problems(formula) != []
