"""Latent-reasoning models: the model-side declaration (``LatentSpec``) and the request protocol.

Three families are served: COCONUT (feedback, GPT-2), CODI (feedback + ``prj`` head, GPT-2 or Llama)
and LOTUS (looped block, Llama). The plain-PyTorch references in ``vllm_loop/reference/{coconut,
codi,lotus}.py`` implement exactly the protocol below; the vLLM side implements the same thing and is
compared against them token for token.

Declaration (one per model)
---------------------------
A latent model's ``config.json`` carries a ``"latent_spec"`` object with the fields of
:class:`LatentSpec` (token ids are ints, token lists are JSON arrays), e.g. COCONUT::

    "latent_spec": {"kind": "feedback", "default_budget": 6, "max_budget": 64, "c_thought": 1,
                    "start_token_ids": [509], "end_token_ids": [510], "latent_token_id": 511,
                    "suppress_token_ids": []}

``LatentSpec.from_config(cfg)`` returns ``None`` for a plain model (no ``latent_spec``): plain
models are untouched and reject the knob (see :func:`resolve_latent_budget`).

Knob (one per request)
----------------------
``SamplingParams(extra_args={"latent_budget": n})``; over the OpenAI API
``extra_body={"vllm_xargs": {"latent_budget": n}}`` (vLLM copies ``vllm_xargs`` into
``extra_args``). Missing key, ``None`` value or ``extra_args=None`` means the model's
``default_budget``. Anything else must be an ``int`` (``bool`` is refused) with
``0 <= n <= max_budget``; otherwise ``ValueError`` naming ``latent_budget`` and the range (the
server turns it into HTTP 400). Requests with different budgets may share a batch.

What the user sends, what the engine appends
--------------------------------------------
The prompt is the plain question, tokenized by the model's tokenizer with its default special
tokens (Llama tokenizers prepend BOS, GPT-2 adds nothing). The original repos build it as:
COCONUT and LOTUS ``question + "\\n"``; CODI the stripped question, no newline. The engine never
edits the prompt; after it, the engine appends (``n`` = resolved budget)::

    feedback (COCONUT, CODI):
        prompt | start_token_ids | n latent positions | end_token_ids | answer ...
        latent position i (i = 0..n-1) is one ordinary causal position with one KV slot;
        its input embedding is  f(h)  where h is the post-final-norm last hidden state
        (HF ``hidden_states[-1]``; GPT-2 after ``ln_f``, Llama after ``norm``) of the position
        right before it (i = 0: the last start token). f = identity for COCONUT,
        f = prj for CODI (Dropout, Linear(H,prj_dim), GELU(erf), Linear(prj_dim,H), LayerNorm).
        GPT-2 adds its position embedding (wpe) to the injected vector like to any input embedding.
        The hidden state of the last latent position is not used (CODI computes prj of it and
        drops it). n = 0: the end tokens follow the start tokens directly.

    looped (LOTUS):
        prompt | start_token_ids | block of n*c_thought latent_token_id | end_token_ids | answer ...
        region = [last start token .. last latent] (the <|start-latent|> position is inside it).
        pass 0: ordinary forward of prompt + start + block (block inputs = E(latent_token_id)).
        passes 1..n: re-forward the whole region IN PLACE (same positions, same KV slots, one
        parallel causal extend over the region attending to the prefix KV and to itself); the
        input at each latent position is E(latent_token_id) + h_prev[same position] ("add",
        the released mode; "replace" = h_prev alone), h_prev = post-final-norm hidden state of
        that position from the previous pass; the start token keeps E(start) (re-forwarding it
        is a no-op: same input, same context). Only the last pass's region KV survives.
        Then end_token_ids are forwarded with prefix KV + last-pass region KV.
        Total region passes = 1 + n. n = 0: no block, a single ordinary forward
        (LOTUS ``n_looped_iters=0``), i.e. prompt | start | end | answer.

Budget semantics
----------------
``feedback``: n = number of continuous thoughts (latent positions), COCONUT's K
(= c_thought x max_latent_stage = 6 for GSM8K), CODI's ``inf_latent_iterations`` (6).
``looped``: n = number of loop iterations (LOTUS ``n_looped_iters``, trained default 6); the block
has ``n * c_thought`` positions (LOTUS allocates ``n_looped_iters * c_thought`` latents, so the two
cannot be chosen separately without leaving the trained regime) and the region is forwarded
``1 + n`` times. ``LatentSpec.latent_positions(n)`` and ``LatentSpec.passes(n)`` give both numbers.

Answer decoding and outputs
---------------------------
The first answer token comes from the logits of the LAST end token. Then ordinary decoding
(greedy in the references: argmax, lowest id wins ties) until EOS (the config's
``eos_token_id``, int or list) or ``max_tokens`` answer tokens. ``suppress_token_ids`` are never
sampled in the answer (CODI: ``eot``; the original slices logits to ``[:vocab_size-1]``). Any
other sampled id, including the special latent ids, is an ordinary token (never re-enters
latent mode).

What the user receives (``LLM.generate``, ``/v1/completions``, ``/v1/chat/completions``; all three
families): ``text`` (chat: ``message.content``), ``token_ids`` and ``logprobs`` hold the answer
only, EOS included when it stopped the request (as vLLM does); ``max_tokens``, ``min_tokens``, stop
strings and ``usage.completion_tokens`` count answer tokens, so ``completion_tokens <= max_tokens``.
Start tokens, latent positions and end tokens are reported on the prompt side, where the engine
holds them: ``RequestOutput.prompt_token_ids`` (the OpenAI API's ``prompt_token_ids`` with
``"return_token_ids": true``) is the prompt followed by the latent phase, and
``usage.prompt_tokens`` counts it; the phase occupies sequence positions (it counts toward
``max_model_len``). A latent position is recorded as a placeholder id: ``latent_token_id``
(COCONUT and LOTUS ``<|latent|>``), else the model's pad id (CODI). The step count is visible
there: :meth:`LatentSpec.phase_budget` reads the budget back from ``prompt_token_ids``.
(Feedback models compute their phase in decode steps; the engine emits it as its first outputs
and the front end moves it to the prompt side before detokenizing -- ``vllm_patches.py``. vLLM's
token counters follow: ``vllm:generation_tokens`` counts answer tokens, ``vllm:prompt_tokens`` the
prompt the engine prefilled, so a feedback model's phase is in neither.)
Differences from the originals' batch-1 ``generate``: COCONUT and LOTUS drop a final EOS from
their returned tokens and never stop on the first answer token; we stop on EOS everywhere and keep
it.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

LATENT_BUDGET_KEY = "latent_budget"
CONFIG_KEY = "latent_spec"


@dataclass(frozen=True)
class LatentSpec:
    """What kind of latent model this is and how much latent compute it was trained for.

    ``kind``: ``"feedback"`` (hidden state fed back as the next input: COCONUT, CODI) or
    ``"looped"`` (a block of latent positions re-forwarded in place: LOTUS).
    ``default_budget``: the trained default (COCONUT 6 thoughts, CODI 6 iterations, LOTUS 6 loops).
    ``c_thought``: looped only, latent positions per loop (LOTUS: 25 for Llama, 13 for GPT-2);
    always 1 for feedback models (one position per budget unit).
    ``start_token_ids`` / ``end_token_ids``: appended by the engine before / after the latent phase.
    ``latent_token_id``: looped: the token whose embedding fills the block; feedback: the
    placeholder id an engine may record at latent positions (COCONUT ``<|latent|>``; CODI has none).
    ``max_budget``: largest accepted ``latent_budget``.
    ``suppress_token_ids``: never sampled in the answer (CODI's ``eot``).
    """

    kind: Literal["feedback", "looped"]
    default_budget: int
    c_thought: int = 1
    start_token_ids: tuple[int, ...] = ()
    end_token_ids: tuple[int, ...] = ()
    latent_token_id: int | None = None
    max_budget: int = 64
    suppress_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        def ints(name: str) -> tuple[int, ...]:
            val = tuple(getattr(self, name))
            if not all(_is_int(t) and t >= 0 for t in val):
                raise ValueError(f"LatentSpec.{name} must be a list of token ids, got {val!r}")
            object.__setattr__(self, name, tuple(int(t) for t in val))
            return val

        if self.kind not in ("feedback", "looped"):
            raise ValueError(f"LatentSpec.kind must be 'feedback' or 'looped', got {self.kind!r}")
        for name in ("default_budget", "c_thought", "max_budget"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"LatentSpec.{name} must be an integer, got {getattr(self, name)!r}")
        if self.c_thought < 1 or (self.kind == "feedback" and self.c_thought != 1):
            raise ValueError(f"LatentSpec.c_thought must be >= 1 (and 1 for feedback), got {self.c_thought}")
        if not 0 <= self.default_budget <= self.max_budget:
            raise ValueError(
                f"LatentSpec.default_budget must be in [0, max_budget={self.max_budget}], got {self.default_budget}"
            )
        start, end = ints("start_token_ids"), ints("end_token_ids")
        ints("suppress_token_ids")
        if not start or not end:
            raise ValueError("LatentSpec.start_token_ids and end_token_ids must each hold at least one token id")
        if self.kind == "looped" and self.latent_token_id is None:
            raise ValueError("LatentSpec.latent_token_id is required for kind 'looped'")
        if self.latent_token_id is not None and not _is_int(self.latent_token_id):
            raise ValueError(f"LatentSpec.latent_token_id must be a token id, got {self.latent_token_id!r}")

    # -- derived numbers ------------------------------------------------------------------
    def latent_positions(self, budget: int) -> int:
        """Sequence positions the latent phase occupies (start/end tokens excluded)."""
        return budget * self.c_thought

    def passes(self, budget: int) -> int:
        """Forwards over the latent region: looped 1 + budget; feedback 1 per latent position."""
        return 1 + budget if self.kind == "looped" else budget

    def appended_tokens(self, budget: int) -> int:
        """All positions the engine adds before the first answer token."""
        return len(self.start_token_ids) + self.latent_positions(budget) + len(self.end_token_ids)

    def phase_budget(self, prompt_token_ids) -> int | None:
        """The latent budget a request ran with, read from the end of its output's
        ``prompt_token_ids`` (prompt + start + latent positions + end); None if it does not end
        with a latent phase."""
        ids, start, end = list(prompt_token_ids), list(self.start_token_ids), list(self.end_token_ids)
        body_end = len(ids) - len(end)
        if body_end < len(start) or ids[body_end:] != end:
            return None
        for first in range(body_end - len(start), -1, -1):  # the nearest start tokens before the end
            if ids[first : first + len(start)] == start:
                positions = body_end - first - len(start)
                return positions // self.c_thought if positions % self.c_thought == 0 else None
        return None

    # -- config.json ----------------------------------------------------------------------
    def to_config(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("start_token_ids", "end_token_ids", "suppress_token_ids"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_config(cls, config: Any) -> LatentSpec | None:
        """Read ``latent_spec`` from a config dict or a transformers ``PretrainedConfig``;
        ``None`` for a plain model."""
        raw = config.get(CONFIG_KEY) if isinstance(config, Mapping) else getattr(config, CONFIG_KEY, None)
        if raw is None:
            return None
        if isinstance(raw, LatentSpec):
            return raw
        if not isinstance(raw, Mapping):
            raise ValueError(f"config '{CONFIG_KEY}' must be an object, got {type(raw).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"config '{CONFIG_KEY}' has unknown keys {sorted(unknown)}; allowed: {sorted(known)}")
        return cls(**dict(raw))


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def resolve_latent_budget(extra_args: Mapping[str, Any] | None, spec: LatentSpec | None) -> int | None:
    """The request's latent budget: ``extra_args["latent_budget"]``, else the model default.

    Returns ``None`` for a plain model (``spec is None``) when no budget was asked for.
    Raises ``ValueError`` (message names ``latent_budget`` and the allowed range) for a bad value,
    or when a plain model is given a budget.
    """
    value = None if extra_args is None else extra_args.get(LATENT_BUDGET_KEY)
    if spec is None:
        if value is not None:
            raise ValueError(
                f"{LATENT_BUDGET_KEY}: this model is not a latent-reasoning model (no latent_spec); "
                f"leave {LATENT_BUDGET_KEY} unset"
            )
        return None
    if value is None:
        return spec.default_budget
    allowed = f"an integer in [0, {spec.max_budget}] (default {spec.default_budget})"
    if not _is_int(value):
        raise ValueError(f"{LATENT_BUDGET_KEY} must be {allowed}; got {value!r} ({type(value).__name__})")
    if not 0 <= value <= spec.max_budget:
        raise ValueError(f"{LATENT_BUDGET_KEY} must be {allowed}; got {value}")
    return int(value)
