//! `forward` on the GPU (`tensor-core` backend): a two-layer Llama-like model (8 query heads
//! over 2 kv heads of 128, bf16) serves two steps, first two prompts, then their first decodes
//! beside a third prompt, one `forward` call per layer per step. The same calls on the CPU
//! backend give the reference the outputs and caches are compared with.
//!
//!     cargo run -p attn-rs --example forward_gpu
//!
//! Without a GPU it says so and exits 0.

use attn_rs::backend::{select_backend, select_backend_no_env, DeviceInfo, ModelConfig};
use attn_rs::forward::{Attention, CpuLayer, ForwardConfig, ForwardLimits, GpuHandles, GpuLayer, LayerIo, NewKv};
use attn_rs::metadata::StepInput;
use attn_rs::{DType, DevIn, DevOut, KvLayout, RowsDesc};
use half::bf16;
use std::sync::Arc;

mod common;
use common::{open_gpu, values};

/// One step as the engine's scheduler leaves it, ordered decodes first.
struct Step {
    query_start_loc: Vec<i32>,
    seq_lens: Vec<i32>,
    block_table: Vec<i32>,
    slots: Vec<i64>,
}

fn main() -> attn_rs::Result<()> {
    let Some(dev) = open_gpu()? else { return Ok(()) };
    let dev = Arc::new(dev);
    let stream = dev.context().new_stream()?;
    let (num_q_heads, num_kv_heads, head_size, block_size, num_layers, num_blocks) = (8, 2, 128, 16, 2, 16);
    let model = ModelConfig::standard(num_q_heads, num_kv_heads, head_size, DType::BF16, block_size, KvLayout::FlashNhd);
    let limits = ForwardLimits { max_num_tokens: 256, max_num_reqs: 8, max_model_len: 128 };
    let config = ForwardConfig::new(model, num_blocks, limits);

    // Once per model: the backend (the registry's choice for this GPU, or `ATTN_BACKEND`), the
    // `Attention` and its step metadata, and every layer's cache.
    let selection = select_backend(&model, &DeviceInfo::from_device(&dev), None)?;
    let mut gpu = Attention::new(&selection, config.clone(), Some(GpuHandles { dev: dev.clone(), stream: stream.clone() }))?;
    let mut gpu_step = gpu.new_step_metadata()?;
    let cache_len = gpu.cache_spec().num_elements();
    let mut gpu_caches = (0..num_layers).map(|_| stream.alloc_zeros::<bf16>(cache_len)).collect::<Result<Vec<_>, _>>()?;
    println!("backend: {} ({})", gpu.backend().name, gpu.backend().summary);
    // The reference: the CPU backend with the same configuration.
    let mut cpu = Attention::new(&select_backend_no_env(&model, &DeviceInfo::no_gpu(), Some("cpu"))?, config, None)?;
    let mut cpu_step = cpu.new_step_metadata()?;
    let mut cpu_caches = vec![vec![bf16::ZERO; cache_len]; num_layers];

    // Step 0: prompts of 20 tokens (blocks 0, 1) and 7 (block 2). Step 1: one decode each
    // (slots 20 and 39), then a prompt of 12 tokens (block 3). Block tables have rows of 2.
    let steps = [
        Step {
            query_start_loc: vec![0, 20, 27],
            seq_lens: vec![20, 7],
            block_table: vec![0, 1, 2, 0],
            slots: (0..20).chain(32..39).collect(),
        },
        Step {
            query_start_loc: vec![0, 1, 2, 14],
            seq_lens: vec![21, 8, 12],
            block_table: vec![0, 1, 2, 0, 3, 0],
            slots: [20, 39].into_iter().chain(48..60).collect(),
        },
    ];
    let mut worst = 0f64;
    for (s, step) in steps.iter().enumerate() {
        let num_tokens = *step.query_start_loc.last().unwrap() as usize;
        let input = StepInput {
            query_start_loc: &step.query_start_loc,
            seq_lens: &step.seq_lens,
            block_table: &step.block_table,
            block_table_stride: 2,
            slot_mapping: &step.slots,
            num_actual_tokens: num_tokens,
            num_blocks,
            block_size,
        };
        // Once per step: checks, decode/prefill split, split plan, one upload.
        let split = gpu_step.build(&input)?;
        cpu_step.build(&input)?;
        let q_rows = RowsDesc::contiguous(num_tokens, num_q_heads, head_size);
        let kv_rows = RowsDesc::contiguous(num_tokens, num_kv_heads, head_size);
        for layer in 0..num_layers {
            // Stand-ins for the layer's QKV projection.
            let seed = (s * num_layers + layer) as u32 * 3;
            let (q, k, v): (Vec<bf16>, Vec<bf16>, Vec<bf16>) =
                (values(q_rows.required_len(), seed), values(kv_rows.required_len(), seed + 1), values(kv_rows.required_len(), seed + 2));
            let (q_d, k_d, v_d) = (stream.clone_htod(&q)?, stream.clone_htod(&k)?, stream.clone_htod(&v)?);
            let mut out_d = stream.alloc_zeros::<bf16>(q_rows.required_len())?;
            gpu.forward(
                &gpu_step,
                LayerIo::Gpu(GpuLayer {
                    q: DevIn::new(&q_d, &stream),
                    q_rows,
                    new_kv: NewKv::Standard {
                        k: DevIn::new(&k_d, &stream),
                        k_rows: kv_rows,
                        v: DevIn::new(&v_d, &stream),
                        v_rows: kv_rows,
                    },
                    cache: DevOut::new(&mut gpu_caches[layer], &stream),
                    out: DevOut::new(&mut out_d, &stream),
                    out_rows: q_rows,
                    alibi_slopes: None,
                    sinks: None,
                    kv_scales: None,
                }),
            )?;
            let mut out = vec![bf16::ZERO; q_rows.required_len()];
            cpu.forward(
                &cpu_step,
                LayerIo::Cpu(CpuLayer {
                    q: q.as_slice().into(),
                    q_rows,
                    new_kv: NewKv::Standard { k: k.as_slice().into(), k_rows: kv_rows, v: v.as_slice().into(), v_rows: kv_rows },
                    cache: cpu_caches[layer].as_mut_slice().into(),
                    out: out.as_mut_slice().into(),
                    out_rows: q_rows,
                    alibi_slopes: None,
                    sinks: None,
                    kv_scales: None,
                }),
            )?;
            let got = stream.clone_dtoh(&out_d)?;
            worst = got.iter().zip(&out).map(|(g, w)| (g.to_f32() as f64 - w.to_f32() as f64).abs()).fold(worst, f64::max);
        }
        // Nothing synchronises until asked: this waits and reports slots or blocks the kernels
        // refused, if any.
        gpu.check_status()?;
        println!("step {s}: {} decodes, {} prefills through {num_layers} layers", split.num_decodes, split.num_prefills);
    }
    let caches_match = gpu_caches.iter().zip(&cpu_caches).all(|(g, c)| {
        let g = stream.clone_dtoh(g).expect("download");
        g.iter().zip(c).all(|(a, b)| a.to_bits() == b.to_bits())
    });
    println!(
        "largest output difference from the CPU backend {worst:.2e} (bf16); caches {}",
        if caches_match { "identical" } else { "DIFFER" }
    );
    if worst > 2e-2 || !caches_match {
        std::process::exit(1);
    }
    Ok(())
}
