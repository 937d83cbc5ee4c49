//! FP8 E4M3 (the `e4m3fn` format of NVIDIA's FP8 tensor cores and the OCP spec): 1 sign bit, 4
//! exponent bits (bias 7), 3 mantissa bits, no infinities. Codes (magnitude bits, the sign in bit 7):
//! `0x00` zero, `0x01..=0x07` subnormals `m * 2^-9`, `0x08..=0x7E` normals `(1 + m / 8) * 2^(e - 7)`
//! from `2^-6` to the largest finite value 448 (`0x7E`), `0x7F` NaN (`0xFF` too).
//!
//! Rounding is PTX `cvt.rn.satfinite.e4m3x2.f32`'s: to nearest, ties to even; a magnitude that
//! rounds above 448 (everything from 464 up) and +-Inf saturate to +-448; NaN stays NaN (code
//! `0x7F`); the sign of zero is kept; magnitudes up to half the smallest subnormal (`2^-10`,
//! included: a tie goes to the even code, zero) become a signed zero. Used by the CPU emulation
//! of the block-sparse FP8 P.V option (`crate::sparse::Int8Qk::pv_fp8`).

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// The smallest normal e4m3 value, 2^-6.
const MIN_NORMAL: f32 = 1.0 / 64.0;
/// Subnormals are multiples of 2^-9.
const SUBNORMAL_STEPS: f32 = 512.0;

/// `x` rounded to the nearest e4m3 value (see the module docs), as an f32 (exact: every e4m3
/// value is an f32).
#[inline]
pub fn e4m3_round(x: f32) -> f32 {
    let a = x.abs();
    let r = if a < MIN_NORMAL {
        // subnormal range: multiples of 2^-9 (scaling by a power of two is exact here); 8 * 2^-9
        // is the smallest normal, so rounding up across the boundary is right too
        (a * SUBNORMAL_STEPS).round_ties_even() * (1.0 / SUBNORMAL_STEPS)
    } else if a < E4M3_MAX {
        // a normal f32: keep 3 of its 23 mantissa bits, round half to even on the 20 dropped ones
        // (a carry into the exponent is the right result); 464 and up round to 480: saturate
        let b = a.to_bits();
        f32::from_bits((b + 0x7_FFFF + ((b >> 20) & 1)) & !0xF_FFFF).min(E4M3_MAX)
    } else if a.is_nan() {
        return f32::NAN;
    } else {
        E4M3_MAX
    };
    r.copysign(x)
}

/// The e4m3 code of `x` (rounded as [`e4m3_round`]; NaN -> `0x7F`).
pub fn f32_to_e4m3_bits(x: f32) -> u8 {
    let r = e4m3_round(x);
    if r.is_nan() {
        return 0x7F;
    }
    let sign = if r.is_sign_negative() { 0x80 } else { 0 };
    let a = r.abs();
    let mag = if a < MIN_NORMAL {
        (a * SUBNORMAL_STEPS) as u8
    } else {
        let b = a.to_bits();
        let e = (b >> 23) - 120; // f32 exponent bias 127, e4m3 bias 7
        ((e << 3) | ((b >> 20) & 7)) as u8
    };
    sign | mag
}

/// The value of e4m3 code `b` (NaN for `0x7F` / `0xFF`).
pub fn e4m3_bits_to_f32(b: u8) -> f32 {
    let (e, m) = ((b >> 3) & 0xF, b & 7);
    let a = match (e, m) {
        (15, 7) => f32::NAN,
        (0, m) => m as f32 / SUBNORMAL_STEPS,
        (e, m) => f32::from_bits(((e as u32 + 120) << 23) | ((m as u32) << 20)),
    };
    if b & 0x80 != 0 { -a } else { a }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finite_codes() -> impl Iterator<Item = u8> {
        (0..=255u8).filter(|&b| b & 0x7F != 0x7F)
    }

    /// The value of the e4m3 code nearest `x` by exhaustive search in f64 (ties: the even code),
    /// saturating: an independent statement of the rounding rule for finite `x`.
    fn nearest_by_search(x: f32) -> f32 {
        let xd = x as f64;
        let mut best = (f64::INFINITY, 0u8);
        for b in 0..=0x7Eu8 {
            let v = e4m3_bits_to_f32(b) as f64;
            let err = (v - xd.abs()).abs();
            if err < best.0 || (err == best.0 && b % 2 == 0) {
                best = (err, b);
            }
        }
        e4m3_bits_to_f32(best.1).copysign(x)
    }

    #[test]
    fn every_code_decodes_and_encodes_back() {
        assert_eq!(e4m3_bits_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_bits_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_bits_to_f32(0x38), 1.0);
        assert_eq!(e4m3_bits_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_bits_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_bits_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_bits_to_f32(0x00).to_bits(), 0.0f32.to_bits());
        assert_eq!(e4m3_bits_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        assert!(e4m3_bits_to_f32(0x7F).is_nan() && e4m3_bits_to_f32(0xFF).is_nan());
        for b in finite_codes() {
            let v = e4m3_bits_to_f32(b);
            assert!(v.is_finite(), "{b:#04x}");
            assert_eq!(f32_to_e4m3_bits(v), b, "{b:#04x} = {v}");
            assert_eq!(e4m3_round(v).to_bits(), v.to_bits(), "{b:#04x} = {v}");
            assert_eq!(e4m3_bits_to_f32(b ^ 0x80).to_bits(), (-v).to_bits());
        }
        // the positive codes are strictly increasing in value (so neighbours are neighbours)
        for b in 0..0x7Eu8 {
            assert!(e4m3_bits_to_f32(b) < e4m3_bits_to_f32(b + 1), "{b:#04x}");
        }
    }

    #[test]
    fn midpoints_round_to_the_even_code() {
        for b in 0..0x7Eu8 {
            let (lo, hi) = (e4m3_bits_to_f32(b), e4m3_bits_to_f32(b + 1));
            let mid = (lo + hi) / 2.0; // exact in f32
            assert_eq!(((mid as f64) - lo as f64), (hi as f64 - mid as f64));
            let even = if b % 2 == 0 { lo } else { hi };
            for s in [1.0f32, -1.0] {
                assert_eq!(e4m3_round(s * mid), s * even, "midpoint of {b:#04x} and {:#04x}", b + 1);
                // one f32 ulp either side decides
                let below = f32::from_bits(mid.to_bits() - 1);
                let above = f32::from_bits(mid.to_bits() + 1);
                assert_eq!(e4m3_round(s * below), s * lo, "just below the midpoint of {b:#04x}");
                assert_eq!(e4m3_round(s * above), s * hi, "just above the midpoint of {b:#04x}");
            }
        }
        // the subnormal / normal boundary and the binade edges, spelled out
        let t = |x: f32| e4m3_round(x);
        assert_eq!(t(1.0625), 1.0); // between 1 (0x38, even) and 1.125 (0x39)
        assert_eq!(t(1.1875), 1.25); // between 1.125 (0x39) and 1.25 (0x3A, even)
        assert_eq!(t(15.0 * 2f32.powi(-10)), 2f32.powi(-6)); // between 7 * 2^-9 (0x07) and 2^-6 (0x08)
        assert_eq!(t(3.0 * 2f32.powi(-10)), 2.0 * 2f32.powi(-9)); // between 0x01 and 0x02 (even)
        assert_eq!(t(248.0), 256.0); // between 240 (0x77) and 256 (0x78, even)
        assert_eq!(t(232.0), 224.0); // between 224 (0x76, even) and 240 (0x77)
        assert_eq!(t(416.0), 416.0); // 0x7D
        assert_eq!(t(440.0), 448.0); // between 416 (0x7D) and 448 (0x7E, even)
    }

    #[test]
    fn saturates_keeps_nan_and_signed_zero() {
        for (x, want) in [
            (448.0f32, 448.0f32),
            (449.0, 448.0),
            (463.99, 448.0),
            (464.0, 448.0),
            (464.01, 448.0),
            (480.0, 448.0),
            (1e6, 448.0),
            (f32::MAX, 448.0),
            (f32::INFINITY, 448.0),
        ] {
            assert_eq!(e4m3_round(x), want, "{x}");
            assert_eq!(e4m3_round(-x), -want, "-{x}");
            assert_eq!(f32_to_e4m3_bits(x), 0x7E, "{x}");
            assert_eq!(f32_to_e4m3_bits(-x), 0xFE, "-{x}");
        }
        for n in [f32::NAN, -f32::NAN, f32::from_bits(0x7FC0_1234)] {
            assert!(e4m3_round(n).is_nan());
            assert_eq!(f32_to_e4m3_bits(n), 0x7F);
        }
        assert_eq!(e4m3_round(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(e4m3_round(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(f32_to_e4m3_bits(-0.0), 0x80);
        assert_eq!(f32_to_e4m3_bits(0.0), 0x00);
    }

    #[test]
    fn below_half_the_smallest_subnormal_is_signed_zero() {
        let half = 2f32.powi(-10);
        for x in [half, f32::from_bits(half.to_bits() - 1), 1e-5, 1e-30, f32::MIN_POSITIVE, f32::from_bits(1)] {
            assert_eq!(e4m3_round(x).to_bits(), 0.0f32.to_bits(), "{x:e}");
            assert_eq!(e4m3_round(-x).to_bits(), (-0.0f32).to_bits(), "-{x:e}");
            assert_eq!(f32_to_e4m3_bits(-x), 0x80);
        }
        // just above half of 2^-9: up to the smallest subnormal
        let above = f32::from_bits(half.to_bits() + 1);
        assert_eq!(e4m3_round(above), 2f32.powi(-9));
        assert_eq!(e4m3_round(-above), -(2f32.powi(-9)));
    }

    #[test]
    fn agrees_with_an_exhaustive_nearest_search() {
        // every f32 exponent in the e4m3 range and around it, mantissas on a coarse grid plus the
        // bit patterns near each e4m3 value and midpoint; then random bit patterns
        let mut xs: Vec<f32> = Vec::new();
        for e in -14i32..=10 {
            for m in 0..64u32 {
                xs.push(f32::from_bits((((e + 127) as u32) << 23) | (m << 17) | (m * 977 % 4096)));
            }
        }
        for b in 0..0x7Eu8 {
            let (lo, hi) = (e4m3_bits_to_f32(b), e4m3_bits_to_f32(b + 1));
            for c in [lo, (lo + hi) / 2.0, hi] {
                for d in -3i32..=3 {
                    let bits = c.to_bits() as i64 + d as i64;
                    if bits > 0 {
                        xs.push(f32::from_bits(bits as u32));
                    }
                }
            }
        }
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..20_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // exponents 2^-12 .. 2^9 (mostly inside the e4m3 range), any mantissa
            let e = 115 + (s >> 40) as u32 % 22;
            xs.push(f32::from_bits((e << 23) | (s as u32 & 0x7F_FFFF)));
        }
        for &x in &xs {
            for x in [x, -x] {
                let want = nearest_by_search(x);
                assert_eq!(e4m3_round(x).to_bits(), want.to_bits(), "{x:e} ({:#010x})", x.to_bits());
            }
        }
    }
}
