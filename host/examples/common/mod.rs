//! What every example shares: deterministic inputs and opening the GPU.

// Each example compiles this module on its own and uses part of it.
#![allow(dead_code)]

use attn_rs::{AttnDevice, AttnError, Element};
use half::bf16;

/// `n` values in [-1, 1), the same on every run.
pub fn values<T: Element>(n: usize, seed: u32) -> Vec<T> {
    (0..n as u32)
        .map(|i| T::from_f32((i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) as f32 / u32::MAX as f32 * 2.0 - 1.0))
        .collect()
}

/// GPU 0, or `None` (after saying why) when there is no driver, no GPU or no kernels for it.
pub fn open_gpu() -> attn_rs::Result<Option<AttnDevice>> {
    match AttnDevice::new(0) {
        Ok(dev) => Ok(Some(dev)),
        Err(e @ (AttnError::NoDevice(_) | AttnError::UnsupportedDevice { .. })) => {
            println!("{e}: this example needs a GPU, nothing to run");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Prints `op`'s largest difference between the GPU's bf16 output `got` and the f64 reference
/// `want`, and exits with status 1 past bf16's bound (2e-2).
pub fn check_bf16(op: &str, got: &[bf16], want: &[f64]) {
    let err = got.iter().zip(want).map(|(g, w)| (g.to_f32() as f64 - w).abs()).fold(0.0, f64::max);
    println!("{op}: largest difference from the CPU reference {err:.2e} (bf16 output)");
    if err > 2e-2 {
        std::process::exit(1);
    }
}
