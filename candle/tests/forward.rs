//! `PagedAttention` on CPU tensors, step after step of a small engine (prefills, chunked
//! prefills, decodes, one-token prompts, a batch not ordered decodes first, two layers with
//! their own caches, GQA, scattered blocks), against the reference attention over the keys and
//! values the test recorded. Queries, keys and values are strided slices of a fused QKV
//! projection (3-D or 2-D), passed without a copy.

mod common;

use attn_candle::attn_rs::backend::ModelConfig;
use attn_candle::{ForwardConfig, ForwardLimits, KvCache, KvLayout, LayerExtras, PagedAttention, StepBatch};
use candle_core::{DType, Device, IndexOp, Result, Tensor};
use common::{block_table, fp8_roundtrip, max_diff, randn, reference, rng, tolerance, Blocks, Seq};
use rand::rngs::SmallRng;

const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 16;
const BLOCK: usize = 4;
const NUM_BLOCKS: usize = 48;
const LAYERS: usize = 2;

fn candle_dtype(d: DType) -> attn_candle::attn_rs::DType {
    match d {
        DType::F16 => attn_candle::attn_rs::DType::F16,
        DType::BF16 => attn_candle::attn_rs::DType::BF16,
        DType::F32 => attn_candle::attn_rs::DType::F32,
        DType::F8E4M3 => attn_candle::attn_rs::DType::Fp8E4m3,
        other => panic!("{other:?}"),
    }
}

/// One request's keys and values so far (what the reference attends over), per layer.
struct History {
    k: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
}

fn append(slot: &mut Option<Tensor>, rows: Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        Some(t) => Tensor::cat(&[&t, &rows], 0)?,
        None => rows,
    });
    Ok(())
}

/// The model's test: `steps` of (request, new tokens), in the engine's order.
fn run(layout: KvLayout, dtype: DType, fp8: bool, two_d: bool, steps: &[Vec<(usize, usize)>], rng: &mut SmallRng) -> Result<()> {
    let dev = Device::Cpu;
    let (k_scale, v_scale) = (0.5f32, 0.25f32);
    let cache_dtype = if fp8 { DType::F8E4M3 } else { dtype };
    let model = ModelConfig::standard(HQ, HKV, D, candle_dtype(dtype), BLOCK, layout).with_cache_dtype(candle_dtype(cache_dtype));
    let limits = ForwardLimits { max_num_tokens: 64, max_num_reqs: 8, max_model_len: 64 };
    let mut attn = PagedAttention::new(ForwardConfig::new(model, NUM_BLOCKS, limits), &dev)?;
    assert_eq!(attn.backend(), "cpu");
    let caches: Vec<KvCache> = (0..LAYERS)
        .map(|_| {
            let c = attn.new_kv_cache()?;
            if fp8 {
                c.with_scales(Tensor::new(&[k_scale], &dev)?, Tensor::new(&[v_scale], &dev)?)
            } else {
                Ok(c)
            }
        })
        .collect::<Result<_>>()?;
    let num_reqs = steps.iter().flatten().map(|&(r, _)| r + 1).max().unwrap_or(0);
    let mut blocks = Blocks::new(rng, NUM_BLOCKS);
    let mut seqs = vec![Seq::default(); num_reqs];
    let mut history: Vec<History> = (0..num_reqs).map(|_| History { k: vec![None; LAYERS], v: vec![None; LAYERS] }).collect();
    let scale = 1.0 / (D as f64).sqrt();
    for (s, step) in steps.iter().enumerate() {
        let mut qsl = vec![0i32];
        let mut slots = Vec::new();
        for &(r, n) in step {
            slots.extend(seqs[r].grow(n, BLOCK, &mut blocks));
            qsl.push(qsl.last().unwrap() + n as i32);
        }
        let seq_lens: Vec<i32> = step.iter().map(|&(r, _)| seqs[r].len as i32).collect();
        let (table, stride) = block_table(&step.iter().map(|&(r, _)| &seqs[r]).collect::<Vec<_>>());
        // Two padding rows past the step's tokens (slots -1).
        let t = slots.len();
        let rows = t + 2;
        slots.extend([-1, -1]);
        attn.begin_step(&StepBatch {
            query_start_loc: &qsl,
            seq_lens: &seq_lens,
            block_table: &table,
            block_table_stride: stride,
            slot_mapping: &slots,
        })?;
        for (layer, cache) in caches.iter().enumerate() {
            // The fused projection: [rows, HQ + 2 * HKV + 1, D] (one extra head of other data).
            let width = HQ + 2 * HKV + 1;
            let qkv = randn(rng, &[rows, width, D], dtype, &dev)?;
            let (q, k, v) = if two_d {
                let flat = qkv.reshape((rows, width * D))?;
                (flat.narrow(1, 0, HQ * D)?, flat.narrow(1, HQ * D, HKV * D)?, flat.narrow(1, (HQ + HKV) * D, HKV * D)?)
            } else {
                (qkv.narrow(1, 0, HQ)?, qkv.narrow(1, HQ, HKV)?, qkv.narrow(1, HQ + HKV, HKV)?)
            };
            assert!(!q.is_contiguous() && !k.is_contiguous() && !v.is_contiguous());
            let out = attn.forward(&q, &k, &v, cache)?;
            assert_eq!(out.dims(), q.dims());
            let out = out.reshape((rows, HQ, D))?;
            let (k3, v3) = (qkv.narrow(1, HQ, HKV)?, qkv.narrow(1, HQ + HKV, HKV)?);
            let q3 = qkv.narrow(1, 0, HQ)?;
            for (i, &(r, n)) in step.iter().enumerate() {
                let a = qsl[i] as usize;
                let (mut kr, mut vr) = (k3.narrow(0, a, n)?, v3.narrow(0, a, n)?);
                if fp8 {
                    kr = fp8_roundtrip(&kr, k_scale)?;
                    vr = fp8_roundtrip(&vr, v_scale)?;
                }
                append(&mut history[r].k[layer], kr)?;
                append(&mut history[r].v[layer], vr)?;
                let h = &history[r];
                let want = reference(&q3.narrow(0, a, n)?, h.k[layer].as_ref().unwrap(), h.v[layer].as_ref().unwrap(), scale)?;
                let got = out.narrow(0, a, n)?;
                let diff = max_diff(&got, &want)?;
                let tol = tolerance(dtype, fp8);
                assert!(
                    diff <= tol,
                    "{layout:?} {dtype:?} fp8={fp8} 2-D={two_d}: step {s} layer {layer} request {r} ({n} new of {}): off by {diff} (> {tol})",
                    seqs[r].len
                );
            }
            // Padding rows are neither attended nor written.
            assert_eq!(out.i(t..)?.abs()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?, 0.0);
        }
    }
    Ok(())
}

/// Prompts of odd lengths and one token, a chunked prefill, a batch with prefills before
/// decodes, then decodes only.
fn steps() -> Vec<Vec<(usize, usize)>> {
    vec![
        vec![(0, 7), (1, 1), (2, 8)],
        vec![(2, 5), (0, 1), (3, 13), (1, 1)],
        vec![(0, 1), (1, 1), (2, 1), (3, 1)],
        vec![(3, 1), (4, 1), (0, 3), (1, 1)],
    ]
}

#[test]
fn mixed_steps_match_the_reference() -> Result<()> {
    let mut rng = rng("forward");
    for layout in KvLayout::ALL {
        run(layout, DType::F32, false, false, &steps(), &mut rng)?;
    }
    run(KvLayout::FlashNhd, DType::F32, false, true, &steps(), &mut rng)?;
    Ok(())
}

#[test]
fn half_precision_and_fp8_caches() -> Result<()> {
    let mut rng = rng("forward_half");
    run(KvLayout::FlashNhd, DType::BF16, false, false, &steps(), &mut rng)?;
    run(KvLayout::FlashHnd, DType::F16, false, true, &steps(), &mut rng)?;
    run(KvLayout::FlashInferNhd, DType::BF16, true, false, &steps(), &mut rng)?;
    run(KvLayout::FlashNhd, DType::F16, true, true, &steps(), &mut rng)?;
    Ok(())
}

#[test]
fn step_from_tensors_and_refusals() -> Result<()> {
    let dev = Device::Cpu;
    let model = ModelConfig::standard(4, 2, 8, attn_candle::attn_rs::DType::F32, 4, KvLayout::FlashNhd);
    let limits = ForwardLimits { max_num_tokens: 16, max_num_reqs: 4, max_model_len: 32 };
    let mut attn = PagedAttention::new(ForwardConfig::new(model, 8, limits), &dev)?;
    let cache = attn.new_kv_cache()?;
    let split = attn.begin_step_from_tensors(
        &Tensor::new(&[0u32, 3, 4], &dev)?,
        &Tensor::new(&[3u32, 1], &dev)?,
        &Tensor::new(&[[2u32], [5]], &dev)?,
        &Tensor::new(&[8i64, 9, 10, 20], &dev)?,
    )?;
    // Prefill then decode: reordered, decodes first (and the layer's rows gathered, a copy
    // that takes any layout).
    assert_eq!((split.num_decodes, split.num_prefills), (1, 1));
    let strided_q = Tensor::ones((4, 8, 4), DType::F32, &dev)?.transpose(1, 2)?;
    let kv = Tensor::ones((4, 2, 8), DType::F32, &dev)?;
    assert_eq!(attn.forward(&strided_q, &kv, &kv, &cache)?.dims(), &[4, 4, 8]);
    // Decodes first: the rows go in as they are.
    attn.begin_step_from_tensors(
        &Tensor::new(&[0i64, 1, 4], &dev)?,
        &Tensor::new(&[5i32, 3], &dev)?,
        &Tensor::new(&[[5i64, 4], [2, 0]], &dev)?,
        &Tensor::new(&[21u32, 8, 9, 10], &dev)?,
    )?;
    let q = Tensor::ones((4, 4, 8), DType::F32, &dev)?;
    // A query layout the kernels cannot index.
    let bad_q = Tensor::ones((4, 8, 4), DType::F32, &dev)?.transpose(1, 2)?;
    let e = attn.forward(&bad_q, &kv, &kv, &cache).unwrap_err().to_string();
    assert!(e.contains("`q`") && e.contains(".contiguous()"), "{e}");
    // Heads the model does not have.
    let e = attn.forward(&Tensor::ones((4, 2, 8), DType::F32, &dev)?, &kv, &kv, &cache).unwrap_err().to_string();
    assert!(e.contains("`q`") && e.contains("heads"), "{e}");
    // A cache of another layout.
    let other = KvCache::zeros(attn_candle::KvCacheSpec::new(KvLayout::FlashHnd, 8, 4, 2, 8).unwrap(), DType::F32, &dev)?;
    let e = attn.forward(&q, &kv, &kv, &other).unwrap_err().to_string();
    assert!(e.contains("`cache`"), "{e}");
    // A slot past the cache, and block ids outside it, refused by the step.
    let e = attn
        .begin_step(&StepBatch { query_start_loc: &[0, 1], seq_lens: &[1], block_table: &[9], block_table_stride: 1, slot_mapping: &[36] })
        .unwrap_err()
        .to_string();
    assert!(e.contains("block_table") || e.contains("slot"), "{e}");
    // ALiBi the model does not declare.
    attn.begin_step(&StepBatch { query_start_loc: &[0, 1], seq_lens: &[1], block_table: &[1], block_table_stride: 1, slot_mapping: &[4] })?;
    let slopes = Tensor::ones(4, DType::F32, &dev)?;
    let q1 = Tensor::ones((1, 4, 8), DType::F32, &dev)?;
    let kv1 = Tensor::ones((1, 2, 8), DType::F32, &dev)?;
    let e = attn.forward_with(&q1, &kv1, &kv1, &cache, &LayerExtras { alibi_slopes: Some(&slopes), sinks: None }).unwrap_err().to_string();
    assert!(e.contains("alibi_slopes"), "{e}");
    let out = attn.forward(&q1, &kv1, &kv1, &cache)?;
    assert_eq!(out.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?, vec![1.0; 32]);
    Ok(())
}
