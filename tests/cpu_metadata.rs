//! CPU tests of the per-step metadata (`host::metadata`): validation and its refusals (each
//! naming its argument), the decode/prefill split and the decode-first order, the tensor-core
//! metadata and the packed staging words, all against straightforward references written here
//! on random batches (decodes of 1..=threshold query tokens, long prefills, empty requests),
//! and `MetadataBuilder` against the free functions.

use host::attn_math::decode::HEAD_SIZES;
use host::decode::DecodePlan;
use host::metadata::{
    build_tensor_core_metadata, decode_first_order, pack, pack_into, split_decodes, validate, BatchSplit, MetadataBuilder, PlanConfig,
    Region, StagingLayout, StepInput, TensorCoreMetadata, ALIGN_WORDS,
};
use host::{AttnError, KvCacheSpec, KvLayout};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

fn pick<T: Copy>(rng: &mut SmallRng, xs: &[T]) -> T {
    xs[rng.random_range(0..xs.len())]
}

// ---------------------------------------------------------------------------------------------
// Batches
// ---------------------------------------------------------------------------------------------

/// One step's engine-side arrays (owned).
#[derive(Clone, Debug)]
struct Batch {
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    block_table: Vec<i32>,
    stride: usize,
    slots: Vec<i64>,
    num_actual_tokens: usize,
    num_blocks: usize,
    block_size: usize,
}

impl Batch {
    fn input(&self) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq_lens,
            block_table: &self.block_table,
            block_table_stride: self.stride,
            slot_mapping: &self.slots,
            num_actual_tokens: self.num_actual_tokens,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
        }
    }

    fn n(&self) -> usize {
        self.seq_lens.len()
    }

    fn q_len(&self, r: usize) -> i32 {
        self.qsl[r + 1] - self.qsl[r]
    }

    fn blocks(&self, r: usize) -> usize {
        (self.seq_lens[r].max(0) as usize).div_ceil(self.block_size)
    }

    fn row(&self, r: usize) -> &[i32] {
        &self.block_table[r * self.stride..][..self.stride]
    }
}

/// A request: `(q_len, seq_len)`.
type Req = (i32, i32);

fn decode_req(rng: &mut SmallRng, threshold: usize) -> Req {
    let q = rng.random_range(1..=threshold as i32);
    (q, q + rng.random_range(0..4000))
}

fn prefill_req(rng: &mut SmallRng, threshold: usize) -> Req {
    let q = rng.random_range(threshold as i32 + 1..=threshold as i32 + 300);
    (q, q + if rng.random_bool(0.5) { 0 } else { rng.random_range(0..2000) })
}

fn empty_req(rng: &mut SmallRng) -> Req {
    (0, if rng.random_bool(0.3) { 0 } else { rng.random_range(0..3000) })
}

/// The arrays of `reqs` in this order: block ids at random in the cache, garbage (out of range,
/// negative) past each request's blocks and in spare rows, slots of each new token from its
/// block (a few -1), and garbage slots past `num_actual_tokens`.
fn assemble(rng: &mut SmallRng, reqs: &[Req], block_size: usize) -> Batch {
    let n = reqs.len();
    let mut qsl = vec![0];
    for &(q, _) in reqs {
        qsl.push(qsl.last().unwrap() + q);
    }
    let seq_lens: Vec<i32> = reqs.iter().map(|&(_, l)| l).collect();
    let max_blocks = seq_lens.iter().map(|&l| (l as usize).div_ceil(block_size)).max().unwrap_or(0);
    let stride = max_blocks + rng.random_range(0..4);
    let num_blocks = rng.random_range(1..5000);
    let spare_rows = rng.random_range(0..3);
    let garbage = [-1, -7, i32::MIN, num_blocks as i32, num_blocks as i32 + 100, i32::MAX];
    let mut block_table: Vec<i32> = (0..(n + spare_rows) * stride).map(|_| pick(rng, &garbage)).collect();
    for (r, &len) in seq_lens.iter().enumerate() {
        for b in &mut block_table[r * stride..][..(len as usize).div_ceil(block_size)] {
            *b = rng.random_range(0..num_blocks as i32);
        }
    }
    let mut slots = Vec::new();
    for (r, &(q, len)) in reqs.iter().enumerate() {
        for pos in (len - q)..len {
            let pos = pos as usize;
            let block = block_table[r * stride + pos / block_size] as usize;
            slots.push(if rng.random_bool(0.05) { -1 } else { (block * block_size + pos % block_size) as i64 });
        }
    }
    let num_actual_tokens = slots.len();
    for _ in 0..rng.random_range(0..3) {
        slots.push(pick(rng, &[i64::MAX, -5, i64::MIN]));
    }
    Batch { qsl, seq_lens, block_table, stride, slots, num_actual_tokens, num_blocks, block_size }
}

/// Random requests: decodes (some empty), prefills, in random order when `shuffled`, else
/// decodes first (the empty ones among them).
fn random_reqs(rng: &mut SmallRng, threshold: usize, shuffled: bool) -> Vec<Req> {
    let n = pick(rng, &[0usize, 1, 3, 17, 64, 200, 300]);
    let prefill_p = pick(rng, &[0.0, 0.1, 0.5, 1.0]);
    let empty_p = pick(rng, &[0.0, 0.05, 0.3]);
    let mut decodes = Vec::new();
    let mut prefills = Vec::new();
    for _ in 0..n {
        if rng.random_bool(prefill_p) {
            prefills.push(prefill_req(rng, threshold));
        } else if rng.random_bool(empty_p) {
            decodes.push(empty_req(rng));
        } else {
            decodes.push(decode_req(rng, threshold));
        }
    }
    decodes.shuffle(rng);
    decodes.extend(prefills);
    if shuffled {
        decodes.shuffle(rng);
    }
    decodes
}

fn random_config(rng: &mut SmallRng) -> PlanConfig {
    let num_kv_heads = pick(rng, &[1usize, 2, 4, 8]);
    PlanConfig {
        decode_threshold: rng.random_range(1..=8),
        num_q_heads: num_kv_heads * pick(rng, &[1usize, 2, 4, 8]),
        num_kv_heads,
        head_size: pick(rng, &HEAD_SIZES) as usize,
    }
}

fn build(b: &Batch, c: &PlanConfig) -> host::Result<TensorCoreMetadata> {
    build_tensor_core_metadata(&b.input(), c.decode_threshold, c.num_q_heads, c.num_kv_heads, c.head_size)
}

fn arg_of<T: std::fmt::Debug>(r: host::Result<T>) -> &'static str {
    match r {
        Err(AttnError::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected an InvalidArgument refusal, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// References
// ---------------------------------------------------------------------------------------------

/// The argument `validate` must refuse first (None: the step is valid), checked in its order.
fn ref_validate(b: &Batch) -> Option<&'static str> {
    let n = b.n();
    if b.block_size == 0 {
        return Some("block_size");
    }
    if b.qsl.len() != n + 1 || b.qsl[0] != 0 || (0..n).any(|r| b.qsl[r + 1] < b.qsl[r]) || b.qsl[n] as i64 != b.num_actual_tokens as i64 {
        return Some("query_start_loc");
    }
    if (0..n).any(|r| b.seq_lens[r] < 0 || (b.q_len(r) > 0 && b.seq_lens[r] < b.q_len(r))) {
        return Some("seq_lens");
    }
    if b.block_table.len() < n * b.stride {
        return Some("block_table");
    }
    for r in 0..n {
        if b.blocks(r) > b.stride || b.row(r)[..b.blocks(r)].iter().any(|&id| id < 0 || id as usize >= b.num_blocks) {
            return Some("block_table");
        }
    }
    if b.slots.len() < b.num_actual_tokens
        || b.slots[..b.num_actual_tokens].iter().any(|&s| s < -1 || s >= (b.num_blocks * b.block_size) as i64)
    {
        return Some("slot_mapping");
    }
    None
}

/// The split of an ordered batch, or the first decode that follows a prefill.
fn ref_split(b: &Batch, threshold: usize) -> Result<BatchSplit, usize> {
    let is_decode = |r: usize| b.q_len(r) <= threshold as i32;
    let mut num_decodes = 0;
    while num_decodes < b.n() && is_decode(num_decodes) {
        num_decodes += 1;
    }
    if let Some(r) = (num_decodes..b.n()).find(|&r| is_decode(r)) {
        return Err(r);
    }
    let decode_tokens: i32 = (0..num_decodes).map(|r| b.q_len(r)).sum();
    let prefill_tokens: i32 = (num_decodes..b.n()).map(|r| b.q_len(r)).sum();
    Ok(BatchSplit {
        num_decodes,
        num_decode_tokens: decode_tokens as usize,
        num_prefills: b.n() - num_decodes,
        num_prefill_tokens: prefill_tokens as usize,
    })
}

/// The metadata, part by part with plain loops (the decode part not planned: a zero split
/// count and partial base a decode request).
fn ref_metadata(b: &Batch, c: &PlanConfig) -> TensorCoreMetadata {
    let split = ref_split(b, c.decode_threshold).expect("ordered");
    let nd = split.num_decodes;
    let mut m = TensorCoreMetadata { split, num_actual_tokens: b.num_actual_tokens, ..Default::default() };
    m.decode.plan.req_num_splits = vec![0; nd];
    m.decode.plan.req_partial_base = vec![0; nd];
    for r in 0..nd {
        m.decode.max_query_len = m.decode.max_query_len.max(b.q_len(r) as usize);
        m.decode.max_seq_len = m.decode.max_seq_len.max(b.seq_lens[r] as usize);
    }
    m.prefill.query_start_loc.push(0);
    for r in nd..b.n() {
        let q = b.q_len(r);
        m.prefill.query_start_loc.push(m.prefill.query_start_loc.last().unwrap() + q);
        m.prefill.seq_lens.push(b.seq_lens[r]);
        m.prefill.max_query_len = m.prefill.max_query_len.max(q as usize);
        m.prefill.max_seq_len = m.prefill.max_seq_len.max(b.seq_lens[r] as usize);
    }
    m
}

fn i32s(words: &[u32]) -> Vec<i32> {
    words.iter().map(|&w| w as i32).collect()
}

/// Checks the layout's alignment and order, the zero gaps, and unpacks every array from the
/// words to compare with the batch and the metadata.
fn check_packed(words: &[u32], layout: &StagingLayout, b: &Batch, m: &TensorCoreMetadata, what: &str) {
    let regions = layout.regions();
    let mut at = 0;
    for (name, r) in regions {
        assert_eq!(r.offset % ALIGN_WORDS, 0, "{what}: {name} at word {} is not 16-byte aligned", r.offset);
        assert!(r.offset >= at && r.offset - at < ALIGN_WORDS, "{what}: {name} at {} after the previous end {at}", r.offset);
        assert!(words[at..r.offset].iter().all(|&w| w == 0), "{what}: the gap before {name} is not zero");
        at = r.end();
    }
    assert_eq!(layout.total_words, at.next_multiple_of(ALIGN_WORDS), "{what}");
    assert_eq!(words.len(), layout.total_words, "{what}");
    assert!(words[at..].iter().all(|&w| w == 0), "{what}: the tail is not zero");

    assert_eq!(i32s(layout.query_start_loc.of(words)), b.qsl, "{what}");
    assert_eq!(i32s(layout.seq_lens.of(words)), b.seq_lens, "{what}");
    let width = (0..b.n()).map(|r| b.blocks(r)).max().unwrap_or(0);
    assert_eq!(layout.block_table_stride, width, "{what}: rows as wide as the most blocks used");
    assert_eq!(layout.block_table.len, b.n() * width, "{what}");
    let table = layout.block_table.of(words);
    for r in 0..b.n() {
        let used = b.blocks(r);
        assert_eq!(i32s(&table[r * width..][..used]), b.row(r)[..used], "{what}: block-table row {r}");
    }
    let slots: Vec<i64> = layout.slot_mapping.of(words).chunks(2).map(|p| (p[0] as u64 | (p[1] as u64) << 32) as i64).collect();
    assert_eq!(slots, b.slots[..b.num_actual_tokens], "{what}");
    assert_eq!(i32s(layout.prefill_query_start_loc.of(words)), m.prefill.query_start_loc, "{what}");
    let plan = &m.decode.plan;
    assert_eq!(layout.work_items.of(words), plan.items, "{what}");
    assert_eq!(layout.req_num_splits.of(words), plan.req_num_splits, "{what}");
    assert_eq!(layout.req_partial_base.of(words), plan.req_partial_base, "{what}");
    assert_eq!(layout.token_request.of(words), plan.token_request, "{what}");
    // The prefill part's views.
    let nd = m.split.num_decodes;
    assert_eq!(layout.num_decodes, nd);
    assert_eq!(i32s(layout.prefill_seq_lens().of(words)), m.prefill.seq_lens, "{what}");
    assert_eq!(layout.prefill_block_table().len, m.split.num_prefills * width, "{what}");
}

/// The words with every block-table entry past a request's blocks zeroed (those are
/// unspecified after `pack_into`).
fn masked(words: &[u32], layout: &StagingLayout, b: &Batch) -> Vec<u32> {
    let mut w = words.to_vec();
    let width = layout.block_table_stride;
    for r in 0..b.n() {
        let start = layout.block_table.offset + r * width;
        w[start + b.blocks(r)..start + width].fill(0);
    }
    w
}

// ---------------------------------------------------------------------------------------------
// Valid batches: split, metadata, words, builder
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// decode_first_order
// ---------------------------------------------------------------------------------------------

/// The batch with its requests in `order` (rows, lengths, slots move with their request).
fn reordered(b: &Batch, order: &[usize]) -> Batch {
    let mut qsl = vec![0];
    let (mut seq_lens, mut block_table, mut slots) = (Vec::new(), Vec::new(), Vec::new());
    for &r in order {
        qsl.push(qsl.last().unwrap() + b.q_len(r));
        seq_lens.push(b.seq_lens[r]);
        block_table.extend_from_slice(b.row(r));
        slots.extend_from_slice(&b.slots[b.qsl[r] as usize..b.qsl[r + 1] as usize]);
    }
    Batch { qsl, seq_lens, block_table, slots, ..b.clone() }
}

#[test]
fn decode_first_order_is_a_stable_partition() {
    let mut rng = SmallRng::seed_from_u64(5);
    let mut out_of_order = 0;
    for _ in 0..300 {
        let threshold = rng.random_range(1..=8);
        let reqs = random_reqs(&mut rng, threshold, true);
        let b = assemble(&mut rng, &reqs, 16);
        let order = decode_first_order(&b.input(), threshold);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..b.n()).collect::<Vec<_>>(), "a permutation");
        let is_decode = |r: usize| b.q_len(r) <= threshold as i32;
        let nd = (0..b.n()).filter(|&r| is_decode(r)).count();
        assert!(order[..nd].iter().all(|&r| is_decode(r)) && order[nd..].iter().all(|&r| !is_decode(r)), "decodes first");
        assert!(order[..nd].windows(2).all(|w| w[0] < w[1]), "decodes keep their order");
        assert!(order[nd..].windows(2).all(|w| w[0] < w[1]), "prefills keep their order");

        out_of_order += split_decodes(&b.input(), threshold).is_err() as usize;
        let ordered = reordered(&b, &order);
        validate(&ordered.input()).unwrap();
        let split = split_decodes(&ordered.input(), threshold).unwrap();
        assert_eq!(Ok(split), ref_split(&ordered, threshold));
        assert_eq!(split.num_decodes, nd);
        // Already ordered: the identity.
        assert_eq!(decode_first_order(&ordered.input(), threshold), (0..b.n()).collect::<Vec<_>>());
    }
    assert!(out_of_order > 50, "{out_of_order} shuffled batches needed reordering");
}

// ---------------------------------------------------------------------------------------------
// Refusals
// ---------------------------------------------------------------------------------------------

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
        (PlanConfig { head_size: 80, ..base }, "head_size"),
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
    let layout = StagingLayout::new(&host::metadata::StagingSizes {
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

// ---------------------------------------------------------------------------------------------
// Prefill plan order
// ---------------------------------------------------------------------------------------------

/// `plan_prefill` on random batches (chunked, empty and causal/non-causal requests, GQA): every
/// row tile once; requests in the order of their longest tile, each one's tiles contiguous and
/// longest first.
#[test]
fn prefill_plan_takes_requests_by_longest_tile_and_their_tiles_longest_first() {
    use host::prefill::{plan_prefill, PrefillBatch};
    let mut rng = SmallRng::seed_from_u64(41);
    for case in 0..200 {
        let n = rng.random_range(1..12);
        let q_lens: Vec<i32> = (0..n).map(|_| pick(&mut rng, &[0, 1, 17, 128, 500, 2048])).collect();
        let seq_lens: Vec<i32> = q_lens.iter().map(|&q| q + pick(&mut rng, &[0, 0, 300, 8192])).collect();
        let qsl: Vec<i32> = std::iter::once(0)
            .chain(q_lens.iter().scan(0, |a, &q| {
                *a += q;
                Some(*a)
            }))
            .collect();
        let (group, causal, block_m) = (pick(&mut rng, &[1, 4, 8]), rng.random_bool(0.7), pick(&mut rng, &[64, 128]));
        let batch = PrefillBatch { query_start_loc: &qsl, seq_lens: &seq_lens, key_start_loc: None };
        let plan = plan_prefill(&batch, group, causal, None, block_m);
        // Keys a tile attends (the plan's own bound): causal, the last token's; else all.
        let keys = |[req, tile]: [u32; 2]| {
            let (r, t) = (req as usize, (tile >> 16) as usize);
            let rows = q_lens[r] as usize * group;
            let last_token = ((t + 1) * block_m as usize).min(rows).div_ceil(group);
            if causal {
                seq_lens[r] as usize - q_lens[r] as usize + last_token
            } else {
                seq_lens[r] as usize
            }
        };
        let mut expected: Vec<[u32; 2]> = (0..n)
            .flat_map(|r| (0..(q_lens[r] as usize * group).div_ceil(block_m as usize)).map(move |t| [r as u32, (t as u32) << 16]))
            .collect();
        let mut got = plan.items.clone();
        got.sort();
        expected.sort();
        assert_eq!(got, expected, "case {case}: every tile once");
        let mut seen_done = std::collections::HashSet::new();
        for w in plan.items.windows(2) {
            let ([ra, _], [rb, _]) = (w[0], w[1]);
            if ra == rb {
                assert!(keys(w[0]) >= keys(w[1]), "case {case}: request {ra}'s tiles longest first");
            } else {
                assert!(seen_done.insert(ra), "case {case}: request {ra}'s tiles are contiguous");
                let longest = |r: u32| plan.items.iter().filter(|i| i[0] == r).map(|&i| keys(i)).max().unwrap();
                assert!(longest(ra) >= longest(rb), "case {case}: requests by their longest tile");
            }
        }
    }
}
