"""When to run lanes: per engine step, LoopSpec's lane step or plain decoding, whichever has been
faster at this batch size.

Lanes pay when a recurrent step over a few lanes costs little more than one over a single token and
acceptance is high. They do not when the batch is already compute-bound, when acceptance is low
(random weights), or when the lane step's own overhead dominates. Both modes are lossless, so the
choice only moves speed; it is made from measured engine-step throughput (committed tokens per
second of engine time), kept per batch-size bucket (powers of two), because what pays at one
request may not at 64.

A bucket first runs ``trial`` lane steps, then ``trial`` plain steps, then the faster of the two;
after ``recheck`` steps the other mode gets ``trial`` steps again (acceptance follows the text, and
the batch the load). A re-check that confirms the choice doubles the wait for the next one (up to 4x
``recheck``), and any change of choice resets it: at 64-128 requests a lane trial costs as much as
many plain steps, and re-checking at a fixed pace cost ~4 % there on the H200 (benchmarks/RESULTS.md).
``lanes="on"`` always runs lanes. The decision is taken in the scheduler (one process), so every
tensor-parallel rank follows the same one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LANES_MODES = ("auto", "on")
# Tests only: a fixed cycle of decisions ("LLPPP": two lane steps, three plain, repeated) instead of
# measured ones, so that a test can force every transition. An environment variable because the
# policy lives in the engine-core process; it is not part of vLLM's compile hash.
PATTERN_ENV = "VLLM_LOOP_LANES_PATTERN"


@dataclass
class StepSample:
    """One decode-only engine step: which mode ran it, its decode rows, the tokens they committed
    and the engine time it took (schedule + execute + update)."""

    lanes: bool
    rows: int
    tokens: int
    seconds: float


@dataclass
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # lanes? -> tokens/s (moving average)
    seen: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    steps: int = 0  # decisions taken after both trials
    wait: int = 0  # decisions from one re-check to the next (0: not set yet)
    next_check: int = 0
    rechecking: bool = False  # the other mode is on trial again
    last: bool | None = None  # the last choice

    def best(self) -> bool:
        return self.rate[True] >= self.rate[False]


def bucket_of(rows: int) -> int:
    return 1 << max(rows - 1, 0).bit_length()


class LanePolicy:
    def __init__(self, mode: str = "auto", trial: int = 4, recheck: int = 256, smoothing: float = 0.3,
                 pattern: str | None = None):
        if mode not in LANES_MODES:
            raise ValueError(f"lanes={mode!r}: allowed values: {', '.join(LANES_MODES)}")
        if pattern is not None and (not pattern or set(pattern) - {"L", "P"}):
            raise ValueError(f"{PATTERN_ENV}={pattern!r}: a non-empty string of L (lanes) and P (plain)")
        self.mode, self.trial, self.recheck, self.smoothing = mode, trial, recheck, smoothing
        self.buckets: dict[int, _Bucket] = {}
        self.pattern, self.decisions = pattern, 0

    def lanes(self, rows: int) -> bool:
        """Run the next engine step, with ``rows`` running requests, on lanes?"""
        if self.pattern:
            self.decisions += 1
            return self.pattern[(self.decisions - 1) % len(self.pattern)] == "L"
        if self.mode == "on":
            return True
        b = self.buckets.setdefault(bucket_of(rows), _Bucket())
        for mode in (True, False):
            if b.seen[mode] < self.trial:
                return mode
        b.steps += 1
        best = b.best()
        if b.wait == 0 or best != b.last:  # first choice, or a change: re-check at the base pace
            b.wait, b.next_check = self.recheck, b.steps + self.recheck
        elif b.rechecking:  # a re-check just confirmed the choice: wait longer for the next
            b.wait = min(2 * b.wait, 4 * self.recheck)
            b.next_check = b.steps + b.wait
        b.rechecking, b.last = False, best
        if b.steps >= b.next_check:  # start a re-measurement of the other mode
            b.rechecking = True
            b.seen[not best] = 0
            return not best
        return best

    def observe(self, sample: StepSample) -> None:
        if sample.seconds <= 0 or sample.rows <= 0:
            return
        b = self.buckets.setdefault(bucket_of(sample.rows), _Bucket())
        rate = sample.tokens / sample.seconds
        old = b.rate.get(sample.lanes)
        # a fresh trial replaces the old estimate; later samples of it are averaged in
        fresh = b.seen[sample.lanes] == 0
        b.rate[sample.lanes] = rate if old is None or fresh else old + self.smoothing * (rate - old)
        b.seen[sample.lanes] += 1

    def describe(self) -> dict[int, dict[str, float]]:
        """Per bucket: the measured tokens/s of each mode (for logs and tests)."""
        return {k: {("lanes" if m else "plain"): round(r, 1) for m, r in b.rate.items()}
                for k, b in sorted(self.buckets.items())}
