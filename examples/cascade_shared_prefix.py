"""Shared-prefix decode with MultiLevelCascadeAttentionWrapper: a system prompt every request shares,
a prefix per user, and each request's own tokens, in one paged cache; the wrapper attends to each
level once for all the queries that share it and merges the levels exactly.

Runs on NumPy (the CPU path); pass --gpu to run the same code on CuPy arrays with the CUDA kernels.
The answer is checked against plain batch decode over the same tokens.
"""
import sys

import numpy as np

import cuattn

xp = __import__("cupy") if "--gpu" in sys.argv else np
to_host = xp.asnumpy if xp is not np else np.asarray
rng = np.random.default_rng(0)
q_heads, kv_heads, head_dim, page_size = 8, 2, 64, 16
system_len, user_len, users, per_user = 64, 48, 2, 3          # 2 users x 3 requests each
own_lens = [5, 17, 1, 30, 9, 16]
batch = users * per_user

next_page = 0


def pages_for(n):
    """Fresh pages for n tokens: (page ids, last page length)."""
    global next_page
    count = -(-n // page_size)
    ids = np.arange(next_page, next_page + count, dtype=np.int32)
    next_page += count
    return ids, n - (count - 1) * page_size


# -- level 0: the system prompt, shared by every request (one query group of all 6)
sys_ids, sys_last = pages_for(system_len)
# -- level 1: one prefix per user, shared by that user's 3 requests
user_pages = [pages_for(user_len) for _ in range(users)]
# -- level 2: each request's own tokens
own_pages = [pages_for(n) for n in own_lens]

levels = [
    (np.array([0, batch], np.int32), [sys_ids], [sys_last]),
    (np.arange(0, batch + 1, per_user, dtype=np.int32), [p for p, _ in user_pages], [n for _, n in user_pages]),
    (np.arange(batch + 1, dtype=np.int32), [p for p, _ in own_pages], [n for _, n in own_pages]),
]
qo_indptr = [lv[0] for lv in levels]
kv_indptr = [np.concatenate([[0], np.cumsum([len(p) for p in lv[1]])]).astype(np.int32) for lv in levels]
kv_indices = [np.concatenate(lv[1]).astype(np.int32) for lv in levels]
kv_last = [np.array(lv[2], np.int32) for lv in levels]

cache = rng.standard_normal((next_page, 2, page_size, kv_heads, head_dim)).astype(np.float16)
q = rng.standard_normal((batch, q_heads, head_dim)).astype(np.float16)

cascade = cuattn.MultiLevelCascadeAttentionWrapper(3, kv_layout="NHD")
cascade.plan(qo_indptr, kv_indptr, kv_indices, kv_last, q_heads, kv_heads, head_dim, page_size,
             q_data_type="float16")
out = to_host(cascade.run(xp.asarray(q), xp.asarray(cache)))

# -- the same attention as plain batch decode: each request's pages of every level, in order
#    (full pages before the last level, so the concatenation is the same tokens)
plain_pages = [np.concatenate([sys_ids, user_pages[b // per_user][0], own_pages[b][0]]) for b in range(batch)]
decode = cuattn.BatchDecodeWithPagedKVCacheWrapper()
decode.plan(np.concatenate([[0], np.cumsum([len(p) for p in plain_pages])]).astype(np.int32),
            np.concatenate(plain_pages), np.array([n for _, n in own_pages], np.int32), q_heads, kv_heads,
            head_dim, page_size, q_data_type="float16")
ref = to_host(decode.run(xp.asarray(q), xp.asarray(cache)))
err = float(np.abs(out.astype(np.float32) - ref.astype(np.float32)).max())
print(f"3-level cascade ({system_len}-token system prompt, {users} users x {user_len}, own tokens {own_lens}): "
      f"max |cascade - plain decode| = {err:.1e}")
assert err < 1e-2
