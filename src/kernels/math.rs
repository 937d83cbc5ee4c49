//! Scalar math shared by the tensor-core kernels.
//!
//! The softmax of the flash kernels runs in base 2, as FlashAttention-2's does: the host passes
//! `scale * log2(e)`, scores become `2^(s * scale_log2 - m)` (one FFMA and one `ex2.approx` per
//! score), and a natural-log LSE is `m * ln(2) + ln(l)`.

use cubecl::prelude::*;

/// ln(2), to turn a base-2 running maximum back into a natural-log LSE.
pub const LN2: f32 = core::f32::consts::LN_2;
/// log2(e), to move a natural-log LSE into base 2.
pub const LOG2E: f32 = core::f32::consts::LOG2_E;

/// `2^x` through the hardware approximation. CubeCL 0.10 has no exp2 operation: this is written
/// as `powf(2, x)` under fast-math flags, which CubeCL emits as `__powf(2, x)`; cubeattn's
/// compile step rewrites that call into `exp2f(x)` (`src/backend/cuda/rewrite/exp2.rs`; `rewrite/`
/// is the one place that edits generated source), which NVRTC with `-ftz=true` turns into a single
/// `MUFU.EX2`.
#[cube(fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
pub fn fast_exp2(x: f32) -> f32 {
    f32::powf(2.0f32, x)
}

/// Channel `e` (0..8) of a 16-byte vector of eight f16 / bf16 channels read as four u32 words
/// (the quantisation passes' loads of Q, K and V rows), as f32.
#[cube]
pub fn channel8<E: Float, NX: Size>(v: &Vector<u32, NX>, #[comptime] e: usize) -> f32 {
    f32::cast_from(Vector::<E, Const<2>>::reinterpret(v[e / 2])[e % 2])
}
