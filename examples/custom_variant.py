"""User-defined attention variants: a few lines of CUDA per hook, compiled by NVRTC on first use.

1. Sigmoid attention (no softmax: out = sum_j sigmoid(q.k_j * scale + bias) v_j).
2. A soft-cap written as a user variant, which equals the built-in ``logits_soft_cap`` exactly.

Each variant also carries NumPy versions of its hooks, so the same calls run on the CPU path (NumPy
arrays here); pass --gpu to run them on CuPy arrays with the CUDA kernels.
"""
import sys

import numpy as np

import cuattn

xp = __import__("cupy") if "--gpu" in sys.argv else np
to_host = xp.asnumpy if xp is not np else np.asarray
rng = np.random.default_rng(0)
qo_len, kv_len, q_heads, kv_heads, head_dim = 20, 96, 8, 2, 64
q = rng.standard_normal((qo_len, q_heads, head_dim)).astype(np.float16)
k = rng.standard_normal((kv_len, kv_heads, head_dim)).astype(np.float16)
v = rng.standard_normal((kv_len, kv_heads, head_dim)).astype(np.float16)

# -- 1. sigmoid attention: the transformed logit is the attention weight itself
sigmoid = cuattn.Variant(
    "sigmoid", params=[("bias", "float")], use_softmax=False,
    logits_transform="return fast_sigmoid(logits + params.bias);",       # logits = q.k * sm_scale
    numpy={"logits_transform": lambda p, pos, x: 1 / (1 + np.exp(-(x + p["bias"])))})
out = to_host(cuattn.single_prefill_with_kv_cache(xp.asarray(q), xp.asarray(k), xp.asarray(v), causal=True,
                                                  variant=sigmoid, variant_args=(-1.0,)))
# float64 check: causal, bottom-right aligned, GQA head h reads kv head h // 4
qd, kd, vd = (x.astype(np.float64) for x in (q, k, v))
worst = 0.0
for h in range(q_heads):
    s = qd[:, h] @ kd[:, h // 4].T / np.sqrt(head_dim)
    keep = np.arange(kv_len)[None, :] <= np.arange(qo_len)[:, None] + kv_len - qo_len
    ref = (np.where(keep, 1 / (1 + np.exp(-(s - 1.0))), 0)) @ vd[:, h // 4]
    worst = max(worst, float(np.abs(out[:, h] - ref).max() / np.abs(ref).max()))
print(f"sigmoid attention: max error / max |ref| = {worst:.1e}")
assert worst < 1e-2

# -- 2. a soft-cap as a user variant: the same code as the built-in, so the same bits
softcap = cuattn.Variant(
    "my_softcap", params=[("cap", "float")],
    logits_transform="return params.cap * fast_tanh(logits * (1.f / params.cap));",
    numpy={"logits_transform": lambda p, pos, x: p["cap"] * np.tanh(x / p["cap"])})
mine = cuattn.single_prefill_with_kv_cache(xp.asarray(q), xp.asarray(k), xp.asarray(v), causal=True,
                                           variant=softcap, variant_args=(5.0,))
builtin = cuattn.single_prefill_with_kv_cache(xp.asarray(q), xp.asarray(k), xp.asarray(v), causal=True,
                                              logits_soft_cap=5.0)
diff = float(np.abs(to_host(mine).astype(np.float32) - to_host(builtin).astype(np.float32)).max())
print(f"user soft-cap vs built-in logits_soft_cap=5: max |difference| = {diff:.1e}")
assert diff < 2e-3
