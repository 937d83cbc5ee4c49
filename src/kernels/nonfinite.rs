//! The per-call device flag "v holds a non-finite element" of the f16/bf16 forward.
//!
//! The tensor-core forward multiplies every key of a 64-key tile with its P.V weight, 0 for a key
//! a row cannot see, and 0 x Inf = NaN. So a call whose v holds a NaN or Inf takes the exact
//! row-wise kernels instead (`rowwise_fwd::rowwise_fwd_exact`, `rowwise_sparse_fwd_exact`), chosen
//! on the device: the host zeroes one u32 of the workspace, [`v_nonfinite`] sets it to 1 when it
//! finds such an element, the tensor-core kernels return at once when it is set and the exact
//! kernels when it is clear. No host synchronization; the tensor-core kernels gain one load.

use cubecl::prelude::*;

/// Units per cube of [`v_nonfinite`].
pub const FLAG_UNITS: usize = 256;
/// u32 words of v per vector load (16 bytes).
pub const FLAG_VEC: usize = 4;

/// Sets `flag[0] = 1` when one of the `n` 16-byte vectors of `v` (f16 or bf16 pairs read as u32)
/// holds a NaN or an Inf: all exponent bits set. Grid-stride over the vectors; `flag[0]` must be
/// zero before the launch (a plain store of 1 by every unit that finds one: all write the same).
#[cube(launch_unchecked)]
pub fn v_nonfinite<NV: Size>(v: &Array<Vector<u32, NV>>, flag: &mut Array<u32>, n: u32, #[comptime] bf16: bool) {
    // exponent field of one 16-bit float in the low half of a word
    let exp = comptime!(if bf16 { 0x7F80u32 } else { 0x7C00u32 });
    let stride = CUBE_COUNT_X * CUBE_DIM_X;
    let mut i = CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X;
    let mut bad = false;
    while i < n {
        let x = v[i as usize];
        #[unroll]
        for e in 0..FLAG_VEC {
            let w = x[e];
            bad = bad || (w & exp) == exp || ((w >> 16u32) & exp) == exp;
        }
        i += stride;
    }
    if bad {
        flag[0] = 1u32;
    }
}
