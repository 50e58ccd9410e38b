"""The LoopSpec schedule: total depth R, first proposal depth d1, optional second proposal depth d2,
optional late re-proposal depths.

Time is counted in *recurrent steps*: one step advances every live lane of every request by one
application of the shared block (depth t -> t+1). A lane reads out a proposal at depth d1 (always),
evaluates the gated second proposal at depth d2, and is verified at depth R. Because d2 is a
multiple of d1 and a child lane starts d1 (or d2) steps behind its parent, every live lane of a
request sits a multiple of d1 steps behind the root: readouts line up, exactly as in the authors'
"cycle of d1 steps" formulation (they advance by K = d1 iterations per cycle; we advance by one and
get the same schedule, with metrics counted in recurrent steps as in the paper's eq. 9). R need not
be a multiple of d1 (the paper asks only ``d1 < d2 < R`` and ``d1 | d2``): a lane is simply
verified when it reaches R, between two of its children's births.

Late re-proposals (greedy requests only; ours, not the paper's). A first proposal that d2 agrees
with and R rejects costs the whole pipeline (~R steps); on random-weight bf16 checkpoints these are
near-ties that rounding flips between depths, and the argmax a few depths later is R's far more often
(Huginn-0125 shape, 1:5: the argmax at depth 8 catches ~3/4 of them, benchmarks/RESULTS.md). At each
depth k of ``late`` a lane reads out once more, and spawns one more sibling when its argmax differs
from every token the lane has proposed: accepted at R, it leaves k steps to the next commit instead
of R. Lossless: the committed token is R's argmax whatever was proposed. Sampled requests ignore the
late depths (the cascade's stages are the paper's two).

Lane capacity. With both proposals always spawning (no gate), the number of lanes born in the k-th
interval of d1 steps of one root lane's tree follows ``s_k = s_{k-1} + s_{k-m}`` with ``m = d2/d1`` and
``s_k = 1`` for ``k < m`` (paper Section 4.3); equivalently, the lanes ``k d1`` steps behind the root
number ``s_k``. When a step starts, the root is at most at depth R-1, so the lanes behind it are at
most ``floor((R-1)/d1)`` intervals back: at most ``sum(s_0 .. s_{n-1})`` lanes with
``n = ceil(R/d1)`` intervals (``R/d1`` when d1 divides R). With d1 alone every interval has one
birth: ``ceil(R/d1)`` lanes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

ALLOWED_CONFIG_KEYS = ("method", "d1", "d2", "gate", "late")


def _check_int(field: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"LoopSpec schedule: {field}={value!r} is invalid: {field} must be an integer")
    if value < minimum:
        raise ValueError(f"LoopSpec schedule: {field}={value} is invalid: {field} must be >= {minimum}")
    return value


@dataclass(frozen=True)
class LoopSpecSchedule:
    """Validated (R, d1, d2, late) with ``1 <= d1 < d2 < R`` and ``d2 % d1 == 0`` (R need not be a
    multiple of d1); ``late``: increasing depths between d2 (or d1) and R, multiples of d1.

    ``d2=None`` is single-proposal mode. ``gate`` (default True, the paper's rule) opens the second
    proposal only when ``q~2(x1) < q1(x1)``; ``gate=False`` proposes from the residual whenever it has
    mass (the ungated variant of Theorem 1, used for ablations and capacity tests).
    """

    R: int
    d1: int
    d2: int | None = None
    gate: bool = True
    late: tuple[int, ...] = ()

    def __post_init__(self):
        R = _check_int("R", self.R, 2)
        d1 = _check_int("d1", self.d1, 1)
        if d1 >= R:
            raise ValueError(f"LoopSpec schedule: d1={d1} is invalid: d1 must be < R (R={R})")
        if self.d2 is not None:
            d2 = _check_int("d2", self.d2, 1)
            if d2 <= d1:
                raise ValueError(f"LoopSpec schedule: d2={d2} is invalid: d1 must be < d2 (d1={d1})")
            if d2 >= R:
                raise ValueError(f"LoopSpec schedule: d2={d2} is invalid: d2 must be < R (R={R})")
            if d2 % d1:
                raise ValueError(f"LoopSpec schedule: d2={d2} is invalid: d2 must be a multiple of d1 (d1={d1})")
        if not isinstance(self.gate, bool):
            raise ValueError(f"LoopSpec schedule: gate={self.gate!r} is invalid: gate must be true or false")
        if not isinstance(self.late, (tuple, list)):
            raise ValueError(f"LoopSpec schedule: late={self.late!r} is invalid: late must be a list of depths")
        object.__setattr__(self, "late", tuple(self.late))
        floor = ("d2", self.d2) if self.d2 is not None else ("d1", d1)
        previous = None
        for k in self.late:
            k = _check_int("late", k, 1)
            if not floor[1] < k < R:
                raise ValueError(f"LoopSpec schedule: late={list(self.late)} is invalid: each late depth must be "
                                 f"> {floor[0]}={floor[1]} and < R={R}")
            if previous is not None and k <= previous:
                raise ValueError(f"LoopSpec schedule: late={list(self.late)} is invalid: late depths must be in "
                                 f"increasing order ({k} comes after {previous})")
            if k % d1:
                raise ValueError(f"LoopSpec schedule: late={list(self.late)} is invalid: {k} is not a multiple "
                                 f"of d1={d1}")
            previous = k

    # -- construction from a speculative config ------------------------------------------------
    @classmethod
    def from_config(cls, config: dict, depth: int) -> LoopSpecSchedule:
        """``{"d1": 2, "d2": 8}`` (plus optional ``"method": "loopspec"``, ``"gate"``) with R = the
        model's loop count ``depth``."""
        if not isinstance(config, dict):
            raise ValueError(f"LoopSpec config must be a dict, got {type(config).__name__}")
        unknown = sorted(set(config) - set(ALLOWED_CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"LoopSpec config: unknown key(s) {', '.join(unknown)}; allowed keys: {', '.join(ALLOWED_CONFIG_KEYS)}"
            )
        if "method" in config and config["method"] != "loopspec":
            raise ValueError(f"LoopSpec config: method={config['method']!r} is invalid: method must be 'loopspec'")
        if "d1" not in config:
            raise ValueError("LoopSpec config: d1 is required (the first proposal depth)")
        return cls(R=depth, d1=config["d1"], d2=config.get("d2"), gate=config.get("gate", True),
                   late=config.get("late", ()))

    # -- derived quantities ---------------------------------------------------------------------
    @property
    def single(self) -> bool:
        return self.d2 is None

    @property
    def readout_depths(self) -> tuple[int, ...]:
        """Depths at which a lane runs the readout (post-layers): d1, d2 (if any), the late depths, R."""
        return (self.d1, *(() if self.d2 is None else (self.d2,)), *self.late, self.R)

    @property
    def intervals(self) -> int:
        """Intervals of d1 steps a lane lives before verification, the pipeline depth:
        ``ceil(R/d1)`` (R/d1 when d1 divides R)."""
        return -(-self.R // self.d1)

    @cached_property
    def births(self) -> tuple[int, ...]:
        """Worst-case lanes born per interval of d1 steps in one root's tree, ``s_0 .. s_{n-1}`` with
        ``n = intervals``."""
        n = self.intervals
        if self.d2 is None:
            return (1,) * n
        m = self.d2 // self.d1
        s: list[int] = []
        for k in range(n):
            s.append(1 if k < m else s[k - 1] + s[k - m])
        return tuple(s)

    @property
    def max_lanes(self) -> int:
        """Upper bound on the lanes of one request advanced in one recurrent step (late re-proposals
        aside: their siblings take room under the pipeline's lane cap, which bounds them)."""
        return sum(self.births)

    def describe(self) -> str:
        second = "none" if self.d2 is None else f"{self.d2} ({'gated' if self.gate else 'ungated'})"
        late = f" late={list(self.late)}" if self.late else ""
        return f"R={self.R} d1={self.d1} d2={second}{late} max_lanes={self.max_lanes}"
