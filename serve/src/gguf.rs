//! The GGUF file: its metadata (through candle's reader) and tensors, and the Llama
//! hyper-parameters it declares.

use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use std::fs::File;
use std::io::{BufReader, Cursor, Read, Seek};
use std::path::{Path, PathBuf};

/// What a GGUF is read from: a file, or bytes in memory.
pub trait ReadSeek: Read + Seek {}
impl<T: Read + Seek> ReadSeek for T {}

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("GGUF: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("GGUF metadata {key}: {what}")]
    Metadata { key: String, what: String },
    #[error("GGUF: {0}")]
    Unsupported(String),
}

/// An open GGUF file.
pub struct Gguf {
    pub path: PathBuf,
    pub content: Content,
    reader: Box<dyn ReadSeek>,
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let file = File::open(path).map_err(|source| GgufError::Open { path: path.to_owned(), source })?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| e.with_path(path))?;
        Ok(Gguf { path: path.to_owned(), content, reader: Box::new(reader) })
    }

    /// The file's reader and content, for candle-transformers' loader.
    pub fn into_parts(self) -> (Content, Box<dyn ReadSeek>) {
        (self.content, self.reader)
    }

    /// The same model with every tensor dequantized to f32, as a GGUF in memory: its matmuls
    /// then run in f32 (candle's `QMatMul` takes f32 tensors as plain matrices) instead of
    /// quantizing the activations to 8 bits per block.
    pub fn dequantized(&mut self) -> Result<Gguf, GgufError> {
        let mut names: Vec<String> = self.content.tensor_infos.keys().cloned().collect();
        names.sort();
        let mut tensors = Vec::with_capacity(names.len());
        for name in &names {
            let q = self.tensor(name, &Device::Cpu)?;
            let f = if q.dtype() == GgmlDType::F32 { q } else { QTensor::quantize(&q.dequantize(&Device::Cpu)?, GgmlDType::F32)? };
            tensors.push(f);
        }
        let mut metadata: Vec<(&str, &Value)> = self.content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        metadata.sort_by_key(|(k, _)| *k);
        let named: Vec<(&str, &QTensor)> = names.iter().map(String::as_str).zip(&tensors).collect();
        let mut bytes = Cursor::new(Vec::new());
        gguf_file::write(&mut bytes, &metadata, &named)?;
        drop(tensors);
        bytes.set_position(0);
        let content = Content::read(&mut bytes)?;
        Ok(Gguf { path: self.path.clone(), content, reader: Box::new(bytes) })
    }

    fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.content.metadata.get(key).ok_or_else(|| GgufError::Metadata { key: key.into(), what: "missing".into() })
    }

    fn bad(key: &str, e: candle_core::Error) -> GgufError {
        GgufError::Metadata { key: key.into(), what: e.to_string() }
    }

    pub fn u32(&self, key: &str) -> Result<u32, GgufError> {
        self.get(key)?.to_u32().map_err(|e| Self::bad(key, e))
    }

    pub fn f32(&self, key: &str) -> Result<f32, GgufError> {
        self.get(key)?.to_f32().map_err(|e| Self::bad(key, e))
    }

    pub fn string(&self, key: &str) -> Result<String, GgufError> {
        self.get(key)?.to_string().cloned().map_err(|e| Self::bad(key, e))
    }

    pub fn strings(&self, key: &str) -> Result<Vec<String>, GgufError> {
        let v = self.get(key)?.to_vec().map_err(|e| Self::bad(key, e))?;
        v.iter().map(|x| x.to_string().cloned().map_err(|e| Self::bad(key, e))).collect()
    }

    pub fn i32s(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        let v = self.get(key)?.to_vec().map_err(|e| Self::bad(key, e))?;
        v.iter().map(|x| x.to_i32().map_err(|e| Self::bad(key, e))).collect()
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Tensor `name` on `device`, as stored (quantized or not).
    pub fn tensor(&mut self, name: &str, device: &Device) -> Result<QTensor, GgufError> {
        Ok(self.content.tensor(&mut self.reader, name, device)?)
    }
}

/// The Llama hyper-parameters of a GGUF (`llama.*` metadata).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaConfig {
    pub num_layers: usize,
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub rms_eps: f64,
    pub rope_theta: f32,
    pub vocab: usize,
    pub context_len: usize,
}

impl LlamaConfig {
    pub fn from_gguf(g: &Gguf) -> Result<Self, GgufError> {
        let arch = g.string("general.architecture")?;
        if arch != "llama" {
            return Err(GgufError::Unsupported(format!("architecture \"{arch}\" (this forward is Llama's)")));
        }
        let us = |k: &str| g.u32(k).map(|v| v as usize);
        let hidden = us("llama.embedding_length")?;
        let num_heads = us("llama.attention.head_count")?;
        let head_dim = hidden / num_heads.max(1);
        let rope_dim = us("llama.rope.dimension_count").unwrap_or(head_dim);
        if rope_dim != head_dim || head_dim * num_heads != hidden {
            return Err(GgufError::Unsupported(format!("rope over {rope_dim} of {head_dim} columns, {num_heads} heads of {hidden}")));
        }
        let vocab = match us("llama.vocab_size") {
            Ok(v) => v,
            Err(_) => g.strings("tokenizer.ggml.tokens")?.len(),
        };
        Ok(LlamaConfig {
            num_layers: us("llama.block_count")?,
            hidden,
            num_heads,
            num_kv_heads: us("llama.attention.head_count_kv")?,
            head_dim,
            ffn: us("llama.feed_forward_length")?,
            rms_eps: g.f32("llama.attention.layer_norm_rms_epsilon")? as f64,
            rope_theta: g.f32("llama.rope.freq_base").unwrap_or(10_000.0),
            vocab,
            context_len: us("llama.context_length")?,
        })
    }
}
