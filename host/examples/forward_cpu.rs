//! `forward` on the CPU backend (no GPU needed): a two-layer model serves two steps, first two
//! prompts, then their first decodes beside a third prompt, with one `forward` call per layer
//! per step (cache write, then attention).
//!
//!     cargo run -p attn-rs --example forward_cpu

use attn_rs::backend::{select_backend_no_env, DeviceInfo, ModelConfig};
use attn_rs::forward::{Attention, CpuLayer, ForwardConfig, ForwardLimits, LayerIo, NewKv};
use attn_rs::metadata::{decode_first_order, StepInput};
use attn_rs::{DType, KvLayout, RowsDesc};

mod common;
use common::values;

/// One request as the engine tracks it: its blocks and the tokens cached so far.
struct Request {
    blocks: Vec<i32>,
    cached: usize,
}

fn main() -> attn_rs::Result<()> {
    let (num_q_heads, num_kv_heads, head_size, block_size, num_layers) = (4, 2, 64, 16, 2);
    let model = ModelConfig::standard(num_q_heads, num_kv_heads, head_size, DType::F32, block_size, KvLayout::FlashNhd);
    // No GPU: the registry picks the `cpu` backend (`select_backend` also reads ATTN_BACKEND).
    let selection = select_backend_no_env(&model, &DeviceInfo::no_gpu(), None)?;
    let num_blocks = 16;
    let limits = ForwardLimits { max_num_tokens: 256, max_num_reqs: 8, max_model_len: 128 };
    let mut attn = Attention::new(&selection, ForwardConfig::new(model, num_blocks, limits), None)?;
    println!("backend: {}", attn.backend().name);
    let mut caches: Vec<Vec<f32>> = (0..num_layers).map(|_| vec![0.0; attn.cache_spec().num_elements()]).collect();
    let mut step_metadata = attn.new_step_metadata()?;
    let mut free_blocks: Vec<i32> = (0..num_blocks as i32).rev().collect();
    let mut requests: Vec<Request> = Vec::new();

    // Each step: (request, new tokens); a request index past the list is a new prompt.
    let steps: [&[(usize, usize)]; 2] = [&[(0, 20), (1, 7)], &[(2, 12), (0, 1), (1, 1)]];
    for (s, step) in steps.iter().enumerate() {
        // `forward` takes batches ordered decodes first: `decode_first_order` gives the order
        // from the step's query lengths (it reads `query_start_loc` only).
        let mut unordered = vec![0i32];
        for &(_, q) in step.iter() {
            unordered.push(unordered.last().unwrap() + q as i32);
        }
        let lengths_only = StepInput {
            query_start_loc: &unordered,
            seq_lens: &[],
            block_table: &[],
            block_table_stride: 0,
            slot_mapping: &[],
            num_actual_tokens: 0,
            num_blocks,
            block_size,
        };
        let order: Vec<(usize, usize)> =
            decode_first_order(&lengths_only, attn.config().decode_threshold).into_iter().map(|i| step[i]).collect();
        let (mut query_start_loc, mut seq_lens, mut slots) = (vec![0i32], Vec::new(), Vec::new());
        for &(r, q) in &order {
            if r == requests.len() {
                requests.push(Request { blocks: Vec::new(), cached: 0 });
            }
            let req = &mut requests[r];
            while req.blocks.len() * block_size < req.cached + q {
                req.blocks.push(free_blocks.pop().expect("enough blocks"));
            }
            for pos in req.cached..req.cached + q {
                slots.push(req.blocks[pos / block_size] as i64 * block_size as i64 + (pos % block_size) as i64);
            }
            query_start_loc.push(query_start_loc.last().unwrap() + q as i32);
            seq_lens.push((req.cached + q) as i32);
        }
        let stride = order.iter().map(|&(r, _)| requests[r].blocks.len()).max().unwrap_or(1);
        let mut block_table = vec![0i32; order.len() * stride];
        for (i, &(r, _)) in order.iter().enumerate() {
            block_table[i * stride..][..requests[r].blocks.len()].copy_from_slice(&requests[r].blocks);
        }
        let num_tokens = *query_start_loc.last().unwrap() as usize;
        let split = step_metadata.build(&StepInput {
            query_start_loc: &query_start_loc,
            seq_lens: &seq_lens,
            block_table: &block_table,
            block_table_stride: stride,
            slot_mapping: &slots,
            num_actual_tokens: num_tokens,
            num_blocks,
            block_size,
        })?;

        let q_rows = RowsDesc::contiguous(num_tokens, num_q_heads, head_size);
        let kv_rows = RowsDesc::contiguous(num_tokens, num_kv_heads, head_size);
        let mut out = vec![0f32; q_rows.required_len()];
        for (layer, cache) in caches.iter_mut().enumerate() {
            // Stand-ins for the layer's QKV projection.
            let seed = (s * num_layers + layer) as u32 * 3;
            let (q, k, v): (Vec<f32>, Vec<f32>, Vec<f32>) =
                (values(q_rows.required_len(), seed), values(kv_rows.required_len(), seed + 1), values(kv_rows.required_len(), seed + 2));
            attn.forward(
                &step_metadata,
                LayerIo::Cpu(CpuLayer {
                    q: q.as_slice().into(),
                    q_rows,
                    new_kv: NewKv::Standard { k: k.as_slice().into(), k_rows: kv_rows, v: v.as_slice().into(), v_rows: kv_rows },
                    cache: cache.as_mut_slice().into(),
                    out: out.as_mut_slice().into(),
                    out_rows: q_rows,
                    alibi_slopes: None,
                    sinks: None,
                    kv_scales: None,
                }),
            )?;
        }
        for &(r, q) in &order {
            requests[r].cached += q;
        }
        let norm = out.iter().map(|x| x * x).sum::<f32>().sqrt();
        println!(
            "step {s}: {} decodes ({} tokens), {} prefills ({} tokens); last layer's output norm {norm:.3}",
            split.num_decodes, split.num_decode_tokens, split.num_prefills, split.num_prefill_tokens
        );
    }
    Ok(())
}
