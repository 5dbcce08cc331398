"""tests/oracle.py's dense_attention (per head, logits in one reused buffer) against its per-row loop
variant_attention: two float64 forms of the same formula that every GPU prefill test leans on."""
import math

import numpy as np
import pytest

from .oracle import dense_attention, variant_attention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qo,kv,hq,hkv,d,dv", [(1, 40, 4, 4, 16, 16), (17, 17, 8, 2, 32, 32), (23, 61, 6, 2, 64, 32),
                                               (40, 9, 7, 1, 16, 16)])
def test_dense_attention_equals_the_row_loop(qo, kv, hq, hkv, d, dv, causal):
    rng = np.random.default_rng(qo * 1000 + kv)
    q = rng.standard_normal((qo, hq, d)).astype(np.float16)
    k = rng.standard_normal((kv, hkv, d)).astype(np.float16)
    v = rng.standard_normal((kv, hkv, dv)).astype(np.float16)
    for scale in (None, 0.3):
        a, sa = dense_attention(q, k, v, sm_scale=scale, causal=causal)
        b, sb = variant_attention(q, k, v, sm_scale=scale, causal=causal)
        np.testing.assert_array_equal(np.isinf(sa), np.isinf(sb))     # causal with qo > kv: rows with no key
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(sa[np.isfinite(sa)], sb[np.isfinite(sb)], rtol=1e-12)


def test_dense_attention_mask_and_fully_masked_rows():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((5, 4, 8)), rng.standard_normal((11, 2, 8)), rng.standard_normal((11, 2, 8))
    mask = rng.random((5, 11)) < 0.5
    mask[2] = False
    out, lse = dense_attention(q, k, v, causal=True, mask=mask)
    assert np.all(out[2] == 0) and np.all(lse[2] == -np.inf)
    for i in (0, 1, 3, 4):
        keys = mask[i] & (np.arange(11) <= i + 6)
        if not keys.any():
            assert np.all(lse[i] == -np.inf)
            continue
        for h in range(4):
            x = k[keys, h // 2] @ q[i, h] / math.sqrt(8)
            w = np.exp(x - x.max())
            np.testing.assert_allclose(out[i, h], w @ v[keys, h // 2] / w.sum(), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(lse[i, h], x.max() + math.log(w.sum()), rtol=1e-12)
