//! How a kernel's one-dimensional grid of work items x slots maps to its cubes.

use cubecl::prelude::*;

/// (work item, slot) of this cube in a grid of `CUBE_COUNT_X / slots` items x `slots` slots (a
/// slot is a head or head group). Slots fastest by default: the cubes start in the work list's
/// order (most expensive first) over all heads, so the longest ones do not start last. Items
/// fastest (the slot outer) where `items_fastest` is non-zero (a launch's run-time choice: the
/// long non-causal dK/dV launches, docs/backward.md) or, comptime, `always` (block-sparse): the
/// items of one slot run together and share its K / V (forward, dQ pass) or Q / dO and dQ rows
/// (dK/dV) in L2; a random pattern lists each block for few query blocks, and slots fastest
/// spreads one wave over every head (1-9% measured, docs/sparse.md).
#[cube]
pub fn cube_item_slot(slots: u32, items_fastest: u32, #[comptime] always: bool) -> (u32, u32) {
    let mut item = CUBE_POS_X / slots;
    let mut slot = CUBE_POS_X % slots;
    let mut outer = items_fastest != 0u32;
    if comptime!(always) {
        outer = true;
    }
    if outer {
        let n_items = CUBE_COUNT_X / slots;
        item = CUBE_POS_X % n_items;
        slot = CUBE_POS_X / n_items;
    }
    (item, slot)
}
