"""The reference (oracle) looped LM: ``pre``, ``core_step``, ``readout`` plus plain decoding loops.

Subclasses (``ouro.py``, ``raven.py``) implement the three pieces for one family; everything here is
family-independent. Positions are absolute token positions; a token keeps its position at every
depth. Depths are 1-based when they name a readout (``readout(state, r)`` reads depth r, after r
core steps) and 0-based when they name a core step (``core_step(state, t)`` computes depth t+1 and
uses KV bank ``("core", t, l)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_loop.reference.kv import SequenceKV


@dataclass
class LoopState:
    """Hidden state of n positions at some depth."""

    h: torch.Tensor  # [n, H]
    inject: torch.Tensor | None = None  # [n, H]: Raven's prelude output, re-injected at every core step


class LoopedReference(nn.Module):
    depth: int  # T: core steps of an ordinary forward
    vocab_size: int

    # -- the three pieces, per family -------------------------------------------------------
    def pre(self, tokens: torch.Tensor, positions: torch.Tensor, kv) -> LoopState:
        raise NotImplementedError

    def core_step(self, state: LoopState, t: int, positions: torch.Tensor, kv) -> LoopState:
        raise NotImplementedError

    def readout(self, state: LoopState, r: int, positions: torch.Tensor, kv) -> torch.Tensor:
        """fp32 logits ``[n, V]`` of the post-layers applied to the depth-r state."""
        raise NotImplementedError

    # -- family-independent loops -----------------------------------------------------------
    @torch.no_grad()
    def forward_depths(self, tokens: torch.Tensor, kv: SequenceKV | None = None, depths=None) -> dict[int, torch.Tensor]:
        """Run ``tokens`` (appended after whatever ``kv`` holds) to full depth.

        Returns ``{r: logits [n, V]}`` for each readout depth r in ``depths`` (default: only T).
        """
        kv = SequenceKV() if kv is None else kv
        depths = sorted(set(depths or [self.depth]))
        if depths[0] < 1 or depths[-1] > self.depth:
            raise ValueError(f"readout depths must be in 1..{self.depth}, got {depths}")
        start = kv.length(self.position_bank())
        lengths_before = {bank: kv.length(bank) for bank in kv.k}
        positions = torch.arange(start, start + tokens.shape[0])
        state = self.pre(tokens, positions, kv)
        out = {}
        for t in range(self.depth):
            state = self.core_step(state, t, positions, kv)
            if t + 1 in depths:
                out[t + 1] = self.readout(state, t + 1, positions, kv)
        _check_banks_aligned(kv, lengths_before, start)
        return out

    @torch.no_grad()
    def final_logits(self, tokens: torch.Tensor, kv: SequenceKV | None = None) -> torch.Tensor:
        """fp32 logits ``[n, V]`` of an ordinary forward (what the original model returns).

        The depth-T readout; a family whose config selects another readout depth per token (Ouro's
        ``early_exit_step`` / ``early_exit_threshold``) overrides this.
        """
        return self.forward_depths(tokens, kv)[self.depth]

    def position_bank(self):
        """A bank every position writes exactly once per forward (its length = tokens so far)."""
        return ("core", 0, 0)

    @torch.no_grad()
    def greedy_generate(self, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
        """Ordinary full-depth greedy decoding with a KV cache (the baseline LoopSpec must match)."""
        return self.generate(prompt, max_new_tokens, eos_token_id=eos_token_id)

    @torch.no_grad()
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        *,
        sample=None,
        eos_token_id: int | list[int] | None = None,
    ) -> list[int]:
        """Ordinary decoding (``final_logits``). ``sample(logits [V]) -> int`` picks a token (default:
        argmax); generation stops after a token in ``eos_token_id`` (an id or a list, as in HF configs)."""
        pick = sample or (lambda logits: int(torch.argmax(logits)))
        stop = _id_set(eos_token_id)
        kv = SequenceKV()
        logits = self.final_logits(torch.tensor(prompt), kv)[-1]
        out: list[int] = []
        for _ in range(max_new_tokens):
            tok = pick(logits)
            out.append(tok)
            if tok in stop:
                break
            logits = self.final_logits(torch.tensor([tok]), kv)[-1]
        return out


def _id_set(ids: int | list[int] | None) -> set[int]:
    if ids is None:
        return set()
    return {int(ids)} if isinstance(ids, int) else {int(i) for i in ids}


def _check_banks_aligned(kv: SequenceKV, lengths_before: dict, start: int) -> None:
    """Every bank a forward wrote must have held exactly the positions before it.

    A bank that missed earlier forwards (e.g. a coda bank of a readout depth that was not requested
    before) would make its attention see a shorter history at wrong positions; refuse instead.
    """
    for bank in kv.k:
        before = lengths_before.get(bank, 0)
        if kv.length(bank) != before and before != start:
            raise ValueError(
                f"KV bank {bank} held {before} positions but this forward starts at position {start}: "
                "request the same readout depths in every forward of a sequence"
            )
