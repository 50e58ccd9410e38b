"""The over-read behind the start-up crash of LoopSpec engines whose mixed-step full graphs were longer
than ``max_model_len``, from vLLM 0.26's own functions, on the CPU (no engine, no GPU).

1. The warm-up before vLLM captures a mixed-step graph of N tokens (``GPUModelRunner._dummy_run``)
   splits N over ``min(N, max_num_seqs)`` dummy requests but gives each a context of N tokens
   (``seq_lens = max_query_len``; vLLM issue #53658). The Triton attention kernel loads block-table
   entries without a mask, so a request whose context needs more pages than a row holds reads the
   next rows, and the last rows read past the table's end: the printout lists those words. What lies
   there is the allocator's choice (``BlockTable`` allocates the slot mapping next, which dummy runs
   fill with -1).
2. Where block id -1 would land in vLLM's two KV layouts: per layer (a vanilla engine; one tensor a
   layer) and packed (one allocation for all layers at a block stride of L pages, which LoopSpec
   engines use, ``vllm_patches.loopspec.install_loopspec_packed_kv``). In the packed layout it lands up to L
   pages below the allocation. That was a guess at why only LoopSpec engines crashed; on an H100 a
   vanilla engine given the packed layout started and generated (``full_graphs_probe.py``'s
   ``vanilla-huginn-fp32-packed``), so the layout alone is not the reason.

    python benchmarks/probes/dummy_run_overread.py
"""

from __future__ import annotations

import types

import torch

MAX_MODEL_LEN, BLOCK, MAX_SEQS, N = 128, 16, 16, 512  # the probe's crashing cases (testing.engines' max_num_seqs)
KV_BYTES = 23 << 30  # ~ gpu_memory_utilization 0.3 of an H100
HEADS, HEAD_SIZE = 4, 32


def block_table_overread() -> None:
    from vllm.utils.math_utils import cdiv
    from vllm.v1.worker.block_table import BlockTable

    num_reqs = min(N, MAX_SEQS)  # _dummy_run's non-uniform batch
    seq_len = N  # ... and every dummy request's context
    table = BlockTable(BLOCK, MAX_SEQS, cdiv(MAX_MODEL_LEN, BLOCK), 16384, False, torch.device("cpu"), BLOCK, 1)
    rows, width = table.block_table.gpu.shape
    print(f"{N}-token warm-up: {num_reqs} dummy requests of {N // num_reqs} tokens, each with a {seq_len}-token "
          f"context; block table {rows} x {width} (max_model_len {MAX_MODEL_LEN}, block {BLOCK})")
    for r in range(num_reqs):
        first, last = r * width, r * width + cdiv(seq_len, BLOCK) - 1  # the words request r's programs load
        if last >= rows * width:
            print(f"  request {r}: block-table words {first}..{last}, {last - rows * width + 1} past the table's end")


def bank_offsets(layers: int, dtype: torch.dtype) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    with set_current_vllm_config(VllmConfig()):
        order = TritonAttentionBackend.get_kv_cache_stride_order()
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=dtype)
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(layers)], spec)]
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(num_gpu_blocks_override=None),
                                   kv_transfer_config=None, additional_config={"loopspec": {}})
    for packed in (False, True):
        if packed:
            blocks, tensors = kv_cache_utils._get_kv_cache_config_packed(config, groups, KV_BYTES)
        else:
            c = kv_cache_utils.get_kv_cache_config_from_groups(config, groups, KV_BYTES)
            blocks, tensors = c.num_blocks, c.kv_cache_tensors
        landing = []
        for t in (tensors[0], tensors[-1]):  # first and last layer
            raw = torch.empty(t.size, dtype=torch.int8, device="meta")
            shape = TritonAttentionBackend.get_kv_cache_shape(blocks, BLOCK, HEADS, HEAD_SIZE)
            placed = (t.offset, t.block_stride) if t.block_stride else None
            kv = _reshape_attention_kv_cache(raw, spec, shape, order, blocks, placed)
            key = kv.transpose(1, 2).split(HEAD_SIZE, dim=-1)[0]  # as triton_attn splits it
            stride = key.stride(0) * key.element_size()
            landing.append((t.offset if t.block_stride else 0) - stride)  # block id -1, from the allocation's start
        where = "1 allocation (a view a layer)" if packed else f"{len(tensors)} allocations"
        print(f"  {layers} layers {str(dtype)[6:]:8s} {'packed' if packed else 'per layer':9s}: {where}, "
              f"block stride {stride:,} B; block -1 lands {landing[0]:+,} B (first layer) / "
              f"{landing[1]:+,} B (last layer) from {'the' if packed else 'its own layer'} allocation's start")


def main() -> None:
    block_table_overread()
    print("Where block id -1 lands (layers: vanilla Huginn R=32 67, LoopSpec 1:5 71 with its coda banks at 1 and 5):")
    for layers in (67, 71):
        for dtype in (torch.float32, torch.bfloat16):
            bank_offsets(layers, dtype)


if __name__ == "__main__":
    main()
