//! A simulated serving engine around [`attn_rs::forward`] (the library side of the `engine-sim`
//! binary): a model configuration ([`SimModel`]), a block allocator ([`BlockAllocator`],
//! [`BlockTable`]), a deterministic stream of requests arriving and finishing
//! ([`Workload`]), a chunked-prefill scheduler ([`Scheduler`]) and the loop ([`run_sim`]) that
//! runs each step's mixed batch through `forward_layer` on every layer (each with its sliding
//! window, soft-cap, chunks or KV sharing; an encoder-decoder model's encoder step, decoder step and
//! cross-attention step), checks a sample against an f64 reference ([`reference_attention`],
//! [`reference_attention_bidirectional`]) and reports throughput and where each step's time
//! goes.

mod allocator;
mod check;
mod engine;
mod model;
mod reference;
mod report;
mod requests;
mod rng;
mod scheduler;

pub use allocator::{AllocError, BlockAllocator, BlockTable};
pub use check::{rel_error, tolerance, CheckStats, Checker, Sensitivity};
pub use engine::{run_sim, SimConfig, SimError};
pub use model::{KvSharing, RowLayout, SimModel};
pub use reference::{key_visible, reference_attention, reference_attention_bidirectional, RefShape};
pub use report::SimReport;
pub use requests::{RequestSpec, Workload};
pub use rng::SplitMix;
pub use scheduler::{Batch, Scheduled, Scheduler, SchedulerConfig, StepArrays};
