//! `2^x` as `exp2f`. CubeCL 0.10 has no exp2 operation. The flash kernels write `2^x` as
//! `f32::powf(2.0, x)` under fast-math flags (`kernels::math::fast_exp2`), which CubeCL emits as
//! `__powf(float(2), x)`; with `-ftz=true` NVRTC makes that FFMA + FADD + MUFU.EX2 per score,
//! against FFMA + MUFU.EX2 for `exp2f(x)` (FlashAttention-2's code). [`exp2_calls`] turns every
//! `__powf` whose base is the constant 2 into `exp2f`. A kernel built with the rewrite must contain
//! at least one such call and no other `__powf`, else [`exp2_calls`] fails loudly: a CubeCL that
//! prints the call differently is caught at the first compile, not by a slow kernel.

use super::mismatch;
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
    mismatch(entry, "exp2", what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_base_two_calls_only() {
        let src = "a = __powf(float(2), l_3 * s - m);\nb = __powf(float(2.0), fma(x, y, z));\nc = __powf(2.0f, q);";
        let out = exp2_calls("k", src).unwrap();
        assert_eq!(out, "a = exp2f( l_3 * s - m);\nb = exp2f( fma(x, y, z));\nc = exp2f( q);");
    }

    #[test]
    fn fails_loudly_when_the_pattern_is_gone() {
        assert!(exp2_calls("k", "a = __expf(x);").is_err());
        assert!(exp2_calls("k", "a = __powf(float(3), x);").is_err());
        assert!(exp2_calls("k", "a = __powf(float(2) x);").is_err());
        let e = exp2_calls("flash_fwd", "y = 1;").unwrap_err().to_string();
        assert!(e.contains("flash_fwd") && e.contains("rewrite/exp2.rs"), "{e}");
    }
}
