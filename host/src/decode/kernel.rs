//! The kernel a decode batch runs ([`TcKernel`]): chosen from the layer's shape and the
//! batch's query and key lengths, with the CTA target of its split plans from the device's
//! occupancy and the [`Tuning`].

use super::split::{plan_decode_tc, DecodePlan};
use crate::batch::DecodeBatch;
use crate::device::AttnDevice;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::{decode_head_width, CacheRows, KernelId};
use crate::layout::KvLayout;
use crate::options::{SplitMode, Tuning};
use attn_math::prefill::{block_m, block_n, shared_layout};
use attn_math::split::EVEN_WAVES_MAX_SPLITS;
use attn_math::{keys_m, keys_rows};

/// Which kernel runs a decode batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DecodeKernel {
    /// Tensor cores, the keys of each tile split across the CTA's warps: up to 16 rows (query
    /// tokens x query heads) per kv head. With the score tile transposed (`decode_kr_*`, keys on
    /// the MMA's rows: `attn_math::keys_rows`) up to 8 rows from 16-bit caches and FP8 at head
    /// sizes 64/128, and up to 16 from 16-bit caches to head size 128 (`_r16`); the rest with
    /// 16-row score tiles (`decode_tc_<q>[_fp8]_d<d>`).
    #[default]
    TensorCoreKeys,
    /// Tensor cores, 64 rows per CTA (the prefill kernel): more rows per kv head (MQA).
    TensorCoreRows,
    /// MLA's latent attention (`attn_rs::mla::mla_attention`; its plans carry this tag).
    Mla,
}

impl DecodeKernel {
    /// The tensor-core shape for a batch: keys split across warps up to 16 rows per kv head.
    pub(crate) fn tensor_cores(rows_per_kv_head: u32) -> DecodeKernel {
        if rows_per_kv_head <= block_m(0, 0, true, false) {
            DecodeKernel::TensorCoreKeys
        } else {
            DecodeKernel::TensorCoreRows
        }
    }

    pub(crate) fn keys_split(self) -> bool {
        self == DecodeKernel::TensorCoreKeys
    }
}

/// What the tensor-core planner needs of a kernel: its query rows and keys per tile, and the
/// CTAs of one work item (kv heads x MLA's V slices).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcShape {
    /// Query rows per CTA tile.
    pub block_m: u32,
    /// Keys per tile (splits are whole tiles).
    pub block_n: u32,
    /// CTAs one work item launches (kv heads, x MLA's value slices).
    pub ctas_per_item: u32,
}

impl TcShape {
    /// The attention kernel's shape for these head sizes, CTA shape and cache format.
    pub const fn attention(head_size_qk: u32, head_size_v: u32, keys_split: bool, fp8: bool, ctas_per_item: u32) -> TcShape {
        TcShape {
            block_m: block_m(head_size_qk, head_size_v, keys_split, fp8),
            block_n: block_n(head_size_qk, head_size_v, keys_split, fp8),
            ctas_per_item,
        }
    }
}

/// The heads and head size of a layer, which a plan's offsets depend on: a request's partial
/// rows are `splits x query tokens x num_q_heads` rows of `head_size` floats, and a launch has
/// one CTA per work item and kv head. A plan used with more heads would index past its partials.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LayerShape {
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_size: usize,
}

/// Kv heads a decode launch groups into one thread-block cluster (1: none), for a cache of
/// `head_size` elements of `elem_bytes` a head row. The grid puts a work item's kv heads side by
/// side, so a cluster of them starts together and reads the same tokens' rows at once; in a cache
/// with heads after tokens (NHD) those rows lie next to each other. Measured on an H100
/// (docs/decode.md, "A work item's kv heads as one cluster" and "Clusters of 2 kv heads"), NHD:
/// - rows of 128 bytes (bf16 d64, FP8 d128) gain 3% with 8 kv heads a cluster, and so do FP8
///   rows of 112 bytes 4-8% (their 2 lose 4-8% against 8; 4 and 8 lose on every other FP8 row
///   size from 40 to 120 bytes, 3-11%);
/// - rows of 48 to 240 bytes up to head size 128 gain up to 13% with 2 (they lose 1-16% with 8),
///   and so do 128-byte rows of a layer whose kv heads are not a multiple of 8;
/// - 16-bit rows of 256 bytes and more stay even; FP8 rows under 48 bytes (kernels bound by their
///   instructions) lose 2%, and FP8 rows past head size 128 (the width-256 kernel) 3-6%.
///
/// HND caches are even or slower at every size.
pub(crate) fn head_cluster(layout: KvLayout, head_size: usize, elem_bytes: usize, num_kv_heads: usize, clusters_enabled: bool) -> u32 {
    let row_bytes = head_size.saturating_mul(elem_bytes);
    if !clusters_enabled || layout.heads_before_tokens() || head_size > 128 || !(48..256).contains(&row_bytes) {
        1
    } else if (row_bytes == 128 || (elem_bytes == 1 && head_size == 112)) && num_kv_heads.is_multiple_of(8) {
        8
    } else if num_kv_heads.is_multiple_of(2) {
        2
    } else {
        1
    }
}

/// Keys a split of a decode over this cache holds at most (`None`: as many as the plan gives
/// it). In an NHD cache a token's kv heads lie side by side, and a CTA reads only its own head's
/// row of each; where the rows are not whole 128-byte lines, the lines at their edges are shared
/// with the neighbouring heads' rows, fetched whole (`.L2::128B`), and read again by the
/// neighbours' CTAs, which find them in L2 only while they run in step. CTAs of 4096 keys drift
/// apart: one launch of bf16 d56 NHD at 64 x 4096 read 1.27-1.48x the cache's bytes from DRAM
/// (clusters of 1, 2 or 8), and 1.00-1.02x with splits of 1024 or 256 keys; HND and 128-byte
/// rows read 1.00x (docs/decode.md, "Splits of 1024 keys"). Shorter splits cost their merge and
/// CTA starts, so the cap is taken where it measured faster (an H100 and an H200): 16-bit rows
/// whose last, partial 128-byte line holds 80 bytes or more of the row (head sizes 40, 48, 56,
/// 104, 112, 120; H100 1.07-1.27x, H200 1.03-1.14x, but 48 and 40 lose 2-3% there while gaining
/// 17-18% on the H100), over more than two kv heads (two, in a cluster of 2, read whole token
/// rows together: GQA 16 d56 lost 6%). Rows of 144 to 192 bytes lost up to 9% on the H200, 64
/// bytes 10%, and FP8 rows lose (their kernels are bound by their instructions).
pub(crate) fn split_key_cap(layout: KvLayout, head_size: usize, elem_bytes: usize, num_kv_heads: usize) -> Option<u32> {
    let row_bytes = head_size.saturating_mul(elem_bytes);
    let capped = !layout.heads_before_tokens() && elem_bytes == 2 && head_size <= 128 && row_bytes % 128 >= 80 && num_kv_heads > 2;
    capped.then_some(NHD_SHARED_LINES_MAX_CHUNK)
}

/// The keys of a split under [`split_key_cap`].
pub(crate) const NHD_SHARED_LINES_MAX_CHUNK: u32 = 1024;

/// A tensor-core kernel for a kind of batch, and the CTA count its split plans aim at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TcKernel {
    pub kernel: DecodeKernel,
    pub id: KernelId,
    /// The layer it runs (MLA: one kv head of the latent width).
    pub layer: LayerShape,
    pub smem: u32,
    pub shape: TcShape,
    /// Threads per CTA.
    pub threads: u32,
    /// Query heads per kv head (MLA: every head).
    pub group: u32,
    /// CTAs the split plan aims at.
    pub target: u64,
    /// CTAs the GPU holds at once (`plan_decode_tc`'s even waves); 0: no even waves (MLA, or
    /// [`Tuning::decode_even_waves`] off).
    pub slots: u64,
    /// The kernel merges its splits itself (`decode_kr_*`: the last CTA of a work item, through
    /// the workspace's counters): no merge kernel, and a plan of uniform splits stays on the host.
    pub fused_merge: bool,
    /// Keys a split holds at most under `SplitMode::Auto` ([`split_key_cap`]), within
    /// `EVEN_WAVES_MAX_SPLITS` splits a request.
    pub max_chunk: Option<u32>,
}

#[cfg(test)]
impl TcKernel {
    /// The keys-as-rows kernel of 32 bf16 query heads over 8 kv heads at d128, for the
    /// planners' unit tests (no device needed).
    pub(crate) fn keys_rows_d128(fused_merge: bool) -> TcKernel {
        TcKernel {
            kernel: DecodeKernel::TensorCoreKeys,
            id: KernelId::DecodeKr { q: crate::dtype::DType::BF16, rows: CacheRows::Bits16, long: false, wide: false, head_size: 128 },
            layer: LayerShape { num_q_heads: 32, num_kv_heads: 8, head_size: 128 },
            smem: 1,
            shape: TcShape::attention(128, 128, true, false, 8),
            threads: 128,
            group: 4,
            target: 264,
            slots: 0,
            fused_merge,
            max_chunk: None,
        }
    }
}

impl TcKernel {
    /// This kernel's split plan of `batch` for `num_q_heads` query heads ([`plan_decode_tc`]
    /// with the kernel's shape, CTA target, slots and chunk cap).
    pub(crate) fn plan(&self, batch: &DecodeBatch<'_>, num_q_heads: usize, mode: SplitMode, partial_capacity: usize) -> DecodePlan {
        plan_decode_tc(batch, num_q_heads, self.group, self.shape, self.target, self.slots, self.max_chunk, mode, partial_capacity)
    }

    /// The most work items a plan of `num_reqs` requests of `q_len` query tokens can have
    /// (`plan_decode_tc`: at most `target` CTAs unless one split per request is already more,
    /// and then up to `EVEN_WAVES_MAX_SPLITS` splits each;
    /// `SplitMode::Fixed(n)`: `n` splits each at most).
    pub fn max_items(&self, num_reqs: usize, q_len: u32, mode: SplitMode) -> usize {
        let bm = self.shape.block_m;
        let per_split = num_reqs * (q_len * self.group).div_ceil(bm).max(1) as usize;
        match mode {
            // Even waves split each request up to EVEN_WAVES_MAX_SPLITS times.
            SplitMode::Auto => (per_split * EVEN_WAVES_MAX_SPLITS as usize).max((self.target / self.shape.ctas_per_item as u64) as usize),
            SplitMode::Fixed(n) => per_split * n.max(1) as usize,
        }
    }
}

/// Whether decode from an FP8 cache on `device` at head size `head_size`, for batches of up to
/// `rows` query rows a kv head (the longest request's query tokens x the query heads of a kv
/// head; up to 16: more take the prefill kernel, [`crate::prefill::fp8_prefill_rounds_to_e4m3`]),
/// rounds the queries and the softmax weights to e4m3. On sm_90a at head sizes 128 to 256, and
/// from 72 for 9 to 16 rows (`fp8_wgmma_pays`), both products run on e4m3 `wgmma` with the
/// cache's bytes as they are (`decode_km_*`, `attn_math::keys_m`), the queries with one scale a
/// row (its largest magnitude to e4m3's 448) and the weights times 2^7, as vLLM's FP8 decode on
/// FlashAttention-3 quantises its queries. Elsewhere the cache's values are converted exactly
/// and the result is as precise as over a 16-bit cache holding the same values. The same for
/// both FP8 formats.
pub fn fp8_decode_rounds_to_e4m3(device: &AttnDevice, head_size: usize, rows: usize) -> bool {
    let width = attn_math::decode::decode_width(head_size.min(u32::MAX as usize) as u32, true);
    device.ptx_target() == "sm_90a" && width.is_some_and(|w| keys_m::FP8_WIDTHS.contains(&w)) && fp8_wgmma_pays(head_size, rows)
}

/// Whether decode at head size `d` for `rows` query rows a kv head, from an FP8 cache (`fp8`) or a
/// 16-bit one, may take the `wgmma` kernels: only from the sm_90a module (`sm_90a`), where they pay.
fn takes_wgmma(sm_90a: bool, fp8: bool, d: usize, rows: usize) -> bool {
    sm_90a && if fp8 { fp8_wgmma_pays(d, rows) } else { half_wgmma_pays(d, rows) }
}

/// Whether FP8 decode at `head_size` for `rows` query rows a kv head takes the `wgmma` kernels
/// where they exist (widths 128 and 256), as measured (docs/decode.md): at width 256 every head
/// size (160: 2% faster on the H200); at width 128 head size 128 itself, and below it every
/// head size from 72 for 9 to 16 rows (GQA 16 on the H100: 80 to 112 1.04-1.08x the
/// keys-as-rows kernel; 120, rows copied in halves, 1.09x with its three stages). Up to 8 rows
/// 80, 96 and 112 ran 8-17% slower than the keys-as-rows kernels, the tile's chain setting the
/// pace.
fn fp8_wgmma_pays(head_size: usize, rows: usize) -> bool {
    head_size >= 128 || (head_size >= 72 && rows > keys_m::ROWS[0] as usize)
}

/// Whether 16-bit decode at `head_size` for `rows` query rows a kv head takes the `wgmma`
/// kernels where they exist (`keys_m::takes`), as measured (docs/decode.md, "Head sizes below
/// 64 on the two width-64 kernels"): up to 8 rows, the keys-as-rows kernel only at head size 56
/// (NHD 1.044x, HND 0.996x); at 32 and 48 it lost 4-6% in both layouts, at 40 3% (NHD).
fn half_wgmma_pays(head_size: usize, rows: usize) -> bool {
    head_size != 56 || rows > keys_m::ROWS[0] as usize
}

/// The longest request's keys (0 for an empty batch or negative lengths).
pub(crate) fn max_len(seq_lens: &[i32]) -> u32 {
    seq_lens.iter().copied().max().unwrap_or(0).max(0) as u32
}

/// The tensor-core decode kernel for `max_q` query tokens per request (`max_len` keys in the
/// longest) over a cache of type `cache` in `layout`, and its CTA target under `tuning`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_tc_kernel(
    dev: &AttnDevice,
    q_dtype: DType,
    cache: DType,
    layout: KvLayout,
    d: usize,
    hq: usize,
    num_kv_heads: usize,
    max_q: u32,
    max_len: u32,
    tuning: &Tuning,
) -> Result<TcKernel> {
    let group = (hq / num_kv_heads) as u32;
    // The kernel's width; the launch runs at head size `d` (`AttnParams::dims`).
    let fp8 = cache.is_fp8();
    let width = decode_head_width("head_size", d, fp8)?;
    // Long FP8 requests take the deep pipeline only where it pays (`fp8_deep_pipeline`); 16-bit
    // ones take their long kernels everywhere (`keys_rows::HALF_LONG_KEYS`).
    let max_len = if !fp8 || dev.fp8_deep_pipeline() { max_len } else { 0 };
    let rows = (max_q * group) as usize;
    let wgmma = takes_wgmma(dev.ptx_target() == "sm_90a", fp8, d, rows);
    let (kernel, id, smem) = decode_kernel_id(wgmma, q_dtype, CacheRows::of(cache, d), width, group, max_q, max_len);
    let waves = tuning.decode_waves.unwrap_or(measured_waves(width)).max(1);
    let resident = dev.resident_ctas(id, attn_math::prefill::THREADS, smem)?;
    let slots = dev.sm_count() as u64 * resident as u64;
    let target = waves * slots;
    // No slots: `plan_decode_tc` leaves the even waves out.
    let slots = if tuning.decode_even_waves { slots } else { 0 };
    let mut shape = TcShape::attention(width, width, kernel.keys_split(), fp8, num_kv_heads as u32);
    // The keys-as-rows kernels and those on `wgmma` take 8 or 16 rows a CTA and merge their
    // splits themselves.
    let keys_rows = match id {
        KernelId::DecodeKr { wide, .. } | KernelId::DecodeKm { wide, .. } => {
            shape.block_m = if wide { keys_rows::WIDE_ROWS } else { keys_rows::MAX_ROWS };
            true
        }
        _ => false,
    };
    let layer = LayerShape { num_q_heads: hq, num_kv_heads, head_size: d };
    let fused_merge = keys_rows;
    let max_chunk = split_key_cap(layout, d, cache.size_bytes(), num_kv_heads);
    Ok(TcKernel { kernel, id, layer, smem, shape, threads: attn_math::prefill::THREADS, group, target, slots, fused_merge, max_chunk })
}

/// The tensor-core decode kernel for `group` query heads per kv head at width `d`, `max_q`
/// query tokens per request and `max_len` keys in the longest over cache rows `rows`, and its
/// shared memory; `wgmma`: the sm_90a module's `wgmma` kernels may be taken.
pub(crate) fn decode_kernel_id(
    wgmma: bool,
    q: DType,
    rows: CacheRows,
    d: u32,
    group: u32,
    max_q: u32,
    max_len: u32,
) -> (DecodeKernel, KernelId, u32) {
    let fp8 = rows.is_fp8();
    let kernel = DecodeKernel::tensor_cores(max_q * group);
    let wide = max_q * group > keys_rows::MAX_ROWS;
    // On sm_90a, `wgmma` with the keys on M (`attn_math::keys_m`): FP8 caches at widths 128 and
    // 256 up to 16 rows (nothing converted), 16-bit ones at width 64 up to 16 rows and at 128
    // for 9 to 16.
    if wgmma && kernel == DecodeKernel::TensorCoreKeys && keys_m::takes(d, fp8, max_q * group) {
        let rows_per_cta = if wide { keys_rows::WIDE_ROWS } else { keys_rows::MAX_ROWS };
        let row_bytes = d * if fp8 { 1 } else { 2 };
        let halves = matches!(rows, CacheRows::Fp8 { a8: true, .. });
        return (kernel, KernelId::DecodeKm { q, rows, wide, head_size: d }, keys_m::layout(row_bytes, rows_per_cta, halves).total);
    }
    // The keys-split CTAs with the score tile transposed (`decode_kr_*`: keys on the MMA's rows,
    // half the math per tile): up to 8 rows per kv head from 16-bit caches and FP8 at head sizes
    // 64, 128 and 256, up to 16 (two column groups) from 16-bit caches up to head size 128 and
    // from FP8 at 64 and 128 (in the deep-pipeline form, whose two CTAs per SM have the registers).
    let keys_rows = kernel == DecodeKernel::TensorCoreKeys
        && if fp8 { keys_rows::fp8_keys_rows(d, wide) } else { !wide || keys_rows::WIDE_HEAD_SIZES.contains(&d) };
    // Batches with long requests: the deep-pipeline FP8 kernels (`keys_rows::fp8_long`: from
    // `FP8_LONG_KEYS`, every FP8 `_r16` kernel whatever its CTAs an SM, and width 256's only
    // kernel), the two-CTA 16-bit ones at width 128 (`keys_rows::HALF_LONG_KEYS`).
    let long = if fp8 { keys_rows::fp8_long(d, max_len, wide) } else { d == 128 && !wide && max_len >= keys_rows::HALF_LONG_KEYS };
    let id = match kernel {
        DecodeKernel::TensorCoreKeys if keys_rows => KernelId::DecodeKr { q, rows, long, wide, head_size: d },
        DecodeKernel::TensorCoreKeys => KernelId::DecodeTc { q, rows, head_size: d },
        _ => KernelId::Prefill { q, rows, head_size_qk: d, head_size_v: d },
    };
    let smem = if keys_rows {
        let rows = if wide { keys_rows::WIDE_ROWS } else { keys_rows::MAX_ROWS };
        keys_rows::layout(d, fp8, keys_rows::ctas_per_sm(d, fp8, long, rows), rows).total
    } else {
        shared_layout(d, d, kernel.keys_split(), fp8).total
    };
    (kernel, id, smem)
}

/// Waves of resident CTAs a decode plan aims at by default: splits short enough to fill every
/// SM, few enough that the per-CTA start (work item, first address tables, pipeline fill) and
/// the merge stay small, measured per head size on the H100 (docs/decode.md): one wave up to
/// d128 (2 CTAs per SM), two at d256 (1 per SM). [`Tuning::decode_waves`] overrides it.
pub(crate) fn measured_waves(d: u32) -> u64 {
    match d {
        0..=128 => 1,
        _ => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Clusters only in NHD caches with rows of 48 to 255 bytes up to head size 128, on sm_90a: 8
    /// kv heads for rows of 128 bytes and FP8 rows of 112 where the heads allow, else 2 where
    /// they are even.
    #[test]
    fn head_cluster_rule() {
        use KvLayout::*;
        // (head size, element bytes, the size at 8 kv heads, at 4, at 2): bf16 d64 and FP8 d128
        // (rows of 128 bytes); rows of 48 to 240 bytes; 256-byte rows and wider, FP8 rows under
        // 48 bytes and FP8 past head size 128.
        let rows = [
            (64, 2, 8, 2, 2),
            (128, 1, 8, 2, 2),
            (112, 1, 8, 2, 2),
            (112, 2, 2, 2, 2),
            (32, 2, 2, 2, 2),
            (40, 2, 2, 2, 2),
            (120, 2, 2, 2, 2),
            (48, 1, 2, 2, 2),
            (120, 1, 2, 2, 2),
            (128, 2, 1, 1, 1),
            (256, 2, 1, 1, 1),
            (40, 1, 1, 1, 1),
            (136, 1, 1, 1, 1),
        ];
        for (d, e, at8, at4, at2) in rows {
            for nhd in [FlashNhd, FlashInferNhd] {
                assert_eq!([8, 4, 2].map(|kv| head_cluster(nhd, d, e, kv, true)), [at8, at4, at2], "d{d} x{e}");
                assert_eq!([16, 3, 1].map(|kv| head_cluster(nhd, d, e, kv, true)), [at8, 1, 1], "d{d} x{e}");
                assert_eq!(head_cluster(nhd, d, e, 8, false), 1);
            }
            for hnd in [FlashHnd, FlashInferHnd] {
                assert_eq!(head_cluster(hnd, d, e, 8, true), 1);
            }
        }
    }

    /// Splits of at most 1024 keys only for 16-bit NHD rows whose last partial 128-byte line
    /// holds 80 bytes or more of the row, up to head size 128, over more than two kv heads.
    #[test]
    fn split_key_cap_rule() {
        use KvLayout::*;
        for d in [40, 48, 56, 104, 112, 120] {
            assert_eq!(split_key_cap(FlashNhd, d, 2, 8), Some(1024), "d{d}");
            assert_eq!(split_key_cap(FlashInferNhd, d, 2, 4), Some(1024), "d{d}");
            assert_eq!(split_key_cap(FlashNhd, d, 2, 2), None, "d{d} with 2 kv heads");
            assert_eq!(split_key_cap(FlashHnd, d, 2, 8), None, "d{d}");
            assert_eq!(split_key_cap(FlashNhd, d, 1, 8), None, "FP8 d{d}");
        }
        for d in [32, 64, 72, 80, 88, 96, 128, 136, 168, 256] {
            assert_eq!(split_key_cap(FlashNhd, d, 2, 8), None, "d{d}");
        }
    }

    /// The decode kernel of each kind of batch: keys as rows up to 8 rows per kv head (FP8 at
    /// head sizes 64, 128 and 256, the deep pipeline at 128 from `FP8_LONG_KEYS` keys and always
    /// at 256) and up to 16
    /// from 16-bit caches up to head size 128, else keys split across warps up to 16, the
    /// prefill kernel above.
    #[test]
    fn decode_kernel_choice() {
        let e4m3 = CacheRows::Fp8 { format: crate::dtype::Fp8Format::E4m3, a8: false };
        let rows = |fp8| if fp8 { e4m3 } else { CacheRows::Bits16 };
        let name = |fp8, d, group, max_q, max_len| decode_kernel_id(false, DType::BF16, rows(fp8), d, group, max_q, max_len).1.entry_name();
        let long = keys_rows::FP8_LONG_KEYS;
        assert_eq!(name(false, 128, 4, 1, 100), "decode_kr_bf16_d128");
        assert_eq!(name(false, 128, 4, 1, long), "decode_kr_bf16_long_d128");
        assert_eq!(name(false, 128, 4, 1, keys_rows::HALF_LONG_KEYS - 1), "decode_kr_bf16_d128");
        assert_eq!(name(false, 256, 8, 1, 100), "decode_kr_bf16_d256");
        assert_eq!(name(true, 128, 4, 2, long - 1), "decode_kr_bf16_fp8_d128");
        assert_eq!(name(true, 128, 4, 2, long), "decode_kr_bf16_fp8_long_d128");
        // Width 64: the four-CTA kernels at every length.
        assert_eq!(name(true, 64, 4, 2, long), "decode_kr_bf16_fp8_d64");
        // FP8 at width 256: the deep-pipeline kernel at any length up to 8 rows, the 16-row
        // score tiles above.
        assert_eq!(name(true, 256, 4, 1, 100), "decode_kr_bf16_fp8_long_d256");
        assert_eq!(name(true, 256, 8, 1, long), "decode_kr_bf16_fp8_long_d256");
        assert_eq!(name(true, 256, 16, 1, 100), "decode_tc_bf16_fp8_d256");
        // FP8 rows of an odd multiple of 8 (`a8`): the `_fp8_a8` twins; E5M2 the `_e5m2` ones.
        let a8 = |d, group, max_q, max_len| {
            decode_kernel_id(false, DType::BF16, CacheRows::of(DType::Fp8E4m3, 72), d, group, max_q, max_len).1.entry_name()
        };
        let e5m2 = |d, group, max_q, max_len| {
            decode_kernel_id(false, DType::BF16, CacheRows::of(DType::Fp8E5m2, d as usize), d, group, max_q, max_len).1.entry_name()
        };
        assert_eq!(e5m2(128, 4, 1, 100), "decode_kr_bf16_e5m2_d128");
        assert_eq!(e5m2(64, 16, 1, 100), "decode_kr_bf16_e5m2_long_r16_d64");
        assert_eq!(e5m2(256, 4, 1, long), "decode_kr_bf16_e5m2_long_d256");
        assert_eq!(a8(128, 4, 1, 100), "decode_kr_bf16_fp8_a8_d128");
        assert_eq!(a8(64, 16, 1, 100), "decode_kr_bf16_fp8_a8_long_r16_d64");
        assert_eq!(a8(256, 4, 1, long), "decode_kr_bf16_fp8_a8_long_d256");
        assert_eq!(a8(256, 16, 1, long), "decode_tc_bf16_fp8_a8_d256");
        assert_eq!(name(false, 128, 4, 3, 100), "decode_kr_bf16_r16_d128");
        assert_eq!(name(false, 64, 16, 1, 100), "decode_kr_bf16_r16_d64");
        assert_eq!(name(false, 256, 16, 1, 100), "decode_tc_bf16_d256");
        assert_eq!(name(true, 128, 16, 1, long), "decode_kr_bf16_fp8_long_r16_d128");
        assert_eq!(name(true, 64, 8, 2, 10), "decode_kr_bf16_fp8_long_r16_d64");
        assert_eq!(name(true, 256, 16, 1, long), "decode_tc_bf16_fp8_d256");
        assert_eq!(name(false, 128, 8, 3, 100), "prefill_bf16_dk128_dv128");
        assert_eq!(name(true, 64, 32, 1, long), "prefill_bf16_fp8_dk64_dv64");
        let f16 = decode_kernel_id(false, DType::F16, CacheRows::Bits16, 96, 2, 1, 10);
        assert_eq!(f16.1.entry_name(), "decode_kr_f16_d96");
        assert_eq!(f16.0, DecodeKernel::TensorCoreKeys);

        // Shared memory: the keys-as-rows layout for its CTAs per SM, else the tile kernel's.
        let (kernel, _, smem) = decode_kernel_id(false, DType::BF16, e4m3, 128, 4, 1, long);
        assert_eq!(kernel, DecodeKernel::TensorCoreKeys);
        assert_eq!(
            smem,
            keys_rows::layout(128, true, keys_rows::ctas_per_sm(128, true, true, keys_rows::MAX_ROWS), keys_rows::MAX_ROWS).total
        );
        let (_, id, smem) = decode_kernel_id(false, DType::BF16, CacheRows::Bits16, 128, 16, 1, 100);
        assert_eq!(id.entry_name(), "decode_kr_bf16_r16_d128");
        assert_eq!(smem, keys_rows::layout(128, false, 2, keys_rows::WIDE_ROWS).total);
        let (_, id, smem) = decode_kernel_id(false, DType::BF16, e4m3, 64, 16, 1, 10);
        assert_eq!(id.entry_name(), "decode_kr_bf16_fp8_long_r16_d64");
        assert_eq!(smem, keys_rows::layout(64, true, 2, keys_rows::WIDE_ROWS).total);
        let (kernel, _, smem) = decode_kernel_id(false, DType::BF16, CacheRows::Bits16, 256, 4, 3, 100);
        assert_eq!((kernel, smem), (DecodeKernel::TensorCoreKeys, shared_layout(256, 256, true, false).total));
        let (kernel, _, smem) = decode_kernel_id(false, DType::BF16, CacheRows::Bits16, 128, 32, 1, 100);
        assert_eq!((kernel, smem), (DecodeKernel::TensorCoreRows, shared_layout(128, 128, false, false).total));
    }

    /// On sm_90a FP8 caches at widths 128 and 256 take the `wgmma` kernels up to 16 rows (width
    /// 64 the keys-as-rows ones, more rows the prefill kernel), 16-bit ones at 64 up to 16 rows
    /// and at 128 for 9 to 16; the rest is as elsewhere.
    #[test]
    fn hopper_decode_kernels() {
        let e4m3 = CacheRows::Fp8 { format: crate::dtype::Fp8Format::E4m3, a8: false };
        let a8 = CacheRows::of(DType::Fp8E5m2, 72);
        let pick = |rows, d, group, max_q| decode_kernel_id(true, DType::BF16, rows, d, group, max_q, 100);
        let (kernel, id, smem) = pick(e4m3, 128, 4, 1);
        assert_eq!(
            (kernel, id.entry_name(), smem),
            (DecodeKernel::TensorCoreKeys, "decode_km_bf16_fp8_d128".into(), keys_m::layout(128, 8, false).total)
        );
        let (_, id, smem) = pick(e4m3, 256, 16, 1);
        assert_eq!((id.entry_name(), smem), ("decode_km_bf16_fp8_r16_d256".into(), keys_m::layout(256, 16, false).total));
        // 16-bit caches: GQA 16 at widths 64 and 128 (rows of 128 and 256 bytes), up to 8 rows
        // at 64 (four CTAs an SM); 8 rows at 128 and width 96 keep the keys-as-rows kernels.
        let (_, id, smem) = pick(CacheRows::Bits16, 128, 16, 1);
        assert_eq!((id.entry_name(), smem), ("decode_km_bf16_r16_d128".into(), keys_m::layout(256, 16, false).total));
        assert_eq!(pick(CacheRows::Bits16, 64, 8, 2).1.entry_name(), "decode_km_bf16_r16_d64");
        let (_, id, smem) = pick(CacheRows::Bits16, 64, 4, 1);
        assert_eq!((id.entry_name(), smem), ("decode_km_bf16_d64".into(), keys_m::layout(128, 8, false).total));
        assert_eq!(pick(CacheRows::Bits16, 96, 16, 1).1.entry_name(), "decode_kr_bf16_r16_d96");
        let (_, id, smem) = pick(a8, 128, 8, 2);
        assert_eq!((id.entry_name(), smem), ("decode_km_bf16_e5m2_a8_r16_d128".into(), keys_m::layout(128, 16, true).total));
        assert_eq!(pick(e4m3, 64, 4, 1).1.entry_name(), "decode_kr_bf16_fp8_d64");
        assert_eq!(pick(e4m3, 128, 32, 1).1.entry_name(), "prefill_bf16_fp8_dk128_dv128");
        assert_eq!(pick(CacheRows::Bits16, 128, 4, 1).1.entry_name(), "decode_kr_bf16_d128");
    }

    /// FP8 head sizes padded to width 128 keep the keys-as-rows kernels up to 8 rows and take
    /// `wgmma` from 9; width 256's all take `wgmma`.
    #[test]
    fn fp8_wgmma_by_head_size() {
        let sizes = [72, 80, 96, 112, 120, 128, 136, 160, 256];
        assert_eq!(sizes.map(|d| fp8_wgmma_pays(d, 8)), [false, false, false, false, false, true, true, true, true]);
        assert_eq!(sizes.map(|d| fp8_wgmma_pays(d, 9)), [true; 9]);
        assert!(!fp8_wgmma_pays(64, 16));
    }

    /// 16-bit head sizes below 64 take `wgmma` (width 64, keys on M) except 56 up to 8 rows.
    #[test]
    fn half_wgmma_by_head_size() {
        let sizes = [32, 40, 48, 56, 64, 128];
        assert_eq!(sizes.map(|d| half_wgmma_pays(d, 8)), [true, true, true, false, true, true]);
        assert_eq!(sizes.map(|d| half_wgmma_pays(d, 9)), [true; 6]);
    }

    #[test]
    fn measured_waves_by_head_size() {
        assert_eq!([64, 96, 128, 256].map(measured_waves), [1, 1, 1, 2]);
    }

    /// Every decode kernel the modules export is the choice for some batch (one path per case):
    /// the kernel choice over both modules, both query types, every cache type and head size,
    /// up to 16 rows a kv head and short and long requests.
    #[test]
    fn every_decode_kernel_is_chosen_for_some_batch() {
        use crate::kernels::KernelId;
        let mut chosen = std::collections::BTreeSet::new();
        for (sm_90a, q, cache) in module_query_cache() {
            for d in (attn_math::decode::MIN_HEAD_SIZE..=attn_math::decode::MAX_HEAD_SIZE).step_by(8) {
                let fp8 = cache.is_fp8();
                let width = attn_math::decode::decode_width(d, fp8).unwrap();
                for (group, max_q) in (1..=16).flat_map(|g| (1..=4).map(move |m| (g, m))).filter(|(g, m)| g * m <= 16) {
                    let rows = (group * max_q) as usize;
                    let wgmma = takes_wgmma(sm_90a, fp8, d as usize, rows);
                    for max_len in [0, 100, keys_rows::FP8_LONG_KEYS, keys_rows::HALF_LONG_KEYS] {
                        let (_, id, _) = decode_kernel_id(wgmma, q, CacheRows::of(cache, d as usize), width, group, max_q, max_len);
                        chosen.insert(id.entry_name());
                    }
                }
            }
        }
        let never: Vec<String> = KernelId::all()
            .iter()
            .filter(|id| matches!(id, KernelId::DecodeTc { .. } | KernelId::DecodeKr { .. } | KernelId::DecodeKm { .. }))
            .map(KernelId::entry_name)
            .filter(|name| !chosen.contains(name))
            .collect();
        assert!(never.is_empty(), "decode kernels no batch takes: {never:?}");
    }

    /// (sm_90a module, query type, cache type) for 16-bit caches of the query's type and FP8 ones.
    fn module_query_cache() -> Vec<(bool, DType, DType)> {
        let mut v = Vec::new();
        for sm_90a in [true, false] {
            for q in [DType::F16, DType::BF16] {
                for cache in [q, DType::Fp8E4m3, DType::Fp8E5m2] {
                    v.push((sm_90a, q, cache));
                }
            }
        }
        v
    }
}
