"""Context-parallel decode (cuattn.distributed): latency against world size.

Each request's KV (batch x kv_len tokens, 32:8 heads, head_dim 128, fp16, page 16) is sharded
round-robin in page-size blocks; a rank holds only its own pages (random page order). Per row:

- local µs: BatchDecodeWithPagedKVCacheWrapper.run over the rank's shard alone (at world size 1:
  the single-GPU decode of the whole KV);
- total µs: ContextParallelDecodeWrapper.run (local decode, all-gather of out + LSE, merge);
- exch+merge µs = total - local (the issue's target: <= 15 µs per layer);
- speedup = local µs at world size 1 / total µs (when world size 1 is in the same run).

Modes. Default: one process per GPU for each --world-size (spawned with multiprocessing, an NCCL
unique id made by the parent: cuattn.distributed.spawn_nccl); world size 1 runs in this process
(LocalCommunicator: nothing to exchange; the merge of one state remains). --simulate N..: on one
GPU, the local decode of one shard of N and the merge of N states, the exchange left out (not
measurable on one GPU); the N=1 row is the unsharded decode.

Timing: CUDA events around each call, 256 MB L2 read-flush before each, 5 warm-up + --reps timed,
median; with NCCL the ranks meet at a 1-element all-gather (outside the events) before each timed
call, and a row reports the largest median over ranks (the ranks wait for each other in the
exchange, so the slowest rank sets the step's latency).

    python benchmarks/bench_context_parallel.py [--world-size 1 2 4] [--simulate 1 2 4]
        [--batch 1 8] [--kv-len 131072 524288 1048576] [--reps 30] [--check] [--out results.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy as cp  # noqa: E402

import cuattn  # noqa: E402
from cuattn import distributed as dist  # noqa: E402
from bench_decode import fill_random, l2_flush, page_table, time_events  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16


class NoExchange(dist.Communicator):
    """--simulate: rank 0 of ``world_size`` on one GPU; the gathered buffer is left as it is (the
    merge still reads ``world_size`` states), so the timing leaves the exchange out."""

    def __init__(self, world_size):
        self.rank, self.world_size = 0, world_size

    def all_gather(self, send, recv, stream):
        pass

    def gather_host(self, values):
        return np.tile(np.asarray(values, np.int64), (self.world_size, 1))


def shard_table(indptr, indices, lpl, world, rank):
    """Rank ``rank``'s page table of a round-robin sharding in page-size blocks: page j of each
    request belongs to rank j % world (KVSharding(world, "round_robin", page_size))."""
    ptr, ids, last = [0], [], []
    for b in range(len(lpl)):
        pages = indices[indptr[b]:indptr[b + 1]]
        mine = pages[rank::world]
        ids.append(mine)
        ptr.append(ptr[-1] + len(mine))
        last.append(0 if not len(mine) else int(lpl[b]) if (len(pages) - 1) % world == rank else PS)
    return np.asarray(ptr, np.int32), np.concatenate(ids).astype(np.int32), np.asarray(last, np.int32)


def check(comm, world, rank):
    """Every rank holds the same random full KV (same seed); its local table names its own pages.
    Returns the max relative error of the merged output against plain decode over all pages."""
    indptr, indices, lpl = page_table(2, 5000, PS, seed=3)
    cache = cp.empty((len(indices), 2, PS, HKV, D), cp.uint16)
    fill_random(cache, "float16", 3)
    q = cp.empty((2, HQ, D), cp.uint16)
    fill_random(q, "float16", 4)
    cache, q = cache.view(cp.float16), q.view(cp.float16)
    full = cuattn.BatchDecodeWithPagedKVCacheWrapper()
    full.plan(indptr, indices, lpl, HQ, HKV, D, PS)
    ref = cp.asnumpy(full.run(q, cache)).astype(np.float64)
    w = dist.ContextParallelDecodeWrapper(comm)
    w.plan(*shard_table(indptr, indices, lpl, world, rank), HQ, HKV, D, PS, world_size=world)
    out = cp.asnumpy(w.run(q, cache)).astype(np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def measure(comm, world, rank, batch, kv_len, reps, flush, barrier):
    """(local µs, total µs) of this rank for one shape."""
    local_len = int(dist.KVSharding(world, "round_robin", PS).local_len([kv_len], rank)[0])
    indptr, indices, lpl = page_table(batch, local_len, PS, seed=rank)
    cache = cp.empty((len(indices), 2, PS, HKV, D), cp.uint16)
    fill_random(cache, "float16", rank)
    q = cp.empty((batch, HQ, D), cp.uint16)
    fill_random(q, "float16", 1)          # the same q on every rank
    cache, q = cache.view(cp.float16), q.view(cp.float16)
    out = cp.empty_like(q)
    w = dist.ContextParallelDecodeWrapper(comm)
    w.plan(indptr, indices, lpl, HQ, HKV, D, PS, world_size=world)

    def before():
        flush()
        barrier()
    local = time_events(lambda: w._decode.run(q, cache, out=out), reps, before)
    total = time_events(lambda: w.run(q, cache, out=out), reps, before)
    cache = w = None     # (freed: not del, which ruff reads as the lambdas' names going undefined)
    cp.get_default_memory_pool().free_all_blocks()
    return local, total


def rank_main(rank, comm, world, args):
    """One rank's rows: [(batch, kv_len, local µs, total µs)], plus the check's error (None
    without --check or under NoExchange, whose merge reads states nobody sent)."""
    flush = l2_flush()
    if world > 1 and not isinstance(comm, NoExchange):
        token = np.zeros(1, np.int64)
        barrier = lambda: comm.gather_host(token)     # noqa: E731 - a 1-element all-gather, synced
    else:
        barrier = lambda: None                        # noqa: E731
    err = check(comm, world, rank) if args.check and not isinstance(comm, NoExchange) else None
    rows = [(b, n, *measure(comm, world, rank, b, n, args.reps, flush, barrier))
            for b in args.batch for n in args.kv_len]
    return rows, err


def print_env(args):
    props = cp.cuda.runtime.getDeviceProperties(0)
    nccl = "n/a"
    try:
        from cupy.cuda import nccl as _nccl
        if _nccl.available:
            nccl = str(_nccl.get_version())
    except ImportError:
        pass
    print(f"# {props['name'].decode()} x {cp.cuda.runtime.getDeviceCount()} visible, CUDA runtime "
          f"{cp.cuda.runtime.runtimeGetVersion()}, NVRTC {cp.cuda.nvrtc.getVersion()}, CuPy {cp.__version__}, "
          f"NCCL {nccl}, cuattn {cuattn.__version__}, {datetime.date.today()}")
    print(f"# {HQ}:{HKV} heads, head_dim {D}, fp16, page {PS}, round-robin page blocks; reps {args.reps}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, nargs="+", default=None,
                    help="world sizes to spawn (default: 1, 2, 4, ... up to the visible GPUs)")
    ap.add_argument("--simulate", type=int, nargs="+", default=None,
                    help="one GPU: shard counts to simulate (the exchange left out) instead of spawning")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--kv-len", type=int, nargs="+", default=[131072, 524288, 1048576])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--check", action="store_true", help="merged output vs plain decode over all pages first")
    ap.add_argument("--out", default=None, help="JSON path for the rows")
    args = ap.parse_args()
    print_env(args)
    results = {}
    if args.simulate:
        sizes = sorted(set([1] + args.simulate))
        for n in sizes:
            results[n] = [rank_main(0, NoExchange(n) if n > 1 else dist.LocalCommunicator(), n, args)]
            if args.check and n > 1:       # the check with every simulated rank (threads, one GPU)
                results[n][0] = (results[n][0][0], max(dist.run_simulated(n, lambda r, c: check(c, n, r))))
        label = "shards (simulated on one GPU, exchange not included)"
    else:
        gpus = cp.cuda.runtime.getDeviceCount()
        sizes = args.world_size or [w for w in (1, 2, 4, 8) if w <= gpus]
        if max(sizes) > gpus:
            sys.exit(f"--world-size {max(sizes)} needs {max(sizes)} GPUs, {gpus} visible")
        for n in sizes:
            if n == 1:
                results[n] = [rank_main(0, dist.LocalCommunicator(), 1, args)]
            else:
                results[n] = dist.spawn_nccl(n, rank_main, n, args)
        label = "world size (one process per GPU, NCCL)"
    print(f"# rows: {label}")
    print(f"{'batch':>5} {'kv_len':>8} {'world':>5} {'local_us':>9} {'total_us':>9} {'exch+merge':>10} {'speedup':>7}")
    rows = []
    for b_i, batch in enumerate(args.batch):
        for n_i, kv_len in enumerate(args.kv_len):
            i = b_i * len(args.kv_len) + n_i
            base = results[1][0][0][i][2] if 1 in results else None
            for n in sizes:
                local = max(r[0][i][2] for r in results[n])
                total = max(r[0][i][3] for r in results[n])
                speed = f"{base / total:7.2f}" if base else "      -"
                print(f"{batch:5d} {kv_len:8d} {n:5d} {local:9.1f} {total:9.1f} {total - local:10.1f} {speed}")
                rows.append(dict(batch=batch, kv_len=kv_len, world=n, local_us=local, total_us=total,
                                 exchange_merge_us=total - local, speedup=base / total if base else None))
    errs = {n: [r[1] for r in results[n]] for n in sizes if args.check}
    if args.check:
        print(f"# check (rel err of the merged output vs plain decode, per rank): {errs}")
        if max(e for v in errs.values() for e in v) > 1e-2:
            sys.exit("check failed")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(mode=label, rows=rows, check=errs), indent=1))


if __name__ == "__main__":
    main()
