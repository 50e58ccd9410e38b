"""Lanes and the per-request branch tree.

A *lane* pushes one token at one position through the recurrence: it starts at depth 0 (after the
pre-layers) and gains one depth per recurrent step. At depth d1 it proposes the next token and
spawns a child lane for it; at depth d2 it may spawn a second child (an alternative for the same
next position), and under greedy decoding one more at each late depth whose argmax is new; at depth
R it is verified and its position is committed.

The tree holds the uncommitted lanes of one request. Its *root* is the oldest lane, the only one
that can reach depth R; every other lane descends from it. On commit the root leaves the tree,
the accepted child becomes the new root with all its descendants, and everything else is pruned.
When nothing was accepted the tree is emptied and restarted with a fresh lane at depth 0 for the
committed token. A lane's attention context is the committed prefix plus its *ancestry chain*
(the uncommitted ancestors, oldest first), then itself.

Engine-independent: ``state`` and ``kv`` are opaque slots for whoever executes the lanes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm_loop.loopspec.verify import CommitSource


class Proposed(NamedTuple):
    """A proposal a lane made for the next position, and the child lane computing it."""

    token: int
    dist: Any  # the (filtered) distribution it was drawn from; None under greedy
    child: Lane
    depth: int = 0  # the depth at which the parent made it


@dataclass(eq=False)
class Lane:
    id: int
    token: int  # input token of this lane's position
    position: int
    origin: CommitSource | None  # which proposal of the parent created it (None: root / restart)
    parent: Lane | None = None  # None once the parent has committed
    depth: int = 0
    children: list[Lane] = field(default_factory=list)
    first: Proposed | None = None  # made at depth d1
    second: Proposed | None = None  # made at depth d2 when the gate opened
    q2_tilde: Any = None  # the d2 readout (for metrics / exact analysis), kept even if the gate closed
    late: list[Proposed] = field(default_factory=list)  # greedy re-proposals made at the late depths
    state: Any = None  # executor payload (hidden state)
    kv: dict = field(default_factory=dict)  # executor payload: this lane's own KV per bank
    slot: int | None = None  # engine payload: the storage slot of its hidden state and KV
    alive: bool = True

    def __repr__(self) -> str:
        return f"Lane(id={self.id}, pos={self.position}, tok={self.token}, depth={self.depth}, origin={self.origin})"


class BranchTree:
    """The live lanes of one request."""

    def __init__(self):
        self.root: Lane | None = None
        self._next_id = 0
        self._lanes: list[Lane] = []  # live lanes, in birth order

    # -- queries ------------------------------------------------------------------------------------
    @property
    def lanes(self) -> list[Lane]:
        return list(self._lanes)

    def __len__(self) -> int:
        return len(self._lanes)

    def ancestors(self, lane: Lane) -> list[Lane]:
        """Uncommitted ancestors of ``lane``, oldest (the root) first."""
        chain = []
        node = lane.parent
        while node is not None:
            chain.append(node)
            node = node.parent
        chain.reverse()
        return chain

    def descendants(self, lane: Lane) -> list[Lane]:
        out, stack = [], [lane]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children)
        return out

    # -- mutations -----------------------------------------------------------------------------------
    def _new(self, token: int, position: int, origin, parent: Lane | None) -> Lane:
        lane = Lane(id=self._next_id, token=token, position=position, origin=origin, parent=parent)
        self._next_id += 1
        self._lanes.append(lane)
        if parent is not None:
            parent.children.append(lane)
        return lane

    def start(self, token: int, position: int) -> Lane:
        """A fresh root lane at depth 0 (first token after prefill, or a restart)."""
        if self._lanes:
            raise RuntimeError("start() on a tree that still has live lanes; commit or clear first")
        self.root = self._new(token, position, None, None)
        return self.root

    def spawn(self, parent: Lane, token: int, origin: CommitSource) -> Lane:
        """A child lane at depth 0 for the token ``parent`` proposed at the next position."""
        if not parent.alive:
            raise RuntimeError(f"cannot spawn from pruned {parent}")
        if origin not in (CommitSource.FIRST, CommitSource.SECOND, CommitSource.LATE):
            raise ValueError(f"origin must be FIRST, SECOND or LATE, got {origin}")
        return self._new(token, parent.position + 1, origin, parent)

    def commit(self, source: CommitSource, token: int | None = None) -> tuple[Lane, Lane | None]:
        """The root is verified: remove it; keep the child of the accepted proposal (if any; a late
        one is the one for ``token``) with its descendants as the new tree, prune every other lane.
        Returns (committed root, new root or None). With ``None`` the caller restarts the tree with
        ``start()``."""
        root = self.root
        if root is None:
            raise RuntimeError("commit() on an empty tree")
        keep: Lane | None = None
        if source == CommitSource.FIRST and root.first is not None:
            keep = root.first.child
        elif source == CommitSource.SECOND and root.second is not None:
            keep = root.second.child
        elif source == CommitSource.LATE:
            keep = next((p.child for p in root.late if p.token == token), None)
        kept = set(map(id, self.descendants(keep))) if keep is not None else set()
        for lane in self._lanes:
            if id(lane) not in kept:
                lane.alive = False
        root.alive = False
        self._lanes = [lane for lane in self._lanes if id(lane) in kept]
        if keep is not None:
            keep.parent = None  # re-root: its parent is now part of the committed prefix
        self.root = keep
        return root, keep

    def reroot(self, lane: Lane) -> list[Lane]:
        """Positions up to ``lane``'s were committed outside the pipeline (an ordinary forward
        verified the chain): ``lane`` becomes the root with its subtree, every other lane is
        pruned. Returns the pruned lanes."""
        if not lane.alive:
            raise RuntimeError(f"cannot re-root at pruned {lane}")
        kept = set(map(id, self.descendants(lane)))
        pruned = [x for x in self._lanes if id(x) not in kept]
        for x in pruned:
            x.alive = False
        self._lanes = [x for x in self._lanes if id(x) in kept]
        lane.parent = None
        self.root = lane
        return pruned

    def clear(self) -> None:
        """Drop every lane (request finished or preempted)."""
        for lane in self._lanes:
            lane.alive = False
        self._lanes = []
        self.root = None
