//! Tests that need a CUDA GPU. They skip (printing why) where the CUDA backend cannot start.

#[cfg(feature = "cuda")]
mod flash_attention;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod backward;

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_tests_need_the_cuda_feature() {
    println!("SKIP: built without the `cuda` feature; GPU tests did not run");
}
