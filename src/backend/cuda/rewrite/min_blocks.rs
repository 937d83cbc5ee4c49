//! A minimum-blocks launch bound: CubeCL prints `__launch_bounds__(threads)` on every kernel and
//! has no way to ask ptxas for fewer registers per thread; [`min_blocks`] adds the second argument.

use super::mismatch;
use crate::error::Result;

/// Asks ptxas for `blocks` resident cubes per multiprocessor: CubeCL prints
/// `__launch_bounds__(threads)` on every kernel; this adds the minimum-blocks argument, which caps
/// the registers per thread at 65536 / (blocks x threads) (NVRTC's `-maxrregcount` does not apply
/// to a kernel that has launch bounds). Used by the d64 forward (three cubes of 128 threads:
/// 168 registers instead of 214, 3-8% faster; docs/forward.md) and the INT8 quantisation pass
/// (`sparse_int8::quantize_source`: four cubes of 256 threads, 64 registers).
pub(crate) fn min_blocks(entry: &str, src: &str, blocks: u32) -> Result<String> {
    let at = src.find("__launch_bounds__(").ok_or_else(|| mismatch(entry, "min_blocks", "no `__launch_bounds__(`"))?;
    let rest = &src[at + "__launch_bounds__(".len()..];
    let close = rest.find(')').ok_or_else(|| mismatch(entry, "min_blocks", "an unterminated `__launch_bounds__`"))?;
    let threads = &rest[..close];
    if threads.is_empty() || !threads.chars().all(|c| c.is_ascii_digit()) || src[at + 1..].contains("__launch_bounds__(") {
        return Err(mismatch(entry, "min_blocks", "not one `__launch_bounds__(threads)`"));
    }
    let mut out = String::with_capacity(src.len() + 8);
    out.push_str(&src[..at]);
    out.push_str(&format!("__launch_bounds__({threads}, {blocks})"));
    out.push_str(&rest[close + 1..]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_blocks_adds_the_second_launch_bound() {
        let src = "extern \"C\" __global__ void __launch_bounds__(128)k_ (\n int x) {}";
        assert_eq!(
            min_blocks("k_", src, 3).unwrap(),
            "extern \"C\" __global__ void __launch_bounds__(128, 3)k_ (\n int x) {}"
        );
    }

    #[test]
    fn refuses_a_kernel_without_one_plain_bound() {
        assert!(min_blocks("k_", "__global__ void k_() {}", 3).is_err());
        assert!(min_blocks("k_", "__launch_bounds__(128, 2)k_", 3).is_err());
    }
}
