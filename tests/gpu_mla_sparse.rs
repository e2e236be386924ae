//! GPU sparse MLA (each query token attends its own top-k list of positions) against the f64
//! CPU reference, on random data with poisoned outputs and scattered block tables: k of 1, 7,
//! 64 and 2048, lists in random order with -1 padding and (where said) entries outside their
//! request, which must be skipped and named in the status word; 16 and 128 heads, bf16 and f16
//! queries over 16-bit and FP8 caches, several query tokens a request (each its own list),
//! planned and forced splits (the merge), a token whose list has nothing to read, block size
//! 16, a bad block id, and index rows farther apart than k (the gap never read).
//!
//! Bounds: the relative error of the whole output within `tolerance` of the query dtype (bf16
//! 1e-2, f16 3e-3) and every (token, head) row within twice that. The FP8 cases use the same
//! bounds: the reference reads the same E4M3 values, which the kernel converts to the query's
//! type exactly, so what is left is the rounding of the weights and products, as for 16-bit
//! caches.

mod common;

use attn_rs::cache_write::KvScales;
use attn_rs::decode::DecodeWorkspace;
use attn_rs::mla::{mla_sparse_attention, MlaArgs, SparseIndexArgs};
use attn_rs::MlaCacheSpec;
use attn_rs::{cpu, AttnError, BatchMetadata, DevIn, DevOut, DeviceStatus, Element, Fp8E4m3, Fp8E5m2, RowsDesc};
use attn_rs::{AttnOptions, PlanOptions, SplitMode, Tuning};
use common::*;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use libtest_mimic::Trial;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::Rng;

const QK: usize = 576;
const V: usize = 512;

/// What an entry of an index row is made to hold besides positions of its request.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Bad {
    /// Only positions and -1.
    None,
    /// One entry of the second token: its request's length (one past its last position).
    OnePastEnd,
    /// Several tokens each get an entry outside (past the end, far past it, negative other
    /// than -1).
    Several,
}

#[derive(Clone, Debug)]
struct Case {
    heads: usize,
    block_size: usize,
    seq_lens: Vec<i32>,
    q_lens: Vec<i32>,
    topk: usize,
    /// Elements between index rows past `topk` (filled with values that must not be read).
    row_gap: usize,
    /// Share of each row that is -1 padding (at least what the request's length leaves).
    padding: f64,
    bad: Bad,
    bad_block: bool,
    /// The first token's list is all -1: zeros and an LSE of -inf.
    empty_token: bool,
    split: SplitMode,
}

impl Case {
    fn new(heads: usize, seq_lens: &[i32], topk: usize) -> Self {
        Case {
            heads,
            block_size: 64,
            seq_lens: seq_lens.to_vec(),
            q_lens: vec![1; seq_lens.len()],
            topk,
            row_gap: 0,
            padding: 0.0,
            bad: Bad::None,
            bad_block: false,
            empty_token: false,
            split: SplitMode::Auto,
        }
    }
}

/// Each token's index row: up to `topk` distinct positions of its request (fewer where the
/// request is shorter, or where `padding` asks), the rest -1, shuffled; then the gap after it.
fn index_rows(rng: &mut SmallRng, c: &Case, qsl: &[i32]) -> (Vec<i32>, usize) {
    let stride = c.topk + c.row_gap;
    let nt = *qsl.last().unwrap() as usize;
    // The gap holds values no list may hold: reading one would show (status or output).
    let mut rows = vec![i32::MIN + 7; nt * stride];
    for (r, &len) in c.seq_lens.iter().enumerate() {
        for token in qsl[r] as usize..qsl[r + 1] as usize {
            let mut positions: Vec<i32> = (0..len).collect();
            positions.shuffle(rng);
            // At least one position (k = 1 with padding would otherwise list nothing).
            let keep = ((c.topk as f64 * (1.0 - c.padding)).ceil() as usize).min(len as usize);
            let mut row: Vec<i32> = positions[..keep].to_vec();
            row.resize(c.topk, -1);
            row.shuffle(rng);
            if c.empty_token && token == 0 {
                row.fill(-1);
            }
            rows[token * stride..token * stride + c.topk].copy_from_slice(&row);
        }
    }
    let token_len = |t: usize| {
        let r = (0..c.seq_lens.len()).find(|&r| (qsl[r] as usize..qsl[r + 1] as usize).contains(&t)).unwrap();
        c.seq_lens[r]
    };
    match c.bad {
        Bad::None => {}
        Bad::OnePastEnd => {
            let t = 1.min(nt - 1);
            let at = rng.random_range(0..c.topk);
            rows[t * stride + at] = token_len(t);
        }
        Bad::Several => {
            for t in 0..nt {
                let at = rng.random_range(0..c.topk);
                rows[t * stride + at] = match t % 3 {
                    0 => token_len(t),
                    1 => i32::MAX,
                    _ => -2 - t as i32,
                };
            }
        }
    }
    (rows, stride)
}

fn sparse_case<Q: Element, C: Element>(c: Case, salt: u64) -> TestResult {
    let mut rng = rng(salt);
    let stream = new_stream();
    let fp8 = C::DTYPE.is_fp8();
    let hq = c.heads;
    let BlockTables { table: block_table, stride, num_blocks } =
        scattered_block_tables(&mut rng, &c.seq_lens, c.block_size, 2, c.bad_block);
    let spec = MlaCacheSpec::deepseek(num_blocks, c.block_size)?;
    let mut qsl = vec![0i32];
    for &q in &c.q_lens {
        qsl.push(qsl.last().unwrap() + q);
    }
    let nt = *qsl.last().unwrap() as usize;
    let (indices, row_stride) = index_rows(&mut rng, &c, &qsl);
    let (q_rows, out_rows) = (RowsDesc::contiguous(nt, hq, QK), RowsDesc::contiguous(nt, hq, V));
    let q: Vec<Q> = random_vec(&mut rng, q_rows.required_len().max(1), 1.0);
    let cache: Vec<C> = random_vec(&mut rng, spec.num_elements(), if fp8 { 20.0 } else { 1.0 });
    let scale = 0.05f32;
    let opts = AttnOptions::new(QK);

    let want = cpu::mla_sparse_attention(&cpu::SparseMlaRef {
        q: &q,
        q_rows,
        cache: &cache,
        spec,
        block_table: &block_table,
        block_table_stride: stride,
        query_start_loc: &qsl,
        seq_lens: &c.seq_lens,
        indices: &indices,
        topk: c.topk,
        row_stride,
        softmax_scale: opts.softmax_scale,
        scale: fp8.then_some(scale),
    })?;
    if (c.bad != Bad::None) != (want.bad_indices > 0) || c.bad_block != (want.bad_blocks > 0) {
        return Err(format!(
            "the case's bad entries were not met by the reference: {} indices, {} blocks",
            want.bad_indices, want.bad_blocks
        )
        .into());
    }

    let (q_d, cache_d, bt_d, idx_d) =
        (upload(&stream, &q), upload(&stream, &cache), upload(&stream, &block_table), upload(&stream, &indices));
    let scale_d = upload(&stream, &[scale]);
    let mut out_d: CudaSlice<Q> = upload(&stream, &vec![poison::<Q>(); out_rows.required_len().max(1)]);
    let mut lse_d: CudaSlice<f32> = upload(&stream, &vec![f32::NAN; (nt * hq).max(1)]);
    // One request a query token in the plan: the workspace holds `nt` of each.
    let mut ws = DecodeWorkspace::new(&stream, 4096 * hq, V, nt, nt)?;
    let mut status = DeviceStatus::new(&stream)?;
    let batch = BatchMetadata::new(&stream, &c.seq_lens, &qsl)?;
    let args = MlaArgs {
        q: DevIn::new(&q_d, &stream),
        q_rows,
        cache: DevIn::new(&cache_d, &stream),
        spec,
        block_table: DevIn::new(&bt_d, &stream),
        block_table_stride: stride,
        out: DevOut::new(&mut out_d, &stream),
        out_rows,
        lse: Some(DevOut::new(&mut lse_d, &stream)),
        scales: fp8.then(|| KvScales { k: DevIn::new(&scale_d, &stream), v: DevIn::new(&scale_d, &stream) }),
    };
    let idx = SparseIndexArgs { indices: DevIn::new(&idx_d, &stream), topk: c.topk, row_stride };
    let plan_options = PlanOptions { split: c.split, tuning: Tuning::DEFAULT };
    let plan = mla_sparse_attention(device(), &stream, args, idx, &batch, opts.softmax_scale, plan_options, &mut ws, &mut status)?;
    // Forced splits: one (no merge) or several (partials and the merge, over tokens).
    if let SplitMode::Fixed(n) = c.split {
        let split = plan.req_num_splits.iter().any(|&s| s > 1);
        if split != (n > 1) || plan.req_num_splits.len() != nt {
            return Err(format!("forced {n} splits, the plan has {:?} (chunk {})", plan.req_num_splits, plan.chunk).into());
        }
    }

    let flags = status.take(&stream)?;
    check_index_status(flags, &want, &indices, row_stride, &c.seq_lens, &qsl)?;
    if flags.block_out_of_range() != (want.bad_blocks > 0) {
        return Err(format!("status {flags:?}, the reference skipped {} entries of bad blocks", want.bad_blocks).into());
    }

    // The narrow shape over an FP8 cache on sm_90a rounds queries and weights to e4m3.
    let e4m3 = fp8 && attn_rs::mla::fp8_mla_rounds_to_e4m3(device());
    let (out, lse): (Vec<Q>, Vec<f32>) = (download(&stream, &out_d), download(&stream, &lse_d));
    check_latent_output(&out, &lse, (&want.out, &want.lse), (nt, hq, V), e4m3, &plan)
}

/// The index bit is raised exactly when the reference skipped entries outside their requests;
/// the recorded offence (if the index one won the record) names an entry that holds that value
/// and is outside its request of that length; with one bad entry in the tensor, the reference's.
fn check_index_status(
    flags: attn_rs::StatusFlags,
    want: &cpu::SparseResult,
    indices: &[i32],
    row_stride: usize,
    seq_lens: &[i32],
    qsl: &[i32],
) -> Result<(), String> {
    if flags.index_out_of_range() != (want.bad_indices > 0) {
        return Err(format!("status {flags:?}, the reference skipped {} entries outside their requests", want.bad_indices));
    }
    if want.bad_indices == 0 {
        return match flags.first_bad_index() {
            None => Ok(()),
            Some(b) => Err(format!("status records {b:?} with no bad index")),
        };
    }
    // The index offence is the only one recorded by the sparse kernel (block ids raise the bit
    // alone), so it must be there.
    let Some(first) = flags.first_bad_index() else { return Err(format!("status {flags:?}: the index bit without its record")) };
    let t = first.token as usize;
    let held = indices.get(t * row_stride + first.entry as usize).copied();
    let req = (0..seq_lens.len()).find(|&r| (qsl[r] as usize..qsl[r + 1] as usize).contains(&t));
    let len = req.map(|r| seq_lens[r] as u64);
    let outside = first.index != -1 && (first.index < 0 || Some(first.index as u64) >= len);
    if held.map(i64::from) != Some(first.index) || len != Some(first.seq_len) || !outside || first.entry as usize >= row_stride {
        return Err(format!("status names {first:?}, but that entry holds {held:?} (request length {len:?})"));
    }
    if want.bad_indices == 1 && want.first_bad_index != Some(first) {
        return Err(format!("status names {first:?}, the reference met {:?}", want.first_bad_index));
    }
    match flags.into_result() {
        Err(AttnError::IndexOutOfRange { first: Some(f) }) if f == first => Ok(()),
        other => Err(format!("into_result gave {other:?} for {flags:?}")),
    }
}

fn cases() -> Vec<(String, Case, &'static str)> {
    let mut v: Vec<(String, Case, &'static str)> = Vec::new();
    let mut push = |name: &str, c: Case, dt: &'static str| v.push((name.to_string(), c, dt));
    let lens = [1, 63, 700, 5000];
    for heads in [16, 128] {
        for topk in [1, 7, 64, 2048] {
            push(&format!("bf16::heads_{heads}_k_{topk}"), Case { padding: 0.1, ..Case::new(heads, &lens, topk) }, "bf16");
        }
    }
    push("f16::heads_16_k_2048", Case::new(16, &[2048, 3000, 9000], 2048), "f16");
    push("bf16_fp8::heads_16_k_2048", Case { padding: 0.2, ..Case::new(16, &[100, 2500, 8192], 2048) }, "bf16_fp8");
    push("bf16_fp8::heads_128_k_2048", Case::new(128, &[4000, 2100], 2048), "bf16_fp8");
    push("f16_fp8::heads_128_k_64", Case::new(128, &[64, 65, 1000], 64), "f16_fp8");
    push("f16_fp8::heads_16_k_7", Case::new(16, &[5, 300], 7), "f16_fp8");
    push("bf16::mtp_3_heads_16", Case { q_lens: vec![3, 1, 2], ..Case::new(16, &[3, 900, 4000], 300) }, "bf16");
    push("bf16::mtp_2_heads_128", Case { q_lens: vec![2, 2], ..Case::new(128, &[50, 3000], 2048) }, "bf16");
    push("bf16::padding_half", Case { padding: 0.5, ..Case::new(16, &[6000, 3000], 2048) }, "bf16");
    push("bf16::empty_list", Case { empty_token: true, ..Case::new(16, &[500, 80], 64) }, "bf16");
    push(
        "bf16::empty_list_heads_128_split",
        Case { empty_token: true, split: SplitMode::Fixed(4), ..Case::new(128, &[5000, 80], 2048) },
        "bf16",
    );
    push("bf16::index_one_past_end", Case { bad: Bad::OnePastEnd, ..Case::new(16, &[700, 300], 256) }, "bf16");
    push("bf16::indices_outside_several", Case { bad: Bad::Several, ..Case::new(16, &[700, 300, 5000, 20], 2048) }, "bf16");
    push("bf16_fp8::indices_outside_heads_128", Case { bad: Bad::Several, ..Case::new(128, &[300, 2000], 64) }, "bf16_fp8");
    push("bf16::bad_block_id", Case { bad_block: true, ..Case::new(16, &[200, 40], 128) }, "bf16");
    push("bf16::bad_block_and_index", Case { bad_block: true, bad: Bad::OnePastEnd, ..Case::new(16, &[200, 90], 128) }, "bf16");
    push("bf16::forced_split_1", Case { split: SplitMode::Fixed(1), ..Case::new(16, &[3000, 10], 2048) }, "bf16");
    push("bf16::forced_split_4", Case { split: SplitMode::Fixed(4), ..Case::new(16, &[8192, 3000], 2048) }, "bf16");
    push("bf16_fp8::forced_split_8_heads_128", Case { split: SplitMode::Fixed(8), ..Case::new(128, &[8192], 2048) }, "bf16_fp8");
    push("bf16::block_size_16", Case { block_size: 16, ..Case::new(16, &[1, 77, 500], 100) }, "bf16");
    push("bf16::row_gap", Case { row_gap: 13, padding: 0.3, ..Case::new(16, &[1000, 64], 99) }, "bf16");
    push("bf16::heads_8", Case::new(8, &[700, 3000], 512), "bf16");
    push("bf16::heads_64", Case::new(64, &[700, 3000], 512), "bf16");
    push("bf16_e5m2::heads_16_k_2048", Case { padding: 0.2, ..Case::new(16, &[100, 2500, 8192], 2048) }, "bf16_e5m2");
    push("f16_e5m2::heads_128_k_64", Case::new(128, &[64, 65, 1000], 64), "f16_e5m2");
    v
}

fn main() {
    let mut trials = Vec::new();
    let all = cases();
    let picked: Vec<_> = if quick() { all.into_iter().step_by(4).collect() } else { all };
    for (i, (name, case, dt)) in picked.into_iter().enumerate() {
        let s = 7000 + i as u64;
        let f: Box<dyn FnOnce() -> TestResult + Send> = match dt {
            "bf16" => Box::new(move || sparse_case::<bf16, bf16>(case, s)),
            "f16" => Box::new(move || sparse_case::<f16, f16>(case, s)),
            "bf16_fp8" => Box::new(move || sparse_case::<bf16, Fp8E4m3>(case, s)),
            "f16_fp8" => Box::new(move || sparse_case::<f16, Fp8E4m3>(case, s)),
            "bf16_e5m2" => Box::new(move || sparse_case::<bf16, Fp8E5m2>(case, s)),
            "f16_e5m2" => Box::new(move || sparse_case::<f16, Fp8E5m2>(case, s)),
            other => unreachable!("dtype pair {other}"),
        };
        trials.push(Trial::test(format!("mla_sparse::{name}"), f));
    }
    run_gpu_trials(trials)
}
