"""Serve a small Llama through cuattn: a `transformers` LlamaForCausalLM with random weights (a tiny
LlamaConfig, nothing downloaded), its attention replaced by cuattn on a paged KV cache.

For 3 prompts of different lengths: reserve pages in a cuattn.PagedKVCache, run the model's own layers
(embedding, RMSNorms, q/k/v/o projections, RoPE, MLP, lm_head) with attention done by cuattn — the
prompts' K/V appended to the cache and attended with BatchPrefillWithPagedKVCacheWrapper (causal), then
greedy decode steps with BatchDecodeWithPagedKVCacheWrapper, one new token per sequence per step —
and check every step's logits against the model's own forward over the whole sequence.

    python examples/llama_serving.py          # torch on the CPU: cuattn's NumPy path
    python examples/llama_serving.py --gpu    # torch on CUDA: the CUDA kernels

The model runs in float32; attention runs in float16 (cuattn's kernels take fp16/bf16), so logits agree
to fp16 rounding. Needs torch and transformers; without them the script says what is missing and exits 0.
"""
import importlib.util
import sys

missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
if missing:
    print(f"llama_serving.py: skipped, {' and '.join(missing)} not installed (pip install torch transformers)")
    sys.exit(0)

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import cuattn

gpu = "--gpu" in sys.argv
dev = torch.device("cuda" if gpu else "cpu")
torch.manual_seed(0)
config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
model = LlamaForCausalLM(config).to(dev).eval()
q_heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
page_size, decode_steps = 16, 6
prompts = [torch.randint(0, config.vocab_size, (n,)).tolist() for n in (11, 5, 23)]

# -- the paged cache: cuattn.PagedKVCache hands out pages; its storage is viewed as torch tensors
#    (zero-copy: torch.from_numpy on the CPU, DLPack on the GPU) so every call takes torch arrays
cache = cuattn.PagedKVCache(config.num_hidden_layers, kv_heads, head_dim, page_size, max_num_pages=32,
                            dtype="float16", device="cuda" if gpu else "cpu")
kv_layers = [torch.from_dlpack(cache.layer(i)) if gpu else torch.from_numpy(cache.layer(i))
             for i in range(config.num_hidden_layers)]
seqs = [cache.add_sequence() for _ in prompts]
prefill = cuattn.BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD")
decode = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")


def t(a):
    """A host int32 NumPy array from the cache's bookkeeping as a torch tensor on the model's device."""
    return torch.from_numpy(a).to(dev)


@torch.no_grad()
def forward_step(tokens, step, wrapper):
    """The model's layers over this step's new tokens (all sequences, concatenated), attention by cuattn.
    Returns the logits of each sequence's last new token."""
    m = model.model
    x = m.embed_tokens(torch.tensor(tokens, device=dev))                      # [nnz, hidden]
    positions = t(step.positions).long()
    cos, sin = m.rotary_emb(x[None], positions[None])                         # the model's own RoPE tables
    for i, layer in enumerate(m.layers):
        attn, h = layer.self_attn, layer.input_layernorm(x)
        q = attn.q_proj(h).view(-1, q_heads, head_dim)
        k = attn.k_proj(h).view(-1, kv_heads, head_dim)
        v = attn.v_proj(h).view(-1, kv_heads, head_dim)
        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)                    # back to [nnz, heads, head_dim]
        cuattn.append_paged_kv_cache(k.half().contiguous(), v.half().contiguous(), t(step.batch_indices),
                                     t(step.positions), kv_layers[i], t(step.kv_indices), t(step.kv_indptr),
                                     t(step.kv_last_page_len), "NHD")
        out = wrapper.run(q.half().contiguous(), kv_layers[i])                # [nnz, q_heads, head_dim] fp16
        x = x + attn.o_proj(out.float().reshape(len(tokens), -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    last = torch.from_numpy(step.append_indptr[1:].astype(np.int64) - 1).to(dev)
    return model.lm_head(m.norm(x[last]))                                     # [batch, vocab]


def plan_args(step):
    return (step.kv_indptr, step.kv_indices, step.kv_last_page_len, q_heads, kv_heads, head_dim, page_size)


# -- prefill: every prompt in one batch, causal
step = cache.reserve(seqs, [len(p) for p in prompts])
prefill.plan(step.append_indptr, *plan_args(step), causal=True, q_data_type="float16")
logits = [forward_step([tok for p in prompts for tok in p], step, prefill)]
generated = [[int(i)] for i in logits[0].argmax(-1)]

# -- decode: one token per sequence per step, greedy
for _ in range(decode_steps - 1):
    step = cache.reserve(seqs, [1] * len(seqs))
    decode.plan(*plan_args(step), q_data_type="float16")
    logits.append(forward_step([g[-1] for g in generated], step, decode))
    for g, i in zip(generated, logits[-1].argmax(-1)):
        g.append(int(i))
print(f"served {len(prompts)} prompts of {[len(p) for p in prompts]} tokens on {dev.type} "
      f"({config.num_hidden_layers} layers, {q_heads}:{kv_heads} heads, head_dim {head_dim}): 1 prefill + "
      f"{decode_steps - 1} decode steps, {cache.max_num_pages - cache.num_free_pages} pages of {page_size} in use")

# -- check: the model's own forward (its eager attention) over each whole sequence
worst = 0.0
with torch.no_grad():
    for b, (p, g) in enumerate(zip(prompts, generated)):
        full = model(torch.tensor([p + g[:-1]], device=dev)).logits[0]        # [len, vocab]
        ours = torch.stack([lg[b] for lg in logits])                          # logits at the last prompt token, then per step
        ref = full[len(p) - 1:]
        err = ((ours - ref).abs().max() / ref.abs().max()).item()
        same = bool((ours.argmax(-1) == ref.argmax(-1)).all())
        print(f"  sequence {b}: generated {g}; max |logits - model forward| / max |logits| = {err:.1e}; "
              f"greedy tokens {'agree' if same else 'DIFFER'}")
        worst = max(worst, err)
for s in seqs:
    cache.remove_sequence(s)
print(f"all sequences freed: {cache.num_free_pages}/{cache.max_num_pages} pages free")
assert worst < 1e-2, worst
