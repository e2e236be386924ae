//! Entry points of the cache writes: `reshape_and_cache_<src>_<cache>` and
//! `concat_and_cache_mla_<src>_<cache>` (`<cache>`: the source's type, `fp8` for E4M3 or `e5m2`). The host builds the same names (host/src/cache_write.rs).

use crate::blocks::device::pdl_prologue;
use crate::blocks::elem::{Bf16, E4m3, E5m2, F16};
use crate::cache_write::token::{concat_and_cache_mla, reshape_and_cache};
use crate::cache_write::writers::{Copy16, F32ToFp8, HalfToFp8};
use attn_math::params::{CacheWriteParams, MlaCacheWriteParams};

/// Entry points, one per (source dtype, cache dtype). Names: `<op>_<src>_<cache>`.
macro_rules! cache_write_kernels {
    ($($suffix:ident => $writer:ty),* $(,)?) => { paste_kernels! { $($suffix => $writer),* } };
}

macro_rules! paste_kernels {
    ($($suffix:ident => $writer:ty),*) => {
        $(
            pub mod $suffix {
                use super::*;
                #[unsafe(export_name = concat!("reshape_and_cache_", stringify!($suffix)))]
                pub unsafe extern "ptx-kernel" fn reshape_and_cache_kernel(p: CacheWriteParams) {
                    pdl_prologue();
                    unsafe { reshape_and_cache::<$writer>(&p) }
                }
                #[unsafe(export_name = concat!("concat_and_cache_mla_", stringify!($suffix)))]
                pub unsafe extern "ptx-kernel" fn concat_and_cache_mla_kernel(p: MlaCacheWriteParams) {
                    pdl_prologue();
                    unsafe { concat_and_cache_mla::<$writer>(&p) }
                }
            }
        )*
    };
}

cache_write_kernels! {
    f16_f16 => Copy16<2>,
    bf16_bf16 => Copy16<2>,
    f32_f32 => Copy16<4>,
    f16_fp8 => HalfToFp8<F16, E4m3>,
    bf16_fp8 => HalfToFp8<Bf16, E4m3>,
    f32_fp8 => F32ToFp8<E4m3>,
    f16_e5m2 => HalfToFp8<F16, E5m2>,
    bf16_e5m2 => HalfToFp8<Bf16, E5m2>,
    f32_e5m2 => F32ToFp8<E5m2>,
}
