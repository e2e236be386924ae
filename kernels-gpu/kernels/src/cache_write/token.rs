//! One warp writes one token's row ([`write_token`]); `reshape_and_cache` and
//! `concat_and_cache_mla` on top of it.

use crate::blocks::device::{block_dim_x, block_idx_x, thread_idx_x};
use crate::blocks::status::report_bad_slot;
use crate::blocks::vec_io::{load16_nc, load_f32_nc, load_i64_nc};
use crate::cache_write::writers::{ScaleDiv, VecWriter};
use attn_math::paging::{resolve_slot, SlotTarget};
use attn_math::params::{CacheWriteParams, MlaCacheWriteParams};

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
/// vector `v` in each of the `TENSORS` tensors, `scale(v)` its scale in each.
#[inline(always)]
unsafe fn write_token<W: VecWriter, const TENSORS: usize>(
    p: TokenRow,
    scale: impl Fn(u32) -> [ScaleDiv; TENSORS],
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
                let (dst, scale) = (dst_addr(v, block, offset), scale(v));
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
pub(super) unsafe fn reshape_and_cache<W: VecWriter>(p: &CacheWriteParams) {
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
    let head_dim = |v: u32| {
        let head = v / vecs_per_head;
        (head as u64, ((v - head * vecs_per_head) * W::ELEMS) as u64)
    };
    let scales = |head: u64| {
        let at = 4 * head * p.scale_head_stride as u64;
        unsafe { [load_scale::<W>(p.k_scale + at), load_scale::<W>(p.v_scale + at)] }
    };
    if W::SCALED && p.scale_head_stride != 0 {
        // One scale per kv head: each vector's own (from L1 after its head's first).
        unsafe { write_rows::<W>(p, row, |v| scales(head_dim(v).0), head_dim) }
    } else {
        // One per tensor: loaded once for the token.
        let scale = scales(0);
        unsafe { write_rows::<W>(p, row, |_| scale, head_dim) }
    }
}

/// [`reshape_and_cache`]'s token: K and V vector `v` from its head and column (`head_dim`).
#[inline(always)]
unsafe fn write_rows<W: VecWriter>(
    p: &CacheWriteParams,
    row: TokenRow,
    scale: impl Fn(u32) -> [ScaleDiv; 2],
    head_dim: impl Fn(u32) -> (u64, u64),
) {
    let token = row.token as u64;
    let (src_bytes, cache_bytes) = (W::SRC_ELEM_BYTES as u64, W::CACHE_ELEM_BYTES as u64);
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
pub(super) unsafe fn concat_and_cache_mla<W: VecWriter>(p: &MlaCacheWriteParams) {
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
    let scale = |_| scale;
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
