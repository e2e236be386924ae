//! GPU cache writes against the CPU reference, bit for bit: every layout x (source, cache)
//! dtype, random inputs, strided sources, odd token counts, padding slots, slots past the cache,
//! and guard zones around the cache that must stay untouched.

mod common;

use common::*;
use half::{bf16, f16};
use host::cache_write::{concat_and_cache_mla, reshape_and_cache, KvScales, KvWrite, MlaWrite};
use host::{cpu, DevIn, DevOut, DeviceStatus, Element, Fp8E4m3, KvCacheSpec, KvLayout, MlaCacheSpec, RowsDesc};
use libtest_mimic::Trial;
use rand::seq::SliceRandom;
use rand::Rng;

/// Elements of poison on each side of the cache inside its allocation.
const GUARD: usize = 4096;

#[derive(Clone, Copy, Debug)]
struct Case {
    tokens: usize,
    heads: usize,
    head_size: usize,
    block_size: usize,
    /// Extra elements between token rows (a K slice of a fused QKV buffer).
    row_pad: usize,
    padding_slots: bool,
    out_of_range_slots: bool,
}

const CASES: &[Case] = &[
    Case { tokens: 1, heads: 1, head_size: 64, block_size: 16, row_pad: 0, padding_slots: false, out_of_range_slots: false },
    Case { tokens: 37, heads: 8, head_size: 128, block_size: 16, row_pad: 24, padding_slots: true, out_of_range_slots: false },
    Case { tokens: 301, heads: 4, head_size: 96, block_size: 32, row_pad: 0, padding_slots: true, out_of_range_slots: true },
    Case { tokens: 64, heads: 2, head_size: 256, block_size: 64, row_pad: 8, padding_slots: false, out_of_range_slots: false },
    Case { tokens: 0, heads: 8, head_size: 128, block_size: 16, row_pad: 0, padding_slots: false, out_of_range_slots: false },
];

/// Distinct random slots for `tokens` tokens in a cache of `num_slots`, with some padding (-1)
/// and some past the end if asked.
fn slot_mapping(rng: &mut impl Rng, tokens: usize, num_slots: usize, padding: bool, out_of_range: bool) -> Vec<i64> {
    let mut all: Vec<i64> = (0..num_slots as i64).collect();
    all.shuffle(rng);
    let mut slots: Vec<i64> = all.into_iter().take(tokens).collect();
    for (i, s) in slots.iter_mut().enumerate() {
        if padding && i % 7 == 3 {
            *s = -1 - (i as i64 % 3);
        } else if out_of_range && i % 11 == 5 {
            *s = num_slots as i64 + (i as i64 % 5) * 1000;
        }
    }
    slots
}

/// Bit pattern of an element, for exact comparison (NaN poison included).
fn bits<T: Element>(x: &T) -> u64 {
    let size = std::mem::size_of::<T>();
    let mut out = [0u8; 8];
    // SAFETY: T is a plain value of `size` <= 8 bytes.
    unsafe { std::ptr::copy_nonoverlapping(x as *const T as *const u8, out.as_mut_ptr(), size) };
    u64::from_le_bytes(out)
}

fn kv_case<T: Element + std::fmt::Debug, C: Element + std::fmt::Debug>(layout: KvLayout, c: Case, salt: u64) -> TestResult {
    let mut rng = rng(salt);
    let stream = new_stream();
    let num_blocks = (c.tokens + 3 * c.block_size) / c.block_size + 2;
    let spec = KvCacheSpec::new(layout, num_blocks, c.block_size, c.heads, c.head_size)?;
    let rows = RowsDesc { token_stride: c.heads * c.head_size + c.row_pad, ..RowsDesc::contiguous(c.tokens, c.heads, c.head_size) };
    let fp8 = C::DTYPE == host::DType::Fp8E4m3;
    // FP8 values up to ~2x past the saturation point, to exercise it.
    let range = if fp8 { 900.0 } else { 4.0 };
    let key: Vec<T> = random_vec(&mut rng, rows.required_len().max(1), range);
    let value: Vec<T> = random_vec(&mut rng, rows.required_len().max(1), range);
    let slots = slot_mapping(&mut rng, c.tokens, spec.num_slots(), c.padding_slots, c.out_of_range_slots);
    let scales = (0.5f32, 2.0f32);
    let mut want = vec![poison::<C>(); spec.num_elements() + 2 * GUARD];

    let key_d = upload(&stream, &key);
    let value_d = upload(&stream, &value);
    let slots_d = upload(&stream, &slots);
    let mut cache_d = upload(&stream, &want);
    let scale_d = (upload(&stream, &[scales.0]), upload(&stream, &[scales.1]));
    let mut status = DeviceStatus::new(&stream)?;
    {
        let mut cache_view = cache_d.slice_mut(GUARD..GUARD + spec.num_elements());
        let w = KvWrite {
            key: DevIn::new(&key_d, &stream),
            key_rows: rows,
            value: DevIn::new(&value_d, &stream),
            value_rows: rows,
            slot_mapping: DevIn::new(&slots_d, &stream),
            cache: DevOut::new(&mut cache_view, &stream),
            spec,
            scales: fp8.then(|| KvScales { k: DevIn::new(&scale_d.0, &stream), v: DevIn::new(&scale_d.1, &stream) }),
        };
        reshape_and_cache(device(), &stream, w, &mut status)?;
    }
    let flags = status.take(&stream)?;
    let got = download(&stream, &cache_d);
    let report = cpu::reshape_and_cache(
        &key,
        rows,
        &value,
        rows,
        &slots,
        &mut want[GUARD..GUARD + spec.num_elements()],
        &spec,
        fp8.then_some(scales),
    )?;
    let bad = bitwise_mismatches(&got, &want, bits);
    if !bad.is_empty() {
        return Err(format!("cache differs from the CPU reference (guard = {GUARD}):\n{}", bad.join("\n")).into());
    }
    if flags.slot_out_of_range() != (report.out_of_range > 0) {
        return Err(format!("status {flags:?}, but the reference saw {} out-of-range slots", report.out_of_range).into());
    }
    Ok(())
}

fn mla_case<T: Element + std::fmt::Debug, C: Element + std::fmt::Debug>(tokens: usize, block_size: usize, salt: u64) -> TestResult {
    let mut rng = rng(salt);
    let stream = new_stream();
    let spec = MlaCacheSpec::deepseek(tokens / block_size + 3, block_size)?;
    let fp8 = C::DTYPE == host::DType::Fp8E4m3;
    let range = if fp8 { 900.0 } else { 4.0 };
    // kv_c and k_pe as slices of one wider projection output (row stride 576 + 64).
    let stride = spec.row_width() + 64;
    let src: Vec<T> = random_vec(&mut rng, tokens * stride + spec.row_width(), range);
    let (kv_c, k_pe) = (&src[..], &src[spec.latent_dim..]);
    let slots = slot_mapping(&mut rng, tokens, spec.num_slots(), true, tokens > 10);
    let scale = 1.5f32;
    let mut want = vec![poison::<C>(); spec.num_elements() + 2 * GUARD];

    let kv_c_d = upload(&stream, kv_c);
    let k_pe_d = upload(&stream, k_pe);
    let slots_d = upload(&stream, &slots);
    let scale_d = upload(&stream, &[scale]);
    let mut cache_d = upload(&stream, &want);
    let mut status = DeviceStatus::new(&stream)?;
    {
        let mut cache_view = cache_d.slice_mut(GUARD..GUARD + spec.num_elements());
        let w = MlaWrite {
            kv_c: DevIn::new(&kv_c_d, &stream),
            kv_c_token_stride: stride,
            k_pe: DevIn::new(&k_pe_d, &stream),
            k_pe_token_stride: stride,
            num_tokens: tokens,
            slot_mapping: DevIn::new(&slots_d, &stream),
            cache: DevOut::new(&mut cache_view, &stream),
            spec,
            scale: fp8.then(|| DevIn::new(&scale_d, &stream)),
        };
        concat_and_cache_mla(device(), &stream, w, &mut status)?;
    }
    let flags = status.take(&stream)?;
    let got = download(&stream, &cache_d);
    let report = cpu::concat_and_cache_mla(
        kv_c,
        stride,
        k_pe,
        stride,
        tokens,
        &slots,
        &mut want[GUARD..GUARD + spec.num_elements()],
        &spec,
        fp8.then_some(scale),
    )?;
    let bad = bitwise_mismatches(&got, &want, bits);
    if !bad.is_empty() {
        return Err(format!("MLA cache differs from the CPU reference:\n{}", bad.join("\n")).into());
    }
    if flags.slot_out_of_range() != (report.out_of_range > 0) {
        return Err(format!("status {flags:?}, but the reference saw {} out-of-range slots", report.out_of_range).into());
    }
    Ok(())
}

/// One trial per (dtype pair) for a generic test body.
macro_rules! for_dtype_pairs {
    ($trials:ident, $prefix:expr, |$src:ident, $cache:ident| $body:expr) => {{
        macro_rules! one {
            ($s:ty, $c:ty, $name:literal) => {{
                type $src = $s;
                type $cache = $c;
                let (name, f) = $body;
                $trials.push(Trial::test(format!("{}::{}::{}", $prefix, $name, name), f));
            }};
        }
        one!(f16, f16, "f16_f16");
        one!(bf16, bf16, "bf16_bf16");
        one!(f32, f32, "f32_f32");
        one!(f16, Fp8E4m3, "f16_fp8");
        one!(bf16, Fp8E4m3, "bf16_fp8");
        one!(f32, Fp8E4m3, "f32_fp8");
    }};
}

fn main() {
    let mut trials = Vec::new();
    let cases: &[Case] = if quick() { &CASES[..3] } else { CASES };
    let mut salt = 0u64;
    for layout in KvLayout::ALL {
        for (i, &c) in cases.iter().enumerate() {
            for_dtype_pairs!(trials, format!("reshape_and_cache::{layout:?}"), |S, C| {
                salt += 1;
                let s = salt;
                (format!("case{i}_t{}_h{}_d{}_bs{}", c.tokens, c.heads, c.head_size, c.block_size), move || kv_case::<S, C>(layout, c, s))
            });
        }
    }
    for (tokens, block_size) in [(1usize, 64usize), (77, 16), (1000, 64)] {
        for_dtype_pairs!(trials, "concat_and_cache_mla", |S, C| {
            salt += 1;
            let s = salt;
            (format!("t{tokens}_bs{block_size}"), move || mla_case::<S, C>(tokens, block_size, s))
        });
    }
    run_gpu_trials(trials)
}
