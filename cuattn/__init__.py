"""cuattn: attention kernels for LLM serving on a paged KV cache (NVRTC + CuPy, any framework)."""
from ._version import __version__
from .errors import CacheFullError, CompileError, CuattnError, DeviceUnavailableError, UnsupportedError
from .page import PagedKVCache, append_paged_kv_cache, get_batch_indices_positions

__all__ = [
    "__version__",
    "CacheFullError", "CompileError", "CuattnError", "DeviceUnavailableError", "UnsupportedError",
    "PagedKVCache", "append_paged_kv_cache", "get_batch_indices_positions",
]
