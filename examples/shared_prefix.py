"""Shared-prefix (cascade) attention from the pieces: attend to a common prefix once with prefill,
to each request's own suffix with paged decode, and merge the two partial states by their LSE.

Runs on NumPy (the CPU path); pass --gpu to run the same code on CuPy arrays.
"""
import sys

import numpy as np

import cuattn

xp = __import__("cupy") if "--gpu" in sys.argv else np
to_host = xp.asnumpy if xp is not np else np.asarray
rng = np.random.default_rng(0)
batch, q_heads, kv_heads, head_dim, page_size = 4, 8, 2, 64, 16
prefix_len, suffix_lens = 300, [17, 40, 5, 64]


def rand(*shape):
    return rng.standard_normal(shape).astype(np.float16)


q = rand(batch, q_heads, head_dim)                       # one decode token per request
prefix_k, prefix_v = rand(prefix_len, kv_heads, head_dim), rand(prefix_len, kv_heads, head_dim)

# -- 1. every request's query against the shared prefix: one prefill call, the requests' queries as rows
out_prefix, lse_prefix = cuattn.single_prefill_with_kv_cache(
    xp.asarray(q), xp.asarray(prefix_k), xp.asarray(prefix_v), return_lse=True)

# -- 2. each request against its own suffix, stored in a paged cache
pages = [-(-n // page_size) for n in suffix_lens]
kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
kv_indices = rng.permutation(sum(pages)).astype(np.int32)
kv_last_page_len = np.array([(n - 1) % page_size + 1 for n in suffix_lens], np.int32)
cache = rand(sum(pages), 2, page_size, kv_heads, head_dim)
decode = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
decode.plan(kv_indptr, kv_indices, kv_last_page_len, q_heads, kv_heads, head_dim, page_size,
            q_data_type="float16")
out_suffix, lse_suffix = decode.run(xp.asarray(q), xp.asarray(cache), return_lse=True)

# -- 3. merge: exact attention over prefix + suffix
out, lse = cuattn.merge_state(out_prefix, lse_prefix, out_suffix, lse_suffix)

# -- check every request against attention over the concatenated KV, in float64
worst = 0.0
for b in range(batch):
    rows = np.concatenate([np.arange(p * page_size, (p + 1) * page_size)
                           for p in kv_indices[kv_indptr[b]:kv_indptr[b + 1]]])[:suffix_lens[b]]
    k = np.concatenate([prefix_k, cache[:, 0].reshape(-1, kv_heads, head_dim)[rows]]).astype(np.float64)
    v = np.concatenate([prefix_v, cache[:, 1].reshape(-1, kv_heads, head_dim)[rows]]).astype(np.float64)
    for h in range(q_heads):
        s = k[:, h // (q_heads // kv_heads)] @ q[b, h].astype(np.float64) / np.sqrt(head_dim)
        p = np.exp(s - s.max())
        ref = p @ v[:, h // (q_heads // kv_heads)] / p.sum()
        worst = max(worst, float(np.abs(to_host(out)[b, h].astype(np.float64) - ref).max()))
print(f"shared prefix {prefix_len} + suffixes {suffix_lens}: max |merged - float64 reference| = {worst:.1e}")
assert worst < 1e-2
