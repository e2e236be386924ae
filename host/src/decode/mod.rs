//! Paged decode attention with two-pass split-K (flash-decoding), and the public LSE merge
//! `merge_attn_states`.
//!
//! The host plans each batch from its host-side metadata (`seq_lens`, `query_start_loc`): one
//! chunk size for the batch (`attn_math::split::plan_chunk`), so long requests get many splits
//! and short ones few and the CTAs fill the GPU; requests with one split write their output
//! directly, the others go through the workspace and the merge kernel. The plan is uploaded into
//! a caller-owned [`DecodeWorkspace`]; nothing is allocated per call.
//!
//! Use: once, a [`DecodeWorkspace`] (for the largest batch, on the stream the calls run on) and
//! a [`DeviceStatus`](crate::DeviceStatus); every step, a [`BatchMetadata`](crate::BatchMetadata)
//! of the batch; every layer, [`paged_decode`] with the layer's [`DecodeArgs`] (or, planning
//! once per step, [`crate::batch_plan`]). `host/examples/paged_decode.rs` runs one call.
//!
//! Source layout:
//!
//! - `args`: what a call takes and its checks (the batch's host arrays and their checks are
//!   the crate's `batch` module's, [`DecodeBatch`] re-exported here);
//! - `kernel`: the kernel a batch runs and the CTA target of its plans;
//! - `split`: the batch's split-K plan;
//! - `plan`: a call's launch, planned (kernel, grid, where the plan's arrays are, the merge);
//! - `workspace`: the split-K partials and the uploaded plan (`plan_words`: the plan packed
//!   for one copy);
//! - `launch`: [`paged_decode`], which checks, plans and runs;
//! - `merge`: split-K's pass 2 and [`merge_attn_states`].

mod args;
mod kernel;
mod launch;
mod merge;
mod plan;
mod plan_words;
mod split;
mod workspace;

pub use crate::batch::{DecodeBatch, MAX_QUERY_LEN};
pub use args::DecodeArgs;
pub use kernel::{fp8_decode_rounds_to_e4m3, DecodeKernel};
pub use launch::paged_decode;
pub use merge::{merge_attn_states, merge_attn_states_sizes, MergeArgs};
pub use split::DecodePlan;
pub use workspace::DecodeWorkspace;

// The planner and the batch checks alone, for the tests in `tests/` (not part of the API).
#[doc(hidden)]
pub use crate::batch::validate_batch;
#[doc(hidden)]
pub use kernel::TcShape;
#[doc(hidden)]
pub use split::plan_decode_tc;

pub(crate) use kernel::{decode_tc_kernel, max_len, LayerShape, TcKernel};
pub(crate) use launch::paged_decode_from;
pub(crate) use merge::{launch_merge, merge_attn_states_from};
pub(crate) use plan::{max_query_len, plan_launch, DevicePlan, PlanArrays, PlanSource};
pub(crate) use plan_words::{append_plan, PlanRegions};
