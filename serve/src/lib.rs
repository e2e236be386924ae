//! SmolLM2-135M (any Llama GGUF) served on attn-rs's paged attention: a Llama forward on candle
//! ops whose attention is `attn_rs::forward::Attention::forward` over a paged KV cache, a block
//! allocator and continuous batching with chunked prefill, checked against candle-transformers'
//! `quantized_llama`.

pub mod bench;
pub mod chat;
pub mod check;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod glue;
pub mod model;
pub mod reference;
pub mod setup;
pub mod stream;
pub mod tokenizer;
