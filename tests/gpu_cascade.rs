//! Cascade attention on the GPU against the plain path: the same step (requests sharing the
//! first blocks of their block tables, then suffixes of mixed lengths; decodes and chunked
//! prefills) through two `tensor-core` Attentions, one with cascade forced on and one with it
//! off, over identical caches. Shared prefixes of 0, 1, 16, 1000 and 8192 tokens (whole blocks
//! are shared: 1 token shares none, 1000 share 62 blocks); the outputs must agree within the
//! dtype's rounding, the caches bit for bit, and the detected prefix must be the shared blocks.

mod common;

use attn_rs::backend::{select_backend_no_env, DeviceInfo, ModelConfig};
use attn_rs::forward::{Attention, ForwardConfig, ForwardLimits, GpuHandles, GpuLayer, LayerIo, NewKv};
use attn_rs::metadata::{CascadeMode, StepInput};
use attn_rs::{DType, DevIn, DevOut, KvLayout, RowsDesc};
use common::*;
use half::bf16;
use libtest_mimic::Trial;
use rand::seq::SliceRandom;

const BS: usize = 16;

#[derive(Clone, Debug)]
struct Case {
    hq: usize,
    hkv: usize,
    d: usize,
    prefix_tokens: usize,
    /// Per request: (query tokens, own tokens after the shared prefix, this step's included).
    reqs: Vec<(usize, usize)>,
    mode: CascadeMode,
}

fn cascade_case(c: Case, salt: u64) -> TestResult {
    let mut rng = rng(salt);
    let dev = arc_device();
    let stream = dev.context().new_stream()?;
    let model = ModelConfig::standard(c.hq, c.hkv, c.d, DType::BF16, BS, KvLayout::FlashNhd);
    let sel = select_backend_no_env(&model, &DeviceInfo::from_device(&dev), None)?;
    let shared = c.prefix_tokens / BS;
    let own_blocks: Vec<usize> = c.reqs.iter().map(|&(_, own)| (c.prefix_tokens % BS + own).div_ceil(BS)).collect();
    let num_blocks = shared + own_blocks.iter().sum::<usize>() + 16;
    let max_len = c.prefix_tokens + c.reqs.iter().map(|r| r.1).max().unwrap_or(0);
    let nt: usize = c.reqs.iter().map(|r| r.0).sum();
    let limits = ForwardLimits { max_num_tokens: nt.max(1), max_num_reqs: c.reqs.len(), max_model_len: max_len };
    let config = |mode| ForwardConfig { cascade: mode, ..ForwardConfig::new(model, num_blocks, limits) };
    let handles = GpuHandles { dev: dev.clone(), stream: stream.clone() };
    let mut on = Attention::new(&sel, config(c.mode), Some(handles.clone()))?;
    let mut off = Attention::new(&sel, config(CascadeMode::Off), Some(handles))?;

    // Block tables: the shared blocks first, then each request's own (scattered).
    let mut pool: Vec<i32> = (0..num_blocks as i32).collect();
    pool.shuffle(&mut rng);
    let prefix_row: Vec<i32> = pool.drain(..shared).collect();
    let stride = shared + own_blocks.iter().max().unwrap_or(&0) + 1;
    let mut table = vec![-1; c.reqs.len() * stride];
    let (mut qsl, mut seq_lens, mut slots) = (vec![0i32], Vec::new(), Vec::new());
    for (r, &(q, own)) in c.reqs.iter().enumerate() {
        let row = &mut table[r * stride..][..shared + own_blocks[r]];
        row[..shared].copy_from_slice(&prefix_row);
        for b in &mut row[shared..] {
            *b = pool.pop().expect("blocks");
        }
        let len = c.prefix_tokens + own;
        for pos in len - q..len {
            slots.push(row[pos / BS] as i64 * BS as i64 + (pos % BS) as i64);
        }
        qsl.push(qsl[r] + q as i32);
        seq_lens.push(len as i32);
    }
    let input = StepInput {
        query_start_loc: &qsl,
        seq_lens: &seq_lens,
        block_table: &table,
        block_table_stride: stride,
        slot_mapping: &slots,
        num_actual_tokens: nt,
        num_blocks,
        block_size: BS,
    };
    let (mut step_on, mut step_off) = (on.new_step_metadata()?, off.new_step_metadata()?);
    step_on.build(&input)?;
    step_off.build(&input)?;
    let want_blocks = if c.mode == CascadeMode::Off || shared == 0 { None } else { Some(shared) };
    if step_on.cascade_prefix().map(|p| p.blocks) != want_blocks || step_off.cascade_prefix().is_some() {
        return Err(format!(
            "cascade prefix {:?} (want {want_blocks:?} blocks), off: {:?}",
            step_on.cascade_prefix(),
            step_off.cascade_prefix()
        )
        .into());
    }

    let init: Vec<bf16> = random_vec(&mut rng, on.cache_spec().num_elements(), 1.0);
    let (mut cache_on, mut cache_off) = (upload(&stream, &init), upload(&stream, &init));
    let (wq, wkv) = (c.hq * c.d, c.hkv * c.d);
    let data = upload(&stream, &random_vec::<bf16>(&mut rng, nt * (wq + 2 * wkv), 1.0));
    let (k, v) = (data.slice(wq..), data.slice(wq + wkv..));
    let width = wq + 2 * wkv;
    let q_rows = RowsDesc { num_tokens: nt, num_heads: c.hq, head_size: c.d, token_stride: width, head_stride: c.d };
    let kv_rows = RowsDesc { num_tokens: nt, num_heads: c.hkv, head_size: c.d, token_stride: width, head_stride: c.d };
    let out_rows = RowsDesc::contiguous(nt, c.hq, c.d);
    let mut outs = [poison::<bf16>(); 2].map(|p| upload(&stream, &vec![p; out_rows.required_len()]));
    let [out_on, out_off] = &mut outs;
    for (attn, step, cache, out) in [(&mut on, &step_on, &mut cache_on, out_on), (&mut off, &step_off, &mut cache_off, out_off)] {
        attn.forward(
            step,
            LayerIo::Gpu(GpuLayer {
                q: DevIn::new(&data, &stream),
                q_rows,
                new_kv: NewKv::Standard { k: DevIn::new(&k, &stream), k_rows: kv_rows, v: DevIn::new(&v, &stream), v_rows: kv_rows },
                cache: DevOut::new(cache, &stream),
                out: DevOut::new(out, &stream),
                out_rows,
                alibi_slopes: None,
                sinks: None,
                kv_scales: None,
            }),
        )?;
        attn.check_status()?;
    }
    let to_f64 = |o| download(&stream, o).iter().map(|x: &bf16| x.to_f32() as f64).collect::<Vec<_>>();
    let (got, want) = (to_f64(&outs[0]), to_f64(&outs[1]));
    for (r, w) in qsl.windows(2).enumerate() {
        let span = w[0] as usize * c.hq * c.d..w[1] as usize * c.hq * c.d;
        let err = rel_error(&got[span.clone()], &want[span]);
        if !within(err, tolerance(DType::BF16)) {
            return Err(format!("request {r} ({:?}): cascade vs plain rel error {err:.3e}", c.reqs[r]).into());
        }
    }
    let mismatched = bitwise_mismatches(&download(&stream, &cache_on), &download(&stream, &cache_off), |x| x.to_bits() as u64);
    if !mismatched.is_empty() {
        return Err(format!("caches differ: {mismatched:?}").into());
    }
    Ok(())
}

fn main() {
    // Decodes (one and several query tokens) first, then chunked prefills; suffixes from
    // exactly the query tokens to long ones.
    let mixed = vec![(1, 1), (1, 7), (1, 300), (1, 33), (4, 4), (2, 1000), (20, 20), (50, 700)];
    let case = |prefix_tokens, mode| Case { hq: 32, hkv: 8, d: 128, prefix_tokens, reqs: mixed.clone(), mode };
    let mut cases: Vec<(String, Case)> =
        [0, 1, 16, 1000, 8192].into_iter().map(|p| (format!("prefix_{p}_gqa4_d128"), case(p, CascadeMode::On))).collect();
    cases.push(("prefix_1000_mha_d64".into(), Case { hq: 8, hkv: 8, d: 64, ..case(1000, CascadeMode::On) }));
    cases.push(("prefix_4096_gqa8_d256".into(), Case { hq: 16, hkv: 2, d: 256, ..case(4096, CascadeMode::On) }));
    // Auto picks cascade: 8 requests, a long prefix, decode-sized queries.
    let decodes: Vec<(usize, usize)> = (0..12).map(|i| (1, 1 + 37 * i)).collect();
    cases.push(("auto_12_decodes_prefix_2048".into(), Case { reqs: decodes, ..case(2048, CascadeMode::Auto) }));
    if quick() {
        cases.retain(|(n, _)| n.contains("1000_gqa4") || n.contains("auto"));
    }
    let trials = cases
        .into_iter()
        .enumerate()
        .map(|(i, (n, c))| Trial::test(format!("cascade::{n}"), move || cascade_case(c, 8000 + i as u64)))
        .collect();
    run_gpu_trials(trials)
}
