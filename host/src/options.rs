//! The options of the attention calls: a layer's ([`AttnOptions`]), and what a decode or MLA
//! split plan is made with besides the batch and the layer ([`PlanOptions`]): how to split
//! ([`SplitMode`]) and the planners' tuning knobs ([`Tuning`]). Plan options are passed where a
//! plan is made ([`paged_decode`](crate::decode::paged_decode),
//! [`mla_attention`](crate::mla::mla_attention), [`BatchPlan`](crate::batch_plan::BatchPlan)),
//! or held by [`ForwardConfig`](crate::forward::ForwardConfig) for `forward`'s plans.

/// Attention options of a layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnOptions {
    /// Multiplies Q K^T before the softmax (usually `1 / sqrt(head_size)`).
    pub softmax_scale: f32,
    /// Sliding window: each query sees its last `window` keys (itself included).
    pub window: Option<u32>,
    /// Logit soft-cap: `cap * tanh(logit / cap)`.
    pub softcap: Option<f32>,
    /// Chunked local attention (Llama 4's `attention_chunk_size`): a query sees only the keys
    /// of its own chunk of `chunk_size` positions (`key / chunk_size == pos / chunk_size`), up
    /// to itself when causal.
    pub chunk_size: Option<u32>,
    /// A symmetric window for bidirectional (non-causal) attention: key `j` is visible from
    /// query `i` when `|i - j| <= symmetric_window` (vLLM's `sliding_window` of encoder-only
    /// layers: `window_size = (w, w)`). Refused with causal attention (use `window`).
    pub symmetric_window: Option<u32>,
}

impl AttnOptions {
    /// Scale `1 / sqrt(head_size)`, no window, no soft-cap, no local mask.
    pub fn new(head_size: usize) -> Self {
        AttnOptions {
            softmax_scale: 1.0 / (head_size as f32).sqrt(),
            window: None,
            softcap: None,
            chunk_size: None,
            symmetric_window: None,
        }
    }

    /// Checks the masks of a call (`causal`: its queries see only earlier keys), naming
    /// `arg` and the value: a window and a chunk of at least one key, and a symmetric window only
    /// without causality and without a (causal) window.
    pub fn validate_masks(&self, arg: &'static str, causal: bool) -> crate::error::Result<()> {
        use crate::error::ensure;
        ensure(self.window != Some(0), arg, || "a sliding window of 0 keys".into())?;
        ensure(self.chunk_size != Some(0), arg, || "chunk_size 0: a chunk holds at least one position".into())?;
        if let Some(w) = self.symmetric_window {
            ensure(!causal, arg, || format!("symmetric_window {w} with causal attention (a causal layer takes window)"))?;
            ensure(self.window.is_none(), arg, || format!("symmetric_window {w} beside window {:?}: one or the other", self.window))?;
        }
        Ok(())
    }
}

/// How decode splits the keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SplitMode {
    /// Planned per batch from the SM count, the batch and the lengths.
    #[default]
    Auto,
    /// The longest request is split into at most `n` chunks of whole 16-token tiles (so
    /// sometimes fewer); `Fixed(1)` gives one split per request and results that do not depend
    /// on the rest of the batch (deterministic mode).
    Fixed(u32),
}

/// The split planners' tuning knobs. The defaults are the values measured on the H100
/// (docs/decode.md, docs/mla.md); the benchmark (`attn-bench`) sets the others.
/// They change how a batch is split, never a result beyond rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Waves of resident CTAs a tensor-core decode plan aims at (`SplitMode::Auto`); `None`:
    /// the measured value for the head size (4 at d64, 1 at d96 and d128, 2 at d256). 0 counts
    /// as 1.
    pub decode_waves: Option<u64>,
    /// Splits batches of requests of about equal length into even waves of CTAs
    /// (`attn_math::split::even_waves_chunk`; tensor-core decode, `SplitMode::Auto`).
    pub decode_even_waves: bool,
    /// Waves of resident CTAs an MLA plan aims at (`SplitMode::Auto`; 0 counts as 1).
    pub mla_waves: u64,
    /// MLA on sm_90a: a request's splits as one thread-block cluster that combines them in
    /// shared memory, where the plan allows it ([`DecodePlan::cluster`](crate::decode::DecodePlan::cluster)).
    pub mla_clusters: bool,
}

impl Tuning {
    /// The measured defaults.
    pub const DEFAULT: Tuning = Tuning { decode_waves: None, decode_even_waves: true, mla_waves: 1, mla_clusters: true };
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning::DEFAULT
    }
}

/// The options of a split plan (FlashInfer's `plan` arguments): how to split, and the tuning.
/// A [`SplitMode`] converts into one with the default tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PlanOptions {
    /// How the keys are split (automatic, or a fixed number of splits).
    pub split: SplitMode,
    /// The planners' knobs ([`Tuning::DEFAULT`]: the measured values).
    pub tuning: Tuning,
}

impl From<SplitMode> for PlanOptions {
    fn from(split: SplitMode) -> Self {
        PlanOptions { split, tuning: Tuning::DEFAULT }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_measured_values() {
        let t = Tuning::default();
        assert_eq!(t, Tuning { decode_waves: None, decode_even_waves: true, mla_waves: 1, mla_clusters: true });
        assert_eq!(PlanOptions::from(SplitMode::Fixed(3)), PlanOptions { split: SplitMode::Fixed(3), tuning: t });
        assert_eq!(PlanOptions::default().split, SplitMode::Auto);
    }
}
