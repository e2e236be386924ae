//! Entry points of the tensor-core attention kernels: `prefill_<dtype>[<fp8>]_dk<qk>_dv<v>` (rows
//! split across warps), `prefill_local_<dtype>_dk<d>_dv<d>` (the same with the local masks) and
//! `decode_tc_<dtype>[<fp8>]_d<head_size>` (keys split across warps); the keys-as-rows decode
//! kernels, the Hopper prefill kernels and the MLA kernels (dense and sparse). `<fp8>`: an FP8
//! cache, `_fp8` (E4M3) or `_e5m2`, and with `_a8` after it the same for a head size that is an
//! odd multiple of 8 (rows that start 8-byte aligned, copied in 8-byte halves). The host builds
//! the same names (host/src/kernels.rs).

use crate::attention::config::{AttnConfig, Bits16, Fp8E4M3, Fp8E4M3A8, Fp8E5M2, Fp8E5M2A8};
#[cfg(wgmma)]
use crate::attention::hopper::half_mma::{Mma16, MmaFp8};
use crate::attention::mainloop::attention;
use crate::attention::mla::kernel::mla_attention;
use crate::attention::mla::keys::{IndexedKeys, PagedKeys};
use crate::blocks::elem::{Bf16, F16};
#[cfg(wgmma)]
use crate::blocks::elem::{E4m3, E5m2};
use attn_math::params::AttnParams;

/// A kernel `$name` running [`attention`] for a config of queries `$q`, tensor-core inputs `$m`,
/// cache `$cache`, head sizes `$dk` / `$dv` and shape `$keys` (the rest of the shape follows:
/// [`AttnConfig`]'s defaults).
macro_rules! attention_kernel {
    ($name:expr, $q:ident, $m:ident, $cache:ident, $dk:literal, $dv:literal, keys_split: $keys:literal) => {
        attention_kernel!($name, $q, $m, $cache, $dk, $dv, keys_split: $keys, local: false);
    };
    ($name:expr, $q:ident, $m:ident, $cache:ident, $dk:literal, $dv:literal, keys_split: $keys:literal, local: $local:literal) => {
        const _: () = {
            struct Config;
            impl AttnConfig for Config {
                type Q = $q;
                type M = $m;
                type Cache = $cache;
                const DK: usize = $dk;
                const DV: usize = $dv;
                const KEYS: bool = $keys;
                const LOCAL: bool = $local;
            }
            #[unsafe(export_name = $name)]
            unsafe extern "ptx-kernel" fn kernel(p: AttnParams) {
                unsafe { attention::<Config, { Config::MT }>(&p) }
            }
        };
    };
}

/// `$mac!($args... <cache>, <tag>)` for each FP8 cache type: E4M3 (`_fp8`) and E5M2 (`_e5m2`),
/// each also for rows of a head size that is an odd multiple of 8 (`_a8`).
macro_rules! for_each_fp8_cache {
    ($mac:ident!($($args:tt)*)) => {
        $mac!($($args)* Fp8E4M3, "_fp8");
        $mac!($($args)* Fp8E4M3A8, "_fp8_a8");
        $mac!($($args)* Fp8E5M2, "_e5m2");
        $mac!($($args)* Fp8E5M2A8, "_e5m2_a8");
    };
}

/// The FP8 kernels of the `mma.sync` shapes: `prefill_<q><tag>_dk<d>_dv<d>` and
/// `decode_tc_<q><tag>_d<d>` over cache rows `$cache`.
macro_rules! fp8_attention_kernel {
    (prefill, $q:ident, $qname:literal, $d:literal, $cache:ident, $tag:literal) => {
        attention_kernel!(concat!("prefill_", $qname, $tag, "_dk", $d, "_dv", $d), $q, F16, $cache, $d, $d, keys_split: false);
    };
    (decode, $q:ident, $qname:literal, $d:literal, $cache:ident, $tag:literal) => {
        attention_kernel!(concat!("decode_tc_", $qname, $tag, "_d", $d), $q, F16, $cache, $d, $d, keys_split: true);
    };
}

macro_rules! prefill_kernels {
    ($q:ident, $qname:literal: $(($dk:literal, $dv:literal)),*) => {
        $(
            attention_kernel!(concat!("prefill_", $qname, "_dk", $dk, "_dv", $dv), $q, $q, Bits16, $dk, $dv, keys_split: false);
        )*
    };
}

// The FP8 prefill kernels, and the keys-split decode shape with 16-row score tiles
// (`decode_tc_*`) where the keys-as-rows kernels do not reach: 16-bit caches at head size 256
// (9 to 16 rows per kv head) and FP8 caches at width 256 (FP8 runs the width-96 head sizes at
// 128: `attn_math::decode::decode_width`).
macro_rules! decode_kernels {
    ($q:ident, $qname:literal: $($d:literal),*; tc_fp8: $($d8:literal),*; tc_16bit: $($d16:literal),*) => {
        $(
            for_each_fp8_cache!(fp8_attention_kernel!(prefill, $q, $qname, $d,));
        )*
        $(
            for_each_fp8_cache!(fp8_attention_kernel!(decode, $q, $qname, $d8,));
        )*
        $(
            attention_kernel!(concat!("decode_tc_", $qname, "_d", $d16), $q, $q, Bits16, $d16, $d16, keys_split: true);
        )*
    };
}

// The prefill shape with the local masks compiled in (`AttnConfig::LOCAL`), 16-bit caches:
// `prefill_local_<q>_dk<d>_dv<d>` (chunked local attention, encoders' symmetric window).
macro_rules! prefill_local_kernels {
    ($q:ident, $qname:literal: $($d:literal),*) => {
        $(
            attention_kernel!(concat!("prefill_local_", $qname, "_dk", $d, "_dv", $d), $q, $q, Bits16, $d, $d, keys_split: false, local: true);
        )*
    };
}

prefill_kernels!(F16, "f16": (64, 64), (96, 96), (128, 128), (256, 256), (192, 128));
prefill_kernels!(Bf16, "bf16": (64, 64), (96, 96), (128, 128), (256, 256), (192, 128));
decode_kernels!(F16, "f16": 64, 96, 128, 256; tc_fp8: 256; tc_16bit: 256);
decode_kernels!(Bf16, "bf16": 64, 96, 128, 256; tc_fp8: 256; tc_16bit: 256);
prefill_local_kernels!(F16, "f16": 64, 96, 128, 256);
prefill_local_kernels!(Bf16, "bf16": 64, 96, 128, 256);

// Keys-as-rows decode (`crate::attention::keys_rows`), up to 8 rows per kv head:
// `decode_kr_<q>[_long]_d<head_size>` (16-bit caches; `_long` at 128 only) and
// `decode_kr_<q><fp8>[_long]_d<head_size>` (`_long` at 128 and 256, at 256 only that); up to 16:
// `decode_kr_<q>_r16_d<head_size>` (16-bit caches) and `decode_kr_<q><fp8>_long_r16_d<head_size>`
// (FP8 at 64 and 128, every length; CTAs per SM: `attn_math::keys_rows::ctas_per_sm`).
macro_rules! keys_rows_kernels {
    ($q:ident, $qname:literal: $($d:literal),*; long: $($dl:literal),*; r16: $($d16:literal),*; fp8: $($d8:literal),*; fp8_long: $($d8l:literal),*; fp8_r16: $($d8w:literal),*) => {
        $(
            const _: () = {
                #[unsafe(export_name = concat!("decode_kr_", $qname, "_d", $d))]
                unsafe extern "ptx-kernel" fn kernel(p: AttnParams) {
                    unsafe { crate::attention::keys_rows::decode_keys_rows_half::<$q, $d, false, 1, 8>(&p) }
                }
            };
        )*
        $(
            const _: () = {
                #[unsafe(export_name = concat!("decode_kr_", $qname, "_long_d", $dl))]
                unsafe extern "ptx-kernel" fn kernel(p: AttnParams) {
                    unsafe { crate::attention::keys_rows::decode_keys_rows_half::<$q, $dl, true, 1, 8>(&p) }
                }
            };
        )*
        $(
            const _: () = {
                #[unsafe(export_name = concat!("decode_kr_", $qname, "_r16_d", $d16))]
                unsafe extern "ptx-kernel" fn kernel(p: AttnParams) {
                    unsafe { crate::attention::keys_rows::decode_keys_rows_half::<$q, $d16, false, 2, 16>(&p) }
                }
            };
        )*
        $(
            for_each_fp8_cache!(keys_rows_kernels!(fp8: $q, $qname, $d8,));
        )*
        $(
            for_each_fp8_cache!(keys_rows_kernels!(fp8_long: $q, $qname, $d8l,));
        )*
        $(
            for_each_fp8_cache!(keys_rows_kernels!(fp8_r16: $q, $qname, $d8w,));
        )*
    };
    (fp8_long: $q:ident, $qname:literal, $d8:literal, $cache:ident, $tag:literal) => {
        const _: () = {
            #[unsafe(export_name = concat!("decode_kr_", $qname, $tag, "_long_d", $d8))]
            unsafe extern "ptx-kernel" fn kernel(p: AttnParams) {
                unsafe { crate::attention::keys_rows::decode_keys_rows_fp8::<$q, $cache, $d8, true, 1, 8>(&p) }
            }
        };
    };
    (fp8: $q:ident, $qname:literal, $d8:literal, $cache:ident, $tag:literal) => {
        const _: () = {
            #[unsafe(export_name = concat!("decode_kr_", $qname, $tag, "_d", $d8))]
            unsafe extern "ptx-kernel" fn kernel(p: AttnParams) {
                unsafe { crate::attention::keys_rows::decode_keys_rows_fp8::<$q, $cache, $d8, false, 1, 8>(&p) }
            }
        };
    };
    (fp8_r16: $q:ident, $qname:literal, $d8:literal, $cache:ident, $tag:literal) => {
        const _: () = {
            #[unsafe(export_name = concat!("decode_kr_", $qname, $tag, "_long_r16_d", $d8))]
            unsafe extern "ptx-kernel" fn kernel(p: AttnParams) {
                unsafe { crate::attention::keys_rows::decode_keys_rows_fp8::<$q, $cache, $d8, true, 2, 16>(&p) }
            }
        };
    };
}

keys_rows_kernels!(F16, "f16": 64, 96, 128, 256; long: 128; r16: 64, 96, 128; fp8: 64, 128; fp8_long: 128, 256; fp8_r16: 64, 128);
keys_rows_kernels!(Bf16, "bf16": 64, 96, 128, 256; long: 128; r16: 64, 96, 128; fp8: 64, 128; fp8_long: 128, 256; fp8_r16: 64, 128);

// Decode on `wgmma` with the keys on M (`crate::attention::keys_m`, sm_90a only): FP8 caches up
// to 8 rows per kv head (at width 128 whole 16-byte rows only) or 16 (`_r16`),
// `decode_km_<q><fp8>[_r16]_d<128|256>`; 16-bit caches at
// 16 rows, `decode_km_<q>_r16_d<64|128>`, and up to 8 at width 64, `decode_km_<q>_d64`.
#[cfg(wgmma)]
macro_rules! keys_m_kernels {
    // Width 128 at up to 8 rows only for whole 16-byte rows: below head size 128 FP8 takes these
    // kernels at 9 to 16 rows only (`decode::kernel::fp8_wgmma_pays` on the host), and every
    // `_a8` head size of width 128 is below 128.
    (aligned: $q:ident, $qname:literal, $cache:ident, $tag:literal) => {
        keys_m_kernels!(@fp8 $q, $qname, $cache, $tag, 128, "", 1, 8);
    };
    ($q:ident, $qname:literal, $cache:ident, $tag:literal) => {
        keys_m_kernels!(@fp8 $q, $qname, $cache, $tag, 128, "_r16", 2, 16);
        keys_m_kernels!(@fp8 $q, $qname, $cache, $tag, 256, "", 1, 8);
        keys_m_kernels!(@fp8 $q, $qname, $cache, $tag, 256, "_r16", 2, 16);
    };
    (@fp8 $q:ident, $qname:literal, $cache:ident, $tag:literal, $d:literal, $wide:literal, $g:literal, $rows:literal) => {
        const _: () = {
            #[unsafe(export_name = concat!("decode_km_", $qname, $tag, $wide, "_d", $d))]
            unsafe extern "ptx-kernel" fn kernel(p: AttnParams) {
                unsafe { crate::attention::keys_m::decode_keys_m_fp8::<$q, $cache, $d, $g, $rows>(&p) }
            }
        };
    };
    (@half $q:ident, $qname:literal: $(($d:literal, $wide:literal, $g:literal, $rows:literal)),*) => {
        $(
            const _: () = {
                #[unsafe(export_name = concat!("decode_km_", $qname, $wide, "_d", $d))]
                unsafe extern "ptx-kernel" fn kernel(p: AttnParams) {
                    unsafe { crate::attention::keys_m::decode_keys_m_half::<$q, $d, $g, $rows>(&p) }
                }
            };
        )*
    };
}

#[cfg(wgmma)]
for_each_fp8_cache!(keys_m_kernels!(F16, "f16",));
#[cfg(wgmma)]
for_each_fp8_cache!(keys_m_kernels!(Bf16, "bf16",));
#[cfg(wgmma)]
keys_m_kernels!(aligned: F16, "f16", Fp8E4M3, "_fp8");
#[cfg(wgmma)]
keys_m_kernels!(aligned: F16, "f16", Fp8E5M2, "_e5m2");
#[cfg(wgmma)]
keys_m_kernels!(aligned: Bf16, "bf16", Fp8E4M3, "_fp8");
#[cfg(wgmma)]
keys_m_kernels!(aligned: Bf16, "bf16", Fp8E5M2, "_e5m2");
#[cfg(wgmma)]
keys_m_kernels!(@half F16, "f16": (64, "", 1, 8), (64, "_r16", 2, 16), (128, "_r16", 2, 16));
#[cfg(wgmma)]
keys_m_kernels!(@half Bf16, "bf16": (64, "", 1, 8), (64, "_r16", 2, 16), (128, "_r16", 2, 16));

// Prefill on Hopper's warpgroup MMA (sm_90a only): `<prefix>_<q><cache>_d<width>` running
// `crate::attention::hopper::$module::$func::<Q, Cache, Mma, D, W, D, W>` (width `D` on shared-memory
// rows `W` wide; `<cache>`: "" for 16-bit K/V, else the FP8 cache's tag; `Mma`: the step's
// MMAs, on 16-bit operands or on e4m3 queries and weights with the cache's FP8 keys and values);
// with `pairs:`, `<prefix>_<q><cache>_dk<qk>_dv<v>` for unequal head sizes (rows as wide as each).
#[cfg(wgmma)]
macro_rules! prefill_wgmma_kernels {
    ($prefix:literal, $module:ident::$func:ident, $q:ident, $qname:literal, $cache:ident, $cname:literal, $mma:ty: $(($d:literal, $w:literal)),*) => {
        $(
            prefill_wgmma_kernels!(@one concat!($prefix, "_", $qname, $cname, "_d", $d), $module::$func, $q, $cache, $mma, $d, $w, $d, $w);
        )*
    };
    ($prefix:literal, $module:ident::$func:ident, $q:ident, $qname:literal, $cache:ident, $cname:literal, $mma:ty, pairs: $(($dk:literal, $dv:literal)),*) => {
        $(
            prefill_wgmma_kernels!(@one concat!($prefix, "_", $qname, $cname, "_dk", $dk, "_dv", $dv), $module::$func, $q, $cache, $mma, $dk, $dk, $dv, $dv);
        )*
    };
    (@one $name:expr, $module:ident::$func:ident, $q:ident, $cache:ident, $mma:ty, $d:literal, $w:literal, $dv:literal, $wv:literal) => {
        const _: () = {
            #[unsafe(export_name = $name)]
            unsafe extern "ptx-kernel" fn kernel(p: attn_math::params::WgsParams) {
                // The tensor maps' generic address in the parameter space, which
                // `cp.async.bulk.tensor` reads them from (a Rust reference to them would be
                // a copy in local memory). The parameter is named after the kernel.
                let params: u64;
                unsafe {
                    core::arch::asm!(
                        concat!("mov.b64 {0}, ", $name, "_param_0;"),
                        "cvta.param.u64 {0}, {0};",
                        out(reg64) params,
                        options(nomem, nostack, pure)
                    )
                };
                let maps = params + core::mem::offset_of!(attn_math::params::WgsParams, kv_maps) as u64;
                unsafe { crate::attention::hopper::$module::$func::<$q, $cache, $mma, $d, $w, $dv, $wv>(&p.attn, &p.kv_maps, maps) }
            }
        };
    };
}

// A producer warpgroup, persistent CTAs: `prefill_wgs_<q>_d<64|80|96|112|128|256>`, and from
// an FP8 cache `prefill_wgs_<q><fp8>_d<64|80|96|112|128|256>` (widths 64 and 256 on converted
// 16-bit rows, the others on FP8 `wgmma`).
#[cfg(wgmma)]
prefill_wgmma_kernels!("prefill_wgs", prefill_specialized::prefill_specialized, F16, "f16", Bits16, "", Mma16<F16>: (64, 64), (80, 128), (96, 128), (112, 128), (128, 128), (256, 256));
#[cfg(wgmma)]
prefill_wgmma_kernels!("prefill_wgs", prefill_specialized::prefill_specialized, Bf16, "bf16", Bits16, "", Mma16<Bf16>: (64, 64), (80, 128), (96, 128), (112, 128), (128, 128), (256, 256));
// QK 192 / V 128 from 16-bit K/V: `prefill_wgs_<q>_dk192_dv128`.
#[cfg(wgmma)]
prefill_wgmma_kernels!("prefill_wgs", prefill_specialized::prefill_specialized, F16, "f16", Bits16, "", Mma16<F16>, pairs: (192, 128));
#[cfg(wgmma)]
prefill_wgmma_kernels!("prefill_wgs", prefill_specialized::prefill_specialized, Bf16, "bf16", Bits16, "", Mma16<Bf16>, pairs: (192, 128));
// From each FP8 cache: widths 64 and 256 (not for rows 8-byte aligned: `ws_takes_a8`) on
// converted 16-bit rows, the others on FP8 `wgmma`.
#[cfg(wgmma)]
macro_rules! prefill_wgs_fp8_kernels {
    ($cache:ident, $tag:literal, $fp8:ident: $(($d:literal, $w:literal)),*) => {
        prefill_wgmma_kernels!("prefill_wgs", prefill_specialized::prefill_specialized, F16, "f16", $cache, $tag, Mma16<F16>: $(($d, $w)),*);
        prefill_wgmma_kernels!("prefill_wgs", prefill_specialized::prefill_specialized, Bf16, "bf16", $cache, $tag, Mma16<Bf16>: $(($d, $w)),*);
        prefill_wgmma_kernels!("prefill_wgs", prefill_specialized::prefill_specialized, F16, "f16", $cache, $tag, MmaFp8<$fp8>: (80, 128), (96, 128), (112, 128), (128, 128));
        prefill_wgmma_kernels!("prefill_wgs", prefill_specialized::prefill_specialized, Bf16, "bf16", $cache, $tag, MmaFp8<$fp8>: (80, 128), (96, 128), (112, 128), (128, 128));
    };
}
#[cfg(wgmma)]
prefill_wgs_fp8_kernels!(Fp8E4M3, "_fp8", E4m3: (64, 64), (256, 256));
#[cfg(wgmma)]
prefill_wgs_fp8_kernels!(Fp8E4M3A8, "_fp8_a8", E4m3: (64, 64));
#[cfg(wgmma)]
prefill_wgs_fp8_kernels!(Fp8E5M2, "_e5m2", E5m2: (64, 64), (256, 256));
#[cfg(wgmma)]
prefill_wgs_fp8_kernels!(Fp8E5M2A8, "_e5m2_a8", E5m2: (64, 64));

// MLA on its own kernel: Q K^T once per tile, P shared by warps owning output columns.
// `mla_<q>[<fp8>]_{narrow,wide}` (shapes in `attn_math::mla`; `<fp8>`: `_fp8` (E4M3) or `_e5m2`),
// and the same kernel over each query token's index list, `mla_sparse_<q>[<fp8>]_{narrow,wide}`.
macro_rules! mla_latent_kernels {
    ($q:ident, $qname:literal, $tag:literal, $cache:ident) => {
        mla_latent_kernels!($q, concat!("mla_", $qname, $tag), $cache, PagedKeys);
        mla_latent_kernels!($q, concat!("mla_sparse_", $qname, $tag), $cache, IndexedKeys);
    };
    ($q:ident, $prefix:expr, $cache:ident, $keys:ident) => {
        const _: () = {
            #[unsafe(export_name = concat!($prefix, "_narrow"))]
            unsafe extern "ptx-kernel" fn kernel(p: AttnParams) {
                unsafe { mla_attention::<$q, false, $cache, $keys>(&p) }
            }
        };
        const _: () = {
            #[unsafe(export_name = concat!($prefix, "_wide"))]
            unsafe extern "ptx-kernel" fn kernel(p: AttnParams) {
                unsafe { mla_attention::<$q, true, $cache, $keys>(&p) }
            }
        };
    };
}

mla_latent_kernels!(Bf16, "bf16", "", Bits16);
mla_latent_kernels!(F16, "f16", "", Bits16);
mla_latent_kernels!(Bf16, "bf16", "_fp8", Fp8E4M3);
mla_latent_kernels!(F16, "f16", "_fp8", Fp8E4M3);
mla_latent_kernels!(Bf16, "bf16", "_e5m2", Fp8E5M2);
mla_latent_kernels!(F16, "f16", "_e5m2", Fp8E5M2);
