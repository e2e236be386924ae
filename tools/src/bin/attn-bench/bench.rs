//! What every group of rows shares: the timing loop, a row, the device, random inputs and the
//! copy ceiling.

use attn_rs::{AttnDevice, DType, Element, Result, Tuning};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// One measured kernel (a line of the table, a row of the JSON).
pub struct Row {
    pub name: String,
    pub shape: String,
    pub median_us: f64,
    /// Bytes the kernel must read plus write.
    pub bytes: f64,
    /// Compute-bound rows: the FLOPs of the attended key-query pairs (0 = memory-bound row).
    pub flops: f64,
}

/// Dense bf16 matmul rate of the H100 SXM measured with cuBLAS (the prefill issue's ceiling).
pub const MATMUL_TFLOPS: f64 = 778.0;

impl Row {
    pub fn gbps(&self) -> f64 {
        self.bytes / (self.median_us * 1e-6) / 1e9
    }
}

pub struct Bench {
    pub stream: Arc<CudaStream>,
    pub warmup: usize,
    pub reps: usize,
    /// Launches between one pair of events: back-to-back launches keep the GPU fed, so the
    /// host's launch cost does not land inside the timed region.
    pub batch: usize,
    /// The split planners' knobs (`--decode-waves` and the others).
    pub tuning: Tuning,
}

impl Bench {
    /// Median over `reps` event-timed batches of `f` (per call), after `warmup` untimed calls,
    /// in microseconds.
    pub fn time(&self, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
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
pub fn random_values<T: Element>(len: usize, seed: u64, range: f32) -> Vec<T> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            T::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * range)
        })
        .collect()
}

/// A random permutation's first `n` slots out of `num_slots` (Fisher-Yates with the LCG).
pub fn random_slots(n: usize, num_slots: usize, seed: u64) -> Vec<i64> {
    let mut all: Vec<i64> = (0..num_slots as i64).collect();
    let mut s = seed | 1;
    for i in (1..all.len()).rev() {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        all.swap(i, (s >> 33) as usize % (i + 1));
    }
    all.truncate(n);
    all
}

/// `cuMemcpyDtoD` of `bytes`: the ceiling the memory-bound rows are measured against.
pub fn copy_row(b: &Bench, bytes: usize) -> Result<Row> {
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

/// Fills a large device buffer with random values cheaply: 32 MiB of random data from the
/// host, repeated on the device.
pub fn random_device<T: Element>(s: &Arc<CudaStream>, len: usize, seed: u64) -> Result<CudaSlice<T>> {
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

/// An experiment's shapes from environment variable `var`: `AxBxC,DxExF` as lists of numbers.
pub fn env_shapes(var: &str) -> Option<Vec<Vec<usize>>> {
    let list = std::env::var(var).ok()?;
    Some(list.split(',').map(|item| item.split('x').filter_map(|x| x.trim().parse().ok()).collect()).collect())
}

/// GPU 0, opened once.
pub fn dev() -> &'static AttnDevice {
    static DEV: std::sync::OnceLock<AttnDevice> = std::sync::OnceLock::new();
    DEV.get_or_init(|| AttnDevice::new(0).expect("open GPU 0"))
}

/// The short name of a dtype in row names (`bf16`, `fp8`), as the kernels' entry names spell it.
pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        DType::Fp8E4m3 => "fp8",
        DType::Fp8E5m2 => "e5m2",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::U32 => "u32",
    }
}
