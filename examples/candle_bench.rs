//! CPU benchmark: candle's naive attention (matmul + masked softmax, materialising the S x S
//! scores) vs cubeattn's candle op, fp32 causal, batch 1, 8 heads, head_dim 128.
//!
//! `cargo run --release --features candle --example candle_bench -- all --out DIR [--sizes 1024,2048,4096] [--iters 5]`
//! runs every (impl, S) in its own process (so each peak RSS is that configuration's alone), prints
//! a table and writes `DIR/candle.json` and `DIR/candle.txt`.
//! `... -- one candle_naive|cubeattn_candle S [--iters N]` runs one configuration and prints one
//! JSON line: median/min forward time over N timed runs after one warm-up, and the process's peak
//! RSS (VmHWM) next to its RSS once the inputs exist.
use std::process::Command;
use std::time::Instant;

use candle_core::{Device, Tensor};

#[path = "common/bench_io.rs"]
mod bench_io;
#[path = "common/naive_attention.rs"]
mod naive_attention;
use bench_io::{arg_after, field};
use naive_attention::{causal_mask, naive_attention as naive};

const HEADS: usize = 8;
const HEAD_DIM: usize = 128;

fn status_kib(key: &str) -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn one(which: &str, s: usize, iters: usize) -> candle_core::Result<String> {
    let dev = Device::Cpu;
    let shape = (1, s, HEADS, HEAD_DIM);
    let q = Tensor::randn(0f32, 1.0, shape, &dev)?;
    let k = Tensor::randn(0f32, 1.0, shape, &dev)?;
    let v = Tensor::randn(0f32, 1.0, shape, &dev)?;
    let scale = 1.0 / (HEAD_DIM as f64).sqrt();
    let mask = causal_mask(s, &dev)?;
    let rss_before = status_kib("VmRSS:").unwrap_or(f64::NAN) / 1024.0;
    let run = || -> candle_core::Result<Tensor> {
        match which {
            "candle_naive" => naive(&q, &k, &v, &mask, scale),
            "cubeattn_candle" => cubeattn::candle::flash_attn(&q, &k, &v, scale as f32, true),
            other => Err(candle_core::Error::msg(format!("unknown impl {other:?}"))),
        }
    };
    let out = run()?; // warm-up (and the first touch of every buffer)
    assert_eq!(out.dims(), &[1, s, HEADS, HEAD_DIM]);
    let mut ms = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        let out = run()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        std::hint::black_box(out);
    }
    let peak = status_kib("VmHWM:").unwrap_or(f64::NAN) / 1024.0;
    let mut sorted = ms.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let med = sorted[sorted.len() / 2];
    let runs: Vec<String> = ms.iter().map(|x| format!("{x:.1}")).collect();
    Ok(format!(
        "{{\"what\": \"candle_attn\", \"impl\": \"{which}\", \"S\": {s}, \"ms\": {med:.1}, \"ms_min\": {:.1}, \"runs_ms\": [{}], \"peak_rss_mib\": {peak:.1}, \"rss_with_inputs_mib\": {rss_before:.1}}}",
        sorted[0],
        runs.join(", ")
    ))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

fn env_json() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).unwrap_or("?").trim().to_string();
    let avx512 = cpuinfo.contains(" avx512f");
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    // CUBEATTN_COMMIT names the commit where the binary runs outside a git checkout
    let commit = std::env::var("CUBEATTN_COMMIT").ok().filter(|c| !c.is_empty()).unwrap_or_else(|| {
        Command::new("git").args(["rev-parse", "--short", "HEAD"]).output().ok().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default()
    });
    format!(
        "{{\"cpu\": \"{model}\", \"threads\": {threads}, \"avx512f\": {avx512}, \"commit\": \"{commit}\", \"candle_core\": \"0.11.1\", \"dtype\": \"float32\", \"causal\": true, \"batch\": 1, \"heads\": {HEADS}, \"head_dim\": {HEAD_DIM}, \"profile\": \"release\", \"timing\": \"median of the timed runs after one warm-up, one process per row\", \"peak_rss\": \"VmHWM of that process (inputs, mask and binary included)\"}}"
    )
}

fn all(args: &[String]) -> Result<(), String> {
    let sizes: Vec<usize> = arg_after(args, "--sizes").unwrap_or_else(|| "1024,2048,4096".into()).split(',').filter_map(|x| x.parse().ok()).collect();
    let iters = arg_after(args, "--iters").unwrap_or_else(|| "5".into());
    let out_dir = arg_after(args, "--out");
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    let date = Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M UTC"]).output().ok().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    let env = env_json();
    let load_before = loadavg();
    let mut table = format!(
        "# candle attention on cpu: {}, {date}, commit {}\n",
        field(&env, "cpu"),
        field(&env, "commit")
    );
    table += &format!(
        "candle attention, CPU, fp32 causal, batch 1, {HEADS} heads, d={HEAD_DIM} (median of {iters} runs; one process per row)\n{:<16} {:>6} {:>10} {:>10} {:>14} {:>18}\n",
        "impl", "S", "ms", "min ms", "peak RSS MiB", "RSS w/ inputs MiB"
    );
    for &s in &sizes {
        for which in ["candle_naive", "cubeattn_candle"] {
            let o = Command::new(&exe).args(["one", which, &s.to_string(), "--iters", &iters]).output().map_err(|e| e.to_string())?;
            let line = String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or("").to_string();
            if !o.status.success() || !line.starts_with('{') {
                return Err(format!("{which} S={s} failed: {}{}", line, String::from_utf8_lossy(&o.stderr)));
            }
            table += &format!(
                "{:<16} {:>6} {:>10} {:>10} {:>14} {:>18}\n",
                which,
                s,
                field(&line, "ms"),
                field(&line, "ms_min"),
                field(&line, "peak_rss_mib"),
                field(&line, "rss_with_inputs_mib")
            );
            eprintln!("{line}");
            rows.push(line);
        }
    }
    // the 1/5/15-minute load averages before and after the run: other work on the machine shows here
    let env = env.replacen('{', &format!("{{\"date\": \"{date}\", \"loadavg_before\": \"{load_before}\", \"loadavg_after\": \"{}\", ", loadavg()), 1);
    let json = format!("{{\"env\": {env},\n \"rows\": [\n  {}\n ]}}\n", rows.join(",\n  "));
    print!("{table}");
    if let Some(dir) = out_dir {
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        std::fs::write(format!("{dir}/candle.json"), &json).map_err(|e| e.to_string())?;
        std::fs::write(format!("{dir}/candle.txt"), &table).map_err(|e| e.to_string())?;
        println!("wrote {dir}/candle.json and {dir}/candle.txt");
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("one") => {
            let which = args.get(1).cloned().unwrap_or_default();
            let s = args.get(2).and_then(|x| x.parse().ok()).unwrap_or(1024);
            let iters = arg_after(&args, "--iters").and_then(|x| x.parse().ok()).unwrap_or(5);
            one(&which, s, iters).map(|l| println!("{l}")).map_err(|e| e.to_string())
        }
        Some("all") => all(&args),
        _ => Err("usage: candle_bench all --out DIR [--sizes 1024,2048,4096] [--iters 5] | one IMPL S [--iters N]".into()),
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
