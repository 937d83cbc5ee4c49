//! Times the CPU forward (or, with `--backward`, the backward) on the shapes: fp32,
//! causal, 8 heads, d=128. `cargo run --release --example cpu_forward -- [--backward] 2048 4096`
//! (median and min of 11 runs; the backward's inputs come from one untimed forward).
//! `CUBEATTN_CPU_KERNEL=gemm` times the gemm-crate path instead of the AVX-512 tiles.
use cubeattn::backend::BackwardInputs;
use cubeattn::{backend_for, AttnSpec, DType, DevicePref, HostData, Pass, TensorMeta};
use std::time::Instant;

fn main() {
    let backward = std::env::args().any(|a| a == "--backward");
    let lens: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let lens = if lens.is_empty() { vec![2048, 4096] } else { lens };
    let (h, d) = (8usize, 128usize);
    for s in lens {
        let m = TensorMeta::new(&[s, h, d], DType::F32);
        let cu = [0, s as i32];
        let spec = AttnSpec::varlen(&m, &m, &m, &cu, &cu, s, s, None, true).unwrap();
        let cpu = backend_for(DevicePref::Cpu, &spec, Pass::Forward).unwrap();
        let x: Vec<f32> = (0..s * h * d).map(|i| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0).collect();
        let g: Vec<f32> = (0..s * h * d).map(|i| ((i * 40503usize) % 997) as f32 / 498.5 - 1.0).collect();
        let (q, dout) = (HostData::F32(x), HostData::F32(g));
        let f = backward.then(|| cpu.forward(&spec, q.view(), q.view(), q.view()).unwrap());
        let mut times = Vec::new();
        for _ in 0..11 {
            let t = Instant::now();
            match &f {
                Some(f) => {
                    let gin = BackwardInputs { out: f.out.view(), lse: &f.lse, dout: dout.view(), deterministic: true };
                    std::hint::black_box(cpu.backward(&spec, q.view(), q.view(), q.view(), gin).unwrap());
                }
                None => {
                    std::hint::black_box(cpu.forward(&spec, q.view(), q.view(), q.view()).unwrap());
                }
            }
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let ms = times[times.len() / 2];
        // the backward's five products: 2.5x the forward's FLOPs
        let (what, flops) = if backward { ("backward", 2.5 * spec.forward_flops()) } else { ("forward", spec.forward_flops()) };
        println!("S={s} H={h} d={d} causal fp32 {what}: median {ms:.1} ms (min {:.1}), {:.1} GFLOP/s", times[0], flops / ms / 1e6);
    }
}
