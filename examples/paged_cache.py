"""Grow two sequences in a paged KV cache and read one back (NumPy path; GPU with --gpu)."""
import sys

import numpy as np

import cuattn
from cuattn import reference

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
storage = cache.layer(0) if device == "cpu" else cache.layer(0).get()
k_pages, v_pages = reference.split_paged_kv_cache(storage, "NHD")
k_a, v_a = reference.gather_paged_kv(k_pages, v_pages, kv_indices, kv_indptr, kv_last_page_len, 0)
assert np.array_equal(k_a, keys[:21]) and np.array_equal(v_a, -keys[:21])
cache.remove_sequence(a)
print(f"read back sequence a intact; after freeing it, {cache.num_free_pages} pages free")
