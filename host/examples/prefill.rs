//! Prefill: a chunked prefill (10 new tokens over 20 cached ones) and a fresh prompt of 25
//! tokens in one varlen batch over the paged cache, causal, 8 query heads over 2 kv heads of
//! 128, bf16; the output is compared with the CPU reference.
//!
//!     cargo run -p attn-rs --example prefill
//!
//! Without a GPU it says so and exits 0.

use attn_rs::prefill::{prefill, PrefillArgs, PrefillKv, PrefillOptions, PrefillWorkspace};
use attn_rs::{cpu, AttnOptions, BatchMetadata, DevIn, DevOut, DeviceStatus, KvCacheSpec, KvLayout, RowsDesc};
use half::bf16;

mod common;
use common::{check_bf16, open_gpu, values};

fn main() -> attn_rs::Result<()> {
    let Some(dev) = open_gpu()? else { return Ok(()) };
    let stream = dev.context().new_stream()?;
    let (num_q_heads, num_kv_heads, head_size, block_size) = (8, 2, 128, 16);
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, 8, block_size, num_kv_heads, head_size)?;

    // Request 0: 10 new tokens after 20 cached (blocks 0, 1); request 1: a prompt of 25 tokens
    // (blocks 2, 3). The cache already holds this step's keys (written by `reshape_and_cache`).
    let seq_lens = [30, 25];
    let query_start_loc = [0, 10, 35];
    let (block_table, stride) = ([0, 1, 2, 3], 2);
    let num_tokens = 35;
    let cache: Vec<bf16> = values(spec.num_elements(), 4);
    let q_rows = RowsDesc::contiguous(num_tokens, num_q_heads, head_size);
    let q: Vec<bf16> = values(q_rows.required_len(), 5);
    let opts = PrefillOptions { attn: AttnOptions::new(head_size), causal: true };

    let (cache_d, q_d, table_d) = (stream.clone_htod(&cache)?, stream.clone_htod(&q)?, stream.clone_htod(&block_table)?);
    let mut out_d = stream.alloc_zeros::<bf16>(q_rows.required_len())?;
    // Once per engine: the workspace for the largest batch (tokens, requests, query heads per
    // kv head), and the status block.
    let mut ws = PrefillWorkspace::new(&stream, 8192, 256, num_q_heads / num_kv_heads)?;
    let mut status = DeviceStatus::new(&stream)?;
    let batch = BatchMetadata::new(&stream, &seq_lens, &query_start_loc)?;
    let args = PrefillArgs {
        q: DevIn::new(&q_d, &stream),
        q_rows,
        kv: PrefillKv::Paged {
            cache: DevIn::new(&cache_d, &stream),
            spec,
            block_table: DevIn::new(&table_d, &stream),
            block_table_stride: stride,
        },
        out: DevOut::new(&mut out_d, &stream),
        out_rows: q_rows,
        lse: None,
        alibi_slopes: None,
        sinks: None,
        scales: None,
    };
    let plan = prefill(&dev, &stream, args, &batch, &opts, &mut ws, &mut status)?;
    status.check(&stream)?;
    println!("plan: {} query-row tiles", plan.items.len());

    let want = cpu::prefill(&cpu::PrefillRef {
        q: &q,
        q_rows,
        kv: cpu::KvRef::Paged { cache: &cache, spec, block_table: &block_table, block_table_stride: stride },
        head_size_v: head_size,
        query_start_loc: &query_start_loc,
        seq_lens: &seq_lens,
        causal: true,
        opts: opts.attn,
        alibi_slopes: None,
        sinks: None,
        scales: None,
    })?;
    check_bf16("prefill", &stream.clone_dtoh(&out_d)?, &want.out);
    Ok(())
}
