"""Requests entering and leaving a :class:`protocol.state.ReplicaState`'s columns (a
part of it: a mixin over its columns, tables, specs and tokens).

A request's row is written when it is added (its spec, spec term and computed count;
its tokens in engine-token mode) and cleared when it finishes (liveness, schedule
membership, table length, block and token sums).  One request at a time takes scalar
writes; a batch that joins or ends together takes column scatters, with the same
result (``tests/test_join_columns.py``, ``tests/test_lane_drop.py`` compare them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocol import digest as dg
from protocol.columns import BlockTable, HandleColumns, TokenBuffer
from protocol.messages import TOKEN_MODE_ENGINE
from protocol.packing import INT64_MAX
from protocol.planned import Added
from protocol.request import IntArray, RequestSpec

#: finished handles up to this many are forgotten one by one (see _forget_all)
FEW_FORGOTTEN = 8
#: ... and added requests up to this many installed one by one (see _install_all)
FEW_INSTALLED = 8


class RequestRows:
    """The install and forget part of :class:`protocol.state.ReplicaState`."""

    token_mode: int
    kv_groups: int
    _cols: HandleColumns
    blocks: list[BlockTable]
    specs: list[RequestSpec | None]
    tokens: list[TokenBuffer | None]
    _rebuild_cache: dict[object, Any]

    def _drop_ahead(self) -> None:
        raise NotImplementedError  # (the state's: pending advances written, lookahead gone)

    def _forget_all(self, finished: list[int]) -> None:
        """:meth:`_forget` of each handle: one by one for a few (scalar writes), by
        column scatters for more (a batch that ends together)."""
        if len(finished) > FEW_FORGOTTEN:
            self._forget_rows(np.array(finished, dtype=np.int64), finished)
            return
        for h in finished:
            self._forget_rows(h, (h,))

    def _forget(self, h: int) -> None:
        self._forget_rows(h, (h,))

    def _forget_rows(self, at: int | IntArray, handles: list[int] | tuple[int, ...]) -> None:
        """Forget ``handles``; ``at`` indexes their rows in the columns (one handle, or an
        array of them: the same writes, scalar or scattered)."""
        self._drop_ahead()
        cols = self._cols  # (current: the drop flushed pending advances)
        cols.live[at] = cols.in_sched[at] = False
        for g in range(self.kv_groups):
            self.blocks[g].lengths[at] = 0
            cols.block_sum[g, at] = 0
        engine_tokens = self.token_mode == TOKEN_MODE_ENGINE
        for h in handles:
            self.specs[h] = None
            if engine_tokens:
                self.tokens[h] = None
        if engine_tokens:
            cols.token_sum[at] = 0
        self._rebuild_cache.clear()

    def _install_all(self, added: list[Added]) -> None:
        """:meth:`_install` of each added request: one by one for a few (scalar writes),
        by column scatters for more (a batch that joins together).  The handles are
        distinct (the plan checked them); a live one is replaced."""
        # (a count past int64, which numpy cannot hold, takes the one-by-one lines)
        if len(added) <= FEW_INSTALLED or max(a.computed for a in added) > INT64_MAX:
            for a in added:
                self._install(a.handle, a.spec, a.spec_hash, a.computed, a.tokens)
            return
        self._drop_ahead()
        cols = self._cols  # (current: the drop flushed pending advances)
        hs = [a.handle for a in added]
        for h in hs:  # (grown as one by one grows them: the same capacities)
            cols.ensure(h)
            for table in self.blocks:
                table.ensure(h, 0)
        missing = max(hs) + 1 - len(self.specs)
        if missing > 0:
            self.specs += [None] * missing
            self.tokens += [None] * missing
        at = np.array(hs, dtype=np.int64)
        self._forget_all(at[cols.live[at]].tolist())
        cols.live[at] = True
        cols.in_sched[at] = False
        cols.spec_term[at] = dg.spec_terms(at, [a.spec_hash for a in added])
        cols.computed[at] = [a.computed for a in added]
        specs = self.specs
        for a in added:
            specs[a.handle] = a.spec
            if a.tokens is not None:
                self._install_tokens(a.handle, a.tokens)
        self._rebuild_cache.clear()

    def _install(self, h: int, spec: RequestSpec, spec_hash: int, computed: int,
                 tokens: IntArray | None) -> None:
        self._drop_ahead()
        cols = self._cols  # (current: the drop flushed pending advances)
        cols.ensure(h)
        for table in self.blocks:
            table.ensure(h, 0)
        while len(self.specs) <= h:
            self.specs.append(None)
            self.tokens.append(None)
        if cols.live[h]:
            self._forget(h)
        cols.live[h] = True
        cols.in_sched[h] = False
        self.specs[h] = spec
        cols.spec_term[h] = dg.spec_term_int(h, spec_hash)
        cols.computed[h] = computed
        if tokens is not None:
            self._install_tokens(h, tokens)
        self._rebuild_cache.clear()

    def _install_tokens(self, h: int, tokens: IntArray) -> None:
        """Handle ``h``'s output tokens (engine-token mode) and their digest sum."""
        self.tokens[h] = TokenBuffer(tokens)
        pos = np.arange(tokens.size)
        self._cols.token_sum[h] = dg.total(dg.token_terms(np.full(pos.size, h), pos, tokens))
