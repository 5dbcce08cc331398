"""JAX interop: JAX arrays in, JAX arrays out, zero-copy (DLPack); and what happens under jax.jit.

1. Eager: a jnp query and a paged KV cache go straight into cuattn's decode; the result is a jax.Array.
   JAX arrays are immutable, so the cache cuattn writes into (append) is a NumPy / CuPy array
   (cuattn.PagedKVCache allocates one); reading it as JAX input is fine.
2. Under jax.jit cuattn cannot be traced: it reads concrete buffers, and XLA has no custom call for it
   (cuattn ships no compiled extension). Passing a tracer raises a TypeError that says so. Jitted
   code on the CPU path can still call it through jax.pure_callback, shown here; on the GPU, call
   cuattn between jitted functions (eager JAX arrays on the device cross without a copy).

    python examples/jax_interop.py          # JAX on the CPU: cuattn's NumPy path
    python examples/jax_interop.py --gpu    # JAX arrays on the GPU (jax[cuda]): the CUDA kernels

Needs jax (`pip install jax`); without it the script says so and exits 0.
"""
import sys

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    print("jax_interop.py: skipped, JAX is not installed (pip install jax)")
    sys.exit(0)
import numpy as np

import cuattn

gpu = "--gpu" in sys.argv
if gpu and jax.default_backend() != "gpu":
    print(f"jax_interop.py --gpu: JAX's backend is {jax.default_backend()!r}, not 'gpu' (install jax[cuda12] or "
          f"jax[cuda13]); running on the CPU path instead")
    gpu = False
q_heads, kv_heads, head_dim, page_size = 8, 2, 64, 16
seq_lens = [40, 3, 17]
batch = len(seq_lens)
rng = np.random.default_rng(0)

# -- a paged cache filled with the sequences' K/V (NumPy on the CPU path, CuPy on the GPU)
cache = cuattn.PagedKVCache(1, kv_heads, head_dim, page_size, max_num_pages=16, dtype="float16",
                            device="cuda" if gpu else "cpu")
seqs = [cache.add_sequence() for _ in seq_lens]
step = cache.reserve(seqs, seq_lens)
kv = rng.standard_normal((2, sum(seq_lens), kv_heads, head_dim)).astype(np.float16)
xp = __import__("cupy") if gpu else np
cache.append(0, xp.asarray(kv[0]), xp.asarray(kv[1]), step)
decode = cuattn.BatchDecodeWithPagedKVCacheWrapper()
decode.plan(step.kv_indptr, step.kv_indices, step.kv_last_page_len, q_heads, kv_heads, head_dim, page_size,
            q_data_type="float16")
paged_kv = jnp.asarray(cache.layer(0)) if not gpu else jax.dlpack.from_dlpack(cache.layer(0))   # a JAX view


def reference(q):
    """float64 attention per sequence (GQA: 4 query heads per KV head)."""
    q, out, start = np.asarray(q, np.float64), [], 0
    for b, n in enumerate(seq_lens):
        k, v = (np.repeat(kv[i, start:start + n].astype(np.float64), q_heads // kv_heads, axis=1) for i in (0, 1))
        s = np.einsum("hd,nhd->hn", q[b], k) / np.sqrt(head_dim)
        p = np.exp(s - s.max(-1, keepdims=True))
        out.append(np.einsum("hn,nhd->hd", p / p.sum(-1, keepdims=True), v))
        start += n
    return np.stack(out)


# -- 1. eager: jax.Array in, jax.Array out
q = jnp.asarray(rng.standard_normal((batch, q_heads, head_dim)), dtype=jnp.float16)
out = decode.run(q, paged_kv)
err = float(np.abs(np.asarray(out, np.float64) - reference(q)).max())
print(f"eager: q jax.Array on {q.devices()} -> out {'jax.Array' if isinstance(out, jax.Array) else type(out)} "
      f"{out.shape} {out.dtype}; "
      f"max |out - float64 attention| = {err:.1e}")
assert isinstance(out, jax.Array) and err < 1e-2


# -- 2a. under jax.jit: refused, with a message that says what to do
@jax.jit
def traced_step(q):
    return decode.run(q, paged_kv) * 2


try:
    traced_step(q)
    raise AssertionError("cuattn accepted a JAX tracer")
except TypeError as e:
    print(f"under jax.jit, refused: TypeError: {e}")

if gpu:
    print("jax.pure_callback: not shown on the GPU (it would copy through the host); call cuattn between jitted "
          "functions instead, as in part 1")
    sys.exit(0)


# -- 2b. on the CPU path: jitted code calls cuattn through jax.pure_callback (a host callback, NumPy in and out)
@jax.jit
def jitted_step(q):
    out = jax.pure_callback(lambda q: decode.run(np.asarray(q), np.asarray(paged_kv)),
                            jax.ShapeDtypeStruct(q.shape, q.dtype), q)
    return out.astype(jnp.float32) * 2


doubled = jitted_step(q)
err = float(np.abs(np.asarray(doubled, np.float64) / 2 - reference(q)).max())
print(f"jax.jit + jax.pure_callback (CPU path): out {doubled.shape} {doubled.dtype}; "
      f"max |out / 2 - float64 attention| = {err:.1e}")
assert err < 1e-2
