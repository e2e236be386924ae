//! Calls through the safe API that used to make a kernel touch memory outside its buffers, now
//! refused before any launch, naming the argument: device metadata that disagrees with the host
//! batch (it can no longer be passed: the library uploads it), a plan used with another layer
//! shape, a misaligned cache, and library memory used from another stream than its own. Each
//! case also checks that the refused call wrote nothing (its output stays poisoned).

mod common;

use attn_rs::batch_plan::{paged_decode_planned, BatchPlan};
use attn_rs::cache_write::KvScales;
use attn_rs::decode::{paged_decode, DecodeArgs, DecodeWorkspace};
use attn_rs::prefill::{prefill, PrefillArgs, PrefillKv, PrefillOptions, PrefillWorkspace};
use attn_rs::{AttnError, BatchMetadata, DType, DevIn, DevOut, DeviceStatus, Fp8E4m3, KvCacheSpec, KvLayout, RowsDesc};
use attn_rs::{AttnOptions, SplitMode};
use common::*;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use libtest_mimic::Trial;
use std::sync::Arc;

const D: usize = 128;
const BLOCKS: usize = 16;

/// A small decode setup on one stream: 8 kv heads of size 128, one request's table of 4
/// blocks, 16-bit and FP8 caches. The output buffer is the caller's (`Setup::out`).
struct Setup {
    stream: Arc<CudaStream>,
    spec: KvCacheSpec,
    cache: CudaSlice<bf16>,
    fp8_cache: CudaSlice<Fp8E4m3>,
    table: CudaSlice<i32>,
    q: CudaSlice<bf16>,
    scale: CudaSlice<f32>,
}

impl Setup {
    fn new(max_heads: usize) -> Result<Self, Box<dyn std::error::Error>> {
        let stream = new_stream();
        let mut rng = rng(max_heads as u64);
        let spec = KvCacheSpec::new(KvLayout::FlashNhd, BLOCKS, 16, 8, D)?;
        let cache = upload(&stream, &random_vec::<bf16>(&mut rng, spec.num_elements(), 1.0));
        let fp8_cache = upload(&stream, &random_vec::<Fp8E4m3>(&mut rng, spec.num_elements(), 40.0));
        let table = upload(&stream, &[3i32, 1, 4, 0]);
        let q = upload(&stream, &random_vec::<bf16>(&mut rng, max_heads * D, 1.0));
        let scale = upload(&stream, &[0.05f32]);
        Ok(Setup { stream, spec, cache, fp8_cache, table, q, scale })
    }

    /// A poisoned output of one token of `hq` heads.
    fn out(&self, hq: usize) -> CudaSlice<bf16> {
        upload(&self.stream, &vec![poison::<bf16>(); hq * D])
    }

    /// Decode arguments of `hq` query heads over one token, reading `cache`.
    fn args<'a>(&'a self, hq: usize, cache: DevIn<'a>, out: &'a mut CudaSlice<bf16>) -> DecodeArgs<'a> {
        let s = &self.stream;
        let rows = RowsDesc::contiguous(1, hq, D);
        let fp8 = cache.dtype().is_fp8();
        DecodeArgs {
            q: DevIn::new(&self.q, s),
            q_rows: rows,
            cache,
            spec: self.spec,
            block_table: DevIn::new(&self.table, s),
            block_table_stride: 4,
            out: DevOut::new(out, s),
            out_rows: rows,
            lse: None,
            alibi_slopes: None,
            sinks: None,
            scales: fp8.then(|| KvScales { k: DevIn::new(&self.scale, s), v: DevIn::new(&self.scale, s) }),
        }
    }

    fn bf16(&self) -> DevIn<'_> {
        DevIn::new(&self.cache, &self.stream)
    }

    /// Fails unless `out` is still poisoned: the refused calls launched nothing.
    fn untouched(&self, out: &CudaSlice<bf16>) -> TestResult {
        self.stream.synchronize()?;
        match download(&self.stream, out).iter().position(|x| !x.to_f32().is_nan()) {
            Some(i) => Err(format!("output element {i} was written by a refused call").into()),
            None => Ok(()),
        }
    }
}

/// Fails unless `r` is an invalid-argument error naming `arg` whose reason contains `what`.
fn refused<T: std::fmt::Debug>(r: attn_rs::Result<T>, arg: &str, what: &str) -> TestResult {
    match r {
        Err(AttnError::InvalidArgument { arg: a, reason }) if a == arg && reason.contains(what) => Ok(()),
        other => Err(format!("expected a refusal of `{arg}` ({what}), got {other:?}").into()),
    }
}

/// The batch's device copy is the library's upload of its host copy: the call of the report
/// (host batch one token over 40 keys, device `query_start_loc = [0, 9]`) cannot be expressed,
/// and a batch that really has 9 tokens is refused against a 1-token `out`; a length past the
/// block-table row is refused too. `BatchMetadata` itself refuses malformed arrays, with
/// 64-bit arithmetic (the old i32 check let `[0, i32::MAX, i32::MIN + 5]` pass).
fn device_metadata() -> TestResult {
    let s = Setup::new(32)?;
    let st = &s.stream;
    let mut out = s.out(32);
    let mut ws = DecodeWorkspace::new(st, 4096, D, 4, 16)?;
    let mut status = DeviceStatus::new(st)?;
    let opts = AttnOptions::new(D);
    let nine = BatchMetadata::new(st, &[40], &[0, 9])?;
    let r = paged_decode(device(), st, s.args(32, s.bf16(), &mut out), &nine, &opts, SplitMode::Auto, &mut ws, &mut status);
    refused(r, "query_start_loc", "9")?;
    let long = BatchMetadata::new(st, &[4000], &[0, 1])?;
    let r = paged_decode(device(), st, s.args(32, s.bf16(), &mut out), &long, &opts, SplitMode::Auto, &mut ws, &mut status);
    refused(r, "block_table", "250 blocks")?;
    s.untouched(&out)?;
    refused(BatchMetadata::new(st, &[5, 5], &[0, i32::MAX, i32::MIN + 5]), "query_start_loc", "decreases")?;
    refused(BatchMetadata::new(st, &[-1], &[0, 1]), "seq_lens", "length -1")?;
    refused(BatchMetadata::new(st, &[5], &[0, 1, 2]), "query_start_loc", "entries")?;
    refused(BatchMetadata::with_key_start_loc(st, &[5], &[0, 1], &[0, 4]), "key_start_loc", "spans 4")?;
    // An update replaces both copies: the new batch runs.
    let mut b = BatchMetadata::new(st, &[40], &[0, 9])?;
    b.update(&[40], &[0, 1], None)?;
    paged_decode(device(), st, s.args(32, s.bf16(), &mut out), &b, &opts, SplitMode::Auto, &mut ws, &mut status)?;
    status.check(st)?;
    let got = download(st, &out);
    match got.iter().position(|x| !x.to_f32().is_finite()) {
        Some(i) => Err(format!("after the update, output element {i} is {}", got[i]).into()),
        None => Ok(()),
    }
}

/// A plan is refused by a call whose heads or kernel differ from the planned ones (a plan for
/// 8 query heads used with 64 indexed its partials 8x past the workspace).
fn plan_bound_to_layer() -> TestResult {
    let s = Setup::new(64)?;
    let st = &s.stream;
    let mut out = s.out(64);
    let mut ws = DecodeWorkspace::new(st, 64 * 4096, D, 4, 16)?;
    let mut status = DeviceStatus::new(st)?;
    let opts = AttnOptions::new(D);
    let batch = BatchMetadata::new(st, &[50], &[0, 1])?;
    let mut bp = BatchPlan::new(st)?;
    bp.plan_decode(device(), &batch, DType::BF16, DType::BF16, s.spec.layout, D, 8, 8, SplitMode::Fixed(4), &ws)?;
    let r = paged_decode_planned(device(), st, s.args(64, s.bf16(), &mut out), &batch, &opts, &bp, &mut ws, &mut status);
    refused(r, "plan", "num_q_heads: 8")?;
    bp.plan_decode(device(), &batch, DType::BF16, DType::BF16, s.spec.layout, D, 64, 8, SplitMode::Fixed(4), &ws)?;
    let fp8 = DevIn::new(&s.fp8_cache, st);
    let r = paged_decode_planned(device(), st, s.args(64, fp8, &mut out), &batch, &opts, &bp, &mut ws, &mut status);
    refused(r, "plan", "was made for kernel")?;
    s.untouched(&out)
}

/// A cache view that is not 16-byte aligned is refused (the kernels' 16-byte copies would
/// fault and lose the CUDA context).
fn decode_cache_alignment() -> TestResult {
    let s = Setup::new(32)?;
    let st = &s.stream;
    let mut out = s.out(32);
    let mut ws = DecodeWorkspace::new(st, 4096, D, 4, 16)?;
    let mut status = DeviceStatus::new(st)?;
    let batch = BatchMetadata::new(st, &[50], &[0, 1])?;
    // One element more than the layout, so that the view one element in is long enough.
    let padded: CudaSlice<bf16> = upload(st, &vec![bf16::ZERO; s.spec.num_elements() + 1]);
    let view = padded.slice(1..);
    let args = s.args(32, DevIn::new(&view, st), &mut out);
    let r = paged_decode(device(), st, args, &batch, &AttnOptions::new(D), SplitMode::Auto, &mut ws, &mut status);
    refused(r, "cache", "16-byte aligned")?;
    s.untouched(&out)
}

/// Workspaces, plans and batches belong to the stream they were made on; a call on another
/// stream is refused (their addresses are taken without per-use events, so two streams would
/// race on them).
fn one_stream_per_workspace() -> TestResult {
    let s = Setup::new(32)?;
    let st = &s.stream;
    let other = new_stream();
    let mut out = s.out(32);
    let opts = AttnOptions::new(D);
    let mut status = DeviceStatus::new(&other)?;
    let batch_here = BatchMetadata::new(st, &[50], &[0, 1])?;
    let batch_there = BatchMetadata::new(&other, &[50], &[0, 1])?;
    let mut ws_here = DecodeWorkspace::new(st, 4096, D, 4, 16)?;
    let mut ws_there = DecodeWorkspace::new(&other, 4096, D, 4, 16)?;
    let r = paged_decode(device(), &other, s.args(32, s.bf16(), &mut out), &batch_there, &opts, SplitMode::Auto, &mut ws_here, &mut status);
    refused(r, "workspace", "belongs to stream")?;
    let r = paged_decode(device(), &other, s.args(32, s.bf16(), &mut out), &batch_here, &opts, SplitMode::Auto, &mut ws_there, &mut status);
    refused(r, "batch", "belongs to stream")?;
    let mut bp = BatchPlan::new(st)?;
    let r = bp.plan_decode(device(), &batch_there, DType::BF16, DType::BF16, s.spec.layout, D, 32, 8, SplitMode::Auto, &ws_there).map(drop);
    refused(r, "batch", "belongs to stream")?;
    bp.plan_decode(device(), &batch_here, DType::BF16, DType::BF16, s.spec.layout, D, 32, 8, SplitMode::Auto, &ws_here)?;
    let r = paged_decode_planned(device(), &other, s.args(32, s.bf16(), &mut out), &batch_here, &opts, &bp, &mut ws_here, &mut status);
    refused(r, "plan", "belongs to stream")?;
    // Prefill's workspace too.
    let mut pws = PrefillWorkspace::new(st, 16, 4, 4)?;
    let rows = RowsDesc::contiguous(1, 32, D);
    let args = PrefillArgs {
        q: DevIn::new(&s.q, &other),
        q_rows: rows,
        kv: PrefillKv::Paged {
            cache: DevIn::new(&s.cache, &other),
            spec: s.spec,
            block_table: DevIn::new(&s.table, &other),
            block_table_stride: 4,
        },
        out: DevOut::new(&mut out, &other),
        out_rows: rows,
        lse: None,
        alibi_slopes: None,
        sinks: None,
        scales: None,
    };
    let popts = PrefillOptions { attn: opts, causal: true };
    refused(prefill(device(), &other, args, &batch_there, &popts, &mut pws, &mut status), "workspace", "belongs to stream")?;
    s.untouched(&out)
}

fn main() {
    let trials = vec![
        Trial::test("soundness::device_metadata", device_metadata),
        Trial::test("soundness::plan_bound_to_layer", plan_bound_to_layer),
        Trial::test("soundness::decode_cache_alignment", decode_cache_alignment),
        Trial::test("soundness::one_stream_per_workspace", one_stream_per_workspace),
    ];
    run_gpu_trials(trials)
}
