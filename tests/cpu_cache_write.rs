//! CPU tests of the paged-cache layouts and of the CPU cache writes (`reshape_and_cache`,
//! `concat_and_cache_mla`), against an independent row-major model of each layout.

use attn_rs::cpu::{concat_and_cache_mla, reshape_and_cache, HostScales, WriteReport};
use attn_rs::{AttnError, BadSlot, Element, Fp8E4m3, KvCacheSpec, KvLayout, MlaCacheSpec, RowsDesc};
use half::{bf16, f16};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

// ---------------------------------------------------------------------------------------------
// Reference layout model
// ---------------------------------------------------------------------------------------------

/// Row-major offset of `index` in a tensor of `shape` (panics if out of bounds).
fn row_major<const N: usize>(shape: [usize; N], index: [usize; N]) -> usize {
    shape.iter().zip(index).fold(0, |acc, (&n, i)| {
        assert!(i < n, "index {index:?} outside shape {shape:?}");
        acc * n + i
    })
}

/// The index in the layout's tensor shape of (plane, block, token, head, dim).
fn layout_index(layout: KvLayout, [p, b, t, h, d]: [usize; 5]) -> [usize; 5] {
    match layout {
        KvLayout::FlashNhd => [p, b, t, h, d],
        KvLayout::FlashHnd => [p, b, h, t, d],
        KvLayout::FlashInferNhd => [b, p, t, h, d],
        KvLayout::FlashInferHnd => [b, p, h, t, d],
    }
}

/// The layout's shape, written out independently of `KvCacheSpec::shape`.
fn layout_shape(spec: &KvCacheSpec) -> [usize; 5] {
    let (n, b, h, d) = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size);
    layout_index(spec.layout, [2, n, b, h, d])
}

fn ref_kv_offset(spec: &KvCacheSpec, index: [usize; 5]) -> usize {
    row_major(layout_shape(spec), layout_index(spec.layout, index))
}

fn ref_mla_offset(spec: &MlaCacheSpec, block: usize, token: usize, col: usize) -> usize {
    row_major([spec.num_blocks, spec.block_size, spec.latent_dim + spec.rope_dim], [block, token, col])
}

/// Every (plane, block, token, head, dim) of a KV cache.
fn kv_indices(spec: &KvCacheSpec) -> impl Iterator<Item = [usize; 5]> {
    let s = *spec;
    (0..2).flat_map(move |p| {
        (0..s.num_blocks).flat_map(move |b| {
            (0..s.block_size).flat_map(move |t| (0..s.num_kv_heads).flat_map(move |h| (0..s.head_size).map(move |d| [p, b, t, h, d])))
        })
    })
}

/// Asserts that `offsets` are distinct and are exactly `0..len`.
fn assert_bijection(offsets: impl Iterator<Item = usize>, len: usize, what: &str) {
    let mut seen = vec![false; len];
    let mut count = 0;
    for o in offsets {
        assert!(o < len, "{what}: offset {o} outside 0..{len}");
        assert!(!seen[o], "{what}: offset {o} addressed twice");
        seen[o] = true;
        count += 1;
    }
    assert_eq!(count, len, "{what}: offsets do not cover 0..{len}");
}

fn kv_spec(layout: KvLayout, num_blocks: usize, block_size: usize, heads: usize, head_size: usize) -> KvCacheSpec {
    KvCacheSpec::new(layout, num_blocks, block_size, heads, head_size).expect("valid spec")
}

#[test]
fn kv_layout_offsets_are_row_major_in_their_shape() {
    for layout in KvLayout::ALL {
        for (n, b, h, d) in [(1, 1, 1, 1), (3, 4, 2, 5), (2, 16, 3, 8), (5, 1, 4, 2)] {
            let spec = kv_spec(layout, n, b, h, d);
            assert_eq!(spec.shape(), layout_shape(&spec), "{spec:?}");
            assert_eq!(spec.num_elements(), 2 * n * b * h * d, "{spec:?}");
            assert_eq!(spec.num_slots(), n * b, "{spec:?}");
            for idx in kv_indices(&spec) {
                let [p, blk, t, hd, dim] = idx;
                assert_eq!(spec.offset(p, blk, t, hd, dim), ref_kv_offset(&spec, idx), "{spec:?} at {idx:?}");
            }
            let offsets = kv_indices(&spec).map(|[p, blk, t, hd, dim]| spec.offset(p, blk, t, hd, dim));
            assert_bijection(offsets, spec.num_elements(), &format!("{spec:?}"));
        }
    }
}

#[test]
fn kv_layout_strides_agree_with_offsets() {
    for layout in KvLayout::ALL {
        let spec = kv_spec(layout, 3, 4, 2, 5);
        let (k0, v0) = spec.kv_origins();
        assert_eq!((k0, v0), (ref_kv_offset(&spec, [0; 5]), ref_kv_offset(&spec, [1, 0, 0, 0, 0])), "{layout:?}");
        let s = spec.strides();
        let base = ref_kv_offset(&spec, [0, 1, 1, 1, 0]);
        assert_eq!(s.block as usize, ref_kv_offset(&spec, [0, 2, 1, 1, 0]) - base, "{layout:?} block stride");
        assert_eq!(s.token as usize, ref_kv_offset(&spec, [0, 1, 2, 1, 0]) - base, "{layout:?} token stride");
        assert_eq!(s.head as usize, ref_kv_offset(&spec, [0, 1, 1, 0, 0]).abs_diff(base), "{layout:?} head stride");
        assert_eq!(layout.heads_before_tokens(), matches!(layout, KvLayout::FlashHnd | KvLayout::FlashInferHnd));
    }
}

#[test]
fn mla_deepseek_offsets() {
    let spec = MlaCacheSpec::deepseek(3, 4).expect("valid spec");
    assert_eq!((spec.latent_dim, spec.rope_dim, spec.row_width()), (512, 64, 576));
    assert_eq!(spec.shape(), [3, 4, 576]);
    assert_eq!(spec.num_elements(), 3 * 4 * 576);
    assert_eq!(spec.num_slots(), 12);
    let indices = || (0..3).flat_map(|b| (0..4).flat_map(move |t| (0..576).map(move |c| (b, t, c))));
    for (b, t, c) in indices() {
        assert_eq!(spec.offset(b, t, c), ref_mla_offset(&spec, b, t, c), "({b}, {t}, {c})");
    }
    assert_bijection(indices().map(|(b, t, c)| spec.offset(b, t, c)), spec.num_elements(), "deepseek MLA");
    assert_eq!(spec.offset(2, 3, 575), 3 * 4 * 576 - 1);
}

// ---------------------------------------------------------------------------------------------
// Cache-write helpers
// ---------------------------------------------------------------------------------------------

fn nan_cache<C: Element>(len: usize) -> Vec<C> {
    vec![C::from_f32(f32::NAN); len]
}

fn random_elems<T: Element>(rng: &mut SmallRng, len: usize, range: f32) -> Vec<T> {
    (0..len).map(|_| T::from_f32(rng.random_range(-range..range))).collect()
}

/// What the cache should hold for source element `x` (`scale` only matters for FP8: vLLM's
/// `x / scale`, one f32 division, then the conversion).
fn expected_store<C: Element>(x: f32, scale: f32) -> C {
    if C::DTYPE == Fp8E4m3::DTYPE {
        C::from_f32(x / scale)
    } else {
        C::from_f32(x)
    }
}

/// `num_valid` distinct in-range slots plus `num_padding` negative and `num_oob` past-the-end
/// slots, shuffled; returns the mapping and its expected report.
fn random_slots(rng: &mut SmallRng, num_slots: usize, num_valid: usize, num_padding: usize, num_oob: usize) -> (Vec<i64>, WriteReport) {
    let mut all: Vec<i64> = (0..num_slots as i64).collect();
    all.shuffle(rng);
    let mut slots: Vec<i64> = all[..num_valid].to_vec();
    slots.extend((0..num_padding).map(|i| -1 - (i as i64) * 3));
    slots.extend((0..num_oob).map(|i| (num_slots + i * 5) as i64));
    slots.shuffle(rng);
    let first_out_of_range = slots.iter().position(|&s| s >= num_slots as i64).map(|token| BadSlot {
        token: token as u32,
        slot: slots[token],
        num_slots: num_slots as u64,
    });
    (slots, WriteReport { written: num_valid, padding: num_padding, out_of_range: num_oob, first_out_of_range })
}

/// A slot that `slots` does not use, appended past `num_tokens` as a trap: it must be ignored.
fn unused_slot(slots: &[i64], num_slots: usize) -> i64 {
    (0..num_slots as i64).find(|s| !slots.contains(s)).expect("a free slot")
}

/// Compares the whole cache with `expected` (`None` = must still be NaN), bit for bit.
fn assert_cache<C: Element>(cache: &[C], expected: &[Option<C>], what: &str) {
    assert_eq!(cache.len(), expected.len());
    for (i, (got, want)) in cache.iter().zip(expected).enumerate() {
        match want {
            None => assert!(got.to_f32().is_nan(), "{what}: element {i} was written ({}) but should be untouched", got.to_f32()),
            Some(w) => {
                assert_eq!(got.to_f32().to_bits(), w.to_f32().to_bits(), "{what}: element {i} is {}, expected {}", got.to_f32(), w.to_f32())
            }
        }
    }
}

/// Sources shaped like vLLM's: K as a slice of a fused QKV projection (token stride covers Q, K
/// and V heads), V with padded heads (head stride > head size, token stride with a gap).
struct KvSources<T> {
    key: Vec<T>,
    key_rows: RowsDesc,
    value: Vec<T>,
    value_rows: RowsDesc,
}

fn kv_sources<T: Element>(rng: &mut SmallRng, spec: &KvCacheSpec, num_tokens: usize, range: f32) -> KvSources<T> {
    let (h, d) = (spec.num_kv_heads, spec.head_size);
    let q_heads = 2 * h;
    let qkv_stride = (q_heads + 2 * h) * d;
    let key_rows = RowsDesc { num_tokens, num_heads: h, head_size: d, token_stride: qkv_stride, head_stride: d };
    let value_rows = RowsDesc { num_tokens, num_heads: h, head_size: d, token_stride: h * (d + 3) + 1, head_stride: d + 3 };
    // K starts after the Q heads of the fused row; the buffer ends where the last K row ends.
    let qkv: Vec<T> = random_elems(rng, num_tokens * qkv_stride, range);
    let key = qkv[q_heads * d..q_heads * d + key_rows.required_len()].to_vec();
    let value = random_elems(rng, value_rows.required_len(), range);
    KvSources { key, key_rows, value, value_rows }
}

/// Random `reshape_and_cache` on a NaN-filled cache (with a tail past the layout) for one
/// layout and dtype pair; checks every element and the report.
/// `scales`: one K and one V scale, or one per head (3) each.
fn check_reshape_and_cache<T: Element, C: Element>(layout: KvLayout, seed: u64, scales: Option<(&[f32], &[f32])>) {
    let what = format!("reshape_and_cache {:?} -> {:?}, {layout:?}", T::DTYPE, C::DTYPE);
    let mut rng = SmallRng::seed_from_u64(seed);
    let spec = kv_spec(layout, 5, 4, 3, 8);
    let (slots_used, expected_report) = random_slots(&mut rng, spec.num_slots(), 11, 3, 2);
    let num_tokens = slots_used.len();
    let src: KvSources<T> = kv_sources(&mut rng, &spec, num_tokens, 30.0);
    let mut slots = slots_used.clone();
    slots.push(unused_slot(&slots_used, spec.num_slots()));

    let tail = 7;
    let mut cache = nan_cache::<C>(spec.num_elements() + tail);
    let host_scales = scales.map(|(k, v)| if k.len() == 1 { HostScales::Tensor(k[0], v[0]) } else { HostScales::PerHead(k, v) });
    let report = reshape_and_cache(&src.key, src.key_rows, &src.value, src.value_rows, &slots, &mut cache, &spec, host_scales)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(report, expected_report, "{what}");

    let scale_of = |s: &[f32], head: usize| s[if s.len() == 1 { 0 } else { head }];
    let mut expected: Vec<Option<C>> = vec![None; cache.len()];
    for (token, &slot) in slots_used.iter().enumerate() {
        if slot < 0 || slot as usize >= spec.num_slots() {
            continue;
        }
        let (block, offset) = (slot as usize / spec.block_size, slot as usize % spec.block_size);
        for head in 0..spec.num_kv_heads {
            let (k_scale, v_scale) = scales.map_or((1.0, 1.0), |(k, v)| (scale_of(k, head), scale_of(v, head)));
            for dim in 0..spec.head_size {
                let k = src.key[token * src.key_rows.token_stride + head * src.key_rows.head_stride + dim].to_f32();
                let v = src.value[token * src.value_rows.token_stride + head * src.value_rows.head_stride + dim].to_f32();
                expected[ref_kv_offset(&spec, [0, block, offset, head, dim])] = Some(expected_store(k, k_scale));
                expected[ref_kv_offset(&spec, [1, block, offset, head, dim])] = Some(expected_store(v, v_scale));
            }
        }
    }
    assert_cache(&cache, &expected, &what);
}

/// Random `concat_and_cache_mla` from one fused `[T, latent + rope (+ pad)]` buffer: `kv_c` is
/// its first `latent` columns, `k_pe` the next `rope`.
fn check_concat_and_cache_mla<T: Element, C: Element>(spec: MlaCacheSpec, seed: u64, scale: Option<f32>) {
    let what = format!("concat_and_cache_mla {:?} -> {:?}, {spec:?}", T::DTYPE, C::DTYPE);
    let mut rng = SmallRng::seed_from_u64(seed);
    let (latent, rope) = (spec.latent_dim, spec.rope_dim);
    let num_valid = spec.num_slots().min(9) - 1;
    let (slots_used, expected_report) = random_slots(&mut rng, spec.num_slots(), num_valid, 2, 2);
    let num_tokens = slots_used.len();
    let stride = latent + rope + 2;
    let fused: Vec<T> = random_elems(&mut rng, num_tokens * stride, 4.0);
    let (kv_c, k_pe) = (&fused[..(num_tokens - 1) * stride + latent], &fused[latent..(num_tokens - 1) * stride + latent + rope]);
    let mut slots = slots_used.clone();
    slots.push(unused_slot(&slots_used, spec.num_slots()));

    let mut cache = nan_cache::<C>(spec.num_elements() + 3);
    let report = concat_and_cache_mla(kv_c, stride, k_pe, stride, num_tokens, &slots, &mut cache, &spec, scale)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(report, expected_report, "{what}");

    let scale = scale.unwrap_or(1.0);
    let mut expected: Vec<Option<C>> = vec![None; cache.len()];
    for (token, &slot) in slots_used.iter().enumerate() {
        if slot < 0 || slot as usize >= spec.num_slots() {
            continue;
        }
        let (block, offset) = (slot as usize / spec.block_size, slot as usize % spec.block_size);
        for col in 0..latent + rope {
            // Columns of the fused row are exactly the cache row's columns.
            expected[ref_mla_offset(&spec, block, offset, col)] = Some(expected_store(fused[token * stride + col].to_f32(), scale));
        }
    }
    assert_cache(&cache, &expected, &what);
}

/// Runs a generic check for the three same-dtype pairs and the three FP8-cache pairs.
macro_rules! for_dtype_pairs {
    ($check:ident, $arg:expr, $seed:expr, $same:expr, $fp8:expr) => {
        $check::<f16, f16>($arg, $seed, $same);
        $check::<bf16, bf16>($arg, $seed + 1, $same);
        $check::<f32, f32>($arg, $seed + 2, $same);
        $check::<f16, Fp8E4m3>($arg, $seed + 3, $fp8);
        $check::<bf16, Fp8E4m3>($arg, $seed + 4, $fp8);
        $check::<f32, Fp8E4m3>($arg, $seed + 5, $fp8);
    };
}

#[test]
fn reshape_and_cache_writes_exactly_the_mapped_slots() {
    for (i, layout) in KvLayout::ALL.into_iter().enumerate() {
        // Sources up to ±30 with k_scale 0.05 reach ±600: FP8 saturation is exercised too.
        for_dtype_pairs!(check_reshape_and_cache, layout, 100 * i as u64, None, Some((&[0.05][..], &[0.125][..])));
        // One scale per kv head.
        let per_head: Option<(&[f32], &[f32])> = Some((&[0.05, 0.5, 0.02], &[0.125, 0.01, 1.0]));
        for_dtype_pairs!(check_reshape_and_cache, layout, 100 * i as u64 + 50, None, per_head);
    }
}

#[test]
fn per_head_scales_must_cover_every_kv_head() {
    let spec = kv_spec(KvLayout::FlashNhd, 5, 4, 3, 8);
    let rows = RowsDesc::contiguous(1, 3, 8);
    let src = vec![f16::from_f32(1.0); rows.required_len()];
    let mut cache = vec![Fp8E4m3::default(); spec.num_elements()];
    let two: &[f32] = &[0.5, 0.5];
    let err = reshape_and_cache(&src, rows, &src, rows, &[0], &mut cache, &spec, Some(HostScales::PerHead(two, two))).unwrap_err();
    assert!(
        matches!(&err, AttnError::InvalidArgument { arg: "scales", reason } if reason.contains("2 K and 2 V values for 3 kv heads")),
        "{err}"
    );
}

#[test]
fn concat_and_cache_mla_writes_exactly_the_mapped_slots() {
    let small = MlaCacheSpec::new(4, 4, 16, 8).expect("valid spec");
    let deepseek = MlaCacheSpec::deepseek(2, 8).expect("valid spec");
    for_dtype_pairs!(check_concat_and_cache_mla, small, 1000, None, Some(0.02));
    for_dtype_pairs!(check_concat_and_cache_mla, deepseek, 2000, None, Some(0.03));
}

#[test]
fn zero_tokens_write_nothing() {
    let spec = kv_spec(KvLayout::FlashNhd, 2, 4, 2, 8);
    let rows = RowsDesc::contiguous(0, 2, 8);
    let mut cache = nan_cache::<f16>(spec.num_elements());
    let report = reshape_and_cache::<f16, f16>(&[], rows, &[], rows, &[], &mut cache, &spec, None).expect("zero tokens");
    assert_eq!(report, WriteReport::default());
    assert!(cache.iter().all(|x| x.to_f32().is_nan()));

    let mla = MlaCacheSpec::new(2, 4, 16, 8).expect("valid spec");
    let mut cache = nan_cache::<Fp8E4m3>(mla.num_elements());
    let report = concat_and_cache_mla::<bf16, Fp8E4m3>(&[], 24, &[], 24, 0, &[], &mut cache, &mla, Some(1.0)).expect("zero tokens");
    assert_eq!(report, WriteReport::default());
    assert!(cache.iter().all(|x| x.to_f32().is_nan()));
}

// ---------------------------------------------------------------------------------------------
// Refusals
// ---------------------------------------------------------------------------------------------

fn invalid_arg(err: AttnError) -> &'static str {
    match err {
        AttnError::InvalidArgument { arg, .. } => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// A valid contiguous f16 `reshape_and_cache` call, to be broken one argument at a time.
struct KvCall {
    spec: KvCacheSpec,
    key: Vec<f16>,
    key_rows: RowsDesc,
    value: Vec<f16>,
    value_rows: RowsDesc,
    slots: Vec<i64>,
    cache_len: usize,
}

impl KvCall {
    fn new() -> Self {
        let spec = kv_spec(KvLayout::FlashInferHnd, 3, 4, 2, 8);
        let rows = RowsDesc::contiguous(5, 2, 8);
        let data = vec![f16::from_f32(1.0); rows.required_len()];
        KvCall {
            spec,
            key: data.clone(),
            key_rows: rows,
            value: data,
            value_rows: rows,
            slots: vec![0, 1, 2, 3, 4],
            cache_len: spec.num_elements(),
        }
    }

    /// Runs the call on a NaN cache; on refusal also checks that nothing was written.
    fn run(&self) -> Result<WriteReport, AttnError> {
        let mut cache = nan_cache::<f16>(self.cache_len);
        let result = reshape_and_cache(&self.key, self.key_rows, &self.value, self.value_rows, &self.slots, &mut cache, &self.spec, None);
        if result.is_err() {
            assert!(cache.iter().all(|x| x.to_f32().is_nan()), "a refused call wrote to the cache");
        }
        result
    }

    fn refused_arg(self) -> &'static str {
        invalid_arg(self.run().expect_err("call should be refused"))
    }
}

#[test]
fn reshape_and_cache_refuses_bad_shapes() {
    assert_eq!(KvCall::new().run().expect("baseline call is valid").written, 5);

    let mut c = KvCall::new();
    c.key_rows = RowsDesc::contiguous(5, 3, 8);
    c.key = vec![f16::ZERO; c.key_rows.required_len()];
    assert_eq!(c.refused_arg(), "key", "wrong head count");

    let mut c = KvCall::new();
    c.key_rows.head_size = 4;
    assert_eq!(c.refused_arg(), "key", "wrong head size");

    let mut c = KvCall::new();
    c.value_rows.num_tokens = 4;
    assert_eq!(c.refused_arg(), "value", "token count mismatch");

    let mut c = KvCall::new();
    c.slots.pop();
    assert_eq!(c.refused_arg(), "slot_mapping", "slot_mapping too short");

    let mut c = KvCall::new();
    c.cache_len -= 1;
    assert_eq!(c.refused_arg(), "cache", "cache too small");

    let mut c = KvCall::new();
    c.key.pop();
    assert_eq!(c.refused_arg(), "key", "key buffer too short");

    let mut c = KvCall::new();
    c.value.pop();
    assert_eq!(c.refused_arg(), "value", "value buffer too short");

    let mut c = KvCall::new();
    c.key_rows.head_stride = 4;
    assert_eq!(c.refused_arg(), "key", "overlapping heads");
}

#[test]
fn reshape_and_cache_refuses_bad_dtypes() {
    let c = KvCall::new();
    let key: Vec<f32> = c.key.iter().map(|x| x.to_f32()).collect();

    let mut fp8 = nan_cache::<Fp8E4m3>(c.cache_len);
    let err = reshape_and_cache(&key, c.key_rows, &key, c.value_rows, &c.slots, &mut fp8, &c.spec, None).expect_err("fp8 without scales");
    assert_eq!(invalid_arg(err), "scales");

    let mut bf = nan_cache::<bf16>(c.cache_len);
    match reshape_and_cache(&key, c.key_rows, &key, c.value_rows, &c.slots, &mut bf, &c.spec, None) {
        Err(AttnError::UnsupportedDType { arg, .. }) => assert_eq!(arg, "cache"),
        other => panic!("f32 -> bf16 cache: expected UnsupportedDType, got {other:?}"),
    }
}

#[test]
fn concat_and_cache_mla_refuses_bad_inputs() {
    let spec = MlaCacheSpec::new(2, 4, 16, 8).expect("valid spec");
    let (n, stride) = (3, 24);
    let src = vec![bf16::ONE; n * stride];
    let slots = [0i64, 1, 2];
    let run = |kv_c: &[bf16], k_pe: &[bf16], slots: &[i64], cache_len: usize| {
        let mut cache = nan_cache::<bf16>(cache_len);
        concat_and_cache_mla(kv_c, stride, k_pe, stride, n, slots, &mut cache, &spec, None)
    };
    assert_eq!(run(&src, &src[16..], &slots, spec.num_elements()).expect("valid").written, 3);
    assert_eq!(invalid_arg(run(&src[..(n - 1) * stride + 15], &src[16..], &slots, spec.num_elements()).unwrap_err()), "kv_c");
    assert_eq!(invalid_arg(run(&src, &src[src.len() - 10..], &slots, spec.num_elements()).unwrap_err()), "k_pe");
    assert_eq!(invalid_arg(run(&src, &src[16..], &slots[..2], spec.num_elements()).unwrap_err()), "slot_mapping");
    assert_eq!(invalid_arg(run(&src, &src[16..], &slots, spec.num_elements() - 1).unwrap_err()), "cache");

    let mut fp8 = nan_cache::<Fp8E4m3>(spec.num_elements());
    let err = concat_and_cache_mla(&src, stride, &src[16..], stride, n, &slots, &mut fp8, &spec, None).unwrap_err();
    assert_eq!(invalid_arg(err), "scales");
}

#[test]
fn spec_constructors_refuse_zero_sizes() {
    assert_eq!(invalid_arg(KvCacheSpec::new(KvLayout::FlashNhd, 4, 0, 2, 8).unwrap_err()), "block_size");
    assert_eq!(invalid_arg(KvCacheSpec::new(KvLayout::FlashNhd, 0, 16, 2, 8).unwrap_err()), "num_blocks");
    assert_eq!(invalid_arg(KvCacheSpec::new(KvLayout::FlashNhd, 4, 16, 0, 8).unwrap_err()), "num_kv_heads");
    assert_eq!(invalid_arg(KvCacheSpec::new(KvLayout::FlashNhd, 4, 16, 2, 0).unwrap_err()), "head_size");
    assert_eq!(invalid_arg(MlaCacheSpec::new(4, 0, 512, 64).unwrap_err()), "block_size");
}
