//! Per-step attention metadata, CPU side (vLLM's metadata builders): what the engine fills each
//! step ([`StepInput`]) and what it needs to know about it before handing it to
//! [`StepMetadata::build`](crate::forward::StepMetadata::build), which checks, splits, plans and
//! uploads it once for every layer.
//!
//! - [`validate`]: the checks `build` runs, naming the field it refuses.
//! - [`decode_first_order`], [`is_decode`]: `forward` takes batches ordered decodes first (at
//!   most `decode_threshold` query tokens each); [`BatchSplit`] is what `build` returns.
//! - [`common_prefix`], [`use_cascade`], [`CascadeMode`]: cascade attention's shared prefix and
//!   the per-step decision (see [`ForwardConfig::cascade`](crate::forward::ForwardConfig::cascade)).
//!
//! ```
//! use attn_rs::metadata::{decode_first_order, is_decode, validate, StepInput};
//!
//! // Two decodes (1 and 2 query tokens), then a prefill of 5; block size 16, 8 blocks.
//! let (qsl, seq_lens) = ([0, 1, 3, 8], [17, 2, 5]);
//! let block_table = [3, 4, 0, 5, 0, 0, 6, 0, 0]; // rows of 3
//! let slots = [4 * 16, 5 * 16, 5 * 16 + 1, 96, 97, 98, 99, 100]; // block * 16 + offset
//! let step = StepInput {
//!     query_start_loc: &qsl, seq_lens: &seq_lens, block_table: &block_table, block_table_stride: 3,
//!     slot_mapping: &slots, num_actual_tokens: 8, num_blocks: 8, block_size: 16,
//! };
//! validate(&step).unwrap();
//! // With decodes of up to 2 query tokens, the batch is already ordered decodes first.
//! assert!(is_decode(2, 2) && !is_decode(5, 2));
//! assert_eq!(decode_first_order(&step, 2), [0, 1, 2]);
//! // A prefill before a decode: the order that puts the decode first.
//! let prefill_first = StepInput { query_start_loc: &[0, 5, 6], seq_lens: &[5, 9], ..step };
//! assert_eq!(decode_first_order(&prefill_first, 2), [1, 0]);
//! assert!(validate(&StepInput { num_blocks: 6, ..step }).is_err()); // block id 6 is outside
//! ```

mod builder;
mod cascade;
mod chunked_local;
mod input;
mod split;
mod staging;
mod tensor_core;
mod upload;
mod validate;

pub use cascade::{
    common_prefix, use_cascade, CascadeMode, CascadeStep, CommonPrefix, MAX_CASCADE_ROWS_PER_REQ, MIN_CASCADE_PREFIX_TOKENS,
    MIN_CASCADE_REQS,
};
pub use input::StepInput;
pub use split::{decode_first_order, is_decode, BatchSplit};
pub use validate::validate;

pub(crate) use split::given_split;
pub(crate) use upload::upload;

// The stages of `StepMetadata::build` one by one, for the tests in `tests/` and the
// `metadata-bench` benchmark (not part of the API).
#[doc(hidden)]
pub use crate::words::{Region, ALIGN_WORDS};
#[doc(hidden)]
pub use builder::{BuiltStep, MetadataBuilder};
#[doc(hidden)]
pub use chunked_local::LocalBatch;
#[doc(hidden)]
pub use split::split_decodes;
#[doc(hidden)]
pub use staging::{pack, pack_into, StagingLayout, StagingSizes};
#[doc(hidden)]
pub use tensor_core::{build_tensor_core_metadata, DecodePart, PlanConfig, PrefillPart, TensorCoreMetadata};
