"""cuattn: attention kernels for LLM serving on a paged KV cache (NVRTC + CuPy, any framework)."""
from ._version import __version__
from .errors import CacheFullError, CompileError, CuattnError, DeviceUnavailableError, UnsupportedError
from .cascade import merge_state, merge_states
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .page import PagedKVCache, append_paged_kv_cache, get_batch_indices_positions
from .prefill import (BatchAttentionWithAttentionSinkWrapper, BatchPrefillWithPagedKVCacheWrapper,
                      BatchPrefillWithRaggedKVCacheWrapper)
from .single import single_decode_with_kv_cache, single_prefill_with_kv_cache
from .activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
from .norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, layernorm, rmsnorm
from .rope import (apply_llama31_rope, apply_llama31_rope_inplace, apply_llama31_rope_pos_ids,
                   apply_llama31_rope_pos_ids_inplace, apply_rope, apply_rope_inplace, apply_rope_pos_ids,
                   apply_rope_pos_ids_inplace, apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace)
from .multilevel import MultiLevelCascadeAttentionWrapper, merge_state_in_place
from .sparse import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper
from .attention import BatchAttention
from .mla import BatchMLAPagedAttentionWrapper, append_paged_mla_kv_cache
from .variants import Variant
from .mask import packbits, segment_packbits
from .sampling import (chain_speculative_sampling, min_p_sampling_from_probs, sampling_from_logits,
                       sampling_from_probs, top_k_mask_logits, top_k_renorm_probs, top_k_sampling_from_probs,
                       top_k_top_p_sampling_from_logits, top_k_top_p_sampling_from_probs, top_p_renorm_probs,
                       top_p_sampling_from_probs)
from .distributed import ContextParallelDecodeWrapper, KVSharding, ShardedPagedKVCache

__all__ = [
    "__version__",
    "CacheFullError", "CompileError", "CuattnError", "DeviceUnavailableError", "UnsupportedError",
    "BatchDecodeWithPagedKVCacheWrapper", "single_decode_with_kv_cache", "merge_state", "merge_states",
    "PagedKVCache", "append_paged_kv_cache", "get_batch_indices_positions",
    "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
    "single_prefill_with_kv_cache", "packbits", "segment_packbits",
    "BatchAttentionWithAttentionSinkWrapper", "Variant", "MultiLevelCascadeAttentionWrapper",
    "merge_state_in_place", "BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper", "BatchAttention",
    "BatchMLAPagedAttentionWrapper", "append_paged_mla_kv_cache",
    "rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm", "layernorm",
    "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul",
    "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids", "apply_rope_pos_ids_inplace", "apply_llama31_rope",
    "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids", "apply_llama31_rope_pos_ids_inplace",
    "apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace",
    "sampling_from_probs", "sampling_from_logits", "top_k_sampling_from_probs", "top_p_sampling_from_probs",
    "min_p_sampling_from_probs", "top_k_top_p_sampling_from_probs", "top_k_top_p_sampling_from_logits",
    "top_k_renorm_probs", "top_p_renorm_probs", "top_k_mask_logits", "chain_speculative_sampling",
    "ContextParallelDecodeWrapper", "KVSharding", "ShardedPagedKVCache",
]
