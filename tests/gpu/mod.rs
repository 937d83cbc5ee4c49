//! Tests that need a CUDA GPU. Each is `#[ignore]`d with the reason, so a plain `cargo test`
//! (CI, no GPU) lists them as ignored instead of a silent `ok`; `scripts/gpu-test.sh test` runs
//! them with `--include-ignored` and `CUBEATTN_REQUIRE_GPU=1` (a CUDA backend that cannot start
//! is then a failure, not a skip).

#[cfg(feature = "cuda")]
mod flash_attention;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod backward;
#[cfg(feature = "cuda")]
mod nonfinite;
#[cfg(feature = "cuda")]
mod sparse;
#[cfg(feature = "cuda")]
mod zigzag;

/// The CUDA backend of device 0, or None (printing why) where it cannot start; a failure instead
/// under CUBEATTN_REQUIRE_GPU=1 (scripts/gpu-test.sh sets it).
#[cfg(feature = "cuda")]
fn backend() -> Option<&'static cubeattn::backend::cuda::CudaBackend> {
    match cubeattn::backend::cuda::CudaBackend::shared() {
        Ok(b) => Some(b),
        Err(e) => {
            assert!(std::env::var_os("CUBEATTN_REQUIRE_GPU").is_none(), "CUDA backend unavailable: {e}");
            println!("SKIP: CUDA backend unavailable: {e}");
            None
        }
    }
}

/// Normal(0, scale^2) values rounded into `dtype` (fresh inputs for every case; never zeros).
#[cfg(feature = "cuda")]
fn random(n: usize, dtype: cubeattn::DType, scale: f32, rng: &mut rand::rngs::StdRng) -> cubeattn::HostData {
    use rand_distr::{Distribution, StandardNormal};
    let x: Vec<f32> = (0..n)
        .map(|_| {
            let z: f64 = StandardNormal.sample(rng);
            scale * z as f32
        })
        .collect();
    cubeattn::HostData::from_f32(dtype, &x)
}

#[cfg(not(feature = "cuda"))]
#[test]
#[ignore = "built without the `cuda` feature: the GPU tests are not compiled"]
fn gpu_tests_need_the_cuda_feature() {}
