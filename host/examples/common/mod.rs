//! What every example shares: deterministic inputs and opening the GPU.

// Each example compiles this module on its own and uses part of it.
#![allow(dead_code)]

use attn_rs::{AttnDevice, AttnError, Element};

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
