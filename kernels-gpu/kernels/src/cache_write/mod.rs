//! Paged KV-cache writes: vLLM's `reshape_and_cache_flash` and `concat_and_cache_mla`.
//!
//! One warp writes one token's row; each lane moves 16-byte vectors of source data (8 f16/bf16
//! or 4 f32 elements), keeping `UNROLL` vectors of K and of V in flight before it stores any;
//! see [`write_token`]. Slots are checked against the
//! cache's capacity; a slot past the end raises `SLOT_OUT_OF_RANGE` and writes nothing.
//!
//! [`writers`]: how a 16-byte source vector becomes cache elements (copied, or divided by the
//! FP8 scale and quantised); [`token`]: a warp's write of one token's row, and the two writes;
//! [`entry`]: the entry points.

mod entry;
mod token;
mod writers;
