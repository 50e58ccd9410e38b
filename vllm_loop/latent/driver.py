"""The latent driver: per step, what each latent request's rows need (inject, loop, force).

It sits beside vLLM's model runner (hooks in ``vllm_loop/vllm_patches/``) and knows nothing of
it beyond a list of ``StepRow`` (one per request in the batch). The request protocol is the one in
``vllm_loop/latent/spec.py``; here is how each family meets the engine:

* feedback (COCONUT, CODI) -- ordinary decode steps. The outputs are forced: the start tokens, then
  one placeholder per latent position, then the end tokens; then the answer is sampled. A step whose
  input is a latent position gets its embedding replaced by the vector stored for that position in
  the request's ledger; the vector is ``model.latent_feedback(h)`` of the previous position, stored
  right after the step that computed h. Because the ledger keeps every vector until the request
  finishes, a preempted request that is recomputed from its tokens re-injects the same vectors.
* looped (LOTUS) -- the front end appended start, block and end tokens to the prompt, so the
  block arrives inside an ordinary prefill; the driver marks its rows and asks the model for
  ``budget`` extra in-place passes of that step (see ``models.py``).

The driver reads only token *counts* from vLLM (computed, scheduled, output), never token values,
so it works under async scheduling: the V1 runner counts a placeholder for each token still in
flight. Nothing it does per step waits for the GPU.

Latent requests never read the prefix cache (the front end sets ``skip_reading_prefix_cache``): a
block cached by another request may hold KV of another budget or of an earlier pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_loop.latent.spec import LATENT_BUDGET_KEY, LatentSpec

PROMPT_LEN_KEY = "latent_prompt_len"  # set by the front end: prompt length before appended tokens


@dataclass
class StepRow:
    """One request's slice of the current step."""

    req_id: str
    row: int  # first row of this request in the step's token batch
    first_pos: int  # sequence position of that row
    num_tokens: int  # rows scheduled for this request in this step
    samples: bool  # this step ends with a sampled token for this request
    out_index: int  # index among the outputs of the token sampled now


@dataclass
class LatentRequest:
    budget: int
    prompt_len: int
    ledger: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> injected vector


class LatentDriver:
    def __init__(self, spec: LatentSpec, placeholder_id: int):
        self.spec = spec
        self.placeholder = placeholder_id  # recorded token at feedback latent positions
        self.requests: dict[str, LatentRequest] = {}
        self._mask_dirty = False
        self._suppress: torch.Tensor | None = None  # suppress_token_ids on the logits' device

    # -- request lifecycle ------------------------------------------------------------------
    def track(self, req_id: str, extra_args: dict | None, num_prompt_tokens: int) -> LatentRequest:
        if req_id not in self.requests:
            args = extra_args or {}
            budget = args.get(LATENT_BUDGET_KEY, self.spec.default_budget)
            self.requests[req_id] = LatentRequest(int(budget), int(args.get(PROMPT_LEN_KEY, num_prompt_tokens)))
        return self.requests[req_id]

    def finish(self, req_ids) -> None:
        """Finished and aborted requests give back their ledgers (preempted ones keep them)."""
        for req_id in req_ids:
            self.requests.pop(req_id, None)

    # -- the forced latent phase of feedback models -------------------------------------------
    def forced_token(self, req: LatentRequest, out_index: int) -> int | None:
        """The token the request must emit at this output index, or None once it is answering."""
        if self.spec.kind != "feedback":
            return None
        start, end = self.spec.start_token_ids, self.spec.end_token_ids
        if out_index < len(start):
            return start[out_index]
        k = out_index - len(start)
        if k < req.budget:
            return self.placeholder
        k -= req.budget
        return end[k] if k < len(end) else None

    def latent_positions(self, req: LatentRequest) -> range:
        first = req.prompt_len + len(self.spec.start_token_ids)
        return range(first, first + self.spec.latent_positions(req.budget))

    # -- per step -------------------------------------------------------------------------
    def before_forward(self, model, rows: list[StepRow]) -> None:
        """Fill the model's inject buffers and LOTUS pass counts for this step."""
        if self._mask_dirty:
            model.latent_mask.zero_()
            model.loop_row_passes.zero_()
            self._mask_dirty = False
        model.loop_passes = 0
        inject_rows, vectors = [], []
        for r in rows:
            req = self.requests[r.req_id]
            latent = self.latent_positions(req)
            lo, hi = max(r.first_pos, latent.start), min(r.first_pos + r.num_tokens, latent.stop)
            if lo >= hi:
                continue
            if self.spec.kind == "feedback":
                for pos in range(lo, hi):
                    inject_rows.append(r.row + pos - r.first_pos)
                    vectors.append(req.ledger[pos])
            else:
                if lo != latent.start or hi != latent.stop or r.first_pos >= latent.start:
                    raise RuntimeError(
                        "a LOTUS latent block must be computed in one step together with its start token; "
                        "latent models run without chunked prefill"
                    )
                model.loop_row_passes[r.row + lo - r.first_pos : r.row + hi - r.first_pos] = req.budget
                model.loop_passes = max(model.loop_passes, req.budget)
                self._mask_dirty = True
        if inject_rows:
            # non_blocking: a blocking host-to-device copy would stall async scheduling
            index = torch.tensor(inject_rows).to(model.latent_mask.device, non_blocking=True)
            model.latent_mask[index] = True
            model.latent_embeds[index] = torch.stack(vectors).to(model.latent_embeds.dtype)
            self._mask_dirty = True

    def after_forward(self, model, hidden_states: torch.Tensor, rows: list[StepRow]) -> None:
        """Store the vector the next latent position will get (feedback models)."""
        if self.spec.kind != "feedback":
            return
        for r in rows:
            req = self.requests[r.req_id]
            if not r.samples:
                continue
            next_pos = r.first_pos + r.num_tokens  # position of the token sampled now
            if next_pos in self.latent_positions(req) and next_pos not in req.ledger:
                last = hidden_states[r.row + r.num_tokens - 1]
                # clone: the hidden states may live in a buffer the next step overwrites (CUDA graphs)
                req.ledger[next_pos] = model.latent_feedback(last.unsqueeze(0))[0].detach().clone()

    def adjust_logits(self, logits: torch.Tensor, rows: list[StepRow]) -> None:
        """Force the latent phase's tokens; keep ``suppress_token_ids`` out of answers.

        Suppression is applied to every row (one kernel, no host sync); a forced row is then
        overwritten whole, so a forced token may be one of the suppressed ones."""
        if self.spec.suppress_token_ids:
            if self._suppress is None or self._suppress.device != logits.device:
                self._suppress = torch.tensor(self.spec.suppress_token_ids, device=logits.device)
            logits.index_fill_(1, self._suppress, float("-inf"))
        for i, r in enumerate(rows):
            if not r.samples:
                continue
            forced = self.forced_token(self.requests[r.req_id], r.out_index)
            if forced is not None:
                logits[i].fill_(float("-inf"))
                logits[i, forced] = 0.0
