//! FP8 E4M3 ("e4m3fn", as NVIDIA's `__nv_fp8_e4m3`): 1 sign, 4 exponent (bias 7), 3 mantissa
//! bits, no infinities, one NaN pattern per sign (`S.1111.111`), largest finite value 448.
//!
//! Encoding rounds to nearest even and saturates: a finite value beyond ±448 (and ±inf) becomes
//! ±448, NaN stays NaN. This is PTX's `cvt.rn.satfinite.e4m3x2.f32` behaviour, written in plain
//! integer/float arithmetic so that pre-sm_89 GPUs and the CPU reference give identical bytes.

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// The canonical (positive) NaN byte.
pub const E4M3_NAN: u8 = 0x7f;

/// f32 -> E4M3, round to nearest even, saturating to ±448.
#[inline(always)]
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let mag = bits & 0x7fff_ffff;
    if mag > 0x7f80_0000 {
        return E4M3_NAN | sign;
    }
    if mag >= 0x43e0_0000 {
        // |x| >= 448 (including inf): saturate.
        return 0x7e | sign;
    }
    if mag >= 0x3c80_0000 {
        // Normal E4M3 (|x| >= 2^-6): rebias the exponent from 127 to 7, then round the 23-bit
        // mantissa to 3 bits, ties to even. Values below 448 round at most to 448 (0x7e).
        let rebiased = mag - (120 << 23);
        let round = 0x7_ffff + ((rebiased >> 20) & 1);
        return ((rebiased + round) >> 20) as u8 | sign;
    }
    // Subnormal E4M3: multiples of 2^-9. Scale and round to an integer, ties to even, using the
    // 2^23 trick (exact in f32 round-to-nearest-even arithmetic). A result of 8 is the smallest
    // normal (code 0x08), which the bit pattern gives for free.
    let scaled = f32::from_bits(mag) * 512.0;
    let rounded = (scaled + 8_388_608.0) - 8_388_608.0;
    (rounded as u32) as u8 | sign
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
