"""packbits / segment_packbits: little bit order, per-segment byte alignment."""
import numpy as np
import pytest

import cuattn


def test_packbits_is_little_bit_order():
    x = np.zeros(10, bool)
    x[[0, 3, 9]] = True
    np.testing.assert_array_equal(cuattn.packbits(x), np.array([0b00001001, 0b00000010], np.uint8))


def test_segment_packbits_starts_each_segment_on_a_byte():
    rng = np.random.default_rng(0)
    lens = [5, 0, 17, 8]
    x = rng.random(sum(lens)) < 0.5
    indptr = np.concatenate([[0], np.cumsum(lens)])
    packed, new_indptr = cuattn.segment_packbits(x, indptr)
    np.testing.assert_array_equal(new_indptr, [0, 1, 1, 4, 5])
    for i in range(len(lens)):
        seg = packed[new_indptr[i]:new_indptr[i + 1]]
        np.testing.assert_array_equal(np.unpackbits(seg, bitorder="little")[:lens[i]], x[indptr[i]:indptr[i + 1]])


def test_packbits_rejects_big_bit_order():
    with pytest.raises(ValueError, match="bitorder must be 'little'"):
        cuattn.packbits(np.ones(3, bool), bitorder="big")


def test_segment_packbits_rejects_bad_indptr():
    with pytest.raises(ValueError, match="indptr"):
        cuattn.segment_packbits(np.ones(5, bool), np.array([0, 3, 4]))


@pytest.mark.gpu
def test_segment_packbits_gpu_equals_numpy():
    import cupy as cp
    rng = np.random.default_rng(1)
    lens = [13, 1, 64, 7]
    x = rng.random(sum(lens)) < 0.5
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    a, ai = cuattn.segment_packbits(x, indptr)
    b, bi = cuattn.segment_packbits(cp.asarray(x), cp.asarray(indptr))
    np.testing.assert_array_equal(a, cp.asnumpy(b))
    np.testing.assert_array_equal(ai, cp.asnumpy(bi))
    np.testing.assert_array_equal(cuattn.packbits(x), cp.asnumpy(cuattn.packbits(cp.asarray(x))))
