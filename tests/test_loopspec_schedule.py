"""LoopSpec schedule validation, lane capacity bounds, the branch tree and the metrics (pure, no model)."""

from __future__ import annotations

import pytest

from vllm_loop.loopspec.lanes import BranchTree, Proposed
from vllm_loop.loopspec.metrics import LoopSpecStats, batch_size_summary, commit_shares, mean_accepted_length
from vllm_loop.loopspec.schedule import LoopSpecSchedule
from vllm_loop.loopspec.verify import CommitSource


# -- validation ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, rule",
    [
        ({"R": 4, "d1": 2, "d2": 2}, "d1 must be < d2"),
        ({"R": 4, "d1": 2, "d2": 1}, "d1 must be < d2"),
        ({"R": 32, "d1": 2, "d2": 32}, "d2 must be < R"),
        ({"R": 32, "d1": 2, "d2": 40}, "d2 must be < R"),
        ({"R": 32, "d1": 2, "d2": 7}, "d2 must be a multiple of d1"),
        ({"R": 4, "d1": -1}, "d1=-1 is invalid: d1 must be >= 1"),
        ({"R": 4, "d1": 0}, "d1=0 is invalid: d1 must be >= 1"),
        ({"R": -4, "d1": 1}, "R=-4 is invalid: R must be >= 2"),
        ({"R": 4, "d1": 1, "d2": -2}, "d2=-2 is invalid: d2 must be >= 1"),
        ({"R": 4, "d1": 4}, "d1 must be < R"),
        ({"R": 4, "d1": 1.5}, "d1 must be an integer"),
        ({"R": 4, "d1": True}, "d1 must be an integer"),
        ({"R": 4, "d1": 1, "gate": "yes"}, "gate must be true or false"),
        ({"R": 32, "d1": 2, "d2": 8, "late": (8,)}, "each late depth must be > d2=8 and < R=32"),
        ({"R": 32, "d1": 2, "d2": 8, "late": (16, 12)}, "increasing order (12 comes after 16)"),
        # the depth that breaks the order is named as such, not as d2 (the message once said "> d2=16")
        ({"R": 32, "d1": 1, "d2": 2, "late": (3, 2)}, "late=[3, 2] is invalid: each late depth must be > d2=2 and"),
        ({"R": 32, "d1": 2, "d2": 8, "late": (16, 32)}, "< R=32"),
        ({"R": 32, "d1": 2, "d2": 8, "late": (15,)}, "15 is not a multiple of d1=2"),
        ({"R": 32, "d1": 2, "late": (1,)}, "each late depth must be > d1=2"),
        ({"R": 32, "d1": 2, "d2": 8, "late": 16}, "late must be a list of depths"),
    ],
)
def test_bad_schedules_name_the_rule(kwargs, rule):
    with pytest.raises(ValueError) as e:
        LoopSpecSchedule(**kwargs)
    assert rule in str(e.value)


@pytest.mark.parametrize(
    "R, d1, d2",
    [(4, 1, None), (4, 1, 2), (32, 2, 8), (32, 4, 8), (32, 2, 10), (32, 2, None),
     # R need not be a multiple of d1 (the paper asks d1 < d2 < R and d1 | d2 only)
     (8, 3, 6), (32, 3, None), (32, 3, 9), (32, 5, 30), (4, 3, None)],
)
def test_good_schedules(R, d1, d2):
    s = LoopSpecSchedule(R, d1, d2)
    assert s.readout_depths == ((d1, R) if d2 is None else (d1, d2, R))
    assert s.single == (d2 is None)
    assert s.intervals == -(-R // d1)  # ceil(R / d1)


def test_late_depths_are_readouts_and_from_config():
    s = LoopSpecSchedule.from_config({"method": "loopspec", "d1": 1, "d2": 5, "late": [8, 16]}, 32)
    assert s.late == (8, 16) and s.readout_depths == (1, 5, 8, 16, 32)
    assert "late=[8, 16]" in s.describe()
    assert LoopSpecSchedule(8, 1, None, late=[3]).readout_depths == (1, 3, 8)  # a list is kept as a tuple


# -- capacity -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "R, d1, d2, births, total",
    [
        (4, 1, 2, (1, 1, 2, 3), 7),  # Ouro 1:2
        (32, 2, None, (1,) * 16, 16),  # Raven d1=2 alone
        (32, 2, 8, None, 249),  # Raven 2:8 (paper Section 4.3)
        (32, 2, 10, None, 139),  # Raven 2:10
        (32, 4, 8, (1, 1, 2, 3, 5, 8, 13, 21), 54),  # Raven 4:8
        (4, 1, None, (1, 1, 1, 1), 4),
        (8, 3, 6, (1, 1, 2), 4),  # lanes 0, 3 and 6 steps behind a root at depth <= 7
        (8, 3, None, (1, 1, 1), 3),
        (32, 3, 9, (1, 1, 1, 2, 3, 4, 6, 9, 13, 19, 28), 87),
        (7, 2, 4, (1, 1, 2, 3), 7),
    ],
)
def test_capacity_bounds(R, d1, d2, births, total):
    s = LoopSpecSchedule(R, d1, d2)
    if births is not None:
        assert s.births == births
    assert s.max_lanes == total


def test_births_recurrence():
    s = LoopSpecSchedule(32, 2, 8)
    m = 4
    b = s.births
    assert b[:m] == (1, 1, 1, 1)
    assert all(b[k] == b[k - 1] + b[k - m] for k in range(m, len(b)))


# -- from_config ----------------------------------------------------------------------------------------------
def test_from_config():
    s = LoopSpecSchedule.from_config({"method": "loopspec", "d1": 2, "d2": 8}, depth=32)
    assert (s.R, s.d1, s.d2, s.gate) == (32, 2, 8, True)
    assert LoopSpecSchedule.from_config({"d1": 1}, depth=4).d2 is None
    assert LoopSpecSchedule.from_config({"d1": 1, "d2": 2, "gate": False}, depth=4).gate is False


def test_from_config_errors():
    with pytest.raises(ValueError, match=r"unknown key\(s\) d3, k; allowed keys: method, d1, d2, gate"):
        LoopSpecSchedule.from_config({"d1": 1, "d3": 2, "k": 1}, depth=4)
    with pytest.raises(ValueError, match="d1 is required"):
        LoopSpecSchedule.from_config({"d2": 2}, depth=4)
    with pytest.raises(ValueError, match="method must be 'loopspec'"):
        LoopSpecSchedule.from_config({"method": "eagle", "d1": 1}, depth=4)
    with pytest.raises(ValueError, match="d2 must be a multiple of d1"):
        LoopSpecSchedule.from_config({"d1": 3, "d2": 8}, depth=32)
    assert LoopSpecSchedule.from_config({"d1": 3}, depth=32).intervals == 11


# -- branch tree ----------------------------------------------------------------------------------------------
def _tree_with_two_children():
    tree = BranchTree()
    root = tree.start(token=10, position=5)
    a = tree.spawn(root, 11, CommitSource.FIRST)
    root.first = Proposed(11, None, a)
    b = tree.spawn(root, 12, CommitSource.SECOND)
    root.second = Proposed(12, None, b)
    a1 = tree.spawn(a, 21, CommitSource.FIRST)
    a.first = Proposed(21, None, a1)
    b1 = tree.spawn(b, 22, CommitSource.FIRST)
    b.first = Proposed(22, None, b1)
    return tree, root, a, b, a1, b1


def test_tree_spawn_and_ancestry():
    tree, root, a, b, a1, b1 = _tree_with_two_children()
    assert len(tree) == 5 and tree.root is root
    assert (a.position, b.position, a1.position) == (6, 6, 7)
    assert tree.ancestors(a1) == [root, a]
    assert tree.ancestors(root) == []
    assert set(map(id, tree.descendants(b))) == {id(b), id(b1)}


def test_commit_first_keeps_its_subtree_and_reroots():
    tree, root, a, b, a1, b1 = _tree_with_two_children()
    committed, new_root = tree.commit(CommitSource.FIRST)
    assert committed is root and new_root is a and tree.root is a
    assert a.parent is None and tree.ancestors(a1) == [a]
    assert [lane.id for lane in tree.lanes] == [a.id, a1.id]
    assert not b.alive and not b1.alive and not root.alive


def test_commit_second_keeps_the_alternative():
    tree, root, a, b, a1, b1 = _tree_with_two_children()
    _, new_root = tree.commit(CommitSource.SECOND)
    assert new_root is b and {lane.id for lane in tree.lanes} == {b.id, b1.id}
    assert not a.alive and not a1.alive


def test_commit_full_prunes_everything_then_restart():
    tree, root, *_ = _tree_with_two_children()
    committed, new_root = tree.commit(CommitSource.FULL)
    assert new_root is None and len(tree) == 0 and tree.root is None
    fresh = tree.start(token=99, position=committed.position + 1)
    assert fresh.depth == 0 and fresh.position == 6 and tree.root is fresh and fresh.origin is None


def test_tree_errors():
    tree, root, *_ = _tree_with_two_children()
    with pytest.raises(RuntimeError, match="still has live lanes"):
        tree.start(1, 0)
    tree.commit(CommitSource.FULL)
    with pytest.raises(RuntimeError, match="pruned"):
        tree.spawn(root, 1, CommitSource.FIRST)
    with pytest.raises(RuntimeError, match="empty tree"):
        tree.commit(CommitSource.FIRST)


# -- metrics --------------------------------------------------------------------------------------------------
def test_mean_accepted_length_eq9():
    # all first-proposal accepts: gamma = R / d1
    assert mean_accepted_length(10, 10, 0, 32, 2, 8) == pytest.approx(16.0)
    # all restarts: gamma = 1
    assert mean_accepted_length(10, 0, 0, 32, 2, 8) == pytest.approx(1.0)
    # mixed: N R / (N1 d1 + N2 d2 + N3 R)
    assert mean_accepted_length(10, 7, 2, 32, 2, 8) == pytest.approx(320 / (14 + 16 + 32))
    assert mean_accepted_length(0, 0, 0, 4, 1, 2) == 0.0
    with pytest.raises(ValueError):
        mean_accepted_length(3, 2, 2, 4, 1, 2)
    # late re-proposals cost the depths they were made at: 10 R / (7 d1 + 1 d2 + (12 + 16) + 0 R)
    assert mean_accepted_length(10, 7, 1, 32, 2, 8, n_late=2, late_depth_sum=28) == pytest.approx(320 / (14 + 8 + 28))
    assert commit_shares(10, 7, 1, 2) == {"first": 0.7, "second": 0.1, "late": 0.2, "full": 0.0}


def test_stats_record_and_merge():
    a = LoopSpecStats(4, 1, 2)
    for src, had in [(CommitSource.FIRST, False), (CommitSource.SECOND, True), (CommitSource.FULL, True)]:
        a.record_commit(src, had_second=had)
    a.gate_evaluations, a.gate_opens = 4, 1
    b = LoopSpecStats(4, 1, 2)
    b.record_commit(CommitSource.FIRST, had_second=False)
    m = a.merge(b)
    assert (m.decoded, m.first, m.second, m.full, m.first_rejected_with_second) == (4, 2, 1, 1, 2)
    assert m.shares == commit_shares(4, 2, 1) == {"first": 0.5, "second": 0.25, "late": 0.0, "full": 0.25}
    assert m.gamma == pytest.approx(16 / (2 + 2 + 4))
    assert a.gate_open_frequency == 0.25
    assert m.double_rejection_rate == 0.25
    assert batch_size_summary([1, 3, 2]) == {"mean": 2.0, "peak": 3, "steps": 3}
    with pytest.raises(ValueError):
        a.merge(LoopSpecStats(32, 2, 8))


def test_theorem1_bound_depends_on_the_gate():
    gated, ungated, single = LoopSpecStats(4, 1, 2), LoopSpecStats(4, 1, 2, gate=False), LoopSpecStats(4, 1)
    for st in (gated, ungated, single):
        st.record_commit(CommitSource.FULL, had_second=False)
        st.eps2_sum = 0.25
    assert gated.theorem1_bound == 0.5 and ungated.theorem1_bound == 0.25 and single.theorem1_bound is None
    assert gated.summary()["theorem1_bound"] == 0.5 and gated.summary()["double_rejection_rate"] == 1.0
