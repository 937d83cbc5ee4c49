//! cubeattn as candle ops: forward, lse, autograd, varlen and grouped calls on CPU tensors.
//! `cargo run --release --features candle --example candle_attention`
use candle_core::{DType, Device, Tensor, Var, D};

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let (b, s, hq, hkv, d) = (2, 256, 8, 2, 64);
    let scale = 1.0 / (d as f32).sqrt();

    // [batch, seqlen, heads, head_dim], as candle-flash-attn takes them; GQA 8 query heads / 2 kv heads
    let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, s, hq, d), &dev)?)?;
    let k = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, s, hkv, d), &dev)?)?;
    let v = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, s, hkv, d), &dev)?)?;

    let (out, lse) = cubeattn::candle::flash_attn_with_lse(&q, &k, &v, scale, true)?;
    println!("flash_attn: out {:?}, lse {:?} ({:?})", out.dims(), lse.dims(), lse.dtype());

    // candle's autograd runs cubeattn's backward
    let grads = out.sqr()?.sum_all()?.backward()?;
    let dq = grads.get(&q).expect("q takes part in the graph");
    println!("backward: dq {:?}, |dq| = {:.4}", dq.dims(), dq.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?);

    // the same in plain candle ops (materialises the [b, h, s, s] scores), for comparison
    let naive = {
        let rep = |t: &Tensor| -> candle_core::Result<Tensor> {
            t.transpose(1, 2)?.unsqueeze(2)?.broadcast_as((b, hkv, hq / hkv, s, d))?.reshape((b, hq, s, d))
        };
        let qh = q.transpose(1, 2)?.contiguous()?;
        let scores = (qh.matmul(&rep(&k)?.t()?.contiguous()?)? * scale as f64)?;
        let mask: Vec<f32> = (0..s * s).map(|i| if i % s > i / s { f32::NEG_INFINITY } else { 0.0 }).collect();
        let scores = scores.broadcast_add(&Tensor::from_vec(mask, (s, s), &dev)?)?;
        let e = scores.broadcast_sub(&scores.max_keepdim(D::Minus1)?)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        p.matmul(&rep(&v)?.contiguous()?)?.transpose(1, 2)?
    };
    let diff = (&out - &naive)?.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("max |cubeattn - naive candle| = {diff:.2e}");

    // varlen: two sequences of 100 and 156 tokens packed as [total, heads, head_dim]; bf16
    let qp = q.reshape((b * s, hq, d))?.to_dtype(DType::BF16)?;
    let kp = k.reshape((b * s, hkv, d))?.to_dtype(DType::BF16)?;
    let vp = v.reshape((b * s, hkv, d))?.to_dtype(DType::BF16)?;
    let cu = Tensor::new(&[0u32, 100, 512], &dev)?;
    let o = cubeattn::candle::flash_attn_varlen(&qp, &kp, &vp, &cu, &cu, 412, 412, scale, true)?;
    println!("flash_attn_varlen (bf16): out {:?} {:?}", o.dims(), o.dtype());

    // grouped (zigzag llama3, 2 ranks, rank 0, chunk 128): two query groups over one shared K,V
    let c = 128;
    let o = cubeattn::candle::grouped_flash_attn(&qp.narrow(0, 0, 2 * c)?, &kp, &vp, &[[0, c], [c, 2 * c]], &[[0, c], [0, 4 * c]], scale, true)?;
    println!("grouped_flash_attn: out {:?}", o.dims());

    // bad input is an error naming the argument, not a panic
    let err = cubeattn::candle::flash_attn(&q, &k.narrow(3, 0, 32)?, &v.narrow(3, 0, 32)?, scale, true).unwrap_err();
    println!("error: {err}");
    Ok(())
}
