"""Independent float64 attention for tests; written apart from cuattn/reference.py on purpose."""
import math

import numpy as np


def dense_attention(q, k, v, sm_scale=None, causal=False, mask=None):
    """q [qo, Hq, D], k/v [kv, Hkv, D] -> (out float64 [qo, Hq, D], lse float64 [qo, Hq], base e).

    Loops over heads and rows; causal is bottom-right aligned; a fully masked row gives 0, -inf.
    A head's [qo, kv] logits go into one buffer reused for every head and are turned into weights in
    place: the same operations in the same order as with a new array per step (bitwise the same result),
    without the page faults of a fresh 40 MB array per step, which were most of this oracle's time on the
    largest GPU test cases (1024 x 4932, 32 heads).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    qo, hq, d = q.shape
    kv, hkv, dv = v.shape
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros((qo, hq, dv))
    lse = np.full((qo, hq), -np.inf)
    allowed = np.ones((qo, kv), bool)
    if causal:
        allowed &= np.arange(kv)[None, :] - (kv - qo) <= np.arange(qo)[:, None]
    if mask is not None:
        allowed &= mask
    any_key = allowed.any(axis=1)
    masked = None if allowed.all() else ~allowed
    rows = None if any_key.all() else any_key      # the rows with a key (None: all of them)
    s = np.empty((qo, kv))
    for h in range(hq):                          # rows vectorized per head (float64 throughout)
        kh = h // (hq // hkv)
        np.matmul(q[:, h, :], k[:, kh, :].T, out=s)
        s *= scale
        if masked is not None:
            np.copyto(s, -np.inf, where=masked)
        mx = np.where(any_key, s.max(axis=1, initial=-np.inf), 0.0)
        s -= mx[:, None]
        w = np.exp(s, out=s)                     # 0 where not allowed
        tot = w.sum(axis=1)
        if rows is None:
            out[:, h] = (w @ v[:, kh, :]) / tot[:, None]
            lse[:, h] = mx + np.log(tot)
        else:
            out[rows, h] = (w @ v[:, kh, :])[rows] / tot[rows, None]
            lse[rows, h] = mx[rows] + np.log(tot[rows])
    return out, lse


def rel_err(x, ref):
    """||x - ref|| / ||ref|| over finite entries; infinities must match exactly."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    inf = ~np.isfinite(ref)
    assert np.array_equal(np.isinf(x) & inf, inf), "infinite entries differ"
    assert np.all(np.isfinite(x[~inf])), "result has NaN/inf where the reference is finite"
    return np.linalg.norm(x[~inf] - ref[~inf]) / max(np.linalg.norm(ref[~inf]), 1e-30)


def alibi_slopes(n):
    """ALiBi slopes as the ALiBi authors' reference code builds them (closest power of two, then
    every other slope of twice that many heads), float64."""
    def power_of_2(m):
        start = 2.0 ** (-(2.0 ** -(math.log2(m) - 3)))
        return [start * start ** i for i in range(m)]
    if math.log2(n).is_integer():
        return np.array(power_of_2(n))
    p = 2 ** math.floor(math.log2(n))
    return np.array(power_of_2(p) + power_of_2(2 * p)[0::2][:n - p])


def variant_attention(q, k, v, sm_scale=None, causal=False, soft_cap=None, window_left=-1, alibi=False,
                      sinks=None, sigmoid_bias=None):
    """float64 attention with FlashInfer's variant options, one (head, row) at a time.

    Logit = q.k * sm_scale (+ ALiBi slope * (key pos - query pos), query pos bottom-right aligned),
    then soft-cap cap * tanh(x / cap); window: keys >= query pos - window_left; sinks[h]: a key of
    logit sinks[h] and value 0; sigmoid_bias: out = sum sigmoid(logit + b) v (no softmax).
    Returns (out [qo, Hq, D], lse [qo, Hq] base e).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    qo, hq, d = q.shape
    kv, hkv, dv = v.shape
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    slopes = alibi_slopes(hq) if alibi else np.zeros(hq)
    out = np.zeros((qo, hq, dv))
    lse = np.full((qo, hq), -np.inf)
    j = np.arange(kv)
    for h in range(hq):
        kh = h // (hq // hkv)
        for i in range(qo):
            pos = i + kv - qo
            keep = np.ones(kv, bool)
            if causal:
                keep &= j <= pos
            if window_left >= 0:
                keep &= j >= pos - window_left
            x = (k[keep, kh] @ q[i, h]) * scale + slopes[h] * (j[keep] - pos)
            if soft_cap:
                x = soft_cap * np.tanh(x / soft_cap)
            vals = v[keep, kh]
            if sigmoid_bias is not None:
                out[i, h] = (1.0 / (1.0 + np.exp(-(x + sigmoid_bias)))) @ vals
                lse[i, h] = 0.0
                continue
            if sinks is not None:
                x = np.append(x, float(sinks[h]))
                vals = np.vstack([vals, np.zeros(dv)])
            if x.size == 0:
                continue
            mx = x.max()
            w = np.exp(x - mx)
            out[i, h] = w @ vals / w.sum()
            lse[i, h] = mx + math.log(w.sum())
    return out, lse
