//! TMA tensor maps of a paged 16-bit cache for the Hopper prefill kernel's producer
//! (`attn_math::params::PagedKvMaps`): it copies a page of a stage's K or V (or the stage, if
//! pages are larger) with one `cp.async.bulk.tensor` instead of 16-byte `cp.async`s a row.

use attn_math::paging::CacheStrides;
use attn_math::params::{PagedKvMaps, TensorMap};

/// One plane's 5-dimensional view (innermost first: 64 columns, 8 rows, `width / 64` atoms, row
/// groups, heads), its box, and where a key's group sits in it (`PagedKvMaps`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MapGeometry {
    pub dims: [u64; 5],
    /// Keys a box copies: the block size or `stage_keys`, whichever is smaller.
    pub box_keys: u32,
    /// Byte strides of dimensions 1 to 4 (dimension 0 is contiguous).
    pub strides: [u64; 4],
    pub slots_per_block: u32,
    pub heads_per_block: u32,
}

/// The paged cache's shape as the kernel sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PagedShape {
    pub strides: CacheStrides,
    pub num_blocks: u64,
    pub block_size: u64,
    pub num_heads: u64,
    pub head_size: u64,
}

/// The view of a cache of 16-bit elements shaped `s` for a kernel whose shared-memory rows are
/// `width` columns and whose stages hold `stage_keys` keys (a multiple of 8; `None` where the
/// producer copies rows instead): boxes of the block size or the stage, whichever is smaller,
/// tile both; the head size fills whole
/// 64-column atoms (a narrower head would put the next head's columns, or bytes past the
/// cache, inside a box), blocks hold a multiple of 8 tokens, and either the tokens of all blocks
/// are evenly spaced (`[blocks, block_size, heads, d]`) or the heads of all blocks are
/// (`[blocks, heads, block_size, d]`). Every element inside the view's dimensions is an element
/// of the cache, so a box never reads outside it.
pub(crate) fn map_geometry(s: &PagedShape, width: u64, stage_keys: u64) -> Option<MapGeometry> {
    let CacheStrides { block, token, head } = s.strides;
    if s.head_size != width || !width.is_multiple_of(64) || !s.block_size.is_multiple_of(8) || s.block_size == 0 {
        return None;
    }
    // Boxes tile both the block and the stage (a block of 48 with stages of 32 would put a box
    // across a block's end), and the kernel's block and head coordinates fit in u32.
    let box_keys = s.block_size.min(stage_keys);
    if !s.block_size.is_multiple_of(box_keys) || !stage_keys.is_multiple_of(box_keys) {
        return None;
    }
    if s.num_blocks.checked_mul(s.block_size)? > u32::MAX as u64 || s.num_blocks.checked_mul(s.num_heads)? > u32::MAX as u64 {
        return None;
    }
    let (slots, heads, slots_per_block, heads_per_block) = if block == s.block_size.checked_mul(token)? {
        // Blocks one after another, tokens evenly spaced: groups of the whole cache, then heads.
        (s.num_blocks.checked_mul(s.block_size)? / 8, s.num_heads, s.block_size, 0)
    } else if block == s.num_heads.checked_mul(head)? {
        // Heads of every block evenly spaced: groups of a block, then (block, head) pairs.
        (s.block_size / 8, s.num_blocks.checked_mul(s.num_heads)?, 0, s.num_heads)
    } else {
        return None;
    };
    let strides = [token.checked_mul(2)?, 128, token.checked_mul(16)?, head.checked_mul(2)?];
    // The driver's bounds: dimensions up to 2^32, strides multiples of 16 below 2^40.
    let fits = |d: u64| (1..=1 << 32).contains(&d);
    if !fits(slots) || !fits(heads) || strides.iter().any(|&b| !b.is_multiple_of(16) || b >= 1 << 40) {
        return None;
    }
    Some(MapGeometry {
        dims: [64, 8, width / 64, slots, heads],
        box_keys: u32::try_from(box_keys).ok().filter(|k| k.is_multiple_of(8))?,
        strides,
        slots_per_block: u32::try_from(slots_per_block).ok()?,
        heads_per_block: u32::try_from(heads_per_block).ok()?,
    })
}

/// The maps of K at `k` and V at `v` (device addresses of the planes' first elements) with
/// geometry `g`, or no maps if the driver refuses one (the producer then copies rows).
pub(crate) fn paged_kv_maps(k: u64, v: u64, g: &MapGeometry) -> PagedKvMaps {
    match (encode(k, g), encode(v, g)) {
        (Some(k), Some(v)) => {
            PagedKvMaps { k, v, enabled: 1, box_keys: g.box_keys, slots_per_block: g.slots_per_block, heads_per_block: g.heads_per_block }
        }
        _ => PagedKvMaps::default(),
    }
}

/// One plane's map: 16-bit elements, boxes of `{64, 8, width / 64, box_keys / 8, 1}` (8-row
/// groups of the kernel's stage) in the 128-byte swizzle the `wgmma` descriptors read.
fn encode(addr: u64, g: &MapGeometry) -> Option<TensorMap> {
    use cudarc::driver::sys;
    if !addr.is_multiple_of(16) {
        return None;
    }
    let boxes: [u32; 5] = [64, 8, g.dims[2] as u32, g.box_keys / 8, 1];
    let element_strides = [1u32; 5];
    // SAFETY: a zeroed map is a valid plain-data value for the driver to overwrite.
    let mut map: sys::CUtensorMap = unsafe { std::mem::zeroed() };
    // SAFETY: every pointer refers to a live local array of the length the rank implies; the
    // driver only encodes (it neither reads nor keeps `addr`).
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            5,
            addr as *mut std::ffi::c_void,
            g.dims.as_ptr(),
            g.strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(TensorMap(map.opaque))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(strides: CacheStrides, block_size: u64, head_size: u64) -> PagedShape {
        PagedShape { strides, num_blocks: 1000, block_size, num_heads: 8, head_size }
    }

    #[test]
    fn tokens_evenly_spaced() {
        // [blocks, 16, 8 heads, 128]
        let s = shape(CacheStrides { block: 16 * 8 * 128, token: 8 * 128, head: 128 }, 16, 128);
        let g = map_geometry(&s, 128, 64).unwrap();
        assert_eq!(g.dims, [64, 8, 2, 2000, 8]);
        assert_eq!(g.box_keys, 16);
        assert_eq!(g.strides, [2048, 128, 16384, 256]);
        assert_eq!((g.slots_per_block, g.heads_per_block), (16, 0));
    }

    #[test]
    fn heads_evenly_spaced() {
        // [blocks, 8 heads, 32, 64]
        let s = shape(CacheStrides { block: 8 * 32 * 64, token: 64, head: 32 * 64 }, 32, 64);
        let g = map_geometry(&s, 64, 128).unwrap();
        assert_eq!(g.dims, [64, 8, 1, 4, 8000]);
        assert_eq!(g.box_keys, 32);
        assert_eq!(map_geometry(&s, 64, 16).unwrap().box_keys, 16);
        assert_eq!(g.strides, [128, 128, 1024, 4096]);
        assert_eq!((g.slots_per_block, g.heads_per_block), (0, 8));
    }

    #[test]
    fn refused_where_a_box_could_leave_the_head_the_block_or_the_stage() {
        let nhd = |bs: u64, d: u64| CacheStrides { block: bs * 8 * d, token: 8 * d, head: d };
        // A head narrower than the kernel's rows, a block size not a multiple of 8.
        assert_eq!(map_geometry(&shape(nhd(16, 120), 16, 120), 128, 64), None);
        assert_eq!(map_geometry(&shape(nhd(4, 128), 4, 128), 128, 64), None);
        // A width with a partial atom.
        assert_eq!(map_geometry(&shape(nhd(16, 96), 16, 96), 96, 64), None);
        // Blocks of 48 with stages of 32, of 24 with stages of 64: a box would cross a block or
        // a stage.
        assert_eq!(map_geometry(&shape(nhd(48, 128), 48, 128), 128, 32), None);
        assert_eq!(map_geometry(&shape(nhd(24, 128), 24, 128), 128, 64), None);
        // K and V interleaved per block: neither tokens nor heads evenly spaced across blocks.
        let mut interleaved = nhd(16, 128);
        interleaved.block *= 2;
        assert_eq!(map_geometry(&shape(interleaved, 16, 128), 128, 64), None);
    }
}
