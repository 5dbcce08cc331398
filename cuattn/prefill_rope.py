"""Ragged prefill's fused RoPE (``pos_encoding_mode="ROPE_LLAMA"``) with the keys rotated once per run.

The prefill kernels rotate each K tile in shared memory after it lands (``variant.cuh``), so a key is
rotated once for every query tile that reads it: at 1 x 16384 causal (fa3, H100) the fused RoPE took
1.63x plain attention, almost all of it that rotation (``benchmarks/results/variants_notes.md``). Where K
is contiguous (``BatchPrefillWithRaggedKVCacheWrapper``, so ``single_prefill_with_kv_cache`` too) and
enough query tiles share each key (``pays``), plan() picks the kernel with ``variants.ROPE_Q`` in the
RoPE's place (each CTA rotates its own query rows, no key tile), and run() first rotates the batch's keys
into a buffer of the wrapper (``KeyRotation``: rope.cu with rope.cuh's float-float angle at every key),
read by the kernel instead of k. The result is the fused RoPE's, not bit for bit (in-kernel key tiles
turn their first row's angles by a step angle; here every angle is the full formula).

Not on the paged cache (its keys would need a gather into the buffer: the kernels rotate there) nor in
CUDA-graph mode (the first plan fixes the kernel for every batch replayed; in-kernel there).
"""
from __future__ import annotations

import numpy as np

from . import arrays, rope, variants

# query tiles (of 128 packed rows) that must read a key, on average over the batch's keys (twice that when
# causal: a causal tile reads about half of them), before its rotation runs once ahead of the kernel: the
# pass costs reading and writing K once more, ~4 reads of K; the in-kernel rotation costs ~0.6x of the
# attention time per tile it repeats in (fa3, head_dim 128, H100)
MIN_SHARING = 4
_TILE_ROWS = 128


def pays(composite: variants.Composite, qo_lens: np.ndarray, kv_lens: np.ndarray, group: int, causal: bool) -> bool:
    """Whether a ragged plan of this batch rotates its keys once ahead of the kernel."""
    if not composite.has_rope or not len(kv_lens):
        return False
    keys = int(kv_lens.sum())
    tiles = -(-qo_lens * group // _TILE_ROWS)
    return keys > 0 and int((tiles * kv_lens).sum()) >= MIN_SHARING * (2 if causal else 1) * keys


def kernel_composite(composite: variants.Composite) -> variants.Composite:
    """The kernel's variant under a key pre-pass: ROPE_Q (same parameters) where the RoPE was."""
    return variants.Composite(tuple(variants.ROPE_Q if v == variants.ROPE_LLAMA else v for v in composite.pieces))


class KeyRotation:
    """A ragged wrapper's rotated keys: ``plan(p)`` at every GPU plan sizes the buffer (plan time, so
    run() allocates nothing), ``rotate`` in run() fills it before the attention launch."""

    def __init__(self):
        self.active = False
        self._buf = None            # uint16 CuPy array: (kv_indptr[-1], num_kv_heads, head_dim) rotated keys

    def plan(self, p) -> None:
        self.active = bool(p.rope_prepass) and p.device is not None
        if not self.active:
            return
        need = max(int(p.kv_indptr[-1]) * p.num_kv_heads * p.head_dim, 8)
        if self._buf is None or self._buf.size < need or self._buf.device.id != p.device:
            cp = arrays.cupy_module()
            self._buf = None        # (freed before the new one is allocated)
            with cp.cuda.Device(p.device):
                self._buf = cp.empty(need, np.uint16)

    def rotate(self, ctx, plan, k: arrays.Tensor, tok: int, head: int) -> arrays.Tensor:
        """The plan's keys of ``k`` (token and head dimensions ``tok``, ``head``) rotated at their positions
        in their requests into the buffer, on the run's stream; returns the buffer as (nnz, heads, head_dim)."""
        nnz, heads, d = int(plan.kv_indptr[-1]), plan.num_kv_heads, plan.head_dim
        src = arrays.Tensor(k.ptr, (nnz, heads, d), (k.strides[tok], k.strides[head], 1), k.dtype, k.device,
                            k.framework, k.obj)
        fixed = plan.bound.fixed
        rope.rotate_rows(ctx, src, self._buf.data.ptr, plan.meta["kv_indptr"], plan.batch, fixed["rotary_dim"],
                         tuple(fixed[n] for n in variants.ROPE_FREQ))
        return arrays.Tensor(self._buf.data.ptr, (nnz, heads, d), (heads * d, d, 1), k.dtype, k.device, "cupy",
                             self._buf)
