//! GPU test target: `cargo test --release --features cuda --test gpu_main -- --include-ignored`
//! (what `scripts/gpu-test.sh test` runs). The tests are `#[ignore]`d with the reason "needs a
//! CUDA GPU", so without a GPU they show as ignored, not as passing.

#[allow(dead_code)]
mod common;
mod gpu;
