"""What preparing a delta yields: the plan's parts and the step-only fields.

Shared by :mod:`protocol.plan` (which builds them) and :mod:`protocol.state`
(which commits them); also the cached per-schedule constants of the steady step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import msgspec
import numpy as np
import numpy.typing as npt

from protocol import digest as dg
from protocol.errors import InvalidDelta
from protocol.messages import DeltaBody
from protocol.request import IntArray, Ragged, RequestSpec

if TYPE_CHECKING:
    from protocol.state import ReplicaState


_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class StepInfo:
    """Step-only content of the last applied delta (not part of the replicated state)."""

    finished_ids: frozenset[str] = frozenset()
    preempted: IntArray = field(default_factory=lambda: _EMPTY)
    resumed: IntArray = field(default_factory=lambda: _EMPTY)
    spec_tokens: Ragged = field(default_factory=lambda: Ragged.empty(0))
    encoder_inputs: Ragged = field(default_factory=lambda: Ragged.empty(0))
    free_encoder_mm_hashes: tuple[str, ...] = ()
    blocks_to_zero: IntArray | None = None
    has_structured_output: bool = False
    pending_structured_output: bool = False
    num_spec_tokens_to_schedule: int = 0
    extension: dict[str, bytes] = field(default_factory=dict)


@dataclass
class Added:
    handle: int
    spec: RequestSpec
    spec_hash: int
    computed: int
    tokens: IntArray | None


@dataclass
class TokenRows:
    """Token appends of a delta, decoded: rows ``handles`` get ``values[offsets[i]:
    offsets[i+1]]``; ``sums`` are each row's digest terms."""

    handles: IntArray
    counts: IntArray
    values: IntArray
    offsets: IntArray
    sums: npt.NDArray[np.uint64]


@dataclass
class BlockEdit:
    """One KV group's block changes: whole-row replacements, then appends at ``starts``;
    ``sum_handles``/``sums`` are the digest sums the touched rows end with."""

    rep_handles: IntArray
    rep_counts: IntArray
    rep_values: IntArray
    app_handles: IntArray
    app_starts: IntArray
    app_counts: IntArray
    app_values: IntArray
    sum_handles: IntArray
    sums: npt.NDArray[np.uint64]


def _row_sums(g: int, hs: IntArray, starts: IntArray, counts: IntArray,
              values: IntArray) -> npt.NDArray[np.uint64]:
    """Per-row sums of the block digest terms of ``values`` placed at ``starts``."""
    if not hs.size:
        return np.zeros(0, dtype=np.uint64)
    offsets = np.zeros(hs.size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    row = np.repeat(np.arange(hs.size), counts)
    pos = starts[row] + (np.arange(values.size) - offsets[row])
    cum = np.zeros(values.size + 1, dtype=np.uint64)
    np.cumsum(dg.block_terms_rows(hs[row], g, pos, values), out=cum[1:])
    return cum[offsets[1:]] - cum[offsets[:-1]]


@dataclass
class Plan:
    """Everything a delta changes, decoded and checked; ``digest`` is the result."""

    finished: IntArray
    added: list[Added]
    schedule: IntArray
    nsched: IntArray
    truncate: dict[int, int]
    token_rows: TokenRows | None
    blocks: list[BlockEdit]
    computed_handles: IntArray
    computed_values: IntArray
    step: StepInfo
    digest: int = 0


def encode_spec_for_hash(spec: RequestSpec) -> bytes:
    """Canonical bytes of a request's static data (the input of its digest term)."""
    prompt = b"" if spec.prompt_token_ids is None else spec.prompt_token_ids.tobytes()
    embeds = b""
    if spec.prompt_embeds is not None:
        from protocol.tensors import tensor_bytes

        embeds = tensor_bytes(spec.prompt_embeds)
    meta = (spec.req_id, spec.sampling, spec.pooling, spec.lora,
            [(f.modality, f.identifier, f.offset, f.length, f.mm_hash) for f in spec.mm_features],
            spec.prompt_is_token_ids, spec.prompt_token_ids is None)
    return msgspec.msgpack.encode(meta) + prompt + embeds


STEADY_BODY = DeltaBody()  # the empty delta: a steady decode step
#: the bodies of steps that set nothing but the structured-output flags, by (structured,
#: pending): the steady body and three more (frozen, shared)
FLAG_BODIES = {(False, False): STEADY_BODY,
               **{(s, p): DeltaBody(has_structured_output=s, pending_structured_output=p)
                  for s in (False, True) for p in (False, True) if s or p}}
_NO_EDIT = BlockEdit(_EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY,
                     np.zeros(0, dtype=np.uint64))  # a KV group the delta leaves untouched


def _read_only(r: Ragged) -> Ragged:
    """Freeze a Ragged's arrays: rebuilt requests share them instead of copying."""
    r.lengths.flags.writeable = r.values.flags.writeable = False
    return r


def _empty_rows(state: ReplicaState, n: int) -> Ragged:
    """A shared, read-only all-empty Ragged of ``n`` rows (handed out by rebuild as is)."""
    key = ("empty_rows", n)
    cached = state._rebuild_cache.get(key)  # type: ignore[call-overload]
    if cached is None:
        cached = _read_only(Ragged.empty(n))
        state._rebuild_cache[key] = cached  # type: ignore[index]
    return cast(Ragged, cached)


def advance_delta(state: ReplicaState) -> int:
    """Digest change of advancing every scheduled request by its scheduled count (cached)."""
    key = state._rebuild_cache.get("advance")
    if key is None or key[0] is not state.schedule or key[1] is not state.nsched:  # type: ignore[index]
        delta = dg.computed_change(state.schedule.tolist(), state.nsched.tolist())
        key = (state.schedule, state.nsched, delta)
        state._rebuild_cache["advance"] = key
    return key[2]  # type: ignore[index,no-any-return]


def steady_step(state: ReplicaState) -> StepInfo:
    """The (shared, cached) step-only fields of an empty delta: all empty."""
    step: Any = state._rebuild_cache.get("steady_step")
    if step is None or step.spec_tokens.lengths.size != state.schedule.size:
        empty = _empty_rows(state, state.schedule.size)
        step = StepInfo(spec_tokens=empty, encoder_inputs=empty)
        state._rebuild_cache["steady_step"] = step
    return cast(StepInfo, step)


class PlannerPart:
    """What a part of :class:`protocol.plan._Planner` (a mixin: :mod:`protocol.plan_blocks`,
    :mod:`protocol.plan_counts`) uses of the planner: its state, body, liveness, reset
    handles, running digest and typed failure."""

    state: ReplicaState
    body: DeltaBody
    live: npt.NDArray[np.bool_]
    reset: set[int]
    digest: int

    def fail(self, message: str, **fields: object) -> InvalidDelta:
        raise NotImplementedError
