//! Shared-memory addresses of `ldmatrix` and `cp.async`: CubeCL passes `shared_memory_N + l_i`
//! (a generic pointer plus a u32 element index) and its wrappers convert that pointer with
//! `__cvta_generic_to_shared`. The index is a u32 sum (`row * stride + col + 8`), and the pointer
//! add widens it to 64 bits first, so the compiler may not split the wrapped 32-bit sum: every
//! `LDSM` got its own add and shift instead of an immediate offset from a shared base register.
//! [`smem_addresses`] makes the wrappers take the 32-bit shared address and computes it at the
//! call as `cvta(base) + index * sizeof(element)` in u32 arithmetic, where constant parts fold
//! (the forward at 8K causal went from 1.90 to 1.77 ms on an H200, docs/cuda-build.md).

use super::{add_helper, mismatch};
use crate::error::Result;

const SMEM_AT: &str = "
template <typename T, typename I>
__device__ __forceinline__ uint32 __cubeattn_smem(T *base, I index) {
  return static_cast<uint32>(__cvta_generic_to_shared(base)) + static_cast<uint32>(index) * uint32(sizeof(T));
}
";
const LDSM_PARAM: &str = "void const *row_addr) {\n  uint32 addr = static_cast<uint32>(__cvta_generic_to_shared(row_addr));";
const CP_PARAM: &str = "void *smem_ptr";
const CP_CVTA: &str = "  uint32 smem_int_ptr = static_cast<uint32>(__cvta_generic_to_shared(smem_ptr));\n";

/// Rewrites the `ldmatrix` and `cp.async` wrappers of kernel `entry` to take 32-bit shared
/// addresses, and their calls to pass `__cubeattn_smem(shared_memory_N, l_i)` (a no-op for
/// kernels without them). A call whose shared operand is not `shared_memory_N + index` is refused.
pub(crate) fn smem_addresses(entry: &str, src: &str) -> Result<String> {
    let bad = |what: &str| mismatch(entry, "smem_addresses", what);
    let ldsm_defs = src.matches("__device__ void\n__ldmatrix_").count();
    let cp_defs = src.matches("(void const *src_ptr, ").count();
    if ldsm_defs + cp_defs == 0 {
        return Ok(src.to_string());
    }
    if src.matches(LDSM_PARAM).count() != ldsm_defs {
        return Err(bad("an ldmatrix wrapper that does not convert a `row_addr` pointer"));
    }
    if src.matches(CP_PARAM).count() != cp_defs || src.matches(CP_CVTA).count() != cp_defs {
        return Err(bad("a cp.async wrapper that does not convert an `smem_ptr` pointer"));
    }
    let defs = src.replace(LDSM_PARAM, "uint32 addr) {").replace(CP_CVTA, "").replace(CP_PARAM, "uint32 smem_int_ptr");
    let mut out = String::with_capacity(defs.len() + 4096);
    let mut calls = 0usize;
    for line in defs.lines() {
        let t = line.trim_start();
        let is_call = (t.starts_with("__ldmatrix_") || t.starts_with("__cp_async_shared_global<")) && t.ends_with(");");
        if !is_call || t.contains("uint32 &reg_0") {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        let found: Vec<_> = line.match_indices("shared_memory_").collect();
        let [(at, _)] = found[..] else {
            return Err(bad(&format!("a call without exactly one shared_memory operand: `{t}`")));
        };
        let rest = &line[at..];
        let end = rest.find([',', ')']).ok_or_else(|| bad(&format!("an unterminated call: `{t}`")))?;
        let Some((base, index)) = rest[..end].split_once(" + ") else {
            return Err(bad(&format!("a shared operand that is not `shared_memory_N + index`: `{t}`")));
        };
        let plain = |x: &str| !x.is_empty() && x.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !plain(base) || !plain(index) {
            return Err(bad(&format!("a shared operand that is not `shared_memory_N + index`: `{t}`")));
        }
        out.push_str(&line[..at]);
        out.push_str(&format!("__cubeattn_smem({base}, {index})"));
        out.push_str(&rest[end..]);
        out.push('\n');
        calls += 1;
    }
    if calls == 0 {
        return Err(bad("ldmatrix / cp.async wrappers but no call of them"));
    }
    add_helper(entry, "smem_addresses", &mut out, SMEM_AT)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const WRAPPERS: &str = "typedef signed long long int int64;\n\
        template <>\ninline __device__ void\n__cp_async_shared_global<16>(void const *src_ptr, void *smem_ptr) {\n\
        \x20 uint64 gmem_int_desc = reinterpret_cast<uint64>(src_ptr);\n\
        \x20 uint32 smem_int_ptr = static_cast<uint32>(__cvta_generic_to_shared(smem_ptr));\n\
        \x20 asm volatile(\"cp.async\" :: \"r\"(smem_int_ptr));\n}\n\
        inline __device__ void\n__ldmatrix_m8n8___nv_bfloat16_4x(uint32 &reg_0, void const *row_addr) {\n\
        \x20 uint32 addr = static_cast<uint32>(__cvta_generic_to_shared(row_addr));\n\
        \x20 asm volatile(\"ldmatrix\" : \"=r\"(reg_0) : \"r\"(addr));\n}\n\
        void k() {\n__cp_async_shared_global<16>(buffer_7 + l_615, shared_memory_4 + l_619);\n\
        __ldmatrix_m8n8___nv_bfloat16_4x(reinterpret_cast<uint32&>(l_arr_1[0]), shared_memory_1 + l_1079);\n}\n";

    #[test]
    fn shared_address_rewrite() {
        let out = smem_addresses("k", WRAPPERS).unwrap();
        assert!(out.contains("__cp_async_shared_global<16>(buffer_7 + l_615, __cubeattn_smem(shared_memory_4, l_619));"), "{out}");
        assert!(out.contains("(reinterpret_cast<uint32&>(l_arr_1[0]), __cubeattn_smem(shared_memory_1, l_1079));"), "{out}");
        assert!(out.contains("(void const *src_ptr, uint32 smem_int_ptr)") && out.contains("(uint32 &reg_0, uint32 addr) {"), "{out}");
        assert!(!out.contains("__cvta_generic_to_shared(row_addr)") && !out.contains("__cvta_generic_to_shared(smem_ptr)"), "{out}");
        assert!(out.find("__cubeattn_smem(T *base").unwrap() < out.find("__cp_async_shared_global<16>(void").unwrap());
        assert_eq!(smem_addresses("k", "no wrappers").unwrap(), "no wrappers");
    }

    #[test]
    fn refuses_other_operands_and_wrappers() {
        // a shared operand of another form, or a wrapper that changed, is refused
        assert!(smem_addresses("k", &WRAPPERS.replace("shared_memory_1 + l_1079", "shared_memory_1 + l_1 * 2")).is_err());
        assert!(smem_addresses("k", &WRAPPERS.replace("shared_memory_1 + l_1079", "&shared_memory_1[l_1079]")).is_err());
        assert!(smem_addresses("k", &WRAPPERS.replace("(__cvta_generic_to_shared(row_addr))", "(row_addr)")).is_err());
    }
}
