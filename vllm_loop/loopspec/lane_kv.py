"""Lane KV inside vLLM: the paged KV banks seen as one tensor, every lane's own KV, and lane attention.

A lane at position p reads, at bank b: the committed prefix 0..c-1 of its request (vLLM's paged
cache, bank b), then its uncommitted ancestors (oldest first) and itself. Sibling lanes (the first
and second proposal for one position) must not share storage, so every live lane keeps its own
K/V of every bank in a runner-owned scratch pool (``LaneScratch``, one slot per lane); when a root
is verified its K/V of all banks is written to its canonical paged slot (``PagedBanks.write``), and
from then on its descendants read that position from the paged cache like the rest of the prefix.

``PagedBanks`` relies on vLLM's packed KV layout (all banks of one block contiguous; the plugin
turns it on for LoopSpec deployments), so one gather serves lanes of every depth. The in-page
layout of K and V is the attention backend's; it is detected at start-up by writing a probe with
the backend's own ``do_kv_cache_update`` and checking which known layout reads it back.

``LaneAttention`` is the plain PyTorch path (CPU and GPU): fp32 scores over the gathered context,
padded positions masked. It is exact and simple; fast GPU kernels are a separate concern.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PagedBanks:
    """vLLM's KV cache of every bank as two ``[blocks, pages, heads, block_size, head_dim]`` views."""

    def __init__(self, kv_caches: list[torch.Tensor], probe_layer=None):
        """``kv_caches[b]``: vLLM's cache tensor of bank b, logical shape ``[blocks, heads, B, 2*D]``
        (the runner's ``kv_caches`` list, ordered by layer index = bank). ``probe_layer``: an
        attention layer of bank 0, whose backend writes the layout probe."""
        first = kv_caches[0]
        nb, H, B, D2 = first.shape
        self.num_banks, self.block_size, self.num_heads, self.head_dim = len(kv_caches), B, H, D2 // 2
        page_elems = H * B * D2
        base = min(t.data_ptr() for t in kv_caches)
        esz = first.element_size()
        pages = [(t.data_ptr() - base) // (page_elems * esz) for t in kv_caches]
        S = max(pages) + 1
        if sorted(pages) != list(range(S)) or any(t.stride() != first.stride() or t.shape != first.shape
                                                  for t in kv_caches):
            raise RuntimeError("LoopSpec needs vLLM's packed KV layout (all banks of a block contiguous), "
                               f"found page offsets {pages}")
        origin = kv_caches[pages.index(0)]
        s = origin.stride()
        if s[0] != S * page_elems:
            raise RuntimeError(f"packed KV: block stride {s[0]} != {S} pages of {page_elems} elements")
        self.pages = torch.as_strided(origin, (nb, S, H, B, D2), (s[0], page_elems, s[1], s[2], s[3]))
        for b, t in enumerate(kv_caches):  # every bank is exactly a page of the combined view
            view = self.pages[:, pages[b]]
            assert view.data_ptr() == t.data_ptr() and view.stride() == t.stride(), f"bank {b}"
        self.page_of = torch.tensor(pages, dtype=torch.long, device=first.device)
        self.layout = self._detect_layout(probe_layer, kv_caches[0], pages[0]) if probe_layer else "split-last"
        D = self.head_dim
        if self.layout == "split-last":  # FlashAttention / Triton: K | V packed in the last dim
            self.k, self.v = self.pages[..., :D], self.pages[..., D:]
        else:  # vLLM CPU (vec / vec16): per head, K transposed [D, B], then V [B, D]
            flat = self.pages.reshape(nb, S, H, 2 * B * D)
            self.k = flat[..., : B * D].unflatten(-1, (D, B)).transpose(-1, -2)
            self.v = flat[..., B * D:].unflatten(-1, (B, D))

    def _views(self, layout: str, page_tensor: torch.Tensor):
        """(k, v) ``[blocks, H, B, D]`` views of one bank's cache tensor in ``layout``."""
        nb, H, B, D2 = page_tensor.shape
        D = D2 // 2
        if layout == "split-last":
            return page_tensor[..., :D], page_tensor[..., D:]
        flat = page_tensor.view(nb, H, B * D2)
        return flat[..., : B * D].unflatten(-1, (D, B)).transpose(-1, -2), flat[..., B * D:].unflatten(-1, (B, D))

    def _detect_layout(self, layer, cache: torch.Tensor, page: int) -> str:
        """Write random K/V into block 0 (vLLM's null block, never handed to a request) with the
        backend's own kernel, find the layout that reads it back, and restore the block."""
        nb, H, B, D2 = cache.shape
        D = D2 // 2
        gen = torch.Generator(device="cpu").manual_seed(0)
        k = torch.randn(B, H, D, generator=gen).to(cache.dtype).to(cache.device)
        v = torch.randn(B, H, D, generator=gen).to(cache.dtype).to(cache.device)
        saved = cache[0].clone()
        try:
            layer.impl.do_kv_cache_update(layer, k, v, cache, torch.arange(B, device=cache.device))
            for layout in ("split-last", "cpu-kt"):
                try:
                    kv, vv = self._views(layout, cache)
                except RuntimeError:  # this layout's view does not exist for these strides
                    continue
                if torch.equal(kv[0].transpose(0, 1), k) and torch.equal(vv[0].transpose(0, 1), v):
                    return layout
        finally:
            cache[0].copy_(saved)
        raise RuntimeError(f"LoopSpec cannot read the KV layout of attention backend {type(layer.impl).__name__}")

    def gather(self, blocks: torch.Tensor, banks: torch.Tensor, offsets: torch.Tensor):
        """K, V ``[n, M, H, D]`` at ``blocks[n, M]``, ``offsets[n, M]`` of bank ``banks[n]``."""
        pages = self.page_of[banks].unsqueeze(1).expand_as(blocks)
        return self.k[blocks, pages, :, offsets], self.v[blocks, pages, :, offsets]

    def write(self, blocks: torch.Tensor, banks: torch.Tensor, offsets: torch.Tensor, k, v) -> None:
        """Store ``k, v [m, H, D]`` at (block, bank, offset) ``m`` times."""
        pages = self.page_of[banks]
        self.k[blocks, pages, :, offsets] = k.to(self.k.dtype)
        self.v[blocks, pages, :, offsets] = v.to(self.v.dtype)


class LaneScratch:
    """Each live lane's own K/V at every bank: ``kv[bank, slot, 0|1, H, D]``, its hidden state, and the
    argmax of its last readout (``readout[slot]``: where a greedy child's token can come from on the
    device, before the host has read it).

    One more slot than lanes, ``pad_slot``, is never handed out: padding rows of a fixed-shape call
    (``lane_graphs.py``) read and write it, so they touch no lane's data."""

    def __init__(self, num_banks: int, num_slots: int, num_heads: int, head_dim: int, state_width: int,
                 dtype, device):
        self.kv = torch.zeros(num_banks, num_slots + 1, 2, num_heads, head_dim, dtype=dtype, device=device)
        self.states = torch.zeros(num_slots + 1, state_width, dtype=dtype, device=device)
        self.readout = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
        self.num_slots, self.pad_slot = num_slots, num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give_back(self, slot: int) -> None:
        self._free.append(slot)


@dataclass
class LaneRows:
    """Per-row context of one lane call: where each row's prefix and ancestors are."""

    slots: torch.Tensor  # [n] the row's own scratch slot
    prefix: torch.Tensor  # [n] committed positions of its request (0..prefix-1 are paged)
    block_rows: torch.Tensor  # [n, max_blocks] its request's block table (kernel blocks)
    ancestors: torch.Tensor  # [n, A] scratch slots of its uncommitted ancestors, oldest first, -1 padded
    context: int | None = None  # committed positions every row reads (>= max prefix; None: max prefix).
    # Given by the caller, it costs no device-to-host read, and a padded one keeps shapes fixed.


class LaneAttention:
    """Attention of a batch of lanes, each row at its own bank: installed for one lane call.

    ``kernel``: the Triton kernel (``kernels/lane_attention.py``), which stores the rows' own K/V and
    reads the paged prefix and the lane window in place; None: the PyTorch path below."""

    def __init__(self, paged: PagedBanks, scratch: LaneScratch, rows: LaneRows, kernel=None):
        self.paged, self.scratch, self.rows, self.kernel = paged, scratch, rows, kernel
        if kernel is not None:
            return
        B = paged.block_size
        M = rows.context if rows.context is not None else int(rows.prefix.max()) if rows.prefix.numel() else 0
        j = torch.arange(M, device=rows.prefix.device)
        n = rows.prefix.shape[0]
        self.blocks = rows.block_rows.gather(1, (j // B).unsqueeze(0).expand(n, M).contiguous())
        self.offsets = (j % B).unsqueeze(0).expand(n, M)
        own = torch.cat([rows.ancestors, rows.slots.unsqueeze(1)], dim=1)  # [n, A+1]
        self.window = own.clamp_min(0)
        self.mask = torch.cat([j.unsqueeze(0) < rows.prefix.unsqueeze(1), own >= 0], dim=1)

    def __call__(self, bank_ids: torch.Tensor, depths: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, scale: float, rope=None, bias=None):
        """``q [n, Hq, D]``, ``k, v [n, H, D]`` of rows at global banks ``bank_ids[depths]`` (the layer's
        banks, ``depths [n]``) -> ``[n, Hq, D]``. ``rope``: ``(rotary_emb, positions)`` (vLLM's rotary
        embedding, not yet applied to q and k), or None. ``bias``: ``(q bias [Hq * D], k bias [H * D])``
        added to q and k before RoPE (Huginn's), or None."""
        kv = self.scratch.kv
        if self.kernel is not None:  # it looks the banks up and stores the rows' own K/V itself
            kernel_rope = kernel_bias = None
            if rope is None or fusable_rope(rope[0]):  # and adds the bias and applies RoPE as it loads q and k
                kernel_bias, bias = bias, None
                if rope is not None:
                    rotary, positions = rope
                    kernel_rope, rope = (positions, rotary._match_cos_sin_cache_dtype(q), rotary.is_neox_style), None
            q, k = rotated(rope, *biased(bias, q, k))
            r = self.rows
            return self.kernel(q, k, v, self.paged.k, self.paged.v, self.paged.page_of, bank_ids, depths, r.prefix,
                               r.slots, r.block_rows, r.ancestors, kv, scale, rope=kernel_rope, bias=kernel_bias)
        q, k = rotated(rope, *biased(bias, q, k))
        banks = bank_ids[depths]
        kv[banks, self.rows.slots, 0] = k.to(kv.dtype)
        kv[banks, self.rows.slots, 1] = v.to(kv.dtype)
        kp, vp = self.paged.gather(self.blocks, banks, self.offsets)
        b = banks.unsqueeze(1).expand_as(self.window)
        K = torch.cat([kp.to(kv.dtype), kv[b, self.window, 0]], dim=1)  # [n, M + A + 1, H, D]
        V = torch.cat([vp.to(kv.dtype), kv[b, self.window, 1]], dim=1)
        rep = q.shape[1] // K.shape[2]
        if rep > 1:
            K, V = K.repeat_interleave(rep, dim=2), V.repeat_interleave(rep, dim=2)
        scores = torch.einsum("nhd,nmhd->nhm", q.float(), K.float()) * scale
        scores = scores.masked_fill(~self.mask.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("nhm,nmhd->nhd", probs, V.float()).to(q.dtype)


def biased(bias, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [n, Hq, D]``, ``k [n, H, D]`` plus ``bias = (q bias [Hq * D], k bias [H * D])`` (None: as they are)."""
    if bias is None:
        return q, k
    return q + bias[0].view(q.shape[1:]), k + bias[1].view(k.shape[1:])


def rotated(rope, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [n, Hq, D]``, ``k [n, H, D]`` after ``rope = (rotary_emb, positions)`` (None: as they are)."""
    if rope is None:
        return q, k
    rotary, positions = rope
    n = q.shape[0]
    q2, k2 = rotary(positions, q.reshape(n, -1), k.reshape(n, -1))
    return q2.view(q.shape), k2.view(k.shape)


def fusable_rope(rotary) -> bool:
    """Can the lane attention kernel apply ``rotary`` itself? vLLM's plain ``RotaryEmbedding`` (its
    scaled variants only change ``cos_sin_cache``), as its CUDA kernel would apply it."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return (isinstance(rotary, RotaryEmbedding) and type(rotary).forward_cuda is RotaryEmbedding.forward_cuda
            and not getattr(rotary, "use_flashinfer", False) and rotary.rotary_dim <= rotary.head_size)
