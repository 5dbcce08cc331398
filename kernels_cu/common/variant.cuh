// variant.cuh — what every attention kernel (decode.cu, prefill.cu, prefill_sm90.cu) calls to apply
// the call's attention variant: cuattn/variants.py generates cuattn::variant (Params, the hooks and
// HAS_* / USE_SOFTMAX flags) and the CUATTN_VARIANT_ARGS / CUATTN_VARIANT_PARAMS launch macros in a
// prelude before the kernel file. A kernel calls, at one site each:
//   row_state()  once per query row, before the key loop (what a transform needs per row only);
//   score()      on every logit of a tile: the logits transform (natural units in and out: the raw
//                dot product times sm_scale) and the masks, before its online softmax;
//   tile_needs_mask() to skip the per-element masks on tiles the variant leaves whole;
//   finish_row() for a row's output scale and LSE: the sink joins the denominator there.
// Plain attention (no hooks) compiles to the kernels' previous code: every branch is constexpr.
#pragma once

namespace cuattn {

constexpr float VARIANT_LOG2E = 1.4426950408889634f;
constexpr float VARIANT_LN2 = 0.69314718055994531f;

// A logit: the raw dot product s of (query at qo_idx / qo_pos, key kv_idx) -> the value the kernel's
// softmax multiplies by its scale_log2 (variants.Composite.scale_log2: log2 e when there is a
// transform, sm_scale * log2 e otherwise), or -inf when the variant drops the key. rs: the row's
// variant::row_state(), computed once per query row by the kernel (before its key loop).
__device__ __forceinline__ float variant_score(const variant::Params& vp, const variant::RowState& rs, float s,
                                               int batch, int qo_idx, int qo_pos, int kv_idx, int qo_head,
                                               int kv_head, int qo_len, int kv_len, int kv_lo) {
  if (variant::HAS_TRANSFORM)
    s = variant::logits_transform(vp, rs, s * vp.sm_scale, batch, qo_idx, qo_pos, kv_idx, qo_head, kv_head, qo_len,
                                  kv_len);
  bool keep = true;
  if (variant::HAS_KV_BEGIN) keep = kv_idx >= kv_lo;
  if (variant::HAS_MASK)
    keep = keep && variant::logits_mask(vp, batch, qo_idx, qo_pos, kv_idx, qo_head, kv_head, qo_len, kv_len);
  return keep ? s : __int_as_float(0xff800000);
}

// The output scale (multiplies the accumulated P V) and natural-log LSE of a finished row, from its
// base-2 running max m (-inf: no key kept) and row sum l relative to max(m, 0 if -inf). The sink
// (with_sink: once per row, in the piece that holds key 0 when KV is split) is a key of logit
// variant::sink() and value 0. Without softmax, the weights are final: scale 1, LSE 0.
struct RowEnd {
  float o_scale;
  float lse;
};
__device__ __forceinline__ RowEnd finish_row(const variant::Params& vp, float m, float l, int batch, int qo_idx,
                                             int qo_head, bool with_sink) {
  const float neg_inf = __int_as_float(0xff800000);
  if (!variant::USE_SOFTMAX) return {1.f, 0.f};
  if (variant::HAS_SINK && with_sink) {
    const float a = l > 0.f ? m : neg_inf;
    const float sk = variant::sink(vp, batch, qo_idx, qo_head) * VARIANT_LOG2E;
    const float m_new = fmaxf(a, sk);
    if (m_new == neg_inf) return {0.f, neg_inf};
    const float f = exp2f(a - m_new);
    const float total = l * f + exp2f(sk - m_new);
    return {f / total, (m_new + __log2f(total)) * VARIANT_LN2};
  }
  if (l > 0.f) return {1.f / l, (m + __log2f(l)) * VARIANT_LN2};
  return {0.f, neg_inf};
}

}  // namespace cuattn
