//! The split-K plan of a batch ([`plan_decode_tc`]): one chunk of whole key tiles for the
//! batch, each request's splits and partial rows, and the work items of the grid.

use super::kernel::{DecodeKernel, TcShape};
use crate::batch::DecodeBatch;
use crate::options::SplitMode;
use attn_math::split::{even_waves_chunk, num_splits, plan_chunk, EVEN_WAVES_MAX_SPLITS};

/// Splits shorter than this cost more in merging than they gain.
pub(crate) const MIN_CHUNK: u32 = 256;

/// A batch's split-K plan, as [`paged_decode`](super::paged_decode),
/// [`mla_attention`](crate::mla::mla_attention) and [`BatchPlan`](crate::batch_plan::BatchPlan)
/// return it: for logging and tuning (which kernel ran, how the keys were split); the calls
/// need nothing from it. An empty batch gives the default (empty) plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecodePlan {
    /// Keys per split (a multiple of the kernel's key tile; `u32::MAX`: one split each).
    pub chunk: u32,
    /// Query rows (query tokens x query heads of a kv head) per CTA.
    pub rows_per_cta: u32,
    /// Row tiles of the request with the most query rows.
    pub row_groups: u32,
    /// Work items, two words each: `request, row_tile << 16 | split`.
    pub items: Vec<u32>,
    /// The kernel the batch runs on.
    pub kernel: DecodeKernel,
    /// `[num_reqs]` splits of each request (1: its output is written directly).
    pub req_num_splits: Vec<u32>,
    /// `[num_reqs]` first partial row of each request in the workspace.
    pub req_partial_base: Vec<u32>,
    /// `[num_tokens]` the request each query token belongs to.
    pub token_request: Vec<u32>,
    /// Partial rows (head_size f32 each) the plan uses in the workspace.
    pub partial_rows: usize,
    /// MLA on sm_90a: every request has this many splits (2..=8), run as one thread-block
    /// cluster that combines them in shared memory (no partials, no merge kernel); 0 = off.
    pub cluster: u32,
}

impl DecodePlan {
    /// Whether a merge pass follows the attention kernel (some request has several splits and
    /// they are not combined in a cluster).
    pub fn needs_merge(&self) -> bool {
        self.cluster <= 1 && self.req_num_splits.iter().any(|&s| s > 1)
    }

    /// The splits of every request when they are all the same (more than one), and the work
    /// items are the ones a CTA derives from its index with `Schedule::uniform_splits`
    /// (split `i % n` of request `i / n`, row tile 0; partial rows in request order, so request
    /// r's start at `n * num_q_heads * query_start_loc[r]`).
    #[doc(hidden)]
    pub fn uniform_splits(&self) -> Option<u32> {
        let n = *self.req_num_splits.first()?;
        let uniform = n > 1
            && self.cluster <= 1
            && self.req_num_splits.iter().all(|&s| s == n)
            && self.items.len() == 2 * n as usize * self.req_num_splits.len()
            && self.items.chunks(2).enumerate().all(|(i, it)| it[0] == i as u32 / n && it[1] == i as u32 % n);
        uniform.then_some(n)
    }

    /// Whether the tensor-core kernels need the plan's arrays on the device. Not when the work
    /// items are the ones CTAs derive from their index (`SplitK::work_items` 0): CTA i is
    /// split `i % c` of request `i / c`, row tile 0, for every request, `c` being the cluster
    /// size or 1 (one split, one row tile, at least one query token each). The call then copies
    /// nothing, and its launch follows the kernel before it directly (programmatic dependent
    /// launch).
    #[doc(hidden)]
    pub fn needs_device_plan(&self) -> bool {
        let per = self.cluster.max(1);
        let implicit = self.items.len() == 2 * per as usize * self.req_num_splits.len()
            && self.items.chunks(2).enumerate().all(|(i, it)| it[0] == i as u32 / per && it[1] == i as u32 % per);
        !implicit
    }
}

/// Partial rows (head_size f32 each) the splits of a chunk size need: `splits x q_len x
/// num_q_heads` for every request split more than once; `None` when that overflows a usize.
fn partial_rows_for(lens: &[u32], q_lens: &[u32], num_q_heads: usize, chunk: u32) -> Option<usize> {
    lens.iter().zip(q_lens).try_fold(0usize, |acc, (&l, &q)| {
        let s = num_splits(l, chunk);
        let rows = if s > 1 { (s as usize).checked_mul(q as usize)?.checked_mul(num_q_heads)? } else { 0 };
        acc.checked_add(rows)
    })
}

/// The splits of every request for a chunk size, grown until the partials fit the workspace
/// (one split each always fits: it needs none): chunk, splits, partial bases, token requests.
/// `items` is left to the caller. Partial bases are u32, so at most `u32::MAX` rows of the
/// capacity are used.
fn plan_splits(lens: &[u32], q_lens: &[u32], num_q_heads: usize, chunk: u32, partial_capacity: usize) -> DecodePlan {
    let capacity = partial_capacity.min(u32::MAX as usize);
    let mut chunk = chunk.max(1);
    loop {
        let fits = partial_rows_for(lens, q_lens, num_q_heads, chunk).is_some_and(|rows| rows <= capacity);
        let splits_ok = lens.iter().all(|&l| num_splits(l, chunk) <= 0xffff);
        // A chunk of u32::MAX keys gives every request one split (no partials): it always fits.
        if (fits && splits_ok) || chunk == u32::MAX {
            break;
        }
        chunk = chunk.saturating_mul(2);
    }
    let mut plan = DecodePlan { chunk, ..DecodePlan::default() };
    for (r, (&len, &q)) in lens.iter().zip(q_lens).enumerate() {
        let splits = num_splits(len, chunk);
        plan.req_num_splits.push(splits);
        plan.req_partial_base.push(plan.partial_rows as u32);
        if splits > 1 {
            // In range: the loop above checked that the sum fits the capacity.
            plan.partial_rows += splits as usize * q as usize * num_q_heads;
        }
        plan.token_request.extend(std::iter::repeat_n(r as u32, q as usize));
    }
    plan
}

/// A chunk of whole `tile`s of at most `cap` keys, or the chunk that splits the longest of
/// `lens` in `EVEN_WAVES_MAX_SPLITS` if that is longer, never under `MIN_CHUNK`.
fn capped_chunk(lens: &[u32], cap: u32, tile: u32) -> u32 {
    let tile = tile.max(1);
    let max_len = lens.iter().copied().max().unwrap_or(0);
    let fewest = max_len.div_ceil(tile).div_ceil(EVEN_WAVES_MAX_SPLITS).saturating_mul(tile);
    let cap = (cap / tile).max(1).saturating_mul(tile);
    cap.max(fewest).max(MIN_CHUNK)
}

/// Plans a batch for the tensor-core kernels: a chunk of whole key tiles, and work items
/// `[request, row_tile << 16 | split]` (flattened in `items`). `group`: query heads per kv head.
/// `slots`: the CTAs the GPU holds at once, for splitting batches of equal requests into even
/// waves (`attn_math::split::even_waves_chunk`); 0 leaves that out (the
/// decode kernels' when `Tuning::decode_even_waves` is off). `max_chunk`: the keys a split
/// holds at most under `SplitMode::Auto` (`decode::kernel::split_key_cap`), taken only up to
/// `EVEN_WAVES_MAX_SPLITS` splits of the longest request, so that a plan never has more work
/// items than `TcKernel::max_items` allows for.
///
/// Never panics: it takes the batch as given (decreasing start locations count as empty
/// requests, negative lengths as 0, a zero tile size as 1). Row tiles are encoded in 16 bits, so
/// a request gets at most 65536 of them: the callers refuse batches with more rows
/// ([`crate::mla::mla_attention`], [`validate_batch`](super::validate_batch)) before planning.
#[allow(clippy::too_many_arguments)]
pub fn plan_decode_tc(
    batch: &DecodeBatch<'_>,
    num_q_heads: usize,
    group: u32,
    shape: TcShape,
    ctas_target: u64,
    slots: u64,
    max_chunk: Option<u32>,
    mode: SplitMode,
    partial_capacity: usize,
) -> DecodePlan {
    let n = batch.seq_lens.len().min(batch.query_start_loc.len().saturating_sub(1));
    let qsl = batch.query_start_loc;
    let q_lens: Vec<u32> = (0..n).map(|r| (qsl[r + 1] as i64 - qsl[r] as i64).clamp(0, u32::MAX as i64) as u32).collect();
    let lens: Vec<u32> = batch.seq_lens[..n].iter().map(|&l| l.max(0) as u32).collect();
    let TcShape { block_m, block_n, ctas_per_item } = shape;
    let (bm, bn) = (block_m.max(1), block_n.max(1));
    // A request's row tiles, in 16 bits (see above).
    let tiles_of = |q: u32| (q as u64 * group as u64).div_ceil(bm as u64).min(1 << 16) as u32;
    let row_tiles = tiles_of(q_lens.iter().copied().max().unwrap_or(1)).max(1);
    let forced = match mode {
        SplitMode::Auto => None,
        SplitMode::Fixed(n) => Some(n),
    };
    let ctas_per_split = ctas_per_item.saturating_mul(row_tiles);
    let chunk = plan_chunk(&lens, ctas_per_split, ctas_target, bn, MIN_CHUNK, forced);
    let chunk = if forced.is_none() { even_waves_chunk(&lens, ctas_per_split, slots, bn, MIN_CHUNK, chunk) } else { chunk };
    let chunk = match (forced, max_chunk) {
        (None, Some(cap)) => chunk.min(capped_chunk(&lens, cap, bn)),
        _ => chunk,
    };
    let mut plan = plan_splits(&lens, &q_lens, num_q_heads, chunk, partial_capacity);
    plan.rows_per_cta = bm;
    plan.row_groups = row_tiles;
    for (r, (&splits, &q)) in plan.req_num_splits.iter().zip(&q_lens).enumerate() {
        for tile in 0..tiles_of(q) {
            for s in 0..splits {
                plan.items.extend([r as u32, tile << 16 | s]);
            }
        }
    }
    plan
}
