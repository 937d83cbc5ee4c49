//! Block-sparse attention's key set: a block index saying, per (sequence, head, query block),
//! which key blocks are attended; everything else is skipped. A spec takes one through
//! [`crate::spec::AttnSpec::with_block_index`] (its key set becomes
//! [`crate::spec::KeySet::BlockSparse`]); the block-sparse backends read it through
//! [`crate::spec::SparseView`]. This module knows the index alone, not the spec.
//!
//! # Block-size contract
//! Sequence `b`'s query rows are cut into blocks of `q_block` rows and its keys into blocks of
//! `k_block` keys, both counted from the sequence's own start; the last block of each may be
//! partial. `block_index` is int32 `[batch, heads, q_blocks, top_k]` with
//! `q_blocks = ceil(max_seqlen_q / q_block)`; entry `[b, h, qb, i]` is a key block of sequence `b`
//! (`0 <= x < ceil(k_len_b / k_block)`) or `-1` (unused slot). Entries may come in any order;
//! a block may appear once per row. `heads` is `heads_q`, or `heads_kv` to share one pattern across
//! a GQA group. Query blocks past a shorter sequence's end are validated but never used.
//! Defaults: `q_block` = [`DEFAULT_Q_BLOCK`] = 64, `k_block` = [`DEFAULT_K_BLOCK`] = 128 (seed
//! 004's CTA_Q / CTA_K); backends may accept only some sizes (the CPU accepts any >= 1).
//!
//! Token mask: query row `r` of sequence `b` sees key `j` when `j`'s block is listed for `r`'s
//! block and (with `causal`) `j <= k_len - q_len + r` (bottom-right, as in dense attention). A row
//! that sees no key gets a zero output and LSE +inf.
//!
//! Optional INT8 QK^T ([`QuantGran`]): Q and (smoothed) K are quantised symmetrically to int8
//! with one f32 scale per group of rows; P.V stays in the input dtype, or with
//! [`Int8Qk::pv_fp8`] runs in FP8 e4m3 (V per channel, P scaled by [`FP8_P_SCALE`]). K smoothing
//! subtracts the mean of K over the sequence (per kv head and channel), which shifts every score
//! of a row by the same constant: the softmax is unchanged and the LSE is corrected by
//! `scale * q . mean`.

use rayon::prelude::*;

use crate::error::{invalid, Error, Result};

/// Query rows per block unless told otherwise (seed 004's CTA_Q).
pub const DEFAULT_Q_BLOCK: usize = 64;
/// Keys per block unless told otherwise (seed 004's CTA_K).
pub const DEFAULT_K_BLOCK: usize = 128;

/// Scale granularity of the INT8 QK^T option, defined on the tile layout of the CUDA kernel
/// (`flash_fwd_mma2` with `int8`: each warp owns 32 query rows as two m16 blocks, keys come in
/// tiles of 64 inside a key block, `mma.sync.m16n8k32` fragments). Query rows are counted from
/// the start of their query block (`q_block` rows), keys from the start of their key block
/// (`k_block` keys), per head; a group never crosses a block.
/// - `PerBlock`: one Q scale per query block, one K scale per key block;
/// - `PerWarp`: one Q scale per 32 rows (what one warp owns when the index is per q head), one K
///   scale per 64-key tile;
/// - `PerThread`: what one thread's accumulator registers cover: Q rows `r` and `r + 8` of each
///   16-row m16 block share a scale (8 per 16 rows: thread `t` holds rows `t / 4` and `t / 4 + 8`),
///   and inside a 64-key tile the keys with the same `(j mod 8) / 2` share one (4 per tile: thread
///   `t` holds columns `2 (t mod 4)` and `2 (t mod 4) + 1` of every n8 block).
///
/// Every rule is [`GroupRule`]: a row at offset `o` in its block belongs to chunk `o / chunk`
/// and, inside the chunk, to class `(o mod chunk mod period) / width`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantGran {
    PerBlock,
    PerWarp,
    PerThread,
}

/// Which rows of a block share a scale: those in the same `chunk`-row chunk whose offsets in the
/// chunk agree in `(offset mod period) / width`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupRule {
    pub chunk: usize,
    pub period: usize,
    pub width: usize,
}

impl GroupRule {
    /// Group id of offset `o` inside its block (unique within the block).
    pub fn group(self, o: usize) -> usize {
        (o / self.chunk) * self.period + ((o % self.chunk) % self.period) / self.width
    }
}

/// Query rows per warp in the CUDA kernel (two m16 blocks).
pub const WARP_ROWS: usize = 32;
/// Keys per key tile in the CUDA kernel.
pub const TILE_KEYS: usize = 64;

impl QuantGran {
    pub fn parse(s: &str) -> Result<QuantGran> {
        match s {
            "per_block" => Ok(QuantGran::PerBlock),
            "per_warp" => Ok(QuantGran::PerWarp),
            "per_thread" => Ok(QuantGran::PerThread),
            _ => Err(invalid("quant_gran", format!("must be \"per_block\", \"per_warp\" or \"per_thread\", got {s:?}"))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            QuantGran::PerBlock => "per_block",
            QuantGran::PerWarp => "per_warp",
            QuantGran::PerThread => "per_thread",
        }
    }
    /// The grouping of the query rows of a `q_block`-row block.
    pub fn q_rule(self, q_block: usize) -> GroupRule {
        match self {
            QuantGran::PerBlock => GroupRule { chunk: q_block, period: q_block, width: q_block },
            QuantGran::PerWarp => GroupRule { chunk: WARP_ROWS, period: WARP_ROWS, width: WARP_ROWS },
            QuantGran::PerThread => GroupRule { chunk: 16, period: 8, width: 1 },
        }
    }
    /// The grouping of the keys of a `k_block`-key block.
    pub fn k_rule(self, k_block: usize) -> GroupRule {
        match self {
            QuantGran::PerBlock => GroupRule { chunk: k_block, period: k_block, width: k_block },
            QuantGran::PerWarp => GroupRule { chunk: TILE_KEYS, period: TILE_KEYS, width: TILE_KEYS },
            QuantGran::PerThread => GroupRule { chunk: TILE_KEYS, period: 8, width: 2 },
        }
    }
    /// Scale group of query row `r` (counted from the sequence start), unique per sequence.
    pub fn q_group(self, r: usize, q_block: usize) -> usize {
        (r / q_block) * q_block.max(16) + self.q_rule(q_block).group(r % q_block)
    }
    /// Scale group of key `j` (counted from the sequence start), unique per sequence.
    pub fn k_group(self, j: usize, k_block: usize) -> usize {
        (j / k_block) * k_block.max(64) + self.k_rule(k_block).group(j % k_block)
    }
}

/// The INT8 QK^T option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int8Qk {
    pub gran: QuantGran,
    /// Subtract K's per-sequence mean before quantising.
    pub smooth_k: bool,
    /// P.V in FP8 e4m3 (SageAttention2): V quantised per (sequence, kv head, channel) with
    /// scale `amax / 448`, P scaled by 256 and rounded to e4m3 ([`FP8_P_SCALE`]); else P.V in
    /// the input's f16/bf16 from the original V. The exact rule: `backend::cpu::sparse`'s module
    /// docs (the CPU emulation) and docs/sparse.md.
    pub pv_fp8: bool,
}

/// P is multiplied by this before its e4m3 rounding (P <= 1, so P * 256 <= 448; the row sums
/// carry the same factor, so it cancels in O; the LSE is that of the unscaled sums: the factor
/// does not reach it).
pub const FP8_P_SCALE: f32 = 256.0;

/// A validated block index in compressed form: for row `(b, h, qb)` (row id
/// `(b * heads + h) * q_blocks + qb`) the kept key blocks `blocks[offsets[id]..offsets[id + 1]]`,
/// ascending, without duplicates or `-1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockIndex {
    pub batch: usize,
    pub heads: usize,
    pub q_blocks: usize,
    pub top_k: usize,
    pub offsets: Vec<usize>,
    pub blocks: Vec<u32>,
}

impl BlockIndex {
    fn row_id(&self, b: usize, h: usize, qb: usize) -> usize {
        (b * self.heads + h) * self.q_blocks + qb
    }
    /// Kept key blocks of `(b, h, qb)`, ascending.
    pub fn kept(&self, b: usize, h: usize, qb: usize) -> &[u32] {
        let id = self.row_id(b, h, qb);
        &self.blocks[self.offsets[id]..self.offsets[id + 1]]
    }
    /// Number of kept (query block, key block) pairs.
    pub fn kept_total(&self) -> usize {
        self.blocks.len()
    }

    /// The transposed index (per key block of `k_blocks` per sequence slot, the query blocks
    /// listing it), built once on the host in O(kept blocks).
    pub fn transposed(&self, k_blocks: usize) -> TransposedIndex {
        let ix = self;
        let kbn = k_blocks;
        let cells = ix.batch * ix.heads * kbn;
        let mut counts = vec![0usize; cells + 1];
        for b in 0..ix.batch {
            for h in 0..ix.heads {
                for qb in 0..ix.q_blocks {
                    for &kb in ix.kept(b, h, qb) {
                        counts[(b * ix.heads + h) * kbn + kb as usize + 1] += 1;
                    }
                }
            }
        }
        for i in 0..cells {
            counts[i + 1] += counts[i];
        }
        let offsets = counts.clone();
        let mut fill = counts;
        let mut q_blocks = vec![0u32; ix.kept_total()];
        // query blocks visited in ascending order, so every list comes out ascending
        for b in 0..ix.batch {
            for h in 0..ix.heads {
                for qb in 0..ix.q_blocks {
                    for &kb in ix.kept(b, h, qb) {
                        let c = (b * ix.heads + h) * kbn + kb as usize;
                        q_blocks[fill[c]] = qb as u32;
                        fill[c] += 1;
                    }
                }
            }
        }
        TransposedIndex { k_blocks: kbn, heads: ix.heads, offsets, q_blocks }
    }
}

/// Per `(b, h, key block)` the query blocks listing it, ascending (the backward's view).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransposedIndex {
    /// Key blocks per sequence slot (the longest sequence's count).
    pub k_blocks: usize,
    pub heads: usize,
    pub offsets: Vec<usize>,
    pub q_blocks: Vec<u32>,
}

impl TransposedIndex {
    /// Query blocks of sequence `b`, index head `h` that list key block `kb`.
    pub fn listing(&self, b: usize, h: usize, kb: usize) -> &[u32] {
        let id = (b * self.heads + h) * self.k_blocks + kb;
        &self.q_blocks[self.offsets[id]..self.offsets[id + 1]]
    }
}

/// A validated block index with its block sizes and options: the block-sparse key set of a spec.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockSparse {
    pub q_block: usize,
    pub k_block: usize,
    pub index: BlockIndex,
    /// INT8 QK^T (forward only); `None` = exact.
    pub int8: Option<Int8Qk>,
    /// 128-bit hash of the block sizes and the index as validated ([`BlockSparse::fingerprint`]).
    fingerprint: [u64; 2],
}

/// What a block index is validated against: the call's heads, its longest query sequence and
/// the key count of each sequence (one per sequence: the index's batch).
#[derive(Debug, Clone, Copy)]
pub struct IndexBounds<'a> {
    pub heads_q: usize,
    pub heads_kv: usize,
    pub max_seqlen_q: usize,
    pub k_lens: &'a [usize],
}

/// Mixes one word into `h` (FNV-1a style over words with odd multiplier `m`).
fn mix(h: &mut u64, x: u64, m: u64) {
    *h = (*h ^ x).wrapping_mul(m);
}

/// Words per independently hashed chunk of the index (fixed, so the fingerprint does not depend
/// on the thread count).
const HASH_CHUNK: usize = 1 << 14;
/// Rows of `block_index` validated per task.
const ROW_CHUNK: usize = 1024;

/// Two independent 64-bit hashes of `words`.
fn hash_words(words: impl Iterator<Item = u64> + Clone) -> [u64; 2] {
    let one = |seed: u64, m: u64| {
        let mut h = seed;
        for x in words.clone() {
            mix(&mut h, x, m);
        }
        h
    };
    [one(0xcbf2_9ce4_8422_2325, 0x0100_0000_01b3), one(0x9e37_79b9_7f4a_7c15, 0xff51_afd7_ed55_8ccd)]
}

/// Two independent 64-bit hashes of the block sizes and the index (offsets and block ids): the
/// offsets and blocks are hashed in chunks of [`HASH_CHUNK`] words in parallel, then the chunk
/// hashes in order with the sizes.
fn index_fingerprint(q_block: usize, k_block: usize, ix: &BlockIndex) -> [u64; 2] {
    let mut parts: Vec<[u64; 2]> =
        ix.offsets.par_chunks(HASH_CHUNK).map(|c| hash_words(c.iter().map(|&o| o as u64))).collect();
    // block ids two to a word (the count of blocks is hashed below: a trailing odd one is unambiguous)
    parts.par_extend(ix.blocks.par_chunks(2 * HASH_CHUNK).map(|c| {
        hash_words(c.chunks(2).map(|p| p[0] as u64 | (*p.get(1).unwrap_or(&u32::MAX) as u64) << 32))
    }));
    let head = [q_block, k_block, ix.batch, ix.heads, ix.q_blocks, ix.offsets.len(), ix.blocks.len()].map(|x| x as u64);
    let words = head.into_iter().chain(parts.iter().flat_map(|p| *p));
    hash_words(words)
}

/// Appends the kept key blocks of one `block_index` row (`slots`), ascending, to `out`; false
/// (with `out` restored) if a slot is negative other than -1, past the last key block `kbn`, or
/// a duplicate. `seen`: a bitmap of at least `kbn` bits, all clear (and left clear).
fn compress_row(slots: &[i32], kbn: usize, seen: &mut [u64], out: &mut Vec<u32>) -> bool {
    let start = out.len();
    let mut ok = true;
    for &x in slots {
        if x == -1 {
            continue;
        }
        if x < 0 || x as usize >= kbn || seen[x as usize / 64] & (1u64 << (x % 64)) != 0 {
            ok = false;
            break;
        }
        seen[x as usize / 64] |= 1u64 << (x % 64);
        out.push(x as u32);
    }
    let words = kbn.div_ceil(64);
    if ok && out.len() - start > 1 && !out[start..].is_sorted() {
        if words <= 2 * slots.len() {
            // counting sort through the bitmap (clears it)
            out.truncate(start);
            for (w, bits) in seen[..words].iter_mut().enumerate() {
                let mut m = *bits;
                while m != 0 {
                    out.push((w * 64) as u32 + m.trailing_zeros());
                    m &= m - 1;
                }
                *bits = 0;
            }
            return true;
        }
        out[start..].sort_unstable();
    }
    for &x in &out[start..] {
        seen[x as usize / 64] = 0;
    }
    if !ok {
        out.truncate(start);
    }
    ok
}

/// Blocks of `block` covering `len` (the last one may be partial).
pub fn block_count(len: usize, block: usize) -> usize {
    len.div_ceil(block)
}

/// The error for the first bad slot of one `block_index` row (in slot order): a negative value
/// other than -1, a block past the sequence's last, or a duplicate.
fn first_bad_slot(slots: &[i32], b: usize, h: usize, qb: usize, kbn: usize, k_len: usize, k_block: usize) -> Error {
    for (i, &x) in slots.iter().enumerate() {
        if x == -1 {
            continue;
        }
        if x < 0 {
            return invalid("block_index", format!("block_index[{b}, {h}, {qb}, {i}] = {x} is negative (only -1 marks an unused slot)"));
        }
        if x as usize >= kbn {
            return invalid(
                "block_index",
                format!("block_index[{b}, {h}, {qb}, {i}] = {x} but there are {kbn} key blocks (sequence {b} has {k_len} keys, k_block {k_block})"),
            );
        }
        if let Some(j) = slots[..i].iter().position(|&y| y == x) {
            return invalid("block_index", format!("block_index[{b}, {h}, {qb}, {i}] = {x} duplicates block_index[{b}, {h}, {qb}, {j}]"));
        }
    }
    invalid("block_index", format!("row [{b}, {h}, {qb}] is invalid"))
}

impl BlockSparse {
    /// Validates `block_index` (flat, C order, shape `index_shape`) against `bounds` (the
    /// sequences and heads of a varlen call; batched calls are varlen with equal lengths).
    pub fn new(
        block_index: &[i32],
        index_shape: &[usize],
        q_block: usize,
        k_block: usize,
        int8: Option<Int8Qk>,
        bounds: IndexBounds,
    ) -> Result<BlockSparse> {
        let batch = bounds.k_lens.len();
        if q_block == 0 {
            return Err(invalid("q_block", "must be at least 1, got 0"));
        }
        if k_block == 0 {
            return Err(invalid("k_block", "must be at least 1, got 0"));
        }
        let q_blocks = block_count(bounds.max_seqlen_q, q_block);
        if index_shape.len() != 4 {
            return Err(invalid(
                "block_index",
                format!("expected rank 4 [batch, heads, q_blocks, top_k], got shape {index_shape:?}"),
            ));
        }
        let (ib, ih, iq, top_k) = (index_shape[0], index_shape[1], index_shape[2], index_shape[3]);
        if ib != batch {
            return Err(invalid("block_index", format!("has batch {ib} (shape {index_shape:?}) but the call has {batch} sequences")));
        }
        if ih != bounds.heads_q && ih != bounds.heads_kv {
            return Err(invalid(
                "block_index",
                format!("has {ih} heads (shape {index_shape:?}); expected heads_q ({}) or heads_kv ({})", bounds.heads_q, bounds.heads_kv),
            ));
        }
        if iq != q_blocks {
            return Err(invalid(
                "block_index",
                format!(
                    "has {iq} query blocks (shape {index_shape:?}); max_seqlen_q {} in blocks of q_block {q_block} gives {q_blocks}",
                    bounds.max_seqlen_q
                ),
            ));
        }
        let n = ib * ih * iq * top_k;
        if block_index.len() != n {
            return Err(invalid("block_index", format!("has {} elements, its shape {index_shape:?} needs {n}", block_index.len())));
        }
        // rows in chunks of ROW_CHUNK on the thread pool: (kept blocks, per-row counts) or the
        // first bad row of the chunk
        let rows = ib * ih * iq;
        let kbns: Vec<usize> = bounds.k_lens.iter().map(|&n| block_count(n, k_block)).collect();
        let words = kbns.iter().copied().max().unwrap_or(0).div_ceil(64);
        let chunks: Vec<std::result::Result<(Vec<u32>, Vec<u32>), usize>> = (0..rows.div_ceil(ROW_CHUNK))
            .into_par_iter()
            .map(|c| {
                let (r0, r1) = (c * ROW_CHUNK, ((c + 1) * ROW_CHUNK).min(rows));
                let mut seen = vec![0u64; words];
                let mut blocks = Vec::with_capacity((r1 - r0) * top_k);
                let mut counts = Vec::with_capacity(r1 - r0);
                for r in r0..r1 {
                    let before = blocks.len();
                    if !compress_row(&block_index[r * top_k..(r + 1) * top_k], kbns[r / (ih * iq)], &mut seen, &mut blocks) {
                        return Err(r);
                    }
                    counts.push((blocks.len() - before) as u32);
                }
                Ok((blocks, counts))
            })
            .collect();
        let mut offsets = Vec::with_capacity(rows + 1);
        offsets.push(0);
        let mut blocks: Vec<u32> = Vec::with_capacity(chunks.iter().map(|c| c.as_ref().map_or(0, |c| c.0.len())).sum());
        for chunk in chunks {
            match chunk {
                Ok((kept, counts)) => {
                    blocks.extend_from_slice(&kept);
                    for n in counts {
                        offsets.push(offsets[offsets.len() - 1] + n as usize);
                    }
                }
                Err(r) => {
                    let (b, h, qb) = (r / (ih * iq), r / iq % ih, r % iq);
                    let slots = &block_index[r * top_k..(r + 1) * top_k];
                    return Err(first_bad_slot(slots, b, h, qb, kbns[b], bounds.k_lens[b], k_block));
                }
            }
        }
        let index = BlockIndex { batch: ib, heads: ih, q_blocks: iq, top_k, offsets, blocks };
        let fingerprint = index_fingerprint(q_block, k_block, &index);
        Ok(BlockSparse { q_block, k_block, index, int8, fingerprint })
    }

    /// 128-bit hash of the block sizes and the index, computed once at validation: what a
    /// device plan of this spec depends on besides the dense shape (a key per call in O(1)).
    pub fn fingerprint(&self) -> [u64; 2] {
        self.fingerprint
    }
}

/// FlexAttention's `BlockMask` fields -> a `block_index` (flat, `[B, H, q_blocks, top_k]` with
/// `top_k` = the total slots, -1 padded): row `(b, h, qb)` keeps `kv_indices[b, h, qb, :kv_num_blocks[b, h, qb]]`
/// plus, when given, `full_kv_indices[b, h, qb, :full_kv_num_blocks[b, h, qb]]` (FlexAttention
/// splits kept blocks into partial and full ones; both are attended in full here). Returns the
/// flat index and its shape. Value checks (range, duplicates) happen in [`BlockSparse::new`].
pub fn block_index_from_flex(
    kv_num_blocks: &[i32],
    num_shape: &[usize],
    kv_indices: &[i32],
    idx_shape: &[usize],
    full: Option<(&[i32], &[usize], &[i32], &[usize])>,
) -> Result<(Vec<i32>, Vec<usize>)> {
    fn check(num_name: &'static str, num: &[i32], ns: &[usize], idx_name: &'static str, idx: &[i32], is: &[usize]) -> Result<()> {
        if ns.len() != 3 {
            return Err(invalid(num_name, format!("expected rank 3 [batch, heads, q_blocks], got shape {ns:?}")));
        }
        if is.len() != 4 || is[..3] != ns[..] {
            return Err(invalid(idx_name, format!("expected shape [{}, {}, {}, max_blocks] to match {num_name}, got {is:?}", ns[0], ns[1], ns[2])));
        }
        if num.len() != ns.iter().product::<usize>() || idx.len() != is.iter().product::<usize>() {
            return Err(invalid(idx_name, "element count does not match the shape"));
        }
        let m = is[3];
        for (i, &c) in num.iter().enumerate() {
            if c < 0 || c as usize > m {
                let (b, h, q) = (i / (ns[1] * ns[2]), (i / ns[2]) % ns[1], i % ns[2]);
                return Err(invalid(num_name, format!("{num_name}[{b}, {h}, {q}] = {c} must lie in 0..={m} (the last dimension of {idx_name})")));
            }
        }
        Ok(())
    }
    check("kv_num_blocks", kv_num_blocks, num_shape, "kv_indices", kv_indices, idx_shape)?;
    let m1 = idx_shape[3];
    let m2 = match full {
        Some((fnum, fns, fidx, fis)) => {
            check("full_kv_num_blocks", fnum, fns, "full_kv_indices", fidx, fis)?;
            if fns != num_shape {
                return Err(invalid("full_kv_num_blocks", format!("shape {fns:?} differs from kv_num_blocks' {num_shape:?}")));
            }
            fis[3]
        }
        None => 0,
    };
    let rows = kv_num_blocks.len();
    let top_k = m1 + m2;
    let mut out = vec![-1i32; rows * top_k];
    for r in 0..rows {
        let dst = &mut out[r * top_k..(r + 1) * top_k];
        let n1 = kv_num_blocks[r] as usize;
        dst[..n1].copy_from_slice(&kv_indices[r * m1..r * m1 + n1]);
        if let Some((fnum, _, fidx, _)) = full {
            let n2 = fnum[r] as usize;
            dst[n1..n1 + n2].copy_from_slice(&fidx[r * m2..r * m2 + n2]);
        }
    }
    let mut shape = num_shape.to_vec();
    shape.push(top_k);
    Ok((out, shape))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Validates `ix` (shape `shape`) for sequences of (query, key) lengths `lens` and `hq` /
    /// `hkv` heads.
    fn check(lens: &[(usize, usize)], hq: usize, hkv: usize, ix: &[i32], shape: &[usize], q_block: usize, k_block: usize) -> Result<BlockSparse> {
        let k_lens: Vec<usize> = lens.iter().map(|l| l.1).collect();
        let max_seqlen_q = lens.iter().map(|l| l.0).max().unwrap();
        BlockSparse::new(ix, shape, q_block, k_block, None, IndexBounds { heads_q: hq, heads_kv: hkv, max_seqlen_q, k_lens: &k_lens })
    }

    fn err_of(r: Result<BlockSparse>) -> String {
        match r {
            Err(crate::Error::InvalidArgument { arg, msg }) => format!("{arg}: {msg}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn validation_names_the_first_bad_position() {
        // 1 sequence, 130 queries (3 blocks of 64), 300 keys (3 blocks of 128)
        let a = [(130, 300)];
        let shape = [1, 2, 3, 2];
        let mut ix = vec![0, 1, 2, -1, 1, 0, 0, 2, -1, -1, 2, 1];
        assert!(check(&a, 2, 1, &ix, &shape, 64, 128).is_ok());
        ix[5] = 3;
        let e = err_of(check(&a, 2, 1, &ix, &shape, 64, 128));
        assert!(e.contains("block_index[0, 0, 2, 1] = 3 but there are 3 key blocks"), "{e}");
        ix[5] = -2;
        let e = err_of(check(&a, 2, 1, &ix, &shape, 64, 128));
        assert!(e.contains("block_index[0, 0, 2, 1] = -2 is negative"), "{e}");
        ix[5] = 0;
        ix[11] = 2;
        let e = err_of(check(&a, 2, 1, &ix, &shape, 64, 128));
        assert!(e.contains("block_index[0, 1, 2, 1] = 2 duplicates block_index[0, 1, 2, 0]"), "{e}");
        let e = err_of(check(&a, 2, 1, &ix[..8], &[1, 2, 2, 2], 64, 128));
        assert!(e.starts_with("block_index") && e.contains("query blocks"), "{e}");
        let e = err_of(check(&a, 2, 1, &ix, &[1, 3, 2, 2], 64, 128));
        assert!(e.contains("heads"), "{e}");
        let e = err_of(check(&a, 2, 1, &ix, &shape, 0, 128));
        assert!(e.starts_with("q_block"), "{e}");
    }

    /// compress_row against sort + dedup on random rows, through both of its orderings (the
    /// bitmap pass for few key blocks, the sort for many) and across validation chunks.
    #[test]
    fn rows_compress_like_sort_and_dedup() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        };
        for kbn in [1usize, 5, 64, 65, 200, 5000] {
            let words = kbn.div_ceil(64);
            let mut seen = vec![0u64; words];
            for _ in 0..300 {
                let top_k = 1 + next(20);
                let mut pool: Vec<i32> = (0..kbn as i32).collect();
                let mut slots = Vec::new();
                for _ in 0..top_k {
                    if next(4) == 0 || pool.is_empty() {
                        slots.push(-1);
                    } else {
                        slots.push(pool.swap_remove(next(pool.len())));
                    }
                }
                let mut want: Vec<u32> = slots.iter().filter(|&&v| v >= 0).map(|&v| v as u32).collect();
                want.sort_unstable();
                let mut out = vec![7u32];
                assert!(compress_row(&slots, kbn, &mut seen, &mut out), "{slots:?}");
                assert_eq!(&out[1..], &want[..], "kbn {kbn} slots {slots:?}");
                assert!(seen.iter().all(|&w| w == 0));
                // a duplicate, a block past the end, a negative other than -1: rejected, out kept
                for bad in [slots.iter().copied().find(|&v| v >= 0), Some(kbn as i32), Some(-3)].into_iter().flatten() {
                    let mut row = slots.clone();
                    row.insert(next(row.len() + 1), bad);
                    if bad >= 0 && bad < kbn as i32 && row.iter().filter(|&&v| v == bad).count() < 2 {
                        continue;
                    }
                    let mut out = vec![7u32];
                    assert!(!compress_row(&row, kbn, &mut seen, &mut out), "{row:?}");
                    assert_eq!(out, [7]);
                    assert!(seen.iter().all(|&w| w == 0));
                }
            }
        }
        // the first bad row is reported when many chunks are validated in parallel
        let a = [(64 * 3000, 128 * 4)];
        let mut ix: Vec<i32> = (0..3000).flat_map(|r| [(r % 4) as i32, ((r + 1) % 4) as i32]).collect();
        assert!(check(&a, 1, 1, &ix, &[1, 1, 3000, 2], 64, 128).is_ok());
        ix[2 * 2900] = 9;
        ix[2 * 2500 + 1] = ix[2 * 2500];
        let e = err_of(check(&a, 1, 1, &ix, &[1, 1, 3000, 2], 64, 128));
        assert!(e.contains("block_index[0, 0, 2500, 1]") && e.contains("duplicates"), "{e}");
    }

    #[test]
    fn index_is_sorted_and_transposed() {
        // batch 2, 1 head, 2 query blocks, top_k 2; sequence 1 has 1 key block
        let ix = vec![1, 0, -1, 1, 0, -1, -1, -1];
        let s = check(&[(128, 256), (64, 100)], 1, 1, &ix, &[2, 1, 2, 2], 64, 128).unwrap();
        assert_eq!(s.index.kept(0, 0, 0), &[0, 1]);
        assert_eq!(s.index.kept(0, 0, 1), &[1]);
        assert_eq!(s.index.kept(1, 0, 0), &[0]);
        assert!(s.index.kept(1, 0, 1).is_empty());
        let t = s.index.transposed(2);
        assert_eq!(t.listing(0, 0, 0), &[0]);
        assert_eq!(t.listing(0, 0, 1), &[0, 1]);
        assert_eq!(t.listing(1, 0, 0), &[0]);
        assert!(t.listing(1, 0, 1).is_empty());
    }

    #[test]
    fn flex_fields_convert() {
        let num = [2, 0];
        let idx = [3, 1, 7, 7];
        let (out, shape) = block_index_from_flex(&num, &[1, 1, 2], &idx, &[1, 1, 2, 2], Some((&[1, 1], &[1, 1, 2], &[0, 2], &[1, 1, 2, 1]))).unwrap();
        assert_eq!(shape, vec![1, 1, 2, 3]);
        assert_eq!(out, vec![3, 1, 0, 2, -1, -1]);
        let e = block_index_from_flex(&[3, 0], &[1, 1, 2], &idx, &[1, 1, 2, 2], None).unwrap_err();
        assert!(e.to_string().contains("kv_num_blocks[0, 0, 0] = 3"), "{e}");
    }
}
