import ml_dtypes
import numpy as np
import pytest

from cuattn import cascade, jit
from tests.oracle import dense_attention, rel_err

BF16 = np.dtype(ml_dtypes.bfloat16)


def partial_states(seq_len, heads, head_dim, cuts, seed=0, dtype=np.float32):
    """Full attention and the states of the key ranges between `cuts` (float64 oracle)."""
    rng = np.random.default_rng(seed)
    kv = cuts[-1]
    q = rng.standard_normal((seq_len, heads, head_dim))
    k = rng.standard_normal((kv, heads, head_dim))
    v = rng.standard_normal((kv, heads, head_dim))
    full = dense_attention(q, k, v)
    parts = [dense_attention(q, k[a:b], v[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    vs = [p[0].astype(dtype) for p in parts]
    ss = [p[1].astype(np.float32) for p in parts]
    return full, vs, ss


def test_merge_state_of_two_key_ranges_equals_full_attention():
    full, (va, vb), (sa, sb) = partial_states(5, 3, 64, [0, 17, 40])
    v, s = cascade.merge_state(va, sa, vb, sb)
    assert v.dtype == np.float32 and s.shape == (5, 3)
    assert rel_err(v, full[0]) < 1e-5 and rel_err(s, full[1]) < 1e-5


def test_merge_states_with_an_empty_state_equals_full_attention():
    full, vs, ss = partial_states(4, 2, 32, [0, 5, 5, 30, 31], seed=1, dtype=np.float16)
    assert np.all(np.isinf(ss[1]))                      # the empty key range: LSE -inf
    v, s = cascade.merge_states(np.stack(vs, 1), np.stack(ss, 1))
    assert v.dtype == np.float16 and v.shape == (4, 2, 32)
    assert rel_err(v, full[0]) < 2e-3 and rel_err(s, full[1]) < 1e-5


def test_merge_state_rejects_mismatched_shapes_and_lse_dtype():
    _, (va, vb), (sa, sb) = partial_states(2, 2, 16, [0, 3, 6])
    with pytest.raises(ValueError, match="same shape"):
        cascade.merge_state(va, sa, vb[:1], sb)
    with pytest.raises(TypeError, match="float32"):
        cascade.merge_state(va, sa.astype(np.float64), vb, sb)


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_shipped_merge_kernels_compile_without_spills(arch):
    for spec in cascade.shipped_specs():
        for entry, r in jit.compile_kernel(spec, arch).resources.items():
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack_frame"] == 0, (spec.name, entry)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_merge_states_gpu_matches_full_attention(dtype):
    import cupy
    full, vs, ss = partial_states(7, 4, 128, [0, 30, 30, 95, 200], seed=2, dtype=dtype)
    raw = np.stack(vs, 1)
    dev = cupy.asarray(raw.view(np.uint16)) if dtype == BF16 else cupy.asarray(raw)
    v, s = cascade.merge_states(dev, cupy.asarray(np.stack(ss, 1)))
    v = cupy.asnumpy(v)
    v = v.view(BF16) if dtype == BF16 else v
    tol = 1e-5 if dtype == np.float32 else 1e-2
    assert rel_err(v, full[0]) < tol and rel_err(cupy.asnumpy(s), full[1]) < 1e-4
    # two states on the GPU against the NumPy path of the same call
    ref_v, ref_s = cascade.merge_state(vs[0], ss[0], vs[2], ss[2])
    dev_v = lambda x: cupy.asarray(x.view(np.uint16) if dtype == BF16 else x)  # noqa: E731
    v2, s2 = cascade.merge_state(dev_v(vs[0]), cupy.asarray(ss[0]), dev_v(vs[2]), cupy.asarray(ss[2]))
    v2 = cupy.asnumpy(v2)
    v2 = v2.view(BF16) if dtype == BF16 else v2
    assert rel_err(v2, ref_v.astype(np.float64)) < tol and rel_err(cupy.asnumpy(s2), ref_s) < 1e-5
