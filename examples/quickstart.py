"""Quick start: paged decode from NumPy (the CPU path) and, with --gpu, the same code on CuPy arrays.

A paged KV cache holds 3 sequences of different lengths for 2 layers; one decode step appends one
new token per sequence in every layer and attends with one query token per sequence. The result is
checked against dense float64 attention over each sequence's tokens.

    python examples/quickstart.py          # NumPy arrays: cuattn's reference path on the CPU
    python examples/quickstart.py --gpu    # also CuPy arrays: the CUDA kernels (NVRTC, first call compiles)
"""
import sys

import numpy as np

import cuattn

num_layers, q_heads, kv_heads, head_dim, page_size = 2, 8, 2, 64, 16
prompt_lens = [37, 5, 100]
rng = np.random.default_rng(0)
# every token's K and V per layer, made up front so both runs see the same numbers
tokens = {n: [(rng.standard_normal((n + 1, kv_heads, head_dim)).astype(np.float16),
               rng.standard_normal((n + 1, kv_heads, head_dim)).astype(np.float16)) for _ in range(num_layers)]
          for n in prompt_lens}
queries = rng.standard_normal((num_layers, len(prompt_lens), q_heads, head_dim)).astype(np.float16)


def decode_step(device):
    """Fill a paged cache with the prompts, then one decode step; returns out [layer] as NumPy."""
    xp = __import__("cupy") if device == "cuda" else np
    cache = cuattn.PagedKVCache(num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                                page_size=page_size, max_num_pages=64, dtype="float16", device=device)
    seqs = [cache.add_sequence() for _ in prompt_lens]

    # -- the prompts: reserve pages for every prompt token, then write each layer's K/V
    batch = cache.reserve(seqs, prompt_lens)
    for layer in range(num_layers):
        k = np.concatenate([tokens[n][layer][0][:n] for n in prompt_lens])     # [sum(prompt_lens), kv_heads, head_dim]
        v = np.concatenate([tokens[n][layer][1][:n] for n in prompt_lens])
        cache.append(layer, xp.asarray(k), xp.asarray(v), batch)

    # -- one decode step: one new token per sequence, plan once, run per layer
    batch = cache.reserve(seqs, [1] * len(seqs))
    decode = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    decode.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, num_qo_heads=q_heads,
                num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, q_data_type="float16")
    outs = []
    for layer in range(num_layers):
        k_new = np.stack([tokens[n][layer][0][n] for n in prompt_lens])          # [batch, kv_heads, head_dim]
        v_new = np.stack([tokens[n][layer][1][n] for n in prompt_lens])
        cache.append(layer, xp.asarray(k_new), xp.asarray(v_new), batch)
        out = decode.run(xp.asarray(queries[layer]), cache.layer(layer))        # [batch, q_heads, head_dim]
        assert type(out) is type(xp.asarray(queries[layer]))                    # same framework as q
        outs.append(out.get() if device == "cuda" else out)
    print(f"  {device}: sequences of {[cache.seq_len(s) for s in seqs]} tokens on "
          f"{cache.max_num_pages - cache.num_free_pages} pages of {page_size}; out {outs[0].shape} {outs[0].dtype}")
    return outs


def dense(q, k, v):
    """float64 attention of one token q [q_heads, D] over k, v [n, kv_heads, D] (GQA: 4 q heads per kv head)."""
    k, v = (np.repeat(x.astype(np.float64), q_heads // kv_heads, axis=1) for x in (k, v))
    s = np.einsum("hd,nhd->hn", q.astype(np.float64), k) / np.sqrt(head_dim)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hn,nhd->hd", p / p.sum(-1, keepdims=True), v)


ref = [np.stack([dense(queries[layer, b], *tokens[n][layer]) for b, n in enumerate(prompt_lens)])
       for layer in range(num_layers)]
print("paged decode, 3 sequences x 2 layers, 8 query heads over 2 KV heads, head_dim 64:")
for device in ["cpu", "cuda"] if "--gpu" in sys.argv else ["cpu"]:
    outs = decode_step(device)
    err = max(float(np.abs(o.astype(np.float64) - r).max()) for o, r in zip(outs, ref))
    print(f"  {device}: max |out - float64 attention| = {err:.1e}")
    assert err < 1e-2
if "--gpu" not in sys.argv:
    print("  cuda: skipped (pass --gpu to run the same step on CuPy arrays with the CUDA kernels)")
