"""Ragged prefill's fused RoPE (``pos_encoding_mode="ROPE_LLAMA"``) as a rotation ahead of plain attention.

The prefill kernels rotate each K tile in shared memory after it lands (``variant.cuh``), so a key is
rotated once for every query tile that reads it: at 1 x 16384 causal (fa3, H100) the fused RoPE took
1.67x plain attention, almost all of it that rotation (``benchmarks/results/variants_notes.md``). Where K
is contiguous (``BatchPrefillWithRaggedKVCacheWrapper``, so ``single_prefill_with_kv_cache`` too) and
enough query tiles share each key (``pays``), plan() picks the kernel of the variant without the RoPE,
and run() first rotates q (at its bottom-right positions) and the batch's keys (at their indices) into a
buffer of the wrapper (``RopeAhead``: rope.cu, rope.cuh's float-float angle at every position; one
launch each), read by the kernel instead of q and k. Rotating q there too measured faster than the
kernel rotating its own query rows (98 against ~300 µs at that shape: each CTA's angle set-up sits
before its first tile). The result is the fused RoPE's within rounding, not bit for bit (the in-kernel
key tiles turn their first row's angles by a step angle; here every angle is the full formula).

The buffer holds q's and k's planned rows (qo_indptr[-1] x num_qo_heads + kv_indptr[-1] x num_kv_heads
head rows of q's dtype), sized at plan(). Not on the paged cache (its keys would need a gather into the
buffer: the kernels rotate there) nor in CUDA-graph mode (the first plan fixes the kernel for every batch
replayed; in-kernel there).
"""
from __future__ import annotations

import numpy as np

from . import arrays, rope, variants

# query tiles (of 128 packed rows) that must read a key, on average over the batch's keys (twice that when
# causal: a causal tile reads about half of them), before the rotation runs ahead of the kernel: the pass
# costs reading and writing q and K once more; the in-kernel rotation costs ~0.6x of the attention time a
# tile (fa3, head_dim 128, H100)
MIN_SHARING = 4
_TILE_ROWS = 128


def pays(composite: variants.Composite, qo_lens: np.ndarray, kv_lens: np.ndarray, group: int, causal: bool) -> bool:
    """Whether a ragged plan of this batch rotates q and K ahead of the kernel."""
    if not composite.has_rope or not len(kv_lens):
        return False
    keys = int(kv_lens.sum())
    tiles = -(-qo_lens * group // _TILE_ROWS)
    return keys > 0 and int((tiles * kv_lens).sum()) >= MIN_SHARING * (2 if causal else 1) * keys


def kernel_composite(composite: variants.Composite) -> variants.Composite:
    """The kernel's variant when q and K come rotated: the plan's without the RoPE."""
    return variants.Composite(tuple(v for v in composite.pieces if v != variants.ROPE_LLAMA))


def kernel_bound(plan) -> variants.Bound:
    """The variant whose arguments a GPU run of ``plan`` passes: the plan's, or under the rotation ahead its
    kernel spec's (the plan's without the RoPE, whose parameters are all fixed: the runtime ones stay)."""
    b = plan.bound
    return variants.Bound(plan.spec.variant, b.fixed, b.runtime) if plan.rope_prepass else b


def offsets(qo_lens: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
    """rope.cu's position offsets of the plan's upload: q's requests (kv_len - qo_len: bottom-right), then
    K's (0), int32 [2 batch]."""
    return np.concatenate([kv_lens - qo_lens, np.zeros(len(kv_lens), np.int64)]).astype(np.int32)


class RopeAhead:
    """A ragged wrapper's rotated q and K: ``plan(p)`` at every GPU plan sizes the buffer (so run()
    allocates nothing), ``rotate`` in run() fills it before the attention launch."""

    def __init__(self):
        self.active = False
        self._buf = None            # uint16 CuPy array: q's rows, then K's, rotated (16-byte aligned)

    def plan(self, p) -> None:
        self.active = bool(p.rope_prepass) and p.device is not None
        if not self.active:
            return
        self._q_elems = -(-int(p.qo_indptr[-1]) * p.num_qo_heads * p.head_dim // 8) * 8
        need = max(self._q_elems + int(p.kv_indptr[-1]) * p.num_kv_heads * p.head_dim, 8)
        if self._buf is None or self._buf.size < need or self._buf.device.id != p.device:
            cp = arrays.cupy_module()
            self._buf = None        # (freed before the new one is allocated)
            with cp.cuda.Device(p.device):
                self._buf = cp.empty(need, np.uint16)

    def rotate(self, ctx, plan, q: arrays.Tensor, k: arrays.Tensor, tok: int, head: int):
        """q (the kernel's: tokens, heads, head_dim) and the plan's keys of ``k`` (token and head dimensions
        ``tok``, ``head``) rotated into the buffer on the run's stream; returns (q, k) there, contiguous."""
        dt, fixed = plan.kv_dtype, plan.bound.fixed     # 16-bit K (RoPE refuses others); q: its type or its copy
        freq, rot, batch = tuple(fixed[n] for n in variants.ROPE_FREQ), fixed["rotary_dim"], plan.batch
        meta, base = plan.meta, self._buf.data.ptr
        rows = ((q, q.strides, int(plan.qo_indptr[-1]), plan.num_qo_heads, meta["qo_indptr"], meta["rope_offsets"],
                 base),
                (k, (k.strides[tok], k.strides[head], 1), int(plan.kv_indptr[-1]), plan.num_kv_heads, meta["kv_indptr"],
                 meta["rope_offsets"] + 4 * batch, base + 2 * self._q_elems))
        out = []
        for x, strides, n, heads, indptr, offs, dst in rows:
            shape = (n, heads, plan.head_dim)
            rope.rotate_rows(ctx, arrays.Tensor(x.ptr, shape, strides, dt, x.device, x.framework, x.obj), dst,
                             indptr, offs, batch, rot, freq)
            out.append(arrays.Tensor(dst, shape, (heads * plan.head_dim, plan.head_dim, 1), x.dtype, x.device,
                                     "cupy", self._buf))
        return out[0], out[1]
