//! MLA (DeepSeek's multi-head latent attention): this step's latent rows written into the
//! `[num_blocks, block_size, 512 + 64]` cache with `concat_and_cache_mla`, then two requests
//! decode one token each over it (40 and 70 keys) with 16 heads, bf16; then the same tokens
//! attend only the positions their top-k lists name (sparse MLA, DeepSeek-V3.2). Each output is
//! compared with the CPU reference.
//!
//!     cargo run -p attn-rs --example mla
//!
//! Without a GPU it says so and exits 0.

use attn_rs::cache_write::{concat_and_cache_mla, MlaWrite};
use attn_rs::decode::DecodeWorkspace;
use attn_rs::mla::{mla_attention, mla_sparse_attention, MlaArgs, SparseIndexArgs};
use attn_rs::{cpu, AttnOptions, BatchMetadata, DevIn, DevOut, DeviceStatus, MlaCacheSpec, RowsDesc, SplitMode};
use half::bf16;

mod common;
use common::{check_bf16, open_gpu, values};

fn main() -> attn_rs::Result<()> {
    let Some(dev) = open_gpu()? else { return Ok(()) };
    let stream = dev.context().new_stream()?;
    let num_heads = 16;
    let spec = MlaCacheSpec::deepseek(8, 16)?;
    let (latent, rope, width) = (spec.latent_dim, spec.rope_dim, spec.row_width());

    // Two requests, one new token each, at positions 39 and 69 of their blocks [0, 1, 2] and
    // [3, 4, 5, 6, 7]; earlier rows were cached by earlier steps.
    let seq_lens = [40, 70];
    let query_start_loc = [0, 1, 2];
    let (block_table, stride) = ([0, 1, 2, 0, 0, 3, 4, 5, 6, 7], 5);
    let slots: Vec<i64> = vec![2 * 16 + 7, 7 * 16 + 5];
    let num_tokens = 2;
    let mut cache: Vec<bf16> = values(spec.num_elements(), 6);
    let (kv_c, k_pe): (Vec<bf16>, Vec<bf16>) = (values(num_tokens * latent, 7), values(num_tokens * rope, 8));
    // Queries with the K up-projection absorbed: 576 wide; outputs are the 512 latent columns.
    let q_rows = RowsDesc::contiguous(num_tokens, num_heads, width);
    let out_rows = RowsDesc::contiguous(num_tokens, num_heads, latent);
    let q: Vec<bf16> = values(q_rows.required_len(), 9);
    // DeepSeek's scale: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) = 1 / sqrt(192).
    let softmax_scale = 1.0 / 192f32.sqrt();

    let mut cache_d = stream.clone_htod(&cache)?;
    let (kv_c_d, k_pe_d, slots_d) = (stream.clone_htod(&kv_c)?, stream.clone_htod(&k_pe)?, stream.clone_htod(&slots)?);
    let (q_d, table_d) = (stream.clone_htod(&q)?, stream.clone_htod(&block_table)?);
    let mut out_d = stream.alloc_zeros::<bf16>(out_rows.required_len())?;
    let mut status = DeviceStatus::new(&stream)?;
    // MLA's split-K partials are rows of the 512 latent columns.
    let mut ws = DecodeWorkspace::new(&stream, 4 * dev.sm_count() as usize * 8 * num_heads, latent, 256, 256)?;
    let batch = BatchMetadata::new(&stream, &seq_lens, &query_start_loc)?;
    // The latent attention's arguments, dense and sparse alike (a macro: they borrow `out_d`
    // mutably for the call).
    macro_rules! args {
        () => {
            MlaArgs {
                q: DevIn::new(&q_d, &stream),
                q_rows,
                cache: DevIn::new(&cache_d, &stream),
                spec,
                block_table: DevIn::new(&table_d, &stream),
                block_table_stride: stride,
                out: DevOut::new(&mut out_d, &stream),
                out_rows,
                lse: None,
                scales: None,
            }
        };
    }

    let write = MlaWrite {
        kv_c: DevIn::new(&kv_c_d, &stream),
        kv_c_token_stride: latent,
        k_pe: DevIn::new(&k_pe_d, &stream),
        k_pe_token_stride: rope,
        num_tokens,
        slot_mapping: DevIn::new(&slots_d, &stream),
        cache: DevOut::new(&mut cache_d, &stream),
        spec,
        scale: None,
    };
    concat_and_cache_mla(&dev, &stream, write, &mut status)?;
    let plan = mla_attention(&dev, &stream, args!(), &batch, softmax_scale, SplitMode::Auto, &mut ws, &mut status)?;
    status.check(&stream)?;
    println!("plan: chunks of {} keys, splits per request {:?}", plan.chunk, plan.req_num_splits);

    cpu::concat_and_cache_mla(&kv_c, latent, &k_pe, rope, num_tokens, &slots, &mut cache, &spec, None)?;
    let want = cpu::prefill(&cpu::PrefillRef {
        q: &q,
        q_rows,
        kv: cpu::KvRef::Mla { cache: &cache, spec, block_table: &block_table, block_table_stride: stride },
        head_size_v: latent,
        query_start_loc: &query_start_loc,
        seq_lens: &seq_lens,
        causal: true,
        opts: AttnOptions { softmax_scale, ..AttnOptions::new(width) },
        alibi_slopes: None,
        sinks: None,
        scales: None,
    })?;
    check_bf16("mla_attention", &stream.clone_dtoh(&out_d)?, &want.out);

    // Sparse: each token attends the 8 positions of its request its row lists, in any order;
    // -1 is padding.
    let topk = 8;
    let indices: Vec<i32> = vec![39, 0, 17, -1, 5, 38, 22, 9, /* token 1 */ 69, 64, 3, 50, 33, -1, -1, 12];
    let idx_d = stream.clone_htod(&indices)?;
    let list = SparseIndexArgs { indices: DevIn::new(&idx_d, &stream), topk, row_stride: topk };
    mla_sparse_attention(&dev, &stream, args!(), list, &batch, softmax_scale, SplitMode::Auto, &mut ws, &mut status)?;
    status.check(&stream)?;
    let want = cpu::mla_sparse_attention(&cpu::SparseMlaRef {
        q: &q,
        q_rows,
        cache: &cache,
        spec,
        block_table: &block_table,
        block_table_stride: stride,
        query_start_loc: &query_start_loc,
        seq_lens: &seq_lens,
        indices: &indices,
        topk,
        row_stride: topk,
        softmax_scale,
        scale: None,
    })?;
    check_bf16("mla_sparse_attention", &stream.clone_dtoh(&out_d)?, &want.out);
    Ok(())
}
