//! Cascade attention on the GPU ([`ForwardConfig::cascade`](super::ForwardConfig::cascade)): the
//! step's shared prefix attended once by all its query tokens, as one non-causal request on the
//! tensor-core decode kernels (split-K over the prefix), each request's suffix attended as
//! usual, and the two merged by their LSEs with `merge_attn_states`.
//!
//! The suffix parts write into scratch buffers laid out like the layer's output (its strides),
//! so the merge reads both partials and writes the output with one set of strides.

use crate::buffer::{DevIn, DevOut};
use crate::dtype::DType;
use crate::error::Result;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// Scratch for one layer's two partial results (outputs in the layer's dtype and strides, and
/// `[num_tokens, num_q_heads]` f32 LSEs). Grown on first use to the largest layer it served:
/// cascade steps run eagerly (graph steps never cascade), so an allocation here is allowed.
#[derive(Default)]
pub(crate) struct CascadeScratch {
    prefix_out: Option<CudaSlice<u16>>,
    suffix_out: Option<CudaSlice<u16>>,
    prefix_lse: Option<CudaSlice<f32>>,
    suffix_lse: Option<CudaSlice<f32>>,
}

/// The scratch as the ops take it.
pub(crate) struct CascadeTargets {
    pub out_len: usize,
    pub lse_len: usize,
    prefix_out: u64,
    suffix_out: u64,
    prefix_lse: u64,
    suffix_lse: u64,
    dtype: DType,
}

fn grow<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    slot: &mut Option<CudaSlice<T>>,
    len: usize,
    stream: &Arc<CudaStream>,
) -> Result<u64> {
    if slot.as_ref().is_none_or(|s| s.len() < len) {
        *slot = Some(stream.alloc_zeros::<T>(len.max(1))?);
    }
    let buf = slot.as_ref().expect("allocated");
    Ok(buf.device_ptr(stream).0)
}

impl CascadeScratch {
    /// Buffers for `out_len` output elements of a 2-byte `dtype` and `lse_len` LSEs.
    pub(crate) fn targets(&mut self, stream: &Arc<CudaStream>, dtype: DType, out_len: usize, lse_len: usize) -> Result<CascadeTargets> {
        debug_assert_eq!(dtype.size_bytes(), 2, "forward's outputs are f16 or bf16");
        Ok(CascadeTargets {
            out_len,
            lse_len,
            prefix_out: grow(&mut self.prefix_out, out_len, stream)?,
            suffix_out: grow(&mut self.suffix_out, out_len, stream)?,
            prefix_lse: grow(&mut self.prefix_lse, lse_len, stream)?,
            suffix_lse: grow(&mut self.suffix_lse, lse_len, stream)?,
            dtype,
        })
    }
}

impl CascadeTargets {
    /// Where the suffix parts write (output, LSE).
    pub(crate) fn suffix(&self) -> (DevOut<'static>, DevOut<'static>) {
        (DevOut::owned(self.suffix_out, self.out_len, self.dtype), DevOut::owned(self.suffix_lse, self.lse_len, DType::F32))
    }

    /// Where the shared prefix writes (output, LSE).
    pub(crate) fn prefix(&self) -> (DevOut<'static>, DevOut<'static>) {
        (DevOut::owned(self.prefix_out, self.out_len, self.dtype), DevOut::owned(self.prefix_lse, self.lse_len, DType::F32))
    }

    /// Both partials for the merge: (prefix out, prefix LSE, suffix out, suffix LSE).
    pub(crate) fn partials(&self) -> [DevIn<'static>; 4] {
        [
            DevIn::owned(self.prefix_out, self.out_len, self.dtype),
            DevIn::owned(self.prefix_lse, self.lse_len, DType::F32),
            DevIn::owned(self.suffix_out, self.out_len, self.dtype),
            DevIn::owned(self.suffix_lse, self.lse_len, DType::F32),
        ]
    }
}
