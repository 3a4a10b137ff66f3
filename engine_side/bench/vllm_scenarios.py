"""The workloads recorded from a real CPU vLLM run (``engine_side.bench.vllm_streams``).

Each :class:`Scenario` is one serving workload: the engine options and the
requests (prompts + SamplingParams) of one ``LLM.generate`` call.  Prompts are
seeded random sequences of the tiny model's words, so every run schedules the
same stream (greedy requests) or the same shapes (sampled ones).  Sizes are
chosen to look like serving (many tokens generated per prompt) yet run in about
a minute each on a 2-core box with the tiny model.

``main`` and ``spec`` are the small coverage scenarios the adapter tests record
(every stream shape in few steps); the other eight are the BENCHMARKS workloads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from engine_side.bench.children import run_in_group

VOCAB = 512
CHILD_TIMEOUT_S = 3600.0  # one benchmark child's run (an LLM's load and generates)
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "seven", "wizards", "quietly", "hex")
COMMON = {"enforce_eager": True, "block_size": 32, "seed": 0}


def build_tiny_model(path: Path, heads: int = 2) -> Path:
    """A random 2-layer Llama (``heads`` heads of 64, bf16: TP up to ``heads``) and a
    512-token BPE tokenizer, offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64 * heads, intermediate_size=128 * heads,
                         num_attention_heads=heads, num_key_value_heads=heads,
                         num_hidden_layers=2, vocab_size=VOCAB,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                         dtype="bfloat16")
    LlamaForCausalLM(config).bfloat16().save_pretrained(path)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [" ".join(WORDS[(i * 7) % len(WORDS):] + WORDS[:i % 5]) for i in range(400)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def text(rng: random.Random, lo: int, hi: int) -> str:
    """A prompt of ``lo``..``hi`` random words (about one token per word)."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


Requests = tuple[list[str], list[Any]]


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    engine: dict[str, Any]
    requests: Callable[[], Requests]
    async_scheduling: bool = False
    tags: tuple[str, ...] = field(default=())

    def engine_kwargs(self) -> dict[str, Any]:
        return {**COMMON, **self.engine}


# ---------------------------------------------------------------- request sets
def _mixed_sampling(i: int, max_tokens: int) -> Any:
    """Half greedy, a quarter top-p, a quarter top-k (unseeded), every output full length."""
    from vllm import SamplingParams

    if i % 4 == 2:
        return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True)
    if i % 4 == 3:
        return SamplingParams(temperature=1.0, top_k=50, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _short_prompts(count: int, max_tokens: int, seed: int) -> Requests:
    rng = random.Random(seed)
    prompts = [text(rng, 8, 40) for _ in range(count)]
    return prompts, [_mixed_sampling(i, max_tokens) for i in range(count)]


def _decode() -> Requests:
    return _short_prompts(256, 128, seed=1)


def _async() -> Requests:
    return _short_prompts(128, 128, seed=8)


def _chunked() -> Requests:
    from vllm import SamplingParams

    rng = random.Random(2)  # unseeded sampling only: seeded + chunked crashes on CPU
    prompts = [text(rng, 1200, 1800) for _ in range(12)]
    return prompts, [SamplingParams(temperature=0 if i % 2 else 0.7, max_tokens=64,
                                    ignore_eos=True) for i in range(12)]


def _preempt() -> Requests:
    rng = random.Random(3)
    prompts = [text(rng, 48, 96) for _ in range(32)]
    return prompts, [_mixed_sampling(i, 128) for i in range(32)]


def _prefix() -> Requests:
    from vllm import SamplingParams

    rng = random.Random(4)
    system = text(rng, 320, 320)
    prompts = [f"{system} {text(rng, 8, 24)}" for _ in range(64)]
    return prompts, [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
                     for _ in prompts]


def _parallel() -> Requests:
    from vllm import SamplingParams

    rng = random.Random(5)
    prompts = [text(rng, 16, 48) for _ in range(24)]
    return prompts, [SamplingParams(n=4, temperature=0.8, top_p=0.95, max_tokens=96,
                                    ignore_eos=True) for _ in prompts]


def _specdec() -> Requests:
    from vllm import SamplingParams

    rng = random.Random(6)  # repeated phrases, so n-gram lookup finds drafts
    prompts = [" ".join([text(rng, 10, 14)] * 4 + [text(rng, 4, 8)]) for _ in range(32)]
    return prompts, [SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
                     for _ in prompts]


def _structured() -> Requests:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams as SO

    rng = random.Random(7)
    schema = {"type": "object", "properties": {"animal": {"enum": ["fox", "dog"]},
                                               "count": {"type": "integer"}},
              "required": ["animal", "count"]}
    kinds = [SO(regex="((fox|dog) )+"), SO(json=schema), SO(choice=["quick fox", "lazy dog"])]
    prompts = [text(rng, 8, 32) for _ in range(32)]  # half regex, a quarter each of the rest
    return prompts, [SamplingParams(temperature=0, max_tokens=64,
                                    structured_outputs=kinds[(0, 0, 1, 2)[i % 4]])
                     for i in range(32)]


def _main() -> Requests:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    base = "the quick brown fox jumps over a lazy dog "
    prompts = [base * 25, base * 6 + "seven", base * 6 + "wizards", "lazy dog " * 5,
               "quietly hex " * 6, "brown fox " * 4, base * 5, "over a lazy dog " * 4]
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=48, logprobs=3),
              SamplingParams(temperature=0, max_tokens=48, stop=["dog"]),
              SamplingParams(temperature=0.8, n=3, max_tokens=32),
              SamplingParams(temperature=0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex="(fox|dog)+")),
              SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)]
    return prompts, params


def _spec_small() -> Requests:
    from vllm import SamplingParams

    prompts = [("the quick brown fox jumps over a lazy dog " * 6) + str(i) for i in range(4)]
    return prompts, [SamplingParams(temperature=0, max_tokens=40) for _ in prompts]


_NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("decode", "256 requests, 8-40-token prompts, 128 output tokens each "
             "(half greedy, half top-p/top-k)", {"max_model_len": 512, "max_num_seqs": 256},
             _decode),
    Scenario("chunked", "12 prompts of 1200-1800 tokens, max_num_batched_tokens=256, "
             "64 output tokens each", {"max_model_len": 2048, "max_num_batched_tokens": 256,
                                       "max_num_seqs": 16}, _chunked),
    Scenario("preemption", "32 requests, 48-96-token prompts, 128 output tokens, "
             "a 64-block KV cache", {"max_model_len": 512, "num_gpu_blocks_override": 64,
                                     "max_num_seqs": 32}, _preempt),
    Scenario("prefix", "64 requests sharing a 320-token system prompt + 8-24-token "
             "question, 64 output tokens, 16 running at a time",
             {"max_model_len": 512, "enable_prefix_caching": True, "max_num_seqs": 16}, _prefix),
    Scenario("parallel", "24 prompts x n=4 (top-p 0.95), 96 output tokens each",
             {"max_model_len": 512, "max_num_seqs": 96}, _parallel),
    Scenario("specdec", "32 greedy requests with repeated phrases, 128 output tokens, "
             "ngram drafts k=4", {"max_model_len": 512, "speculative_config":
                                  {**_NGRAM, "num_speculative_tokens": 4}}, _specdec),
    Scenario("structured", "32 greedy requests, regex / JSON schema / choice "
             "(xgrammar bitmasks), up to 64 output tokens", {"max_model_len": 512},
             _structured),
    Scenario("async", "128 requests as in decode, async scheduling forced on",
             {"max_model_len": 512, "max_num_seqs": 128}, _async, async_scheduling=True),
    # coverage scenarios of tests/test_vllm_adapter.py (not benchmark workloads)
    Scenario("main", "coverage: every stream shape in few steps",
             {"max_model_len": 600, "enable_prefix_caching": True, "max_num_batched_tokens": 128,
              "max_num_seqs": 8, "num_gpu_blocks_override": 20}, _main, tags=("coverage",)),
    Scenario("spec", "coverage: ngram drafts k=3",
             {"max_model_len": 600, "speculative_config":
              {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
               "prompt_lookup_min": 2}}, _spec_small, tags=("coverage",)),
)}
WORKLOADS = tuple(n for n, s in SCENARIOS.items() if "coverage" not in s.tags)


@contextmanager
def async_scheduling(on: bool) -> Iterator[None]:
    """Override the CPU platform, which switches async scheduling off (when ``on``)."""
    if not on:
        yield
        return
    from vllm.platforms.cpu import CpuPlatform

    orig = CpuPlatform.__dict__["check_and_update_config"]

    def patched(cls: Any, vllm_config: Any) -> None:
        orig.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(patched)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = orig  # type: ignore[method-assign]


ROOT = Path(__file__).resolve().parents[2]


T = TypeVar("T")


def listed(one: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse type: comma-separated values, each parsed by ``one`` (e.g.
    :func:`protocol.cli_support.int_in`), none twice."""

    def parse(text: str) -> list[T]:
        values = [one(part) for part in text.split(",")]
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"a value given twice: {text}")
        return values

    return parse


def add_run_options(parser: argparse.ArgumentParser, name: str,
                    executors: Sequence[str]) -> None:
    """The options of a benchmark that runs each executor in a child of its own: its
    work directory, result document and figures, and the child's (hidden) two."""
    parser.add_argument("--work-dir", default=f"/tmp/deltacast-{name}")
    parser.add_argument("--json", default="", help="write the result document here")
    parser.add_argument("--figures", default="", metavar="FILE",
                        help="also write the figures envelope for BENCHMARKS.md here "
                             f"(docs/benchmarks/vllm_{name}.json)")
    parser.add_argument("--executor", choices=executors, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def tree_cpu() -> float:
    """User + system CPU seconds of this process and every descendant (engine core, ranks)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return total


def run_child(module: str, argv: list[str], out: Path, what: str,
              env: dict[str, str] | None = None,
              timeout: float = CHILD_TIMEOUT_S) -> dict[str, Any]:
    """``python -m module *argv`` in a fresh process (an LLM cannot be rebuilt cheaply
    in-process) that writes its result as JSON to ``out``; that result, or RuntimeError
    with the child's stderr tail naming ``what``.  The child and everything it starts
    go when it outlives ``timeout`` seconds (RuntimeError) or this process is stopped
    (SIGTERM included: :func:`engine_side.bench.children.run_in_group`)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    out.unlink(missing_ok=True)
    try:
        _, _, stderr = run_in_group([sys.executable, "-m", module, *argv], timeout,
                                    cwd=ROOT, env=full_env)
    except subprocess.TimeoutExpired as exc:
        written = exc.stderr  # what it wrote so far (bytes)
        tail = written.decode(errors="replace") if isinstance(written, bytes) else written or ""
        raise RuntimeError(f"{what} did not finish in {timeout:g} s and was stopped:\n"
                           f"{tail[-3000:]}") from None
    if not out.exists():
        raise RuntimeError(f"{what} failed:\n{stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result
