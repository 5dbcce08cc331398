// elem_dtype.cuh — elem_t, the 16-bit element type of the serving kernels that take it as a -DDTYPE
// number (norm.cu, activation.cu, rope.cu: 0 float16, 1 bfloat16).
#pragma once
#include "common/dtypes.cuh"

namespace cuattn {
#if DTYPE == 0
typedef f16 elem_t;
#else
typedef bf16 elem_t;
#endif
}  // namespace cuattn
