"""Coupled sampling: every readout of a request samples with the same noise at the same position.

Sampling ``x ~ softmax(z)`` can be written as an exponential race (the Gumbel-max trick): draw
``E(v) ~ Exp(1)`` independently for every token v and take ``argmax_v z(v) - log E(v)``. If the
noise of position t is a fixed function of (request key, t) -- independent across positions and
tokens -- then

* the token committed at t, ``argmax(z_R + g_t)`` with ``z_R`` the filtered depth-R logits, is an
  exact sample of the target distribution, whatever proposals were made (they only decide which
  lanes are computed, never the committed token);
* a proposal at depth d1 or d2 is ``argmax(z_d + g_t)`` with the *same* ``g_t``, and it is accepted
  iff it equals the target's token: verification is the greedy cascade on noisy argmaxes, so a
  sampled request runs the greedy machinery unchanged -- argmax readouts on the GPU, one small copy
  to the host, overlap of recurrent steps;
* the noise is keyed by the request's seed (or a hash of the engine seed and the request id), so a
  seeded request's text does not depend on what else is in its batch.

The filter is vLLM's (and ``proposals.filter_probs``'s): temperature, then top-k (keep logits >= the
k-th largest), then top-p (drop the lowest tokens whose cumulative mass is <= 1 - top_p, never the
top one); greedy rows (temperature 0) take the plain argmax. Proposals are filtered the same way.

Acceptance is lower in theory than the paper's cascade (which accepts with probability
``min(1, p/q)``, ~1 - TV, where the coupling agrees with probability >= (1 - TV) / (1 + TV)); its
point is that it runs where the logits are and overlaps. ``sampling`` in the loopspec config picks
one (``config.py``).

Noise: splitmix64 (a counter-based generator) of ``key``, the position and the token id, in int64
arithmetic that wraps the same way on the CPU and on CUDA, so CPU tests see exactly the GPU's
numbers; 24 bits of it make a float32 uniform in (0, 1), as torch's own float32 exponential does.
"""

from __future__ import annotations

import os

import torch

GREEDY_EPS = 1e-5  # vLLM treats temperature < 1e-5 as greedy (as proposals.GREEDY_EPS)


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 torch stores."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def stream_seed(key: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``[rows]`` int64: one independent stream per (request key, position)."""
    return mix64(key.to(torch.int64) + mix64(position.to(torch.int64) * _GOLDEN + _GOLDEN))


def uniforms(key: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` float32 uniforms in (0, 1): token v of row i is the (v+1)-th output of the
    splitmix64 stream of ``(key[i], position[i])``."""
    seed = stream_seed(key, position)
    tokens = torch.arange(1, vocab + 1, device=seed.device, dtype=torch.int64)
    z = mix64(seed.unsqueeze(1) + tokens * _GOLDEN)
    return (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Row-wise temperature / top-k / top-p, as log-weights: ``logits / T`` with the filtered-out
    tokens at -inf (``softmax`` of a row is ``proposals.filter_probs``'s distribution for that row's
    parameters). ``temperature [rows]`` (rows below ``GREEDY_EPS`` are left unscaled; the caller takes
    their argmax), ``top_k [rows]`` (<= 0 or >= vocab: off), ``top_p [rows]`` (1: off). One sort of the
    vocabulary serves both filters."""
    vocab = logits.shape[-1]
    t = torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature)
    x = logits.to(temperature.dtype) / t.unsqueeze(1)
    ordered, order = torch.sort(x, dim=-1)  # ascending, as filter_probs's top-p
    k = top_k.to(torch.int64)
    use_k = (k > 0) & (k < vocab)
    kth = ordered.gather(1, (vocab - k.clamp(1, vocab)).unsqueeze(1))  # the k-th largest
    kth = torch.where(use_k.unsqueeze(1), kth, torch.full_like(kth, float("-inf")))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    cum = torch.softmax(ordered, dim=-1).cumsum(-1)
    drop_sorted = cum <= (1.0 - top_p.to(cum.dtype)).unsqueeze(1)
    drop_sorted[:, -1] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill((x < kth) | drop, float("-inf"))


# "0": CUDA rows sample through the PyTorch code below instead of the one-kernel sampler
# (``kernels/coupled_sample.py``; the benchmark's ``-torchsample`` systems, to time the two side by side)
KERNEL_ENV = "VLLM_LOOP_COUPLED_KERNEL"


# Rows sampled at once: the filter's sort and the noise take several [rows, vocab] temporaries (int64
# among them), so a lane call of thousands of rows goes through in chunks of this many.
CHUNK_ROWS = 64


def coupled_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   key: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``[rows]`` int64 tokens: greedy rows their argmax, the others ``argmax(filtered - log E)`` with
    the exponentials of ``(key, position)`` -- the token of ``position`` that any readout of the same
    request and position, at any depth, races with the same noise. ``position``: of the token being
    chosen. On CUDA one Triton kernel samples (``kernels/coupled_sample.py``: no sort and no
    ``[rows, vocab]`` temporaries; the same noise bits and filter)."""
    if logits.is_cuda and os.environ.get(KERNEL_ENV, "1") != "0":
        from vllm_loop_kernels.coupled_sample import coupled_sample as kernel

        return kernel(logits, temperature, top_k, top_p, key, position)
    if logits.shape[0] > CHUNK_ROWS:
        return torch.cat([coupled_sample(*(x[i:i + CHUNK_ROWS] for x in (logits, temperature, top_k, top_p, key,
                                                                         position)))
                          for i in range(0, logits.shape[0], CHUNK_ROWS)])
    exponential = -torch.log(uniforms(key, position, logits.shape[-1])).to(temperature.dtype)
    scores = filter_logits(logits, temperature, top_k, top_p) - torch.log(exponential)
    greedy = temperature < GREEDY_EPS
    return torch.where(greedy, logits.argmax(-1), scores.argmax(-1))
