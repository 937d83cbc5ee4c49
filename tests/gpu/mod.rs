//! Tests that need a CUDA GPU. They skip (printing why) where the CUDA backend cannot start.

#[cfg(feature = "cuda")]
mod flash_attention;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod backward;
#[cfg(feature = "cuda")]
mod sparse;

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
fn gpu_tests_need_the_cuda_feature() {
    println!("SKIP: built without the `cuda` feature; GPU tests did not run");
}
