"""NumPy implementations of every op: the CPU path behind NumPy inputs.

Storage dtypes (fp16, bf16 via ml_dtypes, fp8) are read into float32; softmax and accumulation
run in float32. The log-sum-exp (LSE) is in natural-log units (base e) throughout cuattn:
``lse = log(sum_j exp(s_j))`` with ``s_j = sm_scale * q . k_j``.
"""
from __future__ import annotations

import numpy as np


def split_paged_kv_cache(paged_kv_cache, kv_layout: str) -> tuple[np.ndarray, np.ndarray]:
    """(k_pages, v_pages) as NHD views, each [num_pages, page_size, num_kv_heads, head_dim]."""
    if isinstance(paged_kv_cache, (tuple, list)):
        k, v = paged_kv_cache
    else:
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if kv_layout == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return k, v


def gather_paged_kv(k_pages, v_pages, kv_indices, kv_indptr, kv_last_page_len, request: int):
    """One request's contiguous K and V, each [kv_len, num_kv_heads, head_dim], from NHD pages."""
    pages = kv_indices[kv_indptr[request]:kv_indptr[request + 1]]
    if len(pages) == 0:
        shape = (0,) + k_pages.shape[2:]
        return np.empty(shape, k_pages.dtype), np.empty(shape, v_pages.dtype)
    page_size = k_pages.shape[1]
    kv_len = (len(pages) - 1) * page_size + int(kv_last_page_len[request])
    k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:kv_len]
    v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:kv_len]
    return k, v


def attention(q, k, v, *, sm_scale: float, causal: bool = False, mask=None, variant=None, values=None,
              batch_idx: int = 0, fn: str = "attention"):
    """Attention of q [qo_len, num_qo_heads, head_dim] over k, v [kv_len, num_kv_heads, head_dim].

    Query heads are grouped onto kv heads (GQA): head h reads kv head h // (num_qo_heads //
    num_kv_heads). ``causal`` aligns the queries with the last qo_len keys (bottom-right);
    ``mask`` [qo_len, kv_len] bool keeps True entries. ``variant`` (a variants.Composite) with its
    parameter ``values`` runs the NumPy versions of its hooks (request ``batch_idx``). A fully
    masked row gives out 0 and LSE -inf. Returns (out float32 [qo_len, num_qo_heads, head_dim],
    lse float32 [qo_len, num_qo_heads]); without softmax (variant.use_softmax False) the LSE is 0.
    """
    qo_len, num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads, head_dim_v = v.shape
    group = num_qo_heads // num_kv_heads
    if variant is not None and variant.has_rope:   # fused RoPE: q at its position, each key at its own
        rotate = variant.numpy_qk_transform()
        offset = values.get("q_rope_offset")
        q = rotate(values, q, np.arange(qo_len) + (kv_len - qo_len if offset is None else int(offset[batch_idx])))
        k = rotate(values, k, np.arange(kv_len))
    if variant is not None and (variant.has("query_transform") or variant.has("key_transform")):
        q, k = _pair_transforms(variant, values, q, k, batch_idx, fn)
    # [num_kv_heads, group * qo_len, head_dim] @ [num_kv_heads, head_dim, kv_len]: one BLAS batch;
    # qo head h = kv head * group + g, so the result reshapes to [num_qo_heads, qo_len, kv_len]
    qf = np.ascontiguousarray(q.astype(np.float32).transpose(1, 0, 2)).reshape(num_kv_heads, group * qo_len, head_dim)
    kf = k.astype(np.float32).transpose(1, 2, 0)
    vf = v.astype(np.float32).transpose(1, 0, 2)                                  # [num_kv_heads, kv_len, d]
    logits = np.matmul(qf, kf).reshape(num_qo_heads, qo_len, kv_len)
    logits *= np.float32(sm_scale)
    keep = np.ones((1, qo_len, kv_len), bool)
    if causal:
        keep &= np.arange(kv_len)[None, :] <= np.arange(qo_len)[:, None] + (kv_len - qo_len)
    if mask is not None:
        keep &= np.asarray(mask, bool).reshape(qo_len, kv_len)
    sink = None
    softmax = True
    if variant is not None and not variant.is_default:
        from .variants import numpy_positions
        pos = numpy_positions(batch_idx, qo_len, kv_len, num_qo_heads, num_kv_heads)
        for _, f in variant.numpy_hook("logits_transform", fn):
            logits = np.asarray(f(values, pos, logits), np.float32)
        for _, f in variant.numpy_hook("logits_mask", fn):
            keep = keep & np.asarray(f(values, pos), bool)
        for _, f in variant.numpy_hook("kv_begin", fn):
            keep = keep & (pos.kv_idx >= np.asarray(f(values, pos)))
        for _, f in variant.numpy_hook("sink", fn):
            sink = np.broadcast_to(np.asarray(f(values, pos), np.float32), (num_qo_heads, qo_len, 1))
        softmax = variant.use_softmax

    def weighted_sum(w):      # [num_qo_heads, qo_len, kv_len] weights @ V -> [qo_len, num_qo_heads, d]
        o = np.matmul(w.reshape(num_kv_heads, group * qo_len, kv_len), vf)
        return o.reshape(num_qo_heads, qo_len, head_dim_v).transpose(1, 0, 2)

    drop = ~keep
    if not softmax:
        np.copyto(logits, np.float32(0), where=drop)
        return np.ascontiguousarray(weighted_sum(logits), np.float32), np.zeros((qo_len, num_qo_heads), np.float32)
    np.copyto(logits, np.float32(-np.inf), where=drop)
    m = logits.max(axis=-1, keepdims=True) if kv_len else np.full(logits.shape[:-1] + (1,), -np.inf, np.float32)
    if sink is not None:
        m = np.maximum(m, sink)
    m_safe = np.where(np.isfinite(m), m, 0).astype(np.float32)
    logits -= m_safe
    p = np.exp(logits, out=logits)
    denom = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + np.exp(sink - m_safe)
    out = weighted_sum(p) / np.where(denom > 0, denom, 1).transpose(1, 0, 2)
    with np.errstate(divide="ignore"):
        lse = (np.log(denom) + m_safe)[..., 0]           # -inf where the row is fully masked
    return np.ascontiguousarray(out, np.float32), np.ascontiguousarray(lse.T, np.float32)


def _pair_transforms(variant, values, q, k, batch_idx: int, fn: str):
    """q and k through the variant's NumPy query / key transforms: pairs (j, j + head_dim / 2), the
    query at its bottom-right position, each key at its index (float32 out)."""
    from types import SimpleNamespace
    qo_len, kv_len, half = q.shape[0], k.shape[0], q.shape[-1] // 2
    pair = np.arange(half, dtype=np.int64)[None, None, :]
    sides = (("query_transform", q, dict(qo_pos=np.arange(qo_len, dtype=np.int64)[:, None, None] + (kv_len - qo_len),
                                         qo_head_idx=np.arange(q.shape[1], dtype=np.int64)[None, :, None])),
             ("key_transform", k, dict(kv_idx=np.arange(kv_len, dtype=np.int64)[:, None, None],
                                       kv_head_idx=np.arange(k.shape[1], dtype=np.int64)[None, :, None])))
    out = []
    for hook, x, where in sides:
        pos = SimpleNamespace(batch_idx=np.int64(batch_idx), pair=pair, **where)
        for _, f in variant.numpy_hook(hook, fn):
            x = x.astype(np.float32)
            a, b = f(values, pos, x[..., :half], x[..., half:])
            x = np.concatenate([np.broadcast_to(a, x[..., :half].shape), np.broadcast_to(b, x[..., half:].shape)],
                               axis=-1).astype(np.float32)
        out.append(x)
    return out[0], out[1]


def merge_state(v_a, s_a, v_b, s_b):
    """Merge two partial attention states (out, LSE in base e) over disjoint key sets."""
    s_max = np.maximum(s_a, s_b)
    s_max = np.where(np.isfinite(s_max), s_max, 0)
    w_a, w_b = np.exp(s_a - s_max), np.exp(s_b - s_max)
    total = w_a + w_b
    safe = np.where(total > 0, total, 1)
    v = (v_a.astype(np.float32) * (w_a / safe)[..., None] + v_b.astype(np.float32) * (w_b / safe)[..., None])
    with np.errstate(divide="ignore"):
        s = np.log(total) + s_max
    return v.astype(np.float32), s.astype(np.float32)


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int):
    """Request index and KV position of each appended token (FlashInfer semantics)."""
    append_indptr = np.asarray(append_indptr, np.int64)
    seq_lens = np.asarray(seq_lens, np.int64)
    append_lens = np.diff(append_indptr)
    batch_indices = np.repeat(np.arange(len(append_lens)), append_lens)
    offsets = np.arange(append_indptr[-1]) - np.repeat(append_indptr[:-1], append_lens)
    positions = np.repeat(seq_lens - append_lens, append_lens) + offsets
    out_b = np.zeros(nnz, np.int32)
    out_p = np.zeros(nnz, np.int32)
    n = min(nnz, len(batch_indices))
    out_b[:n], out_p[:n] = batch_indices[:n], positions[:n]
    return out_b, out_p


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, k_pages, v_pages,
                          kv_indices, kv_indptr):
    """Write each token's K/V rows into its page slot; k_pages/v_pages are NHD views (written)."""
    page_size = k_pages.shape[1]
    batch_indices = np.asarray(batch_indices, np.int64)
    positions = np.asarray(positions, np.int64)
    pages = np.asarray(kv_indices)[np.asarray(kv_indptr)[batch_indices] + positions // page_size]
    slots = positions % page_size
    k_pages[pages, slots] = append_key
    v_pages[pages, slots] = append_value
