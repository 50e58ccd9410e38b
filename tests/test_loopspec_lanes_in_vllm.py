"""The pieces LoopSpec adds for vLLM, without an engine: the pipeline's engine-facing decisions, the
paged-bank view of vLLM's KV cache (both in-page layouts, detected with vLLM's own CPU kernel) and
lane attention against plain attention."""

from __future__ import annotations

import pytest
import torch

from vllm_loop.loopspec.lane_kv import LaneAttention, LaneRows, LaneScratch, PagedBanks
from vllm_loop.loopspec.lanes import BranchTree
from vllm_loop.loopspec.metrics import EngineCounters
from vllm_loop.loopspec.pipeline import RequestPipeline
from vllm_loop.loopspec.proposals import SamplingParams
from vllm_loop.loopspec.schedule import LoopSpecSchedule
from vllm_loop.loopspec.verify import CommitSource
from vllm_loop.reference.kv import attention

NB, S, H, B, D = 6, 3, 2, 16, 32  # blocks, banks (pages per block), kv heads, block size, head dim


def _packed(dtype=torch.float32):
    """vLLM's packed layout: one allocation, all banks of a block contiguous; bank b at page order[b]."""
    backing = torch.zeros(NB, S, H, B, 2 * D, dtype=dtype)
    order = [2, 0, 1]  # bank -> page: not the identity, as in vLLM (registration order)
    return backing, [backing[:, order[b]] for b in range(S)]


class _Layer:
    """An attention layer whose backend writes the K/V probe (vLLM's CPU kernel, or split last dim)."""

    _k_scale_float = _v_scale_float = 1.0

    def __init__(self, layout):
        self.impl = self
        self.layout = layout

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if self.layout == "cpu":
            from vllm import _custom_ops as ops

            nb, h, b, _ = kv_cache.shape
            kc, vc = kv_cache.view(nb, h, 2 * b, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slot_mapping, "vec", k_scale=1.0, v_scale=1.0,
                                           kv_cache_dtype="auto")
        else:
            blocks, offs = slot_mapping // B, slot_mapping % B
            kv_cache[blocks, :, offs, :D] = key
            kv_cache[blocks, :, offs, D:] = value


@pytest.mark.parametrize("layout, name", [("cpu", "cpu-kt"), ("split", "split-last")])
def test_paged_banks_detect_the_layout_and_round_trip(layout, name):
    backing, caches = _packed()
    paged = PagedBanks(caches, _Layer(layout))
    assert paged.layout == name and paged.page_of.tolist() == [2, 0, 1]
    assert torch.count_nonzero(backing) == 0  # the probe's block is restored
    # what our writer stores, vLLM's kernel would have stored (compare raw pages)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g)
    paged.write(torch.tensor([4, 4, 5]), torch.tensor([1, 1, 2]), torch.tensor([0, 7, 15]), k, v)
    ours = backing.clone()
    backing.zero_()
    slots = torch.tensor([4 * B + 0, 4 * B + 7, 5 * B + 15])
    _Layer(layout).do_kv_cache_update(None, k[:2], v[:2], caches[1], slots[:2])
    _Layer(layout).do_kv_cache_update(None, k[2:], v[2:], caches[2], slots[2:])
    assert torch.equal(ours, backing)
    kk, vv = paged.gather(torch.tensor([[4, 4], [5, 5]]), torch.tensor([1, 2]), torch.tensor([[0, 7], [15, 15]]))
    assert torch.equal(kk[0], k[:2]) and torch.equal(vv[1, 0], v[2])


def test_paged_banks_need_the_packed_layout():
    separate = [torch.zeros(NB, H, B, 2 * D) for _ in range(S)]
    with pytest.raises(RuntimeError, match="packed KV layout"):
        PagedBanks(separate)


def test_lane_attention_equals_attention_over_prefix_ancestors_and_self():
    """Two requests; lanes at different banks; each row attends over its request's paged prefix
    (bank of the row), its ancestors' scratch K/V and its own."""
    g = torch.Generator().manual_seed(0)
    _, caches = _packed()
    paged = PagedBanks(caches)
    scratch = LaneScratch(S, 8, H, D, 4, torch.float32, "cpu")
    prefix = {0: 20, 1: 5}  # committed positions per request
    tables = {0: [3, 1, 0], 1: [5, 0, 0]}
    for r, n in prefix.items():  # fill the paged prefix of every bank
        pos = torch.arange(n)
        for bank in range(S):
            paged.write(torch.tensor(tables[r])[pos // B], torch.full((n,), bank), pos % B,
                        torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g))
    # ancestors of each row live in scratch slots
    anc = {0: [6, 2], 1: [], 2: [4]}
    for slot in (6, 2, 4):
        scratch.kv[:, slot] = torch.randn(S, 2, H, D, generator=g)
    rows_req, rows_slot, banks = [0, 1, 0], [1, 3, 5], torch.tensor([2, 0, 1])
    width = 2
    rows = LaneRows(
        slots=torch.tensor(rows_slot), prefix=torch.tensor([prefix[r] for r in rows_req]),
        block_rows=torch.tensor([tables[r] for r in rows_req]),
        ancestors=torch.tensor([a + [-1] * (width - len(a)) for a in (anc[0], anc[1], anc[2])]),
    )
    Hq = 2 * H  # GQA
    q = torch.randn(3, Hq, D, generator=g)
    k, v = torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g)
    out = LaneAttention(paged, scratch, rows)(torch.arange(S), banks, q, k, v, D**-0.5)
    for i, r in enumerate(rows_req):
        n, b = prefix[r], int(banks[i])
        pos = torch.arange(n)
        kp, vp = paged.gather(torch.tensor(tables[r])[pos // B][None], torch.tensor([b]), (pos % B)[None])
        keys = torch.cat([kp[0]] + [scratch.kv[b, s, 0][None] for s in anc[i]] + [k[i : i + 1]])
        vals = torch.cat([vp[0]] + [scratch.kv[b, s, 1][None] for s in anc[i]] + [v[i : i + 1]])
        want = attention(q[i : i + 1], keys, vals, D**-0.5, keys.shape[0] - 1)
        torch.testing.assert_close(out[i : i + 1], want, atol=1e-5, rtol=1e-5)
        assert torch.equal(scratch.kv[b, rows_slot[i], 0], k[i])  # the row's own K/V is kept


class _ToyLanes:
    """Lane functions of a one-layer toy model: q, k, v linear in the state, attention through the
    installed lane attention (as ``BankedAttention`` calls it), row i at bank ``depths[i] % S``."""

    def __init__(self, gen):
        self.lane_state_width = W = H * D
        self.wq, self.wk, self.wv = (torch.randn(W, 2 * H * D, generator=gen) * 0.1,
                                     torch.randn(W, H * D, generator=gen) * 0.1, torch.randn(W, H * D, generator=gen) * 0.1)
        self.emb, self.head = torch.randn(50, W, generator=gen), torch.randn(2 * H * D, 11, generator=gen)

    def _attend(self, x, depths):
        from vllm_loop.models import layers

        n = x.shape[0]
        q, k, v = (x @ self.wq).view(n, 2 * H, D), (x @ self.wk).view(n, H, D), (x @ self.wv).view(n, H, D)
        return layers._lane_attention(torch.arange(S), depths % S, q, k, v, D**-0.5).reshape(n, -1)

    def lane_pre(self, tokens, positions):
        x = self.emb[tokens]
        return x + self._attend(x, torch.zeros_like(tokens))[:, : x.shape[1]]

    def lane_core(self, state, positions, depths):
        return state + self._attend(state, depths)[:, : state.shape[1]]

    def lane_logits(self, state, positions, depths):
        return self._attend(state, depths) @ self.head


@pytest.mark.parametrize("kind", ["pre", "core", "logits", "sample", "dist"])
def test_padded_lane_calls_equal_exact_ones(kind):
    """What a lane graph runs -- rows padded to a power of two, context to 64, ancestors to the lane
    cap -- gives the real rows what the exact-shape call gives them, and padding rows touch only the
    pad slot. (On the CPU ``LaneGraphs`` runs the padded call eagerly; the GPU test captures it.)"""
    from vllm_loop.loopspec.lane_graphs import LaneBatch, LaneGraphs, lane_call

    g = torch.Generator().manual_seed(1)
    _, caches = _packed()
    paged = PagedBanks(caches)
    table = torch.tensor([[3, 1, 0, 0], [5, 0, 0, 0]]).numpy()
    for r, n in {0: 20, 1: 5}.items():
        pos = torch.arange(n)
        for bank in range(S):
            paged.write(torch.tensor(table[r])[pos // B], torch.full((n,), bank), pos % B,
                        torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g))
    scratch = LaneScratch(S, 8, H, D, H * D, torch.float32, "cpu")
    scratch.kv.copy_(torch.randn(scratch.kv.shape, generator=g))
    scratch.states.copy_(torch.randn(scratch.states.shape, generator=g))
    model = _ToyLanes(g)
    # (slot, position, depth, token, prefix, source) per row; ancestors; request of the row. Row 1 takes its
    # token from slot 6's last readout (a greedy child started on the device): the exact call names it.
    scratch.readout[6] = 13
    lanes = [(1, 21, 2, 7, 20, -1), (3, 5, 0, 0, 5, 6), (5, 22, 1, 4, 20, -1)]
    named = [lanes[0], (3, 5, 0, 13, 5, -1), lanes[2]]
    ancestry, req = [[6, 2], [], [4]], [0, 1, 0]
    exact = LaneBatch.pack(named, ancestry, table[req], rows=3, ancestors=2, context=20, pad_slot=scratch.pad_slot)
    kv0, states0 = scratch.kv.clone(), scratch.states.clone()
    want = lane_call(model, paged, scratch, kind, exact.columns(), 2, 20)
    want_kv, want_states = scratch.kv.clone(), scratch.states.clone()
    scratch.kv.copy_(kv0), scratch.states.copy_(states0)

    graphs = LaneGraphs(model, paged, scratch, table_width=4, ancestors=7, max_rows=16, capture=False)
    rows, ctx = graphs.shape(3, 20)
    assert (rows, ctx) == (4, 64) and graphs.shape(3, 64) == (4, 64)
    assert graphs.shape(3, 65) is None and graphs.shape(17, 20) is None  # past the table, past max_rows
    got = graphs(kind, LaneBatch.pack(lanes, ancestry, table[req], rows=rows, ancestors=7, context=ctx,
                                      pad_slot=scratch.pad_slot))
    real = [1, 3, 5]
    if kind == "dist":  # logits handed back, and their argmax
        assert got[0].shape == want[0].shape
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(got[1], got[0].argmax(-1)) and torch.equal(scratch.readout[real], got[1])
    if kind in ("logits", "sample"):  # tokens only (greedy rows: "sample" takes their argmax too)
        assert got[0] is None and want[0] is None
        assert torch.equal(got[1], want[1]) and torch.equal(scratch.readout[real], got[1])
    torch.testing.assert_close(scratch.states[real], want_states[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scratch.kv[:, real], want_kv[:, real], atol=1e-5, rtol=1e-5)
    others = [s for s in range(scratch.num_slots) if s not in real]  # lanes' slots untouched; pad slot aside
    assert torch.equal(scratch.kv[:, others], kv0[:, others]) and torch.equal(scratch.states[others], states0[others])


@pytest.mark.parametrize("kernel", [None, "kernel"], ids=["torch-attention", "lane-kernel"])
def test_start_up_buckets_cover_every_shape_a_lane_call_can_take(kernel):
    """The start-up warm-up captures ``LaneGraphs.buckets()``: every (rows, context) that ``shape`` can
    give a lane call, so no lane step while serving meets a shape (a capture, a Triton compilation)
    for the first time. On the CPU ``capture_all`` records each bucket without capturing."""
    from types import SimpleNamespace

    from vllm_loop.loopspec.lane_graphs import WARM_KINDS, LaneGraphs

    paged, scratch = SimpleNamespace(block_size=16), SimpleNamespace(kv=torch.empty(0))
    graphs = LaneGraphs(None, paged, scratch, table_width=32, ancestors=7, max_rows=200, capture=False,
                        kernel=kernel)
    buckets = set(graphs.buckets())
    seen = {graphs.shape(n, context) for n in range(1, 257) for context in range(1, 32 * 16 + 2, 3)} - {None}
    assert seen == buckets, (sorted(seen - buckets), sorted(buckets - seen))
    assert graphs.capture_all() == 0 and len(graphs._graphs) == len(WARM_KINDS) * len(buckets)  # none captured on a CPU
    assert graphs.capture_all() == 0 and len(graphs._graphs) == len(WARM_KINDS) * len(buckets)  # and only once


class _NormPriorityProbe(_ToyLanes):
    """Records which RMSNorm implementations vLLM would dispatch to while a lane call runs."""

    def lane_core(self, state, positions, depths):
        from vllm import ir

        self.seen = (ir.ops.rms_norm.get_priority(), ir.ops.fused_add_rms_norm.get_priority())
        return super().lane_core(state, positions, depths)


def test_lane_calls_take_vllms_c_rmsnorm_where_it_runs(monkeypatch):
    """vLLM 0.26 compiles its forward with Inductor and so dispatches RMSNorm to the native PyTorch
    code (fused by Inductor there); the lane calls run outside that forward, so they ask for vLLM's C
    kernel wherever it is supported (on the H200 this took Ouro-1.4B from 5.6 to 3.0 ms per recurrent
    step), and put the priority back afterwards. On the CPU the C kernel is unsupported: native."""
    import vllm.kernels  # noqa: F401  (registers the vllm_c implementations, as a worker does)
    from vllm import ir

    from vllm_loop.loopspec.lane_graphs import LaneBatch, lane_call

    g = torch.Generator().manual_seed(1)
    _, caches = _packed()
    paged = PagedBanks(caches)
    scratch = LaneScratch(S, 8, H, D, H * D, torch.float32, "cpu")
    model = _NormPriorityProbe(g)
    table = torch.tensor([[3, 1, 0, 0]]).numpy()
    batch = LaneBatch.pack([(1, 3, 0, 7, 3, -1)], [[]], table, rows=1, ancestors=0, context=3, pad_slot=scratch.pad_slot)
    ops = (ir.ops.rms_norm, ir.ops.fused_add_rms_norm)
    before = [op.get_priority() for op in ops]

    lane_call(model, paged, scratch, "core", batch.columns(), 0, 3)
    assert model.seen == (["native"], ["native"])  # CPU: vllm_c is registered but unsupported
    for op in ops:  # as on a CUDA device
        monkeypatch.setattr(op.impls["vllm_c"], "supported", True)
    lane_call(model, paged, scratch, "core", batch.columns(), 0, 3)
    assert model.seen == (["vllm_c", "native"], ["vllm_c", "native"])
    assert [op.get_priority() for op in ops] == before  # vLLM's own forward keeps its choice


def test_lane_scratch_slots_come_back():
    scratch = LaneScratch(2, 3, 1, 4, 4, torch.float32, "cpu")
    taken = [scratch.take() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and scratch.take() is None and scratch.free == 0
    for s in taken:
        scratch.give_back(s)
    assert scratch.free == 3


# -- the pipeline, as the engine drives it ----------------------------------------------------------------------
def _drive_greedy(pipe: RequestPipeline, target, steps: int, proposal=None):
    """Advance ``pipe`` for ``steps`` recurrent steps with a fake model: the full-depth argmax after
    token t is ``target(t)``; readouts at d1/d2 propose ``proposal(t, depth)``. -> committed tokens."""
    sch, out = pipe.schedule, []
    proposal = proposal or (lambda token, depth: target(token))
    for _ in range(steps):
        for lane in pipe.lanes:
            lane.depth += 1
        read = {lane.id: (target(lane.token) if lane.depth == sch.R else proposal(lane.token, lane.depth))
                for lane in pipe.readers()}
        step = pipe.advance(read)
        if step.commit is not None:
            out.append(step.commit.verdict.token)
    return out


def test_pipeline_commits_the_full_depth_argmax_whatever_the_proposals():
    target = lambda t: (3 * t + 1) % 17  # noqa: E731
    sch = LoopSpecSchedule(8, 2, 4)
    for proposal in (None, lambda t, d: (t + d) % 17, lambda t, d: target(t) if d == 4 else 0):
        pipe = RequestPipeline(sch)
        pipe.start(5, 10)
        got = _drive_greedy(pipe, target, 60, proposal)
        want, t = [], 5
        for _ in got:
            t = target(t)
            want.append(t)
        assert got == want and len(got) >= 60 // 8


def test_pipeline_lane_cap_keeps_it_lossless():
    """A cap below the schedule's bound skips proposals (never a wrong token)."""
    target = lambda t: (5 * t + 2) % 23  # noqa: E731
    sch = LoopSpecSchedule(8, 2, 4, gate=False)
    free, capped = RequestPipeline(sch), RequestPipeline(sch, max_lanes=2)
    for p in (free, capped):
        p.start(1, 0)
    wrong = lambda t, d: (t + 1) % 23  # noqa: E731  second proposals always differ from the first
    a, b = _drive_greedy(free, target, 80, wrong), _drive_greedy(capped, target, 80, wrong)
    assert b == a[: len(b)] and len(b) > 5
    assert max(capped.stats.lanes_per_step) <= 2 < max(free.stats.lanes_per_step)


def test_pipeline_without_a_first_proposal_samples_from_p():
    sch = LoopSpecSchedule(4, 1)
    pipe = RequestPipeline(sch, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), max_lanes=1)
    root = pipe.start(3, 7)
    for d in range(1, 5):
        root.depth = d
        p = torch.tensor([0.0, 0.25, 0.75])
        step = pipe.advance({root.id: p} if d in sch.readout_depths else {})
    assert root.first is None and step.commit is not None
    assert step.commit.verdict.source == CommitSource.FULL and step.commit.verdict.token in (1, 2)
    assert [lane.position for lane in step.spawned] == [8]  # the restart lane for the next position


@pytest.mark.parametrize("R, d1, d2, cap", [(4, 1, 2, 7), (8, 2, 4, 3), (32, 2, 8, 64)])
def test_expected_outcome_is_what_advance_does_when_it_goes_the_likely_way(R, d1, d2, cap):
    """``expect`` -- what the runner enqueues the next recurrent step on before the readouts reach the
    host (overlap) -- names the root ``advance`` verifies, keeps every lane that survives it, and when
    the step goes the likely way (the root's first proposal accepted or no root verified, no second
    proposal, nothing else pruned) names exactly the lanes whose first proposals spawn children."""
    import random

    rng = random.Random(R * 100 + d1)
    target = lambda t: (7 * t + 3) % 31  # noqa: E731
    pipe = RequestPipeline(LoopSpecSchedule(R, d1, d2), max_lanes=cap)
    pipe.start(1, 0)
    likely = other = 0
    for _ in range(600):
        for lane in pipe.lanes:
            lane.depth += 1
        exp, before = pipe.expect(), pipe.lanes
        read = {lane.id: target(lane.token) if lane.depth == R or rng.random() < 0.85 else (lane.token + lane.depth) % 31
                for lane in pipe.readers()}
        step = pipe.advance(read)
        assert (step.commit.lane if step.commit else None) is exp.commit
        assert all(any(lane is kept for kept in exp.stay) for lane in before if lane.alive)
        went_likely = ((step.commit is None or step.commit.verdict.source == CommitSource.FIRST) and not step.pruned
                       and all(lane.origin == CommitSource.FIRST for lane in step.spawned))
        if went_likely:
            likely += 1
            assert [lane.parent for lane in step.spawned] == exp.proposers
        else:
            other += 1
    assert likely > 100 and other > 10, (likely, other)


def test_tree_reroot_keeps_the_committed_path():
    tree = BranchTree()
    root = tree.start(1, 0)
    a = tree.spawn(root, 2, CommitSource.FIRST)
    b = tree.spawn(root, 9, CommitSource.SECOND)
    a1 = tree.spawn(a, 3, CommitSource.FIRST)
    a2 = tree.spawn(a1, 4, CommitSource.FIRST)
    b1 = tree.spawn(b, 8, CommitSource.FIRST)
    pruned = tree.reroot(a1)
    assert {x.id for x in pruned} == {root.id, a.id, b.id, b1.id}
    assert tree.root is a1 and a1.parent is None and tree.lanes == [a1, a2]
    assert tree.ancestors(a2) == [a1]


def test_ancestor_slots_in_one_pass_equal_the_walk_up_the_tree():
    """The runner's one-pass ancestry (``LoopSpecRunner._ancestor_slots``) gives every lane the slots of
    ``tree.ancestors`` (without the root about to be committed, when it is skipped)."""
    from vllm_loop.loopspec.runner import LoopSpecRunner

    tree = BranchTree()
    root = tree.start(1, 0)
    a = tree.spawn(root, 2, CommitSource.FIRST)
    b = tree.spawn(root, 9, CommitSource.SECOND)
    a1 = tree.spawn(a, 3, CommitSource.FIRST)
    tree.spawn(a1, 4, CommitSource.FIRST)
    tree.spawn(b, 8, CommitSource.FIRST)
    for i, lane in enumerate(tree.lanes):
        lane.slot = 10 + 3 * i
    chains = LoopSpecRunner._ancestor_slots(tree.lanes)
    assert chains == {lane: [x.slot for x in tree.ancestors(lane)] for lane in tree.lanes}
    assert chains[tree.lanes[4]] == [10, 13, 19]  # a2: root, a, a1
    stay = [lane for lane in tree.lanes if lane is not root]
    assert LoopSpecRunner._ancestor_slots(stay, skip=root) == {
        lane: [x.slot for x in tree.ancestors(lane) if x is not root] for lane in stay}


def test_step_drafts_pad_a_short_chain_to_the_step_budget():
    from vllm_loop.loopspec.runner import step_drafts

    # Ouro's chain is at most ceil(R / d1) = 4 long; padded, a lane step may commit up to 1 + 16 tokens
    assert step_drafts([5, 6, 7], 4, 16, pad=True) == [5, 6, 7] + [7] * 13
    assert step_drafts([], 4, 16, pad=True) == [4] * 16  # no proposal yet: the root's token
    assert step_drafts([5, 6, 7], 4, 16, pad=False) == [5, 6, 7]  # a large batch: the chain alone
    assert step_drafts(list(range(20)), 4, 16, pad=True) == list(range(16))  # never past k


def test_cpu_rejection_expand_fills_int_and_float_outputs():
    """vllm_patches.upstream.install_cpu_rejection_expand: vLLM 0.26's CPU kernel left these uninitialised."""
    import vllm.v1.sample.rejection_sampler as rejection

    from vllm_loop.vllm_patches.upstream import install_cpu_rejection_expand

    install_cpu_rejection_expand()
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    top_k = rejection.expand_batch_to_tokens(torch.tensor([5, 0, 7], dtype=torch.int32), cu, 6)
    assert top_k.tolist() == [5, 5, 0, 0, 0, 7] and top_k.dtype == torch.int32
    temperature = rejection.expand_batch_to_tokens(torch.tensor([0.5, -1.0, 0.9]), cu, 6, replace_from=-1.0,
                                                   replace_to=1)
    assert temperature.tolist() == pytest.approx([0.5, 0.5, 1.0, 1.0, 1.0, 0.9])


def test_cpu_sampler_honours_a_seed_next_to_unseeded_rows():
    """vllm_patches.upstream.install_cpu_seeded_sampling: vLLM 0.26's CPU sampler drew every row from the global
    RNG unless all rows were seeded, so a seeded request's token depended on its neighbours."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from vllm_loop.vllm_patches.upstream import install_cpu_seeded_sampling

    install_cpu_seeded_sampling()
    sampler = TopKTopPSampler("raw_logprobs")
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    k = torch.tensor([5, 300, 5, 300], dtype=torch.int32)

    def seeded_row(batch: slice, row: int, global_seed: int) -> int:
        torch.manual_seed(global_seed)  # the global RNG: other draws in the step
        rows = logits[batch].clone()
        sampled, _ = sampler.forward(rows, {row: torch.Generator().manual_seed(1)}, k[batch], None)
        return int(sampled[row])

    alone = [seeded_row(slice(2, 3), 0, 0) for _ in range(2)]
    assert alone[0] == alone[1]
    for global_seed in range(8):  # row 2 of four, three of them unseeded
        assert seeded_row(slice(0, 4), 2, global_seed) == alone[0]


def test_engine_counters_and_vllm_spec_stats():
    from vllm_loop.loopspec.scheduler import loopspec_spec_stats

    c = EngineCounters(recurrent_steps=10, lanes_advanced=40, request_steps=20, first=8, second=2, full=2,
                       first_verified=12, second_verified=5, gate_evaluations=10, gate_opens=5)
    s = c.summary(R=4)
    assert s["gamma"] == pytest.approx(4 * 12 / 20) and s["lanes_per_step"] == 4.0
    assert s["shares"] == {"first": 8 / 12, "second": 2 / 12, "late": 0.0, "full": 2 / 12} and s["gate_open_rate"] == 0.5
    stats = loopspec_spec_stats(c, num_spec_tokens=4)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (12, 17, 10)
    assert stats.num_accepted_tokens_per_pos == [8, 2, 0, 0]
    assert loopspec_spec_stats(EngineCounters(), 4) is None
    total = EngineCounters()
    total.add(c)
    total.add(c)
    assert total.minus(c) == c
