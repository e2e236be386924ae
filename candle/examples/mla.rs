//! MLA (DeepSeek's multi-head latent attention) through `PagedAttention::forward_mla`: each
//! step writes the tokens' compressed KV (`kv_c`) and rope key (`k_pe`) into the latent cache
//! and attends with the absorbed queries; the output is in the latent space (the caller applies
//! the V up-projection).
//!
//!     cargo run -p attn-candle --example mla
//!
//! On the CPU it uses a small latent (128 + 64 rope columns); with `--no-default-features
//! --features cuda` on a GPU, DeepSeek's 512 + 64 in bf16.

use attn_candle::attn_rs::backend::ModelConfig;
use attn_candle::{ForwardConfig, ForwardLimits, PagedAttention, StepBatch};
use candle_core::{DType, Device, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::cuda_if_available(0)?;
    let heads = 16;
    let (dtype, mut model) = if dev.is_cuda() {
        (DType::BF16, ModelConfig::mla(heads, attn_candle::attn_rs::DType::BF16, 16))
    } else {
        (DType::F32, ModelConfig::mla(heads, attn_candle::attn_rs::DType::F32, 16))
    };
    if dev.is_cpu() {
        model.head_size = 128 + 64;
    }
    let limits = ForwardLimits { max_num_tokens: 64, max_num_reqs: 4, max_model_len: 128 };
    let mut attn = PagedAttention::new(ForwardConfig::new(model, 16, limits), &dev)?;
    let cache = attn.new_mla_cache()?;
    let spec = cache.spec();
    println!("device {:?}, backend {}, latent {} + rope {}", dev.location(), attn.backend(), spec.latent_dim, spec.rope_dim);

    // A 9-token prompt in block 5, then its first decode; a one-token prompt in block 2 joins.
    let slots: [Vec<i64>; 2] = [(80..89).collect(), vec![89, 32]];
    let batches = [
        StepBatch { query_start_loc: &[0, 9], seq_lens: &[9], block_table: &[5], block_table_stride: 1, slot_mapping: &slots[0] },
        StepBatch { query_start_loc: &[0, 1, 2], seq_lens: &[10, 1], block_table: &[5, 2], block_table_stride: 1, slot_mapping: &slots[1] },
    ];
    for batch in &batches {
        attn.begin_step(batch)?;
        let (slots, seq_lens) = (batch.slot_mapping, batch.seq_lens);
        let tokens = slots.len();
        let width = spec.latent_dim + spec.rope_dim;
        // One down-projection output per token: kv_c then k_pe.
        let latents = Tensor::randn(0f32, 1., (tokens, width), &dev)?.to_dtype(dtype)?;
        let (kv_c, k_pe) = (latents.narrow(1, 0, spec.latent_dim)?, latents.narrow(1, spec.latent_dim, spec.rope_dim)?);
        let q = Tensor::randn(0f32, 1., (tokens, heads, width), &dev)?.to_dtype(dtype)?;
        let out = attn.forward_mla(&q, &kv_c, &k_pe, &cache)?;
        println!("{} requests, {tokens} tokens -> latent output {:?}", seq_lens.len(), out.dims());
    }
    attn.check_status()?;
    Ok(())
}
