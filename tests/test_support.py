"""The support table (cuattn/support.py): the README shows it as it is, and empty inputs give correctly
shaped results on both paths."""
import re
from pathlib import Path

import numpy as np
import pytest

import cuattn
from cuattn import support

H, D = 4, 64


def test_readme_support_matrix_is_the_support_table():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"<!-- support-table:.*?-->\n(.*?)\n<!-- /support-table -->", readme, re.S)
    assert block is not None, "README has no generated support table"
    assert block.group(1) == support.markdown()


def _empty_calls(xp):
    """(name, call) pairs of every op on an empty batch or an empty KV, arrays from ``xp``."""
    z = lambda *s: xp.asarray(np.zeros(s, np.float16))            # noqa: E731
    o = lambda *s: xp.asarray(np.ones(s, np.float16))             # noqa: E731
    cache = o(3, 2, 16, H, D)

    def decode_empty():
        w = cuattn.BatchDecodeWithPagedKVCacheWrapper()
        w.plan(np.array([0], np.int32), np.array([], np.int32), np.array([], np.int32), H, H, D, 16)
        return w.run(z(0, H, D), cache, return_lse=True)

    def prefill_paged_empty():
        w = cuattn.BatchPrefillWithPagedKVCacheWrapper()
        w.plan(np.array([0], np.int32), np.array([0], np.int32), np.array([], np.int32), np.array([], np.int32),
               H, H, D, 16)
        return w.run(z(0, H, D), cache, return_lse=True)

    def ragged_empty_kv():
        w = cuattn.BatchPrefillWithRaggedKVCacheWrapper()
        w.plan(np.array([0, 2], np.int32), np.array([0, 0], np.int32), H, H, D)
        return w.run(o(2, H, D), z(0, H, D), z(0, H, D), return_lse=True)

    return [
        ("decode batch 0", decode_empty, (0, H, D)),
        ("paged prefill batch 0", prefill_paged_empty, (0, H, D)),
        ("ragged prefill, a request with no keys", ragged_empty_kv, (2, H, D)),
        ("single_prefill qo 0", lambda: cuattn.single_prefill_with_kv_cache(z(0, H, D), o(5, H, D), o(5, H, D),
                                                                             return_lse=True), (0, H, D)),
        ("single_prefill kv 0", lambda: cuattn.single_prefill_with_kv_cache(o(3, H, D), z(0, H, D), z(0, H, D),
                                                                             return_lse=True), (3, H, D)),
        ("single_decode kv 0", lambda: cuattn.single_decode_with_kv_cache(o(H, D), z(0, H, D), z(0, H, D),
                                                                           return_lse=True), (H, D)),
        ("merge_state 0 rows", lambda: cuattn.merge_state(z(0, H, D), xp.asarray(np.zeros((0, H), np.float32)),
                                                          z(0, H, D), xp.asarray(np.zeros((0, H), np.float32))),
         (0, H, D)),
    ]


def _check_empty(out, lse, shape, to_host):
    """Shapes as asked; every output row 0 and every LSE -inf (rows with no key; none when empty)."""
    out, lse = to_host(out), to_host(lse)
    assert out.shape == shape and lse.shape == shape[:-1]
    assert np.all(out.astype(np.float32) == 0)
    assert np.all(np.isneginf(lse))


@pytest.mark.parametrize("i", range(7))
def test_empty_inputs_give_shaped_results_on_cpu(i):
    name, call, shape = _empty_calls(np)[i]
    out, lse = call()
    _check_empty(out, lse, shape, np.asarray)


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(7))
def test_empty_inputs_give_shaped_results_on_gpu(i):
    import cupy as cp
    name, call, shape = _empty_calls(cp)[i]
    out, lse = call()
    _check_empty(out, lse, shape, cp.asnumpy)
    cp.cuda.Device().synchronize()
