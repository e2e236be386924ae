//! `attn_math::softmax`: the online softmax streamed in chunks against the direct one, empty
//! states, and the LSE combination against a log-sum-exp in f64.

use crate::{logsumexp, pick, NEG_INF};
use approx::assert_relative_eq;
use attn_math::softmax::{combine_lse, partial_weight, OnlineSoftmax};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Streams base-2 scores in random chunks the way a kernel does: (state, accumulator).
fn stream(rng: &mut SmallRng, scores: &[f32], values: &[[f32; 4]]) -> (OnlineSoftmax, [f32; 4]) {
    let mut st = OnlineSoftmax::EMPTY;
    let mut acc = [0.0f32; 4];
    let mut i = 0;
    while i < scores.len() {
        let end = (i + rng.random_range(1..=32)).min(scores.len());
        let chunk_max = scores[i..end].iter().copied().fold(NEG_INF, f32::max);
        let f = st.rescale_to(chunk_max);
        acc.iter_mut().for_each(|a| *a *= f);
        for (s, v) in scores[i..end].iter().zip(&values[i..end]) {
            let p = st.weight(*s);
            acc.iter_mut().zip(v).for_each(|(a, x)| *a += p * x);
        }
        i = end;
    }
    (st, acc)
}

#[test]
fn online_softmax_streaming_matches_direct() {
    let mut rng = SmallRng::seed_from_u64(40);
    for iter in 0..300 {
        let n = rng.random_range(1..300);
        let spread = pick(&mut rng, &[0.5f32, 5.0, 40.0]);
        let offset = rng.random_range(-100.0f32..100.0);
        let mut scores: Vec<f32> =
            (0..n).map(|_| if rng.random_bool(0.05) { NEG_INF } else { offset + rng.random_range(-spread..spread) }).collect();
        scores[rng.random_range(0..n)] = offset; // at least one finite score
        let values: Vec<[f32; 4]> = (0..n).map(|_| std::array::from_fn(|_| rng.random_range(-1.0..1.0))).collect();

        // Direct f64: lse = ln(sum 2^s), out = sum 2^s v / sum 2^s.
        let m = scores.iter().copied().fold(NEG_INF, f32::max) as f64;
        let w: Vec<f64> = scores.iter().map(|&s| (s as f64 - m).exp2()).collect();
        let sum: f64 = w.iter().sum();
        let lse = (m + sum.log2()) * std::f64::consts::LN_2;
        let out: Vec<f64> = (0..4).map(|k| w.iter().zip(&values).map(|(w, v)| w * v[k] as f64).sum::<f64>() / sum).collect();

        // Two streamed halves, merged.
        let cut = rng.random_range(0..=n);
        let (mut a, acc_a) = stream(&mut rng, &scores[..cut], &values[..cut]);
        let (b, acc_b) = stream(&mut rng, &scores[cut..], &values[cut..]);
        let (fa, fb) = a.merge(b);
        let acc: Vec<f32> = acc_a.iter().zip(&acc_b).map(|(x, y)| x * fa + y * fb).collect();

        let ctx = format!("iter {iter}: n {n} cut {cut} spread {spread} offset {offset}");
        assert_eq!(a.max as f64, m, "{ctx}: max");
        assert_relative_eq!(a.sum as f64, sum, max_relative = 1e-5);
        assert_relative_eq!(a.lse() as f64, lse, epsilon = 1e-5, max_relative = 1e-6);
        for k in 0..4 {
            assert!((acc[k] / a.sum - out[k] as f32).abs() < 1e-5, "{ctx}: out[{k}] {} vs {}", acc[k] / a.sum, out[k]);
        }
        // One stream over everything agrees with the merge.
        let (whole, _) = stream(&mut rng, &scores, &values);
        assert_eq!(whole.max, a.max, "{ctx}");
        assert_relative_eq!(whole.sum, a.sum, max_relative = 1e-5);
    }
}

#[test]
fn online_softmax_empty_states() {
    let mut rng = SmallRng::seed_from_u64(41);
    let scores = [NEG_INF; 20];
    let values = [[1.0f32; 4]; 20];
    let (mut st, acc) = stream(&mut rng, &scores, &values);
    assert_eq!(st.sum, 0.0);
    assert_eq!(st.lse(), f32::NEG_INFINITY);
    assert!(acc.iter().all(|&x| x == 0.0), "{acc:?}");
    assert_eq!(st.merge(OnlineSoftmax::EMPTY), (0.0, 0.0));
    assert_eq!(st.lse(), f32::NEG_INFINITY);
    assert_eq!(OnlineSoftmax::EMPTY.lse(), f32::NEG_INFINITY);
    // Merging into an empty state takes the other unchanged.
    let mut e = OnlineSoftmax::EMPTY;
    let other = OnlineSoftmax { max: 3.0, sum: 2.5 };
    assert_eq!(e.merge(other), (0.0, 1.0));
    assert_eq!((e.max, e.sum), (3.0, 2.5));
    let mut s = other;
    assert_eq!(s.merge(OnlineSoftmax::EMPTY), (1.0, 0.0));
    assert_eq!((s.max, s.sum), (3.0, 2.5));
}

#[test]
fn combine_lse_matches_logsumexp() {
    let mut rng = SmallRng::seed_from_u64(42);
    for iter in 0..1000 {
        let k = rng.random_range(0..8);
        let lses: Vec<f32> = (0..k).map(|_| if rng.random_bool(0.2) { NEG_INF } else { rng.random_range(-50.0..50.0) }).collect();
        let sink = if rng.random_bool(0.5) { NEG_INF } else { rng.random_range(-50.0..50.0) };
        let (lse, max, sum) = combine_lse(lses.iter().copied(), sink);
        let all: Vec<f64> = lses.iter().chain([&sink]).map(|&x| x as f64).collect();
        let want = logsumexp(&all);
        let weights: Vec<f32> = lses.iter().map(|&l| partial_weight(l, max, sum)).collect();
        let ctx = format!("iter {iter}: lses {lses:?} sink {sink}: ({lse}, {max}, {sum}), weights {weights:?}");
        assert!(!lse.is_nan() && weights.iter().all(|w| !w.is_nan()), "{ctx}");
        if want == f64::NEG_INFINITY {
            assert_eq!(lse, NEG_INF, "{ctx}");
            assert!(weights.iter().all(|&w| w == 0.0), "{ctx}");
            continue;
        }
        assert!((lse as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "{ctx}: want {want}");
        for (&l, &w) in lses.iter().zip(&weights) {
            assert!((w as f64 - (l as f64 - want).exp()).abs() < 1e-5, "{ctx}");
        }
        let total = weights.iter().map(|&w| w as f64).sum::<f64>() + (sink as f64 - want).exp();
        assert!((total - 1.0).abs() < 1e-5, "{ctx}: weights and sink sum to {total}");
    }
}

#[test]
fn combine_lse_edge_cases() {
    let (lse, max, sum) = combine_lse([NEG_INF, NEG_INF].into_iter(), NEG_INF);
    assert_eq!((lse, max, sum), (NEG_INF, 0.0, 0.0));
    assert_eq!(partial_weight(NEG_INF, max, sum), 0.0);
    assert_eq!(combine_lse(std::iter::empty(), NEG_INF).0, NEG_INF);
    // Only the sink: the LSE is the sink, partials weigh nothing.
    let (lse, max, sum) = combine_lse([NEG_INF].into_iter(), 2.5);
    assert_eq!(lse, 2.5);
    assert_eq!(partial_weight(NEG_INF, max, sum), 0.0);
    // One partial, no sink: its LSE and weight 1.
    let (lse, max, sum) = combine_lse([-7.25f32].into_iter(), NEG_INF);
    assert_eq!(lse, -7.25);
    assert_eq!(partial_weight(-7.25, max, sum), 1.0);
    // Two equal partials: + ln 2, weights 1/2.
    let (lse, max, sum) = combine_lse([1.0f32, 1.0].into_iter(), NEG_INF);
    assert_relative_eq!(lse, 1.0 + std::f32::consts::LN_2, max_relative = 1e-6);
    assert_relative_eq!(partial_weight(1.0, max, sum), 0.5, max_relative = 1e-6);
}
