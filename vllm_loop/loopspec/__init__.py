"""LoopSpec: lossless pipelined self-speculative decoding for looped transformers, engine-free.

schedule  (R, d1, d2) validation and lane capacity      lanes     Lane, BranchTree
proposals filtering, residual, gate, sampling            verify    cascade verification (+ exact analysis)
metrics   gamma (eq. 9), shares, gate, batch sizes       executor  plain-PyTorch pipelined executor (oracle)
tune      TV per depth, power-law envelope, Theorem 2
"""

from vllm_loop.loopspec.proposals import SamplingParams
from vllm_loop.loopspec.schedule import LoopSpecSchedule
from vllm_loop.loopspec.verify import CommitSource, cascade_verify, cascade_verify_greedy

__all__ = ["CommitSource", "LoopSpecSchedule", "SamplingParams", "cascade_verify", "cascade_verify_greedy"]
