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
