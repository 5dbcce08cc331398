"""Run by tests/test_rope.py under compute-sanitizer memcheck (not a test itself): the cos_sin_cache RoPE forms on
the cache entries (cuattn_rope_cache_neox / _gptj: in place, and returning with rotary_dim == head_dim) and on the
general entry (a tail to copy, 2-byte accesses), small token counts, views of a packed qkv row, positions outside the
cache, with CuPy's memory pool off so every array is its own allocation (the pool would hide out-of-bounds accesses
inside its blocks). Exits 0 when every finite input gives a finite output; memcheck's own report decides the test."""

import numpy as np

import cupy as cp

import cuattn

cp.cuda.set_allocator(None)
rng = np.random.default_rng(21)
HQ, HK, D = 5, 3, 128


def cache(rows: int, rot: int) -> cp.ndarray:
    f = 1e4 ** (-np.arange(rot // 2) / (rot // 2))
    ang = np.arange(rows)[:, None] * f
    return cp.asarray(np.concatenate([np.cos(ang), np.sin(ang)], 1).astype(np.float32))


def finite(*xs) -> bool:                 # on the host: no CuPy kernel (each would compile under memcheck)
    return all(np.isfinite(cp.asnumpy(x).astype(np.float32)).all() for x in xs)


for nnz in (1, 33):
    for rot in (128, 64):
        for neox in (True, False):
            cs = cache(64, rot)
            pos_host = rng.integers(0, 64, nnz)
            pos = cp.asarray(pos_host)
            packed = cp.asarray(rng.standard_normal((nnz, (HQ + 2 * HK) * D)).astype(np.float16))
            q, k = packed[:, :HQ * D], packed[:, HQ * D:(HQ + HK) * D]           # views of one row
            qo, ko = cuattn.apply_rope_with_cos_sin_cache(pos, q, k, D, cs, is_neox=neox)
            cuattn.apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, cs, is_neox=neox)
            assert finite(qo, ko, packed)
            odd = cp.asarray(rng.standard_normal((nnz, HQ * D + 1)).astype(np.float16))[:, 1:]   # 2-byte aligned
            cuattn.apply_rope_with_cos_sin_cache_inplace(pos, odd, k, D, cs, is_neox=neox)
            bad = pos_host.copy()
            bad[0] = 1 << 40                                                       # outside the cache: NaN rows
            qb, _ = cuattn.apply_rope_with_cos_sin_cache(cp.asarray(bad), q, k, D, cs, is_neox=neox)
            assert np.isnan(cp.asnumpy(qb)[0, :rot].astype(np.float32)).all()
cp.cuda.Device().synchronize()
print("sanitize_rope: done")
