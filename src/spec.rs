//! One validated description of an attention call. Every backend receives only a valid spec.
//!
//! All variants reduce to *segments*: query rows `[q_start, q_start + q_len)` attend to the key
//! window `[k_start, k_start + k_len)` of one shared K,V buffer. Varlen batches give one segment
//! per sequence; grouped attention gives one segment per group (windows may overlap). With
//! `causal`, row `r` of a segment (0-based) sees window keys `j <= k_len - q_len + r`
//! (bottom-right alignment, the flash-attn convention); a row that sees no key gets a zero
//! output and an LSE of +inf (also flash-attn's convention), and so do rows outside every group.
//! A sliding window ([`Window`], flash-attn's `window_size`) narrows each row's keys further, with
//! the same bottom-right alignment; [`AttnSpec::row_keys`] is the one definition of a row's keys.
//! The spec's [`KeySet`] says how those keys are read or thinned: every one (`Dense`), through a
//! page table (`Paged`), or only those of the key blocks a block index lists for the row's query
//! block (`BlockSparse`, seen whole through [`SparseView`]). Each is validated once, by the
//! builder that sets it.
//!
//! Layout (flash-attn varlen): q `[total_q, heads_q, head_dim]`, k `[total_k, heads_kv, head_dim]`,
//! v `[total_k, heads_kv, head_dim_v]` (head_dim_v: v's own head_dim, as DeepSeek's MLA with 192 /
//! 128; usually head_dim), all contiguous; out `[total_q, heads_q, head_dim_v]`; lse
//! `[heads_q, total_q]` f32.

use crate::dtype::DType;
use crate::error::{bad_dtype, invalid, Result};
use crate::sparse::{block_count, BlockSparse, IndexBounds, Int8Qk, TransposedIndex};

/// Largest head_dim any backend accepts (the CUDA backend supports fewer: see its docs).
pub const MAX_HEAD_DIM: usize = 256;

/// Tensor sizes shared by every variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub total_q: usize,
    pub total_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    /// q's and k's head_dim.
    pub head_dim: usize,
    /// v's head_dim, and out's, dout's and dv's (`head_dim` but for calls like DeepSeek's MLA:
    /// 192 / 128). The kernels run specs with one head_dim ([`Dims::at_head_dim`]), but for the
    /// Hopper forward's warp-specialised frame, which runs v at its own.
    pub head_dim_v: usize,
}

impl Dims {
    /// Query heads per K,V head (GQA ratio).
    pub fn group_size(&self) -> usize {
        self.heads_q / self.heads_kv
    }
    pub fn q_len(&self) -> usize {
        self.total_q * self.heads_q * self.head_dim
    }
    pub fn kv_len(&self) -> usize {
        self.total_k * self.heads_kv * self.head_dim
    }
    /// Elements of v (and dv).
    pub fn v_len(&self) -> usize {
        self.total_k * self.heads_kv * self.head_dim_v
    }
    /// Elements of out (and dout).
    pub fn out_len(&self) -> usize {
        self.total_q * self.heads_q * self.head_dim_v
    }
    /// Whether v has q's and k's head_dim.
    pub fn is_uniform(&self) -> bool {
        self.head_dim == self.head_dim_v
    }
    /// These dims with every head_dim `d` (what a kernel of one head_dim runs).
    pub fn at_head_dim(&self, d: usize) -> Dims {
        Dims { head_dim: d, head_dim_v: d, ..*self }
    }
    pub fn lse_len(&self) -> usize {
        self.heads_q * self.total_q
    }
}

/// Query rows `[q_start, q_start + q_len)` attending to keys `[k_start, k_start + k_len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub q_start: usize,
    pub q_len: usize,
    pub k_start: usize,
    pub k_len: usize,
}

impl Segment {
    /// Number of window keys visible to row `r` (0-based inside the segment).
    #[inline]
    pub fn visible_len(&self, r: usize, causal: bool) -> usize {
        if !causal {
            return self.k_len;
        }
        let hi = self.k_len as i64 - self.q_len as i64 + r as i64 + 1;
        hi.clamp(0, self.k_len as i64) as usize
    }
    /// Absolute key range `[lo, hi)` visible to row `r` of the segment.
    #[inline]
    pub fn key_range(&self, r: usize, causal: bool) -> (usize, usize) {
        (self.k_start, self.k_start + self.visible_len(r, causal))
    }
    /// Number of (query, key) pairs this segment computes.
    pub fn pairs(&self, causal: bool) -> u64 {
        (0..self.q_len).map(|r| self.visible_len(r, causal) as u64).sum()
    }
}

/// Sliding-window attention (flash-attn's `window_size = (left, right)`, `-1` = unbounded): row
/// `r` of a segment sees window keys `j` with
/// `r + k_len - q_len - left <= j <= r + k_len - q_len + right` (bottom-right aligned, as causal;
/// with `causal` the right side is at most 0). `None` is an unbounded side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Window {
    pub left: Option<usize>,
    pub right: Option<usize>,
}

impl Window {
    /// No window: every row sees its segment's keys (up to the causal bound).
    pub const NONE: Window = Window { left: None, right: None };

    /// flash-attn's `(left, right)`: each side `-1` (unbounded) or `>= 0`.
    pub fn parse(left: i64, right: i64) -> Result<Window> {
        let side = |x: i64| -> Result<Option<usize>> {
            match x {
                -1 => Ok(None),
                x if x >= 0 => usize::try_from(x).map(Some).map_err(|_| invalid("window_size", format!("{x} is too large"))),
                _ => Err(invalid(
                    "window_size",
                    format!("({left}, {right}): each side must be -1 (unbounded) or >= 0, got {x}"),
                )),
            }
        };
        Ok(Window { left: side(left)?, right: side(right)? })
    }

    pub fn is_none(&self) -> bool {
        self.left.is_none() && self.right.is_none()
    }

    /// flash-attn's form: `-1` for an unbounded side.
    pub fn as_pair(&self) -> (i64, i64) {
        let f = |x: Option<usize>| x.map_or(-1, |v| v.min(i64::MAX as usize) as i64);
        (f(self.left), f(self.right))
    }
}

/// Which API built the spec (kept for messages and for kernels that want the original form).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `cu_seqlens` batch of `batch` sequences.
    Varlen { batch: usize },
    /// `groups` query groups over one shared K,V.
    Grouped { groups: usize },
}

/// A validated attention call.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnSpec {
    pub dims: Dims,
    pub dtype: DType,
    /// Multiplies q.k before the softmax.
    pub scale: f32,
    pub causal: bool,
    pub layout: Layout,
    /// Non-overlapping in their query rows; key windows may overlap.
    pub segments: Vec<Segment>,
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
    /// Sliding window (normalised by [`AttnSpec::with_window`]: a side that bounds no row of any
    /// segment is `None`, and so is the right side under `causal`). Dense key sets only.
    pub window: Window,
    /// How the keys are read or thinned.
    pub keys: KeySet,
}

/// The keys a row reads, besides its segment's window, the causal bound and the sliding window.
#[derive(Debug, Clone, PartialEq)]
pub enum KeySet {
    /// Every key; key `j` is row `j` of k, v.
    Dense,
    /// Paged K,V ([`AttnSpec::with_kv_block_table`]): logical key block `g` (keys
    /// `[KV_PAGE g, KV_PAGE (g + 1))`, the positions of segments and masks) is stored at rows
    /// `[KV_PAGE t[g], KV_PAGE (t[g] + 1))` of k, v (and dk, dv).
    Paged(Vec<u32>),
    /// Block-sparse ([`AttnSpec::with_block_index`]): a row sees only the keys of the key blocks
    /// listed for its query block; K,V read by logical key.
    BlockSparse(Box<BlockSparse>),
}

/// A block index on a paged spec, or a page table on a block-sparse one.
fn paged_and_sparse() -> crate::error::Error {
    // the block-sparse kernels read K,V by logical key: a paged spec would be read unpaged
    invalid("kv_block_table", "block-sparse attention does not take a paged K,V")
}

impl KeySet {
    /// The argument that sets this key set (`None` for dense).
    fn arg(&self) -> Option<&'static str> {
        match self {
            KeySet::Dense => None,
            KeySet::Paged(_) => Some("kv_block_table"),
            KeySet::BlockSparse(_) => Some("block_index"),
        }
    }

    /// `"dense"`, `"paged"` or `"block_sparse"`.
    pub fn name(&self) -> &'static str {
        match self {
            KeySet::Dense => "dense",
            KeySet::Paged(_) => "paged",
            KeySet::BlockSparse(_) => "block_sparse",
        }
    }
}

/// Which pass of a call (backends may serve one and not the other).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Forward,
    /// `deterministic`: bitwise-identical gradients run to run.
    Backward { deterministic: bool },
}

pub use crate::format::KV_PAGE;

/// Shape and dtype of one input tensor, as the caller gave it.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorMeta {
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl TensorMeta {
    pub fn new(shape: &[usize], dtype: DType) -> Self {
        TensorMeta { shape: shape.to_vec(), dtype }
    }
}

/// q, k, v metadata checked against each other; returns the dims and the common dtype.
pub fn check_qkv(q: &TensorMeta, k: &TensorMeta, v: &TensorMeta) -> Result<(Dims, DType)> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.shape.len() != 3 {
            return Err(invalid(
                name,
                format!(
                    "expected rank 3 [total_tokens, heads, head_dim], got rank {} (shape {:?})",
                    t.shape.len(),
                    t.shape
                ),
            ));
        }
    }
    let (total_q, heads_q, head_dim) = (q.shape[0], q.shape[1], q.shape[2]);
    let (total_k, heads_kv, dk) = (k.shape[0], k.shape[1], k.shape[2]);
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(invalid("q", format!("head_dim must be in 1..={MAX_HEAD_DIM}, got {head_dim}")));
    }
    if heads_q == 0 {
        return Err(invalid("q", "heads_q must be at least 1, got 0"));
    }
    if heads_kv == 0 {
        return Err(invalid("k", "heads_kv must be at least 1, got 0"));
    }
    if dk != head_dim {
        return Err(invalid("k", format!("head_dim {dk} differs from q's head_dim {head_dim}")));
    }
    if v.shape[..2] != k.shape[..2] {
        return Err(invalid("v", format!("shape {:?} must have k's [total_k, heads_kv] = {:?}", v.shape, &k.shape[..2])));
    }
    let head_dim_v = v.shape[2];
    if head_dim_v == 0 || head_dim_v > MAX_HEAD_DIM {
        return Err(invalid("v", format!("head_dim must be in 1..={MAX_HEAD_DIM}, got {head_dim_v}")));
    }
    if heads_q % heads_kv != 0 {
        return Err(invalid(
            "k",
            format!("heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) for GQA"),
        ));
    }
    if k.dtype != q.dtype {
        return Err(bad_dtype("k", format!("{} differs from q's {}", k.dtype.name(), q.dtype.name())));
    }
    if v.dtype != q.dtype {
        return Err(bad_dtype("v", format!("{} differs from q's {}", v.dtype.name(), q.dtype.name())));
    }
    Ok((Dims { total_q, total_k, heads_q, heads_kv, head_dim, head_dim_v }, q.dtype))
}

/// `softmax_scale` or the default `1/sqrt(head_dim)`; must be finite.
pub fn resolve_scale(scale: Option<f64>, head_dim: usize) -> Result<f32> {
    match scale {
        None => Ok(1.0 / (head_dim as f32).sqrt()),
        Some(s) if s.is_finite() => Ok(s as f32),
        Some(s) => Err(invalid("softmax_scale", format!("must be a finite number, got {s}"))),
    }
}

fn check_cu_seqlens(name: &'static str, cu: &[i32], total: usize) -> Result<Vec<usize>> {
    if cu.is_empty() {
        return Err(invalid(name, "must have batch+1 >= 1 entries, got an empty array"));
    }
    if cu[0] != 0 {
        return Err(invalid(name, format!("must start at 0, got {}", cu[0])));
    }
    for (i, w) in cu.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(invalid(
                name,
                format!("must be non-decreasing, but entry {} ({}) < entry {} ({})", i + 1, w[1], i, w[0]),
            ));
        }
    }
    let last = *cu.last().unwrap();
    if last as i64 != total as i64 {
        return Err(invalid(name, format!("must end at the total token count {total}, got {last}")));
    }
    Ok(cu.iter().map(|&x| x as usize).collect())
}

fn check_max(name: &'static str, given: usize, actual: usize) -> Result<usize> {
    if given < actual {
        return Err(invalid(name, format!("is {given}, smaller than the longest sequence ({actual})")));
    }
    Ok(given)
}

fn check_ranges(name: &'static str, ranges: &[[i32; 2]], total: usize, total_name: &str) -> Result<()> {
    for (g, r) in ranges.iter().enumerate() {
        if r[0] < 0 || r[1] < r[0] || r[1] as i64 > total as i64 {
            return Err(invalid(
                name,
                format!("group {g} range [{}, {}) must satisfy 0 <= start <= end <= {total_name} ({total})", r[0], r[1]),
            ));
        }
    }
    Ok(())
}

impl AttnSpec {
    /// flash_attn_varlen_func: sequence b has queries `cu_q[b]..cu_q[b+1]` and keys `cu_k[b]..cu_k[b+1]`.
    #[allow(clippy::too_many_arguments)]
    pub fn varlen(
        q: &TensorMeta,
        k: &TensorMeta,
        v: &TensorMeta,
        cu_seqlens_q: &[i32],
        cu_seqlens_k: &[i32],
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        softmax_scale: Option<f64>,
        causal: bool,
    ) -> Result<AttnSpec> {
        let (dims, dtype) = check_qkv(q, k, v)?;
        let cq = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, dims.total_q)?;
        let ck = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, dims.total_k)?;
        if cq.len() != ck.len() {
            return Err(invalid(
                "cu_seqlens_k",
                format!("has {} entries but cu_seqlens_q has {} (both must be batch+1)", ck.len(), cq.len()),
            ));
        }
        let segments: Vec<Segment> = (0..cq.len() - 1)
            .map(|b| Segment { q_start: cq[b], q_len: cq[b + 1] - cq[b], k_start: ck[b], k_len: ck[b + 1] - ck[b] })
            .collect();
        let mq = segments.iter().map(|s| s.q_len).max().unwrap_or(0);
        let mk = segments.iter().map(|s| s.k_len).max().unwrap_or(0);
        Ok(AttnSpec {
            dims,
            dtype,
            scale: resolve_scale(softmax_scale, dims.head_dim)?,
            causal,
            layout: Layout::Varlen { batch: segments.len() },
            max_seqlen_q: check_max("max_seqlen_q", max_seqlen_q, mq)?,
            max_seqlen_k: check_max("max_seqlen_k", max_seqlen_k, mk)?,
            segments,
            window: Window::NONE,
            keys: KeySet::Dense,
        })
    }

    /// Grouped attention: group g's query rows `q_ranges[g]` attend keys `kv_ranges[g]` of the
    /// shared K,V. Query ranges must not overlap; key ranges may. Empty groups are allowed.
    pub fn grouped(
        q: &TensorMeta,
        k: &TensorMeta,
        v: &TensorMeta,
        q_ranges: &[[i32; 2]],
        kv_ranges: &[[i32; 2]],
        softmax_scale: Option<f64>,
        causal: bool,
    ) -> Result<AttnSpec> {
        let (dims, dtype) = check_qkv(q, k, v)?;
        if q_ranges.is_empty() {
            return Err(invalid("q_ranges", "needs at least one group, got 0"));
        }
        if kv_ranges.len() != q_ranges.len() {
            return Err(invalid(
                "kv_ranges",
                format!("has {} groups but q_ranges has {}", kv_ranges.len(), q_ranges.len()),
            ));
        }
        check_ranges("q_ranges", q_ranges, dims.total_q, "total_q")?;
        check_ranges("kv_ranges", kv_ranges, dims.total_k, "total_k")?;
        let mut order: Vec<usize> = (0..q_ranges.len()).filter(|&g| q_ranges[g][1] > q_ranges[g][0]).collect();
        order.sort_by_key(|&g| q_ranges[g][0]);
        for w in order.windows(2) {
            let (a, b) = (q_ranges[w[0]], q_ranges[w[1]]);
            if b[0] < a[1] {
                return Err(invalid(
                    "q_ranges",
                    format!("groups {} [{}, {}) and {} [{}, {}) overlap; each query row belongs to one group", w[0], a[0], a[1], w[1], b[0], b[1]),
                ));
            }
        }
        let segments: Vec<Segment> = q_ranges
            .iter()
            .zip(kv_ranges)
            .map(|(q, k)| Segment {
                q_start: q[0] as usize,
                q_len: (q[1] - q[0]) as usize,
                k_start: k[0] as usize,
                k_len: (k[1] - k[0]) as usize,
            })
            .collect();
        Ok(AttnSpec {
            dims,
            dtype,
            scale: resolve_scale(softmax_scale, dims.head_dim)?,
            causal,
            layout: Layout::Grouped { groups: segments.len() },
            max_seqlen_q: segments.iter().map(|s| s.q_len).max().unwrap_or(0),
            max_seqlen_k: segments.iter().map(|s| s.k_len).max().unwrap_or(0),
            segments,
            window: Window::NONE,
            keys: KeySet::Dense,
        })
    }

    /// The spec with flash-attn's `window_size = (left, right)` (`-1` = unbounded side), checked
    /// here once (`InvalidArgument` naming `window_size`). A side that cannot narrow any row (left
    /// >= k_len - 1, right >= q_len - 1 in every segment; the right side under `causal`) becomes
    /// `None`, so `(-1, -1)` and windows wider than every sequence give the plain spec. Paged
    /// and block-sparse key sets take no window.
    pub fn with_window(mut self, left: i64, right: i64) -> Result<AttnSpec> {
        let mut w = Window::parse(left, right)?;
        if w.left.is_some_and(|l| self.segments.iter().all(|s| l.saturating_add(1) >= s.k_len)) {
            w.left = None;
        }
        if self.causal || w.right.is_some_and(|r| self.segments.iter().all(|s| r.saturating_add(1) >= s.q_len)) {
            w.right = None;
        }
        self.window = w;
        self.check_window_keys()?;
        Ok(self)
    }

    /// The spec reading K,V (and writing dK,dV) through a block table: logical key block `g`
    /// ([`KV_PAGE`] keys; the positions `kv_ranges` / `cu_seqlens_k` and the causal masks speak
    /// of) is stored at rows `[KV_PAGE table[g], KV_PAGE (table[g] + 1))` of k and v. flash-attn's
    /// paged `block_table` with one table for the whole key axis; the zigzag layer reads its
    /// gathered buffer through one. Checked here once (`InvalidArgument` naming
    /// `kv_block_table`): total_k a multiple of KV_PAGE, the table a permutation of
    /// `0..total_k / KV_PAGE` (each physical block holds one logical block, so dK,dV have one
    /// writer per row), every segment's first key a multiple of KV_PAGE, no sliding window, no
    /// block index (`kv_block_table` then; the key sets exclude each other).
    pub fn with_kv_block_table(mut self, table: &[i32]) -> Result<AttnSpec> {
        const ARG: &str = "kv_block_table";
        self.check_uniform(ARG)?;
        let tk = self.dims.total_k;
        if !tk.is_multiple_of(KV_PAGE) {
            return Err(invalid(ARG, format!("needs total_k (k's rows) to be a multiple of {KV_PAGE}, got {tk}")));
        }
        let n = tk / KV_PAGE;
        if table.len() != n {
            return Err(invalid(ARG, format!("has {} entries; k's {tk} rows are {n} blocks of {KV_PAGE}", table.len())));
        }
        let mut seen = vec![usize::MAX; n];
        for (g, &t) in table.iter().enumerate() {
            if t < 0 || t as usize >= n {
                return Err(invalid(ARG, format!("kv_block_table[{g}] = {t} is outside 0..{n}")));
            }
            if seen[t as usize] != usize::MAX {
                return Err(invalid(ARG, format!("kv_block_table[{g}] = {t} repeats kv_block_table[{}] (must be a permutation)", seen[t as usize])));
            }
            seen[t as usize] = g;
        }
        if let Some((i, s)) = self.segments.iter().enumerate().find(|(_, s)| s.k_len > 0 && s.k_start % KV_PAGE != 0) {
            let what = match self.layout {
                Layout::Grouped { .. } => "kv_ranges",
                _ => "cu_seqlens_k",
            };
            return Err(invalid(
                ARG,
                format!("needs every key range to start at a multiple of {KV_PAGE}; {what} {i} starts at {}", s.k_start),
            ));
        }
        if let KeySet::BlockSparse(_) = self.keys {
            return Err(paged_and_sparse());
        }
        self.keys = KeySet::Paged(table.iter().map(|&t| t as u32).collect());
        self.check_window_keys()?;
        Ok(self)
    }

    /// The spec attending, per (sequence, head, query block), only the key blocks `block_index`
    /// lists (block-sparse attention; see [`crate::sparse`] for the block-size contract):
    /// `block_index` is int32 `[batch, heads, q_blocks, top_k]` (flat, C order, shape
    /// `index_shape`), query rows in blocks of `q_block`, keys in blocks of `k_block`, both counted
    /// from each sequence's start; `int8`: the INT8 QK^T option (forward only). Checked here once
    /// (`InvalidArgument` naming the argument): the varlen layout (batched calls are varlen with
    /// equal lengths), no page table, no sliding window, every index entry.
    pub fn with_block_index(
        mut self,
        block_index: &[i32],
        index_shape: &[usize],
        q_block: usize,
        k_block: usize,
        int8: Option<Int8Qk>,
    ) -> Result<AttnSpec> {
        if let Layout::Grouped { .. } = self.layout {
            return Err(invalid("block_index", "block-sparse attention takes the batched or varlen layout, not groups"));
        }
        if let KeySet::Paged(_) = self.keys {
            return Err(paged_and_sparse());
        }
        self.check_uniform("block_index")?;
        let k_lens: Vec<usize> = self.segments.iter().map(|s| s.k_len).collect();
        let d = self.dims;
        let bounds = IndexBounds { heads_q: d.heads_q, heads_kv: d.heads_kv, max_seqlen_q: self.max_seqlen_q, k_lens: &k_lens };
        let sparse = BlockSparse::new(block_index, index_shape, q_block, k_block, int8, bounds)?;
        self.keys = KeySet::BlockSparse(Box::new(sparse));
        self.check_window_keys()?;
        Ok(self)
    }

    /// `Err` naming `v` where v's head_dim is not q's and k's: the paged and block-sparse key
    /// sets (`arg`) take one head_dim.
    fn check_uniform(&self, arg: &str) -> Result<()> {
        let d = self.dims;
        if d.is_uniform() {
            return Ok(());
        }
        Err(invalid("v", format!("head_dim {} differs from q's and k's {}; a {arg} takes one head_dim", d.head_dim_v, d.head_dim)))
    }

    /// `Err` naming `window_size` where a sliding window meets a paged or block-sparse key set:
    /// their kernels take no window.
    fn check_window_keys(&self) -> Result<()> {
        match self.keys.arg() {
            Some(arg) if !self.window.is_none() => Err(invalid("window_size", format!("is not supported with a {arg} (only (-1, -1))"))),
            _ => Ok(()),
        }
    }

    /// `Err` where `pass` cannot take an option of the spec, on any backend: the INT8 QK^T option
    /// of a block-sparse spec is forward-only.
    pub fn check_pass(&self, pass: Pass) -> Result<()> {
        match (pass, self.block_sparse()) {
            (Pass::Backward { .. }, Some(s)) if s.int8.is_some() => Err(invalid(
                "quant_gran",
                "the INT8 QK^T option (qk_int8) is forward-only (inference); the backward needs quant_gran=None",
            )),
            _ => Ok(()),
        }
    }

    /// The page table of a paged K,V ([`KeySet::Paged`]).
    pub fn kv_pages(&self) -> Option<&[u32]> {
        match &self.keys {
            KeySet::Paged(t) => Some(t),
            _ => None,
        }
    }

    /// The spec seen as a block-sparse call ([`KeySet::BlockSparse`]).
    pub fn block_sparse(&self) -> Option<SparseView<'_>> {
        match &self.keys {
            KeySet::BlockSparse(s) => Some(SparseView { attn: self, sparse: s }),
            _ => None,
        }
    }

    /// Row of k / v holding logical key `j`.
    #[inline]
    pub fn kv_row(&self, j: usize) -> usize {
        match &self.keys {
            KeySet::Paged(t) => t[j / KV_PAGE] as usize * KV_PAGE + j % KV_PAGE,
            _ => j,
        }
    }

    /// Keys `[lo, hi)` (relative to the segment's key start) that row `r` of `seg` sees: the
    /// causal bound, then the window, both bottom-right aligned. Empty (`lo == hi`) when the row
    /// sees no key.
    #[inline]
    pub fn row_keys(&self, seg: &Segment, r: usize) -> (usize, usize) {
        let k = seg.k_len as i64;
        // the key aligned with row r (bottom-right): r + k_len - q_len
        let diag = k - seg.q_len as i64 + r as i64;
        let mut hi = k;
        if self.causal {
            hi = hi.min(diag + 1);
        }
        if let Some(w) = self.window.right {
            hi = hi.min(diag.saturating_add(w.min(i64::MAX as usize) as i64).saturating_add(1));
        }
        let hi = hi.max(0);
        let lo = match self.window.left {
            Some(w) => diag.saturating_sub(w.min(i64::MAX as usize) as i64).clamp(0, hi),
            None => 0,
        };
        (lo as usize, hi as usize)
    }

    /// Absolute key range `[lo, hi)` of row `r` of `seg` (see [`AttnSpec::row_keys`]).
    #[inline]
    pub fn row_key_range(&self, seg: &Segment, r: usize) -> (usize, usize) {
        let (lo, hi) = self.row_keys(seg, r);
        (seg.k_start + lo, seg.k_start + hi)
    }

    /// Rows `[r0, r1)` of `seg` that may see a key of `[a, b)` (relative to the key start): every
    /// row outside sees none of them (both bounds of a row's keys grow with the row).
    pub fn rows_seeing(&self, seg: &Segment, a: usize, b: usize) -> (usize, usize) {
        let first = |pred: &dyn Fn(usize) -> bool| {
            // first row in 0..q_len where pred holds (pred is monotone: false..., true...)
            let (mut lo, mut hi) = (0usize, seg.q_len);
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                if pred(mid) {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            lo
        };
        let r0 = first(&|r| self.row_keys(seg, r).1 > a);
        let r1 = first(&|r| self.row_keys(seg, r).0 >= b);
        (r0, r1.max(r0))
    }

    /// Number of (query, key) pairs segment `seg` computes.
    pub fn segment_pairs(&self, seg: &Segment) -> u64 {
        if self.window.is_none() {
            return seg.pairs(self.causal);
        }
        (0..seg.q_len).map(|r| {
            let (lo, hi) = self.row_keys(seg, r);
            (hi - lo) as u64
        }).sum()
    }

    /// Matmul FLOPs of the forward pass (2 * (head_dim + head_dim_v) per visible (query, key)
    /// pair and head: 4 * head_dim where v has q's head_dim).
    pub fn forward_flops(&self) -> f64 {
        let pairs = match self.block_sparse() {
            Some(s) => s.visible_pairs(),
            None => self.segments.iter().map(|s| self.segment_pairs(s)).sum::<u64>() * self.dims.heads_q as u64,
        };
        2.0 * pairs as f64 * (self.dims.head_dim + self.dims.head_dim_v) as f64
    }

    /// Rows of q that no segment covers (their output is zero, their LSE +inf).
    pub fn uncovered_rows(&self) -> usize {
        self.dims.total_q - self.segments.iter().map(|s| s.q_len).sum::<usize>()
    }
}

/// A block-sparse spec seen whole ([`AttnSpec::block_sparse`]): the call and its block index,
/// whose fields ([`BlockSparse`]) it shows through `Deref`. What the block-sparse backends take.
#[derive(Debug, Clone, Copy)]
pub struct SparseView<'a> {
    pub attn: &'a AttnSpec,
    sparse: &'a BlockSparse,
}

impl std::ops::Deref for SparseView<'_> {
    type Target = BlockSparse;
    fn deref(&self) -> &BlockSparse {
        self.sparse
    }
}

impl SparseView<'_> {
    /// The index head that query head `h` reads.
    #[inline]
    pub fn index_head(&self, h: usize) -> usize {
        if self.index.heads == self.attn.dims.heads_q {
            h
        } else {
            h / self.attn.dims.group_size()
        }
    }

    /// Key blocks (of the longest sequence).
    pub fn k_blocks(&self) -> usize {
        block_count(self.attn.max_seqlen_k, self.k_block)
    }

    /// Whether row `r` (inside sequence `b`) of query head `h` sees key `j` (inside the sequence).
    pub fn visible(&self, b: usize, h: usize, r: usize, j: usize) -> bool {
        let seg = &self.attn.segments[b];
        if r >= seg.q_len || j >= seg.visible_len(r, self.attn.causal) {
            return false;
        }
        self.index.kept(b, self.index_head(h), r / self.q_block).binary_search(&((j / self.k_block) as u32)).is_ok()
    }

    /// The transposed index (per key block, the query blocks listing it), built on the host in
    /// O(kept blocks).
    pub fn transposed(&self) -> TransposedIndex {
        self.index.transposed(self.k_blocks())
    }

    /// Visible (query, key) pairs summed over query heads.
    pub fn visible_pairs(&self) -> u64 {
        let dm = self.attn.dims;
        let mut total = 0u64;
        for (b, seg) in self.attn.segments.iter().enumerate() {
            for h in 0..dm.heads_q {
                let hi = self.index_head(h);
                for r in 0..seg.q_len {
                    let lim = seg.visible_len(r, self.attn.causal);
                    for &kb in self.index.kept(b, hi, r / self.q_block) {
                        let lo = kb as usize * self.k_block;
                        total += (lim.min(lo + self.k_block).min(seg.k_len)).saturating_sub(lo) as u64;
                    }
                }
            }
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn spec(lens: &[(usize, usize)], causal: bool) -> AttnSpec {
        let (mut cq, mut ck) = (vec![0i32], vec![0i32]);
        for &(a, b) in lens {
            cq.push(cq.last().unwrap() + a as i32);
            ck.push(ck.last().unwrap() + b as i32);
        }
        let m = |n: i32| TensorMeta::new(&[n as usize, 2, 8], DType::F32);
        let (mq, mk) = (lens.iter().map(|x| x.0).max().unwrap(), lens.iter().map(|x| x.1).max().unwrap());
        AttnSpec::varlen(&m(*cq.last().unwrap()), &m(*ck.last().unwrap()), &m(*ck.last().unwrap()), &cq, &ck, mq, mk, None, causal).unwrap()
    }

    /// flash-attn's docstring, key by key: row i sees j when
    /// i + sk - sq - left <= j <= i + sk - sq + right (unbounded side: -1), and j <= i + sk - sq
    /// with causal.
    fn brute(sq: usize, sk: usize, causal: bool, left: i64, right: i64, i: usize) -> Vec<usize> {
        let diag = i as i64 + sk as i64 - sq as i64;
        (0..sk)
            .filter(|&j| {
                let j = j as i64;
                (!causal || j <= diag) && (left < 0 || j >= diag - left) && (right < 0 || j <= diag + right)
            })
            .collect()
    }

    #[test]
    fn row_keys_follow_flash_attns_definition() {
        let lens = [(1, 1), (7, 7), (5, 13), (13, 5), (0, 4), (4, 0), (9, 1), (1, 9)];
        let windows = [(-1, -1), (0, 0), (0, -1), (-1, 0), (1, 2), (3, 0), (0, 3), (20, -1), (-1, 20), (2, 100), (100, 100)];
        for causal in [false, true] {
            let sp = spec(&lens, causal);
            for &(l, r) in &windows {
                let w = sp.clone().with_window(l, r).unwrap();
                for seg in &w.segments {
                    let mut pairs = 0u64;
                    for i in 0..seg.q_len {
                        let want = brute(seg.q_len, seg.k_len, causal, l, r, i);
                        let (lo, hi) = w.row_keys(seg, i);
                        assert_eq!((lo..hi).collect::<Vec<_>>(), want, "{seg:?} causal={causal} window=({l},{r}) row {i}");
                        pairs += want.len() as u64;
                    }
                    assert_eq!(w.segment_pairs(seg), pairs);
                    // rows_seeing is exact for every key range
                    for a in 0..=seg.k_len {
                        for b in a..=seg.k_len {
                            let (r0, r1) = w.rows_seeing(seg, a, b);
                            for i in 0..seg.q_len {
                                let sees = brute(seg.q_len, seg.k_len, causal, l, r, i).iter().any(|&j| j >= a && j < b);
                                assert!(!sees || (r0..r1).contains(&i), "{seg:?} ({l},{r}) keys [{a},{b}) row {i} outside [{r0},{r1})");
                            }
                        }
                    }
                }
            }
        }
    }

    /// The block index is the spec's key set: validated once by `with_block_index`, exclusive
    /// with a page table, a sliding window and the grouped layout; its visibility and FLOPs are
    /// the token mask's.
    #[test]
    fn block_index_is_a_key_set_of_the_spec() {
        let arg_of = |r: Result<AttnSpec>| match r {
            Err(Error::InvalidArgument { arg, .. }) => arg,
            other => panic!("expected InvalidArgument, got {other:?}"),
        };
        // sequences (128 queries, 256 keys) and (64, 100): q_block 64, k_block 128
        let m = |n: usize| TensorMeta::new(&[n, 2, 8], DType::F32);
        let base = |causal| AttnSpec::varlen(&m(192), &m(356), &m(356), &[0, 128, 192], &[0, 256, 356], 128, 256, None, causal).unwrap();
        // [batch 2, heads 2, q_blocks 2, top_k 2]
        let ix = [1, 0, -1, 1, 0, -1, 1, -1, 0, -1, -1, -1, -1, -1, 0, -1];
        for causal in [false, true] {
            let s = base(causal).with_block_index(&ix, &[2, 2, 2, 2], 64, 128, None).unwrap();
            assert_eq!(s.keys.name(), "block_sparse");
            let v = s.block_sparse().unwrap();
            assert_eq!(v.index.kept(0, 0, 0), &[0, 1]);
            // brute force over the token mask: visible pairs and FLOPs
            let mut pairs = 0u64;
            for (b, seg) in s.segments.iter().enumerate() {
                for h in 0..2 {
                    for r in 0..seg.q_len {
                        for j in 0..seg.k_len {
                            let listed = ix[((b * 2 + h) * 2 + r / 64) * 2..][..2].contains(&((j / 128) as i32));
                            let want = listed && (!causal || j + seg.q_len <= r + seg.k_len);
                            assert_eq!(v.visible(b, h, r, j), want, "b={b} h={h} r={r} j={j} causal={causal}");
                            pairs += want as u64;
                        }
                    }
                }
            }
            assert_eq!(v.visible_pairs(), pairs);
            assert_eq!(s.forward_flops(), 4.0 * pairs as f64 * 8.0);
            // the INT8 option is forward-only on every backend
            let int8 = Some(Int8Qk { gran: crate::sparse::QuantGran::PerWarp, smooth_k: true, pv_fp8: false });
            let q8 = base(causal).with_block_index(&ix, &[2, 2, 2, 2], 64, 128, int8).unwrap();
            assert!(q8.check_pass(Pass::Forward).is_ok() && s.check_pass(Pass::Backward { deterministic: true }).is_ok());
            assert!(matches!(q8.check_pass(Pass::Backward { deterministic: true }), Err(Error::InvalidArgument { arg: "quant_gran", .. })));
        }
        // exclusive with a sliding window (either order) and the grouped layout
        let sparse = base(false).with_block_index(&ix, &[2, 2, 2, 2], 64, 128, None).unwrap();
        assert_eq!(arg_of(sparse.clone().with_window(8, 0)), "window_size");
        assert_eq!(arg_of(base(false).with_window(8, 0).unwrap().with_block_index(&ix, &[2, 2, 2, 2], 64, 128, None)), "window_size");
        assert_eq!(sparse.clone().with_window(-1, -1).unwrap(), sparse);
        let g = AttnSpec::grouped(&m(192), &m(356), &m(356), &[[0, 128]], &[[0, 256]], None, false).unwrap();
        assert_eq!(arg_of(g.with_block_index(&ix[..8], &[1, 2, 2, 2], 64, 128, None)), "block_index");
        // a bad entry is named by its position
        let mut bad = ix;
        bad[5] = 2;
        match base(false).with_block_index(&bad, &[2, 2, 2, 2], 64, 128, None) {
            Err(Error::InvalidArgument { arg: "block_index", msg }) => assert!(msg.contains("block_index[0, 1, 0, 1] = 2"), "{msg}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn window_is_validated_once_naming_window_size() {
        let sp = spec(&[(5, 5)], false);
        for (l, r) in [(-2, 0), (0, -2), (i64::MIN, -1)] {
            match sp.clone().with_window(l, r) {
                Err(Error::InvalidArgument { arg, msg }) => assert!(arg == "window_size" && msg.contains("-1"), "{msg}"),
                other => panic!("({l}, {r}): {other:?}"),
            }
        }
        // sides that narrow no row are dropped: the spec equals the plain one
        assert_eq!(sp.clone().with_window(-1, -1).unwrap(), sp);
        assert_eq!(sp.clone().with_window(4, 4).unwrap(), sp);
        assert_eq!(sp.clone().with_window(3, 4).unwrap().window, Window { left: Some(3), right: None });
        assert_eq!(sp.clone().with_window(4, 3).unwrap().window, Window { left: None, right: Some(3) });
        let c = spec(&[(5, 5)], true);
        assert_eq!(c.clone().with_window(2, 0).unwrap().window, Window { left: Some(2), right: None });
        assert_eq!(c.clone().with_window(2, 0).unwrap().window.as_pair(), (2, -1));
    }
}
