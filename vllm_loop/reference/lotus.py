"""LOTUS reference (arXiv 2606.31779; ``yingfan-bot/lotus`` ``scripts/lotus.py``), KV-cached.

The original ``Lotus.forward`` / ``generate`` on ``question | <|start-latent|> | <|latent|> x
(n_looped_iters * c_thought) | <|end-latent|>``:

* region = ``[loop_start, loop_end)`` with ``loop_start`` = the ``<|start-latent|>`` position
  (first latent - 1) and ``loop_end`` = last latent + 1; the question before it is forwarded once
  (prefix KV);
* pass 0 forwards the region on a fresh copy of the prefix KV with the original embeddings ``E``;
* ``n_looped_iters`` more passes: the latent positions' inputs become ``E + h`` ("add", the
  released default; ``"replace"``: ``h``), ``h`` = the post-final-norm hidden state of the SAME
  position from the previous pass; the start token keeps ``E``; each pass runs on a fresh copy of
  the prefix KV, so only the last pass's region KV survives;
* ``<|end-latent|>`` is forwarded on prefix KV + the last pass's region KV; its logits give the
  first answer token; greedy decoding with the KV cache follows.

Budget n = ``n_looped_iters``: ``n * c_thought`` latent positions and ``1 + n`` region passes,
because the original always allocates ``n_looped_iters * c_thought`` latents (``eval.py``) and a
``LatentSpec`` of kind ``looped`` describes one loop as ``c_thought`` positions. ``n = 0`` leaves no
latent (``question | start | end``) and is a single ordinary forward, as the original's
``n_looped_iters == 0`` path is.
"""

from __future__ import annotations

from collections.abc import Sequence


from vllm_loop.latent.spec import LatentSpec
from vllm_loop.reference.kv import SequenceKV
from vllm_loop.reference.latent import LatentReference


class LotusReference(LatentReference):
    family = "lotus"

    def __init__(self, decoder, spec: LatentSpec, eos_token_ids: Sequence[int] = (), *, mode: str = "add"):
        if spec.kind != "looped":
            raise ValueError(f"LOTUS needs a LatentSpec of kind 'looped', got {spec.kind!r}")
        if mode not in ("add", "replace"):
            raise ValueError(f"latent_injection_mode must be 'add' or 'replace', got {mode!r}")
        super().__init__(decoder, spec, eos_token_ids)
        self.mode = mode

    def _latent_phase(self, prompt, budget):
        dec, spec = self.decoder, self.spec
        prefix = prompt + list(spec.start_token_ids[:-1])
        region = [spec.start_token_ids[-1]] + [spec.latent_token_id] * spec.latent_positions(budget)
        prefix_kv = SequenceKV()
        if prefix:
            dec.forward(dec.embed(prefix), prefix_kv)
        original = dec.embed(region)
        inputs = original
        kv = prefix_kv.fork()
        h = dec.forward(inputs, kv)  # pass 0
        for _ in range(budget):  # passes 1..n, in place: a fresh copy of the prefix KV each time
            inputs = original.clone()
            inputs[1:] = original[1:] + h[1:] if self.mode == "add" else h[1:]
            kv = prefix_kv.fork()
            h = dec.forward(inputs, kv)
        end = dec.forward(dec.embed(list(spec.end_token_ids)), kv)[-1]
        return kv, dec.logits(end), inputs[1:].clone()
