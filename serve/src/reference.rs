//! The reference: candle-transformers' `quantized_llama` on the same GGUF (its own attention
//! over a concatenating, non-paged cache), one sequence or one batch of equal-length ones.

use crate::gguf::{Gguf, GgufError};
use candle_core::{DType, Device, Tensor, D};
use candle_transformers::models::quantized_llama::ModelWeights;

pub struct Reference {
    model: ModelWeights,
    device: Device,
}

/// One greedy step of the reference: the token it chose and the logits it chose from.
pub struct RefStep {
    pub token: u32,
    pub logits: Vec<f32>,
}

impl Reference {
    pub fn load(path: &std::path::Path, device: &Device) -> Result<Self, GgufError> {
        Self::from_gguf(Gguf::open(path)?, device)
    }

    pub fn from_gguf(g: Gguf, device: &Device) -> Result<Self, GgufError> {
        let (content, mut reader) = g.into_parts();
        let model = ModelWeights::from_gguf(content, &mut reader, device)?;
        Ok(Reference { model, device: device.clone() })
    }

    /// Greedy generation of `n` tokens after `prompt`, alone, with every step's logits. The
    /// prompt goes in whole, or with `chunk` in pieces of that many tokens (as chunked prefill
    /// feeds it).
    pub fn generate(&mut self, prompt: &[u32], n: usize, chunk: Option<usize>) -> candle_core::Result<Vec<RefStep>> {
        self.model.clear_kv_cache();
        let mut out = Vec::with_capacity(n);
        let mut pos = 0;
        let chunk = chunk.unwrap_or(prompt.len()).max(1);
        let mut head = prompt;
        while head.len() > chunk {
            let _ = self.model.forward(&Tensor::new(&head[..chunk], &self.device)?.unsqueeze(0)?, pos)?;
            pos += chunk;
            head = &head[chunk..];
        }
        let mut input = Tensor::new(head, &self.device)?.unsqueeze(0)?;
        for _ in 0..n {
            let len = input.dim(1)?;
            let logits = self.model.forward(&input, pos)?.squeeze(0)?.to_dtype(DType::F32)?;
            pos += len;
            let logits = logits.to_vec1::<f32>()?;
            let token = argmax(&logits);
            out.push(RefStep { token, logits });
            input = Tensor::new(&[token], &self.device)?.unsqueeze(0)?;
        }
        Ok(out)
    }

    /// Greedy generation for a batch of equal-length prompts run as one `[batch, len]` input,
    /// then one token per sequence per step; returns each sequence's tokens. `on_step` sees
    /// every step's wall time (after the tokens are on the host; the first step is the prompt).
    ///
    /// candle-transformers 0.11's `quantized_llama` cannot return the logits of a batched
    /// prompt: its last line takes row `len - 1` of `[batch, len, hidden]`, a strided view the
    /// quantized matmul refuses ("not contiguous"). That error comes after every layer has
    /// filled its cache, so the prompt less its last token goes in as one batch (that error
    /// expected, and nothing else), then the last token as a one-token step, which returns the
    /// logits.
    pub fn generate_batch(
        &mut self,
        prompts: &[Vec<u32>],
        n: usize,
        mut on_step: impl FnMut(usize, std::time::Duration),
    ) -> candle_core::Result<Vec<Vec<u32>>> {
        self.model.clear_kv_cache();
        let len = prompts.first().map_or(0, Vec::len);
        if prompts.iter().any(|p| p.len() != len) || len == 0 {
            candle_core::bail!("the reference batch takes non-empty prompts of one length");
        }
        let b = prompts.len();
        let started = std::time::Instant::now();
        if len > 1 {
            let head: Vec<u32> = prompts.iter().flat_map(|p| p[..len - 1].iter().copied()).collect();
            match self.model.forward(&Tensor::from_vec(head, (b, len - 1), &self.device)?, 0) {
                Ok(_) => {}
                Err(e) if b > 1 && e.to_string().contains("contiguous") => {}
                Err(e) => return Err(e),
            }
        }
        let last: Vec<u32> = prompts.iter().map(|p| p[len - 1]).collect();
        let mut input = Tensor::from_vec(last, (b, 1), &self.device)?;
        let mut out = vec![Vec::with_capacity(n); b];
        for (step, pos) in (0..n).zip(len - 1..) {
            let step_start = if step == 0 { started } else { std::time::Instant::now() };
            let logits = self.model.forward(&input, pos)?;
            let next = logits.argmax(D::Minus1)?.to_dtype(DType::U32)?;
            let tokens = next.to_vec1::<u32>()?;
            on_step(step, step_start.elapsed());
            for (o, t) in out.iter_mut().zip(&tokens) {
                o.push(*t);
            }
            input = next.unsqueeze(1)?;
        }
        Ok(out)
    }
}

/// The index of the largest logit (the first of equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The gap between the two largest logits.
pub fn top2_gap(logits: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in logits {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}
