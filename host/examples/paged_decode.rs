//! Paged decode: three requests each decode one token over their cached context (40, 300 and
//! 17 keys), 8 query heads over 2 kv heads of 128, bf16; the output is compared with the CPU
//! reference.
//!
//!     cargo run -p attn-rs --example paged_decode
//!
//! Without a GPU it says so and exits 0.

use attn_rs::decode::{paged_decode, DecodeArgs, DecodeBatch, DecodeWorkspace};
use attn_rs::{cpu, AttnOptions, BatchMetadata, DevIn, DevOut, DeviceStatus, KvCacheSpec, KvLayout, RowsDesc, SplitMode};
use half::bf16;

mod common;
use common::{check_bf16, open_gpu, values};

fn main() -> attn_rs::Result<()> {
    let Some(dev) = open_gpu()? else { return Ok(()) };
    let stream = dev.context().new_stream()?;
    let (num_q_heads, num_kv_heads, head_size, block_size) = (8, 2, 128, 16);
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, 32, block_size, num_kv_heads, head_size)?;

    // The batch: one new token per request; the cache already holds every key, the new one
    // included (written by `reshape_and_cache` earlier in the step).
    let seq_lens = [40, 300, 17];
    let query_start_loc = [0, 1, 2, 3];
    let num_tokens = 3;
    // Each request's blocks, consecutive here; rows of `stride` block ids.
    let stride = 19;
    let mut block_table = vec![0i32; seq_lens.len() * stride];
    let mut next = 0;
    for (r, &len) in seq_lens.iter().enumerate() {
        for b in 0..(len as usize).div_ceil(block_size) {
            block_table[r * stride + b] = next;
            next += 1;
        }
    }
    let cache: Vec<bf16> = values(spec.num_elements(), 2);
    let q_rows = RowsDesc::contiguous(num_tokens, num_q_heads, head_size);
    let q: Vec<bf16> = values(q_rows.required_len(), 3);
    let opts = AttnOptions::new(head_size);

    let (cache_d, q_d, table_d) = (stream.clone_htod(&cache)?, stream.clone_htod(&q)?, stream.clone_htod(&block_table)?);
    let mut out_d = stream.alloc_zeros::<bf16>(q_rows.required_len())?;
    // Once per engine: the workspace for the largest batch, and the status block.
    let partial_rows = 4 * dev.sm_count() as usize * 8 * num_q_heads / num_kv_heads;
    let mut ws = DecodeWorkspace::new(&stream, partial_rows, head_size, 256, 256)?;
    let mut status = DeviceStatus::new(&stream)?;
    // Every step: the batch's metadata, checked and uploaded once for every layer's call.
    let batch = BatchMetadata::new(&stream, &seq_lens, &query_start_loc)?;
    let args = DecodeArgs {
        q: DevIn::new(&q_d, &stream),
        q_rows,
        cache: DevIn::new(&cache_d, &stream),
        spec,
        block_table: DevIn::new(&table_d, &stream),
        block_table_stride: stride,
        out: DevOut::new(&mut out_d, &stream),
        out_rows: q_rows,
        lse: None,
        alibi_slopes: None,
        sinks: None,
        scales: None,
    };
    let plan = paged_decode(&dev, &stream, args, &batch, &opts, SplitMode::Auto, &mut ws, &mut status)?;
    status.check(&stream)?;
    println!("plan: {:?} kernel, chunks of {} keys, splits per request {:?}", plan.kernel, plan.chunk, plan.req_num_splits);

    let want = cpu::paged_decode(&cpu::DecodeRef {
        q: &q,
        q_rows,
        cache: &cache,
        spec,
        block_table: &block_table,
        block_table_stride: stride,
        batch: DecodeBatch { seq_lens: &seq_lens, query_start_loc: &query_start_loc },
        opts,
        alibi_slopes: None,
        sinks: None,
        scales: None,
    })?;
    check_bf16("paged_decode", &stream.clone_dtoh(&out_d)?, &want.out);
    Ok(())
}
