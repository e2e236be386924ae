//! MLA through `PagedAttention::forward_mla` and the standalone `paged_attention` decode, on CPU
//! tensors, against the reference attention over the rows the test recorded.

mod common;

use attn_candle::attn_rs::backend::ModelConfig;
use attn_candle::{
    paged_attention, reshape_and_cache, ForwardConfig, ForwardLimits, KvCache, KvCacheSpec, KvLayout, PagedAttention, StepBatch,
};
use candle_core::{DType, Device, IndexOp, Result, Tensor};
use common::{block_table, fp8_roundtrip, max_diff, randn, reference, rng, tolerance, Blocks, Seq};

const LATENT: usize = 32;
const ROPE: usize = 64;
const HEADS: usize = 4;
const BLOCK: usize = 4;

fn mla_case(dtype: DType, fp8: bool) -> Result<()> {
    let mut rng = rng("mla_forward");
    let dev = Device::Cpu;
    let to_attn = |d: DType| match d {
        DType::F32 => attn_candle::attn_rs::DType::F32,
        DType::BF16 => attn_candle::attn_rs::DType::BF16,
        DType::F16 => attn_candle::attn_rs::DType::F16,
        _ => attn_candle::attn_rs::DType::Fp8E4m3,
    };
    // The MLA model with a small latent: head size latent + 64 rope columns.
    let mut model = ModelConfig::mla(HEADS, to_attn(dtype), BLOCK);
    model.head_size = LATENT + ROPE;
    if fp8 {
        model = model.with_cache_dtype(attn_candle::attn_rs::DType::Fp8E4m3);
    }
    let limits = ForwardLimits { max_num_tokens: 64, max_num_reqs: 8, max_model_len: 64 };
    let num_blocks = 32;
    let mut attn = PagedAttention::new(ForwardConfig::new(model, num_blocks, limits), &dev)?;
    let scale = 0.5f32;
    let mut cache = attn.new_mla_cache()?;
    if fp8 {
        cache = cache.with_scale(Tensor::new(&[scale], &dev)?)?;
    }
    assert_eq!(cache.tensor().dims(), &[num_blocks, BLOCK, LATENT + ROPE]);
    let steps: Vec<Vec<(usize, usize)>> = vec![vec![(0, 9), (1, 1)], vec![(0, 1), (2, 6), (1, 1)], vec![(2, 1), (0, 1), (1, 2)]];
    let mut blocks = Blocks::new(&mut rng, num_blocks);
    let mut seqs = vec![Seq::default(); 3];
    let mut rows: Vec<Option<Tensor>> = vec![None; 3];
    for (s, step) in steps.iter().enumerate() {
        let mut qsl = vec![0i32];
        let mut slots = Vec::new();
        for &(r, n) in step {
            slots.extend(seqs[r].grow(n, BLOCK, &mut blocks));
            qsl.push(qsl.last().unwrap() + n as i32);
        }
        let seq_lens: Vec<i32> = step.iter().map(|&(r, _)| seqs[r].len as i32).collect();
        let (table, stride) = block_table(&step.iter().map(|&(r, _)| &seqs[r]).collect::<Vec<_>>());
        attn.begin_step(&StepBatch {
            query_start_loc: &qsl,
            seq_lens: &seq_lens,
            block_table: &table,
            block_table_stride: stride,
            slot_mapping: &slots,
        })?;
        let t = slots.len();
        // One projection per token: kv_c, k_pe, then 3 other columns; k_pe as [t, 1, rope].
        let proj = randn(&mut rng, &[t, LATENT + ROPE + 3], dtype, &dev)?;
        let (kv_c, k_pe) = (proj.narrow(1, 0, LATENT)?, proj.narrow(1, LATENT, ROPE)?.unsqueeze(1)?);
        let q = randn(&mut rng, &[t, HEADS + 1, LATENT + ROPE], dtype, &dev)?.narrow(1, 1, HEADS)?;
        let out = attn.forward_mla(&q, &kv_c, &k_pe, &cache)?;
        assert_eq!(out.dims(), &[t, HEADS, LATENT]);
        for (i, &(r, n)) in step.iter().enumerate() {
            let a = qsl[i] as usize;
            let mut new = proj.narrow(0, a, n)?.narrow(1, 0, LATENT + ROPE)?;
            if fp8 {
                new = fp8_roundtrip(&new, scale)?;
            }
            rows[r] = Some(match rows[r].take() {
                Some(old) => Tensor::cat(&[&old, &new], 0)?,
                None => new,
            });
            let keys = rows[r].as_ref().unwrap().unsqueeze(1)?;
            let values = keys.narrow(2, 0, LATENT)?;
            let want = reference(&q.narrow(0, a, n)?, &keys, &values, 1.0 / ((LATENT + ROPE) as f64).sqrt())?;
            let diff = max_diff(&out.narrow(0, a, n)?, &want)?;
            assert!(diff <= tolerance(dtype, fp8), "{dtype:?} fp8={fp8}: step {s} request {r}: off by {diff}");
        }
    }
    Ok(())
}

#[test]
fn mla_steps_match_the_reference() -> Result<()> {
    mla_case(DType::F32, false)?;
    mla_case(DType::BF16, false)?;
    mla_case(DType::BF16, true)
}

fn decode_case(dtype: DType, fp8: bool, table_dtype: DType) -> Result<()> {
    let mut rng = rng("paged_attention");
    let dev = Device::Cpu;
    let (hq, hkv, d, num_blocks) = (8, 2, 16, 40);
    let spec = KvCacheSpec::new(KvLayout::FlashHnd, num_blocks, BLOCK, hkv, d).unwrap();
    let (k_scale, v_scale) = (0.75f32, 0.5f32);
    let cache = if fp8 {
        KvCache::zeros(spec, DType::F8E4M3, &dev)?.with_scales(Tensor::new(&[k_scale], &dev)?, Tensor::new(&[v_scale], &dev)?)?
    } else {
        KvCache::zeros(spec, dtype, &dev)?
    };
    // Sequences of odd lengths, one token long among them, written in two calls each.
    let lens = [1usize, 5, 17, 9, 4];
    let mut blocks = Blocks::new(&mut rng, num_blocks);
    let mut seqs = vec![Seq::default(); lens.len()];
    let mut hist = Vec::new();
    for (r, &len) in lens.iter().enumerate() {
        let slots = seqs[r].grow(len, BLOCK, &mut blocks);
        let kv = randn(&mut rng, &[len, 2 * hkv + 1, d], dtype, &dev)?;
        let (k, v) = (kv.narrow(1, 1, hkv)?, kv.narrow(1, 1 + hkv, hkv)?);
        let half = len / 2;
        for (a, b) in [(0, half), (half, len)] {
            if b > a {
                reshape_and_cache(&k.narrow(0, a, b - a)?, &v.narrow(0, a, b - a)?, &cache, &Tensor::new(&slots[a..b], &dev)?)?;
            }
        }
        let (k, v) = if fp8 { (fp8_roundtrip(&k, k_scale)?, fp8_roundtrip(&v, v_scale)?) } else { (k, v) };
        hist.push((k, v));
    }
    let (table, stride) = block_table(&seqs.iter().collect::<Vec<_>>());
    let block_tables = Tensor::from_vec(table, (lens.len(), stride), &dev)?.to_dtype(table_dtype)?;
    let context_lens = Tensor::from_vec(lens.iter().map(|&l| l as u32).collect::<Vec<_>>(), lens.len(), &dev)?;
    // The new tokens' queries: a strided slice.
    let q = randn(&mut rng, &[lens.len(), hq + 3, d], dtype, &dev)?.narrow(1, 2, hq)?;
    let softmax_scale = 1.0 / (d as f32).sqrt();
    let out = paged_attention(&q, &cache, &block_tables, &context_lens, None, softmax_scale, None)?;
    assert_eq!(out.dims(), &[lens.len(), hq, d]);
    for (r, (k, v)) in hist.iter().enumerate() {
        let want = reference(&q.i(r..r + 1)?, k, v, softmax_scale as f64)?;
        let diff = max_diff(&out.i(r..r + 1)?, &want)?;
        assert!(diff <= tolerance(dtype, fp8), "{dtype:?} fp8={fp8}: sequence {r} ({} keys): off by {diff}", lens[r]);
    }
    Ok(())
}

#[test]
fn decode_matches_the_reference() -> Result<()> {
    decode_case(DType::F32, false, DType::U32)?;
    decode_case(DType::BF16, false, DType::I64)?;
    decode_case(DType::F16, true, DType::U32)
}

#[test]
fn decode_refuses_a_block_outside_the_cache() -> Result<()> {
    let dev = Device::Cpu;
    let cache = KvCache::zeros(KvCacheSpec::new(KvLayout::FlashNhd, 4, 4, 1, 8).unwrap(), DType::F32, &dev)?;
    let q = Tensor::ones((1, 1, 8), DType::F32, &dev)?;
    let e =
        paged_attention(&q, &cache, &Tensor::new(&[[7u32]], &dev)?, &Tensor::new(&[3u32], &dev)?, None, 1.0, None).unwrap_err().to_string();
    assert!(e.contains("block id 7"), "{e}");
    Ok(())
}
