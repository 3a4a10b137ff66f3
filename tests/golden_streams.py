"""The frozen golden corpus of vLLM object streams: ``tests/golden/streams/*.dcobj``.

Each file is an object stream (``engine_side/bench/objstream.py``): vLLM's own
per-step objects, in a format independent of deltacast's wire.  Their expected
outputs are the objects themselves: an adapter must rebuild each SchedulerOutput
/ GrammarOutput / ModelRunnerOutput exactly.  Each header's meta says what the
file is and how to regenerate it.

* Real runs (vLLM 0.32 CPU, the tiny model), :data:`REAL`: the coverage scenarios
  ``main`` and ``spec`` in full, and short online runs (about 16 running, requests
  joining and leaving every few steps): ``golden16``, ``golden16_prefix`` (prefix
  caching) and ``golden16_async`` (async scheduling), from
  ``engine_side/bench/vllm_online.py``.
* Synthetic streams, :data:`SYNTHETIC`: ``tests/vllm_streams.py``
  ``scheduler_streams()`` drawn by Hypothesis under a fixed ``@seed`` (generate
  phase only, no example database); the first of :data:`DRAWS` draws that shows
  the wanted shapes is kept.  Each SchedulerOutput is followed by the records of a
  real step (``reply`` None, ``sample_tokens`` None, ``sample_reply`` one token per
  scheduled request).  They hold ``vllm_streams.OpaqueMeta`` connector metadata:
  read them with ``allow=ALLOW``.  The draws depend on the Hypothesis version
  (recorded in the meta) and on ``vllm_streams.py``; the files are the reference.

Regenerate (rewrites the files; review the diff of sizes and meta)::

    .venv/bin/python tests/golden_streams.py [--only real|synthetic] [--model DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_side.bench.objstream import Record, read_stream, write_stream

STREAMS_DIR = Path(__file__).resolve().parent / "golden" / "streams"
ALLOW = ("vllm_streams.",)
REAL = ("main", "spec", "golden16", "golden16_prefix", "golden16_async")
DRAWS = 300
REGENERATE = "python tests/golden_streams.py"


def _shapes(stream: dict[str, Any]) -> set[str]:
    """Stream shapes a synthetic stream shows."""
    seen = set()
    for so in stream["steps"]:
        c = so.scheduled_cached_reqs
        flags = {
            "preempted": bool(so.preempted_req_ids), "v1_resumed": bool(c.resumed_req_ids),
            "v2_resumed_as_new": any(len(nr.prefill_token_ids or ()) > len(nr.prompt_token_ids)
                                     for nr in so.scheduled_new_reqs),
            "drafts": bool(so.scheduled_spec_decode_tokens), "finished": bool(so.finished_req_ids),
            "connector_metadata": so.kv_connector_metadata is not None,
            "mm": any(nr.mm_features for nr in so.scheduled_new_reqs),
            "lora": any(nr.lora_request for nr in so.scheduled_new_reqs),
            "pooling": any(nr.pooling_params for nr in so.scheduled_new_reqs),
            "pp_new_token_ids": bool(c.new_token_ids), "all_token_ids": bool(c.all_token_ids)}
        seen |= {k for k, v in flags.items() if v}
    return seen


def _wants(steps: int, *shapes: str, groups: int = 1) -> Callable[[dict[str, Any]], bool]:
    return lambda s: (len(s["steps"]) >= steps and s["kv_groups"] == groups
                      and set(shapes) <= _shapes(s))


#: name -> (seed, scheduler_streams kwargs, what it shows, the pick)
SYNTHETIC: dict[str, tuple[int, dict[str, Any], str, Callable[[dict[str, Any]], bool]]] = {
    "synthetic_v1": (1, {"v2": False, "max_steps": 16},
                     ">= 10 steps, V1 shape: preemption, resumed cached requests, drafts",
                     _wants(10, "preempted", "v1_resumed", "drafts", "finished")),
    "synthetic_v2": (2, {"v2": True, "max_steps": 16},
                     ">= 10 steps, V2 shape: preemption, resumed as new requests, drafts",
                     _wants(10, "preempted", "v2_resumed_as_new", "drafts", "finished")),
    "synthetic_rare": (3, {"max_steps": 16},
                       ">= 6 steps: connector metadata, multimodal features, LoRA, pooling",
                       _wants(6, "connector_metadata", "mm", "lora", "pooling")),
    "synthetic_groups": (4, {"rare": False, "max_steps": 24},
                         ">= 12 steps, 2 KV cache groups, no rare extras",
                         _wants(12, "preempted", "finished", groups=2)),
}


@functools.cache
def golden_streams() -> dict[str, tuple[dict[str, Any], list[Record]]]:
    """Every golden file by name: ``(meta, [(kind, object), ...])``."""
    return {p.stem: read_stream(p, allow=ALLOW) for p in sorted(STREAMS_DIR.glob("*.dcobj"))}


class _Found(Exception):
    pass


def draw_stream(seed: int, count: int, pick: Callable[[dict[str, Any]], bool],
                **kwargs: Any) -> dict[str, Any] | None:
    """The first stream ``pick`` accepts among the first ``count`` Hypothesis draws from
    ``scheduler_streams(**kwargs)`` under ``@seed(seed)`` (deterministic for one
    Hypothesis version), or None."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed
    from vllm_streams import scheduler_streams

    found: list[dict[str, Any]] = []

    @fixed_seed(seed)
    @settings(database=None, max_examples=count, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(scheduler_streams(**kwargs))
    def collect(stream: dict[str, Any]) -> None:
        if pick(stream):
            found.append(stream)
            raise _Found

    with warnings.catch_warnings(), contextlib.suppress(_Found):
        warnings.simplefilter("ignore")  # Hypothesis: "overly large repr" of the found stream
        collect()
    return found[0] if found else None


def synthetic_records(stream: dict[str, Any]) -> list[Record]:
    """A synthetic stream's SchedulerOutputs, each followed by a real step's replies."""
    from vllm.v1.outputs import ModelRunnerOutput

    records: list[Record] = []
    for so in stream["steps"]:
        ids = list(so.num_scheduled_tokens)
        reply = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                  sampled_token_ids=[[len(r) % 7] for r in ids])
        records += [("execute_model", so), ("reply", None), ("sample_tokens", None),
                    ("sample_reply", reply)]
    return records


def regenerate_synthetic() -> None:
    import hypothesis

    for name, (seed, kwargs, what, pick) in SYNTHETIC.items():
        stream = draw_stream(seed, DRAWS, pick, **kwargs)
        if stream is None:
            raise RuntimeError(f"{name}: no draw of {DRAWS} under seed {seed} shows {what}")
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        meta = {"what": f"synthetic SchedulerOutput stream ({what}), each step followed by "
                        "reply None, sample_tokens None, sample_reply (one token per request)",
                "scenario": name, "generator": f"tests/vllm_streams.py scheduler_streams({args})",
                "pick": f"the first of {DRAWS} Hypothesis draws under @seed({seed}) "
                        "(generate phase only, no database) showing it",
                "hypothesis": hypothesis.__version__, "seed": seed, "v2": stream["v2"],
                "kv_groups": stream["kv_groups"], "shapes": sorted(_shapes(stream)),
                "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "regenerate": f"{REGENERATE} --only synthetic"}
        size = write_stream(STREAMS_DIR / f"{name}.dcobj", synthetic_records(stream), meta,
                            allow=ALLOW)
        print(f"{name}: {len(stream['steps'])} steps, {size} bytes", file=sys.stderr)


def regenerate(model: Path | None = None, only: str = "") -> None:
    """Rewrite the golden files (real runs: one vLLM child process each)."""
    from engine_side.bench.vllm_online import record_many, render
    from engine_side.bench.vllm_scenarios import build_tiny_model

    STREAMS_DIR.mkdir(parents=True, exist_ok=True)
    if only in ("", "synthetic"):
        regenerate_synthetic()
    if only in ("", "real"):
        tiny = build_tiny_model(model or Path("/tmp/deltacast-tiny-llama"))
        print(render(record_many(tiny, REAL, STREAMS_DIR, force=True)))
    golden_streams.cache_clear()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("real", "synthetic"), default="")
    parser.add_argument("--model", type=Path, help="tiny model dir (built if missing)")
    args = parser.parse_args()
    regenerate(args.model, args.only)
