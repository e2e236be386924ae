//! Attention variants as small policy types (as FlashInfer's `variants.cuh`): what a score
//! becomes ([`LogitsPolicy::transform`]), which keys a query row sees
//! ([`LogitsPolicy::visible`]), and which tiles can hide a key at all
//! ([`LogitsPolicy::crosses`]), so that the others are never masked. Each type reads its runtime
//! parameter (a feature it does not have is a no-op), so one kernel serves every combination;
//! [`Chain`] composes them. The logits ([`crate::attention::logits::Logits`]) are a scale,
//! [`SoftCap`] and [`Alibi`], masked by [`KeyEnd`], [`Causal`] and [`SlidingWindow`], and by
//! [`BadBlocks`] (or [`BadSlab`]) where a key's block is outside the cache. A row's [`Sinks`]
//! join its softmax after the last tile.

use crate::attention::work::RowInfo;
use crate::blocks::device::tanh;
use crate::blocks::mma::ld_shared_u32;
use crate::blocks::vec_io::load_f32_nc;
use attn_math::params::AttnParams;
use attn_math::softmax::{OnlineSoftmax, LOG2_E};

/// A piece of an attention variant. Scores and logits are in base-2 units (the softmax takes
/// `2^x`).
pub(crate) trait LogitsPolicy: Copy {
    /// The logit of `row` for `key` from `x` (the score, or the logit of the policies before).
    #[inline(always)]
    fn transform(&self, x: f32, _key: u32, _row: &RowInfo) -> f32 {
        x
    }

    /// Whether `row` sees `key`. Evaluated for every element of a masked tile: combined with
    /// non-short-circuit `&`, a select per element, no branches.
    #[inline(always)]
    fn visible(&self, _key: u32, _row: &RowInfo) -> bool {
        true
    }

    /// Whether keys `kt .. kt + kw` may hide a key from some row at positions
    /// `min_pos..=max_pos`: a tile that cannot is not masked.
    #[inline(always)]
    fn crosses(&self, _kt: u32, _kw: u32, _pos: (u32, u32)) -> bool {
        false
    }
}

/// Two policies in turn: `1` transforms what `0` made of the score; a key is visible to both;
/// a tile crosses a boundary of either.
#[derive(Clone, Copy)]
pub(crate) struct Chain<A, B>(pub A, pub B);

impl<A: LogitsPolicy, B: LogitsPolicy> LogitsPolicy for Chain<A, B> {
    #[inline(always)]
    fn transform(&self, x: f32, key: u32, row: &RowInfo) -> f32 {
        self.1.transform(self.0.transform(x, key, row), key, row)
    }

    #[inline(always)]
    fn visible(&self, key: u32, row: &RowInfo) -> bool {
        self.0.visible(key, row) & self.1.visible(key, row)
    }

    #[inline(always)]
    fn crosses(&self, kt: u32, kw: u32, pos: (u32, u32)) -> bool {
        self.0.crosses(kt, kw, pos) || self.1.crosses(kt, kw, pos)
    }
}

/// Scores times the softmax scale (in base-2 units).
#[derive(Clone, Copy)]
pub(crate) struct Scale(pub f32);

impl LogitsPolicy for Scale {
    #[inline(always)]
    fn transform(&self, x: f32, _: u32, _: &RowInfo) -> f32 {
        x * self.0
    }
}

/// Soft-capping (`p.variant.softcap`, 0: none): `cap * tanh(x / cap)`, on scaled scores.
#[derive(Clone, Copy)]
pub(crate) struct SoftCap {
    /// The cap in base-2 units, and its inverse (0 without a cap).
    log2: f32,
    inv: f32,
}

impl SoftCap {
    #[inline(always)]
    pub fn new(softcap: f32) -> SoftCap {
        SoftCap { log2: softcap * LOG2_E, inv: if softcap > 0.0 { 1.0 / (softcap * LOG2_E) } else { 0.0 } }
    }

    #[inline(always)]
    pub fn on(&self) -> bool {
        self.inv > 0.0
    }
}

impl LogitsPolicy for SoftCap {
    #[inline(always)]
    fn transform(&self, x: f32, _: u32, _: &RowInfo) -> f32 {
        if self.on() {
            self.log2 * tanh(x * self.inv)
        } else {
            x
        }
    }
}

/// ALiBi (`p.per_head.alibi_slopes`): the row's head's slope times the key's distance back
/// from the row.
#[derive(Clone, Copy)]
pub(crate) struct Alibi {
    pub on: bool,
}

impl LogitsPolicy for Alibi {
    #[inline(always)]
    fn transform(&self, x: f32, key: u32, row: &RowInfo) -> f32 {
        if self.on {
            x + row.slope_log2 * (key as f32 - row.pos as f32)
        } else {
            x
        }
    }
}

/// The keys the CTA attends end at `end` (its last key + 1).
#[derive(Clone, Copy)]
pub(crate) struct KeyEnd {
    pub end: u32,
}

impl LogitsPolicy for KeyEnd {
    #[inline(always)]
    fn visible(&self, key: u32, _: &RowInfo) -> bool {
        key < self.end
    }

    #[inline(always)]
    fn crosses(&self, kt: u32, kw: u32, _: (u32, u32)) -> bool {
        kt + kw > self.end
    }
}

/// Causality (`p.mask.causal`): a row sees the keys up to its position.
#[derive(Clone, Copy)]
pub(crate) struct Causal {
    pub on: bool,
}

impl LogitsPolicy for Causal {
    #[inline(always)]
    fn visible(&self, key: u32, row: &RowInfo) -> bool {
        !self.on | (key <= row.pos)
    }

    #[inline(always)]
    fn crosses(&self, kt: u32, kw: u32, (min_pos, _): (u32, u32)) -> bool {
        self.on && kt + kw - 1 > min_pos
    }
}

/// A sliding window (`p.variant.window`, 0: none): a row sees the `window` keys up to its
/// position.
#[derive(Clone, Copy)]
pub(crate) struct SlidingWindow {
    pub window: u32,
}

impl LogitsPolicy for SlidingWindow {
    #[inline(always)]
    fn visible(&self, key: u32, row: &RowInfo) -> bool {
        (self.window == 0) | (key + self.window > row.pos)
    }

    #[inline(always)]
    fn crosses(&self, kt: u32, _: u32, (_, max_pos): (u32, u32)) -> bool {
        self.window > 0 && kt + self.window <= max_pos
    }
}

/// Chunked local attention (`p.local.chunk`, 0: none): a row sees only the keys of its own chunk
/// of `chunk` positions (from `pos - pos % chunk`; causality bounds the other end).
#[derive(Clone, Copy)]
pub(crate) struct ChunkedLocal {
    pub chunk: u32,
}

impl ChunkedLocal {
    /// The first key of the chunk of position `pos` (`on` only).
    #[inline(always)]
    pub fn start(&self, pos: u32) -> u32 {
        pos - pos % self.chunk
    }

    #[inline(always)]
    pub fn on(&self) -> bool {
        self.chunk > 0
    }
}

impl LogitsPolicy for ChunkedLocal {
    #[inline(always)]
    fn visible(&self, key: u32, row: &RowInfo) -> bool {
        !self.on() || key >= self.start(row.pos)
    }

    /// The latest row's chunk starts last: a tile before it hides a key from that row.
    #[inline(always)]
    fn crosses(&self, kt: u32, _: u32, (_, max_pos): (u32, u32)) -> bool {
        self.on() && kt < self.start(max_pos)
    }
}

/// A symmetric window (`p.local.symmetric`: the window plus one, 0: none): a row sees the keys
/// less than `symmetric` positions from its own, on either side (bidirectional encoders).
#[derive(Clone, Copy)]
pub(crate) struct SymmetricWindow {
    pub symmetric: u32,
}

impl LogitsPolicy for SymmetricWindow {
    #[inline(always)]
    fn visible(&self, key: u32, row: &RowInfo) -> bool {
        (self.symmetric == 0) | ((key + self.symmetric > row.pos) & (key < row.pos.saturating_add(self.symmetric)))
    }

    /// Keys too far back from the latest row, or too far ahead of the earliest.
    #[inline(always)]
    fn crosses(&self, kt: u32, kw: u32, (min_pos, max_pos): (u32, u32)) -> bool {
        self.symmetric > 0 && (kt + self.symmetric <= max_pos || kt + kw > min_pos.saturating_add(self.symmetric))
    }
}

/// Keys of a tile whose block is outside the cache: a bit a key in the tile's bad-key masks (a
/// u32 word a 32 keys from key `kt` at `masks`, bit `l` the word's key `l`;
/// `crate::attention::kv::KeyTables`); `any` when the tile has one.
#[derive(Clone, Copy)]
pub(crate) struct BadBlocks {
    any: bool,
    masks: u32,
    kt: u32,
    end: u32,
}

impl BadBlocks {
    /// The tile's keys `kt .. end` have their bits at `masks`, which `visible` reads (the slot
    /// must be filled and published).
    #[inline(always)]
    pub unsafe fn new(any: bool, masks: u32, kt: u32, end: u32) -> BadBlocks {
        BadBlocks { any, masks, kt, end }
    }
}

impl BadBlocks {
    #[inline(always)]
    pub fn hidden(&self, key: u32) -> bool {
        let i = key.wrapping_sub(self.kt);
        key < self.end && (unsafe { ld_shared_u32(self.masks + (i / 32) * 4) } >> (i % 32)) & 1 != 0
    }
}

impl LogitsPolicy for BadBlocks {
    /// A shared-memory load per key: only for tiles that have a bad block.
    #[inline(always)]
    fn visible(&self, key: u32, _: &RowInfo) -> bool {
        !self.hidden(key)
    }

    #[inline(always)]
    fn crosses(&self, _: u32, _: u32, _: (u32, u32)) -> bool {
        self.any
    }
}

/// [`BadBlocks`] for a slab of keys that share one block (`crate::attention::keys_rows`): all
/// of them hidden, or none.
#[derive(Clone, Copy)]
pub(crate) struct BadSlab(pub bool);

impl LogitsPolicy for BadSlab {
    #[inline(always)]
    fn visible(&self, _: u32, _: &RowInfo) -> bool {
        !self.0
    }

    #[inline(always)]
    fn crosses(&self, _: u32, _: u32, _: (u32, u32)) -> bool {
        self.0
    }
}

/// Attention sinks (`p.per_head.sinks`, 0: none): a logit per query head (natural-log units)
/// that joins the softmax's denominator as one more key with no value. Not a per-key policy: it
/// joins a row's state once, when the row is finished (with split-K, when its splits are
/// merged: `crate::merge`).
#[derive(Clone, Copy)]
pub(crate) struct Sinks {
    logits: u64,
}

impl Sinks {
    #[inline(always)]
    pub fn of(p: &AttnParams) -> Sinks {
        Sinks { logits: p.per_head.sinks }
    }

    #[inline(always)]
    pub fn on(&self) -> bool {
        self.logits != 0
    }

    /// Adds `head`'s sink to a finished row's state ([`Self::on`] only); returns the factor the
    /// row's accumulator takes for it.
    #[inline(always)]
    pub unsafe fn fold(&self, st: &mut OnlineSoftmax, head: u32) -> f32 {
        let sink = (unsafe { load_f32_nc(self.logits + head as u64 * 4) }) * LOG2_E;
        st.merge(OnlineSoftmax { max: sink, sum: 1.0 }).0
    }
}
