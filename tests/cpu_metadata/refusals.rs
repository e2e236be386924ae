//! Refusals by `validate`, `build_tensor_core_metadata` and the builder, each naming its
//! argument, like the reference on random corruptions; the builder recovers after one.

use crate::{arg_of, assemble, build, pick, random_config, random_reqs, ref_validate, Batch};
use attn_rs::metadata::{validate, MetadataBuilder, PlanConfig, Region, StagingLayout};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// A small valid batch: decodes (1, 2 tokens), an empty request, a prefill of 20; block size 16.
fn small_batch() -> Batch {
    let mut rng = SmallRng::seed_from_u64(6);
    let mut b = assemble(&mut rng, &[(1, 40), (2, 17), (0, 0), (20, 50)], 16);
    b.slots.truncate(b.num_actual_tokens);
    b
}

/// Refusals by `validate`, `build_tensor_core_metadata` and the builder, all naming `arg`,
/// with the builder's message the free path's.
fn refused(b: &Batch, arg: &str, case: &str) {
    assert_eq!(ref_validate(b), Some(arg), "{case}: the reference disagrees");
    assert_eq!(arg_of(validate(&b.input())), arg, "{case}");
    let c = PlanConfig { decode_threshold: 2, num_q_heads: 8, num_kv_heads: 2, head_size: 64 };
    let free = build(b, &c).unwrap_err().to_string();
    assert!(free.contains(&format!("`{arg}`")), "{case}: {free}");
    let mut builder = MetadataBuilder::new(c).unwrap();
    let e = builder.build(&b.input()).unwrap_err().to_string();
    assert_eq!(e, free, "{case}");
}

#[test]
fn every_refusal_names_its_argument() {
    let ok = small_batch();
    assert_eq!(ref_validate(&ok), None);
    validate(&ok.input()).unwrap();
    let with = |f: &dyn Fn(&mut Batch)| {
        let mut b = ok.clone();
        f(&mut b);
        b
    };

    // query_start_loc
    refused(&with(&|b| b.qsl[0] = 1), "query_start_loc", "not starting at 0");
    refused(&with(&|b| b.qsl.insert(0, 0)), "query_start_loc", "num_reqs + 2 entries");
    refused(&with(&|b| b.qsl.truncate(b.qsl.len() - 1)), "query_start_loc", "num_reqs entries");
    refused(&with(&|b| b.qsl[2] = 0), "query_start_loc", "decreasing");
    refused(&with(&|b| b.num_actual_tokens += 1), "query_start_loc", "last != num_actual_tokens");
    refused(&with(&|b| b.num_actual_tokens -= 1), "query_start_loc", "last != num_actual_tokens (fewer)");
    // seq_lens
    refused(&with(&|b| b.seq_lens[1] = 1), "seq_lens", "seq_len < q_len");
    refused(&with(&|b| b.seq_lens[3] = 19), "seq_lens", "prefill seq_len < q_len");
    refused(&with(&|b| b.seq_lens[2] = -1), "seq_lens", "negative (empty request)");
    // block_table
    refused(&with(&|b| b.seq_lens[0] = (b.stride * 16 + 1) as i32), "block_table", "more blocks than the row holds");
    refused(&with(&|b| b.block_table[b.stride] = b.num_blocks as i32), "block_table", "block id == num_blocks");
    refused(&with(&|b| b.block_table[2] = -1), "block_table", "negative block id");
    refused(&with(&|b| b.block_table[3 * b.stride + 3] = i32::MAX), "block_table", "prefill's last block");
    refused(&with(&|b| b.block_table.truncate(4 * b.stride - 1)), "block_table", "fewer than num_reqs rows");
    // slot_mapping
    refused(&with(&|b| b.slots.pop().map(drop).unwrap()), "slot_mapping", "shorter than num_actual_tokens");
    refused(&with(&|b| b.slots[0] = (b.num_blocks * 16) as i64), "slot_mapping", "slot == num_slots");
    refused(&with(&|b| b.slots[5] = -2), "slot_mapping", "negative other than -1");
    refused(&with(&|b| b.slots[22] = i64::MAX), "slot_mapping", "huge");
    // block_size
    let mut b = ok.clone();
    b.block_size = 0;
    assert_eq!(arg_of(validate(&b.input())), "block_size");

    // What is not refused: unused block-table entries and slots past num_actual_tokens.
    let fine = with(&|b| {
        let used = b.blocks(0);
        b.block_table[used..b.stride].fill(-9);
        b.slots.push(i64::MIN);
    });
    assert_eq!(ref_validate(&fine), None);
    validate(&fine.input()).unwrap();
    // An empty request may have any length, and -1 is padding.
    let fine = with(&|b| {
        b.seq_lens[2] = 3;
        b.block_table[2 * b.stride] = 0;
        b.slots[1] = -1;
    });
    validate(&fine.input()).unwrap();
}

#[test]
fn random_corruptions_are_refused_like_the_reference() {
    let mut rng = SmallRng::seed_from_u64(7);
    let mut refusals = std::collections::BTreeMap::<&str, usize>::new();
    for _ in 0..600 {
        let threshold = rng.random_range(1..=8);
        let reqs = random_reqs(&mut rng, threshold, false);
        let block_size = pick(&mut rng, &[1usize, 16, 64]);
        let mut b = assemble(&mut rng, &reqs, block_size);
        let n = b.n();
        for _ in 0..rng.random_range(1..3) {
            match rng.random_range(0..8) {
                0 if n > 0 => b.qsl[rng.random_range(0..=n)] += pick(&mut rng, &[-3, -1, 1, 5]),
                1 if n > 0 => b.seq_lens[rng.random_range(0..n)] += pick(&mut rng, &[-4000, -10, -1, 1, 300, 50_000]),
                2 if !b.block_table.is_empty() => {
                    let i = rng.random_range(0..b.block_table.len());
                    let num_blocks = b.num_blocks as i32;
                    b.block_table[i] = pick(&mut rng, &[-1, num_blocks, i32::MAX, 0]);
                }
                3 => b.num_blocks = rng.random_range(0..b.num_blocks + 1),
                4 if !b.slots.is_empty() => {
                    let i = rng.random_range(0..b.slots.len());
                    let num_slots = (b.num_blocks * b.block_size) as i64;
                    b.slots[i] = pick(&mut rng, &[-2, -1, i64::MAX, num_slots]);
                }
                5 => b.slots.truncate(rng.random_range(0..=b.slots.len())),
                6 => b.stride = b.stride.saturating_sub(rng.random_range(0..3)),
                _ => b.num_actual_tokens = rng.random_range(0..b.num_actual_tokens + 2),
            }
        }
        let want = ref_validate(&b);
        let got = validate(&b.input());
        match want {
            None => got.unwrap(),
            Some(arg) => {
                assert_eq!(arg_of(got), arg, "{b:?}");
                *refusals.entry(arg).or_default() += 1;
            }
        }
        // The builder reports exactly what the free path reports (or builds the same).
        let c = PlanConfig { decode_threshold: threshold, ..random_config(&mut rng) };
        let mut builder = MetadataBuilder::new(c).unwrap();
        match (build(&b, &c), builder.build(&b.input())) {
            (Ok(m), Ok(built)) => assert_eq!(built.metadata, &m),
            (Err(e), Err(f)) => assert_eq!(f.to_string(), e.to_string()),
            (free, built) => panic!("free {:?} vs builder {:?}", free.map(|_| ()), built.map(|_| ())),
        }
    }
    for arg in ["query_start_loc", "seq_lens", "block_table", "slot_mapping"] {
        assert!(refusals.get(arg).copied().unwrap_or(0) > 10, "{refusals:?}");
    }
}

#[test]
fn config_refusals_name_their_argument() {
    let b = small_batch();
    let base = PlanConfig { decode_threshold: 2, num_q_heads: 8, num_kv_heads: 2, head_size: 64 };
    for (c, arg) in [
        (PlanConfig { decode_threshold: 0, ..base }, "decode_threshold"),
        (PlanConfig { decode_threshold: 9, ..base }, "decode_threshold"),
        (PlanConfig { num_kv_heads: 0, ..base }, "num_kv_heads"),
        (PlanConfig { num_q_heads: 7, ..base }, "num_q_heads"),
        (PlanConfig { num_q_heads: 0, ..base }, "num_q_heads"),
        (PlanConfig { head_size: 84, ..base }, "head_size"),
        (PlanConfig { head_size: 264, ..base }, "head_size"),
    ] {
        assert_eq!(arg_of(build(&b, &c)), arg, "{c:?}");
        assert_eq!(arg_of(MetadataBuilder::new(c)), arg, "{c:?}");
    }
}

#[test]
fn builder_recovers_after_a_refusal() {
    let ok = small_batch();
    let mut bad = ok.clone();
    bad.slots[0] = -3;
    let c = PlanConfig { decode_threshold: 2, num_q_heads: 8, num_kv_heads: 2, head_size: 64 };
    let mut builder = MetadataBuilder::new(c).unwrap();
    let first = builder.build(&ok.input()).unwrap().words.to_vec();
    assert_eq!(arg_of(builder.build(&bad.input())), "slot_mapping");
    let again = builder.build(&ok.input()).unwrap();
    assert_eq!(again.words, first);
    assert_eq!(again.metadata, &build(&ok, &c).unwrap());
}

#[test]
fn layout_of_sizes() {
    let layout = StagingLayout::new(&attn_rs::metadata::StagingSizes {
        num_reqs: 3,
        block_table_stride: 5,
        num_actual_tokens: 7,
        num_decodes: 2,
        num_prefills: 1,
        num_work_items: 9,
        num_decode_tokens: 2,
    });
    let want = [
        ("query_start_loc", Region { offset: 0, len: 4 }),
        ("seq_lens", Region { offset: 4, len: 3 }),
        ("block_table", Region { offset: 8, len: 15 }),
        ("slot_mapping", Region { offset: 24, len: 14 }),
        ("prefill_query_start_loc", Region { offset: 40, len: 2 }),
        ("work_items", Region { offset: 44, len: 9 }),
        ("req_num_splits", Region { offset: 56, len: 2 }),
        ("req_partial_base", Region { offset: 60, len: 2 }),
        ("token_request", Region { offset: 64, len: 2 }),
    ];
    assert_eq!(layout.regions(), want);
    assert_eq!((layout.total_words, layout.total_bytes()), (68, 272));
    assert_eq!(layout.slot_mapping.byte_offset() % 8, 0);
    assert_eq!(layout.prefill_seq_lens(), Region { offset: 6, len: 1 });
    assert_eq!(layout.prefill_block_table(), Region { offset: 18, len: 5 });
}
