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
//! loop (used by the backward kernels, see `compile::codegen_exp2`; bench/NOTES.md).

use crate::error::{Error, Result};

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

fn changed(entry: &str, what: &str) -> Error {
    Error::Device(format!(
        "CubeCL's generated source for {entry} has {what}: the exp2 rewrite (src/backend/cuda/rewrite.rs) does not \
         match this CubeCL version's output"
    ))
}

const CP_ARRIVE_ASM: &str = "cp.async.mbarrier.arrive.shared::cta.b64";
const CP_ARRIVE_CALL: &str = "__cp_async_arrive(";
const SPIN_WAIT: &str = r#"
__device__ __forceinline__ void __cubeattn_wait_parity(::cuda::barrier<::cuda::thread_scope_block> &bar, uint32 parity) {
  uint32 a = static_cast<uint32>(__cvta_generic_to_shared(::cuda::device::barrier_native_handle(bar)));
  asm volatile("{\n.reg .pred p;\nW%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W%=;\n}\n"
               :: "r"(a), "r"(parity) : "memory");
}
"#;

/// Applies the mbarrier rewrites `(noinc, spin)` to kernel `entry` (a no-op for kernels without
/// cp.async barriers). Every explicit arrive must directly follow a copy arrival on the same
/// barrier, else the rewrite refuses.
pub(crate) fn mbarriers(entry: &str, src: &str, noinc: bool, spin: bool) -> Result<String> {
    if !src.contains(CP_ARRIVE_CALL) {
        return Ok(src.to_string());
    }
    let bad = |what: &str| {
        Error::Device(format!(
            "CubeCL's generated source for {entry} has {what}: the mbarrier rewrite (src/backend/cuda/rewrite.rs) \
             does not match this CubeCL version's output"
        ))
    };
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
        return Err(Error::Device(format!(
            "CubeCL's generated source for {entry} has no `int8_4` struct as rewrite.rs expects (int8_words)"
        )));
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

    #[test]
    fn fails_loudly_when_the_pattern_is_gone() {
        assert!(exp2_calls("k", "a = __expf(x);").is_err());
        assert!(exp2_calls("k", "a = __powf(float(3), x);").is_err());
        assert!(exp2_calls("k", "a = __powf(float(2) x);").is_err());
        let e = exp2_calls("flash_fwd", "y = 1;").unwrap_err().to_string();
        assert!(e.contains("flash_fwd") && e.contains("rewrite.rs"), "{e}");
    }
}
