//! Bulk reductions (`kernels::bulk_reduce`, sm_90+): CubeCL 0.10 cannot express
//! `cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32`. The kernels write it as a
//! `copy_async` from a shared f32 tile to a global f32 buffer, which CubeCL prints as a cp.async
//! call with the operands reversed (`__cp_async_shared_global<BYTES>(shared_memory_N + i,
//! buffer_M + j)`, a direction no other kernel uses). [`bulk_adds`] turns exactly those calls into
//! the reduction; an operand of another form or type is refused, and a reversed call left
//! unrewritten would fail the wrapper's size check at compile time.

use super::{add_helper, mismatch};
use crate::error::Result;

/// The helper [`bulk_adds`] calls: `BYTES` of f32 at shared `src` added into global `dst` by the
/// copy engine, committed as its own bulk group.
const BULK_AT: &str = "
template <int BYTES>
__device__ __forceinline__ void __cubeattn_bulk_add_f32(void *dst, const void *src) {
  static_assert(BYTES > 0 && BYTES % 16 == 0, \"bulk reductions move multiples of 16 bytes\");
  asm volatile(\"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\\n\"
               :: \"l\"(dst), \"r\"(static_cast<uint32>(__cvta_generic_to_shared(src))), \"n\"(BYTES) : \"memory\");
}
";
/// What a kernel holds once [`bulk_adds`] rewrote a call.
pub(crate) const BULK_ADD: &str = "__cubeattn_bulk_add_f32<";

/// Rewrites every cp.async call of kernel `entry` whose source is shared memory and destination a
/// global buffer (`kernels::bulk_reduce`'s marker) into an f32 bulk reduction of the same bytes
/// (a no-op for kernels without one). Both operands must be `name + index` of f32 memory
/// (`float`, `float_2` or `float_4`), the byte count a multiple of 16.
pub(crate) fn bulk_adds(entry: &str, src: &str) -> Result<String> {
    let bad = |what: &str| mismatch(entry, "bulk_adds", what);
    const CALL: &str = "__cp_async_shared_global<";
    let f32_type = |decl: &str| ["float", "float_2", "float_4"].contains(&decl);
    let plain = |x: &str| !x.is_empty() && x.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    let mut out = String::with_capacity(src.len() + 1024);
    let mut calls = 0usize;
    for line in src.lines() {
        let t = line.trim();
        let reversed = t.strip_prefix(CALL).and_then(|r| r.split_once(">(")).filter(|(_, r)| r.starts_with("shared_memory_"));
        let Some((bytes, args)) = reversed else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let n: u32 = bytes.parse().map_err(|_| bad(&format!("a byte count that is not a number: `{t}`")))?;
        let ops = args.strip_suffix(");").and_then(|a| a.split_once(", "));
        let parts = ops.and_then(|(s, d)| Some((s.split_once(" + ")?, d.split_once(" + ")?)));
        let Some(((smem, si), (buf, bi))) = parts else {
            return Err(bad(&format!("operands that are not `shared_memory_N + i, buffer_M + j`: `{t}`")));
        };
        if n == 0 || !n.is_multiple_of(16) || ![smem, si, buf, bi].iter().all(|x| plain(x)) || !buf.starts_with("buffer_") {
            return Err(bad(&format!("operands that are not `shared_memory_N + i, buffer_M + j` of 16-byte multiples: `{t}`")));
        }
        let smem_type = src.split_once(&format!(" *{smem} = reinterpret_cast<")).map(|(pre, _)| pre.rsplit('\n').next().unwrap_or(""));
        let buf_type = src.split_once(&format!("* {buf},")).or_else(|| src.split_once(&format!("* {buf}\n"))).map(|(pre, _)| pre.rsplit([' ', '(']).next().unwrap_or(""));
        if !smem_type.is_some_and(f32_type) || !buf_type.is_some_and(f32_type) {
            return Err(bad(&format!("a bulk reduction of memory that is not f32 (`{smem_type:?}`, `{buf_type:?}`): `{t}`")));
        }
        out.push_str(&format!("{BULK_ADD}{n}>({buf} + {bi}, {smem} + {si});\n"));
        calls += 1;
    }
    if calls == 0 {
        return Ok(src.to_string());
    }
    if !src.ends_with('\n') {
        out.pop();
    }
    add_helper(entry, "bulk_adds", &mut out, BULK_AT)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BULK: &str = "typedef signed long long int int64;\n\
        extern \"C\" __global__ void k(float_2* buffer_6, float_2* buffer_7, const __grid_constant__ info_st info\n) {\n\
        float_2 *shared_memory_5 = reinterpret_cast<float_2*>(&dynamic_shared_mem[16]);\n\
        __cp_async_shared_global<512>(shared_memory_5 + l_9, buffer_7 + l_12);\n\
        __cp_async_shared_global<16>(buffer_7 + l_1, shared_memory_5 + l_2);\n}\n";

    #[test]
    fn bulk_reduction_rewrite() {
        let out = bulk_adds("k", BULK).unwrap();
        assert!(out.contains("\n__cubeattn_bulk_add_f32<512>(buffer_7 + l_12, shared_memory_5 + l_9);\n"), "{out}");
        // the forward copy is left alone; the helper sits after the typedefs
        assert!(out.contains("__cp_async_shared_global<16>(buffer_7 + l_1, shared_memory_5 + l_2);"), "{out}");
        assert!(out.find("int64;").unwrap() < out.find("void __cubeattn_bulk_add_f32").unwrap());
        assert!(out.contains("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"));
        assert_eq!(bulk_adds("k", "no bulk").unwrap(), "no bulk");
    }

    #[test]
    fn refuses_other_sizes_types_and_operands() {
        // sizes that are not 16-byte multiples, other types, other operand forms are refused
        assert!(bulk_adds("k", &BULK.replace("<512>", "<8>")).is_err());
        assert!(bulk_adds("k", &BULK.replace("float_2 *shared_memory_5 = reinterpret_cast<float_2", "__half *shared_memory_5 = reinterpret_cast<__half")).is_err());
        assert!(bulk_adds("k", &BULK.replace("float_2* buffer_7,", "__nv_bfloat16* buffer_7,")).is_err());
        assert!(bulk_adds("k", &BULK.replace("buffer_7 + l_12", "&buffer_7[l_12]")).is_err());
    }
}
