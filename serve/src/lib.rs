//! SmolLM2-135M (any Llama GGUF) served on attn-rs's paged attention: a Llama forward on candle
//! ops whose attention is `attn_rs::forward::Attention::forward` over a paged KV cache, a block
//! allocator and continuous batching with chunked prefill, checked against candle-transformers'
//! `quantized_llama`.

pub mod chat;
pub mod gguf;
pub mod tokenizer;
