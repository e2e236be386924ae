//! How the tests compare a result with the f64 reference (no GPU needed).

use host::DType;

/// ‖got − want‖ / ‖want‖ (the plain norm of the difference when the reference is all zeros).
pub fn rel_error(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Relative error allowed for outputs of a dtype.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1e-2,
        DType::F16 => 3e-3,
        _ => 1e-5,
    }
}

/// Checks GPU LSEs (`[tokens, heads]`) against the reference: -inf exactly where the reference
/// has it (nothing attended), else within 2e-3 (relative above 1). Names the first bad entry.
pub fn check_lse(got: &[f32], want: &[f64], heads: usize) -> Result<(), String> {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w == f64::NEG_INFINITY { g == f32::NEG_INFINITY } else { (g as f64 - w).abs() <= 2e-3 * w.abs().max(1.0) };
        if !ok {
            return Err(format!("lse[{i}] (token {}, head {}) = {g}, want {w}", i / heads, i % heads));
        }
    }
    Ok(())
}
