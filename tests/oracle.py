"""Independent float64 attention for tests; written apart from cuattn/reference.py on purpose."""
import math

import numpy as np


def dense_attention(q, k, v, sm_scale=None, causal=False, mask=None):
    """q [qo, Hq, D], k/v [kv, Hkv, D] -> (out float64 [qo, Hq, D], lse float64 [qo, Hq], base e).

    Loops over heads and rows; causal is bottom-right aligned; a fully masked row gives 0, -inf.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    qo, hq, d = q.shape
    kv, hkv, dv = v.shape
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros((qo, hq, dv))
    lse = np.full((qo, hq), -np.inf)
    for h in range(hq):
        kh = h // (hq // hkv)
        s = q[:, h, :] @ k[:, kh, :].T * scale
        allowed = np.ones((qo, kv), bool)
        if causal:
            allowed &= np.arange(kv)[None, :] - (kv - qo) <= np.arange(qo)[:, None]
        if mask is not None:
            allowed &= mask
        for i in range(qo):
            row = s[i][allowed[i]]
            if row.size == 0:
                continue
            mx = row.max()
            w = np.exp(s[i] - mx) * allowed[i]
            out[i, h] = w @ v[:, kh, :] / w.sum()
            lse[i, h] = mx + math.log(w.sum())
    return out, lse


def rel_err(x, ref):
    """||x - ref|| / ||ref|| over finite entries; infinities must match exactly."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    inf = ~np.isfinite(ref)
    assert np.array_equal(np.isinf(x) & inf, inf), "infinite entries differ"
    assert np.all(np.isfinite(x[~inf])), "result has NaN/inf where the reference is finite"
    return np.linalg.norm(x[~inf] - ref[~inf]) / max(np.linalg.norm(ref[~inf]), 1e-30)
