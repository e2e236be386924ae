//! The CPU implementation of every op: the reference the GPU tests compare with (written for
//! clarity, element by element) and the path the library runs on when there is no GPU.

use crate::cache_write::{check_kv_shapes, check_mla_shapes, check_write_dtypes};
use crate::dtype::Element;
use crate::error::Result;
use crate::layout::{KvCacheSpec, MlaCacheSpec, RowsDesc};
use attn_math::paging::{resolve_slot, SlotTarget};

/// What a CPU cache write did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteReport {
    pub written: usize,
    pub padding: usize,
    /// Tokens whose slot was past the cache (not written; the GPU raises `SLOT_OUT_OF_RANGE`).
    pub out_of_range: usize,
}

impl WriteReport {
    fn count(&mut self, target: SlotTarget) -> Option<(usize, usize)> {
        match target {
            SlotTarget::Padding => self.padding += 1,
            SlotTarget::OutOfRange => self.out_of_range += 1,
            SlotTarget::At { block, offset } => {
                self.written += 1;
                return Some((block as usize, offset as usize));
            }
        }
        None
    }
}

/// Cache-element value of `x`: a plain conversion, or `x / scale` quantised for an FP8 cache.
fn store<C: Element>(x: f32, scale: f32) -> C {
    if C::DTYPE == crate::dtype::DType::Fp8E4m3 {
        C::from_f32(x * (1.0 / scale))
    } else {
        C::from_f32(x)
    }
}

/// CPU `reshape_and_cache`. `scales` = (k_scale, v_scale), needed for an FP8 cache.
#[allow(clippy::too_many_arguments)]
pub fn reshape_and_cache<T: Element, C: Element>(
    key: &[T],
    key_rows: RowsDesc,
    value: &[T],
    value_rows: RowsDesc,
    slot_mapping: &[i64],
    cache: &mut [C],
    spec: &KvCacheSpec,
    scales: Option<(f32, f32)>,
) -> Result<WriteReport> {
    check_write_dtypes(T::DTYPE, T::DTYPE, C::DTYPE, scales.is_some())?;
    check_kv_shapes(key.len(), &key_rows, value.len(), &value_rows, slot_mapping.len(), cache.len(), spec)?;
    let (k_scale, v_scale) = scales.unwrap_or((1.0, 1.0));
    let mut report = WriteReport::default();
    for (token, &slot) in slot_mapping.iter().take(key_rows.num_tokens).enumerate() {
        let Some((block, offset)) = report.count(resolve_slot(slot, spec.block_size as u32, spec.num_slots() as u64)) else { continue };
        for head in 0..spec.num_kv_heads {
            for dim in 0..spec.head_size {
                cache[spec.offset(0, block, offset, head, dim)] = store(key[key_rows.offset(token, head, dim)].to_f32(), k_scale);
                cache[spec.offset(1, block, offset, head, dim)] = store(value[value_rows.offset(token, head, dim)].to_f32(), v_scale);
            }
        }
    }
    Ok(report)
}

/// CPU `concat_and_cache_mla`.
#[allow(clippy::too_many_arguments)]
pub fn concat_and_cache_mla<T: Element, C: Element>(
    kv_c: &[T],
    kv_c_token_stride: usize,
    k_pe: &[T],
    k_pe_token_stride: usize,
    num_tokens: usize,
    slot_mapping: &[i64],
    cache: &mut [C],
    spec: &MlaCacheSpec,
    scale: Option<f32>,
) -> Result<WriteReport> {
    check_write_dtypes(T::DTYPE, T::DTYPE, C::DTYPE, scale.is_some())?;
    check_mla_shapes(kv_c.len(), kv_c_token_stride, k_pe.len(), k_pe_token_stride, num_tokens, slot_mapping.len(), cache.len(), spec)?;
    let scale = scale.unwrap_or(1.0);
    let mut report = WriteReport::default();
    for (token, &slot) in slot_mapping.iter().take(num_tokens).enumerate() {
        let Some((block, offset)) = report.count(resolve_slot(slot, spec.block_size as u32, spec.num_slots() as u64)) else { continue };
        for col in 0..spec.latent_dim {
            cache[spec.offset(block, offset, col)] = store(kv_c[token * kv_c_token_stride + col].to_f32(), scale);
        }
        for col in 0..spec.rope_dim {
            cache[spec.offset(block, offset, spec.latent_dim + col)] = store(k_pe[token * k_pe_token_stride + col].to_f32(), scale);
        }
    }
    Ok(report)
}
