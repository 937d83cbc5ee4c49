//! The one place where cubeattn edits the CUDA source CubeCL generates, before NVRTC compiles it.
//!
//! CubeCL 0.10 has no exp2 operation. The flash kernels write `2^x` as `f32::powf(2.0, x)` under
//! fast-math flags (`kernels::math::fast_exp2`), which CubeCL emits as `__powf(float(2), x)`; with
//! `-ftz=true` NVRTC makes that FFMA + FADD + MUFU.EX2 per score, against FFMA + MUFU.EX2 for
//! `exp2f(x)` (FlashAttention-2's code). [`exp2_calls`] turns every `__powf` whose base is the
//! constant 2 into `exp2f`. A kernel built with the rewrite must contain at least one such call
//! and no other `__powf`, else [`exp2_calls`] fails loudly: a CubeCL that prints the call
//! differently is caught at the first compile, not by a slow kernel.
//!
//! The cp.async pipelines (CubeCL's `Barrier::commit_copy_async` + `arrive` + `wait_parity`) are
//! emitted as `cp.async.mbarrier.arrive` (which raises the barrier's pending count, then arrives
//! when the thread's copies land) followed by a second, explicit `barrier.arrive()`, and waited
//! with libcu++'s `wait_parity` (a `try_wait` loop with a clock-driven back-off). [`mbarriers`]
//! rewrites both: `noinc` makes the copy arrival the thread's one arrival of the phase (`.noinc`,
//! the explicit arrive dropped; compute-sanitizer's synccheck reported "Missing wait" on every
//! cp.async barrier before, none after); `spin` waits with a plain `mbarrier.try_wait.parity`
//! loop (`test_wait` below sm_90, where `try_wait` does not exist, and with `CUBEATTN_PORTABLE`; used by the backward kernels,
//! see `compile::codegen_exp2`; measured in docs/forward.md, "Forward order, O rescale, mbarrier protocol").
//!
//! `stmatrix` (the backward's P / dS stores, `kernels::fragments::store_acc_16x16`) is sm_90+.
//! [`stmatrix_fallback`] keeps it on sm_90+ and, below (or with `CUBEATTN_PORTABLE` defined:
//! `CUBEATTN_CUDA_PORTABLE=1`, how the pre-Hopper code is tested on a Hopper GPU), stores each of
//! the four 8 x 8 matrices with one 32-bit shared store per lane: the lane holding row `lane / 4`
//! of matrix `i` (its columns `2 (lane % 4), +1`, register `i`) takes that row's address from lane
//! `8 i + lane / 4` by a shuffle, as `stmatrix` itself pairs them.
//!
//! Shared-memory addresses of `ldmatrix` and `cp.async`: CubeCL passes `shared_memory_N + l_i`
//! (a generic pointer plus a u32 element index) and its wrappers convert that pointer with
//! `__cvta_generic_to_shared`. The index is a u32 sum (`row * stride + col + 8`), and the pointer
//! add widens it to 64 bits first, so the compiler may not split the wrapped 32-bit sum: every
//! `LDSM` got its own add and shift instead of an immediate offset from a shared base register.
//! [`smem_addresses`] makes the wrappers take the 32-bit shared address and computes it at the
//! call as `cvta(base) + index * sizeof(element)` in u32 arithmetic, where constant parts fold.
//!
//! Shared-memory layout: CubeCL places a kernel's shared buffers in the iteration order of a
//! hash set, which differs from process to process, so the same kernel compiled twice got
//! different buffer offsets (and a user's disk cache kept whichever came first). [`smem_layout`]
//! places them in declaration order instead, each at the kernel's largest alignment: one layout
//! per kernel source, whoever compiles it.
//!
//! Bulk reductions (`kernels::bulk_reduce`, sm_90+): CubeCL 0.10 cannot express
//! `cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32`. The kernels write it as a
//! `copy_async` from a shared f32 tile to a global f32 buffer, which CubeCL prints as a cp.async
//! call with the operands reversed (`__cp_async_shared_global<BYTES>(shared_memory_N + i,
//! buffer_M + j)`, a direction no other kernel uses). [`bulk_adds`] turns exactly those calls into
//! the reduction; an operand of another form or type is refused, and a reversed call left
//! unrewritten would fail the wrapper's size check at compile time.

use crate::error::{Error, Result};

pub(crate) mod sm90;

/// Whether `arg` (the first argument of a `__powf` call, as CubeCL prints it) is the constant 2.
fn is_two(arg: &str) -> bool {
    let mut a: String = arg.chars().filter(|c| !c.is_whitespace()).collect();
    loop {
        if let Some(inner) = a.strip_prefix("float(").and_then(|x| x.strip_suffix(')')) {
            a = inner.to_string();
        } else if let Some(inner) = a.strip_prefix('(').and_then(|x| x.strip_suffix(')')) {
            a = inner.to_string();
        } else {
            break;
        }
    }
    let a = a.strip_suffix('f').unwrap_or(&a);
    a.parse::<f64>().map(|v| v == 2.0).unwrap_or(false)
}

/// End (exclusive) of the first top-level argument starting at `from`: the index of the `,` that
/// ends it, or `None` when the call has no second argument.
fn first_arg_end(s: &str, from: usize) -> Option<usize> {
    let mut depth = 0i32;
    for (i, c) in s[from..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => return None,
            ')' => depth -= 1,
            ',' if depth == 0 => return Some(from + i),
            _ => {}
        }
    }
    None
}

/// Rewrites `__powf(2, x)` into `exp2f(x)` in the generated source of kernel `entry`.
pub(crate) fn exp2_calls(entry: &str, src: &str) -> Result<String> {
    const CALL: &str = "__powf(";
    let mut out = String::with_capacity(src.len());
    let mut rest = 0usize;
    let mut rewritten = 0usize;
    while let Some(pos) = src[rest..].find(CALL) {
        let start = rest + pos;
        let arg0 = start + CALL.len();
        let comma = first_arg_end(src, arg0).filter(|&c| is_two(&src[arg0..c]));
        let Some(comma) = comma else {
            return Err(changed(entry, &format!("a `__powf` call whose base is not the constant 2 at byte {start}")));
        };
        out.push_str(&src[rest..start]);
        out.push_str("exp2f(");
        rest = comma + 1;
        rewritten += 1;
    }
    out.push_str(&src[rest..]);
    if rewritten == 0 {
        return Err(changed(entry, "no `__powf(2, x)` call (fast_exp2 is no longer emitted as __powf)"));
    }
    Ok(out)
}

/// The error of a rewrite that does not recognise CubeCL's output for kernel `entry`.
fn mismatch(entry: &str, rewrite: &str, what: &str) -> Error {
    Error::Device(format!(
        "CubeCL's generated source for {entry} has {what}: the {rewrite} rewrite (src/backend/cuda/rewrite.rs) does \
         not match this CubeCL version's output"
    ))
}

fn changed(entry: &str, what: &str) -> Error {
    mismatch(entry, "exp2", what)
}

const CP_ARRIVE_ASM: &str = "cp.async.mbarrier.arrive.shared::cta.b64";
const CP_ARRIVE_CALL: &str = "__cp_async_arrive(";
/// The preprocessor condition of the sm_90-only instructions the rewrites emit (`try_wait`,
/// `stmatrix`): an sm_90+ target, and not the portable build (`compile::portable`).
macro_rules! if_sm90 {
    () => {
        "#if __CUDA_ARCH__ >= 900 && !defined(CUBEATTN_PORTABLE)\n"
    };
}

const SPIN_WAIT: &str = concat!(
    r#"
__device__ __forceinline__ void __cubeattn_wait_parity(::cuda::barrier<::cuda::thread_scope_block> &bar, uint32 parity) {
  uint32 a = static_cast<uint32>(__cvta_generic_to_shared(::cuda::device::barrier_native_handle(bar)));
"#,
    if_sm90!(),
    r#"  asm volatile("{\n.reg .pred p;\nW%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W%=;\n}\n"
               :: "r"(a), "r"(parity) : "memory");
#else
  asm volatile("{\n.reg .pred p;\nW%=:\nmbarrier.test_wait.parity.shared.b64 p, [%0], %1;\n@!p bra W%=;\n}\n"
               :: "r"(a), "r"(parity) : "memory");
#endif
}
"#
);

/// Applies the mbarrier rewrites `(noinc, spin)` to kernel `entry` (a no-op for kernels without
/// cp.async barriers). Every explicit arrive must directly follow a copy arrival on the same
/// barrier, else the rewrite refuses.
pub(crate) fn mbarriers(entry: &str, src: &str, noinc: bool, spin: bool) -> Result<String> {
    if !src.contains(CP_ARRIVE_CALL) {
        return Ok(src.to_string());
    }
    let bad = |what: &str| mismatch(entry, "mbarrier", what);
    let mut out = src.to_string();
    if noinc {
        if out.matches(CP_ARRIVE_ASM).count() != 1 {
            return Err(bad("not exactly one cp.async.mbarrier.arrive wrapper"));
        }
        out = out.replace(CP_ARRIVE_ASM, "cp.async.mbarrier.arrive.noinc.shared::cta.b64");
        let mut kept = String::with_capacity(out.len());
        let mut prev_bar: Option<String> = None;
        let (mut dropped, mut calls) = (0usize, 0usize);
        for line in out.lines() {
            let t = line.trim();
            if t.ends_with(".arrive();") {
                let bar = t.split('=').nth(1).map(|r| r.trim().trim_end_matches(".arrive();").to_string());
                if bar.is_none() || bar != prev_bar {
                    return Err(bad(&format!("an arrive that does not follow a copy arrival: `{t}`")));
                }
                dropped += 1;
                prev_bar = None;
                continue;
            }
            prev_bar = t
                .strip_prefix(CP_ARRIVE_CALL)
                .and_then(|r| r.strip_suffix(");"))
                .map(|b| b.trim().to_string());
            calls += prev_bar.is_some() as usize;
            kept.push_str(line);
            kept.push('\n');
        }
        if calls == 0 || dropped != calls {
            return Err(bad("copy arrivals without an explicit arrive"));
        }
        out = kept;
    }
    if spin {
        let n = out.matches(".wait_parity(").count();
        if n == 0 {
            return Err(bad("cp.async barriers but no wait_parity"));
        }
        let mut w = String::with_capacity(out.len() + 512);
        for line in out.lines() {
            let t = line.trim();
            match t.strip_suffix(");").and_then(|r| r.split_once(".wait_parity(")) {
                Some((bar, parity)) if !bar.contains(' ') => {
                    w.push_str(&format!("__cubeattn_wait_parity({bar}, {parity});\n"));
                }
                _ => {
                    w.push_str(line);
                    w.push('\n');
                }
            }
        }
        let at = w.find("// Wrapper for").ok_or_else(|| bad("no cp.async wrapper comment to place the wait before"))?;
        w.insert_str(at, SPIN_WAIT);
        out = w;
    }
    Ok(out)
}

const SMEM_AT: &str = "
template <typename T, typename I>
__device__ __forceinline__ uint32 __cubeattn_smem(T *base, I index) {
  return static_cast<uint32>(__cvta_generic_to_shared(base)) + static_cast<uint32>(index) * uint32(sizeof(T));
}
";
const LDSM_PARAM: &str = "void const *row_addr) {\n  uint32 addr = static_cast<uint32>(__cvta_generic_to_shared(row_addr));";
const CP_PARAM: &str = "void *smem_ptr";
const CP_CVTA: &str = "  uint32 smem_int_ptr = static_cast<uint32>(__cvta_generic_to_shared(smem_ptr));\n";
const LAST_TYPEDEF: &str = "typedef signed long long int int64;\n";

/// Rewrites the `ldmatrix` and `cp.async` wrappers of kernel `entry` to take 32-bit shared
/// addresses, and their calls to pass `__cubeattn_smem(shared_memory_N, l_i)` (a no-op for
/// kernels without them). A call whose shared operand is not `shared_memory_N + index` is refused.
pub(crate) fn smem_addresses(entry: &str, src: &str) -> Result<String> {
    let bad = |what: &str| mismatch(entry, "shared-address", what);
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
    let at = out.find(LAST_TYPEDEF).ok_or_else(|| bad("no int64 typedef to place the address helper after"))?;
    out.insert_str(at + LAST_TYPEDEF.len(), SMEM_AT);
    Ok(out)
}

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

/// Places the shared buffers of kernel `entry` one after the other in the order of their ids
/// (CubeCL numbers them in creation order), each aligned to the largest alignment CubeCL declared
/// for the dynamic shared memory. Returns the source and the bytes of shared memory it needs. A
/// buffer declaration of another form is refused; a kernel without shared memory is unchanged.
pub(crate) fn smem_layout(entry: &str, src: &str) -> Result<(String, u32)> {
    let bad = |what: &str| mismatch(entry, "shared-layout", what);
    const DYN: &str = " uint8 dynamic_shared_mem[];";
    let Some(dyn_at) = src.find(DYN) else {
        if src.contains("dynamic_shared_mem") {
            return Err(bad("shared memory without the `extern __shared__ __align__(N) uint8` array"));
        }
        return Ok((src.to_string(), 0));
    };
    let align: usize = src[..dyn_at]
        .rsplit_once("__align__(")
        .and_then(|(_, a)| a.strip_suffix(')'))
        .and_then(|a| a.parse().ok())
        .filter(|a: &usize| a.is_power_of_two())
        .ok_or_else(|| bad("no `__align__(N)` on the dynamic shared memory"))?;
    let lines: Vec<&str> = src.lines().collect();
    // (id, bytes, line of the declaration, text before and after the offset)
    let mut bufs = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(at) = line.find("dynamic_shared_mem[").filter(|_| !line.ends_with(DYN)) else { continue };
        if i == 0 || !line.contains(" = reinterpret_cast<") {
            return Err(bad(&format!("a use of the shared memory that is not a buffer declaration: `{line}`")));
        }
        let bytes = lines[i - 1]
            .strip_prefix("// Shared array size: ")
            .and_then(|c| c.split_once(", "))
            .map(|(_, b)| b)
            .or_else(|| lines[i - 1].strip_prefix("// Shared value size: "))
            .and_then(|b| b.strip_suffix(" bytes"))
            .and_then(|b| b.parse::<usize>().ok())
            .ok_or_else(|| bad(&format!("a buffer without its size comment: `{line}`")))?;
        let id = line
            .split_once("shared_memory_")
            .and_then(|(_, r)| r.split_once(' '))
            .and_then(|(n, _)| n.parse::<u32>().ok())
            .ok_or_else(|| bad(&format!("a buffer that is not `shared_memory_N`: `{line}`")))?;
        let open = at + "dynamic_shared_mem[".len();
        let close = line[open..].find(']').map(|c| open + c).ok_or_else(|| bad(&format!("an unterminated offset: `{line}`")))?;
        if line[open..close].parse::<usize>().is_err() {
            return Err(bad(&format!("an offset that is not a number: `{line}`")));
        }
        bufs.push((id, bytes, i, open, close));
    }
    bufs.sort_by_key(|b| b.0);
    let mut out: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    let mut at = 0usize;
    for &(_, bytes, i, open, close) in &bufs {
        out[i] = format!("{}{at}{}", &lines[i][..open], &lines[i][close..]);
        at = (at + bytes).next_multiple_of(align);
    }
    let mut text = out.join("\n");
    if src.ends_with('\n') {
        text.push('\n');
    }
    let total = u32::try_from(at).map_err(|_| bad("more shared memory than a u32 counts"))?;
    Ok((text, total))
}

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
    let bad = |what: &str| mismatch(entry, "bulk-reduction", what);
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
    let at = out.find(LAST_TYPEDEF).ok_or_else(|| bad("no int64 typedef to place the reduction helper after"))?;
    out.insert_str(at + LAST_TYPEDEF.len(), BULK_AT);
    Ok(out)
}

/// Asks ptxas for `blocks` resident cubes per multiprocessor: CubeCL prints
/// `__launch_bounds__(threads)` on every kernel; this adds the minimum-blocks argument, which caps
/// the registers per thread at 65536 / (blocks x threads) (NVRTC's `-maxrregcount` does not apply
/// to a kernel that has launch bounds). Used by the d64 forward (three cubes of 128 threads:
/// 168 registers instead of 214, 3-8% faster; docs/forward.md).
pub(crate) fn min_blocks(entry: &str, src: &str, blocks: u32) -> Result<String> {
    let at = src.find("__launch_bounds__(").ok_or_else(|| mismatch(entry, "launch-bounds", "no `__launch_bounds__(`"))?;
    let rest = &src[at + "__launch_bounds__(".len()..];
    let close = rest.find(')').ok_or_else(|| mismatch(entry, "launch-bounds", "an unterminated `__launch_bounds__`"))?;
    let threads = &rest[..close];
    if threads.is_empty() || !threads.chars().all(|c| c.is_ascii_digit()) || src[at + 1..].contains("__launch_bounds__(") {
        return Err(mismatch(entry, "launch-bounds", "not one `__launch_bounds__(threads)`"));
    }
    let mut out = String::with_capacity(src.len() + 8);
    out.push_str(&src[..at]);
    out.push_str(&format!("__launch_bounds__({threads}, {blocks})"));
    out.push_str(&rest[close + 1..]);
    Ok(out)
}

/// CubeCL's 4 x int8 vector (the int8 `mma.sync` fragment register) as it prints it.
const INT8_4: &str = "struct __align__(4) int8_4 {\n    int8 i_0;\n    int8 i_1;\n    int8 i_2;\n    int8 i_3;\n};";

/// The int8 forward (`int8_qk`) only moves whole 4 x int8 vectors between 32-bit words and the
/// `mma` operands (reinterpret casts, never a byte): CubeCL's struct of four `int8` makes NVRTC
/// split every copy into bytes and repack them (6 PRMT + shifts per IMMA; 2844 -> 1999
/// instructions per key tile at d128 with one 32-bit member). The struct becomes one `uint32`;
/// a kernel that reads a byte member (`.i_0`..`.i_3` of an `int8_4`) would no longer compile, so
/// a mistake here cannot pass silently.
pub(crate) fn int8_words(entry: &str, src: &str) -> Result<String> {
    if !src.contains(INT8_4) {
        return Err(mismatch(entry, "int8 word", "no `int8_4` struct"));
    }
    Ok(src.replacen(INT8_4, "struct __align__(4) int8_4 {\n    uint32 w;\n};", 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_vectors_become_words() {
        let src = format!("x\n{INT8_4}\ny");
        assert_eq!(int8_words("k", &src).unwrap(), "x\nstruct __align__(4) int8_4 {\n    uint32 w;\n};\ny");
        assert!(int8_words("k", "struct int8_4 { int8 a; };").is_err());
    }

    #[test]
    fn stmatrix_gets_a_store_path_below_sm90() {
        let wrapper = format!("void f(uint32 const &reg_0, uint32 addr) {{\n{STMATRIX_X4}}}\n");
        let out = stmatrix_fallback("k", &wrapper).unwrap();
        assert!(out.contains(STMATRIX_X4) && out.contains("__shfl_sync") && out.contains("st.shared.b32"), "{out}");
        assert!(out.find("#if __CUDA_ARCH__ >= 900").unwrap() < out.find("stmatrix.sync").unwrap());
        assert_eq!(stmatrix_fallback("k", "no stores").unwrap(), "no stores");
        let trans = wrapper.replace("m8n8.x4.shared", "m8n8.x4.trans.shared");
        assert!(stmatrix_fallback("k", &trans).is_err());
    }

    #[test]
    fn rewrites_base_two_calls_only() {
        let src = "a = __powf(float(2), l_3 * s - m);\nb = __powf(float(2.0), fma(x, y, z));\nc = __powf(2.0f, q);";
        let out = exp2_calls("k", src).unwrap();
        assert_eq!(out, "a = exp2f( l_3 * s - m);\nb = exp2f( fma(x, y, z));\nc = exp2f( q);");
    }

    const PIPE: &str = "// Wrapper for x\n  asm volatile(\"cp.async.mbarrier.arrive.shared::cta.b64 [%0];\\n\" :: \"r\"(m));\n\
        void f() {\n__cp_async_arrive(shared_memory_9);\nbarrier_9_token = shared_memory_9.arrive();\n\
        shared_memory_9.wait_parity(l_5);\n}\n";

    #[test]
    fn mbarrier_rewrites() {
        assert_eq!(mbarriers("k", PIPE, false, false).unwrap(), PIPE);
        let n = mbarriers("k", PIPE, true, false).unwrap();
        assert!(n.contains("arrive.noinc.shared::cta") && !n.contains(".arrive();"), "{n}");
        let s = mbarriers("k", PIPE, true, true).unwrap();
        assert!(s.contains("__cubeattn_wait_parity(shared_memory_9, l_5);") && !s.contains(".wait_parity("), "{s}");
        assert!(s.find("void __cubeattn_wait_parity").unwrap() < s.find("// Wrapper for").unwrap());
        // an explicit arrive that no copy arrival precedes is refused
        let odd = PIPE.replace("__cp_async_arrive(shared_memory_9);\n", "__cp_async_arrive(shared_memory_9);\nx = 1;\n");
        assert!(mbarriers("k", &odd, true, false).is_err());
        assert_eq!(mbarriers("k", "no pipeline", true, true).unwrap(), "no pipeline");
    }

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
        // a shared operand of another form, or a wrapper that changed, is refused
        assert!(smem_addresses("k", &WRAPPERS.replace("shared_memory_1 + l_1079", "shared_memory_1 + l_1 * 2")).is_err());
        assert!(smem_addresses("k", &WRAPPERS.replace("shared_memory_1 + l_1079", "&shared_memory_1[l_1079]")).is_err());
        assert!(smem_addresses("k", &WRAPPERS.replace("(__cvta_generic_to_shared(row_addr))", "(row_addr)")).is_err());
    }

    #[test]
    fn shared_layout_in_declaration_order() {
        let src = "extern __shared__ __align__(16) uint8 dynamic_shared_mem[];\n\
            // Shared array size: 4, 8 bytes\n\
            float *shared_memory_9 = reinterpret_cast<float*>(&dynamic_shared_mem[0]);\n\
            // Shared value size: 8 bytes\n\
            cuda::barrier<cuda::thread_scope_block> &shared_memory_2 = reinterpret_cast<cuda::barrier<cuda::thread_scope_block>&>(dynamic_shared_mem[16]);\n\
            // Shared array size: 40, 80 bytes\n\
            __half *shared_memory_5 = reinterpret_cast<__half*>(&dynamic_shared_mem[32]);\n";
        let (out, total) = smem_layout("k", src).unwrap();
        assert!(out.contains("&shared_memory_2 = reinterpret_cast<cuda::barrier<cuda::thread_scope_block>&>(dynamic_shared_mem[0]);"), "{out}");
        assert!(out.contains("*shared_memory_5 = reinterpret_cast<__half*>(&dynamic_shared_mem[16]);"), "{out}");
        assert!(out.contains("*shared_memory_9 = reinterpret_cast<float*>(&dynamic_shared_mem[96]);"), "{out}");
        assert_eq!(total, 112);
        assert_eq!(smem_layout("k", "no shared memory").unwrap(), ("no shared memory".to_string(), 0));
        // a size comment or a declaration of another form is refused
        assert!(smem_layout("k", &src.replace("// Shared value size: 8 bytes\n", "")).is_err());
        assert!(smem_layout("k", &format!("{src}x = dynamic_shared_mem[3];\n")).is_err());
        assert!(smem_layout("k", &src.replace("__align__(16) ", "")).is_err());
    }

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
        // sizes that are not 16-byte multiples, other types, other operand forms are refused
        assert!(bulk_adds("k", &BULK.replace("<512>", "<8>")).is_err());
        assert!(bulk_adds("k", &BULK.replace("float_2 *shared_memory_5 = reinterpret_cast<float_2", "__half *shared_memory_5 = reinterpret_cast<__half")).is_err());
        assert!(bulk_adds("k", &BULK.replace("float_2* buffer_7,", "__nv_bfloat16* buffer_7,")).is_err());
        assert!(bulk_adds("k", &BULK.replace("buffer_7 + l_12", "&buffer_7[l_12]")).is_err());
    }

    #[test]
    fn min_blocks_adds_the_second_launch_bound() {
        let src = "extern \"C\" __global__ void __launch_bounds__(128)k_ (\n int x) {}";
        assert_eq!(
            min_blocks("k_", src, 3).unwrap(),
            "extern \"C\" __global__ void __launch_bounds__(128, 3)k_ (\n int x) {}"
        );
        assert!(min_blocks("k_", "__global__ void k_() {}", 3).is_err());
        assert!(min_blocks("k_", "__launch_bounds__(128, 2)k_", 3).is_err());
    }

    #[test]
    fn fails_loudly_when_the_pattern_is_gone() {
        assert!(exp2_calls("k", "a = __expf(x);").is_err());
        assert!(exp2_calls("k", "a = __powf(float(3), x);").is_err());
        assert!(exp2_calls("k", "a = __powf(float(2) x);").is_err());
        let e = exp2_calls("flash_fwd", "y = 1;").unwrap_err().to_string();
        assert!(e.contains("flash_fwd") && e.contains("rewrite.rs"), "{e}");
    }
}
