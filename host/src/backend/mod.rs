//! Attention backends as data, and choosing one per model.
//!
//! A backend is a [`BackendSpec`]: the GPUs, dtypes, head and block sizes, attention kinds,
//! features and cache layouts it takes, and how far CUDA graphs capture it. [`REGISTRY`] lists
//! them all; [`priorities`] ranks them for a model's attention kind and the device (best first);
//! [`select_backend`] picks the first that accepts the model, or the one an override
//! (the argument, else `ATTN_BACKEND`) names, refusing with every reason when it cannot
//! ([`refusal_reasons`]). [`describe`] reports the whole decision.
//!
//! Adding a backend: a module with its `static BackendSpec`, an entry in [`REGISTRY`] and its
//! place in [`priorities`].
//!
//! ```
//! use attn_rs::backend::{select_backend_no_env, DeviceInfo, ModelConfig};
//! use attn_rs::{DType, KvLayout};
//!
//! let llama = ModelConfig::standard(32, 8, 128, DType::BF16, 16, KvLayout::FlashNhd);
//! let chosen = select_backend_no_env(&llama, &DeviceInfo::gpu(8, 0), None).unwrap();
//! assert_eq!(chosen.name(), "tensor-core");
//! let chosen = select_backend_no_env(&llama, &DeviceInfo::no_gpu(), None).unwrap();
//! assert_eq!(chosen.name(), "cpu");
//! ```

mod config;
mod cpu;
mod describe;
mod mla;
mod priority;
mod reason;
mod registry;
mod select;
mod spec;
mod tensor_core;
mod validate;

pub use config::{DeviceInfo, ModelConfig};
pub use cpu::CPU;
pub use describe::{describe, describe_no_env};
pub use mla::{MLA, MLA_HEAD_SIZE};
pub use priority::priorities;
pub use reason::Reason;
pub use registry::{backend_names, find_backend, REGISTRY};
pub use select::{override_from_env, select_backend, select_backend_no_env, OverrideSource, Refusal, Selection, OVERRIDE_ENV};
pub use spec::{
    AttentionKind, BackendSpec, BlockSizes, CacheDTypeRule, CcRange, ComputeCapability, Feature, Features, GraphSupport, HeadSizes,
};
pub use tensor_core::TENSOR_CORE;
pub use validate::{config_reasons, refusal_reasons};
