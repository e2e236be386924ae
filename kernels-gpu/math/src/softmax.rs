//! Online-softmax state and the log-sum-exp merge of partial attention results.
//!
//! Kernels keep scores in base-2 units (the softmax scale is multiplied by log2(e) once, so
//! exponentials are a single `ex2`); LSEs that leave a kernel are in natural-log units, as in
//! vLLM and FlashInfer. An empty partial result has LSE = -inf and contributes nothing.

pub const LOG2_E: f32 = core::f32::consts::LOG2_E;
pub const LN_2: f32 = core::f32::consts::LN_2;

/// `2^x`: the hardware approximation on the GPU, std's on the host.
#[inline(always)]
pub fn exp2(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let y: f32;
        unsafe { core::arch::asm!("ex2.approx.ftz.f32 {0}, {1};", out(reg32) y, in(reg32) x, options(pure, nomem, nostack)) };
        y
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        std::primitive::f32::exp2(x)
    }
}

/// `log2(x)` (GPU: hardware approximation).
#[inline(always)]
pub fn log2(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let y: f32;
        unsafe { core::arch::asm!("lg2.approx.ftz.f32 {0}, {1};", out(reg32) y, in(reg32) x, options(pure, nomem, nostack)) };
        y
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        std::primitive::f32::log2(x)
    }
}

/// Weights that combine partial results with natural-log LSEs `lse` into one: returns
/// (the combined LSE, `max`), and each partial's weight is `exp(lse_i - max) / sum`.
/// An extra `sink` logit (natural units; `-inf` for none) joins the denominator only.
#[inline(always)]
pub fn combine_lse(lses: impl Iterator<Item = f32> + Clone, sink: f32) -> (f32, f32, f32) {
    let mut max = sink;
    for l in lses.clone() {
        max = if l > max { l } else { max };
    }
    if max == f32::NEG_INFINITY {
        // Nothing attended: the output is zero and the LSE -inf.
        return (f32::NEG_INFINITY, 0.0, 0.0);
    }
    let mut sum = exp2((sink - max) * LOG2_E);
    for l in lses {
        sum += exp2((l - max) * LOG2_E);
    }
    (max + log2(sum) * LN_2, max, sum)
}

/// Weight of one partial (natural-log LSE `lse`) in a combination from [`combine_lse`].
#[inline(always)]
pub fn partial_weight(lse: f32, max: f32, sum: f32) -> f32 {
    if sum == 0.0 {
        0.0
    } else {
        exp2((lse - max) * LOG2_E) / sum
    }
}

/// Running max (base-2 units) and denominator of one softmax row, with the rescale factor that
/// an accumulator must take when the max grows.
#[derive(Clone, Copy, Debug)]
pub struct OnlineSoftmax {
    pub max: f32,
    pub sum: f32,
}

impl OnlineSoftmax {
    pub const EMPTY: OnlineSoftmax = OnlineSoftmax { max: f32::NEG_INFINITY, sum: 0.0 };

    /// Raises the max to cover `chunk_max`; returns the factor to rescale the accumulator by.
    #[inline(always)]
    pub fn rescale_to(&mut self, chunk_max: f32) -> f32 {
        if chunk_max <= self.max {
            return 1.0;
        }
        let factor = if self.max == f32::NEG_INFINITY { 0.0 } else { exp2(self.max - chunk_max) };
        self.sum *= factor;
        self.max = chunk_max;
        factor
    }

    /// `2^(s - max)` for a score under the current max, added to the denominator.
    #[inline(always)]
    pub fn weight(&mut self, score: f32) -> f32 {
        let p = if score == f32::NEG_INFINITY { 0.0 } else { exp2(score - self.max) };
        self.sum += p;
        p
    }

    /// Merges another state of the same row; returns (factor for self's accumulator, factor for
    /// the other's).
    #[inline(always)]
    pub fn merge(&mut self, other: OnlineSoftmax) -> (f32, f32) {
        let max = if other.max > self.max { other.max } else { self.max };
        if max == f32::NEG_INFINITY {
            return (0.0, 0.0);
        }
        let (a, b) = (exp2(self.max - max), exp2(other.max - max));
        self.sum = self.sum * a + other.sum * b;
        self.max = max;
        (a, b)
    }

    /// The natural-log LSE of the row (scores were in base-2 units).
    #[inline(always)]
    pub fn lse(&self) -> f32 {
        if self.sum == 0.0 {
            f32::NEG_INFINITY
        } else {
            (self.max + log2(self.sum)) * LN_2
        }
    }
}
