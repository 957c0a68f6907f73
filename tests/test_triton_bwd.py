"""The Triton backward kernels (`_triton/bwd.py`, ``backward``) against the float64 reference.

The launcher is called as the dispatcher calls it: dq/dk/dv/ds_aux poisoned with NaN, an
`AttnParams` already normalised. Its forward inputs (out, lse) come from the float64 reference
cast to the input dtype / float32, so these tests do not depend on the Triton forward. Every
gradient is checked with the tolerance rule (`assert_close_to_reference`): our error against
float64 autograd must stay within twice PyTorch's own error, the reference's gradients
evaluated at ``dtype=q.dtype``.

Without a GPU the kernels run under Triton's interpreter on CPU tensors, in fp16 only (the
interpreter computes bf16 dots wrongly). The interpreter is slow, so shapes stay small but
awkward (1, 17, 113, Sq != Sk), and small tiles make them cross several blocks both ways, so
the interior (unmasked) and edge (masked) loops both run. GQA and MQA backward get the most
cases: their dK/dV group reduction is where published kernels have broken. On a GPU machine
the same matrix runs compiled, and the `gpu` tests add realistic sizes in bf16 and fp16.
"""

from __future__ import annotations

import os
import sys

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when the kernel module is
# imported (by the fixtures below, after collection). Without CUDA the interpreter is the only
# way to run it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import itertools  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from helpers import (SOURCE_PACKAGE, assert_each_close, built_or_source_package,  # noqa: E402
                     make_sequences_qkv, random_tensor, reference_kwargs, reference_results,
                     run_backward, submodule, triton_device)

# The interpreter converts 1-element arrays to loop bounds with a call NumPy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")


@pytest.fixture(scope="module")
def package(request):
    return built_or_source_package(request)


@pytest.fixture(scope="module")
def bwd(package):
    return submodule(package, "_triton.bwd")


@pytest.fixture(scope="module")
def heuristics(package):
    return submodule(package, "_heuristics")


@pytest.fixture(scope="module")
def attn_params(package):
    return submodule(package, "_params").AttnParams


@pytest.fixture(scope="module")
def device(bwd):
    return triton_device(bwd._bwd_dq_kernel)


# ---------------------------------------------------------------------------------------------
# One case: inputs, the reference forward (out, lse) and gradients, a call of the kernels.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    heads: tuple = (4, 4)  # (Hq, Hkv)
    sizes: tuple = (37, 53)  # (Sq, Sk); varlen: the first sequence, others added (seqlens)
    head_dim: int = 32
    batch: int = 2  # batched layouts only; varlen always packs the five seqlens() entries
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    softmax_scale: float | None = None
    alibi: str = "none"  # none | head: (Hq,) | batch: (B, Hq)
    sink: bool = False
    dropout_p: float = 0.0
    seed: int = 0
    layout: str = "contiguous"  # contiguous | transposed | varlen | varlen_transposed
    dout: str = "contiguous"  # contiguous | strided (a slice of a wider tensor)
    tiles: tuple | None = None  # BwdTiles fields; None: the module's table
    deterministic: bool = True  # False lets a tile entry with atomic_dq use the atomic path
    group_splits: int | None = None  # forces the dK/dV group split; None: the launcher's choice

    @property
    def varlen(self):
        return self.layout.startswith("varlen")

    def seqlens(self):
        """(Sq, Sk) per sequence; varlen mixes in empty and length-1 sequences."""
        if not self.varlen:
            return [self.sizes] * self.batch
        sq, sk = self.sizes
        return [(sq, sk), (0, 5), (1, 1), (6, 0), (sk % 37 + 2, sq % 29 + 1)]


def make_inputs(case: Case, dtype, device):
    """Transposed: q transposed, K and V views of one padded packed tensor (every stride but the
    last differs); a strided dout is a slice of a wider tensor."""
    hq, hkv = case.heads
    seqlens = case.seqlens()
    transposed = case.layout.endswith("transposed")
    q, k, v, cu_q, cu_k, max_q, max_k = make_sequences_qkv(
        seqlens, hq, hkv, case.head_dim, varlen=case.varlen, dtype=dtype, device=device,
        transposed=transposed, kv_layout="packed_transposed" if transposed else "contiguous")
    dout = random_tensor(q.shape, dtype=dtype, device=device,
                         layout="sliced" if case.dout == "strided" else "contiguous")
    slopes = {"none": None,
              "head": torch.rand(hq, device=device) * 0.3,
              "batch": torch.rand(len(seqlens), hq, device=device) * 0.3}[case.alibi]
    s_aux = torch.randn(hq, device=device) if case.sink else None
    return dict(q=q, k=k, v=v, dout=dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, s_aux=s_aux,
                alibi_slopes=slopes, max_seqlen_q=max_q, max_seqlen_k=max_k)


def make_params(attn_params, case: Case, inputs):
    left, right = case.window
    scale = case.head_dim ** -0.5 if case.softmax_scale is None else case.softmax_scale
    return attn_params(softmax_scale=scale, causal=case.causal, window_left=left,
                       window_right=0 if case.causal else right, softcap=case.softcap,
                       dropout_p=case.dropout_p, seed=case.seed,
                       deterministic=case.deterministic,
                       max_seqlen_q=inputs["max_seqlen_q"], max_seqlen_k=inputs["max_seqlen_k"])


def reference(inputs, params, dtype):
    """Reference out, lse and gradients of (q, k, v[, s_aux]) computed in ``dtype``."""
    return reference_results(
        inputs["q"], inputs["k"], inputs["v"], dtype=dtype, dout=inputs["dout"],
        s_aux=inputs["s_aux"], alibi_slopes=inputs["alibi_slopes"],
        cu_seqlens_q=inputs["cu_seqlens_q"], cu_seqlens_k=inputs["cu_seqlens_k"],
        **reference_kwargs(params))


def run_kernels(bwd, inputs, params, out, lse, tiles=None, group_splits=None):
    """The kernels into NaN-poisoned destinations; returns dq, dk, dv (and ds_aux)."""
    return run_backward(bwd, inputs["dout"], inputs["q"], inputs["k"], inputs["v"], out, lse,
                        params=params, cu_seqlens_q=inputs["cu_seqlens_q"],
                        cu_seqlens_k=inputs["cu_seqlens_k"], s_aux=inputs["s_aux"],
                        alibi_slopes=inputs["alibi_slopes"],
                        tiles=None if tiles is None else bwd.BwdTiles(*tiles),
                        group_splits=group_splits)


def check_case(bwd, attn_params, device, case: Case, dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    inputs = make_inputs(case, dtype, device)
    params = make_params(attn_params, case, inputs)
    ref64, lowp = reference(inputs, params, torch.float64), reference(inputs, params, dtype)
    # The backward's forward inputs as a forward kernel would hand them over.
    out, lse = ref64["out"].to(dtype).contiguous(), ref64["lse"].to(torch.float32).contiguous()
    ours = run_kernels(bwd, inputs, params, out, lse, case.tiles, case.group_splits)
    for name, value in ours.items():
        assert value.dtype == (torch.float32 if name == "ds_aux" else dtype), name
    assert_each_close(ours, ref64, lowp)
    return inputs, params, out, lse, ours


# ---------------------------------------------------------------------------------------------
# The feature matrix (interpreter-sized). GQA ratios 2 and 4 and MQA appear in most rows.
# ---------------------------------------------------------------------------------------------

MHA, GQA2, GQA4, MQA = (4, 4), (4, 2), (8, 2), (4, 1)
LARGE = (32, 64, 4, 2, 64, 32, 4, 2)  # fewer interpreted steps for the ~130-long cases
CASES = {
    "mha_full": Case(heads=MHA),
    "gqa2_causal_square": Case(heads=GQA2, sizes=(65, 65), causal=True),
    "gqa4_causal_sq_lt_sk": Case(heads=GQA4, sizes=(47, 113), causal=True, batch=1),
    "mqa_causal_sq_gt_sk": Case(heads=MQA, sizes=(113, 47), causal=True, batch=1),
    "group3_full": Case(heads=(3, 1), sizes=(29, 41)),
    "decode_sq1_gqa4": Case(heads=GQA4, sizes=(1, 77), causal=True),
    "sq1_sk2_mqa": Case(heads=MQA, sizes=(1, 2), batch=3),
    "window_gqa2": Case(heads=GQA2, sizes=(70, 90), window=(17, 4), batch=1),
    "window_wide_gqa4": Case(heads=GQA4, sizes=(100, 110), window=(45, 38), batch=1),
    "window_left_only_mha": Case(heads=MHA, sizes=(53, 40), window=(9, -1), batch=1),
    "window_right_only_gqa4": Case(heads=GQA4, sizes=(40, 53), window=(-1, 5), batch=1),
    "causal_window_mqa": Case(heads=MQA, sizes=(90, 90), causal=True, window=(23, -1),
                              batch=1),
    "softcap_gqa4_causal": Case(heads=GQA4, sizes=(33, 47), causal=True, softcap=4.0,
                                softmax_scale=0.5, batch=1),
    "softcap_mha": Case(heads=MHA, softcap=30.0),
    "alibi_head_gqa2": Case(heads=GQA2, alibi="head"),
    "alibi_batch_causal_mqa": Case(heads=MQA, alibi="batch", causal=True, sizes=(53, 37)),
    "sink_gqa4_causal": Case(heads=GQA4, sink=True, causal=True, batch=1),
    "sink_window_empty_rows": Case(heads=GQA2, sink=True, window=(3, 0), sizes=(53, 37),
                                   batch=1),
    "dropout_mha": Case(heads=MHA, dropout_p=0.17, seed=1),
    "dropout_gqa4_causal_seed64": Case(heads=GQA4, dropout_p=0.5, seed=(7 << 32) + 12345,
                                       causal=True, batch=1),
    "varlen_gqa2_causal": Case(heads=GQA2, sizes=(33, 40), layout="varlen", causal=True),
    "varlen_mqa_sink": Case(heads=MQA, sizes=(40, 33), layout="varlen", sink=True),
    "varlen_transposed_window_gqa4": Case(heads=GQA4, sizes=(45, 45), window=(8, 8),
                                          layout="varlen_transposed"),
    "varlen_alibi_batch_dropout": Case(heads=GQA2, sizes=(30, 50), layout="varlen",
                                       alibi="batch", dropout_p=0.3, seed=5, causal=True),
    "transposed_gqa4_strided_dout": Case(heads=GQA4, layout="transposed", dout="strided",
                                         causal=True, batch=1),
    "strided_dout_mha": Case(heads=MHA, dout="strided", window=(12, 12)),
    "odd_129x130_large_tiles": Case(heads=GQA2, sizes=(129, 130), head_dim=16, batch=1,
                                    causal=True, tiles=LARGE),
    "odd_130x17_full": Case(heads=MQA, sizes=(130, 17), head_dim=16, batch=1, tiles=LARGE),
    "d8_causal": Case(heads=GQA2, sizes=(20, 20), head_dim=8, causal=True),
    "d40_transposed_window": Case(heads=GQA2, head_dim=40, layout="transposed", window=(6, 2)),
    "d80_gqa2": Case(heads=(2, 1), sizes=(17, 33), head_dim=80, batch=1),
    "d128_causal_mqa": Case(heads=(2, 1), sizes=(33, 33), head_dim=128, batch=1, causal=True),
    "d256_sink": Case(heads=(2, 1), sizes=(17, 20), head_dim=256, batch=1, sink=True),
    "everything_varlen": Case(heads=(6, 2), sizes=(41, 47), layout="varlen_transposed",
                              causal=True, window=(19, -1), softcap=5.0, alibi="head",
                              sink=True, dropout_p=0.25, seed=99, dout="strided"),
}
# Dropout is in the CI subset through test_bitwise_deterministic (GQA, causal, sink, dropout).
CI_CASES = {"gqa4_causal_sq_lt_sk", "mqa_causal_sq_gt_sk", "varlen_mqa_sink", "decode_sq1_gqa4"}


def _marked(names):
    return [pytest.param(name, marks=pytest.mark.kernels_ci) if name in CI_CASES else name
            for name in names]


@pytest.mark.parametrize("name", _marked(CASES))
def test_gradients_match_reference(bwd, attn_params, device, name):
    check_case(bwd, attn_params, device, CASES[name])


TMA_TILES = (16, 32, 1, 1, 32, 16, 1, 1, "tests: tensor descriptors", True, True)


@pytest.mark.parametrize("name", ["gqa4_causal_sq_lt_sk", "mqa_causal_sq_gt_sk", "d8_causal",
                                  "d40_transposed_window", "everything_varlen",
                                  "transposed_gqa4_strided_dout"])
def test_tensor_descriptor_path(bwd, attn_params, device, monkeypatch, name):
    """Both kernels through tensor descriptors (the interpreter runs them on CPU tensors): the
    descriptors' bounds replace the row and column masks of Q, dO, K and V."""
    granted = []

    def recording(*args):
        granted.append(use_tma(*args))
        return granted[-1]
    use_tma = bwd.use_tma
    monkeypatch.setattr(bwd, "use_tma", recording)
    check_case(bwd, attn_params, device, dataclasses.replace(CASES[name], tiles=TMA_TILES))
    assert granted == [True, True]


ATOMIC_TILES = (16, 32, 1, 1, 32, 16, 1, 1, "tests: atomic dQ", False, False, True)
ATOMIC_CASES = ["gqa4_causal_sq_lt_sk", "mqa_causal_sq_gt_sk", "decode_sq1_gqa4", "group3_full",
                "window_gqa2", "softcap_gqa4_causal", "sink_window_empty_rows",
                "dropout_gqa4_causal_seed64", "varlen_mqa_sink", "everything_varlen",
                "odd_130x17_full", "d80_gqa2"]


@pytest.mark.parametrize("name", _marked(ATOMIC_CASES))
def test_atomic_dq_path(bwd, attn_params, device, monkeypatch, name):
    """deterministic=False with an ``atomic_dq`` tile: dQ is accumulated in the dK/dV kernel
    (fp32 atomics) and the dQ kernel is not launched."""
    launched = []
    dq_kernel = bwd._bwd_dq_kernel

    class Recording:
        def __getitem__(self, grid):
            launched.append(grid)
            return dq_kernel[grid]
    monkeypatch.setattr(bwd, "_bwd_dq_kernel", Recording())
    case = CASES[name]
    tiles = ATOMIC_TILES if case.tiles is None else (*case.tiles, "tests", False, False, True)
    check_case(bwd, attn_params, device,
               dataclasses.replace(case, tiles=tiles, deterministic=False))
    assert launched == []


@pytest.mark.parametrize("name", ["everything_varlen", "odd_130x17_full", "d80_gqa2"])
def test_atomic_dq_with_tensor_descriptors(bwd, attn_params, device, name):
    """The atomic path with descriptor reads: partial query blocks and D=80 in a 128-wide tile
    (the atomics' row and column masks)."""
    tiles = (*ATOMIC_TILES[:9], True, False, True)
    check_case(bwd, attn_params, device,
               dataclasses.replace(CASES[name], tiles=tiles, deterministic=False))


@pytest.mark.parametrize("name", ["everything_varlen", "d80_gqa2"])
def test_head_dim_split_with_atomic_dq_through_descriptors(bwd, attn_params, device, name):
    """Each half-width program adds its columns of dQ at column col0, reading through
    descriptors."""
    tiles = (*D_SPLIT_TILES[:9], True, False, True, 2)
    check_case(bwd, attn_params, device,
               dataclasses.replace(CASES[name], tiles=tiles, deterministic=False))


def test_deterministic_ignores_atomic_dq(bwd, attn_params, device):
    """deterministic=True with an ``atomic_dq`` tile still runs the dQ kernel: bitwise
    reproducible."""
    case = dataclasses.replace(CASES["gqa4_causal_sq_lt_sk"], tiles=ATOMIC_TILES)
    inputs, params, out, lse, first = check_case(bwd, attn_params, device, case)
    second = run_kernels(bwd, inputs, params, out, lse, case.tiles)
    for name in first:
        assert torch.equal(first[name], second[name]), name


D_SPLIT_TILES = (16, 32, 1, 1, 32, 16, 1, 1, "tests: head-dim split", False, False, False, 2)
D_SPLIT_CASES = ["gqa4_causal_sq_lt_sk", "mqa_causal_sq_gt_sk", "window_gqa2",
                 "softcap_gqa4_causal", "dropout_gqa4_causal_seed64", "varlen_mqa_sink",
                 "everything_varlen", "d40_transposed_window", "d80_gqa2", "d256_sink",
                 "odd_130x17_full", "d8_causal"]


@pytest.mark.parametrize("name", _marked(D_SPLIT_CASES))
def test_head_dim_split(bwd, attn_params, device, name):
    """``dkdv_d_splits=2``: two dK/dV programs per key block, each owning half the head dim
    ([Note: head-dim split]); D=40 and D=80 leave the second half partly padding, and D=8/16
    (BLOCK_D 16, too narrow to halve) run unsplit."""
    case = CASES[name]
    tiles = D_SPLIT_TILES if case.tiles is None else (*case.tiles, "tests", False, False,
                                                       False, 2)
    check_case(bwd, attn_params, device, dataclasses.replace(case, tiles=tiles))


@pytest.mark.parametrize("name", ["everything_varlen", "d40_transposed_window"])
def test_head_dim_split_with_tensor_descriptors(bwd, attn_params, device, name):
    """Full tiles through descriptors, the column slices through pointers, in one program."""
    tiles = (*D_SPLIT_TILES[:9], True, True, False, 2)
    check_case(bwd, attn_params, device, dataclasses.replace(CASES[name], tiles=tiles))


@pytest.mark.parametrize("name", ["everything_varlen", "d80_gqa2", "mqa_causal_sq_gt_sk"])
def test_head_dim_split_with_atomic_dq_and_group_split(bwd, attn_params, device, name):
    """The head-dim split with dQ from the dK/dV kernel (each program adds its half of dQ's
    columns) and with the query-head group split across programs as well."""
    tiles = (*D_SPLIT_TILES[:11], True, 2)
    case = CASES[name]
    group = case.heads[0] // case.heads[1]
    check_case(bwd, attn_params, device,
               dataclasses.replace(case, tiles=tiles, deterministic=False,
                                   group_splits=2 if group % 2 == 0 else 1))


@pytest.mark.kernels_ci
def test_bitwise_deterministic(bwd, attn_params, device):
    """Two runs give bitwise equal gradients: every element has one writer, no atomics."""
    case = Case(heads=GQA4, sizes=(33, 47), causal=True, sink=True, dropout_p=0.2, seed=3,
                batch=1)
    inputs, params, out, lse, first = check_case(bwd, attn_params, device, case)
    second = run_kernels(bwd, inputs, params, out, lse)
    for name in first:
        assert torch.equal(first[name], second[name]), name


# ---------------------------------------------------------------------------------------------
# The dK/dV group split ([Note: group split]): forced, so that small interpreter grids take
# it; each part's fp32 partial is summed afterwards, and a wrong slice, a lost part or a part
# counted twice moves dK/dV by a whole query head's contribution, far past the tolerance.
# ---------------------------------------------------------------------------------------------


def record_group_splits(monkeypatch, bwd) -> list:
    """The GROUP_SPLITS of every dK/dV launch from now on."""
    splits = []
    kernel = bwd._bwd_dkdv_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                splits.append(kwargs["GROUP_SPLITS"])
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(bwd, "_bwd_dkdv_kernel", Recording())
    return splits


GQA4_FULL = Case(heads=GQA4, sizes=(37, 53))
SPLIT_CASES = {  # (case, forced splits)
    "mqa_causal_split2": (CASES["mqa_causal_sq_gt_sk"], 2),
    "mqa_causal_split4": (CASES["mqa_causal_sq_gt_sk"], 4),
    "mqa_causal_unsplit": (CASES["mqa_causal_sq_gt_sk"], 1),
    "mqa_full_split4": (Case(heads=MQA, sizes=(45, 70)), 4),
    "gqa4_full_split2": (GQA4_FULL, 2),
    "gqa4_full_split4": (GQA4_FULL, 4),
    "gqa4_causal_split4": (CASES["gqa4_causal_sq_lt_sk"], 4),
    "gqa4_window_split2": (CASES["window_wide_gqa4"], 2),
    "gqa4_softcap_split2": (CASES["softcap_gqa4_causal"], 2),
    "gqa4_dropout_split4": (CASES["dropout_gqa4_causal_seed64"], 4),
    "gqa4_transposed_split2": (CASES["transposed_gqa4_strided_dout"], 2),
    "mqa_alibi_batch_split2": (CASES["alibi_batch_causal_mqa"], 2),
    "mqa_decode_sq1_split4": (CASES["sq1_sk2_mqa"], 4),
    "varlen_mqa_sink_split4": (CASES["varlen_mqa_sink"], 4),
    "varlen_mqa_sink_unsplit": (CASES["varlen_mqa_sink"], 1),
    "varlen_gqa2_causal_split2": (CASES["varlen_gqa2_causal"], 2),
    "varlen_gqa4_window_split4": (CASES["varlen_transposed_window_gqa4"], 4),
    "varlen_everything_group6_split2": (dataclasses.replace(CASES["everything_varlen"],
                                                           heads=(6, 1)), 2),
    "odd_130x17_mqa_large_tiles_split4": (CASES["odd_130x17_full"], 4),
    "d128_causal_mqa_split2": (CASES["d128_causal_mqa"], 2),
    "d256_sink_split2": (CASES["d256_sink"], 2),
}
SPLIT_CI_CASES = {"mqa_causal_split4", "gqa4_full_split2", "varlen_mqa_sink_split4"}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.kernels_ci)
                                  if name in SPLIT_CI_CASES else name for name in SPLIT_CASES])
def test_group_split(bwd, attn_params, device, monkeypatch, name):
    case, splits = SPLIT_CASES[name]
    launched = record_group_splits(monkeypatch, bwd)
    check_case(bwd, attn_params, device, dataclasses.replace(case, group_splits=splits))
    assert launched == [splits]


@pytest.mark.parametrize("name", ["gqa4_causal_split4", "varlen_everything_group6_split2"])
def test_group_split_with_atomic_dq(bwd, attn_params, device, name):
    """Each part adds the dQ of its own query heads with atomics, beside its dK/dV partial."""
    case, splits = SPLIT_CASES[name]
    check_case(bwd, attn_params, device, dataclasses.replace(
        case, tiles=ATOMIC_TILES, deterministic=False, group_splits=splits))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("layout", ["contiguous", "varlen"])
def test_group_split_bitwise_deterministic(bwd, attn_params, device, layout):
    """A split run twice gives bitwise equal gradients: the partial sum has a fixed order."""
    case = Case(heads=GQA4, sizes=(33, 47), causal=True, sink=True, dropout_p=0.2, seed=3,
                batch=1, layout=layout, group_splits=4)
    inputs, params, out, lse, first = check_case(bwd, attn_params, device, case)
    second = run_kernels(bwd, inputs, params, out, lse, group_splits=case.group_splits)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_group_split_choice(heuristics):
    """The smallest power of two dividing the group that reaches DKDV_WAVES programs per SM,
    capped by the group; never a split once the grid is large enough."""
    waves = heuristics.DKDV_WAVES
    choose = heuristics.dkdv_group_splits
    assert choose(128, 32, 132) == 8  # MQA 32/1, 16k tokens, BLOCK_N=128, on an H200
    assert choose(32, 32, 132) == 32  # capped by the group
    assert choose(256, 4, 132) == 4
    assert choose(waves * 132, 32, 132) == 1
    assert choose(10, 1, 132) == 1  # MHA
    assert choose(10, 3, 132) == 1  # no power of two divides an odd group
    assert choose(10, 6, 132) == 2
    # without a band one wave suffices: MQA 32/1 at 16k tokens is not split, a short one is
    assert choose(128, 32, 132, banded=False) == 1
    assert choose(32, 32, 132, banded=False) == 4
    assert choose(10, 6, 132, banded=False) == 2
    for programs, group in itertools.product((1, 7, 64, 128, 300, 529, 5000), (1, 2, 8, 32)):
        splits = choose(programs, group, 132)
        assert group % splits == 0 and splits & (splits - 1) == 0
        if splits > 1:  # the peak-memory bound of the note: the smaller split fell short
            assert programs * splits // 2 < waves * 132 <= programs * splits or splits == group


def test_group_split_default_follows_sm_count(bwd, heuristics, attn_params, device,
                                              monkeypatch):
    """Without a forced split the launcher asks dkdv_group_splits with the device's SM count
    (fixed under the interpreter): an MQA grid of 2 programs splits, MHA does not."""
    launched = record_group_splits(monkeypatch, bwd)
    check_case(bwd, attn_params, device, CASES["mqa_causal_sq_gt_sk"])
    check_case(bwd, attn_params, device, CASES["mha_full"])
    sms = heuristics.sm_count(device)
    assert launched == [heuristics.dkdv_group_splits(2, 4, sms), 1]
    assert device.type == "cuda" or launched[0] > 1


def test_group_split_must_divide_the_group(bwd, attn_params, device):
    torch.manual_seed(0)
    case = Case(heads=GQA4, sizes=(5, 7), batch=1)
    inputs = make_inputs(case, torch.float16, device)
    params = make_params(attn_params, case, inputs)
    ref64 = reference(inputs, params, torch.float64)
    with pytest.raises(ValueError, match="group_splits must divide Hq // Hkv = 4; got 3"):
        run_kernels(bwd, inputs, params, ref64["out"].half(), ref64["lse"].float(),
                    group_splits=3)


def test_keys_nobody_sees_get_zero_gradients(bwd, attn_params, device):
    """A causal Sq < Sk band leaves keys past the last diagonal unseen: exact zeros, no NaN;
    rows with lse = -inf (Sq > Sk) contribute nothing."""
    torch.manual_seed(0)
    case = Case(heads=GQA2, sizes=(5, 70), window=(3, 0), batch=1)
    inputs = make_inputs(case, torch.float16, device)
    params = make_params(attn_params, case, inputs)
    ref64 = reference(inputs, params, torch.float64)
    grads = run_kernels(bwd, inputs, params, ref64["out"].half(), ref64["lse"].float())
    seen = slice(70 - 5 - 3, 70)
    assert torch.count_nonzero(grads["dk"][:, :seen.start]) == 0
    assert torch.count_nonzero(grads["dv"][:, :seen.start]) == 0
    assert torch.isfinite(grads["dk"]).all() and torch.isfinite(grads["dq"]).all()


def test_tile_table_is_complete_and_valid(bwd):
    """Every (arch, BLOCK_D) the launcher can ask for has an entry the kernels can compile."""
    archs = {arch for arch, _ in bwd.TILES}
    for arch, block_d in itertools.product(archs, (16, 32, 64, 128, 256)):
        tiles = bwd.TILES[(arch, block_d)]
        for size in (tiles.dkdv_block_m, tiles.dkdv_block_n, tiles.dq_block_m,
                     tiles.dq_block_n):
            assert size >= 16 and size & (size - 1) == 0, (arch, block_d, tiles)
        assert tiles.reason, (arch, block_d)


def test_import_does_not_touch_cuda():
    """Importing the module defines kernels only: no CUDA initialisation, no compilation."""
    code = ("import sys, types, torch; p = types.ModuleType('fa'); p.__path__ = [sys.argv[1]]; "
            "sys.modules['fa'] = p; import fa._triton.bwd; "
            "assert not torch.cuda.is_initialized(), 'CUDA initialised at import'")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code, str(SOURCE_PACKAGE)], check=True, env=env,
                   timeout=120)


# Compiles both main kernels for sm_90a and sm_80 with every feature flag on and the shipped
# tiles, and for sm_90a through tensor descriptors too (Triton's frontend, LLVM and ptxas run
# without a GPU), in a process without the interpreter: catches what only the compiler checks
# (constexpr globals, types, layouts). Prints ptxas's registers and spills per variant.
_COMPILE_SCRIPT = r"""
import importlib, os, re, subprocess, sys, tempfile, types
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
package = types.ModuleType("fa_compile"); package.__path__ = [sys.argv[1]]
sys.modules["fa_compile"] = package
bwd = importlib.import_module("fa_compile._triton.bwd")
FLOATS = {"softmax_scale", "qk_scale", "softcap_log2", "dropout_rescale"}
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

def ptxas_usage(ptx, arch):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx); f.flush()
        log = subprocess.run([PTXAS, "-v", f"-arch=sm_{arch}{'a' if arch == 90 else ''}", f.name,
                              "-o", os.devnull], capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log).group(1)
    spill = re.search(r"(\d+) bytes spill stores", log).group(1)
    return f"{regs} regs, {spill} B spill stores"

for arch, name, tma in ((90, "sm90", False), (90, "sm90", True), (80, "sm80", False)):
    for head_dim in (64, 128, 256):
        tiles = bwd.TILES[(name, head_dim)]
        # the dK/dV kernel also with a group split (fp32 partial stores) and with the head-dim
        # split (column slices, sm90 D=256 with atomic dQ) on sm90 pointers
        extra = [dict(GROUP_SPLITS=2, D_SPLITS=1)] if (arch, tma) == (90, False) else []
        if (arch, tma, head_dim) == (90, False, 256):
            extra.append(dict(GROUP_SPLITS=1, D_SPLITS=2, ATOMIC_DQ=True))
        if (arch, tma, head_dim) == (90, False, 64):  # the H200's D=64 entry: atomic dQ
            extra.append(dict(GROUP_SPLITS=1, D_SPLITS=1, ATOMIC_DQ=True))
        variants = [(bwd._bwd_dkdv_kernel, "dkdv", e)
                    for e in [dict(GROUP_SPLITS=1, D_SPLITS=1)] + extra]
        for kernel, kind, extra in variants + [(bwd._bwd_dq_kernel, "dq", {})]:
            flags = dict(HEAD_DIM=head_dim - 8, BLOCK_D=head_dim, GROUP=4, IS_VARLEN=True,
                         HAS_WINDOW_LEFT=True, HAS_WINDOW_RIGHT=True, SOFTCAP=True,
                         HAS_ALIBI=True, DROPOUT=True, BLOCK_M=getattr(tiles, kind + "_block_m"),
                         BLOCK_N=getattr(tiles, kind + "_block_n"),
                         TMA=tma or getattr(tiles, kind + "_tma"), **extra)
            if kind == "dkdv":
                flags.setdefault("ATOMIC_DQ", False)
            fp32 = ({"LSE", "DELTA", "ALIBI"}
                    | ({"DK", "DV"} if extra.get("GROUP_SPLITS", 1) > 1 else set())
                    | ({"DQACC"} if extra.get("ATOMIC_DQ") else set()))
            signature = {}
            for arg in kernel.arg_names:
                if arg in flags:
                    signature[arg] = "constexpr"
                elif arg.isupper():
                    signature[arg] = ("*i32" if arg.startswith("CU_") else
                                      "*fp32" if arg in fp32 else "*bf16")
                else:
                    signature[arg] = "fp32" if arg in FLOATS else "i32"
            options = dict(num_warps=getattr(tiles, kind + "_warps"),
                           num_stages=getattr(tiles, kind + "_stages"))
            compiled = triton.compile(ASTSource(kernel, signature, flags),
                                      target=GPUTarget("cuda", arch, 32), options=options)
            assert compiled.asm["cubin"], (arch, head_dim, kind)
            print(f"{name} D={head_dim - 8} {kind} tma={flags['TMA']} {extra} "
                  f"{flags['BLOCK_M']}x{flags['BLOCK_N']} {options}: "
                  f"{compiled.metadata.shared} B shared memory, "
                  f"{ptxas_usage(compiled.asm['ptx'], arch)}")
"""


def test_kernels_compile_for_hopper_and_ampere(bwd):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    package = Path(bwd.__file__).parents[1]  # the folder holding _triton/
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(package)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)


# ---------------------------------------------------------------------------------------------
# GPU: realistic sizes, both dtypes, compiled with the shipped tile table.
# ---------------------------------------------------------------------------------------------

GPU_CASES = {
    "gqa_32_8_causal": Case(heads=(32, 8), sizes=(1024, 1024), head_dim=128, causal=True),
    "gqa_32_8_full_d64": Case(heads=(32, 8), sizes=(777, 1025), head_dim=64),
    "mqa_16_1_causal_decode_band": Case(heads=(16, 1), sizes=(300, 1500), head_dim=128,
                                        causal=True),
    "mha_d256_window": Case(heads=(8, 8), sizes=(1000, 1000), head_dim=256, window=(255, 255)),
    "varlen_gqa_32_8_causal": Case(heads=(32, 8), sizes=(1500, 1500), head_dim=128,
                                   layout="varlen_transposed", causal=True),
    "gqa_softcap_sink_dropout": Case(heads=(16, 4), sizes=(513, 513), head_dim=96,
                                     causal=True, softcap=30.0, sink=True, dropout_p=0.1,
                                     seed=42, alibi="head"),
    # 2048 / 128 * 2 = 32 dK/dV programs: the launcher splits the group (GROUP_SPLITS > 1)
    "mqa_32_1_causal_group_split": Case(heads=(32, 1), sizes=(2048, 2048), head_dim=128,
                                        causal=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_realistic(bwd, attn_params, name, dtype):
    inputs, params, out, lse, first = check_case(bwd, attn_params, torch.device("cuda"),
                                                 GPU_CASES[name], dtype=dtype)
    second = run_kernels(bwd, inputs, params, out, lse)
    for key in first:
        assert torch.equal(first[key], second[key]), f"{key} not bitwise reproducible"


@pytest.mark.gpu
@pytest.mark.parametrize("heads,group_splits", [((32, 8), 1), ((32, 1), None)],
                         ids=["gqa_32_8_unsplit", "mqa_32_1_split"])
def test_gpu_no_query_head_sized_buffers(bwd, attn_params, monkeypatch, heads, group_splits):
    """Without a group split the backward allocates only the fp32 DELTA (lse-sized): no
    (.., Hq, D) dK/dV. With one, it adds the fp32 partials (2 x GROUP_SPLITS x K-size) and one
    K-size fp32 sum at a time ([Note: group split])."""
    case = Case(heads=heads, sizes=(2048, 2048), head_dim=128, causal=True, batch=2)
    torch.manual_seed(0)
    inputs = make_inputs(case, torch.bfloat16, torch.device("cuda"))
    params = make_params(attn_params, case, inputs)
    q = inputs["q"]
    out = torch.randn_like(q).contiguous()
    lse = torch.randn(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    with monkeypatch.context() as patch:  # compile outside the measurement, learn the split
        launched = record_group_splits(patch, bwd)
        run_kernels(bwd, inputs, params, out, lse, group_splits=group_splits)
    splits = launched[0]
    assert (splits == 1) == (group_splits == 1), splits
    grads = dict(dq=torch.empty_like(q, memory_format=torch.contiguous_format),
                 dk=torch.empty_like(inputs["k"], memory_format=torch.contiguous_format),
                 dv=torch.empty_like(inputs["v"], memory_format=torch.contiguous_format))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    bwd.backward(inputs["dout"], q, inputs["k"], inputs["v"], out, lse, grads["dq"],
                 grads["dk"], grads["dv"], None, cu_seqlens_q=None, cu_seqlens_k=None,
                 s_aux=None, alibi_slopes=None, params=params, group_splits=group_splits)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    partials = 0 if splits == 1 else (2 * splits + 1) * inputs["k"].numel() * 4
    assert extra <= 2 * lse.numel() * 4 + partials + (1 << 20), \
        f"backward allocated {extra} bytes with GROUP_SPLITS={splits}"
