"""COCONUT, CODI and LOTUS through the real vLLM engine, token for token against the references.

One engine per family (module-scoped, parametrized), each with a KV cache so small that the mixed
batch below must preempt requests: the outputs must not change.

Output contract (``vllm_loop/latent/spec.py``): ``token_ids`` / ``text`` / ``logprobs`` hold the
answer only and ``max_tokens`` bounds it; the latent phase (start, latent positions, end) ends
``prompt_token_ids`` for every family.
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
    from vllm_loop.reference.latent_loading import load_latent_reference

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


def _check(latent, prompt: list[int], budget: int | None, out, max_tokens: int = 16) -> None:
    spec, ref = latent["spec"], latent["ref"]
    n = spec.default_budget if budget is None else budget
    answer, info = ref.generate(prompt, latent_budget=n, max_new_tokens=max_tokens, ignore_eos=True)
    got = list(out.outputs[0].token_ids)
    assert got == answer, f"{latent['name']} budget {n}: {got} != {answer}"
    assert len(got) <= max_tokens
    # the latent phase ends the prompt: start tokens, one placeholder per latent position, end tokens
    start, end = list(spec.start_token_ids), list(spec.end_token_ids)
    shown = list(out.prompt_token_ids)
    assert shown[: len(prompt)] == prompt and len(shown) == len(prompt) + spec.appended_tokens(n)
    phase = shown[len(prompt):]
    assert phase[: len(start)] == start and phase[len(phase) - len(end):] == end
    assert len(set(phase[len(start): len(phase) - len(end)])) <= 1, "one placeholder id at latent positions"
    assert spec.phase_budget(shown) == n
    # the answer's text (vLLM holds back incomplete UTF-8 where a batch decode writes U+FFFD)
    text = out.outputs[0].text.replace("\ufffd", "")
    assert text == latent["tok"].decode(got, skip_special_tokens=True).replace("\ufffd", "")


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


@pytest.mark.engine
def test_answer_only_output_with_logprobs_n_and_stop_strings(latent):
    """``logprobs`` align with the answer's tokens, ``n=2`` children each report the phase once, and
    a stop string is matched in the answer only."""
    from vllm import SamplingParams

    spec, tok = latent["spec"], latent["tok"]
    prompt = tok(QUESTIONS[1]).input_ids
    # n > 1 needs a sampling request: top_k=1 samples the argmax, i.e. the greedy answer
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True, logprobs=2, n=2,
                            extra_args={"latent_budget": 3})
    (out,) = latent["llm"].generate([{"prompt_token_ids": prompt}], params)
    answer, _ = latent["ref"].generate(prompt, latent_budget=3, max_new_tokens=8, ignore_eos=True)
    assert len(out.outputs) == 2 and len(out.prompt_token_ids) == len(prompt) + spec.appended_tokens(3)
    for o in out.outputs:
        assert list(o.token_ids) == answer
        assert len(o.logprobs) == len(answer)
        assert all(t in lp for t, lp in zip(answer, o.logprobs)), "logprobs of the answer's own tokens"
    # a stop string taken from the answer's text: the output stops at its first occurrence
    full = out.outputs[0].text
    stop = full.strip()[-2:]
    if stop:
        (out,) = latent["llm"].generate([{"prompt_token_ids": prompt}], [SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop], extra_args={"latent_budget": 3})])
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text == full[: full.index(stop)]
