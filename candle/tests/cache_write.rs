//! `reshape_and_cache` and `concat_and_cache_mla` on CPU tensors, against the test's own reads
//! of the cache tensor: every layout and dtype, strided sources (slices of a fused
//! projection), scattered slots with padding, FP8 caches with scales.

mod common;

use attn_candle::{concat_and_cache_mla, reshape_and_cache, KvCache, KvCacheSpec, KvLayout, MlaCache, MlaCacheSpec};
use candle_core::{DType, Device, IndexOp, Result, Tensor};
use common::{fp8_roundtrip, max_diff, randn, rng};
use rand::seq::SliceRandom;
use rand::Rng;

/// The K (`plane` 0) or V row the cache holds at `slot`, `[heads, head_size]`.
fn cached_row(cache: &KvCache, plane: usize, slot: usize) -> Result<Tensor> {
    let s = cache.spec();
    let (block, off) = (slot / s.block_size, slot % s.block_size);
    let p = if plane == 0 { cache.key_cache()? } else { cache.value_cache()? };
    if s.layout.heads_before_tokens() {
        p.i((block, .., off, ..))
    } else {
        p.i((block, off))
    }
}

fn write_case(layout: KvLayout, src: DType, fp8: bool, seed_name: &str) -> Result<()> {
    let mut rng = rng(seed_name);
    let dev = Device::Cpu;
    let (num_blocks, block_size, hkv, d) = (7, 5, 3, 8);
    let spec = KvCacheSpec::new(layout, num_blocks, block_size, hkv, d).unwrap();
    let (k_scale, v_scale) = (0.5f32, 2.0f32);
    let cache = if fp8 {
        KvCache::zeros(spec, DType::F8E4M3, &dev)?
            .with_scales(Tensor::new(&[k_scale], &dev)?, Tensor::new(k_scale * 0.0 + v_scale, &dev)?)?
    } else {
        KvCache::zeros(spec, src, &dev)?
    };
    // 11 tokens to random distinct slots, two of them padding.
    let t = 11;
    let mut slots: Vec<i64> = (0..(num_blocks * block_size) as i64).collect();
    slots.shuffle(&mut rng);
    slots.truncate(t);
    for _ in 0..2 {
        let i = rng.random_range(0..t);
        slots[i] = -1;
    }
    // A fused projection [t, 2 + 2 * hkv + 1, d]: keys and values are strided views of it.
    let qkv = randn(&mut rng, &[t, 2 + 2 * hkv + 1, d], src, &dev)?;
    let (k, v) = (qkv.narrow(1, 2, hkv)?, qkv.narrow(1, 2 + hkv, hkv)?);
    assert!(!k.is_contiguous());
    // The value as 2-D rows, also strided.
    let v2 = qkv.reshape((t, (2 + 2 * hkv + 1) * d))?.narrow(1, (2 + hkv) * d, hkv * d)?;
    reshape_and_cache(&k, &v2, &cache, &Tensor::new(slots.as_slice(), &dev)?)?;

    let written: std::collections::HashMap<usize, usize> =
        slots.iter().enumerate().filter(|(_, &s)| s >= 0).map(|(i, &s)| (s as usize, i)).collect();
    for slot in 0..num_blocks * block_size {
        for (plane, src_rows, scale) in [(0, &k, k_scale), (1, &v, v_scale)] {
            // (candle 0.11's F8E4M3 -> F64 conversion overflows the stack: through f32.)
            let got = cached_row(&cache, plane, slot)?.to_dtype(DType::F32)?.to_dtype(DType::F64)?;
            let want = match written.get(&slot) {
                Some(&tok) => {
                    let row = src_rows.i(tok)?;
                    if fp8 {
                        fp8_roundtrip(&row.to_dtype(DType::F32)?, scale)?.affine(1.0 / scale as f64, 0.0)?
                    } else {
                        row
                    }
                }
                None => Tensor::zeros((hkv, d), DType::F64, &dev)?,
            };
            let diff = max_diff(&got, &want)?;
            assert!(diff == 0.0, "{layout:?} {src:?} fp8={fp8}: slot {slot} plane {plane} differs by {diff}");
        }
    }
    Ok(())
}

#[test]
fn every_layout_and_dtype() -> Result<()> {
    for layout in KvLayout::ALL {
        for src in [DType::F32, DType::BF16, DType::F16] {
            write_case(layout, src, false, "cache_write")?;
        }
    }
    Ok(())
}

#[test]
fn fp8_caches_store_scaled_values() -> Result<()> {
    for layout in [KvLayout::FlashNhd, KvLayout::FlashInferHnd] {
        for src in [DType::F32, DType::BF16] {
            write_case(layout, src, true, "cache_write_fp8")?;
        }
    }
    Ok(())
}

#[test]
fn a_slot_past_the_cache_is_refused() -> Result<()> {
    let dev = Device::Cpu;
    let cache = KvCache::zeros(KvCacheSpec::new(KvLayout::FlashNhd, 2, 4, 1, 8).unwrap(), DType::F32, &dev)?;
    let k = Tensor::ones((2, 1, 8), DType::F32, &dev)?;
    let e = reshape_and_cache(&k, &k.clone(), &cache, &Tensor::new(&[1i64, 8], &dev)?).unwrap_err().to_string();
    assert!(e.contains("slot 8 of token 1"), "{e}");
    Ok(())
}

#[test]
fn inexpressible_layouts_and_mismatches_name_the_argument() -> Result<()> {
    let dev = Device::Cpu;
    let cache = KvCache::zeros(KvCacheSpec::new(KvLayout::FlashNhd, 2, 4, 2, 8).unwrap(), DType::F32, &dev)?;
    let slots = Tensor::new(&[0i64, 1, 2], &dev)?;
    let k = Tensor::ones((3, 2, 8), DType::F32, &dev)?;
    // Heads before tokens (a transposed [heads, tokens, d]).
    let hnd = Tensor::ones((2, 3, 8), DType::F32, &dev)?.transpose(0, 1)?;
    let e = reshape_and_cache(&k, &hnd, &cache, &slots).unwrap_err().to_string();
    assert!(e.contains("`value`") && e.contains(".contiguous()"), "{e}");
    // A strided head dimension.
    let strided = Tensor::ones((3, 8, 2), DType::F32, &dev)?.transpose(1, 2)?;
    let e = reshape_and_cache(&strided, &k, &cache, &slots).unwrap_err().to_string();
    assert!(e.contains("`key`") && e.contains("strides [16, 1, 2]"), "{e}");
    // Wrong dtype pair, FP8 without scales.
    let e = reshape_and_cache(&k.to_dtype(DType::BF16)?, &k.to_dtype(DType::BF16)?, &cache, &slots).unwrap_err().to_string();
    assert!(e.contains("`cache`"), "{e}");
    let fp8 = KvCache::zeros(cache.spec(), DType::F8E4M3, &dev)?;
    let e = reshape_and_cache(&k, &k, &fp8, &slots).unwrap_err().to_string();
    assert!(e.contains("scales"), "{e}");
    // A cache tensor that is not contiguous.
    let t = Tensor::zeros((2, 4, 2, 2, 8), DType::F32, &dev)?.transpose(1, 2)?;
    let e = KvCache::from_tensor(t, KvLayout::FlashNhd).unwrap_err().to_string();
    assert!(e.contains("contiguous"), "{e}");
    Ok(())
}

#[test]
fn a_layer_view_of_a_stacked_cache() -> Result<()> {
    // Every layer's cache in one tensor: layer 1's writes land in its part only.
    let dev = Device::Cpu;
    let all = Tensor::zeros((3, 2, 4, 4, 1, 8), DType::F32, &dev)?;
    let layer1 = KvCache::from_tensor(all.get(1)?, KvLayout::FlashNhd)?;
    let k = Tensor::ones((1, 1, 8), DType::F32, &dev)?;
    reshape_and_cache(&k, &(&k * 2.0)?, &layer1, &Tensor::new(&[5i64], &dev)?)?;
    let sums: Vec<f32> = (0..3).map(|l| all.get(l).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()).collect();
    assert_eq!(sums, [0.0, 24.0, 0.0]);
    assert_eq!(all.i((1, 1, 1, 1, 0))?.to_vec1::<f32>()?, vec![2f32; 8]);
    Ok(())
}

#[test]
fn mla_latents_land_in_their_rows() -> Result<()> {
    let mut rng = rng("mla_write");
    let dev = Device::Cpu;
    for (src, fp8) in [(DType::F32, false), (DType::BF16, false), (DType::BF16, true)] {
        let spec = MlaCacheSpec::new(5, 3, 16, 8).unwrap();
        let scale = 0.25f32;
        let cache = if fp8 {
            MlaCache::zeros(spec, DType::F8E4M3, &dev)?.with_scale(Tensor::new(&[scale], &dev)?)?
        } else {
            MlaCache::zeros(spec, src, &dev)?
        };
        let t = 7;
        let mut slots: Vec<i64> = (0..15).collect();
        slots.shuffle(&mut rng);
        slots.truncate(t);
        slots[3] = -1;
        // One projection [t, 16 + 8 + 5]: kv_c, then k_pe, then other columns.
        let proj = randn(&mut rng, &[t, 29], src, &dev)?;
        let (kv_c, k_pe) = (proj.narrow(1, 0, 16)?, proj.narrow(1, 16, 8)?.unsqueeze(1)?);
        concat_and_cache_mla(&kv_c, &k_pe, &cache, &Tensor::new(slots.as_slice(), &dev)?)?;
        for slot in 0..15usize {
            let got = cache.tensor().i((slot / 3, slot % 3))?.to_dtype(DType::F32)?.to_dtype(DType::F64)?;
            let want = match slots.iter().position(|&s| s == slot as i64) {
                Some(tok) => {
                    let row = proj.i((tok, 0..24))?;
                    if fp8 {
                        fp8_roundtrip(&row.to_dtype(DType::F32)?, scale)?.affine(1.0 / scale as f64, 0.0)?
                    } else {
                        row
                    }
                }
                None => Tensor::zeros(24, DType::F64, &dev)?,
            };
            assert_eq!(max_diff(&got, &want)?, 0.0, "{src:?} fp8={fp8}: slot {slot}");
        }
    }
    Ok(())
}
