"""Property tests (hypothesis) of the public entry points on the CPU (issue 13): forward and
backward of varlen, batched, grouped and block-sparse attention against conftest's f64 references
on random shapes (1 token, lengths around the 64/128 tiles, empty sequences and groups, many small
groups, GQA 1/2/4, head_dim 1..128, three dtypes, causal, random scales, 1x/10x inputs); and the
input contract: every malformed class raises ValueError/TypeError naming the argument, and a
non-contiguous array gives the same result as a contiguous one.

The bodies take a `Target` (where they run, what the backend there serves); test_properties_gpu.py
runs the same bodies on CUDA.

Run with `--hypothesis-show-statistics` to see how many cases each property generated."""
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

import cubeattn
from conftest import (BWD_TOL, assert_grad_close, DTYPES, FWD_TOL, grouped_segments, np_dtype, rand, ref_attention, ref_backward,
                      ref_sparse, rel_err, varlen_segments, visible_mask)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# lengths: 1 token, around the 64-row query tile and the 128-key tile, empty, and small random ones
LENS = st.one_of(st.sampled_from([0, 1, 63, 64, 65, 127, 128, 129]), st.integers(0, 40))
SMALL = st.one_of(st.sampled_from([0, 1, 2, 17, 63, 64, 65]), st.integers(0, 12))
HEAD_DIMS = [1, 8, 33, 64, 128]
U32 = 2.0 ** -24  # float32 unit roundoff


def seed_of(data):
    return np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))


def dtype_of(x):
    """'float32' | 'float16' | 'bfloat16' of a numpy array or torch tensor."""
    return str(x.dtype).removeprefix("torch.")


class Numpy:
    """Inputs as numpy arrays (outputs come back as numpy arrays)."""

    def put(self, x):
        return x

    def get(self, x):
        assert isinstance(x, np.ndarray), type(x)
        return x


NUMPY = Numpy()


class Target:
    """Where the properties run and what the backend there serves: here the CPU, every head_dim
    and dtype, numpy inputs. test_properties_gpu.py overrides it for CUDA."""

    device = "cpu"  # the calls' `device=`
    backend = "cpu"  # what cubeattn.last_backend() says after them
    head_dims = HEAD_DIMS  # forward
    bwd_head_dims = [1, 8, 33, 64]
    small_head_dims = [1, 8, 33]  # non-finite and malformed inputs
    sparse_dtypes = DTYPES  # block-sparse forward
    bwd_lens = SMALL  # sequence lengths of the backward properties
    bad_devices = []  # wrong `device` strings besides the syntactically wrong ones

    def draw_io(self, data):
        """How the arrays go in and come back (numpy here; torch tensors too on CUDA)."""
        return NUMPY

    def unsupported(self, api, dtype, d, deterministic=False):
        """None where the backend runs `api` ('dense', 'dense_bwd' or 'sparse') for (dtype, head_dim d; a
        backward with `deterministic`); else (exception, message regex) that device=self.device raises."""
        return None

    def kernel(self, api, dtype):
        """The kernel family a supported call runs (for hypothesis' statistics)."""
        return self.backend

    def bwd_rounding(self, dtype):
        """Relative rounding of the terms of each gradient element (conftest.ref_backward's
        abs_sums): here float32 products (a few units in the last place) and, for 16-bit inputs,
        the out stored in that dtype (its unit roundoff) in delta = rowsum(dout * out)."""
        return {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}.get(dtype, 8 * U32)

    def masks_non_finite_exactly(self, dtype):
        """Whether a non-finite v element masked for a row contributes exactly nothing to it."""
        return True

    def known_non_finite_deviations(self, out, want, x, dtype, causal, window):
        """`out` [rows, heads, d] with this backend's known departures from torch SDPA's NaN/Inf
        pattern `want` (inputs x, one bad element) set to `want`'s values: none here."""
        return out

    def call(self, api, fn, *args, **kw):
        """fn(*args, device=self.device, **kw), run by self.backend. Where that backend has no
        kernel for q's (dtype, head_dim) (args[0]: q, or dout of the same shape), the call must
        raise its documented exception, and device='auto' must run it on the CPU: that result is
        returned."""
        dtype, d = dtype_of(args[0]), args[0].shape[-1]
        why = self.unsupported(api, dtype, d, bool(kw.get("deterministic", False)))
        if why is None:
            event(f"{api}: {self.kernel(api, dtype)}")
            res = fn(*args, device=self.device, **kw)
            assert cubeattn.last_backend() == self.backend
            return res
        exc, pattern = why
        event(f"{api}: {self.backend} raises {exc.__name__}, auto runs the cpu")
        with pytest.raises(exc, match=pattern):
            fn(*args, device=self.device, **kw)
        res = fn(*args, device="auto", **kw)
        assert cubeattn.last_backend() == "cpu"
        return res


CPU = Target()


def draw_common(data, head_dims=HEAD_DIMS, dtypes=DTYPES):
    hkv = data.draw(st.sampled_from([1, 2]), label="heads_kv")
    hq = hkv * data.draw(st.sampled_from([1, 2, 4]), label="gqa_ratio")
    d = data.draw(st.sampled_from(head_dims), label="head_dim")
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    causal = data.draw(st.booleans(), label="causal")
    scale = data.draw(st.one_of(st.none(), st.floats(1e-3, 1.0)), label="softmax_scale")
    return hq, hkv, d, dtype, causal, scale


def fwd_tols(dtype, amp, scale, d):
    """(atol, rtol, relative-norm bound, lse atol): FWD_TOL for unit inputs, widened for |x| <= amp
    (output rounding grows with |out| <= amp) and by the float32 dot-product rounding bound of the
    logits, d * u * scale * amp^2 (negligible at amp 1 with the default scale)."""
    tol, rel = FWD_TOL[dtype]
    logit = d * U32 * scale * amp * amp
    return tol * amp + logit * amp, tol, rel + logit, 1e-5 + logit


def check_fwd(out, lse, ref_out, ref_lse, dtype, amp, scale, d):
    atol, rtol, rel, lse_tol = fwd_tols(dtype, amp, 1.0 / np.sqrt(d) if scale is None else scale, d)
    o = np.asarray(out, np.float64)
    assert np.all(np.isfinite(o))
    np.testing.assert_allclose(o, ref_out, rtol=rtol, atol=atol)
    assert rel_err(o, ref_out, floor=atol * np.sqrt(o.size)) <= rel
    lse = np.asarray(lse)
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape
    fin = np.isfinite(ref_lse)
    assert np.all(lse[~fin] == np.inf), "rows that see no key must have lse +inf"
    assert np.all(np.isfinite(lse[fin]))
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=lse_tol)
    assert np.all(o.transpose(1, 0, 2)[~fin] == 0.0), "rows that see no key must be exactly zero"


def cu_of(lens):
    return np.cumsum([0] + list(lens)).astype(np.int32)


# ---------------------------------------------------------------- forward against the f64 reference

def run_varlen_forward(data, t):
    lens = data.draw(st.lists(st.tuples(LENS, LENS), min_size=1, max_size=4), label="lens")
    hq, hkv, d, dtype, causal, scale = draw_common(data, t.head_dims)
    amp = data.draw(st.sampled_from([1.0, 10.0]), label="amp")
    slack = data.draw(st.integers(0, 3), label="max_seqlen_slack")
    io = t.draw_io(data)
    rng = seed_of(data)
    cu_q, cu_k = cu_of(a for a, _ in lens), cu_of(b for _, b in lens)
    q = rand(rng, (cu_q[-1], hq, d), dtype, amp)
    k, v = rand(rng, (cu_k[-1], hkv, d), dtype, amp), rand(rng, (cu_k[-1], hkv, d), dtype, amp)
    mq, mk = max(a for a, _ in lens) + slack, max(b for _, b in lens) + slack
    args = (io.put(q), io.put(k), io.put(v), cu_q, cu_k, mq, mk)
    out, lse = map(io.get, t.call("dense", cubeattn.flash_attn_varlen_func, *args, softmax_scale=scale,
                                  causal=causal, return_lse=True))
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (hq, cu_q[-1])
    ref_out, ref_lse = ref_attention(q, k, v, varlen_segments(cu_q, cu_k), causal, scale)
    check_fwd(out, lse, ref_out, ref_lse, dtype, amp, scale, d)
    # return_lse=False gives the same output
    again = io.get(t.call("dense", cubeattn.flash_attn_varlen_func, *args, softmax_scale=scale, causal=causal))
    assert np.array_equal(np.asarray(again, np.float64), np.asarray(out, np.float64))


@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_varlen_forward_matches_reference(data):
    run_varlen_forward(data, CPU)


def run_batched_forward(data, t):
    b = data.draw(st.integers(1, 3), label="batch")
    sq, sk = data.draw(LENS, label="seqlen_q"), data.draw(LENS, label="seqlen_k")
    hq, hkv, d, dtype, causal, scale = draw_common(data, t.head_dims)
    amp = data.draw(st.sampled_from([1.0, 10.0]), label="amp")
    io = t.draw_io(data)
    rng = seed_of(data)
    q = rand(rng, (b, sq, hq, d), dtype, amp)
    k, v = rand(rng, (b, sk, hkv, d), dtype, amp), rand(rng, (b, sk, hkv, d), dtype, amp)
    args = (io.put(q), io.put(k), io.put(v))
    out, lse = map(io.get, t.call("dense", cubeattn.flash_attn_func, *args, softmax_scale=scale, causal=causal,
                                  return_lse=True))
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, hq, sq)
    # without lse, twice (a repeated call of torch CUDA tensors takes the cached fast path): the same
    for _ in range(2):
        again = io.get(t.call("dense", cubeattn.flash_attn_func, *args, softmax_scale=scale, causal=causal))
        assert np.array_equal(np.asarray(again, np.float64), np.asarray(out, np.float64))
    cu_q, cu_k = np.arange(b + 1) * sq, np.arange(b + 1) * sk
    ref_out, ref_lse = ref_attention(q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d),
                                     varlen_segments(cu_q, cu_k), causal, scale)
    check_fwd(out.reshape(-1, hq, d), lse.transpose(1, 0, 2).reshape(hq, -1), ref_out, ref_lse, dtype, amp, scale, d)


@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_batched_forward_matches_reference(data):
    run_batched_forward(data, CPU)


def draw_groups(data, rng_groups=(1, 24)):
    """Non-overlapping query ranges with gaps (rows in no group), given in shuffled order, and key
    ranges anywhere in [0, total_k] (overlapping, empty or full)."""
    n = data.draw(st.integers(*rng_groups), label="groups")
    qlen = SMALL if n > 4 else LENS
    q_ranges, pos = [], 0
    for _ in range(n):
        pos += data.draw(st.sampled_from([0, 0, 1, 3]), label="gap")
        ln = data.draw(qlen, label="q_len")
        q_ranges.append([pos, pos + ln])
        pos += ln
    total_q = pos + data.draw(st.sampled_from([0, 2]), label="tail")
    total_k = data.draw(st.one_of(st.sampled_from([0, 1, 64, 129, 200]), st.integers(0, 90)), label="total_k")
    kv_ranges = []
    for _ in range(n):
        a = data.draw(st.integers(0, total_k), label="kv_start")
        kv_ranges.append([a, data.draw(st.integers(a, total_k), label="kv_end")])
    order = data.draw(st.permutations(range(n)), label="order")
    q_ranges = np.array([q_ranges[i] for i in order], np.int32).reshape(-1, 2)
    kv_ranges = np.array([kv_ranges[i] for i in order], np.int32).reshape(-1, 2)
    return q_ranges, kv_ranges, total_q, total_k


def run_grouped_forward(data, t):
    q_ranges, kv_ranges, total_q, total_k = draw_groups(data)
    hq, hkv, d, dtype, causal, scale = draw_common(data, t.head_dims)
    amp = data.draw(st.sampled_from([1.0, 10.0]), label="amp")
    io = t.draw_io(data)
    rng = seed_of(data)
    q = rand(rng, (total_q, hq, d), dtype, amp)
    k, v = rand(rng, (total_k, hkv, d), dtype, amp), rand(rng, (total_k, hkv, d), dtype, amp)
    as_list = data.draw(st.booleans(), label="ranges_as_lists")
    qr, kr = (q_ranges.tolist(), kv_ranges.tolist()) if as_list else (q_ranges, kv_ranges)
    out, lse = map(io.get, t.call("dense", cubeattn.grouped_flash_attn_func, io.put(q), io.put(k), io.put(v), qr, kr,
                                  softmax_scale=scale, causal=causal, return_lse=True))
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (hq, total_q)
    ref_out, ref_lse = ref_attention(q, k, v, grouped_segments(q_ranges, kv_ranges), causal, scale)
    check_fwd(out, lse, ref_out, ref_lse, dtype, amp, scale, d)


@settings(max_examples=250, **SETTINGS)
@given(data=st.data())
def test_grouped_forward_matches_reference(data):
    run_grouped_forward(data, CPU)


def random_block_index(rng, n_batch, h, qbn, kbns, top_k):
    """[B, H, qbn, top_k] int32: per row a random subset (any order) of sequence b's key blocks, -1 padded."""
    ix = np.full((n_batch, h, qbn, top_k), -1, np.int32)
    for b in range(n_batch):
        for hh in range(h):
            for qb in range(qbn):
                n = rng.integers(0, min(top_k, kbns[b]) + 1)
                ix[b, hh, qb, :n] = rng.choice(kbns[b], size=n, replace=False)
                rng.shuffle(ix[b, hh, qb])
    return ix


def run_block_sparse_forward(data, t):
    hq, hkv, d, dtype, causal, scale = draw_common(data, t.head_dims, t.sparse_dtypes)
    amp = data.draw(st.sampled_from([1.0, 10.0]), label="amp")
    q_block = data.draw(st.sampled_from([1, 3, 16, 64]), label="q_block")
    k_block = data.draw(st.sampled_from([1, 5, 32, 128]), label="k_block")
    top_k = data.draw(st.integers(1, 4), label="top_k")
    h_ix = data.draw(st.sampled_from([hq, hkv]), label="index_heads")
    batched = data.draw(st.booleans(), label="batched")
    io = t.draw_io(data)
    rng = seed_of(data)
    if batched:
        n_batch = data.draw(st.integers(1, 3), label="batch")
        sq, sk = data.draw(LENS, label="seqlen_q"), data.draw(LENS, label="seqlen_k")
        lq, lk = [sq] * n_batch, [sk] * n_batch
    else:
        lens = data.draw(st.lists(st.tuples(LENS, LENS), min_size=1, max_size=3), label="lens")
        lq, lk = [a for a, _ in lens], [b for _, b in lens]
        n_batch = len(lens)
    cu_q, cu_k = cu_of(lq), cu_of(lk)
    qbn = -(-max(lq) // q_block)
    ix = random_block_index(rng, n_batch, h_ix, qbn, [-(-x // k_block) for x in lk], top_k)
    q = rand(rng, (cu_q[-1], hq, d), dtype, amp)
    k, v = rand(rng, (cu_k[-1], hkv, d), dtype, amp), rand(rng, (cu_k[-1], hkv, d), dtype, amp)
    kw = dict(q_block=q_block, k_block=k_block, causal=causal, softmax_scale=scale, return_lse=True)
    if batched:
        b4 = (q.reshape(n_batch, -1, hq, d), k.reshape(n_batch, -1, hkv, d), v.reshape(n_batch, -1, hkv, d))
        out, lse = map(io.get, t.call("sparse", cubeattn.block_sparse_attn_func, *map(io.put, b4), ix, **kw))
        assert out.shape == (n_batch, lq[0], hq, d) and lse.shape == (n_batch, hq, lq[0])
        out, lse = out.reshape(-1, hq, d), lse.transpose(1, 0, 2).reshape(hq, -1)
    else:
        out, lse = map(io.get, t.call("sparse", cubeattn.block_sparse_attn_func, io.put(q), io.put(k), io.put(v), ix,
                                      cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw))
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (hq, cu_q[-1])
    ref_out, ref_lse = ref_sparse(q, k, v, ix, cu_q, cu_k, q_block, k_block, causal, scale)
    check_fwd(out, lse, ref_out, ref_lse, dtype, amp, scale, d)


@settings(max_examples=200, **SETTINGS)
@given(data=st.data())
def test_block_sparse_forward_matches_reference(data):
    run_block_sparse_forward(data, CPU)


# ---------------------------------------------------------------- backward against the f64 reference

def check_grads(got, want, shapes, dtype, scale, d, t=CPU):
    """BWD_TOL, with atol grown in proportion to softmax_scale above the default 1/sqrt(d) (dq, dk
    grow with it); both bounds apply to the error beyond t.bwd_rounding(dtype) times each element's
    sum of |terms| (`want`: ref_backward with abs_sums), the rounding of the products' operands,
    which no fixed bound covers (a gradient that is small by cancellation of large terms); the
    relative-norm bound applies where the gradient is above the atol level (below it, the stored
    out's rounding in delta = rowsum(dout * out) dominates, as in flash-attn, and the elementwise
    bound is the meaningful one)."""
    tol, rel = BWD_TOL[dtype]
    atol = tol * max(1.0, (1.0 / np.sqrt(d) if scale is None else scale) * np.sqrt(d))
    u = t.bwd_rounding(dtype)
    for name, g, w, s, (shape, dt) in zip(("dq", "dk", "dv"), got, want[:3], want[3:], shapes):
        assert g.shape == shape and g.dtype == dt, name
        g = np.asarray(g, np.float64)
        assert np.all(np.isfinite(g)), name
        assert_grad_close(g, w, tol, rel, atol, name, slack=u * s)


def run_varlen_backward(data, t):
    lens = data.draw(st.lists(st.tuples(t.bwd_lens, t.bwd_lens), min_size=1, max_size=3), label="lens")
    hq, hkv, d, dtype, causal, scale = draw_common(data, t.bwd_head_dims)
    deterministic = data.draw(st.booleans(), label="deterministic")
    io = t.draw_io(data)
    rng = seed_of(data)
    cu_q, cu_k = cu_of(a for a, _ in lens), cu_of(b for _, b in lens)
    q = rand(rng, (cu_q[-1], hq, d), dtype)
    k, v = rand(rng, (cu_k[-1], hkv, d), dtype), rand(rng, (cu_k[-1], hkv, d), dtype)
    dout = rand(rng, q.shape, dtype)
    mq, mk = max(a for a, _ in lens), max(b for _, b in lens)
    tq, tk, tv = io.put(q), io.put(k), io.put(v)
    out, lse = t.call("dense", cubeattn.flash_attn_varlen_func, tq, tk, tv, cu_q, cu_k, mq, mk, softmax_scale=scale,
                      causal=causal, return_lse=True)
    grads = t.call("dense_bwd", cubeattn.flash_attn_varlen_backward, io.put(dout), tq, tk, tv, out, lse, cu_q, cu_k, mq,
                   mk, softmax_scale=scale, causal=causal, deterministic=deterministic)
    want = ref_backward(q, k, v, dout, varlen_segments(cu_q, cu_k), causal, scale, abs_sums=True)
    check_grads([io.get(g) for g in grads], want, [(x.shape, x.dtype) for x in (q, k, v)], dtype, scale, d, t)


@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_varlen_backward_matches_reference(data):
    run_varlen_backward(data, CPU)


def run_grouped_backward(data, t):
    q_ranges, kv_ranges, total_q, total_k = draw_groups(data, rng_groups=(1, 10))
    hq, hkv, d, dtype, causal, scale = draw_common(data, t.bwd_head_dims)
    deterministic = data.draw(st.booleans(), label="deterministic")
    io = t.draw_io(data)
    rng = seed_of(data)
    q = rand(rng, (total_q, hq, d), dtype)
    k, v = rand(rng, (total_k, hkv, d), dtype), rand(rng, (total_k, hkv, d), dtype)
    dout = rand(rng, q.shape, dtype)
    tq, tk, tv = io.put(q), io.put(k), io.put(v)
    out, lse = t.call("dense", cubeattn.grouped_flash_attn_func, tq, tk, tv, q_ranges, kv_ranges,
                      softmax_scale=scale, causal=causal, return_lse=True)
    grads = t.call("dense_bwd", cubeattn.grouped_flash_attn_backward, io.put(dout), tq, tk, tv, out, lse, q_ranges,
                   kv_ranges, softmax_scale=scale, causal=causal, deterministic=deterministic)
    want = ref_backward(q, k, v, dout, grouped_segments(q_ranges, kv_ranges), causal, scale, abs_sums=True)
    check_grads([io.get(g) for g in grads], want, [(x.shape, x.dtype) for x in (q, k, v)], dtype, scale, d, t)


@settings(max_examples=120, **SETTINGS)
@given(data=st.data())
def test_grouped_backward_matches_reference(data):
    run_grouped_backward(data, CPU)


# ---------------------------------------------------------------- non-contiguous inputs

def strided(rng, x, how):
    """The same values as x in a non-contiguous array: every other element of a wider array, a
    transposed copy transposed back, or a reversed view."""
    if how == "step":
        wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
        wide[..., ::2] = x
        y = wide[..., ::2]
    elif how == "transpose":
        y = np.ascontiguousarray(np.swapaxes(x, 0, 1)).swapaxes(0, 1)
    else:
        y = np.ascontiguousarray(x[::-1])[::-1]
    assert np.array_equal(np.ascontiguousarray(y).view(np.uint8), np.ascontiguousarray(x).view(np.uint8))
    return y


@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_non_contiguous_inputs_give_the_contiguous_result(data):
    lens = data.draw(st.lists(st.tuples(SMALL, SMALL), min_size=1, max_size=3), label="lens")
    hq, hkv, d, dtype, causal, scale = draw_common(data, head_dims=[1, 8, 33, 64])
    how = data.draw(st.sampled_from(["step", "transpose", "reverse"]), label="how")
    which = data.draw(st.sets(st.sampled_from(["q", "k", "v", "dout", "out", "cu"]), min_size=1), label="which")
    rng = seed_of(data)
    cu_q, cu_k = cu_of(a for a, _ in lens), cu_of(b for _, b in lens)
    t = dict(q=rand(rng, (cu_q[-1], hq, d), dtype), k=rand(rng, (cu_k[-1], hkv, d), dtype),
             v=rand(rng, (cu_k[-1], hkv, d), dtype))
    t["dout"] = rand(rng, t["q"].shape, dtype)
    mq, mk = max(a for a, _ in lens), max(b for _, b in lens)
    kw = dict(softmax_scale=scale, causal=causal, device="cpu")
    out, lse = cubeattn.flash_attn_varlen_func(t["q"], t["k"], t["v"], cu_q, cu_k, mq, mk, return_lse=True, **kw)
    t["out"] = out
    grads = cubeattn.flash_attn_varlen_backward(t["dout"], t["q"], t["k"], t["v"], out, lse, cu_q, cu_k, mq, mk,
                                                deterministic=True, **kw)
    s = {n: (strided(rng, x, how) if n in which and x.size else x) for n, x in t.items()}
    sc_q, sc_k = (cu_q, cu_k) if "cu" not in which else (np.repeat(cu_q, 2)[::2], np.repeat(cu_k, 2)[::2])
    if "cu" in which:
        assert not sc_q.flags.c_contiguous or sc_q.size <= 1
    out2, lse2 = cubeattn.flash_attn_varlen_func(s["q"], s["k"], s["v"], sc_q, sc_k, mq, mk, return_lse=True, **kw)
    assert np.array_equal(out2.view(np.uint8), out.view(np.uint8)) and np.array_equal(lse2, lse)
    lse_s = strided(rng, lse, how) if lse.size else lse
    grads2 = cubeattn.flash_attn_varlen_backward(s["dout"], s["q"], s["k"], s["v"], s["out"], lse_s,
                                                 sc_q, sc_k, mq, mk, deterministic=True, **kw)
    for g, g2 in zip(grads, grads2):
        assert np.array_equal(g.view(np.uint8), g2.view(np.uint8))
    # grouped and batched take the same path
    qr = np.stack([cu_q[:-1], cu_q[1:]], 1)
    kr = np.stack([cu_k[:-1], cu_k[1:]], 1)
    a = cubeattn.grouped_flash_attn_func(t["q"], t["k"], t["v"], qr, kr, **kw)
    b = cubeattn.grouped_flash_attn_func(s["q"], s["k"], s["v"], strided(rng, qr, "step"), kr, **kw)
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


# ---------------------------------------------------------------- malformed inputs

def raises_naming(exc, arg, fn, *args, **kwargs):
    """fn(...) raises exc (ValueError or TypeError) whose message names `arg` in backticks."""
    with pytest.raises((ValueError, TypeError)) as e:
        fn(*args, **kwargs)
    assert isinstance(e.value, exc), f"{type(e.value).__name__} instead of {exc.__name__}: {e.value}"
    assert re.search(arg, str(e.value)), f"message does not name {arg}: {e.value}"
    return e.value


VARLEN_BAD = ["q_rank", "k_rank", "v_rank", "k_head_dim", "v_shape", "heads_ratio", "q_heads_zero", "head_dim_zero",
              "k_dtype", "v_dtype", "q_int", "k_int", "q_float64", "v_float64", "q_list",
              "cu_q_not_monotonic", "cu_k_not_monotonic", "cu_q_start", "cu_q_last", "cu_k_last", "cu_q_negative",
              "cu_lengths_differ", "cu_q_empty", "cu_q_rank", "cu_k_float", "max_q_small", "max_k_small",
              "max_q_negative", "max_k_float", "scale_nan", "scale_inf", "scale_str", "device_str", "device_type"]


def run_varlen_malformed(data, t):
    case = data.draw(st.sampled_from(VARLEN_BAD), label="case")
    lens = data.draw(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=4), label="lens")
    hkv = data.draw(st.sampled_from([1, 2, 3]), label="heads_kv")
    hq = hkv * data.draw(st.sampled_from([1, 2]), label="ratio")
    d = data.draw(st.sampled_from(t.small_head_dims), label="head_dim")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    backward = data.draw(st.booleans(), label="backward")
    io = t.draw_io(data)
    rng = seed_of(data)
    cu_q, cu_k = cu_of(a for a, _ in lens), cu_of(b for _, b in lens)
    mq, mk = max(a for a, _ in lens), max(b for _, b in lens)
    a = dict(q=rand(rng, (cu_q[-1], hq, d), dtype), k=rand(rng, (cu_k[-1], hkv, d), dtype),
             v=rand(rng, (cu_k[-1], hkv, d), dtype), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq,
             max_seqlen_k=mk)
    kw = dict(device=t.device)
    other = data.draw(st.sampled_from([x for x in DTYPES if x != dtype]), label="other_dtype")
    pos = data.draw(st.integers(1, len(lens)), label="position")
    if case.endswith("_rank") and case[0] in "qkv":
        n = case[0]
        a[n] = a[n].reshape(a[n].shape[0], -1) if data.draw(st.booleans()) else a[n][None]
        exc, arg = ValueError, n
    elif case == "k_head_dim":
        a["k"], a["v"] = (rand(rng, (cu_k[-1], hkv, d + 1), dtype) for _ in range(2))
        exc, arg = ValueError, "k"
    elif case == "v_shape":
        # (v may have a head_dim of its own, 1..=256; not 0 or 257, nor k's tokens or heads changed)
        bad = data.draw(st.sampled_from([(0, 0, 0), (0, 0, 257), (0, 1, None), (1, 0, None)]))
        a["v"] = rand(rng, (cu_k[-1] + bad[0], hkv + bad[1], d if bad[2] is None else bad[2]), dtype)
        exc, arg = ValueError, "v"
    elif case == "heads_ratio":
        h = data.draw(st.sampled_from([(3, 2), (2, 4), (5, 3), (1, 2)]))
        a["q"] = rand(rng, (cu_q[-1], h[0], d), dtype)
        a["k"], a["v"] = (rand(rng, (cu_k[-1], h[1], d), dtype) for _ in range(2))
        exc, arg = ValueError, "k"
    elif case == "q_heads_zero":
        a["q"] = rand(rng, (cu_q[-1], 0, d), dtype)
        exc, arg = ValueError, "q"
    elif case == "head_dim_zero":
        a["q"] = rand(rng, (cu_q[-1], hq, 0), dtype)
        a["k"], a["v"] = (rand(rng, (cu_k[-1], hkv, 0), dtype) for _ in range(2))
        exc, arg = ValueError, "q"
    elif case in ("k_dtype", "v_dtype"):
        n = case[0]
        a[n] = a[n].astype(np_dtype(other))
        exc, arg = TypeError, n
    elif case in ("q_int", "k_int"):
        n = case[0]
        a[n] = a[n].astype(data.draw(st.sampled_from([np.int32, np.int64, np.int8, np.bool_])))
        exc, arg = TypeError, n
    elif case in ("q_float64", "v_float64"):
        n = case[0]
        a[n] = a[n].astype(np.float64)
        exc, arg = TypeError, n
    elif case == "q_list":
        a["q"] = a["q"].astype(np.float32).tolist()
        exc, arg = TypeError, "q"
    elif case in ("cu_q_not_monotonic", "cu_k_not_monotonic"):
        n = "cu_seqlens_" + case[3]
        c = a[n].copy()
        if len(c) >= 3:
            i = data.draw(st.integers(1, len(c) - 2))
            c[i] = c[i + 1] + data.draw(st.integers(1, 5))
        else:  # one sequence: [0, T] -> [0, T + 1, T]
            c = np.array([0, c[-1] + 1, c[-1]], np.int32)
            other_n = "cu_seqlens_" + ("k" if n.endswith("q") else "q")
            a[other_n] = np.array([0, 0, a[other_n][-1]], np.int32)
        a[n] = c
        exc, arg = ValueError, n
    elif case == "cu_q_start":
        c = cu_q.copy()
        c[0] = data.draw(st.sampled_from([1, -1]))
        a["cu_seqlens_q"] = c
        exc, arg = ValueError, "cu_seqlens_q"
    elif case in ("cu_q_last", "cu_k_last"):
        n = "cu_seqlens_" + case[3]
        c = a[n].copy()
        c[-1] += data.draw(st.sampled_from([-1, 1, 100]))
        a[n] = c
        exc, arg = ValueError, n
    elif case == "cu_q_negative":
        c = cu_q.copy()
        c[pos - 1 if pos > 1 else 0] = -data.draw(st.integers(1, 2 ** 31 - 1))
        a["cu_seqlens_q"] = c
        exc, arg = ValueError, "cu_seqlens_q"
    elif case == "cu_lengths_differ":
        # both end at their totals, but the batch sizes differ
        a["cu_seqlens_k"] = np.array([0] + [int(cu_k[-1])] * (len(cu_q) + 1 if len(cu_q) < 3 else 1), np.int32)
        exc, arg = ValueError, "cu_seqlens_k"
    elif case == "cu_q_empty":
        a["cu_seqlens_q"] = np.zeros(0, np.int32)
        exc, arg = ValueError, "cu_seqlens_q"
    elif case == "cu_q_rank":
        a["cu_seqlens_q"] = cu_q[None]
        exc, arg = ValueError, "cu_seqlens_q"
    elif case == "cu_k_float":
        a["cu_seqlens_k"] = cu_k.astype(np.float64)
        exc, arg = TypeError, "cu_seqlens_k"
    elif case in ("max_q_small", "max_k_small"):
        n = "max_seqlen_" + case[4]
        a[n] = a[n] - data.draw(st.integers(1, a[n]))
        exc, arg = ValueError, n
    elif case == "max_q_negative":
        a["max_seqlen_q"] = -data.draw(st.integers(1, 100))
        exc, arg = ValueError, "max_seqlen_q"
    elif case == "max_k_float":
        a["max_seqlen_k"] = float(mk)
        exc, arg = ValueError, "max_seqlen_k"
    elif case in ("scale_nan", "scale_inf"):
        kw["softmax_scale"] = float("nan") if case == "scale_nan" else data.draw(st.sampled_from([np.inf, -np.inf]))
        exc, arg = ValueError, "softmax_scale"
    elif case == "scale_str":
        kw["softmax_scale"] = "0.1"
        exc, arg = TypeError, "softmax_scale"
    elif case == "device_str":
        kw["device"] = data.draw(st.one_of(
            st.sampled_from(["", "tpu", "CPU", "cpu:0", "cuda:", "cuda:-1", "cuda:x", "cuda:1:2", "cuda:99999999"]
                            + t.bad_devices),
            st.text(max_size=8).filter(lambda s: s not in ("auto", "cpu", "cuda", "gpu")
                                       and not re.fullmatch(r"(auto|cuda|gpu):\d+", s))))
        exc, arg = ValueError, "device"
    elif case == "device_type":
        kw["device"] = data.draw(st.sampled_from([0, None, 1.0, b"cpu"]))
        exc, arg = TypeError, "device"
    else:
        raise AssertionError(case)
    arg = f"`{arg}`"
    if not backward:
        a.update((n, io.put(a[n])) for n in "qkv" if isinstance(a[n], np.ndarray))
        raises_naming(exc, arg, cubeattn.flash_attn_varlen_func, **a, **kw)
    else:
        q = a["q"]
        shape = np.shape(q)
        dout = np.zeros(shape, q.dtype) if isinstance(q, np.ndarray) else q
        lse = np.zeros((shape[1] if len(shape) > 1 else 1, shape[0]), np.float32)
        dout, q, k, v, lse = (io.put(x) if isinstance(x, np.ndarray) else x for x in (dout, q, a["k"], a["v"], lse))
        raises_naming(exc, arg, cubeattn.flash_attn_varlen_backward, dout, q, k, v, dout, lse,
                      a["cu_seqlens_q"], a["cu_seqlens_k"], a["max_seqlen_q"], a["max_seqlen_k"], **kw)


@settings(max_examples=400, **SETTINGS)
@given(data=st.data())
def test_varlen_malformed_inputs_raise_naming_the_argument(data):
    run_varlen_malformed(data, CPU)


GROUPED_BAD = ["q_end_out", "q_start_negative", "q_reversed", "kv_end_out", "kv_start_negative", "kv_reversed",
               "q_overlap", "count_mismatch", "no_groups", "q_three_columns", "kv_one_dim", "q_float",
               "kv_ragged"]


@settings(max_examples=200, **SETTINGS)
@given(data=st.data())
def test_grouped_malformed_ranges_raise_naming_the_argument(data):
    case = data.draw(st.sampled_from(GROUPED_BAD), label="case")
    n = data.draw(st.integers(1, 6), label="groups")
    lens = data.draw(st.lists(st.integers(1, 8), min_size=n, max_size=n), label="q_lens")
    total_k = data.draw(st.integers(1, 40), label="total_k")
    backward = data.draw(st.booleans(), label="backward")
    starts = np.concatenate([[0], np.cumsum(lens)])
    qr = np.stack([starts[:-1], starts[1:]], 1).astype(np.int64)
    kr = np.array([[0, total_k]] * n, np.int64)
    total_q = int(starts[-1])
    g = data.draw(st.integers(0, n - 1), label="bad_group")
    if case == "q_end_out":
        qr[g, 1] = total_q + data.draw(st.integers(1, 2 ** 20))
        qr[g, 0] = min(qr[g, 0], total_q)
        qr = qr[g:g + 1]
        kr = kr[:1]
        arg = "q_ranges"
    elif case == "q_start_negative":
        qr[0, 0] = -data.draw(st.integers(1, 2 ** 31 - 1))
        arg = "q_ranges"
    elif case == "q_reversed":
        qr[g] = qr[g, ::-1]
        arg = "q_ranges"
    elif case == "kv_end_out":
        kr[g, 1] = total_k + data.draw(st.integers(1, 2 ** 20))
        arg = "kv_ranges"
    elif case == "kv_start_negative":
        kr[g, 0] = -data.draw(st.integers(1, 2 ** 31 - 1))
        arg = "kv_ranges"
    elif case == "kv_reversed":
        kr[g] = [total_k, data.draw(st.integers(0, total_k - 1))]
        arg = "kv_ranges"
    elif case == "q_overlap":
        qr = np.concatenate([qr, qr[g:g + 1] + [[0, 0]]])
        qr[-1, 1] = qr[-1, 0] + 1
        kr = np.concatenate([kr, kr[:1]])
        arg = "q_ranges"
    elif case == "count_mismatch":
        kr = kr[:-1] if n > 1 and data.draw(st.booleans()) else np.concatenate([kr, kr[:1]])
        arg = "kv_ranges"
    elif case == "no_groups":
        qr, kr = np.zeros((0, 2), np.int32), np.zeros((0, 2), np.int32)
        arg = "q_ranges"
    elif case == "q_three_columns":
        qr = np.concatenate([qr, qr[:, :1]], 1)
        arg = "q_ranges"
    elif case == "kv_one_dim":
        kr = kr.reshape(-1)
        arg = "kv_ranges"
    elif case == "q_float":
        qr = qr.astype(np.float32)
        arg = "q_ranges"
    elif case == "kv_ragged":
        kr = [[0, total_k]] * (n - 1) + [[0]]
        arg = "kv_ranges"
    else:
        raise AssertionError(case)
    exc = TypeError if case == "q_float" else ValueError
    rng = seed_of(data)
    q, k, v = rand(rng, (total_q, 2, 8), "float32"), rand(rng, (total_k, 1, 8), "float32"), rand(rng, (total_k, 1, 8), "float32")
    if not backward:
        raises_naming(exc, f"`{arg}`", cubeattn.grouped_flash_attn_func, q, k, v, qr, kr, device="cpu")
    else:
        lse = np.zeros((2, total_q), np.float32)
        raises_naming(exc, f"`{arg}`", cubeattn.grouped_flash_attn_backward, q, q, k, v, q, lse, qr, kr, device="cpu")


BACKWARD_BAD = ["out_shape", "dout_shape", "out_dtype", "dout_dtype", "lse_length", "out_int"]


def run_backward_malformed(data, t):
    case = data.draw(st.sampled_from(BACKWARD_BAD), label="case")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    other = data.draw(st.sampled_from([x for x in DTYPES if x != dtype]), label="other_dtype")
    grouped = data.draw(st.booleans(), label="grouped")
    tq, tk = data.draw(st.integers(1, 20), label="total_q"), data.draw(st.integers(1, 20), label="total_k")
    d = data.draw(st.sampled_from(t.small_head_dims), label="head_dim")
    io = t.draw_io(data)
    rng = seed_of(data)
    q, k, v = rand(rng, (tq, 2, d), dtype), rand(rng, (tk, 1, d), dtype), rand(rng, (tk, 1, d), dtype)
    q, k, v = map(io.put, (q, k, v))
    cu_q, cu_k = np.array([0, tq], np.int32), np.array([0, tk], np.int32)
    if grouped:
        res = t.call("dense", cubeattn.grouped_flash_attn_func, q, k, v, [[0, tq]], [[0, tk]], return_lse=True)
    else:
        res = t.call("dense", cubeattn.flash_attn_varlen_func, q, k, v, cu_q, cu_k, tq, tk, return_lse=True)
    out, lse = map(io.get, res)
    dout = rand(rng, q.shape, dtype)
    exc = TypeError if case in ("out_dtype", "dout_dtype", "out_int") else ValueError
    arg = case.split("_")[0]
    if case == "out_shape":
        out = out[:-1]
    elif case == "dout_shape":
        dout = np.concatenate([dout, dout[:1]])
    elif case == "out_dtype":
        out = out.astype(np_dtype(other))
    elif case == "dout_dtype":
        dout = dout.astype(np_dtype(other))
    elif case == "lse_length":
        lse = lse[:, :-1] if data.draw(st.booleans()) else np.concatenate([lse, lse], 1)
    elif case == "out_int":
        out = out.astype(np.int16)
    dout, out, lse = map(io.put, (dout, out, lse))
    if grouped:
        raises_naming(exc, f"`{arg}`", cubeattn.grouped_flash_attn_backward, dout, q, k, v, out, lse, [[0, tq]],
                      [[0, tk]], device=t.device)
    else:
        raises_naming(exc, f"`{arg}`", cubeattn.flash_attn_varlen_backward, dout, q, k, v, out, lse, cu_q, cu_k,
                      tq, tk, device=t.device)


@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_backward_malformed_out_dout_lse_raise_naming_the_argument(data):
    run_backward_malformed(data, CPU)


@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_batched_and_sparse_malformed_inputs_raise_naming_the_argument(data):
    case = data.draw(st.sampled_from(["rank3", "batch", "k_dtype", "q_float64", "ix_out_of_range", "ix_duplicate",
                                      "ix_shape", "ix_float"]), label="case")
    sparse = data.draw(st.booleans(), label="sparse") or case.startswith("ix")
    b, sq, sk = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 70)), data.draw(st.integers(1, 300))
    rng = seed_of(data)
    q, k, v = rand(rng, (b, sq, 2, 8), "float32"), rand(rng, (b, sk, 1, 8), "float32"), rand(rng, (b, sk, 1, 8), "float32")
    qbn, kbn = -(-sq // 64), -(-sk // 128)
    ix = np.full((b, 2, qbn, 2), -1, np.int32)
    ix[..., 0] = 0
    if case == "rank3":
        n = data.draw(st.sampled_from("qkv"))
        x = dict(q=q, k=k, v=v)
        x[n] = x[n][0]
        q, k, v = x["q"], x["k"], x["v"]
        exc, arg = ValueError, f"`{n}`"
    elif case == "batch":
        k, v = np.concatenate([k, k]), np.concatenate([v, v])
        exc, arg = ValueError, "`k`"
    elif case == "k_dtype":
        k = k.astype(np.float16)
        exc, arg = TypeError, "`k`"
    elif case == "q_float64":
        q = q.astype(np.float64)
        exc, arg = TypeError, "`q`"
    elif case == "ix_out_of_range":
        pos = tuple(data.draw(st.integers(0, s - 1)) for s in ix.shape)
        ix[pos] = kbn + data.draw(st.integers(0, 1000))
        exc, arg = ValueError, re.escape(f"block_index[{', '.join(map(str, pos))}]")
    elif case == "ix_duplicate":
        pos = tuple(data.draw(st.integers(0, s - 1)) for s in ix.shape[:3])
        ix[pos] = [0, 0]
        exc, arg = ValueError, re.escape(f"block_index[{', '.join(map(str, pos))}, 1]")
    elif case == "ix_shape":
        ix = ix[:, :, :, :, None] if data.draw(st.booleans()) else np.concatenate([ix, ix], 2)
        exc, arg = ValueError, "block_index"
    elif case == "ix_float":
        ix = ix.astype(np.float32)
        exc, arg = TypeError, "block_index"
    if sparse:
        raises_naming(exc, arg, cubeattn.block_sparse_attn_func, q, k, v, ix, device="cpu")
    else:
        raises_naming(exc, arg, cubeattn.flash_attn_func, q, k, v, device="cpu")


# ---------------------------------------------------------------- empty inputs

@settings(max_examples=50, **SETTINGS)
@given(data=st.data())
def test_empty_batches_give_empty_or_zero_outputs(data):
    """0 query tokens: empty output; 0 key tokens: zero output and lse +inf (no crash, no garbage)."""
    hq, hkv, d, dtype, causal, scale = draw_common(data)
    n = data.draw(st.integers(1, 4), label="batch")
    tq = data.draw(st.sampled_from([0, 1, 5]), label="total_q")
    tk = 0 if tq else data.draw(st.sampled_from([0, 3]), label="total_k")
    rng = seed_of(data)
    q, k, v = rand(rng, (tq, hq, d), dtype), rand(rng, (tk, hkv, d), dtype), rand(rng, (tk, hkv, d), dtype)
    cu_q = np.array([0] * n + [tq], np.int32)
    cu_k = np.array([0] * n + [tk], np.int32)
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, tq, tk, softmax_scale=scale, causal=causal,
                                               return_lse=True, device="cpu")
    assert out.shape == q.shape and lse.shape == (hq, tq)
    if tq:
        assert np.all(np.asarray(out, np.float64) == 0) and np.all(lse == np.inf)
    dq, dk, dv = cubeattn.flash_attn_varlen_backward(q, q, k, v, out, lse, cu_q, cu_k, tq, tk, softmax_scale=scale,
                                                     causal=causal, device="cpu")
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert all(np.all(np.asarray(g, np.float64) == 0) for g in (dq, dk, dv))
    g = cubeattn.grouped_flash_attn_func(q, k, v, [[0, tq]] * 1, [[0, tk]], causal=causal, device="cpu")
    assert g.shape == q.shape and np.all(np.asarray(g, np.float64) == 0)


# ---------------------------------------------------------------- NaN / Inf (issue 13's policy, not met yet)

WINDOWS = [(-1, -1), (-1, -1), (2, 1), (0, 0), (5, -1), (-1, 3)]


def draw_non_finite_case(data, t=CPU, exact=False):
    """One NaN or Inf in q, k or v, the call on t. With `exact` (the property needs masked
    elements to contribute exactly nothing), where t does not promise that for a masked v element
    (t.masks_non_finite_exactly), a bad v element comes without a mask (no causal, no window)."""
    lq = data.draw(st.integers(1, 70), label="seqlen_q")
    lk = data.draw(st.integers(1, 70), label="seqlen_k")
    hq, hkv, d, dtype, causal, _ = draw_common(data, t.small_head_dims)
    window = data.draw(st.sampled_from(WINDOWS), label="window_size")
    where = data.draw(st.sampled_from(["q", "k", "v"]), label="where")
    value = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="value")
    if exact and where == "v" and not t.masks_non_finite_exactly(dtype):
        causal, window = False, (-1, -1)
    io = t.draw_io(data)
    rng = seed_of(data)
    x = dict(q=rand(rng, (lq, hq, d), dtype), k=rand(rng, (lk, hkv, d), dtype), v=rand(rng, (lk, hkv, d), dtype))
    row = data.draw(st.integers(0, x[where].shape[0] - 1), label="row")
    head = data.draw(st.integers(0, x[where].shape[1] - 1), label="head")
    chan = data.draw(st.integers(0, d - 1), label="channel")
    clean = {n: a.copy() for n, a in x.items()}
    clean[where][row, head, chan] = 0
    x[where][row, head, chan] = value
    cu_q, cu_k = np.array([0, lq], np.int32), np.array([0, lk], np.int32)
    out, lse = map(io.get, t.call("dense", cubeattn.flash_attn_varlen_func, io.put(x["q"]), io.put(x["k"]),
                                  io.put(x["v"]), cu_q, cu_k, lq, lk, causal=causal, window_size=window,
                                  return_lse=True))
    # which (query row, q head) pairs use the bad element
    g = hq // hkv
    uses = np.zeros((lq, hq), bool)
    if where == "q":
        uses[row, head] = visible_mask(lq, lk, causal, window)[row].any()
    else:
        sees = visible_mask(lq, lk, causal, window)[:, row]
        uses[:, head * g:(head + 1) * g] = sees[:, None]
    ref, _ = ref_attention(clean["q"], clean["k"], clean["v"], [(0, lq, 0, lk)], causal, window=window)
    return np.asarray(out, np.float64), ref, uses, where, value, dtype, lse, x, causal, window


def run_non_finite_does_not_reach(data, t):
    out, ref, uses, _, _, dtype, lse, *_ = draw_non_finite_case(data, t, exact=True)
    tol, _ = FWD_TOL[dtype]
    o = out.transpose(1, 0, 2)[~uses.T]
    assert np.all(np.isfinite(o))
    np.testing.assert_allclose(o, ref.transpose(1, 0, 2)[~uses.T], rtol=tol, atol=tol)


@settings(max_examples=120, **SETTINGS)
@given(data=st.data())
def test_non_finite_element_does_not_reach_rows_that_cannot_see_it(data):
    """A key that a row cannot see (causal mask, sliding window) contributes exactly nothing, even
    an Inf in v (no 0 * Inf): those rows are finite and equal to the output without the element."""
    run_non_finite_does_not_reach(data, CPU)


def run_nan_propagates(data, t):
    out, _, uses, where, value, _, lse, *_ = draw_non_finite_case(data, t)
    if not (np.isnan(value) or where == "v"):
        return  # an Inf in q or k may give a -inf score, i.e. a finite row: no claim (see the torch test)
    for r, h in zip(*np.nonzero(uses)):
        assert not np.all(np.isfinite(out[r, h])), f"row {r} head {h} uses a NaN (or an Inf value) but is finite"
        if np.isnan(value) and where != "v":
            assert np.all(np.isnan(out[r, h])) and np.isnan(lse[h, r]), f"row {r} head {h}: NaN score, NaN row"


@settings(max_examples=120, **SETTINGS)
@given(data=st.data())
def test_nan_propagates_to_the_rows_that_use_it(data):
    """torch SDPA's policy: a NaN that takes part in a row's softmax makes that row's output (and
    lse) NaN; an Inf value in v makes the row non-finite."""
    run_nan_propagates(data, CPU)


def run_non_finite_pattern(data, t):
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out, _, _, _, _, dtype, _, x, causal, window = draw_non_finite_case(data, t, exact=True)
    q, k, v = (torch.from_numpy(np.asarray(x[n], np.float64)) for n in ("q", "k", "v"))
    lq, hq, d = q.shape
    g = hq // k.shape[1]
    mask = visible_mask(lq, k.shape[0], causal, window)
    want = np.zeros(out.shape)  # rows that see no key: zero (cubeattn's convention)
    for i in range(lq):
        keys = np.nonzero(mask[i])[0]
        if keys.size:
            kk, vv = (y[keys].repeat_interleave(g, 1).transpose(0, 1) for y in (k, v))  # [hq, keys, d]
            # the math backend: torch's fused CPU kernel gives 0 instead of NaN for a NaN query
            # seeing one key (float32), its math backend propagates it
            with sdpa_kernel(SDPBackend.MATH):
                o = torch.nn.functional.scaled_dot_product_attention(q[i:i + 1].transpose(0, 1), kk, vv,
                                                                     scale=1.0 / np.sqrt(d))
            want[i] = o[:, 0].numpy()
    out = t.known_non_finite_deviations(out, want, x, dtype, causal, window)
    for name, f in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        bad = np.argwhere(f(out) != f(want))
        assert bad.size == 0, f"{name} pattern differs from torch SDPA at (row, head, channel) {bad[:5].tolist()}"


@pytest.mark.torch
@settings(max_examples=120, **SETTINGS)
@given(data=st.data())
def test_non_finite_pattern_is_torch_sdpas(data):
    """Element by element, which outputs are NaN, +Inf or -Inf is what torch's
    scaled_dot_product_attention (math backend, float64) gives over the keys each row sees, Inf in q and k
    included (a -inf score weighs 0, a +inf score makes the row NaN, a row of -inf scores is zero).
    Per row, not with SDPA's attn_mask: the mask is additive there, so a masked +inf score would
    still reach the row as NaN, where cubeattn's masked keys contribute nothing."""
    run_non_finite_pattern(data, CPU)
