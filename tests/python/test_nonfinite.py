"""The NaN/Inf policy on the issue's own examples (CPU, and CUDA: row-wise f32 and tensor-core f16
kernels; a v with a NaN or Inf sends an f16 call to the exact row-wise kernel, decided on the
device): a masked key contributes exactly nothing, also inside a 64-key tensor-core tile; a NaN
that takes part in a row's softmax makes that row (and its lse) NaN, as torch's SDPA; an Inf in a value a row uses makes that row non-finite. The backward follows: gradients of
rows and keys that never meet the bad element stay finite and exact."""
import numpy as np
import pytest

import cubeattn
from conftest import ref_attention, ref_backward

CU = np.array([0, 8], np.int32)
# (device, dtype, head_dim): the CPU, CUDA's row-wise f32 kernels, CUDA's tensor-core kernels
TARGETS = [pytest.param(("cpu", np.float32, 16), id="cpu"),
           pytest.param(("cuda", np.float32, 64), id="cuda-f32", marks=pytest.mark.gpu),
           pytest.param(("cuda", np.float16, 64), id="cuda-f16", marks=pytest.mark.gpu)]


@pytest.fixture(params=TARGETS)
def target(request):
    return request.param


def inputs(target):
    _, dtype, d = target
    rng = np.random.default_rng(0)
    return [rng.uniform(-1, 1, (8, 2, d)).astype(dtype) for _ in range(4)]


def tol(target):
    return 1e-5 if target[1] == np.float32 else 2e-3


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_inf_in_v3_does_not_touch_rows_0_to_2_under_causal(value, target):
    dev, t = target[0], tol(target)
    q, k, v, dout = inputs(target)
    v[3, 1, 5] = value
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, CU, CU, 8, 8, causal=True, return_lse=True, device=dev)
    clean = v.copy()
    clean[3, 1, 5] = 0
    ref, _ = ref_attention(q, k, clean, [(0, 8, 0, 8)], True)
    np.testing.assert_allclose(out[:3], ref[:3], rtol=t, atol=t)  # finite, as without the element
    assert np.all(np.isfinite(out[:, 0]))  # kv head 0 never meets it
    assert np.all(~np.isfinite(out[3:, 1, 5]))  # rows 3.. use v[3] with weight > 0
    dq, dk, dv = cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, CU, CU, 8, 8, causal=True, device=dev)
    rq, rk, rv = ref_backward(q, k, clean, dout, [(0, 8, 0, 8)], True)
    t = 10 * t
    np.testing.assert_allclose(dq[:3], rq[:3], rtol=t, atol=t)
    np.testing.assert_allclose(dq[:, 0], rq[:, 0], rtol=t, atol=t)
    np.testing.assert_allclose(dk[:, 0], rk[:, 0], rtol=t, atol=t)
    np.testing.assert_allclose(dv[:, 0], rv[:, 0], rtol=t, atol=t)


def test_nan_in_one_key_element_makes_the_rows_that_see_it_nan(target):
    dev = target[0]
    q, k, v, _ = inputs(target)
    k[5, 0, 2] = np.nan
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, CU, CU, 8, 8, causal=True, return_lse=True, device=dev)
    assert np.all(np.isnan(out[5:, 0])) and np.all(np.isnan(lse[0, 5:]))
    assert np.all(np.isfinite(out[:5])) and np.all(np.isfinite(out[:, 1]))
    # without causal every row sees key 5
    full = cubeattn.flash_attn_varlen_func(q, k, v, CU, CU, 8, 8, device=dev)
    assert np.all(np.isnan(full[:, 0])) and np.all(np.isfinite(full[:, 1]))


def test_nan_query_row_gives_nan_not_zeros(target):
    q, k, v, _ = inputs(target)
    q[2, 1, 0] = np.nan
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, CU, CU, 8, 8, return_lse=True, device=target[0])
    assert np.all(np.isnan(out[2, 1])) and np.isnan(lse[1, 2])
    mask = np.ones(out.shape[:2], bool)
    mask[2, 1] = False
    assert np.all(np.isfinite(out[mask]))


def test_nan_outside_a_sliding_window_is_invisible(target):
    q, k, v, _ = inputs(target)
    v[0, 0, 0] = np.nan
    out = cubeattn.flash_attn_varlen_func(q, k, v, CU, CU, 8, 8, causal=True, window_size=(2, 0), device=target[0])
    assert np.all(np.isnan(out[:3, 0, 0])) and np.all(np.isfinite(out[3:]))


@pytest.mark.torch
def test_autograd_nan_stays_in_its_rows(target):
    torch = pytest.importorskip("torch")
    dev = "cpu" if target[0] == "cpu" else "cuda"
    q, k, v, dout = (torch.from_numpy(x).to(dev) for x in inputs(target))
    v[6, 0, 1] = float("inf")
    for x in (q, k, v):
        x.requires_grad_()
    out = cubeattn.flash_attn_varlen_func(q, k, v, CU, CU, 8, 8, causal=True, device=target[0])
    out.backward(dout)
    assert torch.isfinite(out[:6]).all() and torch.isfinite(q.grad[:6]).all()
    assert torch.isfinite(k.grad[:, 1]).all() and torch.isfinite(v.grad[:, 1]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_backward_inf_in_v_stays_in_its_sequence(causal, target):
    """Two packed sequences whose keys share a 64-key tile of the tensor-core kernels (keys 64-127
    hold keys 64-99 of sequence 0 and 0-27 of sequence 1). An Inf in v of sequence 1 makes its
    rows' outputs non-finite; the gradients of sequence 0 must still be those of sequence 0 alone
    (a masked (key, row) pair contributes nothing, also when its dP or delta is non-finite), and
    kv head 0 never meets the Inf."""
    dev, dtype, d = target
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.uniform(-1, 1, (250, 2, d)).astype(dtype) for _ in range(4))
    v[120, 1, 3] = np.inf
    cu = np.array([0, 100, 250], np.int32)
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, 150, 150, causal=causal, return_lse=True, device=dev)
    assert not np.all(np.isfinite(out[100:, 1]))
    grads = cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, 150, 150, causal=causal, device=dev)
    c0 = np.array([0, 100], np.int32)
    o0, l0 = cubeattn.flash_attn_varlen_func(q[:100], k[:100], v[:100], c0, c0, 100, 100, causal=causal,
                                             return_lse=True, device=dev)
    alone = cubeattn.flash_attn_varlen_backward(dout[:100], q[:100], k[:100], v[:100], o0, l0, c0, c0, 100, 100,
                                                causal=causal, device=dev)
    t = 10 * tol(target)
    for name, g, g0 in zip(("dq", "dk", "dv"), grads, alone):
        assert np.all(np.isfinite(g[:100])), f"{name} of sequence 0 is not finite"
        np.testing.assert_allclose(g[:100], g0, rtol=t, atol=t, err_msg=name)
        assert np.all(np.isfinite(g[:, 0])), f"{name} of kv head 0 is not finite"


@pytest.mark.gpu
@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_decode_step_with_a_bad_value_takes_the_exact_path(value):
    """A decode step (one query row per sequence, GQA 8 / 2, head_dim 128): few rows a tile, so on
    Hopper the tensor-core kernel checks its V tiles itself instead of the pass over v. A bad value
    in sequence 1's kv head 1 reaches that sequence's rows of heads 4-7 only; everything else is
    the clean result."""
    rng = np.random.default_rng(2)
    b, sk, d = 3, 300, 128
    q = rng.uniform(-1, 1, (b, 1, 8, d)).astype(np.float16)
    k, v = (rng.uniform(-1, 1, (b, sk, 2, d)).astype(np.float16) for _ in range(2))
    v[1, 217, 1, 40] = value
    out = cubeattn.flash_attn_func(q, k, v, device="cuda")
    clean = v.copy()
    clean[1, 217, 1, 40] = 0
    want = cubeattn.flash_attn_func(q, k, clean, device="cpu")
    bad = np.zeros(out.shape, bool)
    bad[1, :, 4:, 40] = True
    assert np.all(~np.isfinite(out[bad]))
    np.testing.assert_allclose(out[~bad].astype(np.float64), want[~bad].astype(np.float64), rtol=2e-3, atol=2e-3)
