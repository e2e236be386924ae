//! What one layer's [`forward`](super::Attention::forward) takes: this step's queries and new
//! keys/values, the layer's cache and the output, on the device ([`GpuLayer`]) or in host memory
//! for the CPU backend ([`CpuLayer`]).

use super::host_buf::{HostIn, HostOut};
use crate::buffer::{DevIn, DevOut};
use crate::layout::{KvCacheSpec, MlaCacheSpec, RowsDesc};

/// This step's new keys and values, one row per token.
pub enum NewKv<I> {
    /// None: a layer that reads an earlier layer's cache and writes nothing
    /// ([`LayerSpec::kv_sharing_target`](super::LayerSpec::kv_sharing_target)).
    None,
    /// Standard attention: `[num_tokens, num_kv_heads, head_size]` K and V (any token/head
    /// stride, e.g. slices of a fused QKV projection).
    Standard {
        /// The keys.
        k: I,
        /// Shape and strides of `k`.
        k_rows: RowsDesc,
        /// The values.
        v: I,
        /// Shape and strides of `v`.
        v_rows: RowsDesc,
    },
    /// MLA: the compressed latent `kv_c` `[num_tokens, latent_dim]` and the rope key `k_pe`
    /// `[num_tokens, rope_dim]`, rows `*_token_stride` elements apart.
    Mla {
        /// The compressed latent.
        kv_c: I,
        /// Elements between consecutive tokens of `kv_c`.
        kv_c_token_stride: usize,
        /// The rope key.
        k_pe: I,
        /// Elements between consecutive tokens of `k_pe`.
        k_pe_token_stride: usize,
    },
}

/// One layer's tensors. `I` is what the backend reads, `O` what it writes.
///
/// Rows past the step's `num_actual_tokens` (padding) are neither written to the cache nor
/// attended, and their output rows are left as they are.
pub struct Layer<I, O> {
    /// `[num_tokens, num_q_heads, head_size]` (MLA: the absorbed query, `latent_dim + rope_dim`
    /// wide), the model's query dtype.
    pub q: I,
    /// Shape and strides of `q` (`num_tokens` at least the step's `num_actual_tokens`).
    pub q_rows: RowsDesc,
    /// This step's keys and values (the query dtype), written into `cache` at the step's slots
    /// (an encoder-only layer attends them and writes nothing; a KV-sharing layer has none).
    pub new_kv: NewKv<I>,
    /// The layer's paged cache ([`CacheSpec`] of the [`Attention`](super::Attention)); for a
    /// KV-sharing layer, the cache buffer its target layer was given (read, not written); for
    /// an encoder-only layer, not used (any buffer, an empty one included).
    pub cache: O,
    /// `[num_tokens, num_q_heads, v_head_size]`, the query dtype (MLA: `v_head_size` is
    /// `latent_dim`).
    pub out: O,
    /// Shape and strides of `out`.
    pub out_rows: RowsDesc,
    /// `[num_q_heads]` f32 ALiBi slopes: given exactly when the model config declares ALiBi.
    pub alibi_slopes: Option<I>,
    /// `[num_q_heads]` f32 attention-sink logits: given exactly when the model declares sinks.
    pub sinks: Option<I>,
    /// `[1]` f32 each: the K and V scales of an FP8 cache (stored = value / scale, vLLM's
    /// `k_scale`/`v_scale`); given exactly when the cache is FP8. MLA: its one scale, as both.
    pub kv_scales: Option<(I, I)>,
}

/// A layer on the GPU (the `tensor-core` backend).
pub type GpuLayer<'a> = Layer<DevIn<'a>, DevOut<'a>>;
/// A layer in host memory (the `cpu` backend).
pub type CpuLayer<'a> = Layer<HostIn<'a>, HostOut<'a>>;

/// A layer's tensors where the chosen backend runs.
// Made and consumed once per layer call: boxing the larger (GPU) variant would allocate on
// every call to save a few hundred bytes of stack.
#[allow(clippy::large_enum_variant)]
pub enum LayerIo<'a> {
    /// Device buffers, for the `tensor-core` and `mla` backends.
    Gpu(GpuLayer<'a>),
    /// Host slices, for the `cpu` backend.
    Cpu(CpuLayer<'a>),
}

impl LayerIo<'_> {
    /// `"GPU"` or `"host"`: where the tensors live, for messages.
    pub fn location(&self) -> &'static str {
        match self {
            LayerIo::Gpu(_) => "GPU",
            LayerIo::Cpu(_) => "host",
        }
    }
}

/// A layer's new keys and values and the cache they go into, for
/// [`Attention::write_kv`](super::Attention::write_kv) (a cross-attention layer's own cache,
/// filled from the encoder's output once per request).
pub struct KvCacheWrite<I, O> {
    /// The step's keys and values, one row per token (`NewKv::Standard`).
    pub new_kv: NewKv<I>,
    /// The layer's paged cache.
    pub cache: O,
    /// The K and V scales of an FP8 cache (as [`Layer::kv_scales`]).
    pub kv_scales: Option<(I, I)>,
}

/// A cache write where the chosen backend runs.
pub enum KvWriteIo<'a> {
    /// Device buffers, for the GPU backends.
    Gpu(KvCacheWrite<DevIn<'a>, DevOut<'a>>),
    /// Host slices, for the `cpu` backend.
    Cpu(KvCacheWrite<HostIn<'a>, HostOut<'a>>),
}

/// The layout of every layer's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheSpec {
    /// Standard attention: K and V planes.
    Paged(KvCacheSpec),
    /// MLA: one latent row per token, `[num_blocks, block_size, latent_dim + rope_dim]`.
    Mla(MlaCacheSpec),
}

impl CacheSpec {
    /// Elements one layer's cache holds.
    pub fn num_elements(&self) -> usize {
        match self {
            CacheSpec::Paged(s) => s.num_elements(),
            CacheSpec::Mla(s) => s.num_elements(),
        }
    }

    /// Blocks in each layer's cache.
    pub fn num_blocks(&self) -> usize {
        match self {
            CacheSpec::Paged(s) => s.num_blocks,
            CacheSpec::Mla(s) => s.num_blocks,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        match self {
            CacheSpec::Paged(s) => s.block_size,
            CacheSpec::Mla(s) => s.block_size,
        }
    }

    /// Width of a query/key row: `head_size`, or `latent_dim + rope_dim` for MLA.
    pub fn qk_head_size(&self) -> usize {
        match self {
            CacheSpec::Paged(s) => s.head_size,
            CacheSpec::Mla(s) => s.row_width(),
        }
    }

    /// Width of a value/output row: `head_size`, or `latent_dim` for MLA.
    pub fn v_head_size(&self) -> usize {
        match self {
            CacheSpec::Paged(s) => s.head_size,
            CacheSpec::Mla(s) => s.latent_dim,
        }
    }

    /// Key/value heads (1 for MLA's latent).
    pub fn num_kv_heads(&self) -> usize {
        match self {
            CacheSpec::Paged(s) => s.num_kv_heads,
            CacheSpec::Mla(_) => 1,
        }
    }
}
