"""Does prefetching the next weight matrix into L2 on a side stream shorten a lane step? GPU only.

A lane step at one request multiplies ~4 rows by each matrix of the shared block: cuBLAS then
reads weights at 1.4-3.4 TB/s (``lane_gemm_compare.py``), short of the H200's ~4.8, because each
small GEMM ramps up and drains; and between GEMMs the attention and the norms leave HBM idle. A
side stream that pulls the next matrix into the 50 MB L2 cache while the current kernel runs could
fill both gaps. This probe times a model of one recurrent step of lanes -- per layer: a norm, qkv,
the attention, o, a norm, gate_up, SiLU-and-mul, down; the norms and the attention stood in for by
``torch.cuda._sleep`` (busy kernels that read no memory) -- for every layer of a shape, each layer
with its own weights so nothing stays in L2 between layers, under one CUDA graph, with and without
the prefetch. It needs only PyTorch and Triton:

    python benchmarks/probes/weight_prefetch_probe.py --out benchmarks/results/weight-prefetch-probe-h200.txt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: loopspec_speed

from lane_gemm_compare import shared_block_matrices  # noqa: E402
from loopspec_speed import SHAPES  # noqa: E402

ORDER = ["qkv", "o", "gate_up", "down"]


@triton.jit
def _prefetch_kernel(ptr, n_lines, LINES: tl.constexpr, PER_PROGRAM: tl.constexpr):
    # One thread per 128-byte line: ``prefetch.global.L2`` asks for the line and returns at once.
    base = tl.program_id(0).to(tl.int64) * LINES * PER_PROGRAM
    for i in range(PER_PROGRAM):
        line = tl.minimum(base + i * LINES + tl.arange(0, LINES), n_lines - 1)  # past the end: the last line
        p = ptr + line * 64  # bf16 pointer: 64 elements per line
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _touch_kernel(ptr, sink, n_lines, LINES: tl.constexpr, PER_PROGRAM: tl.constexpr):
    # The plain way: load every line through L2 (``.cg``) and keep one number so the loads stay.
    base = tl.program_id(0).to(tl.int64) * LINES * PER_PROGRAM
    acc = tl.zeros([LINES], tl.float32)
    for i in range(PER_PROGRAM):
        line = base + i * LINES + tl.arange(0, LINES)
        acc += tl.load(ptr + line * 64, mask=line < n_lines, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(sink + tl.program_id(0), tl.sum(acc))


def prefetch(w: torch.Tensor, how: str, programs: int, sink: torch.Tensor) -> None:
    n_lines = w.numel() * 2 // 128
    lines = 128
    per = max(1, triton.cdiv(n_lines, lines * programs))
    grid = (triton.cdiv(n_lines, lines * per),)
    if how == "prefetch":
        _prefetch_kernel[grid](w, n_lines, LINES=lines, PER_PROGRAM=per, num_warps=4)
    else:
        _touch_kernel[grid](w, sink, n_lines, LINES=lines, PER_PROGRAM=per, num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="weight-prefetch-probe.txt")
    ap.add_argument("--shapes", nargs="+", default=["ouro-1.4b", "huginn-0125"])
    ap.add_argument("--rows", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("weight_prefetch_probe.py needs a CUDA GPU")
    from triton.testing import do_bench_cudagraph

    clock_ghz = 1.98  # H200 boost clock: _sleep takes cycles
    lines = [f"# {torch.cuda.get_device_name()}, bf16, {args.rows} rows; us per recurrent step of the model "
             "(do_bench_cudagraph); 'sleep' = the norms' and attention's stand-in time per layer"]
    g = torch.Generator(device="cuda").manual_seed(0)
    side = torch.cuda.Stream()
    for shape in args.shapes:
        layers = SHAPES[shape][2]["num_hidden_layers"] if SHAPES[shape][0] == "ouro" else 4  # Huginn: 4 core blocks
        mats = shared_block_matrices(shape)
        ws = [{m: torch.randn(*mats[m], device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for m in ORDER}
              for _ in range(layers)]
        seq = [w[m] for w in ws for m in ORDER]  # the order the step reads them
        H = mats["o"][0]
        x = torch.randn(args.rows, H, device="cuda", dtype=torch.bfloat16, generator=g)
        sink = torch.empty(4096, device="cuda", dtype=torch.float32)

        def step(how: str, programs: int, attn_us: float, norm_us: float, ahead: int = 1):
            main = torch.cuda.current_stream()

            def run():
                h = x
                for i, w in enumerate(seq):
                    m = ORDER[i % 4]
                    if how != "none" and i + ahead < len(seq):
                        ev = torch.cuda.Event()
                        ev.record(main)
                        with torch.cuda.stream(side):
                            side.wait_event(ev)
                            prefetch(seq[i + ahead], how, programs, sink)
                    if m in ("qkv", "gate_up") and norm_us:
                        torch.cuda._sleep(int(norm_us * 1000 * clock_ghz))
                    y = torch.nn.functional.linear(h if m != "down" else act, w)
                    if m == "qkv":
                        if attn_us:
                            torch.cuda._sleep(int(attn_us * 1000 * clock_ghz))
                        h = y[:, :H]
                    elif m == "gate_up":
                        act = torch.nn.functional.silu(y[:, : y.shape[1] // 2]) * y[:, y.shape[1] // 2:]
                    else:
                        h = y
                if how != "none":
                    main.wait_stream(side)
                return h
            return run

        for attn_us, norm_us in [(0, 0), (11, 2.2)]:
            base = do_bench_cudagraph(step("none", 0, attn_us, norm_us), rep=200)
            lines.append(f"{shape}: sleep {attn_us} + 2x{norm_us} us per layer, {layers} layers: "
                         f"no prefetch {base * 1000:.1f} us")
            for how in ("prefetch", "touch"):
                for programs in (4, 16, 64):
                    for ahead in (1, 2):
                        try:
                            t = do_bench_cudagraph(step(how, programs, attn_us, norm_us, ahead), rep=200)
                        except Exception as e:  # noqa: BLE001  (a probe: report and go on)
                            lines.append(f"  {how} programs={programs} ahead={ahead}: failed {type(e).__name__}: "
                                         f"{str(e)[:200]}")
                            continue
                        lines.append(f"  {how} programs={programs} ahead={ahead}: {t * 1000:.1f} us "
                                     f"({base / t:.3f}x)")
            print("\n".join(lines), flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
