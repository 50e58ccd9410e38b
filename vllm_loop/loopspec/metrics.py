"""LoopSpec metrics, with the paper's definitions.

* Mean accepted length (eq. 9): ``gamma = N R / (N1 d1 + N2 d2 + (N - N1 - N2) R)``, N the tokens
  committed by the pipeline, N1 / N2 those accepted from the first / second proposal. It counts
  recurrent steps: an accepted first proposal leaves d1 steps to the next commit, a second one d2,
  a restart R. gamma <= R/d1. A late re-proposal (greedy, ours) accepted costs the depth it was made
  at: ``N_late`` commits add their depths' sum to the denominator.
* Commit shares (Section E): N1/N, N2/N, (N - N1 - N2)/N; with late re-proposals also N_late/N
  (taken out of the full share).
* Gate-open frequency (Section D, Table 6): gate openings / gate evaluations (evaluations at d2).
* Effective batch size (Section D, Figure 5): lanes advanced per recurrent step; mean and peak.
* Double-rejection rate (Theorem 1): restarts / N, compared with eps2 = mean TV(p_d2, p_R) over
  the committed positions (bound eps2 ungated, 2 eps2 gated). A single-proposal schedule restarts
  on every first rejection (rate -> eps1 = mean TV(p_d1, p_R)). Under greedy decoding the proposal
  and target distributions are one-hot, so TV is the disagreement indicator of the argmaxes.

The token chosen from the prefill's final readout is not a pipeline commit and is not counted in N.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vllm_loop.loopspec.verify import CommitSource


def mean_accepted_length(n_decode: int, n_first: int, n_second: int, R: int, d1: int, d2: int | None,
                         n_late: int = 0, late_depth_sum: int = 0) -> float:
    """Paper eq. 9 (late commits costing ``late_depth_sum`` steps in all). 0 tokens -> 0.0."""
    if n_decode == 0:
        return 0.0
    n_full = n_decode - n_first - n_second - n_late
    if n_full < 0:
        raise ValueError("n_first + n_second + n_late exceeds n_decode")
    if n_second and d2 is None:
        raise ValueError("second-proposal commits without a d2")
    cost = n_first * d1 + n_second * (d2 or 0) + late_depth_sum + n_full * R
    return n_decode * R / cost


def commit_shares(n_decode: int, n_first: int, n_second: int, n_late: int = 0) -> dict[str, float]:
    if n_decode == 0:
        return {"first": 0.0, "second": 0.0, "late": 0.0, "full": 0.0}
    return {
        "first": n_first / n_decode,
        "second": n_second / n_decode,
        "late": n_late / n_decode,
        "full": (n_decode - n_first - n_second - n_late) / n_decode,
    }


def batch_size_summary(sizes: list[int]) -> dict[str, float]:
    if not sizes:
        return {"mean": 0.0, "peak": 0, "steps": 0}
    return {"mean": sum(sizes) / len(sizes), "peak": max(sizes), "steps": len(sizes)}


@dataclass
class LoopSpecStats:
    """Counters of one request (or a merge of several)."""

    R: int
    d1: int
    d2: int | None = None
    gate: bool = True
    late_depths: tuple[int, ...] = ()
    decoded: int = 0  # tokens committed by the pipeline (excludes the prefill's token)
    first: int = 0
    second: int = 0
    late: int = 0  # greedy: a late re-proposal accepted
    full: int = 0
    late_proposals: int = 0  # children spawned from late re-proposals
    late_depth_sum: int = 0  # the depths at which the accepted late re-proposals were made
    second_proposals: int = 0  # children spawned from the second proposal
    gate_evaluations: int = 0
    gate_opens: int = 0
    first_rejected_with_second: int = 0  # first rejected while a second proposal existed
    recurrent_steps: int = 0  # steps in which this request had lanes (for a merge: the executor's steps)
    eps1_sum: float = 0.0  # sum over committed positions of TV(p_d1, p_R)
    eps2_sum: float = 0.0  # sum over committed positions of TV(p_d2, p_R)
    exact_double_reject_sum: float = 0.0  # sampling: exact P(double rejection) summed over positions
    lanes_per_step: list[int] = field(default_factory=list)  # this request's lanes per step

    def record_commit(self, source: CommitSource, had_second: bool, late_depth: int | None = None) -> None:
        self.decoded += 1
        if source == CommitSource.FIRST:
            self.first += 1
        elif source == CommitSource.SECOND:
            self.second += 1
        elif source == CommitSource.LATE:
            self.late += 1
            self.late_depth_sum += late_depth
        else:
            self.full += 1
        if source != CommitSource.FIRST and had_second:
            self.first_rejected_with_second += 1

    # -- derived ------------------------------------------------------------------------------------------
    @property
    def gamma(self) -> float:
        return mean_accepted_length(self.decoded, self.first, self.second, self.R, self.d1, self.d2, self.late,
                                    self.late_depth_sum)

    @property
    def shares(self) -> dict[str, float]:
        return commit_shares(self.decoded, self.first, self.second, self.late)

    @property
    def gate_open_frequency(self) -> float:
        return self.gate_opens / self.gate_evaluations if self.gate_evaluations else 0.0

    @property
    def double_rejection_rate(self) -> float:
        return self.full / self.decoded if self.decoded else 0.0

    @property
    def eps1(self) -> float:
        return self.eps1_sum / self.decoded if self.decoded else 0.0

    @property
    def eps2(self) -> float:
        return self.eps2_sum / self.decoded if self.decoded else 0.0

    @property
    def theorem1_bound(self) -> float | None:
        """Theorem 1: P(both rejected) <= 2 eps2 with the gate, eps2 without (None: no d2)."""
        if self.d2 is None:
            return None
        return (2.0 if self.gate else 1.0) * self.eps2

    @property
    def expected_double_rejection(self) -> float:
        return self.exact_double_reject_sum / self.decoded if self.decoded else 0.0

    def merge(self, other: LoopSpecStats) -> LoopSpecStats:
        schedule = (self.R, self.d1, self.d2, self.gate, self.late_depths)
        if schedule != (other.R, other.d1, other.d2, other.gate, other.late_depths):
            raise ValueError("cannot merge stats of different schedules")
        out = LoopSpecStats(*schedule)
        for name in (
            "decoded first second late full second_proposals late_proposals late_depth_sum gate_evaluations gate_opens "
            "first_rejected_with_second eps1_sum eps2_sum exact_double_reject_sum"
        ).split():
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.recurrent_steps = max(self.recurrent_steps, other.recurrent_steps)
        out.lanes_per_step = self.lanes_per_step + other.lanes_per_step
        return out

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "lanes_per_step"}
        d.update(
            gamma=self.gamma,
            gamma_bound=self.R / self.d1,
            shares=self.shares,
            gate_open_frequency=self.gate_open_frequency,
            double_rejection_rate=self.double_rejection_rate,
            eps1=self.eps1,
            eps2=self.eps2,
            theorem1_bound=self.theorem1_bound,
            expected_double_rejection=self.expected_double_rejection,
            lanes_per_request_step=batch_size_summary(self.lanes_per_step),
        )
        return d


def format_summary(summary: dict, effective_batch: dict | None = None) -> str:
    """A few human-readable lines."""
    s = summary
    lines = [
        f"tokens decoded by the pipeline: {s['decoded']}  gamma (eq. 9): {s['gamma']:.3f} (max {s['gamma_bound']:.1f})",
        "commit shares: first {first:.2%}  second {second:.2%}  late {late:.2%}  full depth {full:.2%}".format(
            **s["shares"]),
        f"gate-open frequency: {s['gate_open_frequency']:.2%} ({s['gate_opens']}/{s['gate_evaluations']})",
        f"double-rejection rate: {s['double_rejection_rate']:.4f}  eps1={s['eps1']:.4f} eps2={s['eps2']:.4f}"
        + ("" if s["theorem1_bound"] is None
           else f"  Theorem-1 bound {'2*' if s['gate'] else ''}eps2={s['theorem1_bound']:.4f}"),
    ]
    if effective_batch is not None:
        lines.append(
            f"effective batch size per recurrent step: mean {effective_batch['mean']:.2f}, peak {effective_batch['peak']}"
            " (all requests)"
        )
    per = s["lanes_per_request_step"]
    if per["steps"]:
        lines.append(f"lanes of one request per recurrent step: mean {per['mean']:.2f}, peak {per['peak']}")
    return "\n".join(lines)


@dataclass
class EngineCounters:
    """LoopSpec counters of an engine, summed over requests (a step's delta, or running totals).

    Lane steps (decode steps served by lanes) count recurrent steps, lanes and cascades. Steps in
    which a prefill or a request the lanes cannot serve joins the batch run vLLM's ordinary forward,
    which verifies the lanes' first-proposal chain as speculative drafts: those count in
    ``chain_drafts`` / ``chain_accepted``.
    """

    lane_steps: int = 0  # engine steps served by lanes
    recurrent_steps: int = 0  # recurrent steps run (each advances every live lane once)
    lanes_advanced: int = 0  # sum over recurrent steps of the lanes advanced
    request_steps: int = 0  # sum over recurrent steps of the requests advanced
    first: int = 0  # commits whose first proposal was accepted
    second: int = 0  # ... whose second proposal was accepted
    late: int = 0  # ... whose late re-proposal was accepted (greedy)
    full: int = 0  # ... sampled from the full-depth residual (pipeline restart)
    first_verified: int = 0  # first proposals verified (commits that had one)
    second_verified: int = 0  # second proposals verified
    late_verified: int = 0  # late re-proposals verified
    gate_evaluations: int = 0
    gate_opens: int = 0
    standard_steps: int = 0  # engine steps in which lane requests decoded on vLLM's ordinary forward
    plain_steps: int = 0  # engine steps decoded without lanes: the lanes policy found that faster
    chain_rows: int = 0  # requests whose lane chain was verified there
    chain_drafts: int = 0  # lane-chain tokens verified there as drafts
    chain_accepted: int = 0
    # async scheduling (scheduler-side): steps scheduled while another was in flight, and lanes-mode
    # steps that first waited for the steps in flight to finish (a barrier)
    pipelined_steps: int = 0
    drains: int = 0
    warmup_rows: int = 0  # lane-step rows whose lanes had just (re)started: nothing to commit early
    # overlap: lane rows computed on an expected outcome that did not come (wasted), and new lanes that
    # the expected outcome did not have and so started one recurrent step later (lagged)
    overlap_wasted: int = 0
    overlap_lagged: int = 0
    graph_captures: int = 0  # lane CUDA graphs captured during steps (their first call of a shape bucket)
    lane_step_seconds: float = 0.0  # the runner's wall time in lane steps (their GPU work included)
    # the wall time from the end of a lane step to the start of the next, when the two are consecutive
    # engine steps: vLLM's scheduler, the step's output and the engine core's loop, during which the
    # GPU has no lane work
    lane_step_gaps: int = 0
    lane_step_gap_seconds: float = 0.0
    # gauges, not sums: the lanes and LoopSpec requests the runner holds after the step (an operator's
    # check that finished, aborted and preempted requests give every lane back)
    lanes_live: int = 0
    lane_requests_live: int = 0
    # lanes-mode steps by the lane budget they ran (``policy.LaneOption`` name -> steps; scheduler-side)
    option_steps: dict[str, int] = field(default_factory=dict)

    GAUGES = ("lanes_live", "lane_requests_live")

    def add(self, other: EngineCounters) -> None:
        """Sum the counters; a gauge takes ``other``'s (the later) value."""
        for name in self.__dataclass_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if isinstance(mine, dict):
                for key, value in theirs.items():
                    mine[key] = mine.get(key, 0) + value
            else:
                setattr(self, name, theirs if name in self.GAUGES else mine + theirs)

    def minus(self, other: EngineCounters) -> EngineCounters:
        """The counters' difference; a gauge keeps this one's value."""
        def diff(name):
            mine, theirs = getattr(self, name), getattr(other, name)
            if isinstance(mine, dict):
                return {key: value - theirs.get(key, 0) for key, value in mine.items()}
            return mine if name in self.GAUGES else mine - theirs

        return EngineCounters(**{n: diff(n) for n in self.__dataclass_fields__})

    @property
    def lane_step_gap_ms(self) -> float:
        """Mean engine time between two consecutive lane steps, in ms (0 without any)."""
        return 1000 * self.lane_step_gap_seconds / self.lane_step_gaps if self.lane_step_gaps else 0.0

    @property
    def commits(self) -> int:
        return self.first + self.second + self.late + self.full

    def summary(self, R: int) -> dict:
        """Measured gamma (tokens a request commits per R recurrent steps), commit shares, gate-open
        rate, lanes per recurrent step, requests per recurrent step."""
        n = self.commits
        return {
            "gamma": R * n / self.request_steps if self.request_steps else 0.0,
            "shares": commit_shares(n, self.first, self.second, self.late),
            "gate_open_rate": self.gate_opens / self.gate_evaluations if self.gate_evaluations else 0.0,
            "lanes_per_step": self.lanes_advanced / self.recurrent_steps if self.recurrent_steps else 0.0,
            "requests_per_step": self.request_steps / self.recurrent_steps if self.recurrent_steps else 0.0,
            "chain_acceptance": self.chain_accepted / self.chain_drafts if self.chain_drafts else 0.0,
        }

    def log_line(self, R: int) -> str:
        s = self.summary(R)
        late = f" late {s['shares']['late']:.1%}" if self.late_verified else ""
        return ("LoopSpec: gamma {gamma:.2f} (max {R}), commits first {f:.1%} second {s2:.1%}{late} full {u:.1%}, "
                "gate open {g:.1%}, lanes per recurrent step {l:.2f}, recurrent steps {rs}, lane steps {ls}, "
                "prefill-joined steps {ss}, plain steps {ps}").format(
            gamma=s["gamma"], R=R, f=s["shares"]["first"], s2=s["shares"]["second"], late=late, u=s["shares"]["full"],
            g=s["gate_open_rate"], l=s["lanes_per_step"], rs=self.recurrent_steps, ls=self.lane_steps,
            ss=self.standard_steps, ps=self.plain_steps)
