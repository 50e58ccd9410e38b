"""What the CUDA calls of a lane step cost the host, on the GPU host itself (PyTorch only, no vLLM):
replaying a CUDA graph of 10-600 kernels against launching them eagerly, a lane call's input upload
(pinned copy into the graphs' input buffer), the eager ops of a commit, a readout's pinned copy back,
``record_function``. One H200 host's output: ``benchmarks/results/cuda-host-costs-h200.txt``.

    python3 benchmarks/probes/cuda_host_costs.py
"""
import time

import torch
from torch.profiler import record_function

dev = "cuda"
torch.zeros(1, device=dev)
torch.cuda.synchronize()


def host_us(fn, reps=40, sync=True):
    """Median host time of ``fn`` in microseconds (after the GPU is idle, when ``sync``)."""
    ts = []
    for _ in range(reps):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def body(x, n):  # n small kernels, one after the other
    for _ in range(n):
        x = torch.addcmul(x, x, x, value=1e-6)
    return x


for n in (10, 100, 300, 600):
    x = torch.zeros(4, 2048, device=dev)
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body(x, n)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = body(x, n)
    torch.cuda.synchronize()
    hr = host_us(g.replay)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(50):
        g.replay()
    torch.cuda.synchronize(); gpu = (time.perf_counter() - t) / 50 * 1e6
    he = host_us(lambda: body(x, n), reps=10)
    print(f"graph of {n} kernels: replay host {hr:.1f} us; back-to-back {gpu:.1f} us per replay; eager launch host {he:.1f} us", flush=True)
packed = torch.zeros(77, 16, dtype=torch.long, device=dev)
host = torch.zeros(77, 4, dtype=torch.long)
print(f"pin_memory of a 77x4 int64: {host_us(lambda: host.pin_memory()):.1f} us", flush=True)
pinned = host.pin_memory()
print(f"copy_ pinned -> non-contiguous device view: {host_us(lambda: packed[:, :4].copy_(pinned, non_blocking=True)):.1f} us", flush=True)
print(f"copy_ pinned -> contiguous device: {host_us(lambda: packed[0, :4].copy_(pinned[0], non_blocking=True)):.1f} us", flush=True)
print(f"pin_memory + copy_ (upload): {host_us(lambda: packed[:, :4].copy_(host.pin_memory(), non_blocking=True)):.1f} us", flush=True)
print(f".to(device, non_blocking) of pinned: {host_us(lambda: pinned.to(dev, non_blocking=True)):.1f} us", flush=True)
kv = torch.zeros(96, 64, 2, 8, 128, dtype=torch.bfloat16, device=dev)
idx = torch.arange(96, device=dev); sl = torch.zeros(96, dtype=torch.long, device=dev)
print(f"kv[banks, slots] gather: {host_us(lambda: kv[idx, sl]):.1f} us", flush=True)
src = kv[idx, sl]
def put(): kv[idx, sl] = src
print(f"kv[banks, slots] = x index_put: {host_us(put):.1f} us", flush=True)
top = torch.zeros(4, dtype=torch.long, device=dev)
def hc():
    h = torch.empty(4, dtype=torch.long, pin_memory=True); h.copy_(top, non_blocking=True); e = torch.cuda.Event(); e.record()
print(f"pinned D2H copy + event record: {host_us(hc):.1f} us", flush=True)
print(f"tolist of a device tensor (sync, idle GPU): {host_us(lambda: top.tolist()):.1f} us", flush=True)


def rf():
    with record_function("x"):
        pass
print(f"record_function enter/exit (no profiler): {host_us(rf, sync=False):.2f} us", flush=True)
print(f"argmax of [4, 49152] bf16: {host_us(lambda: torch.zeros(4, 49152, device=dev, dtype=torch.bfloat16).argmax(-1)):.1f} us", flush=True)
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
