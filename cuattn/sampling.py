"""Token sampling from probabilities or logits, with FlashInfer's names, argument order and semantics
(``flashinfer.sampling``, 0.6): plain, top-k, top-p, min-p and top-k + top-p sampling, the renorm and
mask ops, and chain speculative sampling.

Rows are float32 ``(batch, vocab_size)``. The kept set of a row is threshold-based and keeps ties: top-k
keeps every token at least as probable as the k-th most probable one; top-p keeps token i when the tokens
strictly more probable than i hold less than ``top_p`` of the row's mass (the nucleus); min-p keeps
``p >= min_p * max(p)``. ``filter_apply_order="top_k_first"`` (default) applies top-k, renormalizes, then
top-p on the renormalized probabilities; ``"joint"`` keeps the intersection of both sets on the original
probabilities. Rows need not be normalized (top-p is a fraction of the row's sum).

GPU (``kernels_cu/sampling.cu``): no sort over the vocabulary. A row goes to one CTA, or at small batches to a
group of CTAs that split it (``ctas_per_row``: up to 32 while batch * n fits the SMs; they merge row stats,
integer histograms and the race's argmin through a per-stream workspace that every launch leaves zeroed, so
CUDA graphs replay; the result does not depend on n). Plain sampling from probabilities reads the row once (the
race needs no row stats). Top-k with k <= 1024 on one CTA per row takes one extra pass: the k-th largest of
the threads' maxima bounds the threshold from below, the few elements above it are sorted in shared memory,
and top-p within them comes from one warp's prefix sums. Other thresholds (top-p alone, k > 1024, heavy ties,
groups of CTAs) come from a radix select over the float bits: 3 passes
(11 + 11 + 10 key bits), each a shared-memory histogram of counts and masses, then a block scan. Top-p
masses are fixed point (``fixed_mass``: ``floor(w * 2**(S - E))``, exact uint64 sums), and the NumPy path
defines its threshold by the same integers, so both paths keep the same tokens. The token is drawn by an exponential
race, ``argmin E_i / p_i`` over the kept set, with ``E_i`` from Philox4x32-10 keyed by ``seed`` and
counted by ``(element, output row, offset)``. Draws are therefore reproducible: the same (seed, offset) give
the same tokens on every run, block size and GPU; every kernel is deterministic, so ``deterministic`` is
accepted for FlashInfer's signature and changes nothing. The NumPy path draws from the same random stream
(bit-identical Philox). Logits: values are float32 ``exp(x - max)`` on both paths, and the last bit of the exp
may differ (rare boundary tokens).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrays, jit, plan

_SOURCE = "sampling.cu"
_LOGITS, _JOINT, _TOP_K, _TOP_P, _MIN_P = 1, 2, 4, 8, 16            # flags of cuattn_sample
_TAG_RACE, _TAG_ACCEPT, _TAG_RECOUNT = 0, 1, 2                        # Philox streams (counter word 3)
_ORDERS = ("top_k_first", "joint")
_MAX_VOCAB = 2**31 - 1
_host_rng = np.random.default_rng()                                   # seeds when none is given
_NBINS, _MAX_SPLITS = 2048, 32                                        # sampling.cu's NBINS, MAX_SPLITS
_WS_ROW_BYTES = 3 * _NBINS * 16 + _MAX_SPLITS * 16 + 16               # sizeof(RowWs): sampling_group.cuh asserts it
_MIN_CHUNK = 4096                                                     # elements a CTA of a group reads at least
_ctas_per_row: int | None = None                                      # set_ctas_per_row; None: automatic
_workspaces: dict = {}                                                # (device, stream handle) -> zeroed buffer


@dataclass(frozen=True)
class SamplingSpec:
    """The compiled sampling.cu: cuattn_sample, the three renorm/mask entries and
    cuattn_chain_speculative. Vocabulary, batch and parameters are run-time arguments."""
    block: int = 1024         # threads of the one CTA per row
    source = _SOURCE

    @property
    def name(self) -> str:    # "sampling_b1024"
        return f"sampling_b{self.block}"

    def defines(self) -> tuple[str, ...]:
        return (f"-DBLOCK={self.block}", f"-DMAX_SPLITS={_MAX_SPLITS}", f"-DWS_ROW_BYTES={_WS_ROW_BYTES}")


def shipped_specs() -> list[SamplingSpec]:
    return [SamplingSpec()]


_SPEC = SamplingSpec()

_COMMON_DOC = """
    indices : int32 or int64 array, shape (batch,), optional
        Output ``b`` samples from row ``indices[b]`` (rows shared by several outputs); default: row ``b``.
        Checked on the NumPy path; on the GPU an index outside the rows gives token -1.
    deterministic : bool
        Accepted for FlashInfer's signature: every cuattn sampling kernel is deterministic.
    generator : numpy.random.Generator or torch.Generator, optional
        Source of the seed when ``seed`` is None (a CUDA torch.Generator is read and advanced as FlashInfer
        does: its (seed, offset) state). Neither: a fresh seed from the OS.
    check_nan : bool
        Raise ValueError if the input holds NaN (a device sync on the GPU).
    seed, offset : int, optional
        Philox key and offset in [0, 2**64); the same values give the same tokens. ``offset`` defaults to 0.
    stream : optional
        CUDA stream to launch on (default: the caller framework's current stream).

    Returns
    -------
    samples : int32 array, shape (batch,), same framework and device as the input

    Raises
    ------
    TypeError
        If the input is not float32, or a parameter array has a non-numeric dtype.
    ValueError
        If shapes disagree, a parameter is out of range (top_k < 1, top_p outside (0, 1], min_p outside
        [0, 1]; checked for scalars and host arrays, not for GPU arrays, which would need a sync), an index
        is out of range (NumPy path), or the input holds NaN with ``check_nan``.
"""


def _doc(f):
    f.__doc__ = f.__doc__.replace("    {common}\n", _COMMON_DOC.strip("\n") + "\n")
    return f


# ---------------------------------------------------------------------------- public API


def set_ctas_per_row(n: int | None) -> None:
    """How many CTAs share one row on the GPU (all sampling and renorm/mask ops except chain speculative).

    None (default): automatic, ``ctas_per_row(batch, vocab_size, num_sms)``: one CTA per row when the batch
    fills the GPU, else up to 32 (each reading at least 4096 elements). An int fixes it (for tuning and
    tests); a launch with ``batch * n`` above the GPU's SM count raises ValueError (the CTAs of a row wait for
    each other, so they must all be resident). Tokens and outputs do not depend on it.
    """
    global _ctas_per_row
    if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= _MAX_SPLITS):
        raise ValueError(f"set_ctas_per_row: n must be None or an int in [1, {_MAX_SPLITS}], got {n!r}")
    _ctas_per_row = None if n is None else int(n)


def ctas_per_row(batch: int, vocab: int, num_sms: int) -> int:
    """The automatic CTAs per row: the most (<= 32) with ``batch * n <= num_sms`` and at least 4096 elements
    per CTA; 1 when the batch alone fills the SMs."""
    return max(1, min(_MAX_SPLITS, num_sms // max(batch, 1), vocab // _MIN_CHUNK))


@_doc
def sampling_from_probs(probs, indices=None, deterministic: bool = True, generator=None, check_nan: bool = False,
                        seed: int | None = None, offset: int | None = None, *, stream: Any = None):
    """Sample one token per row from probabilities.

    Parameters
    ----------
    probs : float32 array, shape (num_rows, vocab_size); last dimension contiguous
        NumPy (or CPU torch/JAX) runs the reference path; CuPy, PyTorch CUDA or JAX GPU the kernel.
    {common}
    """
    return _sample("sampling_from_probs", probs, "probs", 0, None, None, None, indices, generator, check_nan,
                   seed, offset, stream)


@_doc
def sampling_from_logits(logits, indices=None, deterministic: bool = True, generator=None, check_nan: bool = False,
                         seed: int | None = None, offset: int | None = None, *, stream: Any = None):
    """Sample one token per row from ``softmax(logits)`` (the softmax is never materialized).

    Parameters
    ----------
    logits : float32 array, shape (num_rows, vocab_size); last dimension contiguous
    {common}
    """
    return _sample("sampling_from_logits", logits, "logits", _LOGITS, None, None, None, indices, generator,
                   check_nan, seed, offset, stream)


@_doc
def top_p_sampling_from_probs(probs, top_p, indices=None, deterministic: bool = True, generator=None,
                              check_nan: bool = False, seed: int | None = None, offset: int | None = None, *,
                              stream: Any = None):
    """Top-p (nucleus) sampling from probabilities.

    Parameters
    ----------
    probs : float32 array, shape (num_rows, vocab_size)
    top_p : float in (0, 1], or float32 array of shape (batch,) (one per request)
    {common}
    """
    return _sample("top_p_sampling_from_probs", probs, "probs", _TOP_P, None, top_p, None, indices, generator,
                   check_nan, seed, offset, stream)


@_doc
def top_k_sampling_from_probs(probs, top_k, indices=None, deterministic: bool = True, generator=None,
                              check_nan: bool = False, seed: int | None = None, offset: int | None = None, *,
                              stream: Any = None):
    """Top-k sampling from probabilities (ties with the k-th largest are kept).

    Parameters
    ----------
    probs : float32 array, shape (num_rows, vocab_size)
    top_k : int >= 1, or int32/int64 array of shape (batch,); k >= vocab_size keeps every token
    {common}
    """
    return _sample("top_k_sampling_from_probs", probs, "probs", _TOP_K, top_k, None, None, indices, generator,
                   check_nan, seed, offset, stream)


@_doc
def min_p_sampling_from_probs(probs, min_p, indices=None, deterministic: bool = True, generator=None,
                              check_nan: bool = False, seed: int | None = None, offset: int | None = None, *,
                              stream: Any = None):
    """Min-p sampling from probabilities: tokens with ``p >= min_p * max(p)``.

    Parameters
    ----------
    probs : float32 array, shape (num_rows, vocab_size)
    min_p : float in [0, 1], or float32 array of shape (batch,)
    {common}
    """
    return _sample("min_p_sampling_from_probs", probs, "probs", _MIN_P, None, None, min_p, indices, generator,
                   check_nan, seed, offset, stream)


@_doc
def top_k_top_p_sampling_from_probs(probs, top_k, top_p, indices=None, filter_apply_order: str = "top_k_first",
                                    deterministic: bool = True, generator=None, check_nan: bool = False,
                                    seed: int | None = None, offset: int | None = None, *, stream: Any = None):
    """Top-k and top-p sampling from probabilities.

    Parameters
    ----------
    probs : float32 array, shape (num_rows, vocab_size)
    top_k : int >= 1, or int32/int64 array of shape (batch,)
    top_p : float in (0, 1], or float32 array of shape (batch,)
    filter_apply_order : "top_k_first" or "joint"
        "top_k_first": top-k, renormalize, then top-p on the renormalized probabilities; "joint": the
        tokens both filters keep on the original probabilities.
    {common}
    """
    flags = _TOP_K | _TOP_P | _order_flag("top_k_top_p_sampling_from_probs", filter_apply_order)
    return _sample("top_k_top_p_sampling_from_probs", probs, "probs", flags, top_k, top_p, None, indices,
                   generator, check_nan, seed, offset, stream)


@_doc
def top_k_top_p_sampling_from_logits(logits, top_k, top_p, indices=None, filter_apply_order: str = "top_k_first",
                                     deterministic: bool = True, generator=None, check_nan: bool = False,
                                     seed: int | None = None, offset: int | None = None, *, stream: Any = None):
    """Top-k and top-p sampling from ``softmax(logits)``, fused (no probabilities are written).

    Parameters
    ----------
    logits : float32 array, shape (num_rows, vocab_size)
    top_k : int >= 1, or int32/int64 array of shape (batch,)
    top_p : float in (0, 1], or float32 array of shape (batch,)
    filter_apply_order : "top_k_first" or "joint", as :func:`top_k_top_p_sampling_from_probs`
    {common}
    """
    flags = _LOGITS | _TOP_K | _TOP_P | _order_flag("top_k_top_p_sampling_from_logits", filter_apply_order)
    return _sample("top_k_top_p_sampling_from_logits", logits, "logits", flags, top_k, top_p, None, indices,
                   generator, check_nan, seed, offset, stream)


def top_k_renorm_probs(probs, top_k, *, stream: Any = None):
    """Keep the top-k probabilities of each row (ties kept), zero the rest, renormalize.

    Parameters
    ----------
    probs : float32 array, shape (batch, vocab_size)
    top_k : int >= 1, or int32/int64 array of shape (batch,)

    Returns
    -------
    renorm_probs : float32 array, shape (batch, vocab_size), same framework

    Raises
    ------
    TypeError, ValueError
        As the sampling functions.
    """
    return _renorm("top_k_renorm_probs", probs, "probs", 0, top_k, None, stream)


def top_p_renorm_probs(probs, top_p, *, stream: Any = None):
    """Keep each row's nucleus (top-p set, ties kept), zero the rest, renormalize.

    Parameters
    ----------
    probs : float32 array, shape (batch, vocab_size)
    top_p : float in (0, 1], or float32 array of shape (batch,)

    Returns
    -------
    renorm_probs : float32 array, shape (batch, vocab_size), same framework
    """
    return _renorm("top_p_renorm_probs", probs, "probs", 1, None, top_p, stream)


def top_k_mask_logits(logits, top_k, *, stream: Any = None):
    """Keep the top-k logits of each row (ties kept), set the rest to -inf.

    Parameters
    ----------
    logits : float32 array, shape (batch, vocab_size)
    top_k : int >= 1, or int32/int64 array of shape (batch,)

    Returns
    -------
    masked_logits : float32 array, shape (batch, vocab_size), same framework
    """
    return _renorm("top_k_mask_logits", logits, "logits", 2, top_k, None, stream)


def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, maybe_output_accepted_token_num=None,
                               maybe_output_emitted_draft_token_num=None, deterministic: bool = True,
                               generator=None, seed: int | None = None, offset: int | None = None, *,
                               stream: Any = None):
    """Speculative sampling of a chain of draft tokens (Chen et al. 2023), FlashInfer's semantics.

    Draft token i of request b is accepted while ``u * draft_probs[b, i, d] < target_probs[b, i, d]``
    (u uniform); at the first rejection a token is drawn from ``relu(target - draft)`` at that position and
    the later slots are -1; when all are accepted a bonus token is drawn from ``target_probs[b, n]``.

    Parameters
    ----------
    draft_probs : float32 array, shape (batch, num_speculate_tokens, vocab_size), contiguous
    draft_token_ids : int32 array, shape (batch, num_speculate_tokens), contiguous (ids are not checked on
        the GPU)
    target_probs : float32 array, shape (batch, num_speculate_tokens + 1, vocab_size), contiguous
    maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num : int32 array, shape (batch,),
        optional; the counts are added to them in place (else to new zero arrays)
    deterministic, generator, seed, offset, stream
        As :func:`sampling_from_probs`.

    Returns
    -------
    output_token_ids : int32 array, shape (batch, num_speculate_tokens + 1); -1 after the emitted tokens
    output_accepted_token_num : int32 array, shape (batch,): tokens a draft-by-draft test would accept
        (emitted ones plus later positions accepted with a fresh uniform)
    output_emitted_draft_token_num : int32 array, shape (batch,): draft tokens emitted (the bonus or
        resampled token not counted)
    """
    fn = "chain_speculative_sampling"
    acc_in, emi_in = maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num
    arrays.writable(acc_in, "maybe_output_accepted_token_num", fn)
    arrays.writable(emi_in, "maybe_output_emitted_draft_token_num", fn)
    named = {"draft_probs": draft_probs, "draft_token_ids": draft_token_ids, "target_probs": target_probs,
             "maybe_output_accepted_token_num": acc_in, "maybe_output_emitted_draft_token_num": emi_in}
    ctx = arrays.context_of(fn, named, stream)
    get = (lambda a, n: arrays.device_tensor(a, n, fn)) if ctx.on_gpu else (lambda a, n: arrays.host_array(a, n, fn))
    t = {n: get(a, n) for n, a in named.items() if a is not None}
    batch, n, vocab = _check_speculative(fn, t)
    s, off = _seed_offset(fn, seed, offset, generator, batch * (n + 1) * 4)
    if not ctx.on_gpu:
        ids, acc, emi = _np_chain_speculative(t["draft_probs"], t["draft_token_ids"], t["target_probs"], s, off)
        results = []
        for given, name, val in ((acc_in, "maybe_output_accepted_token_num", acc),
                                 (emi_in, "maybe_output_emitted_draft_token_num", emi)):
            if given is None:
                results.append(arrays.export(ctx, val))
            else:
                t[name][...] += val
                results.append(given)
        return (arrays.export(ctx, ids), *results)
    out = arrays.empty(ctx, (batch, n + 1), np.int32)
    counts = []
    for given, name in ((acc_in, "maybe_output_accepted_token_num"), (emi_in, "maybe_output_emitted_draft_token_num")):
        if given is None:
            given = arrays.empty(ctx, (batch,), np.int32)
            arrays.fill(ctx, given, 0, name, fn)
        counts.append(given)
    if batch:
        tc = [arrays.device_tensor(c, "counts", fn) for c in counts]
        launch = jit.get_launcher(_SPEC, "cuattn_chain_speculative", ctx.device, "ppp" "ii" "qq" "ppp")
        launch((batch,), _SPEC.block, ctx.stream, t["draft_probs"].ptr, t["target_probs"].ptr,
               t["draft_token_ids"].ptr, n, vocab, _signed(s), _signed(off),
               arrays.device_tensor(out, "out", fn).ptr, tc[0].ptr, tc[1].ptr)
    return arrays.export(ctx, out), arrays.export(ctx, counts[0]), arrays.export(ctx, counts[1])


# ---------------------------------------------------------------------------- implementation


def _order_flag(fn: str, order: str) -> int:
    if order not in _ORDERS:
        raise ValueError(f"{fn}: filter_apply_order must be 'top_k_first' or 'joint', got {order!r}")
    return _JOINT if order == "joint" else 0


def _signed(v: int) -> int:
    """A value in [0, 2**64) as the int64 of the same bits (the launcher packs int64)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _seed_offset(fn: str, seed, offset, generator, increment: int) -> tuple[int, int]:
    for name, v in (("seed", seed), ("offset", offset)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < 1 << 64):
            raise ValueError(f"{fn}: {name} must be an int in [0, 2**64), got {v!r}")
    if seed is not None:
        return int(seed), int(offset or 0)
    if generator is None:
        return int(_host_rng.integers(0, 1 << 63)), int(offset or 0)
    if isinstance(generator, np.random.Generator):
        return int(generator.integers(0, 1 << 63)), int(offset or 0)
    if type(generator).__module__.startswith("torch"):
        import torch
        if generator.device.type == "cuda":      # FlashInfer's get_seed_and_offset: (seed, offset) state, advanced
            state = generator.get_state()
            s, off = (int(v) for v in state.view(torch.int64))
            generator.set_state(torch.tensor([s, off + (increment + 3) // 4 * 4], dtype=torch.int64).view(torch.uint8))
            return s % (1 << 64), off % (1 << 64)
        return int(torch.randint(0, 1 << 62, (1,), generator=generator).item()), int(offset or 0)
    raise TypeError(f"{fn}: generator must be a numpy.random.Generator or a torch.Generator, "
                    f"got {type(generator).__name__}")


def _check_input(fn: str, name: str, shape, dtype) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"{fn}: {name} must have shape (batch, vocab_size), got {tuple(shape)}")
    if np.dtype(dtype) != np.float32:
        raise TypeError(f"{fn}: {name} must be float32, got {np.dtype(dtype)}")
    if not 1 <= shape[1] <= _MAX_VOCAB:
        raise ValueError(f"{fn}: vocab_size (the last dimension of {name}) must be in [1, 2**31), got {shape[1]}")
    return shape[0], shape[1]


def _param(fn: str, name: str, value, batch: int, ctx, integer: bool):
    """(device pointer or 0, scalar, host array or None) for a per-request parameter."""
    lo, hi, lo_open = (1, None, False) if integer else ((0.0, 1.0, True) if name == "top_p" else (0.0, 1.0, False))
    want = np.int32 if integer else np.float32
    rng = "an int >= 1" if integer else f"a float in {'(' if lo_open else '['}0, 1]"

    def bad(v):
        v = np.asarray(v)
        return v < lo if integer else ((v <= lo) if lo_open else (v < lo)) | (v > hi) | np.isnan(v)
    if isinstance(value, (numbers.Number, np.generic)) and not isinstance(value, bool):
        if integer and not isinstance(value, numbers.Integral):
            raise TypeError(f"{fn}: {name} must be an int or an integer array, got {value!r}")
        if bad(value):
            raise ValueError(f"{fn}: {name} must be {rng}, got {value}")
        v = int(min(value, _MAX_VOCAB)) if integer else float(value)
        return 0, v, None
    on_device = not isinstance(value, (list, tuple)) and arrays.is_device_array(value, name, fn)
    if on_device:
        t = arrays.device_tensor(value, name, fn)
        shape, dtype = t.shape, np.dtype(t.dtype)
    else:
        a = np.asarray(value) if isinstance(value, (list, tuple)) else arrays.host_array(value, name, fn)
        shape, dtype = a.shape, a.dtype
    if tuple(shape) != (batch,):
        raise ValueError(f"{fn}: {name} must be a scalar or have shape (batch,) = ({batch},), got {tuple(shape)}")
    if (integer and dtype.kind not in "iu") or (not integer and dtype.kind != "f"):
        raise TypeError(f"{fn}: {name} must be {'an integer' if integer else 'a float'} array, got {dtype}")
    if not on_device:
        if a.size and np.any(bad(a)):
            i = int(np.argmax(bad(a)))
            raise ValueError(f"{fn}: {name} must be {rng} for every request, got {a[i]} at index {i}")
        host = np.minimum(a, _MAX_VOCAB).astype(want) if integer else a.astype(want)
        if not ctx.on_gpu:
            return 0, 0, host
        cp = arrays.cupy_module()
        with cp.cuda.Device(ctx.device), ctx.stream:
            dev = cp.asarray(host)
        return dev, 0, None
    view = arrays.cupy_view(t)
    if view.dtype != want or not view.flags.c_contiguous:
        cp = arrays.cupy_module()
        with cp.cuda.Device(ctx.device), ctx.stream:
            view = cp.ascontiguousarray(view, dtype=want)
    return view, 0, None


def _group(fn: str, batch: int, vocab: int, ctx, top_k: int = 0) -> tuple[int, int]:
    """(CTAs per row, workspace pointer or 0) of a launch over ``batch`` rows. ``top_k``: 1 for a sampling op
    with a top-k filter, 2 for top-k renorm / mask. Automatic choice, from an H100 A/B (vocab 128256,
    benchmarks/results/ops_H100_2026-11-25_session11.md): groups of CTAs for every op without top-k
    (top_p_sampling_from_probs batch 1: 55 us vs 156 alone, batch 64: 123 vs 159); top-k sampling ops keep
    one CTA per row (their one-CTA candidate path: top_k_top_p_sampling_from_logits 50 vs 76 us at batch 1, 53
    vs 125 at 64); top-k renorm / mask take groups of at least 8 (batch 1: 50 vs 73-86 us; at batch 64, 2 CTAs
    a row were slower: 111-118 vs 89-101)."""
    sms = plan.num_sms(ctx.device)
    if _ctas_per_row is None:
        splits = ctas_per_row(batch, vocab, sms)
        if top_k == 1 or (top_k == 2 and splits < 8):
            splits = 1
    else:
        splits = _ctas_per_row
        if splits > 1 and batch * splits > sms:
            raise ValueError(f"{fn}: set_ctas_per_row({splits}) needs batch * {splits} <= {sms} (the GPU's SMs: the "
                             f"CTAs of a row must be resident together), got batch {batch}")
    if splits == 1:
        return 1, 0
    return splits, _workspace(fn, ctx, sms // 2)


def _workspace(fn: str, ctx, rows: int) -> int:
    """A zeroed RowWs per row for groups of CTAs, one buffer per (device, stream) (a launch leaves it zeroed, so
    launches on one stream, and replays of a captured graph, reuse it; launches on two streams never share one)."""
    key = (ctx.device, ctx.stream.ptr)
    buf = _workspaces.get(key)
    if buf is None:
        if arrays.is_capturing(ctx.stream):
            raise RuntimeError(f"{fn}: the sampling workspace of this stream is allocated on its first GPU call, which "
                               f"must not be inside a CUDA graph capture; call once before capturing")
        cp = arrays.cupy_module()
        with cp.cuda.Device(ctx.device), ctx.stream:
            buf = _workspaces[key] = cp.zeros(rows * _WS_ROW_BYTES, np.uint8)
    return buf.data.ptr


def _ptr(v) -> int:
    return 0 if isinstance(v, int) else v.data.ptr


def _indices(fn: str, indices, num_rows: int, ctx):
    """(batch, tensor-or-array or None); NumPy indices are range-checked."""
    if indices is None:
        return num_rows, None
    t = arrays.device_tensor(indices, "indices", fn) if ctx.on_gpu else arrays.host_array(indices, "indices", fn)
    if len(t.shape) != 1 or np.dtype(t.dtype) not in (np.int32, np.int64):
        raise ValueError(f"{fn}: indices must be a 1-D int32 or int64 array, got shape {tuple(t.shape)} "
                         f"dtype {np.dtype(t.dtype)}")
    if not ctx.on_gpu and t.size and (t.min() < 0 or t.max() >= num_rows):
        raise ValueError(f"{fn}: indices must be in [0, {num_rows}) (rows of the input), "
                         f"got values in [{t.min()}, {t.max()}]")
    return t.shape[0], t


def _check_nan(fn: str, name: str, x, ctx) -> None:
    if ctx.on_gpu:
        cp = arrays.cupy_module()
        with cp.cuda.Device(ctx.device), ctx.stream:
            has = bool(cp.isnan(arrays.cupy_view(x)).any())
    else:
        has = bool(np.isnan(x).any())
    if has:
        raise ValueError(f"{fn}: {name} must not contain NaN (check_nan=True), got NaN")


def _sample(fn, x, name, flags, top_k, top_p, min_p, indices, generator, check_nan, seed, offset, stream):
    ctx = arrays.context_of(fn, {name: x, "indices": indices}, stream)
    t = arrays.device_tensor(x, name, fn) if ctx.on_gpu else arrays.host_array(x, name, fn)
    num_rows, vocab = _check_input(fn, name, t.shape, t.dtype)
    batch, idx = _indices(fn, indices, num_rows, ctx)
    k = _param(fn, "top_k", top_k, batch, ctx, True) if flags & _TOP_K else (0, 0, None)
    p = _param(fn, "top_p", top_p, batch, ctx, False) if flags & _TOP_P else (0, 1.0, None)
    m = _param(fn, "min_p", min_p, batch, ctx, False) if flags & _MIN_P else (0, 0.0, None)
    if check_nan:
        _check_nan(fn, name, t, ctx)
    s, off = _seed_offset(fn, seed, offset, generator, batch * 32)
    if not ctx.on_gpu:
        rows = np.arange(batch) if idx is None else idx.astype(np.int64)
        per = [np.full(batch, v[1]) if v[2] is None else v[2] for v in (k, p, m)]
        out = _np_sample(t, rows, flags, per[0], per[1], per[2], s, off)
        return arrays.export(ctx, out)
    out = arrays.empty(ctx, (batch,), np.int32)
    if batch:
        splits, ws = _group(fn, batch, vocab, ctx, int(bool(flags & _TOP_K)))
        launch = jit.get_launcher(_SPEC, "cuattn_sample", ctx.device, "pqii" "pi" "pi" "pf" "pf" "i" "qq" "p" "ip")
        launch((batch * splits,), _SPEC.block, ctx.stream, t.ptr, t.strides[0], vocab, num_rows,
               0 if idx is None else idx.ptr, int(idx is not None and np.dtype(idx.dtype) == np.int64),
               _ptr(k[0]), k[1], _ptr(p[0]), p[1], _ptr(m[0]), m[1], flags, _signed(s), _signed(off),
               arrays.device_tensor(out, "out", fn).ptr, splits, ws)
    return arrays.export(ctx, out)


def _renorm(fn, x, name, mode, top_k, top_p, stream):
    ctx = arrays.context_of(fn, {name: x}, stream)
    t = arrays.device_tensor(x, name, fn) if ctx.on_gpu else arrays.host_array(x, name, fn)
    rows, vocab = _check_input(fn, name, t.shape, t.dtype)
    k = _param(fn, "top_k", top_k, rows, ctx, True) if mode != 1 else (0, 0, None)
    p = _param(fn, "top_p", top_p, rows, ctx, False) if mode == 1 else (0, 1.0, None)
    if not ctx.on_gpu:
        per_k = np.full(rows, k[1]) if k[2] is None else k[2]
        per_p = np.full(rows, p[1]) if p[2] is None else p[2]
        x64 = t.astype(np.float64)
        if mode == 2:
            return arrays.export(ctx, np.where(_top_k_keep(x64, per_k), t, np.float32(-np.inf)).astype(np.float32))
        keep = _top_k_keep(x64, per_k) if mode == 0 else _top_p_keep(t, t, per_p)
        kept = np.where(keep, x64, 0.0)
        total = kept.sum(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            return arrays.export(ctx, (kept / total).astype(np.float32))
    out = arrays.empty(ctx, (rows, vocab), np.float32)
    if rows:
        entry = ("cuattn_top_k_renorm", "cuattn_top_p_renorm", "cuattn_top_k_mask_logits")[mode]
        splits, ws = _group(fn, rows, vocab, ctx, 0 if mode == 1 else 2)
        launch = jit.get_launcher(_SPEC, entry, ctx.device, "pqi" "pi" "pf" "pq" "ip")
        launch((rows * splits,), _SPEC.block, ctx.stream, t.ptr, t.strides[0], vocab, _ptr(k[0]), k[1], _ptr(p[0]),
               p[1], arrays.device_tensor(out, "out", fn).ptr, vocab, splits, ws)
    return arrays.export(ctx, out)


def _check_speculative(fn, t) -> tuple[int, int, int]:
    d, ids, tg = t["draft_probs"], t["draft_token_ids"], t["target_probs"]
    if len(d.shape) != 3:
        raise ValueError(f"{fn}: draft_probs must have shape (batch, num_speculate_tokens, vocab_size), "
                         f"got {tuple(d.shape)}")
    batch, n, vocab = d.shape
    for nm, a, shape in (("target_probs", tg, (batch, n + 1, vocab)), ("draft_token_ids", ids, (batch, n))):
        if tuple(a.shape) != shape:
            raise ValueError(f"{fn}: {nm} must have shape {shape}, got {tuple(a.shape)}")
    for nm in ("draft_probs", "target_probs"):
        if np.dtype(t[nm].dtype) != np.float32:
            raise TypeError(f"{fn}: {nm} must be float32, got {np.dtype(t[nm].dtype)}")
    for nm in ("draft_token_ids", "maybe_output_accepted_token_num", "maybe_output_emitted_draft_token_num"):
        if nm in t and np.dtype(t[nm].dtype) != np.int32:
            raise TypeError(f"{fn}: {nm} must be int32, got {np.dtype(t[nm].dtype)}")
    for nm in ("maybe_output_accepted_token_num", "maybe_output_emitted_draft_token_num"):
        if nm in t and tuple(t[nm].shape) != (batch,):
            raise ValueError(f"{fn}: {nm} must have shape ({batch},), got {tuple(t[nm].shape)}")
    for nm, a in t.items():
        contiguous = a.is_contiguous() if isinstance(a, arrays.Tensor) else a.flags.c_contiguous
        if not contiguous:
            raise ValueError(f"{fn}: {nm} must be contiguous")
    if isinstance(ids, np.ndarray) and ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"{fn}: draft_token_ids must be in [0, {vocab}), got values in [{ids.min()}, {ids.max()}]")
    return batch, n, vocab


# ---------------------------------------------------------------------------- NumPy path


_M0, _M1, _W0, _W1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57), np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LOW = np.uint64(0xFFFFFFFF)


def philox4x32(c0, c1, c2, c3, k0: int, k1: int):
    """Philox4x32-10 of counters (broadcast uint32 arrays) under key (k0, k1): four uint32 arrays,
    bit-identical to ``philox`` in common/sampling_math.cuh."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) for c in np.broadcast_arrays(c0, c1, c2, c3))
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(10):
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _LOW, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _LOW
        k0, k1 = (k0 + _W0) & _LOW, (k1 + _W1) & _LOW
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def _random_bits(rows: np.ndarray, vocab: int, seed: int, offset: int, tag: int) -> np.ndarray:
    """uint32 (len(rows), vocab): the bits element i of output row r draws (Philox group i // 4, word i % 4)."""
    groups = np.arange((vocab + 3) // 4, dtype=np.uint64)[None, :]
    r = np.asarray(rows, np.uint64)[:, None]
    words = philox4x32(groups, r, offset & 0xFFFFFFFF, ((offset >> 32) ^ (tag << 24)) & 0xFFFFFFFF,
                       seed & 0xFFFFFFFF, seed >> 32)
    return np.stack(words, axis=-1).reshape(len(rows), 4 * groups.shape[1])[:, :vocab]


def _uniform(bits: np.ndarray) -> np.ndarray:
    u = bits.astype(np.float32) * np.float32(2.0 ** -32)
    return np.clip(u, np.float32(2.0 ** -33), np.float32(1 - 2.0 ** -24))


def _race(values32: np.ndarray, keep: np.ndarray, rows: np.ndarray, seed: int, offset: int) -> np.ndarray:
    """argmin over kept i of E_i / value_i (E exponential from the Philox stream); ties: lower index."""
    e = -np.log1p(-_uniform(_random_bits(rows, values32.shape[1], seed, offset, _TAG_RACE)))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        score = np.where(keep, e / values32, np.float32(np.inf))
    score = np.where(np.isnan(score), np.float32(np.inf), score)
    tok = np.argmin(score, axis=1)
    none = ~np.isfinite(score[np.arange(len(tok)), tok])
    tok[none] = np.argmax(keep[none], axis=1)          # no finite score: the first kept token, as the kernel
    return tok.astype(np.int32)


def _top_k_keep(w: np.ndarray, k: np.ndarray) -> np.ndarray:
    """w >= the k-th largest of its row (every token when k >= vocab)."""
    vocab = w.shape[1]
    kk = np.clip(np.asarray(k, np.int64), 1, vocab)
    kth = -np.sort(-w, axis=1)[np.arange(len(w)), kk - 1]
    return w >= kth[:, None]


def fixed_mass(w: np.ndarray) -> np.ndarray:
    """The fixed-point masses top-p compares, as sampling.cu: uint64 ``floor(w * 2**(S - E))`` for w > 0
    (0 else), E the exponent of the row's largest w (its max in [2**E, 2**(E+1))), S = 62 - bit_length(vocab)
    so that a row's sum stays below 2**63. Exact integers: sums do not depend on the order of addition."""
    w64 = np.asarray(w, np.float32).astype(np.float64)
    pos = np.where(w64 > 0, w64, 0.0)
    e = np.frexp(pos.max(axis=1))[1] - 1
    s = 62 - w64.shape[1].bit_length()
    return np.floor(np.ldexp(pos, (s - e)[:, None].astype(np.int32))).astype(np.uint64)


def _top_p_keep(x: np.ndarray, w: np.ndarray, p) -> np.ndarray:
    """Tokens at or above the largest x = T whose tokens (x >= T) hold at least the target mass
    ``min(ceil(fp64(total) * fp64(p)), total)`` (fixed_mass of w; total: the row's mass; p rounded to float32,
    as the kernel receives it); every token when p >= 1 or nothing reaches the target (no mass)."""
    p64 = np.asarray(p, np.float32).astype(np.float64)
    x64 = np.asarray(x, np.float64)
    order = np.argsort(-x64, axis=1, kind="stable")
    cs = np.cumsum(np.take_along_axis(fixed_mass(w), order, axis=1), axis=1, dtype=np.uint64)
    total = cs[:, -1]
    target = np.maximum(np.minimum(np.ceil(total.astype(np.float64) * p64).astype(np.uint64), total), 1)
    first = np.argmax(cs >= target[:, None], axis=1)
    thr = np.take_along_axis(x64, order, axis=1)[np.arange(len(x64)), first]
    thr = np.where(total >= target, thr, -np.inf)
    return (x64 >= thr[:, None]) | (p64[:, None] >= 1)


def _np_sample(x, rows, flags, k, p, m, seed: int, offset: int) -> np.ndarray:
    out = np.empty(len(rows), np.int32)
    vocab = x.shape[1]
    step = max(1, (1 << 22) // vocab)
    for start in range(0, len(rows), step):
        sl = slice(start, start + step)
        xs = x[rows[sl]]
        v32 = np.exp(xs - xs.max(axis=1, keepdims=True)) if flags & _LOGITS else xs   # the kernel's values
        x64 = xs.astype(np.float64)                                                     # order (keys) of tokens
        keep = np.ones(xs.shape, bool)
        if flags & _MIN_P:
            w = v32.astype(np.float64)
            keep = w >= np.asarray(m[sl], np.float32).astype(np.float64)[:, None] * w.max(axis=1, keepdims=True)
        elif flags & _TOP_K and flags & _TOP_P and flags & _JOINT:
            keep = _top_k_keep(x64, k[sl]) & _top_p_keep(xs, v32, p[sl])
        else:
            if flags & _TOP_K:
                keep = _top_k_keep(x64, k[sl])
            if flags & _TOP_P:
                keep &= _top_p_keep(xs, np.where(keep, v32, np.float32(0)), p[sl])
        degenerate = ~(v32.astype(np.float64).sum(axis=1) > 0)
        keep[degenerate] = True
        out[sl] = _race(v32, keep, np.arange(len(rows))[sl], seed, offset)
    return out


def _np_chain_speculative(draft, ids, target, seed: int, offset: int):
    batch, n, vocab = draft.shape
    b_all = np.arange(batch)
    u = _uniform(_random_bits(b_all, n, seed, offset, _TAG_ACCEPT))
    w = _uniform(_random_bits(b_all, n, seed, offset, _TAG_RECOUNT))
    q = np.take_along_axis(draft, ids[:, :, None].astype(np.int64), axis=2)[:, :, 0]
    p = np.take_along_axis(target[:, :n], ids[:, :, None].astype(np.int64), axis=2)[:, :, 0]
    rejected = ~(u * q < p)
    pos = np.where(rejected.any(axis=1), np.argmax(rejected, axis=1), n) if n else np.zeros(batch, np.int64)
    later = (np.arange(n)[None, :] >= pos[:, None]) & (w * q < p)
    acc = (pos + later.sum(axis=1)).astype(np.int32)
    vals = target[b_all, pos].copy()
    r = pos < n
    vals[r] = np.maximum(vals[r] - draft[b_all[r], pos[r]], np.float32(0))
    tok = _race(vals.astype(np.float32), np.ones(vals.shape, bool), b_all * (n + 1) + pos, seed, offset)
    out = np.where(np.arange(n + 1)[None, :] < pos[:, None], np.pad(ids, ((0, 0), (0, 1))), -1).astype(np.int32)
    out[b_all, pos] = tok
    return out, acc, pos.astype(np.int32)
