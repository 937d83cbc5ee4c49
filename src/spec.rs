//! One validated description of an attention call. Every backend receives only a valid spec.
//!
//! All variants reduce to *segments*: query rows `[q_start, q_start + q_len)` attend to the key
//! window `[k_start, k_start + k_len)` of one shared K,V buffer. Varlen batches give one segment
//! per sequence; grouped attention gives one segment per group (windows may overlap). With
//! `causal`, row `r` of a segment (0-based) sees window keys `j <= k_len - q_len + r`
//! (bottom-right alignment, the flash-attn convention); a row that sees no key gets a zero
//! output and an LSE of +inf (also flash-attn's convention), and so do rows outside every group.
//!
//! Layout (flash-attn varlen): q `[total_q, heads_q, head_dim]`, k and v
//! `[total_k, heads_kv, head_dim]`, all contiguous; out like q; lse `[heads_q, total_q]` f32.

use crate::dtype::DType;
use crate::error::{bad_dtype, invalid, Result};

/// Largest head_dim any backend accepts (the CUDA backend supports fewer: see its docs).
pub const MAX_HEAD_DIM: usize = 256;

/// Tensor sizes shared by every variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub total_q: usize,
    pub total_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
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
}

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
    if v.shape != k.shape {
        return Err(invalid("v", format!("shape {:?} must equal k's shape {:?}", v.shape, k.shape)));
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
    Ok((Dims { total_q, total_k, heads_q, heads_kv, head_dim }, q.dtype))
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
        })
    }

    /// Matmul FLOPs of the forward pass (4 * head_dim per visible (query, key) pair and head).
    pub fn forward_flops(&self) -> f64 {
        let pairs: u64 = self.segments.iter().map(|s| s.pairs(self.causal)).sum();
        4.0 * pairs as f64 * self.dims.heads_q as f64 * self.dims.head_dim as f64
    }

    /// Rows of q that no segment covers (their output is zero, their LSE +inf).
    pub fn uncovered_rows(&self) -> usize {
        self.dims.total_q - self.segments.iter().map(|s| s.q_len).sum::<usize>()
    }
}
