//! Row copies of the zigzag context-parallel layout (`crate::zigzag`) on the GPU: the gathered
//! zigzag K or V to the sequences' causal prefixes (extract) and the gradient of the prefixes back
//! to the gathered layout (scatter).
//!
//! One kernel serves both and writes every output row exactly once: `out[j] = src[map[j]]`, or
//! zeros where `map[j]` is [`NO_ROW`]. Extract's map is `zigzag::gathered_rows` (one entry per
//! prefix row, never [`NO_ROW`]); scatter's is its inverse over all gathered rows ([`NO_ROW`] for
//! the rows outside the prefixes), so no separate zero fill runs and no row is written twice.
//!
//! Rows are moved as raw words whatever they hold, so the copy is exact for every dtype: `N`
//! words of type `W` per unit (u32 x 4 = one 16-byte load and store where the row length and both
//! addresses allow it; narrower words otherwise, down to single bytes). One unit per vector of the
//! output, 2-D grid of [`COPY_THREADS`]-unit cubes (x fastest).

use cubecl::prelude::*;

/// Map entry of an output row that no source row feeds (written as zeros).
pub const NO_ROW: u32 = u32::MAX;
/// Units per cube.
pub const COPY_THREADS: usize = 256;

/// `out[j] = src[map[j]]` row by row (zeros where `map[j] == NO_ROW`). `row_vecs`: vectors per
/// row; `n_vecs`: vectors of `out` (its rows times `row_vecs`).
#[cube(launch_unchecked)]
pub fn copy_rows<W: Int, N: Size>(
    src: &Array<Vector<W, N>>,
    map: &Array<u32>,
    out: &mut Array<Vector<W, N>>,
    row_vecs: u32,
    n_vecs: u32,
) {
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * COPY_THREADS as u32 + UNIT_POS;
    if i < n_vecs {
        let row = i / row_vecs;
        let from = map[row as usize];
        if from == NO_ROW {
            out[i as usize] = Vector::<W, N>::new(W::from_int(0));
        } else {
            out[i as usize] = src[(from * row_vecs + (i - row * row_vecs)) as usize];
        }
    }
}
