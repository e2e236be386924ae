//! Paged KV-cache writes and attention for LLM inference on NVIDIA GPUs, with the kernels
//! written in Rust and shipped as embedded PTX: an engine that links this crate builds with
//! stable Rust and needs no CUDA toolkit, only the driver at run time.
//!
//! - [`device::AttnDevice`]: loads the kernels for the GPU once; every op launches on a stream the
//!   caller gives and never synchronises unless asked.
//! - [`buffer`]: the caller's device memory (any cudarc slice or view) with its dtype.
//! - [`layout`]: the paged KV-cache layouts (vLLM FlashAttention, FlashInfer, HND variants, MLA).
//! - [`cache_write`]: `reshape_and_cache` and `concat_and_cache_mla`.
//! - [`decode`]: paged decode with split-K, and `merge_attn_states`.
//! - [`batch`]: a batch's request metadata, checked and uploaded by the library (the device
//!   copy the kernels index with always equals the host copy the call was checked against).
//! - [`batch_plan`]: a decode batch's split plan made once per step for every layer's call.
//! - [`options`]: the options of the attention calls (`AttnOptions`) and of their split plans
//!   (`SplitMode`, and the planners' `Tuning`).
//! - [`kernels`]: [`kernels::KernelId`], every kernel the host launches, and its PTX entry name.
//! - [`backend`]: the backend registry and per-model selection (with every refusal reason).
//! - [`metadata`]: per-step metadata (checks, decode/prefill split, one upload).
//! - [`forward`]: one call per layer: cache write, then decode and prefill attention.
//! - [`sim`]: a simulated serving engine around `forward` (the `engine-sim` binary).
//! - [`cpu`]: the CPU implementation of every op: the reference the tests compare with, and the
//!   path for machines without a GPU.

pub mod backend;
pub mod batch;
pub mod batch_plan;
pub mod buffer;
pub mod cache_write;
pub mod cpu;
pub mod decode;
pub mod device;
pub mod dtype;
pub mod error;
pub mod forward;
pub mod kernels;
pub mod layout;
pub mod metadata;
pub mod mla;
pub mod options;
pub mod prefill;
mod ptx;
pub mod sim;
pub mod status;
mod stream_check;
mod words;

pub use attn_math;
pub use batch::BatchMetadata;
pub use buffer::{DevIn, DevOut, SharedBuf};
/// The cudarc this crate is built on (0.19): its `CudaContext`, `CudaStream` and `CudaSlice` are
/// the types the ops take. An engine names them through this path (or depends on the same
/// version) so that its device memory and attn-rs's share one type, e.g. candle's
/// `CudaStorage::as_cuda_slice` slices and `CudaDevice::cuda_stream`.
pub use cudarc;
pub use device::AttnDevice;
pub use dtype::{DType, Element, Fp8E4m3};
pub use error::{AttnError, BadBlock, BadSlot, Result};
pub use layout::{KvCacheSpec, KvLayout, MlaCacheSpec, RowsDesc};
pub use options::{AttnOptions, PlanOptions, SplitMode, Tuning};
pub use status::{DeviceStatus, Offence, StatusFlags};
