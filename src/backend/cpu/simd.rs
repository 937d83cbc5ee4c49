//! Vectorised row kernels for the softmax parts of the CPU backend.
//!
//! The crate is built for baseline x86-64, so each hot function is compiled three times (AVX-512,
//! AVX2+FMA, baseline) by [`multiversion!`] and the best version is picked once at run time.

use std::sync::OnceLock;

/// 0 = baseline, 1 = AVX2+FMA, 2 = AVX-512.
pub(crate) fn simd_level() -> u8 {
    static LEVEL: OnceLock<u8> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("fma")
            {
                return 2;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return 1;
            }
        }
        0
    })
}

/// Defines `pub(crate) fn $name(args)` that runs `$body` compiled for the best SIMD level.
macro_rules! multiversion {
    ($(#[$m:meta])* fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        pub(crate) fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn inner($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? { inner($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? { inner($($arg),*) }
                // SAFETY: the CPU features each version needs were detected at run time.
                match $crate::backend::cpu::simd::simd_level() {
                    2 => unsafe { v4($($arg),*) },
                    1 => unsafe { v3($($arg),*) },
                    _ => inner($($arg),*),
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                inner($($arg),*)
            }
        }
    };
}
pub(crate) use multiversion;

/// f32 lanes of an AVX-512 register (the width the loops here are written for).
pub(crate) const LANES: usize = 16;

/// 2^x for x <= 0 (values below -127 give 0). Relative error about 1e-7 (degree-7 polynomial).
#[inline(always)]
pub(crate) fn exp2_neg(x: f32) -> f32 {
    let x = if x < -127.0 { -127.0 } else { x };
    // round to nearest with the 1.5*2^23 trick (|x| <= 127 here): the integer lands in the low
    // mantissa bits of `t`, so no float->int conversion (which would not vectorise) is needed.
    let t = x + 12_582_912.0;
    let n_int = t.to_bits() as i32 - 0x4B40_0000;
    let f = x - (t - 12_582_912.0); // in [-0.5, 0.5]
    const C: [f32; 8] = [
        1.0,
        std::f32::consts::LN_2,
        0.240_226_5,
        0.055_504_11,
        0.009_618_129,
        0.001_333_355_8,
        0.000_154_035_3,
        0.000_015_252_734,
    ];
    let mut p = C[7];
    for i in (0..7).rev() {
        p = p.mul_add(f, C[i]);
    }
    let bits = ((n_int + 127) as u32) << 23;
    p * f32::from_bits(bits)
}

/// Maximum of a slice (-inf when empty); written so that it vectorises.
#[inline(always)]
pub(crate) fn max_of(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &x in acc.iter().chain(rest) {
        m = if x > m { x } else { m };
    }
    m
}

/// In place: x <- 2^(x - m); returns the sum. `m` must be finite and >= every x.
#[inline(always)]
pub(crate) fn exp2_sub_sum(xs: &mut [f32], m: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            let e = exp2_neg(c[i] - m);
            c[i] = e;
            acc[i] += e;
        }
    }
    let mut s = 0.0;
    for x in chunks.into_remainder() {
        *x = exp2_neg(*x - m);
        s += *x;
    }
    s + acc.iter().sum::<f32>()
}

/// In place: x <- 2^(c*x - m); returns the sum. `m` must be finite and >= every c*x.
#[inline(always)]
pub(crate) fn exp2_scaled_sub_sum(xs: &mut [f32], c: f32, m: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for ch in &mut chunks {
        for i in 0..LANES {
            let e = exp2_neg(ch[i].mul_add(c, -m));
            ch[i] = e;
            acc[i] += e;
        }
    }
    let mut s = 0.0;
    for x in chunks.into_remainder() {
        *x = exp2_neg(x.mul_add(c, -m));
        s += *x;
    }
    s + acc.iter().sum::<f32>()
}

#[inline(always)]
pub(crate) fn scale_in_place(xs: &mut [f32], c: f32) {
    for x in xs {
        *x *= c;
    }
}

/// The sum of a vector's lanes as a tree (halves added until one lane is left): four dependent
/// vector adds where a lane-by-lane sum is `LANES` dependent scalar adds.
#[inline(always)]
pub(crate) fn hsum(x: &[f32; LANES]) -> f32 {
    let mut t = *x;
    let mut w = LANES / 2;
    while w > 0 {
        for e in 0..w {
            t[e] += t[e + w];
        }
        w /= 2;
    }
    t[0]
}

#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let mut s: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    s += acc.iter().sum::<f32>();
    s
}

/// Element types the CPU backend widens to f32 a slice at a time: f16 through `half`'s slice
/// conversion (F16C found at run time: 0.2 ns an element where `f16::to_f32` one at a time checks
/// for it on every call and took 1.4 ns here), bf16 by a shift compiled for the best SIMD level.
pub(crate) trait Widen: crate::dtype::Element {
    /// `dst[i] = src[i]` as f32 (equal lengths).
    fn widen(src: &[Self], dst: &mut [f32]);
}

impl Widen for f32 {
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Widen for half::f16 {
    fn widen(src: &[half::f16], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}

impl Widen for half::bf16 {
    fn widen(src: &[half::bf16], dst: &mut [f32]) {
        widen_bf16(src, dst);
    }
}

multiversion! {
    /// bf16 -> f32: the 16 bits above 16 zero bits (the value `bf16::to_f32` gives; a signalling
    /// NaN is not quieted).
    fn widen_bf16(src: &[half::bf16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        for (o, x) in dst.iter_mut().zip(src) {
            *o = f32::from_bits((x.to_bits() as u32) << 16);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_a_slice_is_to_f32_of_every_bit_pattern() {
        let hs: Vec<half::f16> = (0..=u16::MAX).map(half::f16::from_bits).collect();
        let bs: Vec<half::bf16> = (0..=u16::MAX).map(half::bf16::from_bits).collect();
        let mut out = vec![0.0f32; hs.len()];
        // odd lengths and offsets too (the vector loops' tails)
        for (a, b) in [(0usize, hs.len()), (3, 40_000), (7, 8)] {
            <half::f16 as Widen>::widen(&hs[a..b], &mut out[..b - a]);
            for (x, y) in hs[a..b].iter().zip(&out) {
                let w = x.to_f32();
                assert!(w.to_bits() == y.to_bits() || (w.is_nan() && y.is_nan()), "f16 {:#06x}: {w} vs {y}", x.to_bits());
            }
            <half::bf16 as Widen>::widen(&bs[a..b], &mut out[..b - a]);
            // (a NaN stays a NaN: `bf16::to_f32` also sets the quiet bit of a signalling one)
            for (x, y) in bs[a..b].iter().zip(&out) {
                let w = x.to_f32();
                assert!(w.to_bits() == y.to_bits() || (w.is_nan() && y.is_nan()), "bf16 {:#06x}: {w} vs {y}", x.to_bits());
            }
        }
    }

    #[test]
    fn exp2_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = -126.0f32;
        while x <= 0.0 {
            let got = exp2_neg(x) as f64;
            let want = (x as f64).exp2();
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp2_neg(-200.0), 0.0f32.max(exp2_neg(-200.0)));
        assert!(exp2_neg(-200.0) < 1e-37);
        assert_eq!(exp2_neg(0.0), 1.0);
    }

    #[test]
    fn reductions_match_scalar() {
        let xs: Vec<f32> = (0..77).map(|i| ((i * 37) % 101) as f32 * 0.1 - 3.0).collect();
        let m = xs.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(max_of(&xs), m);
        let mut ys = xs.clone();
        let s = exp2_sub_sum(&mut ys, m);
        let want: f64 = xs.iter().map(|&x| ((x - m) as f64).exp2()).sum();
        assert!((s as f64 - want).abs() / want < 1e-6);
        assert!((dot(&xs, &xs) as f64 - xs.iter().map(|&x| (x * x) as f64).sum::<f64>()).abs() < 1e-3);
    }
}
