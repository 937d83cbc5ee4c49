//! `stmatrix` (the backward's P / dS stores, `kernels::fragments::store_acc_16x16`) is sm_90+.
//! [`stmatrix_fallback`] keeps it on sm_90+ and, below (or with `CUBEATTN_PORTABLE` defined:
//! `CUBEATTN_CUDA_PORTABLE=1`, how the pre-Hopper code is tested on a Hopper GPU), stores each of
//! the four 8 x 8 matrices with one 32-bit shared store per lane: the lane holding row `lane / 4`
//! of matrix `i` (its columns `2 (lane % 4), +1`, register `i`) takes that row's address from lane
//! `8 i + lane / 4` by a shuffle, as `stmatrix` itself pairs them.

use super::mismatch;
use crate::error::Result;

const STMATRIX_X4: &str = "  asm volatile(\"stmatrix.sync.aligned.m8n8.x4.shared::cta.b16\"\n               \" [%0], {%1, %2, %3, %4};\"\n               :: \"r\"(addr), \"r\"(reg_0), \"r\"(reg_1), \"r\"(reg_2), \"r\"(reg_3));\n";
const STMATRIX_BY_LANES: &str = "#else
  {
    uint32 lane;
    asm volatile(\"mov.u32 %0, %%laneid;\" : \"=r\"(lane));
    const uint32 regs[4] = {reg_0, reg_1, reg_2, reg_3};
    #pragma unroll
    for (uint32 i = 0; i < 4; ++i) {
      const uint32 row = __shfl_sync(0xffffffffu, addr, 8u * i + lane / 4u);
      asm volatile(\"st.shared.b32 [%0], %1;\" :: \"r\"(row + 4u * (lane % 4u)), \"r\"(regs[i]) : \"memory\");
    }
  }
#endif
";

/// Gives kernel `entry`'s `stmatrix` x4 wrappers a store path below sm_90 (and with
/// `CUBEATTN_PORTABLE`): four shuffled row addresses and four 32-bit stores per lane (module
/// docs). A no-op without `stmatrix`; any other `stmatrix` form (`.trans`, x1 / x2) is refused.
pub(crate) fn stmatrix_fallback(entry: &str, src: &str) -> Result<String> {
    let all = src.matches("\"stmatrix.").count();
    if all == 0 {
        return Ok(src.to_string());
    }
    if src.matches(STMATRIX_X4).count() != all {
        return Err(mismatch(entry, "stmatrix", "a stmatrix that is not the non-transposed x4 store this rewrite knows"));
    }
    let guarded = format!("{}{STMATRIX_X4}{STMATRIX_BY_LANES}", if_sm90!());
    Ok(src.replace(STMATRIX_X4, &guarded))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `stmatrix` x4 wrapper as CubeCL prints it.
    fn wrapper() -> String {
        format!("void f(uint32 const &reg_0, uint32 addr) {{\n{STMATRIX_X4}}}\n")
    }

    #[test]
    fn stmatrix_gets_a_store_path_below_sm90() {
        let wrapper = wrapper();
        let out = stmatrix_fallback("k", &wrapper).unwrap();
        assert!(out.contains(STMATRIX_X4) && out.contains("__shfl_sync") && out.contains("st.shared.b32"), "{out}");
        assert!(out.find("#if __CUDA_ARCH__ >= 900").unwrap() < out.find("stmatrix.sync").unwrap());
        assert_eq!(stmatrix_fallback("k", "no stores").unwrap(), "no stores");
    }

    #[test]
    fn refuses_other_stmatrix_forms() {
        let trans = wrapper().replace("m8n8.x4.shared", "m8n8.x4.trans.shared");
        assert!(stmatrix_fallback("k", &trans).is_err());
    }
}
