//! The one place where cubeattn edits the CUDA source CubeCL generates, before NVRTC compiles it:
//! one patch per file, each refusing (an error naming the kernel and the patch, [`mismatch`]) any
//! output it does not recognise, so a CubeCL that prints differently fails at the first compile
//! instead of building a slower or wrong kernel.
//!
//! In the order they apply: to every kernel, by `compile::codegen`,
//! - [`smem_layout`]: the shared buffers placed in declaration order (CubeCL's order is a hash
//!   set's);
//!
//! to the kernels that use `kernels::math::fast_exp2`, by `compile::codegen_exp2`,
//! - [`exp2`]: `__powf(2, x)` (CubeCL has no exp2) into `exp2f(x)`;
//! - [`mbarriers`]: the cp.async barriers' copy arrivals made `.noinc`, and their waits as a plain
//!   `try_wait` loop;
//! - [`bulk_adds`]: the reversed cp.async calls of `kernels::bulk_reduce` into bulk f32 reductions;
//! - [`smem_addresses`]: 32-bit shared addresses for the `ldmatrix` and `cp.async` wrappers;
//! - [`stmatrix`]: a store path for `stmatrix` below sm_90 (and in the portable build);
//!
//! and by the launchers, to the kernels that need them,
//! - [`sm90`]: the `kernels::sm90` markers lowered to wgmma / fence inline PTX;
//! - [`min_blocks`]: a minimum-blocks launch bound (a register cap);
//! - [`int8_words`]: CubeCL's 4 x int8 struct as one 32-bit word.

use crate::error::{Error, Result};

/// The preprocessor condition of the sm_90-only instructions the rewrites emit (`try_wait`,
/// `stmatrix`): an sm_90+ target, and not the portable build (`Target::stmatrix` on the host;
/// `Target::nvrtc_defines` defines `CUBEATTN_PORTABLE`).
macro_rules! if_sm90 {
    () => {
        "#if __CUDA_ARCH__ >= 900 && !defined(CUBEATTN_PORTABLE)\n"
    };
}

mod bulk_adds;
mod exp2;
mod int8_words;
mod mbarriers;
mod min_blocks;
pub(crate) mod sm90;
mod smem_addresses;
mod smem_layout;
mod stmatrix;

pub(crate) use bulk_adds::{bulk_adds, BULK_ADD};
pub(crate) use exp2::exp2_calls;
pub(crate) use int8_words::int8_words;
pub(crate) use mbarriers::mbarriers;
pub(crate) use min_blocks::min_blocks;
pub(crate) use smem_addresses::smem_addresses;
pub(crate) use smem_layout::smem_layout;
pub(crate) use stmatrix::stmatrix_fallback;

/// The last of the typedefs CubeCL prints before the kernel: helpers the rewrites add go after it.
const LAST_TYPEDEF: &str = "typedef signed long long int int64;\n";

/// Places `helper` (device code a rewrite calls) after CubeCL's typedefs in `src`, the source of
/// kernel `entry` as rewrite `rewrite` made it.
fn add_helper(entry: &str, rewrite: &str, src: &mut String, helper: &str) -> Result<()> {
    let at = src.find(LAST_TYPEDEF).ok_or_else(|| mismatch(entry, rewrite, "no int64 typedef to place its helper after"))?;
    src.insert_str(at + LAST_TYPEDEF.len(), helper);
    Ok(())
}

/// The error of rewrite `rewrite` (its file name under `rewrite/`) that does not recognise
/// CubeCL's output for kernel `entry`.
fn mismatch(entry: &str, rewrite: &str, what: &str) -> Error {
    Error::Device(format!(
        "CubeCL's generated source for {entry} has {what}: the {rewrite} rewrite (src/backend/cuda/rewrite/{rewrite}.rs) \
         does not match this CubeCL version's output"
    ))
}
