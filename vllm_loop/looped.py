"""What every recurrent-depth model shares, in plain PyTorch (no vLLM import).

A looped LM is ``pre`` (embedding, plus prelude blocks for Raven), ``core_step`` applied T times
(the shared block; step t reads and writes KV bank t), and ``readout`` (coda blocks for Raven, the
final norm and the LM head). Both the vLLM model files and the reference implementations are built
from these pieces, so the names, the bank layout and the small pure functions live here once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def check_depth(field: str, value) -> int:
    """The loop count T (``total_ut_steps`` / ``mean_recurrence``) must be a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}={value!r} is invalid: the loop count must be an integer >= 1")
    return value


def check_required_keys(raw: dict, required: tuple[str, ...], model_type: str) -> None:
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"config.json of this {model_type} checkpoint is missing required key(s): {', '.join(missing)}")


@dataclass(frozen=True)
class BankLayout:
    """Where each attention application keeps its KV: one vLLM attention layer ("bank") each.

    Banks are numbered ``prelude | core depth 0 | ... | core depth T-1 | coda per readout depth``,
    so bank (t, l) of the looped core is ``P + t*C + l`` (``t*L + l`` for Ouro, which has no
    prelude). vLLM requires exactly one integer in a KV layer's name, hence a flat index. Coda
    blocks see hidden states of one readout depth, so each readout depth that runs the coda (the
    final depth T always; more for depth readouts and LoopSpec proposals) gets its own coda banks.
    """

    prelude: int
    core: int
    coda: int
    depth: int
    coda_depths: tuple[int, ...] = ()  # readout depths with their own coda banks, final depth first

    def __post_init__(self):
        if self.coda and (not self.coda_depths or self.coda_depths[0] != self.depth):
            raise ValueError("coda_depths must start with the final depth")

    def prelude_bank(self, layer: int) -> int:
        return layer

    def core_bank(self, t: int, layer: int) -> int:
        return self.prelude + t * self.core + layer

    def coda_bank(self, readout_depth: int, layer: int) -> int:
        k = self.coda_depths.index(readout_depth)
        return self.prelude + self.depth * self.core + k * self.coda + layer

    @property
    def num_banks(self) -> int:
        return self.prelude + self.depth * self.core + len(self.coda_depths) * self.coda


def ouro_exit_pdf(gate_logits: torch.Tensor) -> torch.Tensor:
    """Ouro's learned exit distribution over depths, ``[T, ...] -> [T, ...]`` summing to 1.

    ``lambda_t = sigmoid(gate_t)``; ``p_t = lambda_t * prod_{j<t}(1 - lambda_j)`` for t < T-1 and
    the last depth takes the remaining mass (as in Ouro's modeling code).
    """
    lam = torch.sigmoid(gate_logits.float())
    survive = torch.cumprod(1.0 - lam, dim=0)
    alive_before = torch.cat([torch.ones_like(survive[:1]), survive[:-1]], dim=0)
    pdf = lam * alive_before
    pdf[-1] = alive_before[-1]
    return pdf


def ouro_exit_depth(pdf: torch.Tensor, threshold: float) -> torch.Tensor:
    """Index of the first depth whose exit CDF reaches ``threshold`` (last depth if none does).

    A threshold of 1.0 (Ouro's default) always selects the last depth: the CDF reaches 1.0 only
    through rounding, and Ouro's intent at 1.0 is full depth.
    """
    T = pdf.shape[0]
    if threshold >= 1.0:
        return torch.full(pdf.shape[1:], T - 1, dtype=torch.long, device=pdf.device)
    cdf = torch.cumsum(pdf, dim=0)
    reached = cdf >= threshold
    reached[-1] = True
    return reached.to(torch.int8).argmax(dim=0)


_MASK63 = (1 << 63) - 1


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 (wrapping arithmetic; logical shifts by masking)."""

    def shr(v, s):
        return (v >> s) & ((1 << (64 - s)) - 1)

    x = x ^ shr(x, 30)
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9 as signed int64
    x = x ^ shr(x, 27)
    x = x * -7723592293110705685  # 0x94D049BB133111EB as signed int64
    return x ^ shr(x, 31)


def seeded_state(positions: torch.Tensor, hidden: int, std: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Raven's initial recurrent state, drawn deterministically per (seed, position, channel).

    Same distribution as Huginn's ``like-init`` (a normal truncated at +-3 std), but a pure
    function of the token position: it does not depend on batching, on the device or on how many
    random numbers were drawn before, so the reference and vLLM agree exactly. ``[n] -> [n, hidden]``.
    """
    pos = positions.to(torch.int64).reshape(-1, 1)
    ch = torch.arange(hidden, dtype=torch.int64, device=positions.device).reshape(1, -1)
    key = (pos * 1_000_003 + ch) * 0x9E3779B1 + (seed + 1) * 0x632BE5AB
    bits = _mix64(key) & _MASK63
    u = ((bits >> 39).to(torch.float64) + 0.5) / float(1 << 24)  # 24 random bits, in (0, 1)
    lo = 0.5 * (1 + math.erf(-3 / math.sqrt(2)))
    hi = 1 - lo
    v = (2 * lo - 1) + (2 * hi - 2 * lo) * u
    x = torch.erfinv(v) * (std * math.sqrt(2.0))
    return x.clamp(-3 * std, 3 * std).to(dtype)
