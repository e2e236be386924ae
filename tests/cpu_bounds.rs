//! CPU tests of the size and range checks: sizes computed from caller numbers that would wrap
//! (row strides, cache specs, latent rows, split plans), start locations whose differences
//! overflow an i32, negative lengths, a block size of 0 and heads of 0 are refused with an error
//! naming the argument, never accepted with a wrapped size and never a panic.

use attn_rs::decode::{merge_attn_states_sizes, plan_decode_tc, validate_batch, DecodeBatch, TcShape};
use attn_rs::prefill::{plan_prefill, validate_prefill_batch, PrefillBatch};
use attn_rs::SplitMode;
use attn_rs::{AttnError, KvCacheSpec, KvLayout, MlaCacheSpec, RowsDesc};

fn arg_of<T>(r: attn_rs::Result<T>) -> String {
    match r {
        Err(AttnError::InvalidArgument { arg, .. }) | Err(AttnError::UnsupportedDType { arg, .. }) => arg.to_string(),
        Err(e) => format!("other error: {e}"),
        Ok(_) => "accepted".to_string(),
    }
}

/// 5 tokens 2^62 elements apart: (5 - 1) * 2^62 + 64 wraps to 64 in a usize.
const WRAPPING_ROWS: RowsDesc = RowsDesc { num_tokens: 5, num_heads: 1, head_size: 64, token_stride: 1 << 62, head_stride: 64 };

#[test]
fn rows_whose_span_overflows_are_refused() {
    assert_eq!(WRAPPING_ROWS.checked_required_len(), None);
    assert_eq!(WRAPPING_ROWS.required_len(), usize::MAX, "saturates: no buffer passes a check against it");
    assert_eq!(arg_of(WRAPPING_ROWS.validate("q")), "q");
    let heads = RowsDesc { num_tokens: 1, num_heads: 3, head_size: 8, token_stride: 0, head_stride: usize::MAX / 2 };
    assert_eq!(heads.checked_required_len(), None);
    assert_eq!(arg_of(heads.validate("k")), "k");
    // Tokens x heads past a usize (the LSE's size), even with a head size of 0.
    let lse = RowsDesc { num_tokens: 1 << 40, num_heads: 1 << 40, head_size: 0, token_stride: 0, head_stride: 0 };
    assert_eq!(arg_of(lse.validate("out")), "out");
    assert_eq!(arg_of(RowsDesc::contiguous(2, usize::MAX, 2).validate("q")), "q");
    let ok = RowsDesc::contiguous(3, 2, 8);
    assert_eq!((ok.checked_required_len(), ok.required_len()), (Some(48), 48));
    ok.validate("q").unwrap();

    // Through an op: 64 elements of key for the wrapping rows.
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, 2, 16, 1, 64).unwrap();
    let (key, mut cache) = (vec![1f32; 64], vec![0f32; spec.num_elements()]);
    let slots = [0i64, 1, 2, 3, 4];
    let value_rows = RowsDesc::contiguous(5, 1, 64);
    let value = vec![1f32; value_rows.required_len()];
    let r = attn_rs::cpu::reshape_and_cache(&key, WRAPPING_ROWS, &value, value_rows, &slots, &mut cache, &spec, None);
    assert_eq!(arg_of(r), "key");
    assert!(cache.iter().all(|&x| x == 0.0));
}

#[test]
fn cache_specs_whose_sizes_overflow_are_refused() {
    // 2^56 + 1 blocks of 16 x 1 x 8: 2 * (2^56 + 1) * 128 elements wrap to one block's 256, and
    // 2^60 + 16 slots would let writes land anywhere.
    let spec = KvCacheSpec { layout: KvLayout::FlashNhd, num_blocks: (1 << 56) + 1, block_size: 16, num_kv_heads: 1, head_size: 8 };
    assert_eq!(spec.checked_num_elements(), None);
    assert_eq!(spec.num_elements(), usize::MAX);
    assert_eq!(arg_of(spec.validate("spec")), "spec");
    assert_eq!(arg_of(KvCacheSpec::new(spec.layout, spec.num_blocks, 16, 1, 8)), "num_blocks");
    let (key, rows) = (vec![1f32; 8], RowsDesc::contiguous(1, 1, 8));
    let mut cache = vec![0f32; 256];
    let r = attn_rs::cpu::reshape_and_cache(&key, rows, &key, rows, &[1 << 40], &mut cache, &spec, None);
    assert_eq!(arg_of(r), "spec");
    assert!(cache.iter().all(|&x| x == 0.0));
    // Every field within u32 but their product past a usize.
    let big = 1usize << 31;
    assert_eq!(arg_of(KvCacheSpec::new(KvLayout::FlashInferHnd, big, big, big, big)), "num_blocks");
    // A spec built field by field with a block size of 0, or no heads.
    for bad in [KvCacheSpec { block_size: 0, ..spec }, KvCacheSpec { num_blocks: 4, num_kv_heads: 0, ..spec }] {
        let mut cache = vec![0f32; 1024];
        let r = attn_rs::cpu::reshape_and_cache(&key, rows, &key, rows, &[0], &mut cache, &bad, None);
        assert_eq!(arg_of(r), "spec", "{bad:?}");
    }
    assert_eq!(arg_of(KvCacheSpec::new(KvLayout::FlashNhd, 4, 0, 1, 8)), "block_size");

    // MLA: (2^56 + 1) blocks of 16 rows of 576 wrap likewise.
    let mla = MlaCacheSpec { num_blocks: (1 << 56) + 1, block_size: 16, latent_dim: 512, rope_dim: 64 };
    assert_eq!(mla.checked_num_elements(), None);
    assert_eq!(arg_of(mla.validate("spec")), "spec");
    assert_eq!(arg_of(MlaCacheSpec::new(mla.num_blocks, 16, 512, 64)), "num_blocks");
    assert_eq!(arg_of(MlaCacheSpec::new(4, 16, 512, usize::MAX)), "rope_dim");
    let (kv_c, k_pe) = (vec![1f32; 512], vec![1f32; 64]);
    let mut cache = vec![0f32; 16 * 576];
    let r = attn_rs::cpu::concat_and_cache_mla(&kv_c, 512, &k_pe, 64, 1, &[1 << 40], &mut cache, &mla, None);
    assert_eq!(arg_of(r), "spec");
    let ok = MlaCacheSpec::new(1, 16, 512, 64).unwrap();
    // Latent rows 2^62 apart: (5 - 1) * 2^62 + 512 wraps to 512.
    let r = attn_rs::cpu::concat_and_cache_mla(&kv_c, 1 << 62, &k_pe, 64, 5, &[0, 1, 2, 3, 4], &mut cache, &ok, None);
    assert_eq!(arg_of(r), "kv_c");
    assert!(cache.iter().all(|&x| x == 0.0));
}

#[test]
fn start_locations_are_compared_without_wrapping() {
    // Prefill: i32::MIN + 5 - i32::MAX wraps to 6, which would pass as "not decreasing".
    let qsl = [0, i32::MAX, i32::MIN + 5];
    let pb = PrefillBatch { query_start_loc: &qsl, seq_lens: &[i32::MAX, 10], key_start_loc: None };
    for causal in [false, true] {
        assert_eq!(arg_of(validate_prefill_batch(&pb, (i32::MIN + 5) as usize, causal, None)), "query_start_loc");
        assert_eq!(arg_of(validate_prefill_batch(&pb, (i32::MIN + 5) as u32 as usize, causal, None)), "query_start_loc");
    }
    let ksl = [0, i32::MAX, i32::MIN];
    let pb = PrefillBatch { query_start_loc: &[0, 1, 2], seq_lens: &[i32::MAX, 1], key_start_loc: Some(&ksl) };
    assert_eq!(arg_of(validate_prefill_batch(&pb, 2, false, None)), "key_start_loc");
    // Decode: i32::MIN - 1.
    let batch = DecodeBatch { seq_lens: &[1, 1], query_start_loc: &[0, 1, i32::MIN] };
    assert_eq!(arg_of(validate_batch(&batch, i32::MIN as usize, 16, 4)), "query_start_loc");
    assert_eq!(arg_of(validate_batch(&batch, i32::MIN as u32 as usize, 16, 4)), "query_start_loc");
    // Negative lengths, even with no query tokens.
    let batch = DecodeBatch { seq_lens: &[-5], query_start_loc: &[0, 0] };
    assert_eq!(arg_of(validate_batch(&batch, 0, 16, 4)), "seq_lens");
    // The infallible planners take such batches without panicking: decreasing start locations
    // are empty requests.
    let batch = DecodeBatch { seq_lens: &[10, -7], query_start_loc: &[0, 3, i32::MIN] };
    let plan = plan_decode_tc(&batch, 4, 4, TcShape { block_m: 0, block_n: 0, ctas_per_item: u32::MAX }, 64, 8, None, SplitMode::Auto, 0);
    assert_eq!((plan.req_num_splits.as_slice(), plan.token_request.as_slice()), (&[1u32, 1][..], &[0u32, 0, 0][..]));
    assert!(plan.items.chunks(2).all(|it| it[0] == 0), "the empty request has no work");
    let plan = plan_prefill(&PrefillBatch { query_start_loc: &[0, 3, -4], seq_lens: &[3, 9], key_start_loc: None }, 0, true, None, 0);
    assert!(plan.items.iter().all(|&[r, _]| r == 0) && plan.items.len() == 3);
}

#[test]
fn block_size_zero_is_refused() {
    let batch = DecodeBatch { seq_lens: &[10], query_start_loc: &[0, 1] };
    assert_eq!(arg_of(validate_batch(&batch, 1, 0, 4)), "block_size");
    let pb = PrefillBatch { query_start_loc: &[0, 4], seq_lens: &[10], key_start_loc: None };
    assert_eq!(arg_of(validate_prefill_batch(&pb, 4, true, Some((0, 4)))), "block_size");
    validate_prefill_batch(&pb, 4, true, None).unwrap();
}

#[test]
fn empty_requests_pass_decode_validation() {
    // No query tokens this step: attends nothing, writes nothing (as `metadata::is_decode`).
    let batch = DecodeBatch { seq_lens: &[7, 0, 3], query_start_loc: &[0, 1, 1, 1] };
    validate_batch(&batch, 1, 16, 1).unwrap();
    let shape = TcShape::attention(64, 64, true, false, 2);
    let plan = plan_decode_tc(&batch, 4, 2, shape, 64, 0, None, SplitMode::Auto, 1024);
    assert_eq!((plan.req_num_splits.len(), plan.token_request.as_slice()), (3, &[0u32][..]));
    let all_empty = DecodeBatch { seq_lens: &[7, 9], query_start_loc: &[0, 0, 0] };
    validate_batch(&all_empty, 0, 16, 1).unwrap();
    let plan = plan_decode_tc(&all_empty, 4, 2, shape, 64, 0, None, SplitMode::Auto, 1024);
    assert!(plan.row_groups >= 1 && plan.partial_rows == 0 && plan.token_request.is_empty(), "{plan:?}");
    let bad = DecodeBatch { seq_lens: &[7], query_start_loc: &[0, 9] };
    assert_eq!(arg_of(validate_batch(&bad, 9, 16, 1)), "query_start_loc");
}

/// A request of 2^22 query tokens in 1024 splits: 1024 * 2^22 partial rows wrap a u32 to 0, so
/// the plan would have said it needs none while writing 2^32 rows.
#[test]
fn split_plans_count_partial_rows_without_wrapping() {
    let q = 1i32 << 22;
    let batch = DecodeBatch { seq_lens: &[2 * q], query_start_loc: &[0, q] };
    // Row tiles of 2^16 rows: 64 for the request, so the work items stay small.
    let shape = TcShape { block_m: 1 << 16, block_n: 16, ctas_per_item: 1 };
    for capacity in [usize::MAX, 1 << 33, 1 << 31, 5 << 22] {
        let plan = plan_decode_tc(&batch, 1, 1, shape, 64, 0, None, SplitMode::Fixed(1024), capacity);
        let splits = plan.req_num_splits[0] as usize;
        let want = if splits > 1 { splits * q as usize } else { 0 };
        assert_eq!(plan.partial_rows, want, "capacity {capacity}: {} splits", splits);
        assert!(plan.partial_rows <= capacity && plan.partial_rows <= u32::MAX as usize, "capacity {capacity}");
        assert_eq!(plan.token_request.len(), q as usize);
    }
}

/// The CPU reference ops read what their arguments say is there: a block table too short for
/// the requests' blocks, short queries or packed keys, or too few ALiBi slopes are refused
/// (they indexed past the slices before).
#[test]
fn cpu_attention_ops_refuse_short_inputs() {
    use attn_rs::cpu::{DecodeRef, KvRef, PrefillRef};
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, 4, 4, 1, 8).unwrap();
    let cache = vec![0.5f32; spec.num_elements()];
    let q = vec![0.5f32; 2 * 8];
    let opts = attn_rs::AttnOptions::new(8);
    let batch = DecodeBatch { seq_lens: &[8, 8], query_start_loc: &[0, 1, 2] };
    let decode = |q: &[f32], block_table: &[i32], slopes: Option<&[f32]>| {
        attn_rs::cpu::paged_decode::<f32, f32>(&DecodeRef {
            q,
            q_rows: RowsDesc::contiguous(2, 1, 8),
            cache: &cache,
            spec,
            block_table,
            block_table_stride: 2,
            batch,
            opts,
            alibi_slopes: slopes,
            sinks: None,
            scales: None,
        })
    };
    decode(&q, &[0, 1, 2, 3], None).unwrap();
    assert_eq!(arg_of(decode(&q, &[0, 1, 2], None)), "block_table");
    assert_eq!(arg_of(decode(&q[..15], &[0, 1, 2, 3], None)), "q");
    assert_eq!(arg_of(decode(&q, &[0, 1, 2, 3], Some(&[]))), "alibi_slopes");
    // Packed keys: request 1's 8 keys from row 8 need 16 rows, k has 12.
    let k_rows = RowsDesc::contiguous(12, 1, 8);
    let k = vec![0.5f32; 12 * 8];
    let r = attn_rs::cpu::prefill::<f32, f32>(&PrefillRef {
        q: &q,
        q_rows: RowsDesc::contiguous(2, 1, 8),
        kv: KvRef::Packed { k: &k, k_rows, v: &k, v_rows: k_rows, key_start_loc: &[0, 8, 16] },
        head_size_v: 8,
        query_start_loc: &[0, 1, 2],
        seq_lens: &[8, 8],
        causal: false,
        opts,
        alibi_slopes: None,
        sinks: None,
        scales: None,
    });
    assert_eq!(arg_of(r), "key_start_loc");
}

#[test]
fn merge_states_sizes_refuse_zero_heads_and_overflow() {
    let rows = RowsDesc::contiguous(4, 2, 64);
    assert_eq!(merge_attn_states_sizes(&rows, (2, 1)).unwrap(), (512, 8));
    assert_eq!(merge_attn_states_sizes(&rows, (1, 4)).unwrap(), (512, 8));
    // No heads: nothing to merge, no LSE (it underflowed `num_heads - 1` before).
    let none = RowsDesc { num_heads: 0, ..rows };
    assert_eq!(merge_attn_states_sizes(&none, (0, 1)).unwrap(), (0, 0));
    assert_eq!(merge_attn_states_sizes(&RowsDesc::contiguous(0, 2, 64), (2, 1)).unwrap(), (0, 0));
    assert_eq!(arg_of(merge_attn_states_sizes(&rows, (usize::MAX / 2, 1))), "lse_strides");
    assert_eq!(arg_of(merge_attn_states_sizes(&WRAPPING_ROWS, (1, 1))), "rows");
    let many = RowsDesc { num_tokens: 1 << 20, num_heads: 1 << 13, head_size: 1, token_stride: 1 << 13, head_stride: 1 };
    assert_eq!(arg_of(merge_attn_states_sizes(&many, (1 << 13, 1))), "rows", "2^33 rows exceed the kernel's u32");
}
