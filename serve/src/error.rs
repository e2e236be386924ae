//! What serving can fail with.

use crate::gguf::GgufError;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("attn-rs: {0}")]
    Attn(#[from] attn_rs::AttnError),
    #[error("chat template: {0}")]
    Template(#[from] minijinja::Error),
    #[error("{0}")]
    Config(String),
    #[error("output: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = ServeError> = std::result::Result<T, E>;
