//! Entry points of the attention kernels, one per (dtypes, head size, rows per CTA).
//! Names: `decode_<q>_<cache>_d<head_size>_r<rows>`, `decode_merge_<out>`,
//! `merge_attn_states_<dtype>`. The host builds the same names (host/src/decode.rs).

use crate::decode::decode;
use crate::elem::{Bf16, Fp8Cache, HalfCache, F16};
use crate::merge::{decode_merge, merge_states, F32Out, Half};
use attn_math::params::{DecodeMergeParams, DecodeParams, MergeStatesParams};

macro_rules! decode_kernels {
    ($q:ident, $qname:literal, $cache:ty, $cname:literal: $(($d:literal, $vpl:literal: $($rows:literal),*)),*) => {
        $($(
            const _: () = {
                #[unsafe(export_name = concat!("decode_", $qname, "_", $cname, "_d", $d, "_r", $rows))]
                unsafe extern "ptx-kernel" fn kernel(p: DecodeParams) {
                    unsafe { decode::<$q, $cache, $d, $rows, $vpl>(&p) }
                }
            };
        )*)*
    };
}

// Rows per CTA are bounded so that the per-lane accumulators (rows x head_size/8 floats) stay
// in registers; more rows run as more CTAs (grid.z).
macro_rules! decode_family {
    ($q:ident, $qname:literal, $cache:ty, $cname:literal) => {
        decode_kernels!($q, $qname, $cache, $cname: (64, 1: 1, 2, 4, 8), (96, 2: 1, 2, 4), (128, 2: 1, 2, 4), (256, 4: 1, 2));
    };
}

decode_family!(F16, "f16", HalfCache<F16>, "f16");
decode_family!(Bf16, "bf16", HalfCache<Bf16>, "bf16");
decode_family!(F16, "f16", Fp8Cache, "fp8");
decode_family!(Bf16, "bf16", Fp8Cache, "fp8");

macro_rules! merge_kernels {
    ($($name:literal => $out:ty),*) => {
        $(
            const _: () = {
                #[unsafe(export_name = concat!("decode_merge_", $name))]
                unsafe extern "ptx-kernel" fn merge_kernel(p: DecodeMergeParams) {
                    unsafe { decode_merge::<$out>(&p) }
                }
                #[unsafe(export_name = concat!("merge_attn_states_", $name))]
                unsafe extern "ptx-kernel" fn states_kernel(p: MergeStatesParams) {
                    unsafe { merge_states::<$out>(&p) }
                }
            };
        )*
    };
}

merge_kernels!("f16" => Half<F16>, "bf16" => Half<Bf16>, "f32" => F32Out);
