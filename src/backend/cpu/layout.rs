//! Data movement for the CPU backend: token-major <-> head-major f32 copies, shared output
//! pointers for disjoint parallel writes, and a thin wrapper over the `gemm` crate.

use std::borrow::Cow;

use rayon::prelude::*;

use super::simd::Widen;
use crate::dtype::{DType, Element, HostData, HostView};

/// `[tokens, heads, d]` in any dtype -> `[heads, tokens, d]` f32.
pub(crate) fn to_head_major(x: HostView, tokens: usize, heads: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; tokens * heads * d];
    to_head_major_into(x, tokens, heads, d, &mut out);
    out
}

/// [`to_head_major`] into `out` (`tokens * heads * d` floats).
pub(crate) fn to_head_major_into(x: HostView, tokens: usize, heads: usize, d: usize, out: &mut [f32]) {
    fn go<T: Widen>(x: &[T], tokens: usize, heads: usize, d: usize, out: &mut [f32]) {
        assert_eq!(out.len(), x.len());
        if out.is_empty() {
            return;
        }
        out.par_chunks_mut(tokens.max(1) * d).enumerate().for_each(|(h, dst)| {
            for t in 0..tokens {
                T::widen(&x[(t * heads + h) * d..][..d], &mut dst[t * d..][..d]);
            }
        });
    }
    match x {
        HostView::F32(s) => go(s, tokens, heads, d, out),
        HostView::F16(s) => go(s, tokens, heads, d, out),
        HostView::BF16(s) => go(s, tokens, heads, d, out),
    }
}

/// Any dtype -> f32 in the same (token-major) layout; f32 input is borrowed, not copied.
pub(crate) fn to_f32_cow(x: HostView<'_>) -> Cow<'_, [f32]> {
    fn go<T: Widen>(x: &[T]) -> Vec<f32> {
        let mut out = vec![0.0f32; x.len()];
        out.par_chunks_mut(1 << 14).zip(x.par_chunks(1 << 14)).for_each(|(o, s)| T::widen(s, o));
        out
    }
    match x {
        HostView::F32(s) => Cow::Borrowed(s),
        HostView::F16(s) => Cow::Owned(go(s)),
        HostView::BF16(s) => Cow::Owned(go(s)),
    }
}

/// f32 values -> `dtype` (same layout); f32 output is moved, not copied.
pub(crate) fn from_f32_vec(x: Vec<f32>, dtype: DType) -> HostData {
    fn go<T: Element>(x: &[f32]) -> Vec<T> {
        let mut out = vec![T::default(); x.len()];
        out.par_chunks_mut(1 << 14).zip(x.par_chunks(1 << 14)).for_each(|(o, s)| {
            for (a, &b) in o.iter_mut().zip(s) {
                *a = T::from_f32(b);
            }
        });
        out
    }
    match dtype {
        DType::F32 => HostData::F32(x),
        DType::F16 => HostData::F16(go(&x)),
        DType::BF16 => HostData::BF16(go(&x)),
    }
}

/// `[tokens, heads, d]` in any dtype -> `[heads, d, tokens]` f32: K transposed per head, so that
/// q.k products read K^T row-major (the layout the gemm kernels are fastest with).
pub(crate) fn transpose_per_head(x: HostView, tokens: usize, heads: usize, d: usize) -> Vec<f32> {
    fn go<T: Widen>(x: &[T], tokens: usize, heads: usize, d: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; x.len()];
        if out.is_empty() {
            return out;
        }
        // one task per (head, block of 64 tokens): reads and writes stay within a few cache lines;
        // the block's token rows are widened a row at a time, then written transposed
        const TB: usize = 64;
        let nb = tokens.div_ceil(TB);
        let w = SharedMut::new(&mut out);
        (0..heads * nb).into_par_iter().for_each_init(|| vec![0.0f32; TB * d], |rows, i| {
            let (h, b) = (i / nb, i % nb);
            let (t0, t1) = (b * TB, ((b + 1) * TB).min(tokens));
            for (j, r) in rows[..(t1 - t0) * d].chunks_exact_mut(d).enumerate() {
                T::widen(&x[((t0 + j) * heads + h) * d..][..d], r);
            }
            for c in 0..d {
                // SAFETY: (head, column, token block) ranges are disjoint across tasks.
                let dst = unsafe { w.slice((h * d + c) * tokens + t0, t1 - t0) };
                for (j, o) in dst.iter_mut().enumerate() {
                    *o = rows[j * d + c];
                }
            }
        });
        out
    }
    match x {
        HostView::F32(s) => go(s, tokens, heads, d),
        HostView::F16(s) => go(s, tokens, heads, d),
        HostView::BF16(s) => go(s, tokens, heads, d),
    }
}

/// `[heads, tokens, d]` f32 -> `[tokens, heads, d]` in `dtype`.
pub(crate) fn from_head_major(x: &[f32], tokens: usize, heads: usize, d: usize, dtype: DType) -> HostData {
    fn go<T: Element>(x: &[f32], tokens: usize, heads: usize, d: usize) -> Vec<T> {
        let mut out = vec![T::default(); x.len()];
        if out.is_empty() {
            return out;
        }
        out.par_chunks_mut(heads * d).enumerate().for_each(|(t, dst)| {
            for h in 0..heads {
                let src = &x[(h * tokens + t) * d..][..d];
                for (o, &s) in dst[h * d..][..d].iter_mut().zip(src) {
                    *o = T::from_f32(s);
                }
            }
        });
        out
    }
    match dtype {
        DType::F32 => HostData::F32(go(x, tokens, heads, d)),
        DType::F16 => HostData::F16(go(x, tokens, heads, d)),
        DType::BF16 => HostData::BF16(go(x, tokens, heads, d)),
    }
}

/// A raw pointer that parallel tasks use to write disjoint parts of one buffer.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(*mut T, usize);
// SAFETY: every user writes only the sub-slices its task owns (disjoint by construction).
unsafe impl<T: Send> Send for SharedMut<T> {}
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub(crate) fn new(x: &mut [T]) -> Self {
        SharedMut(x.as_mut_ptr(), x.len())
    }
    /// The address of element `start` (not dereferenced here; for prefetches).
    pub(crate) fn ptr_at(&self, start: usize) -> *const T {
        self.0.wrapping_add(start.min(self.1))
    }
    /// # Safety
    /// No two live slices obtained from one `SharedMut` may overlap.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.1, "SharedMut range out of bounds");
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}

/// A row-major f32 matrix view: element (i, j) at `ptr[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}

impl Mat {
    /// Row-major view of `data` with `cols` columns.
    pub fn rows(data: &[f32], cols: usize) -> Mat {
        Mat { ptr: data.as_ptr(), rs: cols as isize, cs: 1 }
    }
    /// The transpose of a row-major `data` with `cols` columns.
    pub fn rows_t(data: &[f32], cols: usize) -> Mat {
        Mat { ptr: data.as_ptr(), rs: 1, cs: cols as isize }
    }
}

/// `dst[m x n] (row-major, leading dim ldd) = (accumulate ? dst : 0) + alpha * a[m x k] * b[k x n]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(dst: &mut [f32], ldd: usize, m: usize, n: usize, k: usize, a: Mat, b: Mat, alpha: f32, accumulate: bool) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst.len() >= (m - 1) * ldd + n, "matmul destination too small");
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[r * ldd..r * ldd + n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: callers build `a` and `b` from slices holding at least m x k and k x n elements at
    // the given strides, and `dst` was bounds-checked above.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            ldd as isize,
            accumulate,
            a.ptr,
            a.cs,
            a.rs,
            b.ptr,
            b.cs,
            b.rs,
            1.0,
            alpha,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}
