"""What cuattn runs: one table that every plan() and single_* call checks, on the GPU and the NumPy
path alike, so a serving loop tested on a laptop runs unchanged on a GPU. The README's support
matrix is this table's ``markdown()`` (tests/test_support.py keeps them equal).
"""
from __future__ import annotations

import numpy as np

from . import arrays
from .errors import UnsupportedError

# family -> what its kernels take; every entry also runs on the NumPy path (and nothing else does)
TABLE = {
    "decode": dict(
        api="BatchDecodeWithPagedKVCacheWrapper, single_decode_with_kv_cache",
        head_dims=(64, 128, 256), q_dtypes=("float16", "bfloat16", "float32"),
        kv_dtypes=("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float32"),
        layouts="NHD, HND, (k, v) pair", page_sizes="any >= 1 (TMA on sm_90 when page_size % 16 == 0)",
        archs="sm_80+ (sm_90a: TMA loads)"),
    "prefill": dict(
        api="BatchPrefillWith{Paged,Ragged}KVCacheWrapper, single_prefill_with_kv_cache, "
            "BatchAttentionWithAttentionSinkWrapper, MultiLevelCascadeAttentionWrapper, "
            "BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper, BatchAttention",
        head_dims=(64, 128, 256), head_dim_pairs=((192, 128),), q_dtypes=("float16", "bfloat16", "float32"),
        kv_dtypes=("same as q", "float16 or bfloat16 with a float32 q", "float8_e4m3fn", "float8_e5m2", "float32"),
        layouts="NHD, HND, (k, v) pair", page_sizes="any >= 1",
        archs="fa2: sm_80+; fa3: sm_90a, head_dim 64, 128, 256, 192/128, K/V of q's dtype or fp8 (head_dim 64, 128), "
              "contiguous K/V or pages of any size"),
}
# what a refused kv dtype is told, per family
KV_NOT_YET = {"decode": "with any q dtype",
              "prefill": "fp32 KV: fa2 backend"}
# kv_dtypes entries that name a rule rather than a dtype: the dtypes they admit for a q dtype
_KV_RULES = {"same as q": lambda q: [q],
             "float16 or bfloat16 with a float32 q": lambda q: [np.dtype(np.float16), arrays.bfloat16]
             if q == np.float32 else []}
# how a float32 q runs (cuattn/qcast.py), as the README says it
FP32_Q = ("Float32 q (decode, prefill, MLA and the wrappers above them): q is converted on the "
          "GPU to the 16-bit kernels' type, bfloat16 for a bfloat16 KV cache, else float16 (11 significant bits against bfloat16's 8), "
          "saturating at the type's largest finite value (float16: +-65504: no finite q becomes inf; NaN stays NaN); "
          "the kernel's 16-bit output is converted back into a "
          "float32 out (fa3 runs it where it runs that 16-bit q); the NumPy path computes with the float32 q as it is")
VARIANTS = ("logits_soft_cap, window_left, pos_encoding_mode='ALIBI', sinks, user cuattn.Variant "
            "(every family); pos_encoding_mode='ROPE_LLAMA' and a user variant's query_transform / key_transform "
            "(decode, fa2 and fa3; not with an fp8 or fp32 KV cache); fp8 KV (decode, prefill on fa2 and fa3): k_scale / v_scale as floats, 1-element or per-kv-head arrays; "
            "not yet: "
            "use_fp16_qk_reduction")


def check(family: str, fn: str, *, head_dim: int, q_dtype, kv_dtype, head_dim_vo: int | None = None) -> None:
    """Raise UnsupportedError naming the first limit the call hits (the same message on every path).
    ``head_dim_vo`` (None: head_dim): V's and the output's head_dim."""
    t = TABLE[family]
    if head_dim_vo not in (None, head_dim):
        pairs = t.get("head_dim_pairs", ())
        if (head_dim, head_dim_vo) not in pairs:
            raise UnsupportedError(f"{fn}: head_dim_qk={head_dim} with head_dim_vo={head_dim_vo} has no kernel; "
                                   f"supported: equal head dims {', '.join(map(str, t['head_dims']))}"
                                   + (f", or (qk, vo) {', '.join(f'{a}/{b}' for a, b in pairs)}" if pairs else ""))
    elif head_dim not in t["head_dims"]:
        raise UnsupportedError(f"{fn}: head_dim={head_dim} has no kernel; supported: "
                               f"{', '.join(map(str, t['head_dims']))}")
    q, kv = np.dtype(q_dtype), np.dtype(kv_dtype)
    q_ok = [np.dtype(arrays.as_dtype(d, "q", fn)) for d in t["q_dtypes"]]
    if q not in q_ok:
        raise UnsupportedError(f"{fn}: q dtype {q} has no kernel; supported: {', '.join(t['q_dtypes'])}")
    kv_ok = [x for d in t["kv_dtypes"] for x in (_KV_RULES[d](q) if d in _KV_RULES else
                                                  [np.dtype(arrays.as_dtype(d, "kv", fn))])]
    if kv not in kv_ok:
        raise UnsupportedError(f"{fn}: kv dtype {kv} with q dtype {q} has no kernel; supported kv dtypes: "
                               f"{', '.join(t['kv_dtypes'])} ({KV_NOT_YET[family]})")


def markdown() -> str:
    """The support matrix as the README shows it."""
    rows = ["| family | API | head_dim | q dtype | kv dtype | layouts | page_size | arch |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for family, t in TABLE.items():
        dims = ", ".join(list(map(str, t["head_dims"])) + [f"{a}/{b} (qk/vo)" for a, b in t.get("head_dim_pairs", ())])
        rows.append(f"| {family} | {t['api']} | {dims} | {', '.join(t['q_dtypes'])} | "
                    f"{', '.join(t['kv_dtypes'])} | {t['layouts']} | {t['page_sizes']} | {t['archs']} |")
    rows.append("")
    rows.append(f"Variants: {VARIANTS}.")
    rows.append("")
    rows.append(f"{FP32_Q}.")
    return "\n".join(rows)
