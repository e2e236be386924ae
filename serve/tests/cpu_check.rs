//! The `--check` of the README on the CPU, short: two prompts, eight greedy tokens each, our
//! forward (attn-rs's CPU backend over the paged cache, chunked prefill mixed with decodes)
//! against candle-transformers' quantized_llama. Skips when the model file is absent
//! (`scripts/fetch-smollm2.sh` fetches it; CI does).

use attn_serve::check::{run_check, Weights};
use attn_serve::setup::{Loaded, Sizes};
use candle_core::Device;
use std::path::PathBuf;

#[test]
fn smollm2_matches_quantized_llama_on_cpu() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !model.is_file() {
        eprintln!("skipped: {} is absent (run scripts/fetch-smollm2.sh)", model.display());
        return;
    }
    let device = Device::Cpu;
    let loaded = Loaded::load(&model, &device).expect("model loads");
    let prompts = vec!["What is the capital of France?".to_owned(), "Write a haiku about the sea.".to_owned()];
    let tokens = 8;
    // A small token budget: the prompts are prefilled in chunks, the first request's decodes
    // in the same steps as the second's chunks.
    let sizes = Sizes { max_running: 2, token_budget: 16, block_size: 16, num_blocks: None, max_model_len: 128 };
    let report = run_check(&loaded, &model, &device, &prompts, tokens, sizes, &[Weights::F32, Weights::Served]).expect("check runs");
    eprint!("{}", report.table());
    assert!(report.passed(), "our forward disagrees with quantized_llama:\n{}", report.table());
    for row in &report.rows {
        assert!(row.compared > 0, "{row:?}");
    }
}
