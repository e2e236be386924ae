//! Writes a step's keys and values into a paged cache with `reshape_and_cache`: the keys and
//! values are slices of a fused QKV projection (no copy), the slots scattered over the cache,
//! one token padding. Then an FP8 cache with its scales.
//!
//!     cargo run -p attn-candle --example cache_write
//!
//! With `--no-default-features --features cuda` it runs on GPU 0 when there is one.

use attn_candle::{reshape_and_cache, KvCache, KvCacheSpec, KvLayout};
use candle_core::{DType, Device, IndexOp, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::cuda_if_available(0)?;
    println!("device: {:?}", dev.location());
    let (q_heads, kv_heads, head_size, tokens) = (8, 2, 64, 5);
    // 16 blocks of 16 tokens, FlashAttention's layout: [2, blocks, block_size, kv_heads, head_size].
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, 16, 16, kv_heads, head_size)?;
    let cache = KvCache::zeros(spec, DType::F16, &dev)?;

    let qkv = Tensor::randn(0f32, 1., (tokens, q_heads + 2 * kv_heads, head_size), &dev)?.to_dtype(DType::F16)?;
    let k = qkv.narrow(1, q_heads, kv_heads)?;
    let v = qkv.narrow(1, q_heads + kv_heads, kv_heads)?;
    // Block 3 offsets 0..2, block 9 offset 7, one padding token.
    let slots = Tensor::new(&[48i64, 49, 50, 151, -1], &dev)?;
    reshape_and_cache(&k, &v, &cache, &slots)?;
    attn_candle::check_device_status(&dev)?;
    let stored = cache.key_cache()?.i((9, 7))?;
    let diff = (stored.to_dtype(DType::F32)? - k.i(3)?.to_dtype(DType::F32)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("token 3's keys at block 9, offset 7: max difference {diff}");
    assert_eq!(diff, 0.0);

    // The same into an FP8 cache: stored = value / scale.
    let fp8 = KvCache::zeros(spec, DType::F8E4M3, &dev)?.with_scales(Tensor::new(&[0.5f32], &dev)?, Tensor::new(&[0.5f32], &dev)?)?;
    reshape_and_cache(&k, &v, &fp8, &slots)?;
    let back = (fp8.value_cache()?.i((3, 1))?.to_dtype(DType::F32)? * 0.5)?;
    let want = v.i(1)?.to_dtype(DType::F32)?;
    let err = (back - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("FP8 cache, token 1's values: max error {err} (E4M3 keeps 3 mantissa bits)");
    Ok(())
}
