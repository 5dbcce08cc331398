"""A previous kernel for Programmatic Dependent Launch tests: it lets the next grid start at once
(griddepcontrol.launch_dependents), spins ~0.2 ms, then copies its inputs over poisoned
buffers. A kernel launched after it with PDL that read those buffers before its
griddepcontrol.wait would see the poison."""
import numpy as np

_SOURCE = r"""
extern "C" __global__ void late_writer(const unsigned char* a, unsigned char* a_dst, long long na,
                                       const unsigned char* b, unsigned char* b_dst, long long nb,
                                       const unsigned char* c, unsigned char* c_dst, long long nc,
                                       long long cycles) {
  asm volatile("griddepcontrol.launch_dependents;");
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < na + nb + nc; i += stride) {
    if (i < na) a_dst[i] = a[i];
    else if (i < na + nb) b_dst[i - na] = b[i - na];
    else c_dst[i - na - nb] = c[i - na - nb];
  }
}"""


def late_copy(pairs, cycles=400_000):
    """Launch late_writer on the current CuPy stream, copying 1 to 3 (src, dst) CuPy arrays."""
    import cupy
    assert 1 <= len(pairs) <= 3 and all(src.nbytes == dst.nbytes for src, dst in pairs)
    args = []
    for src, dst in pairs:
        args += [src, dst, np.int64(src.nbytes)]
    args += [pairs[0][0], pairs[0][1], np.int64(0)] * (3 - len(pairs))     # unused slots copy nothing
    cupy.RawKernel(_SOURCE, "late_writer")((8,), (256,), (*args, np.int64(cycles)))
