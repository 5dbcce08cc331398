import math

import numpy as np
import pytest

from cuattn import jit, sampling

N_DRAWS = 20000
# one row of a small vocabulary: distinct probabilities, no cumulative sum near the top_p values used below
PROBS = np.array([0.02, 0.21, 0.07, 0.15, 0.004, 0.11, 0.26, 0.05, 0.086, 0.04], np.float64)
PROBS = PROBS / PROBS.sum()


# ---------------------------------------------------------------------------- float64 oracle


def top_k_set(p, k):
    return p >= np.sort(p)[::-1][min(k, len(p)) - 1]


def top_p_set(p, top_p):
    """Nucleus by walking the tokens in decreasing order: include while the mass before them < top_p."""
    keep = np.zeros(len(p), bool)
    before = 0.0
    for i in np.argsort(-p, kind="stable"):
        if before >= top_p * p.sum():
            break
        keep[p == p[i]] = True
        before += p[i]
    return keep


def expected(op, p, k=None, top_p=None, min_p=None, order="top_k_first"):
    """The distribution each op draws from, in float64."""
    if op in ("sampling_from_probs", "sampling_from_logits"):
        keep = np.ones(len(p), bool)
    elif op == "top_k_sampling_from_probs":
        keep = top_k_set(p, k)
    elif op == "top_p_sampling_from_probs":
        keep = top_p_set(p, top_p)
    elif op == "min_p_sampling_from_probs":
        keep = p >= min_p * p.max()
    elif order == "joint":
        keep = top_k_set(p, k) & top_p_set(p, top_p)
    else:
        kk = top_k_set(p, k)
        keep = kk & top_p_set(np.where(kk, p, 0.0), top_p)
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def chi_square_p_value(counts, probs):
    """Upper tail of the chi-square statistic over the cells of nonzero probability (Wilson-Hilferty)."""
    cells = probs > 0
    n = counts.sum()
    stat = float(np.sum((counts[cells] - n * probs[cells]) ** 2 / (n * probs[cells])))
    df = int(cells.sum()) - 1
    if df == 0:
        return 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


CASES = [  # (op, kwargs)
    ("sampling_from_probs", {}),
    ("sampling_from_logits", {}),
    ("top_k_sampling_from_probs", {"top_k": 4}),
    ("top_p_sampling_from_probs", {"top_p": 0.6}),
    ("min_p_sampling_from_probs", {"min_p": 0.3}),
    ("top_k_top_p_sampling_from_probs", {"top_k": 5, "top_p": 0.75}),
    ("top_k_top_p_sampling_from_probs", {"top_k": 5, "top_p": 0.6, "filter_apply_order": "joint"}),
    ("top_k_top_p_sampling_from_logits", {"top_k": 6, "top_p": 0.8}),
    ("top_k_top_p_sampling_from_logits", {"top_k": 3, "top_p": 0.5, "filter_apply_order": "joint"}),
]
CASE_IDS = [f"{op.replace('_sampling_from', '')}-{'-'.join(f'{v}' for v in kw.values()) or 'plain'}"
            for op, kw in CASES]


def call(op, row, n, kwargs, to_device=lambda a: a, seed=7):
    """n draws from one row through ``indices`` (every output shares row 0)."""
    x = np.log(row).astype(np.float32) if op.endswith("logits") else row.astype(np.float32)
    params = {k: v for k, v in kwargs.items() if k != "filter_apply_order"}
    extra = {"filter_apply_order": kwargs["filter_apply_order"]} if "filter_apply_order" in kwargs else {}
    out = getattr(sampling, op)(to_device(x[None, :]), *params.values(),
                                indices=to_device(np.zeros(n, np.int32)), seed=seed, **extra)
    return out


def check_distribution(op, kwargs, tokens):
    q = expected(op, PROBS, kwargs.get("top_k"), kwargs.get("top_p"), kwargs.get("min_p"),
                 kwargs.get("filter_apply_order", "top_k_first"))
    tokens = np.asarray(tokens)
    assert tokens.dtype == np.int32 and tokens.shape == (N_DRAWS,)
    outside = np.flatnonzero(q[tokens] == 0)
    assert outside.size == 0, f"drew tokens outside the kept set: {np.unique(tokens[outside])}"
    p = chi_square_p_value(np.bincount(tokens, minlength=len(q)), q)
    assert p > 1e-4, (np.bincount(tokens, minlength=len(q)) / N_DRAWS, q)


# ---------------------------------------------------------------------------- NumPy path


def test_philox_matches_random123_known_answers():
    zero = sampling.philox4x32(np.uint32(0), 0, 0, 0, 0, 0)
    assert [int(w) for w in zero] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = sampling.philox4x32(np.uint32(0xFFFFFFFF), 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
    assert [int(w) for w in ones] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


@pytest.mark.parametrize("op,kwargs", CASES, ids=CASE_IDS)
def test_sampling_matches_filtered_distribution(op, kwargs):
    check_distribution(op, kwargs, call(op, PROBS, N_DRAWS, kwargs))


def test_sampling_same_seed_gives_same_tokens_and_offset_changes_them():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(50, 0.3), size=64).astype(np.float32)
    a = sampling.top_k_top_p_sampling_from_probs(probs, 20, 0.9, seed=123)
    b = sampling.top_k_top_p_sampling_from_probs(probs, 20, 0.9, seed=123)
    c = sampling.top_k_top_p_sampling_from_probs(probs, 20, 0.9, seed=123, offset=4)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    g1, g2 = np.random.default_rng(5), np.random.default_rng(5)
    np.testing.assert_array_equal(sampling.sampling_from_probs(probs, generator=g1),
                                  sampling.sampling_from_probs(probs, generator=g2))


def test_sampling_takes_per_request_parameters():
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.full(40, 0.5), size=6).astype(np.float32)
    top_k = np.array([1, 2, 3, 5, 8, 40], np.int32)
    for _ in range(3):
        tok = sampling.top_k_sampling_from_probs(probs, top_k, seed=int(rng.integers(1 << 30)))
        for b in range(6):
            assert top_k_set(probs[b].astype(np.float64), top_k[b])[tok[b]]
    top_p = [0.1, 0.3, 0.5, 0.7, 0.9, 1.0]
    tok = sampling.top_p_sampling_from_probs(probs, top_p, seed=3)
    for b in range(6):
        assert top_p_set(probs[b].astype(np.float64), top_p[b])[tok[b]]
    assert sampling.top_k_sampling_from_probs(probs, 1, seed=4).tolist() == np.argmax(probs, 1).tolist()


def test_renorm_and_mask_match_float64_formulas():
    rng = np.random.default_rng(2)
    probs = rng.dirichlet(np.full(1000, 0.2), size=5).astype(np.float32)
    top_k = np.array([1, 7, 50, 999, 1000])
    top_p = np.array([0.05, 0.3, 0.6, 0.9, 1.0], np.float32)
    got_k = sampling.top_k_renorm_probs(probs, top_k)
    got_p = sampling.top_p_renorm_probs(probs, top_p)
    logits = np.log(probs) + np.float32(3.0)
    got_m = sampling.top_k_mask_logits(logits, top_k)
    for b in range(5):
        p64 = probs[b].astype(np.float64)
        keep = top_k_set(p64, top_k[b])
        np.testing.assert_allclose(got_k[b], np.where(keep, p64 / p64[keep].sum(), 0), rtol=1e-6, atol=1e-12)
        keep = top_p_set(p64, float(top_p[b]))
        np.testing.assert_allclose(got_p[b], np.where(keep, p64 / p64[keep].sum(), 0), rtol=1e-6, atol=1e-12)
        keep = top_k_set(logits[b].astype(np.float64), top_k[b])
        np.testing.assert_array_equal(got_m[b], np.where(keep, logits[b], -np.inf))
    assert got_k.dtype == got_p.dtype == got_m.dtype == np.float32


def test_fixed_point_mass_is_the_exact_integer_formula():
    """q(w) = floor(w * 2**(S - E)): checked with Python integers (exact) on normal, subnormal, zero and
    negative values; E from the row's max, S = 62 - bit_length(vocab)."""
    row = np.array([0.75, 1.5, 3e-39, 1e-45, 0.0, -2.0, 1e-30, 1.4999999], np.float32)
    q = sampling.fixed_mass(row[None])[0]
    s, e = 62 - len(row).bit_length(), 0                     # max 1.5 in [2**0, 2**1)
    for w, got in zip(row, q):
        num, den = float(w).as_integer_ratio() if w > 0 else (0, 1)
        assert int(got) == (num << (s - e)) // den, (w, got)
    assert int(q.max()) < 2 ** (s + 1) and int(q[1]) == 3 << (s - 1)


def test_top_p_numpy_path_matches_the_float64_nucleus_away_from_the_boundary():
    """The fixed-point nucleus equals the float64 walk over sorted tokens unless the cumulative mass is within
    1e-9 of the target (rows with ties and with many zeros included)."""
    rng = np.random.default_rng(12)
    rows = [rng.dirichlet(np.full(3000, 0.1)), np.repeat(rng.dirichlet(np.ones(30)), 100),
            np.where(rng.random(3000) < 0.8, 0.0, rng.random(3000))]
    for r in rows:
        p32 = (r / r.sum()).astype(np.float32)
        p64 = p32.astype(np.float64)
        cs = np.cumsum(np.sort(p64)[::-1])
        for top_p in (0.1, 0.5, 0.9, 0.99, 1.0):
            t = float(np.float32(top_p)) * cs[-1]
            if np.min(np.abs(cs - t)) < 1e-9:
                continue
            got = sampling.top_p_renorm_probs(p32[None], top_p)[0] > 0
            np.testing.assert_array_equal(got, top_p_set(p64, float(np.float32(top_p))) & (p64 > 0))


def test_chain_speculative_sampling_follows_flashinfer_example():
    draft = np.array([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]], np.float32)
    target = np.array([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]], np.float32)
    acc = np.array([5], np.int32)
    ids, acc_out, emitted = sampling.chain_speculative_sampling(draft, np.array([[2, 1]], np.int32), target,
                                                                maybe_output_accepted_token_num=acc, seed=0)
    assert ids.tolist() == [[2, 0, -1]] and emitted.tolist() == [1]
    assert acc_out is acc and acc.tolist() == [6]


def speculative_first_tokens(to_device=lambda a: a, seed=11):
    """First emitted token of N_DRAWS one-draft chains: distributed as the target, whatever the draft."""
    rng = np.random.default_rng(3)
    q = rng.dirichlet(np.ones(len(PROBS)))
    draft = np.broadcast_to(q.astype(np.float32), (N_DRAWS, 1, len(PROBS))).copy()
    target = np.broadcast_to(PROBS.astype(np.float32), (N_DRAWS, 2, len(PROBS))).copy()
    ids = rng.choice(len(PROBS), size=(N_DRAWS, 1), p=q).astype(np.int32)
    out, acc, emitted = sampling.chain_speculative_sampling(to_device(draft), to_device(ids), to_device(target),
                                                            seed=seed)
    return out, acc, emitted


def test_chain_speculative_sampling_emits_the_target_distribution():
    out, acc, emitted = speculative_first_tokens()
    assert chi_square_p_value(np.bincount(out[:, 0], minlength=len(PROBS)), PROBS) > 1e-4
    assert ((emitted == 1) == (out[:, 1] >= 0)).all() and (acc >= emitted).all()


def test_sampling_of_empty_batches_and_chains_without_drafts():
    assert sampling.sampling_from_probs(np.empty((0, 5), np.float32), seed=1).shape == (0,)
    assert sampling.top_k_renorm_probs(np.empty((0, 5), np.float32), 2).shape == (0, 5)
    assert sampling.top_p_sampling_from_probs(np.ones((2, 5), np.float32), 0.5, indices=np.empty(0, np.int64)).shape == (0,)
    ids, acc, emitted = sampling.chain_speculative_sampling(np.ones((0, 2, 4), np.float32), np.zeros((0, 2), np.int32),
                                                            np.ones((0, 3, 4), np.float32), seed=1)
    assert ids.shape == (0, 3) and acc.shape == emitted.shape == (0,)
    target = np.zeros((2, 1, 4), np.float32)
    target[:, 0, 3] = 1.0
    ids, acc, emitted = sampling.chain_speculative_sampling(np.ones((2, 0, 4), np.float32), np.zeros((2, 0), np.int32),
                                                            target, seed=1)
    assert ids.tolist() == [[3], [3]] and acc.tolist() == emitted.tolist() == [0, 0]


def test_sampling_rejects_bad_inputs_naming_the_argument():
    p = np.full((2, 8), 0.125, np.float32)
    with pytest.raises(ValueError, match="top_p_sampling_from_probs: top_p must be a float in \\(0, 1\\]"):
        sampling.top_p_sampling_from_probs(p, 0.0)
    with pytest.raises(ValueError, match="top_p must be a float in \\(0, 1\\]"):
        sampling.top_p_renorm_probs(p, 1.5)
    with pytest.raises(ValueError, match="top_k_sampling_from_probs: top_k must be an int >= 1, got 0"):
        sampling.top_k_sampling_from_probs(p, 0)
    with pytest.raises(ValueError, match="top_k must be an int >= 1 for every request, got 0 at index 1"):
        sampling.top_k_top_p_sampling_from_probs(p, np.array([3, 0]), 0.5)
    with pytest.raises(ValueError, match="min_p must be a float in \\[0, 1\\]"):
        sampling.min_p_sampling_from_probs(p, -0.1)
    with pytest.raises(TypeError, match="sampling_from_probs: probs must be float32, got float16"):
        sampling.sampling_from_probs(p.astype(np.float16))
    with pytest.raises(ValueError, match="probs must have shape \\(batch, vocab_size\\)"):
        sampling.sampling_from_probs(p[0])
    with pytest.raises(ValueError, match="top_p must be a scalar or have shape \\(batch,\\) = \\(2,\\), got \\(3,\\)"):
        sampling.top_p_sampling_from_probs(p, np.full(3, 0.5, np.float32))
    with pytest.raises(ValueError, match="top_k must be a scalar or have shape \\(batch,\\) = \\(5,\\)"):
        sampling.top_k_sampling_from_probs(p, np.ones(2, np.int32), indices=np.zeros(5, np.int32))
    with pytest.raises(ValueError, match="indices must be in \\[0, 2\\)"):
        sampling.sampling_from_probs(p, indices=np.array([0, 2], np.int32))
    with pytest.raises(ValueError, match="filter_apply_order must be 'top_k_first' or 'joint'"):
        sampling.top_k_top_p_sampling_from_logits(p, 2, 0.5, filter_apply_order="top_p_first")
    with pytest.raises(ValueError, match="seed must be an int in \\[0, 2\\*\\*64\\)"):
        sampling.sampling_from_probs(p, seed=-1)
    with pytest.raises(ValueError, match="probs must not contain NaN"):
        sampling.sampling_from_probs(np.full((1, 4), np.nan, np.float32), check_nan=True)
    with pytest.raises(ValueError, match="chain_speculative_sampling: target_probs must have shape \\(1, 3, 4\\)"):
        sampling.chain_speculative_sampling(np.ones((1, 2, 4), np.float32), np.zeros((1, 2), np.int32),
                                            np.ones((1, 2, 4), np.float32))


@pytest.fixture(scope="module")
def compiled_for_shipped_archs():
    """Both archs compiled at once (one NVRTC process each) into the test session's cache."""
    jit.precompile([(spec, arch) for spec in sampling.shipped_specs() for arch in jit.SHIPPED_ARCHS])


@pytest.mark.parametrize("arch", jit.SHIPPED_ARCHS)
def test_shipped_sampling_kernels_compile_without_spills(arch, compiled_for_shipped_archs):
    entries = {"cuattn_sample", "cuattn_top_k_renorm", "cuattn_top_p_renorm", "cuattn_top_k_mask_logits",
               "cuattn_chain_speculative"}
    for spec in sampling.shipped_specs():
        resources = jit.compile_kernel(spec, arch).resources
        assert set(resources) >= entries or not resources
        for entry, r in resources.items():
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack_frame"] == 0, (spec.name, entry, r)


# ---------------------------------------------------------------------------- GPU


def to_cupy(a):
    import cupy
    return cupy.asarray(a)


@pytest.mark.gpu
@pytest.mark.parametrize("op,kwargs", CASES, ids=CASE_IDS)
def test_sampling_gpu_matches_filtered_distribution(op, kwargs):
    import cupy
    check_distribution(op, kwargs, cupy.asnumpy(call(op, PROBS, N_DRAWS, kwargs, to_cupy)))


@pytest.mark.gpu
@pytest.mark.parametrize("op,kwargs", CASES, ids=CASE_IDS)
def test_sampling_gpu_draws_the_numpy_paths_tokens(op, kwargs):
    """Same seed: the kernel and the NumPy path use one Philox stream; tokens agree except where float32
    sums or the last bit of log1p/exp differ at a boundary (allowed: 1%)."""
    import cupy
    rng = np.random.default_rng(4)
    vocab = 128256
    p = rng.dirichlet(np.full(vocab, 0.05), size=32)
    x = (np.log(p + 1e-30) if op.endswith("logits") else p).astype(np.float32)
    params = {k: v for k, v in kwargs.items() if k != "filter_apply_order"}
    if "top_k" in params:
        params["top_k"] = 50
    extra = {"filter_apply_order": kwargs["filter_apply_order"]} if "filter_apply_order" in kwargs else {}
    f = getattr(sampling, op)
    host = f(x, *params.values(), seed=99, offset=8, **extra)
    dev = f(cupy.asarray(x), *params.values(), seed=99, offset=8, **extra)
    again = f(cupy.asarray(x), *params.values(), seed=99, offset=8, **extra)
    np.testing.assert_array_equal(cupy.asnumpy(dev), cupy.asnumpy(again))
    assert np.mean(cupy.asnumpy(dev) == host) >= 0.99, (cupy.asnumpy(dev), host)


@pytest.mark.gpu
def test_sampling_gpu_scalar_path_and_per_request_parameters():
    """A vocabulary that is no multiple of 4 and a row view at an odd offset (scalar loads); parameters as
    NumPy, CuPy and int64 arrays; int64 indices."""
    import cupy
    rng = np.random.default_rng(5)
    big = rng.dirichlet(np.full(1001, 0.3), size=8).astype(np.float32)
    host = big[:, 1:]
    dev = cupy.asarray(big)[:, 1:]
    top_k = np.array([1, 2, 5, 10, 50, 100, 999, 1000], np.int64)
    top_p = np.linspace(0.1, 1.0, 8).astype(np.float32)
    idx = np.array([7, 6, 5, 4, 3, 2, 1, 0], np.int64)
    for k_arg, p_arg in ((top_k, top_p), (cupy.asarray(top_k), cupy.asarray(top_p))):
        for order in ("top_k_first", "joint"):
            want = sampling.top_k_top_p_sampling_from_probs(host, top_k, top_p, indices=idx, filter_apply_order=order,
                                                            seed=5)
            got = sampling.top_k_top_p_sampling_from_probs(dev, k_arg, p_arg, indices=cupy.asarray(idx),
                                                           filter_apply_order=order, seed=5)
            np.testing.assert_array_equal(cupy.asnumpy(got), want)


@pytest.mark.gpu
@pytest.mark.parametrize("top_k", [5, 1000, 1500], ids=["k5", "k1000", "k1500"])
def test_top_k_gpu_keeps_ties_on_both_threshold_paths(top_k):
    """Rows of many equal values: more than 2048 reach the bound of the shared-memory path (k <= 1024),
    which falls back to the pivot search; k > 1024 always searches. Every tie of the k-th is kept."""
    import cupy
    probs = np.full((4, 5000), 1 / 5000, np.float32)
    probs[1, :3000] *= 1.5
    probs[2, ::7] = 0.004
    probs[3] = np.random.default_rng(9).dirichlet(np.full(5000, 0.5))
    for order in ("top_k_first", "joint"):
        want = sampling.top_k_top_p_sampling_from_probs(probs, top_k, 0.95, filter_apply_order=order, seed=3)
        got = sampling.top_k_top_p_sampling_from_probs(cupy.asarray(probs), top_k, 0.95, filter_apply_order=order,
                                                       seed=3)
        np.testing.assert_array_equal(cupy.asnumpy(got), want)
    renorm = cupy.asnumpy(sampling.top_k_renorm_probs(cupy.asarray(probs), top_k))
    np.testing.assert_allclose(renorm, sampling.top_k_renorm_probs(probs, top_k), rtol=1e-5, atol=1e-12)


@pytest.mark.gpu
def test_renorm_and_mask_gpu_match_numpy_path():
    import cupy
    rng = np.random.default_rng(6)
    probs = rng.dirichlet(np.full(128256, 0.05), size=16).astype(np.float32)
    top_k = rng.integers(1, 2000, size=16)
    top_p = rng.uniform(0.05, 1.0, size=16).astype(np.float32)
    for f, x, arg in ((sampling.top_k_renorm_probs, probs, top_k), (sampling.top_p_renorm_probs, probs, top_p),
                      (sampling.top_k_mask_logits, np.log(probs + 1e-30).astype(np.float32), top_k)):
        want = f(x, arg)
        got = cupy.asnumpy(f(cupy.asarray(x), cupy.asarray(arg)))
        kept_want, kept_got = np.isfinite(want) & (want != 0), np.isfinite(got) & (got != 0)
        assert (kept_want != kept_got).sum() <= 16, f.__name__          # boundary ties of float32 sums
        same = kept_want == kept_got
        np.testing.assert_allclose(got[same], want[same], rtol=1e-4, atol=1e-10)


@pytest.mark.gpu
def test_chain_speculative_sampling_gpu_matches_numpy_and_target_distribution():
    import cupy
    out, acc, emitted = speculative_first_tokens(to_cupy)
    out, acc, emitted = (cupy.asnumpy(a) for a in (out, acc, emitted))
    want = speculative_first_tokens()
    np.testing.assert_array_equal(acc, want[1])
    np.testing.assert_array_equal(emitted, want[2])
    assert np.mean(out == want[0]) >= 0.99
    assert chi_square_p_value(np.bincount(out[:, 0], minlength=len(PROBS)), PROBS) > 1e-4


@pytest.mark.gpu
def test_sampling_gpu_takes_torch_tensors_and_returns_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.full(5000, 0.3), size=4).astype(np.float32)
    tp = torch.from_numpy(probs).cuda()
    tok = sampling.top_k_top_p_sampling_from_probs(tp, torch.tensor([3, 5, 7, 9], device="cuda"), 0.8, seed=1)
    assert isinstance(tok, torch.Tensor) and tok.is_cuda and tok.dtype == torch.int32
    np.testing.assert_array_equal(tok.cpu().numpy(), sampling.top_k_top_p_sampling_from_probs(
        probs, np.array([3, 5, 7, 9]), 0.8, seed=1))
    renorm = sampling.top_k_renorm_probs(tp, 10)
    assert isinstance(renorm, torch.Tensor) and renorm.dtype == torch.float32
    g = torch.Generator(device="cuda")
    g.manual_seed(3)
    a = sampling.sampling_from_probs(tp, generator=g)
    g.manual_seed(3)
    assert torch.equal(a, sampling.sampling_from_probs(tp, generator=g))


@pytest.mark.gpu
def test_sampling_gpu_takes_jax_arrays_and_returns_jax():
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((3, 777)).astype(np.float32)
    jl = jax.device_put(logits, jax.devices("gpu")[0])
    tok = sampling.top_k_top_p_sampling_from_logits(jl, 5, 0.9, seed=2)
    assert type(tok).__module__.startswith("jax") and tok.dtype == np.int32
    want = sampling.top_k_top_p_sampling_from_logits(logits, 5, 0.9, seed=2)
    assert np.mean(np.asarray(tok) == want) >= 2 / 3
    masked = sampling.top_k_mask_logits(jl, 5)
    np.testing.assert_array_equal(np.asarray(masked), sampling.top_k_mask_logits(logits, 5))


GPU_EXACT = [(1, 128256), (7, 128256), (64, 128256), (1, 1000), (7, 1000), (64, 1000), (1, 50257), (7, 50257),
             (64, 50257)]                                         # (batch, vocab)
TOP_PS = np.array([0.1, 0.5, 0.9, 0.99, 1.0], np.float32)


def exact_rows(batch, vocab, seed):
    """Rows of four kinds, cycling: peaked (Dirichlet 0.05), softmax of 3 * randn, many zeros (70%), ties
    (a few distinct values, half the row equal to the largest)."""
    rng = np.random.default_rng(seed)
    rows = []
    for b in range(batch):
        kind = b % 4
        if kind == 0:
            r = rng.dirichlet(np.full(vocab, 0.05))
        elif kind == 1:
            z = 3 * rng.standard_normal(vocab)
            r = np.exp(z - z.max())
        elif kind == 2:
            r = np.where(rng.random(vocab) < 0.7, 0.0, rng.random(vocab))
            r[rng.integers(vocab)] = 1.0
        else:
            r = rng.integers(1, 5, vocab).astype(np.float64)
            r[: vocab // 2] = 5.0
        rows.append(r / r.sum())
    return np.asarray(rows, np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,vocab", GPU_EXACT, ids=[f"b{b}-v{v}" for b, v in GPU_EXACT])
def test_top_p_gpu_threshold_equals_numpy_path_exactly(batch, vocab):
    """The radix-select threshold on fixed-point masses is the NumPy path's: same tokens with the same seed
    (top-p, top-k + top-p both orders with k on the candidate path (50) and the radix path (2000), min-p),
    renorm outputs to 1e-6 with identical kept sets; every kernel twice: identical results (deterministic)."""
    import cupy
    probs = exact_rows(batch, vocab, seed=batch * 7 + vocab)
    dev = cupy.asarray(probs)
    top_p = TOP_PS[np.arange(batch) % len(TOP_PS)]
    calls = [("top_p_sampling_from_probs", (top_p,), {})]
    if batch * vocab <= 400_000:   # the NumPy path takes seconds per call on big batches: top-p only there
        calls += [("top_p_sampling_from_probs", (0.9,), {}), ("min_p_sampling_from_probs", (top_p * 0.5,), {})]
        for k in (50, 2000):
            for order in ("top_k_first", "joint"):
                calls.append(("top_k_top_p_sampling_from_probs", (k, top_p), {"filter_apply_order": order}))
    for name, args, kw in calls:
        f = getattr(sampling, name)
        want = f(probs, *args, seed=17, offset=4, **kw)
        dev_args = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
        got = [cupy.asnumpy(f(dev, *dev_args, seed=17, offset=4, deterministic=True, **kw)) for _ in range(2)]
        np.testing.assert_array_equal(got[0], got[1], err_msg=name)
        np.testing.assert_array_equal(got[0], want, err_msg=f"{name} {args[0] if np.isscalar(args[0]) else ''} {kw}")
    for p_arg in (top_p, 0.9) if batch * vocab <= 400_000 else (top_p,):
        want = sampling.top_p_renorm_probs(probs, p_arg)
        out = []
        for _ in range(2):
            o = sampling.top_p_renorm_probs(dev, cupy.asarray(p_arg) if isinstance(p_arg, np.ndarray) else p_arg)
            out.append(cupy.asnumpy(o))
        np.testing.assert_array_equal(out[0], out[1])
        np.testing.assert_array_equal(out[0] > 0, want > 0)
        np.testing.assert_allclose(out[0], want, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------- groups of CTAs per row


def test_ctas_per_row_policy_and_setting():
    """Automatic: up to 32 CTAs per row while batch * n fits the SMs and each reads >= 4096 elements."""
    assert sampling.ctas_per_row(1, 128256, 132) == 31
    assert sampling.ctas_per_row(64, 128256, 132) == 2
    assert sampling.ctas_per_row(67, 128256, 132) == 1 and sampling.ctas_per_row(256, 128256, 132) == 1
    assert sampling.ctas_per_row(1, 1000, 132) == 1 and sampling.ctas_per_row(1, 50257, 132) == 12
    assert sampling.ctas_per_row(0, 128256, 132) == 31
    for bad in (0, 33, 2.0, True):
        with pytest.raises(ValueError, match="set_ctas_per_row: n must be None or an int in \\[1, 32\\]"):
            sampling.set_ctas_per_row(bad)
    assert sampling._ctas_per_row is None


def test_forced_ctas_per_row_refuses_groups_that_cannot_be_resident(monkeypatch):
    monkeypatch.setattr(sampling.plan, "num_sms", lambda device: 132)
    ctx = type("Ctx", (), {"device": 0, "stream": None})()
    sampling.set_ctas_per_row(8)
    try:
        with pytest.raises(ValueError, match="top_p_sampling_from_probs: set_ctas_per_row\\(8\\) needs batch \\* 8 <= 132"):
            sampling._group("top_p_sampling_from_probs", 17, 128256, ctx)
        sampling.set_ctas_per_row(1)
        assert sampling._group("top_p_sampling_from_probs", 500, 128256, ctx) == (1, 0)
    finally:
        sampling.set_ctas_per_row(None)


def test_sampling_spec_passes_the_workspace_layout():
    assert f"-DWS_ROW_BYTES={sampling._WS_ROW_BYTES}" in sampling.SamplingSpec().defines()


@pytest.fixture
def ctas():
    """Sets the CTAs per row for one test; back to automatic afterwards."""
    yield sampling.set_ctas_per_row
    sampling.set_ctas_per_row(None)


GROUP_CASES = [  # (ctas per row, batch, vocab); vocab 1000 with an odd-offset view: scalar loads, 4 chunks of 252
    (2, 5, 128256), (8, 3, 128256), (32, 1, 128256), (32, 2, 50257), (4, 4, 1001)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,batch,vocab", GROUP_CASES, ids=[f"ctas{n}-b{b}-v{v}" for n, b, v in GROUP_CASES])
def test_groups_of_ctas_give_the_numpy_paths_tokens(n, batch, vocab, ctas):
    """A row split over n CTAs (stats, radix histograms and the race's argmin merged across them): the same
    tokens as the NumPy path (probabilities: exactly) and as one CTA per row, for every filter, with
    per-request parameters (NumPy and CuPy arrays), indices (int64, repeated rows) and the renorm/mask outputs."""
    import cupy
    rows_n = batch + 1                                               # batch outputs through indices, batch + 1 else
    if vocab % 4:                                                    # a view at an odd offset: scalar loads
        rows = exact_rows(rows_n, vocab + 1, seed=n * 131 + vocab)
        host, dev = rows[:, 1:], cupy.asarray(rows)[:, 1:]
    else:                                                            # contiguous, 16-byte loads
        host = exact_rows(rows_n, vocab, seed=n * 131 + vocab)
        dev = cupy.asarray(host)
    logits_h = np.log(host + np.float32(1e-30)).astype(np.float32)
    logits_d = cupy.asarray(logits_h)
    idx = np.array([batch - 1 - b for b in range(batch)], np.int64)
    idx[0] = idx[-1] = batch                                         # the last row, twice when batch > 1
    top_p = TOP_PS[np.arange(rows_n) % len(TOP_PS)]
    top_k = np.array(([1, 50, 2000, 7, 300] * rows_n)[:rows_n], np.int32)
    calls = [("sampling_from_probs", host, dev, (), {}),
             ("top_p_sampling_from_probs", host, dev, (top_p,), {}),
             ("top_p_sampling_from_probs", host, dev, (0.9,), {"indices": idx}),
             ("top_k_sampling_from_probs", host, dev, (top_k,), {}),
             ("min_p_sampling_from_probs", host, dev, (top_p * 0.5,), {}),
             ("top_k_top_p_sampling_from_probs", host, dev, (top_k, top_p), {}),
             ("top_k_top_p_sampling_from_probs", host, dev, (2000, top_p), {"filter_apply_order": "joint"}),
             ("sampling_from_logits", logits_h, logits_d, (), {}),
             ("top_k_top_p_sampling_from_logits", logits_h, logits_d, (top_k, 0.8), {})]
    for name, xh, xd, args, kw in calls:
        f = getattr(sampling, name)
        want = f(xh, *args, seed=23, offset=8, **kw)
        dev_args = [cupy.asarray(a) if isinstance(a, np.ndarray) and i % 2 else a for i, a in enumerate(args)]
        dev_kw = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        ctas(n)
        got = [cupy.asnumpy(f(xd, *dev_args, seed=23, offset=8, **dev_kw)) for _ in range(2)]
        ctas(1)
        one = cupy.asnumpy(f(xd, *dev_args, seed=23, offset=8, **dev_kw))
        np.testing.assert_array_equal(got[0], got[1], err_msg=f"{name}: not deterministic")
        np.testing.assert_array_equal(got[0], one, err_msg=f"{name}: {n} CTAs per row != 1")
        if name.endswith("logits"):     # __expf and NumPy's exp may differ in the last bit: one boundary token
            assert np.sum(got[0] != want) <= 1, (name, got[0], want)
        else:
            np.testing.assert_array_equal(got[0], want, err_msg=f"{name} {kw}")
    for f, xh, xd, arg in ((sampling.top_k_renorm_probs, host, dev, top_k),
                           (sampling.top_p_renorm_probs, host, dev, top_p),
                           (sampling.top_k_renorm_probs, host, dev, vocab),    # every token: the row's mass
                           (sampling.top_k_mask_logits, logits_h, logits_d, top_k)):
        want = f(xh, arg)
        ctas(n)
        got = cupy.asnumpy(f(xd, cupy.asarray(arg) if isinstance(arg, np.ndarray) else arg))
        ctas(1)
        one = cupy.asnumpy(f(xd, cupy.asarray(arg) if isinstance(arg, np.ndarray) else arg))
        np.testing.assert_array_equal(got, one, err_msg=f.__name__)
        if f is sampling.top_k_mask_logits:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_array_equal(got > 0, want > 0, err_msg=f.__name__)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f.__name__)


@pytest.mark.gpu
def test_groups_of_ctas_mark_out_of_range_indices_and_leave_a_clean_workspace(ctas):
    """An index outside the rows gives -1 for its whole group; the calls after it still agree with NumPy."""
    import cupy
    probs = exact_rows(3, 128256, seed=41)
    ctas(16)
    idx = cupy.asarray(np.array([0, 7, 2, -1, 1], np.int32))
    got = cupy.asnumpy(sampling.top_p_sampling_from_probs(cupy.asarray(probs), 0.7, indices=idx, seed=5))
    want = sampling.top_p_sampling_from_probs(probs, 0.7, indices=np.array([0, 2, 2, 2, 1]), seed=5)
    assert got[1] == -1 and got[3] == -1
    np.testing.assert_array_equal(got[[0, 2, 4]], want[[0, 2, 4]])
    for _ in range(3):
        got = cupy.asnumpy(sampling.top_p_sampling_from_probs(cupy.asarray(probs), 0.7, seed=6))
        np.testing.assert_array_equal(got, sampling.top_p_sampling_from_probs(probs, 0.7, seed=6))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8])
def test_sampling_gpu_cuda_graph_replays(n, ctas):
    """A captured call replays with the same tokens (the group's workspace is left zeroed by every launch), and new
    probabilities copied into the captured input give the NumPy path's tokens for them."""
    import cupy
    ctas(n)
    p0, p1 = exact_rows(4, 128256, seed=51), exact_rows(4, 128256, seed=52)
    x = cupy.asarray(p0)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        warm = sampling.top_k_top_p_sampling_from_probs(x, 2000, 0.8, seed=9)      # compiles, allocates the workspace
        del warm
        stream.begin_capture()
        out = sampling.top_k_top_p_sampling_from_probs(x, 2000, 0.8, seed=9)
        graph = stream.end_capture()
        for p in (p0, p0, p1, p1):
            x[...] = cupy.asarray(p)
            out[...] = -7
            graph.launch()
            stream.synchronize()
            np.testing.assert_array_equal(cupy.asnumpy(out), sampling.top_k_top_p_sampling_from_probs(p, 2000, 0.8,
                                                                                                    seed=9))
