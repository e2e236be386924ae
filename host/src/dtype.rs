//! Element types of the buffers the library reads and writes.

use attn_math::fp8::{e4m3_to_f32, e5m2_to_f32, f32_to_e4m3, f32_to_e5m2};
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

/// The element type of a buffer, carried by [`DevIn`](crate::DevIn)/[`DevOut`](crate::DevOut)
/// and checked by every op against what it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE half precision ([`half::f16`]).
    F16,
    /// bfloat16 ([`half::bf16`]).
    BF16,
    /// IEEE single precision.
    F32,
    /// FP8 E4M3 (`e4m3fn`), stored with a per-tensor or per-head scale.
    Fp8E4m3,
    /// FP8 E5M2, stored with a per-tensor or per-head scale.
    Fp8E5m2,
    /// 32-bit signed integers (block tables, start locations, lengths).
    I32,
    /// 64-bit signed integers (slot mappings).
    I64,
    /// 32-bit unsigned integers (status words).
    U32,
}

impl DType {
    /// Bytes per element (1 for FP8, 2 for f16/bf16, 4, or 8 for i64).
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::Fp8E4m3 | DType::Fp8E5m2 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::I64 => 8,
        }
    }

    /// The FP8 format of an FP8 type.
    pub const fn fp8_format(self) -> Option<Fp8Format> {
        match self {
            DType::Fp8E4m3 => Some(Fp8Format::E4m3),
            DType::Fp8E5m2 => Some(Fp8Format::E5m2),
            _ => None,
        }
    }

    /// One of the FP8 types.
    pub const fn is_fp8(self) -> bool {
        self.fp8_format().is_some()
    }

    /// The name used in kernel entry points (`reshape_and_cache_bf16_fp8`).
    pub(crate) const fn kernel_name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::Fp8E4m3 => "fp8",
            DType::Fp8E5m2 => "e5m2",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U32 => "u32",
        }
    }
}

/// The two FP8 cache formats ([`DType::Fp8E4m3`], [`DType::Fp8E5m2`]): E4M3 has the precision
/// (3 mantissa bits, to 448), E5M2 the range (2 mantissa bits, to 57344).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// [`DType::Fp8E4m3`].
    E4m3,
    /// [`DType::Fp8E5m2`].
    E5m2,
}

impl Fp8Format {
    /// The dtype of a cache in this format.
    pub const fn dtype(self) -> DType {
        match self {
            Fp8Format::E4m3 => DType::Fp8E4m3,
            Fp8Format::E5m2 => DType::Fp8E5m2,
        }
    }
}

/// One FP8 E4M3 value (its byte). A cache of this type stores `x / scale`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fp8E4m3(pub u8);

// SAFETY: a plain byte, valid for any bit pattern, with no padding.
unsafe impl DeviceRepr for Fp8E4m3 {}
unsafe impl ValidAsZeroBits for Fp8E4m3 {}

/// One FP8 E5M2 value (its byte). A cache of this type stores `x / scale`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fp8E5m2(pub u8);

// SAFETY: a plain byte, valid for any bit pattern, with no padding.
unsafe impl DeviceRepr for Fp8E5m2 {}
unsafe impl ValidAsZeroBits for Fp8E5m2 {}

/// A type the library moves between host and device, with its dtype and (for the CPU path and
/// the tests) its value as f32/f64.
pub trait Element: DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + 'static {
    /// The run-time dtype of this type.
    const DTYPE: DType;
    /// The value as an f32 (exact for every type but i32/i64/u32 beyond 2^24).
    fn to_f32(self) -> f32;
    /// Round to nearest even (saturating for FP8).
    fn from_f32(x: f32) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr, |$x:ident| $to:expr, |$y:ident| $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn to_f32(self) -> f32 {
                let $x = self;
                $to
            }
            #[inline]
            fn from_f32($y: f32) -> Self {
                $from
            }
        }
    };
}

element!(f16, DType::F16, |x| x.to_f32(), |y| f16::from_f32(y));
element!(bf16, DType::BF16, |x| x.to_f32(), |y| bf16::from_f32(y));
element!(f32, DType::F32, |x| x, |y| y);
element!(Fp8E4m3, DType::Fp8E4m3, |x| e4m3_to_f32(x.0), |y| Fp8E4m3(f32_to_e4m3(y)));
element!(Fp8E5m2, DType::Fp8E5m2, |x| e5m2_to_f32(x.0), |y| Fp8E5m2(f32_to_e5m2(y)));
element!(i32, DType::I32, |x| x as f32, |y| y as i32);
element!(i64, DType::I64, |x| x as f32, |y| y as i64);
element!(u32, DType::U32, |x| x as f32, |y| y as u32);
