"""Hypothesis strategy: streams of engine steps for the core API (``EngineMirror.step``).

A toy scheduler keeps live requests (prompt, computed count, block tables, token
history) and the last batch, and emits steps that exercise every part of a Delta:
finishes (including ids never added), joins, an id finished and re-added in one
step, a live id re-sent (an update), drops and appends, reorders (a whole new
schedule), scheduled-count and computed-count departures, block appends and
replacements in one or two KV groups, token appends and truncations (engine-token
mode).  Each step also carries the state the receiver must hold after it
(``expect``), the oracle of the tests.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from protocol.messages import Spec
from protocol.packing import pack_uints
from protocol.params import SamplingSpec


@dataclass
class Req:
    rid: str
    prompt: list[int]
    computed: int = 0
    tables: list[list[int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def spec_of(req: Req, temperature: float) -> Spec:
    return Spec(req_id=req.rid, prompt=pack_uints(req.prompt),
                sampling=SamplingSpec(temperature=temperature, max_tokens=len(req.prompt) + 7))


@st.composite
def core_streams(draw: Any, max_steps: int = 10, engine_tokens: bool | None = None,
                 max_batch: int = 12) -> dict[str, Any]:
    """{"kv_groups", "engine_tokens", "steps": [{"kwargs": step kwargs, "expect": model}]}."""
    groups = draw(st.integers(1, 2))
    engine = draw(st.booleans()) if engine_tokens is None else engine_tokens
    live: dict[str, Req] = {}
    batch: list[str] = []
    nsched: dict[str, int] = {}
    steps = []
    counter = 0
    for _ in range(draw(st.integers(1, max_steps))):
        finished = [r for r in list(live) if draw(st.booleans()) and draw(st.booleans())]
        unknown = [f"ghost{counter}"] if draw(st.integers(0, 9)) == 0 else []
        readd = [r for r in finished if draw(st.integers(0, 3)) == 0]
        update = [r for r in live if r not in finished and draw(st.integers(0, 7)) == 0]
        for r in finished:
            del live[r]
        added: list[Req] = []
        joined: list[tuple[Req, float]] = []
        for rid in readd + update + [f"r{counter + i}" for i in range(draw(st.integers(0, 3)))]:
            prompt = draw(st.lists(st.integers(0, 600), min_size=0, max_size=20))
            req = Req(rid, prompt, computed=draw(st.integers(0, len(prompt))),
                      tables=[[] for _ in range(groups)],
                      tokens=draw(st.lists(st.integers(0, 600), max_size=4)) if engine else [])
            live[rid] = req
            added.append(req)
            joined.append((copy.deepcopy(req), draw(st.sampled_from([0.0, 0.7]))))
        counter += 4
        reset = set(finished) | {a.rid for a in added}
        kept = [r for r in batch if r in live and draw(st.integers(0, 5)) > 0]
        waiting = [r for r in live if r not in kept]
        joins = [r for r in waiting if draw(st.booleans())]
        new_batch = kept + joins
        if draw(st.integers(0, 6)) == 0:
            new_batch = draw(st.permutations(new_batch))
        new_batch = new_batch[:max_batch]
        # counts: the protocol's prediction, with departures
        counts = []
        for r in new_batch:
            predicted = nsched[r] if r in batch and r not in reset else 1
            counts.append(predicted if draw(st.integers(0, 3)) else draw(st.integers(0, 40)))
        # computed: advance the previous batch's survivors, then departures
        for r in batch:
            if r in live and r not in reset:
                live[r].computed += nsched[r]
        computed = []
        for r in new_batch:
            if draw(st.integers(0, 5)) == 0:
                live[r].computed = max(0, live[r].computed + draw(st.integers(-5, 5)))
            computed.append(live[r].computed)
        appends: list[Any] = []
        replaces: list[Any] = []
        for g in range(groups):
            rows_a: tuple[list[int], list[int], list[int]] = ([], [], [])
            rows_r: tuple[list[int], list[int], list[int]] = ([], [], [])
            for p, r in enumerate(new_batch):
                if draw(st.integers(0, 6)) == 0:
                    ids = draw(st.lists(st.integers(0, 5000), max_size=4))
                    live[r].tables[g] = list(ids)
                    rows_r[0].append(p)
                    rows_r[1].append(len(ids))
                    rows_r[2].extend(ids)
                if draw(st.booleans()):
                    ids = draw(st.lists(st.integers(0, 5000), min_size=1, max_size=3))
                    live[r].tables[g] += ids
                    rows_a[0].append(p)
                    rows_a[1].append(len(ids))
                    rows_a[2].extend(ids)
            appends.append(rows_a if rows_a[0] else None)
            replaces.append(rows_r if rows_r[0] else None)
        tokens = truncate = None
        if engine and new_batch:
            tk: tuple[list[int], list[int], list[int]] = ([], [], [])
            tr: tuple[list[int], list[int]] = ([], [])
            for p, r in enumerate(new_batch):
                if live[r].tokens and draw(st.integers(0, 5)) == 0:
                    n = draw(st.integers(0, len(live[r].tokens)))
                    live[r].tokens = live[r].tokens[:n]
                    tr[0].append(p)
                    tr[1].append(n)
                if draw(st.booleans()):
                    new = draw(st.lists(st.integers(0, 600), min_size=1, max_size=2))
                    live[r].tokens += new
                    tk[0].append(p)
                    tk[1].append(len(new))
                    tk[2].extend(new)
            tokens = tk if tk[0] else None
            truncate = tr if tr[0] else None
        kwargs = {"finished": finished + unknown, "added": joined, "computed": computed,
            "appends": appends, "replaces": replaces, "tokens": tokens, "truncate": truncate,
            "batch": list(new_batch), "nsched": counts}
        batch, nsched = list(new_batch), dict(zip(new_batch, counts, strict=True))
        steps.append({"kwargs": kwargs, "expect": {
            "batch": list(batch), "nsched": list(counts),
            "computed": [live[r].computed for r in batch],
            "tables": [[list(live[r].tables[g]) for g in range(groups)] for r in batch],
            "tokens": [list(live[r].tokens) for r in batch] if engine else None,
            "live": sorted(live)}})
    return {"kv_groups": groups, "engine_tokens": engine, "steps": steps}
