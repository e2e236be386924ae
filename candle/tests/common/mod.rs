//! Shared by the tests: seeded random tensors, a block allocator, and the reference attention,
//! written with plain candle ops in f64 (softmax(Q K^T) V per request and head over the keys
//! the test itself recorded), independent of attn-rs.

#![allow(dead_code)]

use candle_core::{DType, Device, IndexOp, Result, Tensor, D};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// A seeded generator: `ATTN_TEST_SEED` replays a run; the seed is printed.
pub fn rng(test: &str) -> SmallRng {
    let seed = std::env::var("ATTN_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64));
    println!("{test}: ATTN_TEST_SEED={seed}");
    SmallRng::seed_from_u64(seed)
}

/// A `[dims]` tensor of standard-normal-ish values (sum of uniforms) in `dtype`.
pub fn randn(rng: &mut SmallRng, dims: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n).map(|_| (0..4).map(|_| rng.random::<f32>() - 0.5).sum::<f32>() * 1.7).collect();
    Tensor::from_vec(v, dims, device)?.to_dtype(dtype)
}

/// Hands out the cache's blocks in a random order.
pub struct Blocks {
    free: Vec<i32>,
}

impl Blocks {
    pub fn new(rng: &mut SmallRng, num_blocks: usize) -> Self {
        let mut free: Vec<i32> = (0..num_blocks as i32).collect();
        free.shuffle(rng);
        Blocks { free }
    }

    pub fn take(&mut self) -> i32 {
        self.free.pop().expect("the test sized the cache")
    }
}

/// A request's blocks, grown as its length does.
#[derive(Default, Clone)]
pub struct Seq {
    pub blocks: Vec<i32>,
    pub len: usize,
}

impl Seq {
    /// Slots of `n` more tokens, taking blocks as needed.
    pub fn grow(&mut self, n: usize, block_size: usize, blocks: &mut Blocks) -> Vec<i64> {
        (0..n)
            .map(|_| {
                let pos = self.len;
                if pos / block_size == self.blocks.len() {
                    self.blocks.push(blocks.take());
                }
                self.len += 1;
                (self.blocks[pos / block_size] as i64) * block_size as i64 + (pos % block_size) as i64
            })
            .collect()
    }
}

/// `[rows, width]` of the table rows of `seqs`, padded with -1.
pub fn block_table(seqs: &[&Seq]) -> (Vec<i32>, usize) {
    let width = seqs.iter().map(|s| s.blocks.len()).max().unwrap_or(0).max(1);
    let mut t = Vec::new();
    for s in seqs {
        t.extend_from_slice(&s.blocks);
        t.resize(t.len() + width - s.blocks.len(), -1);
    }
    (t, width)
}

/// Attention of `q` (`[Q, Hq, Dk]`) over `k` (`[L, Hkv, Dk]`) and `v` (`[L, Hkv, Dv]`), the
/// queries being the last `Q` positions of the `L` (causal), in f64: `[Q, Hq, Dv]`.
pub fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (q, k, v) = (q.to_dtype(DType::F64)?, k.to_dtype(DType::F64)?, v.to_dtype(DType::F64)?);
    let (nq, hq, _) = q.dims3()?;
    let (l, hkv, _) = k.dims3()?;
    let group = hq / hkv;
    let mask: Vec<f64> = (0..nq).flat_map(|i| (0..l).map(move |j| if j + nq > l + i { f64::NEG_INFINITY } else { 0.0 })).collect();
    let mask = Tensor::from_vec(mask, (nq, l), q.device())?;
    let mut heads = Vec::with_capacity(hq);
    for h in 0..hq {
        let qh = q.i((.., h, ..))?.contiguous()?;
        let kh = k.i((.., h / group, ..))?.contiguous()?;
        let vh = v.i((.., h / group, ..))?.contiguous()?;
        let s = (qh.matmul(&kh.t()?)? * scale)?.broadcast_add(&mask)?;
        let e = s.broadcast_sub(&s.max_keepdim(D::Minus1)?)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        heads.push(p.matmul(&vh)?);
    }
    Tensor::stack(&heads, 1)
}

/// The largest absolute difference of two tensors (as f64).
pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let d = (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?.abs()?.flatten_all()?.max(0)?;
    d.to_scalar::<f64>()
}

/// What an FP8 E4M3 cache holds for `x` with `scale`, dequantized (through the `float8` crate).
pub fn fp8_roundtrip(x: &Tensor, scale: f32) -> Result<Tensor> {
    let v: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let r: Vec<f32> = v.iter().map(|&x| float8::F8E4M3::from_f32(x / scale).to_f32() * scale).collect();
    Tensor::from_vec(r, x.dims(), x.device())?.to_dtype(x.dtype())
}

/// Tolerance of an output in `dtype` (values about 1).
pub fn tolerance(dtype: DType, fp8: bool) -> f64 {
    match (dtype, fp8) {
        (_, true) => 0.03,
        (DType::F32, _) => 1e-4,
        (DType::F16, _) => 4e-3,
        _ => 3e-2,
    }
}
