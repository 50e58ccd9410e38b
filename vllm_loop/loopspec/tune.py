"""Depth tuning for LoopSpec (paper Sections 4.1 and 5, Appendix G.2).

1. Measure ``TV(p_r, p_R)`` for every depth r (and greedy top-1 agreement) on a model's own
   continuations of some prompts, under the filtered (temperature / top-k / top-p) distributions.
2. Fit the power-law upper envelope ``phi(r) = beta r^-alpha``: among envelopes with ``phi >= TV`` at
   every measured depth, the one minimising the maximum ratio ``phi(r) / TV(r)``.
3. Theorem 2: the minimiser of the expected-steps bound
   ``f(d1, d2) = d1 + beta d1^-alpha d2 + 2 beta d2^-alpha R`` is
   ``d1* = (ab)^((a+1)/D) (2aR)^(1/D)``, ``d2* = (ab)^(a/D) (2aR)^((a+1)/D)``, ``D = a^2 + a + 1``
   (a = alpha, b = beta; from the stationary conditions ``d2 = d1^(a+1) / (ab)`` and
   ``d2^(a+1) = 2aR d1^a``), valid when ``1 <= d1* < d2* < R``.
4. The best valid integer schedule: minimise f over all valid (d1, d2), and
   ``f1(d1) = d1 + beta d1^-alpha R`` for single-proposal schedules.

The envelope fit is exact: with ``g_r(alpha) = log TV(r) + alpha log r`` the tightest beta for a given
alpha is ``max_r exp(g_r)`` and the log of the maximum ratio is ``max_r g_r - min_r g_r``, a convex
piecewise-linear function of alpha, so its minimum lies at a crossing of two lines ``g_r = g_s`` or at
an end of the search interval; all of them are evaluated.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

import torch

from vllm_loop.loopspec.executor import full_depth_generate
from vllm_loop.loopspec.proposals import SamplingParams, filter_probs, sample_token, total_variation
from vllm_loop.loopspec.schedule import LoopSpecSchedule
from vllm_loop.reference.kv import SequenceKV

ALPHA_RANGE = (1e-3, 20.0)


# -- envelope -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Envelope:
    beta: float
    alpha: float
    max_ratio: float  # max over fitted depths of phi(r) / TV(r)  (>= 1)
    depths: tuple[int, ...]  # depths used in the fit (0 < TV, r < R)

    def __call__(self, r):
        return self.beta * r ** (-self.alpha)


def fit_power_envelope(depths, tv, alpha_range=ALPHA_RANGE) -> Envelope:
    """Tightest power-law upper envelope of the points ``(r, TV(r))`` (points with TV <= 0 are
    dropped: no power law bounds them with a finite ratio)."""
    pts = [(int(r), float(v)) for r, v in zip(depths, tv) if v > 0]
    if len(pts) < 2:
        raise ValueError(f"need TV > 0 at two or more depths to fit an envelope, got {len(pts)}")
    logr = [math.log(r) for r, _ in pts]
    logtv = [math.log(v) for _, v in pts]

    def spread(a: float) -> tuple[float, float]:
        g = [lt + a * lr for lt, lr in zip(logtv, logr)]
        return max(g) - min(g), max(g)

    lo, hi = alpha_range
    candidates = {lo, hi}
    for i, j in itertools.combinations(range(len(pts)), 2):
        if logr[i] != logr[j]:
            a = (logtv[j] - logtv[i]) / (logr[i] - logr[j])
            if lo <= a <= hi:
                candidates.add(a)
    best = min(sorted(candidates), key=lambda a: spread(a)[0])
    h, log_beta = spread(best)
    return Envelope(beta=math.exp(log_beta), alpha=best, max_ratio=math.exp(h), depths=tuple(r for r, _ in pts))


# -- Theorem 2 ------------------------------------------------------------------------------------------
def optimal_depths(beta: float, alpha: float, R: float) -> tuple[float, float]:
    """Continuous minimiser (d1*, d2*) of ``f`` (Theorem 2, eq. 8)."""
    if beta <= 0 or alpha <= 0 or R <= 0:
        raise ValueError("beta, alpha and R must be > 0")
    ab, D = alpha * beta, alpha * alpha + alpha + 1
    d1 = ab ** ((alpha + 1) / D) * (2 * alpha * R) ** (1 / D)
    d2 = ab ** (alpha / D) * (2 * alpha * R) ** ((alpha + 1) / D)
    return d1, d2


def theorem2_min_depth(beta: float, alpha: float) -> float:
    """Theorem 2's condition: (d1*, d2*) satisfy ``1 <= d1* < d2* < R`` iff R exceeds this."""
    ab = alpha * beta
    return max(ab ** (1 / alpha), ab ** (-alpha - 1), ab ** (1 / alpha) * (2 * alpha) ** ((alpha**2 + alpha + 1) / alpha**2)) / (
        2 * alpha
    )


def cost_bound(d1: float, d2: float | None, beta: float, alpha: float, R: float) -> float:
    """Upper bound on expected recurrent steps per committed token (eq. 11); ``d2=None``: the
    single-proposal bound ``d1 + beta d1^-alpha R``."""
    if d2 is None:
        return d1 + beta * d1 ** (-alpha) * R
    return d1 + beta * d1 ** (-alpha) * d2 + 2 * beta * d2 ** (-alpha) * R


def cost_from_tv(d1: int, d2: int | None, tv: dict[int, float], R: int) -> float:
    """The same bound with the measured TV at d1, d2 in place of the envelope."""
    if d2 is None:
        return d1 + tv[d1] * R
    return d1 + tv[d1] * d2 + 2 * tv[d2] * R


def valid_schedules(R: int, single: bool = True) -> list[tuple[int, int | None]]:
    """Every (d1, d2) the schedule accepts for depth R: ``1 <= d1 < R`` (any d1, also one that does
    not divide R), ``d2`` a multiple of d1 with ``d1 < d2 < R``, and (``single``) ``d2=None``."""
    out: list[tuple[int, int | None]] = []
    for d1 in range(1, R):
        if single:
            out.append((d1, None))
        out.extend((d1, d2) for d2 in range(2 * d1, R, d1))
    for d1, d2 in out:  # every candidate passes the schedule's own validation
        LoopSpecSchedule(R, d1, d2)
    return out


def rank_schedules(beta: float, alpha: float, R: int, single: bool = True) -> list[tuple[float, int, int | None]]:
    """All valid integer schedules sorted by the envelope bound f: ``[(f, d1, d2), ...]``."""
    rows = [(cost_bound(d1, d2, beta, alpha, R), d1, d2) for d1, d2 in valid_schedules(R, single)]
    return sorted(rows, key=lambda row: (row[0], row[1], row[2] or 0))


# -- measurement ----------------------------------------------------------------------------------------
@dataclass
class DepthProfile:
    R: int
    depths: list[int]  # 1..R
    tv: list[float]  # mean TV(p_r, p_R) over the measured positions
    agreement: list[float]  # fraction of positions with argmax p_r == argmax p_R
    positions: int
    sampling: dict

    def tv_at(self) -> dict[int, float]:
        return dict(zip(self.depths, self.tv))


@torch.no_grad()
def _depth_logits(model, tokens: list[int], rows: slice) -> list[torch.Tensor]:
    """Logits of the selected positions at every depth 1..R (only those rows are kept)."""
    kv = SequenceKV()
    ids = torch.tensor(tokens)
    positions = torch.arange(len(tokens))
    state = model.pre(ids, positions, kv)
    out = []
    for t in range(model.depth):
        state = model.core_step(state, t, positions, kv)
        out.append(model.readout(state, t + 1, positions, kv)[rows].float())
    return out


@torch.no_grad()
def measure_depth_profile(
    model,
    prompts: list[list[int]],
    params: SamplingParams = SamplingParams(temperature=1.0),
    max_new_tokens: int = 32,
    *,
    seed: int = 0,
    positions: str = "generated",
    eos_token_id: int | None = None,
) -> DepthProfile:
    """TV(p_r, p_R) and greedy agreement per depth, averaged over token positions.

    ``positions="generated"``: the model first continues each prompt by ordinary full-depth decoding
    with ``params`` (seeded), and the positions that predict the continuation tokens (the last
    prompt position and the continuation's own, except its last) are measured: the distribution
    LoopSpec meets while decoding. ``positions="prompt"``: the prompt's own next-token positions.
    """
    if positions not in ("generated", "prompt"):
        raise ValueError(f"positions={positions!r}: allowed: generated, prompt")
    R = model.depth
    g = torch.Generator().manual_seed(seed)
    tv_sum = torch.zeros(R, dtype=torch.float64)
    agree_sum = torch.zeros(R, dtype=torch.float64)
    count = 0
    for prompt in prompts:
        if positions == "generated":
            eos = frozenset() if eos_token_id is None else frozenset([eos_token_id])
            cont = full_depth_generate(model, prompt, max_new_tokens, lambda lg: sample_token(lg, params, g), eos)
            tokens = list(prompt) + cont
            rows = slice(len(prompt) - 1, len(tokens) - 1)
        else:
            tokens = list(prompt)
            rows = slice(0, len(tokens) - 1)
        if rows.stop <= rows.start:
            continue
        logits = _depth_logits(model, tokens, rows)
        target = filter_probs(logits[-1], params)
        top = logits[-1].argmax(-1)
        for i, lg in enumerate(logits):
            tv_sum[i] += total_variation(filter_probs(lg, params), target).sum()
            agree_sum[i] += (lg.argmax(-1) == top).sum()
        count += rows.stop - rows.start
    if count == 0:
        raise ValueError("no positions to measure (prompts too short or empty)")
    return DepthProfile(
        R=R,
        depths=list(range(1, R + 1)),
        tv=(tv_sum / count).tolist(),
        agreement=(agree_sum / count).tolist(),
        positions=count,
        sampling=asdict(params),
    )


# -- the whole recommendation ---------------------------------------------------------------------------
@dataclass
class TuneResult:
    profile: DepthProfile | None
    envelope: Envelope
    R: int
    d_star: tuple[float, float]
    theorem2_valid: bool
    ranking: list[tuple[float, int, int | None]]  # by the envelope bound

    @property
    def best(self) -> tuple[int, int | None]:
        return self.ranking[0][1], self.ranking[0][2]

    @property
    def best_two_proposals(self) -> tuple[int, int]:
        return next((d1, d2) for _, d1, d2 in self.ranking if d2 is not None)

    def to_dict(self) -> dict:
        d = {
            "R": self.R,
            "beta": self.envelope.beta,
            "alpha": self.envelope.alpha,
            "envelope_max_ratio": self.envelope.max_ratio,
            "fitted_depths": list(self.envelope.depths),
            "d1_star": self.d_star[0],
            "d2_star": self.d_star[1],
            "theorem2_valid": self.theorem2_valid,
            "best": {"d1": self.best[0], "d2": self.best[1], "bound": self.ranking[0][0]},
            "best_two_proposals": dict(zip(("d1", "d2"), self.best_two_proposals)),
            "ranking": [{"bound": f, "d1": d1, "d2": d2} for f, d1, d2 in self.ranking],
        }
        if self.profile is not None:
            d["profile"] = asdict(self.profile)
            tv = self.profile.tv_at()
            d["ranking_measured"] = sorted(
                ({"bound": cost_from_tv(d1, d2, tv, self.R), "d1": d1, "d2": d2} for _, d1, d2 in self.ranking),
                key=lambda row: row["bound"],
            )
        return d


def recommend(beta: float, alpha: float, R: int, profile: DepthProfile | None = None, envelope=None) -> TuneResult:
    env = envelope or Envelope(beta=beta, alpha=alpha, max_ratio=float("nan"), depths=())
    d_star = optimal_depths(beta, alpha, R)
    valid = 1 <= d_star[0] < d_star[1] < R
    return TuneResult(profile, env, R, d_star, valid, rank_schedules(beta, alpha, R))


def tune_profile(profile: DepthProfile) -> TuneResult:
    fit_depths = [r for r in profile.depths if r < profile.R]
    env = fit_power_envelope(fit_depths, [profile.tv_at()[r] for r in fit_depths])
    return recommend(env.beta, env.alpha, profile.R, profile, env)


def format_profile(p: DepthProfile) -> str:
    lines = [f"measured on {p.positions} token positions, sampling {p.sampling}", "depth  TV(p_r, p_R)  greedy agreement"]
    for r, tv, ag in zip(p.depths, p.tv, p.agreement):
        lines.append(f"{r:5d}  {tv:12.5f}  {ag:15.2%}")
    return "\n".join(lines)


def format_result(res: TuneResult) -> str:
    lines = [] if res.profile is None else [format_profile(res.profile)]
    e = res.envelope
    lines.append(f"power-law envelope: phi(r) = {e.beta:.4f} * r^-{e.alpha:.4f}  (max phi/TV = {e.max_ratio:.3f})")
    lines.append(
        f"Theorem 2 optimum (R={res.R}): d1* = {res.d_star[0]:.2f}, d2* = {res.d_star[1]:.2f}"
        + ("" if res.theorem2_valid else "  (outside 1 <= d1* < d2* < R: the closed form does not apply)")
    )
    lines.append("best valid schedules by the bound f (expected recurrent steps per token):")
    for f, d1, d2 in res.ranking[:5]:
        lines.append(f"  d1={d1:<3d} d2={'-' if d2 is None else d2:<4}  f={f:.3f}  R/f={res.R / f:.2f}")
    if res.profile is not None:
        tv = res.profile.tv_at()
        f, d1, d2 = min((cost_from_tv(d1, d2, tv, res.R), d1, d2) for _, d1, d2 in res.ranking)
        lines.append(f"with the measured TV in place of the envelope: d1={d1} d2={'-' if d2 is None else d2} f={f:.3f}")
    d1, d2 = res.best
    from vllm_loop.loopspec.config import flag

    lines.append(f"recommended LoopSpec schedule: vllm serve MODEL {flag(d1, d2)}")
    return "\n".join(lines)


def plot_fit(res: TuneResult, path) -> None:
    """Log-log plot of the measured TV per depth, the envelope, and the greedy agreement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    if res.profile is not None:
        p = res.profile
        rs = [r for r, v in zip(p.depths, p.tv) if r < p.R and v > 0]
        ax1.loglog(rs, [p.tv_at()[r] for r in rs], "o", label="measured TV(p_r, p_R)")
        ax2.plot(p.depths, [100 * a for a in p.agreement], "o-")
    rr = torch.linspace(1, res.R, 200).tolist()
    e = res.envelope
    ax1.loglog(rr, [e(r) for r in rr], "-", label=f"phi(r) = {e.beta:.3f} r^-{e.alpha:.2f}")
    for d, name in zip(res.d_star, ("d1*", "d2*")):
        ax1.axvline(d, linestyle=":", color="gray")
        ax1.text(d, ax1.get_ylim()[1], name, ha="center", va="bottom")
    ax1.set_xlabel("recurrent depth r")
    ax1.set_ylabel("total variation")
    ax1.legend()
    ax2.set_xlabel("recurrent depth r")
    ax2.set_ylabel("greedy agreement with depth R (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
