//! The two FP8 cache formats, as NVIDIA's `__nv_fp8_e4m3` and `__nv_fp8_e5m2`:
//! - E4M3 ("e4m3fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities, one NaN
//!   pattern per sign (`S.1111.111`), largest finite value 448.
//! - E5M2: 1 sign, 5 exponent (bias 15), 2 mantissa bits: the upper byte of an IEEE f16, with its
//!   infinities and NaNs, largest finite value 57344.
//!
//! Encoding rounds to nearest even and saturates: a finite value beyond the largest (and ±inf)
//! becomes the largest, NaN stays NaN. This is PTX's `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`
//! behaviour, written in plain integer/float arithmetic so that pre-sm_89 GPUs and the CPU
//! reference give identical bytes.

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// The canonical (positive) NaN byte.
pub const E4M3_NAN: u8 = 0x7f;

/// An FP8 format's encoding constants, for [`f32_to_fp8`].
struct Encoding {
    /// Mantissa bits.
    mant_bits: u32,
    /// Exponent bias.
    bias: u32,
    /// The largest finite code, and its value's f32 bits (magnitudes from there saturate).
    max_code: u8,
    max_bits: u32,
    /// The smallest normal value's f32 bits.
    min_normal_bits: u32,
    /// 2^k for the subnormals' spacing 2^-k.
    subnormal_scale: f32,
}

/// f32 -> FP8 of `e`, round to nearest even, saturating to the largest finite value; NaN to
/// `S.1111111` (a NaN in both formats).
#[inline(always)]
fn f32_to_fp8(x: f32, e: Encoding) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let mag = bits & 0x7fff_ffff;
    if mag > 0x7f80_0000 {
        return 0x7f | sign;
    }
    if mag >= e.max_bits {
        // Past the largest value (including inf): saturate. Below it, values round at most to
        // the largest.
        return e.max_code | sign;
    }
    if mag >= e.min_normal_bits {
        // Normal: rebias the exponent from 127, then round the 23-bit mantissa to
        // `mant_bits`, ties to even.
        let shift = 23 - e.mant_bits;
        let rebiased = mag - ((127 - e.bias) << 23);
        let round = ((1 << (shift - 1)) - 1) + ((rebiased >> shift) & 1);
        return ((rebiased + round) >> shift) as u8 | sign;
    }
    // Subnormal: multiples of 1 / subnormal_scale. Scale and round to an integer, ties to even,
    // using the 2^23 trick (exact in f32 round-to-nearest-even arithmetic). A result of
    // 2^mant_bits is the smallest normal, which the bit pattern gives for free.
    let scaled = f32::from_bits(mag) * e.subnormal_scale;
    let rounded = (scaled + 8_388_608.0) - 8_388_608.0;
    (rounded as u32) as u8 | sign
}

/// f32 -> E4M3, round to nearest even, saturating to ±448.
#[inline(always)]
pub fn f32_to_e4m3(x: f32) -> u8 {
    let e = Encoding { mant_bits: 3, bias: 7, max_code: 0x7e, max_bits: 0x43e0_0000, min_normal_bits: 0x3c80_0000, subnormal_scale: 512.0 };
    f32_to_fp8(x, e)
}

/// E4M3 -> f32 (exact).
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = ((b as u32) & 0x80) << 24;
    let exp = ((b >> 3) & 0xf) as u32;
    let mant = (b & 7) as u32;
    let mag = if exp == 0 {
        // Subnormal: mant * 2^-9.
        mant as f32 * (1.0 / 512.0)
    } else if exp == 15 && mant == 7 {
        f32::NAN
    } else {
        f32::from_bits(((exp + 120) << 23) | (mant << 20))
    };
    f32::from_bits(mag.to_bits() | sign)
}

/// Quantise a value for an FP8 cache with a per-tensor scale: `x / scale` (one correctly
/// rounded f32 division, as vLLM; not `x * (1 / scale)`, which rounds twice), then
/// [`f32_to_e4m3`].
#[inline(always)]
pub fn quantize_e4m3(x: f32, scale: f32) -> u8 {
    f32_to_e4m3(x / scale)
}

/// Largest finite E5M2 magnitude.
pub const E5M2_MAX: f32 = 57344.0;
/// The canonical (positive) NaN byte of E5M2 (`cvt.rn.satfinite.e5m2x2.f32`'s).
pub const E5M2_NAN: u8 = 0x7f;

/// f32 -> E5M2, round to nearest even, saturating to ±57344.
#[inline(always)]
pub fn f32_to_e5m2(x: f32) -> u8 {
    let e =
        Encoding { mant_bits: 2, bias: 15, max_code: 0x7b, max_bits: 0x4760_0000, min_normal_bits: 0x3880_0000, subnormal_scale: 65536.0 };
    f32_to_fp8(x, e)
}

/// E5M2 -> f32 (exact).
#[inline(always)]
pub fn e5m2_to_f32(b: u8) -> f32 {
    let sign = ((b as u32) & 0x80) << 24;
    let exp = ((b >> 2) & 0x1f) as u32;
    let mant = (b & 3) as u32;
    let mag = if exp == 0 {
        // Subnormal: mant * 2^-16.
        mant as f32 * (1.0 / 65536.0)
    } else if exp == 31 {
        if mant == 0 {
            f32::INFINITY
        } else {
            f32::NAN
        }
    } else {
        f32::from_bits(((exp + 112) << 23) | (mant << 21))
    };
    f32::from_bits(mag.to_bits() | sign)
}

/// Quantise a value for an E5M2 cache: `x / scale`, then [`f32_to_e5m2`] ([`quantize_e4m3`]'s
/// rounding).
#[inline(always)]
pub fn quantize_e5m2(x: f32, scale: f32) -> u8 {
    f32_to_e5m2(x / scale)
}

/// f32 -> bf16 bits, round to nearest even (NaN kept quiet).
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if (bits & 0x7fff_ffff) > 0x7f80_0000 {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    ((bits + round) >> 16) as u16
}

/// bf16 bits -> f32 (exact).
#[inline(always)]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}
