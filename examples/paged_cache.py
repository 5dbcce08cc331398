"""Grow two sequences in a paged KV cache and read one back through its page table (NumPy path; GPU with --gpu).

Only public API: the cache's storage layout is documented ([max_num_pages, 2, page_size, num_kv_heads,
head_dim] per layer for "NHD"), so a sequence's keys are its pages' K slots, in page-table order.
"""
import sys

import numpy as np

import cuattn

device = "cuda" if "--gpu" in sys.argv else "cpu"
xp = __import__("cupy") if device == "cuda" else np
cache = cuattn.PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=64, page_size=16,
                            max_num_pages=8, dtype="float16", device=device)
a, b = cache.add_sequence(), cache.add_sequence()
rng = np.random.default_rng(0)
keys = rng.standard_normal((30, 2, 64)).astype(np.float16)
batch = cache.reserve([a, b], [21, 9])                 # 21 tokens for a, 9 for b
cache.append(0, xp.asarray(keys), xp.asarray(-keys), batch)
print(f"sequence a: {cache.seq_len(a)} tokens on pages {cache.pages_of(a)}; "
      f"b: {cache.seq_len(b)} on {cache.pages_of(b)}; {cache.num_free_pages} pages free")

kv_indptr, kv_indices, kv_last_page_len = cache.page_table([a, b])
storage = cache.layer(0) if device == "cpu" else cache.layer(0).get()      # [pages, 2, page_size, heads, dim]
pages_a = kv_indices[kv_indptr[0]:kv_indptr[1]]
k_a = storage[pages_a, 0].reshape(-1, 2, 64)[:cache.seq_len(a)]           # K slots of a's pages, in order
v_a = storage[pages_a, 1].reshape(-1, 2, 64)[:cache.seq_len(a)]
assert np.array_equal(k_a, keys[:21]) and np.array_equal(v_a, -keys[:21])
cache.remove_sequence(a)
print(f"read back sequence a intact; after freeing it, {cache.num_free_pages} pages free")
