//! The cube order of a launch over (work item, head) pairs: the grid is one dimension of
//! `items x heads` cubes, and the hardware starts cubes in index order.

use cubecl::prelude::*;

/// (work item, head) of this cube. `heads_fast` = 1: the head varies fastest, so the cubes start in
/// the work list's order (most expensive first) over all heads and the longest ones never start
/// last (short launches); 0: head-major, so the cubes running at once share a head's streamed
/// operand in L2 (long launches). The host picks (`backend::cuda::plan::heads_fast`).
#[cube]
pub fn cube_item(heads: u32, heads_fast: u32) -> (u32, u32) {
    let items = CUBE_COUNT_X / heads;
    let mut item = CUBE_POS_X % items;
    let mut head = CUBE_POS_X / items;
    if heads_fast != 0u32 {
        item = CUBE_POS_X / heads;
        head = CUBE_POS_X % heads;
    }
    (item, head)
}
