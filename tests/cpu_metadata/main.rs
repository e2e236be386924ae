//! CPU tests of the per-step metadata (`attn_rs::metadata`): validation and its refusals (each
//! naming its argument), the decode/prefill split and the decode-first order, the tensor-core
//! metadata and the packed staging words, all against straightforward references written here
//! on random batches (decodes of 1..=threshold query tokens, long prefills, empty requests),
//! and `MetadataBuilder` against the free functions.
//!
//! Here: the batches and the references; by part: [`valid`] (valid batches), [`order`] (the
//! decode-first and prefill plan orders), [`refusals`].

use attn_math::decode::HEAD_SIZES;
use attn_rs::metadata::{build_tensor_core_metadata, BatchSplit, PlanConfig, StagingLayout, StepInput, TensorCoreMetadata, ALIGN_WORDS};
use attn_rs::AttnError;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::Rng;

mod order;
mod refusals;
mod valid;

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

fn build(b: &Batch, c: &PlanConfig) -> attn_rs::Result<TensorCoreMetadata> {
    build_tensor_core_metadata(&b.input(), c.decode_threshold, c.num_q_heads, c.num_kv_heads, c.head_size)
}

fn arg_of<T: std::fmt::Debug>(r: attn_rs::Result<T>) -> &'static str {
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
