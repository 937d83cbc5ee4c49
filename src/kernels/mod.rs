//! CubeCL kernels (`#[cube]` code only), one file per kernel family. Built with feature `cuda`.

pub mod flash_fwd;
pub mod rowwise_fwd;
pub mod flash_bwd;
