"""Every step of a stream through the fast paths and the general path, both ends.

The fast paths (same-batch, turnover) must be invisible: the very frames of an encoder
built with ``fast=False``, and at the worker a SchedulerOutput equal to the original
from a fast decoder and from a ``fast=False`` one.  The runner's mutations are played
too: it extends the ``block_ids`` lists it receives, so those must be fresh.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm_equal import assert_vllm_equal

from engine_side.vllm import SchedulerOutputEncoder
from worker_side.vllm import SchedulerOutputDecoder


def run_both_paths(steps: list[Any], kv_groups: int | None, secret: bytes,
                   ) -> tuple[SchedulerOutputEncoder, SchedulerOutputDecoder]:
    """Run ``steps`` (SchedulerOutputs) fast and general; returns the fast encoder and
    decoder (their step counters say which paths fired)."""
    fast = SchedulerOutputEncoder(kv_groups, secret=secret)
    slow = SchedulerOutputEncoder(kv_groups, secret=secret, fast=False)
    decoders = [SchedulerOutputDecoder(secret), SchedulerOutputDecoder(secret, fast=False)]
    for so in steps:
        expected = copy.deepcopy(so)
        frames = [bytes(f) for f in fast.encode(so)]
        assert frames == [bytes(f) for f in slow.encode(so)]
        for dec in decoders:
            got = dec.decode(frames)
            assert_vllm_equal(expected, got)
            for entry in got.scheduled_cached_reqs.new_block_ids:  # the runner extends these
                for ids in entry or ():
                    ids.append(-5)
            for nr in got.scheduled_new_reqs:
                for ids in nr.block_ids:
                    ids.append(-6)
    assert slow.quick_steps == slow.turnover_steps == 0
    assert decoders[1].quick_steps == decoders[1].turnover_steps == 0
    return fast, decoders[0]
