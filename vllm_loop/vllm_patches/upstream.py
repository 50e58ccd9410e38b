"""Upstream fixes: hooks that correct vLLM 0.26 for every model (or, where noted, the plugin's
models only), each with the vLLM behaviour it fixes and when it can go. None of them is needed for
LoopSpec or the latent models' own features; they keep a server up and its exit status honest."""

from __future__ import annotations

from vllm_loop import get_logger
from vllm_loop.vllm_patches import patch

logger = get_logger(__name__)


def install() -> None:
    install_server_exit_status()
    install_prompt_vocab_check()
    install_cpu_seeded_chunked_prefill()
    install_cpu_seeded_sampling()
    install_cpu_rejection_expand()


def install_server_exit_status() -> None:
    """``vllm serve`` exits with status 0 when its engine dies (a killed worker, a dead Ray actor): the
    watchdog in vllm/entrypoints/launcher.py stops uvicorn just as a requested shutdown does, so a
    supervisor (systemd, Kubernetes, Ray Serve) reads a crash as a clean stop. Exit 1 instead.

    ``serve_http`` returns the coroutine the caller awaits after the engine client is closed: vLLM's
    ``dummy_shutdown`` when uvicorn stopped by itself, ``server.shutdown()`` after a signal. Stopped by
    itself with the engine already errored = the engine died. Only in the API server process
    (api_server is imported there before plugins load; ``serve_http`` is looked up at call time)."""
    import sys

    api = sys.modules.get("vllm.entrypoints.openai.api_server")
    if api is None:
        return
    serve_http = api.serve_http

    async def serve_http_with_exit_status(app, *args, **kwargs):
        # read now: vLLM's lifespan handler deletes ``app.state`` when uvicorn stops, before
        # ``serve_http`` returns
        client = getattr(app.state, "engine_client", None)
        shutdown = await serve_http(app, *args, **kwargs)
        died = getattr(shutdown, "__name__", "") == "dummy_shutdown" and client is not None and client.errored

        async def finish():
            result = await shutdown
            if died:
                logger.error("the engine died while serving (see above); exiting with status 1")
                raise SystemExit(1)
            return result

        return finish()

    patch(api, "serve_http", "upstream.server_exit_status", serve_http_with_exit_status)


def install_prompt_vocab_check() -> None:
    """Upstream fix (vLLM 0.26; the check came with vllm-project/vllm#22471 and still admits ids up
    to max(tokenizer ids, ``tokenizer.vocab_size``, model vocab - 1)): a prompt token id equal to the
    tokenizer's ``vocab_size`` passes vLLM's check, and the embedding then raises ``IndexError`` in
    the engine core, which dies and takes the server down with it. For the plugin's models, whose
    embeddings have exactly ``vocab_size`` rows, a prompt id outside [0, vocab_size) is refused in the
    front end instead (a ``ValueError``: HTTP 400 from the API server). Other models keep vLLM's
    check; the hook can go once vLLM bounds prompt ids by the model's vocabulary."""
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_loop import plugin

    original = InputProcessor._validate_model_input

    def validate_model_input(self, prompt_input, prompt_type, *args, **kwargs):
        archs = getattr(self.model_config, "architectures", None) or []
        ids = prompt_input.get("prompt_token_ids") if prompt_input.get("type") != "embeds" else None
        if ids and any(a in plugin.MODELS for a in archs):
            vocab = self.model_config.get_vocab_size()
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt: token id {bad} is out of vocabulary; allowed: token ids 0 to {vocab - 1} "
                                 f"(the model's vocab_size is {vocab})")
        return original(self, prompt_input, prompt_type, *args, **kwargs)

    patch(InputProcessor, "_validate_model_input", "upstream.prompt_vocab_check", validate_model_input)


def install_cpu_seeded_chunked_prefill() -> None:
    """Upstream fix (vLLM 0.26 on CPU, every model): a step that samples a token it then discards (a
    prefill chunk that does not end the prompt) rewinds the request's generator with
    ``set_offset(get_offset() - 4)`` in ``GPUModelRunner._bookkeeping_sync`` -- the Philox offset of a
    CUDA generator. A CPU generator has no offset and raises ``RuntimeError: CPU Generator does not
    use offset``: a seeded request with a chunked prefill killed the engine. The same effect on the
    CPU: the generators of the rows to discard are saved before sampling and put back after it, so
    the discarded draw leaves the request's random stream as if it had not happened (as the rewind
    does on CUDA). Can go once vLLM's CPU runner stops rewinding CPU generators by offset."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync

    def sample_hook(self, *args, **kwargs):
        generators = self.input_batch.generators
        if generators:
            discard = self.discard_request_mask.np[: self.input_batch.num_reqs]
            self._vllm_loop_rewind = {int(i): generators[int(i)].get_state()
                                      for i in discard.nonzero()[0] if int(i) in generators}
        return sample(self, *args, **kwargs)

    def bookkeeping_hook(self, *args, **kwargs):
        saved, self._vllm_loop_rewind = getattr(self, "_vllm_loop_rewind", None), None
        if not saved:
            return bookkeeping(self, *args, **kwargs)
        generators = self.input_batch.generators
        held = {i: generators.pop(i) for i in saved if i in generators}  # vLLM's rewind skips them
        for i, gen in held.items():
            gen.set_state(saved[i])
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    patch(GPUModelRunner, "_sample", "upstream.cpu_seeded_chunked_prefill", sample_hook)
    patch(GPUModelRunner, "_bookkeeping_sync", "upstream.cpu_seeded_chunked_prefill", bookkeeping_hook)


def install_cpu_seeded_sampling() -> None:
    """vLLM 0.26 on CPU: ``TopKTopPSampler.forward_cpu`` ignores the per-request generators (a
    request's ``seed``) unless every row of the batch has one, and samples all rows from the global
    RNG. A seeded request's tokens then depend on what else shares its steps and on every other draw
    from the global RNG, e.g. the rejection sampler's, whose size follows the drafts of other
    requests (LoopSpec's lane chains). Batches with some seeded rows go to vLLM's own
    ``forward_native``, which honours them (as on the GPU); others are unchanged. CPU only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    original = TopKTopPSampler.forward_cpu

    def forward_cpu(self, logits, generators, k, p):
        if generators and len(generators) != logits.shape[0]:
            return self.forward_native(logits, generators, k, p)
        return original(self, logits, generators, k, p)

    patch(TopKTopPSampler, "forward_cpu", "upstream.cpu_seeded_sampling", forward_cpu)


def install_cpu_rejection_expand() -> None:
    """vLLM 0.26 on CPU: the rejection sampler spreads each request's temperature, top-k and top-p over
    its draft tokens with ``expand_batch_to_tokens``, whose CPU kernel
    (``cpu_triton_utils._expand_kernel_impl``) converts its output to int64 and fills the copy, so
    an int32 (top-k) or float (temperature, top-p) output is left uninitialised. A step that verifies
    drafts of a sampling request then sampled with garbage constraints (a crash in ``topk``, or a
    wrong distribution). LoopSpec's lane chains are such drafts. Same result as the GPU kernel, in
    PyTorch; CPU only (the Triton kernel is right)."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.v1.sample.rejection_sampler as rejection

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return torch.repeat_interleave(x, counts, output_size=num_tokens)

    patch(rejection, "expand_batch_to_tokens", "upstream.cpu_rejection_expand", expand_batch_to_tokens)
