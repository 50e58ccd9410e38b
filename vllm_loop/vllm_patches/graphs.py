"""vLLM's CUDA graphs in a LoopSpec engine: full graphs for 1-token decode steps (the lanes policy's
plain steps and requests the lanes do not serve), and the graph sizes of ``loopspec/config.py``."""

from __future__ import annotations

from vllm_loop import get_logger
from vllm_loop.vllm_patches import patch
from vllm_loop.vllm_patches.loopspec import loopspec_runner

logger = get_logger(__name__)


def install() -> None:
    install_loopspec_decode_graphs()


def install_loopspec_decode_graphs() -> None:
    """vLLM captures its full CUDA graphs for decode steps of exactly 1 + num_speculative_tokens
    tokens per request (``uniform_decode_query_len``), the shape of a draft-model engine's steps. A
    LoopSpec engine never runs that shape through vLLM's forward (lane steps bypass it; steps that
    verify lane chains have a prefill in them), but it does run decode steps of 1 token per request:
    the lanes policy's plain steps and requests the lanes do not serve. Those fell to piecewise graphs
    (attention outside the graph, once per bank), which made a plain step cost ~2x a vanilla
    engine's on the H200 (benchmarks/RESULTS.md). So a LoopSpec runner declares 1-token decode
    uniform before vLLM builds its graph keys and capture sizes (``_check_and_update_cudagraph_mode``
    of vLLM 0.26's ``GPUModelRunner``, and the runner's ``CudagraphDispatcher``); its graph sizes are
    ``loopspec_config.graph_capture_sizes``'s (``VllmConfig._set_cudagraph_sizes``).

    Under ``cudagraph_mode`` FULL (full graphs for mixed steps too: prefills graphed), vLLM keys every
    graph as a mixed step, so a plain decode step replays a graph captured for a prefill of as many
    tokens: 14 % slower plain steps at 128 requests (an H100, benchmarks/RESULTS.md). A LoopSpec engine
    also captures the decode graphs FULL_DECODE_ONLY would and sends 1-token decode steps to them
    (``add_decode_graph_keys``), as FULL_AND_PIECEWISE does with its piecewise half; vLLM 0.26 has no
    mode for full graphs on both sides."""
    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_loop.loopspec.config import graph_capture_sizes, knobs

    original = GPUModelRunner._check_and_update_cudagraph_mode
    set_sizes = VllmConfig._set_cudagraph_sizes

    def set_cudagraph_sizes(self):
        cc = self.compilation_config
        if knobs(self) is not None:
            cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = graph_capture_sizes(
                cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size, mixed=cc.cudagraph_mode == CUDAGraphMode.FULL,
                max_num_seqs=self.scheduler_config.max_num_seqs, max_model_len=self.model_config.max_model_len)
        return set_sizes(self)

    def check_and_update_cudagraph_mode(self, *args, **kwargs):
        lanes = loopspec_runner(self) is not None
        if lanes:
            self.uniform_decode_query_len = 1
            self.cudagraph_dispatcher.uniform_decode_query_len = 1
        out = original(self, *args, **kwargs)
        if lanes and self.cudagraph_dispatcher.cudagraph_mode == CUDAGraphMode.FULL:
            add_decode_graph_keys(self.cudagraph_dispatcher)
        return out

    patch(GPUModelRunner, "_check_and_update_cudagraph_mode", "graphs.decode", check_and_update_cudagraph_mode)
    patch(VllmConfig, "_set_cudagraph_sizes", "graphs.sizes", set_cudagraph_sizes)


def add_decode_graph_keys(dispatcher) -> None:
    """Add FULL_DECODE_ONLY's keys (1-token decode steps up to ``max_num_seqs`` requests, as vLLM 0.26's
    ``CudagraphDispatcher.initialize_cudagraph_keys`` adds them for a separate decode routine) to a
    dispatcher in ``cudagraph_mode`` FULL, and send decode steps to them: this dispatcher's ``dispatch``
    only, so other engines' dispatchers stay vLLM's (``install_loopspec_decode_graphs`` says why)."""
    from dataclasses import replace
    from itertools import product

    from vllm.config.compilation import CUDAGraphMode

    max_num_seqs = dispatcher.vllm_config.scheduler_config.max_num_seqs
    sizes = [n for n in dispatcher.compilation_config.cudagraph_capture_sizes if n <= max_num_seqs]
    for n, loras in product(sizes, dispatcher._get_lora_cases()):
        dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, dispatcher._create_padded_batch_descriptor(n, True, loras > 0, loras))
    dispatch, full_keys = dispatcher.dispatch, dispatcher.cudagraph_keys[CUDAGraphMode.FULL]

    def dispatch_decode_apart(num_tokens, uniform_decode=False, *args, **kwargs):
        mode, desc = dispatch(num_tokens, uniform_decode, *args, **kwargs)
        if mode == CUDAGraphMode.FULL and uniform_decode:
            decode = replace(desc, uniform=True)  # at 1 token a request, num_reqs is the mixed key's
            if decode in full_keys:
                desc = decode
        return mode, desc

    dispatcher.dispatch = dispatch_decode_apart
