"""Multimodal requests and prompt embeds through a real DeltaExecutor (vLLM CPU build).

One subprocess (tests/vllm_mm_run.py) builds a tiny random Qwen2-Audio model
offline and runs vLLM's default executor and DeltaExecutor (with a
shared-memory store) on two audio prompts, one prompt-embeds prompt and the
first clip again; a recorder on each worker digests every NewRequestData it got.
(Vision models cannot run here: vLLM's CLIP/SigLIP path imports transformers'
pixtral image processor, which needs torchvision.)  Skipped without vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    where = tmp_path_factory.mktemp("vllm-mm")
    out = where / "run.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_mm_run.py"),
                           str(where / "tiny-qwen2-audio"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _without_ids(seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k != "req_id"} for e in seen]


def test_outputs_match_the_default_executor(run: dict[str, Any]) -> None:
    default, delta = run["default"]["outputs"], run["delta"]["outputs"]
    assert [len(r) for r in delta] == [3, 1]  # 2 audio + 1 prompt-embeds prompt, then a repeat
    assert delta == default  # token ids and top-3 logprobs at every step


def test_the_audio_reaches_the_model(run: dict[str, Any]) -> None:
    first = run["delta"]["outputs"][0]
    assert first[0]["prompt"] == first[1]["prompt"]  # same text, different clips ...
    assert first[0]["lp"] != first[1]["lp"]  # ... so the features changed the logits


def test_workers_got_exactly_what_the_default_path_delivers(run: dict[str, Any]) -> None:
    seen = run["delta"]["seen"]
    assert _without_ids(seen) == _without_ids(run["default"]["seen"])
    audio = [e for e in seen if e["features"]]
    assert len(audio) == 3 and all(f[6] is not None for e in audio for f in e["features"])
    assert [e["embeds"] for e in seen if e["embeds"]] == [run["delta"]["embeds_sent"]]


def test_items_went_through_the_store_once(run: dict[str, Any]) -> None:
    store = run["delta"]["store"]
    assert store["readers"] == 1 and store["inline"] == 0
    assert store["written"] == 3  # two clips + the prompt embeds
    assert store["hits"] >= 1  # the first clip again: not written twice
