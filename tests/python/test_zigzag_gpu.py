"""Zigzag extract / scatter of CUDA tensors (the CubeCL row-copy kernel, kernels/zigzag_copy.rs)
against plain slicing on the host, bit for bit: random bit patterns (NaN payloads, infinities,
-0.0, denormals included) in float16, bfloat16 and float32, W = 1, 2, 3, 4, one and several
sequences (lengths that are not multiples of 2W too), early and late chunks, odd head counts,
head_dim 64 and 128, rows and addresses that take each copy width, a non-default stream, a launch
grid taller than one row of cubes, and the argument checks. Same references as the CPU tests in test_zigzag.py."""
import numpy as np
import pytest

import cubeattn
from conftest import cuda_available
from test_zigzag import check_in_place_read, cu_of, ref_gathered, ref_prefix, ref_prefix_mask, same

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch,
              pytest.mark.skipif(not (torch.cuda.is_available() and cuda_available()),
                                 reason="needs torch with CUDA and the CUDA backend")]

# torch dtype and the integer type of the same width (its bits are the comparison)
DTYPES = {"float16": (torch.float16, np.int16), "bfloat16": (torch.bfloat16, np.int16),
          "float32": (torch.float32, np.int32)}
BASE = {"single": [1536], "multiple": [512, 1024, 768], "any": [13, 1, 7, 0, 1000]}


def lens_for(name, w):
    """The base lengths rounded down to a multiple of 2W (W = 3 needs multiples of 6); "any" as
    they are (uneven chunks, shards padded in the gathered buffer)."""
    return BASE[name] if name == "any" else [n - n % (2 * w) for n in BASE[name]]


def random_bits(shape, dtype, seed):
    """Uniformly random bit patterns of `dtype`'s width (every float value, NaNs included)."""
    ity = DTYPES[dtype][1]
    info = np.iinfo(ity)
    return np.random.default_rng(seed).integers(info.min, info.max, size=shape, endpoint=True, dtype=ity)


def to_cuda(bits, dtype):
    return torch.from_numpy(np.ascontiguousarray(bits)).view(DTYPES[dtype][0]).cuda()


def bits_of(t, dtype):
    assert t.is_cuda and t.dtype == DTYPES[dtype][0]
    return t.cpu().view(getattr(torch, np.dtype(DTYPES[dtype][1]).name)).numpy()


def check_extract(bits, lens, w, m, dtype, kv=None):
    kv = to_cuda(ref_gathered(bits, lens, w), dtype) if kv is None else kv
    out = cubeattn.extract_zigzag_kv_slice(kv, cu_of(lens), w, max_chunk_idx=m)
    assert cubeattn.last_backend() == "cuda"
    same(bits_of(out, dtype), ref_prefix(bits, lens, w, m))
    return out


def check_scatter(bits, lens, w, m, dtype, grad=None):
    grad = to_cuda(ref_prefix(bits, lens, w, m), dtype) if grad is None else grad
    out = cubeattn.scatter_grad_to_zigzag(grad, cu_of(lens), w, max_chunk_idx=m)
    assert cubeattn.last_backend() == "cuda"
    keep = ref_prefix_mask(lens, w, m).reshape((-1,) + (1,) * (bits.ndim - 1))  # rows x (1, ...)
    full = np.where(keep, bits, np.zeros_like(bits))
    same(bits_of(out, dtype), ref_gathered(full, lens, w))
    return out


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [1, 3, 5])
@pytest.mark.parametrize("lens", ["single", "multiple", "any"])
@pytest.mark.parametrize("w", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_extract_and_scatter_on_cuda_are_exact(dtype, w, lens, heads, d):
    lens = lens_for(lens, w)
    bits = random_bits((sum(lens), heads, d), dtype, seed=w * 1000 + heads * 10 + d)
    # early chunks (0 .. W-1), late ones (W .. 2W-1, the last: every chunk)
    for m in sorted({0, w - 1, w, 2 * w - 1}):
        check_extract(bits, lens, w, m, dtype)
        check_scatter(bits, lens, w, m, dtype)
    # the default max_chunk_idx: every chunk, i.e. the sequences back in original order
    out = cubeattn.extract_zigzag_kv_slice(to_cuda(ref_gathered(bits, lens, w), dtype), cu_of(lens), w)
    same(bits_of(out, dtype), bits)


@pytest.mark.parametrize("w", [1, 2, 3, 4])
def test_every_chunk_prefix_and_the_round_trip(w):
    """Extract then scatter gives the gathered buffer with the rows outside the prefix zeroed;
    lengths with an empty sequence in the middle."""
    lens = [n - n % (2 * w) for n in (240, 0, 96, 720)]
    bits = random_bits((sum(lens), 3, 64), "bfloat16", seed=70 + w)
    g = ref_gathered(bits, lens, w)
    kv = to_cuda(g, "bfloat16")
    for m in range(2 * w):
        ex = check_extract(bits, lens, w, m, "bfloat16", kv=kv)
        back = cubeattn.scatter_grad_to_zigzag(ex, cu_of(lens), w, max_chunk_idx=m)
        mask = ref_gathered(ref_prefix_mask(lens, w, m)[:, None, None], lens, w)
        same(bits_of(back, "bfloat16"), np.where(mask, g, np.zeros_like(g)))
    # nothing to copy: every sequence empty
    empty = torch.zeros((0, 3, 64), dtype=torch.bfloat16, device="cuda")
    assert cubeattn.extract_zigzag_kv_slice(empty, cu_of([0, 0]), w).shape == (0, 3, 64)
    assert cubeattn.scatter_grad_to_zigzag(empty, cu_of([0, 0]), w).shape == (0, 3, 64)


# (heads, d) x dtype: row bytes that 16, 8, 4 or 2 bytes divide; `offset` elements in front of the
# input moves its address off 16 bytes (the copy then takes a narrower word)
@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("shape", [(3, 64), (1, 6), (1, 3), (5, 1), (7, 10)])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_row_lengths_and_addresses_of_every_copy_width(dtype, shape, offset):
    w, lens = 2, [64, 128]
    bits = random_bits((sum(lens),) + shape, dtype, seed=offset * 100 + shape[0] * 10 + shape[1])

    def shifted(a):
        flat = np.concatenate([np.zeros(offset, a.dtype), a.reshape(-1)])
        return to_cuda(flat, dtype)[offset:].view((a.shape[0],) + shape)

    for m in (0, 3):
        g = ref_gathered(bits, lens, w)
        kv = shifted(g)
        assert kv.is_contiguous() and kv.data_ptr() % 16 == (offset * kv.element_size()) % 16
        check_extract(bits, lens, w, m, dtype, kv=kv)
        check_scatter(bits, lens, w, m, dtype, grad=shifted(ref_prefix(bits, lens, w, m)))


def test_on_a_side_stream_without_synchronization():
    """Enqueued on torch's current stream: an input made on a side stream just before is read
    after it is written, and the output is complete once that stream is synchronized."""
    w, lens, dtype = 4, [1024, 2048], "float16"
    bits = random_bits((sum(lens), 8, 128), dtype, seed=5)
    src = to_cuda(ref_gathered(bits, lens, w), dtype)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        kv = torch.empty_like(src)
        torch.cuda._sleep(20_000_000)  # keeps the stream busy: a reader on another stream would race
        kv.copy_(src)
        ex = cubeattn.extract_zigzag_kv_slice(kv, cu_of(lens), w, max_chunk_idx=5)
        back = cubeattn.scatter_grad_to_zigzag(ex, cu_of(lens), w, max_chunk_idx=5)
    side.synchronize()
    same(bits_of(ex, dtype), ref_prefix(bits, lens, w, 5))
    full = np.where(ref_prefix_mask(lens, w, 5)[:, None, None], bits, np.zeros_like(bits))
    same(bits_of(back, dtype), ref_gathered(full, lens, w))


def test_more_cubes_than_one_grid_row():
    """17M 16-byte rows: more than 65535 cubes of 256 units, so the grid has a second row."""
    w, lens, dtype = 2, [(1 << 24) + (1 << 20)], "float32"
    bits = random_bits((lens[0], 4), dtype, seed=9)
    check_extract(bits, lens, w, 3, dtype)
    check_scatter(bits, lens, w, 2, dtype)


def test_cuda_argument_checks_name_the_argument():
    cu = cu_of([16])
    x = torch.zeros((16, 3, 64), dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="`kv`: has 12 rows"):
        cubeattn.extract_zigzag_kv_slice(x[:12], cu, 2)
    with pytest.raises(ValueError, match="`grad`: has 5 rows"):
        cubeattn.scatter_grad_to_zigzag(x[:5], cu, 2, max_chunk_idx=1)
    with pytest.raises(TypeError, match="`kv`"):
        cubeattn.extract_zigzag_kv_slice(x.double(), cu, 2)
    with pytest.raises(TypeError, match="`grad`"):
        cubeattn.scatter_grad_to_zigzag(x[:8].to(torch.int16), cu, 2, max_chunk_idx=1)
    with pytest.raises(ValueError, match="`kv`.*contiguous"):
        cubeattn.extract_zigzag_kv_slice(x.transpose(1, 2), cu, 2)
    with pytest.raises(ValueError, match="`grad`.*contiguous"):
        cubeattn.scatter_grad_to_zigzag(x[:8, :, ::2], cu, 2, max_chunk_idx=1)
    with pytest.raises(ValueError, match="`max_chunk_idx`"):
        cubeattn.extract_zigzag_kv_slice(x, cu, 2, max_chunk_idx=4)
    with pytest.raises(ValueError, match="`cu_seqlens`.*non-decreasing"):
        cubeattn.extract_zigzag_kv_slice(x, np.array([0, 8, 4], np.int32), 2)
    with pytest.raises(ValueError, match="`kv`: has 16 rows, the gathered buffer of cu_seqlens has 18"):
        cubeattn.extract_zigzag_kv_slice(x, cu, 3)  # 16 tokens over 3 ranks: shards of 5, 5, 6 rows
    with pytest.raises(ValueError, match="`world_size`"):
        cubeattn.scatter_grad_to_zigzag(x, cu, 0)


@pytest.mark.parametrize("w", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("causal", [True, False])
def test_in_place_read_of_every_rank_equals_the_ordered_call(w, dtype, causal):
    """The zigzag layer's in-place read on CUDA, every rank of W emulated in one process (the
    collectives are the gloo / NCCL tests' part): bit for bit the ordered call (test_zigzag.py)."""
    m = 2 * w * 64
    lens = [3 * m, m, 0] if w < 8 else [m, 2 * m]
    d = 128 if w % 2 else 64
    # On Hopper a non-causal 16-bit d128 forward over K,V in sequence order takes 160-key tiles, and
    # the paged in-place read 128-key ones (docs/forward.md): the same sums in another order
    exact = causal or d != 128 or dtype == "float32"
    check_in_place_read(w, lens, dtype, causal, "cuda", stride_heads=(8, 2), d=d, seed=w, fwd_exact=exact)
