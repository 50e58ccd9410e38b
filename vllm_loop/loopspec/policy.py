"""When to run lanes: per engine step, LoopSpec's lane step or plain decoding, whichever has been
faster at this batch size.

Lanes pay when a recurrent step over a few lanes costs little more than one over a single token and
acceptance is high. They do not when the batch is already compute-bound, when acceptance is low
(random weights), or when the lane step's own overhead dominates. Both modes are lossless, so the
choice only moves speed; it is made from measured engine-step throughput (committed tokens per
second of engine time), kept per batch-size bucket (powers of two), because what pays at one
request may not at 64.

A bucket first runs ``trial`` lane steps, then ``trial`` plain steps, then the faster of the two --
lanes only if they measured ``LANES_MARGIN`` times faster; now and then the other mode gets ``trial``
steps again (acceptance follows the text, and the batch the load). A re-check costs what the slower
mode loses against the faster over its trial steps, plus the warm-up below; the next one comes
``recheck`` decisions later, or later still if that is what keeps re-checks under ``budget`` of the
bucket's engine time (at most 16 x ``recheck``). At 64-128 requests on the H200 a lane trial costs
as much as ~7 plain steps, and re-checking every 256-1,024 steps was what kept LoopSpec below vanilla
there (benchmarks/RESULTS.md).

The first step of a mode after the other is a *warm-up*. A lane step whose requests mostly start
their lanes afresh (after plain steps or their prefill): every pipeline is empty, so each request
commits one token after R recurrent steps. The plain step right after a lanes-mode step: under async
scheduling it is not pipelined behind another step, and it runs after the lane step's last work.
A warm-up counts as a trial step but not in its mode's rate -- it is the price of switching, which
the re-check budget pays -- unless a trial saw nothing else. A trial whose first steady sample is
clearly slower than the other mode ends there. (Before plain steps had warm-ups, a plain trial after
lanes could end on its slow first step, and plain's rate stayed that step's: the likely reason lanes
ran 141 of 259 steps at 64 requests on the H200 while losing, benchmarks/RESULTS.md.)
Plain steps are samples only in a batch that does not change (``scheduler.step_sample``): a plain
trial at the end of a short run once ended on the step whose update finished requests, at a third of
plain's steady rate, and lanes ran a whole 64-request case on that figure (benchmarks/RESULTS.md).

The choice changes only on rates measured side by side (a trial or re-check), because both modes
slow down as contexts grow: when running lanes fall below plain's older rate itself (not merely
within the margin that choosing lanes needs), plain is re-checked at once; when plain falls below the
lanes' older rate, nothing happens until the planned re-check, since lanes slow down faster with
context (each of a request's lanes reads the whole context). At 128 requests on an H100 lanes ran
~1.09x plain a step at like contexts, just under the margin, and a re-check whenever they fell within
it came every 4 decisions, with both modes' warm-ups each time (benchmarks/RESULTS.md). The other way
round, a mode's older rate can come from much *longer* contexts than today's -- a new wave of requests
after the last one finished -- and then it undersells that mode: it is re-checked at once, before the
other runs on it (``stale_mode``); and a mode's own moving average starts afresh on a steady sample
from far shorter contexts than its last one -- if that sample is not slower than the average: shorter
contexts are faster, so a slower one is a stalled step (a GC pause, say). On an H100 a lane rate from 594
positions a request once kept 64 fresh requests on plain steps for 1,407 decisions (benchmarks/RESULTS.md), and
at 128 requests a lane rate from 73 positions was weighed against plain's from 597
(benchmarks/RESULTS.md). In a CPU model with random stalls (benchmarks/policy_stall_model.py) one
stalled step at a new wave replaced the lanes' rate with a tenth of it, and plain steps ran the
rest of the run where lanes were ~6x faster.

``lanes="on"`` always runs lanes, at the full budget. The decision is taken in the scheduler (one process), so every
tensor-parallel rank follows the same one.

**Lane budget.** A lanes-mode step also picks how many lanes requests may hold (``LaneOption``): the
schedule's full budget, first proposals only (no second-proposal siblings), or a small per-request cap
(``lane_options``). At a few requests the full budget pays; as the batch grows, every extra lane row
is compute the step pays for whether or not its proposal is accepted, and a smaller budget can keep
lanes ahead of plain decoding where the full one falls behind. Per bucket ``OptionChooser`` gives each
option ``trial`` lane steps (in a bucket's first trials: the full budget's, plain's, then the other budgets' unless
the full one was clearly slower than plain; a budget clearly slower than plain or than another
budget ends its trial at once), then runs the fastest (tokens per second of lane steps, as ratios of
sums), re-checking the others now and then; the lanes-vs-plain choice above weighs the lanes at
their best option. An
option only withholds proposals, which is lossless at any step (a root verified without a proposal
commits its own full-depth token), so options switch from one step to the next without a restart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vllm_loop import get_logger

logger = get_logger(__name__)

LANES_MODES = ("auto", "on")
_MODE = {True: "lanes", False: "plain"}
# Tests only: a fixed cycle of decisions ("LLPPP": two lane steps, three plain, repeated) instead of
# measured ones, so that a test can force every transition. An environment variable because the
# policy lives in the engine-core process; it is not part of vLLM's compile hash.
PATTERN_ENV = "VLLM_LOOP_LANES_PATTERN"
# A trial ends after its first steady sample when that shows the mode below this share of the other's
# rate: at 64-128 requests on the H200 each further lane step of a trial costs ~1.5 plain steps' time
# more than plain decoding would (benchmarks/RESULTS.md).
EARLY_END = 0.75
# Lanes run only where they have measured this much faster than plain decoding. Switching to lanes pays
# costs no sample sees: under async scheduling the drain before a lanes-mode step and the unpipelined
# plain step after one, and the step that restarts every pipeline. At 64 requests on the H200 lanes
# measured about even with plain steps and ran for half the tokens, and the run came out at 0.92x
# vanilla (benchmarks/RESULTS.md).
LANES_MARGIN = 1.1
# A mode's older rate undersells it when it was measured at more than this many times the context of the
# other's newer one, plus CONTEXT_SLACK positions (a lane trial alone moves a request's context by up to
# ~17 positions a step, so at short contexts the two trials' contexts differ ~2x with nothing stale).
CONTEXT_DROP, CONTEXT_SLACK = 2.0, 64.0


def far_longer(context: float, than: float) -> bool:
    """Is a mean context of ``context`` positions from another wave of requests than one of ``than``?"""
    return context > CONTEXT_DROP * than + CONTEXT_SLACK


@dataclass
class StepSample:
    """One decode-only engine step: which mode ran it, its decode rows, the tokens they committed
    and the engine time it took (schedule + execute + update); ``warmup``: the first step of its mode
    after the other (see the module's docstring)."""

    lanes: bool
    rows: int
    tokens: int
    seconds: float
    warmup: bool = False
    context: float = 0.0  # the rows' mean committed positions (for the log: both modes slow down with it)
    option: int = 0  # the lane option a lane step ran (``LaneOption``)


@dataclass
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # lanes? -> tokens/s (moving average)
    step_s: dict[bool, float] = field(default_factory=dict)  # lanes? -> seconds per step (moving average)
    context: dict[bool, float] = field(default_factory=dict)  # lanes? -> mean context of its last rated sample
    seen: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # samples in this trial
    # mode -> its rate comes from a steady (not warm-up) sample of this trial
    steady: dict[bool, bool] = field(default_factory=lambda: {True: False, False: False})
    warmup: dict[bool, tuple[float, int]] = field(default_factory=dict)  # mode -> its last warm-up: seconds, tokens
    steps: int = 0  # decisions taken after both trials
    next_check: int = 0
    rechecking: bool = False  # the other mode is on trial again
    last: bool | None = None  # the last choice
    latest: bool | None = None  # the mode of the last rated sample

    def best(self) -> bool:
        return self.rate[True] > LANES_MARGIN * self.rate[False]

    def stale_mode(self) -> bool | None:
        """The mode whose rate is older and from contexts much longer than the other's newer rate (so it
        undersells that mode), or None."""
        if self.latest is None or (not self.latest) not in self.context:
            return None
        older = not self.latest
        return older if far_longer(self.context[older], self.context[self.latest]) else None


def bucket_of(rows: int) -> int:
    return 1 << max(rows - 1, 0).bit_length()


@dataclass(frozen=True)
class LaneOption:
    """A lane budget: lanes a request may hold (None: the deployment's ``max_lanes``) and whether
    second proposals are made."""

    name: str
    cap: int | None = None
    second: bool = True


def lane_options(R: int, d1: int, d2: int | None, max_lanes: int) -> list[LaneOption]:
    """The options a lanes-mode step chooses among: ``full``; ``first`` (first proposals only, where
    the schedule has a second depth); ``capN``: at most N lanes a request, about half of a full
    first-proposal chain (where that is below ``max_lanes``)."""
    options = [LaneOption("full")]
    if d2 is not None:
        options.append(LaneOption("first", None, False))
    chain = math.ceil(R / d1) + 1  # a root and its first-proposal chain
    half = max(2, chain // 2)
    if half < min(chain, max_lanes):
        options.append(LaneOption(f"cap{half}", half, False))
    return options


@dataclass
class _Options:
    rate: dict[int, float] = field(default_factory=dict)  # option -> tokens/s of its lane steps (moving average)
    seen: dict[int, int] = field(default_factory=dict)  # option -> samples in its current trial
    window: dict[int, list[float]] = field(default_factory=dict)  # option -> [tokens, seconds] not yet in its rate
    floor: float = 0.0  # plain decoding's rate in this bucket: a budget's trial clearly below it ends at once
    steps: int = 0  # choices after every trial
    next_check: int = 0
    checked: int = 0  # the option re-checked last


class OptionChooser:
    """Which ``LaneOption`` a lanes-mode step runs, per batch-size bucket (the module's docstring)."""

    def __init__(self, options: list[LaneOption], trial: int = 4, recheck: int = 64, smoothing: float = 0.3):
        self.options, self.trial, self.recheck, self.smoothing = options, trial, recheck, smoothing
        self.buckets: dict[int, _Options] = {}

    def choose(self, rows: int) -> int:
        if len(self.options) == 1:
            return 0
        b = self.buckets.setdefault(bucket_of(rows), _Options())
        for i in range(len(self.options)):
            if b.seen.get(i, 0) < self.trial:
                return i
        b.steps += 1
        best = self.best(b)
        if not b.next_check:  # every trial done: the first re-check comes ``recheck`` choices later
            b.next_check = b.steps + self.recheck
        if b.steps >= b.next_check:  # re-check the options after the best in turn
            others = [i for i in range(len(self.options)) if i != best]
            b.checked = next((i for i in others if i > b.checked), others[0])
            b.seen[b.checked] = 0
            b.next_check = b.steps + self.recheck
            logger.info("LoopSpec lane budget, bucket %d: running %s, re-checking %s (%s)", bucket_of(rows),
                        self.options[best].name, self.options[b.checked].name, self._rates(b))
            return b.checked
        return best

    def best(self, b: _Options) -> int:
        return max(b.rate, key=b.rate.get) if b.rate else 0

    def best_rate(self, rows: int) -> float:
        """The measured rate of the bucket's best option (0 before any)."""
        b = self.buckets.get(bucket_of(rows))
        return max(b.rate.values()) if b is not None and b.rate else 0.0

    def set_floor(self, rows: int, plain: float) -> None:
        """Plain decoding's measured rate in this bucket (LanePolicy): a budget whose trial starts
        clearly below it ends its trial at once."""
        self.buckets.setdefault(bucket_of(rows), _Options()).floor = plain

    def settled(self, rows: int) -> bool:
        """Has every option of this bucket had its trial (the lanes' rate is then their best option's)?"""
        b = self.buckets.get(bucket_of(rows))
        return len(self.options) == 1 or (b is not None and all(b.seen.get(i, 0) >= self.trial
                                                                for i in range(len(self.options))))

    def observe(self, rows: int, option: int, tokens: float, seconds: float) -> None:
        """A steady lane step's tokens and seconds. Rates are ratios of sums: a lane step commits from 1
        to 17 tokens a request, so per-step rates scatter several-fold (185-606 tokens/s at one request
        on the trained Raven, benchmarks/RESULTS.md), and averaging them favours whatever had a lucky
        step. A trial's rate is its steps' tokens over their seconds; afterwards the running option's
        rate moves once per ``trial`` steps, by the ratio of that window's sums."""
        if not 0 <= option < len(self.options) or seconds <= 0:
            return
        b = self.buckets.setdefault(bucket_of(rows), _Options())
        n = b.seen.get(option, 0)
        if n == 0 or option not in b.window:
            b.window[option] = [0.0, 0.0]  # a new trial
        window = b.window[option]
        window[0] += tokens
        window[1] += seconds
        b.seen[option] = n + 1
        ratio = window[0] / window[1]
        if n < self.trial or option not in b.rate:  # in its trial: the trial's ratio so far
            others = [r for i, r in b.rate.items() if i != option] + [b.floor]
            b.rate[option] = ratio
            if n == 0 and ratio < EARLY_END * max(others):  # clearly slower: its trial ends here
                b.seen[option] = self.trial
            if b.seen[option] >= self.trial:
                b.window[option] = [0.0, 0.0]
        elif (n + 1 - self.trial) % self.trial == 0:
            b.rate[option] += self.smoothing * (ratio - b.rate[option])
            b.window[option] = [0.0, 0.0]

    def _rates(self, b: _Options) -> str:
        return ", ".join(f"{self.options[i].name} {r:.0f}" for i, r in sorted(b.rate.items()))

    def describe(self) -> dict[int, dict[str, float]]:
        return {k: {self.options[i].name: round(r, 1) for i, r in sorted(b.rate.items())}
                for k, b in sorted(self.buckets.items())}


class LanePolicy:
    def __init__(self, mode: str = "auto", trial: int = 4, recheck: int = 256, smoothing: float = 0.3,
                 budget: float = 0.005, pattern: str | None = None, options: list[LaneOption] | None = None):
        if mode not in LANES_MODES:
            raise ValueError(f"lanes={mode!r}: allowed values: {', '.join(LANES_MODES)}")
        if pattern is not None and (not pattern or set(pattern) - set("LP0123456789")):
            raise ValueError(f"{PATTERN_ENV}={pattern!r}: a non-empty string of L (lanes), P (plain) and digits "
                             "(lanes with that lane option)")
        self.mode, self.trial, self.recheck, self.smoothing, self.budget = mode, trial, recheck, smoothing, budget
        self.buckets: dict[int, _Bucket] = {}
        self.pattern, self.decisions = pattern, 0
        self.chooser = OptionChooser(options or [LaneOption("full")], trial=trial)
        self._option = 0  # the option of the last lanes decision (``option``)

    @property
    def options(self) -> list[LaneOption]:
        return self.chooser.options

    def option(self) -> int:
        """The lane option of the last ``lanes`` decision that chose lanes."""
        return self._option

    def lanes(self, rows: int) -> bool:
        """Run the next engine step, with ``rows`` running requests, on lanes? (Which lane option:
        ``option()`` afterwards.)"""
        lanes = self._lanes(rows)
        if lanes:
            forced = self.pattern[(self.decisions - 1) % len(self.pattern)] if self.pattern else "L"
            self._option = int(forced) % len(self.options) if forced.isdigit() else \
                (self.chooser.choose(rows) if self.mode == "auto" and not self.pattern else 0)
        return lanes

    def _lanes(self, rows: int) -> bool:
        if self.pattern:
            self.decisions += 1
            return self.pattern[(self.decisions - 1) % len(self.pattern)] != "P"
        if self.mode == "on":
            return True
        b = self.buckets.setdefault(bucket_of(rows), _Bucket())
        for mode in (True, False):
            if b.seen[mode] < self.trial:
                return mode
        # then the other lane budgets' trials, so that lanes are weighed against plain at their best
        # budget (at the full one alone they lost at 4 requests on the trained Raven while the others were
        # never measured there, benchmarks/RESULTS.md) -- unless the first was clearly slower than plain:
        # the budgets withhold lanes from the full one, and where it is that far behind (3-9x at 16-64
        # requests there) their trials cost more than they can find
        plain = b.rate.get(False, 0.0)
        if not self.chooser.settled(rows) and self.chooser.best_rate(rows) >= EARLY_END * plain:
            self.chooser.set_floor(rows, plain)
            return True
        b.steps += 1
        best = b.best()
        if b.last is not None and best != b.last and not b.rechecking:
            # the running mode fell below the other's older rate, a figure from shorter contexts: keep
            # running it until the other is measured again -- at once if lanes fell behind; if plain did,
            # at the planned re-check, since lanes slow down faster with context (each of a request's
            # lanes reads the whole context), so their older figure flatters them
            best = b.last
            # only lanes below plain's rate itself: a trigger at the margin churned (see the docstring)
            if best and b.rate[True] < b.rate[False]:
                b.next_check = b.steps
        if b.stale_mode() == (not best):  # the other's rate is from far longer contexts: no choice on it
            b.next_check = b.steps  # measure it now
        else:
            if b.last is None or best != b.last or b.rechecking:  # a choice made or confirmed: plan a re-check
                b.next_check = b.steps + self.wait(b, best)
                if best != b.last:
                    self._log(rows, b, f"{_MODE[best]} chosen", f"next re-check in {b.next_check - b.steps} decisions")
            b.last = best
        b.rechecking = False
        if b.steps >= b.next_check:  # start a re-measurement of the other mode
            b.rechecking = True
            b.seen[not best] = 0
            self._log(rows, b, f"re-checking {_MODE[not best]}", f"{b.steps} decisions in")
            return not best
        return best

    @staticmethod
    def _log(rows: int, b: _Bucket, what: str, when: str) -> None:
        """One line per choice that changes and per re-check (rare: the engine log then shows why a
        bucket ran what it ran)."""
        logger.info("LoopSpec lanes policy, %d requests (bucket %d): %s (lanes %.0f, plain %.0f tokens/s, measured "
                    "at %.0f / %.0f positions a request); %s", rows, bucket_of(rows), what, b.rate.get(True, 0.0),
                    b.rate.get(False, 0.0), b.context.get(True, 0.0), b.context.get(False, 0.0), when)

    def wait(self, b: _Bucket, best: bool) -> int:
        """Decisions until the next re-check of the mode that is not ``best``: ``recheck``, or more
        where a re-check would otherwise cost over ``budget`` of the time ``best`` runs meanwhile."""
        other = not best
        if b.rate[best] <= 0:
            return self.recheck
        share = b.rate[other] / b.rate[best]
        steps = 1 if share < EARLY_END else self.trial  # a clearly slower mode's trial ends early
        cost = steps * b.step_s[other] * max(0.0, 1.0 - share)
        for seconds, tokens in b.warmup.values():  # there and back: one warm-up of each mode
            cost += max(0.0, seconds - tokens / b.rate[best])
        return min(max(self.recheck, math.ceil(cost / (self.budget * b.step_s[best]))), 16 * self.recheck)

    def observe(self, sample: StepSample) -> None:
        if sample.seconds <= 0 or sample.rows <= 0:
            return
        b = self.buckets.setdefault(bucket_of(sample.rows), _Bucket())
        mode, rate = sample.lanes, sample.tokens / sample.seconds
        if mode and not sample.warmup and len(self.options) > 1:
            # lanes are weighed against plain at their best budget, not at the one a re-check just tried
            self.chooser.observe(sample.rows, sample.option, sample.tokens, sample.seconds)
            rate = self.chooser.best_rate(sample.rows)
        # a fresh trial replaces the old estimate, and so does a steady sample from far shorter contexts than
        # the estimate's (a new wave of requests: averaging the two undersold plain at 128 requests on an
        # H100) unless it is slower, since shorter contexts are faster: that is a stalled
        # step, and is averaged in like later samples
        fresh = b.seen[mode] == 0 or (not sample.warmup and far_longer(b.context.get(mode, 0.0), sample.context)
                                      and rate >= b.rate.get(mode, 0.0))
        b.seen[mode] += 1
        if sample.warmup:
            b.warmup[mode] = (sample.seconds, sample.tokens)
            if not fresh:
                return  # the switch's price, not the mode's rate
            b.steady[mode] = False  # a stand-in, until a steady sample of this trial replaces it
        else:
            fresh, b.steady[mode] = fresh or not b.steady[mode], True
        for values, value in ((b.rate, rate), (b.step_s, sample.seconds)):
            old = values.get(mode)
            values[mode] = value if old is None or fresh else old + self.smoothing * (value - old)
        b.context[mode], b.latest = sample.context, mode
        # clearly the slower: its trial ends here (not on a warm-up, which is slow whatever lanes can do)
        if fresh and not sample.warmup and rate < EARLY_END * b.rate.get(not mode, 0.0):
            b.seen[mode] = max(b.seen[mode], self.trial)

    def describe(self) -> dict[int, dict[str, float]]:
        """Per bucket: the measured tokens/s of each mode and, where lanes ran more than one lane
        option, of each option (``lanes:NAME``; for logs, the trace and tests)."""
        options = self.chooser.describe()
        out = {}
        for k, b in sorted(self.buckets.items()):
            out[k] = {("lanes" if m else "plain"): round(r, 1) for m, r in b.rate.items()}
            if len(options.get(k, {})) > 1:
                out[k] |= {f"lanes:{name}": r for name, r in options[k].items()}
        return out
