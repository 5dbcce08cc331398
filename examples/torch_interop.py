"""PyTorch interop: a decode step of one attention layer written in torch, with cuattn's paged attention
in the middle, zero-copy (DLPack) and on torch's current stream; then the same run() captured in a CUDA
graph (BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)) and replayed after the next step's plan().

    python examples/torch_interop.py          # torch CPU tensors: cuattn runs its NumPy path on them
    python examples/torch_interop.py --gpu    # torch CUDA tensors: the CUDA kernels, a side stream, a CUDA graph

Needs torch (`pip install torch`); without it the script says so and exits 0.
"""
import sys

try:
    import torch
except ImportError:
    print("torch_interop.py: skipped, PyTorch is not installed (pip install torch)")
    sys.exit(0)

import cuattn

gpu = "--gpu" in sys.argv
dev = torch.device("cuda" if gpu else "cpu")
torch.manual_seed(0)
hidden, q_heads, kv_heads, head_dim, page_size = 512, 8, 2, 64, 16
prompt_lens = [50, 7, 27]                    # tokens already in the cache; room left on each last page
batch, num_pages = len(prompt_lens), 32

# -- the layer's projections, in torch
wq = torch.randn(hidden, q_heads * head_dim, device=dev) / hidden ** 0.5
wk = torch.randn(hidden, kv_heads * head_dim, device=dev) / hidden ** 0.5
wv = torch.randn(hidden, kv_heads * head_dim, device=dev) / hidden ** 0.5
wo = torch.randn(q_heads * head_dim, hidden, device=dev) / hidden ** 0.5

# -- a paged KV cache owned by torch: [num_pages, 2, page_size, kv_heads, head_dim] ("NHD"), fp16
kv_cache = torch.zeros(num_pages, 2, page_size, kv_heads, head_dim, dtype=torch.float16, device=dev)
pages = [list(range(sum(-(-n // page_size) for n in prompt_lens[:b]), sum(-(-n // page_size) for n in prompt_lens[:b + 1])))
         for b in range(batch)]
history = [torch.randn(2, n, kv_heads, head_dim, device=dev).half() for n in prompt_lens]   # the prompts' K/V

def page_table(lens):
    """CSR page table for these lengths: indptr and last_page_len on the host, page ids on the model's device
    (plan() reads host arrays without a device sync; page ids on the device are copied in place)."""
    indptr = torch.tensor([0] + [sum(len(p) for p in pages[:b + 1]) for b in range(batch)], dtype=torch.int32)
    indices = torch.tensor([i for p in pages for i in p], dtype=torch.int32, device=dev)
    last = torch.tensor([(n - 1) % page_size + 1 for n in lens], dtype=torch.int32)
    return indptr, indices, last


def layer_step(x, lens, decode):
    """Project one new token per request, append its K/V with cuattn, attend with cuattn, project out."""
    q = (x @ wq).view(batch, q_heads, head_dim).half()
    k = (x @ wk).view(batch, kv_heads, head_dim).half()
    v = (x @ wv).view(batch, kv_heads, head_dim).half()
    indptr, indices, last = page_table(lens)
    positions = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device=dev)
    cuattn.append_paged_kv_cache(k, v, torch.arange(batch, dtype=torch.int32, device=dev), positions, kv_cache,
                                 indices, indptr.to(dev), last.to(dev), "NHD")
    out = decode.run(q, kv_cache)                       # a torch tensor, written by cuattn in place of allocation
    for b in range(batch):
        history[b] = torch.cat([history[b], torch.stack([k[b:b + 1], v[b:b + 1]])], dim=1)
    return q, out, out.reshape(batch, -1).float() @ wo


def reference(q, lens):
    """torch SDPA in float32 over each request's K/V history (GQA by repeating the KV heads)."""
    rows = []
    for b in range(batch):
        k, v = (t[:lens[b]].float().repeat_interleave(q_heads // kv_heads, dim=1).transpose(0, 1) for t in history[b])
        rows.append(torch.nn.functional.scaled_dot_product_attention(q[b].float()[:, None], k, v)[:, 0])
    return torch.stack(rows)


# -- the prompts' K/V into the cache: cuattn.append_paged_kv_cache with each token's request and position
indptr, indices, last = page_table(prompt_lens)
append_indptr = torch.tensor([0] + [sum(prompt_lens[:b + 1]) for b in range(batch)], dtype=torch.int32, device=dev)
batch_indices, positions = cuattn.get_batch_indices_positions(
    append_indptr, torch.tensor(prompt_lens, dtype=torch.int32, device=dev), sum(prompt_lens))
cuattn.append_paged_kv_cache(torch.cat([h[0] for h in history]), torch.cat([h[1] for h in history]), batch_indices,
                             positions, kv_cache, indices, indptr.to(dev), last.to(dev), "NHD")

# -- 1. eager: plan once per step, run per layer; on a side stream when on the GPU (cuattn follows
#       torch.cuda.current_stream(), so no synchronization is needed around the call)
lens = [n + 1 for n in prompt_lens]
decode = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
indptr, indices, last = page_table(lens)
decode.plan(indptr, indices, last, q_heads, kv_heads, head_dim, page_size, q_data_type=torch.float16)
x = torch.randn(batch, hidden, device=dev)
stream = torch.cuda.Stream() if gpu else None
if gpu:
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        q, out, y = layer_step(x, lens, decode)
    torch.cuda.current_stream().wait_stream(stream)
else:
    q, out, y = layer_step(x, lens, decode)
err = (out.float() - reference(q, lens)).abs().max().item()
print(f"eager decode step on {dev.type}: out is a torch.Tensor {tuple(out.shape)} {out.dtype} on {out.device}; "
      f"layer output {tuple(y.shape)}; max |out - torch SDPA| = {err:.1e}")
assert isinstance(out, torch.Tensor) and err < 1e-2

if not gpu:
    print("CUDA graph: skipped (needs a GPU; pass --gpu)")
    sys.exit(0)

# -- 2. CUDA graph: a wrapper with use_cuda_graph=True keeps its device buffers at fixed addresses, so one
#       captured run() replays after each step's plan(). Static input/output tensors, as torch graphs need.
graph_decode = cuattn.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD", use_cuda_graph=True)
graph_decode.plan(*page_table(lens), q_heads, kv_heads, head_dim, page_size, q_data_type=torch.float16)
q_static = q.clone()
out_static = torch.empty_like(q_static)
with torch.cuda.stream(stream):
    graph_decode.run(q_static, kv_cache, out=out_static)       # warm-up: compiles, sets kernel attributes
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    graph_decode.run(q_static, kv_cache, out=out_static)
for step in range(3):
    lens = [n + 1 for n in lens]                              # one more token each (still on the same pages)
    x = torch.randn(batch, hidden, device=dev)
    q = (x @ wq).view(batch, q_heads, head_dim).half()
    k = (x @ wk).view(batch, kv_heads, head_dim).half()
    v = (x @ wv).view(batch, kv_heads, head_dim).half()
    indptr, indices, last = page_table(lens)
    cuattn.append_paged_kv_cache(k, v, torch.arange(batch, dtype=torch.int32, device=dev),
                                 torch.tensor([n - 1 for n in lens], dtype=torch.int32, device=dev), kv_cache,
                                 indices, indptr.to(dev), last.to(dev), "NHD")
    for b in range(batch):
        history[b] = torch.cat([history[b], torch.stack([k[b:b + 1], v[b:b + 1]])], dim=1)
    graph_decode.plan(indptr, indices, last, q_heads, kv_heads, head_dim, page_size, q_data_type=torch.float16)
    q_static.copy_(q)
    graph.replay()
    err = (out_static.float() - reference(q, lens)).abs().max().item()
    print(f"CUDA graph replay, step {step}: lengths {lens}, max |out - torch SDPA| = {err:.1e}")
    assert err < 1e-2
