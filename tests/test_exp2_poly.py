"""softmax.cuh's exp2_poly (2^x on the FMA pipe for part of the softmax's exp2, the spec field
``exp2_poly``), emulated in float32 NumPy with the coefficients read from the header: its error over the
softmax's range, exact zeros where the softmax needs them, and what it does to an attention output
against the ex2.approx path; plus which specs get it. GPU: tests/test_variants.py
(test_softcap_exp2_poly_matches_oracle_on_gpu)."""
import re

import numpy as np
import pytest

from cuattn import jit, prefill_sm90, prefill_spec, variants

F32 = np.float32
SOURCE = (jit.KERNELS_DIR / "common" / "softmax.cuh").read_text()
# max relative error over [-126, 0] per degree (float32 emulation: 1.01e-4, 2.89e-6, 1.72e-7)
BOUND = {3: 1.1e-4, 4: 3.0e-6, 5: 2.0e-7}


def _coefficients(degree: int) -> list:
    """c_degree .. c_1 of the header's polynomial (c_0 = 1), as the Horner FMAs use them."""
    block = re.search(rf"#(?:el)?if EXP2_POLY_DEGREE == {degree}\n(.*?)\n#el", SOURCE, re.S).group(1)
    return [F32(c) for c in re.findall(r"(\d+\.\d+(?:e-?\d+)?)f", block)]


def _fma(a, b, c):
    # a * b is exact in float64; the sum rounds to float64 then float32 (a double rounding that is
    # one in ~2^29 away from the hardware's single one: immaterial at these bounds)
    return (a.astype(np.float64) * b.astype(np.float64) + np.asarray(c, np.float64)).astype(F32)


def exp2_poly(x: np.ndarray, degree: int) -> np.ndarray:
    """softmax.cuh's exp2_poly, operation by operation in float32."""
    x = np.fmax(x.astype(F32), F32(-127))      # fmaxf: NaN gives the other operand
    t = x + F32(12582912)
    f = x - (t - F32(12582912))
    p = np.full_like(f, 0)
    for i, c in enumerate(_coefficients(degree) + [F32(1)]):
        p = np.full_like(f, c) if i == 0 else _fma(p, f, c)
    bits = (p.view(np.int32).astype(np.int64) + (t.view(np.int32).astype(np.int64) << 23)) & 0xFFFFFFFF
    return bits.astype(np.uint32).view(F32)


def exp2_sfu(x: np.ndarray) -> np.ndarray:
    """ex2.approx.ftz as a model: 2^x rounded to float32, results below 2^-126 flushed to 0."""
    y = np.exp2(x.astype(np.float64))
    return np.where(y < 2.0 ** -126, 0.0, y).astype(F32)


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_exp2_poly_error_over_the_softmax_range(degree):
    rng = np.random.default_rng(degree)
    x = np.concatenate([np.linspace(-126, 0, 4_000_001).astype(F32), -rng.random(2_000_000, dtype=F32) * 126,
                        -rng.random(1_000_000, dtype=F32)])
    ref = np.exp2(x.astype(np.float64))
    rel = np.abs(exp2_poly(x, degree) - ref) / ref
    assert rel.max() < BOUND[degree], rel.max()
    # (-127, -126): below 2^-126 and not negative (ex2.approx flushes to 0 there); x <= -127, -inf and NaN: +0
    low = exp2_poly(np.linspace(-127, -126, 10001, dtype=F32)[1:-1], degree)
    assert np.all(low >= 0) and np.all(low < 2.0 ** -126)
    zero = exp2_poly(np.array([-np.inf, -1e30, -200, -127.5, -127, np.nan], F32), degree)
    assert np.array_equal(zero.view(np.uint32), np.zeros(6, np.uint32))
    assert exp2_poly(np.array([0], F32), degree)[0] == 1


@pytest.mark.parametrize("degree", [3, 5])
def test_exp2_poly_leaves_attention_output_error_unchanged(degree):
    # the kernels' softmax of soft-capped logits: p = exp2(s log2 e - m) in float32, the row sum l in
    # float32, p rounded to fp16 for P V, the output rounded to fp16; every exp2 by the polynomial
    # against every exp2 by ex2.approx, both against float64
    rng = np.random.default_rng(7)
    rows, keys, d = 64, 2048, 128
    v = rng.standard_normal((keys, d)).astype(np.float16)
    for spread in (1.0, 4.0):
        logits = (30 * np.tanh(rng.standard_normal((rows, keys)) * spread / 30)).astype(F32)
        ref = np.exp(logits - logits.max(1, keepdims=True).astype(np.float64))
        ref = (ref / ref.sum(1, keepdims=True)) @ v.astype(np.float64)
        errs = []
        for exp2 in (exp2_sfu, lambda x: exp2_poly(x, degree)):
            m = logits.max(1, keepdims=True) * F32(np.log2(np.e))
            p = exp2(_fma(logits, np.full_like(logits, F32(np.log2(np.e))), -m))
            o = (p.astype(np.float16).astype(np.float64) @ v.astype(np.float64)) / p.sum(1, dtype=F32)[:, None]
            errs.append(np.linalg.norm(o.astype(np.float16) - ref) / np.linalg.norm(ref))
        assert errs[1] < 1.02 * errs[0] + 1e-6, errs      # (fp16 rounding: ~3e-4 both)


def test_exp2_poly_only_for_transforms_on_the_special_function_unit():
    user_cap = variants.Variant("ucap", params=(("cap", "float"),),
                                logits_transform="return params.cap * fast_tanh(logits * (1.f / params.cap));")
    sfu = [variants.resolve("f", num_qo_heads=8, logits_soft_cap=30.0).composite, variants.Composite((user_cap,)),
           variants.resolve("f", num_qo_heads=8, logits_soft_cap=30.0, pos_encoding_mode="ALIBI", window_left=9,
                            custom_mask=True).composite]
    other = [variants.DEFAULT, variants.resolve("f", num_qo_heads=8, pos_encoding_mode="ALIBI").composite,
             variants.resolve("f", num_qo_heads=8, custom_mask=True, window_left=3).composite,
             variants.Composite((variants.Variant("sig", use_softmax=False, logits_transform="return fast_sigmoid(logits);"),))]
    for comp in sfu + other:
        want = comp in sfu
        assert comp.sfu_transform == want
        for spec, n in ((prefill_sm90.make_spec("f16", True, comp), prefill_sm90.EXP2_POLY),
                        (prefill_spec.make_spec(128, "f16", True, False, False, comp), prefill_spec.EXP2_POLY)):
            assert spec.exp2_poly == (n if want else 0)
            assert ("-DEXP2_POLY=" in " ".join(spec.defines())) == bool(want and n)
            assert ("_ep" in spec.name) == bool(want and n)
