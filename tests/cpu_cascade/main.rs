//! CPU tests of cascade attention and of merging attention shares by LSE (no GPU):
//! `attn_rs::metadata::common_prefix` against a naive reference (identical, diverging and capped
//! prefixes, odd input, random tables), `use_cascade`'s thresholds on each side, and, with the
//! f64 reference (`attn_rs::cpu`), that the decompositions are exact: shared prefix (all query
//! tokens of the batch as one non-causal request) merged with each request's own suffix equals
//! plain attention, and a decode's context split in two shares (context parallel) merged by LSE
//! equals the whole.

use rand::rngs::SmallRng;
use rand::Rng;

mod merge;
mod prefix;

fn pick<T: Copy>(rng: &mut SmallRng, xs: &[T]) -> T {
    xs[rng.random_range(0..xs.len())]
}

fn start_locs(q_lens: &[usize]) -> Vec<i32> {
    let mut locs = vec![0i32];
    for &q in q_lens {
        locs.push(locs.last().unwrap() + q as i32);
    }
    locs
}
