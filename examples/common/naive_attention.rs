//! candle's attention as model code writes it with candle-core ops (the peer the candle benchmarks
//! and examples measure cubeattn against): scores = q k^T * scale in the inputs' dtype, the causal
//! mask applied with `where_cond` (-inf above the diagonal), softmax in f32 as exp(x - max) / sum
//! over the last axis (candle-transformers' models upcast the same way), then p v in the inputs'
//! dtype. Each S x S intermediate is dropped as soon as the next one exists, so the peak is the
//! least this formulation needs. Differentiable (candle's autograd runs through every op).
use candle_core::{DType, Tensor, D};

/// q, k, v `[batch, seqlen, heads, head_dim]` (equal heads) -> `[batch, seqlen, heads, head_dim]`;
/// `mask` u8 `[seqlen, seqlen]`, 1 above the diagonal (built once per length, as models cache it).
pub fn naive_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    let dtype = q.dtype();
    let q = q.transpose(1, 2)?.contiguous()?; // [b, h, s, d]
    let k = k.transpose(1, 2)?.contiguous()?;
    let v = v.transpose(1, 2)?.contiguous()?;
    let masked = {
        let att = (q.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?; // [b, h, s, s]
        let neg = Tensor::new(f32::NEG_INFINITY, att.device())?.broadcast_as(att.shape())?;
        mask.broadcast_as(att.shape())?.where_cond(&neg, &att)?
    };
    let e = {
        let max = masked.max_keepdim(D::Minus1)?;
        let x = masked.broadcast_sub(&max)?;
        drop(masked);
        x.exp()?
    };
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.to_dtype(dtype)?;
    drop(e);
    p.matmul(&v)?.transpose(1, 2)?.contiguous() // [b, s, h, d]
}

/// The causal mask of [`naive_attention`] for `s` tokens on `dev`.
pub fn causal_mask(s: usize, dev: &candle_core::Device) -> candle_core::Result<Tensor> {
    let mask: Vec<u8> = (0..s * s).map(|i| u8::from(i % s > i / s)).collect();
    Tensor::from_vec(mask, (s, s), dev)
}
