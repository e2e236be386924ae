//! `cpu::paged_decode` against an explicit f64 softmax-attention written here: single keys,
//! context-parallel halves, sinks, windows, empty contexts, GQA, whole batches, refusals.

use crate::{logsumexp, pick, refused_arg, start_locs};
use approx::assert_relative_eq;
use attn_rs::cpu::{self, DecodeRef, DecodeResult};
use attn_rs::decode::{DecodeBatch, MAX_QUERY_LEN};
use attn_rs::AttnOptions;
use attn_rs::{Element, Fp8E4m3, KvCacheSpec, KvLayout, RowsDesc};
use half::bf16;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const BLOCK: usize = 16;

/// Requests' K/V in a FlashNhd cache of 16-token blocks, each request's blocks drawn from a
/// shuffled pool (with spare blocks); every element random in [-1, 1).
struct Paged<C> {
    spec: KvCacheSpec,
    cache: Vec<C>,
    block_table: Vec<i32>,
    stride: usize,
    seq_lens: Vec<i32>,
}

impl<C: Element> Paged<C> {
    fn new(rng: &mut SmallRng, lens: &[usize], num_kv_heads: usize, head_size: usize) -> Self {
        let need: Vec<usize> = lens.iter().map(|l| l.div_ceil(BLOCK)).collect();
        let num_blocks = need.iter().sum::<usize>() + 3;
        let stride = need.iter().copied().max().unwrap_or(0) + 1;
        let spec = KvCacheSpec::new(KvLayout::FlashNhd, num_blocks, BLOCK, num_kv_heads, head_size).unwrap();
        let mut pool: Vec<i32> = (0..num_blocks as i32).collect();
        pool.shuffle(rng);
        let mut pool = pool.into_iter();
        let mut block_table = vec![-1; lens.len() * stride]; // unused entries: never read
        for (r, &n) in need.iter().enumerate() {
            for i in 0..n {
                block_table[r * stride + i] = pool.next().unwrap();
            }
        }
        let cache = (0..spec.num_elements()).map(|_| C::from_f32(rng.random_range(-1.0..1.0))).collect();
        Paged { spec, cache, block_table, stride, seq_lens: lens.iter().map(|&l| l as i32).collect() }
    }

    fn addr(&self, plane: usize, r: usize, t: usize, h: usize, dim: usize) -> usize {
        let block = self.block_table[r * self.stride + t / BLOCK];
        assert!(block >= 0);
        self.spec.offset(plane, block as usize, t % BLOCK, h, dim)
    }

    /// K (plane 0) or V (plane 1) of token `t` of request `r`, kv head `h`, as stored.
    fn row(&self, plane: usize, r: usize, t: usize, h: usize) -> Vec<f64> {
        (0..self.spec.head_size).map(|dim| self.cache[self.addr(plane, r, t, h, dim)].to_f32() as f64).collect()
    }

    fn randomize(&mut self, rng: &mut SmallRng, r: usize, t: usize) {
        for plane in 0..2 {
            for h in 0..self.spec.num_kv_heads {
                for dim in 0..self.spec.head_size {
                    let at = self.addr(plane, r, t, h, dim);
                    self.cache[at] = C::from_f32(rng.random_range(-1.0..1.0));
                }
            }
        }
    }
}

pub(crate) fn random_q<Q: Element>(rng: &mut SmallRng, n: usize, amp: f32) -> Vec<Q> {
    (0..n).map(|_| Q::from_f32(rng.random_range(-amp..amp))).collect()
}

fn q_row<Q: Element>(q: &[Q], rows: &RowsDesc, token: usize, h: usize) -> Vec<f64> {
    (0..rows.head_size).map(|dim| q[rows.offset(token, h, dim)].to_f32() as f64).collect()
}

struct Call<'a> {
    q_lens: &'a [usize],
    num_q_heads: usize,
    opts: AttnOptions,
    alibi: Option<&'a [f32]>,
    sinks: Option<&'a [f32]>,
    scales: Option<(f32, f32)>,
}

impl<'a> Call<'a> {
    fn new(q_lens: &'a [usize], num_q_heads: usize, head_size: usize) -> Self {
        Call { q_lens, num_q_heads, opts: AttnOptions::new(head_size), alibi: None, sinks: None, scales: None }
    }

    fn rows(&self, head_size: usize) -> RowsDesc {
        RowsDesc::contiguous(self.q_lens.iter().sum(), self.num_q_heads, head_size)
    }

    fn run<Q: Element, C: Element>(&self, p: &Paged<C>, q: &[Q]) -> DecodeResult {
        let qsl = start_locs(self.q_lens);
        let res = cpu::paged_decode(&DecodeRef {
            q,
            q_rows: self.rows(p.spec.head_size),
            cache: &p.cache,
            spec: p.spec,
            block_table: &p.block_table,
            block_table_stride: p.stride,
            batch: DecodeBatch { seq_lens: &p.seq_lens, query_start_loc: &qsl },
            opts: self.opts,
            alibi_slopes: self.alibi,
            sinks: self.sinks,
            scales: self.scales.map(Into::into),
        })
        .unwrap();
        assert_eq!(res.bad_blocks, 0);
        assert!(res.out.iter().all(|x| x.is_finite()) && res.lse.iter().all(|x| !x.is_nan()));
        res
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Softmax attention in f64, written out: (sum_i e^(l_i - m) v_i / Z, m + ln Z) with
/// Z = sum_i e^(l_i - m) + e^(sink - m); no keys and no sink give (0, -inf).
fn attend(logits: &[f64], values: &[Vec<f64>], sink: f64, head_size: usize) -> (Vec<f64>, f64) {
    let m = logits.iter().copied().fold(sink, f64::max);
    if m == f64::NEG_INFINITY {
        return (vec![0.0; head_size], f64::NEG_INFINITY);
    }
    let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
    let z = e.iter().sum::<f64>() + (sink - m).exp();
    let mut out = vec![0.0; head_size];
    for (w, v) in e.iter().zip(values) {
        for (o, x) in out.iter_mut().zip(v) {
            *o += w * x;
        }
    }
    out.iter_mut().for_each(|o| *o /= z);
    (out, m + z.ln())
}

/// [`attend`] for query `q` over keys `ts` of request `r`, kv head `kvh` (plain scaled dot
/// products).
fn attend_keys<C: Element>(p: &Paged<C>, r: usize, kvh: usize, q: &[f64], ts: std::ops::Range<usize>, scale: f64) -> (Vec<f64>, f64) {
    let logits: Vec<f64> = ts.clone().map(|t| scale * dot(q, &p.row(0, r, t, kvh))).collect();
    let values: Vec<Vec<f64>> = ts.map(|t| p.row(1, r, t, kvh)).collect();
    attend(&logits, &values, f64::NEG_INFINITY, p.spec.head_size)
}

/// `|got - want| <= tol * max(1e-300, max |want|)` elementwise.
fn assert_close(got: &[f64], want: &[f64], tol: f64, ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}");
    let norm = want.iter().fold(1e-300f64, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * norm, "{ctx}: [{i}] {g} vs {w} (scale {norm})");
    }
}

fn assert_lse_close(got: f64, want: f64, tol: f64, ctx: &str) {
    if want == f64::NEG_INFINITY {
        assert_eq!(got, want, "{ctx}: lse");
    } else {
        assert!((got - want).abs() <= tol * want.abs().max(1.0), "{ctx}: lse {got} vs {want}");
    }
}

fn out_row(res: &DecodeResult, token: usize, h: usize, num_q_heads: usize, d: usize) -> &[f64] {
    &res.out[(token * num_q_heads + h) * d..(token * num_q_heads + h + 1) * d]
}

#[test]
fn single_key_gives_its_value() {
    let mut rng = SmallRng::seed_from_u64(50);
    let (hq, hkv, d) = (4, 2, 64);
    let call = Call::new(&[1], hq, d);
    let scale = call.opts.softmax_scale as f64;

    // f32 cache, no scales: out = V exactly, lse = the logit.
    let p = Paged::<f32>::new(&mut rng, &[1], hkv, d);
    let q: Vec<f32> = random_q(&mut rng, hq * d, 2.0);
    let res = call.run(&p, &q);
    let rows = call.rows(d);
    for h in 0..hq {
        let kvh = h / (hq / hkv);
        assert_eq!(out_row(&res, 0, h, hq, d), p.row(1, 0, 0, kvh).as_slice(), "head {h}");
        assert_relative_eq!(res.lse[h], scale * dot(&q_row(&q, &rows, 0, h), &p.row(0, 0, 0, kvh)), max_relative = 1e-12);
    }

    // FP8 cache with scales: out = v_scale * V, lse = k_scale * the logit.
    let p = Paged::<Fp8E4m3>::new(&mut rng, &[1], hkv, d);
    let q: Vec<bf16> = random_q(&mut rng, hq * d, 2.0);
    let call = Call { scales: Some((0.5, 3.0)), ..Call::new(&[1], hq, d) };
    let res = call.run(&p, &q);
    for h in 0..hq {
        let kvh = h / (hq / hkv);
        let want: Vec<f64> = p.row(1, 0, 0, kvh).iter().map(|v| v * 3.0).collect();
        assert_close(out_row(&res, 0, h, hq, d), &want, 1e-15, &format!("fp8 head {h}"));
        let logit = 0.5 * scale * dot(&q_row(&q, &rows, 0, h), &p.row(0, 0, 0, kvh));
        assert_relative_eq!(res.lse[h], logit, max_relative = 1e-12);
    }
}

#[test]
fn context_parallel_halves_merge_to_the_whole() {
    let mut rng = SmallRng::seed_from_u64(51);
    for iter in 0..12 {
        let (hq, hkv) = pick(&mut rng, &[(4, 2), (2, 1), (4, 4)]);
        let d = pick(&mut rng, &[64, 128]);
        let len = rng.random_range(1..200);
        let p = Paged::<bf16>::new(&mut rng, &[len], hkv, d);
        let q: Vec<bf16> = random_q(&mut rng, hq * d, 3.0); // peaky enough to matter
        let call = Call::new(&[1], hq, d);
        let rows = call.rows(d);
        let scale = call.opts.softmax_scale as f64;
        let res = call.run(&p, &q);
        for h in 0..hq {
            let kvh = h / (hq / hkv);
            let qh = q_row(&q, &rows, 0, h);
            let split = rng.random_range(0..=len);
            let ctx = format!("iter {iter}: len {len} split {split} hq {hq} hkv {hkv} d {d} head {h}");
            let (full, full_lse) = attend_keys(&p, 0, kvh, &qh, 0..len, scale);
            let (a, a_lse) = attend_keys(&p, 0, kvh, &qh, 0..split, scale);
            let (b, b_lse) = attend_keys(&p, 0, kvh, &qh, split..len, scale);
            let (merged, merged_lse) = cpu::merge_states_row(&a, a_lse, &b, b_lse);
            assert_close(&merged, &full, 1e-9, &format!("{ctx}: merge vs whole"));
            assert_lse_close(merged_lse, full_lse, 1e-9, &format!("{ctx}: merge vs whole"));
            assert_close(out_row(&res, 0, h, hq, d), &full, 1e-9, &format!("{ctx}: cpu::paged_decode vs whole"));
            assert_lse_close(res.lse[h], full_lse, 1e-9, &format!("{ctx}: cpu::paged_decode vs whole"));
        }
    }
}

#[test]
fn sinks_scale_the_output_down_and_raise_the_lse() {
    let mut rng = SmallRng::seed_from_u64(52);
    let (hq, hkv, d) = (4, 2, 64);
    let lens = [120, 7];
    let q_lens = [3, 1];
    let p = Paged::<f32>::new(&mut rng, &lens, hkv, d);
    let nt: usize = q_lens.iter().sum();
    let q: Vec<f32> = random_q(&mut rng, nt * hq * d, 2.0);
    let sinks = [-2.0f32, 0.5, 3.0, 30.0];
    let plain = Call::new(&q_lens, hq, d).run(&p, &q);
    let with = Call { sinks: Some(&sinks), ..Call::new(&q_lens, hq, d) }.run(&p, &q);
    for token in 0..nt {
        for (h, &sink) in sinks.iter().enumerate() {
            let ctx = format!("token {token} head {h}");
            let (lse, lse_s) = (plain.lse[token * hq + h], with.lse[token * hq + h]);
            assert!(lse_s > lse, "{ctx}: {lse_s} <= {lse}");
            assert_relative_eq!(lse_s, logsumexp(&[lse, sink as f64]), max_relative = 1e-12);
            let (o, o_s) = (out_row(&plain, token, h, hq, d), out_row(&with, token, h, hq, d));
            let want: Vec<f64> = o.iter().map(|x| x * (lse - lse_s).exp()).collect();
            assert_close(o_s, &want, 1e-12, &ctx);
            let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
            assert!(norm(o_s) < norm(o), "{ctx}: {} >= {}", norm(o_s), norm(o));
        }
    }
}

#[test]
fn window_hides_older_keys() {
    let mut rng = SmallRng::seed_from_u64(53);
    let (hq, hkv, d) = (2, 1, 64);
    for iter in 0..10 {
        let q_len = rng.random_range(1..=4);
        let len = rng.random_range(q_len + 1..180);
        let window = rng.random_range(1..=len as u32 + 5);
        let mut p = Paged::<bf16>::new(&mut rng, &[len], hkv, d);
        let q: Vec<bf16> = random_q(&mut rng, q_len * hq * d, 2.0);
        let q_lens = [q_len];
        let call = Call { opts: AttnOptions { window: Some(window), ..AttnOptions::new(d) }, ..Call::new(&q_lens, hq, d) };
        let rows = call.rows(d);
        let scale = call.opts.softmax_scale as f64;
        let ctx = format!("iter {iter}: len {len} q_len {q_len} window {window}");
        let before = call.run(&p, &q);

        // Each query token j at position pos = len - q_len + j sees keys [pos - W + 1, pos].
        let first_of = |j: usize| (len - q_len + j + 1).saturating_sub(window as usize);
        for j in 0..q_len {
            let pos = len - q_len + j;
            for h in 0..hq {
                let (want, want_lse) = attend_keys(&p, 0, h / (hq / hkv), &q_row(&q, &rows, j, h), first_of(j)..pos + 1, scale);
                assert_close(out_row(&before, j, h, hq, d), &want, 1e-9, &format!("{ctx}: token {j} head {h}"));
                assert_lse_close(before.lse[j * hq + h], want_lse, 1e-9, &format!("{ctx}: token {j} head {h}"));
            }
        }

        // Keys older than every token's window: new values change nothing.
        for t in 0..first_of(0) {
            p.randomize(&mut rng, 0, t);
        }
        let after = call.run(&p, &q);
        assert_eq!(before.out, after.out, "{ctx}");
        assert_eq!(before.lse, after.lse, "{ctx}");

        // The first key of token 0's window matters to token 0 only (if token 1 exists, its
        // window starts one later), unless the window reaches the start of the context.
        if len - q_len + 1 > window as usize {
            let t = first_of(0);
            p.randomize(&mut rng, 0, t);
            let changed = call.run(&p, &q);
            let tok = |res: &DecodeResult, j: usize| res.out[j * hq * d..(j + 1) * hq * d].to_vec();
            assert_ne!(tok(&changed, 0), tok(&after, 0), "{ctx}: key {t} is in token 0's window");
            for j in 1..q_len {
                assert_eq!(tok(&changed, j), tok(&after, j), "{ctx}: key {t} is outside token {j}'s window");
            }
        }
    }
}

#[test]
fn empty_context_gives_zero_and_neg_inf() {
    let mut rng = SmallRng::seed_from_u64(54);
    let (hq, hkv, d) = (4, 2, 128);
    let lens = [0, 40, 0];
    let q_lens = [1, 2, 1];
    let p = Paged::<bf16>::new(&mut rng, &lens, hkv, d);
    let nt: usize = q_lens.iter().sum();
    let q: Vec<bf16> = random_q(&mut rng, nt * hq * d, 1.0);
    let sinks = [0.25f32, -3.0, 7.5, -0.0];
    for sinks in [None, Some(&sinks[..])] {
        let res = Call { sinks, ..Call::new(&q_lens, hq, d) }.run(&p, &q);
        for token in [0, 3] {
            for h in 0..hq {
                assert!(out_row(&res, token, h, hq, d).iter().all(|&x| x == 0.0), "token {token} head {h}");
                let want = sinks.map_or(f64::NEG_INFINITY, |s| s[h] as f64);
                assert_eq!(res.lse[token * hq + h], want, "token {token} head {h} sinks {sinks:?}");
            }
        }
        // The non-empty request attends as if alone.
        let mut alone = Paged::<bf16>::new(&mut rng, &[40], hkv, d);
        for t in 0..40 {
            for plane in 0..2 {
                for h in 0..hkv {
                    for dim in 0..d {
                        let (dst, src) = (alone.addr(plane, 0, t, h, dim), p.addr(plane, 1, t, h, dim));
                        alone.cache[dst] = p.cache[src];
                    }
                }
            }
        }
        let res1 = Call { sinks, ..Call::new(&[2], hq, d) }.run(&alone, &q[hq * d..3 * hq * d]);
        assert_eq!(res1.out, res.out[hq * d..3 * hq * d]);
        assert_eq!(res1.lse, res.lse[hq..3 * hq]);
    }
}

#[test]
fn gqa_query_heads_read_their_kv_head() {
    let mut rng = SmallRng::seed_from_u64(55);
    for (hq, hkv) in [(8, 2), (6, 3), (4, 4), (4, 1)] {
        let group = hq / hkv;
        let d = 64;
        let len = 50;
        let p = Paged::<f32>::new(&mut rng, &[len], hkv, d);
        // Every query head gets the same vector: outputs can differ only through the kv head.
        let one: Vec<f32> = random_q(&mut rng, d, 3.0);
        let q: Vec<f32> = (0..hq).flat_map(|_| one.iter().copied()).collect();
        let call = Call::new(&[1], hq, d);
        let scale = call.opts.softmax_scale as f64;
        let res = call.run(&p, &q);
        let qh: Vec<f64> = one.iter().map(|&x| x as f64).collect();
        let per_kv: Vec<(Vec<f64>, f64)> = (0..hkv).map(|kvh| attend_keys(&p, 0, kvh, &qh, 0..len, scale)).collect();
        for h in 0..hq {
            let ctx = format!("hq {hq} hkv {hkv} head {h}");
            let got = out_row(&res, 0, h, hq, d);
            assert_close(got, &per_kv[h / group].0, 1e-9, &ctx);
            assert_lse_close(res.lse[h], per_kv[h / group].1, 1e-9, &ctx);
            assert_eq!(got, out_row(&res, 0, (h / group) * group, hq, d), "{ctx}: same group, same output");
            for (kvh, (other, _)) in per_kv.iter().enumerate().filter(|(k, _)| *k != h / group) {
                // `f64::max` drops a NaN: check for one first, so that a NaN output fails.
                assert!(got.iter().chain(other).all(|x| !x.is_nan()), "{ctx}: a NaN output");
                let diff = got.iter().zip(other).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
                assert!(diff > 1e-3, "{ctx}: output matches kv head {kvh} too");
            }
        }
    }
}

#[test]
fn batch_matches_explicit_attention() {
    // Several requests, 1..=8 causal query tokens each, soft-cap and ALiBi: every (token, head)
    // against the explicit f64 attention over its visible keys.
    let mut rng = SmallRng::seed_from_u64(56);
    for iter in 0..4 {
        let (hq, hkv, d) = (4, 2, 64);
        let num_reqs = rng.random_range(1..5);
        let q_lens: Vec<usize> = (0..num_reqs).map(|_| rng.random_range(1..=MAX_QUERY_LEN)).collect();
        let lens: Vec<usize> = q_lens.iter().map(|&q| if rng.random_bool(0.15) { 0 } else { rng.random_range(q..150) }).collect();
        let p = Paged::<bf16>::new(&mut rng, &lens, hkv, d);
        let nt: usize = q_lens.iter().sum();
        let q: Vec<bf16> = random_q(&mut rng, nt * hq * d, 3.0);
        let softcap = if iter % 2 == 1 { Some(5.0f32) } else { None };
        let slopes: Vec<f32> = (0..hq).map(|h| 0.5f32.powi(h as i32 + 1)).collect();
        let alibi = if iter >= 2 { Some(slopes.as_slice()) } else { None };
        let call = Call { opts: AttnOptions { softcap, ..AttnOptions::new(d) }, alibi, ..Call::new(&q_lens, hq, d) };
        let rows = call.rows(d);
        let scale = call.opts.softmax_scale as f64;
        let res = call.run(&p, &q);
        let mut token = 0;
        for r in 0..num_reqs {
            for j in 0..q_lens[r] {
                let pos = (lens[r] + j).saturating_sub(q_lens[r]);
                for h in 0..hq {
                    let kvh = h / (hq / hkv);
                    let qh = q_row(&q, &rows, token, h);
                    let keys = 0..lens[r].min(pos + 1);
                    let logits: Vec<f64> = keys
                        .clone()
                        .map(|t| {
                            let mut l = scale * dot(&qh, &p.row(0, r, t, kvh));
                            if let Some(c) = softcap {
                                l = c as f64 * (l / c as f64).tanh();
                            }
                            l + alibi.map_or(0.0, |s| s[h] as f64 * (t as f64 - pos as f64))
                        })
                        .collect();
                    let values: Vec<Vec<f64>> = keys.map(|t| p.row(1, r, t, kvh)).collect();
                    let (want, want_lse) = attend(&logits, &values, f64::NEG_INFINITY, d);
                    let ctx = format!("iter {iter}: request {r} (len {}, q {}) token {j} head {h}", lens[r], q_lens[r]);
                    assert_close(out_row(&res, token, h, hq, d), &want, 1e-9, &ctx);
                    assert_lse_close(res.lse[token * hq + h], want_lse, 1e-9, &ctx);
                }
                token += 1;
            }
        }
    }
}

#[test]
fn cpu_decode_refuses_invalid_batches() {
    let mut rng = SmallRng::seed_from_u64(57);
    let p = Paged::<f32>::new(&mut rng, &[40], 1, 64);
    let q: Vec<f32> = random_q(&mut rng, 9 * 64, 1.0);
    let call = |seq_lens: &[i32], qsl: &[i32], stride: usize| {
        cpu::paged_decode(&DecodeRef {
            q: &q,
            q_rows: RowsDesc::contiguous(*qsl.last().unwrap() as usize, 1, 64),
            cache: &p.cache,
            spec: p.spec,
            block_table: &p.block_table,
            block_table_stride: stride,
            batch: DecodeBatch { seq_lens, query_start_loc: qsl },
            opts: AttnOptions::new(64),
            alibi_slopes: None,
            sinks: None,
            scales: None,
        })
        .map(|_| ())
    };
    assert_eq!(refused_arg(call(&[40], &[0, 9], p.stride)), "query_start_loc");
    assert_eq!(refused_arg(call(&[40], &[0, 1], 2)), "block_table");
    assert_eq!(refused_arg(call(&[2], &[0, 3], p.stride)), "seq_lens");
    call(&[40], &[0, 8], p.stride).unwrap();
}
