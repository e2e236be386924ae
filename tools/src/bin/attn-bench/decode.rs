//! `--only decode`: paged decode over a scattered cache, per call and planned once, with and
//! without programmatic dependent launch, and other head sizes, block sizes and groups.

use crate::bench::{dev, dtype_name, env_shapes, random_device, random_slots, random_values, Bench, Row};
use attn_rs::cache_write::KvScales;
use attn_rs::{
    BatchMetadata, DevIn, DevOut, DeviceStatus, Element, Fp8E4m3, Fp8E5m2, KvCacheSpec, KvLayout, PlanOptions, Result, RowsDesc, SplitMode,
};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::CudaSlice;
use half::bf16;

struct DecodeShape {
    batch: usize,
    context: usize,
    q_heads: usize,
    kv_heads: usize,
    head_size: usize,
    block_size: usize,
    /// FP8: one K and one V scale per kv head (else one for the cache).
    per_head_scales: bool,
}

/// How many caches of `cache_bytes` the timed calls take in turn: at least two, and enough that
/// together they are twice the L2 cache, as an engine's consecutive layers read different caches.
/// With one, a call reads rows the call before left in L2: a small cache (FP8 64 x 256, 34 MB)
/// fits in it whole, and a call whose grid leaves SM slots free overlaps the next (programmatic
/// dependent launch; the context is read before the wait), which then reads the rows the first
/// is reading (docs/decode.md, "GQA 16 with one split a request"). One where the rows are meant
/// to come from L2 (`hot`). `ATTN_BENCH_DECODE_CACHES=N` sets it (experiments).
fn num_caches(cache_bytes: u64, hot: bool) -> u64 {
    if let Some(n) = std::env::var("ATTN_BENCH_DECODE_CACHES").ok().and_then(|v| v.parse::<u64>().ok()) {
        return n.max(1);
    }
    if hot {
        return 1;
    }
    let l2 = dev().context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE).map_or(64 << 20, |b| b.max(0) as u64);
    (2 * l2).div_ceil(cache_bytes.max(1)).clamp(2, 16)
}

/// Paged decode; `planned`: the split plan made once ([`attn_rs::batch_plan`], as every layer of a
/// step runs it), else planned and uploaded by each call.
fn decode_row<C: Element>(b: &Bench, sh: &DecodeShape, planned: bool, status: &mut DeviceStatus) -> Result<Row> {
    use attn_rs::batch_plan::{paged_decode_planned, BatchPlan};
    use attn_rs::decode::{paged_decode, DecodeArgs, DecodeWorkspace};
    use attn_rs::AttnOptions;
    let s = &b.stream;
    let blocks_per_req = sh.context.div_ceil(sh.block_size);
    let num_blocks = sh.batch * blocks_per_req;
    // `ATTN_BENCH_DECODE_LAYOUT=hnd|fi_nhd|fi_hnd`: another cache layout (experiments).
    let layout = match std::env::var("ATTN_BENCH_DECODE_LAYOUT").as_deref() {
        Ok("hnd") => KvLayout::FlashHnd,
        Ok("fi_nhd") => KvLayout::FlashInferNhd,
        Ok("fi_hnd") => KvLayout::FlashInferHnd,
        _ => KvLayout::FlashNhd,
    };
    let spec = KvCacheSpec::new(layout, num_blocks, sh.block_size, sh.kv_heads, sh.head_size)?;
    let hot = std::env::var("ATTN_BENCH_DECODE_HOT").ok().and_then(|v| v.parse::<i32>().ok());
    let cache_bytes = spec.num_elements() as u64 * std::mem::size_of::<C>() as u64;
    let num_caches = num_caches(cache_bytes, hot.is_some());
    let caches =
        (0..num_caches).map(|i| random_device::<C>(s, spec.num_elements(), 11 + 100 * i)).collect::<Result<Vec<CudaSlice<C>>>>()?;
    let mut turn = 0usize;
    // Scattered block tables: a random permutation of all blocks.
    let mut block_table: Vec<i32> = random_slots(num_blocks, num_blocks, 12).into_iter().map(|x| x as i32).collect();
    // `ATTN_BENCH_DECODE_HOT=N`: every table entry within the first N blocks, so the cache rows
    // come from L2 and the row measures the kernel's own rate (experiments).
    if let Some(hot) = hot {
        block_table.iter_mut().for_each(|b| *b %= hot);
    }
    let seq_lens = vec![sh.context as i32; sh.batch];
    let qsl: Vec<i32> = (0..=sh.batch as i32).collect();
    let q_rows = RowsDesc::contiguous(sh.batch, sh.q_heads, sh.head_size);
    let q = s.clone_htod(&random_values::<bf16>(q_rows.required_len(), 13, 1.0))?;
    let mut out: CudaSlice<bf16> = s.alloc_zeros(q_rows.required_len())?;
    let bt = s.clone_htod(&block_table)?;
    let n_scales = if sh.per_head_scales { sh.kv_heads } else { 1 };
    let (ks, vs) = (s.clone_htod(&vec![0.05f32; n_scales])?, s.clone_htod(&vec![0.05f32; n_scales])?);
    // The size `DecodeWorkspace::new` suggests (an oversized one made later rows slower).
    let partial_rows = 4 * dev().sm_count() as usize * 8 * sh.q_heads / sh.kv_heads;
    let mut ws = DecodeWorkspace::new(s, partial_rows, sh.head_size, sh.batch, sh.batch)?;
    let fp8 = C::DTYPE.is_fp8();
    let opts = AttnOptions::new(sh.head_size);
    let batch = BatchMetadata::new(s, &seq_lens, &qsl)?;
    let mut bp = BatchPlan::new(s)?;
    let mut chunk = 0;
    // `ATTN_BENCH_DECODE_SPLITS=n`: n splits a request (experiments; the planner's otherwise).
    let split = std::env::var("ATTN_BENCH_DECODE_SPLITS").ok().and_then(|v| v.parse().ok()).map_or(SplitMode::Auto, SplitMode::Fixed);
    let mode = PlanOptions { split, tuning: b.tuning };
    if planned {
        let (qt, hd) = (attn_rs::DType::BF16, sh.head_size);
        chunk = bp.plan_decode(dev(), &batch, qt, C::DTYPE, layout, hd, sh.q_heads, sh.kv_heads, mode, &ws)?.chunk;
    }
    let us = b.time(|| {
        let cache = &caches[turn % caches.len()];
        turn += 1;
        let args = DecodeArgs {
            q: DevIn::new(&q, s),
            q_rows,
            cache: DevIn::new(cache, s),
            spec,
            block_table: DevIn::new(&bt, s),
            block_table_stride: blocks_per_req,
            out: DevOut::new(&mut out, s),
            out_rows: q_rows,
            lse: None,
            alibi_slopes: None,
            sinks: None,
            scales: fp8.then(|| KvScales { k: DevIn::new(&ks, s), v: DevIn::new(&vs, s) }),
        };
        if planned {
            paged_decode_planned(dev(), s, args, &batch, &opts, &bp, &mut ws, status)
        } else {
            chunk = paged_decode(dev(), s, args, &batch, &opts, mode, &mut ws, status)?.chunk;
            Ok(())
        }
    })?;
    status.check(s)?;
    let kv_bytes = 2.0 * (sh.batch * sh.context * sh.kv_heads * sh.head_size) as f64 * std::mem::size_of::<C>() as f64;
    Ok(Row {
        name: format!(
            "paged_decode{} bf16 q, {} cache{}",
            if planned { "_planned" } else { "" },
            dtype_name(C::DTYPE),
            if sh.per_head_scales { " (per-head scales)" } else { "" }
        ),
        shape: format!(
            "{}x{} {}q/{}kv d{} bs{} (chunk {chunk})",
            sh.batch, sh.context, sh.q_heads, sh.kv_heads, sh.head_size, sh.block_size
        ),
        median_us: us,
        bytes: kv_bytes,
        flops: 0.0,
    })
}

pub fn decode_rows(b: &Bench, rows: &mut Vec<Row>, status: &mut DeviceStatus) -> Result<()> {
    let shape =
        |batch, context| DecodeShape { batch, context, q_heads: 32, kv_heads: 8, head_size: 128, block_size: 16, per_head_scales: false };
    // `ATTN_BENCH_DECODE_SHAPES=64x4096,8x32768,64x4096x112,64x4096x128x2`: planned rows of
    // those batch x context (x head size, 128 if not given, x kv heads of 32 query heads, 8 if
    // not given) only, over a bf16 cache and over an FP8 one (experiments).
    if let Some(shapes) = env_shapes("ATTN_BENCH_DECODE_SHAPES") {
        for v in shapes.iter().filter(|v| (2..=4).contains(&v.len())) {
            let sh =
                DecodeShape { head_size: v.get(2).copied().unwrap_or(128), kv_heads: v.get(3).copied().unwrap_or(8), ..shape(v[0], v[1]) };
            rows.push(decode_row::<bf16>(b, &sh, true, status)?);
            rows.push(decode_row::<Fp8E4m3>(b, &sh, true, status)?);
        }
        return Ok(());
    }
    for (batch, context) in [(64, 4096), (8, 32768), (256, 1024), (1, 131072)] {
        rows.push(decode_row::<bf16>(b, &shape(batch, context), false, status)?);
        rows.push(decode_row::<Fp8E4m3>(b, &shape(batch, context), false, status)?);
    }
    for (batch, context) in [(64, 4096), (8, 32768), (256, 1024), (1, 131072)] {
        rows.push(decode_row::<bf16>(b, &shape(batch, context), true, status)?);
    }
    // Each call alone: without programmatic dependent launch, a call neither starts while the
    // one before drains nor lets the next one's CTAs stream in the slots it frees at its end
    // (as in an engine step whose next kernel is not launched with PDL).
    std::env::set_var("ATTN_DISABLE_PDL", "1");
    for (batch, context) in [(64, 4096), (8, 32768), (256, 1024), (1, 131072)] {
        for mut r in [
            decode_row::<bf16>(b, &shape(batch, context), false, status)?,
            decode_row::<Fp8E4m3>(b, &shape(batch, context), false, status)?,
        ] {
            r.name += " (no PDL)";
            rows.push(r);
        }
    }
    std::env::remove_var("ATTN_DISABLE_PDL");
    for sh in [
        DecodeShape { head_size: 64, ..shape(64, 4096) },
        DecodeShape { head_size: 256, ..shape(64, 4096) },
        DecodeShape { block_size: 64, ..shape(64, 4096) },
        DecodeShape { kv_heads: 32, ..shape(64, 4096) },
        DecodeShape { kv_heads: 2, ..shape(64, 4096) },
        // Short contexts: 4 key tiles per CTA, where each CTA's start-up counts.
        shape(64, 256),
    ] {
        rows.push(decode_row::<bf16>(b, &sh, false, status)?);
    }
    rows.push(decode_row::<Fp8E4m3>(b, &DecodeShape { kv_heads: 2, ..shape(64, 4096) }, false, status)?);
    rows.push(decode_row::<Fp8E4m3>(b, &DecodeShape { per_head_scales: true, ..shape(64, 4096) }, false, status)?);
    // E5M2 caches: the same kernels with the E5M2 conversion (a byte permute a pair).
    for (batch, context) in [(64, 4096), (8, 32768)] {
        rows.push(decode_row::<Fp8E5m2>(b, &shape(batch, context), false, status)?);
    }
    // Head sizes below the kernels' widths (`attn_math::decode::decode_width`): 40 (width 64),
    // 80 (96; FP8: 128), 112 (128), 200 (256), and FP8 at 96 (128); beside the d128 rows' % of
    // the read ceiling.
    for head_size in [40, 80, 112, 200] {
        rows.push(decode_row::<bf16>(b, &DecodeShape { head_size, ..shape(64, 4096) }, false, status)?);
    }
    for head_size in [80, 96, 112] {
        rows.push(decode_row::<Fp8E4m3>(b, &DecodeShape { head_size, ..shape(64, 4096) }, false, status)?);
    }
    Ok(())
}
