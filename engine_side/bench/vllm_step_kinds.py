"""Where a recording's request µs go, by step kind: ours against pickle, side by side.

``python -m engine_side.bench.vllm_step_kinds /tmp/vllm-streams/chunked.dcrec --passes 7``
replays each recording as :func:`engine_side.bench.vllm_replay.replay` does (fresh
encoder → fresh decoder, pickle of the same object in the same loop, the side timed
first alternating) and prints, per step kind, how many steps a pass has and the
medians of our engine encode, our worker decode and pickle's serialize + deserialize
(vLLM's MessageQueue serializer) of the ``execute_model`` message alone (the grammar
message is not counted here).  Kinds, from the encoder's and decoder's own counters:

* ``steady``: the same batch, nothing but the advance (a header-only frame);
* ``appends``: the same batch with block appends and no count or draft rows (the
  plain step with appends, chunked prefill's common step);
* ``same-batch``: any other step the same-batch path took (count exceptions, drafts);
* ``after-change``: any of those three right after a step that changed the batch (a
  finish, turnover or general step): the same path, counted apart because it runs
  dearer there (BENCHMARKS.md, twenty-seventh session: the step before it left its
  objects cold), and such steps hold specdec's median;
* ``finish``: requests of the last batch finished, the rest stayed (the finish path);
* ``turnover``: requests left or joined, answered by the turnover path;
* ``general``: the rest.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from engine_side.bench.vllm_replay import load_recording, pickled

KINDS = ("steady", "appends", "same-batch", "after-change", "finish", "turnover",
         "general")
SAME_BATCH = frozenset(KINDS[:3])  # the same-batch path's kinds
STEADY_FRAME = 40  # a same-batch frame shorter than this carries no body (header only)


def _kind(enc: Any, dec: Any, before: tuple[int, int, int], frames: list[Any]) -> str:
    from protocol.lane_lists import NO_ROWS

    quick_before, finish_before, turnover_before = before
    if enc.finish_steps > finish_before:
        return "finish"
    if enc.quick_steps > quick_before:
        if len(frames) == 1 and len(frames[0]) < STEADY_FRAME and not enc.quick.appends:
            return "steady"
        return "appends" if enc.quick.appends and enc.quick.rows is NO_ROWS else "same-batch"
    return "turnover" if dec.turnover_steps > turnover_before else "general"


def _pass(messages: list[tuple[str, Any]], rows: dict[str, list[tuple[int, int, float]]],
          ) -> None:
    """One replay of ``messages``, appending (encode ns, decode ns, pickle s) per step."""
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    enc, dec = SchedulerOutputEncoder(), SchedulerOutputDecoder()
    first, last = False, "general"  # last: the step before's kind (the first is general)
    for kind, obj in messages:
        if kind == "sample_tokens":
            dec.decode_grammar(enc.encode_grammar(obj))
        elif kind != "execute_model":
            enc.decode_reply(dec.encode_reply(obj))
        else:
            first = not first
            theirs = pickled(kind, obj) if first else None
            before = enc.quick_steps, enc.finish_steps, dec.turnover_steps
            t0 = time.perf_counter_ns()
            frames = enc.encode(obj)
            t1 = time.perf_counter_ns()
            dec.decode(frames)
            t2 = time.perf_counter_ns()
            theirs = theirs or pickled(kind, obj)
            step = _kind(enc, dec, before, frames)
            after = step in SAME_BATCH and last not in SAME_BATCH
            rows["after-change" if after else step].append(
                (t1 - t0, t2 - t1, theirs[1] + theirs[2]))
            last = step


def step_kinds(path: Path, passes: int = 7) -> dict[str, dict[str, float]]:
    """Per kind: steps in one pass and the median encode, decode and pickle µs."""
    messages = load_recording(path)
    rows: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    gc.collect()
    gc.freeze()
    try:
        for _ in range(passes):
            _pass(messages, rows)
    finally:
        gc.unfreeze()
    return {kind: {"steps": len(rows[kind]) // passes,
                   "encode_us": statistics.median(r[0] for r in rows[kind]) / 1e3,
                   "decode_us": statistics.median(r[1] for r in rows[kind]) / 1e3,
                   "pickle_us": statistics.median(r[2] for r in rows[kind]) * 1e6}
            for kind in KINDS if rows[kind]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recordings", nargs="+", type=Path, help=".dcrec files")
    parser.add_argument("--passes", type=int, default=7, help="replays per recording")
    parser.add_argument("--json", action="store_true", help="one JSON object per recording")
    args = parser.parse_args(argv)
    if args.passes < 1:
        parser.error("--passes must be at least 1")
    for path in args.recordings:
        if not path.is_file():
            parser.error(f"no such recording: {path}")
        got = step_kinds(path, args.passes)
        if args.json:
            print(json.dumps({"recording": str(path), "kinds": got}))
            continue
        print(f"{path.name}: median µs per step kind over {args.passes} passes")
        for kind, f in got.items():
            print(f"  {kind:12s} {f['steps']:4d} steps  engine {f['encode_us']:7.2f}  "
                  f"worker {f['decode_us']:7.2f}  pickle {f['pickle_us']:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
