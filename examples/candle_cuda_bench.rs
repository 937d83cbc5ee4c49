//! CUDA benchmark: cubeattn's candle op vs candle's own attention (matmul + masked softmax in
//! candle-core ops, `common/naive_attention.rs`), both on candle CUDA tensors in one process,
//! causal, forward (`candle_fwd`) and forward + backward through candle's autograd
//! (`candle_fwdbwd`: out, then `(out * dout).sum_all().backward()` for both).
//!
//! `cargo run --release --features candle-cuda --example candle_cuda_bench -- [--out DIR]
//!  [--sizes 1024,2048,4096,8192] [--batch 1] [--heads 16] [--head-dim 128] [--dtype bf16|f16]
//!  [--iters 20] [--warmup 3]`
//! prints a table and, with --out, writes `DIR/candle_cuda.json` (`{"env": ..., "rows": [{what,
//! impl, dtype, batch, seqlen, heads, head_dim, causal, ms, ...}]}`) and `DIR/candle_cuda.txt`.
//! Times are the median (and min) over the timed iterations after the warm-up, each iteration
//! ended by a device synchronize. Before timing, every size checks cubeattn's output against
//! candle's (relative difference in the cubeattn forward row); a configuration that fails (out
//! of memory, say) gets a row with `ms: null` and the error.
use std::process::Command;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};

#[path = "common/bench_io.rs"]
mod bench_io;
#[path = "common/naive_attention.rs"]
mod naive_attention;
use bench_io::{arg_after, field};
use naive_attention::{causal_mask, naive_attention};

struct Cfg {
    batch: usize,
    heads: usize,
    head_dim: usize,
    dtype: DType,
    iters: usize,
    warmup: usize,
}

fn num(args: &[String], flag: &str, default: usize) -> Result<usize, String> {
    match arg_after(args, flag) {
        None => Ok(default),
        Some(x) => x.parse().map_err(|_| format!("{flag} takes a positive integer, got {x:?}")),
    }
}

/// Median and min of `ms`.
fn stats(ms: &mut [f64]) -> (f64, f64) {
    ms.sort_by(|a, b| a.total_cmp(b));
    (ms[ms.len() / 2], ms[0])
}

/// Times `step` (one iteration, then a device synchronize): (median ms, min ms).
fn time(dev: &Device, cfg: &Cfg, mut step: impl FnMut() -> candle_core::Result<()>) -> candle_core::Result<(f64, f64)> {
    for _ in 0..cfg.warmup {
        step()?;
    }
    dev.synchronize()?;
    let mut ms = Vec::with_capacity(cfg.iters);
    for _ in 0..cfg.iters {
        let t = Instant::now();
        step()?;
        dev.synchronize()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(stats(&mut ms))
}

fn rel_diff(a: &Tensor, b: &Tensor) -> candle_core::Result<f64> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    let num = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    let den = b.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    Ok((num / den.max(1e-30)).sqrt())
}

/// The rows of one sequence length: (what, impl, result: (median, min) ms or the error).
fn measure(dev: &Device, cfg: &Cfg, s: usize) -> Vec<String> {
    let (b, h, d) = (cfg.batch, cfg.heads, cfg.head_dim);
    let scale = 1.0 / (d as f64).sqrt();
    let mut rows = Vec::new();
    let setup = || -> candle_core::Result<(Var, Var, Var, Tensor, Tensor)> {
        let r = |_| -> candle_core::Result<Var> { Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, s, h, d), dev)?.to_dtype(cfg.dtype)?) };
        let (q, k, v) = (r(0)?, r(1)?, r(2)?);
        let dout = Tensor::randn(0f32, 1.0, (b, s, h, d), dev)?.to_dtype(cfg.dtype)?;
        Ok((q, k, v, dout, causal_mask(s, dev)?))
    };
    let (q, k, v, dout, mask) = match setup() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("S={s}: inputs: {e}");
            return rows;
        }
    };
    let ours = |q: &Tensor, k: &Tensor, v: &Tensor| cubeattn::candle::flash_attn(q, k, v, scale as f32, true);
    let naive = |q: &Tensor, k: &Tensor, v: &Tensor| naive_attention(q, k, v, &mask, scale);
    let check = (|| rel_diff(&ours(&q, &k, &v)?, &naive(&q, &k, &v)?))();
    let flops_fwd = 4.0 * (b * h * s * s * d) as f64 / 2.0; // causal: half the score matrix
    for what in ["candle_fwd", "candle_fwdbwd"] {
        for (imp, f) in [("cubeattn", &ours as &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>), ("candle_naive", &naive)] {
            let r = if what == "candle_fwd" {
                time(dev, cfg, || f(&q, &k, &v).map(drop))
            } else {
                time(dev, cfg, || {
                    let out = f(&q, &k, &v)?;
                    (out * &dout)?.sum_all()?.backward().map(drop)
                })
            };
            let flops = if what == "candle_fwd" { flops_fwd } else { 3.5 * flops_fwd };
            let dt = if cfg.dtype == DType::BF16 { "bfloat16" } else { "float16" };
            let keys = format!(
                "\"what\": \"{what}\", \"impl\": \"{imp}\", \"dtype\": \"{dt}\", \"batch\": {b}, \"seqlen\": {s}, \"heads\": {h}, \"head_dim\": {d}, \"causal\": true"
            );
            let extra = match (&check, imp, what) {
                (Ok(e), "cubeattn", "candle_fwd") => format!(", \"rel_diff_vs_candle_naive\": {e:.3e}"),
                (Err(e), "cubeattn", "candle_fwd") => format!(", \"check_error\": {:?}", e.to_string()),
                _ => String::new(),
            };
            let row = match r {
                Ok((med, min)) => format!("{{{keys}, \"ms\": {med:.4}, \"ms_min\": {min:.4}, \"tflops\": {:.2}{extra}}}", flops / med / 1e9),
                Err(e) => format!("{{{keys}, \"ms\": null, \"error\": {:?}{extra}}}", e.to_string()),
            };
            eprintln!("{row}");
            rows.push(row);
        }
    }
    rows
}

fn env_json(dev: &Device, cfg: &Cfg) -> String {
    let sh = |cmd: &str, args: &[&str]| {
        Command::new(cmd).args(args).output().ok().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default()
    };
    let gpu = sh("nvidia-smi", &["--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0"]);
    // CUBEATTN_COMMIT names the commit where the binary runs outside a git checkout
    let commit = std::env::var("CUBEATTN_COMMIT").ok().filter(|c| !c.is_empty()).unwrap_or_else(|| sh("git", &["rev-parse", "--short", "HEAD"]));
    let date = sh("date", &["-u", "+%Y-%m-%dT%H:%M UTC"]);
    format!(
        "{{\"date\": \"{date}\", \"gpu\": {gpu:?}, \"device\": \"{:?}\", \"commit\": \"{commit}\", \"candle_core\": \"0.11.1\", \"profile\": \"release\", \"iters\": {}, \"warmup\": {}, \"timing\": \"median (and min) wall time per iteration, each ended by a device synchronize; both impls in this process on the same inputs\", \"fwdbwd\": \"out = attention(q, k, v); (out * dout).sum_all().backward()\", \"naive\": \"candle-core ops: bf16/f16 matmuls, masked softmax in f32\"}}",
        dev.location(),
        cfg.iters,
        cfg.warmup
    )
}

fn main_() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("usage: candle_cuda_bench [--out DIR] [--sizes 1024,2048,4096,8192] [--batch 1] [--heads 16] [--head-dim 128] [--dtype bf16|f16] [--iters 20] [--warmup 3]");
        return Ok(());
    }
    let sizes: Vec<usize> = arg_after(&args, "--sizes")
        .unwrap_or_else(|| "1024,2048,4096,8192".into())
        .split(',')
        .map(|x| x.parse().map_err(|_| format!("--sizes takes comma-separated integers, got {x:?}")))
        .collect::<Result<_, _>>()?;
    let dtype = match arg_after(&args, "--dtype").as_deref() {
        None | Some("bf16") | Some("bfloat16") => DType::BF16,
        Some("f16") | Some("float16") => DType::F16,
        Some(x) => return Err(format!("--dtype takes bf16 or f16, got {x:?}")),
    };
    let cfg = Cfg {
        batch: num(&args, "--batch", 1)?,
        heads: num(&args, "--heads", 16)?,
        head_dim: num(&args, "--head-dim", 128)?,
        dtype,
        iters: num(&args, "--iters", 20)?.max(1),
        warmup: num(&args, "--warmup", 3)?,
    };
    let dev = Device::new_cuda(0).map_err(|e| format!("this benchmark needs a CUDA GPU: {}", e.to_string().lines().next().unwrap_or_default()))?;
    let env = env_json(&dev, &cfg);
    let mut rows = Vec::new();
    let mut table = format!(
        "# candle attention on CUDA: {}, commit {}, {}\ncausal, {:?}, batch {}, {} heads, d={} (median of {} iterations)\n{:<14} {:<13} {:>7} {:>10} {:>10} {:>8}  {}\n",
        field(&env, "gpu"),
        field(&env, "commit"),
        field(&env, "date"),
        cfg.dtype,
        cfg.batch,
        cfg.heads,
        cfg.head_dim,
        cfg.iters,
        "what",
        "impl",
        "S",
        "ms",
        "min ms",
        "TFLOP/s",
        "note"
    );
    for &s in &sizes {
        for row in measure(&dev, &cfg, s) {
            let note = match (field(&row, "error"), field(&row, "rel_diff_vs_candle_naive")) {
                ("", "") => String::new(),
                ("", e) => format!("rel diff vs candle_naive {e}"),
                (e, _) => e.chars().take(60).collect(),
            };
            table += &format!(
                "{:<14} {:<13} {:>7} {:>10} {:>10} {:>8}  {note}\n",
                field(&row, "what"),
                field(&row, "impl"),
                s,
                field(&row, "ms"),
                field(&row, "ms_min"),
                field(&row, "tflops")
            );
            rows.push(row);
        }
    }
    print!("{table}");
    if let Some(dir) = arg_after(&args, "--out") {
        let json = format!("{{\"env\": {env},\n \"rows\": [\n  {}\n ]}}\n", rows.join(",\n  "));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        std::fs::write(format!("{dir}/candle_cuda.json"), json).map_err(|e| e.to_string())?;
        std::fs::write(format!("{dir}/candle_cuda.txt"), &table).map_err(|e| e.to_string())?;
        println!("wrote {dir}/candle_cuda.json and {dir}/candle_cuda.txt");
    }
    if rows.iter().any(|r| field(r, "impl") == "cubeattn" && field(r, "ms") == "null") {
        return Err("a cubeattn configuration failed (see the rows above)".into());
    }
    Ok(())
}

fn main() {
    if let Err(e) = main_() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
