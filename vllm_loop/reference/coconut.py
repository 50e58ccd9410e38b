"""COCONUT reference (Hao et al., arXiv 2412.06769; ``facebookresearch/coconut``), KV-cached.

The original ``Coconut.forward`` takes ``question | <|start-latent|> | <|latent|> x K |
<|end-latent|>`` and runs sequential passes: pass 0 covers everything before the first latent;
each later pass computes exactly one latent position, whose input embedding is replaced by
``hidden_states[-1][p - 1]`` -- the last-layer output (after ``ln_f``) of the position before it;
the final pass covers the last latent and ``<|end-latent|>``, and ``generate`` continues greedily
from the last logits. That equals: prefill ``question | start``; K single-position steps each fed
the previous step's post-norm hidden state; then ``<|end-latent|>``; then ordinary decoding --
what ``FeedbackReference`` does with ``feedback = identity``. Budget n = K (``0``: start then end).
"""

from __future__ import annotations

import torch

from vllm_loop.reference.kv import SequenceKV
from vllm_loop.reference.latent import LatentReference


class FeedbackReference(LatentReference):
    """Feedback latent loop shared by COCONUT and CODI; ``feedback`` maps the post-final-norm
    hidden state of a position to the input embedding of the next (latent) position."""

    def feedback(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def _latent_phase(self, prompt, budget):
        dec, spec = self.decoder, self.spec
        kv = SequenceKV()
        last = dec.forward(dec.embed(prompt + list(spec.start_token_ids)), kv)[-1]
        injected = []
        for _ in range(spec.latent_positions(budget)):
            z = self.feedback(last)
            injected.append(z)
            last = dec.forward(z[None, :], kv)[-1]
        end = dec.forward(dec.embed(list(spec.end_token_ids)), kv)[-1]
        latent_inputs = torch.stack(injected) if injected else torch.empty(0, dec.hidden_size)
        return kv, dec.logits(end), latent_inputs


class CoconutReference(FeedbackReference):
    family = "coconut"
