//! How 16 bytes of source elements become cache elements: a copy, or FP8 quantisation with
//! vLLM's rounding of `x / scale`.

use crate::blocks::device::fma;
use crate::blocks::elem::{Fp8Format, HalfFloat};
use crate::blocks::vec_io::{store16, store4, store8};
use core::marker::PhantomData;

/// How 16 bytes of source elements become cache elements.
pub(super) trait VecWriter {
    /// Bytes of one source element.
    const SRC_ELEM_BYTES: u32;
    /// Bytes of one cache element.
    const CACHE_ELEM_BYTES: u32;
    /// Elements in one 16-byte source vector.
    const ELEMS: u32 = 16 / Self::SRC_ELEM_BYTES;
    /// Whether the writer needs the (device-resident) scale.
    const SCALED: bool;
    unsafe fn store(addr: u64, v: [u32; 4], scale: ScaleDiv);
}

/// Division by one tensor's FP8 scale, correctly rounded as vLLM's `x / scale`, at the cost of
/// a multiply and two FMAs per value: `div.rn.f32`'s longer sequence made the FP8 writes
/// compute-bound (14% slower for K/V rows, 56% for MLA's latent rows, on the H100).
///
/// `q0 = x * (1 / scale)` is within an ulp of `x / scale`; the remainder `x - q0 * scale` is
/// exact in one FMA while it does not underflow, and then `q0 + remainder / scale` rounded once
/// (Markstein's correction, the reciprocal correctly rounded) is the correctly rounded quotient.
/// For scales in `[2^-60, 2^60]` the remainder underflows only when `|x| < 2^-100`, where the
/// quotient is far below E4M3's smallest value and both round to a zero of the same sign. FP8
/// cache scales (an absolute maximum over 448, or 1) lie far inside that range; outside it a
/// value may land one E4M3 step from vLLM's. Checked against `x / scale` on every 16-bit input
/// and random f32s (`cpu_math::fp8_scale_division_matches_vllm`).
#[derive(Clone, Copy)]
pub(super) struct ScaleDiv {
    scale: f32,
    recip: f32,
}

impl ScaleDiv {
    #[inline(always)]
    pub(super) fn new(scale: f32) -> Self {
        ScaleDiv { scale, recip: 1.0 / scale }
    }

    #[inline(always)]
    fn div(self, x: f32) -> f32 {
        let q0 = x * self.recip;
        // The remainder negated (`q0 * scale - x`), so that a zero x keeps its sign through both
        // FMAs (`-0 / scale` is -0); an infinite x makes it NaN, and the quotient is q0 = x.
        let q1 = fma(-fma(q0, self.scale, -x), self.recip, q0);
        if q1.is_nan() {
            q0
        } else {
            q1
        }
    }
}

/// Same dtype in and out: a plain 16-byte copy.
pub(super) struct Copy16<const ELEM_BYTES: u32>;
impl<const ELEM_BYTES: u32> VecWriter for Copy16<ELEM_BYTES> {
    const SRC_ELEM_BYTES: u32 = ELEM_BYTES;
    const CACHE_ELEM_BYTES: u32 = ELEM_BYTES;
    const SCALED: bool = false;
    #[inline(always)]
    unsafe fn store(addr: u64, v: [u32; 4], _: ScaleDiv) {
        unsafe { store16(addr, v) }
    }
}

/// Two values divided by the scale and quantised to FP8 format `F`, packed as `lo | hi << 8`.
/// vLLM divides (a correctly rounded `x / scale`); multiplying by `1 / scale` alone rounds twice
/// and lands some values one FP8 step away.
#[inline(always)]
fn quantize_pair<F: Fp8Format>(lo: f32, hi: f32, scale: ScaleDiv) -> u32 {
    F::from_f32x2(scale.div(lo), scale.div(hi))
}

/// A 16-bit float source quantised to FP8 format `F`: 8 values (4 packed words) to 8 bytes.
pub(super) struct HalfToFp8<H, F>(PhantomData<(H, F)>);
impl<H: HalfFloat, F: Fp8Format> VecWriter for HalfToFp8<H, F> {
    const SRC_ELEM_BYTES: u32 = 2;
    const CACHE_ELEM_BYTES: u32 = 1;
    const SCALED: bool = true;
    #[inline(always)]
    unsafe fn store(addr: u64, v: [u32; 4], scale: ScaleDiv) {
        let q = |w: u32| {
            let (lo, hi) = H::unpack2(w);
            quantize_pair::<F>(lo, hi, scale)
        };
        unsafe { store8(addr, [q(v[0]) | q(v[1]) << 16, q(v[2]) | q(v[3]) << 16]) }
    }
}

/// An f32 source quantised to FP8 format `F`: 4 values to 4 bytes.
pub(super) struct F32ToFp8<F>(PhantomData<F>);
impl<F: Fp8Format> VecWriter for F32ToFp8<F> {
    const SRC_ELEM_BYTES: u32 = 4;
    const CACHE_ELEM_BYTES: u32 = 1;
    const SCALED: bool = true;
    #[inline(always)]
    unsafe fn store(addr: u64, v: [u32; 4], scale: ScaleDiv) {
        let f = f32::from_bits;
        let word = quantize_pair::<F>(f(v[0]), f(v[1]), scale) | quantize_pair::<F>(f(v[2]), f(v[3]), scale) << 16;
        unsafe { store4(addr, word) }
    }
}
