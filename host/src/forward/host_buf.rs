//! Host memory as the CPU backend takes it: a slice of one of the float element types, with its
//! dtype known at run time (the host counterpart of [`DevIn`](crate::DevIn) /
//! [`DevOut`](crate::DevOut)), so one [`Layer`](super::Layer) type serves every dtype.

use crate::dtype::{DType, Element, Fp8E4m3, Fp8E5m2};
use half::{bf16, f16};

/// A host slice the CPU backend reads.
#[derive(Clone, Copy, Debug)]
pub enum HostIn<'a> {
    /// f16 elements.
    F16(&'a [f16]),
    /// bf16 elements.
    BF16(&'a [bf16]),
    /// f32 elements.
    F32(&'a [f32]),
    /// FP8 E4M3 elements (an FP8 cache).
    Fp8E4m3(&'a [Fp8E4m3]),
    /// FP8 E5M2 elements (an FP8 cache).
    Fp8E5m2(&'a [Fp8E5m2]),
}

/// A host slice the CPU backend writes.
#[derive(Debug)]
pub enum HostOut<'a> {
    /// f16 elements.
    F16(&'a mut [f16]),
    /// bf16 elements.
    BF16(&'a mut [bf16]),
    /// f32 elements.
    F32(&'a mut [f32]),
    /// FP8 E4M3 elements (an FP8 cache).
    Fp8E4m3(&'a mut [Fp8E4m3]),
    /// FP8 E5M2 elements (an FP8 cache).
    Fp8E5m2(&'a mut [Fp8E5m2]),
}

impl HostIn<'_> {
    /// The slice's address (to tell buffers apart).
    pub(crate) fn addr(&self) -> u64 {
        match self {
            HostIn::F16(s) => s.as_ptr() as u64,
            HostIn::BF16(s) => s.as_ptr() as u64,
            HostIn::F32(s) => s.as_ptr() as u64,
            HostIn::Fp8E4m3(s) => s.as_ptr() as u64,
            HostIn::Fp8E5m2(s) => s.as_ptr() as u64,
        }
    }

    /// The element type held.
    pub fn dtype(&self) -> DType {
        match self {
            HostIn::F16(_) => DType::F16,
            HostIn::BF16(_) => DType::BF16,
            HostIn::F32(_) => DType::F32,
            HostIn::Fp8E4m3(_) => DType::Fp8E4m3,
            HostIn::Fp8E5m2(_) => DType::Fp8E5m2,
        }
    }

    /// Elements in the slice.
    pub fn len(&self) -> usize {
        match self {
            HostIn::F16(s) => s.len(),
            HostIn::BF16(s) => s.len(),
            HostIn::F32(s) => s.len(),
            HostIn::Fp8E4m3(s) => s.len(),
            HostIn::Fp8E5m2(s) => s.len(),
        }
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl HostOut<'_> {
    /// The slice's address (to tell buffers apart).
    pub(crate) fn addr(&self) -> u64 {
        match self {
            HostOut::F16(s) => s.as_ptr() as u64,
            HostOut::BF16(s) => s.as_ptr() as u64,
            HostOut::F32(s) => s.as_ptr() as u64,
            HostOut::Fp8E4m3(s) => s.as_ptr() as u64,
            HostOut::Fp8E5m2(s) => s.as_ptr() as u64,
        }
    }

    /// The element type held.
    pub fn dtype(&self) -> DType {
        match self {
            HostOut::F16(_) => DType::F16,
            HostOut::BF16(_) => DType::BF16,
            HostOut::F32(_) => DType::F32,
            HostOut::Fp8E4m3(_) => DType::Fp8E4m3,
            HostOut::Fp8E5m2(_) => DType::Fp8E5m2,
        }
    }

    /// Elements in the slice.
    pub fn len(&self) -> usize {
        match self {
            HostOut::F16(s) => s.len(),
            HostOut::BF16(s) => s.len(),
            HostOut::F32(s) => s.len(),
            HostOut::Fp8E4m3(s) => s.len(),
            HostOut::Fp8E5m2(s) => s.len(),
        }
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The element types a [`HostIn`] / [`HostOut`] holds, and the way back to typed slices.
pub trait HostElement: Element {
    /// `s` as a [`HostIn`] (the same as `s.into()`).
    fn host_in(s: &[Self]) -> HostIn<'_>;
    /// `s` as a [`HostOut`] (the same as `s.into()`).
    fn host_out(s: &mut [Self]) -> HostOut<'_>;
    /// The slice, if `x` holds this type.
    fn from_in<'a>(x: &HostIn<'a>) -> Option<&'a [Self]>;
    /// The slice, if `x` holds this type.
    fn from_out<'s>(x: &'s mut HostOut<'_>) -> Option<&'s mut [Self]>;
}

macro_rules! host_element {
    ($t:ty, $v:ident) => {
        impl HostElement for $t {
            fn host_in(s: &[Self]) -> HostIn<'_> {
                HostIn::$v(s)
            }
            fn host_out(s: &mut [Self]) -> HostOut<'_> {
                HostOut::$v(s)
            }
            fn from_in<'a>(x: &HostIn<'a>) -> Option<&'a [Self]> {
                match *x {
                    HostIn::$v(s) => Some(s),
                    _ => None,
                }
            }
            fn from_out<'s>(x: &'s mut HostOut<'_>) -> Option<&'s mut [Self]> {
                match x {
                    HostOut::$v(s) => Some(s),
                    _ => None,
                }
            }
        }

        impl<'a> From<&'a [$t]> for HostIn<'a> {
            fn from(s: &'a [$t]) -> Self {
                HostIn::$v(s)
            }
        }

        impl<'a> From<&'a Vec<$t>> for HostIn<'a> {
            fn from(s: &'a Vec<$t>) -> Self {
                HostIn::$v(s)
            }
        }

        impl<'a> From<&'a mut [$t]> for HostOut<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                HostOut::$v(s)
            }
        }

        impl<'a> From<&'a mut Vec<$t>> for HostOut<'a> {
            fn from(s: &'a mut Vec<$t>) -> Self {
                HostOut::$v(s)
            }
        }
    };
}

host_element!(f16, F16);
host_element!(bf16, BF16);
host_element!(f32, F32);
host_element!(Fp8E4m3, Fp8E4m3);
host_element!(Fp8E5m2, Fp8E5m2);
