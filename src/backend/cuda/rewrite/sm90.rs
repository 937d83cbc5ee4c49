//! Lowering of the Hopper intrinsics of `kernels::sm90`: every marker statement
//! `printf("<MARK><name> <params>", args);` becomes a call of an inline-PTX helper generated for
//! exactly those parameters, defined once before the kernel. A marker this module does not know,
//! a malformed one, or a kernel built with [`lower`] that holds no marker at all is refused with an
//! error naming the kernel: a CubeCL that prints the markers differently fails at the first
//! compile, never as a kernel that silently prints instead of multiplying.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::mismatch;
use crate::error::Result;
use crate::kernels::sm90::MARK;

/// Bytes between two 8-row groups of a 128-byte-swizzled tile (the descriptors' stride offset).
const SBO: u32 = 1024;

/// Common helpers: the 64-bit matrix descriptor of a 128-byte-swizzled operand at `byte_off`
/// bytes (a multiple of 16) into the shared buffer `p`. Its low word is the start address >> 4
/// (bits 0-13; shared addresses stay below 2^18) with the leading-byte offset >> 4 above it, so
/// the offset is one 32-bit add to a base the compiler computes once per buffer (no carry can
/// leave the address field), instead of a descriptor rebuilt per MMA.
const PRELUDE: &str = r#"
__device__ __forceinline__ unsigned long long __cubeattn_desc(const void* p, unsigned byte_off, unsigned lbo, unsigned sbo) {
  const unsigned lo = ((static_cast<unsigned>(__cvta_generic_to_shared(p)) >> 4) | (((lbo >> 4) & 0x3FFFu) << 16)) + (byte_off >> 4);
  const unsigned hi = ((sbo >> 4) & 0x3FFFu) | (1u << 30);
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}
// the same for a 64-byte-swizzled K-major operand of 64-byte rows (layout 2, SBO 512 bytes)
__device__ __forceinline__ unsigned long long __cubeattn_desc_sw64(const void* p, unsigned byte_off) {
  const unsigned lo = ((static_cast<unsigned>(__cvta_generic_to_shared(p)) >> 4) | (1u << 16)) + (byte_off >> 4);
  const unsigned hi = (512u >> 4) | (2u << 30);
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}
"#;

/// One parsed marker: the helper it becomes (name and definition) and its call arguments.
struct Lowered {
    helper: String,
    definition: String,
}

fn elem_bytes(t: &str) -> Option<u32> {
    matches!(t, "bf16" | "f16").then_some(2)
}

/// The accumulator operands of an `n`-column MMA: their count `n / 2`, `{%0, ..., %(n/2 - 1)}` and
/// their `"+<letter>"(d[i])` constraints (`f`: f32, `r`: i32).
fn acc_operands(n: u32, letter: char) -> (usize, String, String) {
    let regs = (n / 2) as usize;
    let list = (0..regs).map(|i| format!("%{i}")).collect::<Vec<_>>().join(", ");
    let cons = (0..regs).map(|i| format!("\"+{letter}\"(d[{i}])")).collect::<Vec<_>>().join(", ");
    (regs, list, cons)
}

/// Parses the parameters of a `wgmma_ss` / `wgmma_rs` marker.
fn parse_nums(words: &[&str]) -> Option<Vec<u32>> {
    words.iter().map(|w| w.parse::<u32>().ok()).collect()
}

fn lower_marker(text: &str) -> Option<Lowered> {
    let words: Vec<&str> = text.split(' ').collect();
    match words.as_slice() {
        ["fence"] => Some(simple("fence", "wgmma.fence.sync.aligned;")),
        ["commit"] => Some(simple("commit", "wgmma.commit_group.sync.aligned;")),
        ["proxy_fence"] => Some(simple("proxy_fence", "fence.proxy.async.shared::cta;")),
        ["gpu_fence"] => Some(simple("gpu_fence", "fence.acq_rel.gpu;")),
        ["wait", n] => {
            let n: u32 = n.parse().ok().filter(|&n| n <= 7)?;
            Some(simple(&format!("wait_{n}"), &format!("wgmma.wait_group.sync.aligned {n};")))
        }
        ["setmaxnreg", dir @ ("inc" | "dec"), n] => {
            let n: u32 = n.parse().ok().filter(|&n| (24..=256).contains(&n) && n % 8 == 0)?;
            Some(simple(&format!("setmaxnreg_{dir}_{n}"), &format!("setmaxnreg.{dir}.sync.aligned.u32 {n};")))
        }
        ["named_barrier", id, n] => {
            let id: u32 = id.parse().ok().filter(|&i| (1..=15).contains(&i))?;
            let n: u32 = n.parse().ok().filter(|&n| n > 0 && n % 32 == 0 && n <= 1024)?;
            Some(simple(&format!("named_barrier_{id}_{n}"), &format!("bar.sync {id}, {n};")))
        }
        ["named_barrier_at", n] => {
            let n: u32 = n.parse().ok().filter(|&n| n > 0 && n % 32 == 0 && n <= 1024)?;
            let helper = format!("__cubeattn_named_barrier_at_{n}");
            let definition =
                format!("__device__ __forceinline__ void {helper}(unsigned id) {{\n  asm volatile(\"bar.sync %0, {n};\\n\" :: \"r\"(id) : \"memory\");\n}}\n");
            Some(Lowered { helper, definition })
        }
        ["wgmma_ss", t, rest @ ..] => {
            let eb = elem_bytes(t)?;
            let [n, acc0, a_mn, a_lbo, b_mn, b_lbo, accum] = parse_nums(rest)?.try_into().ok()?;
            check_mma(n, b_mn, accum)?;
            (a_mn <= 1).then_some(())?;
            let helper = format!("__cubeattn_wgmma_ss_{t}_{n}_{acc0}_{a_mn}_{a_lbo}_{b_mn}_{b_lbo}_{accum}");
            let a_lbo = if a_mn == 1 { a_lbo } else { 16 };
            let b_lbo = if b_mn == 1 { b_lbo } else { 16 };
            let shape = format!("m64n{n}k16.f32.{t}.{t}");
            let d = format!("float* d = acc + {acc0};");
            Some(ss_helper(helper, "float* acc", &d, eb, a_lbo, b_lbo, n, 'f', &shape, &format!(", 1, 1, {a_mn}, {b_mn}"), accum))
        }
        ["wgmma_rs", t, rest @ ..] => {
            let eb = elem_bytes(t)?;
            let [n, acc0, a0, b_mn, b_lbo, accum] = parse_nums(rest)?.try_into().ok()?;
            check_mma(n, b_mn, accum)?;
            let helper = format!("__cubeattn_wgmma_rs_{t}_{n}_{acc0}_{a0}_{b_mn}_{b_lbo}_{accum}");
            let b_lbo = if b_mn == 1 { b_lbo } else { 16 };
            let desc = format!("__cubeattn_desc(b, b_off * {eb}u, {b_lbo}u, {SBO}u)");
            Some(rs_helper(helper, &format!("float* d = acc + {acc0};"), a0, &desc, n, &format!("m64n{n}k16.f32.{t}.{t}"), &format!(", 1, 1, {b_mn}"), accum))
        }
        ["wgmma_ss_s8", t, rest @ ..] => {
            let eb = elem_bytes(t)?;
            let [n, accum] = parse_nums(rest)?.try_into().ok()?;
            // the int8 shapes: N = 8, 16, 24, then multiples of 16 up to 256
            check_mma(n, 0, accum)?;
            (n <= 24 || n.is_multiple_of(16)).then_some(())?;
            let helper = format!("__cubeattn_wgmma_ss_s8_{t}_{n}_{accum}");
            let shape = format!("m64n{n}k32.s32.s8.s8");
            Some(ss_helper(helper, "void* acc", "int* d = reinterpret_cast<int*>(acc);", eb, 16, 16, n, 'r', &shape, "", accum))
        }
        ["wgmma_rs_e4m3", t, rest @ ..] => {
            let eb = elem_bytes(t)?;
            let [n, a0] = parse_nums(rest)?.try_into().ok()?;
            // FP8 shapes: N a multiple of 8 up to 256
            check_mma(n, 0, 1)?;
            let helper = format!("__cubeattn_wgmma_rs_e4m3_{t}_{n}_{a0}");
            let desc = format!("__cubeattn_desc_sw64(b, b_off * {eb}u)");
            Some(rs_helper(helper, "float* d = acc;", a0, &desc, n, &format!("m64n{n}k32.f32.e4m3.e4m3"), ", 1, 1", 1))
        }
        ["pack_p_e4m3", chunks] => {
            let chunks: u32 = chunks.parse().ok().filter(|&c| (1..=8).contains(&c))?;
            let helper = format!("__cubeattn_pack_p_e4m3_{chunks}");
            // word w of k32 step c: n8 blocks 4c + 2 (w / 2) and the next, elements 2 (w % 2) + {0, 1}
            let definition = format!(
                r#"__device__ __forceinline__ void {helper}(const float* s, unsigned* out) {{
#pragma unroll
  for (int c = 0; c < {chunks}; ++c) {{
#pragma unroll
    for (int w = 0; w < 4; ++w) {{
      const int i0 = (4 * c + (w >> 1) * 2) * 4 + (w & 1) * 2;
      unsigned short lo, hi;
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(s[i0 + 1]), "f"(s[i0]));
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(s[i0 + 5]), "f"(s[i0 + 4]));
      out[4 * c + w] = static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
    }}
  }}
}}
"#
            );
            Some(Lowered { helper, definition })
        }
        ["store_pair", t @ ("bf16" | "f16")] => {
            let (pair, cvt) = if *t == "bf16" { ("__nv_bfloat162", "__floats2bfloat162_rn") } else { ("__half2", "__floats2half2_rn") };
            let helper = format!("__cubeattn_store_pair_{t}");
            let definition = format!(
                "__device__ __forceinline__ void {helper}(void* out, unsigned idx, float a, float b) {{\n  \
                 reinterpret_cast<{pair}*>(out)[idx >> 1] = {cvt}(a, b);\n}}\n"
            );
            Some(Lowered { helper, definition })
        }
        ["copy16_out"] => {
            let helper = "__cubeattn_copy16_out".to_string();
            let definition = format!(
                "__device__ __forceinline__ void {helper}(void* dst, unsigned dst_idx, const void* src, unsigned src_idx) {{\n  \
                 reinterpret_cast<uint4*>(dst)[dst_idx >> 3] = reinterpret_cast<const uint4*>(src)[src_idx >> 3];\n}}\n"
            );
            Some(Lowered { helper, definition })
        }
        ["bulk_add"] => {
            let helper = "__cubeattn_bulk_add".to_string();
            let definition = format!(
                r#"__device__ __forceinline__ void {helper}(void* dst, unsigned dst_off, const void* src, unsigned src_off, unsigned bytes) {{
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               :: "l"(reinterpret_cast<float*>(dst) + dst_off),
                  "r"(static_cast<unsigned>(__cvta_generic_to_shared(reinterpret_cast<const float*>(src) + src_off))), "r"(bytes)
               : "memory");
}}
"#
            );
            Some(Lowered { helper, definition })
        }
        ["e4m3x4", i] => {
            let i: u32 = i.parse().ok()?;
            let helper = format!("__cubeattn_e4m3x4_{i}");
            let definition = format!(
                r#"__device__ __forceinline__ void {helper}(unsigned* out, float x0, float x1, float x2, float x3) {{
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x1), "f"(x0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x3), "f"(x2));
  out[{i}] = static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
}}
"#
            );
            Some(Lowered { helper, definition })
        }
        _ => None,
    }
}

/// The helper of an MMA with both operands in shared memory (128-byte-swizzled descriptors):
/// `acc_param` / `d` declare the accumulator, `shape` is the instruction's shape and types, `flags`
/// what follows its scale-d predicate.
#[allow(clippy::too_many_arguments)]
fn ss_helper(helper: String, acc_param: &str, d: &str, eb: u32, a_lbo: u32, b_lbo: u32, n: u32, letter: char, shape: &str, flags: &str, accum: u32) -> Lowered {
    let (regs, list, cons) = acc_operands(n, letter);
    let (r0, r1, r2) = (regs, regs + 1, regs + 2);
    let definition = format!(
        r#"__device__ __forceinline__ void {helper}({acc_param}, const void* a, unsigned a_off, const void* b, unsigned b_off) {{
  {d}
  const unsigned long long da = __cubeattn_desc(a, a_off * {eb}u, {a_lbo}u, {SBO}u);
  const unsigned long long db = __cubeattn_desc(b, b_off * {eb}u, {b_lbo}u, {SBO}u);
#ifndef CUBEATTN_SM90_NO_MMA
  asm volatile("{{\n.reg .pred p;\nsetp.ne.b32 p, %{r2}, 0;\n"
               "wgmma.mma_async.sync.aligned.{shape} {{{list}}}, %{r0}, %{r1}, p{flags};\n}}\n"
               : {cons} : "l"(da), "l"(db), "r"({accum}));
#endif
}}
"#
    );
    Lowered { helper, definition }
}

/// The helper of an MMA with A from four registers (`a_regs[a0 ..]`) and B in shared memory
/// (descriptor expression `desc`); `d` declares the f32 accumulator pointer.
#[allow(clippy::too_many_arguments)]
fn rs_helper(helper: String, d: &str, a0: u32, desc: &str, n: u32, shape: &str, flags: &str, accum: u32) -> Lowered {
    let (regs, list, cons) = acc_operands(n, 'f');
    let (r0, r1, r2, r3, r4, r5) = (regs, regs + 1, regs + 2, regs + 3, regs + 4, regs + 5);
    let definition = format!(
        r#"__device__ __forceinline__ void {helper}(float* acc, const void* a_regs, const void* b, unsigned b_off) {{
  {d}
  const unsigned* a = reinterpret_cast<const unsigned*>(a_regs) + {a0};
  const unsigned long long db = {desc};
#ifndef CUBEATTN_SM90_NO_MMA
  asm volatile("{{\n.reg .pred p;\nsetp.ne.b32 p, %{r5}, 0;\n"
               "wgmma.mma_async.sync.aligned.{shape} {{{list}}}, {{%{r0}, %{r1}, %{r2}, %{r3}}}, %{r4}, p{flags};\n}}\n"
               : {cons} : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"({accum}));
#endif
}}
"#
    );
    Lowered { helper, definition }
}

/// N a multiple of 8 in 8..=256 (f16/bf16 wgmma), flags 0 or 1.
fn check_mma(n: u32, b_mn: u32, accum: u32) -> Option<()> {
    (n.is_multiple_of(8) && (8..=256).contains(&n) && b_mn <= 1 && accum <= 1).then_some(())
}

fn simple(name: &str, ptx: &str) -> Lowered {
    let helper = format!("__cubeattn_{name}");
    let definition = format!(
        "__device__ __forceinline__ void {helper}() {{\n  asm volatile(\"{ptx}\\n\" ::: \"memory\");\n}}\n"
    );
    Lowered { helper, definition }
}

/// Splits the text after a marker's format string (`, a,b,c)`) into its arguments.
fn call_args(rest: &str) -> Option<Vec<String>> {
    let rest = rest.trim_start();
    let inner = rest.strip_suffix(')')?;
    if inner.trim().is_empty() {
        return Some(Vec::new());
    }
    let inner = inner.trim_start().strip_prefix(',')?;
    let mut args = Vec::new();
    let mut depth = 0i32;
    let mut cur = String::new();
    for c in inner.chars() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                args.push(cur.trim().to_string());
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    args.push(cur.trim().to_string());
    Some(args)
}

/// Lowers every `kernels::sm90` marker of kernel `entry`. Refuses a kernel without one.
pub(crate) fn lower(entry: &str, src: &str) -> Result<String> {
    let open = format!("printf(\"{MARK}");
    let mut helpers: BTreeMap<String, String> = BTreeMap::new();
    let mut body = String::with_capacity(src.len());
    let mut found = 0usize;
    for line in src.split_inclusive('\n') {
        let Some(at) = line.find(&open) else {
            if line.contains("printf(") {
                return Err(mismatch(entry, "sm90", "a `printf` that is not an sm90 marker"));
            }
            body.push_str(line);
            continue;
        };
        let after = &line[at + open.len()..];
        let bad = || mismatch(entry, "sm90", &format!("a marker it cannot read: `{}`", line.trim()));
        let close = after.find('"').ok_or_else(bad)?;
        let text = &after[..close];
        let stmt = after[close + 1..].trim_end();
        let stmt = stmt.strip_suffix(';').ok_or_else(bad)?;
        let args = call_args(stmt).ok_or_else(bad)?;
        let low = lower_marker(text).ok_or_else(bad)?;
        let want = match text.split(' ').next() {
            Some("wgmma_ss" | "wgmma_ss_s8" | "e4m3x4" | "bulk_add") => 5,
            Some("wgmma_rs" | "wgmma_rs_e4m3" | "store_pair" | "copy16_out") => 4,
            Some("named_barrier_at") => 1,
            Some("pack_p_e4m3") => 2,
            _ => 0,
        };
        if args.len() != want {
            return Err(bad());
        }
        body.push_str(&line[..at]);
        write!(body, "{}({});", low.helper, args.join(", ")).expect("write to a String");
        body.push('\n');
        helpers.entry(low.helper).or_insert(low.definition);
        found += 1;
    }
    if found == 0 {
        return Err(mismatch(entry, "sm90", "no sm90 marker (the kernel's wgmma calls are not emitted as expected)"));
    }
    // the helpers go before the kernel's entry point (after CubeCL's includes and structs)
    let at = body.find("extern \"C\" __global__").ok_or_else(|| mismatch(entry, "sm90", "no `extern \"C\" __global__` entry"))?;
    let mut out = String::with_capacity(body.len() + 4096);
    out.push_str(&body[..at]);
    out.push_str(PRELUDE);
    for def in helpers.values() {
        out.push_str(def);
    }
    out.push_str(&body[at..]);
    Ok(out)
}

/// [`lower`], then `blocks` resident cubes per SM declared (`rewrite::min_blocks`): every wgmma
/// kernel takes both (the min-blocks bound sets its register cap and lets `setmaxnreg` stand).
pub(crate) fn lower_bounded(entry: &str, src: &str, blocks: u32) -> Result<String> {
    super::min_blocks(entry, &lower(entry, src)?, blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(body: &str) -> String {
        format!("#include <x.h>\nextern \"C\" __global__ void __launch_bounds__(256) k_(float* b) {{\n{body}}}\n")
    }

    #[test]
    fn markers_become_inline_ptx_helpers() {
        let src = kernel(&format!(
            "printf(\"{MARK}fence\");\nprintf(\"{MARK}wgmma_ss bf16 128 0 0 0 0 0 0\", l_arr_3,shared_memory_0,l_5,shared_memory_1,uint32(64));\n\
             printf(\"{MARK}wgmma_rs f16 64 0 4 1 8192 1\", l_arr_4,l_arr_6,shared_memory_2,l_7);\nprintf(\"{MARK}commit\");\nprintf(\"{MARK}wait 0\");\n"
        ));
        let out = lower("k_", &src).unwrap();
        assert!(!out.contains("printf"), "{out}");
        assert!(out.contains("__cubeattn_wgmma_ss_bf16_128_0_0_0_0_0_0(l_arr_3, shared_memory_0, l_5, shared_memory_1, uint32(64));"));
        assert!(out.contains("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, "));
        assert!(out.contains("%63}, %64, %65, p, 1, 1, 0, 0;"), "{out}");
        assert!(out.contains("setp.ne.b32 p, %66, 0;"), "{out}");
        assert!(out.contains("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, "));
        assert!(out.contains("%31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;"), "{out}");
        assert!(out.contains("\"l\"(db), \"r\"(1));"), "{out}");
        assert!(out.contains("__cubeattn_desc(b, b_off * 2u, 8192u, 1024u)"));
        assert!(out.contains("wgmma.wait_group.sync.aligned 0;"));
        // an MN-major A operand (dQ = dS K with dS^T stored key-major): the transpose flag and its LBO
        let mn = lower("k_", &kernel(&format!("printf(\"{MARK}wgmma_ss bf16 64 0 1 16384 1 16384 1\", x,a,o,b,p);\n"))).unwrap();
        assert!(mn.contains("p, 1, 1, 1, 1;"), "{mn}");
        assert!(mn.contains("__cubeattn_desc(a, a_off * 2u, 16384u, 1024u)"), "{mn}");
        // int8 operands: i32 accumulators, k32, no transpose or scale immediates
        let s8 = lower("k_", &kernel(&format!("printf(\"{MARK}wgmma_ss_s8 bf16 64 1\", x,a,o,b,p);\n"))).unwrap();
        assert!(s8.contains("wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%0, "), "{s8}");
        assert!(s8.contains("%31}, %32, %33, p;"), "{s8}");
        assert!(s8.contains("\"+r\"(d[31])") && s8.contains("__cubeattn_desc(a, a_off * 2u, 16u, 1024u)"), "{s8}");
        for bad in ["wgmma_ss_s8 bf16 40 1", "wgmma_ss_s8 bf16 64 2", "wgmma_ss_s8 s8 64 1"] {
            assert!(lower("k", &kernel(&format!("printf(\"{MARK}{bad}\", x,a,o,b,p);\n"))).is_err(), "{bad}");
        }
        // FP8: P packed to e4m3 A words, the 64-byte-swizzled K-major B operand, a quantised store
        let f8 = lower("k_", &kernel(&format!(
            "printf(\"{MARK}pack_p_e4m3 2\", s,w);\nprintf(\"{MARK}wgmma_rs_e4m3 bf16 128 4\", x,w,b,o);\nprintf(\"{MARK}e4m3x4 0\", w,a,b,c,d);\n"
        ))).unwrap();
        assert!(f8.contains("__cubeattn_pack_p_e4m3_2(s, w);") && f8.contains("cvt.rn.satfinite.e4m3x2.f32"), "{f8}");
        assert!(f8.contains("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, "), "{f8}");
        assert!(f8.contains("%63}, {%64, %65, %66, %67}, %68, p, 1, 1;"), "{f8}");
        assert!(f8.contains("reinterpret_cast<const unsigned*>(a_regs) + 4;") && f8.contains("__cubeattn_desc_sw64(b, b_off * 2u)"), "{f8}");
        assert!(f8.contains("__cubeattn_e4m3x4_0(w, a, b, c, d);"), "{f8}");
        assert!(lower("k", &kernel(&format!("printf(\"{MARK}pack_p_e4m3 2\", s);\n"))).is_err());
        assert!(lower("k", &kernel(&format!("printf(\"{MARK}pack_p_e4m3 9\", s,w);\n"))).is_err());
        // the warp-specialised frame: register moves and named barriers
        let ws = lower("k_", &kernel(&format!("printf(\"{MARK}setmaxnreg dec 40\");\nprintf(\"{MARK}setmaxnreg inc 232\");\nprintf(\"{MARK}named_barrier 1 256\");\n"))).unwrap();
        assert!(ws.contains("setmaxnreg.dec.sync.aligned.u32 40;") && ws.contains("setmaxnreg.inc.sync.aligned.u32 232;"), "{ws}");
        assert!(ws.contains("bar.sync 1, 256;") && ws.contains("__cubeattn_named_barrier_1_256();"), "{ws}");
        let staged = lower("k_", &kernel(&format!("printf(\"{MARK}named_barrier_at 128\", id);\nprintf(\"{MARK}copy16_out\", out,g,stage,at);\n"))).unwrap();
        assert!(staged.contains("bar.sync %0, 128;") && staged.contains("__cubeattn_copy16_out(out, g, stage, at);"), "{staged}");
        for bad in ["setmaxnreg inc 20", "setmaxnreg inc 233", "setmaxnreg up 64", "named_barrier 0 256", "named_barrier 1 100"] {
            assert!(lower("k", &kernel(&format!("printf(\"{MARK}{bad}\");\n"))).is_err(), "{bad}");
        }
        // the GPU-scope fence around a counter between cubes
        let gf = lower("k_", &kernel(&format!("printf(\"{MARK}gpu_fence\");\n"))).unwrap();
        assert!(gf.contains("__cubeattn_gpu_fence();") && gf.contains("asm volatile(\"fence.acq_rel.gpu;\\n\" ::: \"memory\");"), "{gf}");
        // paired 16-bit output stores
        let sp = lower("k_", &kernel(&format!("printf(\"{MARK}store_pair bf16\", buffer_5,l_9,l_10,l_11);\n"))).unwrap();
        assert!(sp.contains("__cubeattn_store_pair_bf16(buffer_5, l_9, l_10, l_11);") && sp.contains("__floats2bfloat162_rn(a, b)"), "{sp}");
        assert!(lower("k", &kernel(&format!("printf(\"{MARK}store_pair f32\", a,b,c,d);\n"))).is_err());
        // bulk f32 reduce-adds of a run-time size
        let ba = lower("k_", &kernel(&format!("printf(\"{MARK}bulk_add\", buffer_9,l_3,shared_memory_8,l_5,l_4);\n"))).unwrap();
        assert!(ba.contains("__cubeattn_bulk_add(buffer_9, l_3, shared_memory_8, l_5, l_4);"), "{ba}");
        assert!(ba.contains("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"), "{ba}");
        assert!(lower("k", &kernel(&format!("printf(\"{MARK}bulk_add\", buffer_9,l_3,shared_memory_8);\n"))).is_err());
        // helpers sit before the entry point, each once
        let entry = out.find("extern \"C\"").unwrap();
        assert!(out.find("void __cubeattn_fence()").unwrap() < entry);
        assert_eq!(out.matches("void __cubeattn_fence()").count(), 1);
    }

    #[test]
    fn refuses_what_it_does_not_know() {
        let unknown = kernel(&format!("printf(\"{MARK}wgmma_xx bf16 128\", a);\n"));
        let e = lower("flash_fwd_sm90", &unknown).unwrap_err().to_string();
        assert!(e.contains("flash_fwd_sm90") && e.contains("sm90"), "{e}");
        // wrong operand count, bad N, f32 operands
        for m in [
            "wgmma_ss bf16 128 0 0 0 0 0 0\", a,b",
            "wgmma_ss bf16 100 0 0 0 0 0 0\", a,b,c,d,e",
            "wgmma_ss f32 128 0 0 0 0 0 0\", a,b,c,d,e",
            "wgmma_ss bf16 128 0 2 0 0 0 0\", a,b,c,d,e",
            "wgmma_ss bf16 128 0 0 0 0\", a,b,c,d,e",
        ] {
            assert!(lower("k", &kernel(&format!("printf(\"{MARK}{m});\n"))).is_err(), "{m}");
        }
        // a kernel without markers, and a stray printf
        assert!(lower("k", &kernel("int x = 1;\n")).is_err());
        assert!(lower("k", &kernel(&format!("printf(\"{MARK}fence\");\nprintf(\"%d\", x);\n"))).is_err());
    }
}
