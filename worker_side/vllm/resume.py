"""A vLLM rank takes over requests that resume after its group was restarted.

The engine sends each such request as a new one with the tokens it sampled before the
restart (SPEC §16 ``ro``).  vLLM's model runner builds a new request's state with no
sampled tokens, and recovers them only for a request it already holds that resumes
from preemption.  So the rank first registers these requests with the runner (their
step schedules no token: the runner updates its states and returns), sets their
sampled tokens (the step names every request it schedules, so the runner keeps the
others in its batch), and then hands it the step with them resumed from preemption: the
runner's own path, as when vLLM preempts and resumes a request on one process.

A seeded request's generator is new (seeded afresh): it is advanced by the draws its
sampler made for the tokens already sampled (:func:`advance`), so the request goes on
with the random stream an undisturbed run would have used.
"""

from __future__ import annotations

from typing import Any


def resume(runner: Any, so: Any, restored: dict[str, list[int]]) -> None:
    """Register ``so``'s new requests named in ``restored`` (id -> sampled tokens) with
    ``runner`` and move them, in place, to ``so``'s cached requests, resumed."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    moving = [nr for nr in so.scheduled_new_reqs if nr.req_id in restored]
    runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=moving, scheduled_cached_reqs=CachedRequestData.make_empty(),
        # every request of the step "scheduled" (no token): the runner keeps the others
        num_scheduled_tokens=dict.fromkeys(so.num_scheduled_tokens, 0),
        total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[]))
    cached = so.scheduled_cached_reqs
    for nr in moving:
        tokens = restored[nr.req_id]
        state = runner.requests[nr.req_id]
        state.output_token_ids = list(tokens)
        if state.generator is not None:
            advance(runner, state.generator, len(tokens))
        cached.req_ids.append(nr.req_id)
        cached.resumed_req_ids.add(nr.req_id)
        if cached.new_token_ids:
            cached.new_token_ids.append([])
        prompt = nr.prompt_token_ids if nr.prompt_token_ids is not None \
            else [0] * nr.prompt_len  # (prompt embeds: the runner reads the tokens' tail)
        cached.all_token_ids[nr.req_id] = [*prompt, *tokens]
        cached.new_block_ids.append(nr.block_ids)
        cached.num_computed_tokens.append(nr.num_computed_tokens)
        cached.num_output_tokens.append(len(tokens))
    so.scheduled_new_reqs = [nr for nr in so.scheduled_new_reqs if nr.req_id not in restored]


def advance(runner: Any, generator: Any, draws: int) -> None:
    """Advance a seeded request's ``generator`` by what ``runner``'s sampler draws for
    ``draws`` sampled tokens, one sampling step each.  vLLM's CPU sampler draws one
    seed per step (``torch.randint``); the native one an exponential row over the
    vocabulary (a speculative decoding step's rejection sampler draws otherwise: not
    replayed)."""
    import torch

    sampler = runner.sampler.topk_topp_sampler
    fp64 = bool(getattr(sampler, "use_fp64_gumbel", False))
    if getattr(sampler.forward, "__func__", None) is getattr(type(sampler), "forward_cpu",
                                                              None) and not fp64:
        for _ in range(draws):
            torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long)
        return
    row = torch.empty(runner.model_config.get_vocab_size(),
                      dtype=torch.float64 if fp64 else torch.float32, device=generator.device)
    for _ in range(draws):
        row.exponential_(generator=generator)
