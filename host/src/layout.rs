//! Shapes of the tensors the ops take: source rows and the paged KV-cache layouts.
//!
//! Each cache layout knows its tensor shape, the element strides of K and V (block, token in
//! block, head; the head dimension is contiguous) and the element address of
//! (K or V, block, token, head, dim). Kernels get the same numbers through
//! [`attn_math::paging::CacheStrides`].

use crate::error::{ensure, Result};
use attn_math::paging::CacheStrides;

/// `[num_tokens, num_heads, head_size]` rows with arbitrary token and head strides (in elements),
/// e.g. K as a slice of a fused QKV projection. The head dimension is contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowsDesc {
    pub num_tokens: usize,
    pub num_heads: usize,
    pub head_size: usize,
    pub token_stride: usize,
    pub head_stride: usize,
}

impl RowsDesc {
    /// Densely packed rows.
    pub fn contiguous(num_tokens: usize, num_heads: usize, head_size: usize) -> Self {
        RowsDesc { num_tokens, num_heads, head_size, token_stride: num_heads * head_size, head_stride: head_size }
    }

    /// Elements a buffer must hold for every addressed element to be inside it.
    pub fn required_len(&self) -> usize {
        if self.num_tokens == 0 || self.num_heads == 0 || self.head_size == 0 {
            return 0;
        }
        (self.num_tokens - 1) * self.token_stride + (self.num_heads - 1) * self.head_stride + self.head_size
    }

    /// Element offset of (token, head, dim).
    pub fn offset(&self, token: usize, head: usize, dim: usize) -> usize {
        token * self.token_stride + head * self.head_stride + dim
    }

    /// Refuses rows whose heads overlap (a write from them would be ambiguous) or whose shape is
    /// not what `arg` must have.
    pub(crate) fn validate(&self, arg: &'static str) -> Result<()> {
        ensure(self.head_stride >= self.head_size || self.num_heads <= 1, arg, || {
            format!("head_stride {} is smaller than head_size {}", self.head_stride, self.head_size)
        })?;
        ensure(
            self.token_stride >= self.num_heads.saturating_sub(1) * self.head_stride + self.head_size || self.num_tokens <= 1,
            arg,
            || format!("token_stride {} overlaps the previous token's {} heads", self.token_stride, self.num_heads),
        )
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
    pub const ALL: [KvLayout; 4] = [KvLayout::FlashNhd, KvLayout::FlashHnd, KvLayout::FlashInferNhd, KvLayout::FlashInferHnd];

    /// Whether tokens of a block are contiguous per head (HND) rather than heads per token (NHD).
    pub fn heads_before_tokens(self) -> bool {
        matches!(self, KvLayout::FlashHnd | KvLayout::FlashInferHnd)
    }
}

/// A paged K/V cache: its layout and sizes (the dtype comes with the buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheSpec {
    pub layout: KvLayout,
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_size: usize,
}

impl KvCacheSpec {
    pub fn new(layout: KvLayout, num_blocks: usize, block_size: usize, num_kv_heads: usize, head_size: usize) -> Result<Self> {
        ensure(num_blocks > 0, "num_blocks", || "must be positive".into())?;
        ensure(block_size > 0 && block_size <= u32::MAX as usize, "block_size", || format!("{block_size} is out of range"))?;
        ensure(num_kv_heads > 0, "num_kv_heads", || "must be positive".into())?;
        ensure(head_size > 0, "head_size", || "must be positive".into())?;
        Ok(KvCacheSpec { layout, num_blocks, block_size, num_kv_heads, head_size })
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

    /// Elements in the whole cache (K and V).
    pub fn num_elements(&self) -> usize {
        self.shape().iter().product()
    }

    /// Token slots: `num_blocks * block_size`.
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Element offsets of the K and V planes' origins.
    pub fn kv_origins(&self) -> (usize, usize) {
        let per_block = self.block_size * self.num_kv_heads * self.head_size;
        match self.layout {
            KvLayout::FlashNhd | KvLayout::FlashHnd => (0, self.num_blocks * per_block),
            KvLayout::FlashInferNhd | KvLayout::FlashInferHnd => (0, per_block),
        }
    }

    /// Element strides (block, token, head) shared by K and V.
    pub fn strides(&self) -> CacheStrides {
        let (b, h, d) = (self.block_size as u64, self.num_kv_heads as u64, self.head_size as u64);
        let block = match self.layout {
            KvLayout::FlashNhd | KvLayout::FlashHnd => b * h * d,
            KvLayout::FlashInferNhd | KvLayout::FlashInferHnd => 2 * b * h * d,
        };
        if self.layout.heads_before_tokens() {
            CacheStrides { block, token: d, head: b * d }
        } else {
            CacheStrides { block, token: h * d, head: d }
        }
    }

    /// Element offset of (plane: 0 = K, 1 = V; block; token in block; head; dim).
    pub fn offset(&self, plane: usize, block: usize, token: usize, head: usize, dim: usize) -> usize {
        let origin = if plane == 0 { self.kv_origins().0 } else { self.kv_origins().1 };
        origin + self.strides().offset(block as u64, token as u64, head as u64, dim as u64) as usize
    }
}

/// The MLA latent cache `[num_blocks, block_size, latent_dim + rope_dim]` (DeepSeek: 512 + 64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaCacheSpec {
    pub num_blocks: usize,
    pub block_size: usize,
    pub latent_dim: usize,
    pub rope_dim: usize,
}

impl MlaCacheSpec {
    pub const DEEPSEEK_LATENT: usize = 512;
    pub const DEEPSEEK_ROPE: usize = 64;

    pub fn new(num_blocks: usize, block_size: usize, latent_dim: usize, rope_dim: usize) -> Result<Self> {
        ensure(num_blocks > 0, "num_blocks", || "must be positive".into())?;
        ensure(block_size > 0 && block_size <= u32::MAX as usize, "block_size", || format!("{block_size} is out of range"))?;
        ensure(latent_dim > 0, "latent_dim", || "must be positive".into())?;
        Ok(MlaCacheSpec { num_blocks, block_size, latent_dim, rope_dim })
    }

    /// DeepSeek-V2/V3's 512 + 64.
    pub fn deepseek(num_blocks: usize, block_size: usize) -> Result<Self> {
        Self::new(num_blocks, block_size, Self::DEEPSEEK_LATENT, Self::DEEPSEEK_ROPE)
    }

    pub fn row_width(&self) -> usize {
        self.latent_dim + self.rope_dim
    }

    pub fn shape(&self) -> [usize; 3] {
        [self.num_blocks, self.block_size, self.row_width()]
    }

    pub fn num_elements(&self) -> usize {
        self.shape().iter().product()
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    pub fn strides(&self) -> CacheStrides {
        let w = self.row_width() as u64;
        CacheStrides { block: self.block_size as u64 * w, token: w, head: 0 }
    }

    /// Element offset of (block, token in block, column).
    pub fn offset(&self, block: usize, token: usize, col: usize) -> usize {
        self.strides().offset(block as u64, token as u64, 0, col as u64) as usize
    }
}
