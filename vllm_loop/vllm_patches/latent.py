"""Latent reasoning (COCONUT, CODI, LOTUS) at vLLM's seams: ``latent_budget`` checked and latent
requests shaped in the front end, the latent driver beside the V1 model runner, latent models kept
off Model Runner V2, and the latent phase moved from a request's output to its prompt before the
user sees it (``vllm_loop/latent/``)."""

from __future__ import annotations

from vllm_loop import get_logger
from vllm_loop.vllm_patches import patch

logger = get_logger(__name__)


def install() -> None:
    install_latent_frontend()
    install_latent_runner()
    install_latent_config()
    install_latent_outputs()


def _latent_spec(model_config):
    from vllm_loop.latent.spec import LatentSpec

    return LatentSpec.from_config(model_config.hf_config)


def install_latent_frontend() -> None:
    """Check ``latent_budget`` and shape latent requests where vLLM turns a prompt into an engine
    request (``InputProcessor.process_inputs``, process 0): the one place that sees every request
    from ``LLM.generate`` and from the API server, and whose ``ValueError`` becomes an HTTP 400."""
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_loop.latent.frontend import prepare_request

    original = InputProcessor.process_inputs

    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        prepare_request(request, _latent_spec(self.model_config), self.model_config.max_model_len)
        return request

    patch(InputProcessor, "process_inputs", "latent.frontend", process_inputs)


def _step_rows(runner, scheduler_output, driver):
    from vllm_loop.latent.driver import StepRow

    rows = []
    qsl = runner.query_start_loc.np
    for i, req_id in enumerate(runner.input_batch.req_ids[: runner.input_batch.num_reqs]):
        state = runner.requests[req_id]
        n = scheduler_output.num_scheduled_tokens[req_id]
        driver.track(req_id, state.sampling_params.extra_args, state.num_prompt_tokens)
        rows.append(StepRow(req_id, int(qsl[i]), state.num_computed_tokens, n,
                            state.num_computed_tokens + n >= state.num_tokens, len(state.output_token_ids)))
    return rows


def _driver(runner):
    """The runner's latent driver, or None when its model is not a latent model."""
    if not hasattr(runner, "_vllm_loop_driver"):
        from vllm_loop.latent.driver import LatentDriver

        model = runner.get_model()
        spec = getattr(model, "latent_spec", None)
        placeholder = None
        if spec is not None:
            codi = getattr(model, "codi", None) or {}
            placeholder = spec.latent_token_id if spec.latent_token_id is not None else codi.get("pad_token_id")
            placeholder = placeholder if placeholder is not None else spec.start_token_ids[-1]
        runner._vllm_loop_driver = LatentDriver(spec, placeholder) if spec is not None else None
    return runner._vllm_loop_driver


def install_latent_runner() -> None:
    """Drive latent requests from vLLM's V1 model runner (the CPU runner subclasses it; latent models
    are kept off Model Runner V2, see ``install_latent_config``). Three private seams:
    ``execute_model`` (the step's scheduler output, finished requests), ``_model_forward`` (fill the
    inject buffers before, store fed-back vectors after) and ``_sample`` (force the latent phase)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    execute_model, model_forward, sample = (
        GPUModelRunner.execute_model, GPUModelRunner._model_forward, GPUModelRunner._sample)

    def execute_model_hook(self, scheduler_output, *args, **kwargs):
        driver = _driver(self)
        if driver is not None:
            driver.finish(scheduler_output.finished_req_ids)
            self._vllm_loop_step = scheduler_output
        return execute_model(self, scheduler_output, *args, **kwargs)

    def model_forward_hook(self, *args, **kwargs):
        driver, step = _driver(self), getattr(self, "_vllm_loop_step", None)
        if driver is None or step is None:
            return model_forward(self, *args, **kwargs)
        self._vllm_loop_step = None
        model = self.get_model()
        rows = _step_rows(self, step, driver)
        driver.before_forward(model, rows)
        out = model_forward(self, *args, **kwargs)
        driver.after_forward(model, out, rows)
        self._vllm_loop_rows = rows
        return out

    def sample_hook(self, logits, spec_decode_metadata):
        rows = getattr(self, "_vllm_loop_rows", None)
        if rows is not None and logits is not None:
            self._vllm_loop_rows = None
            _driver(self).adjust_logits(logits, rows)
        return sample(self, logits, spec_decode_metadata)

    patch(GPUModelRunner, "execute_model", "latent.runner", execute_model_hook)
    patch(GPUModelRunner, "_model_forward", "latent.runner", model_forward_hook)
    patch(GPUModelRunner, "_sample", "latent.runner", sample_hook)


def install_latent_config() -> None:
    """Latent models run on the V1 model runner (where the driver hooks live): report them as a
    feature Model Runner V2 does not support, which makes vLLM fall back to V1 as it does for other
    unsupported features."""
    from vllm.config import VllmConfig

    from vllm_loop.latent import LATENT_ARCHITECTURES

    original = VllmConfig._get_v2_model_runner_unsupported_features

    def unsupported(self):
        found = original(self)
        archs = getattr(self.model_config, "architectures", None) or []
        if any(a in LATENT_ARCHITECTURES for a in archs):
            found.append("latent-reasoning models (vllm-loop)")
        return found

    patch(VllmConfig, "_get_v2_model_runner_unsupported_features", "latent.config", unsupported)


def install_latent_outputs() -> None:
    """What the user receives from a feedback latent request (COCONUT, CODI): the answer only.

    The engine emits the forced latent phase (start, one placeholder per thought, end) as the
    request's first outputs; ``OutputProcessor`` (process 0, which serves ``LLM`` and the API
    server alike) turns engine outputs into ``RequestOutput``s. Before it detokenizes, checks stop
    strings or collects logprobs, the phase's tokens are moved from the output to the end of the
    request's prompt, so ``text`` / ``token_ids`` / ``logprobs`` / ``usage.completion_tokens`` are
    the answer, ``max_tokens`` / ``min_tokens`` / stop strings apply to the answer, and
    ``prompt_token_ids`` / ``usage.prompt_tokens`` hold prompt + latent phase -- the same shape a
    LOTUS request has (its phase is appended to the prompt up front). No output is emitted while
    only phase tokens have arrived (a stream starts with the first answer token)."""
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState
    from vllm.v1.outputs import LogprobsLists

    from vllm_loop.latent.frontend import PHASE_KEY

    add_request, process_outputs, make_request_output = (
        OutputProcessor.add_request, OutputProcessor.process_outputs, RequestState.make_request_output)

    def add_request_hook(self, request, *args, **kwargs):
        add_request(self, request, *args, **kwargs)
        params = request.sampling_params
        state = self.request_states.get(request.request_id)
        phase = int(((params.extra_args or {}) if params is not None else {}).get(PHASE_KEY, 0))
        if state is None or phase <= 0 or getattr(state, "_vllm_loop_phase", None) is not None:
            return
        state._vllm_loop_phase = phase  # phase tokens still to come
        if state.max_tokens_param is not None:  # the user's max_tokens, for vLLM's request stats
            state.max_tokens_param -= phase
        detok = state.detokenizer
        if getattr(detok, "min_tokens", 0):  # stop strings count answer tokens
            detok.min_tokens = max(0, detok.min_tokens - phase)

    def process_outputs_hook(self, engine_core_outputs, *args, **kwargs):
        held = []
        for out in engine_core_outputs:
            state = self.request_states.get(out.request_id)
            left = getattr(state, "_vllm_loop_phase", 0)
            if not left:
                continue
            k = min(left, len(out.new_token_ids))
            if k:
                phase = list(out.new_token_ids[:k])
                out.new_token_ids = list(out.new_token_ids[k:])
                if out.new_logprobs is not None:
                    lp = out.new_logprobs
                    out.new_logprobs = LogprobsLists(lp.logprob_token_ids[k:], lp.logprobs[k:],
                                                     lp.sampled_token_ranks[k:], None)
                # a new list: n > 1 children share the request's prompt list
                state.prompt_token_ids = list(state.prompt_token_ids or []) + phase
                state.prompt_len = len(state.prompt_token_ids)
                prompt_logprobs = getattr(state.logprobs_processor, "prompt_logprobs", None)
                if prompt_logprobs is not None:
                    for _ in phase:
                        prompt_logprobs.append(None)
                state._vllm_loop_phase = left - k
            if not out.new_token_ids and out.finish_reason is None:
                state._vllm_loop_hold = True  # only phase tokens so far: nothing to show yet
                held.append(state)
        try:
            return process_outputs(self, engine_core_outputs, *args, **kwargs)
        finally:
            for state in held:
                state._vllm_loop_hold = False

    def make_request_output_hook(self, *args, **kwargs):
        if getattr(self, "_vllm_loop_hold", False):
            return None
        return make_request_output(self, *args, **kwargs)

    patch(OutputProcessor, "add_request", "latent.outputs", add_request_hook)
    patch(OutputProcessor, "process_outputs", "latent.outputs", process_outputs_hook)
    patch(RequestState, "make_request_output", "latent.outputs", make_request_output_hook)
