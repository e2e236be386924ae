//! GPU cache writes against the CPU reference, bit for bit: every layout x (source, cache)
//! dtype, random inputs, strided sources, odd token counts, padding slots, slots past the cache
//! (and the one the status block names), and guard zones around the cache that must stay
//! untouched. FP8 writes are also checked against vLLM's quantisation written out here.

mod common;

use attn_rs::cache_write::{concat_and_cache_mla, reshape_and_cache, KvScales, KvWrite, MlaWrite};
use attn_rs::{
    cpu, AttnError, DType, DevIn, DevOut, DeviceStatus, Element, Fp8E4m3, Fp8E5m2, KvCacheSpec, KvLayout, MlaCacheSpec, RowsDesc,
    StatusFlags,
};
use common::*;
use half::{bf16, f16};
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

/// The status after a write that met `report.out_of_range` slots past the cache: the bit, and a
/// recorded offence that names one of them (any: warps race for the record).
fn check_slot_status(flags: StatusFlags, report: &cpu::WriteReport, slots: &[i64], num_slots: usize) -> TestResult {
    if flags.slot_out_of_range() != (report.out_of_range > 0) {
        return Err(format!("status {flags:?}, but the reference saw {} out-of-range slots", report.out_of_range).into());
    }
    if report.out_of_range == 0 {
        return match flags.into_result() {
            Ok(()) => Ok(()),
            Err(e) => Err(format!("status {flags:?} ({e}) after a write with every slot in range").into()),
        };
    }
    let Some(first) = flags.first_bad_slot() else {
        return Err(format!("status {flags:?}: the bit without the offending slot").into());
    };
    let named = slots.get(first.token as usize).copied();
    if named != Some(first.slot) || first.slot < num_slots as i64 || first.num_slots != num_slots as u64 {
        return Err(format!("status names {first:?}, but slot_mapping[{}] = {named:?} (cache of {num_slots} slots)", first.token).into());
    }
    match flags.into_result() {
        Err(AttnError::SlotOutOfRange { first: Some(f) }) if f == first => Ok(()),
        other => Err(format!("into_result gave {other:?} for {flags:?}").into()),
    }
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
    let fp8 = C::DTYPE.is_fp8();
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
        fp8.then_some(scales.into()),
    )?;
    let bad = bitwise_mismatches(&got, &want, bits);
    if !bad.is_empty() {
        return Err(format!("cache differs from the CPU reference (guard = {GUARD}):\n{}", bad.join("\n")).into());
    }
    check_slot_status(flags, &report, &slots, spec.num_slots())
}

fn mla_case<T: Element + std::fmt::Debug, C: Element + std::fmt::Debug>(tokens: usize, block_size: usize, salt: u64) -> TestResult {
    let mut rng = rng(salt);
    let stream = new_stream();
    let spec = MlaCacheSpec::deepseek(tokens / block_size + 3, block_size)?;
    let fp8 = C::DTYPE.is_fp8();
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
    check_slot_status(flags, &report, &slots, spec.num_slots())
}

/// A finite code's value from its format's definition: sign, then E4M3's 4 exponent bits (bias
/// 7) and 3 mantissa bits, or E5M2's 5 (bias 15) and 2; exponent 0 subnormal.
fn fp8_value(dtype: DType, code: u8) -> f64 {
    let (mant_bits, bias) = if dtype == DType::Fp8E4m3 { (3, 7) } else { (2, 15) };
    let exp = i32::from((code & 0x7f) >> mant_bits);
    let mant = f64::from(code & ((1 << mant_bits) - 1));
    let scale = f64::from(1u32 << mant_bits);
    let mag = if exp == 0 { mant / scale * 2f64.powi(1 - bias) } else { (1.0 + mant / scale) * 2f64.powi(exp - bias) };
    if code & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

/// vLLM's FP8 quantisation of a finite `x` into `dtype`, written from the definitions: `x /
/// scale` as one f32 division, then the finite value nearest to it (ties to the even code),
/// saturated at the largest (E4M3 448, E5M2 57344), with the quotient's sign.
fn vllm_fp8(dtype: DType, x: f32, scale: f32) -> u8 {
    let max_code = if dtype == DType::Fp8E4m3 { 0x7e } else { 0x7b };
    let y = x / scale;
    let mag = f64::from(y.abs()).min(fp8_value(dtype, max_code));
    let mut best = 0u8;
    for code in 1..=max_code {
        let (d, d_best) = ((fp8_value(dtype, code) - mag).abs(), (fp8_value(dtype, best) - mag).abs());
        if d < d_best || (d == d_best && code % 2 == 0) {
            best = code;
        }
    }
    best | if y.is_sign_negative() { 0x80 } else { 0 }
}

/// An FP8 cache element's byte.
trait Fp8Byte: Element {
    fn byte(self) -> u8;
}

impl Fp8Byte for Fp8E4m3 {
    fn byte(self) -> u8 {
        self.0
    }
}

impl Fp8Byte for Fp8E5m2 {
    fn byte(self) -> u8 {
        self.0
    }
}

/// FP8 cache bytes of type `C` against [`vllm_fp8`] (not the CPU path): `reshape_and_cache` with
/// K and V scales `scales` and `concat_and_cache_mla` with the K scale, inputs spread over the
/// cache's range (a few past its largest value after the division, to saturate).
fn fp8_vllm_case<T: Element, C: Fp8Byte>(scales: (&[f32], &[f32]), salt: u64) -> TestResult {
    let mut rng = rng(salt);
    let stream = new_stream();
    let (tokens, heads, head_size, block_size) = (96usize, 4usize, 128usize, 16usize);
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, tokens / block_size + 2, block_size, heads, head_size)?;
    let rows = RowsDesc::contiguous(tokens, heads, head_size);
    // One scale per tensor, or one per head.
    let at = |s: &[f32], head: usize| s[if s.len() == 1 { 0 } else { head }];
    // Values up to a few past the largest value times their head's scale (saturation).
    let top = if C::DTYPE == DType::Fp8E4m3 { 460.0 } else { 60000.0 };
    let spread = |rng: &mut _, s: &[f32]| -> Vec<T> {
        let raw: Vec<f32> = random_vec(rng, rows.required_len(), top);
        raw.iter().enumerate().map(|(i, &x)| T::from_f32(x * at(s, i / head_size % heads))).collect()
    };
    let (key, value) = (spread(&mut rng, scales.0), spread(&mut rng, scales.1));
    let slots = slot_mapping(&mut rng, tokens, spec.num_slots(), false, false);
    let key_d = upload(&stream, &key);
    let value_d = upload(&stream, &value);
    let slots_d = upload(&stream, &slots);
    let mut cache_d = upload(&stream, &vec![poison::<C>(); spec.num_elements()]);
    let scale_d = (upload(&stream, scales.0), upload(&stream, scales.1));
    let mut status = DeviceStatus::new(&stream)?;
    let w = KvWrite {
        key: DevIn::new(&key_d, &stream),
        key_rows: rows,
        value: DevIn::new(&value_d, &stream),
        value_rows: rows,
        slot_mapping: DevIn::new(&slots_d, &stream),
        cache: DevOut::new(&mut cache_d, &stream),
        spec,
        scales: Some(KvScales { k: DevIn::new(&scale_d.0, &stream), v: DevIn::new(&scale_d.1, &stream) }),
    };
    reshape_and_cache(device(), &stream, w, &mut status)?;
    status.check(&stream)?;
    let got = download(&stream, &cache_d);
    let mut bad = Vec::new();
    for (token, &slot) in slots.iter().enumerate() {
        let (block, offset) = (slot as usize / block_size, slot as usize % block_size);
        for head in 0..heads {
            for dim in 0..head_size {
                for (plane, src, scale) in [(0, &key, at(scales.0, head)), (1, &value, at(scales.1, head))] {
                    let x = src[rows.offset(token, head, dim)].to_f32();
                    let (g, want) = (got[spec.offset(plane, block, offset, head, dim)].byte(), vllm_fp8(C::DTYPE, x, scale));
                    if g != want && bad.len() < 10 {
                        bad.push(format!(
                            "plane {plane} token {token} head {head} dim {dim}: x = {x:e}, scale {scale}: {g:#04x}, vLLM {want:#04x}"
                        ));
                    }
                }
            }
        }
    }
    if !bad.is_empty() {
        return Err(format!("FP8 K/V cache differs from x / scale quantised:\n{}", bad.join("\n")).into());
    }

    let mla = MlaCacheSpec::deepseek(tokens / block_size + 2, block_size)?;
    let width = mla.row_width();
    // The latent cache's one scale: the first key scale.
    let mla_scale = scales.0[0];
    let mla_scale_d = upload(&stream, &[mla_scale]);
    let src: Vec<T> = random_vec(&mut rng, tokens * width, top * mla_scale);
    let kv_c_d = upload(&stream, &src);
    let k_pe_d = upload(&stream, &src[mla.latent_dim..]);
    let mut mla_d = upload(&stream, &vec![poison::<C>(); mla.num_elements()]);
    let w = MlaWrite {
        kv_c: DevIn::new(&kv_c_d, &stream),
        kv_c_token_stride: width,
        k_pe: DevIn::new(&k_pe_d, &stream),
        k_pe_token_stride: width,
        num_tokens: tokens,
        slot_mapping: DevIn::new(&slots_d, &stream),
        cache: DevOut::new(&mut mla_d, &stream),
        spec: mla,
        scale: Some(DevIn::new(&mla_scale_d, &stream)),
    };
    concat_and_cache_mla(device(), &stream, w, &mut status)?;
    status.check(&stream)?;
    let got = download(&stream, &mla_d);
    for (token, &slot) in slots.iter().enumerate() {
        let (block, offset) = (slot as usize / block_size, slot as usize % block_size);
        for col in 0..width {
            let x = src[token * width + col].to_f32();
            let (g, want) = (got[mla.offset(block, offset, col)].byte(), vllm_fp8(C::DTYPE, x, mla_scale));
            if g != want && bad.len() < 10 {
                bad.push(format!("token {token} column {col}: x = {x:e}, scale {mla_scale}: {g:#04x}, vLLM {want:#04x}"));
            }
        }
    }
    if !bad.is_empty() {
        return Err(format!("FP8 MLA cache differs from x / scale quantised:\n{}", bad.join("\n")).into());
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
        one!(f16, Fp8E5m2, "f16_e5m2");
        one!(bf16, Fp8E5m2, "bf16_e5m2");
        one!(f32, Fp8E5m2, "f32_e5m2");
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
    // vLLM's quantisation: 0.05 (whose reciprocal is exactly 20 in f32), 0.03 (where
    // multiplying by the reciprocal differs for about 0.8% of bf16 inputs) and others.
    // One scale per kv head too (4 heads): each head's rows quantised with its own.
    let per_head: (&[f32], &[f32]) = (&[0.05, 0.03, 0.037, 3.3], &[0.0173, 1.0, 0.05, 0.03]);
    let tensor = [(0.05f32, 0.05f32), (0.03, 0.05), (0.037, 1.0), (3.3, 0.0173)];
    let mut sets: Vec<(String, Vec<f32>, Vec<f32>)> = tensor.iter().map(|&(k, v)| (format!("k{k}_v{v}"), vec![k], vec![v])).collect();
    sets.push(("per_head".into(), per_head.0.to_vec(), per_head.1.to_vec()));
    for (label, k, v) in sets {
        for (name, f) in [
            ("f16", fp8_vllm_case::<f16, Fp8E4m3> as fn((&[f32], &[f32]), u64) -> TestResult),
            ("bf16", fp8_vllm_case::<bf16, Fp8E4m3>),
            ("f32", fp8_vllm_case::<f32, Fp8E4m3>),
            ("f16_e5m2", fp8_vllm_case::<f16, Fp8E5m2>),
            ("bf16_e5m2", fp8_vllm_case::<bf16, Fp8E5m2>),
            ("f32_e5m2", fp8_vllm_case::<f32, Fp8E5m2>),
        ] {
            salt += 1;
            let (s, k, v) = (salt, k.clone(), v.clone());
            trials.push(Trial::test(format!("fp8_matches_vllm::{name}::{label}"), move || f((&k, &v), s)));
        }
    }
    run_gpu_trials(trials)
}
