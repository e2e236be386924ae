//! Valid batches: the split, the metadata, the packed words and the builder against the
//! references.

use crate::{arg_of, assemble, build, check_packed, masked, pick, random_config, random_reqs, ref_metadata, ref_split, ref_validate, Req};
use attn_rs::decode::DecodePlan;
use attn_rs::metadata::{pack, pack_into, split_decodes, validate, BatchSplit, MetadataBuilder, PlanConfig, StepInput};
use attn_rs::{AttnError, KvCacheSpec, KvLayout};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[test]
fn random_batches_match_the_reference() {
    let mut rng = SmallRng::seed_from_u64(1);
    let mut stale = vec![0xdead_beef_u32; 1 << 16];
    let (mut with_decodes, mut with_prefills, mut with_empty) = (0, 0, 0);
    for _ in 0..120 {
        let c = random_config(&mut rng);
        let mut builder = MetadataBuilder::new(c).unwrap();
        for _ in 0..4 {
            let reqs = random_reqs(&mut rng, c.decode_threshold, false);
            let block_size = pick(&mut rng, &[1usize, 16, 32, 64]);
            let b = assemble(&mut rng, &reqs, block_size);
            let what = format!("{} requests, config {c:?}", b.n());
            assert_eq!(ref_validate(&b), None, "{what}");
            validate(&b.input()).unwrap();
            let split = split_decodes(&b.input(), c.decode_threshold).unwrap();
            assert_eq!(Ok(split), ref_split(&b, c.decode_threshold), "{what}");

            let m = build(&b, &c).unwrap();
            let want = ref_metadata(&b, &c);
            assert_eq!(m, want, "{what}");
            let plan = &m.decode.plan;
            assert_eq!(plan.req_num_splits.len(), split.num_decodes, "{what}");
            assert!(plan.items.is_empty() && plan.token_request.is_empty(), "{what}");

            let (words, layout) = pack(&m, &b.input());
            check_packed(&words, &layout, &b, &m, &what);
            // Into a reused buffer full of stale words: the same except for unused entries.
            let stale_layout = pack_into(&m, &b.input(), &mut stale);
            assert_eq!(stale_layout, layout, "{what}");
            check_packed(&stale, &layout, &b, &m, &what);
            assert_eq!(masked(&stale, &layout, &b), masked(&words, &layout, &b), "{what}");

            // The builder (its buffers reused across these batches) gives the same.
            let built = builder.build(&b.input()).unwrap();
            assert_eq!(built.metadata, &m, "{what}");
            assert_eq!(built.layout, &layout, "{what}");
            assert_eq!(masked(built.words, built.layout, &b), masked(&words, &layout, &b), "{what}");

            with_decodes += (split.num_decodes > 0) as usize;
            with_prefills += (split.num_prefills > 0) as usize;
            with_empty += (0..b.n()).any(|r| b.q_len(r) == 0) as usize;
        }
    }
    assert!(with_decodes > 100 && with_prefills > 100 && with_empty > 50, "{with_decodes} {with_prefills} {with_empty}");
}

#[test]
fn many_decodes_match_the_free_functions() {
    // Large decode batches and small ones with long contexts through the builder.
    let mut rng = SmallRng::seed_from_u64(2);
    for i in 0..200 {
        let c = random_config(&mut rng);
        let n = if i % 2 == 0 { rng.random_range(100..400) } else { rng.random_range(1..12) };
        let reqs: Vec<Req> = (0..n)
            .map(|_| {
                let q = rng.random_range(1..=c.decode_threshold as i32);
                (q, q + rng.random_range(0..if i % 2 == 0 { 8000 } else { 60_000 }))
            })
            .collect();
        let b = assemble(&mut rng, &reqs, 16);
        let m = build(&b, &c).unwrap();
        assert_eq!(m, ref_metadata(&b, &c));
        let mut builder = MetadataBuilder::new(c).unwrap();
        let built = builder.build(&b.input()).unwrap();
        assert_eq!(built.metadata, &m, "{n} requests, {c:?}");
        let (words, layout) = pack(&m, &b.input());
        assert_eq!(masked(built.words, built.layout, &b), masked(&words, &layout, &b));
    }
}

#[test]
fn edge_batches() {
    let c = PlanConfig { decode_threshold: 4, num_q_heads: 32, num_kv_heads: 8, head_size: 128 };
    let mut rng = SmallRng::seed_from_u64(3);
    for reqs in [
        vec![],                                     // no requests at all
        vec![(0, 0), (0, 35)],                      // only empty requests (decodes, no tokens)
        vec![(1, 1), (4, 4), (2, 5000)],            // only decodes, up to the threshold
        vec![(5, 5), (300, 1000)],                  // only prefills, from threshold + 1
        vec![(0, 0), (1, 17), (3, 3), (9, 9)],      // all kinds
        vec![(1, 16), (1, 17), (16, 32), (17, 48)], // block boundaries
    ] {
        let b = assemble(&mut rng, &reqs, 16);
        let m = build(&b, &c).unwrap();
        assert_eq!(m, ref_metadata(&b, &c), "{reqs:?}");
        let (words, layout) = pack(&m, &b.input());
        check_packed(&words, &layout, &b, &m, &format!("{reqs:?}"));
        let mut builder = MetadataBuilder::new(c).unwrap();
        let built = builder.build(&b.input()).unwrap();
        assert_eq!(built.metadata, &m, "{reqs:?}");
        assert_eq!(masked(built.words, built.layout, &b), masked(&words, &layout, &b));
    }
    // No decodes: an empty plan.
    let b = assemble(&mut rng, &[(5, 5)], 16);
    let m = build(&b, &c).unwrap();
    assert_eq!(m.decode.plan, DecodePlan::default());
    assert_eq!((m.split.num_decodes, m.split.num_prefills, m.split.num_prefill_tokens), (0, 1, 5));
    assert_eq!((m.prefill.max_query_len, m.prefill.max_seq_len), (5, 5));
    // The spec constructor takes the cache's blocks and block size.
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, b.num_blocks, 16, 8, 128).unwrap();
    let input = StepInput::new(&b.qsl, &b.seq_lens, &b.block_table, b.stride, &b.slots, b.num_actual_tokens, &spec);
    assert_eq!((input.num_blocks, input.block_size, input.num_slots()), (b.num_blocks, 16, b.num_blocks * 16));
    validate(&input).unwrap();
}

#[test]
fn split_counts_and_the_decode_after_prefill_refusal() {
    let mut rng = SmallRng::seed_from_u64(4);
    // q_lens 1, 2, 0 | 3, 7 with threshold 2: an empty request is a decode.
    let b = assemble(&mut rng, &[(1, 10), (2, 20), (0, 5), (3, 3), (7, 40)], 16);
    let s = split_decodes(&b.input(), 2).unwrap();
    assert_eq!(s, BatchSplit { num_decodes: 3, num_decode_tokens: 3, num_prefills: 2, num_prefill_tokens: 10 });
    assert_eq!(split_decodes(&b.input(), 3).unwrap().num_decodes, 4);
    assert_eq!(split_decodes(&b.input(), 7).unwrap().num_prefills, 0);
    // threshold 1: request 1 (2 tokens) is a prefill, request 2 (empty) a decode after it.
    let e = split_decodes(&b.input(), 1).unwrap_err();
    assert!(matches!(&e, AttnError::InvalidArgument { arg: "query_start_loc", reason } if reason.contains("request 2")), "{e}");
    // An empty request after prefills is a decode out of place too (as in vLLM).
    let b = assemble(&mut rng, &[(1, 10), (9, 20), (0, 5)], 16);
    let e = split_decodes(&b.input(), 4).unwrap_err();
    assert!(matches!(&e, AttnError::InvalidArgument { arg: "query_start_loc", reason } if reason.contains("request 2")), "{e}");
    // build refuses it the same way.
    let c = PlanConfig { decode_threshold: 4, ..random_config(&mut rng) };
    assert_eq!(arg_of(build(&b, &c)), "query_start_loc");
    // Bad start locations are refused by the split itself.
    let mut bad = b.clone();
    bad.qsl[1] = 50;
    assert_eq!(arg_of(split_decodes(&bad.input(), 4)), "query_start_loc");
}
