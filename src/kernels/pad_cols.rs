//! Row copies between two row widths, for head dims without a kernel of their own
//! (`backend::cuda::head_pad`): q, k, v rows of `head_dim` elements widened to the kernel's head
//! dim with zero columns after the caller's, and the outputs narrowed back.
//!
//! `out[r][c] = src[r][c]` for `c` below the source row's width, zero beyond it; with a narrower
//! output the extra source columns are not read. Rows are moved as raw words (`N` words of type
//! `W` per unit: the widest that divides both row widths and both addresses), so the copy is
//! exact for every dtype. One unit per vector of the output, 2-D grid of [`PAD_THREADS`]-unit
//! cubes (x fastest).

use cubecl::prelude::*;

/// Units per cube.
pub const PAD_THREADS: usize = 256;

/// `out` has rows of `out_vecs` vectors, `src` rows of `src_vecs`; `n_vecs`: vectors of `out`.
#[cube(launch_unchecked)]
pub fn copy_cols<W: Int, N: Size>(
    src: &Array<Vector<W, N>>,
    out: &mut Array<Vector<W, N>>,
    src_vecs: u32,
    out_vecs: u32,
    n_vecs: u32,
) {
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * PAD_THREADS as u32 + UNIT_POS;
    if i < n_vecs {
        let row = i / out_vecs;
        let col = i - row * out_vecs;
        if col < src_vecs {
            out[i as usize] = src[(row * src_vecs + col) as usize];
        } else {
            out[i as usize] = Vector::<W, N>::new(W::from_int(0));
        }
    }
}
