//! Paged KV-cache writes and attention for LLM inference on NVIDIA GPUs, with the kernels
//! written in Rust and shipped as embedded PTX: an engine that links this crate builds with
//! stable Rust and needs no CUDA toolkit, only the driver at run time.
//!
//! The types every op shares are at the crate root:
//!
//! - [`AttnDevice`]: loads the kernels for the GPU once; every op launches on a stream the
//!   caller gives (`&Arc<CudaStream>`) and never synchronises unless asked.
//! - [`DevIn`], [`DevOut`], [`SharedBuf`]: the caller's device memory (any cudarc slice or view)
//!   with its dtype; [`DType`], [`Element`], [`Fp8E4m3`], [`Fp8E5m2`]: the element types.
//! - [`KvCacheSpec`], [`KvLayout`], [`MlaCacheSpec`], [`RowsDesc`]: the paged KV-cache layouts
//!   (vLLM FlashAttention, FlashInfer, HND variants, MLA) and the rows of the source tensors.
//! - [`BatchMetadata`]: a batch's request metadata, checked and uploaded by the library (the
//!   device copy the kernels index with always equals the host copy the call was checked
//!   against).
//! - [`AttnOptions`], [`PlanOptions`], [`SplitMode`], [`Tuning`]: a layer's attention options
//!   and the options of the split plans.
//! - [`DeviceStatus`]: the device word kernels report refused slots and blocks in;
//!   [`AttnError`]: every refusal, naming the argument.
//!
//! The ops, one module each:
//!
//! - [`cache_write`]: `reshape_and_cache` and `concat_and_cache_mla`.
//! - [`decode`]: paged decode with split-K, and `merge_attn_states`.
//! - [`prefill`]: varlen prefill over the paged cache or packed K/V.
//! - [`mla`]: DeepSeek's multi-head latent attention over the latent cache.
//! - [`context_parallel`]: decode over a context dealt across GPUs (vLLM's DCP), merged by LSE.
//! - [`batch_plan`]: a decode or MLA batch's split plan made once per step for every layer.
//! - [`forward`]: one call per layer (cache write, then decode and prefill attention), with
//!   [`metadata`] (per-step metadata: checks, decode/prefill split, cascade detection) and
//!   [`backend`] (the backend registry and per-model selection, with every refusal reason).
//! - [`cpu`]: the CPU implementation of every op: the reference the tests compare with, and the
//!   path for machines without a GPU.
//!
//! `host/examples/` has a small program per op (`cargo run -p attn-rs --example NAME`).

#![warn(missing_docs)]

mod attn_params;
pub mod backend;
mod batch;
pub mod batch_plan;
mod buffer;
pub mod cache_write;
pub mod context_parallel;
pub mod cpu;
pub mod decode;
mod device;
mod dtype;
mod error;
pub mod forward;
mod kernels;
mod layout;
pub mod metadata;
pub mod mla;
mod options;
pub mod prefill;
mod ptx;
mod status;
mod stream_check;
mod tensor_map;
mod words;

/// Element strides of a cache layout, as [`KvCacheSpec::strides`] and [`MlaCacheSpec::strides`]
/// return them (the `attn-math` crate's type, which the kernels take too).
pub use attn_math::paging::CacheStrides;
pub use batch::BatchMetadata;
pub use buffer::{DevIn, DevOut, SharedBuf};
/// The cudarc this crate is built on (0.19): its `CudaContext`, `CudaStream` and `CudaSlice` are
/// the types the ops take. An engine names them through this path (or depends on the same
/// version) so that its device memory and attn-rs's share one type, e.g. candle's
/// `CudaStorage::as_cuda_slice` slices and `CudaDevice::cuda_stream`.
pub use cudarc;
pub use device::AttnDevice;
pub use dtype::{DType, Element, Fp8E4m3, Fp8E5m2, Fp8Format};
pub use error::{AttnError, BadBlock, BadIndex, BadSlot, Result};
pub use layout::{KvCacheSpec, KvLayout, MlaCacheSpec, RowsDesc};
pub use options::{AttnOptions, PlanOptions, SplitMode, Tuning};
pub use status::{DeviceStatus, Offence, StatusFlags};
