//! Context parallelism on the CPU (no GPU): the dealing of positions to ranks against a count
//! done position by position, every rank's slot mapping against the table, and N ranks' decodes
//! over their shares (the CPU cache write with each rank's slots, then the CPU decode with the
//! local lengths) merged by LSE against the decode of the whole context, in f64.

use attn_rs::context_parallel::CpShard;
use attn_rs::cpu::{self, DecodeRef, DecodeResult, HostScales};
use attn_rs::decode::DecodeBatch;
use attn_rs::{AttnOptions, Element, Fp8E4m3, KvCacheSpec, KvLayout, RowsDesc};
use half::bf16;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

#[test]
fn dealing_matches_a_count_position_by_position() {
    for world in 1..=5 {
        for interleave in [1, 2, 4, 16] {
            let shards: Vec<CpShard> = (0..world).map(|r| CpShard::new(world, r, interleave).unwrap()).collect();
            let mut held = vec![0usize; world];
            for pos in 0..3000 {
                for s in &shards {
                    assert_eq!(s.local_len(pos), held[s.rank], "world {world}, interleave {interleave}, rank {} at length {pos}", s.rank);
                }
                let owner = shards[0].owner(pos);
                assert_eq!(pos / interleave % world, owner);
                assert_eq!(shards[owner].local_index(pos), held[owner], "world {world}, interleave {interleave}: position {pos}");
                held[owner] += 1;
            }
        }
    }
}

/// A table of `ceil(len / (block_size * world))` scattered entries a request, in a cache of
/// those blocks plus 3.
fn group_table(rng: &mut SmallRng, seq_lens: &[i32], vblock: usize) -> (Vec<i32>, usize, usize) {
    let entries: Vec<usize> = seq_lens.iter().map(|&l| (l as usize).div_ceil(vblock)).collect();
    let stride = entries.iter().copied().max().unwrap_or(0) + 1;
    let num_blocks = entries.iter().sum::<usize>() + 3;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    ids.shuffle(rng);
    let mut table = vec![-1i32; seq_lens.len() * stride];
    let mut next = 0;
    for (r, &e) in entries.iter().enumerate() {
        table[r * stride..][..e].copy_from_slice(&ids[next..next + e]);
        next += e;
    }
    (table, stride, num_blocks)
}

fn start_locs(lens: &[i32]) -> Vec<i32> {
    std::iter::once(0).chain(lens.iter().scan(0, |t, &l| Some(*t + l).inspect(|&x| *t = x))).collect()
}

#[test]
fn every_position_has_one_slot_on_its_owner() {
    let mut rng = SmallRng::seed_from_u64(40);
    for (world, interleave, bs) in [(2, 1, 16), (3, 1, 16), (4, 8, 16), (3, 16, 32), (2, 64, 64)] {
        let seq_lens = vec![1, 0, 2, 17, 300, 1001, 4097];
        let (table, stride, num_blocks) = group_table(&mut rng, &seq_lens, bs * world);
        let qsl = start_locs(&seq_lens);
        let mut written = vec![0usize; *qsl.last().unwrap() as usize];
        for rank in 0..world {
            let s = CpShard::new(world, rank, interleave).unwrap();
            let step = s.shard_step(&qsl, &seq_lens, &table, stride, bs, num_blocks).unwrap();
            let mut seen = std::collections::HashSet::new();
            for (r, &len) in seq_lens.iter().enumerate() {
                for pos in 0..len as usize {
                    let t = qsl[r] as usize + pos;
                    let slot = step.slot_mapping[t];
                    if s.owner(pos) != rank {
                        assert_eq!(slot, -1, "rank {rank} writes request {r}'s position {pos}, which rank {} holds", s.owner(pos));
                        continue;
                    }
                    written[t] += 1;
                    // The decode reads local key `li` at entry `li / bs` of the same row.
                    let li = s.local_index(pos);
                    let want = table[r * stride + li / bs] as i64 * bs as i64 + (li % bs) as i64;
                    assert_eq!(slot, want, "world {world}, rank {rank}, request {r}, position {pos}");
                    assert!(seen.insert(slot), "slot {slot} written twice on rank {rank}");
                }
                assert_eq!(step.local_seq_lens[r] as usize, s.local_len(len as usize));
            }
        }
        assert!(
            written.iter().all(|&w| w == 1),
            "world {world}, interleave {interleave}: a position written {:?} times",
            written.iter().find(|&&w| w != 1)
        );
    }
}

/// N ranks' CPU decodes over their shares, merged by LSE, against the whole; `q` new tokens a
/// request (more than one: decoded as a request a token over `token_seq_lens`, each request's
/// row repeated, as a context-parallel `forward` does).
fn sharded_equals_whole<C: Element>(world: usize, interleave: usize, sinks: bool, q: usize, salt: u64) {
    let mut rng = SmallRng::seed_from_u64(salt);
    let (bs, hkv, hq, d) = (16usize, 2, 8, 64);
    // The step's new tokens are each request's last `q` positions (the empty request then has
    // `q`, all new).
    let seq_lens: Vec<i32> = [1, 0, 3, 31, 517, 1600, 2049].into_iter().map(|l: i32| l.max(q as i32)).collect();
    let n = seq_lens.len();
    let fp8 = C::DTYPE.is_fp8();
    let scales = fp8.then_some(HostScales::Tensor(0.05, 0.03));
    let ctx_qsl = start_locs(&seq_lens);
    let kv_rows = RowsDesc::contiguous(*ctx_qsl.last().unwrap() as usize, hkv, d);
    let rand_vec = |rng: &mut SmallRng, len| (0..len).map(|_| bf16::from_f32(rng.random_range(-1.0..1.0))).collect::<Vec<_>>();
    let (k, v) = (rand_vec(&mut rng, kv_rows.required_len()), rand_vec(&mut rng, kv_rows.required_len()));
    let nt = n * q;
    let q_rows = RowsDesc::contiguous(nt, hq, d);
    let q_len = q;
    let q = rand_vec(&mut rng, q_rows.required_len());
    let sink_logits: Vec<f32> = (0..hq).map(|_| rng.random_range(-2.0..3.0)).collect();
    let mut opts = AttnOptions::new(d);
    opts.softcap = Some(20.0);
    let dec_qsl: Vec<i32> = (0..=n as i32).map(|r| r * q_len as i32).collect();
    let token_qsl: Vec<i32> = (0..=nt as i32).collect();
    let decode = |cache: &[C], spec, table: &[i32], stride, lens: &[i32], qsl: &[i32], sinks: Option<&[f32]>| -> DecodeResult {
        cpu::paged_decode(&DecodeRef {
            q: &q,
            q_rows,
            cache,
            spec,
            block_table: table,
            block_table_stride: stride,
            batch: DecodeBatch { seq_lens: lens, query_start_loc: qsl },
            opts,
            alibi_slopes: None,
            sinks,
            scales,
        })
        .unwrap()
    };
    let sinks = sinks.then_some(&sink_logits[..]);
    // The whole: world size 1.
    let one = CpShard::new(1, 0, 1).unwrap();
    let (table1, stride1, blocks1) = group_table(&mut rng, &seq_lens, bs);
    let spec1 = KvCacheSpec::new(KvLayout::FlashNhd, blocks1, bs, hkv, d).unwrap();
    let slots1 = one.shard_step(&ctx_qsl, &seq_lens, &table1, stride1, bs, blocks1).unwrap().slot_mapping;
    let mut cache1 = vec![C::from_f32(0.0); spec1.num_elements()];
    cpu::reshape_and_cache(&k, kv_rows, &v, kv_rows, &slots1, &mut cache1, &spec1, scales).unwrap();
    let whole = decode(&cache1, spec1, &table1, stride1, &seq_lens, &dec_qsl, sinks);

    let (table, stride, blocks) = group_table(&mut rng, &seq_lens, bs * world);
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, blocks, bs, hkv, d).unwrap();
    let mut merged: Option<DecodeResult> = None;
    for rank in 0..world {
        let s = CpShard::new(world, rank, interleave).unwrap();
        let ctx = s.shard_step(&ctx_qsl, &seq_lens, &table, stride, bs, blocks).unwrap();
        let mut cache = vec![C::from_f32(f32::NAN); spec.num_elements()];
        cpu::reshape_and_cache(&k, kv_rows, &v, kv_rows, &ctx.slot_mapping, &mut cache, &spec, scales).unwrap();
        let r0_sinks = sinks.filter(|_| rank == 0);
        let part = if q_len == 1 {
            decode(&cache, spec, &table, stride, &ctx.local_seq_lens, &dec_qsl, r0_sinks)
        } else {
            let step = s.shard_step(&dec_qsl, &seq_lens, &table, stride, bs, blocks).unwrap();
            let rows = step.expand_block_table(&dec_qsl, &table, stride);
            decode(&cache, spec, &rows, stride, &step.token_seq_lens, &token_qsl, r0_sinks)
        };
        merged = Some(match merged {
            None => part,
            Some(acc) => {
                let (mut out, mut lse) = (Vec::new(), Vec::new());
                for row in 0..nt * hq {
                    let (o, l) = cpu::merge_states_row(&acc.out[row * d..][..d], acc.lse[row], &part.out[row * d..][..d], part.lse[row]);
                    out.extend(o);
                    lse.push(l);
                }
                DecodeResult { out, lse, bad_blocks: 0, first_bad_block: None }
            }
        });
    }
    let merged = merged.unwrap();
    let ctx = format!("{:?} cache, {world} ranks, interleave {interleave}, sinks {}, {q_len} new tokens", C::DTYPE, sinks.is_some());
    let scale = whole.out.iter().fold(0f64, |m, x| m.max(x.abs()));
    let err = merged.out.iter().zip(&whole.out).fold(0f64, |m, (a, b)| m.max((a - b).abs())) / scale;
    assert!(err < 1e-9, "{ctx}: merged differs from the whole by {err:e}");
    for (i, (&g, &w)) in merged.lse.iter().zip(&whole.lse).enumerate() {
        let ok = if w == f64::NEG_INFINITY { g == w } else { (g - w).abs() <= 1e-9 * w.abs().max(1.0) };
        assert!(ok, "{ctx}: lse[{i}] = {g}, want {w}");
    }
}

#[test]
fn sharded_decode_merged_equals_whole_bf16() {
    for (world, interleave, sinks) in [(2, 1, false), (3, 1, true), (4, 8, false), (4, 16, true)] {
        sharded_equals_whole::<bf16>(world, interleave, sinks, 1, 50 + world as u64);
    }
}

#[test]
fn speculative_tokens_decoded_a_request_a_token_equal_whole() {
    for (world, interleave, q) in [(2, 1, 2), (3, 1, 4), (4, 8, 3), (2, 16, 8)] {
        sharded_equals_whole::<bf16>(world, interleave, true, q, 70 + q as u64);
    }
}

#[test]
fn sharded_decode_merged_equals_whole_fp8() {
    for (world, interleave) in [(2, 1), (3, 4)] {
        sharded_equals_whole::<Fp8E4m3>(world, interleave, true, 1, 60 + world as u64);
    }
}
