"""Structured-output bitmasks: ``sample_tokens`` messages at real vocabulary sizes.

vLLM sends each step's GrammarOutput bitmask (int32, one row per structured request,
``ceil(vocab / 32)`` words a row) to the workers.  This benchmark builds bitmasks
shaped like xgrammar's -- rows that allow almost every token (-1 words) or almost
none (0 words), a few mixed words each, requests at the same grammar state sharing
a row, each step at 8 states of a pool of 32 (so rows recur across steps) -- and
measures, over consecutive steps, side by side in one loop (alternating which side
runs first):

* ours: ``SchedulerOutputEncoder.encode_grammar`` + ``SchedulerOutputDecoder.decode_grammar``
  (rows by reference, ``engine_side.vllm.rowrefs``; fresh rows raw, deflated up to
  ``DEFLATE_MAX`` bytes or sparse words above: ``engine_side.vllm.schema``);
* vLLM's: the MultiprocExecutor RPC tuple serialized as vLLM's MessageQueue serializes
  it (protocol-5 pickle, out-of-band buffers counted: ``engine_side.bench.vllm_replay.pickled``);
* and, beside it, vLLM's serializer plus the copies its ring makes of the message
  (:func:`ring_copies`): ``MessageQueue.enqueue`` writes every buffer into the shared
  ring and ``dequeue`` copies each out-of-band buffer out of it (``bytearray``), so a
  4 MB bitmask is copied twice.  The pickle figure alone leaves those copies out; ours
  are of a few KB, not counted.

Run: ``python -m engine_side.bench.bitmask [--reps N] [--json FILE]`` (needs vLLM).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from engine_side.bench.figures import stamp
from engine_side.bench.page_tables import write_figures

CASES = ((32, 512), (256, 512), (32, 128256), (256, 128256))  # (requests, vocabulary)


def states(vocab: int, count: int = 32, seed: int = 0) -> np.ndarray:
    """``count`` xgrammar-like grammar states: each allows most tokens (-1 words) or few
    (0 words), with 1 in 64 words mixed."""
    rng = np.random.default_rng(seed)
    words = -(-vocab // 32)
    pool = np.where(rng.random((count, 1)) < 0.5, np.int32(-1), np.int32(0)) * np.ones(
        (count, words), np.int32)
    mixed = rng.random((count, words)) < 1 / 64
    pool[mixed] = rng.integers(1, 2**31 - 1, int(mixed.sum()), dtype=np.int32)
    return pool


def bitmask(rows: int, pool: np.ndarray, step: int = 0) -> np.ndarray:
    """One step's bitmask: its requests at 8 of the pool's grammar states (which 8, and
    which request at which, change with ``step``), sharing rows."""
    rng = np.random.default_rng(step)
    at = rng.choice(len(pool), 8, replace=False)
    return pool[at[rng.integers(0, 8, rows)]]


def ring_copies(buffers: list[Any], ring: bytearray) -> tuple[float, list[bytearray]]:
    """(seconds, the reader's out-of-band buffers) of the copies vLLM's shared-memory
    ring makes of a serialized message (``buffers``: ``vllm_serialize``'s): the writer
    copies every buffer into ``ring`` after its 4-byte length, as ``MessageQueue.enqueue``
    does, and a reader copies each out-of-band buffer out (``dequeue``; the pickle bytes
    it reads in place)."""
    view = memoryview(ring)
    t0 = time.perf_counter()
    offset, spans = 3, []
    for buffer in buffers:
        length = len(buffer)
        view[offset:offset + 4] = length.to_bytes(4, "big")
        view[offset + 4:offset + 4 + length] = buffer
        spans.append((offset + 4, length))
        offset += 4 + length
    out = [bytearray(view[start:start + length]) for start, length in spans[1:]]
    return time.perf_counter() - t0, out


def _pair(rows: int) -> tuple[Any, Any, list[str]]:
    """An encoder and a decoder that agree on a first step of ``rows`` requests."""
    from engine_side.bench.vllm_replay import synthetic_decode
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    enc, dec = SchedulerOutputEncoder(), SchedulerOutputDecoder()
    first = synthetic_decode(rows, 1)[0][1]
    dec.decode([bytes(f) for f in enc.encode(first)])
    return enc, dec, list(first.num_scheduled_tokens)


def measure(rows: int, vocab: int, reps: int) -> dict[str, Any]:
    """Median bytes and µs per message over ``reps`` steps, ours and pickle's; every
    decoded bitmask checked."""
    from vllm.v1.core.sched.output import GrammarOutput

    from engine_side.bench.vllm_replay import pickled, vllm_message, vllm_serialize

    enc, dec, ids = _pair(rows)
    pool = states(vocab)
    steps = [GrammarOutput(ids, bitmask(rows, pool, k), None) for k in range(reps)]
    ours, theirs, copies, sizes, pickle_sizes = [], [], [], [], []
    ring = bytearray(2 * rows * -(-vocab // 32) * 4 + (1 << 20))  # (mapped once, as shm is)
    for k, grammar in enumerate(steps):  # the side timed first alternates
        first = pickled("sample_tokens", grammar) if k % 2 else None
        t0 = time.perf_counter()
        frames = [bytes(f) for f in enc.encode_grammar(grammar)]
        out = dec.decode_grammar(frames)
        ours.append(time.perf_counter() - t0)
        pickle_size, pickle_s = first or pickled("sample_tokens", grammar)
        theirs.append(pickle_s)
        copies.append(ring_copies(vllm_serialize(vllm_message("sample_tokens", grammar)),
                                  ring)[0])
        sizes.append(sum(map(len, frames)))
        pickle_sizes.append(pickle_size)
        if not np.array_equal(out.grammar_bitmask, grammar.grammar_bitmask):
            raise AssertionError("the decoded bitmask differs")
    size, pickle_size = statistics.median_low(sizes), statistics.median_low(pickle_sizes)
    grammar = steps[0]
    us, pickle_us = statistics.median(ours) * 1e6, statistics.median(theirs) * 1e6
    ring_us = statistics.median(map(sum, zip(theirs, copies, strict=True))) * 1e6
    return {"requests": rows, "vocab": vocab, "raw_bytes": grammar.grammar_bitmask.nbytes,
            "bytes": size, "pickle_bytes": pickle_size, "us": us, "pickle_us": pickle_us,
            "bytes_ratio": pickle_size / size, "us_ratio": us / pickle_us,
            "ring_us": ring_us, "ring_ratio": us / ring_us}


def table(results: list[dict[str, Any]]) -> str:
    head = ("| requests | vocabulary | bitmask bytes | ours bytes | pickle bytes | × fewer bytes "
            "| ours µs | pickle µs | µs ÷ pickle | pickle + ring copies µs | µs ÷ that |\n"
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = [f"| {r['requests']} | {r['vocab']:,} | {r['raw_bytes']:,} | {r['bytes']:,} | "
            f"{r['pickle_bytes']:,} | {r['bytes_ratio']:.1f} | {r['us']:,.1f} | "
            f"{r['pickle_us']:,.1f} | {r['us_ratio']:.2f} | {r['ring_us']:,.1f} | "
            f"{r['ring_ratio']:.2f} |" for r in results]
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21, help="messages timed per case (odd)")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--figures", default="", metavar="FILE",
                        help="also write the figures envelope for BENCHMARKS.md here "
                             "(docs/benchmarks/bitmask.json)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    started = stamp() if args.figures else None  # the run's start, for the envelope
    results = [measure(rows, vocab, args.reps) for rows, vocab in CASES]
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.figures:
        write_figures(args.figures, "bitmask", results, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
