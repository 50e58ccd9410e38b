"""GPU kernels of vllm-loop (Triton). Imported lazily: nothing here loads unless a kernel is asked for.

* ``lane_attention`` -- LoopSpec's lane attention: every lane at its own depth (KV bank) reads its
  request's committed prefix from vLLM's paged cache and its uncommitted ancestors and itself from
  the lane pool, in one pass with an online softmax (``vllm_loop/loopspec/lane_kv.py`` has the
  PyTorch path it is tested against).
"""
