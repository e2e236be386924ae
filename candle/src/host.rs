//! CPU tensors as the CPU backend's host slices: a slice of the tensor's storage from its
//! layout's start offset (FP8 viewed as attn-rs's [`Fp8E4m3`], the same byte).

use crate::error::invalid;
use attn_rs::forward::{HostIn, HostOut};
use attn_rs::{Element, Fp8E4m3};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Result, Storage};
use half::{bf16, f16};

/// candle's FP8 E4M3 elements as attn-rs's.
fn fp8(s: &[float8::F8E4M3]) -> &[Fp8E4m3] {
    // SAFETY: both types are `#[repr(transparent)]` over one `u8` (E4M3 "fn": the same
    // encoding, read by attn-rs's conversions), valid for every bit pattern.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<Fp8E4m3>(), s.len()) }
}

fn fp8_mut(s: &mut [float8::F8E4M3]) -> &mut [Fp8E4m3] {
    // SAFETY: as in `fp8`; the borrow is moved into the result.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<Fp8E4m3>(), s.len()) }
}

/// Elements `offset..` of `v`.
fn tail<'a, T>(arg: &str, v: &'a [T], offset: usize) -> Result<&'a [T]> {
    v.get(offset..).ok_or_else(|| invalid(arg, format!("start offset {offset} past its storage of {}", v.len())))
}

fn tail_mut<'a, T>(arg: &str, v: &'a mut [T], offset: usize) -> Result<&'a mut [T]> {
    let len = v.len();
    v.get_mut(offset..).ok_or_else(|| invalid(arg, format!("start offset {offset} past its storage of {len}")))
}

/// A tensor's CPU storage.
pub(crate) fn cpu<'a>(arg: &str, s: &'a Storage) -> Result<&'a CpuStorage> {
    match s {
        Storage::Cpu(s) => Ok(s),
        _ => Err(invalid(arg, "is not a CPU tensor (the other tensors are)")),
    }
}

/// Elements `offset..` of a float storage, for the CPU backend.
pub(crate) fn host_in<'a>(arg: &str, s: &'a CpuStorage, offset: usize) -> Result<HostIn<'a>> {
    Ok(match s {
        CpuStorage::F16(v) => HostIn::F16(tail(arg, v, offset)?),
        CpuStorage::BF16(v) => HostIn::BF16(tail(arg, v, offset)?),
        CpuStorage::F32(v) => HostIn::F32(tail(arg, v, offset)?),
        CpuStorage::F8E4M3(v) => HostIn::Fp8E4m3(fp8(tail(arg, v, offset)?)),
        other => return Err(invalid(arg, format!("dtype {:?}: expected f16, bf16, f32 or f8e4m3", other.dtype()))),
    })
}

/// Elements `offset..` of a float storage, for the CPU backend to write.
pub(crate) fn host_out<'a>(arg: &str, s: &'a mut CpuStorage, offset: usize) -> Result<HostOut<'a>> {
    let dtype = s.dtype();
    Ok(match s {
        CpuStorage::F16(v) => HostOut::F16(tail_mut(arg, v, offset)?),
        CpuStorage::BF16(v) => HostOut::BF16(tail_mut(arg, v, offset)?),
        CpuStorage::F32(v) => HostOut::F32(tail_mut(arg, v, offset)?),
        CpuStorage::F8E4M3(v) => HostOut::Fp8E4m3(fp8_mut(tail_mut(arg, v, offset)?)),
        _ => return Err(invalid(arg, format!("dtype {dtype:?}: expected f16, bf16, f32 or f8e4m3"))),
    })
}

/// The element types of a CPU storage, typed.
pub(crate) trait HostSlice: Element {
    fn of(s: &CpuStorage) -> Option<&[Self]>;
    fn of_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
}

macro_rules! host_slice {
    ($t:ty, $v:ident, $conv:ident, $conv_mut:ident) => {
        impl HostSlice for $t {
            fn of(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$v(v) => Some($conv(v)),
                    _ => None,
                }
            }
            fn of_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$v(v) => Some($conv_mut(v)),
                    _ => None,
                }
            }
        }
    };
}

fn plain<T>(v: &[T]) -> &[T] {
    v
}

fn plain_mut<T>(v: &mut [T]) -> &mut [T] {
    v
}

host_slice!(f16, F16, plain, plain_mut);
host_slice!(bf16, BF16, plain, plain_mut);
host_slice!(f32, F32, plain, plain_mut);
host_slice!(Fp8E4m3, F8E4M3, fp8, fp8_mut);

/// Elements `offset..` of `s` as `T`.
pub(crate) fn typed<'a, T: HostSlice>(arg: &str, s: &'a CpuStorage, offset: usize) -> Result<&'a [T]> {
    let v = T::of(s).ok_or_else(|| invalid(arg, format!("dtype {:?}, expected {:?}", s.dtype(), T::DTYPE)))?;
    tail(arg, v, offset)
}

/// Elements `offset..` of `s` as `T`, to write.
pub(crate) fn typed_mut<'a, T: HostSlice>(arg: &str, s: &'a mut CpuStorage, offset: usize) -> Result<&'a mut [T]> {
    let dtype = s.dtype();
    let v = T::of_mut(s).ok_or_else(|| invalid(arg, format!("dtype {dtype:?}, expected {:?}", T::DTYPE)))?;
    tail_mut(arg, v, offset)
}
