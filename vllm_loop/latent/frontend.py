"""Front-end (API server / ``LLM``) side of a latent request: check the knob, shape the request.

Runs in vLLM's input processing, before the request reaches the engine, so a bad
``latent_budget`` is a ``ValueError`` there (HTTP 400 over the OpenAI API) and never reaches a
worker. What it does to a request of a latent model (``n`` = the resolved budget):

* stores ``n`` and the prompt length in ``extra_args`` for the driver;
* looped (LOTUS): appends start, ``n * c_thought`` latent tokens and end to the prompt;
* feedback (COCONUT, CODI): the engine generates the forced latent phase (start, one placeholder
  per thought, end) as its first outputs, so the engine-side ``max_tokens`` (and a non-zero
  ``min_tokens``) is raised by that many tokens and their count is stored in ``extra_args``
  (``PHASE_KEY``); the front end's output processing (``vllm_patches.latent.install_latent_outputs``)
  moves them from the output to the end of the prompt, so the user receives the answer only and
  ``max_tokens`` bounds it -- the same shape a LOTUS request has;
* marks the request to skip reading the prefix cache (see ``driver.py``).
"""

from __future__ import annotations

from vllm_loop.latent.driver import PROMPT_LEN_KEY
from vllm_loop.latent.spec import LATENT_BUDGET_KEY, LatentSpec, resolve_latent_budget

PHASE_KEY = "latent_phase_tokens"  # feedback: engine outputs that are the forced latent phase


def prepare_request(request, spec: LatentSpec | None, max_model_len: int) -> None:
    """Validate and shape an ``EngineCoreRequest`` in place (plain models: validation only)."""
    params = request.sampling_params
    if params is None:  # pooling
        return
    budget = resolve_latent_budget(params.extra_args, spec)
    if spec is None:
        return
    prompt = list(request.prompt_token_ids or [])
    params.extra_args = {**(params.extra_args or {}), LATENT_BUDGET_KEY: budget, PROMPT_LEN_KEY: len(prompt)}
    params.skip_reading_prefix_cache = True
    appended = spec.appended_tokens(budget)
    if spec.kind == "looped":
        block = [spec.latent_token_id] * spec.latent_positions(budget)
        request.prompt_token_ids = prompt + list(spec.start_token_ids) + block + list(spec.end_token_ids)
    else:
        if getattr(params, "structured_outputs", None) is not None:
            raise ValueError(
                f"{LATENT_BUDGET_KEY}: structured outputs (guided decoding) are not supported for this latent "
                "model: its latent phase is generated as forced tokens, which the grammar would constrain too"
            )
        params.extra_args[PHASE_KEY] = appended
        params.max_tokens += appended
        if params.min_tokens:
            params.min_tokens += appended
    if len(prompt) + appended >= max_model_len:
        raise ValueError(
            f"{LATENT_BUDGET_KEY}={budget}: the prompt ({len(prompt)} tokens) plus the latent phase "
            f"({appended} tokens) leaves no room for an answer within max_model_len={max_model_len}"
        )
