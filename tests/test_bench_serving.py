"""The serving-latency benchmark's arrivals, latencies and table, and the benchmarks' list
options and percentiles (no vLLM needed)."""

from __future__ import annotations

import argparse
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_side.bench.page_serving import from_serving
from engine_side.bench.vllm_scenarios import listed, percentile
from engine_side.bench.vllm_serving import arrivals, latencies
from protocol.cli_support import int_in


@given(st.integers(1, 300), st.floats(0.5, 500), st.integers(1, 400), st.integers(0, 99))
def test_arrivals_are_seeded_ordered_and_in_range(count: int, rate: float, max_tokens: int,
                                                   seed: int) -> None:
    plan = arrivals(count, rate, max_tokens, seed)
    assert plan == arrivals(count, rate, max_tokens, seed)
    assert len(plan) == count
    times = [at for at, _, _ in plan]
    assert all(0 < a <= b for a, b in zip(times, times[1:], strict=False))
    for _, prompt, n in plan:
        assert 16 <= len(prompt) <= 112 and all(20 <= t < 400 for t in prompt)
        assert max(1, max_tokens // 2) <= n <= max_tokens * 3 // 2


def test_arrivals_follow_the_rate() -> None:
    plan = arrivals(4000, 40.0, 64)
    assert math.isclose(len(plan) / plan[-1][0], 40.0, rel_tol=0.1)


def test_latencies_measure_from_arrival_and_between_tokens() -> None:
    ttft, itl = latencies({"a": 1.0, "b": 2.0, "c": 3.0},
                          {"a": [1.5, 1.75, 2.25], "b": [2.125], "c": []})
    assert ttft == [0.5, 0.125]
    assert itl == [0.25, 0.5]


def _run(itl: float, tok_s: float) -> dict:
    return {"itl_ms": {"p50": itl, "p99": 2 * itl}, "ttft_ms": {"p50": 10.0, "p99": 20.0},
            "tok_s": tok_s, "steps": 100, "complete": 8}


def test_the_table_names_where_delta_is_slower() -> None:
    rounds = [{"round": 1, "default": _run(4.0, 1000), "delta": _run(5.0, 900),
               "ratios": {"itl_p50": 1.25, "itl_p99": 1.25, "ttft_p50": 1.0, "tok_s": 0.9}},
              {"round": 2, "default": _run(4.0, 1000), "delta": _run(3.0, 1100),
               "ratios": {"itl_p50": 0.75, "itl_p99": 0.75, "ttft_p50": 1.0, "tok_s": 1.1}}]
    load = {"rate": 40.0, "requests": 8, "rounds": rounds, "complete": True,
            "median_ratios": {"itl_p50": 1.0, "itl_p99": 1.0, "ttft_p50": 1.0, "tok_s": 1.0}}
    doc = {"tp": 2, "seconds": 6.0, "max_tokens": 64, "max_running": 256, "loads": [load],
           "complete": True}
    fields = from_serving(doc)
    rows = fields["rows"]
    assert [r[:2] for r in rows] == [["40/s", 1], ["40/s", 2], ["40/s", "median"]]
    assert rows[0][-1] == "ITL p50, ITL p99, throughput"
    assert rows[1][-1] == "–" and rows[2][-1] == "–"
    assert all(len(r) == len(fields["columns"]) for r in rows)
    assert fields["targets"][0]["met"] is True


@given(st.lists(st.integers(0, 50), min_size=1, max_size=6))
def test_listed_parses_comma_separated_values_and_refuses_repeats(values: list[int]) -> None:
    parse = listed(int_in(0, 50))  # (--rate and --running of the benchmarks)
    text = ",".join(map(str, values))
    if len(set(values)) == len(values):
        assert parse(text) == values
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="twice"):
            parse(text)
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text + ",51")


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=200), st.floats(0.1, 100))
def test_percentile_is_the_nearest_rank(values: list[float], q: float) -> None:
    """The smallest value with at least q% of the values at or below it."""
    got = percentile(values, q)
    assert got in values
    assert sum(v <= got for v in values) >= q / 100 * len(values)
    assert sum(v < got for v in values) < q / 100 * len(values)
