"""COCONUT, CODI and LOTUS through the real vLLM engine, token for token against the references.

One engine per family (module-scoped, parametrized), each with a KV cache so small that the mixed
batch below must preempt requests: the outputs must not change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_loop.testing.engines import start_llm, stop_llm

FAMILIES = {
    "coconut": ("coconut", {}),
    "codi-gpt2": ("codi", {"base": "gpt2"}),
    "codi-llama": ("codi", {"base": "llama"}),
    "lotus": ("lotus", {}),
}
QUESTIONS = [
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\n",
    "A train travels 60 miles in 2 hours.\n",
    "x\n",
    "Mary reads 12 pages a day for 4 days. How many pages does she read?\n",
]
BLOCK = 16
NUM_BLOCKS = 24  # 384 KV slots for a batch that needs about twice that: requests get preempted


@pytest.fixture(scope="module", params=list(FAMILIES))
def latent(request, ckpt_factory):
    from transformers import AutoTokenizer

    from vllm_loop.latent.spec import LatentSpec
    from vllm_loop.reference.latent import load_latent_reference

    family, options = FAMILIES[request.param]
    path = ckpt_factory(family, options=options)
    spec = LatentSpec.from_config(json.loads((Path(path) / "config.json").read_text()))
    llm = start_llm(path, max_model_len=256, block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS,
                    max_num_seqs=16, disable_log_stats=False)
    yield {"name": request.param, "llm": llm, "spec": spec, "ref": load_latent_reference(path),
           "tok": AutoTokenizer.from_pretrained(path)}
    stop_llm(llm)


def _params(budget, max_tokens=16):
    from vllm import SamplingParams

    extra = None if budget is None else {"latent_budget": budget}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)


def _latent_phase(spec, budget: int) -> list[int]:
    """What a feedback model emits before its answer: start, one placeholder per thought, end."""
    return list(spec.start_token_ids) + [None] * budget + list(spec.end_token_ids)


def _check(latent, prompt: list[int], budget: int | None, out, max_tokens: int = 16) -> None:
    spec, ref = latent["spec"], latent["ref"]
    n = spec.default_budget if budget is None else budget
    answer, info = ref.generate(prompt, latent_budget=n, max_new_tokens=max_tokens, ignore_eos=True)
    got = list(out.outputs[0].token_ids)
    if spec.kind == "feedback":
        phase = _latent_phase(spec, n)
        head, got = got[: len(phase)], got[len(phase):]
        assert [h for h, p in zip(head, phase) if p is not None] == [p for p in phase if p is not None]
        assert len(head) == len(phase), "one output per latent step"
    else:  # LOTUS: the block was appended to the prompt by the front end
        assert len(out.prompt_token_ids) == len(prompt) + spec.appended_tokens(n)
    assert got == answer, f"{latent['name']} budget {n}: {got} != {answer}"


def _preemptions(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


@pytest.mark.engine
def test_mixed_budgets_in_one_batch_match_reference_under_preemption(latent):
    spec, tok = latent["spec"], latent["tok"]
    budgets = [0, None, spec.default_budget + 3]  # None: the model's trained default
    prompts = [tok(q).input_ids for q in QUESTIONS]
    batch = [(p, b) for p in prompts for b in budgets]
    before = _preemptions(latent["llm"])
    outs = latent["llm"].generate([{"prompt_token_ids": p} for p, _ in batch], [_params(b, 24) for _, b in batch])
    assert _preemptions(latent["llm"]) > before, "the small KV cache must force preemption in this batch"
    for (p, b), out in zip(batch, outs):
        _check(latent, p, b, out, 24)


@pytest.mark.engine
def test_shared_prompt_different_budgets_no_wrong_prefix_reuse(latent):
    """The second request shares the first one's whole prompt (cached by then) with another budget."""
    spec, tok = latent["spec"], latent["tok"]
    prompt = tok(QUESTIONS[0]).input_ids
    for budget in (spec.default_budget, spec.default_budget + 2, spec.default_budget):
        (out,) = latent["llm"].generate([{"prompt_token_ids": prompt}], [_params(budget)])
        _check(latent, prompt, budget, out)


@pytest.mark.engine
def test_bad_budget_is_rejected_and_engine_keeps_serving(latent):
    spec, tok = latent["spec"], latent["tok"]
    prompt = tok(QUESTIONS[2]).input_ids
    for bad in (-1, 2.5, True, "3", spec.max_budget + 1):
        with pytest.raises(ValueError, match=rf"latent_budget.*\[0, {spec.max_budget}\]"):
            latent["llm"].generate([{"prompt_token_ids": prompt}], [_params(bad)])
    (out,) = latent["llm"].generate([{"prompt_token_ids": prompt}], [_params(1)])
    _check(latent, prompt, 1, out)
