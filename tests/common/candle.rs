//! Helpers shared by the candle tests (tests/candle.rs on CPU tensors, tests/candle_gpu.rs on CUDA).

use candle_core::{DType as CDType, Device, Tensor};
use cubeattn::DType;
use rand::{rngs::StdRng, Rng};

/// Uniform(-1, 1) values, rounded into `dtype`, on the CPU.
pub fn rand_t(rng: &mut StdRng, shape: &[usize], dtype: CDType) -> Tensor {
    let n: usize = shape.iter().product();
    let xs: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(xs, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

/// The tensor's values, row-major, widened to f64 (copied to the host).
pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(CDType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

pub fn our_dtype(d: CDType) -> DType {
    match d {
        CDType::F32 => DType::F32,
        CDType::F16 => DType::F16,
        _ => DType::BF16,
    }
}

/// Asserts that `r` is an error whose message names `arg` (as cubeattn writes it: `arg`).
pub fn expect_err<T: std::fmt::Debug>(r: candle_core::Result<T>, arg: &str) {
    let e = r.expect_err(&format!("expected an error naming `{arg}`"));
    let msg = e.to_string();
    assert!(msg.contains(&format!("`{arg}`")), "error should name `{arg}`: {msg}");
}
