"""The decisions LoopSpec takes for one request, engine-free: the single home of the algorithm.

A ``RequestPipeline`` owns one request's ``BranchTree``, its sampling parameters, its random
source and its counters. Whoever executes lanes (the reference ``PipelinedExecutor`` or the vLLM
runner) advances every lane by one core step, reads out the lanes that reached d1, d2 or R, and
hands the readouts to ``advance``; the pipeline then

* proposes at d1 (always) and spawns a child lane for the proposed token,
* evaluates the gated residual second proposal at d2 and spawns a sibling when it opens,
* (greedy) re-proposes at each late depth whose argmax the lane has not proposed yet,
* verifies the root at R by cascade verification and commits one token, re-rooting the tree at
  the accepted child or restarting it with a fresh lane for the committed token.

Within one ``advance`` the order is fixed (the root's verification first, so that lanes it prunes
make no proposals; then proposals of the surviving lanes in birth order), so a seeded request
draws the same uniforms whatever executes it.

A readout is the argmax (greedy), the noisy argmax (coupled sampling, ``noise.py``: the greedy
decisions on argmaxes that every depth of a position draws with the same noise) or the filtered
distribution (the paper's sampling cascade) of the lane's logits, as ``readout_values`` computes it. ``max_lanes`` caps the request's live lanes (storage is finite in an
engine): a proposal that would exceed it is not made. That keeps LoopSpec lossless (whether a
proposal exists is decided before the verification draws its uniforms); a root verified without a
first proposal commits a plain sample of p_R.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm_loop.loopspec.lanes import BranchTree, Lane, Proposed
from vllm_loop.loopspec.metrics import LoopSpecStats
from vllm_loop.loopspec.proposals import SamplingParams, filter_probs, sample_from, total_variation, uniform_source
from vllm_loop.loopspec.schedule import LoopSpecSchedule
from vllm_loop.loopspec.verify import (
    CommitSource,
    Proposal,
    Verdict,
    cascade_verify,
    cascade_verify_greedy,
    double_rejection_probability,
    propose_first,
    propose_second,
)


def readout_values(logits: torch.Tensor, params: SamplingParams) -> list:
    """What a lane keeps from its readout: the argmax (greedy) or the filtered distribution, on the
    host. Both are computed where the logits are (in an engine: the GPU, where top-k / top-p sort
    the vocabulary far faster than the host), so only the argmax, or the filtered rows in one copy,
    cross to the host."""
    if params.greedy:
        return logits.argmax(-1).tolist()
    return list(filter_probs(logits, params).cpu())


@dataclass
class Commit:
    lane: Lane  # the verified root: its position is now committed
    verdict: Verdict  # the token committed for the next position, and where it came from


@dataclass
class Advance:
    """What one ``advance`` did: lanes to run the pre-layers for, and the commit (if the root was verified)."""

    spawned: list[Lane] = field(default_factory=list)  # alive new lanes (children and restarts), depth 0
    commit: Commit | None = None
    pruned: list[Lane] = field(default_factory=list)  # lanes that left the tree, the committed root aside


@dataclass
class Expected:
    """What the next ``advance`` does when it goes the likely way: the root, if it is at R, is
    verified and its first proposal accepted; no second proposal is made; the request goes on. A
    runner enqueues the next recurrent step on this before the readouts reach the host. Where
    ``advance`` goes another way, the lanes planned for it are wasted and the lanes it did not plan
    for start one recurrent step later: both lossless, since every lane still computes exactly its
    own token at its own position and depth."""

    commit: Lane | None  # the root that is verified: its position is committed whatever the verdict
    stay: list[Lane]  # every lane that may still be alive afterwards (a superset)
    proposers: list[Lane]  # lanes whose first proposal spawns a child, in birth order


class RequestPipeline:
    def __init__(
        self,
        schedule: LoopSpecSchedule,
        params: SamplingParams = SamplingParams(),
        rng: torch.Generator | None = None,
        max_lanes: int | None = None,
        coupled: bool = False,
    ):
        """``coupled``: a sampled request's readouts are its noisy argmaxes (``noise.coupled_sample``)
        and it is decided as greedy is; otherwise the paper's cascade on filtered distributions, with
        uniforms from ``rng``."""
        self.schedule, self.params = schedule, params
        self.tree = BranchTree()
        self.stats = LoopSpecStats(schedule.R, schedule.d1, schedule.d2, schedule.gate, schedule.late)
        self.max_lanes = schedule.max_lanes if max_lanes is None else max(1, max_lanes)
        self.argmax = params.greedy or coupled  # readouts are tokens: the greedy decisions apply
        # the lane budget of the step being run (``policy.LaneOption``, set by the runner): at most this many
        # lanes (None: max_lanes), second proposals or not; withholding proposals is lossless at any step
        self.cap: int | None = None
        self.seconds = True
        self._rng = rng
        self._uniform = uniform_source(rng) if not self.argmax else None

    @property
    def lanes(self) -> list[Lane]:
        return self.tree.lanes

    @property
    def root(self) -> Lane | None:
        return self.tree.root

    def start(self, token: int, position: int) -> Lane:
        """A fresh root lane at depth 0 for the last committed token (after prefill or a restart)."""
        return self.tree.start(token, position)

    def readers(self) -> list[Lane]:
        """Lanes whose current depth is a readout depth (call after the core step)."""
        depths = self.schedule.readout_depths
        return [lane for lane in self.tree.lanes if lane.depth in depths]

    def chain(self) -> list[Lane]:
        """The root's first-proposal chain below it (the most likely continuation), oldest first."""
        out, node = [], self.tree.root
        while node is not None and node.first is not None and node.first.child.alive:
            node = node.first.child
            out.append(node)
        return out

    def clear(self) -> list[Lane]:
        lanes = self.tree.lanes
        self.tree.clear()
        return lanes

    # -- one recurrent step's decisions ---------------------------------------------------------------------
    def expect(self) -> Expected:
        """The likely outcome of the next ``advance`` (call after the core step), from the tree alone."""
        root = self.tree.root
        commit = root if root is not None and root.depth == self.schedule.R else None
        stay = [lane for lane in self.tree.lanes if lane is not commit]
        room = self.limit - len(stay)  # advance prunes at least the root before it proposes
        proposers = []
        for lane in stay:
            if lane.depth == self.schedule.d1 and room > 0:
                proposers.append(lane)
                room -= 1
        return Expected(commit, stay, proposers)

    def advance(self, read: dict[int, object], is_final: Callable[[int], bool] = lambda token: False) -> Advance:
        """``read[lane.id]``: the readout value of every lane at a readout depth. ``is_final(token)``:
        True when committing ``token`` ends the request (then no lane restarts)."""
        sch, out = self.schedule, Advance()
        self.stats.recurrent_steps += 1
        self.stats.lanes_per_step.append(len(self.tree))
        root = self.tree.root
        if root is not None and root.depth == sch.R:
            # Verify first: lanes the commit prunes then make no proposals (and draw no uniforms).
            before = self.tree.lanes
            verdict = self._verify(root, read[root.id])
            self.stats.record_commit(verdict.source, had_second=root.second is not None,
                                     late_depth=self._late_depth(root, verdict))
            _, new_root = self.tree.commit(verdict.source, verdict.token)
            if new_root is not None and new_root.token != verdict.token:
                raise AssertionError("kept child does not carry the committed token")
            out.commit = Commit(root, verdict)
            out.pruned = [lane for lane in before if not lane.alive and lane is not root]
            if is_final(verdict.token):
                out.pruned += self.clear()
                return out
            if new_root is None:
                out.spawned.append(self.tree.start(verdict.token, root.position + 1))
        for lane in self.tree.lanes:
            if lane.depth == sch.d1:
                child = self._first_proposal(lane, read[lane.id])
            elif lane.depth == sch.d2:
                child = self._second_proposal(lane, read[lane.id])
            elif lane.depth in sch.late:
                child = self._late_proposal(lane, read[lane.id])
            else:
                continue
            if child is not None:
                out.spawned.append(child)
        return out

    # -- proposals ------------------------------------------------------------------------------------------
    @property
    def limit(self) -> int:
        """Lanes this request may hold now: ``max_lanes``, or the step's lane budget if lower."""
        return self.max_lanes if self.cap is None else min(self.max_lanes, self.cap)

    def _room(self) -> bool:
        return len(self.tree) < self.limit

    def _first_proposal(self, lane: Lane, value) -> Lane | None:
        if not self._room():
            return None  # no proposal: the root commits a plain sample of p_R at verification
        first = Proposal(value, None) if self.argmax else propose_first(value, self._uniform)
        child = self.tree.spawn(lane, first.token, CommitSource.FIRST)
        lane.first = Proposed(first.token, first.dist, child, lane.depth)
        return child

    def _second_proposal(self, lane: Lane, value) -> Lane | None:
        if lane.first is None or not self.seconds:
            return None
        x1, q1 = lane.first.token, lane.first.dist
        self.stats.gate_evaluations += 1
        lane.q2_tilde = value
        if not self._room():
            return None  # no storage for a sibling: no second proposal, whatever the gate says
        if self.argmax:
            if value == x1:  # gate closed (and the residual of equal one-hots is empty)
                return None
            second = Proposal(value, None)
        else:
            second = propose_second(value, Proposal(x1, q1), self._uniform, gate=self.schedule.gate)
            if second is None:
                return None
        self.stats.gate_opens += 1
        self.stats.second_proposals += 1
        child = self.tree.spawn(lane, second.token, CommitSource.SECOND)
        lane.second = Proposed(second.token, second.dist, child, lane.depth)
        return child

    def _late_proposal(self, lane: Lane, value) -> Lane | None:
        """Greedy (and coupled): a sibling for the argmax at a late depth when the lane has not proposed it yet."""
        if not self.argmax or lane.first is None:
            return None
        proposed = [lane.first.token] + ([lane.second.token] if lane.second else []) + [p.token for p in lane.late]
        if value in proposed or not self._room():
            return None
        self.stats.late_proposals += 1
        child = self.tree.spawn(lane, value, CommitSource.LATE)
        lane.late.append(Proposed(value, None, child, lane.depth))
        return child

    @staticmethod
    def _late_depth(root: Lane, verdict: Verdict) -> int | None:
        """The depth at which the accepted late re-proposal was made (eq. 9's cost), else None."""
        if verdict.source != CommitSource.LATE:
            return None
        return next(p.depth for p in root.late if p.token == verdict.token)

    # -- verification ---------------------------------------------------------------------------------------
    def _verify(self, root: Lane, value) -> Verdict:
        sch, st = self.schedule, self.stats
        first, second = root.first, root.second
        if self.argmax:
            target = value
            if first is None:
                return Verdict(target, CommitSource.FULL)
            verdict = cascade_verify_greedy(target, first.token, None if second is None else second.token,
                                            [p.token for p in root.late])
            st.eps1_sum += float(first.token != target)
            if sch.d2 is not None and root.q2_tilde is not None:
                st.eps2_sum += float(root.q2_tilde != target)
            st.exact_double_reject_sum += float(verdict.source == CommitSource.FULL)
            return verdict
        p = value
        if first is None:
            return Verdict(sample_from(p, self._uniform()), CommitSource.FULL)
        verdict = cascade_verify(
            p,
            Proposal(first.token, first.dist),
            None if second is None else Proposal(second.token, second.dist),
            rng=self._uniform,
        )
        st.eps1_sum += float(total_variation(first.dist, p))
        q2_tilde = root.q2_tilde if sch.d2 is not None else None
        if q2_tilde is not None:
            st.eps2_sum += float(total_variation(q2_tilde, p))
        st.exact_double_reject_sum += double_rejection_probability(p, first.dist, q2_tilde, gate=sch.gate)
        return verdict
