//! From a tile's scores to softmax weights: the logits (the attention variant of
//! `crate::attention::variants`: scale, soft-cap, ALiBi, masks) and the online-softmax step of a
//! warp's rows.

use crate::attention::config::AttnConfig;
use crate::attention::variants::{
    Alibi, BadBlocks, BadSlab, Causal, Chain, ChunkedLocal, KeyEnd, LogitsPolicy, Scale, SlidingWindow, SoftCap, SymmetricWindow,
};
use crate::attention::work::RowInfo;
use crate::blocks::device::{fma, fresh, shfl_xor, static_for, thread_idx_x};
use crate::blocks::mma::ld_shared_u32;
use attn_math::params::AttnParams;
use attn_math::softmax::{exp2, OnlineSoftmax};

/// The online-softmax step of a warp's two rows per thread (h = 0: row g, 1: row g + 8) over
/// `C::KW` scores each (and `C::DV` accumulator columns): raises the running max, rescales the accumulators, turns the scores into
/// weights `2^(s * mult - max)` and adds them to the denominators. `mult` is the factor left to
/// apply to the scores (the softmax scale in base-2 units, or 1 when already applied).
#[inline(always)]
pub(crate) fn softmax_step<C: AttnConfig, const NB: usize, const NO: usize>(
    s: &mut [[f32; 4]; NB],
    o: &mut [[f32; 4]; NO],
    state: &mut [OnlineSoftmax; 2],
    mult: f32,
) {
    static_for::<2>(|h| {
        let mut m = f32::NEG_INFINITY;
        static_for::<NB>(|n| {
            if n < C::KW / 8 {
                m = m.max(s[n][2 * h]).max(s[n][2 * h + 1]);
            }
        });
        // The 4 lanes of a quad share a row.
        m = m.max(shfl_xor(m, 1));
        m = m.max(shfl_xor(m, 2));
        let factor = state[h].rescale_to(m * mult);
        if factor != 1.0 {
            static_for::<NO>(|n| {
                if n < C::DV / 8 {
                    o[n][2 * h] *= factor;
                    o[n][2 * h + 1] *= factor;
                }
            });
        }
        // A row that has seen nothing yet keeps max -inf: its weights are all 0.
        let neg_max = if state[h].max == f32::NEG_INFINITY { 0.0 } else { -state[h].max };
        let mut sum = 0.0;
        static_for::<NB>(|n| {
            if n < C::KW / 8 {
                static_for::<2>(|e| {
                    let w = exp2(fma(s[n][2 * h + e], mult, neg_max));
                    s[n][2 * h + e] = w;
                    sum += w;
                });
            }
        });
        state[h].sum += sum;
    });
}

/// What turns a tile's scores into logits: the variant's pieces with this launch's parameters.
/// Scores are scaled inside the exponent's FMA ([`Self::mult`]) unless a transform needs them
/// scaled first (`prescale`).
#[derive(Clone, Copy)]
pub(crate) struct Logits {
    scale: Scale,
    prescale: bool,
    softcap: SoftCap,
    alibi: Alibi,
    causal: Causal,
    window: SlidingWindow,
    end: KeyEnd,
    /// Chunked local attention and the symmetric window: their own masking pass, compiled only
    /// into the kernels built for them ([`AttnConfig::LOCAL`]), so the others keep their code.
    local: Chain<ChunkedLocal, SymmetricWindow>,
}

impl Logits {
    #[inline(always)]
    pub fn new(p: &AttnParams, score_scale: f32, end: u32) -> Logits {
        let prescale = p.variant.softcap > 0.0 || p.per_head.alibi_slopes != 0 || score_scale <= 0.0;
        Logits {
            scale: Scale(score_scale),
            prescale,
            softcap: SoftCap::new(p.variant.softcap),
            alibi: Alibi { on: p.per_head.alibi_slopes != 0 },
            causal: Causal { on: p.mask.causal != 0 },
            window: SlidingWindow { window: p.variant.window },
            end: KeyEnd { end },
            local: Chain(ChunkedLocal { chunk: p.local.chunk }, SymmetricWindow { symmetric: p.local.symmetric }),
        }
    }

    /// The factor the softmax step still applies to the logits.
    #[inline(always)]
    pub fn mult(&self) -> f32 {
        if self.prescale {
            1.0
        } else {
            self.scale.0
        }
    }

    /// What a score becomes where `prescale`: scaled, soft-capped, ALiBi.
    #[inline(always)]
    fn prescaled(&self, s: f32, key: u32, row: &RowInfo) -> f32 {
        let x = self.scale.transform(s, key, row);
        let x = self.softcap.transform(x, key, row);
        self.alibi.transform(x, key, row)
    }

    /// The keys a row sees: the CTA's, causality, the window.
    #[inline(always)]
    fn mask(&self) -> impl LogitsPolicy {
        Chain(Chain(self.end, self.causal), self.window)
    }

    /// [`Self::apply`] for the keys-as-rows score fragment (`crate::attention::keys_rows`): element e of
    /// this thread is key `kt + g + 8 * (e / 2)` of row `rows[e % 2]`; `bad`: the warp's 16 keys
    /// have no block in the cache.
    #[inline(always)]
    pub fn apply_keys_rows(&self, s: &mut [f32; 4], rows: &[RowInfo; 2], kt: u32, pos: (u32, u32), bad: bool) {
        let g = (thread_idx_x() % 32) / 4;
        let key_of = |e: usize| kt + g + 8 * (e / 2) as u32;
        if self.prescale {
            static_for::<4>(|e| s[e] = self.prescaled(s[e], key_of(e), &rows[e % 2]));
        }
        if self.mask().crosses(kt, 16, pos) || BadSlab(bad).crosses(kt, 16, pos) {
            static_for::<4>(|e| {
                let (key, row) = (key_of(e), &rows[e % 2]);
                s[e] = if self.mask().visible(key, row) & BadSlab(bad).visible(key, row) { s[e] } else { f32::NEG_INFINITY }
            });
        }
    }

    /// Turns the scores of `MT` row tiles x `C::KW` keys from key `kt` into logits, masked where
    /// the tile crosses a boundary for rows `min_pos..=max_pos`. `flags`: the table slot's
    /// `C::KW / 32` bad-key masks from key `kt` ([`BadBlocks`]).
    #[inline(always)]
    pub unsafe fn apply<C: AttnConfig, const MT: usize, const NB: usize>(
        &self,
        s: &mut [[[f32; 4]; NB]; MT],
        rows: &[[RowInfo; 2]; MT],
        kt: u32,
        (min_pos, max_pos): (u32, u32),
        flags: u32,
    ) {
        // Column (n, e)'s key: the thread's first key plus a constant. Each pass that reads keys
        // takes the first key anew (`fresh`): shared, the passes' adds (16 keys a block) were
        // hoisted above their branches and ran on every tile, masked or not (e4m3 kernels: 32
        // instructions a warp a 64-key step).
        let first_key = || fresh(kt + 2 * (thread_idx_x() % 4));
        let key_of = |k0: u32, n: usize, e: usize| k0 + (n as u32 * 8 + (e % 2) as u32);
        // Every element of the warp's score tiles: (row tile, column tile, register).
        macro_rules! each {
            (|$mt:ident, $n:ident, $e:ident| $body:expr) => {
                static_for::<MT>(|$mt| {
                    static_for::<NB>(|$n| {
                        if $n < C::KW / 8 {
                            static_for::<4>(|$e| $body)
                        }
                    })
                })
            };
        }
        if self.prescale {
            let k0 = first_key();
            each!(|mt, n, e| s[mt][n][e] = self.prescaled(s[mt][n][e], key_of(k0, n, e), &rows[mt][e / 2]));
        }
        let mut has_bad = false;
        static_for::<4>(|i| {
            if i < C::KW.div_ceil(32) {
                has_bad |= unsafe { ld_shared_u32(flags + i as u32 * 4) } != 0;
            }
        });
        if self.mask().crosses(kt, C::KW as u32, (min_pos, max_pos))
            || unsafe { BadBlocks::new(has_bad, flags, kt, self.end.end) }.crosses(kt, C::KW as u32, (min_pos, max_pos))
        {
            let k0 = first_key();
            each!(|mt, n, e| {
                s[mt][n][e] = if self.mask().visible(key_of(k0, n, e), &rows[mt][e / 2]) { s[mt][n][e] } else { f32::NEG_INFINITY };
            });
            if has_bad {
                each!(|mt, n, e| {
                    if unsafe { BadBlocks::new(has_bad, flags, kt, self.end.end) }.hidden(key_of(k0, n, e)) {
                        s[mt][n][e] = f32::NEG_INFINITY;
                    }
                });
            }
        }
        if C::LOCAL && self.local.crosses(kt, C::KW as u32, (min_pos, max_pos)) {
            let k0 = first_key();
            each!(|mt, n, e| {
                if !self.local.visible(key_of(k0, n, e), &rows[mt][e / 2]) {
                    s[mt][n][e] = f32::NEG_INFINITY;
                }
            });
        }
    }
}
