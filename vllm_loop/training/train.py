"""Train a small looped LM from scratch and write it as a checkpoint folder the plugin serves.

Objectives, in miniature:

* Ouro (Zhu et al. 2025, stage I): per token, the expected loss over exit depths minus an entropy
  bonus, ``sum_t p_t CE_t - beta H(p)``, where ``p`` is the exit distribution of the learned gate
  (``lambda_t = sigmoid(gate(h_t))``, the last depth takes the remaining mass), mixed with a plain
  loss at every depth: ``sum_t ((1 - u) p_t + u / T) CE_t - beta H(p)``. ``u = 0`` is Ouro's
  objective as published; a short run needs ``u > 0``: early in training the shallowest depth has
  the lowest loss, the gate piles its mass there and the deeper depths, starved of gradient, end
  up worse than depth 1 (seen on the tiny preset with u = 0, beta = 0.05). Optionally stage II ("focused gate
  training"): the LM frozen, the gate alone learns by binary cross-entropy to continue where the
  next depth still lowers the token's loss (target ``sigmoid(k (I - gamma))``, ``I`` the detached
  loss improvement, k = 50, gamma = 0.005).
* Raven (Geiping et al. 2025, Huginn): a recurrence count per batch drawn from a Poisson-lognormal
  with the configured mean (``r = Poisson(exp(tau)) + 1``, ``tau ~ N(log mean - sigma^2 / 2, sigma)``,
  sigma = 0.5), the state initialised randomly (truncated normal), only the last
  ``mean_backprop_depth`` recurrences back-propagated, the loss read at depth r. At test time the
  depth R is fixed per deployment (config ``mean_recurrence``) and the state init is ``seeded``.

Same seed, same corpus, same device and thread count: the same loss curve (CPU). The checkpoint's
config, tensor names and tokenizer come from the checkpoint factory (``plan_checkpoint``), so a
trained folder has exactly the keys of the random test checkpoints and of the real models.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_loop.training.corpus import Corpus
from vllm_loop.training.modules import OuroLM, RavenLM

FAMILIES = {"ouro": "ouro", "raven": "huginn_raven"}
FACTORY_OPTIONS = {"ouro": {}, "raven": {"layout": "huginn", "state_init": "seeded"}}
TRAINING_VERSION = 1  # bump when a change alters what a given spec trains (invalidates caches)


@dataclass(frozen=True)
class ModelSpec:
    family: str  # "ouro" | "raven"
    hidden: int
    heads: int
    intermediate: int
    vocab: int  # BPE vocabulary size (special tokens included)
    depth: int  # Ouro: total_ut_steps T; Raven: test-time recurrence R (config mean_recurrence)
    layers: int = 2  # Ouro: shared layers L
    prelude: int = 1  # Raven
    core: int = 2  # Raven
    coda: int = 1  # Raven
    train_recurrence: int = 0  # Raven: mean recurrence of the training sampler (0: = depth)
    backprop_depth: int = 4  # Raven: recurrences with gradients (Huginn: mean_backprop_depth)
    max_positions: int = 2048

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: allowed {', '.join(FAMILIES)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads}")


@dataclass(frozen=True)
class TrainSpec:
    seq_len: int = 128
    batch: int = 16
    steps: int | None = 300  # None: as many as fit time_budget_s (measured after the first steps)
    time_budget_s: float = 0.0  # for steps=None; also a hard stop at 1.15x when > 0
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dropout: float = 0.0
    entropy_beta: float = 0.1  # Ouro stage I: entropy bonus of the exit distribution
    depth_uniform: float = 0.5  # Ouro stage I: weight u of the plain every-depth loss (0 = as published)
    gate_steps: int = 0  # Ouro stage II
    gate_lr: float = 1e-3
    eval_every: int = 0  # 0: only at the end; else held-out loss every N steps, best kept
    eval_tokens: int = 16384  # held-out tokens for the loss during training
    log_every: int = 10
    seed: int = 0
    bf16: bool = False  # autocast (GPU)


@dataclass
class TrainResult:
    path: Path
    family: str
    config: dict
    history: list[dict] = field(default_factory=list)  # logged steps
    evals: list[dict] = field(default_factory=list)  # held-out losses during training
    steps: int = 0
    best_step: int = 0
    seconds: float = 0.0
    tokens_seen: int = 0
    stopped_early: bool = False
    device: str = "cpu"


# -- data -----------------------------------------------------------------------------------------------
def tokenizer_texts(corpus: Corpus) -> list[str]:
    """The tokenizer's training text: paragraphs of the training works (newlines kept inside)."""
    return [p for t in corpus.train_texts() for p in t.split("\n\n") if p.strip()]


def encode_works(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    """One token stream: each work's paragraphs (joined by blank lines), then EOS between works."""
    ids: list[int] = []
    for text in texts:
        paragraphs = text.split("\n\n")
        chunks = [p + ("\n\n" if i < len(paragraphs) - 1 else "\n") for i, p in enumerate(paragraphs)]
        for enc in tok.encode_batch(chunks, add_special_tokens=False):
            ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def eos_token(family: str) -> str:
    return "<|endoftext|>" if family == "ouro" else "<|end_text|>"


def _config_overrides(m: ModelSpec) -> dict:
    if m.family == "ouro":
        hd = m.hidden // m.heads
        return {"hidden_size": m.hidden, "num_attention_heads": m.heads, "num_key_value_heads": m.heads,
                "head_dim": hd, "intermediate_size": m.intermediate, "num_hidden_layers": m.layers,
                "total_ut_steps": m.depth, "max_position_embeddings": m.max_positions}
    return {"n_embd": m.hidden, "n_heads": m.heads, "intermediate_size": m.intermediate,
            "n_layers_in_prelude": m.prelude, "n_layers_in_recurrent_block": m.core, "n_layers_in_coda": m.coda,
            "mean_recurrence": m.depth, "mean_backprop_depth": m.backprop_depth, "block_size": m.max_positions}


_DATA_CACHE: dict = {}  # (family, vocab, corpus sha256) -> (tokenizer, train stream, held-out stream)


def prepare_data(family: str, vocab: int, corpus: Corpus):
    """``(tokenizer, train stream, held-out stream)``, trained / encoded once per process."""
    key = (family, vocab, corpus.sha256)
    if key not in _DATA_CACHE:
        from vllm_loop.testing.checkpoints import _load_families, FAMILIES as FACTORY, _check_options, train_tokenizer

        _load_families()
        fam = FACTORY[FAMILIES[family]]
        spec = fam.tokenizer(_check_options(fam, FACTORY_OPTIONS[family]))
        tok = train_tokenizer(spec, vocab, tokenizer_texts(corpus))
        eos = tok.token_to_id(eos_token(family))
        _DATA_CACHE.clear()  # keep one corpus encoding in memory
        _DATA_CACHE[key] = (tok, encode_works(tok, corpus.train_texts(), eos), encode_works(tok, corpus.heldout_texts(), eos))
    return _DATA_CACHE[key]


def plan(m: ModelSpec, corpus: Corpus, seed: int):
    """(factory checkpoint with meta tensors, tokenizer spec, tokenizer) for the model spec."""
    from vllm_loop.testing.checkpoints import plan_checkpoint

    tok = prepare_data(m.family, m.vocab, corpus)[0]
    return plan_checkpoint(FAMILIES[m.family], seed=seed, options=FACTORY_OPTIONS[m.family], tokenizer_vocab=m.vocab,
                           weights=False, tokenizer=tok, **_config_overrides(m))


def build_model(family: str, config: dict, dropout: float = 0.0):
    return (OuroLM if family == "ouro" else RavenLM)(config, dropout)


def export_tensors(family: str, model, config: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: the state dict, plus Huginn's stored extras (a second copy of the
    tied embedding as ``lm_head.weight`` and the ``freqs_cis`` RoPE table)."""
    tensors = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    if family == "raven":
        from vllm_loop.reference.common import huginn_freqs_cis

        tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
        tensors["freqs_cis"] = huginn_freqs_cis(config["head_dim"], config["block_size"], config["rope_base"])
    return tensors


def load_trained(path: Path, device="cpu"):
    """``(family, model, config)`` of a trained checkpoint folder (eval mode, fp32)."""
    from vllm_loop.reference import read_tensors

    config = json.loads((Path(path) / "config.json").read_text())
    family = "ouro" if config["model_type"] == "ouro" else "raven"
    model = build_model(family, config)
    tensors = read_tensors(Path(path))
    if family == "raven":
        tensors = {k: v for k, v in tensors.items() if k not in ("lm_head.weight", "freqs_cis")}
    model.load_state_dict(tensors, strict=True)
    return family, model.to(device).eval(), config


# -- objectives -----------------------------------------------------------------------------------------
def ouro_losses(model: OuroLM, x, y, beta: float, uniform: float = 0.0):
    """Stage I: ``(loss, per-depth mean CE [T], mean exit pdf [T])``."""
    states, gates = model(x)
    V = model.lm_head.weight.shape[0]
    ce = torch.stack([F.cross_entropy(model.logits(s).float().reshape(-1, V), y.reshape(-1), reduction="none")
                      for s in states])  # [T, N]
    pdf = model.exit_pdf(gates.reshape(len(states), -1))  # [T, N]
    entropy = -(pdf * pdf.clamp_min(1e-12).log()).sum(0)
    weight = (1.0 - uniform) * pdf + uniform / len(states)
    loss = (weight * ce).sum(0).mean() - beta * entropy.mean()
    return loss, ce.mean(1).detach(), pdf.mean(1).detach()


def ouro_gate_loss(model: OuroLM, x, y, k: float = 50.0, gamma: float = 0.005):
    """Stage II: BCE of the exit probability at depth t against 'the next depth does not help'."""
    with torch.no_grad():
        states, _ = model(x)
        V = model.lm_head.weight.shape[0]
        ce = torch.stack([F.cross_entropy(model.logits(s).float().reshape(-1, V), y.reshape(-1), reduction="none")
                          for s in states])
        improve = (ce[:-1] - ce[1:]).clamp_min(0)  # [T-1, N]
        cont = torch.sigmoid(k * (improve - gamma))
    logits = torch.stack([model.model.early_exit_gate(s.detach()).squeeze(-1).float().reshape(-1)
                          for s in states[:-1]])  # exit logits, lambda_t = sigmoid
    return F.binary_cross_entropy_with_logits(logits, 1.0 - cont)  # (plain BCE refuses autocast)


def sample_recurrence(mean: int, backprop: int, g: torch.Generator, sigma: float = 0.5) -> tuple[int, int]:
    """Huginn's Poisson-lognormal recurrence count: ``(no-grad steps, grad steps)``."""
    mu = math.log(mean) - sigma**2 / 2
    rate = torch.empty(1).log_normal_(mu, sigma, generator=g)
    r = int(torch.poisson(rate, generator=g).item()) + 1
    return max(r - backprop, 0), min(r, backprop)


def raven_loss(model: RavenLM, x, y, n_free: int, n_grad: int, g_state: torch.Generator):
    e = model.embed(x)
    s = model.initial_state(e, g_state)
    with torch.no_grad():
        for _ in range(n_free):
            s = model.core(s, e)
    s = s.detach()
    for _ in range(n_grad):
        s = model.core(s, e)
    logits = model.readout(s)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def heldout_depth_losses(family: str, model, stream: torch.Tensor, seq_len: int, batch: int, depths,
                         max_tokens: int | None = None, bf16: bool = False) -> dict:
    """Mean CE at each depth over non-overlapping windows of ``stream`` (Raven: seeded state init,
    as deployed). Returns ``{"ce": {r: ce}, "tokens": n}`` (+ Ouro: ``"exit_pdf": {r: mean p_r}``)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    n = (len(stream) - 1) // seq_len
    if max_tokens:
        n = min(n, max(1, max_tokens // seq_len))
    depths = sorted(set(depths))
    sums = {r: 0.0 for r in depths}
    pdf_sum = None
    for i in range(0, n, batch):
        rows = range(i, min(n, i + batch))
        x = torch.stack([stream[j * seq_len:(j + 1) * seq_len] for j in rows]).to(device)
        y = torch.stack([stream[j * seq_len + 1:(j + 1) * seq_len + 1] for j in rows]).to(device)
        def add(r, logits):  # one depth's logits at a time (R=32 readouts would not fit at once)
            sums[r] += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                       reduction="sum").item()

        with _autocast(device, bf16):
            if family == "ouro":
                states, gates = model(x, depth=depths[-1])
                for r in depths:
                    add(r, model.logits(states[r - 1]))
                pdf = model.exit_pdf(gates.reshape(len(states), -1)).sum(1)
                pdf_sum = pdf if pdf_sum is None else pdf_sum + pdf
            else:
                e = model.embed(x)
                state = model.initial_state(e)
                for r in range(1, depths[-1] + 1):
                    state = model.core(state, e)
                    if r in depths:
                        add(r, model.readout(state))
    tokens = n * seq_len
    out = {"ce": {r: sums[r] / tokens for r in depths}, "tokens": tokens}
    if pdf_sum is not None:
        out["exit_pdf"] = {r + 1: v for r, v in enumerate((pdf_sum / tokens).tolist())}
    model.train(was_training)
    return out


def _autocast(device, bf16: bool):
    if bf16:
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return torch.autocast(device_type="cpu", enabled=False)


def _lr(step: int, total: int, t: TrainSpec) -> float:
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    frac = min(1.0, (step - t.warmup_steps) / max(1, total - t.warmup_steps))
    return t.lr * (t.min_lr_frac + (1 - t.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def _optimizer(model, t: TrainSpec):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "qk_bias" not in name else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(0.9, 0.95), eps=1e-8)


class _Progress:
    """tqdm when installed (and wanted), else nothing; ``write`` prints above the bar."""

    def __init__(self, total: int | None, desc: str, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, leave=True)
            except ImportError:
                self.bar = None

    def update(self, n=1, **postfix):
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)

    def set_total(self, total: int):
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def write(self, text: str):
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# -- the loop -------------------------------------------------------------------------------------------
def train(m: ModelSpec, t: TrainSpec, corpus: Corpus, out: Path, *, device: str = "cpu", progress: bool = True,
          log=None, verbose: bool = True) -> TrainResult:
    """Train one model and write its checkpoint folder ``out`` (its parent must exist).
    ``log(line)`` receives the printed loss lines (default: printed)."""
    from vllm_loop.testing.checkpoints import write_checkpoint

    t0 = time.perf_counter()
    torch.manual_seed(t.seed)
    ckpt, spec, tok = plan(m, corpus, t.seed)
    config = ckpt.config
    _, train_stream, held_stream = prepare_data(m.family, m.vocab, corpus)

    model = build_model(m.family, config, t.dropout).to(device)
    names = {k: tuple(v.shape) for k, v in export_tensors(m.family, model, config).items()}
    expected = {k: tuple(v.shape) for k, v in ckpt.tensors.items()}
    if names != expected:
        raise AssertionError(f"trainable module does not match the factory's tensors: "
                             f"{sorted(set(names) ^ set(expected))[:6]} / shapes differ")
    model.train()
    opt = _optimizer(model, t)
    g_data = torch.Generator().manual_seed(t.seed + 1)
    g_depth = torch.Generator().manual_seed(t.seed + 2)
    g_state = torch.Generator(device=device).manual_seed(t.seed + 3)
    res = TrainResult(path=Path(out), family=m.family, config=config, device=str(device))
    total = t.steps if t.steps is not None else 10**9
    bar = _Progress(t.steps, f"train {m.family}", progress)
    say = (lambda s: (bar.write(s), log(s) if log else None)) if verbose else (lambda s: log(s) if log else None)
    mean_rec = m.train_recurrence or m.depth
    best, best_loss = None, float("inf")
    n_tokens = len(train_stream)
    say(f"[{m.family}] {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab {config['vocab_size']}, "
        f"train {n_tokens:,} tokens, held out {len(held_stream):,} tokens, device {device}")
    step = 0
    t_loop = time.perf_counter()
    calib_at = 20
    while step < total:
        lr = _lr(step, total, t)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, n_tokens - t.seq_len - 1, (t.batch,), generator=g_data)
        idx = starts[:, None] + torch.arange(t.seq_len + 1)[None, :]
        xy = train_stream[idx].to(device)
        x, y = xy[:, :-1], xy[:, 1:]
        with _autocast(device, t.bf16):
            if m.family == "ouro":
                loss, ce, pdf = ouro_losses(model, x, y, t.entropy_beta, t.depth_uniform)
                rec = None
            else:
                n_free, n_grad = sample_recurrence(mean_rec, m.backprop_depth, g_depth)
                loss = raven_loss(model, x, y, n_free, n_grad, g_state)
                rec = n_free + n_grad
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        step += 1
        res.tokens_seen += t.batch * t.seq_len
        if t.steps is None and step == 3:  # the first steps pay for warm-up (kernels, allocator)
            _sync(device)
            t_loop = time.perf_counter()
        if t.steps is None and step == calib_at:  # fix the step count from the measured speed
            _sync(device)
            per_step = (time.perf_counter() - t_loop) / (calib_at - 3)
            # reserve time for the held-out evaluations (forward passes over eval_tokens, counted as
            # training steps of as many tokens) and for the gate-only stage II (about half a step each)
            n_evals = 0 if not t.eval_every else 1 + (t.time_budget_s / per_step) // t.eval_every
            eval_cost = n_evals * max(1.0, t.eval_tokens / (t.batch * t.seq_len)) * per_step
            gate_cost = (t.gate_steps if m.family == "ouro" else 0) * 0.5 * per_step
            budget = t.time_budget_s - (time.perf_counter() - t0) - eval_cost - gate_cost
            total = max(step + 1, int(step + budget / per_step))
            bar.set_total(total)
            say(f"[{m.family}] {per_step * 1e3:.0f} ms/step over steps 4-{calib_at}: training {total} steps "
                f"to fit {t.time_budget_s:.0f} s")
        if step % t.log_every == 0 or step == total:
            row = {"step": step, "lr": lr, "loss": round(loss.item(), 4), "grad_norm": round(float(gnorm), 3)}
            if m.family == "ouro":
                row["ce"] = [round(v, 4) for v in ce.tolist()]
                row["exit_pdf"] = [round(v, 3) for v in pdf.tolist()]
                line = f"step {step:5d}  loss {row['loss']:.4f}  ce@depth " + " ".join(f"{v:.4f}" for v in row["ce"])
            else:
                row["recurrence"] = rec
                line = f"step {step:5d}  loss {row['loss']:.4f}  (r={rec})"
            res.history.append(row)
            say(line)
        bar.update(1, loss=f"{loss.item():.3f}")
        if t.eval_every and (step % t.eval_every == 0 or step == total):
            ev = heldout_depth_losses(m.family, model, held_stream, t.seq_len, t.batch, [m.depth], t.eval_tokens,
                                      t.bf16)
            val = ev["ce"][m.depth]
            res.evals.append({"step": step, "heldout_ce": round(val, 4)})
            say(f"step {step:5d}  held-out CE at depth {m.depth}: {val:.4f}")
            if val < best_loss:
                best_loss, res.best_step = val, step
                best = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if t.time_budget_s and time.perf_counter() - t0 > 1.15 * t.time_budget_s and step < total:
            say(f"[{m.family}] stopping at step {step}: over 1.15x the time budget")
            res.stopped_early = True
            break
    bar.close()
    res.steps = step
    if best is not None and res.best_step != step:
        model.load_state_dict(best)
        say(f"[{m.family}] keeping the weights of step {res.best_step} (lowest held-out CE {best_loss:.4f})")
    if not res.best_step:
        res.best_step = step
    if m.family == "ouro" and t.gate_steps:
        _train_gate(model, t, train_stream, g_data, device, say)
    model.eval()
    ckpt.tensors = export_tensors(m.family, model, config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out, ckpt, spec, tok)
    res.seconds = time.perf_counter() - t0
    (out / "training.json").write_text(json.dumps(training_record(res, m, t, corpus), indent=1) + "\n")
    say(f"[{m.family}] wrote {out} after {res.steps} steps, {res.tokens_seen:,} tokens, {res.seconds:.1f} s")
    return res


def _train_gate(model: OuroLM, t: TrainSpec, stream, g_data, device, say) -> None:
    """Ouro stage II: only the exit gate learns."""
    for p in model.parameters():
        p.requires_grad_(False)
    gate = list(model.model.early_exit_gate.parameters())
    for p in gate:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(gate, lr=t.gate_lr, weight_decay=0.0)
    model.eval()  # no dropout: the gate learns from the deployed LM
    loss = None
    for _ in range(t.gate_steps):
        starts = torch.randint(0, len(stream) - t.seq_len - 1, (t.batch,), generator=g_data)
        xy = stream[starts[:, None] + torch.arange(t.seq_len + 1)[None, :]].to(device)
        with _autocast(device, t.bf16):
            loss = ouro_gate_loss(model, xy[:, :-1], xy[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    for p in model.parameters():
        p.requires_grad_(True)
    say(f"[ouro] gate stage II: {t.gate_steps} steps, final BCE {loss.item():.4f}")


def training_record(res: TrainResult, m: ModelSpec, t: TrainSpec, corpus: Corpus) -> dict:
    return {"family": m.family, "model": asdict(m), "train": asdict(t), "steps": res.steps, "best_step": res.best_step,
            "tokens_seen": res.tokens_seen, "seconds": round(res.seconds, 2), "stopped_early": res.stopped_early,
            "device": res.device, "corpus": {"file": corpus.path.name, "sha256": corpus.sha256, "license": corpus.license},
            "training_version": TRAINING_VERSION, "history": res.history, "evals": res.evals}


# -- presets --------------------------------------------------------------------------------------------
# tiny: CPU (the demo and tests); h200: one H200, 150 s of training per model (both models plus their
# evaluation fit one 10-minute call).
PRESETS: dict[str, dict[str, tuple[ModelSpec, TrainSpec]]] = {
    "tiny": {
        "ouro": (ModelSpec("ouro", hidden=128, heads=4, intermediate=384, vocab=1024, depth=4, layers=2),
                 TrainSpec(seq_len=64, batch=16, steps=200, lr=6e-3, warmup_steps=20, log_every=25)),
        "raven": (ModelSpec("raven", hidden=128, heads=4, intermediate=384, vocab=1024, depth=8, prelude=1, core=2,
                            coda=1, train_recurrence=8, backprop_depth=4),
                  TrainSpec(seq_len=64, batch=16, steps=200, lr=6e-3, warmup_steps=20, log_every=25)),
    },
    "h200": {
        "ouro": (ModelSpec("ouro", hidden=512, heads=8, intermediate=1536, vocab=8192, depth=4, layers=8),
                 TrainSpec(seq_len=256, batch=64, steps=None, time_budget_s=150, lr=1.5e-3, warmup_steps=100,
                           dropout=0.1, gate_steps=200, eval_every=100, eval_tokens=65536, log_every=50, bf16=True)),
        "raven": (ModelSpec("raven", hidden=512, heads=8, intermediate=1536, vocab=8192, depth=32, prelude=2, core=4,
                            coda=2, train_recurrence=32, backprop_depth=8),
                  TrainSpec(seq_len=256, batch=64, steps=None, time_budget_s=150, lr=1.5e-3, warmup_steps=100,
                            dropout=0.1, eval_every=100, eval_tokens=65536, log_every=50, bf16=True)),
    },
}


def preset(name: str, family: str, **train_overrides) -> tuple[ModelSpec, TrainSpec]:
    if name not in PRESETS:
        raise ValueError(f"preset={name!r}: allowed {', '.join(PRESETS)}")
    m, t = PRESETS[name][family]
    return m, replace(t, **train_overrides)
