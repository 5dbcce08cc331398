// variant.cuh — what every attention kernel (decode.cu, prefill.cu, prefill_sm90.cu) calls to apply
// the call's attention variant: cuattn/variants.py generates cuattn::variant (Params, the hooks and
// HAS_* / USE_SOFTMAX flags) and the CUATTN_VARIANT_ARGS / CUATTN_VARIANT_PARAMS launch macros in a
// prelude before the kernel file. A kernel calls, at one site each:
//   row_state()  once per query row, before the key loop (what a transform or mask needs per row only);
//   score()      on every logit of a tile: the logits transform (natural units in and out: the raw
//                dot product times the kernel's logit_scale, sm_scale with the key scale where it folds
//                that in) and the masks, before its online softmax; kv_base (the transform's, see
//                variants.py) a key the kernel holds fixed over a tile, kv_idx - kv_base a compile-time
//                constant in its unrolled loops;
//   (a kernel skips the per-element pass on a tile only when the variant has no logits transform
//   and no logits_mask (!HAS_TRANSFORM && !HAS_MASK) and the tile lies inside the causal / kv_begin
//   bounds: a mask variant, the built-in custom mask included, sees every tile);
//   variant_transform() instead of score() on a tile no mask reaches (a transform without bound checks);
//   finish_row() for a row's output scale and LSE: the sink joins the denominator there;
//   transform_rows() on the query rows once and on each key tile as it lands in shared memory, with
//   variant::query_transform / key_transform (CUATTN_VARIANT_QK; the built-in RoPE has its own below).
// Plain attention (no hooks) compiles to the kernels' previous code: every branch is constexpr.
#pragma once
#include "common/dtypes.cuh"
#if CUATTN_VARIANT_ROPE
#include "common/rope.cuh"
#endif

namespace cuattn {

// The 8 pairs (lo[e], hi[e]) of two 16-byte chunks of a row in shared memory (T the 16-bit element
// type), each replaced by f(e, pair) (a float2: x = the lo element, y = the hi one).
template <class T, class F>
__device__ __forceinline__ void transform_chunks(uint32_t lo, uint32_t hi, F f) {
  uint32_t a[4], b[4];
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(lo));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(hi));
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float2 x = unpack2<T>(a[w]), y = unpack2<T>(b[w]);
    const float2 r0 = f(2 * w, make_float2(x.x, y.x));
    const float2 r1 = f(2 * w + 1, make_float2(x.y, y.y));
    a[w] = pack2<T>(r0.x, r1.x);
    b[w] = pack2<T>(r0.y, r1.y);
  }
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(lo), "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]));
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(hi), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]));
}

#if CUATTN_VARIANT_QK
// -- the variant's query / key transform over rows [0, rows) of a tile whose chunk (row, c) of 8
//    elements sits at shared address addr(row, c): pair j of row r is (j, j + D / 2), so chunk c pairs
//    with chunk c + D / 16; f(r, j, x) gives the new pair. Threads idx0, idx0 + step, ... take the
//    (row, chunk) items in turn.
template <class T, int D, class Addr, class F>
__device__ __forceinline__ void transform_rows(Addr addr, int rows, int idx0, int step, F f) {
  constexpr int NC = D / 16;
  for (int i = idx0; i < rows * NC; i += step) {
    const int r = i / NC, c = i % NC;
    transform_chunks<T>(addr(r, c), addr(r, c + NC), [&](int e, float2 x) { return f(r, 8 * c + e, x); });
  }
}
#endif

constexpr float VARIANT_LOG2E = 1.4426950408889634f;
constexpr float VARIANT_LN2 = 0.69314718055994531f;

// A logit: the raw dot product s of (query at qo_idx / qo_pos, key kv_idx) -> the value the kernel's
// softmax multiplies by its scale_log2 (variants.Composite.scale_log2: log2 e when there is a
// transform, sm_scale * log2 e otherwise), or -inf when the variant drops the key. With a transform,
// s * logit_scale is the logit in natural units (logit_scale: sm_scale, times the key scale where the
// kernel folds it in: one multiply per logit). rs: the row's variant::row_state(), computed once per
// query row by the kernel (before its key loop); kv_base: the transform's (variants.py).
__device__ __forceinline__ float variant_score(const variant::Params& vp, const variant::RowState& rs, float s,
                                               float logit_scale, int batch, int qo_idx, int qo_pos, int kv_idx,
                                               int kv_base, int qo_head, int kv_head, int qo_len, int kv_len,
                                               int kv_lo) {
  if (variant::HAS_TRANSFORM)
    s = variant::logits_transform(vp, rs, s * logit_scale, batch, qo_idx, qo_pos, kv_idx, qo_head, kv_head, qo_len,
                                  kv_len, kv_base);
  bool keep = true;
  if (variant::HAS_KV_BEGIN) keep = kv_idx >= kv_lo;
  if (variant::HAS_MASK)
    keep = keep && variant::logits_mask(vp, rs, batch, qo_idx, qo_pos, kv_idx, qo_head, kv_head, qo_len, kv_len);
  return keep ? s : __int_as_float(0xff800000);
}

// The logits transform alone, for a tile that no mask reaches (the kernels' interior tiles: inside the
// causal and kv_begin bounds, below kv_len, no logits_mask): what variant_score gives there, without the
// per-logit bound checks.
__device__ __forceinline__ float variant_transform(const variant::Params& vp, const variant::RowState& rs, float s,
                                                   float logit_scale, int batch, int qo_idx, int qo_pos, int kv_idx,
                                                   int kv_base, int qo_head, int kv_head, int qo_len, int kv_len) {
  return variant::logits_transform(vp, rs, s * logit_scale, batch, qo_idx, qo_pos, kv_idx, qo_head, kv_head, qo_len,
                                   kv_len, kv_base);
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

#if CUATTN_VARIANT_ROPE
// -- fused RoPE (pos_encoding_mode="ROPE_LLAMA"): NeoX / Llama pairs (j, j + rotary_dim / 2) of a row
//    held in shared memory as 16-byte chunks of 8 elements; chunk c (< nc = rotary_dim / 16) pairs
//    with chunk c + nc. A thread keeps one c for every row it rotates (its index % nc: the kernels'
//    thread counts are multiples of nc), so the 8 pairs' frequencies are computed once per kernel.
struct RopeCols {
  ff32 half_turns[8];   // rope.cuh's rope_half_turns of pairs 8c .. 8c + 7
  float2 step_cs[8];    // (cos, sin) of the angle `row_step` positions turn each pair by
};
// row_step: how many positions apart the rows one thread rotates are (rope_rotate_rows_linear)
__device__ __forceinline__ RopeCols rope_cols(const variant::Params& p, int c, int row_step) {
  const RopeFreq f{{p.rope_step_hi, p.rope_step_lo}, {p.rope_sa_hi, p.rope_sa_lo}, {p.rope_sb_hi, p.rope_sb_lo},
                   {p.rope_scaled_pi_hi, p.rope_scaled_pi_lo}, {p.rope_unscaled_pi_hi, p.rope_unscaled_pi_lo}};
  RopeCols rc;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    rc.half_turns[e] = rope_half_turns(8 * c + e, f);
    rc.step_cs[e] = rope_cos_sin(row_step, rc.half_turns[e]);
  }
  return rc;
}
// rotate the chunk pair (lo at shared address lo, hi at hi; T the 16-bit element type) of a row by the
// angles whose (cos, sin) are cs[0..7]
template <class T>
__device__ __forceinline__ void rope_rotate_chunks(uint32_t lo, uint32_t hi, const float2 (&cs)[8]) {
  transform_chunks<T>(lo, hi, [&](int e, float2 x) { return rope_rotate(x.x, x.y, cs[e]); });
}
__device__ __forceinline__ void rope_angles(int64_t pos, const RopeCols& rc, float2 (&cs)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) cs[e] = rope_cos_sin(pos, rc.half_turns[e]);
}
// rotate rows [0, rows) of a tile whose chunk (row, c) sits at shared address addr(row, c), row r at
// position pos_of(r): every angle from rope.cuh's float-float formula (rows at unrelated positions:
// packed GQA query rows). Threads idx0, idx0 + step, ... (step a multiple of nc).
template <class T, class Addr, class Pos>
__device__ __forceinline__ void rope_rotate_rows(Addr addr, Pos pos_of, int rows, int idx0, int step,
                                                 const variant::Params& vp, const RopeCols& rc) {
  const int nc = vp.rotary_dim / 16;
  const int c = idx0 % nc;
  for (int r = idx0 / nc; r < rows; r += step / nc) {
    float2 cs[8];
    rope_angles(pos_of(r), rc, cs);
    rope_rotate_chunks<T>(addr(r, c), addr(r, c + nc), cs);
  }
}
// the same for rows at consecutive positions pos0 + r (key tiles): the thread's first row takes the
// full formula, each later one (step / nc = rc's row_step positions on) turns the previous angles
// by rc.step_cs (angle addition: 4 FMAs a pair instead of ~35 instructions; <= 3 steps a tile)
template <class T, class Addr>
__device__ __forceinline__ void rope_rotate_rows_linear(Addr addr, int64_t pos0, int rows, int idx0, int step,
                                                        const variant::Params& vp, const RopeCols& rc) {
  const int nc = vp.rotary_dim / 16;
  const int c = idx0 % nc;
  int r = idx0 / nc;
  if (r >= rows) return;
  float2 cs[8];
  rope_angles(pos0 + r, rc, cs);
  for (;;) {
    rope_rotate_chunks<T>(addr(r, c), addr(r, c + nc), cs);
    r += step / nc;
    if (r >= rows) break;
#pragma unroll
    for (int e = 0; e < 8; ++e)
      cs[e] = make_float2(cs[e].x * rc.step_cs[e].x - cs[e].y * rc.step_cs[e].y,
                          cs[e].y * rc.step_cs[e].x + cs[e].x * rc.step_cs[e].y);
  }
}
#endif

}  // namespace cuattn
