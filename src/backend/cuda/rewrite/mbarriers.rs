//! The cp.async barrier protocol. The cp.async pipelines (CubeCL's `Barrier::commit_copy_async` +
//! `arrive` + `wait_parity`) are emitted as `cp.async.mbarrier.arrive` (which raises the barrier's
//! pending count, then arrives when the thread's copies land) followed by a second, explicit
//! `barrier.arrive()`, and waited with libcu++'s `wait_parity` (a `try_wait` loop with a
//! clock-driven back-off). [`mbarriers`] rewrites both: `noinc` makes the copy arrival the thread's
//! one arrival of the phase (`.noinc`, the explicit arrive dropped; compute-sanitizer's synccheck
//! reported "Missing wait" on every cp.async barrier before, none after); `spin` waits with a plain
//! `mbarrier.try_wait.parity` loop (`test_wait` below sm_90, where `try_wait` does not exist, and
//! with `CUBEATTN_PORTABLE`; used by the backward kernels, see `compile::codegen_exp2`; measured in
//! docs/forward.md, "Forward order, O rescale, mbarrier protocol").

use super::mismatch;
use crate::error::Result;

const CP_ARRIVE_ASM: &str = "cp.async.mbarrier.arrive.shared::cta.b64";
const CP_ARRIVE_CALL: &str = "__cp_async_arrive(";

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
    let bad = |what: &str| mismatch(entry, "mbarriers", what);
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(mbarriers("k", "no pipeline", true, true).unwrap(), "no pipeline");
    }

    #[test]
    fn refuses_an_arrive_without_a_copy_arrival() {
        // an explicit arrive that no copy arrival precedes is refused
        let odd = PIPE.replace("__cp_async_arrive(shared_memory_9);\n", "__cp_async_arrive(shared_memory_9);\nx = 1;\n");
        let e = mbarriers("k", &odd, true, false).unwrap_err().to_string();
        assert!(e.contains("rewrite/mbarriers.rs"), "{e}");
    }
}
