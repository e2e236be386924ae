//! How the tests compare a result with the f64 reference (no GPU needed).

use attn_rs::DType;

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

/// Relative error allowed for outputs of a dtype. Compare with [`within`]: `err > tol` passes
/// a NaN.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1e-2,
        DType::F16 => 3e-3,
        _ => 1e-5,
    }
}

/// Relative errors allowed (global, worst row) and the log-sum-exp's where FP8-cache prefill
/// rounds its queries and softmax weights to e4m3 (`attn_rs::prefill::fp8_prefill_rounds_to_e4m3`).
/// Each rounding is off by up to 2^-4 relative (3 mantissa bits; about 2.5% RMS), the queries'
/// moving a score by a few percent of its size and the weights' an output row by a few percent
/// of its norm. Measured on the H100 over `gpu_prefill`'s e4m3 cases: global 1.3-2.4e-2, worst
/// row 2.9-5.9e-2, log-sum-exp 0.6-2.4e-2; the bounds are about 1.7x the largest. The
/// log-sum-exp's since reached 4.3e-2 in one draw of `bf16_fp8::lengths` and 6.2e-2 in one of
/// `gpu_decode`'s `f16_fp8::basic` (H200): a one-key row's log-sum-exp is its single score, off by
/// the queries' rounding alone (sum of dq_i k_i x scale: no other keys average it out). With the
/// decode tests' ranges (queries up to 1, FP8 keys up to 2, d128) that error has an RMS of 0.017;
/// simulated over 40,000 rows, 2.8e-4 of them pass 0.06 and the largest was 0.071. Its bound is
/// 1e-1 (absolute below 1, as every log-sum-exp check), six RMS.
pub const E4M3_TOLERANCE: (f64, f64, f64) = (4e-2, 1e-1, 1e-1);

/// The bounds a result of `dtype` is checked within (global relative error, worst row,
/// log-sum-exp): [`E4M3_TOLERANCE`] where the kernel rounds its queries and weights to e4m3.
pub fn bounds(dtype: DType, e4m3: bool) -> (f64, f64, f64) {
    if e4m3 {
        E4M3_TOLERANCE
    } else {
        (tolerance(dtype), row_tolerance(dtype), 2e-3)
    }
}

/// Whether `err` is at most `tol`: false for a NaN, which every comparison must fail on.
pub fn within(err: f64, tol: f64) -> bool {
    err <= tol
}

/// Relative error allowed for one output row ([`max_row_error`]): twice [`tolerance`]. A row's
/// error is the rounding of its own elements (the output and the softmax weights, each a few
/// thousandths relative in bf16), measured over one head's columns instead of the whole
/// output, so the worst of many rows sits above the global figure.
pub fn row_tolerance(dtype: DType) -> f64 {
    2.0 * tolerance(dtype)
}

/// The worst row of an output: its index and ‖got_row − want_row‖ / max(‖want_row‖, 1e-30).
#[derive(Clone, Copy, Debug)]
pub struct RowError {
    pub row: usize,
    pub err: f64,
}

impl RowError {
    /// Whether the worst row is within `tol` (never for a NaN).
    pub fn within(&self, tol: f64) -> bool {
        self.err <= tol
    }
}

/// Each row's relative error ‖got_row − want_row‖ / max(‖want_row‖, 1e-30), rows of `row_len`
/// (for attention: one (token, head) output vector each). NaN where either row has one; a row
/// whose reference is zero (nothing attended) is measured absolutely.
pub fn row_errors<'a>(got: &'a [f64], want: &'a [f64], row_len: usize) -> impl Iterator<Item = f64> + 'a {
    assert_eq!(got.len(), want.len(), "output lengths differ");
    assert!(row_len > 0 && got.len().is_multiple_of(row_len), "{} elements are not rows of {row_len}", got.len());
    got.chunks(row_len).zip(want.chunks(row_len)).map(|(g, w)| {
        let num: f64 = g.iter().zip(w).map(|(g, w)| (g - w) * (g - w)).sum();
        let den: f64 = w.iter().map(|w| w * w).sum();
        num.sqrt() / den.sqrt().max(1e-30)
    })
}

/// Fails unless every row of `got` (rows of `row_len`, `heads` rows a token) is within the row
/// tolerance of `dtype`, naming the worst row's token and head.
pub fn check_rows(got: &[f64], want: &[f64], row_len: usize, heads: usize, dtype: DType) -> Result<(), String> {
    check_rows_within(got, want, row_len, heads, row_tolerance(dtype))
}

/// [`check_rows`] with `tol` instead of the dtype's row tolerance.
pub fn check_rows_within(got: &[f64], want: &[f64], row_len: usize, heads: usize, tol: f64) -> Result<(), String> {
    let worst = max_row_error(got, want, row_len);
    match worst.within(tol) {
        true => Ok(()),
        false => {
            Err(format!("row relative error {:.2e} > {tol:.0e} at token {}, head {}", worst.err, worst.row / heads, worst.row % heads))
        }
    }
}

/// The worst row of [`row_errors`]. One global norm averages over every row, so a row that is
/// wrong alone (one key masked wrongly at a long context) barely moves it; the worst row does
/// not. The first row with a NaN is returned as the worst.
pub fn max_row_error(got: &[f64], want: &[f64], row_len: usize) -> RowError {
    let mut worst = RowError { row: 0, err: 0.0 };
    for (row, err) in row_errors(got, want, row_len).enumerate() {
        if err.is_nan() {
            return RowError { row, err };
        }
        if err > worst.err {
            worst = RowError { row, err };
        }
    }
    worst
}

/// Checks GPU LSEs (`[tokens, heads]`) against the reference: -inf exactly where the reference
/// has it (nothing attended), else within 2e-3 (relative above 1). Names the first bad entry.
pub fn check_lse(got: &[f32], want: &[f64], heads: usize) -> Result<(), String> {
    check_lse_within(got, want, heads, 2e-3)
}

/// [`check_lse`] with `rel` instead of 2e-3 (relative to the value, or absolute below 1).
pub fn check_lse_within(got: &[f32], want: &[f64], heads: usize, rel: f64) -> Result<(), String> {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w == f64::NEG_INFINITY { g == f32::NEG_INFINITY } else { (g as f64 - w).abs() <= rel * w.abs().max(1.0) };
        if !ok {
            return Err(format!("lse[{i}] (token {}, head {}) = {g}, want {w}", i / heads, i % heads));
        }
    }
    Ok(())
}
