//! A small pre-norm transformer block in candle on CUDA (bf16) with cubeattn's attention: RMSNorm,
//! q/k/v projections with grouped-query heads, causal flash attention (`cubeattn::candle`), output
//! projection, RMSNorm and a SwiGLU MLP, each with a residual. It checks the block's output and
//! its gradients against the same block with candle's own attention (matmul + softmax), then takes
//! a few gradient steps on a toy regression (f32 master weights, bf16 compute) and prints the
//! loss going down.
//!
//! `cargo run --release --features candle-cuda --example candle_cuda_block` (a CUDA GPU needed;
//! scripts/build-candle-cuda.sh builds it for a GPU box without Rust). Exits non-zero when a check
//! fails.
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var, D};

#[path = "common/naive_attention.rs"]
mod naive_attention;
use naive_attention::{causal_mask, naive_attention};

const DIM: usize = 512;
const HEADS: usize = 8;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = DIM / HEADS; // 64
const HIDDEN: usize = 1376;

struct Block {
    norm1: Var,
    wq: Var,
    wk: Var,
    wv: Var,
    wo: Var,
    norm2: Var,
    w_gate: Var,
    w_up: Var,
    w_down: Var,
}

/// f32 master weights (the forward computes in bf16 copies of them).
fn weight(rows: usize, cols: usize, dev: &Device) -> candle_core::Result<Var> {
    let std = (1.0 / rows as f64).sqrt();
    Var::from_tensor(&Tensor::randn(0f32, std as f32, (rows, cols), dev)?)
}

fn ones(n: usize, dev: &Device) -> candle_core::Result<Var> {
    Var::from_tensor(&Tensor::ones(n, DType::F32, dev)?)
}

fn bf16(w: &Var) -> candle_core::Result<Tensor> {
    w.to_dtype(DType::BF16)
}

fn rms_norm(x: &Tensor, g: &Var) -> candle_core::Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let r = (x32.sqr()?.mean_keepdim(D::Minus1)? + 1e-6)?.sqrt()?;
    x32.broadcast_div(&r)?.broadcast_mul(g)?.to_dtype(x.dtype())
}

/// x `[b, s, in]` times w `[in, out]` (in bf16).
fn linear(x: &Tensor, w: &Var) -> candle_core::Result<Tensor> {
    let (b, s, n) = x.dims3()?;
    x.reshape((b * s, n))?.matmul(&bf16(w)?)?.reshape((b, s, ()))
}

impl Block {
    fn new(dev: &Device) -> candle_core::Result<Block> {
        Ok(Block {
            norm1: ones(DIM, dev)?,
            wq: weight(DIM, HEADS * HEAD_DIM, dev)?,
            wk: weight(DIM, KV_HEADS * HEAD_DIM, dev)?,
            wv: weight(DIM, KV_HEADS * HEAD_DIM, dev)?,
            wo: weight(HEADS * HEAD_DIM, DIM, dev)?,
            norm2: ones(DIM, dev)?,
            w_gate: weight(DIM, HIDDEN, dev)?,
            w_up: weight(DIM, HIDDEN, dev)?,
            w_down: weight(HIDDEN, DIM, dev)?,
        })
    }

    fn vars(&self) -> [&Var; 9] {
        [&self.norm1, &self.wq, &self.wk, &self.wv, &self.wo, &self.norm2, &self.w_gate, &self.w_up, &self.w_down]
    }

    /// x `[b, s, DIM]` -> `[b, s, DIM]`; `naive` picks candle's own attention instead of cubeattn's.
    fn forward(&self, x: &Tensor, naive: Option<&Tensor>) -> candle_core::Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let h = rms_norm(x, &self.norm1)?;
        let q = linear(&h, &self.wq)?.reshape((b, s, HEADS, HEAD_DIM))?;
        let k = linear(&h, &self.wk)?.reshape((b, s, KV_HEADS, HEAD_DIM))?;
        let v = linear(&h, &self.wv)?.reshape((b, s, KV_HEADS, HEAD_DIM))?;
        let scale = 1.0 / (HEAD_DIM as f64).sqrt();
        let att = match naive {
            None => cubeattn::candle::flash_attn(&q, &k, &v, scale as f32, true)?,
            Some(mask) => {
                // candle's attention takes equal heads: each kv head repeated for its query heads
                let rep = |t: &Tensor| -> candle_core::Result<Tensor> {
                    t.unsqueeze(3)?.broadcast_as((b, s, KV_HEADS, HEADS / KV_HEADS, HEAD_DIM))?.reshape((b, s, HEADS, HEAD_DIM))
                };
                naive_attention(&q, &rep(&k)?, &rep(&v)?, mask, scale)?
            }
        };
        let x = (x + linear(&att.reshape((b, s, HEADS * HEAD_DIM))?, &self.wo)?)?;
        let h = rms_norm(&x, &self.norm2)?;
        let mlp = (linear(&h, &self.w_gate)?.silu()? * linear(&h, &self.w_up)?)?;
        x + linear(&mlp, &self.w_down)?
    }
}

fn rel_diff(a: &Tensor, b: &Tensor) -> candle_core::Result<f32> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    let num = (&a - &b)?.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
    let den = b.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
    Ok(num / den.max(1e-12))
}

fn mse(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.sqr()?.mean_all()
}

fn main() -> candle_core::Result<()> {
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("this example needs a CUDA GPU: {}", e.to_string().lines().next().unwrap_or_default());
            std::process::exit(2);
        }
    };
    let (b, s) = (2, 1024);
    let block = Block::new(&dev)?;
    let x = Tensor::randn(0f32, 1.0, (b, s, DIM), &dev)?.to_dtype(DType::BF16)?;
    let target = Tensor::randn(0f32, 1.0, (b, s, DIM), &dev)?.to_dtype(DType::BF16)?;
    let mask = causal_mask(s, &dev)?;
    let mut failed = false;

    // 1. the block with cubeattn's attention vs the same weights with candle's attention
    let y = block.forward(&x, None)?;
    let y_naive = block.forward(&x, Some(&mask))?;
    let e = rel_diff(&y, &y_naive)?;
    println!("block output {:?} {:?} on {:?}: relative difference to candle's attention {e:.2e}", y.dims(), y.dtype(), y.device().location());
    failed |= !(e < 1e-2);
    let g = mse(&y, &target)?.backward()?;
    let g_naive = mse(&y_naive, &target)?.backward()?;
    for (name, w) in ["wq", "wk", "wv"].iter().zip([&block.wq, &block.wk, &block.wv]) {
        let (a, n) = (g.get(w).expect("grad"), g_naive.get(w).expect("grad"));
        let e = rel_diff(a, n)?;
        println!("  d{name}: relative difference to candle's attention {e:.2e}");
        failed |= !(e < 5e-2);
    }

    // 2. a few gradient steps, each moving every weight by 1% of its norm downhill: the loss goes down
    let mut first = None;
    let mut last = 0.0;
    let t = Instant::now();
    for step in 0..10 {
        let loss = mse(&block.forward(&x, None)?, &target)?;
        let grads = loss.backward()?;
        last = loss.to_scalar::<f32>()?;
        first.get_or_insert(last);
        println!("  step {step}: loss {last:.5}");
        for w in block.vars() {
            let g = grads.get(w).expect("every weight takes part in the loss");
            let norm = |t: &Tensor| -> candle_core::Result<f32> { t.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>() };
            let step = 0.01 * norm(w.as_tensor())? / norm(g)?.max(1e-30);
            w.set(&(w.as_tensor() - (g * step as f64)?)?)?;
        }
    }
    dev.synchronize()?;
    println!("10 training steps (batch {b}, {s} tokens) in {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    let first = first.unwrap_or(f32::NAN);
    failed |= !(last < first);
    if failed {
        eprintln!("FAILED: see the differences and losses above");
        std::process::exit(1);
    }
    println!("ok: loss {first:.5} -> {last:.5}");
    Ok(())
}
