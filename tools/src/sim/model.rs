//! The models the simulator plays: their attention configuration and layer count.

use attn_rs::backend::ModelConfig;
use attn_rs::DType;
use attn_rs::KvLayout;

/// A model's attention, as the simulated engine runs it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimModel {
    pub name: &'static str,
    pub config: ModelConfig,
    pub num_layers: usize,
    pub softmax_scale: f32,
}

impl SimModel {
    /// Llama-3-8B: 32 query heads over 8 kv heads of 128, 32 layers, blocks of 16.
    pub fn llama3_8b(dtype: DType) -> Self {
        let config = ModelConfig::standard(32, 8, 128, dtype, 16, KvLayout::FlashNhd);
        SimModel { name: "llama-3-8b-like", config, num_layers: 32, softmax_scale: 1.0 / (128f32).sqrt() }
    }

    /// DeepSeek-V2-Lite: MLA with 16 heads over one latent of 512 + 64 rope, 27 layers, blocks
    /// of 64; the softmax scale of its 128 + 64 query/key head.
    pub fn deepseek_v2_lite(dtype: DType) -> Self {
        let config = ModelConfig::mla(16, dtype, 64);
        SimModel { name: "deepseek-v2-lite-like (MLA)", config, num_layers: 27, softmax_scale: 1.0 / (192f32).sqrt() }
    }

    /// A small standard-attention model for tests: 4 query heads over 2 kv heads of 64.
    pub fn tiny(dtype: DType) -> Self {
        let config = ModelConfig::standard(4, 2, 64, dtype, 16, KvLayout::FlashNhd);
        SimModel { name: "tiny", config, num_layers: 2, softmax_scale: 0.125 }
    }

    /// A small MLA model for tests: 2 heads over the 512 + 64 latent, blocks of 16.
    pub fn tiny_mla(dtype: DType) -> Self {
        let config = ModelConfig::mla(2, dtype, 16);
        SimModel { name: "tiny-mla", config, num_layers: 2, softmax_scale: 1.0 / (192f32).sqrt() }
    }

    pub fn with_layers(self, num_layers: usize) -> Self {
        SimModel { num_layers, ..self }
    }

    pub fn is_mla(&self) -> bool {
        self.config.kind == attn_rs::backend::AttentionKind::Mla
    }

    /// Columns of one token's row of the simulated projection output:
    /// `[q heads | k heads | v heads]`, or `[q heads | kv_c | k_pe]` for MLA.
    pub fn row_layout(&self) -> RowLayout {
        let c = &self.config;
        let q = c.num_q_heads * c.head_size;
        if self.is_mla() {
            let rope = attn_rs::MlaCacheSpec::DEEPSEEK_ROPE;
            let latent = c.head_size - rope;
            RowLayout { q: 0, k: q, v: q + latent, width: q + c.head_size }
        } else {
            let kv = c.num_kv_heads * c.head_size;
            RowLayout { q: 0, k: q, v: q + kv, width: q + 2 * kv }
        }
    }
}

/// Where q, k and v (MLA: q, kv_c and k_pe) start in a token's row, and the row's width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLayout {
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub width: usize,
}
