//! Element formats the kernels read and write: queries and
//! outputs in f16/bf16; the FP8 cache formats (E4M3, E5M2).

use crate::blocks::mma::byte_perm;
use crate::blocks::vec_io::{bf16x2_to_f32, f16x2_to_f32, f32_to_f16_bits};
use attn_math::fp8::f32_to_bf16_bits;
#[cfg(not(hw_fp8))]
use attn_math::fp8::{f32_to_e4m3, f32_to_e5m2};

/// Query / output element (16-bit float).
pub trait HalfFloat {
    fn unpack2(w: u32) -> (f32, f32);
    fn pack(x: f32) -> u16;
}

pub struct F16;
pub struct Bf16;

impl HalfFloat for F16 {
    #[inline(always)]
    fn unpack2(w: u32) -> (f32, f32) {
        f16x2_to_f32(w)
    }
    #[inline(always)]
    fn pack(x: f32) -> u16 {
        f32_to_f16_bits(x)
    }
}

impl HalfFloat for Bf16 {
    #[inline(always)]
    fn unpack2(w: u32) -> (f32, f32) {
        bf16x2_to_f32(w)
    }
    #[inline(always)]
    fn pack(x: f32) -> u16 {
        f32_to_bf16_bits(x)
    }
}

/// An FP8 cache encoding: how its bytes become f16 (what the tensor cores and the converting
/// copies take), and how values are rounded into it. Every FP8 conversion of the kernels goes
/// through one of these, so that a kernel's FP8 format is a type parameter.
pub trait Fp8Format {
    /// E5M2 (otherwise E4M3): which type the tensor cores read the bytes as.
    const E5M2: bool;
    /// What converted values must be multiplied by (the kernels fold it into the k/v scales).
    const UNPACK_SCALE: f32;
    /// Two bytes (low byte first, the low 16 bits of `pair`) as an f16x2 word, exactly (divided
    /// by `UNPACK_SCALE`).
    fn to_f16x2(pair: u32) -> u32;
    /// [`to_f16x2`](Self::to_f16x2) of bytes 0-1 and 2-3 of `quad`.
    fn to_f16x4(quad: u32) -> [u32; 2];
    /// Two values rounded to nearest even, saturating, as `lo | hi << 8` (`attn_math::fp8`).
    fn from_f32x2(lo: f32, hi: f32) -> u32;
}

/// FP8 E4M3. sm_89+: `cvt.rn.f16x2.e4m3x2`, exact. Older GPUs: the byte's bits moved into an
/// f16 (same mantissa, exponent bias 15 instead of 7), exact up to the factor 2^8 that
/// `UNPACK_SCALE` carries; valid for every non-NaN byte.
pub struct E4m3;

impl Fp8Format for E4m3 {
    const E5M2: bool = false;
    #[cfg(hw_fp8)]
    const UNPACK_SCALE: f32 = 1.0;
    #[cfg(not(hw_fp8))]
    const UNPACK_SCALE: f32 = 256.0;

    #[inline(always)]
    fn to_f16x2(pair: u32) -> u32 {
        e4m3x2_to_f16x2(pair)
    }

    #[inline(always)]
    fn to_f16x4(quad: u32) -> [u32; 2] {
        e4m3x4_to_f16x4(quad)
    }

    #[inline(always)]
    fn from_f32x2(lo: f32, hi: f32) -> u32 {
        #[cfg(hw_fp8)]
        {
            // sm_89+: one instruction, with the rounding and saturation of `attn_math::fp8`.
            crate::blocks::vec_io::e4m3x2(lo, hi)
        }
        #[cfg(not(hw_fp8))]
        {
            f32_to_e4m3(lo) as u32 | (f32_to_e4m3(hi) as u32) << 8
        }
    }
}

/// [`E4m3::to_f16x2`].
#[inline(always)]
fn e4m3x2_to_f16x2(pair: u32) -> u32 {
    #[cfg(hw_fp8)]
    {
        let out: u32;
        unsafe {
            core::arch::asm!("{{ .reg .b16 p; cvt.u16.u32 p, {1}; cvt.rn.f16x2.e4m3x2 {0}, p; }}", out(reg32) out, in(reg32) pair,
                options(pure, nomem, nostack));
        }
        out
    }
    #[cfg(not(hw_fp8))]
    {
        let half = |b: u32| ((b & 0x80) << 8) | ((b & 0x7f) << 7);
        half(pair & 0xff) | half(pair >> 8) << 16
    }
}

/// [`E4m3::to_f16x4`]. With the conversion instruction, the halves are read as the register's
/// 16-bit halves: no shift or mask.
#[inline(always)]
fn e4m3x4_to_f16x4(quad: u32) -> [u32; 2] {
    #[cfg(hw_fp8)]
    {
        let (lo, hi): (u32, u32);
        unsafe {
            core::arch::asm!("{{ .reg .b16 l, h; mov.b32 {{l, h}}, {2}; cvt.rn.f16x2.e4m3x2 {0}, l; cvt.rn.f16x2.e4m3x2 {1}, h; }}",
                out(reg32) lo, out(reg32) hi, in(reg32) quad, options(pure, nomem, nostack));
        }
        [lo, hi]
    }
    #[cfg(not(hw_fp8))]
    {
        [e4m3x2_to_f16x2(quad & 0xffff), e4m3x2_to_f16x2(quad >> 16)]
    }
}

/// FP8 E5M2: the upper byte of an f16, so a byte moved into place is its exact f16 on every
/// GPU (one byte permute a pair; `UNPACK_SCALE` 1).
pub struct E5m2;

impl Fp8Format for E5m2 {
    const E5M2: bool = true;
    const UNPACK_SCALE: f32 = 1.0;

    #[inline(always)]
    fn to_f16x2(pair: u32) -> u32 {
        // Bytes 0 and 1 into the upper bytes of the two halves, zeros below.
        byte_perm(pair, 0, 0x1404)
    }

    #[inline(always)]
    fn to_f16x4(quad: u32) -> [u32; 2] {
        [byte_perm(quad, 0, 0x1404), byte_perm(quad, 0, 0x3424)]
    }

    #[inline(always)]
    fn from_f32x2(lo: f32, hi: f32) -> u32 {
        #[cfg(hw_fp8)]
        {
            let packed: u16;
            unsafe {
                core::arch::asm!("cvt.rn.satfinite.e5m2x2.f32 {0}, {1}, {2};", out(reg16) packed, in(reg32) hi, in(reg32) lo,
                    options(pure, nomem, nostack));
            }
            packed as u32
        }
        #[cfg(not(hw_fp8))]
        {
            f32_to_e5m2(lo) as u32 | (f32_to_e5m2(hi) as u32) << 8
        }
    }
}
