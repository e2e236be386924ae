//! The ops on CUDA tensors against the same ops on CPU tensors (attn-rs's CPU backend, itself
//! checked against the reference by the CPU tests). They need the `cuda` feature and a GPU:
//! without the feature they are reported as ignored, and without a GPU they say so and pass.

mod common;

#[cfg(feature = "cuda")]
mod gpu {
    use super::common::{block_table, max_diff, randn, rng, Blocks, Seq};
    use attn_candle::attn_rs::backend::ModelConfig;
    use attn_candle::{
        concat_and_cache_mla, paged_attention, reshape_and_cache, ForwardConfig, ForwardLimits, KvCache, KvCacheSpec, KvLayout, MlaCache,
        MlaCacheSpec, PagedAttention, StepBatch,
    };
    use candle_core::{DType, Device, Result, Tensor};

    /// GPU 0, or `None` (said) when there is none.
    pub fn gpu() -> Option<Device> {
        match Device::new_cuda(0) {
            Ok(d) => Some(d),
            Err(e) => {
                println!("skipped: no CUDA device ({e})");
                None
            }
        }
    }

    fn on(t: &Tensor, d: &Device) -> Result<Tensor> {
        t.to_device(d)
    }

    pub fn cache_writes(dev: &Device) -> Result<()> {
        let mut rng = rng("gpu_cache_writes");
        let cpu = Device::Cpu;
        for (dtype, fp8) in [(DType::BF16, false), (DType::F16, true)] {
            let spec = KvCacheSpec::new(KvLayout::FlashNhd, 16, 16, 4, 128).unwrap();
            let scales = (Tensor::new(&[0.5f32], &cpu)?, Tensor::new(&[0.25f32], &cpu)?);
            let make = |d: &Device| -> Result<KvCache> {
                if fp8 {
                    KvCache::zeros(spec, DType::F8E4M3, d)?.with_scales(on(&scales.0, d)?, on(&scales.1, d)?)
                } else {
                    KvCache::zeros(spec, dtype, d)
                }
            };
            let (c_cpu, c_gpu) = (make(&cpu)?, make(dev)?);
            let qkv = randn(&mut rng, &[37, 16, 128], dtype, &cpu)?;
            let slots: Vec<i64> = (0..37).map(|i| if i == 5 { -1 } else { (i * 7 % 256) as i64 }).collect();
            let slots = Tensor::new(slots.as_slice(), &cpu)?;
            let (k, v) = (qkv.narrow(1, 8, 4)?, qkv.narrow(1, 12, 4)?);
            reshape_and_cache(&k, &v, &c_cpu, &slots)?;
            let qkv_g = on(&qkv, dev)?;
            reshape_and_cache(&qkv_g.narrow(1, 8, 4)?, &qkv_g.narrow(1, 12, 4)?, &c_gpu, &on(&slots, dev)?)?;
            attn_candle::check_device_status(dev)?;
            let as_f32 = |t: &Tensor| t.to_device(&cpu)?.to_dtype(DType::F32);
            assert_eq!(max_diff(&as_f32(c_cpu.tensor())?, &as_f32(c_gpu.tensor())?)?, 0.0, "{dtype:?} fp8={fp8}");
        }
        let spec = MlaCacheSpec::deepseek(8, 16).unwrap();
        let (m_cpu, m_gpu) = (MlaCache::zeros(spec, DType::BF16, &cpu)?, MlaCache::zeros(spec, DType::BF16, dev)?);
        let proj = randn(&mut rng, &[9, 600], DType::BF16, &cpu)?;
        let slots = Tensor::new(&[3i64, 17, 40, 41, 42, 100, -1, 127, 0], &cpu)?;
        concat_and_cache_mla(&proj.narrow(1, 0, 512)?, &proj.narrow(1, 512, 64)?, &m_cpu, &slots)?;
        let pg = on(&proj, dev)?;
        concat_and_cache_mla(&pg.narrow(1, 0, 512)?, &pg.narrow(1, 512, 64)?, &m_gpu, &on(&slots, dev)?)?;
        assert_eq!(max_diff(&m_cpu.tensor().to_dtype(DType::F32)?, &m_gpu.tensor().to_device(&cpu)?.to_dtype(DType::F32)?)?, 0.0);
        Ok(())
    }

    /// Two mixed steps of a Llama-like layer (32 query heads over 8, head size 128, blocks of
    /// 16) or of an MLA layer, on both devices.
    pub fn forward(dev: &Device, mla: bool) -> Result<()> {
        let mut rng = rng("gpu_forward");
        let cpu = Device::Cpu;
        let block = 16;
        let num_blocks = 64;
        let model = if mla {
            ModelConfig::mla(16, attn_candle::attn_rs::DType::BF16, block)
        } else {
            ModelConfig::standard(32, 8, 128, attn_candle::attn_rs::DType::BF16, block, KvLayout::FlashNhd)
        };
        let limits = ForwardLimits { max_num_tokens: 256, max_num_reqs: 8, max_model_len: 512 };
        let config = ForwardConfig::new(model, num_blocks, limits);
        let mut on_cpu = PagedAttention::new(config, &cpu)?;
        let mut on_gpu = PagedAttention::new(config, dev)?;
        assert_eq!(on_gpu.backend(), if mla { "mla" } else { "tensor-core" });
        let mut blocks = Blocks::new(&mut rng, num_blocks);
        let mut seqs = vec![Seq::default(); 4];
        let (kv_c, kv_g, ml_c, ml_g) = if mla {
            (None, None, Some(on_cpu.new_mla_cache()?), Some(on_gpu.new_mla_cache()?))
        } else {
            (Some(on_cpu.new_kv_cache()?), Some(on_gpu.new_kv_cache()?), None, None)
        };
        for step in [vec![(0, 37), (1, 1), (2, 100)], vec![(2, 1), (0, 1), (3, 20), (1, 1)]] {
            let mut qsl = vec![0i32];
            let mut slots = Vec::new();
            for &(r, n) in &step {
                slots.extend(seqs[r].grow(n, block, &mut blocks));
                qsl.push(qsl.last().unwrap() + n as i32);
            }
            let seq_lens: Vec<i32> = step.iter().map(|&(r, _)| seqs[r].len as i32).collect();
            let (table, stride) = block_table(&step.iter().map(|&(r, _)| &seqs[r]).collect::<Vec<_>>());
            let batch = StepBatch {
                query_start_loc: &qsl,
                seq_lens: &seq_lens,
                block_table: &table,
                block_table_stride: stride,
                slot_mapping: &slots,
            };
            on_cpu.begin_step(&batch)?;
            on_gpu.begin_step(&batch)?;
            let t = slots.len();
            let (out_c, out_g) = if mla {
                let q = randn(&mut rng, &[t, 16, 576], DType::BF16, &cpu)?;
                let proj = randn(&mut rng, &[t, 576], DType::BF16, &cpu)?;
                let (qg, pg) = (on(&q, dev)?, on(&proj, dev)?);
                (
                    on_cpu.forward_mla(&q, &proj.narrow(1, 0, 512)?, &proj.narrow(1, 512, 64)?, ml_c.as_ref().unwrap())?,
                    on_gpu.forward_mla(&qg, &pg.narrow(1, 0, 512)?, &pg.narrow(1, 512, 64)?, ml_g.as_ref().unwrap())?,
                )
            } else {
                let qkv = randn(&mut rng, &[t, 48, 128], DType::BF16, &cpu)?;
                let g = on(&qkv, dev)?;
                (
                    on_cpu.forward(&qkv.narrow(1, 0, 32)?, &qkv.narrow(1, 32, 8)?, &qkv.narrow(1, 40, 8)?, kv_c.as_ref().unwrap())?,
                    on_gpu.forward(&g.narrow(1, 0, 32)?, &g.narrow(1, 32, 8)?, &g.narrow(1, 40, 8)?, kv_g.as_ref().unwrap())?,
                )
            };
            on_gpu.check_status()?;
            let diff = max_diff(&out_c, &out_g.to_device(&cpu)?)?;
            assert!(diff <= 3e-2, "mla={mla}: GPU and CPU differ by {diff}");
        }
        Ok(())
    }

    pub fn decode(dev: &Device) -> Result<()> {
        let mut rng = rng("gpu_decode");
        let cpu = Device::Cpu;
        let spec = KvCacheSpec::new(KvLayout::FlashHnd, 32, 16, 2, 128).unwrap();
        let (c_cpu, c_gpu) = (KvCache::zeros(spec, DType::F16, &cpu)?, KvCache::zeros(spec, DType::F16, dev)?);
        let lens = [1usize, 33, 200, 17];
        let mut blocks = Blocks::new(&mut rng, 32);
        let mut seqs = vec![Seq::default(); lens.len()];
        for (r, &len) in lens.iter().enumerate() {
            let slots = Tensor::new(seqs[r].grow(len, 16, &mut blocks).as_slice(), &cpu)?;
            let kv = randn(&mut rng, &[len, 4, 128], DType::F16, &cpu)?;
            reshape_and_cache(&kv.narrow(1, 0, 2)?, &kv.narrow(1, 2, 2)?, &c_cpu, &slots)?;
            let g = on(&kv, dev)?;
            reshape_and_cache(&g.narrow(1, 0, 2)?, &g.narrow(1, 2, 2)?, &c_gpu, &on(&slots, dev)?)?;
        }
        let (table, stride) = block_table(&seqs.iter().collect::<Vec<_>>());
        let bt = Tensor::from_vec(table, (lens.len(), stride), &cpu)?;
        let cl = Tensor::from_vec(lens.iter().map(|&l| l as u32).collect::<Vec<_>>(), lens.len(), &cpu)?;
        let q = randn(&mut rng, &[lens.len(), 16, 128], DType::F16, &cpu)?;
        let scale = 1.0 / (128f32).sqrt();
        let want = paged_attention(&q, &c_cpu, &bt, &cl, None, scale, None)?;
        let got = paged_attention(&on(&q, dev)?, &c_gpu, &on(&bt, dev)?, &on(&cl, dev)?, None, scale, None)?;
        attn_candle::check_device_status(dev)?;
        let diff = max_diff(&want, &got.to_device(&cpu)?)?;
        assert!(diff <= 4e-3, "decode: GPU and CPU differ by {diff}");
        Ok(())
    }
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs the `cuda` feature and a GPU")]
fn gpu_cache_writes_match_the_cpu() -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(dev) = gpu::gpu() {
        gpu::cache_writes(&dev)?;
    }
    Ok(())
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs the `cuda` feature and a GPU")]
fn gpu_forward_matches_the_cpu() -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(dev) = gpu::gpu() {
        gpu::forward(&dev, false)?;
        gpu::forward(&dev, true)?;
    }
    Ok(())
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs the `cuda` feature and a GPU")]
fn gpu_decode_matches_the_cpu() -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(dev) = gpu::gpu() {
        gpu::decode(&dev)?;
    }
    Ok(())
}
