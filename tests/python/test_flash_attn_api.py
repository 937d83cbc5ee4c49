"""flash-attn conformance (issue 13): every entry point takes flash-attn 2's positional order,
options cubeattn cannot serve raise NotImplementedError naming the argument, and the return
convention of return_attn_probs is flash-attn's (with S_dmask None). Also the first-use argument
checks: bool-only flags, 0-d tensors as max_seqlen, shapes and estimate_vram naming the argument."""
import inspect

import numpy as np
import pytest

import cubeattn
from conftest import ref_attention, ref_backward, varlen_segments

try:
    import torch
except Exception:  # pragma: no cover - torch is optional
    torch = None

# flash-attn 2.x (flash_attn/flash_attn_interface.py): parameter names and defaults, in order
FA_FUNC = [("q", None), ("k", None), ("v", None), ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
           ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
           ("return_attn_probs", False)]
FA_VARLEN = FA_FUNC[:3] + [("cu_seqlens_q", None), ("cu_seqlens_k", None), ("max_seqlen_q", None),
                           ("max_seqlen_k", None)] + FA_FUNC[3:] + [("block_table", None)]
# ring-flash-attention's llama3 / zigzag llama3 varlen function (our causal default is True)
RING = FA_VARLEN[:7] + [("heads_k_stride", None), ("local_k_slice", None), ("dropout_p", 0.0),
                        ("softmax_scale", None), ("causal", True), ("window_size", (-1, -1)),
                        ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False),
                        ("group", None)]
# the options after the tensors, in flash-attn's order (the backward and grouped entry points)
OPTS_BWD = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
            ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False)]


def positional(fn):
    """(name, default) of the parameters that can be given positionally."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            out.append((p.name, None if p.default is p.empty else p.default))
    return out


def keyword_only(fn):
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY]


def test_signatures_are_flash_attns():
    assert positional(cubeattn.flash_attn_func) == FA_FUNC
    assert positional(cubeattn.flash_attn_varlen_func) == FA_VARLEN
    assert positional(cubeattn.zigzag_llama3_flash_attn_varlen_func) == RING
    tensors = [("dout", None), ("q", None), ("k", None), ("v", None), ("out", None), ("lse", None)]
    varlen = [("cu_seqlens_q", None), ("cu_seqlens_k", None), ("max_seqlen_q", None), ("max_seqlen_k", None)]
    assert positional(cubeattn.flash_attn_varlen_backward) == tensors + varlen + OPTS_BWD
    ranges = [("q_ranges", None), ("kv_ranges", None)]
    grouped = [(n, True if n == "causal" else d) for n, d in OPTS_BWD]
    assert positional(cubeattn.grouped_flash_attn_backward) == tensors + ranges + grouped
    assert positional(cubeattn.grouped_flash_attn_func) == FA_FUNC[:3] + ranges + grouped + [("return_attn_probs", False)]
    # our extras are keyword-only, so a flash-attn positional call can never reach them
    for fn in (cubeattn.flash_attn_func, cubeattn.flash_attn_varlen_func):
        # the FP8 descales keyword-only too (FlashAttention-3 names them so)
        assert keyword_only(fn) == ["return_lse", "device", "q_descale", "k_descale", "v_descale"]
    assert keyword_only(cubeattn.grouped_flash_attn_func) == ["return_lse", "kv_block_table", "device"]
    assert keyword_only(cubeattn.flash_attn_varlen_backward) == ["device"]
    assert keyword_only(cubeattn.grouped_flash_attn_backward) == ["kv_block_table", "device"]


def case(seed=0, lq=37, lk=53, hq=4, hkv=2, d=16):
    rng = np.random.default_rng(seed)
    q = rng.uniform(-1, 1, (lq, hq, d)).astype(np.float32)
    k = rng.uniform(-1, 1, (lk, hkv, d)).astype(np.float32)
    v = rng.uniform(-1, 1, (lk, hkv, d)).astype(np.float32)
    return q, k, v, np.array([0, lq], np.int32), np.array([0, lk], np.int32)


SCALE = 0.37


def test_flash_attn_func_in_flash_attns_positional_order():
    q, k, v, cu_q, cu_k = case()
    ref, ref_lse = ref_attention(q, k, v, varlen_segments(cu_q, cu_k), True, SCALE)
    # the call of the issue: dropout_p, softmax_scale, causal by position
    out = cubeattn.flash_attn_func(q[None], k[None], v[None], 0.0, SCALE, True, device="cpu")
    np.testing.assert_allclose(out[0], ref, rtol=1e-5, atol=1e-5)
    # every positional argument, then the return_attn_probs convention: (out, softmax_lse, None)
    res = cubeattn.flash_attn_func(q[None], k[None], v[None], 0.0, SCALE, True, (-1, -1), 0.0, None, False, True,
                                   device="cpu")
    assert isinstance(res, tuple) and len(res) == 3 and res[2] is None
    np.testing.assert_array_equal(res[0], out)
    assert res[1].shape == (1, 4, 37)
    np.testing.assert_allclose(res[1][0], ref_lse, rtol=1e-5, atol=1e-5)
    # keywords give the same; return_lse (ours, keyword-only) gives (out, lse)
    o2, lse2 = cubeattn.flash_attn_func(q[None], k[None], v[None], dropout_p=0.0, softmax_scale=SCALE, causal=True,
                                        return_lse=True, device="cpu")
    np.testing.assert_array_equal(o2, out)
    np.testing.assert_array_equal(lse2, res[1])


def test_varlen_forward_and_backward_in_flash_attns_positional_order():
    q, k, v, cu_q, cu_k = case(1)
    segs = varlen_segments(cu_q, cu_k)
    ref, ref_lse = ref_attention(q, k, v, segs, True, SCALE)
    out = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 37, 53, 0.0, SCALE, True, device="cpu")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    res = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 37, 53, 0.0, SCALE, True, (-1, -1), 0.0, None, False,
                                          True, None, device="cpu")
    assert len(res) == 3 and res[2] is None
    np.testing.assert_array_equal(res[0], out)
    np.testing.assert_allclose(res[1], ref_lse, rtol=1e-5, atol=1e-5)
    dout = np.random.default_rng(5).uniform(-1, 1, q.shape).astype(np.float32)
    grads = cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, res[1], cu_q, cu_k, 37, 53, 0.0, SCALE, True,
                                                (-1, -1), 0.0, None, True, device="cpu")
    for g, r in zip(grads, ref_backward(q, k, v, dout, segs, True, SCALE)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_grouped_in_flash_attns_positional_order():
    q, k, v, _, _ = case(2, lq=30, lk=40)
    qr, kr = [[0, 12], [12, 30]], [[0, 20], [5, 40]]
    segs = [(0, 12, 0, 20), (12, 18, 5, 35)]
    ref, ref_lse = ref_attention(q, k, v, segs, False, SCALE)
    out, lse, none = cubeattn.grouped_flash_attn_func(q, k, v, qr, kr, 0.0, SCALE, False, (-1, -1), 0.0, None,
                                                      False, True, device="cpu")
    assert none is None
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    dout = np.random.default_rng(6).uniform(-1, 1, q.shape).astype(np.float32)
    grads = cubeattn.grouped_flash_attn_backward(dout, q, k, v, out, lse, qr, kr, 0.0, SCALE, False, (-1, -1), 0.0,
                                                 None, True, device="cpu")
    for g, r in zip(grads, ref_backward(q, k, v, dout, segs, False, SCALE)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def entry_points():
    """(name, call(**options)) for every entry point, on a small valid case."""
    q, k, v, cu_q, cu_k = case(3, lq=9, lk=9)
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, return_lse=True, device="cpu")
    return [
        ("flash_attn_func", lambda **o: cubeattn.flash_attn_func(q[None], k[None], v[None], device="cpu", **o)),
        ("flash_attn_varlen_func",
         lambda **o: cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, device="cpu", **o)),
        ("flash_attn_varlen_backward",
         lambda **o: cubeattn.flash_attn_varlen_backward(q, q, k, v, out, lse, cu_q, cu_k, 9, 9, device="cpu", **o)),
        ("grouped_flash_attn_func",
         lambda **o: cubeattn.grouped_flash_attn_func(q, k, v, [[0, 9]], [[0, 9]], device="cpu", **o)),
        ("grouped_flash_attn_backward",
         lambda **o: cubeattn.grouped_flash_attn_backward(q, q, k, v, out, lse, [[0, 9]], [[0, 9]], device="cpu",
                                                          **o)),
    ]


@pytest.mark.parametrize("option, value", [("dropout_p", 0.1), ("softcap", 30.0), ("alibi_slopes", np.ones(4, np.float32))])
def test_options_without_a_kernel_raise_not_implemented_naming_them(option, value):
    for name, call in entry_points():
        with pytest.raises(NotImplementedError, match=f"`{option}`"):
            call(**{option: value})
        # the default value (also as an int 0 for the float options) is accepted
        call(**{option: 0 if option != "alibi_slopes" else None})


def test_block_table_with_an_unpaged_k_names_the_argument():
    """block_table takes a paged k [num_blocks, page_block_size, heads_kv, d] (test_kvcache.py):
    the rank-3 varlen k beside one is an error naming k."""
    q, k, v, cu_q, cu_k = case(4, lq=5, lk=5)
    with pytest.raises(ValueError, match="`k`"):
        cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, block_table=np.zeros((1, 1), np.int32))


@pytest.mark.parametrize("option, value", [("dropout_p", "0"), ("softcap", None), ("dropout_p", True),
                                           ("window_size", 3), ("window_size", (1, 2, 3)), ("window_size", (1.0, 2)),
                                           ("window_size", "ab"), ("deterministic", "yes")])
def test_option_of_the_wrong_type_is_a_type_error_naming_it(option, value):
    for name, call in entry_points():
        with pytest.raises(TypeError, match=f"`{option}`"):
            call(**{option: value})


@pytest.mark.parametrize("value", ["no", "", 1, 0, 1.0, None, [True], np.array([True])])
def test_causal_accepts_bools_only(value):
    q, k, v, cu_q, cu_k = case(5, lq=6, lk=6)
    with pytest.raises(TypeError, match="`causal`"):
        cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, causal=value)
    with pytest.raises(TypeError, match="`causal`"):
        cubeattn.flash_attn_func(q[None], k[None], v[None], causal=value)
    with pytest.raises(TypeError, match="`causal`"):
        cubeattn.grouped_flash_attn_func(q, k, v, [[0, 6]], [[0, 6]], causal=value)


def test_causal_accepts_numpy_and_torch_bool_scalars():
    q, k, v, cu_q, cu_k = case(6, lq=7, lk=7)
    want = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, causal=True, device="cpu")
    assert not np.array_equal(want, cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, device="cpu"))
    np.testing.assert_array_equal(
        want, cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, causal=np.bool_(True), device="cpu"))
    if torch is not None:
        np.testing.assert_array_equal(
            want, cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, causal=torch.tensor(True), device="cpu"))
        with pytest.raises(TypeError, match="`causal`"):
            cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, causal=torch.tensor(1))


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_max_seqlen_as_a_0d_tensor_as_flash_attn_users_pass_it():
    q, k, v, _, _ = case(7, lq=12, lk=12)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    mx = cu.diff().max()  # a 0-d int32 tensor
    want = cubeattn.flash_attn_varlen_func(q, k, v, cu.numpy(), cu.numpy(), 7, 7, causal=True, device="cpu")
    got = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True, device="cpu")
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="`max_seqlen_q`"):
        cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, cu, mx)  # not 0-d
    with pytest.raises(ValueError, match="`max_seqlen_k`"):
        cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, mx, torch.tensor(7.0))  # not an integer
    with pytest.raises(ValueError, match="`max_seqlen_k`"):
        cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, mx, torch.tensor(6))  # too small


def test_negative_shapes_name_the_argument():
    cu = np.array([0, 10], np.int32)
    with pytest.raises(ValueError, match="`q_shape`"):
        cubeattn.varlen_spec((-10, 2, 16), (10, 2, 16), "float32", cu, cu, 10, 10)
    with pytest.raises(ValueError, match="`k_shape`"):
        cubeattn.varlen_spec((10, 2, 16), (10, -2, 16), "float32", cu, cu, 10, 10)
    with pytest.raises(ValueError, match="`q_shape`"):
        cubeattn.estimate_vram((-16, 8, 64), (16, 8, 64), "float16")
    with pytest.raises(ValueError, match="`k_shape`"):
        cubeattn.estimate_vram((16, 8, 64), (16, 8, -64), "float16")
    with pytest.raises(ValueError, match="`q_shape`"):
        cubeattn.estimate_vram((16, 8), (16, 8, 64), "float16")
    # a malformed cu_seqlens is named as such, not as a bad maximum
    with pytest.raises(ValueError, match="`cu_seqlens_q`"):
        cubeattn.estimate_vram((16, 8, 64), (16, 8, 64), "float16", cu_seqlens_q=[0, 10, 4, 16],
                               cu_seqlens_k=[0, 4, 8, 16])


def test_out_of_another_dtype_is_a_type_error_naming_out():
    q, k, v, cu_q, cu_k = case(8, lq=6, lk=6)
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, return_lse=True)
    with pytest.raises(TypeError, match="`out`"):
        cubeattn.flash_attn_varlen_backward(out, q, k, v, out.astype(np.float16), lse, cu_q, cu_k, 6, 6)
