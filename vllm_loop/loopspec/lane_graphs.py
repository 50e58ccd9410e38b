"""Lane calls -- the model functions a lane step runs on a batch of lanes -- eagerly or as CUDA graphs.

Three calls, each on rows that sit at their own depths and read their own KV banks (``lane_kv.py``):

* ``pre``    -- depth-0 states of new lanes: ``tokens -> states[slot]``;
* ``core``   -- one recurrent step: ``states[slot] -> states[slot]``;
* ``logits`` -- readouts: ``states[slot] -> logits`` and their argmax, which also goes to
  ``readout[slot]``: a ``pre`` row whose source column names a slot takes its token from there, so a
  greedy proposal's child can start before the proposal reaches the host (``runner.py``, overlap);
* ``sample`` -- the same readouts when some row samples (coupled sampling, ``noise.py``): each row's
  token is its noisy argmax under its own temperature / top-k / top-p and its request's noise at the
  position it proposes for (greedy rows: the argmax), so sampled lanes overlap as greedy ones do;
* ``dist`` -- ``logits`` that also hands the logits back (the cascade's sampled rows are filtered
  from them). ``logits`` and ``sample`` keep only the tokens: a graph's outputs stay allocated until
  it is replayed again, and logits of thousands of rows in every bucket's graph would not fit beside
  the KV cache.

Why graphs: a recurrent step of lanes is a handful of rows through the shared block. Launched eagerly it
costs far more host time than GPU time (an Ouro-1.4B lane step on the H200: ~3 ms of kernels behind
~70 ms of launches under the profiler, benchmarks/RESULTS.md), and vLLM's own graphs cover only its
forward. So ``LaneGraphs`` captures every call once per shape bucket and replays it.

Fixed shapes: rows are padded to a power of two, the committed context to a power of two (at least
``MIN_CONTEXT``, at most what the block table reaches), ancestors to the request's lane cap. A padding
row reads and writes the scratch's pad slot, has no committed context and no ancestors: it attends to
itself only and touches no lane. A call's inputs travel host -> device as one int64 array
(``LaneBatch``, column-major) through pinned memory (``upload``), its outputs stay in the graphs'
memory pool (one for all: they replay one at a time on one stream) until the next replay.

Without CUDA (CPU, CI) ``LaneGraphs`` runs the same padded calls eagerly, so the padding and the
buffers are tested everywhere and only the capture needs a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from vllm_loop.loopspec.lane_kv import LaneAttention, LaneRows, LaneScratch, PagedBanks
from vllm_loop.models.layers import lane_attention

KINDS = ("pre", "core", "logits", "sample", "dist")
WARM_KINDS = ("pre", "core", "logits", "sample")  # captured at start-up (``dist``: on first use)
# LaneBatch columns (then ancestors, then the block-table row); KEY .. TOP_P: the row's sampling (coupled
# readouts of ``sample``), TEMPERATURE and TOP_P as the bits of float64 values
SLOT, POSITION, DEPTH, TOKEN, PREFIX, SOURCE, KEY, TEMPERATURE, TOP_K, TOP_P, FIXED = range(11)
GREEDY_FIELDS = (0, 0, 0, int(np.float64(1.0).view(np.int64)))  # KEY .. TOP_P of a greedy row (and padding)


def sampling_fields(key: int, temperature: float, top_k: int, top_p: float) -> tuple[int, int, int, int]:
    """The KEY .. TOP_P columns of a row: the float parameters as the int64 bits of float64 values."""
    return (key, int(np.float64(temperature).view(np.int64)), top_k, int(np.float64(top_p).view(np.int64)))


@dataclass
class LaneBatch:
    """One lane call's rows packed host-side: columns slot, position, depth, token, prefix, source (the
    slot whose last readout is the token, or -1: the token column), key, temperature, top-k, top-p
    (``sampling_fields``), then ``ancestors`` ancestor slots (-1 padded, oldest first), then the
    request's block-table row."""

    host: np.ndarray  # [rows, FIXED + ancestors + table width] int64
    ancestors: int
    context: int  # committed positions every row reads (>= every row's prefix)
    n: int  # real rows; rows n.. are padding

    @staticmethod
    def empty(rows: int, ancestors: int, table_width: int, pad_slot: int) -> np.ndarray:
        host = np.zeros((rows, FIXED + ancestors + table_width), dtype=np.int64)
        host[:, SLOT] = pad_slot
        host[:, SOURCE] = -1
        host[:, KEY:FIXED] = GREEDY_FIELDS
        host[:, FIXED:FIXED + ancestors] = -1
        return host

    @classmethod
    def pack(cls, lanes: Sequence[tuple[int, ...]], ancestry: Sequence[list[int]],
             table_rows: np.ndarray, *, rows: int, ancestors: int, context: int, pad_slot: int) -> LaneBatch:
        """``lanes[i]``: (slot, position, depth, token, prefix, source, key, temperature, top-k, top-p) of
        real row i (without the last four: a greedy row); ``ancestry[i]`` its
        ancestors' slots; ``table_rows[i]`` its request's block-table row. Rows ``len(lanes)..rows``
        are padding."""
        n = len(lanes)
        host = cls.empty(rows, ancestors, table_rows.shape[1], pad_slot)
        width = len(lanes[0]) if n else KEY
        host[:n, :width] = lanes
        if ancestors:  # one assignment of the rows' slots, -1 padded (a loop of row assignments cost more)
            pad = [-1] * ancestors
            host[:n, FIXED:FIXED + ancestors] = [slots + pad[len(slots):] for slots in ancestry]
        host[:n, FIXED + ancestors:] = table_rows
        return cls(host, ancestors, context, n)


    def columns(self) -> torch.Tensor:
        """The batch column-major (``[columns, rows]``), as it goes to the device: every per-row
        field is then a contiguous vector (vLLM's kernels, rotary embedding for one, want that)."""
        return torch.from_numpy(np.ascontiguousarray(self.host.T))


def upload(host: torch.Tensor, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """CPU tensor ``host`` on ``device`` (into ``out`` if given) without stalling the host. CUDA
    synchronizes the stream before a copy from pageable memory, so every lane call would wait for the one before it
    and host and GPU would take turns; from pinned memory the copy is queued like a kernel and the host
    packs the next call meanwhile. PyTorch's pinned-memory cache holds the buffer until its copy ran."""
    src = host.pin_memory() if device.type == "cuda" else host
    if out is None:
        return src.to(device, non_blocking=True)
    return out.copy_(src, non_blocking=True)


def device_rows(packed: torch.Tensor, ancestors: int, context: int):
    """Views of a column-major packed batch on the device: ``(LaneRows, positions, depths, tokens,
    sources)``."""
    rows = LaneRows(slots=packed[SLOT], prefix=packed[PREFIX], block_rows=packed[FIXED + ancestors:].T,
                    ancestors=packed[FIXED:FIXED + ancestors].T, context=context)
    return rows, packed[POSITION], packed[DEPTH], packed[TOKEN], packed[SOURCE]


def coupled_readout(logits: torch.Tensor, packed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each row's token of a ``sample`` call (``noise.coupled_sample``, in float32 as vLLM samples):
    the noise of the position after the row's own."""
    from vllm_loop.loopspec.noise import coupled_sample

    return coupled_sample(logits, packed[TEMPERATURE].view(torch.float64).float(), packed[TOP_K],
                          packed[TOP_P].view(torch.float64).float(), packed[KEY], positions + 1)


@contextmanager
def compiled_norms():
    """vLLM's C RMSNorm kernels for the length of a lane call. vLLM 0.26 dispatches RMSNorm through
    ``vllm.ir`` and, when it compiles with Inductor, picks the native (PyTorch) implementation, which
    Inductor fuses inside vLLM's forward; the lane calls run outside it, where native is ~10 kernels
    per norm. Where the C kernel is not built (CPU) this changes nothing."""
    from vllm import ir

    with ExitStack() as stack:
        for op in (ir.ops.rms_norm, ir.ops.fused_add_rms_norm):
            providers = [p for p in ("vllm_c", "native") if p in op.impls]
            stack.enter_context(op.set_priority(providers))
        yield


def custom_ops_of(model) -> list:
    """The model's vLLM custom ops that have a CUDA implementation (SiLU-and-mul, rotary, RMSNorm);
    found once per model. vLLM 0.26's ``CustomOp`` dispatches through ``_forward_method``, chosen at
    construction; an op without one (another vLLM) is left alone."""
    ops = getattr(model, "_vllm_loop_cuda_ops", None)
    if ops is None:
        from vllm.model_executor.custom_op import CustomOp

        ops = [m for m in model.modules()
               if isinstance(m, CustomOp) and hasattr(m, "_forward_method")
               and type(m).forward_cuda is not CustomOp.forward_cuda]
        model._vllm_loop_cuda_ops = ops
    return ops


@contextmanager
def cuda_custom_ops(model, cuda: bool):
    """vLLM's CUDA implementation of every custom op for the length of a lane call, whatever the
    engine's ``custom_ops``. Under torch.compile vLLM builds them native (``custom_ops`` "none") for
    Inductor to fuse inside its forward; lane calls run the layers outside it, where native is several
    small kernels per op. vLLM's compiled forward never reads the op's dispatch again, so it keeps what
    it compiled. ``cuda`` False (CPU): nothing changes."""
    ops = custom_ops_of(model) if cuda else []
    kept = [op._forward_method for op in ops]
    for op in ops:
        op._forward_method = op.forward_cuda
    try:
        yield
    finally:
        for op, method in zip(ops, kept):
            op._forward_method = method


def lane_call(model, paged: PagedBanks, scratch: LaneScratch, kind: str, packed: torch.Tensor, ancestors: int,
              context: int, kernel=None) -> torch.Tensor | None:
    """Run one lane call on a packed batch already on the device. States go to the scratch; a readout
    (``logits``, ``sample``, ``dist``) returns ``(logits or None, token)`` of every row (padding rows
    included) and keeps the token in ``scratch.readout``. ``kernel``: the lane attention kernel (None: the PyTorch lane attention)."""
    rows, positions, depths, tokens, sources = device_rows(packed, ancestors, context)
    with lane_attention(LaneAttention(paged, scratch, rows, kernel)), compiled_norms(), \
            cuda_custom_ops(model, packed.is_cuda):
        if kind == "pre":
            tokens = torch.where(sources >= 0, scratch.readout[sources.clamp_min(0)], tokens)
            scratch.states[rows.slots] = model.lane_pre(tokens, positions)
        elif kind == "core":
            scratch.states[rows.slots] = model.lane_core(scratch.states[rows.slots], positions, depths)
        elif kind in ("logits", "sample", "dist"):
            logits = model.lane_logits(scratch.states[rows.slots], positions, depths)
            top = coupled_readout(logits, packed, positions) if kind == "sample" else logits.argmax(-1)
            scratch.readout[rows.slots] = top
            return (logits if kind == "dist" else None), top
        else:
            raise ValueError(f"lane call kind {kind!r}; allowed: {', '.join(KINDS)}")
    return None


class LaneGraphs:
    """Every lane call captured once per (kind, rows, context) bucket, replayed with one input buffer."""

    MIN_CONTEXT = 64
    MAX_CELLS = 1 << 16  # rows x context above this run eagerly: the torch lane attention gathers
    #                      K/V per row, so a graph's memory grows with both (the kernel's does not)

    def __init__(self, model, paged: PagedBanks, scratch: LaneScratch, *, table_width: int, ancestors: int,
                 max_rows: int, capture: bool, kernel=None):
        self.model, self.paged, self.scratch, self.kernel = model, paged, scratch, kernel
        self.ancestors, self.table_width, self.capture = ancestors, table_width, capture
        self.max_rows = 1 << (max(1, max_rows) - 1).bit_length()
        self.max_context = table_width * paged.block_size
        self.packed = torch.zeros(FIXED + ancestors + table_width, self.max_rows, dtype=torch.long,
                                  device=scratch.kv.device)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._graphs: dict[tuple[str, int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}

    @property
    def captured(self) -> int:
        return sum(graph is not None for graph, _ in self._graphs.values())

    def shape(self, n: int, context: int) -> tuple[int, int] | None:
        """(padded rows, padded context) of a call, or None when it is outside the buckets."""
        rows = 1 << (max(1, n) - 1).bit_length()
        if self.kernel is not None:  # the kernel reads each row's own prefix: one context bucket will do
            return (rows, self.max_context) if rows <= self.max_rows else None
        ctx = min(max(self.MIN_CONTEXT, 1 << (max(1, context) - 1).bit_length()), self.max_context)
        if rows > self.max_rows or context > ctx or rows * ctx > self.MAX_CELLS:
            return None
        return rows, ctx

    def buckets(self) -> list[tuple[int, int]]:
        """Every (rows, context) ``shape`` can return: with the kernel one context, else each power of two
        from ``MIN_CONTEXT`` up to the block table's reach, within ``MAX_CELLS``."""
        rows = [1 << i for i in range(self.max_rows.bit_length())]
        if self.kernel is not None:
            return [(r, self.max_context) for r in rows]
        contexts = sorted({min(max(self.MIN_CONTEXT, 1 << i), self.max_context)
                           for i in range(self.max_context.bit_length() + 1)})
        return [(r, c) for r in rows for c in contexts if r * c <= self.MAX_CELLS]

    def capture_all(self) -> int:
        """Capture every bucket of every kind now (engine start-up), so that no lane step while serving
        pays for a capture or for the Triton compilations its first replay of a shape would trigger.
        Returns the number captured."""
        before = self.captured
        for rows, context in self.buckets():
            for kind in WARM_KINDS:
                if (kind, rows, context) not in self._graphs:
                    self._graphs[(kind, rows, context)] = self._capture(kind, rows, context)
        return self.captured - before

    def __call__(self, kind: str, batch: LaneBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run ``kind`` on ``batch`` (built with ``self.shape``'s rows and context, ``self.ancestors``).
        Returns the logits and argmax of the real rows (``logits``), else None."""
        rows = batch.host.shape[0]
        key = (kind, rows, batch.context)
        if key not in self._graphs:
            self._graphs[key] = self._capture(kind, rows, batch.context)
        upload(batch.columns(), self.packed.device, self.packed[:, :rows])
        graph, out = self._graphs[key]
        if graph is None:  # no CUDA: the same padded call, eagerly
            out = lane_call(self.model, self.paged, self.scratch, kind, self.packed[:, :rows], self.ancestors,
                            batch.context, self.kernel)
        else:
            graph.replay()
        return None if out is None else tuple(None if x is None else x[: batch.n] for x in out)

    def _capture(self, kind: str, rows: int, context: int):
        if not self.capture:
            return None, None
        # Capture on padding rows only: the warm-up and the capture then run on the pad slot and
        # change no lane's state (the caller fills in the real rows afterwards).
        pad = LaneBatch.empty(rows, self.ancestors, self.table_width, self.scratch.pad_slot)
        upload(LaneBatch(pad, self.ancestors, context, 0).columns(), self.packed.device, self.packed[:, :rows])

        def body():
            return lane_call(self.model, self.paged, self.scratch, kind, self.packed[:, :rows], self.ancestors,
                             context, self.kernel)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graphs asks
            body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = body()
        return graph, out
