"""Lane attention: our Triton kernel against FlashAttention with per-lane page tables (GPU only).

Issue 10 asks to choose the lane attention by a measured comparison. A lane row reads (1) its
request's committed prefix at its own bank -- paged, so any paged decode kernel can read it given a
per-lane page table -- and (2) its window: its uncommitted ancestors and itself, which live in the
runner's lane pool, not in vLLM's cache, and differ between sibling lanes. So the FlashAttention
variant is three steps: store the rows' own K/V in the pool, FlashAttention 3 (vLLM's bundled
``vllm_flash_attn``) over the prefix with ``block_table[row] = block * pages + page_of[bank]`` on the
cache viewed as ``[blocks * pages, B, H, D]`` (every (block, bank) page becomes one FA page), a small
attention over the window that also returns its log-sum-exp, and vLLM's ``merge_attn_states``. The
Triton kernels (``kernels/lane_attention.py``) do all of it in two launches (the prefix split over
programs, then the window and the merge).

Every variant runs on the same inputs (vLLM's packed KV layout of a LoopSpec engine: all banks of a
block contiguous, K | V split in the last dimension) and is checked against the PyTorch lane
attention (``LaneAttention``, fp32 softmax) before it is timed. Times: ``triton.testing.do_bench_cudagraph``
(the lane calls are replayed from CUDA graphs in the engine), microseconds per call of one layer.
FlashInfer is not in the offline vLLM bundle of the GPU host, so it is not compared.

    python benchmarks/lane_attention_compare.py --out benchmarks/results/lane-attention-compare-h200.txt
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loopspec_speed import SHAPES  # noqa: E402  (the benchmark shapes' configs: one home)
from vllm_loop.loopspec.lane_kv import LaneAttention, LaneRows, LaneScratch, PagedBanks  # noqa: E402

BLOCK = 16  # vLLM's GPU block size
ENGINE_BLOCKS = 64  # block tables as wide as loopspec_speed.py's engines' (max_model_len 1,024)


def attention_shape(shape: str) -> tuple[int, int, int, int]:
    """(query heads, KV heads, head dim, KV banks) of a benchmark shape: banks = T x layers (Ouro),
    R x core layers + prelude + coda (Huginn)."""
    family, _, c, _ = SHAPES[shape]
    if family == "ouro":
        return (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                c["total_ut_steps"] * c["num_hidden_layers"])
    return (c["n_heads"], c["n_heads"], c["n_embd"] // c["n_heads"],
            c["mean_recurrence"] * c["n_layers_in_recurrent_block"] + c["n_layers_in_prelude"] + c["n_layers_in_coda"])


def make_case(shape: str, requests: int, lanes: int, prefix: int, window: int, seed: int = 0, dev: str = "cuda",
              width: int | None = None):
    """``requests`` requests with ``prefix`` committed positions at every bank, ``lanes`` lane rows
    each at random banks, up to ``window`` ancestors each in the lane pool; block tables ``width``
    blocks wide (None: just the prefix; an engine's are as wide as its longest request can be).
    -> (paged, scratch, rows, banks, q, k, v)."""
    Hq, H, D, S = attention_shape(shape)
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    per_req = math.ceil(prefix / BLOCK)
    NB = requests * per_req + 1  # block 0: vLLM's null block
    backing = torch.randn(NB, S, H, BLOCK, 2 * D, device=dev, dtype=dt, generator=g)
    paged = PagedBanks([backing[:, b] for b in range(S)])
    perm = torch.randperm(NB - 1, device=dev, generator=g) + 1  # scattered blocks, as after a while of serving
    tables = perm.view(requests, per_req)
    if width is not None and width > per_req:
        tables = torch.cat([tables, tables.new_zeros(requests, width - per_req)], dim=1)
    n = requests * lanes
    scratch = LaneScratch(S, n, H, D, 4, dt, dev)
    scratch.kv.normal_(generator=g)
    req = torch.arange(requests, device=dev).repeat_interleave(lanes)
    slots = torch.randperm(n, device=dev, generator=g)
    # ancestors: other slots, oldest first, -1 padded; between 0 and `window` of them
    count = torch.randint(0, window + 1, (n,), device=dev, generator=g)
    anc = torch.stack([torch.roll(slots, s + 1) for s in range(window)], dim=1) if window else \
        torch.empty(n, 0, dtype=torch.long, device=dev)
    anc = torch.where(torch.arange(window, device=dev)[None, :] < count[:, None], anc, -1)
    rows = LaneRows(slots=slots, prefix=torch.full((n,), prefix, device=dev), block_rows=tables[req],
                    ancestors=anc, context=prefix)
    banks = torch.randint(0, S, (n,), device=dev, generator=g)
    qkv = torch.randn(n, (Hq + 2 * H) * D, device=dev, dtype=dt, generator=g)
    q, k, v = qkv.split([Hq * D, H * D, H * D], dim=-1)
    return paged, scratch, rows, banks, q.view(n, Hq, D), k.view(n, H, D), v.view(n, H, D)


class FlashLaneAttention:
    """FlashAttention 3 over the prefix with per-lane page tables, a PyTorch window with its LSE, and
    vLLM's ``merge_attn_states``. The page tables are built once per call (as a lane step would)."""

    def __init__(self, paged: PagedBanks, scratch: LaneScratch, rows: LaneRows, banks: torch.Tensor,
                 fa_layout: bool = False):
        """``fa_layout``: read a copy of the cache in FlashAttention's own page layout ``[pages, B, H,
        D]`` contiguous (what it would cost if the packed layout were FA's), instead of in place."""
        S = paged.pages.shape[1]
        # [blocks, pages, H, B, D] -> [blocks * pages, B, H, D]: one FA page per (block, bank)
        self.k_cache = paged.k.flatten(0, 1).transpose(1, 2)
        self.v_cache = paged.v.flatten(0, 1).transpose(1, 2)
        if fa_layout:
            self.k_cache, self.v_cache = self.k_cache.contiguous(), self.v_cache.contiguous()
        self.block_table = (rows.block_rows * S + paged.page_of[banks][:, None]).to(torch.int32)
        n = banks.shape[0]
        self.seqused = rows.prefix.to(torch.int32)
        self.cu_q = torch.arange(n + 1, device=banks.device, dtype=torch.int32)
        self.max_k = int(rows.context)
        own = torch.cat([rows.ancestors, rows.slots[:, None]], dim=1)
        self.window, self.window_mask = own.clamp_min(0), own >= 0
        self.scratch, self.rows, self.banks = scratch, rows, banks

    def __call__(self, q, k, v, scale):
        from vllm.v1.attention.ops.merge_attn_states import merge_attn_states
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        kv, banks = self.scratch.kv, self.banks
        kv[banks, self.rows.slots, 0] = k
        kv[banks, self.rows.slots, 1] = v
        q = q.contiguous()
        prefix_out, prefix_lse = flash_attn_varlen_func(
            q, self.k_cache, self.v_cache, max_seqlen_q=1, cu_seqlens_q=self.cu_q, max_seqlen_k=self.max_k,
            seqused_k=self.seqused, softmax_scale=scale, causal=True, block_table=self.block_table,
            return_softmax_lse=True, fa_version=3)
        # the window: ancestors + self, fp32 scores, LSE for the merge
        b = banks[:, None].expand_as(self.window)
        K, V = kv[b, self.window, 0].float(), kv[b, self.window, 1].float()  # [n, A+1, H, D]
        rep = q.shape[1] // K.shape[2]
        if rep > 1:
            K, V = K.repeat_interleave(rep, dim=2), V.repeat_interleave(rep, dim=2)
        s = torch.einsum("nhd,nmhd->nhm", q.float(), K) * scale
        s = s.masked_fill(~self.window_mask[:, None, :], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [n, Hq]
        window_out = torch.einsum("nhm,nmhd->nhd", torch.softmax(s, dim=-1), V).to(q.dtype).contiguous()
        out = torch.empty_like(q)
        merge_attn_states(out, prefix_out, prefix_lse, window_out, lse.t().contiguous())
        return out


def run_case(shape, requests, lanes, prefix, window, do_bench) -> dict:
    from vllm_loop_kernels.lane_attention import lane_attention

    paged, scratch, rows, banks, q, k, v = make_case(shape, requests, lanes, prefix, window, width=ENGINE_BLOCKS)
    scale = q.shape[-1] ** -0.5
    variants = {
        "torch": LaneAttention(paged, scratch, rows),
        "triton": LaneAttention(paged, scratch, rows, kernel=lane_attention),
        "flash3": FlashLaneAttention(paged, scratch, rows, banks),
        "flash3_fa_layout": FlashLaneAttention(paged, scratch, rows, banks, fa_layout=True),
    }
    bank_ids = torch.arange(paged.num_banks, device=banks.device)  # every bank: depth i is bank i
    calls = {"torch": lambda: variants["torch"](bank_ids, banks, q, k, v, scale),
             "triton": lambda: variants["triton"](bank_ids, banks, q, k, v, scale),
             "flash3": lambda: variants["flash3"](q, k, v, scale),
             "flash3_fa_layout": lambda: variants["flash3_fa_layout"](q, k, v, scale)}
    want = calls["torch"]().float()
    row = dict(shape=shape, requests=requests, lanes=requests * lanes, prefix=prefix, window=window)
    for name, fn in calls.items():
        try:
            got = fn().float()
            err = (got - want).abs().max().item()
            if not err <= 2e-2:
                raise AssertionError(f"max abs error {err:.3g} against the PyTorch lane attention")
            row[f"{name}_us"] = round(do_bench(fn) * 1e3, 1)
            row[f"{name}_err"] = err
        except Exception as e:  # noqa: BLE001 -- recorded in the table, never silently dropped
            row[f"{name}_us"], row[f"{name}_error"] = None, f"{type(e).__name__}: {str(e)[:160]}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="lane-attention-compare.txt")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lane_attention_compare.py needs a CUDA GPU (FlashAttention 3 and the compiled Triton kernel)")
    from triton.testing import do_bench_cudagraph

    cases = [("ouro-1.4b", r, 4, p, 3) for r in (1, 4, 16) for p in (128, 352, 1024)] + \
            [("huginn-0125", r, 16, p, 3) for r in (1, 4) for p in (128, 512)]
    lines = [f"# {torch.cuda.get_device_name()}, bf16, block {BLOCK}; us per call of one layer "
             "(do_bench_cudagraph); err: max abs vs the PyTorch lane attention (fp32 softmax)",
             "flash3: FA3 in place (+ window + merge); flash3 FA layout: the same on a copy of the cache in FA's "
             "own page layout",
             "| shape | lane rows | prefix | window | torch us | triton us | flash3 us | flash3 FA layout us | "
             "flash3 / triton |", "|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        row = run_case(*case, do_bench=do_bench_cudagraph)
        print(row, flush=True)
        t, f = row.get("triton_us"), row.get("flash3_us")
        ratio = f"{f / t:.2f}" if t and f else "-"
        cell = lambda name: (f"{row[name + '_us']}" if row[name + "_us"] is not None  # noqa: E731
                             else f"failed ({row[name + '_error']})")
        lines.append(f"| {row['shape']} | {row['lanes']} | {row['prefix']} | <= {row['window']} | {cell('torch')} | "
                     f"{cell('triton')} | {cell('flash3')} | {cell('flash3_fa_layout')} | {ratio} |")
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
