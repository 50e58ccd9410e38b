"""No compilation while serving: what a LoopSpec engine warms up at start-up beyond vLLM's own warm-up
(its lane graphs, vLLM's rejection sampler at LoopSpec's draft shapes, the V1 runner's slot mapping)."""

from __future__ import annotations

from vllm_loop import get_logger
from vllm_loop.vllm_patches import patch
from vllm_loop.vllm_patches.loopspec import loopspec_runner

logger = get_logger(__name__)


def install() -> None:
    install_loopspec_warmup()


def install_loopspec_warmup() -> None:
    """No compilation while serving: vLLM warms its kernels up at start-up and then watches for
    Triton compilations (``vllm/utils/jit_monitor.py``), but a LoopSpec engine launches kernels its
    warm-up never met -- the lane calls' (``kernels/``), in every row bucket, and vLLM's rejection
    sampler at the draft lengths and greedy / random mixes that verifying lane chains brings -- and
    each one's first launch compiled it mid-stream (a 2 s inter-token stall under ``vllm bench
    serve``). Right after vLLM warms its sampler (``Worker.compile_or_warm_up_model`` ->
    ``GPUModelRunner._dummy_sampler_run``, the first call with a KV cache; the memory profile calls
    it before there is one), the lanes capture every lane-graph bucket (``LoopSpecRunner.warm_up``),
    the rejection sampler runs on dummy drafts of each kind (``_warm_rejection_sampler``) and the
    slot-mapping kernel runs once (``_warm_slot_mapping``)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._dummy_sampler_run

    def dummy_sampler_run(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        lanes = loopspec_runner(self)
        if lanes is not None and self.kv_caches and not getattr(lanes, "warmed_up", False):
            lanes.warmed_up = True
            lanes.warm_up(self)
            _warm_rejection_sampler(self, lanes.num_spec_tokens)
            _warm_slot_mapping(self)
        return out

    patch(GPUModelRunner, "_dummy_sampler_run", "warmup.loopspec", dummy_sampler_run)


def _warm_slot_mapping(runner) -> None:
    """vLLM's V1 runner computes each step's KV slot mapping with a Triton kernel
    (``BlockTable.compute_slot_mapping``) that its dummy runs never launch, so the first request
    compiled it mid-stream (seen in a LoopSpec server's log under ``vllm bench serve``). One launch on
    the runner's own block table compiles it for every later step (its token counts are not
    specialized on); it writes only the slot mapping, which every step writes afresh. CUDA only."""
    if runner.device.type != "cuda":
        return
    import torch

    dev = runner.device
    with torch.inference_mode():
        runner.input_batch.block_table.compute_slot_mapping(
            1, torch.tensor([0, 1], dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int64, device=dev))
    torch.cuda.synchronize()


def _warm_rejection_sampler(runner, max_drafts: int, *, cuda_only: bool = True) -> None:
    """Run vLLM's rejection sampler once for each kind of call a LoopSpec engine makes, so that each
    Triton kernel it launches compiles now: all greedy, all random (top-p, seeded or not) and mixed
    rows; 1, a few and 16 requests with 1, a few and 16 drafts each (Triton specializes an integer
    argument on being 1 or a multiple of 16). CUDA only: vLLM's CPU build runs no Triton here."""
    if cuda_only and runner.device.type != "cuda":
        return
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    vocab = runner.model_config.get_vocab_size()
    max_reqs = runner.scheduler_config.max_num_seqs
    dev = runner.device

    def metadata(n: int, kind: str) -> SamplingMetadata:
        full = lambda v: torch.full((n,), v, device=dev, dtype=torch.float32)  # noqa: E731
        temperature = full(0.0) if kind == "greedy" else full(0.8)
        if kind == "mixed":
            temperature[::2] = 0.0
        return SamplingMetadata(
            temperature=temperature, all_greedy=kind == "greedy", all_random=kind in ("random", "seeded"),
            top_p=None if kind == "greedy" else full(0.7), top_k=None,
            generators={0: torch.Generator(device=dev).manual_seed(0)} if kind == "seeded" else {},
            max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=full(0.0),
            presence_penalties=full(0.0), repetition_penalties=full(1.0), output_token_ids=[[] for _ in range(n)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
            spec_token_ids=[[] for _ in range(n)])

    with torch.inference_mode():
        for n in sorted({min(k, max_reqs) for k in (1, 3, 16)}):
            for drafts in sorted({min(k, max_drafts) for k in (1, 3, 16)}):
                spec = SpecDecodeMetadata.make_dummy([[0] * drafts for _ in range(n)], dev)
                logits = torch.randn(n * (drafts + 1), vocab, device=dev, dtype=runner.model_config.dtype)
                for kind in ("greedy", "random", "seeded", "mixed"):
                    runner.rejection_sampler(spec, None, logits.clone(), metadata(n, kind))
    if dev.type == "cuda":
        torch.cuda.synchronize()
