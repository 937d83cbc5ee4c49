//! Host-side launch plans of the forward: segment table, work lists, packed-row tiles, split-K,
//! and the device bytes they take (used by the VRAM estimate).

use super::*;
use crate::dtype::DType;

/// Device workspace of a forward call besides q, k, v, out and lse: the split-K partial buffers
/// (the caller's workspace) and the plan tables (the backend's plan cache). Host-only arithmetic
/// (no GPU needed); the VRAM estimate uses it so that it follows the plan the launch really makes.
pub fn forward_workspace_bytes(spec: &AttnSpec) -> u64 {
    if let Some(ps) = super::head_pad::padded(spec, Pass::Forward, super::head_pad::wgmma_padding(None, spec)) {
        // the padded copies around the padded spec's own plan and workspace
        let inner = forward_workspace_bytes(&ps);
        return super::head_pad::fwd_workspace(spec, &ps, inner as usize) as u64;
    }
    let plan = Plan::new(spec);
    // the tables the plan cache uploads, counted from the one list of them
    super::forward::fwd_tables(spec, &plan).bytes() + super::forward::fwd_workspace(spec, &plan) as u64
}

/// Host-side launch plan: segment table and the work list of the forward kernels.
pub(crate) struct Plan {
    /// (q_start, q_len, k_start, k_len) per segment.
    pub segs: Vec<u32>,
    /// Segment of every query row, u32::MAX when none (the row-wise kernels: the f32 forward and
    /// the exact f16/bf16 forward of a v with a NaN or Inf).
    pub row_seg: Vec<u32>,
    /// Packed-row work list of the tensor-core forward kernel (empty for f32).
    pub fwd: FwdPlan,
}

impl Plan {
    pub fn new(spec: &AttnSpec) -> Plan {
        Plan::with_rows(spec, BLOCK_M)
    }

    /// The plan with tiles of `rows` packed rows (`BLOCK_M`, or the decode kernel's 8-32,
    /// `forward::tile_rows`).
    pub fn with_rows(spec: &AttnSpec, rows: usize) -> Plan {
        let mut segs = Vec::with_capacity(spec.segments.len() * 4);
        for s in &spec.segments {
            segs.extend_from_slice(&[s.q_start as u32, s.q_len as u32, s.k_start as u32, s.k_len as u32]);
        }
        let mut row_seg = vec![u32::MAX; spec.dims.total_q];
        for (i, s) in spec.segments.iter().enumerate() {
            for r in &mut row_seg[s.q_start..s.q_start + s.q_len] {
                *r = i as u32;
            }
        }
        let fwd = if spec.dtype == DType::F32 { FwdPlan::default() } else { FwdPlan::with_rows(spec, &fwd_options(), rows) };
        Plan { segs, row_seg, fwd }
    }

    /// Rows of the split-K partial buffers of the tensor-core forward (`part_o` holds
    /// rows x head_dim f32, `part_lse` rows f32).
    pub(crate) fn split_rows(&self, heads_q: usize) -> usize {
        let y = (heads_q as u32 / self.fwd.hp.max(1)).max(1) as usize;
        (self.fwd.n_slots as usize * y * BLOCK_M).max(1)
    }
}

/// Multiprocessors of device 0 (132 when unknown), for the split decision.
pub(crate) fn sm_count() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        guarded("CUDA device query", || {
            use cudarc::driver::result as drv;
            use cudarc::driver::sys::CUdevice_attribute as A;
            drv::device::get(0)
                .ok()
                .and_then(|d| unsafe { drv::device::get_attribute(d, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) }.ok())
                .filter(|&n| n > 0)
                .map(|n| n as usize)
        })
        .ok()
        .flatten()
        .unwrap_or(132)
    })
}

/// Work list of the tensor-core forward kernel: tiles of BLOCK_M packed rows built from slices of
/// segments (several segments share a tile when their key ranges overlap), each tile's key range,
/// and the split of long tiles into parts when the launch would not fill the GPU.
#[derive(Debug, Clone, Default)]
pub struct FwdPlan {
    /// SLICE_WORDS u32 per slice: (segment, first packed row, rows).
    pub slices: Vec<u32>,
    /// WORK_WORDS u32 per cube column: (slice offset, slice count, klo, khi, slot or NONE).
    pub work: Vec<u32>,
    /// COMB_WORDS u32 per split tile: (slice offset, slice count, first slot, parts).
    pub comb: Vec<u32>,
    /// Partial slots per CUBE_POS_Y.
    pub n_slots: u32,
    /// Heads packed per row group (1, or the GQA group size).
    pub hp: u32,
    /// Tiles before splitting (for reports).
    pub n_tiles: usize,
    /// Packed rows (query rows x `hp`) of the longest segment: the most a tile holds of one
    /// segment (`forward::launch_forward` picks the decode variant from it).
    pub max_seg_rows: usize,
    /// Packed rows a tile holds (`BLOCK_M`; 8-32 for the decode kernel, `forward::tile_rows`).
    /// Partial slots keep `BLOCK_M` rows either way.
    pub rows: usize,
}

struct Tile {
    slices: Vec<[u32; 3]>,
    rows: usize,
    lo: u64,
    hi: u64,
}

impl Tile {
    fn len(&self) -> u64 {
        self.hi.saturating_sub(self.lo)
    }
}

impl FwdPlan {
    pub fn new(spec: &AttnSpec, opts: &FwdOptions) -> FwdPlan {
        FwdPlan::with_rows(spec, opts, BLOCK_M)
    }

    /// The plan with tiles of at most `bm` packed rows.
    pub fn with_rows(spec: &AttnSpec, opts: &FwdOptions, bm: usize) -> FwdPlan {
        let d = &spec.dims;
        let hp = if opts.pack_heads && d.heads_kv > 0 { d.group_size().max(1) } else { 1 };
        // Full tiles of one segment, and the remainders as packing candidates.
        let mut tiles: Vec<Tile> = Vec::new();
        let mut pieces: Vec<Tile> = Vec::new();
        for (i, s) in spec.segments.iter().enumerate() {
            let rows = s.q_len * hp;
            // keys from the first row's first to the last row's last (both bounds grow with the row)
            let range = |p0: usize, n: usize| -> (u64, u64) {
                let (lo, _) = spec.row_key_range(s, p0 / hp);
                let (_, hi) = spec.row_key_range(s, (p0 + n - 1) / hp);
                (lo.min(hi) as u64, hi as u64)
            };
            let mut p = 0;
            while p < rows {
                let n = bm.min(rows - p);
                let (lo, hi) = range(p, n);
                let t = Tile { slices: vec![[i as u32, p as u32, n as u32]], rows: n, lo, hi };
                if n == bm {
                    tiles.push(t);
                } else {
                    pieces.push(t);
                }
                p += n;
            }
        }
        // Pack remainders: longest ranges first; a piece joins the open tile when the rows fit and
        // the union of the key ranges is shorter than the two ranges apart (so keys are read once).
        pieces.sort_by(|a, b| b.hi.cmp(&a.hi).then(a.lo.cmp(&b.lo)));
        let mut open: Option<Tile> = None;
        for pc in pieces {
            match open.as_mut() {
                Some(t) if t.rows + pc.rows <= bm && {
                    let (lo, hi) = if t.len() == 0 {
                        (pc.lo, pc.hi)
                    } else if pc.len() == 0 {
                        (t.lo, t.hi)
                    } else {
                        (t.lo.min(pc.lo), t.hi.max(pc.hi))
                    };
                    hi - lo < t.len() + pc.len() || t.len() == 0 || pc.len() == 0
                } =>
                {
                    if t.len() == 0 {
                        t.lo = pc.lo;
                        t.hi = pc.hi;
                    } else if pc.len() > 0 {
                        t.lo = t.lo.min(pc.lo);
                        t.hi = t.hi.max(pc.hi);
                    }
                    t.rows += pc.rows;
                    t.slices.extend(pc.slices);
                }
                _ => {
                    if let Some(t) = open.take() {
                        tiles.push(t);
                    }
                    open = Some(pc);
                }
            }
        }
        if let Some(t) = open.take() {
            tiles.push(t);
        }

        let y = (d.heads_q / hp).max(1);
        let kt = |len: u64| len.div_ceil(BLOCK_N as u64);
        // Split when the launch has fewer cubes than a few per multiprocessor.
        let target = opts.split_waves.max(1) as usize * sm_count();
        let mut chunk = u64::MAX;
        if opts.split && tiles.len() * y < target {
            let total: u64 = tiles.iter().map(|t| kt(t.len())).sum();
            let want = target.div_ceil(y) as u64;
            chunk = fill_chunk(tiles.iter().map(|t| kt(t.len())), total.div_ceil(want).max(8), want);
        }
        let max_seg_rows = spec.segments.iter().map(|s| s.q_len * hp).max().unwrap_or(0);
        let mut plan = FwdPlan { hp: hp as u32, n_tiles: tiles.len(), max_seg_rows, rows: bm, ..Default::default() };
        // (cost, work entry)
        let mut items: Vec<(u64, [u32; WORK_WORDS])> = Vec::new();
        for t in &tiles {
            let off = (plan.slices.len() / SLICE_WORDS) as u32;
            for sl in &t.slices {
                plan.slices.extend_from_slice(sl);
            }
            let ns = t.slices.len() as u32;
            let n_kt = kt(t.len());
            if n_kt > chunk {
                let parts = n_kt.div_ceil(chunk);
                let per = n_kt.div_ceil(parts);
                let first = plan.n_slots;
                let mut used = 0u32;
                for i in 0..parts {
                    let a = t.lo + i * per * BLOCK_N as u64;
                    if a >= t.hi {
                        break;
                    }
                    let b = (a + per * BLOCK_N as u64).min(t.hi);
                    items.push((kt(b - a) + 1, [off, ns, a as u32, b as u32, first + used]));
                    used += 1;
                }
                plan.comb.extend_from_slice(&[off, ns, first, used]);
                plan.n_slots += used;
            } else {
                items.push((n_kt + 1, [off, ns, t.lo as u32, t.hi as u32, NONE]));
            }
        }
        // Longest first so the tail of the grid is short work (`order_by_cost`): the cubes are
        // items x slots, slots fastest, so a wave holds about `sm_count / y` items of a slot, each
        // `BLOCK_M / BLOCK_N` key tiles apart in a causal sequence. Strictly by cost, B4 H32 d128
        // causal 8K took 1.33x cuDNN's time (non-causal 1.08x).
        let span = (sm_count().div_ceil(y) * (bm / BLOCK_N)) as u64;
        order_by_cost(&mut items, opts.seq_waves, span, |x| x.0, |x| plan.slices[x.1[0] as usize * SLICE_WORDS]);
        plan.work = items.iter().flat_map(|(_, w)| *w).collect();
        let _ = COMB_WORDS;
        plan
    }

    pub fn n_work(&self) -> usize {
        self.work.len() / WORK_WORDS
    }

    pub fn n_comb(&self) -> usize {
        self.comb.len() / COMB_WORDS
    }

    /// Two u32 per partial slot: the first slot of its split tile and the tile's parts (what the
    /// decode kernel's in-launch merge reads; `comb` inverted).
    pub fn slot_parts(&self) -> Vec<u32> {
        let mut t = vec![0u32; 2 * self.n_slots as usize];
        for c in self.comb.chunks_exact(COMB_WORDS) {
            let (first, parts) = (c[2], c[3]);
            for s in first..first + parts {
                t[2 * s as usize] = first;
                t[2 * s as usize + 1] = parts;
            }
        }
        t
    }
}

/// The smallest split chunk from `chunk` on whose parts (a tile of `n` key tiles makes `ceil(n /
/// chunk)`) number at most `want`: each tile's parts rounded up can exceed the even share
/// (8 sequences of 256 key tiles in 33 columns: chunk 63 gives 5 parts each, 40 columns, and the
/// launch a second wave of 56 cubes; chunk 64 gives 4 each). Tiles without keys count one part.
pub(crate) fn fill_chunk(tiles: impl Iterator<Item = u64> + Clone, chunk: u64, want: u64) -> u64 {
    let parts = |c: u64| tiles.clone().map(|n| n.div_ceil(c).max(1)).sum::<u64>();
    let (mut lo, mut hi) = (chunk, tiles.clone().max().unwrap_or(chunk).max(chunk));
    if parts(lo) <= want {
        return lo;
    }
    // parts(hi) is the tile count, at most `want` where a split is asked for; parts(c) does not
    // grow with c
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if parts(mid) <= want {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// The cost width of the buckets whose items go sequence by sequence ([`order_by_cost`]): one
/// wave's span `span`, at most a quarter of the largest cost `max`, at least 1.
pub(crate) fn seq_bucket(span: u64, max: u64) -> u64 {
    span.min(max / 4).max(1)
}

/// Sorts a work list most expensive first (stable: deterministic), so the tail of a grid is short
/// work: the forward's items (`FwdPlan::new`), the dK/dV key tiles and the dQ pass's query tiles
/// (`backward`). With `seq_waves` (`CUBEATTN_WORK_ORDER=cost` turns it off), items of close cost go
/// sequence by sequence: costs in buckets of [`seq_bucket`]`(span, largest cost)`, where `span` is
/// what one wave's items of one head slot span in a causal sequence, and inside a bucket by `seq`,
/// then by cost. The cubes are items x head slots, heads fastest; strictly by cost a causal call
/// over several sequences runs their equal-cost tiles side by side, and the cubes of a wave each
/// read another sequence's K / V (Q / dO) instead of sharing one in L2. The cap at a quarter of the
/// largest cost keeps many short sequences (a wave spanning whole sequences) from starting the
/// last sequence's longest items last.
pub(crate) fn order_by_cost<T>(items: &mut [T], seq_waves: bool, span: u64, cost: impl Fn(&T) -> u64, seq: impl Fn(&T) -> u32) {
    if seq_waves {
        let width = seq_bucket(span, items.iter().map(&cost).max().unwrap_or(0));
        items.sort_by_key(|x| (std::cmp::Reverse(cost(x) / width), seq(x), std::cmp::Reverse(cost(x))));
    } else {
        items.sort_by_key(|x| std::cmp::Reverse(cost(x)));
    }
}

#[cfg(test)]
mod fwd_plan_tests {
    use super::*;

    #[test]
    fn the_split_chunk_keeps_the_parts_within_the_columns() {
        // 8 sequences of 256 key tiles in 33 columns: 63 would make 40 parts, 64 makes 32
        assert_eq!(fill_chunk([256u64; 8].into_iter(), 63, 33), 64);
        // already within: unchanged
        assert_eq!(fill_chunk([512u64].into_iter(), 16, 33), 16);
        // ragged tiles: the smallest chunk that fits, checked against every smaller one
        let ts = [1000u64, 7, 300, 0, 129];
        let c = fill_chunk(ts.into_iter(), 20, 12);
        let parts = |c: u64| ts.iter().map(|n| n.div_ceil(c).max(1)).sum::<u64>();
        assert!(parts(c) <= 12 && parts(c - 1) > 12, "chunk {c}");
    }
    use crate::spec::TensorMeta;

    fn grouped(hq: usize, hkv: usize, qr: &[[i32; 2]], kr: &[[i32; 2]], tq: usize, tk: usize, causal: bool) -> AttnSpec {
        AttnSpec::grouped(
            &TensorMeta::new(&[tq, hq, 128], DType::BF16),
            &TensorMeta::new(&[tk, hkv, 128], DType::BF16),
            &TensorMeta::new(&[tk, hkv, 128], DType::BF16),
            qr,
            kr,
            None,
            causal,
        )
        .unwrap()
    }

    /// Every (query, head) of every segment appears in exactly one tile, tiles hold at most
    /// BLOCK_M rows, each row's visible keys lie inside its tile's range, and split parts tile
    /// that range without gaps.
    fn check(spec: &AttnSpec, o: &FwdOptions) -> FwdPlan {
        check_rows(spec, o, BLOCK_M)
    }

    /// [`check`] of the plan with tiles of at most `bm` rows.
    fn check_rows(spec: &AttnSpec, o: &FwdOptions, bm: usize) -> FwdPlan {
        let p = FwdPlan::with_rows(spec, o, bm);
        assert_eq!(p.rows, bm);
        let hp = p.hp as usize;
        let d = &spec.dims;
        let mut seen = vec![0u8; d.total_q * hp];
        let slot_parts = p.slot_parts();
        assert_eq!(slot_parts.len(), 2 * p.n_slots as usize);
        // (slice offset) -> list of (klo, khi, slot)
        let mut ranges: std::collections::BTreeMap<u32, Vec<(u32, u32, u32)>> = Default::default();
        for w in p.work.chunks(WORK_WORDS) {
            ranges.entry(w[0]).or_default().push((w[2], w[3], w[4]));
            assert!(w[2] <= w[3]);
        }
        for (&off, rs) in &ranges {
            let mut rs = rs.clone();
            rs.sort();
            let (lo, hi) = (rs[0].0, rs.last().unwrap().1);
            for w in rs.windows(2) {
                assert_eq!(w[0].1, w[1].0, "split parts must be contiguous");
            }
            if rs.len() > 1 {
                assert!(rs.iter().all(|r| r.2 != NONE));
                // the decode kernel's merge: each part names its tile's first slot and part count,
                // and the parts take the slots from the first on
                let first = rs.iter().map(|r| r.2).min().unwrap();
                for r in &rs {
                    let s = r.2 as usize;
                    assert_eq!((slot_parts[2 * s], slot_parts[2 * s + 1]), (first, rs.len() as u32));
                    assert!(r.2 < first + rs.len() as u32);
                }
            }
            let ns = p.work.chunks(WORK_WORDS).find(|w| w[0] == off).unwrap()[1];
            let mut rows = 0;
            for i in 0..ns {
                let b = ((off + i) as usize) * SLICE_WORDS;
                let (seg, p0, n) = (p.slices[b] as usize, p.slices[b + 1] as usize, p.slices[b + 2] as usize);
                rows += n;
                let s = &spec.segments[seg];
                for pr in p0..p0 + n {
                    let qr = pr / hp;
                    assert!(qr < s.q_len);
                    let idx = (s.q_start + qr) * hp + pr % hp;
                    seen[idx] += 1;
                    let (a, z) = spec.row_key_range(s, qr);
                    if z > a {
                        assert!(a as u32 >= lo && z as u32 <= hi, "row keys [{a},{z}) outside tile [{lo},{hi})");
                    }
                }
            }
            assert!(rows <= bm);
        }
        for s in &spec.segments {
            for r in s.q_start..s.q_start + s.q_len {
                for h in 0..hp {
                    assert_eq!(seen[r * hp + h], 1, "row {r} head {h}");
                }
            }
        }
        p
    }

    #[test]
    fn decode_tiles_of_8_to_32_rows_cover_every_row() {
        // decode steps (one query row x a GQA group of 4 a sequence, 32 sequences) and a few-rows
        // grouped call of ragged key ranges, in the decode kernel's tiles (the rows rounded up to 8)
        let qr: Vec<[i32; 2]> = (0..32).map(|b| [b, b + 1]).collect();
        let kr: Vec<[i32; 2]> = (0..32).map(|b| [b * 2048, b * 2048 + 2048 - 7 * b]).collect();
        let spec = grouped(32, 8, &qr, &kr, 32, 32 * 2048, true);
        for o in all_opts() {
            for bm in [8, 16, 32] {
                let p = check_rows(&spec, &o, bm);
                if o.pack_heads {
                    assert!(p.n_tiles >= 128 / bm, "128 packed rows need {} tiles of {bm}", 128 / bm);
                }
            }
        }
        let spec = grouped(8, 2, &[[0, 3], [3, 5], [5, 13]], &[[0, 700], [100, 900], [0, 64]], 13, 900, false);
        for o in all_opts() {
            for bm in [8, 16, 24, 32] {
                check_rows(&spec, &o, bm);
            }
        }
    }

    fn all_opts() -> Vec<FwdOptions> {
        let mut v = Vec::new();
        for pack_heads in [false, true] {
            for split in [false, true] {
                v.push(FwdOptions { pack_heads, split, split_waves: 4, ..FwdOptions::defaults() });
            }
        }
        v
    }

    /// Sliding windows: every row's window keys inside its tile's range, and the tile ranges
    /// narrowed to the band (a row far down a long sequence does not read keys from the start).
    #[test]
    fn window_tiles_cover_exactly_the_band() {
        let qr = [[0, 1], [1, 64], [64, 194], [194, 451]];
        let kr = [[0, 1], [1, 81], [81, 211], [211, 511]];
        for (l, r, causal) in [(70i64, 0i64, true), (5, 130, false), (0, 0, false), (300, -1, false), (-1, 3, false), (4, 3, false)] {
            let spec = grouped(8, 2, &[[0, 1000], [1000, 1001]], &[[0, 1000], [0, 1000]], 1001, 1000, causal)
                .with_window(l, r)
                .unwrap();
            for o in all_opts() {
                check(&grouped(4, 2, &qr, &kr, 451, 511, causal).with_window(l, r).unwrap(), &o);
            }
            for o in all_opts() {
                let p = check(&spec, &o);
                if l >= 0 && (r >= 0 || causal) {
                    let widest = p.work.chunks(WORK_WORDS).map(|w| w[3] - w[2]).max().unwrap();
                    // a tile holds at most BLOCK_M query rows
                    assert!(widest as i64 <= l + r.max(0) + BLOCK_M as i64, "({l},{r}): a tile spans {widest} keys");
                }
            }
        }
    }

    /// Causal calls over several equal sequences (MHA, heads fastest): a wave's items of one slot
    /// (`sm_count / y` of them) come from one sequence, the buckets go from the costliest down,
    /// and the strict order (`seq_waves` off) lists the sequences' equal-cost tiles side by side.
    #[test]
    fn causal_items_of_close_cost_go_sequence_by_sequence() {
        let (b, s) = (4i32, 8192i32);
        let r: Vec<[i32; 2]> = (0..b).map(|i| [i * s, (i + 1) * s]).collect();
        let spec = grouped(32, 32, &r, &r, (b * s) as usize, (b * s) as usize, true);
        let seq_of = |p: &FwdPlan| -> Vec<(u32, u32)> {
            p.work.chunks(WORK_WORDS).map(|w| (p.slices[w[0] as usize * SLICE_WORDS], w[3] - w[2])).collect()
        };
        let o = FwdOptions { split: false, ..FwdOptions::defaults() };
        let p = check(&spec, &o);
        let items = seq_of(&p);
        let per_wave = sm_count().div_ceil(32);
        assert!(items[..per_wave].iter().all(|&(q, _)| q == items[0].0), "{:?}", &items[..per_wave]);
        // costs non-increasing across buckets: never more than one bucket's span above a predecessor
        let width = (per_wave * (BLOCK_M / BLOCK_N) * BLOCK_N) as u32;
        for w in items.windows(2) {
            assert!(w[1].1 < w[0].1 + width, "{w:?}");
        }
        assert_eq!(items.iter().map(|x| x.1).max(), Some(items[0].1));
        let strict = seq_of(&check(&spec, &FwdOptions { seq_waves: false, ..o }));
        assert_ne!(strict[0].0, strict[1].0);
        assert!(strict.windows(2).all(|w| w[1].1 <= w[0].1));
    }

    /// Many short causal sequences with few slots (GQA packed): one wave spans whole sequences,
    /// and the quarter-of-the-largest-cost cap keeps every sequence's longest items early (no
    /// sequence's costliest tile starts behind the others' cheap ones).
    #[test]
    fn short_sequences_keep_their_longest_items_early() {
        let (b, s) = (16i32, 2048i32);
        let r: Vec<[i32; 2]> = (0..b).map(|i| [i * s, (i + 1) * s]).collect();
        let spec = grouped(32, 8, &r, &r, (b * s) as usize, (b * s) as usize, true);
        let p = check(&spec, &FwdOptions { split: false, ..FwdOptions::defaults() });
        let items: Vec<(u32, u32)> = p.work.chunks(WORK_WORDS).map(|w| (p.slices[w[0] as usize * SLICE_WORDS], w[3] - w[2])).collect();
        let longest = items.iter().map(|x| x.1).max().unwrap();
        let last_long = items.iter().rposition(|x| x.1 == longest).unwrap();
        assert!(last_long < items.len() / 4, "a longest item at {last_long} of {}", items.len());
        assert_eq!(seq_bucket(34, 33), 8);
        assert_eq!(seq_bucket(10, 129), 10);
        assert_eq!(seq_bucket(10, 2), 1);
    }

    #[test]
    fn shared_prefix_groups_share_tiles() {
        let qr: Vec<[i32; 2]> = (0..32).map(|g| [8 * g, 8 * g + 8]).collect();
        let kr: Vec<[i32; 2]> = (0..32).map(|g| [0, 32768 - 256 * g]).collect();
        let spec = grouped(32, 8, &qr, &kr, 256, 32768, false);
        for o in all_opts() {
            let p = check(&spec, &o);
            if o.pack_heads {
                // 8 queries x 4 heads = 32 rows per group: 4 groups per tile.
                assert_eq!(p.n_tiles, 8);
            }
            if o.split {
                assert!(p.n_work() * (32 / p.hp as usize) >= 4 * 132 / 2, "{} items", p.n_work());
            }
        }
    }

    #[test]
    fn zigzag_and_varlen_plans_cover_every_row() {
        let c = 4096;
        let spec = grouped(32, 8, &[[0, c], [c, 2 * c]], &[[0, c], [0, 16 * c]], 2 * c as usize, 16 * c as usize, true);
        for o in all_opts() {
            check(&spec, &o);
        }
        // Many small groups, 1-token and empty groups, uncovered rows, causal and not.
        let qr = [[0, 1], [1, 1], [1, 9], [9, 40], [45, 46], [46, 300], [300, 301]];
        let kr = [[0, 5], [3, 3], [0, 700], [100, 900], [5, 6], [0, 1000], [999, 1000]];
        for causal in [false, true] {
            let spec = grouped(32, 8, &qr, &kr, 310, 1000, causal);
            for o in all_opts() {
                check(&spec, &o);
            }
        }
    }
}

