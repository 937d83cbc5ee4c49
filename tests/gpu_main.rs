//! GPU test target: `cargo test --release --features cuda --test gpu_main`.
//! Every test prints a reason and passes when no CUDA device (or no `cuda` feature) is present.

#[allow(dead_code)]
mod common;
mod gpu;
