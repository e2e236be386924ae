//! [`CpDecode`]: a rank's partial decode result, the exchange of every rank's partial, and
//! their merge by LSE into the output.
//!
//! A rank's partial is its decode over its share of the context: the output rows, laid out as
//! the merged output will be, then their f32 LSEs, in one byte buffer (a "part"), so that one
//! all-gather moves them. After the exchange every rank holds every part, in rank order, and
//! merges them in the same order: the ranks' outputs are bit-for-bit the same.

use super::exchange::CpExchange;
use super::shard::CpShard;
use crate::buffer::{DevIn, DevOut};
use crate::decode::{merge_attn_states, MergeArgs};
use crate::device::AttnDevice;
use crate::dtype::DType;
use crate::error::{ensure, AttnError, Result};
use crate::layout::RowsDesc;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// Where a part's pieces are, for one call's output rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PartLayout {
    /// Elements of the output rows (`out_rows.required_len()`).
    pub out_len: usize,
    /// Byte offset of the LSEs (16-byte aligned).
    pub lse_offset: usize,
    /// `num_tokens * num_heads` f32 LSEs.
    pub lse_len: usize,
    /// Bytes of a part (16-byte aligned, so that every rank's part starts aligned).
    pub bytes: usize,
}

/// The buffers of context-parallel decode on one rank: its part, every rank's part after the
/// exchange, and the merge's intermediate results (three or more ranks). Sized once for the
/// largest step; one per rank and stream.
pub struct CpDecode {
    pub(super) shard: CpShard,
    pub(super) dtype: DType,
    /// Bytes of the largest part.
    capacity: usize,
    pub(super) send: CudaSlice<u8>,
    pub(super) recv: CudaSlice<u8>,
    /// Two parts' room: the running merge, alternating.
    scratch: CudaSlice<u8>,
    pub(super) stream: Arc<CudaStream>,
}

fn align16(bytes: usize) -> Option<usize> {
    bytes.checked_add(15).map(|b| b & !15)
}

impl CpDecode {
    /// Buffers for rank `shard` with outputs of `dtype` (f16 or bf16, the queries') of up to
    /// `max_out_elements` elements (`out_rows.required_len()` of the largest step: `max_tokens *
    /// num_q_heads * head_size` for contiguous rows) and `max_tokens * num_q_heads` LSEs, on
    /// `stream`.
    ///
    /// Errors: a shard that does not validate, another dtype, sizes that overflow; `Driver` when
    /// an allocation fails.
    pub fn new(stream: &Arc<CudaStream>, shard: CpShard, dtype: DType, max_out_elements: usize, max_lse: usize) -> Result<Self> {
        shard.validate()?;
        ensure(matches!(dtype, DType::F16 | DType::BF16), "dtype", || format!("{dtype:?}: decode outputs are f16 or bf16"))?;
        let part = part_layout(dtype, max_out_elements, max_lse).ok_or_else(|| {
            AttnError::invalid("max_out_elements", format!("{max_out_elements} elements and {max_lse} LSEs overflow a usize"))
        })?;
        let all = part.bytes.checked_mul(shard.world_size).ok_or_else(|| {
            AttnError::invalid("max_out_elements", format!("{} bytes x {} ranks overflow a usize", part.bytes, shard.world_size))
        })?;
        let bytes = |n: usize| stream.alloc_zeros::<u8>(n.max(16));
        Ok(CpDecode {
            shard,
            dtype,
            capacity: part.bytes,
            send: bytes(part.bytes)?,
            recv: bytes(all)?,
            scratch: bytes(2 * part.bytes)?,
            stream: stream.clone(),
        })
    }

    /// The dtype of the outputs the buffers hold.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The rank these buffers are for.
    pub fn shard(&self) -> CpShard {
        self.shard
    }

    /// A part's layout for `out_rows`, checked against the buffers' dtype and capacity.
    pub(crate) fn layout(&self, out_rows: &RowsDesc) -> Result<PartLayout> {
        out_rows.validate("out_rows")?;
        let lse_len = out_rows.num_tokens.checked_mul(out_rows.num_heads);
        let part = lse_len.and_then(|l| part_layout(self.dtype, out_rows.required_len(), l));
        let part = part.filter(|p| p.bytes <= self.capacity).ok_or_else(|| {
            AttnError::invalid("out_rows", format!("{out_rows:?} need more than the {} bytes a part was made for", self.capacity))
        })?;
        Ok(part)
    }

    /// Where this rank's decode writes its partial for `out_rows`: the output rows (as
    /// `out_rows` lays them out) and `[num_tokens, num_heads]` f32 LSEs, for
    /// [`paged_decode`](crate::decode::paged_decode)'s `out` and `lse`.
    ///
    /// Errors: rows past the capacity the buffers were made for.
    pub fn partial_out(&mut self, out_rows: &RowsDesc) -> Result<(DevOut<'_>, DevOut<'_>)> {
        let p = self.layout(out_rows)?;
        Ok(self.partial_views(&p))
    }

    /// The views of [`partial_out`](Self::partial_out), unborrowed (the buffers outlive the
    /// launches that write them: they are enqueued on `self.stream`).
    pub(crate) fn partial_views(&self, p: &PartLayout) -> (DevOut<'static>, DevOut<'static>) {
        let base = self.send_ptr();
        (DevOut::owned(base, p.out_len, self.dtype), DevOut::owned(base + p.lse_offset as u64, p.lse_len, DType::F32))
    }

    fn send_ptr(&self) -> u64 {
        let (ptr, _order) = self.send.device_ptr(&self.stream);
        ptr
    }

    fn recv_ptr(&self) -> u64 {
        let (ptr, _order) = self.recv.device_ptr(&self.stream);
        ptr
    }

    /// Merges every rank's part (after an exchange) into `out` (laid out as `out_rows`, the
    /// rows the parts were written with) and, if given, `out_lse` (`[num_tokens, num_heads]`
    /// f32): rank 0's with rank 1's, the result with rank 2's, and so on. Enqueued on `stream`,
    /// which must be the one the buffers were made on.
    ///
    /// Errors: another stream, another dtype or rows than the parts', buffers too small.
    pub fn merge(
        &mut self,
        dev: &AttnDevice,
        stream: &Arc<CudaStream>,
        out: DevOut<'_>,
        out_rows: &RowsDesc,
        out_lse: Option<DevOut<'_>>,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let p = self.layout(out_rows)?;
        let n = self.shard.world_size;
        if n == 1 {
            return Err(AttnError::invalid("shard", "a group of one rank has nothing to merge: decode into the output directly"));
        }
        let (recv, scratch) = (self.recv_ptr(), {
            let (ptr, _order) = self.scratch.device_ptr(stream);
            ptr
        });
        let part_in =
            |base: u64| (DevIn::owned(base, p.out_len, self.dtype), DevIn::owned(base + p.lse_offset as u64, p.lse_len, DType::F32));
        let part_out =
            |base: u64| (DevOut::owned(base, p.out_len, self.dtype), DevOut::owned(base + p.lse_offset as u64, p.lse_len, DType::F32));
        let (mut out, mut out_lse) = (Some(out), out_lse);
        // The running merge alternates between the two scratch parts; the last one goes to `out`.
        let mut acc = recv;
        for i in 1..n {
            let (prefix_out, prefix_lse) = part_in(acc);
            let (suffix_out, suffix_lse) = part_in(recv + (i * p.bytes) as u64);
            let (dst, dst_lse) = if i + 1 == n {
                (out.take().expect("the last merge"), out_lse.take())
            } else {
                let base = scratch + (((i - 1) % 2) * p.bytes) as u64;
                acc = base;
                let (o, l) = part_out(base);
                (o, Some(l))
            };
            let rows = *out_rows;
            let a = MergeArgs {
                prefix_out,
                prefix_lse,
                suffix_out,
                suffix_lse,
                out: dst,
                out_lse: dst_lse,
                rows,
                lse_strides: (rows.num_heads, 1),
            };
            merge_attn_states(dev, stream, a)?;
        }
        Ok(())
    }

    /// Gathers every rank's part for `out_rows` into every rank's buffers through `ex` (its
    /// rank and group size must be the shard's), enqueued on the buffers' stream. Every rank
    /// of the group calls it with the same rows.
    ///
    /// Errors: an exchange of another rank or group size, rows past the capacity, the
    /// exchange's own.
    pub fn exchange_with(&mut self, ex: &mut dyn CpExchange, out_rows: &RowsDesc) -> Result<()> {
        let s = self.shard;
        ensure(ex.rank() == s.rank && ex.world_size() == s.world_size, "exchange", || {
            format!("is rank {} of {}, the buffers are for rank {} of {}", ex.rank(), ex.world_size(), s.rank, s.world_size)
        })?;
        let p = self.layout(out_rows)?;
        // `layout` bounded the part by the capacity: the send buffer holds `p.bytes` and the
        // receive buffer `world_size` times that.
        let send = self.send.slice(..p.bytes);
        let mut recv = self.recv.slice_mut(..p.bytes * s.world_size);
        ex.all_gather(&self.stream, &send, &mut recv)
    }

    pub(super) fn check_stream(&self, stream: &Arc<CudaStream>) -> Result<()> {
        ensure(stream.cu_stream() == self.stream.cu_stream(), "stream", || {
            "differs from the stream the context-parallel buffers were made on".into()
        })
    }

    /// The exchange for ranks that share one device (tests, or running a group's shards on one
    /// GPU): every rank's part for `out_rows` copied into every rank's gather buffer, in rank
    /// order, on `stream` (all ranks' buffers must have been made on it).
    ///
    /// Errors: ranks that are not `0..world_size` of one group in order, another stream, rows
    /// past a rank's capacity.
    pub fn exchange_on_one_device(ranks: &mut [CpDecode], stream: &Arc<CudaStream>, out_rows: &RowsDesc) -> Result<()> {
        let n = ranks.len();
        for (i, r) in ranks.iter().enumerate() {
            ensure(r.shard.rank == i && r.shard.world_size == n, "ranks", || {
                format!("entry {i} is rank {} of {}, not rank {i} of {n}", r.shard.rank, r.shard.world_size)
            })?;
            r.check_stream(stream)?;
        }
        let layouts = ranks.iter().map(|r| r.layout(out_rows)).collect::<Result<Vec<_>>>()?;
        let bytes = layouts[0].bytes;
        let (sends, recvs): (Vec<u64>, Vec<u64>) = ranks.iter().map(|r| (r.send_ptr(), r.recv_ptr())).unzip();
        for (src, &from) in sends.iter().enumerate() {
            for &to in &recvs {
                // SAFETY: both buffers are the ranks' own, allocated for at least `bytes` (send)
                // and `world_size * bytes` (recv), as `layout` checked; the copy is ordered on
                // `stream`, the stream every rank's launches use.
                unsafe { cudarc::driver::result::memcpy_dtod_async(to + (src * bytes) as u64, from, bytes, stream.cu_stream()) }?;
            }
        }
        Ok(())
    }
}

/// A part's layout: `out_len` elements of `dtype`, then (16-byte aligned) `lse_len` f32.
fn part_layout(dtype: DType, out_len: usize, lse_len: usize) -> Option<PartLayout> {
    let lse_offset = align16(out_len.checked_mul(dtype.size_bytes())?)?;
    let bytes = align16(lse_offset.checked_add(lse_len.checked_mul(4)?)?)?;
    Some(PartLayout { out_len, lse_offset, lse_len, bytes })
}
