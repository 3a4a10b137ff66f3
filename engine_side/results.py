"""Step results checked against the step they answer, before the engine uses them.

A worker's :class:`~protocol.replies.StepResult` names the batch rows that sampled and
their tokens.  The session checks epoch and seq itself; a *validator* (``validate=`` of
:class:`~engine_side.session.EngineSession`) checks the rest against the request that
was published: ``validator(request, result)`` returns None for a good result, or what
is wrong with it.  A bad result is its rank's fault (the session treats it like a
divergent rank), never an exception in the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from protocol.errors import ProtocolError
from protocol.replies import StepResult
from protocol.request import ExecuteModelRequest, IntArray

Validator = Callable[[ExecuteModelRequest, StepResult], "str | None"]


def sampling_rows(request: ExecuteModelRequest) -> IntArray:
    """The batch rows that sample a token in ``request`` (engine-token mode): those whose
    scheduled tokens reach the end of the known sequence, prompt plus outputs (the rule
    of :class:`worker_side.runner.ModelRunner` and :class:`engine_side.scheduler.Scheduler`)."""
    if request.output_token_ids is None:
        raise ValueError("sampling_rows needs engine-sent tokens (output_token_ids)")
    known = np.array([(0 if s.prompt_token_ids is None else len(s.prompt_token_ids)) + len(o)
                      for s, o in zip(request.specs, request.output_token_ids, strict=True)],
                     dtype=np.int64)
    start, count = request.num_computed_tokens, request.num_scheduled_tokens
    return np.flatnonzero((count > 0) & (start < known) & (start + count >= known))


class SampledTokens:
    """Validator for engine-token steps (``deltacast demo``): the rows are exactly the
    rows that sample (:func:`sampling_rows`, in batch order), one token each, every token
    in ``[0, vocab)``."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(self, request: ExecuteModelRequest, result: StepResult) -> str | None:
        try:
            rows, tokens = result.row_array(), result.token_array()
        except ProtocolError as exc:
            return str(exc)
        want = sampling_rows(request)
        if rows.size != want.size or not np.array_equal(rows, want):
            return (f"rows {rows[:8].tolist()} (of {rows.size}) are not the sampling rows "
                    f"{want[:8].tolist()} (of {want.size}) of a batch of {len(request.req_ids)}")
        if tokens.size != rows.size:
            return f"{tokens.size} tokens for {rows.size} rows"
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab):
            return f"a token outside the vocabulary [0, {self.vocab})"
        return None
