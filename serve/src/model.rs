//! The Llama forward on candle ops, one step of a mixed batch at a time: quantized matmuls
//! (`QMatMul`) on the GGUF's tensors, RMSNorm, interleaved RoPE at each token's own position
//! (the GGUF's theta), a SiLU-gated MLP, tied embeddings when the file has no `output.weight`,
//! and attention through [`PagedAttention`] (the paged caches of attn-rs).

use crate::error::Result;
use crate::gguf::{Gguf, LlamaConfig};
use crate::glue::PagedAttention;
use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::ops::rms_norm;
use candle_nn::rotary_emb::rope_i;

struct Block {
    attn_norm: Tensor,
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    ffn_norm: Tensor,
    gate: QMatMul,
    up: QMatMul,
    down: QMatMul,
}

pub struct Llama {
    pub cfg: LlamaConfig,
    device: Device,
    /// `[vocab, hidden]` f32 (dequantized once, as the rows are gathered every step).
    embed: Tensor,
    blocks: Vec<Block>,
    norm: Tensor,
    lm_head: QMatMul,
    /// `[positions, head_dim / 2]`: the rotation angles' cosines and sines.
    cos: Tensor,
    sin: Tensor,
}

/// One step's tokens, in batch order (decodes first).
pub struct StepTokens<'a> {
    pub tokens: &'a [u32],
    /// Each token's position in its sequence.
    pub positions: &'a [u32],
    /// The rows whose logits the step returns (the last token of each request that samples).
    pub logit_rows: &'a [u32],
}

impl Llama {
    /// The weights of `g` on `device`.
    pub fn load(g: &mut Gguf, device: &Device) -> Result<Self> {
        let cfg = LlamaConfig::from_gguf(g)?;
        let head = if g.has_tensor("output.weight") { "output.weight" } else { "token_embd.weight" };
        let mut qmm = |name: &str| -> Result<QMatMul> { Ok(QMatMul::from_qtensor(g.tensor(name, device)?)?) };
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("blk.{l}");
            blocks.push(Block {
                attn_norm: Tensor::new(0f32, device)?,
                wq: qmm(&format!("{p}.attn_q.weight"))?,
                wk: qmm(&format!("{p}.attn_k.weight"))?,
                wv: qmm(&format!("{p}.attn_v.weight"))?,
                wo: qmm(&format!("{p}.attn_output.weight"))?,
                ffn_norm: Tensor::new(0f32, device)?,
                gate: qmm(&format!("{p}.ffn_gate.weight"))?,
                up: qmm(&format!("{p}.ffn_up.weight"))?,
                down: qmm(&format!("{p}.ffn_down.weight"))?,
            });
        }
        let lm_head = qmm(head)?;
        let mut dense = |name: &str| -> Result<Tensor> { Ok(g.tensor(name, device)?.dequantize(device)?) };
        for (l, b) in blocks.iter_mut().enumerate() {
            b.attn_norm = dense(&format!("blk.{l}.attn_norm.weight"))?;
            b.ffn_norm = dense(&format!("blk.{l}.ffn_norm.weight"))?;
        }
        let embed = dense("token_embd.weight")?;
        let norm = dense("output_norm.weight")?;
        let (cos, sin) = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.context_len, device)?;
        Ok(Llama { cfg, device: device.clone(), embed, blocks, norm, lm_head, cos, sin })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// One step: every token through every layer (attention over the paged caches, the step's
    /// metadata already built in `attn`), then the logits of `step.logit_rows`, `[rows, vocab]`
    /// f32 (`None` for a step of prompt chunks only, none of them the last).
    pub fn forward(&self, step: &StepTokens<'_>, attn: &mut PagedAttention) -> Result<Option<Tensor>> {
        let c = &self.cfg;
        let (t, eps) = (step.tokens.len(), c.rms_eps as f32);
        let dev = &self.device;
        let mut x = self.embed.index_select(&Tensor::new(step.tokens, dev)?, 0)?;
        // Each token's own angles, as a batch of one-token sequences: `[t, 1, head_dim / 2]`.
        let pos = Tensor::new(step.positions, dev)?;
        let cos = self.cos.index_select(&pos, 0)?.reshape((t, 1, c.head_dim / 2))?;
        let sin = self.sin.index_select(&pos, 0)?.reshape((t, 1, c.head_dim / 2))?;
        let rope = |x: Tensor, heads: usize| -> Result<Tensor> {
            // `[t, heads, 1, head_dim]`: one batch entry per token.
            Ok(rope_i(&x.reshape((t, heads, 1, c.head_dim))?, &cos, &sin)?.reshape((t, heads, c.head_dim))?)
        };
        for (l, b) in self.blocks.iter().enumerate() {
            let h = rms_norm(&x, &b.attn_norm, eps)?;
            let q = rope(b.wq.forward(&h)?, c.num_heads)?;
            let k = rope(b.wk.forward(&h)?, c.num_kv_heads)?;
            let v = b.wv.forward(&h)?.reshape((t, c.num_kv_heads, c.head_dim))?;
            let a = attn.forward(l, &q, &k, &v)?;
            x = (b.wo.forward(&a)? + x)?;
            let h = rms_norm(&x, &b.ffn_norm, eps)?;
            let m = (candle_nn::ops::silu(&b.gate.forward(&h)?)? * b.up.forward(&h)?)?;
            x = (b.down.forward(&m)? + x)?;
        }
        if step.logit_rows.is_empty() {
            return Ok(None);
        }
        let rows = Tensor::new(step.logit_rows, dev)?;
        let x = rms_norm(&x.index_select(&rows, 0)?, &self.norm, eps)?;
        Ok(Some(self.lm_head.forward(&x)?.to_dtype(DType::F32)?))
    }
}

/// RoPE's cosines and sines for positions `0..len`: angle `pos / theta^(2i / head_dim)`.
fn rope_tables(head_dim: usize, theta: f32, len: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let inv: Vec<f32> = (0..head_dim).step_by(2).map(|i| 1f32 / theta.powf(i as f32 / head_dim as f32)).collect();
    let inv = Tensor::new(inv.as_slice(), device)?.reshape((1, head_dim / 2))?;
    let pos = Tensor::arange(0, len as u32, device)?.to_dtype(DType::F32)?.reshape((len, 1))?;
    let angles = pos.matmul(&inv)?;
    Ok((angles.cos()?, angles.sin()?))
}
