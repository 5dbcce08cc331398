// grid_dependency.cuh — Programmatic Dependent Launch (PDL, sm_90+) as inline PTX.
// A grid launched with programmatic stream serialization may start while the previous kernel in
// its stream is still running: it does the work that reads nothing that kernel writes, then waits.
// Without that launch attribute (or below sm_90) both are no-ops.
#pragma once

namespace cuattn {

// -- block until every prerequisite grid has completed and its memory is visible
__device__ __forceinline__ void wait_prior_grids() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// -- let the next grid in the stream be scheduled once every CTA of this one has said so (or exited);
//    it still waits (wait_prior_grids) for this grid to complete before reading its results
__device__ __forceinline__ void allow_next_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace cuattn
