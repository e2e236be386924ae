//! One call per layer: [`Attention::forward`] writes a step's new keys and values into the
//! layer's paged cache, then computes attention for a batch that mixes decodes and prefills,
//! each part on its kernel, into a caller-provided `[num_tokens, num_q_heads, v_head_size]`
//! output.
//!
//! Once per model: pick the backend ([`crate::backend::select_backend`]), make the
//! [`Attention`] and a [`StepMetadata`]. Every step: order the batch decodes first
//! ([`crate::metadata::decode_first_order`]), [`StepMetadata::build`] it (checks, split,
//! plan, one upload on the GPU), then `forward` each layer ([`LayerIo::Gpu`] device buffers for
//! `tensor-core` and `mla`, [`LayerIo::Cpu`] host slices for `cpu`). MLA models use the same
//! calls with [`NewKv::Mla`] and their latent cache.
//!
//! `build` also plans the step's decode splits once for every layer. It detects a prefix of
//! blocks that every request shares, and then runs the step as cascade attention
//! ([`ForwardConfig::cascade`]).
//!
//! For CUDA graphs, make a graph step per batch-size bucket with
//! [`Attention::new_graph_step`]. Build it every step as usual, [`Attention::capture`] the
//! layers once, and [`StepGraph::replay`] after each build.
//!
//! An FP8 cache takes each layer's `kv_scales`.
//!
//! ```
//! use attn_rs::backend::{select_backend_no_env, DeviceInfo, ModelConfig};
//! use attn_rs::forward::{Attention, CpuLayer, ForwardConfig, ForwardLimits, LayerIo, NewKv};
//! use attn_rs::metadata::StepInput;
//! use attn_rs::{DType, KvLayout, RowsDesc};
//!
//! // 4 query heads over 2 kv heads of 8, f32, blocks of 4 tokens; 8 blocks per layer.
//! let model = ModelConfig::standard(4, 2, 8, DType::F32, 4, KvLayout::FlashNhd);
//! let selection = select_backend_no_env(&model, &DeviceInfo::no_gpu(), None).unwrap();
//! let limits = ForwardLimits { max_num_tokens: 16, max_num_reqs: 4, max_model_len: 32 };
//! let mut attn = Attention::new(&selection, ForwardConfig::new(model, 8, limits), None).unwrap();
//! let mut cache = vec![0f32; attn.cache_spec().num_elements()];
//! let mut step = attn.new_step_metadata().unwrap();
//!
//! // A decode (1 new token, 3 cached: blocks [2]) then a prefill of 5 tokens (blocks [0, 1]).
//! let (qsl, seq_lens, block_table) = ([0, 1, 6], [4, 5], [2, 0, 0, 1]);
//! let slots = [2 * 4 + 3, 0, 1, 2, 3, 4];
//! let split = step.build(&StepInput {
//!     query_start_loc: &qsl, seq_lens: &seq_lens, block_table: &block_table, block_table_stride: 2,
//!     slot_mapping: &slots, num_actual_tokens: 6, num_blocks: 8, block_size: 4,
//! }).unwrap();
//! assert_eq!((split.num_decodes, split.num_prefills), (1, 1));
//!
//! let (q, k, v) = (vec![0.5f32; 6 * 4 * 8], vec![0.25f32; 6 * 2 * 8], vec![1f32; 6 * 2 * 8]);
//! let mut out = vec![0f32; 6 * 4 * 8];
//! attn.forward(&step, LayerIo::Cpu(CpuLayer {
//!     q: q.as_slice().into(), q_rows: RowsDesc::contiguous(6, 4, 8),
//!     new_kv: NewKv::Standard {
//!         k: k.as_slice().into(), k_rows: RowsDesc::contiguous(6, 2, 8),
//!         v: v.as_slice().into(), v_rows: RowsDesc::contiguous(6, 2, 8),
//!     },
//!     cache: cache.as_mut_slice().into(),
//!     out: out.as_mut_slice().into(), out_rows: RowsDesc::contiguous(6, 4, 8),
//!     alibi_slopes: None, sinks: None, kv_scales: None,
//! })).unwrap();
//! // The prefill's tokens see only this step's keys, all V = 1; the decode's 3 cached keys are
//! // zeros (never written) with V = 0, and its new one has V = 1.
//! assert!(out[4 * 8..].iter().all(|&x| (x - 1.0).abs() < 1e-6));
//! assert!(out[..4 * 8].iter().all(|&x| x > 0.0 && x < 1.0));
//! ```

mod attention;
mod cascade_exec;
mod config;
mod cp_exec;
mod cpu_exec;
mod gpu_exec;
mod graph;
mod graph_plan;
mod held;
mod host_buf;
mod io;
mod kv_sharing;
mod layers;
mod step;
mod step_plan;
mod timing;
mod validate;

pub use attention::{Attention, GpuHandles};
pub use config::{ForwardConfig, ForwardLimits};
pub use graph::StepGraph;
pub use graph_plan::GraphBucket;
pub use host_buf::{HostElement, HostIn, HostOut};
pub use io::{CacheSpec, CpuLayer, GpuLayer, KvCacheWrite, KvWriteIo, Layer, LayerIo, NewKv};
pub use layers::{AttentionType, LayerSpec};
pub use step::StepMetadata;
pub use timing::PhaseTimes;
