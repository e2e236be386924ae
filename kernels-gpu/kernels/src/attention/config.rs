//! What an attention kernel is built for, as types: [`AttnConfig`] (the query and tensor-core
//! types, the cache's row format, the head sizes and the CTA's shape) and [`CacheFormat`] (16-bit
//! or FP8 cache rows, E4M3 or E5M2). The entry macros (`crate::attention::entry`) declare one config type
//! per kernel; the other kernels that share the helpers declare theirs next to their code.
//!
//! The shape is associated consts rather than const generics so that one type parameter carries
//! it. Without `generic_const_exprs` an associated const of a type parameter can neither size an
//! array nor be a const generic argument, hence:
//! - the helpers take the config type itself and read its consts. (Passing the numbers in as
//!   arguments gives the same program, but not the same code: the helpers' closures then capture
//!   them, and LLVM schedules the kernels differently.)
//! - the kernel keeps the row tiles per warp, which size its accumulator arrays, as a const
//!   generic (`MT`, equal to [`AttnConfig::MT`]).

use crate::blocks::elem::{E4m3, E5m2, Fp8Format};
use crate::blocks::mma::MmaHalf;
use crate::blocks::vec_io::load_f32_nc;
use attn_math::params::AttnParams;
use attn_math::prefill::{block_n, m_tiles, ROW_PAD, THREADS, WARPS};

/// One attention kernel's types and shape.
pub(crate) trait AttnConfig {
    /// The queries' and the output's type.
    type Q: MmaHalf;
    /// The tensor cores' input type: `Q`, or f16 for an FP8 cache (one conversion instruction
    /// per pair, and exact; bf16 queries are scaled by 2^-8 into f16's range, undone in the
    /// scores).
    type M: MmaHalf;
    /// The cache's rows.
    type Cache: CacheFormat;
    /// Head sizes of Q and K, and of V.
    const DK: usize;
    const DV: usize;
    /// The decode shape (16 rows, keys split across warps), else the prefill shape (rows split
    /// across warps); `attn_math::prefill` describes both.
    const KEYS: bool;
    /// Keys per K/V tile.
    const BN: usize = block_n(Self::DK as u32, Self::DV as u32, Self::KEYS, <Self::Cache as CacheFormat>::FP8) as usize;
    /// The keys of a tile one warp takes: `BN / WARPS` (keys split) or `BN`.
    const KW: usize = if Self::KEYS { Self::BN / WARPS as usize } else { Self::BN };
    /// 16-row tiles per warp (2 on the prefill shape up to head size 128: each K/V fragment read
    /// from shared memory feeds twice the MMAs, and the two tiles' chains interleave).
    const MT: usize = m_tiles(Self::DK as u32, Self::DV as u32, Self::KEYS, <Self::Cache as CacheFormat>::FP8) as usize;
    /// Local masks (`p.local`: chunked local attention, the symmetric window) are compiled in:
    /// the `prefill_local_*` kernels. Off elsewhere, where the pass and its registers would cost
    /// the decoder paths (spills at head sizes 64 and 128 when every kernel had it).
    const LOCAL: bool = false;
    /// MLA: V is columns `slice * DV ..` of each K row, read from the K tile; no V copies. No
    /// entry point sets it (MLA runs on its own kernel, `crate::attention::mla`); its branches
    /// stay because taking them out reorders the registers of other instances' PTX.
    const VK: bool = false;
}

/// The K (`V = false`) or V plane of a stage as one group of threads copies and converts it:
/// keys split, a warp's `KW` rows; else the CTA's `BN`.
pub(crate) struct Plane<C, const V: bool>(core::marker::PhantomData<C>);

impl<C: AttnConfig, const V: bool> Plane<C, V> {
    /// Elements of a row.
    pub const D: usize = if V { C::DV } else { C::DK };
    pub const ROWS: usize = if C::KEYS { C::KW } else { C::BN };
    /// Threads of the group.
    pub const NT: u32 = if C::KEYS { 32 } else { THREADS };
}

/// How a cache's rows are stored, staged in shared memory, and turned into the 16-bit tiles the
/// math reads.
pub(crate) trait CacheFormat {
    /// FP8 rows (the flag `attn_math`'s shape functions take: both FP8 formats have one byte an
    /// element and the same shapes).
    const FP8: bool;
    /// The FP8 rows' encoding, which every conversion of them goes through. 16-bit rows are
    /// never converted and name E4M3.
    type Fp8: Fp8Format;
    /// Bytes of an element.
    const ELEM_BYTES: u32;
    /// Rows are staged raw and converted into separate 16-bit tiles in shared memory (unless
    /// the kernel reads its fragments straight from the staged rows: `fp8_direct`).
    const CONVERTS: bool;
    /// Rows may start 8 bytes off a 16-byte boundary (FP8 rows of a head size that is an odd
    /// multiple of 8, every other kv head or token): each 16-byte chunk is copied as two 8-byte
    /// halves (`cp_async_halves`), and a row's read span is counted in halves
    /// ([`Self::live_units`]). The other kernels keep their 16-byte copies.
    const HALVES: bool = false;

    /// The dequantisation factors of kv head `kv_head`'s K and V, each times the FP8 format's
    /// unpack scale (1 and 1 for a 16-bit cache). They fold into the score scale (k) and the
    /// output factor (v).
    unsafe fn scales(p: &AttnParams, kv_head: u32) -> (f32, f32);

    /// Row pitch in bytes of `d`-element rows as staged, and their 16-byte chunks.
    fn staged_pitch(d: u32) -> u32;
    fn staged_chunks(d: u32) -> u32;

    /// The copy units of the first `d` elements of a row, which the copies read (the rest of a
    /// staged row is zero-filled): 16-byte chunks, or 8-byte halves ([`Self::HALVES`]).
    #[inline(always)]
    fn live_units(d: u32) -> u32 {
        if Self::HALVES {
            d * Self::ELEM_BYTES / 8
        } else {
            Self::staged_chunks(d)
        }
    }

    /// Converts the staged rows of plane `Plane<C, V>` this thread copied (at `staging`) into
    /// the 16-bit tile at `tile` ([`Self::CONVERTS`] only).
    unsafe fn convert<C: AttnConfig, const V: bool>(staging: u32, tile: u32);
}

/// 16-bit rows (the queries' type), staged as the padded tiles the math reads.
pub(crate) struct Bits16;

impl CacheFormat for Bits16 {
    const FP8: bool = false;
    type Fp8 = E4m3;
    const ELEM_BYTES: u32 = 2;
    const CONVERTS: bool = false;

    #[inline(always)]
    unsafe fn scales(_: &AttnParams, _: u32) -> (f32, f32) {
        (1.0, 1.0)
    }

    #[inline(always)]
    fn staged_pitch(d: u32) -> u32 {
        (d + ROW_PAD) * 2
    }

    #[inline(always)]
    fn staged_chunks(d: u32) -> u32 {
        d / 8
    }

    #[inline(always)]
    unsafe fn convert<C: AttnConfig, const V: bool>(_: u32, _: u32) {}
}

/// FP8 rows of format `F` with per-tensor or per-kv-head scales (`p.fp8.k_scale`,
/// `p.fp8.v_scale`, `p.scale_layout`), staged raw (`d` bytes a row). `HALVES`: rows that may
/// start only 8-byte aligned (a head size that is an odd multiple of 8: the `_a8` kernels).
pub(crate) struct Fp8Cache<F, const HALVES: bool>(core::marker::PhantomData<F>);

/// FP8 E4M3 rows (the `_fp8` kernels), and those of odd multiples of 8 (`_fp8_a8`).
pub(crate) type Fp8E4M3 = Fp8Cache<E4m3, false>;
pub(crate) type Fp8E4M3A8 = Fp8Cache<E4m3, true>;
/// FP8 E5M2 rows (the `_e5m2` kernels), and those of odd multiples of 8 (`_e5m2_a8`).
pub(crate) type Fp8E5M2 = Fp8Cache<E5m2, false>;
pub(crate) type Fp8E5M2A8 = Fp8Cache<E5m2, true>;

impl<F: Fp8Format, const H: bool> CacheFormat for Fp8Cache<F, H> {
    const FP8: bool = true;
    type Fp8 = F;
    const ELEM_BYTES: u32 = 1;
    const CONVERTS: bool = true;
    const HALVES: bool = H;

    #[inline(always)]
    unsafe fn scales(p: &AttnParams, kv_head: u32) -> (f32, f32) {
        let unpack = F::UNPACK_SCALE;
        let at = 4 * (kv_head * p.scale_layout.head_stride) as u64;
        (unsafe { load_f32_nc(p.fp8.k_scale + at) } * unpack, unsafe { load_f32_nc(p.fp8.v_scale + at) } * unpack)
    }

    #[inline(always)]
    fn staged_pitch(d: u32) -> u32 {
        d
    }

    #[inline(always)]
    fn staged_chunks(d: u32) -> u32 {
        d / 16
    }

    #[inline(always)]
    unsafe fn convert<C: AttnConfig, const V: bool>(staging: u32, tile: u32) {
        unsafe { Plane::<C, V>::convert_fp8(staging, tile) }
    }
}
