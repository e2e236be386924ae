//! Shapes of the tensors the ops take: source rows and the paged KV-cache layouts.
//!
//! Each cache layout knows its tensor shape, the element strides of K and V (block, token in
//! block, head; the head dimension is contiguous) and the element address of
//! (K or V, block, token, head, dim). Kernels get the same numbers through
//! [`attn_math::paging::CacheStrides`].

use crate::error::{ensure, AttnError, Result};
use attn_math::paging::CacheStrides;

/// `[num_tokens, num_heads, head_size]` rows with arbitrary token and head strides (in elements),
/// e.g. K as a slice of a fused QKV projection. The head dimension is contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowsDesc {
    /// Rows (tokens) of the tensor.
    pub num_tokens: usize,
    /// Heads per token.
    pub num_heads: usize,
    /// Elements per head (contiguous).
    pub head_size: usize,
    /// Elements from one token's first element to the next token's.
    pub token_stride: usize,
    /// Elements from one head's first element to the next head's, within a token.
    pub head_stride: usize,
}

impl RowsDesc {
    /// Densely packed rows.
    pub fn contiguous(num_tokens: usize, num_heads: usize, head_size: usize) -> Self {
        // Saturating: rows too large for a usize are refused by `validate` (and by every op).
        RowsDesc { num_tokens, num_heads, head_size, token_stride: num_heads.saturating_mul(head_size), head_stride: head_size }
    }

    /// Elements a buffer must hold for every addressed element to be inside it, or `None` when
    /// that does not fit in a `usize` (no buffer can hold such rows).
    pub fn checked_required_len(&self) -> Option<usize> {
        if self.num_tokens == 0 || self.num_heads == 0 || self.head_size == 0 {
            return Some(0);
        }
        let tokens = (self.num_tokens - 1).checked_mul(self.token_stride)?;
        let heads = (self.num_heads - 1).checked_mul(self.head_stride)?;
        tokens.checked_add(heads)?.checked_add(self.head_size)
    }

    /// [`checked_required_len`](Self::checked_required_len), saturating at `usize::MAX` when it
    /// overflows, so that a length check against it refuses the rows instead of passing a
    /// wrapped size.
    pub fn required_len(&self) -> usize {
        self.checked_required_len().unwrap_or(usize::MAX)
    }

    /// Element offset of (token, head, dim): exact for an element of rows that pass
    /// [`validate`](Self::validate), saturating (never wrapping) otherwise.
    pub fn offset(&self, token: usize, head: usize, dim: usize) -> usize {
        token.saturating_mul(self.token_stride).saturating_add(head.saturating_mul(self.head_stride)).saturating_add(dim)
    }

    /// Refuses rows whose heads overlap (a write from them would be ambiguous), and rows whose
    /// size (the elements they span, or tokens x heads) does not fit in a `usize`. `arg` names
    /// the tensor in the error.
    pub fn validate(&self, arg: &'static str) -> Result<()> {
        ensure(self.head_stride >= self.head_size || self.num_heads <= 1, arg, || {
            format!("head_stride {} is smaller than head_size {}", self.head_stride, self.head_size)
        })?;
        // One token's heads span this many elements (`None`: more than a usize holds).
        let token_span = (self.num_heads.saturating_sub(1)).checked_mul(self.head_stride).and_then(|h| h.checked_add(self.head_size));
        ensure(self.num_tokens <= 1 || token_span.is_some_and(|span| self.token_stride >= span), arg, || {
            format!("token_stride {} overlaps the previous token's {} heads", self.token_stride, self.num_heads)
        })?;
        let rows = self.num_tokens.checked_mul(self.num_heads);
        ensure(self.checked_required_len().is_some() && rows.is_some(), arg, || {
            format!(
                "{} tokens x {} heads of {} with strides ({}, {}) span more elements than a usize holds",
                self.num_tokens, self.num_heads, self.head_size, self.token_stride, self.head_stride
            )
        })
    }
}

/// The physical layouts of a paged K/V cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvLayout {
    /// vLLM FlashAttention: `[2, num_blocks, block_size, num_kv_heads, head_size]`.
    FlashNhd,
    /// vLLM FlashAttention, heads before tokens: `[2, num_blocks, num_kv_heads, block_size, head_size]`.
    FlashHnd,
    /// FlashInfer: `[num_blocks, 2, block_size, num_kv_heads, head_size]`.
    FlashInferNhd,
    /// FlashInfer, heads before tokens: `[num_blocks, 2, num_kv_heads, block_size, head_size]`.
    FlashInferHnd,
}

impl KvLayout {
    /// Every layout, in declaration order.
    pub const ALL: [KvLayout; 4] = [KvLayout::FlashNhd, KvLayout::FlashHnd, KvLayout::FlashInferNhd, KvLayout::FlashInferHnd];

    /// Whether tokens of a block are contiguous per head (HND) rather than heads per token (NHD).
    pub fn heads_before_tokens(self) -> bool {
        matches!(self, KvLayout::FlashHnd | KvLayout::FlashInferHnd)
    }
}

/// A paged K/V cache: its layout and sizes (the dtype comes with the buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheSpec {
    /// Where K and V and the tokens and heads of a block lie.
    pub layout: KvLayout,
    /// Blocks in the cache (each holds `block_size` tokens of K and of V).
    pub num_blocks: usize,
    /// Tokens per block (the paging granularity; slot = block * block_size + offset).
    pub block_size: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_size: usize,
}

impl KvCacheSpec {
    /// A checked spec: every size positive and every size derived from them (elements, slots,
    /// strides) representable (see [`validate`](Self::validate)).
    pub fn new(layout: KvLayout, num_blocks: usize, block_size: usize, num_kv_heads: usize, head_size: usize) -> Result<Self> {
        let spec = KvCacheSpec { layout, num_blocks, block_size, num_kv_heads, head_size };
        spec.check().map_err(|(field, reason)| AttnError::invalid(field, reason))?;
        Ok(spec)
    }

    /// What [`new`](Self::new) checks, for a spec built field by field (the fields are public):
    /// positive sizes, a block size, heads and head size that fit the kernels' u32 parameters,
    /// at most `u32::MAX` blocks, and a cache whose elements (K and V) and slots fit in a
    /// `usize`, so that [`num_elements`](Self::num_elements), [`num_slots`](Self::num_slots),
    /// [`kv_origins`](Self::kv_origins) and [`strides`](Self::strides) are exact. Every op that
    /// takes a spec calls it before using the sizes. The error names `arg` (the op's argument)
    /// and, in its reason, the field and its value.
    pub fn validate(&self, arg: &'static str) -> Result<()> {
        self.check().map_err(|(field, reason)| AttnError::invalid(arg, format!("{field} {reason}")))
    }

    /// The first field [`validate`](Self::validate) refuses, with why.
    fn check(&self) -> std::result::Result<(), (&'static str, String)> {
        let (n, b, h, d) = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_size);
        let max = u32::MAX as usize;
        let range = |field, v: usize| if v > 0 && v <= max { Ok(()) } else { Err((field, format!("{v} is out of range 1..={max}"))) };
        range("num_blocks", n)?;
        range("block_size", b)?;
        range("num_kv_heads", h)?;
        range("head_size", d)?;
        match self.checked_num_elements() {
            Some(_) => Ok(()),
            None => Err(("num_blocks", format!("{n} blocks of {b} tokens x {h} heads x {d} (K and V) exceed a usize of elements"))),
        }
    }

    /// Elements in the whole cache (K and V), or `None` when they do not fit in a `usize`.
    pub fn checked_num_elements(&self) -> Option<usize> {
        let shape = self.shape();
        if shape.contains(&0) {
            return Some(0);
        }
        shape.iter().try_fold(1usize, |acc, &x| acc.checked_mul(x))
    }

    /// The tensor shape, outermost first.
    pub fn shape(&self) -> [usize; 5] {
        let (n, b, h, d) = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_size);
        match self.layout {
            KvLayout::FlashNhd => [2, n, b, h, d],
            KvLayout::FlashHnd => [2, n, h, b, d],
            KvLayout::FlashInferNhd => [n, 2, b, h, d],
            KvLayout::FlashInferHnd => [n, 2, h, b, d],
        }
    }

    /// Elements in the whole cache (K and V). Exact for a spec that passes
    /// [`validate`](Self::validate); saturates at `usize::MAX` otherwise, so that no buffer
    /// passes a length check against an unvalidated spec whose size overflows.
    pub fn num_elements(&self) -> usize {
        self.checked_num_elements().unwrap_or(usize::MAX)
    }

    /// Token slots: `num_blocks * block_size` (exact for a valid spec, else saturating).
    pub fn num_slots(&self) -> usize {
        self.num_blocks.saturating_mul(self.block_size)
    }

    /// Element offsets of the K and V planes' origins (exact for a valid spec, else saturating).
    pub fn kv_origins(&self) -> (usize, usize) {
        let per_block = self.block_size.saturating_mul(self.num_kv_heads).saturating_mul(self.head_size);
        match self.layout {
            KvLayout::FlashNhd | KvLayout::FlashHnd => (0, self.num_blocks.saturating_mul(per_block)),
            KvLayout::FlashInferNhd | KvLayout::FlashInferHnd => (0, per_block),
        }
    }

    /// Element strides (block, token, head) shared by K and V (exact for a valid spec, else
    /// saturating).
    pub fn strides(&self) -> CacheStrides {
        let (b, h, d) = (self.block_size as u64, self.num_kv_heads as u64, self.head_size as u64);
        let per_block = b.saturating_mul(h).saturating_mul(d);
        let block = match self.layout {
            KvLayout::FlashNhd | KvLayout::FlashHnd => per_block,
            KvLayout::FlashInferNhd | KvLayout::FlashInferHnd => per_block.saturating_mul(2),
        };
        if self.layout.heads_before_tokens() {
            CacheStrides { block, token: d, head: b.saturating_mul(d) }
        } else {
            CacheStrides { block, token: h.saturating_mul(d), head: d }
        }
    }

    /// Element offset of (plane: 0 = K, 1 = V; block; token in block; head; dim): exact for an
    /// element of a valid spec, saturating (never wrapping) otherwise.
    pub fn offset(&self, plane: usize, block: usize, token: usize, head: usize, dim: usize) -> usize {
        let origin = if plane == 0 { self.kv_origins().0 } else { self.kv_origins().1 };
        origin.saturating_add(saturating_offset(&self.strides(), block, token, head, dim))
    }
}

/// The MLA latent cache `[num_blocks, block_size, latent_dim + rope_dim]` (DeepSeek: 512 + 64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaCacheSpec {
    /// Blocks in the cache.
    pub num_blocks: usize,
    /// Tokens (rows) per block.
    pub block_size: usize,
    /// Width of the compressed KV part of a row (DeepSeek: 512); it is also the value.
    pub latent_dim: usize,
    /// Width of the rope key part after it (DeepSeek: 64; may be 0).
    pub rope_dim: usize,
}

impl MlaCacheSpec {
    /// DeepSeek-V2/V3's `kv_lora_rank`: the latent width.
    pub const DEEPSEEK_LATENT: usize = 512;
    /// DeepSeek-V2/V3's `qk_rope_head_dim`: the rope width.
    pub const DEEPSEEK_ROPE: usize = 64;

    /// A checked spec (see [`validate`](Self::validate)).
    pub fn new(num_blocks: usize, block_size: usize, latent_dim: usize, rope_dim: usize) -> Result<Self> {
        let spec = MlaCacheSpec { num_blocks, block_size, latent_dim, rope_dim };
        spec.check().map_err(|(field, reason)| AttnError::invalid(field, reason))?;
        Ok(spec)
    }

    /// What [`new`](Self::new) checks, for a spec built field by field: positive sizes (the
    /// rope part may be empty), block size and row width that fit the kernels' u32 parameters,
    /// at most `u32::MAX` blocks, and a cache whose elements and slots fit in a `usize`. Every
    /// op that takes a spec calls it before using the sizes. The error names `arg` (the op's
    /// argument) and, in its reason, the field and its value.
    pub fn validate(&self, arg: &'static str) -> Result<()> {
        self.check().map_err(|(field, reason)| AttnError::invalid(arg, format!("{field} {reason}")))
    }

    /// The first field [`validate`](Self::validate) refuses, with why.
    fn check(&self) -> std::result::Result<(), (&'static str, String)> {
        let (n, b) = (self.num_blocks, self.block_size);
        let max = u32::MAX as usize;
        let range = |field, v: usize| if v > 0 && v <= max { Ok(()) } else { Err((field, format!("{v} is out of range 1..={max}"))) };
        range("num_blocks", n)?;
        range("block_size", b)?;
        if self.latent_dim == 0 {
            return Err(("latent_dim", "must be positive".into()));
        }
        if self.latent_dim.checked_add(self.rope_dim).is_none_or(|w| w > max) {
            return Err(("rope_dim", format!("{}: latent_dim {} + rope_dim is out of range", self.rope_dim, self.latent_dim)));
        }
        match self.checked_num_elements() {
            Some(_) => Ok(()),
            None => Err(("num_blocks", format!("{n} blocks of {b} rows of {} exceed a usize of elements", self.row_width()))),
        }
    }

    /// Elements in the cache, or `None` when they do not fit in a `usize`.
    pub fn checked_num_elements(&self) -> Option<usize> {
        let width = self.latent_dim.checked_add(self.rope_dim)?;
        if self.num_blocks == 0 || self.block_size == 0 || width == 0 {
            return Some(0);
        }
        self.num_blocks.checked_mul(self.block_size)?.checked_mul(width)
    }

    /// DeepSeek-V2/V3's 512 + 64.
    pub fn deepseek(num_blocks: usize, block_size: usize) -> Result<Self> {
        Self::new(num_blocks, block_size, Self::DEEPSEEK_LATENT, Self::DEEPSEEK_ROPE)
    }

    /// `latent_dim + rope_dim` (saturating for an invalid spec).
    pub fn row_width(&self) -> usize {
        self.latent_dim.saturating_add(self.rope_dim)
    }

    /// The tensor shape `[num_blocks, block_size, latent_dim + rope_dim]`.
    pub fn shape(&self) -> [usize; 3] {
        [self.num_blocks, self.block_size, self.row_width()]
    }

    /// Elements in the cache: exact for a spec that passes [`validate`](Self::validate),
    /// saturating at `usize::MAX` otherwise (no buffer passes a length check against it).
    pub fn num_elements(&self) -> usize {
        self.checked_num_elements().unwrap_or(usize::MAX)
    }

    /// Token slots: `num_blocks * block_size` (exact for a valid spec, else saturating).
    pub fn num_slots(&self) -> usize {
        self.num_blocks.saturating_mul(self.block_size)
    }

    /// Element strides (block, token; the head stride is 0: one latent row per token),
    /// saturating for an invalid spec.
    pub fn strides(&self) -> CacheStrides {
        let w = self.row_width() as u64;
        CacheStrides { block: (self.block_size as u64).saturating_mul(w), token: w, head: 0 }
    }

    /// Element offset of (block, token in block, column): exact for an element of a valid spec,
    /// saturating (never wrapping) otherwise.
    pub fn offset(&self, block: usize, token: usize, col: usize) -> usize {
        saturating_offset(&self.strides(), block, token, 0, col)
    }
}

/// `CacheStrides::offset` without wrapping: saturates at `usize::MAX`.
fn saturating_offset(s: &CacheStrides, block: usize, token: usize, head: usize, dim: usize) -> usize {
    let at = (block as u64)
        .saturating_mul(s.block)
        .saturating_add((token as u64).saturating_mul(s.token))
        .saturating_add((head as u64).saturating_mul(s.head))
        .saturating_add(dim as u64);
    usize::try_from(at).unwrap_or(usize::MAX)
}
