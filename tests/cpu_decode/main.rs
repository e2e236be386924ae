//! CPU tests of decode (no GPU): the split-K planning math (`attn_math::split`), the host's batch
//! plan and validation (`attn_rs::decode`), the online softmax and LSE combination
//! (`attn_math::softmax`), and properties of the CPU reference `cpu::paged_decode` checked
//! against an explicit f64 softmax-attention written here.
//!
//! By part: [`split`], [`plan`] (and validation), [`softmax`], [`reference`] (`cpu::paged_decode`),
//! [`edge_markers`] (the GPU tests' masking inputs).

use attn_rs::AttnError;
use rand::rngs::SmallRng;
use rand::Rng;

mod edge_markers;
mod plan;
mod reference;
mod softmax;
mod split;

#[allow(dead_code)]
#[path = "../common/compare.rs"]
mod compare;
#[allow(dead_code)]
#[path = "../common/masking.rs"]
mod masking;

const NEG_INF: f32 = f32::NEG_INFINITY;

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

fn refused_arg(r: attn_rs::Result<()>) -> &'static str {
    match r {
        Err(AttnError::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// ln(sum exp(x)) in f64.
fn logsumexp(xs: &[f64]) -> f64 {
    let m = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + xs.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}
