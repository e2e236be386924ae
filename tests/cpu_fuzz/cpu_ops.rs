//! The CPU attention ops (`cpu::paged_decode`, `cpu::prefill`, `cpu::mla_sparse_attention`).

use crate::{batch, fuzz, named, size, wild_i32, wild_usize};
use attn_rs::decode::DecodeBatch;
use attn_rs::{KvCacheSpec, KvLayout, MlaCacheSpec, RowsDesc};
use rand::Rng;
use std::fmt::Debug;

#[derive(Debug)]
struct CpuOpCase {
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    spec: KvCacheSpec,
    mla: MlaCacheSpec,
    q_rows: RowsDesc,
    q_len: usize,
    cache_len: usize,
    block_table: Vec<i32>,
    stride: usize,
    key_start_loc: Vec<i32>,
    head_size_v: usize,
    per_head: (usize, usize),
    causal: bool,
    /// Sparse MLA: the index tensor, k and the row stride.
    indices: Vec<i32>,
    topk: usize,
    row_stride: usize,
}

/// `cpu::paged_decode`, `cpu::prefill` (paged, packed and MLA keys) and
/// `cpu::mla_sparse_attention` (wild index rows): refused with a named error or run, never a
/// panic; a run's output has one row per query token and head.
#[test]
fn cpu_attention_ops_check_what_they_read() {
    fuzz(
        "cpu ops",
        7,
        |rng| {
            let (qsl, seq_lens) = batch(rng, 0..=9, 30);
            let spec = KvCacheSpec {
                layout: KvLayout::ALL[rng.random_range(0..4)],
                num_blocks: size(rng, 1..12),
                block_size: size(rng, 1..9),
                num_kv_heads: size(rng, 1..3),
                head_size: size(rng, 1..9),
            };
            let mla = MlaCacheSpec {
                num_blocks: size(rng, 1..12),
                block_size: size(rng, 1..9),
                latent_dim: size(rng, 1..9),
                rope_dim: size(rng, 0..4),
            };
            let tokens = qsl.last().map_or(0, |&t| t.max(0) as usize);
            let mut q_rows =
                RowsDesc::contiguous(if rng.random_bool(0.9) { tokens } else { wild_usize(rng) }, size(rng, 1..5), size(rng, 1..9));
            if rng.random_bool(0.1) {
                q_rows.token_stride = wild_usize(rng);
            }
            let stride = size(rng, 0..12);
            let table_len = if rng.random_bool(0.8) { seq_lens.len().saturating_mul(stride).min(256) } else { rng.random_range(0..8) };
            let block_table = (0..table_len).map(|_| if rng.random_bool(0.1) { wild_i32(rng) } else { rng.random_range(0..12) }).collect();
            let mut key_start_loc = vec![0];
            seq_lens.iter().for_each(|&l| key_start_loc.push(key_start_loc.last().copied().unwrap_or(0i32).saturating_add(l.max(0))));
            if rng.random_bool(0.2) {
                let i = rng.random_range(0..key_start_loc.len());
                key_start_loc[i] = wild_i32(rng);
            }
            CpuOpCase {
                q_len: q_rows.required_len().min(4096) - if rng.random_bool(0.1) { 1.min(q_rows.required_len()) } else { 0 },
                cache_len: if rng.random_bool(0.9) {
                    spec.num_elements().max(mla.num_elements()).min(8192)
                } else {
                    rng.random_range(0..64)
                },
                qsl,
                seq_lens,
                spec,
                mla,
                q_rows,
                block_table,
                stride,
                key_start_loc,
                head_size_v: size(rng, 0..9),
                per_head: (rng.random_range(0..6), rng.random_range(0..6)),
                causal: rng.random(),
                indices: (0..rng.random_range(0..64))
                    .map(|_| if rng.random_bool(0.2) { wild_i32(rng) } else { rng.random_range(-1..40) })
                    .collect(),
                topk: size(rng, 0..6),
                row_stride: if rng.random_bool(0.9) { size(rng, 0..8) } else { wild_usize(rng) },
            }
        },
        |c| {
            let q = vec![0.5f32; c.q_len];
            let cache = vec![0.25f32; c.cache_len];
            let (slopes, sinks) = (vec![0.1f32; c.per_head.0], vec![0.0f32; c.per_head.1]);
            let (slopes, sinks) =
                (c.per_head.0.is_multiple_of(2).then_some(&slopes[..]), c.per_head.1.is_multiple_of(2).then_some(&sinks[..]));
            let opts = attn_rs::AttnOptions::new(8);
            let rows = |r: &attn_rs::cpu::DecodeResult, dv: usize| -> Result<(), String> {
                let (nt, hq) = (c.q_rows.num_tokens, c.q_rows.num_heads);
                check!(r.out.len() == nt * hq * dv && r.lse.len() == nt * hq, "{} outputs for {nt} x {hq} x {dv}", r.out.len());
                Ok(())
            };
            let batch = DecodeBatch { seq_lens: &c.seq_lens, query_start_loc: &c.qsl };
            let d = attn_rs::cpu::paged_decode::<f32, f32>(&attn_rs::cpu::DecodeRef {
                q: &q,
                q_rows: c.q_rows,
                cache: &cache,
                spec: c.spec,
                block_table: &c.block_table,
                block_table_stride: c.stride,
                batch,
                opts,
                alibi_slopes: slopes,
                sinks,
                scales: None,
            });
            named(&d)?;
            if let Ok(r) = &d {
                check!(c.spec.validate("spec").is_ok(), "decode took an invalid spec");
                rows(r, c.q_rows.head_size)?;
            }
            let packed_rows = RowsDesc::contiguous(*c.key_start_loc.last().unwrap_or(&0) as usize, c.spec.num_kv_heads, c.spec.head_size);
            let kvs = [
                attn_rs::cpu::KvRef::Paged { cache: &cache, spec: c.spec, block_table: &c.block_table, block_table_stride: c.stride },
                attn_rs::cpu::KvRef::Mla { cache: &cache, spec: c.mla, block_table: &c.block_table, block_table_stride: c.stride },
                attn_rs::cpu::KvRef::Packed {
                    k: &cache,
                    k_rows: packed_rows,
                    v: &cache,
                    v_rows: packed_rows,
                    key_start_loc: &c.key_start_loc,
                },
            ];
            for kv in kvs {
                let p = attn_rs::cpu::prefill::<f32, f32>(&attn_rs::cpu::PrefillRef {
                    q: &q,
                    q_rows: c.q_rows,
                    kv,
                    head_size_v: c.head_size_v,
                    query_start_loc: &c.qsl,
                    seq_lens: &c.seq_lens,
                    causal: c.causal,
                    opts,
                    alibi_slopes: slopes,
                    sinks,
                    scales: None,
                });
                named(&p)?;
                if let Ok(r) = &p {
                    rows(r, c.head_size_v)?;
                }
            }
            let sparse = attn_rs::cpu::mla_sparse_attention::<f32, f32>(&attn_rs::cpu::SparseMlaRef {
                q: &q,
                q_rows: c.q_rows,
                cache: &cache,
                spec: c.mla,
                block_table: &c.block_table,
                block_table_stride: c.stride,
                query_start_loc: &c.qsl,
                seq_lens: &c.seq_lens,
                indices: &c.indices,
                topk: c.topk,
                row_stride: c.row_stride,
                softmax_scale: 0.5,
                scale: None,
            });
            named(&sparse)?;
            if let Ok(r) = &sparse {
                let (nt, hq, dv) = (c.q_rows.num_tokens, c.q_rows.num_heads, c.mla.latent_dim);
                check!(r.out.len() == nt * hq * dv && r.lse.len() == nt * hq, "{} sparse outputs for {nt} x {hq} x {dv}", r.out.len());
                check!(c.topk >= 1 && c.row_stride >= c.topk, "sparse took k {} with rows {} apart", c.topk, c.row_stride);
            }
            Ok(())
        },
    );
}
