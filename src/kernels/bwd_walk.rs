//! The dK / dV kernels' walk, shared by the mma.sync kernel (`flash_bwd_wide`) and the wgmma one
//! (`flash_bwd_sm90`): which keys a cube owns ([`key_item`]), and per segment overlapping them
//! which (q head, query tile) pairs it visits ([`seg_walk`], [`sparse_q_tile`]). Both kernels take
//! the same host plan (`backend::cuda::backward`): dense, a key tile of the shared key axis and the
//! CSR list of the segments overlapping it; block-sparse, a work item inside one key block of one
//! sequence and the transposed block index.

use cubecl::prelude::*;

use super::rows::key_rows;
use super::tiles::{BWD_BM, SPARSE_KWORK_WORDS, SPARSE_QB_BITS, SPARSE_QB_MASK};

/// A cube's keys `[key0, key_lim)` (absolute; dense: `key_lim` is `total_k`, the segments bound
/// them) and where its segments are: dense, `tile_segs[s_begin..s_end]`; sparse, the one
/// sequence `seq` (`s_begin..s_end` = 0..1) and its key block `kblk`.
#[derive(CubeType, Clone, Copy)]
pub struct KeyItem {
    pub key0: u32,
    pub key_lim: u32,
    pub s_begin: u32,
    pub s_end: u32,
    pub seq: u32,
    pub kblk: u32,
}

/// The keys of work item `item` (`ktiles`: dense, key-tile indices of `bn` keys: [`WIDE_BN`](super::tiles::WIDE_BN)
/// or [`SPLIT_BN`](super::tiles::SPLIT_BN); sparse,
/// [`SPARSE_KWORK_WORDS`] words per item: sequence, first window key, keys, key block), the first
/// at `offset` keys into it (a cube taking part of an item).
#[cube]
#[allow(unused_assignments)]
pub fn key_item(
    ktiles: &Array<u32>,
    tile_off: &Array<u32>,
    segs: &Array<u32>,
    item: u32,
    offset: u32,
    total_k: u32,
    #[comptime] sparse: bool,
    #[comptime] bn: usize,
) -> KeyItem {
    let mut key0 = 0u32;
    let mut key_lim = total_k;
    let mut s_begin = 0u32;
    let mut s_end = 1u32;
    let mut seq = 0u32;
    let mut kblk = 0u32;
    if sparse {
        let w = item as usize * SPARSE_KWORK_WORDS;
        seq = ktiles[w];
        kblk = ktiles[w + 3];
        let first = segs[seq as usize * 4 + 2] + ktiles[w + 1];
        key0 = first + offset;
        key_lim = first + ktiles[w + 2];
    } else {
        let kt = ktiles[item as usize];
        key0 = kt * bn as u32 + offset;
        s_begin = tile_off[kt as usize];
        s_end = tile_off[kt as usize + 1];
    }
    KeyItem { key0, key_lim, s_begin, s_end, seq, kblk }
}

/// One segment of a cube's walk: its rows and keys (`q_start`, `q_len`, `k_start`, `k_len`,
/// `shift = k_len - q_len`), the window keys the cube may touch (`[.., k_hi)`: dense the
/// segment's, sparse the item's), and its (q head, query tile) pairs: `n_it` of them. Dense: q
/// head outer, `n_qt` tiles of `rows` rows (the kernel's query tile) from `r_min` (the first row that sees the cube's
/// first key). Sparse: the entries `t_lo..t_lo + t_n` of the transposed index (query blocks listing
/// the key block, per index head; `span` index heads per kv head; with an index per kv head every
/// q head of the group walks the one list), `q_tiles_per_block` tiles of [`BWD_BM`] rows each.
#[derive(CubeType, Clone, Copy)]
pub struct SegWalk {
    pub q_start: u32,
    pub q_len: u32,
    pub k_start: u32,
    pub k_len: u32,
    pub shift: i32,
    pub r_min: i32,
    pub k_hi: u32,
    pub n_qt: u32,
    pub n_it: u32,
    pub t_lo: u32,
    pub t_n: u32,
    pub span: u32,
}

/// Segment `si` of the cube's list (`ki`; its keys end at `key0 + keys`) for kv head `hk`.
#[cube]
#[allow(clippy::too_many_arguments, unused_assignments)]
pub fn seg_walk(
    segs: &Array<u32>,
    tile_segs: &Array<u32>,
    tq_off: &Array<u32>,
    ki: &KeyItem,
    si: u32,
    keys: u32,
    hk: u32,
    heads_kv: u32,
    group: u32,
    idx_heads: u32,
    k_blocks: u32,
    q_tiles_per_block: u32,
    win_l: u32,
    win_r: u32,
    #[comptime] sparse: bool,
    #[comptime] rows: usize,
) -> SegWalk {
    let mut seg = ki.seq as usize;
    if !sparse {
        seg = tile_segs[si as usize] as usize;
    }
    let q_start = segs[seg * 4];
    let q_len = segs[seg * 4 + 1];
    let k_start = segs[seg * 4 + 2];
    let k_len = segs[seg * 4 + 3];
    let shift = k_len as i32 - q_len as i32;
    // rows from the first that sees the cube's first key to the last that sees its last
    let first_key = max(ki.key0, k_start) - k_start;
    let last_key = min(ki.key0 + keys, k_start + k_len) - 1u32 - k_start;
    let (r_min, _) = key_rows(q_len, k_len, first_key as i32, win_l, win_r);
    let (_, r_end) = key_rows(q_len, k_len, last_key as i32, win_l, win_r);
    let mut k_hi = k_len;
    let mut n_qt = 0u32;
    let mut n_it = 0u32;
    let mut t_lo = 0u32;
    let mut t_n = 0u32;
    let span = idx_heads / heads_kv;
    if sparse {
        k_hi = ki.key_lim - k_start;
        let c0 = (ki.seq * k_blocks + ki.kblk) * idx_heads + hk * span;
        t_lo = tq_off[c0 as usize];
        t_n = tq_off[(c0 + span) as usize] - t_lo;
        n_it = (group / span) * t_n * q_tiles_per_block;
    } else {
        if r_min < r_end {
            n_qt = (r_end as u32 - r_min as u32 + rows as u32 - 1) / rows as u32;
        }
        n_it = group * n_qt;
    }
    SegWalk { q_start, q_len, k_start, k_len, shift, r_min, k_hi, n_qt, n_it, t_lo, t_n, span }
}

/// Block-sparse: (q head, first row, end row of the query block) of query tile `t` of entry `e` of
/// the transposed list at `lo` (entries `query block | index head << SPARSE_QB_BITS`). With an
/// index per q head (`span` > 1) the entry names the head; with one per kv head, the `ri`-th q
/// head of the group (`h_base` = its first).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn sparse_q_tile(
    tq_list: &Array<u32>,
    lo: u32,
    e: u32,
    t: u32,
    ri: u32,
    h_base: u32,
    span: u32,
    q_block: u32,
    q_len: u32,
) -> (u32, u32, u32) {
    let entry = tq_list[(lo + e) as usize];
    let qblk = entry & SPARSE_QB_MASK;
    let mut h = h_base + ri;
    if span > 1u32 {
        h = entry >> SPARSE_QB_BITS;
    }
    let b0 = qblk * q_block;
    (h, b0 + t * BWD_BM as u32, min(b0 + q_block, q_len))
}

/// A cube's position in a segment's (q head, query tile) walk ([`SegWalk`]): the counters (query
/// tile `ti`, transposed-list entry `ei`, q head `hq`) and the pair they name (head `h`, first row
/// `r0`, end row `row_end`).
#[derive(CubeType, Clone, Copy)]
pub struct QTile {
    pub ti: u32,
    pub ei: u32,
    pub hq: u32,
    pub h: u32,
    pub r0: u32,
    pub row_end: u32,
}

/// The first pair of segment `sw`'s walk for kv head `hk` (any value when the walk is empty).
#[cube]
pub fn first_q_tile(
    tq_list: &Array<u32>,
    sw: &SegWalk,
    hk: u32,
    group: u32,
    q_block: u32,
    #[comptime] sparse: bool,
) -> QTile {
    let mut h = hk * group;
    let mut r0 = sw.r_min as u32;
    let mut row_end = sw.q_len;
    if sparse && sw.n_it > 0 {
        let (ha, ra, re) = sparse_q_tile(tq_list, sw.t_lo, 0u32, 0u32, 0u32, hk * group, sw.span, q_block, sw.q_len);
        h = ha;
        r0 = ra;
        row_end = re;
    }
    QTile { ti: 0u32, ei: 0u32, hq: 0u32, h, r0, row_end }
}

/// Moves `c` to the next pair of segment `sw`'s walk: dense, the next query tile of the head, then
/// the next q head; sparse, the next tile
/// of the query block, then the next entry, then the next q head (past the walk's last pair: any
/// value).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn next_q_tile(
    tq_list: &Array<u32>,
    sw: &SegWalk,
    c: &mut QTile,
    hk: u32,
    group: u32,
    q_tiles_per_block: u32,
    q_block: u32,
    #[comptime] sparse: bool,
    #[comptime] rows: usize,
) {
    c.ti += 1u32;
    if sparse {
        if c.ti == q_tiles_per_block {
            c.ti = 0u32;
            c.ei += 1u32;
            if c.ei == sw.t_n {
                c.ei = 0u32;
                c.hq += 1u32;
            }
        }
        let (ha, ra, re) = sparse_q_tile(tq_list, sw.t_lo, c.ei, c.ti, c.hq, hk * group, sw.span, q_block, sw.q_len);
        c.h = ha;
        c.r0 = ra;
        c.row_end = re;
    } else {
        if c.ti == sw.n_qt {
            c.ti = 0u32;
            c.hq += 1u32;
        }
        c.h = hk * group + c.hq;
        c.r0 = sw.r_min as u32 + c.ti * rows as u32;
    }
}
