//! Entry points of the merge kernels: `decode_merge_<out>` (split-K's pass 2) and
//! `merge_attn_states_<dtype>`. The host builds the same names (host/src/decode.rs).

use crate::blocks::elem::{Bf16, F16};
use crate::merge::lse_merge::{decode_merge, merge_states, F32Out, Half};
use attn_math::params::{DecodeMergeParams, MergeStatesParams};

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
