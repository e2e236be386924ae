//! Per-step attention metadata, CPU side (vLLM's metadata builders): what the engine fills each
//! step ([`StepInput`]), checked ([`validate`]), split into decodes and prefills
//! ([`split_decodes`], [`decode_first_order`]), gathered for the `tensor-core` backend
//! ([`build_tensor_core_metadata`]) and packed into one buffer ([`pack`]) that one copy from
//! pinned memory moves to the GPU ([`upload`]). [`MetadataBuilder`] does it all step after step
//! without allocating.
//!
//! ```
//! use attn_rs::metadata::{build_tensor_core_metadata, pack, validate, StepInput};
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
//! let meta = build_tensor_core_metadata(&step, 2, 32, 8, 128).unwrap();
//! assert_eq!((meta.split.num_decodes, meta.split.num_decode_tokens, meta.split.num_prefill_tokens), (2, 3, 5));
//! assert_eq!(meta.prefill.query_start_loc, [0, 5]);
//! let (words, layout) = pack(&meta, &step);
//! assert_eq!(layout.block_table_stride, 2); // the longest request uses 2 blocks
//! assert_eq!(layout.seq_lens.of(&words), [17, 2, 5]);
//! ```

mod builder;
mod cascade;
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

pub(crate) use upload::upload;

// The stages of `StepMetadata::build` one by one, for the tests in `tests/` and the
// `metadata-bench` benchmark (not part of the API).
#[doc(hidden)]
pub use crate::words::{Region, ALIGN_WORDS};
#[doc(hidden)]
pub use builder::{BuiltStep, MetadataBuilder};
#[doc(hidden)]
pub use split::split_decodes;
#[doc(hidden)]
pub use staging::{pack, pack_into, StagingLayout, StagingSizes};
#[doc(hidden)]
pub use tensor_core::{build_tensor_core_metadata, DecodePart, PlanConfig, PrefillPart, TensorCoreMetadata};
