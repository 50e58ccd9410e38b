"""GPU kernels of vllm-loop (Triton). Imported lazily: nothing here loads unless a kernel is asked for.

* ``lane_attention`` -- LoopSpec's lane attention: every lane at its own depth (KV bank) reads its
  request's committed prefix from vLLM's paged cache (split over programs) and its uncommitted
  ancestors and itself from the lane pool, with an online softmax, adding a q / k bias (Huginn's) and
  applying RoPE as it loads q and k (``vllm_loop/loopspec/lane_kv.py`` has the PyTorch path it is
  tested against).
* ``norm_add_norm`` -- the seams of sandwich-norm layers, two RMSNorms and the add in one kernel:
  Ouro's ``second(first(x) + residual)`` and Huginn's ``first(a + x)`` then ``second``, in lane calls
  and in vLLM's forward when it is not compiled.
* ``skinny_gemm`` -- ``x @ w.T`` for a few rows, optionally split over K, optionally with SwiGLU's
  ``silu(gate) * up`` formed as it loads ``x``: the lanes' MLP down projection (``swiglu_down``, one
  launch for SiLU-and-mul and the GEMM). Not as a plain GEMM: cuBLAS measured as fast or faster
  (``benchmarks/probes/lane_gemm_compare.py``).
* ``coupled_sample`` -- coupled sampling's filtered noisy argmax of a row (``vllm_loop/loopspec/noise.py``)
  in one kernel, without sorting the vocabulary.
* ``arrivals`` -- the atomic counters by which the last program of a split computation merges the
  partials in the same launch (the lane attention's one-pass merge, the split-K GEMM).

Each runs on CUDA and, for CI, on the CPU under ``TRITON_INTERPRET=1`` (``tests/test_lane_kernels.py``).
"""
