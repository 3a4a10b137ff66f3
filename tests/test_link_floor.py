"""The transport-floor benchmark (engine_side/bench/link_floor.py) at a tiny size: every
path carries every message to the reader and back (a lost one fails the run) and the
figures are consistent; no wall-clock assertions.  Skipped without network namespaces."""

from __future__ import annotations

import pytest

from engine_side.bench import link_floor, netns

pytestmark = pytest.mark.skipif(netns.unavailable() is not None,
                                reason=str(netns.unavailable()))


def test_every_path_carries_every_step() -> None:
    doc = link_floor.run(steps=300, rounds=1)
    assert set(doc["modes"]) == set(link_floor.MODES)
    for mode, figures in doc["modes"].items():
        assert 0 < figures["median_us"] <= figures["p99_us"], mode
        assert len(figures["medians_us"]) == 1, mode


def test_too_few_steps_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="at least 10 steps"):
        link_floor.run(steps=5, rounds=1)
    assert link_floor.main(["--steps", "5"]) == 2
