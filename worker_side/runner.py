"""ModelRunner: executes rebuilt ``ExecuteModelRequest``s on a :class:`TinyModel`.

Contract
--------
For each scheduled request ``i`` (batch order) the runner processes positions
``[num_computed, num_computed + num_scheduled)`` of the request's *known
sequence*, ``prompt_token_ids ++ outputs``, where ``outputs`` is
``req.output_token_ids[i]`` in engine-token mode (``output_token_ids`` is not
None) and the runner's own record ``self.outputs[req_id]`` in worker-owned mode.
In worker-owned mode that record is dropped when the id is in
``finished_req_ids`` (before anything of the step runs, so an id finished and
re-added in one step starts afresh).

KV cache: per layer, K and V tensors of ``num_blocks * block_size`` slots;
position ``p`` lives in slot ``table[p // block_size] * block_size + p %
block_size`` where ``table`` is the request's block table for KV group 0
(other groups are ignored: the tiny model has a single attention type).
``blocks_to_zero`` is honoured.  Position ``p`` attends to ``[0, p]`` read
through the block table, so the same request placed in different blocks gives
bitwise-identical results (see the position-invariance note in
:mod:`worker_side.model`).

Sampling: a request produces one token when the step reaches the end of its
known sequence (prefill complete, or a decode step); a partial prefill chunk
produces none.  Greedy (argmax, first index on ties) when ``sampling`` is None
or ``temperature < 1e-5``; otherwise ``softmax(logits / temperature)``
restricted to the ``top_k`` largest logits (when ``0 < top_k < vocab``; ties
with the k-th largest are kept), drawn with a ``torch.Generator`` seeded by
blake2b of ``(sampling.seed or 0, req_id, position)`` where ``position`` is the
index the new token takes, so every rank and every rerun draws the same token.  Only
temperature and top_k are applied (no top_p, min_p, penalties, stop tokens,
logit bias or max_tokens: stopping is the engine's business).

Speculative tokens are ignored: scheduled positions past the known sequence
are not processed, and the step samples from the last known position.

Determinism: requests are processed one at a time, and the model computes one
position at a time, so results do not depend on batch composition or on how a
prompt was chunked.  Callers own the torch thread count; equal inputs and equal
thread counts give equal tokens in every process.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from protocol.messages import TOKEN_MODE_ENGINE
from protocol.packing import unpack_uints
from protocol.params import SamplingSpec
from protocol.request import ExecuteModelRequest, IntArray
from protocol.state import ReplicaState
from worker_side.model import TinyModel

GREEDY_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class StepOutput:
    """Tokens sampled by one step."""

    req_ids: list[str]  # requests that produced a token this step, in batch order
    token_ids: list[int]  # one sampled token each (aligned with req_ids)


class ModelRunner:
    """Runs requests on ``model`` over its own paged KV cache.

    Args:
        model: the (shared, read-only) model.
        num_blocks: KV-cache blocks; block ids in requests must lie in ``[0, num_blocks)``.
        block_size: token slots per block.
        kv_groups: KV-cache groups the engine sends; only group 0 is used.

    Errors: ``ValueError`` for a request the runner cannot execute (block table
    too short or out of range, no token ids, positions past the known sequence);
    requests before the failing one in the batch have already run.
    """

    def __init__(self, model: TinyModel, num_blocks: int = 4096, block_size: int = 16,
                 kv_groups: int = 1) -> None:
        if num_blocks < 1 or block_size < 1 or kv_groups < 1:
            raise ValueError("num_blocks, block_size and kv_groups must be >= 1")
        self.model = model
        self.num_blocks, self.block_size, self.kv_groups = num_blocks, block_size, kv_groups
        self.cache = model.new_cache(num_blocks * block_size)
        self.outputs: dict[str, list[int]] = {}  # worker-owned mode only
        self._hash = 0
        self.num_sampled = 0

    # -- stepping ---------------------------------------------------------------------
    def execute(self, req: ExecuteModelRequest) -> StepOutput:
        """Run one step; return the tokens sampled, in batch order."""
        engine_tokens = req.output_token_ids is not None
        if not engine_tokens:
            for req_id in req.finished_req_ids:
                self.outputs.pop(req_id, None)
        if req.blocks_to_zero is not None and req.blocks_to_zero.size:
            self._zero_blocks(req.blocks_to_zero)
        tables = req.block_tables[0]
        offsets = tables.offsets()
        ids: list[str] = []
        tokens: list[int] = []
        for i, req_id in enumerate(req.req_ids):
            spec = req.specs[i]
            outputs = (req.output_token_ids[i] if req.output_token_ids is not None
                       else self.outputs.get(req_id, []))
            seq = _sequence(spec.prompt_token_ids, outputs, req_id)
            start, count = int(req.num_computed_tokens[i]), int(req.num_scheduled_tokens[i])
            if count == 0:
                continue
            if start >= seq.size:
                raise ValueError(f"{req_id}: position {start} is past its known sequence "
                                 f"of {seq.size} tokens")
            end = min(start + count, seq.size)
            table = tables.values[offsets[i] : offsets[i + 1]]
            hidden = self._forward(req_id, seq, start, end, table)
            if end == seq.size:
                token = self._sample(hidden, spec.sampling, req_id, end)
                ids.append(req_id)
                tokens.append(token)
                if not engine_tokens:
                    self.outputs.setdefault(req_id, []).append(token)
        return StepOutput(ids, tokens)

    def recompute(self, state: ReplicaState) -> int:
        """Rebuild the KV cache of every live request from a replica state; no sampling.

        For a worker that rejoined (loaded a snapshot) with an empty cache.  A
        state at seq ``s`` describes step ``s``, which the rejoining worker does
        not execute, while step ``s + 1`` needs the KV that step ``s`` wrote; so
        each live handle is recomputed over ``[0, computed + last scheduled
        count)``, clipped to its known tokens.  In engine-token mode the known
        tokens are the prompt plus the state's output tokens; in worker-owned
        mode only the prompt is known (sampled tokens never cross the wire), so
        a rejoin mid-decode needs engine-token mode or the engine's token
        history.  Caveat: a snapshot does not carry the last scheduled count of
        live but unscheduled handles, so after ``load_snapshot`` those are
        recomputed over ``[0, computed)`` only.

        Returns the number of positions recomputed.
        """
        engine_tokens = state.token_mode == TOKEN_MODE_ENGINE
        assert state.tables is not None  # a worker's state keeps its tables
        cols, done = state.cols, 0
        for h in state.live_handles().tolist():
            spec = state.spec_of(h)
            prompt = None if spec.prompt_none else unpack_uints(spec.prompt)
            outputs = state.token_history(h) if engine_tokens else np.zeros(0, dtype=np.int64)
            seq = _sequence(prompt, outputs, spec.req_id)
            at = int(cols.pos[h])
            last = int(state.nsched[at]) if at >= 0 else 0
            end = min(int(cols.computed[h]) + last, seq.size)
            if end > 0:
                self._forward(spec.req_id, seq, 0, end, state.tables[0].row(h))
                done += end
        return done

    def token_hash(self) -> int:
        """Rolling 64-bit blake2b hash over (req_id, position, token) of every sampled token."""
        return self._hash

    # -- internals --------------------------------------------------------------------
    def _forward(self, req_id: str, seq: IntArray, start: int, end: int,
                 table: IntArray) -> torch.Tensor:
        slots = torch.from_numpy(self._slots(req_id, table, end))
        chunk = torch.from_numpy(np.array(seq[start:end], dtype=np.int64))
        if chunk.min() < 0 or chunk.max() >= self.model.vocab_size:
            raise ValueError(f"{req_id}: token id outside [0, {self.model.vocab_size})")
        return self.model(chunk, start, self.cache, slots)  # type: ignore[no-any-return]

    def _slots(self, req_id: str, table: IntArray, end: int) -> IntArray:
        """Cache slot of each position in ``[0, end)`` through the block table."""
        need = -(-end // self.block_size)
        if table.size < need:
            raise ValueError(f"{req_id}: block table has {table.size} blocks, "
                             f"{need} needed for {end} tokens")
        blocks = np.asarray(table[:need], dtype=np.int64)
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise ValueError(f"{req_id}: block id out of range [0, {self.num_blocks})")
        pos = np.arange(end, dtype=np.int64)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _zero_blocks(self, block_ids: IntArray) -> None:
        ids = torch.from_numpy(np.array(block_ids, dtype=np.int64))  # copy: may be read-only
        for k, v in self.cache:
            for tensor in (k, v):
                tensor.view(self.num_blocks, self.block_size, -1).index_fill_(0, ids, 0.0)

    def _sample(self, hidden: torch.Tensor, sampling: SamplingSpec | None, req_id: str,
                position: int) -> int:
        logits = self.model.logits(hidden)
        token = sample(logits, sampling, req_id, position)
        self._record(req_id, position, token)
        return token

    def _record(self, req_id: str, position: int, token: int) -> None:
        data = b"".join((self._hash.to_bytes(8, "little"), position.to_bytes(8, "little"),
                         token.to_bytes(8, "little", signed=True), req_id.encode()))
        self._hash = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        self.num_sampled += 1


def sample(logits: torch.Tensor, sampling: SamplingSpec | None, req_id: str,
           position: int) -> int:
    """One token from ``logits`` (see the module docstring for the rule)."""
    if sampling is None or sampling.temperature < GREEDY_EPS:
        return int(torch.argmax(logits))
    scaled = logits / sampling.temperature
    if 0 < sampling.top_k < scaled.numel():
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    gen = torch.Generator().manual_seed(sample_seed(sampling.seed or 0, req_id, position))
    return int(torch.multinomial(torch.softmax(scaled, dim=0), 1, generator=gen))


def sample_seed(seed: int, req_id: str, position: int) -> int:
    """A 63-bit generator seed from (request seed, request id, position); process-stable."""
    data = b"".join((seed.to_bytes(16, "little", signed=True),
                     position.to_bytes(8, "little"), req_id.encode()))
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") & (_MASK64 >> 1)


def _sequence(prompt: IntArray | None, outputs: IntArray | list[int], req_id: str) -> IntArray:
    if prompt is None:
        raise ValueError(f"{req_id}: prompt embeddings are not supported, token ids needed")
    if len(outputs) == 0:
        return prompt
    return np.concatenate([prompt, np.asarray(outputs, dtype=np.int64)])
