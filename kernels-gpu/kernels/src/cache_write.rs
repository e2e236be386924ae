//! Paged KV-cache writes: vLLM's `reshape_and_cache_flash` and `concat_and_cache_mla`.
//!
//! One warp writes one token's row; each lane moves 16-byte vectors of source data (8 f16/bf16
//! or 4 f32 elements), keeping `UNROLL` vectors of K and of V in flight before it stores any;
//! see [`write_token`]. Slots are checked against the
//! cache's capacity; a slot past the end raises `SLOT_OUT_OF_RANGE` and writes nothing.

use crate::device::{block_dim_x, block_idx_x, fma, pdl_prologue, thread_idx_x};
use crate::elem::{Bf16, HalfFloat, F16};
use crate::status::report_bad_slot;
use crate::vec_io::{load16_nc, load_f32_nc, load_i64_nc, store16, store4, store8};
#[cfg(not(hw_fp8))]
use attn_math::fp8::f32_to_e4m3;
use attn_math::paging::{resolve_slot, SlotTarget};
use attn_math::params::{CacheWriteParams, MlaCacheWriteParams};

/// How 16 bytes of source elements become cache elements.
trait VecWriter {
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
struct ScaleDiv {
    scale: f32,
    recip: f32,
}

impl ScaleDiv {
    #[inline(always)]
    fn new(scale: f32) -> Self {
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
struct Copy16<const ELEM_BYTES: u32>;
impl<const ELEM_BYTES: u32> VecWriter for Copy16<ELEM_BYTES> {
    const SRC_ELEM_BYTES: u32 = ELEM_BYTES;
    const CACHE_ELEM_BYTES: u32 = ELEM_BYTES;
    const SCALED: bool = false;
    #[inline(always)]
    unsafe fn store(addr: u64, v: [u32; 4], _: ScaleDiv) {
        unsafe { store16(addr, v) }
    }
}

/// Two values divided by the scale and quantised to FP8, packed as `lo | hi << 8`. vLLM
/// divides (a correctly rounded `x / scale`); multiplying by `1 / scale` alone rounds twice and
/// lands some values one E4M3 step away.
#[inline(always)]
fn quantize_pair(lo: f32, hi: f32, scale: ScaleDiv) -> u32 {
    #[cfg(hw_fp8)]
    {
        // sm_89+: the conversion is one instruction, with the rounding and saturation of
        // `attn_math::fp8`.
        crate::vec_io::e4m3x2(scale.div(lo), scale.div(hi))
    }
    #[cfg(not(hw_fp8))]
    {
        f32_to_e4m3(scale.div(lo)) as u32 | (f32_to_e4m3(scale.div(hi)) as u32) << 8
    }
}

/// A 16-bit float source quantised to FP8: 8 values (4 packed words) to 8 bytes.
struct HalfToFp8<H>(core::marker::PhantomData<H>);
impl<H: HalfFloat> VecWriter for HalfToFp8<H> {
    const SRC_ELEM_BYTES: u32 = 2;
    const CACHE_ELEM_BYTES: u32 = 1;
    const SCALED: bool = true;
    #[inline(always)]
    unsafe fn store(addr: u64, v: [u32; 4], scale: ScaleDiv) {
        let q = |w: u32| {
            let (lo, hi) = H::unpack2(w);
            quantize_pair(lo, hi, scale)
        };
        unsafe { store8(addr, [q(v[0]) | q(v[1]) << 16, q(v[2]) | q(v[3]) << 16]) }
    }
}

struct F32ToFp8;
impl VecWriter for F32ToFp8 {
    const SRC_ELEM_BYTES: u32 = 4;
    const CACHE_ELEM_BYTES: u32 = 1;
    const SCALED: bool = true;
    #[inline(always)]
    unsafe fn store(addr: u64, v: [u32; 4], scale: ScaleDiv) {
        let f = f32::from_bits;
        let word = quantize_pair(f(v[0]), f(v[1]), scale) | quantize_pair(f(v[2]), f(v[3]), scale) << 16;
        unsafe { store4(addr, word) }
    }
}

/// Vectors each thread keeps in flight per tensor (all loads are issued before any store).
const UNROLL: u32 = 4; // = the copies `unroll4!` makes
const WARP: u32 = 32;

/// Repeats `$body` for `$u` = 0..4 as a constant, so the per-thread register arrays are indexed
/// only by constants (a loop LLVM declines to unroll would move them to local memory).
macro_rules! unroll4 {
    (|$u:ident| $body:block) => {{
        {
            const $u: usize = 0;
            $body
        }
        {
            const $u: usize = 1;
            $body
        }
        {
            const $u: usize = 2;
            $body
        }
        {
            const $u: usize = 3;
            $body
        }
    }};
}

/// Repeats `$body` for `$t` = 0..TENSORS (at most 2) as a constant.
macro_rules! for_tensors {
    (|$t:ident| $body:block) => {{
        { const $t: usize = 0; if $t < TENSORS $body }
        { const $t: usize = 1; if $t < TENSORS $body }
    }};
}

/// `*scale` for FP8 writers, 1 otherwise (the scale pointer is then null).
#[inline(always)]
unsafe fn load_scale<W: VecWriter>(scale: u64) -> ScaleDiv {
    ScaleDiv::new(if W::SCALED { unsafe { load_f32_nc(scale) } } else { 1.0 })
}

/// One warp per token: (warp index in the grid, lane).
#[inline(always)]
fn warp_and_lane() -> (u32, u32) {
    let t = thread_idx_x();
    (block_idx_x() * (block_dim_x() / WARP) + t / WARP, t % WARP)
}

/// Writes one token's row: lane `l` takes vectors `l, l + 32, ...`, `UNROLL` at a time, with
/// all their loads issued before any store. The token's slot is loaded together with the first
/// data (source addresses do not depend on it), so a warp pays one memory round trip, not two;
/// reading a padding token's source is harmless, since the host checked every token's rows lie
/// inside their buffers. `src_addr(v)` / `dst_addr(v, block, offset)` give the byte addresses of
/// vector `v` in each of the `TENSORS` tensors.
#[inline(always)]
unsafe fn write_token<W: VecWriter, const TENSORS: usize>(
    p: TokenRow,
    scale: [ScaleDiv; TENSORS],
    src_addr: impl Fn(u32) -> [u64; TENSORS],
    dst_addr: impl Fn(u32, u64, u64) -> [u64; TENSORS],
) {
    let slot = unsafe { load_i64_nc(p.slot_mapping + p.token as u64 * 8) };
    let mut base = 0;
    while base < p.vecs {
        let mut data = [[[0u32; 4]; TENSORS]; UNROLL as usize];
        unroll4!(|U| {
            let v = base + p.lane + WARP * U as u32;
            if v < p.vecs {
                let src = src_addr(v);
                for_tensors!(|T| {
                    data[U][T] = unsafe { load16_nc(src[T]) };
                });
            }
        });
        let (block, offset) = match resolve_slot(slot, p.block_size, p.num_slots) {
            SlotTarget::At { block, offset } => (block, offset),
            SlotTarget::Padding => return,
            SlotTarget::OutOfRange => {
                if p.lane == 0 {
                    unsafe { report_bad_slot(p.status, p.token, slot, p.num_slots) };
                }
                return;
            }
        };
        unroll4!(|U| {
            let v = base + p.lane + WARP * U as u32;
            if v < p.vecs {
                let dst = dst_addr(v, block, offset);
                for_tensors!(|T| {
                    unsafe { W::store(dst[T], data[U][T], scale[T]) };
                });
            }
        });
        base += WARP * UNROLL;
    }
}

/// What [`write_token`] needs to know of its token.
#[derive(Clone, Copy)]
struct TokenRow {
    token: u32,
    lane: u32,
    /// 16-byte source vectors in the row.
    vecs: u32,
    slot_mapping: u64,
    block_size: u32,
    num_slots: u64,
    status: u64,
}

#[inline(always)]
unsafe fn reshape_and_cache<W: VecWriter>(p: &CacheWriteParams) {
    let (token, lane) = warp_and_lane();
    if token >= p.num_tokens {
        return;
    }
    let vecs_per_head = p.head_size / W::ELEMS;
    let row = TokenRow {
        token,
        lane,
        vecs: p.num_heads * vecs_per_head,
        slot_mapping: p.slot_mapping,
        block_size: p.block_size,
        num_slots: p.num_slots,
        status: p.status,
    };
    let token = token as u64;
    let src_bytes = W::SRC_ELEM_BYTES as u64;
    let cache_bytes = W::CACHE_ELEM_BYTES as u64;
    let scale = unsafe { [load_scale::<W>(p.k_scale), load_scale::<W>(p.v_scale)] };
    let head_dim = |v: u32| {
        let head = v / vecs_per_head;
        (head as u64, ((v - head * vecs_per_head) * W::ELEMS) as u64)
    };
    unsafe {
        write_token::<W, 2>(
            row,
            scale,
            |v| {
                let (head, dim) = head_dim(v);
                [
                    p.key + (token * p.key_token_stride + head * p.key_head_stride + dim) * src_bytes,
                    p.value + (token * p.value_token_stride + head * p.value_head_stride + dim) * src_bytes,
                ]
            },
            |v, block, offset| {
                let (head, dim) = head_dim(v);
                [
                    p.k_cache + p.k_strides.offset(block, offset, head, dim) * cache_bytes,
                    p.v_cache + p.v_strides.offset(block, offset, head, dim) * cache_bytes,
                ]
            },
        )
    }
}

#[inline(always)]
unsafe fn concat_and_cache_mla<W: VecWriter>(p: &MlaCacheWriteParams) {
    let (token, lane) = warp_and_lane();
    if token >= p.num_tokens {
        return;
    }
    let latent_vecs = p.latent_dim / W::ELEMS;
    let row = TokenRow {
        token,
        lane,
        vecs: latent_vecs + p.rope_dim / W::ELEMS,
        slot_mapping: p.slot_mapping,
        block_size: p.block_size,
        num_slots: p.num_slots,
        status: p.status,
    };
    let token = token as u64;
    let src_bytes = W::SRC_ELEM_BYTES as u64;
    let cache_bytes = W::CACHE_ELEM_BYTES as u64;
    let scale = unsafe { [load_scale::<W>(p.scale)] };
    // Row bases once per token, so that a vector's address is a select and an add: computed per
    // vector from the strides, they were a third of the FP8 write's instructions.
    let vec_bytes = W::ELEMS as u64 * src_bytes;
    let latent = p.kv_c + token * p.kv_c_token_stride * src_bytes;
    // Biased so that vector v of the row (v >= latent_vecs) is at `rope + v * vec_bytes`.
    let rope = (p.k_pe + token * p.k_pe_token_stride * src_bytes).wrapping_sub(latent_vecs as u64 * vec_bytes);
    unsafe {
        write_token::<W, 1>(
            row,
            scale,
            |v| [(if v < latent_vecs { latent } else { rope }).wrapping_add(v as u64 * vec_bytes)],
            |v, block, offset| [p.cache + p.cache_strides.offset(block, offset, 0, (v * W::ELEMS) as u64) * cache_bytes],
        )
    }
}

/// Entry points, one per (source dtype, cache dtype). Names: `<op>_<src>_<cache>`.
macro_rules! cache_write_kernels {
    ($($suffix:ident => $writer:ty),* $(,)?) => { paste_kernels! { $($suffix => $writer),* } };
}

macro_rules! paste_kernels {
    ($($suffix:ident => $writer:ty),*) => {
        $(
            pub mod $suffix {
                use super::*;
                #[unsafe(export_name = concat!("reshape_and_cache_", stringify!($suffix)))]
                pub unsafe extern "ptx-kernel" fn reshape_and_cache_kernel(p: CacheWriteParams) {
                    pdl_prologue();
                    unsafe { reshape_and_cache::<$writer>(&p) }
                }
                #[unsafe(export_name = concat!("concat_and_cache_mla_", stringify!($suffix)))]
                pub unsafe extern "ptx-kernel" fn concat_and_cache_mla_kernel(p: MlaCacheWriteParams) {
                    pdl_prologue();
                    unsafe { concat_and_cache_mla::<$writer>(&p) }
                }
            }
        )*
    };
}

cache_write_kernels! {
    f16_f16 => Copy16<2>,
    bf16_bf16 => Copy16<2>,
    f32_f32 => Copy16<4>,
    f16_fp8 => HalfToFp8<F16>,
    bf16_fp8 => HalfToFp8<Bf16>,
    f32_fp8 => F32ToFp8,
}
