//! A batch's request metadata as the attention ops take it: the host arrays the library plans
//! and checks with, and the device copy the kernels index with, uploaded by the library itself
//! from those host arrays.
//!
//! Why a type of its own: the kernels use `query_start_loc`, `seq_lens` and `key_start_loc`
//! as row and key indices. A device copy handed in by the caller could say something other than
//! the host copy the call was checked against (a longer request, a later start), and the kernels
//! would then read or write past the buffers the host checked. [`BatchMetadata`] makes the two
//! copies one value: no safe code can change one without the other. `forward` needs none of
//! this: its [`StepMetadata`](crate::forward::StepMetadata) uploads its own arrays the same way.
//!
//! The host arrays alone, as the planners and checks take them: [`DecodeBatch`] and
//! [`PrefillBatch`], checked by [`validate_batch`] and [`validate_prefill_batch`].

use crate::buffer::DevIn;
use crate::dtype::DType;
use crate::error::{ensure, BadBlock, Result};
use crate::stream_check::check_stream;
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// Query tokens per request that decode takes (speculative decoding: causal among them).
pub const MAX_QUERY_LEN: usize = 8;

/// A batch's host-side metadata, as the decode planners take it. The ops take a
/// [`BatchMetadata`], which holds these and their device copy.
#[derive(Clone, Copy, Debug)]
pub struct DecodeBatch<'a> {
    /// `[num_reqs]` context lengths, new tokens included.
    pub seq_lens: &'a [i32],
    /// `[num_reqs + 1]`, starting at 0.
    pub query_start_loc: &'a [i32],
}

/// A batch's host-side metadata, as the prefill planner takes it. The ops take a
/// [`BatchMetadata`], which holds these and their device copy.
#[derive(Clone, Copy, Debug)]
pub struct PrefillBatch<'a> {
    /// `[num_reqs + 1]`, from 0 to num_tokens.
    pub query_start_loc: &'a [i32],
    /// `[num_reqs]` keys per request (cached context + new tokens).
    pub seq_lens: &'a [i32],
    /// Packed K/V only: `[num_reqs + 1]` key rows (`cu_seqlens_k`), consistent with `seq_lens`.
    pub key_start_loc: Option<&'a [i32]>,
}

/// Checks host metadata: sorted start locations that cover the tokens, 0..=8 queries per
/// request (a request with none is an empty decode: it attends nothing and writes nothing, as
/// in [`crate::metadata::is_decode`]), non-negative lengths that hold their queries and fit the
/// block table, a positive block size. Differences of start locations are taken in i64, so no
/// pair of i32s wraps.
pub fn validate_batch(batch: &DecodeBatch<'_>, num_tokens: usize, block_size: usize, block_table_stride: usize) -> Result<()> {
    let n = batch.seq_lens.len();
    let qsl = batch.query_start_loc;
    ensure(block_size > 0, "block_size", || "must be at least 1".into())?;
    ensure(qsl.len() == n + 1, "query_start_loc", || format!("has {} entries for {n} requests (needs {})", qsl.len(), n + 1))?;
    ensure(qsl[0] == 0, "query_start_loc", || format!("starts at {}, not 0", qsl[0]))?;
    ensure(qsl[n] as i64 == num_tokens as i64, "query_start_loc", || format!("ends at {}, but q has {num_tokens} tokens", qsl[n]))?;
    ensure(n < 1 << 16, "seq_lens", || format!("{n} requests exceed the 65535 a launch takes"))?;
    for r in 0..n {
        let q = qsl[r + 1] as i64 - qsl[r] as i64;
        ensure((0..=MAX_QUERY_LEN as i64).contains(&q), "query_start_loc", || {
            format!("request {r} has {q} query tokens ({} -> {}; decode takes 0..={MAX_QUERY_LEN})", qsl[r], qsl[r + 1])
        })?;
        let len = batch.seq_lens[r];
        ensure(len >= 0, "seq_lens", || format!("request {r} has negative length {len}"))?;
        ensure(len == 0 || len as i64 >= q, "seq_lens", || format!("request {r} has length {len} < its {q} query tokens"))?;
        let blocks = (len as usize).div_ceil(block_size);
        ensure(blocks <= block_table_stride, "block_table", || {
            format!("request {r} needs {blocks} blocks, rows hold {block_table_stride}")
        })?;
    }
    Ok(())
}

/// Checks host metadata: start locations that cover the tokens, lengths that hold their
/// queries (causal) and fit the block table (paged).
///
/// `paged` is `(block_size, block_table_stride)`; a block size of 0 is refused. Differences of
/// start locations are taken in i64, so no pair of i32s wraps.
pub fn validate_prefill_batch(batch: &PrefillBatch<'_>, num_tokens: usize, causal: bool, paged: Option<(usize, usize)>) -> Result<()> {
    let n = batch.seq_lens.len();
    let qsl = batch.query_start_loc;
    if let Some((block_size, _)) = paged {
        ensure(block_size > 0, "block_size", || "must be at least 1".into())?;
    }
    ensure(qsl.len() == n + 1, "query_start_loc", || format!("has {} entries for {n} requests (needs {})", qsl.len(), n + 1))?;
    ensure(qsl[0] == 0, "query_start_loc", || format!("starts at {}, not 0", qsl[0]))?;
    ensure(qsl[n] as i64 == num_tokens as i64, "query_start_loc", || format!("ends at {}, but q has {num_tokens} tokens", qsl[n]))?;
    ensure(n < 1 << 31, "seq_lens", || format!("{n} requests"))?;
    for r in 0..n {
        let q = qsl[r + 1] as i64 - qsl[r] as i64;
        ensure(q >= 0, "query_start_loc", || format!("decreases at request {r} ({} -> {})", qsl[r], qsl[r + 1]))?;
        let len = batch.seq_lens[r];
        ensure(len >= 0, "seq_lens", || format!("request {r} has length {len}"))?;
        ensure(!causal || len == 0 || len as i64 >= q, "seq_lens", || format!("request {r} has length {len} < its {q} query tokens"))?;
        if let Some((block_size, stride)) = paged {
            let blocks = (len as usize).div_ceil(block_size);
            ensure(blocks <= stride, "block_table", || format!("request {r} needs {blocks} blocks, rows hold {stride}"))?;
        }
    }
    if let Some(ksl) = batch.key_start_loc {
        ensure(ksl.len() == n + 1 && ksl[0] == 0, "key_start_loc", || format!("must have {} entries starting at 0", n + 1))?;
        for r in 0..n {
            let keys = ksl[r + 1] as i64 - ksl[r] as i64;
            ensure(keys == batch.seq_lens[r] as i64, "key_start_loc", || {
                format!("request {r} spans {keys} keys ({} -> {}), seq_lens says {}", ksl[r], ksl[r + 1], batch.seq_lens[r])
            })?;
        }
    }
    Ok(())
}

/// Block-table entries the kernels may read: up to request r's last used block in its row
/// (`r * stride + ceil(seq_len / block_size)`), so a table that is a view into a wider one (a
/// cascade suffix's rows start past the shared blocks) need not hold full rows at its end.
/// Saturates at `usize::MAX` (no table is that long) rather than wrapping.
pub(crate) fn block_table_reach(seq_lens: &[i32], block_size: usize, stride: usize) -> usize {
    let used = |l: i32| (l.max(0) as usize).div_ceil(block_size.max(1));
    seq_lens.iter().enumerate().map(|(r, &l)| r.saturating_mul(stride).saturating_add(used(l))).max().unwrap_or(0)
}

/// Request metadata of one batch, host and device copies, on one stream.
///
/// The ops take no device metadata of the caller's: an argument block that would carry one
/// does not compile.
///
/// ```compile_fail
/// # fn f(start_locations: attn_rs::DevIn<'_>, a: attn_rs::decode::DecodeArgs<'_>) {
/// let a = attn_rs::decode::DecodeArgs { query_start_loc: start_locations, ..a };
/// # }
/// ```
///
/// ```no_run
/// # fn demo(stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> attn_rs::Result<()> {
/// use attn_rs::BatchMetadata;
/// // Two requests: 1 new token over 40 keys, 3 new tokens over 3 keys.
/// let mut batch = BatchMetadata::new(stream, &[40, 3], &[0, 1, 4])?;
/// // Next step: the same buffer, new contents (it grows when a batch needs more).
/// batch.update(&[41, 4], &[0, 1, 2], None)?;
/// # Ok(()) }
/// ```
pub struct BatchMetadata {
    stream: Arc<CudaStream>,
    seq_lens: Vec<i32>,
    query_start_loc: Vec<i32>,
    key_start_loc: Option<Vec<i32>>,
    /// `seq_lens`, then `query_start_loc`, then `key_start_loc` when present.
    device: CudaSlice<i32>,
    words: Vec<i32>,
}

/// The device copies of a batch's arrays, as the kernels get them: uploaded by the library from
/// the host arrays the call checked (from a [`BatchMetadata`], or `forward`'s step buffer).
pub(crate) struct DeviceBatch<'a> {
    pub seq_lens: DevIn<'a>,
    pub query_start_loc: DevIn<'a>,
    /// Packed K/V prefill only.
    pub key_start_loc: Option<DevIn<'a>>,
}

impl std::fmt::Debug for BatchMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchMetadata")
            .field("seq_lens", &self.seq_lens)
            .field("query_start_loc", &self.query_start_loc)
            .field("key_start_loc", &self.key_start_loc)
            .finish_non_exhaustive()
    }
}

impl DeviceBatch<'_> {
    /// Checks that the device arrays hold `num_reqs` requests (they are the library's own
    /// uploads of the host arrays, so this guards the library's bookkeeping).
    pub(crate) fn check(&self, num_reqs: usize) -> Result<()> {
        let ok = |b: &DevIn<'_>, len: usize| b.dtype == DType::I32 && b.len >= len;
        ensure(ok(&self.seq_lens, num_reqs), "seq_lens", || format!("device copy must be {num_reqs} i32"))?;
        ensure(ok(&self.query_start_loc, num_reqs + 1), "query_start_loc", || format!("device copy must be {} i32", num_reqs + 1))?;
        match &self.key_start_loc {
            Some(k) => ensure(ok(k, num_reqs + 1), "key_start_loc", || format!("device copy must be {} i32", num_reqs + 1)),
            None => Ok(()),
        }
    }
}

impl BatchMetadata {
    /// Finds the block-table entry behind a `BlockOutOfRange` error that the GPU attention
    /// kernels raised without a record (they raise the status bit alone): the first entry, in
    /// request order, that a call over this batch covers (request r's first
    /// `ceil(seq_lens[r] / block_size)`) and that is not a block of a `num_blocks`-block cache.
    /// Copies those rows of `block_table` (`[num_reqs, block_table_stride]` i32) back and
    /// waits for the batch's stream. `None`: every covered entry is inside the cache (the table
    /// changed since, or a sliding window skipped the offending block).
    pub fn find_bad_block(
        &self,
        block_table: &DevIn<'_>,
        block_table_stride: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Option<BadBlock>> {
        ensure(block_table.dtype == DType::I32, "block_table", || format!("must be i32, is {:?}", block_table.dtype))?;
        ensure(block_size > 0, "block_size", || "must be positive".to_string())?;
        let reach = block_table_reach(&self.seq_lens, block_size, block_table_stride);
        ensure(block_table.len >= reach, "block_table", || format!("holds {} entries, the batch covers {reach}", block_table.len))?;
        let mut host = vec![0i32; reach];
        if reach > 0 {
            // SAFETY: `host` holds `reach` i32s and the device buffer at least as many (checked
            // above); the copy is ordered on the batch's stream and waited for before `host`
            // is read.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host, block_table.ptr, self.stream.cu_stream()) }?;
            self.stream.synchronize()?;
        }
        Ok(first_bad_block(&host, block_table_stride, &self.seq_lens, block_size, num_blocks))
    }
}

/// The first entry of `table` (rows of `stride`) among each request's first
/// `ceil(seq_lens[r] / block_size)` that is not a block of a `num_blocks`-block cache.
pub(crate) fn first_bad_block(table: &[i32], stride: usize, seq_lens: &[i32], block_size: usize, num_blocks: usize) -> Option<BadBlock> {
    seq_lens.iter().enumerate().find_map(|(r, &len)| {
        let used = (len.max(0) as usize).div_ceil(block_size.max(1)).min(stride);
        let row = table.get(r * stride..r * stride + used)?;
        let entry = row.iter().position(|&b| b < 0 || b as usize >= num_blocks)?;
        Some(BadBlock { request: r as u32, entry: entry as u32, block: row[entry] as i64, num_blocks: num_blocks as u64 })
    })
}

impl BatchMetadata {
    /// Checks the arrays (see [`update`](Self::update)) and uploads them on `stream`, the
    /// stream every op that takes this batch must run on. `seq_lens`: `[num_reqs]` keys per
    /// request (context plus new tokens); `query_start_loc`: `[num_reqs + 1]` from 0.
    ///
    /// Errors: `InvalidArgument` naming the array that fails a check; `Driver` when the
    /// allocation or the copy fails.
    pub fn new(stream: &Arc<CudaStream>, seq_lens: &[i32], query_start_loc: &[i32]) -> Result<Self> {
        let mut b = BatchMetadata {
            stream: stream.clone(),
            seq_lens: Vec::new(),
            query_start_loc: Vec::new(),
            key_start_loc: None,
            device: stream.alloc_zeros(2 * seq_lens.len() + 2)?,
            words: Vec::new(),
        };
        b.update(seq_lens, query_start_loc, None)?;
        Ok(b)
    }

    /// A batch of packed K/V prefills: request r's keys are rows
    /// `key_start_loc[r]..key_start_loc[r + 1]` of the packed tensors.
    pub fn with_key_start_loc(stream: &Arc<CudaStream>, seq_lens: &[i32], query_start_loc: &[i32], key_start_loc: &[i32]) -> Result<Self> {
        let mut b = Self::new(stream, seq_lens, query_start_loc)?;
        b.update(seq_lens, query_start_loc, Some(key_start_loc))?;
        Ok(b)
    }

    /// Replaces the batch (one copy, enqueued on the batch's stream after the work already
    /// enqueued there, so earlier launches still read the earlier batch). Checked here: one
    /// length per request, `query_start_loc` of `num_reqs + 1` entries from 0 and never
    /// decreasing, no negative length, and `key_start_loc` (when given) from 0 with steps equal
    /// to the lengths. What depends on the layer (tokens, block-table width, the queries a
    /// kernel takes per request) is checked by each op.
    ///
    /// Errors: `InvalidArgument` naming the array (the batch is unchanged); `Driver` when the
    /// copy fails (the batch is then empty).
    pub fn update(&mut self, seq_lens: &[i32], query_start_loc: &[i32], key_start_loc: Option<&[i32]>) -> Result<()> {
        check_arrays(seq_lens, query_start_loc, key_start_loc)?;
        self.words.clear();
        self.words.extend_from_slice(seq_lens);
        self.words.extend_from_slice(query_start_loc);
        if let Some(k) = key_start_loc {
            self.words.extend_from_slice(k);
        }
        if self.device.len() < self.words.len() {
            self.device = self.stream.alloc_zeros(self.words.len().next_power_of_two())?;
        }
        // A copy that failed to enqueue leaves the device contents unknown: the batch becomes
        // empty on the host too, so that no launch uses the two copies together.
        let copied = self.stream.memcpy_htod(&self.words[..], &mut self.device.slice_mut(..self.words.len()));
        if let Err(e) = copied {
            self.seq_lens.clear();
            self.query_start_loc.clear();
            self.query_start_loc.push(0);
            self.key_start_loc = None;
            return Err(e.into());
        }
        self.seq_lens.clear();
        self.seq_lens.extend_from_slice(seq_lens);
        self.query_start_loc.clear();
        self.query_start_loc.extend_from_slice(query_start_loc);
        self.key_start_loc = key_start_loc.map(<[i32]>::to_vec);
        Ok(())
    }

    /// Requests in the batch (`seq_lens.len()`).
    pub fn num_reqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// Query tokens of the batch (`query_start_loc`'s last entry).
    pub fn num_tokens(&self) -> usize {
        self.query_start_loc.last().map_or(0, |&n| n as usize)
    }

    /// `[num_reqs]` keys per request (context plus this step's tokens), as last uploaded.
    pub fn seq_lens(&self) -> &[i32] {
        &self.seq_lens
    }

    /// `[num_reqs + 1]` query-token start of each request, from 0, as last uploaded.
    pub fn query_start_loc(&self) -> &[i32] {
        &self.query_start_loc
    }

    /// `[num_reqs + 1]` key-row starts of packed K/V, when the batch has them.
    pub fn key_start_loc(&self) -> Option<&[i32]> {
        self.key_start_loc.as_deref()
    }

    /// The stream the batch was uploaded on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The host arrays, as decode plans them.
    pub(crate) fn decode_batch(&self) -> DecodeBatch<'_> {
        DecodeBatch { seq_lens: &self.seq_lens, query_start_loc: &self.query_start_loc }
    }

    /// The host arrays, as prefill plans them.
    pub(crate) fn prefill_batch(&self) -> PrefillBatch<'_> {
        PrefillBatch { query_start_loc: &self.query_start_loc, seq_lens: &self.seq_lens, key_start_loc: self.key_start_loc.as_deref() }
    }

    /// The device copies, for a launch on `stream` (which must be the batch's).
    pub(crate) fn device(&self, stream: &Arc<CudaStream>) -> Result<DeviceBatch<'_>> {
        check_stream("batch", &self.stream, stream)?;
        #[cfg(debug_assertions)]
        self.verify_device_copy()?;
        let n = self.seq_lens.len();
        // Taken without cudarc's per-use events: every use is on the batch's own stream.
        let base = DevIn::owned(self.device_base(), self.device.len(), DType::I32);
        let at = |offset: usize, len: usize| DevIn::owned(base.ptr + 4 * offset as u64, len, DType::I32);
        Ok(DeviceBatch {
            seq_lens: at(0, n),
            query_start_loc: at(n, n + 1),
            key_start_loc: self.key_start_loc.as_ref().map(|_| at(2 * n + 1, n + 1)),
        })
    }

    /// Checked mode (debug builds): reads the device copy back and compares it with the host
    /// arrays before a launch uses them. It synchronises the stream, so it is skipped while the
    /// stream is being captured into a graph.
    #[cfg(debug_assertions)]
    fn verify_device_copy(&self) -> Result<()> {
        use cudarc::driver::sys::CUstreamCaptureStatus;
        if self.stream.capture_status()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Ok(());
        }
        let n = self.seq_lens.len() + self.query_start_loc.len() + self.key_start_loc.as_ref().map_or(0, Vec::len);
        let mut back = vec![0i32; n];
        self.stream.memcpy_dtoh(&self.device.slice(..n), &mut back)?;
        self.stream.synchronize()?;
        let host = self.seq_lens.iter().chain(&self.query_start_loc).chain(self.key_start_loc.iter().flatten());
        match back.iter().zip(host).position(|(d, h)| d != h) {
            None => Ok(()),
            Some(i) => Err(crate::error::AttnError::invalid("batch", format!("device copy differs from the host arrays at word {i}"))),
        }
    }

    fn device_base(&self) -> u64 {
        use cudarc::driver::DevicePtr;
        self.device.device_ptr(&self.stream).0
    }
}

/// The structural checks of [`BatchMetadata::update`], with 64-bit arithmetic throughout.
fn check_arrays(seq_lens: &[i32], qsl: &[i32], ksl: Option<&[i32]>) -> Result<()> {
    let n = seq_lens.len();
    ensure(qsl.len() == n + 1, "query_start_loc", || format!("has {} entries for {n} requests (needs {})", qsl.len(), n + 1))?;
    ensure(qsl[0] == 0, "query_start_loc", || format!("starts at {}, not 0", qsl[0]))?;
    for r in 0..n {
        ensure(qsl[r + 1] >= qsl[r], "query_start_loc", || format!("decreases at request {r} ({} -> {})", qsl[r], qsl[r + 1]))?;
        ensure(seq_lens[r] >= 0, "seq_lens", || format!("request {r} has length {}", seq_lens[r]))?;
    }
    if let Some(k) = ksl {
        ensure(k.len() == n + 1 && k[0] == 0, "key_start_loc", || format!("must have {} entries starting at 0, has {}", n + 1, k.len()))?;
        for r in 0..n {
            let step = k[r + 1] as i64 - k[r] as i64;
            ensure(step == seq_lens[r] as i64, "key_start_loc", || {
                format!("request {r} spans {step} key rows but has length {}", seq_lens[r])
            })?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_bad_block_names_the_first_covered_offender() {
        // Rows of 3; blocks of 16; a cache of 8 blocks.
        let table = [0, 1, 99, /* r1 */ 2, -5, 7, /* r2 */ 3, 8, 4];
        // Request 0 covers 2 entries (its 99 is unused); request 1's second entry is -5.
        assert_eq!(first_bad_block(&table, 3, &[20, 17, 40], 16, 8), Some(BadBlock { request: 1, entry: 1, block: -5, num_blocks: 8 }));
        // With request 0 covering all three entries, its 99 comes first.
        assert_eq!(first_bad_block(&table, 3, &[48, 17, 40], 16, 8).map(|b| (b.request, b.entry, b.block)), Some((0, 2, 99)));
        // Nothing covered is outside: empty requests cover nothing.
        assert_eq!(first_bad_block(&table, 3, &[32, 0, 16], 16, 8), None);
        // A short table (fewer rows than requests) is never indexed past its end.
        assert_eq!(first_bad_block(&table[..3], 3, &[16, 48], 16, 8), None);
    }
}
