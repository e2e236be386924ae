//! CPU tests of `attn_math`: the FP8 E4M3 and E5M2 and bf16 conversions and the paged-cache slot math,
//! checked against independent reference formulas.

use attn_math::fp8::{
    bf16_bits_to_f32, e4m3_to_f32, e5m2_to_f32, f32_to_bf16_bits, f32_to_e4m3, f32_to_e5m2, quantize_e4m3, quantize_e5m2, E4M3_MAX,
    E5M2_MAX,
};
use attn_math::paging::{resolve_slot, CacheStrides, SlotTarget};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Largest finite positive E4M3 code (448).
const MAX_CODE: u8 = 0x7e;

// ---------------------------------------------------------------------------------------------
// Reference E4M3, written from the format's definition in f64.
// ---------------------------------------------------------------------------------------------

/// Decode from the definition: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
/// subnormal (`m * 2^-9`); `S.1111.111` is NaN; there are no infinities.
fn ref_decode(code: u8) -> f64 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((code >> 3) & 0xf);
    let mant = f64::from(code & 7);
    if exp == 15 && mant == 7.0 {
        return f64::NAN;
    }
    let mag = if exp == 0 { mant * 2f64.powi(-9) } else { (1.0 + mant / 8.0) * 2f64.powi(exp - 7) };
    sign * mag
}

/// Magnitudes of the finite positive codes `0..=0x7e`, increasing.
fn positive_table() -> Vec<f64> {
    (0..=MAX_CODE).map(ref_decode).collect()
}

/// Reference encoder over a format's finite positive codes `table` (increasing, the largest
/// last): the nearest code to `min(|x|, largest)`, ties to the even mantissa (the code's low
/// bit), sign copied from `x` (so `-0.0` and tiny negatives give `0x80`); NaN gives a NaN code.
fn ref_encode(table: &[f64], x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let mag = f64::from(x.abs()).min(table[table.len() - 1]);
    // First code whose value is >= mag; the answer is it or its predecessor.
    let hi = table.partition_point(|&v| v < mag);
    let code = if hi == 0 {
        0
    } else if hi == table.len() {
        table.len() - 1
    } else {
        let lo = hi - 1;
        let (dlo, dhi) = (mag - table[lo], table[hi] - mag);
        if dlo < dhi || (dlo == dhi && lo % 2 == 0) {
            lo
        } else {
            hi
        }
    };
    code as u8 | sign
}

fn same_f32(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
}

/// Asserts that the library encodes `x` as the reference does (any NaN code for NaN).
fn check_encode(table: &[f64], x: f32) {
    let got = f32_to_e4m3(x);
    let want = ref_encode(table, x);
    if x.is_nan() {
        assert!(e4m3_to_f32(got).is_nan(), "f32_to_e4m3({x:e}) = {got:#04x}, expected a NaN code");
    } else {
        assert_eq!(
            got,
            want,
            "f32_to_e4m3({x:e} = {:#010x}): got {got:#04x} ({}), expected {want:#04x} ({})",
            x.to_bits(),
            ref_decode(got),
            ref_decode(want)
        );
    }
}

/// Edge values: zeros, f32 subnormals, E4M3 subnormal/normal boundary, every midpoint between
/// adjacent codes and its f32 neighbours, the saturation region and non-finite values.
fn edge_values(table: &[f64]) -> Vec<f32> {
    let v = vec![
        0.0,
        f32::from_bits(1),
        f32::from_bits(0x007f_ffff),
        f32::MIN_POSITIVE,
        2f32.powi(-10), // half the smallest subnormal: tie to 0
        3.0 * 2f32.powi(-11),
        2f32.powi(-6),
        448.0,
        449.0,
        463.99997,
        464.0,
        464.00003,
        480.0,
        1e9,
        f32::MAX,
        f32::INFINITY,
        f32::NAN,
    ];
    with_midpoints(table, v)
}

/// `special` values, then every midpoint between adjacent codes of `table` (exact in f32) with
/// its f32 neighbours and the upper code, then all of them negated.
fn with_midpoints(table: &[f64], mut v: Vec<f32>) -> Vec<f32> {
    for w in table.windows(2) {
        let mid = ((w[0] + w[1]) / 2.0) as f32;
        assert_eq!(f64::from(mid), (w[0] + w[1]) / 2.0, "midpoints of the codes are exact in f32");
        v.extend([mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1), w[1] as f32]);
    }
    let negated: Vec<f32> = v.iter().map(|x| -x).collect();
    v.extend(negated);
    v
}

/// Random f32s of three kinds: any bit pattern, uniform in [-512, 512], and log-uniform
/// magnitudes around the E4M3 range (2^-12 .. 2^10) with a random sign.
fn random_f32s(rng: &mut SmallRng, n: usize) -> impl Iterator<Item = f32> + '_ {
    (0..n).map(move |i| match i % 3 {
        0 => f32::from_bits(rng.random()),
        1 => rng.random_range(-512.0f32..512.0),
        _ => {
            let mag = 2f32.powf(rng.random_range(-12.0f32..10.0));
            if rng.random() {
                mag
            } else {
                -mag
            }
        }
    })
}

#[test]
fn e4m3_decodes_every_code_by_definition() {
    for code in 0..=255u8 {
        let got = e4m3_to_f32(code);
        let want = ref_decode(code);
        if want.is_nan() {
            assert!(got.is_nan(), "e4m3_to_f32({code:#04x}) = {got}, expected NaN");
        } else {
            assert_eq!(f64::from(got), want, "e4m3_to_f32({code:#04x})");
            assert_eq!(got.is_sign_negative(), code & 0x80 != 0, "sign of e4m3_to_f32({code:#04x})");
        }
        assert!(!got.is_infinite(), "E4M3 has no infinities ({code:#04x})");
    }
    assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
    assert_eq!(e4m3_to_f32(MAX_CODE), E4M3_MAX);
    assert_eq!(e4m3_to_f32(0xfe), -E4M3_MAX);
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
    // Only the two all-ones patterns are NaN.
    assert_eq!((0..=255u8).filter(|&c| e4m3_to_f32(c).is_nan()).count(), 2);
}

#[test]
fn e4m3_round_trips_every_code() {
    for code in (0..=255u8).filter(|&c| c & 0x7f != 0x7f) {
        let x = e4m3_to_f32(code);
        assert_eq!(f32_to_e4m3(x), code, "f32_to_e4m3(e4m3_to_f32({code:#04x}) = {x:e})");
    }
    assert_eq!(f32_to_e4m3(0.0), 0x00);
    assert_eq!(f32_to_e4m3(-0.0), 0x80);
}

#[test]
fn e4m3_encodes_edge_values_to_nearest_even_saturating() {
    let table = positive_table();
    for x in edge_values(&table) {
        check_encode(&table, x);
    }
    // Spot values stated by the format's contract.
    for (x, want) in
        [(448.0, 0x7e), (449.0, 0x7e), (464.0, 0x7e), (1e9, 0x7e), (f32::INFINITY, 0x7e), (f32::NEG_INFINITY, 0xfe), (-1e9, 0xfe)]
    {
        assert_eq!(f32_to_e4m3(x), want, "f32_to_e4m3({x:e})");
    }
    // Ties: 1.0625 lies between 1.0 (0x38, even) and 1.125 (0x39); 1.1875 between 0x39 and 0x3a.
    assert_eq!(f32_to_e4m3(1.0625), 0x38);
    assert_eq!(f32_to_e4m3(1.1875), 0x3a);
    // Subnormal ties: 0.5 * 2^-9 -> 0, 1.5 * 2^-9 -> 2 * 2^-9.
    assert_eq!(f32_to_e4m3(2f32.powi(-10)), 0x00);
    assert_eq!(f32_to_e4m3(-(2f32.powi(-10))), 0x80);
    assert_eq!(f32_to_e4m3(3.0 * 2f32.powi(-10)), 0x02);
    assert!(e4m3_to_f32(f32_to_e4m3(f32::NAN)).is_nan());
    assert!(e4m3_to_f32(f32_to_e4m3(-f32::NAN)).is_nan());
}

#[test]
fn e4m3_encodes_random_values_to_nearest_even_saturating() {
    let table = positive_table();
    let mut rng = SmallRng::seed_from_u64(0xe4e3);
    for x in random_f32s(&mut rng, 300_000) {
        check_encode(&table, x);
    }
}

/// vLLM's FP8 quantisation from the definitions, independent of the library: `x / scale` as one
/// f32 division, then the nearest of the 256 codes decoded by [`ref_decode`] (ties to the even
/// code, magnitudes past 448 saturated to it, the sign kept; NaN to a NaN code).
fn ref_quantize(table: &[f64], x: f32, scale: f32) -> u8 {
    ref_encode(table, x / scale)
}

/// Scales as engines calibrate them (vLLM's default 1.0, amax / 448 of typical activations),
/// and some with no short binary expansion, whose reciprocal is inexact.
const SCALES: [f32; 11] = [0.05, 0.03, 1.0, 0.5, 4.0, 0.037, 0.0173, 0.1, 3.3, 1e-3, 0.0234375];

/// Asserts the library's quantisation equals the reference byte for byte.
fn check_quantize(table: &[f64], x: f32, scale: f32) {
    let (got, want) = (quantize_e4m3(x, scale), ref_quantize(table, x, scale));
    if (x / scale).is_nan() {
        assert!(e4m3_to_f32(got).is_nan(), "quantize_e4m3({x:e}, {scale:e}) = {got:#04x}, expected a NaN code");
    } else {
        assert_eq!(
            got,
            want,
            "quantize_e4m3({x:e}, {scale:e}): got {got:#04x} ({}), expected {want:#04x} ({})",
            ref_decode(got),
            ref_decode(want)
        );
    }
}

#[test]
fn quantize_e4m3_divides_by_the_scale_as_vllm() {
    let table = positive_table();
    let mut rng = SmallRng::seed_from_u64(7);
    for scale in SCALES {
        // Every code's value, the midpoints around it and their f32 neighbours, times the
        // scale: the inputs whose quotient lands on or next to a rounding boundary.
        for code in 0..=MAX_CODE {
            let v = ref_decode(code);
            let next = table.get(code as usize + 1).copied().unwrap_or(512.0);
            for y in [v, (v + next) / 2.0] {
                let x = (y * f64::from(scale)) as f32;
                for x in [x, f32::from_bits(x.to_bits() + 1), f32::from_bits(x.to_bits().saturating_sub(1))] {
                    check_quantize(&table, x, scale);
                    check_quantize(&table, -x, scale);
                }
            }
        }
        for x in random_f32s(&mut rng, 30_000) {
            check_quantize(&table, x, scale);
        }
        // Random values over the cache's range at this scale (a random cache write's inputs).
        for _ in 0..30_000 {
            check_quantize(&table, rng.random_range(-500.0f32..500.0) * scale, scale);
        }
    }
    assert_eq!(quantize_e4m3(1000.0, 2.0), f32_to_e4m3(500.0));
    assert_eq!(quantize_e4m3(3.0, 2.0), 0x3c); // 1.5
}

/// The reason the quantisation divides: at scale 0.03, `1 / 0.03` rounds up in f32, so for
/// bf16 inputs `x * (1 / 0.03)` lands on or past a midpoint between two E4M3 values where
/// `x / 0.03` lies just below it, one E4M3 step apart (about 0.8% of values). (At 0.05 the
/// reciprocal rounds to exactly 20 and the two agree.)
#[test]
fn quantize_e4m3_is_not_multiplication_by_the_reciprocal() {
    let table = positive_table();
    let mut rng = SmallRng::seed_from_u64(0x05);
    let scale = 0.03f32;
    let mut random_bf16 = || bf16_bits_to_f32(f32_to_bf16_bits(rng.random_range(-15.0f32..15.0)));
    let inv = 1.0 / scale;
    let mut differ = 0;
    for _ in 0..200_000 {
        let x = random_bf16();
        if f32_to_e4m3(x * inv) != ref_quantize(&table, x, scale) {
            differ += 1;
            assert_eq!(quantize_e4m3(x, scale), ref_quantize(&table, x, scale), "quantize_e4m3({x:e}, {scale})");
        }
    }
    assert!(differ > 0, "no input told division from multiplication by the reciprocal");
}

/// The GPU cache writes divide by the scale without `div.rn.f32`: `q0 = x * (1 / scale)`, then
/// one Markstein correction `q0 - (q0 * scale - x) * (1 / scale)` in two FMAs, keeping `q0` when
/// the result is NaN (`ScaleDiv` in the kernels' `cache_write/writers.rs`, for scales in
/// `[2^-60, 2^60]`). The same steps here (f32 `mul_add` is one rounding, as `fma.rn.f32`) must
/// give the E4M3 bytes of `x / scale` for every f16 and bf16 input and random f32s (NaN, inf,
/// zeros and subnormals included) over scales spread across that range. A release run over
/// 2000 scales and 300M inputs found no byte apart.
#[test]
fn fp8_scale_division_matches_vllm() {
    fn divide(x: f32, scale: f32, recip: f32) -> f32 {
        let q0 = x * recip;
        let q1 = (-q0.mul_add(scale, -x)).mul_add(recip, q0);
        if q1.is_nan() {
            q0
        } else {
            q1
        }
    }
    let mut rng = SmallRng::seed_from_u64(0x5ca1e);
    let mut scales = vec![0.05f32, 0.03, 0.037, 3.3, 0.0173, 1.0, 448.0, 1.0 / 448.0, 2f32.powi(-60), 2f32.powi(60)];
    scales.extend((0..22).map(|_| rng.random_range(1.0f32..2.0) * 2f32.powi(rng.random_range(-60..=60))));
    for scale in scales {
        let recip = 1.0 / scale;
        let sixteen_bit = (0..=u16::MAX).flat_map(|b| [half::bf16::from_bits(b).to_f32(), half::f16::from_bits(b).to_f32()]);
        let random: Vec<f32> = (0..4096).map(|_| f32::from_bits(rng.random())).collect();
        for x in sixteen_bit.chain(random) {
            let (got, want) = (f32_to_e4m3(divide(x, scale, recip)), quantize_e4m3(x, scale));
            assert_eq!(got, want, "x {x:e} ({:#010x}) / scale {scale:e}", x.to_bits());
        }
    }
}

/// The CPU cache write (the CPU backend's path and the GPU tests' reference) stores vLLM's bytes:
/// bf16 and f32 sources over the cache's range at each scale, every byte against
/// [`ref_quantize`].
#[test]
fn cpu_fp8_cache_write_matches_vllm_bytes() {
    use attn_rs::cpu::reshape_and_cache;
    use attn_rs::{Element, Fp8E4m3, KvCacheSpec, KvLayout, RowsDesc};
    let table = positive_table();
    let mut rng = SmallRng::seed_from_u64(0x448);
    let (tokens, heads, dim) = (64usize, 4usize, 64usize);
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, tokens / 16, 16, heads, dim).expect("valid spec");
    let rows = RowsDesc::contiguous(tokens, heads, dim);
    let slots: Vec<i64> = (0..tokens as i64).collect();
    for (k_scale, v_scale) in [(0.05f32, 0.03f32), (0.037, 1.0), (3.3, 0.0173)] {
        fn check<T: Element>(table: &[f64], rng: &mut SmallRng, c: (&KvCacheSpec, RowsDesc, &[i64]), scales: (f32, f32)) {
            let (spec, rows, slots) = c;
            let mut random = |scale: f32| -> Vec<T> {
                (0..rows.required_len()).map(|_| T::from_f32(rng.random_range(-500.0f32..500.0) * scale)).collect()
            };
            let (key, value) = (random(scales.0), random(scales.1));
            let mut cache = vec![Fp8E4m3(0x7f); spec.num_elements()];
            reshape_and_cache(&key, rows, &value, rows, slots, &mut cache, spec, Some(scales.into())).expect("valid write");
            for token in 0..rows.num_tokens {
                for head in 0..rows.num_heads {
                    for d in 0..rows.head_size {
                        let (block, offset) = (token / spec.block_size, token % spec.block_size);
                        for (plane, src, scale) in [(0, &key, scales.0), (1, &value, scales.1)] {
                            let x = src[rows.offset(token, head, d)].to_f32();
                            let got = cache[spec.offset(plane, block, offset, head, d)].0;
                            let want = ref_quantize(table, x, scale);
                            assert_eq!(
                                got,
                                want,
                                "{:?} plane {plane}, x = {x:e}, scale {scale}: got {got:#04x}, want {want:#04x}",
                                T::DTYPE
                            );
                        }
                    }
                }
            }
        }
        check::<half::bf16>(&table, &mut rng, (&spec, rows, &slots), (k_scale, v_scale));
        check::<f32>(&table, &mut rng, (&spec, rows, &slots), (k_scale, v_scale));
    }
}

// ---------------------------------------------------------------------------------------------
// E5M2, against its definition in f64 and against IEEE f16 (whose upper byte it is).
// ---------------------------------------------------------------------------------------------

/// Largest finite positive E5M2 code (57344).
const E5M2_MAX_CODE: u8 = 0x7b;

/// Decode from the definition: sign, 5 exponent bits (bias 15), 2 mantissa bits; exponent 0 is
/// subnormal (`m * 2^-16`); exponent 31 is infinity (mantissa 0) or NaN.
fn ref_decode_e5m2(code: u8) -> f64 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((code >> 2) & 0x1f);
    let mant = f64::from(code & 3);
    let mag = match exp {
        31 if mant == 0.0 => f64::INFINITY,
        31 => return f64::NAN,
        0 => mant * 2f64.powi(-16),
        _ => (1.0 + mant / 4.0) * 2f64.powi(exp - 15),
    };
    sign * mag
}

fn e5m2_table() -> Vec<f64> {
    (0..=E5M2_MAX_CODE).map(ref_decode_e5m2).collect()
}

fn check_encode_e5m2(table: &[f64], x: f32) {
    let (got, want) = (f32_to_e5m2(x), ref_encode(table, x));
    if x.is_nan() {
        assert!(e5m2_to_f32(got).is_nan(), "f32_to_e5m2({x:e}) = {got:#04x}, expected a NaN code");
    } else {
        assert_eq!(got, want, "f32_to_e5m2({x:e} = {:#010x}): got {got:#04x}, expected {want:#04x}", x.to_bits());
    }
}

#[test]
fn e5m2_decodes_every_code_as_the_definition_and_as_f16() {
    for code in 0..=255u8 {
        let got = e5m2_to_f32(code);
        let want = ref_decode_e5m2(code);
        let as_f16 = half::f16::from_bits(u16::from(code) << 8).to_f32();
        if want.is_nan() {
            assert!(got.is_nan() && as_f16.is_nan(), "e5m2_to_f32({code:#04x}) = {got}, expected NaN");
        } else {
            assert_eq!(f64::from(got), want, "e5m2_to_f32({code:#04x})");
            assert!(same_f32(got, as_f16), "e5m2_to_f32({code:#04x}) = {got:e}, f16's upper byte {as_f16:e}");
        }
    }
    assert_eq!(e5m2_to_f32(E5M2_MAX_CODE), E5M2_MAX);
    assert_eq!(e5m2_to_f32(0x01), 2f32.powi(-16));
    assert_eq!(e5m2_to_f32(0x04), 2f32.powi(-14));
    assert_eq!(e5m2_to_f32(0x7c), f32::INFINITY);
}

#[test]
fn e5m2_round_trips_every_finite_code() {
    for code in (0..=255u8).filter(|c| c & 0x7f <= E5M2_MAX_CODE) {
        let x = e5m2_to_f32(code);
        assert_eq!(f32_to_e5m2(x), code, "f32_to_e5m2(e5m2_to_f32({code:#04x}) = {x:e})");
    }
}

#[test]
fn e5m2_encodes_edge_and_random_values_to_nearest_even_saturating() {
    let table = e5m2_table();
    let v = vec![
        0.0,
        f32::from_bits(1),
        f32::MIN_POSITIVE,
        2f32.powi(-17),
        3.0 * 2f32.powi(-18),
        2f32.powi(-14),
        57344.0,
        57345.0,
        61439.996,
        61440.0,
        65504.0,
        1e9,
        f32::MAX,
        f32::INFINITY,
        f32::NAN,
    ];
    let v = with_midpoints(&table, v);
    let mut rng = SmallRng::seed_from_u64(0xe5e2);
    let random = (0..300_000).map(|i| match i % 3 {
        0 => f32::from_bits(rng.random()),
        1 => rng.random_range(-70000.0f32..70000.0),
        _ => 2f32.powf(rng.random_range(-18.0f32..17.0)) * if rng.random() { 1.0 } else { -1.0 },
    });
    for x in v.into_iter().chain(random.collect::<Vec<_>>()) {
        check_encode_e5m2(&table, x);
    }
    let mut rng = SmallRng::seed_from_u64(5);
    for scale in SCALES {
        for _ in 0..20_000 {
            let x = rng.random_range(-60000.0f32..60000.0) * scale;
            assert_eq!(quantize_e5m2(x, scale), ref_encode(&table, x / scale), "quantize_e5m2({x:e}, {scale:e})");
        }
    }
}

#[test]
fn bf16_matches_half() {
    for b in 0..=u16::MAX {
        let got = bf16_bits_to_f32(b);
        let want = half::bf16::from_bits(b).to_f32();
        assert!(same_f32(got, want), "bf16_bits_to_f32({b:#06x}) = {got:e}, half says {want:e}");
        if !got.is_nan() {
            assert_eq!(f32_to_bf16_bits(got), b, "bf16 round trip of {b:#06x}");
        }
    }
    let mut rng = SmallRng::seed_from_u64(0xbf16);
    let specials = [
        0.0,
        -0.0,
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(1),
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
    ];
    for x in specials.into_iter().chain(random_f32s(&mut rng, 200_000)).filter(|x| !x.is_nan()) {
        assert_eq!(f32_to_bf16_bits(x), half::bf16::from_f32(x).to_bits(), "f32_to_bf16_bits({x:e} = {:#010x})", x.to_bits());
    }
    for nan in [f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001), f32::from_bits(0xff80_0001)] {
        let b = f32_to_bf16_bits(nan);
        assert!(bf16_bits_to_f32(b).is_nan(), "f32_to_bf16_bits({:#010x}) = {b:#06x} is not NaN", nan.to_bits());
        assert_eq!(b & 0x8000 != 0, nan.is_sign_negative(), "NaN sign kept");
    }
}

#[test]
fn resolve_slot_classifies_slots() {
    let (block_size, num_blocks) = (16u32, 5u64);
    let num_slots = num_blocks * u64::from(block_size);
    for slot in [-1, -2, -17, i64::MIN] {
        assert_eq!(resolve_slot(slot, block_size, num_slots), SlotTarget::Padding, "slot {slot}");
    }
    for slot in [num_slots as i64, num_slots as i64 + 1, i64::MAX] {
        assert_eq!(resolve_slot(slot, block_size, num_slots), SlotTarget::OutOfRange, "slot {slot}");
    }
    for slot in 0..num_slots {
        let want = SlotTarget::At { block: slot / u64::from(block_size), offset: slot % u64::from(block_size) };
        assert_eq!(resolve_slot(slot as i64, block_size, num_slots), want, "slot {slot}");
    }
    // A capacity that is not a whole number of blocks is still the limit.
    assert_eq!(resolve_slot(10, 4, 10), SlotTarget::OutOfRange);
    assert_eq!(resolve_slot(9, 4, 10), SlotTarget::At { block: 2, offset: 1 });
    assert_eq!(resolve_slot(0, 1, 0), SlotTarget::OutOfRange);
}

#[test]
fn cache_strides_offset_is_linear() {
    let s = CacheStrides { block: 1000, token: 50, head: 7 };
    assert_eq!(s.offset(0, 0, 0, 0), 0);
    assert_eq!(s.offset(2, 3, 4, 5), 2 * 1000 + 3 * 50 + 4 * 7 + 5);
    assert_eq!(CacheStrides::default().offset(9, 9, 9, 3), 3);
}
