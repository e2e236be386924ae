//! Groups of the attention parameter block ([`attn_math::params::AttnParams`]) that more than
//! one launch path (decode, prefill, MLA) fills the same way, each built here from the call's
//! buffers. The split-K group comes from the decode workspace (`WorkspacePtrs::split_k`), the
//! variant's scalars from [`VariantParams::new`](attn_math::params::VariantParams::new).

use crate::batch::DeviceBatch;
use crate::buffer::{DevIn, DevOut};
use crate::layout::{KvCacheSpec, RowsDesc};
use attn_math::paging::CacheStrides;
use attn_math::params::{BatchMeta, OutputTensors, QkvTensors};

/// Queries `q` laid out as `q_rows`; keys and values at `k` and `v` with their strides.
pub(crate) fn qkv(
    q: &DevIn<'_>,
    q_rows: &RowsDesc,
    (k, k_strides): (u64, CacheStrides),
    (v, v_strides): (u64, CacheStrides),
) -> QkvTensors {
    QkvTensors {
        q: q.ptr,
        q_token_stride: q_rows.token_stride as u64,
        q_head_stride: q_rows.head_stride as u64,
        k,
        v,
        k_strides,
        v_strides,
    }
}

/// The K and V planes of the paged cache `cache` laid out as `spec`: each one's address and
/// strides, as [`qkv`] takes them.
pub(crate) fn paged_kv(cache: &DevIn<'_>, spec: &KvCacheSpec) -> [(u64, CacheStrides); 2] {
    let (k_origin, v_origin) = spec.kv_origins();
    let elem = cache.dtype.size_bytes() as u64;
    [(cache.ptr + k_origin as u64 * elem, spec.strides()), (cache.ptr + v_origin as u64 * elem, spec.strides())]
}

/// A paged cache's batch: each request's row of `block_table` (`block_table_stride` i32 a
/// row), and its lengths from the batch's device copy `meta`.
pub(crate) fn paged_batch(block_table: &DevIn<'_>, block_table_stride: usize, meta: &DeviceBatch<'_>) -> BatchMeta {
    BatchMeta {
        block_table: block_table.ptr,
        block_table_stride: block_table_stride as u64,
        seq_lens: meta.seq_lens.ptr,
        key_start_loc: 0,
        query_start_loc: meta.query_start_loc.ptr,
    }
}

/// Rows into `out` laid out as `out_rows`, and the LSEs into `lse` when given.
pub(crate) fn output(out: &DevOut<'_>, out_rows: &RowsDesc, lse: Option<&DevOut<'_>>) -> OutputTensors {
    OutputTensors {
        out: out.ptr,
        out_token_stride: out_rows.token_stride as u64,
        out_head_stride: out_rows.head_stride as u64,
        lse: lse.map_or(0, |l| l.ptr),
    }
}
