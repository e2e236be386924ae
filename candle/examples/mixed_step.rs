//! A few steps of a small serving loop through `PagedAttention`: each step mixes decodes with
//! (chunked) prefills, builds its metadata once, and runs two layers, each writing its own
//! cache and returning its attention output. Queries, keys and values come from one fused
//! projection per layer, without copies.
//!
//!     cargo run -p attn-candle --example mixed_step
//!
//! With `--no-default-features --features cuda` it runs on GPU 0 when there is one (bf16 there,
//! f32 on the CPU).

use attn_candle::attn_rs::backend::ModelConfig;
use attn_candle::{ForwardConfig, ForwardLimits, KvLayout, PagedAttention, StepBatch};
use candle_core::{DType, Device, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::cuda_if_available(0)?;
    let (dtype, attn_dtype) =
        if dev.is_cuda() { (DType::BF16, attn_candle::attn_rs::DType::BF16) } else { (DType::F32, attn_candle::attn_rs::DType::F32) };
    let (q_heads, kv_heads, head_size, block_size, num_blocks) = (8, 2, 64, 16, 32);
    let model = ModelConfig::standard(q_heads, kv_heads, head_size, attn_dtype, block_size, KvLayout::FlashNhd);
    let limits = ForwardLimits { max_num_tokens: 128, max_num_reqs: 8, max_model_len: 256 };
    let mut attn = PagedAttention::new(ForwardConfig::new(model, num_blocks, limits), &dev)?;
    println!("device {:?}, backend {}", dev.location(), attn.backend());
    let caches = [attn.new_kv_cache()?, attn.new_kv_cache()?];

    // Request A: a 20-token prompt in blocks [4, 9]; request B: a 5-token prompt in block [2].
    // Step 1 prefills both; step 2 decodes A and B and prefills C (7 tokens, block [11]).
    struct Step {
        query_start_loc: Vec<i32>,
        seq_lens: Vec<i32>,
        block_table: Vec<i32>,
        slots: Vec<i64>,
    }
    let slot = |block: i64, off: i64| block * block_size as i64 + off;
    let steps = [
        Step {
            query_start_loc: vec![0, 20, 25],
            seq_lens: vec![20, 5],
            block_table: vec![4, 9, 2, -1],
            slots: (0..16).map(|i| slot(4, i)).chain((0..4).map(|i| slot(9, i))).chain((0..5).map(|i| slot(2, i))).collect(),
        },
        Step {
            query_start_loc: vec![0, 1, 2, 9],
            seq_lens: vec![21, 6, 7],
            block_table: vec![4, 9, 2, -1, 11, -1],
            slots: [slot(9, 4), slot(2, 5)].into_iter().chain((0..7).map(|i| slot(11, i))).collect(),
        },
    ];
    for (n, s) in steps.iter().enumerate() {
        let split = attn.begin_step(&StepBatch {
            query_start_loc: &s.query_start_loc,
            seq_lens: &s.seq_lens,
            block_table: &s.block_table,
            block_table_stride: 2,
            slot_mapping: &s.slots,
        })?;
        let tokens = s.slots.len();
        for (layer, cache) in caches.iter().enumerate() {
            let qkv = Tensor::randn(0f32, 1., (tokens, (q_heads + 2 * kv_heads) * head_size), &dev)?.to_dtype(dtype)?;
            let q = qkv.narrow(1, 0, q_heads * head_size)?;
            let k = qkv.narrow(1, q_heads * head_size, kv_heads * head_size)?;
            let v = qkv.narrow(1, (q_heads + kv_heads) * head_size, kv_heads * head_size)?;
            let out = attn.forward(&q, &k, &v, cache)?;
            let norm = out.to_dtype(DType::F32)?.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>()?;
            println!(
                "step {n} layer {layer}: {} decodes + {} prefills, {tokens} tokens -> output {:?}, rms {norm:.3}",
                split.num_decodes,
                split.num_prefills,
                out.dims()
            );
        }
    }
    attn.check_status()?;
    Ok(())
}
