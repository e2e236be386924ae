//! Entry points of the tensor-core prefill kernels: `prefill_<dtype>_dk<qk>_dv<v>`. The host
//! builds the same names (host/src/prefill.rs).

use crate::elem::{Bf16, F16};
use crate::prefill::prefill;
use attn_math::params::PrefillParams;
use attn_math::prefill::block_n;

macro_rules! prefill_kernels {
    ($q:ident, $qname:literal: $(($dk:literal, $dv:literal)),*) => {
        $(
            const _: () = {
                #[unsafe(export_name = concat!("prefill_", $qname, "_dk", $dk, "_dv", $dv))]
                unsafe extern "ptx-kernel" fn kernel(p: PrefillParams) {
                    unsafe { prefill::<$q, $dk, $dv, { block_n($dk, $dv) as usize }>(&p) }
                }
            };
        )*
    };
}

prefill_kernels!(F16, "f16": (64, 64), (96, 96), (128, 128), (256, 256), (192, 128));
prefill_kernels!(Bf16, "bf16": (64, 64), (96, 96), (128, 128), (256, 256), (192, 128));
