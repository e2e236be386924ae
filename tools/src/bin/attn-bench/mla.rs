//! `--only mla`: MLA decode over the latent cache, bf16 and FP8, per call and planned once; and
//! sparse MLA (each token's top-k positions), bf16 and FP8.

use crate::bench::{dev, dtype_name, env_shapes, random_device, random_slots, random_values, Bench, Row};
use attn_rs::cache_write::KvScales;
use attn_rs::{BatchMetadata, DevIn, DevOut, DeviceStatus, Element, Fp8E4m3, Fp8E5m2, PlanOptions, Result, RowsDesc, SplitMode};
use cudarc::driver::CudaSlice;
use half::bf16;

/// What every MLA row sets up: `batch` requests of `context` keys over the shared latent cache
/// (block size 64, scattered block tables), `mtp` query tokens each (the last of the context:
/// 1, or a multi-token-prediction step's 2-4), queries and outputs of `heads` heads, and the FP8
/// scale (MLA's one, passed as both K's and V's).
struct Latent<'a, C> {
    spec: attn_rs::MlaCacheSpec,
    cache: cudarc::driver::CudaView<'a, C>,
    blocks_per_req: usize,
    block_table: CudaSlice<i32>,
    q_rows: RowsDesc,
    out_rows: RowsDesc,
    q: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    scale: CudaSlice<f32>,
    batch: BatchMetadata,
    ws: attn_rs::decode::DecodeWorkspace,
}

impl<'a, C: Element> Latent<'a, C> {
    fn new(b: &Bench, cache: &'a CudaSlice<C>, heads: usize, batch: usize, context: usize, mtp: usize) -> Result<Self> {
        let s = &b.stream;
        let blocks_per_req = context.div_ceil(64);
        let num_blocks = batch * blocks_per_req;
        let spec = attn_rs::MlaCacheSpec::deepseek(num_blocks, 64)?;
        let block_table: Vec<i32> = random_slots(num_blocks, num_blocks, 32).into_iter().map(|x| x as i32).collect();
        let tokens = batch * mtp;
        let (q_rows, out_rows) = (RowsDesc::contiguous(tokens, heads, 576), RowsDesc::contiguous(tokens, heads, 512));
        let qsl: Vec<i32> = (0..=batch).map(|r| (r * mtp) as i32).collect();
        Ok(Latent {
            spec,
            cache: cache.slice(..spec.num_elements()),
            blocks_per_req,
            block_table: s.clone_htod(&block_table)?,
            q_rows,
            out_rows,
            q: s.clone_htod(&random_values::<bf16>(q_rows.required_len(), 33, 1.0))?,
            out: s.alloc_zeros(out_rows.required_len())?,
            scale: s.clone_htod(&[0.05f32])?,
            batch: BatchMetadata::new(s, &vec![context as i32; batch], &qsl)?,
            // The size `DecodeWorkspace::new` suggests (a 2-16 GB one made rows measured after
            // it slower).
            ws: attn_rs::decode::DecodeWorkspace::new(s, 4 * dev().sm_count() as usize * 8 * heads * mtp, 512, batch, tokens)?,
        })
    }

    /// The call's arguments, its batch and the workspace it runs in.
    fn args<'s>(&'s mut self, b: &'s Bench) -> (attn_rs::mla::MlaArgs<'s>, &'s BatchMetadata, &'s mut attn_rs::decode::DecodeWorkspace) {
        let s = &b.stream;
        let fp8 = C::DTYPE.is_fp8();
        let args = attn_rs::mla::MlaArgs {
            q: DevIn::new(&self.q, s),
            q_rows: self.q_rows,
            cache: DevIn::new(&self.cache, s),
            spec: self.spec,
            block_table: DevIn::new(&self.block_table, s),
            block_table_stride: self.blocks_per_req,
            out: DevOut::new(&mut self.out, s),
            out_rows: self.out_rows,
            lse: None,
            scales: fp8.then(|| KvScales { k: DevIn::new(&self.scale, s), v: DevIn::new(&self.scale, s) }),
        };
        (args, &self.batch, &mut self.ws)
    }
}

/// MLA decode over the latent cache, context 4096, block size 64, scattered block tables, `mtp`
/// query tokens a request (causal among them); bytes = the latent cache read once; FLOPs = 2 *
/// heads * (576 + 512) per attended (token, key) pair. `planned`: the split plan made once
/// ([`attn_rs::batch_plan`], as every layer of a step runs it), else planned and uploaded by
/// each call.
fn mla_row<C: Element>(
    b: &Bench,
    cache: &CudaSlice<C>,
    (heads, batch, context, mtp): (usize, usize, usize, usize),
    planned: bool,
    status: &mut DeviceStatus,
) -> Result<Row> {
    use attn_rs::batch_plan::{mla_attention_planned, BatchPlan};
    use attn_rs::mla::mla_attention;
    let s = &b.stream;
    let mut l = Latent::new(b, cache, heads, batch, context, mtp)?;
    let mut bp = BatchPlan::new(s)?;
    let mode = PlanOptions { split: SplitMode::Auto, tuning: b.tuning };
    let planned_once = bp.plan_mla(dev(), &l.batch, attn_rs::DType::BF16, C::DTYPE, heads, mode, &l.ws)?;
    let (mut chunk, mut cluster) = (planned_once.chunk, planned_once.cluster);
    let scale = attn_rs::AttnOptions::new(576).softmax_scale;
    let us = b.time(|| {
        let (args, batch_meta, ws) = l.args(b);
        if planned {
            mla_attention_planned(dev(), s, args, batch_meta, scale, &bp, ws, status)
        } else {
            let plan = mla_attention(dev(), s, args, batch_meta, scale, mode, ws, status)?;
            (chunk, cluster) = (plan.chunk, plan.cluster);
            Ok(())
        }
    })?;
    status.check(s)?;
    let bytes = (batch * context * 576 * C::DTYPE.size_bytes()) as f64;
    // Token i of the last `mtp` attends context - (mtp - 1 - i) keys.
    let pairs = batch * (mtp * context - mtp * (mtp - 1) / 2);
    let flops = 2.0 * (heads * (576 + 512) * pairs) as f64;
    Ok(Row {
        name: format!("mla_attention{} bf16 q, {} latent", if planned { "_planned" } else { "" }, dtype_name(C::DTYPE)),
        shape: format!(
            "{heads} heads x batch {batch} x {context}{}, bs64 (chunk {chunk}{})",
            if mtp > 1 { format!(", MTP {mtp}") } else { String::new() },
            if cluster > 1 { format!(", cluster {cluster}") } else { String::new() }
        ),
        median_us: us,
        bytes,
        // Up to 16 query rows a request is memory-bound (GB/s), more compute-bound (TFLOP/s).
        flops: if heads * mtp > 16 { flops } else { 0.0 },
    })
}

/// Sparse MLA decode (DeepSeek-V3.2's top-k attention): one token a request over a context of
/// `context` (block size 64, scattered block tables), each attending `topk` distinct positions
/// in random order. Bytes = the gathered rows (tokens x k x 576 x the cache's element size) plus
/// the queries and outputs; 16 heads are memory-bound (flops 0), 128 heads compute-bound
/// (FLOPs = 2 * heads * k * (576 + 512) per token).
fn mla_sparse_row<C: Element>(
    b: &Bench,
    cache: &CudaSlice<C>,
    (heads, batch, context, topk): (usize, usize, usize, usize),
    status: &mut DeviceStatus,
) -> Result<Row> {
    use attn_rs::mla::{mla_sparse_attention, SparseIndexArgs};
    let s = &b.stream;
    let mut l = Latent::new(b, cache, heads, batch, context, 1)?;
    // Each token's k distinct positions of its context, in random order.
    let indices: Vec<i32> = (0..batch).flat_map(|t| random_slots(topk, context, 40 + t as u64).into_iter().map(|x| x as i32)).collect();
    let idx = s.clone_htod(&indices)?;
    let mode = PlanOptions { split: SplitMode::Auto, tuning: b.tuning };
    let scale = attn_rs::AttnOptions::new(576).softmax_scale;
    let mut chunk = 0;
    let us = b.time(|| {
        let (args, batch_meta, ws) = l.args(b);
        let list = SparseIndexArgs { indices: DevIn::new(&idx, s), topk, row_stride: topk };
        chunk = mla_sparse_attention(dev(), s, args, list, batch_meta, scale, mode, ws, status)?.chunk;
        Ok(())
    })?;
    status.check(s)?;
    let bytes = (batch * topk * 576 * C::DTYPE.size_bytes() + batch * heads * (576 + 512) * 2) as f64;
    let flops = 2.0 * (heads * topk * (576 + 512) * batch) as f64;
    Ok(Row {
        name: format!("mla_sparse_attention bf16 q, {} latent", dtype_name(C::DTYPE)),
        shape: format!("{heads} heads x batch {batch} x {context}, k {topk}, bs64 (chunk {chunk})"),
        median_us: us,
        bytes,
        // 16 heads is memory-bound (GB/s), 128 heads compute-bound (TFLOP/s).
        flops: if heads > 16 { flops } else { 0.0 },
    })
}

pub fn mla_rows(b: &Bench, rows: &mut Vec<Row>, status: &mut DeviceStatus) -> Result<()> {
    // One cache for every row, as an engine allocates it once: rows measured on caches
    // allocated one after another differed by up to 12% with where the allocation landed.
    let (max_batch, context) = (128, 4096);
    let rows_of = |bytes: usize| max_batch * context * 576 * bytes;
    let cache = random_device::<bf16>(&b.stream, rows_of(1), 31)?;
    // `ATTN_BENCH_MLA_SHAPES=16x64x4096,16x128x2048`: planned bf16 rows of those heads x batch x
    // context only (within the one cache's 128 x 4096 rows), for experiments.
    if let Some(shapes) = env_shapes("ATTN_BENCH_MLA_SHAPES") {
        for v in shapes.iter().filter(|v| v.len() == 3 && v[1] * v[2] <= max_batch * context) {
            rows.push(mla_row::<bf16>(b, &cache, (v[0], v[1], v[2], 1), true, status)?);
        }
        return Ok(());
    }
    for planned in [false, true] {
        for (heads, batch) in [(16, 64), (16, 128), (128, 64), (128, 128)] {
            rows.push(mla_row::<bf16>(b, &cache, (heads, batch, context, 1), planned, status)?);
        }
    }
    // Multi-token prediction: 2 and 4 query tokens a request (16 heads: 32 and 64 rows, the wide
    // shape; 128 heads x 2: 256 rows), planned once.
    for (heads, mtp) in [(16, 2), (16, 4), (128, 2)] {
        rows.push(mla_row::<bf16>(b, &cache, (heads, 64, context, mtp), true, status)?);
    }
    drop(cache);
    let cache = random_device::<Fp8E4m3>(&b.stream, rows_of(1), 31)?;
    // The FP8 cache: half the bytes at 16 heads; the conversion's cost at 128.
    for (heads, batch) in [(16, 64), (16, 128), (128, 64)] {
        rows.push(mla_row::<Fp8E4m3>(b, &cache, (heads, batch, context, 1), false, status)?);
    }
    // Sparse MLA: batch 64 over contexts of 8192 (the same cache rows as 128 x 4096), k 2048.
    let sparse = (64, 8192, 2048);
    for heads in [16, 128] {
        rows.push(mla_sparse_row::<Fp8E4m3>(b, &cache, (heads, sparse.0, sparse.1, sparse.2), status)?);
    }
    drop(cache);
    let cache = random_device::<Fp8E5m2>(&b.stream, rows_of(1), 31)?;
    for (heads, batch) in [(16, 64), (128, 64)] {
        rows.push(mla_row::<Fp8E5m2>(b, &cache, (heads, batch, context, 1), false, status)?);
    }
    drop(cache);
    let cache = random_device::<bf16>(&b.stream, rows_of(1), 31)?;
    for heads in [16, 128] {
        rows.push(mla_sparse_row::<bf16>(b, &cache, (heads, sparse.0, sparse.1, sparse.2), status)?);
    }
    Ok(())
}
