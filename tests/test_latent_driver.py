"""The latent driver on its own (no engine): forced tokens, suppression, inject buffers, ledger."""

import torch

from vllm_loop.latent.driver import LatentDriver, StepRow
from vllm_loop.latent.spec import LatentSpec

VOCAB, HIDDEN = 16, 4
# CODI-like: start 10, end 11, and 11 is also suppressed in answers; placeholder 12.
FEEDBACK = LatentSpec(kind="feedback", default_budget=2, start_token_ids=(10,), end_token_ids=(11,),
                      suppress_token_ids=(11,))


class FakeModel:
    """The buffers and feedback head the driver fills and calls."""

    def __init__(self, rows: int = 8):
        self.latent_mask = torch.zeros(rows, dtype=torch.bool)
        self.latent_embeds = torch.zeros(rows, HIDDEN)
        self.loop_row_passes = torch.zeros(rows, dtype=torch.int32)
        self.loop_passes = 0

    def latent_feedback(self, h):
        return 2 * h


def sampled(driver, req_id, out_index, logits_row=None):
    logits = torch.zeros(1, VOCAB) if logits_row is None else logits_row.clone()[None]
    driver.adjust_logits(logits, [StepRow(req_id, 0, 0, 1, True, out_index)])
    return int(logits[0].argmax()), logits[0]


def test_forced_phase_then_answer_with_suppression():
    driver = LatentDriver(FEEDBACK, placeholder_id=12)
    driver.track("a", {"latent_budget": 3}, num_prompt_tokens=5)
    # start token, 3 placeholders, end token -- although 11 is in suppress_token_ids
    assert [sampled(driver, "a", k)[0] for k in range(5)] == [10, 12, 12, 12, 11]
    favour_end = torch.zeros(VOCAB)
    favour_end[11], favour_end[3] = 5.0, 1.0
    token, row = sampled(driver, "a", 5, favour_end)
    assert token == 3 and row[11] == float("-inf") and row[3] == 1.0


def test_rows_that_do_not_sample_are_not_forced():
    driver = LatentDriver(FEEDBACK, placeholder_id=12)
    driver.track("a", None, num_prompt_tokens=5)
    logits = torch.arange(VOCAB, dtype=torch.float)[None].repeat(2, 1)
    driver.track("b", {"latent_budget": 0}, num_prompt_tokens=3)
    driver.adjust_logits(logits, [StepRow("a", 0, 0, 5, False, 0), StepRow("b", 5, 0, 3, True, 1)])
    assert logits[0, :11].tolist() == list(range(11))  # only suppression touched it
    assert int(logits[1].argmax()) == 11  # b: budget 0, index 1 = its end token


def test_ledger_feeds_back_the_previous_hidden_state_and_fills_the_mask():
    driver, model = LatentDriver(FEEDBACK, placeholder_id=12), FakeModel()
    req = driver.track("a", {"latent_budget": 2}, num_prompt_tokens=3)
    assert list(driver.latent_positions(req)) == [4, 5]  # prompt 0..2, start token at 3
    # prefill of 3 prompt tokens + decode of the start token (position 3) -> stores vector for 4
    hidden = torch.arange(4 * HIDDEN, dtype=torch.float).view(4, HIDDEN)
    driver.after_forward(model, hidden[:3], [StepRow("a", 0, 0, 3, True, 0)])
    assert req.ledger == {}
    driver.after_forward(model, hidden[3:], [StepRow("a", 0, 3, 1, True, 1)])
    assert torch.equal(req.ledger[4], 2 * hidden[3])
    # the step whose input is position 4 gets that vector injected at its row
    driver.before_forward(model, [StepRow("a", 2, 4, 1, True, 2)])
    assert model.latent_mask.tolist() == [False, False, True] + [False] * 5
    assert torch.equal(model.latent_embeds[2], 2 * hidden[3])
    # a later plain step clears the mask again
    driver.before_forward(model, [StepRow("a", 0, 7, 1, True, 5)])
    assert not model.latent_mask.any()


def test_finish_frees_the_ledger():
    driver = LatentDriver(FEEDBACK, placeholder_id=12)
    driver.track("a", None, num_prompt_tokens=3)
    driver.finish({"a", "unknown"})
    assert driver.requests == {}


# -- front end: what a request becomes, and the step count read back from an output -------------------------
LOOPED = LatentSpec(kind="looped", default_budget=2, c_thought=3, start_token_ids=(10,), end_token_ids=(11,),
                    latent_token_id=12)


def _request(prompt, **params):
    from types import SimpleNamespace

    from vllm import SamplingParams

    return SimpleNamespace(prompt_token_ids=list(prompt), sampling_params=SamplingParams(**params))


def test_front_end_shapes_feedback_and_looped_requests():
    from vllm_loop.latent.frontend import PHASE_KEY, prepare_request

    req = _request([1, 2, 3], max_tokens=5, extra_args={"latent_budget": 3})
    prepare_request(req, FEEDBACK, max_model_len=64)
    phase = FEEDBACK.appended_tokens(3)  # start, 3 thoughts, end
    assert req.prompt_token_ids == [1, 2, 3] and req.sampling_params.max_tokens == 5 + phase
    assert req.sampling_params.extra_args[PHASE_KEY] == phase and req.sampling_params.skip_reading_prefix_cache
    req = _request([1, 2, 3], max_tokens=5)
    prepare_request(req, LOOPED, max_model_len=64)
    assert req.prompt_token_ids == [1, 2, 3, 10] + [12] * 6 + [11] and req.sampling_params.max_tokens == 5
    assert PHASE_KEY not in req.sampling_params.extra_args


def test_structured_outputs_are_refused_for_feedback_models_only():
    import pytest
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_loop.latent.frontend import prepare_request

    with pytest.raises(ValueError, match="structured outputs"):
        prepare_request(_request([1, 2], structured_outputs=StructuredOutputsParams(regex="a+")), FEEDBACK, 64)
    prepare_request(_request([1, 2], structured_outputs=StructuredOutputsParams(regex="a+")), LOOPED, 64)


def test_phase_budget_reads_the_step_count_back():
    for n in (0, 1, 4):
        assert FEEDBACK.phase_budget([5, 6] + [10] + [12] * n + [11]) == n
        assert LOOPED.phase_budget([5, 6, 10] + [12] * (3 * n) + [11]) == n
    assert FEEDBACK.phase_budget([5, 6, 7]) is None  # no latent phase at the end
    assert LOOPED.phase_budget([10, 12, 12, 11]) is None  # not a whole number of loops
    two = LatentSpec(kind="feedback", default_budget=1, start_token_ids=(2, 10), end_token_ids=(11, 2))
    assert two.phase_budget([7, 2, 10, 9, 9, 11, 2]) == 2
