"""Workloads a report replays: built-in synthetic generators and ``deltacast record`` files.

Built-ins extend :class:`engine_side.workloads.Workload` where a behaviour is
report-specific (preemption storms, multimodal items, chat-like length spreads).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine_side.workloads import SCENARIOS, Scenario, Workload
from protocol import codec
from protocol.errors import IncompatibleVersion, ProtocolError
from protocol.messages import TOKEN_MODE_WORKER, Delta, NewRequest
from protocol.params import MMFeatureRef
from protocol.rebuild import rebuild_request
from protocol.recording import NotARecording, RecordReader
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec
from protocol.state import ReplicaState


class ChatWorkload(Workload):
    """Prompt and history lengths drawn log-normally (median ~400 prompt tokens)."""

    def _new_request(self, slot: int, phase: int | None) -> None:
        plen = int(np.clip(self.rng.lognormal(np.log(400), 0.9), 16, 6000))
        hist = int(np.clip(self.rng.lognormal(np.log(60), 1.0), 1, 400))
        self.prompt_range, self.history_range = (plen, plen + 1), (hist, hist + 1)
        super()._new_request(slot, phase)


class PreemptionStorm(Workload):
    """Every few steps a slice of the running requests is preempted (blocks freed,
    recompute from scratch) and resumed a few steps later with a new block table."""

    def __init__(self, *args: object, every: int = 4, fraction: float = 0.1, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.every, self.fraction = every, fraction
        self.parked: list[tuple[int, int]] = []  # (resume at step, slot)

    def step(self) -> ExecuteModelRequest:
        resumed = self._resume()
        victims = self._preempt() if self.steps and self.steps % self.every == 0 else []
        req = super().step()
        req.preempted_req_ids = frozenset(self.ids[s] for s in victims)
        req.resumed_req_ids = frozenset(self.ids[s] for s in resumed if self.live[s])
        return req

    def _preempt(self) -> list[int]:
        decoding = [s for s in self.order if self.computed[s] >= self.prefill_target[s]]
        count = int(len(decoding) * self.fraction)
        victims = self.rng.choice(decoding, count, replace=False).tolist() if count else []
        for slot in victims:
            self.order.remove(slot)
            self.free_blocks.extend(self.blocks[slot, : self.nblocks[slot]].tolist())
            self.nblocks[slot] = 0
            self._table = None
            spec = self.specs[slot]
            assert spec is not None and spec.prompt_token_ids is not None
            self.prefill_target[slot] = spec.prompt_token_ids.size + self.out_len[slot]
            self.computed[slot] = 0
            self.parked.append((self.steps + 3, slot))
        return victims

    def _resume(self) -> list[int]:
        due = [slot for at, slot in self.parked if at <= self.steps]
        self.parked = [(at, slot) for at, slot in self.parked if at > self.steps]
        self.order.extend(due)
        return due


class MultimodalWorkload(Workload):
    """Each request carries one image (3×112×112 float32 pixel values, nested like
    multimodal kwargs) encoded on its first step; its hash is freed when it finishes."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.pending_encode: set[str] = set()
        self.freed: list[str] = []

    def _new_request(self, slot: int, phase: int | None) -> None:
        super()._new_request(slot, phase)
        spec = self.specs[slot]
        assert spec is not None
        pixels = self.rng.standard_normal((3, 112, 112), dtype=np.float32)
        ident = hashlib.sha256(pixels.tobytes()).hexdigest()
        item = MMFeatureRef("image", ident, offset=4, length=64,
                            data={"pixel_values": pixels, "image_grid_thw": [[1, 8, 8]]})
        self.specs[slot] = RequestSpec(spec.req_id, spec.prompt_token_ids, spec.sampling,
                                       mm_features=(item,))
        self.pending_encode.add(spec.req_id)

    def step(self) -> ExecuteModelRequest:
        freed, self.freed = self.freed, []
        finishing = set(self.finished)
        hashes = {s.req_id: s.mm_features[0].identifier for s in self.specs if s is not None}
        req = super().step()
        self.freed = [hashes[i] for i in self.finished if i in hashes]
        rows = [[0] if i in self.pending_encode else [] for i in req.req_ids]
        self.pending_encode -= set(req.req_ids)
        req.encoder_inputs = Ragged.from_lists(rows)
        req.free_encoder_mm_hashes = tuple(freed) if finishing or freed else ()
        return req


@dataclass(frozen=True)
class Builtin:
    description: str
    scenario: Scenario
    batch: int
    cls: type[Workload] = Workload
    prompt_tokens: tuple[int, int] = (192, 512)
    history_tokens: tuple[int, int] = (16, 128)


BUILTIN: dict[str, Builtin] = {
    "decode_heavy": Builtin("steady decode, worker-owned tokens, blocks growing",
                            Scenario("decode_heavy", "decode with new blocks"), 256),
    "long_prefill": Builtin("4k–8k-token prompts prefilled in 512-token chunks",
                            Scenario("long_prefill", "chunked prefill", prefill_chunk=512,
                                     finish_rate=0.05), 16, prompt_tokens=(4000, 8000)),
    "preemption_storm": Builtin("10% of running requests preempted every 4 steps",
                                Scenario("preemption_storm", "preemption"), 128,
                                PreemptionStorm),
    "spec_decode": Builtin("3 draft tokens per request, random acceptance",
                           SCENARIOS["spec_decode"], 128),
    "multimodal": Builtin("one image per request, encoder inputs, freed hashes",
                          Scenario("multimodal", "images", finish_rate=0.05), 32,
                          MultimodalWorkload),
    "mixed_chat": Builtin("arrivals/finishes, log-normal lengths, chunked prefill, system prompt",
                          SCENARIOS["mixed_chat"], 128, ChatWorkload, prompt_tokens=(16, 6001),
                          history_tokens=(1, 401)),
}


@dataclass
class Source:
    name: str
    requests: Iterator[ExecuteModelRequest]
    steps: int
    batch: int
    token_mode: int
    kv_groups: int = 1


def load_workload(name: str, *, steps: int, batch: int | None, seed: int,
                  quick: bool = False) -> Source:
    """A built-in workload by name, or a recording by path (ValueError if neither)."""
    if name in BUILTIN:
        spec = BUILTIN[name]
        size = batch or (min(spec.batch, 16) if quick else spec.batch)
        work = spec.cls(spec.scenario, size, seed=seed, prompt_tokens=spec.prompt_tokens,
                        history_tokens=spec.history_tokens)
        return Source(name, iter(work.step, None), steps, size, work.token_mode)
    path = Path(name)
    if path.exists():
        return _recording(path, steps)
    raise ValueError(f"unknown workload {name!r}; built-ins: {', '.join(BUILTIN)}")


def _recording(path: Path, steps: int) -> Source:
    """The engine's full requests of a ``deltacast record`` file, rebuilt from its Deltas.

    Raises ValueError for a file that is not a recording (it is never unpickled), is
    truncated or corrupt (also while its requests are read), or that another protocol
    major made (its digests differ).
    """
    try:
        reader = RecordReader(path)
        deltas = [frames for kind, frames in reader if kind == "execute_model"]
    except (NotARecording, IncompatibleVersion) as exc:
        raise ValueError(str(exc)) from exc
    if not deltas:
        raise ValueError(f"{path}: the recording holds no execute_model steps")
    state = ReplicaState(TOKEN_MODE_WORKER, reader.header.kv_groups)
    requests = _rebuilt(state, deltas, path)
    first = next(requests)
    batch = len(first.req_ids)
    return Source(path.stem, itertools.chain([first], requests), min(steps, len(deltas)),
                  batch, TOKEN_MODE_WORKER, reader.header.kv_groups)


def _rebuilt(state: ReplicaState, records: list[list[memoryview]],
             path: Path) -> Iterator[ExecuteModelRequest]:
    specs: dict[int, tuple[NewRequest, RequestSpec]] = {}  # rebuild_request's cache
    for i, frames in enumerate(records):
        try:
            msg = codec.decode(frames, copy=True)
        except ProtocolError as exc:
            raise ValueError(f"{path}: record {i} is corrupt: {exc}") from exc
        if not isinstance(msg, Delta):
            raise ValueError(f"{path}: record {i} is not a Delta")
        try:
            applied = state.apply(msg.body, expected_digest=msg.digest)
            req = rebuild_request(state, msg.body, applied, specs)
        except ProtocolError as exc:
            raise ValueError(f"{path}: record {i} does not apply: {exc}") from exc
        yield req
