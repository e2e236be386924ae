//! Benchmark: measures the device-to-device copy ceiling, then each kernel, in one run, and
//! prints a table (and JSON with `--json PATH`): shape, median time over CUDA-event timings
//! after warm-up, GB/s (bytes read + written), and the fraction of the copy ceiling.
//!
//! `attn-bench [--json PATH] [--quick] [--only cache|decode|prefill|mla] [TUNING]`
//!
//! The split planners' knobs (`host::options::Tuning`; the measured defaults otherwise):
//! `--decode-waves N` (waves of resident CTAs a decode plan aims at), `--no-decode-even-waves`,
//! `--mla-waves N`, `--no-mla-clusters`.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use host::cache_write::{concat_and_cache_mla, reshape_and_cache, KvScales, KvWrite, MlaWrite};
use host::{
    AttnDevice, AttnError, BatchMetadata, DevIn, DevOut, DeviceStatus, Element, Fp8E4m3, KvCacheSpec, KvLayout, MlaCacheSpec, PlanOptions,
    Result, RowsDesc, SplitMode, Tuning,
};
use std::sync::Arc;

struct Row {
    name: String,
    shape: String,
    median_us: f64,
    /// Bytes the kernel must read plus write.
    bytes: f64,
    /// Compute-bound rows: the FLOPs of the attended key-query pairs (0 = memory-bound row).
    flops: f64,
}

/// Dense bf16 matmul rate of the H100 SXM measured with cuBLAS (the prefill issue's ceiling).
const MATMUL_TFLOPS: f64 = 778.0;

impl Row {
    fn gbps(&self) -> f64 {
        self.bytes / (self.median_us * 1e-6) / 1e9
    }
}

struct Bench {
    stream: Arc<CudaStream>,
    warmup: usize,
    reps: usize,
    /// Launches between one pair of events: back-to-back launches keep the GPU fed, so the
    /// host's launch cost does not land inside the timed region.
    batch: usize,
    /// The split planners' knobs (`--decode-waves` and the others).
    tuning: Tuning,
}

impl Bench {
    /// Median over `reps` event-timed batches of `f` (per call), after `warmup` untimed calls,
    /// in microseconds.
    fn time(&self, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        for _ in 0..self.warmup {
            f()?;
        }
        let ctx = self.stream.context();
        let mut times = Vec::with_capacity(self.reps);
        for _ in 0..self.reps {
            let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            start.record(&self.stream)?;
            for _ in 0..self.batch {
                f()?;
            }
            end.record(&self.stream)?;
            end.synchronize()?;
            times.push(start.elapsed_ms(&end)? as f64 * 1e3 / self.batch as f64);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }
}

/// Pseudo-random values without pulling an RNG into the library's binary: a 64-bit LCG.
fn random_values<T: Element>(len: usize, seed: u64, range: f32) -> Vec<T> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            T::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * range)
        })
        .collect()
}

/// A random permutation's first `n` slots out of `num_slots` (Fisher-Yates with the LCG).
fn random_slots(n: usize, num_slots: usize, seed: u64) -> Vec<i64> {
    let mut all: Vec<i64> = (0..num_slots as i64).collect();
    let mut s = seed | 1;
    for i in (1..all.len()).rev() {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        all.swap(i, (s >> 33) as usize % (i + 1));
    }
    all.truncate(n);
    all
}

fn copy_row(b: &Bench, bytes: usize) -> Result<Row> {
    let src: CudaSlice<u8> =
        b.stream.clone_htod(&random_values::<u32>(bytes / 4, 7, 1e6).iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())?;
    let mut dst: CudaSlice<u8> = b.stream.alloc_zeros(bytes)?;
    let us = b.time(|| Ok(b.stream.memcpy_dtod(&src, &mut dst)?))?;
    Ok(Row {
        name: "copy ceiling (cuMemcpyDtoD)".into(),
        shape: format!("{} MiB", bytes >> 20),
        median_us: us,
        bytes: 2.0 * bytes as f64,
        flops: 0.0,
    })
}

/// How the benchmark's slot mapping places tokens in the cache.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Slots {
    /// A random permutation: tokens scattered over a cache twice their size (the case).
    Random,
    /// Token i in slot i: the write is a plain copy (a reference point for the random case).
    Sequential,
}

#[allow(clippy::too_many_arguments)]
fn kv_write_row<C: Element>(
    b: &Bench,
    layout: KvLayout,
    tokens: usize,
    heads: usize,
    head_size: usize,
    block_size: usize,
    slots: Slots,
    status: &mut DeviceStatus,
) -> Result<Row> {
    let s = &b.stream;
    // Twice as many slots as tokens, so the random slots scatter over the whole cache.
    let spec = KvCacheSpec::new(layout, 2 * tokens / block_size, block_size, heads, head_size)?;
    let rows = RowsDesc::contiguous(tokens, heads, head_size);
    let key = s.clone_htod(&random_values::<bf16>(rows.required_len(), 1, 4.0))?;
    let value = s.clone_htod(&random_values::<bf16>(rows.required_len(), 2, 4.0))?;
    let slot_order = slots;
    let slots = match slot_order {
        Slots::Random => s.clone_htod(&random_slots(tokens, spec.num_slots(), 3))?,
        Slots::Sequential => s.clone_htod(&(0..tokens as i64).collect::<Vec<i64>>())?,
    };
    let mut cache: CudaSlice<C> = s.alloc_zeros(spec.num_elements())?;
    let (ks, vs) = (s.clone_htod(&[0.5f32])?, s.clone_htod(&[0.5f32])?);
    let fp8 = C::DTYPE == host::DType::Fp8E4m3;
    let us = b.time(|| {
        let w = KvWrite {
            key: DevIn::new(&key, s),
            key_rows: rows,
            value: DevIn::new(&value, s),
            value_rows: rows,
            slot_mapping: DevIn::new(&slots, s),
            cache: DevOut::new(&mut cache, s),
            spec,
            scales: fp8.then(|| KvScales { k: DevIn::new(&ks, s), v: DevIn::new(&vs, s) }),
        };
        reshape_and_cache(dev(), s, w, status)
    })?;
    status.check(s)?;
    let elems = (tokens * heads * head_size) as f64;
    Ok(Row {
        name: format!("reshape_and_cache {layout:?} bf16->{}", C::DTYPE.kernel_name()),
        shape: format!(
            "{tokens} tok x {heads} kvh x {head_size}, bs {block_size}{}",
            if slot_order == Slots::Sequential { ", seq slots" } else { "" }
        ),
        median_us: us,
        bytes: 2.0 * elems * (2.0 + std::mem::size_of::<C>() as f64) + 8.0 * tokens as f64,
        flops: 0.0,
    })
}

fn mla_write_row<C: Element>(b: &Bench, tokens: usize, block_size: usize, status: &mut DeviceStatus) -> Result<Row> {
    let s = &b.stream;
    let spec = MlaCacheSpec::deepseek(2 * tokens / block_size, block_size)?;
    let kv_c = s.clone_htod(&random_values::<bf16>(tokens * spec.latent_dim, 4, 4.0))?;
    let k_pe = s.clone_htod(&random_values::<bf16>(tokens * spec.rope_dim, 5, 4.0))?;
    let slots = s.clone_htod(&random_slots(tokens, spec.num_slots(), 6))?;
    let mut cache: CudaSlice<C> = s.alloc_zeros(spec.num_elements())?;
    let scale = s.clone_htod(&[0.5f32])?;
    let fp8 = C::DTYPE == host::DType::Fp8E4m3;
    let us = b.time(|| {
        let w = MlaWrite {
            kv_c: DevIn::new(&kv_c, s),
            kv_c_token_stride: spec.latent_dim,
            k_pe: DevIn::new(&k_pe, s),
            k_pe_token_stride: spec.rope_dim,
            num_tokens: tokens,
            slot_mapping: DevIn::new(&slots, s),
            cache: DevOut::new(&mut cache, s),
            spec,
            scale: fp8.then(|| DevIn::new(&scale, s)),
        };
        concat_and_cache_mla(dev(), s, w, status)
    })?;
    status.check(s)?;
    let elems = (tokens * spec.row_width()) as f64;
    Ok(Row {
        name: format!("concat_and_cache_mla bf16->{}", C::DTYPE.kernel_name()),
        shape: format!("{tokens} tok x 576, bs {block_size}"),
        median_us: us,
        bytes: elems * (2.0 + std::mem::size_of::<C>() as f64) + 8.0 * tokens as f64,
        flops: 0.0,
    })
}

/// Fills a large device buffer with random values cheaply: 32 MiB of random data from the
/// host, repeated on the device.
fn random_device<T: Element>(s: &Arc<CudaStream>, len: usize, seed: u64) -> Result<CudaSlice<T>> {
    let chunk = (32usize << 20) / std::mem::size_of::<T>();
    let src = s.clone_htod(&random_values::<T>(chunk.min(len), seed, 1.0))?;
    let mut dst: CudaSlice<T> = s.alloc_zeros(len)?;
    let mut at = 0;
    while at < len {
        let n = chunk.min(len - at);
        s.memcpy_dtod(&src.slice(..n), &mut dst.slice_mut(at..at + n))?;
        at += n;
    }
    Ok(dst)
}

struct DecodeShape {
    batch: usize,
    context: usize,
    q_heads: usize,
    kv_heads: usize,
    head_size: usize,
    block_size: usize,
}

/// Paged decode; `planned` as in [`mla_row`].
fn decode_row<C: Element>(b: &Bench, sh: &DecodeShape, planned: bool, status: &mut DeviceStatus) -> Result<Row> {
    use host::batch_plan::{paged_decode_planned, BatchPlan};
    use host::decode::{paged_decode, AttnOptions, DecodeArgs, DecodeWorkspace};
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
    let cache = random_device::<C>(s, spec.num_elements(), 11)?;
    // Scattered block tables: a random permutation of all blocks.
    let mut block_table: Vec<i32> = random_slots(num_blocks, num_blocks, 12).into_iter().map(|x| x as i32).collect();
    // `ATTN_BENCH_DECODE_HOT=N`: every table entry within the first N blocks, so the cache rows
    // come from L2 and the row measures the kernel's own rate (experiments).
    if let Some(hot) = std::env::var("ATTN_BENCH_DECODE_HOT").ok().and_then(|v| v.parse::<i32>().ok()) {
        block_table.iter_mut().for_each(|b| *b %= hot);
    }
    let seq_lens = vec![sh.context as i32; sh.batch];
    let qsl: Vec<i32> = (0..=sh.batch as i32).collect();
    let q_rows = RowsDesc::contiguous(sh.batch, sh.q_heads, sh.head_size);
    let q = s.clone_htod(&random_values::<bf16>(q_rows.required_len(), 13, 1.0))?;
    let mut out: CudaSlice<bf16> = s.alloc_zeros(q_rows.required_len())?;
    let bt = s.clone_htod(&block_table)?;
    let (ks, vs) = (s.clone_htod(&[0.05f32])?, s.clone_htod(&[0.05f32])?);
    // The size `DecodeWorkspace::new` suggests (an oversized one made later rows slower).
    let partial_rows = 4 * dev().sm_count() as usize * 8 * sh.q_heads / sh.kv_heads;
    let mut ws = DecodeWorkspace::new(s, partial_rows, sh.head_size, sh.batch, sh.batch)?;
    let fp8 = C::DTYPE == host::DType::Fp8E4m3;
    let opts = AttnOptions::new(sh.head_size);
    let batch = BatchMetadata::new(s, &seq_lens, &qsl)?;
    let mut bp = BatchPlan::new(s)?;
    let mut chunk = 0;
    // `ATTN_BENCH_DECODE_SPLITS=n`: n splits a request (experiments; the planner's otherwise).
    let split = std::env::var("ATTN_BENCH_DECODE_SPLITS").ok().and_then(|v| v.parse().ok()).map_or(SplitMode::Auto, SplitMode::Fixed);
    let mode = PlanOptions { split, tuning: b.tuning };
    if planned {
        let (qt, hd) = (host::DType::BF16, sh.head_size);
        chunk = bp.plan_decode(dev(), &batch, qt, C::DTYPE, hd, sh.q_heads, sh.kv_heads, mode, &ws)?.chunk;
    }
    let us = b.time(|| {
        let args = DecodeArgs {
            q: DevIn::new(&q, s),
            q_rows,
            cache: DevIn::new(&cache, s),
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
        name: format!("paged_decode{} bf16 q, {} cache", if planned { "_planned" } else { "" }, C::DTYPE.kernel_name()),
        shape: format!(
            "{}x{} {}q/{}kv d{} bs{} (chunk {chunk})",
            sh.batch, sh.context, sh.q_heads, sh.kv_heads, sh.head_size, sh.block_size
        ),
        median_us: us,
        bytes: kv_bytes,
        flops: 0.0,
    })
}

struct PrefillShape {
    batch: usize,
    /// New tokens per request.
    q_len: usize,
    /// Cached tokens before them.
    cached: usize,
    q_heads: usize,
    kv_heads: usize,
    head_size: usize,
}

/// Causal paged prefill, bf16, block size 16, scattered block tables. FLOPs = 4 * q_heads *
/// head_size * attended pairs.
fn prefill_row(b: &Bench, sh: &PrefillShape, status: &mut DeviceStatus) -> Result<Row> {
    use host::decode::AttnOptions;
    use host::prefill::{prefill, PrefillArgs, PrefillKv, PrefillOptions, PrefillWorkspace};
    let s = &b.stream;
    let block_size = 16;
    let seq = sh.cached + sh.q_len;
    let blocks_per_req = seq.div_ceil(block_size);
    let num_blocks = sh.batch * blocks_per_req;
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, num_blocks, block_size, sh.kv_heads, sh.head_size)?;
    let cache = random_device::<bf16>(s, spec.num_elements(), 21)?;
    let block_table: Vec<i32> = random_slots(num_blocks, num_blocks, 22).into_iter().map(|x| x as i32).collect();
    let seq_lens = vec![seq as i32; sh.batch];
    let qsl: Vec<i32> = (0..=sh.batch).map(|r| (r * sh.q_len) as i32).collect();
    let nt = sh.batch * sh.q_len;
    let q_rows = RowsDesc::contiguous(nt, sh.q_heads, sh.head_size);
    let q = random_device::<bf16>(s, q_rows.required_len(), 23)?;
    let mut out: CudaSlice<bf16> = s.alloc_zeros(q_rows.required_len())?;
    let bt = s.clone_htod(&block_table)?;
    let mut ws = PrefillWorkspace::new(s, nt, sh.batch, sh.q_heads / sh.kv_heads)?;
    let opts = PrefillOptions { attn: AttnOptions::new(sh.head_size), causal: true };
    let batch = BatchMetadata::new(s, &seq_lens, &qsl)?;
    let us = b.time(|| {
        prefill(
            dev(),
            s,
            PrefillArgs {
                q: DevIn::new(&q, s),
                q_rows,
                kv: PrefillKv::Paged {
                    cache: DevIn::new(&cache, s),
                    spec,
                    block_table: DevIn::new(&bt, s),
                    block_table_stride: blocks_per_req,
                },
                out: DevOut::new(&mut out, s),
                out_rows: q_rows,
                lse: None,
                alibi_slopes: None,
                sinks: None,
                scales: None,
            },
            &batch,
            &opts,
            &mut ws,
            status,
        )?;
        Ok(())
    })?;
    status.check(s)?;
    // Query i (0-based among the new tokens) attends cached + i + 1 keys.
    let pairs = sh.batch as f64 * (sh.q_len as f64 * sh.cached as f64 + (sh.q_len * (sh.q_len + 1) / 2) as f64);
    Ok(Row {
        name: "prefill bf16 causal, paged bs16".into(),
        shape: format!("{}x{} (+{} cached) {}q/{}kv d{}", sh.batch, sh.q_len, sh.cached, sh.q_heads, sh.kv_heads, sh.head_size),
        median_us: us,
        bytes: 0.0,
        flops: 4.0 * (sh.q_heads * sh.head_size) as f64 * pairs,
    })
}

fn prefill_rows(b: &Bench, rows: &mut Vec<Row>, status: &mut DeviceStatus) -> Result<()> {
    let sh = |batch, q_len, q_heads, kv_heads, head_size| PrefillShape { batch, q_len, cached: 0, q_heads, kv_heads, head_size };
    // `ATTN_BENCH_PREFILL_SHAPES=8x2048x32x32x64,8x512x32x8x128x8192`: rows of those batch x new
    // tokens x q heads x kv heads x head size [x cached tokens] only (experiments).
    if let Some(shapes) = env_shapes("ATTN_BENCH_PREFILL_SHAPES") {
        for v in shapes.iter().filter(|v| v.len() == 5 || v.len() == 6) {
            let shape = PrefillShape { cached: v.get(5).copied().unwrap_or(0), ..sh(v[0], v[1], v[2], v[3], v[4]) };
            rows.push(prefill_row(b, &shape, status)?);
        }
        return Ok(());
    }
    for shape in [
        sh(4, 4096, 32, 8, 128),
        sh(1, 16384, 32, 8, 128),
        sh(8, 2048, 32, 32, 64),
        sh(2, 8192, 64, 8, 128),
        PrefillShape { cached: 8192, ..sh(8, 512, 32, 8, 128) },
    ] {
        rows.push(prefill_row(b, &shape, status)?);
    }
    Ok(())
}

fn cache_write_rows(b: &Bench, rows: &mut Vec<Row>, status: &mut DeviceStatus) -> Result<()> {
    // The same copy at the size of the main cache-write case (64 MiB read + 64 MiB written).
    rows.push(copy_row(b, 64 << 20)?);
    let tokens = 16384;
    for layout in [KvLayout::FlashNhd, KvLayout::FlashHnd, KvLayout::FlashInferNhd] {
        rows.push(kv_write_row::<bf16>(b, layout, tokens, 8, 128, 16, Slots::Random, status)?);
    }
    // Without programmatic dependent launch (on sm_90a the cache writes use it by default).
    std::env::set_var("ATTN_DISABLE_PDL", "1");
    let mut r = kv_write_row::<bf16>(b, KvLayout::FlashNhd, tokens, 8, 128, 16, Slots::Random, status)?;
    std::env::remove_var("ATTN_DISABLE_PDL");
    r.name += " (no PDL)";
    rows.push(r);
    rows.push(kv_write_row::<bf16>(b, KvLayout::FlashNhd, tokens, 8, 128, 16, Slots::Sequential, status)?);
    rows.push(kv_write_row::<bf16>(b, KvLayout::FlashNhd, 4 * tokens, 8, 128, 16, Slots::Random, status)?);
    rows.push(kv_write_row::<Fp8E4m3>(b, KvLayout::FlashNhd, tokens, 8, 128, 16, Slots::Random, status)?);
    rows.push(kv_write_row::<bf16>(b, KvLayout::FlashNhd, 256, 8, 128, 16, Slots::Random, status)?);
    rows.push(mla_write_row::<bf16>(b, tokens, 64, status)?);
    rows.push(mla_write_row::<bf16>(b, 4 * tokens, 64, status)?);
    rows.push(mla_write_row::<Fp8E4m3>(b, tokens, 64, status)?);

    Ok(())
}

fn dev() -> &'static AttnDevice {
    static DEV: std::sync::OnceLock<AttnDevice> = std::sync::OnceLock::new();
    DEV.get_or_init(|| AttnDevice::new(0).expect("open GPU 0"))
}

/// The split planners' knobs from the command line (see the module doc).
fn tuning_flags(args: &[String]) -> Result<Tuning> {
    let waves = |flag: &'static str| -> Result<Option<u64>> {
        let Some(i) = args.iter().position(|a| a == flag) else { return Ok(None) };
        let v = args.get(i + 1).and_then(|v| v.parse::<u64>().ok());
        v.map(Some).ok_or_else(|| AttnError::InvalidArgument { arg: flag, reason: "takes a number of waves".into() })
    };
    let on = |flag: &str| !args.iter().any(|a| a == flag);
    let d = Tuning::DEFAULT;
    Ok(Tuning {
        decode_waves: waves("--decode-waves")?.or(d.decode_waves),
        decode_even_waves: on("--no-decode-even-waves"),
        mla_waves: waves("--mla-waves")?.unwrap_or(d.mla_waves),
        mla_clusters: on("--no-mla-clusters"),
    })
}

fn json_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let json_path = args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1)).cloned();
    let quick = args.iter().any(|a| a == "--quick");
    let tuning = tuning_flags(&args)?;
    if !AttnDevice::driver_available() {
        eprintln!("attn-bench: no CUDA driver or GPU; nothing to measure");
        std::process::exit(2);
    }
    let d = dev();
    let name = d.context().name()?;
    println!(
        "device: {name}, sm_{}{}, {} SMs, module {} ({})",
        d.compute_capability().0,
        d.compute_capability().1,
        d.sm_count(),
        d.ptx_target(),
        if d.loads_sass() { "SASS" } else { "PTX JIT" }
    );
    let stream = d.context().new_stream()?;
    // The bench owns every buffer and uses one stream: cudarc's cross-stream event tracking
    // would only add host work between launches.
    unsafe { d.context().disable_event_tracking() };
    let b = Bench { stream: stream.clone(), warmup: if quick { 5 } else { 20 }, reps: if quick { 10 } else { 50 }, batch: 10, tuning };
    let mut status = DeviceStatus::new(&stream)?;

    let ceiling = copy_row(&b, 1 << 30)?;
    let mut rows = vec![];
    // `--only cache|decode|prefill|mla`: one group of rows.
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1)).cloned();
    let want = |group: &str| only.as_deref().is_none_or(|o| o == group);
    if want("cache") {
        cache_write_rows(&b, &mut rows, &mut status)?;
    }
    if want("prefill") {
        prefill_rows(&b, &mut rows, &mut status)?;
    }
    if want("decode") {
        decode_rows(&b, &mut rows, &mut status)?;
    }
    if want("mla") {
        mla_rows(&b, &mut rows, &mut status)?;
    }
    print_and_save(&ceiling, &rows, &name, json_path)
}

/// MLA decode over the latent cache: bf16, context 4096, block size 64, scattered block tables.
/// Bytes = the latent cache read once; FLOPs = 2 * heads * context * (576 + 512) per token.
/// MLA decode; `planned`: the split plan made once ([`host::batch_plan`], as every layer of a
/// step runs it), else planned and uploaded by each call.
fn mla_row<C: Element>(
    b: &Bench,
    cache: &CudaSlice<C>,
    (heads, batch, context): (usize, usize, usize),
    planned: bool,
    status: &mut DeviceStatus,
) -> Result<Row> {
    use host::batch_plan::{mla_attention_planned, BatchPlan};
    use host::decode::{AttnOptions, DecodeWorkspace};
    use host::layout::MlaCacheSpec;
    use host::mla::{mla_attention, MlaArgs};
    let s = &b.stream;
    let block_size = 64;
    let blocks_per_req = context.div_ceil(block_size);
    let num_blocks = batch * blocks_per_req;
    let spec = MlaCacheSpec::deepseek(num_blocks, block_size)?;
    let cache = cache.slice(..spec.num_elements());
    let fp8 = C::DTYPE == host::DType::Fp8E4m3;
    let scale = s.clone_htod(&[0.05f32])?;
    let block_table: Vec<i32> = random_slots(num_blocks, num_blocks, 32).into_iter().map(|x| x as i32).collect();
    let seq_lens = vec![context as i32; batch];
    let qsl: Vec<i32> = (0..=batch as i32).collect();
    let (q_rows, out_rows) = (RowsDesc::contiguous(batch, heads, 576), RowsDesc::contiguous(batch, heads, 512));
    let q = s.clone_htod(&random_values::<bf16>(q_rows.required_len(), 33, 1.0))?;
    let mut out: CudaSlice<bf16> = s.alloc_zeros(out_rows.required_len())?;
    let bt = s.clone_htod(&block_table)?;
    // The size `DecodeWorkspace::new` suggests (a 2-16 GB one made rows measured after it slower).
    let mut ws = DecodeWorkspace::new(s, 4 * dev().sm_count() as usize * 8 * heads, 512, batch, batch)?;
    let batch_meta = BatchMetadata::new(s, &seq_lens, &qsl)?;
    let mut bp = BatchPlan::new(s)?;
    let mode = PlanOptions { split: SplitMode::Auto, tuning: b.tuning };
    let planned_once = bp.plan_mla(dev(), &batch_meta, host::DType::BF16, C::DTYPE, heads, mode, &ws)?;
    let (mut chunk, mut cluster) = (planned_once.chunk, planned_once.cluster);
    let us = b.time(|| {
        let args = MlaArgs {
            q: DevIn::new(&q, s),
            q_rows,
            cache: DevIn::new(&cache, s),
            spec,
            block_table: DevIn::new(&bt, s),
            block_table_stride: blocks_per_req,
            out: DevOut::new(&mut out, s),
            out_rows,
            lse: None,
            // MLA's one scale, passed as both.
            scales: fp8.then(|| KvScales { k: DevIn::new(&scale, s), v: DevIn::new(&scale, s) }),
        };
        let scale = AttnOptions::new(576).softmax_scale;
        if planned {
            mla_attention_planned(dev(), s, args, &batch_meta, scale, &bp, &mut ws, status)
        } else {
            let plan = mla_attention(dev(), s, args, &batch_meta, scale, mode, &mut ws, status)?;
            (chunk, cluster) = (plan.chunk, plan.cluster);
            Ok(())
        }
    })?;
    status.check(s)?;
    let bytes = (batch * context * 576 * C::DTYPE.size_bytes()) as f64;
    let flops = 2.0 * (heads * context * (576 + 512) * batch) as f64;
    let mut row = Row {
        name: format!("mla_attention{} bf16 q, {} latent", if planned { "_planned" } else { "" }, C::DTYPE.kernel_name()),
        shape: format!(
            "{heads} heads x batch {batch} x {context}, bs64 (chunk {chunk}{})",
            if cluster > 1 { format!(", cluster {cluster}") } else { String::new() }
        ),
        median_us: us,
        bytes,
        flops: 0.0,
    };
    // 16 heads is memory-bound (GB/s), 128 heads compute-bound (TFLOP/s).
    if heads > 16 {
        row.flops = flops;
    }
    Ok(row)
}

/// An experiment's shapes from environment variable `var`: `AxBxC,DxExF` as lists of numbers.
fn env_shapes(var: &str) -> Option<Vec<Vec<usize>>> {
    let list = std::env::var(var).ok()?;
    Some(list.split(',').map(|item| item.split('x').filter_map(|x| x.trim().parse().ok()).collect()).collect())
}

fn mla_rows(b: &Bench, rows: &mut Vec<Row>, status: &mut DeviceStatus) -> Result<()> {
    // One cache for every row, as an engine allocates it once: rows measured on caches
    // allocated one after another differed by up to 12% with where the allocation landed.
    let (max_batch, context) = (128, 4096);
    let rows_of = |bytes: usize| max_batch * context * 576 * bytes;
    let cache = random_device::<bf16>(&b.stream, rows_of(1), 31)?;
    // `ATTN_BENCH_MLA_SHAPES=16x64x4096,16x128x2048`: planned bf16 rows of those heads x batch x
    // context only (within the one cache's 128 x 4096 rows), for experiments.
    if let Some(shapes) = env_shapes("ATTN_BENCH_MLA_SHAPES") {
        for v in shapes.iter().filter(|v| v.len() == 3 && v[1] * v[2] <= max_batch * context) {
            rows.push(mla_row::<bf16>(b, &cache, (v[0], v[1], v[2]), true, status)?);
        }
        return Ok(());
    }
    for planned in [false, true] {
        for (heads, batch) in [(16, 64), (16, 128), (128, 64), (128, 128)] {
            rows.push(mla_row::<bf16>(b, &cache, (heads, batch, context), planned, status)?);
        }
    }
    drop(cache);
    let cache = random_device::<Fp8E4m3>(&b.stream, rows_of(1), 31)?;
    // The FP8 cache: half the bytes at 16 heads; the conversion's cost at 128.
    for (heads, batch) in [(16, 64), (16, 128), (128, 64)] {
        rows.push(mla_row::<Fp8E4m3>(b, &cache, (heads, batch, context), false, status)?);
    }
    Ok(())
}

fn decode_rows(b: &Bench, rows: &mut Vec<Row>, status: &mut DeviceStatus) -> Result<()> {
    let shape = |batch, context| DecodeShape { batch, context, q_heads: 32, kv_heads: 8, head_size: 128, block_size: 16 };
    // `ATTN_BENCH_DECODE_SHAPES=64x4096,8x32768`: planned bf16 rows of those batch x context
    // only (experiments).
    if let Some(shapes) = env_shapes("ATTN_BENCH_DECODE_SHAPES") {
        for v in shapes.iter().filter(|v| v.len() == 2) {
            rows.push(decode_row::<bf16>(b, &shape(v[0], v[1]), true, status)?);
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
    ] {
        rows.push(decode_row::<bf16>(b, &sh, false, status)?);
    }
    Ok(())
}

fn print_and_save(ceiling: &Row, rows: &[Row], name: &str, json_path: Option<String>) -> Result<()> {
    let ceil = ceiling.gbps();
    // Memory-bound rows: GB/s and % of the copy ceiling; compute-bound rows: TFLOP/s and % of
    // the dense bf16 matmul rate.
    let rate = |r: &Row| if r.flops > 0.0 { r.flops / (r.median_us * 1e-6) / 1e12 } else { r.gbps() };
    let pct = |r: &Row| if r.flops > 0.0 { 100.0 * rate(r) / MATMUL_TFLOPS } else { 100.0 * r.gbps() / ceil };
    println!("\n{:<44} {:<44} {:>10} {:>9} {:>8}", "kernel", "shape", "median us", "GB/s|TF/s", "% ceil");
    println!("{:<44} {:<44} {:>10.2} {:>9.0} {:>8}", ceiling.name, ceiling.shape, ceiling.median_us, ceil, "100.0");
    for r in rows {
        let unit = if r.flops > 0.0 { " TF" } else { "" };
        println!("{:<44} {:<44} {:>10.2} {:>9.1}{unit} {:>8.1}", r.name, r.shape, r.median_us, rate(r), pct(r));
    }
    if let Some(path) = json_path {
        let items: Vec<String> = std::iter::once(ceiling)
            .chain(rows)
            .map(|r| {
                let metric = if r.flops > 0.0 {
                    format!("\"tflops\":{:.1},\"pct_of_matmul\":{:.2}", rate(r), pct(r))
                } else {
                    format!("\"gbps\":{:.1},\"pct_of_copy\":{:.2}", r.gbps(), pct(r))
                };
                format!(
                    "{{\"kernel\":{},\"shape\":{},\"median_us\":{:.3},{metric}}}",
                    json_string(&r.name),
                    json_string(&r.shape),
                    r.median_us
                )
            })
            .collect();
        let text = format!(
            "{{\"device\":{},\"copy_gbps\":{:.1},\"matmul_tflops\":{MATMUL_TFLOPS},\"rows\":[\n{}\n]}}\n",
            json_string(name),
            ceil,
            items.join(",\n")
        );
        std::fs::write(&path, text).map_err(|e| host::AttnError::InvalidArgument { arg: "--json", reason: e.to_string() })?;
        println!("\nJSON written to {path}");
    }
    Ok(())
}
