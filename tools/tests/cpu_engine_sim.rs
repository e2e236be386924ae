//! CPU tests of the simulated engine (`attn_tools::sim`): the block allocator and block tables, the
//! request stream, the scheduler's batches (budget, room, decodes first, slots that match the
//! block tables, every block back at the end; with an encoder, the encoder and cross-attention
//! steps' arrays), short runs of the engine loop on the CPU backend (standard and MLA, the
//! presets, the Gemma-2-like, KV-shared and Whisper-like models included) with their checks
//! passing, and the check's reference (its masks against `attn_rs::cpu`'s, and that a window or
//! soft-cap ignored, a causal mask in the encoder or cross-attention, or another layer's encoder
//! keys would fail it).
//!
//! On the CPU backend the sim's check compares `attn_rs::cpu` with the simulator's own f64
//! attention (`attn_tools::sim::reference_attention`): the attention arithmetic with each
//! layer's settings, and the bookkeeping (which rows reach the cache, block tables, positions,
//! the batch layout).

use attn_rs::backend::{select_backend_no_env, DeviceInfo};
use attn_rs::cpu::{self, KvRef, PrefillRef};
use attn_rs::forward::AttentionType;
use attn_rs::metadata::{is_decode, split_decodes, validate};
use attn_rs::{AttnOptions, DType, RowsDesc};
use attn_tools::sim::{
    reference_attention, reference_attention_bidirectional, rel_error, run_sim, tolerance, AllocError, BlockAllocator, BlockTable, Checker,
    RefShape, RequestSpec, Scheduler, SchedulerConfig, SimConfig, SimModel, SplitMix, Workload,
};
use half::bf16;
use std::collections::HashMap;

// ---------------------------------------------------------------------------------------------
// Block allocator
// ---------------------------------------------------------------------------------------------

#[test]
fn allocator_hands_out_every_block_once_and_takes_them_back() {
    let mut a = BlockAllocator::new(4, 16);
    assert_eq!((a.num_blocks(), a.num_free(), a.num_used(), a.block_size()), (4, 4, 0, 16));
    let got: Vec<i32> = (0..4).map(|_| a.allocate().unwrap()).collect();
    assert_eq!(got, [0, 1, 2, 3]);
    assert_eq!(a.allocate(), Err(AllocError::OutOfBlocks { needed: 1, free: 0, total: 4 }));
    a.free(2).unwrap();
    a.free(0).unwrap();
    assert_eq!((a.num_free(), a.num_used()), (2, 2));
    assert_eq!(a.allocate().unwrap(), 0, "the most recently freed block first");
    assert_eq!(a.free(2), Err(AllocError::DoubleFree(2)));
    assert_eq!(a.free(4), Err(AllocError::NotABlock { block: 4, total: 4 }));
    assert_eq!(a.free(-1), Err(AllocError::NotABlock { block: -1, total: 4 }));
}

#[test]
fn shuffled_allocator_is_a_permutation() {
    let mut a = BlockAllocator::shuffled(100, 16, &mut SplitMix::new(3));
    let mut got: Vec<i32> = (0..100).map(|_| a.allocate().unwrap()).collect();
    assert_ne!(got, (0..100).collect::<Vec<_>>(), "shuffled");
    got.sort_unstable();
    assert_eq!(got, (0..100).collect::<Vec<_>>());
}

#[test]
fn block_tables_grow_all_or_nothing_and_release() {
    let mut a = BlockAllocator::new(5, 4);
    let mut t = BlockTable::new();
    t.grow_to(9, &mut a).unwrap(); // 3 blocks
    assert_eq!(t.blocks(), [0, 1, 2]);
    t.grow_to(12, &mut a).unwrap(); // still 3
    assert_eq!(t.blocks().len(), 3);
    assert_eq!(t.slot(0, 4), 0);
    assert_eq!(t.slot(9, 4), 2 * 4 + 1);
    let mut u = BlockTable::new();
    assert_eq!(u.grow_to(12, &mut a), Err(AllocError::OutOfBlocks { needed: 3, free: 2, total: 5 }));
    assert!(u.blocks().is_empty() && a.num_free() == 2, "a refused growth takes nothing");
    u.grow_to(8, &mut a).unwrap();
    t.release(&mut a).unwrap();
    assert!(t.blocks().is_empty());
    assert_eq!(a.num_free(), 3);
    assert_eq!(BlockTable::blocks_for(0, 16), 0);
    assert_eq!(BlockTable::blocks_for(17, 16), 2);
}

// ---------------------------------------------------------------------------------------------
// Requests and scheduling
// ---------------------------------------------------------------------------------------------

fn workload() -> Workload {
    Workload { num_requests: 40, prompt_len: (1, 70), gen_len: (1, 20), initial: 5, max_arrivals_per_step: 3 }
}

#[test]
fn the_request_stream_is_deterministic_and_in_range() {
    let w = workload();
    let a = w.generate(&mut SplitMix::new(9));
    assert_eq!(a, w.generate(&mut SplitMix::new(9)));
    assert_ne!(a, w.generate(&mut SplitMix::new(10)));
    assert_eq!(a.len(), 40);
    assert!(a.iter().enumerate().all(|(i, r)| r.id == i));
    assert!(a.windows(2).all(|p| p[0].arrival_step <= p[1].arrival_step));
    assert_eq!(a.iter().filter(|r| r.arrival_step == 0).count(), 5);
    assert!(a.iter().all(|r| (1..=70).contains(&r.prompt_len) && (1..=20).contains(&r.gen_len)));
    assert_eq!(w.max_model_len(), 89);
}

/// Runs the scheduler alone to the end, checking every batch.
fn drive(config: SchedulerConfig, num_blocks: usize, block_size: usize, requests: Vec<RequestSpec>) -> usize {
    let specs: HashMap<usize, RequestSpec> = requests.iter().map(|r| (r.id, *r)).collect();
    let mut s = Scheduler::new(config, BlockAllocator::shuffled(num_blocks, block_size, &mut SplitMix::new(5)), requests).unwrap();
    let mut fed: HashMap<usize, usize> = HashMap::new();
    let mut finished = Vec::new();
    let mut step = 0;
    let mut steps = 0;
    while !s.is_done() {
        let b = s.schedule(&mut step).unwrap();
        assert!(!b.is_empty(), "step {step}: an empty batch with work left");
        assert!(b.num_tokens() <= config.token_budget && b.reqs.len() <= config.max_running);
        let input = b.arrays.input(num_blocks, block_size);
        validate(&input).unwrap_or_else(|e| panic!("step {step}: {e}"));
        let split = split_decodes(&input, config.decode_threshold).expect("decodes first");
        assert_eq!((split.num_decodes, split.num_decode_tokens), (b.num_decodes, b.num_decode_tokens));
        // Slots are the requests' next positions in their own blocks; no slot twice.
        let mut seen = std::collections::HashSet::new();
        for (i, r) in b.reqs.iter().enumerate() {
            assert_eq!(r.context, fed.get(&r.id).copied().unwrap_or(0), "request {} resumes where it was", r.id);
            assert!(is_decode(r.q_len as i64, config.decode_threshold) == (i < b.num_decodes));
            let row = &b.arrays.block_table[i * b.arrays.block_table_stride..];
            for (j, pos) in (r.context..r.seq_len()).enumerate() {
                let slot = b.arrays.slot_mapping[b.arrays.query_start_loc[i] as usize + j];
                assert_eq!(slot, row[pos / block_size] as i64 * block_size as i64 + (pos % block_size) as i64);
                assert!(seen.insert(slot), "slot {slot} twice in one step");
            }
        }
        for r in &b.reqs {
            *fed.entry(r.id).or_default() += r.q_len;
        }
        finished.extend(s.complete(&b).unwrap());
        step += 1;
        steps += 1;
        assert!(steps < 100_000);
    }
    assert_eq!(s.allocator().num_free(), num_blocks, "every block back");
    finished.sort_unstable();
    assert_eq!(finished, (0..specs.len()).collect::<Vec<_>>(), "every request finished once");
    for (id, n) in fed {
        assert_eq!(n, specs[&id].total_tokens(), "request {id} fed its prompt and all but its last generated token");
    }
    assert_eq!(s.num_finished(), specs.len());
    steps
}

#[test]
fn scheduler_batches_are_valid_and_every_request_finishes() {
    let requests = workload().generate(&mut SplitMix::new(1));
    let config = SchedulerConfig { max_running: 6, token_budget: 24, decode_threshold: 1 };
    drive(config, 40, 4, requests.clone());
    // Tight on blocks (admission waits), and multi-token decodes ordered first.
    drive(SchedulerConfig { decode_threshold: 4, ..config }, 23, 4, requests.clone());
    drive(SchedulerConfig { max_running: 1, token_budget: 1, decode_threshold: 1 }, 23, 4, requests);
}

#[test]
fn scheduler_refuses_a_request_larger_than_the_cache() {
    let r = RequestSpec { id: 0, arrival_step: 0, prompt_len: 60, gen_len: 10 };
    let config = SchedulerConfig { max_running: 2, token_budget: 8, decode_threshold: 1 };
    assert!(matches!(Scheduler::new(config, BlockAllocator::new(4, 16), vec![r]), Err(AllocError::OutOfBlocks { needed: 5, .. })));
}

#[test]
fn idle_steps_skip_to_the_next_arrival() {
    let reqs = vec![
        RequestSpec { id: 0, arrival_step: 0, prompt_len: 3, gen_len: 1 },
        RequestSpec { id: 1, arrival_step: 50, prompt_len: 3, gen_len: 2 },
    ];
    let config = SchedulerConfig { max_running: 2, token_budget: 8, decode_threshold: 1 };
    let mut s = Scheduler::new(config, BlockAllocator::new(4, 4), reqs).unwrap();
    let mut step = 0;
    let b = s.schedule(&mut step).unwrap();
    assert_eq!((step, b.reqs.len()), (0, 1));
    assert_eq!(s.complete(&b).unwrap(), [0]);
    step += 1;
    let b = s.schedule(&mut step).unwrap();
    assert_eq!((step, b.reqs[0].id), (50, 1));
}

/// Runs a scheduler with an encoder (inputs of `len` tokens, `enc_blocks` blocks, a budget of
/// `budget`) to the end, checking every batch's encoder and cross-attention arrays.
fn drive_with_encoder(config: SchedulerConfig, (num_blocks, enc_blocks, block_size): (usize, usize, usize), len: usize, budget: usize) {
    let requests = workload().generate(&mut SplitMix::new(4));
    let n = requests.len();
    let alloc = BlockAllocator::shuffled(num_blocks, block_size, &mut SplitMix::new(5));
    let enc_alloc = BlockAllocator::shuffled(enc_blocks, block_size, &mut SplitMix::new(6));
    let mut s = Scheduler::new(config, alloc, requests).unwrap().with_encoder(enc_alloc, len, budget).unwrap();
    let mut encoder_blocks: HashMap<usize, Vec<i32>> = HashMap::new();
    let (mut step, mut steps, mut finished, mut encoded) = (0, 0, 0, 0);
    while !s.is_done() {
        let b = s.schedule(&mut step).unwrap();
        assert!(!b.is_empty());
        // The encoder step: the admitted requests whole, within the budget (or one), slots in
        // their own encoder blocks, none twice; then they are in the decoder batch.
        let e = &b.encoder;
        assert!(b.num_encoder_tokens() <= budget.max(len), "{} encoder tokens", b.num_encoder_tokens());
        if !b.encoder_reqs.is_empty() {
            validate(&e.input(enc_blocks, block_size)).unwrap_or_else(|err| panic!("step {step} encoder: {err}"));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, r) in b.encoder_reqs.iter().enumerate() {
            assert_eq!((r.q_len, r.context, e.seq_lens[i]), (len, 0, len as i32));
            let row = &e.block_table[i * e.block_table_stride..][..BlockTable::blocks_for(len, block_size)];
            for pos in 0..len {
                let slot = e.slot_mapping[e.query_start_loc[i] as usize + pos];
                assert_eq!(slot, row[pos / block_size] as i64 * block_size as i64 + (pos % block_size) as i64);
                assert!(seen.insert(slot), "slot {slot} twice in one encoder step");
            }
            assert!(encoder_blocks.insert(r.id, row.to_vec()).is_none(), "request {} encoded twice", r.id);
            assert!(b.reqs.iter().any(|d| d.id == r.id && d.context == 0), "request {} joins the decoder batch", r.id);
            encoded += 1;
        }
        // The cross-attention step: the decoder's tokens over each request's encoder blocks.
        let c = &b.cross;
        assert_eq!(c.query_start_loc, b.arrays.query_start_loc);
        assert!(c.slot_mapping.len() == b.num_tokens() && c.slot_mapping.iter().all(|&x| x == -1));
        let input = c.input(enc_blocks, block_size);
        validate(&input).unwrap_or_else(|err| panic!("step {step} cross: {err}"));
        let split = split_decodes(&input, config.decode_threshold).expect("decodes first");
        assert_eq!((split.num_decodes, split.num_decode_tokens), (b.num_decodes, b.num_decode_tokens));
        for (i, r) in b.reqs.iter().enumerate() {
            assert!(r.q_len <= len, "request {}: {} query tokens past its encoder's {len}", r.id, r.q_len);
            assert_eq!(c.seq_lens[i], len as i32);
            let row = &c.block_table[i * c.block_table_stride..][..BlockTable::blocks_for(len, block_size)];
            assert_eq!(row, encoder_blocks[&r.id], "request {}'s encoder blocks", r.id);
        }
        finished += s.complete(&b).unwrap().len();
        step += 1;
        steps += 1;
        assert!(steps < 100_000);
    }
    assert_eq!((finished, encoded), (n, n));
    assert_eq!(s.allocator().num_free(), num_blocks, "every decoder block back");
    assert_eq!(s.encoder_allocator().unwrap().num_free(), enc_blocks, "every encoder block back");
}

#[test]
fn scheduler_with_an_encoder_runs_encoder_steps_and_cross_steps() {
    let config = SchedulerConfig { max_running: 6, token_budget: 24, decode_threshold: 1 };
    // Encoder inputs of 30 tokens, two to a step; prompts (up to 70) cut to 30 tokens a step.
    drive_with_encoder(config, (40, 20, 4), 30, 60);
    // Tight encoder blocks (admission waits for them), a budget below one input (one a step),
    // multi-token decodes, an input of one block exactly.
    drive_with_encoder(SchedulerConfig { decode_threshold: 4, ..config }, (40, 9, 4), 8, 5);
    drive_with_encoder(SchedulerConfig { max_running: 1, token_budget: 1, decode_threshold: 1 }, (23, 2, 4), 7, 100);
    // An encoder input larger than its pool is refused.
    let s = Scheduler::new(config, BlockAllocator::new(40, 4), Vec::new()).unwrap();
    assert!(matches!(s.with_encoder(BlockAllocator::new(3, 4), 13, 100), Err(AllocError::OutOfBlocks { needed: 4, .. })));
}

// ---------------------------------------------------------------------------------------------
// The engine loop on the CPU backend
// ---------------------------------------------------------------------------------------------

fn small_config() -> SimConfig {
    SimConfig {
        workload: Workload { num_requests: 8, prompt_len: (3, 40), gen_len: (1, 8), initial: 3, max_arrivals_per_step: 2 },
        max_running: 4,
        token_budget: 16,
        num_blocks: None,
        num_layers: None,
        window: None,
        softcap: None,
        chunk: None,
        encoder_len: None,
        encoder_budget: 64,
        max_steps: 10_000,
        check_every: 2,
        check_layers: None,
        check_reqs: 3,
        check_tokens: 2,
        progress_every: 4,
        decode_threshold: 1,
        seed: 7,
        graphs: false,
    }
}

/// CUDA graphs are a GPU backend's: on the CPU the run is refused before any step.
#[test]
fn graphs_need_a_gpu_backend() {
    let model = SimModel::tiny(DType::F32);
    let cfg = SimConfig { graphs: true, ..small_config() };
    let sel = select_backend_no_env(&model.config, &DeviceInfo::no_gpu(), None).unwrap();
    let err = run_sim(&model, &cfg, &sel, None, &mut Vec::new()).expect_err("refused");
    assert!(err.to_string().contains("CUDA graphs need a GPU backend"), "{err}");
}

fn run_on_cpu(model: &SimModel, cfg: &SimConfig) -> (attn_tools::sim::SimReport, String) {
    let sel = select_backend_no_env(&model.config, &DeviceInfo::no_gpu(), None).unwrap();
    let mut log = Vec::new();
    let report = run_sim(model, cfg, &sel, None, &mut log).unwrap_or_else(|e| panic!("{}: {e}", model.name));
    (report, String::from_utf8(log).unwrap())
}

#[test]
fn engine_loop_runs_to_completion_on_the_cpu_backend() {
    let cfg = small_config();
    let expected: usize = cfg.workload.generate(&mut SplitMix::new(cfg.seed)).iter().map(|r| r.total_tokens()).sum();
    for model in [SimModel::tiny(DType::F32), SimModel::tiny(DType::BF16), SimModel::tiny_mla(DType::BF16)] {
        let (r, log) = run_on_cpu(&model, &cfg);
        assert_eq!((r.backend, r.on_gpu), ("cpu", false));
        assert_eq!((r.finished, r.requests), (8, 8), "{log}");
        assert_eq!(r.tokens(), expected, "every request's tokens went through forward");
        assert!(r.decode_tokens > 0 && r.prefill_tokens > 0);
        assert!(r.max_batch_tokens <= cfg.token_budget && r.max_batch_reqs <= cfg.max_running);
        assert!(r.checks.comparisons > 0 && r.passed(), "{}: {:?}\n{log}", model.name, r.checks);
        assert!(r.checks.worst_rel_error <= attn_tools::sim::tolerance(model.config.q_dtype));
        assert!(r.attention > std::time::Duration::ZERO && r.wall >= r.attention);
        assert_eq!(r.check_layers, [0, 1]);
        assert!(
            log.contains("backend cpu on the CPU")
                && log.contains("the simulator's own f64 attention")
                && log.contains("step ")
                && log.contains("summary [")
                && log.contains("PASS"),
            "{log}"
        );
    }
}

#[test]
fn engine_loop_is_deterministic() {
    let model = SimModel::tiny(DType::F32);
    let (a, _) = run_on_cpu(&model, &small_config());
    let (b, _) = run_on_cpu(&model, &small_config());
    assert_eq!(
        (a.steps, a.prefill_tokens, a.decode_tokens, a.checks.tokens),
        (b.steps, b.prefill_tokens, b.decode_tokens, b.checks.tokens)
    );
    assert_eq!(a.checks.worst_rel_error, b.checks.worst_rel_error);
}

#[test]
fn presets_run_a_few_steps_on_the_cpu_backend() {
    let cfg = SimConfig {
        workload: Workload { num_requests: 3, prompt_len: (2, 6), gen_len: (2, 3), initial: 3, max_arrivals_per_step: 1 },
        max_running: 3,
        token_budget: 8,
        num_layers: Some(1),
        max_steps: 3,
        check_every: 1,
        check_reqs: 2,
        check_tokens: 1,
        progress_every: 1,
        ..small_config()
    };
    for model in [SimModel::llama3_8b(DType::BF16), SimModel::deepseek_v2_lite(DType::BF16)] {
        let (r, log) = run_on_cpu(&model, &cfg);
        assert_eq!(r.steps, 3, "{log}");
        assert!(r.passed() && r.checks.comparisons > 0, "{:?}\n{log}", r.checks);
    }
    assert_eq!(SimModel::llama3_8b(DType::BF16).num_layers, 32);
    assert_eq!(SimModel::deepseek_v2_lite(DType::BF16).config.head_size, 576);
}

#[test]
fn a_bad_check_layer_is_refused() {
    let cfg = SimConfig { check_layers: Some(vec![5]), ..small_config() };
    let model = SimModel::tiny(DType::F32);
    let sel = select_backend_no_env(&model.config, &DeviceInfo::no_gpu(), None).unwrap();
    let err = run_sim(&model, &cfg, &sel, None, &mut Vec::new()).expect_err("refused");
    assert!(err.to_string().contains("check layer 5"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Per-layer settings: the Gemma-2-like and KV-shared models, and the check's reference
// ---------------------------------------------------------------------------------------------

/// The CPU preset's layers, window (64) and soft-cap (0.5), with fewer and longer requests: most
/// contexts pass the window.
fn layered_config() -> SimConfig {
    SimConfig {
        workload: Workload { num_requests: 6, prompt_len: (40, 100), gen_len: (1, 6), initial: 3, max_arrivals_per_step: 2 },
        max_running: 4,
        token_budget: 24,
        check_every: 2,
        check_reqs: 3,
        progress_every: 4,
        seed: 3,
        ..SimConfig::cpu_default()
    }
}

#[test]
fn gemma2_like_passes_the_check_and_its_window_and_softcap_matter_there() {
    let cfg = layered_config();
    let (r, log) = run_on_cpu(&SimModel::gemma2_2b(DType::BF16), &cfg);
    assert_eq!((r.finished, r.requests, r.layers, r.check_layers.as_slice()), (6, 6, 2, &[0, 1][..]), "{log}");
    assert!(r.passed() && r.checks.comparisons > 0, "{:?}\n{log}", r.checks);
    // Layer 0 is windowed, both are soft-capped; an ignored setting would have failed some
    // comparisons (the reference without it differs from it by more than the tolerance).
    let (w, c) = (r.checks.window, r.checks.softcap);
    assert!(w.comparisons > 0 && w.comparisons < r.checks.comparisons && w.caught > 0, "{w:?}\n{log}");
    assert!(c.comparisons == r.checks.comparisons && c.caught > 0, "{c:?}\n{log}");
    assert!(
        log.contains("summary [gemma-2-2b-like on cpu]")
            && log.contains("sliding window 64 on the even layers")
            && log.contains("soft-cap 0.5 on every layer")
            && log.contains("the check catches a backend ignoring the window in"),
        "{log}"
    );
}

#[test]
fn llama4_like_passes_the_check_and_its_chunks_matter_there() {
    // Four layers: 0..3 in chunks of 40 positions, layer 3 over the whole context; prompts of
    // 40 to 100 tokens cross one or two chunk starts.
    let cfg = SimConfig { num_layers: Some(4), check_layers: Some(vec![0, 2, 3]), ..layered_config() };
    let (r, log) = run_on_cpu(&SimModel::llama4_scout(DType::BF16), &cfg);
    assert_eq!((r.finished, r.requests, r.layers, r.check_layers.as_slice()), (6, 6, 4, &[0, 2, 3][..]), "{log}");
    assert!(r.passed() && r.checks.comparisons > 0, "{:?}\n{log}", r.checks);
    // Two of the three checked layers are chunked; ignoring the chunks would have failed some.
    let c = r.checks.chunk;
    assert!(c.comparisons > 0 && c.comparisons < r.checks.comparisons && c.caught > 0, "{c:?}\n{log}");
    assert_eq!((r.checks.window.comparisons, r.checks.softcap.comparisons), (0, 0));
    assert!(
        log.contains("summary [llama-4-scout-like (chunked local) on cpu]")
            && log.contains("chunked local attention in chunks of 40 positions on every layer but layer 3")
            && log.contains("the check catches a backend ignoring the chunks in"),
        "{log}"
    );
}

#[test]
fn kv_shared_layers_read_the_last_owning_layer_and_pass_the_check() {
    // Three layers: the last reads the second's cache.
    let small = small_config();
    let workload = Workload { num_requests: 5, ..small.workload };
    let cfg = SimConfig { workload, num_layers: Some(3), check_layers: Some(vec![0, 1, 2]), ..small };
    let (r, log) = run_on_cpu(&SimModel::kv_shared(DType::BF16), &cfg);
    assert_eq!((r.finished, r.layers, r.cache_layers), (5, 3, 2), "{log}");
    assert!(r.passed() && r.checks.comparisons > 0, "{:?}\n{log}", r.checks);
    let per_layer = r.num_blocks * 16 * 8 * 128 * 2 * 2; // blocks x tokens x kv heads x d x (K, V) x bf16
    assert_eq!(r.cache_bytes, 2 * per_layer, "caches for layers 0 and 1 only");
    assert!(log.contains("layer 2 reads layer 1's cache and writes none") && log.contains("in 2 of the 3 layers"), "{log}");
    assert_eq!((r.checks.window.comparisons, r.checks.softcap.comparisons), (0, 0));
}

#[test]
fn the_new_models_run_a_few_steps_with_all_their_layers() {
    let cfg = SimConfig {
        workload: Workload { num_requests: 3, prompt_len: (2, 6), gen_len: (2, 3), initial: 3, max_arrivals_per_step: 1 },
        max_running: 3,
        token_budget: 8,
        num_layers: None,
        max_steps: 3,
        check_every: 1,
        check_layers: Some(vec![0, 7, 8, 15]),
        check_reqs: 2,
        check_tokens: 1,
        ..SimConfig::cpu_default()
    };
    for (model, caches, note) in [
        (SimModel::gemma2_2b(DType::BF16), 26, "sliding window 64 on the even layers"),
        (SimModel::kv_shared(DType::BF16), 8, "layers 8..=15 read layer 7's cache"),
        (SimModel::phi2(DType::BF16), 32, "head size 80, q bf16"),
        (SimModel::llama4_scout(DType::BF16), 48, "chunks of 40 positions on every layer but layers 3, 7, ..., 47"),
    ] {
        let (r, log) = run_on_cpu(&model, &cfg);
        assert_eq!((r.steps, r.layers, r.cache_layers), (3, model.num_layers, caches), "{log}");
        assert!(r.passed() && r.checks.comparisons > 0, "{:?}\n{log}", r.checks);
        assert!(log.contains(note), "{log}");
    }
}

#[test]
fn layer_specs_follow_the_models() {
    let g = SimModel::gemma2_2b(DType::BF16);
    assert_eq!((g.num_layers, g.config.num_q_heads, g.config.num_kv_heads, g.config.head_size), (26, 8, 4, 256));
    assert!(g.config.features.sliding_window && g.config.features.softcap);
    for (i, l) in g.layer_specs(26).iter().enumerate() {
        assert_eq!((l.opts.window, l.opts.softcap, l.kv_sharing_target), ((i % 2 == 0).then_some(4096), Some(50.0), None), "layer {i}");
        assert_eq!(l.opts.softmax_scale, 1.0 / 16.0);
    }
    let k = SimModel::kv_shared(DType::BF16);
    let targets: Vec<Option<usize>> = k.layer_specs(16).iter().map(|l| l.kv_sharing_target).collect();
    assert_eq!(targets, [vec![None; 8], vec![Some(7); 8]].concat());
    assert_eq!(k.layer_specs(1)[0].kv_sharing_target, None);
    assert!(k.layer_specs(3).iter().map(|l| l.kv_sharing_target).eq([None, None, Some(1)]));
    assert_eq!(SimModel::llama3_8b(DType::BF16).describe_layers(32), None);
    let l4 = SimModel::llama4_scout(DType::BF16);
    assert_eq!((l4.num_layers, l4.config.num_q_heads, l4.config.num_kv_heads, l4.config.head_size), (48, 40, 8, 128));
    for (i, l) in l4.layer_specs(48).iter().enumerate() {
        assert_eq!((l.opts.chunk_size, l.opts.window, l.opts.softcap), ((i % 4 != 3).then_some(8192), None, None), "layer {i}");
    }
    // The CPU preset's window and soft-cap replace the model's; a model without them gains none.
    let cpu = SimConfig::cpu_default();
    assert_eq!((cpu.run_model(&g).window, cpu.run_model(&g).softcap), (Some(64), Some(0.5)));
    assert_eq!(cpu.run_model(&k), k);
    assert_eq!((cpu.run_model(&l4).chunk, cpu.run_model(&g).chunk), (Some(40), None));
}

/// Random rows rounded to bf16 (as the simulator's pool): `n` of `width`.
fn bf16_rows(rng: &mut SplitMix, n: usize, width: usize) -> Vec<f64> {
    (0..n * width).map(|_| bf16::from_f32(rng.signed_unit()).to_f32() as f64).collect()
}

#[test]
fn an_ignored_window_or_softcap_would_fail_the_check_on_the_cpu_preset() {
    // Layer 0 of the Gemma-2-like model as the CPU preset plays it (window 64, soft-cap 0.5),
    // two query tokens at the end of 100 keys, as the pool's rows.
    let model = SimConfig::cpu_default().run_model(&SimModel::gemma2_2b(DType::BF16));
    let opts = model.layer_spec(0, 2).opts;
    assert_eq!((opts.window, opts.softcap), (Some(64), Some(0.5)));
    let shape = RefShape { q_heads: 8, kv_heads: 4, dk: 256, dv: 256 };
    let mut rng = SplitMix::new(11);
    let (q, k, v) = (bf16_rows(&mut rng, 2, 8 * 256), bf16_rows(&mut rng, 100, 4 * 256), bf16_rows(&mut rng, 100, 4 * 256));
    let want = reference_attention(shape, &opts, &q, &k, &v);
    let tol = tolerance(DType::BF16);
    for (what, ignored) in [("window", AttnOptions { window: None, ..opts }), ("soft-cap", AttnOptions { softcap: None, ..opts })] {
        let err = rel_error(&reference_attention(shape, &ignored, &q, &k, &v), &want);
        assert!(err > 3.0 * tol, "ignoring the {what}: rel error {err:.2e}, within {tol:.0e} of the check");
    }
    // Before the context passes the window, the window changes nothing.
    let n = 64 * 4 * 256;
    let short = |o: &AttnOptions| reference_attention(shape, o, &q, &k[..n], &v[..n]);
    assert_eq!(short(&opts), short(&AttnOptions { window: None, ..opts }));
}

/// One of the simulator's f64 attentions: (shape, options, q, k, v) -> out.
type RefFn = fn(RefShape, &AttnOptions, &[f64], &[f64], &[f64]) -> Vec<f64>;

/// `reference` (the simulator's f64 attention) against `attn_rs::cpu::prefill` with `causal`:
/// `nq` query tokens (the last of `nk`), 4 query heads over 2 kv heads of 16, random inputs; the
/// relative error between the two.
fn against_attn_rs_cpu(rng: &mut SplitMix, (nq, nk): (usize, usize), opts: &AttnOptions, causal: bool, reference: RefFn) -> f64 {
    let (hq, hkv, d) = (4, 2, REF_HEAD_SIZE);
    let q: Vec<f32> = (0..nq * hq * d).map(|_| rng.signed_unit()).collect();
    let k: Vec<f32> = (0..nk * hkv * d).map(|_| rng.signed_unit()).collect();
    let v: Vec<f32> = (0..nk * hkv * d).map(|_| rng.signed_unit()).collect();
    let f64s = |x: &[f32]| x.iter().map(|&y| y as f64).collect::<Vec<_>>();
    let got = reference(RefShape { q_heads: hq, kv_heads: hkv, dk: d, dv: d }, opts, &f64s(&q), &f64s(&k), &f64s(&v));
    let rows = RowsDesc::contiguous(nk, hkv, d);
    let want = cpu::prefill(&PrefillRef {
        q: &q,
        q_rows: RowsDesc::contiguous(nq, hq, d),
        kv: KvRef::Packed { k: &k, k_rows: rows, v: &v, v_rows: rows, key_start_loc: &[0, nk as i32] },
        head_size_v: d,
        query_start_loc: &[0, nq as i32],
        seq_lens: &[nk as i32],
        causal,
        opts: *opts,
        alibi_slopes: None,
        sinks: None,
        scales: None,
    })
    .unwrap();
    rel_error(&got, &want.out)
}

/// The head size of [`against_attn_rs_cpu`]'s inputs.
const REF_HEAD_SIZE: usize = 16;

#[test]
fn the_reference_masks_and_caps_as_attn_rs_cpu_does() {
    // Three requests' worth of shapes: windows shorter, equal to and longer than the context,
    // with and without a soft-cap, grouped heads; the last nq of nk tokens as queries. Then
    // chunked local attention.
    let mut rng = SplitMix::new(5);
    for (nq, nk, window, softcap) in
        [(3, 20, Some(7), Some(2.0)), (1, 9, Some(9), None), (4, 12, Some(30), Some(0.3)), (2, 15, None, Some(1.0))]
    {
        let opts = AttnOptions { window, softcap, softmax_scale: 0.6, ..AttnOptions::new(REF_HEAD_SIZE) };
        let err = against_attn_rs_cpu(&mut rng, (nq, nk), &opts, true, reference_attention);
        assert!(err < 1e-12, "{nq} of {nk}, window {window:?}, soft-cap {softcap:?}: rel error {err:.2e}");
    }
    // Chunks: queries across a chunk start, one at a chunk's first position, chunks of one
    // position, chunks longer than the context, and with a window as well.
    for (nq, nk, chunk, window) in [(5, 20, 7, None), (1, 15, 7, None), (3, 9, 1, None), (4, 12, 40, None), (6, 23, 8, Some(3))] {
        let opts = AttnOptions { chunk_size: Some(chunk), window, softmax_scale: 0.6, ..AttnOptions::new(REF_HEAD_SIZE) };
        let err = against_attn_rs_cpu(&mut rng, (nq, nk), &opts, true, reference_attention);
        assert!(err < 1e-12, "{nq} of {nk}, chunks of {chunk}, window {window:?}: rel error {err:.2e}");
    }
}

// ---------------------------------------------------------------------------------------------
// The Whisper-like encoder-decoder model
// ---------------------------------------------------------------------------------------------

/// The CPU preset's sizes for the Whisper-like model (two encoder layers, two decoder blocks,
/// encoder inputs of 75 tokens, decoder prompts of 1 to 8), fewer requests, checked often.
fn whisper_config() -> SimConfig {
    let cpu = SimConfig::cpu_default().with_encoder_decoder_prompts(&SimModel::whisper_small(DType::BF16));
    SimConfig { workload: Workload { num_requests: 8, gen_len: (2, 10), initial: 3, ..cpu.workload }, check_every: 2, seed: 5, ..cpu }
}

#[test]
fn whisper_like_model_passes_the_check_in_every_kind_of_layer() {
    let cfg = whisper_config();
    let model = SimModel::whisper_small(DType::BF16);
    let expected: usize = cfg.workload.generate(&mut SplitMix::new(cfg.seed)).iter().map(|r| r.total_tokens()).sum();
    let (r, log) = run_on_cpu(&model, &cfg);
    assert_eq!((r.finished, r.requests, r.layers, r.cache_layers, r.model_layers), (8, 8, 6, 6, 36), "{log}");
    assert_eq!(r.tokens(), expected, "every decoder token went through forward");
    assert_eq!((r.encoder_tokens, r.encoder_len), (8 * 75, Some(75)), "every request's encoder input, once");
    assert!(r.encoder_steps > 1 && r.max_encoder_tokens <= 150, "{log}");
    assert_eq!(r.check_layers, [0, 1, 2, 3, 4, 5], "every layer of each kind");
    let c = &r.checks;
    assert!(r.passed(), "{c:?}\n{log}");
    let self_attention = c.comparisons - c.encoder_comparisons - c.cross_comparisons;
    assert!(c.encoder_comparisons > 0 && c.cross_comparisons > 0 && self_attention > 0, "{c:?}\n{log}");
    // Not vacuous: a causal mask in the encoder or in a cross-attention prompt, or another
    // layer's encoder rows in a cross-attention layer, would have failed comparisons.
    assert_eq!(c.bidirectional.comparisons, c.encoder_comparisons + c.cross_comparisons);
    assert!(c.bidirectional.caught >= c.encoder_comparisons && c.bidirectional.caught < c.bidirectional.comparisons, "{c:?}");
    assert_eq!((c.cross_source.comparisons, c.cross_source.caught), (c.cross_comparisons, c.cross_comparisons), "{c:?}");
    assert_eq!((c.window.comparisons, c.softcap.comparisons), (0, 0));
    // Two pools, every cache sized for the larger (the encoder's: 3/4 of 8 inputs of 5 blocks).
    assert_eq!((r.num_blocks, r.pools), (30, Some((30, 12))));
    assert_eq!(r.cache_bytes, 6 * 30 * 16 * 12 * 64 * 2 * 2, "six caches: blocks x tokens x heads x d x (K, V) x bf16");
    assert!(
        log.contains("summary [whisper-small-like (encoder-decoder) on cpu]")
            && log.contains("layers 0 and 1 encoder")
            && log.contains("causal self-attention (layers 2 and 4)")
            && log.contains("filled by write_kv in the request's encoder step (layers 3 and 5)")
            && log.contains("two pools, 30 encoder blocks")
            && log.contains("encoder: ")
            && log.contains("reading another layer's encoder K/V in a cross-attention layer in"),
        "{log}"
    );
}

#[test]
fn whisper_like_model_splits_prompts_longer_than_its_encoder_and_takes_multi_token_decodes() {
    // The CPU preset's decoder prompts (16 to 96 tokens) against encoder inputs of 20: a
    // request's query tokens in a step stay within 20 (the cross-attention step's sequences
    // must hold them); decodes of up to 4 tokens; f32 and f16.
    for (dtype, threshold) in [(DType::F32, 4), (DType::F16, 1)] {
        let cfg = SimConfig {
            workload: Workload { num_requests: 4, prompt_len: (16, 50), gen_len: (1, 4), initial: 2, max_arrivals_per_step: 2 },
            encoder_len: Some(20),
            encoder_budget: 1,
            decode_threshold: threshold,
            check_every: 1,
            seed: 9,
            ..SimConfig::cpu_default()
        };
        let (r, log) = run_on_cpu(&SimModel::whisper_small(dtype), &cfg);
        assert_eq!(r.finished, 4, "{log}");
        assert!(r.passed() && r.checks.cross_comparisons > 0 && r.checks.encoder_comparisons > 0, "{:?}\n{log}", r.checks);
        assert_eq!(r.max_encoder_tokens, 20, "a budget below one input takes one a step");
        assert!(r.max_batch_tokens <= cfg.token_budget);
    }
}

#[test]
fn whisper_like_model_runs_a_few_steps_with_all_its_layers() {
    let cfg = SimConfig {
        workload: Workload { num_requests: 3, prompt_len: (1, 4), gen_len: (2, 3), initial: 3, max_arrivals_per_step: 1 },
        max_running: 3,
        token_budget: 8,
        num_layers: None,
        encoder_len: Some(33),
        max_steps: 3,
        check_every: 1,
        check_reqs: 2,
        check_tokens: 1,
        ..SimConfig::cpu_default()
    };
    let (r, log) = run_on_cpu(&SimModel::whisper_small(DType::BF16), &cfg);
    assert_eq!((r.steps, r.layers, r.cache_layers), (3, 36, 36), "{log}");
    assert_eq!(r.check_layers, [0, 11, 12, 13, 34, 35]);
    assert!(r.passed() && r.checks.encoder_comparisons > 0 && r.checks.cross_comparisons > 0, "{:?}\n{log}", r.checks);
    assert!(
        log.contains("layers 0..=11 encoder") && log.contains("layers 12, 14, ..., 34") && log.contains("layers 13, 15, ..., 35"),
        "{log}"
    );
}

#[test]
fn whisper_layer_specs_follow_the_model() {
    let w = SimModel::whisper_small(DType::BF16);
    let c = &w.config;
    assert_eq!((w.num_layers, c.num_q_heads, c.num_kv_heads, c.head_size, c.block_size, w.encoder_len), (12, 12, 12, 64, 16, Some(1500)));
    assert_eq!((w.attention_layers(12), w.attention_layers(2)), (36, 6));
    let specs = w.layer_specs(12);
    assert_eq!(specs.len(), 36);
    for (i, l) in specs.iter().enumerate() {
        let kind = match i {
            0..12 => AttentionType::Encoder,
            _ if i % 2 == 0 => AttentionType::Decoder,
            _ => AttentionType::EncoderDecoder,
        };
        assert_eq!((l.attn_type, l.kv_sharing_target, l.opts.softmax_scale), (kind, None, 0.125), "layer {i}");
        assert_eq!((l.opts.window, l.opts.softcap, l.alibi, l.sinks), (None, None, false, false));
    }
    assert_eq!(w.default_check_layers(12), [0, 11, 12, 13, 34, 35]);
    assert_eq!(w.default_check_layers(1), [0, 1, 2]);
    // Another layer's encoder keys: the next cross-attention layer's, the previous for the
    // last, the encoder's with one decoder block.
    assert_eq!((Checker::other_source(13, 12), Checker::other_source(35, 12), Checker::other_source(2, 1)), (15, 33, 0));
    // The CPU preset's encoder length replaces the model's; decoder-only models gain none.
    let cpu = SimConfig::cpu_default();
    assert_eq!(cpu.run_model(&w).encoder_len, Some(75));
    assert_eq!(cpu.run_model(&SimModel::llama3_8b(DType::BF16)).encoder_len, None);
    assert_eq!(cpu.clone().with_encoder_decoder_prompts(&w).workload.prompt_len, (1, 8));
    assert_eq!(cpu.clone().with_encoder_decoder_prompts(&SimModel::llama3_8b(DType::BF16)), cpu);
    // GPU preset: encoder steps of four 1500-token inputs; the encoder pool the larger.
    let gpu = SimConfig::gpu_default().with_encoder_decoder_prompts(&w);
    assert_eq!(gpu.max_encoder_step(&w), 6000);
    assert_eq!((gpu.encoder_blocks(&w, 16), gpu.blocks(16)), (Some(64 * 94 * 3 / 4), 64 * 17 * 3 / 4));
}

#[test]
fn a_causal_mask_or_another_layers_encoder_rows_would_fail_the_cross_attention_check() {
    // A Whisper cross-attention layer (12 heads of 64, scale 1/8) on the pool's bf16 rows: a
    // prompt of 5 query tokens over the 75 encoder rows its write_kv wrote, and another layer's.
    let w = SimConfig::cpu_default().run_model(&SimModel::whisper_small(DType::BF16));
    let opts = w.layer_spec(3, 2).opts;
    assert_eq!(w.layer_kind(3, 2), AttentionType::EncoderDecoder);
    let shape = RefShape { q_heads: 12, kv_heads: 12, dk: 64, dv: 64 };
    let mut rng = SplitMix::new(21);
    let width = 12 * 64;
    let (q, k, v) = (bf16_rows(&mut rng, 5, width), bf16_rows(&mut rng, 75, width), bf16_rows(&mut rng, 75, width));
    let (k2, v2) = (bf16_rows(&mut rng, 75, width), bf16_rows(&mut rng, 75, width));
    let want = reference_attention_bidirectional(shape, &opts, &q, &k, &v);
    let tol = tolerance(DType::BF16);
    let causal = rel_error(&reference_attention(shape, &opts, &q, &k, &v), &want);
    let other = rel_error(&reference_attention_bidirectional(shape, &opts, &q, &k2, &v2), &want);
    assert!(causal > 3.0 * tol, "a causal mask: rel error {causal:.2e}, within {tol:.0e} of the check");
    assert!(other > 3.0 * tol, "another layer's rows: rel error {other:.2e}, within {tol:.0e} of the check");
    // The first of an encoder's query tokens, causal, would see one key of 75.
    let first = rel_error(&reference_attention(shape, &opts, &q[..width], &k[..width], &v[..width]), &want[..width]);
    assert!(first > 3.0 * tol, "{first:.2e}");
    // A single decoder token (a decode) at the end of the encoder's keys sees them all either
    // way: only prompts tell a causal mask apart, as the run's counts show.
    let last = &q[4 * width..];
    assert_eq!(reference_attention(shape, &opts, last, &k, &v), reference_attention_bidirectional(shape, &opts, last, &k, &v));
}

#[test]
fn the_bidirectional_reference_matches_attn_rs_cpu_without_the_causal_mask() {
    let mut rng = SplitMix::new(8);
    for (nq, nk, softcap) in [(3, 20, None), (1, 9, Some(0.7)), (5, 5, None)] {
        let opts = AttnOptions { softcap, softmax_scale: 0.6, ..AttnOptions::new(REF_HEAD_SIZE) };
        let err = against_attn_rs_cpu(&mut rng, (nq, nk), &opts, false, reference_attention_bidirectional);
        assert!(err < 1e-12, "{nq} of {nk}, soft-cap {softcap:?}: rel error {err:.2e}");
    }
}
