"""Real vLLM (CPU) streams: record them, check the round-trip live, compare with pickle.

``python -m engine_side.bench.vllm_streams --model DIR --scenario main --out stats.json``
runs ``LLM.generate`` in-process with a :class:`Recorder` on the executor: every
SchedulerOutput / GrammarOutput / ModelRunnerOutput is encoded, decoded by a fresh
worker-side decoder and (with ``--check``) compared with the original using the
strict test helper.  In the same run each object is also pickled the way vLLM's
MultiprocExecutor does (protocol 5, the ``(method, args, kwargs, rank)`` RPC tuple;
replies ``(SUCCESS, output)``), so bytes and µs are side by side.

Scenarios: ``main`` (chunked prefill of a long prompt, prefix caching,
preemption under a tiny KV cache, n>1, stop strings, logprobs, structured
output) and ``spec`` (ngram speculative decoding).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

VOCAB = 512
_RPC = {"execute_model": "execute_model", "sample_tokens": "sample_tokens"}


def build_tiny_model(path: Path) -> Path:
    """A random 2-layer Llama (head_dim 64, bf16) and a 512-token BPE tokenizer, offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                         torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
             "seven", "wizards", "quietly", "hex"]
    corpus = [" ".join(words[(i * 7) % len(words):] + words[:i % 5]) for i in range(400)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def _pickled(kind: str, obj: Any) -> tuple[int, float, float]:
    """Bytes, dumps s, loads s of vLLM's own message for ``obj``."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    msg = (_RPC[kind], (obj,), {}, 0) if kind in _RPC else \
        (WorkerProc.ResponseStatus.SUCCESS, obj)
    bufs: list[Any] = []
    t0 = time.perf_counter()
    data = pickle.dumps(msg, protocol=5, buffer_callback=bufs.append)
    t1 = time.perf_counter()
    pickle.loads(data, buffers=bufs)  # our own bytes, produced just above
    t2 = time.perf_counter()
    return len(data) + sum(memoryview(b).nbytes for b in bufs), t1 - t0, t2 - t1


def _requests(scenario: str) -> tuple[list[str], list[Any]]:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    base = "the quick brown fox jumps over a lazy dog "
    if scenario == "spec":
        prompts = [(base * 6) + str(i) for i in range(4)]
        return prompts, [SamplingParams(temperature=0, max_tokens=40) for _ in prompts]
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


def _engine_kwargs(scenario: str) -> dict[str, Any]:
    common = {"enforce_eager": True, "block_size": 32, "max_model_len": 600, "seed": 0}
    if scenario == "spec":
        return {**common, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_max": 3, "prompt_lookup_min": 2}}
    return {**common, "enable_prefix_caching": True, "max_num_batched_tokens": 128,
            "max_num_seqs": 8, "num_gpu_blocks_override": 20}


class _Checker:
    """Compares each original with its decoded copy; measures pickle side by side."""

    def __init__(self, check: bool) -> None:
        self.diff = None
        if check:
            sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
            from vllm_equal import differences

            self.diff = differences
        self.failures: list[str] = []
        self.pickle_rows: list[tuple[str, int, float, float]] = []
        self.seen: dict[str, int] = {}

    def __call__(self, kind: str, original: Any, decoded: Any) -> None:
        if self.diff is not None:
            self.failures += [f"{kind}: {d}" for d in self.diff(original, decoded)[:5]]
        self.pickle_rows.append((kind, *_pickled(kind, original)))
        if kind == "execute_model":
            self._coverage(original)
        elif kind == "sample_tokens" and original is not None:
            self.seen["grammar"] = self.seen.get("grammar", 0) + 1

    def _coverage(self, so: Any) -> None:
        c = so.scheduled_cached_reqs
        flags = {"preempted": bool(so.preempted_req_ids), "resumed": bool(c.resumed_req_ids),
                 "spec_tokens": bool(so.scheduled_spec_decode_tokens),
                 "chunked": any(n > 32 for n in so.num_scheduled_tokens.values())
                 and bool(c.req_ids) and any(o == 0 for o in c.num_output_tokens),
                 "prefix_hit": any(nr.num_computed_tokens > 0 for nr in so.scheduled_new_reqs),
                 "all_token_ids": bool(c.all_token_ids)}
        for k, v in flags.items():
            self.seen[k] = self.seen.get(k, 0) + int(v)


def _summary(rows: list[tuple[str, int, float, float]], prows: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, kinds in (("request", ("execute_model", "sample_tokens")),
                        ("reply", ("reply", "sample_reply"))):
        ours = [r for r in rows if r[0] in kinds]
        theirs = [r for r in prows if r[0] in kinds]
        steps = max(1, sum(1 for r in ours if r[0] == kinds[0]))
        per_msg = [(a[2] + a[3]) * 1e6 for a in ours]
        per_msg_p = [(b[2] + b[3]) * 1e6 for b in theirs]
        out[path] = {
            "steps": steps, "bytes_per_step": sum(r[1] for r in ours) / steps,
            "pickle_bytes_per_step": sum(r[1] for r in theirs) / steps,
            "us_median_msg": statistics.median(per_msg) if per_msg else 0.0,
            "pickle_us_median_msg": statistics.median(per_msg_p) if per_msg_p else 0.0,
            "us_per_step": sum(per_msg) / steps, "pickle_us_per_step": sum(per_msg_p) / steps}
    return out


def record_scenario(model: Path, scenario: str, out: Path | None, check: bool,
                    recording: Path | None = None) -> dict[str, Any]:
    """Run one scenario in this process; returns stats (also written to ``out``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm
    from vllm import LLM

    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from engine_side.vllm.record import Recorder, RecordWriter, engine_executor
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    llm = LLM(model=str(model), **_engine_kwargs(scenario))
    checker = _Checker(check)
    writer = None if recording is None else RecordWriter(
        recording, meta={"scenario": scenario}, vllm_version=vllm.__version__)
    recorder = Recorder(writer, SchedulerOutputEncoder(), SchedulerOutputDecoder(), checker)
    recorder.install(engine_executor(llm))
    prompts, params = _requests(scenario)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if writer is not None:
        writer.close()
    stats = {"scenario": scenario, "failures": checker.failures[:50], "seen": checker.seen,
             "outputs": [[list(c.token_ids) for c in o.outputs] for o in outputs],
             **_summary(recorder.stats, checker.pickle_rows)}
    if out is not None:
        out.write_text(json.dumps(stats))
    return stats


# ---------------------------------------------------------------- offline, side by side
def load_recording(path: Path) -> list[tuple[str, Any]]:
    """The original objects of a recording, rebuilt by fresh decoders."""
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from engine_side.vllm.record import RecordReader
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    enc, dec = SchedulerOutputEncoder(), SchedulerOutputDecoder()
    decode = {"execute_model": dec.decode, "sample_tokens": dec.decode_grammar,
              "reply": enc.decode_reply, "sample_reply": enc.decode_reply}
    out = []
    for kind, frames in RecordReader(path):
        out.append((kind, decode[kind](list(frames))))
        if kind == "execute_model":
            enc.encode(out[-1][1])  # the engine side learns the step's batch
    return out


def synthetic_decode(running: int, steps: int, prompt: int = 500) -> list[tuple[str, Any]]:
    """Steady decode of ``running`` requests (34-byte ids, 1 token each, a block per 32 steps)."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    ids = [f"chatcmpl-{i:016x}-{i * 7919 % 65536:08x}"[:34] for i in range(running)]
    sp = SamplingParams(temperature=0, max_tokens=steps + 1)
    blocks = {rid: list(range(k * 64, k * 64 + prompt // 32 + 1)) for k, rid in enumerate(ids)}
    first = SchedulerOutput(
        [NewRequestData(rid, list(range(prompt)), [], sp, None, (blocks[rid],), 0, None)
         for rid in ids], CachedRequestData.make_empty(), dict.fromkeys(ids, prompt),
        prompt * running, {}, {}, set(), [], preempted_req_ids=set())
    out: list[tuple[str, Any]] = [("execute_model", first)]
    for t in range(1, steps):
        computed = prompt + t - 1
        grow = [(k + t) % 32 == 0 for k in range(running)]
        cached = CachedRequestData(
            list(ids), set(), [], {},
            [([k * 64 + 40 + t],) if g else None for k, g in enumerate(grow)],
            [computed] * running, [t] * running)
        out.append(("execute_model", SchedulerOutput(
            [], cached, dict.fromkeys(ids, 1), running, {}, {}, set(), [],
            preempted_req_ids=set())))
        out.append(("reply", ModelRunnerOutput(list(ids), {r: i for i, r in enumerate(ids)},
                                               [[(t * 31 + k) % 500] for k in range(running)])))
    return out


def replay(messages: list[tuple[str, Any]]) -> dict[str, Any]:
    """Median per-step bytes and µs, ours (fresh encoder → fresh decoder) vs pickle."""
    import gc

    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    gc.collect()
    gc.freeze()
    enc, dec = SchedulerOutputEncoder(), SchedulerOutputDecoder()
    route = {"execute_model": (enc.encode, dec.decode),
             "sample_tokens": (enc.encode_grammar, dec.decode_grammar),
             "reply": (dec.encode_reply, enc.decode_reply),
             "sample_reply": (dec.encode_reply, enc.decode_reply)}
    rows: list[tuple[str, int, float, float]] = []
    prows: list[tuple[str, int, float, float]] = []
    for kind, obj in messages:
        encode, decode = route[kind]
        t0 = time.perf_counter()
        frames = [bytes(f) for f in encode(obj)]
        t1 = time.perf_counter()
        decode(frames)
        t2 = time.perf_counter()
        rows.append((kind, sum(map(len, frames)), t1 - t0, t2 - t1))
        prows.append((kind, *_pickled(kind, obj)))
    gc.unfreeze()
    return _step_medians(rows, prows)


def _step_medians(rows: list[Any], prows: list[Any]) -> dict[str, Any]:
    """Per step (a step opens at each execute_model): bytes and µs, summed per path."""
    out: dict[str, Any] = {}
    for path, kinds in (("request", ("execute_model", "sample_tokens")),
                        ("reply", ("reply", "sample_reply"))):
        per_step: list[list[float]] = []
        for (kind, nb, te, td), (_, pb, pd, pl) in zip(rows, prows, strict=True):
            if kind == "execute_model":
                per_step.append([0, 0, 0, 0])
            if kind in kinds and per_step:
                acc = per_step[-1]
                acc[0] += nb
                acc[1] += pb
                acc[2] += (te + td) * 1e6
                acc[3] += (pd + pl) * 1e6
        cols = list(zip(*per_step, strict=True)) if per_step else [[0.0]] * 4
        out[path] = {"steps": len(per_step), "bytes": sum(cols[0]), "pickle_bytes": sum(cols[1]),
                     "median_bytes": statistics.median(cols[0]),
                     "pickle_median_bytes": statistics.median(cols[1]),
                     "median_us": statistics.median(cols[2]),
                     "pickle_median_us": statistics.median(cols[3])}
    return out


def run(args: argparse.Namespace) -> int:
    if args.replay:
        table = {Path(p).stem: replay(load_recording(Path(p))) for p in args.replay}
        for n in args.synthetic:
            table[f"synthetic-{n}"] = replay(synthetic_decode(n, 20))
        print(json.dumps(table, indent=1))
        return 0
    model = build_tiny_model(Path(args.model))
    stats = record_scenario(model, args.scenario, Path(args.out) if args.out else None,
                            args.check, Path(args.record) if args.record else None)
    print(json.dumps({k: v for k, v in stats.items() if k != "outputs"}, indent=1))
    return 1 if stats["failures"] else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="tiny model dir (built if missing)")
    parser.add_argument("--scenario", choices=("main", "spec"), default="main")
    parser.add_argument("--out", default="", help="write stats JSON here")
    parser.add_argument("--record", default="", help="also write a deltacast recording")
    parser.add_argument("--check", action="store_true", help="strict live equality checks")
    parser.add_argument("--replay", nargs="*", default=[], help="recordings to measure offline")
    parser.add_argument("--synthetic", nargs="*", type=int, default=[],
                        help="also measure synthetic steady decode at these batch sizes")


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
