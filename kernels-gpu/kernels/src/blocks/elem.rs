//! Element formats the attention kernels read and write, as 8-element chunks: queries and
//! outputs in f16/bf16, caches in f16/bf16 (16 bytes a chunk) or FP8 E4M3 (8 bytes a chunk).

use crate::blocks::vec_io::{bf16x2_to_f32, f16x2_to_f32, f32_to_f16_bits, load16_nc, load8_nc, store_u16};
use attn_math::fp8::f32_to_bf16_bits;

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

/// 8 consecutive 16-bit floats at `addr` (16-byte aligned) as f32.
#[inline(always)]
pub unsafe fn load_chunk_half<H: HalfFloat>(addr: u64) -> [f32; 8] {
    HalfCache::<H>::unpack(unsafe { load16_nc(addr) })
}

#[inline(always)]
pub unsafe fn store_half<H: HalfFloat>(addr: u64, x: f32) {
    unsafe { store_u16(addr, H::pack(x)) }
}

/// A cache element format: bytes per element, and 8-element chunks loaded raw (few registers
/// while in flight) and unpacked to f32 where they are used.
pub trait CacheFormat {
    const BYTES: u64;
    /// What unpacked values must be multiplied by (the kernel folds it into the k/v scales).
    const UNPACK_SCALE: f32;
    type Raw: Copy;
    const ZERO: Self::Raw;
    unsafe fn load_raw(addr: u64) -> Self::Raw;
    fn unpack(raw: Self::Raw) -> [f32; 8];
}

pub struct HalfCache<H>(core::marker::PhantomData<H>);
impl<H: HalfFloat> CacheFormat for HalfCache<H> {
    const BYTES: u64 = 2;
    const UNPACK_SCALE: f32 = 1.0;
    type Raw = [u32; 4];
    const ZERO: [u32; 4] = [0; 4];
    #[inline(always)]
    unsafe fn load_raw(addr: u64) -> [u32; 4] {
        unsafe { load16_nc(addr) }
    }
    #[inline(always)]
    fn unpack(w: [u32; 4]) -> [f32; 8] {
        let mut out = [0.0; 8];
        let mut i = 0;
        while i < 4 {
            let (a, b) = H::unpack2(w[i]);
            out[2 * i] = a;
            out[2 * i + 1] = b;
            i += 1;
        }
        out
    }
}

/// FP8 E4M3. sm_89+: `cvt.rn.f16x2.e4m3x2`, exact. Older GPUs: the byte's bits moved into an
/// f16 (same mantissa, exponent bias 15 instead of 7), exact up to the factor 2^8 that
/// `UNPACK_SCALE` carries; valid for every non-NaN byte.
pub struct Fp8Cache;
impl CacheFormat for Fp8Cache {
    const BYTES: u64 = 1;
    #[cfg(hw_fp8)]
    const UNPACK_SCALE: f32 = 1.0;
    #[cfg(not(hw_fp8))]
    const UNPACK_SCALE: f32 = 256.0;
    type Raw = [u32; 2];
    const ZERO: [u32; 2] = [0; 2];
    #[inline(always)]
    unsafe fn load_raw(addr: u64) -> [u32; 2] {
        unsafe { load8_nc(addr) }
    }
    #[inline(always)]
    fn unpack(w: [u32; 2]) -> [f32; 8] {
        let mut out = [0.0; 8];
        let mut i = 0;
        while i < 4 {
            let pair = (w[i / 2] >> (16 * (i % 2))) & 0xffff;
            let (a, b) = f16x2_to_f32(fp8x2_to_f16x2(pair));
            out[2 * i] = a;
            out[2 * i + 1] = b;
            i += 1;
        }
        out
    }
}

/// Two FP8 bytes (low byte first) as an f16x2 word (scaled by `Fp8Cache::UNPACK_SCALE`^-1).
#[inline(always)]
pub fn fp8x2_to_f16x2(pair: u32) -> u32 {
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

/// [`fp8x2_to_f16x2`] of both halves of `quad` (bytes 0-1, then 2-3). With the conversion
/// instruction, the halves are read as the register's 16-bit halves: no shift or mask.
#[inline(always)]
pub fn fp8x4_to_f16x4(quad: u32) -> [u32; 2] {
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
        [fp8x2_to_f16x2(quad & 0xffff), fp8x2_to_f16x2(quad >> 16)]
    }
}
