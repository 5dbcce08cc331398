"""The fa3 kernel's persistent form (``Sm90PrefillSpec.persistent``, PERSISTENT=1: at most one CTA per SM,
each looping over work items with its K/V stages and barrier phases running on across them): it compiles
without spills wherever the plain kernel does (16-bit K/V), and on an sm_90 GPU gives the plain kernel's
answers: the fa3 GPU tests of test_prefill_sm90 and the scheduler's fa3 graph replay, re-run with every
16-bit fa3 spec made persistent."""
import dataclasses

import pytest

from cuattn import jit, prefill_sm90

from . import test_prefill_sm90 as fa3
from .conftest import gpu_cc

sm90 = pytest.mark.skipif(gpu_cc() != 90, reason="the fa3 kernel needs an sm_90 GPU")


def _persistent(spec):
    return spec if spec.dtype_kv else dataclasses.replace(spec, persistent=True)


@pytest.fixture
def persistent(monkeypatch):
    """Every 16-bit fa3 spec the wrappers make is the persistent one (fp8 K/V keeps the plain kernel)."""
    made = prefill_sm90.make_spec
    monkeypatch.setattr(prefill_sm90, "make_spec", lambda *a, **kw: _persistent(made(*a, **kw)))


def _specs():
    """The fa3 feature grid's 16-bit specs (test_prefill_sm90), persistent; not the custom mask's gather spec, whose
    consumers spill 12 bytes persistent at every producer register count tried (40-104; Sm90PrefillSpec.persistent
    says so)."""
    return [_persistent(s) for s in fa3._feature_grid()
            if not s.dtype_kv and not (s.gather and s.variant.has_custom_mask)]


def test_persistent_specs_compile_without_spills():
    for spec in _specs():
        assert spec.persistent and "_persist" in spec.name
        res = jit.compile_kernel(spec, prefill_sm90.ARCH).resources["cuattn_prefill_sm90"]
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, (spec.name, res)


def test_persistent_needs_16_bit_kv():
    spec = dataclasses.replace(prefill_sm90.make_spec("f16", False, paged=True, dtype_kv="e4m3"), persistent=True)
    with pytest.raises(jit.CompileError, match="PERSISTENT with 16-bit K/V only"):
        jit.compile_kernel(spec, prefill_sm90.ARCH)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("case", fa3.SINGLE[:4], ids=[str(i) for i in range(4)])
def test_persistent_single_matches_oracle(case, persistent, launches):
    fa3._single(*case)
    assert launches


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_ragged_batch_matches_oracle(causal, persistent, launches):
    fa3.test_fa3_ragged_batch_matches_oracle(causal, "bfloat16", launches)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("page_size,layout,form,causal,split", fa3.PAGED_CASES)
def test_persistent_paged_matches_oracle(page_size, layout, form, causal, split, persistent, monkeypatch):
    fa3.test_fa3_paged_prefill_reads_pages_by_tma_boxes_or_gathers(page_size, layout, form, causal, split, monkeypatch)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dims,dtype,page_size,layout,form,split", fa3.DIM_PAGED[:6])
def test_persistent_head_dims_paged_match_oracle(dims, dtype, page_size, layout, form, split, persistent, launches):
    fa3.test_fa3_head_dims_paged_batch_matches_oracle(dims, dtype, page_size, layout, form, split, launches)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("d", [64, 256])
def test_persistent_transforms_match_oracle(d, persistent, launches):
    fa3.test_fa3_transforms_at_head_dims_64_256_match_oracle(d, launches)


@pytest.mark.gpu
@sm90
def test_persistent_graph_replays_padded_plans(persistent):
    """Graph mode pads the work list with empty items: the persistent CTAs skip them."""
    from .test_scheduler import test_prefill_cuda_graph_replays_after_replans_with_new_lengths as replay
    replay("ragged", "fa3")


launches = fa3.launches
