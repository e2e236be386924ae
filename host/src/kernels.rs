//! [`KernelId`]: every kernel the host launches, by what tells the kernels apart (family, types,
//! head sizes, pipeline). Plans and launches carry a `KernelId`; its PTX entry name
//! ([`KernelId::entry_name`], the name the kernels' export macros give it) is made only where
//! the device looks the function up in its module.

use crate::dtype::{DType, Fp8Format};
use crate::error::{ensure, Result};
use crate::ptx::Family;
use std::fmt;

/// The width the standard (QK = V) kernels run head size `d` at (`attn_math::decode::width`),
/// or an error naming `arg` when they do not take it: a multiple of 8 from 32 to 256, with a
/// 16-bit or an FP8 cache.
pub(crate) fn head_width(arg: &'static str, d: usize) -> Result<u32> {
    use attn_math::decode::{takes_head_size, width, MAX_HEAD_SIZE, MIN_HEAD_SIZE};
    let taken = u32::try_from(d).ok().filter(|&d| takes_head_size(d));
    ensure(taken.is_some(), arg, || format!("{d}: the GPU kernels take multiples of 8 from {MIN_HEAD_SIZE} to {MAX_HEAD_SIZE}"))?;
    Ok(taken.and_then(width).expect("every head size taken has a width"))
}

/// The rows a standard kernel reads from the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CacheRows {
    /// 16-bit rows of the queries' type.
    Bits16,
    /// FP8 rows of `format`; `a8`: rows that may start only 8-byte aligned (a head size that is
    /// an odd multiple of 8: the `_a8` kernels, which copy each 16-byte chunk as two 8-byte
    /// halves).
    Fp8 { format: Fp8Format, a8: bool },
}

impl CacheRows {
    /// The rows of a cache of type `cache` at head size `d` (16-bit unless `cache` is FP8).
    pub(crate) fn of(cache: DType, d: usize) -> CacheRows {
        match cache.fp8_format() {
            Some(format) => CacheRows::Fp8 { format, a8: d % 16 == 8 },
            None => CacheRows::Bits16,
        }
    }

    /// FP8 rows.
    pub(crate) fn is_fp8(self) -> bool {
        matches!(self, CacheRows::Fp8 { .. })
    }

    /// The part of an entry name that names them: "", `_fp8` (E4M3), `_e5m2`, then `_a8`.
    fn tag(self) -> &'static str {
        match self {
            CacheRows::Bits16 => "",
            CacheRows::Fp8 { format: Fp8Format::E4m3, a8: false } => "_fp8",
            CacheRows::Fp8 { format: Fp8Format::E4m3, a8: true } => "_fp8_a8",
            CacheRows::Fp8 { format: Fp8Format::E5m2, a8: false } => "_e5m2",
            CacheRows::Fp8 { format: Fp8Format::E5m2, a8: true } => "_e5m2_a8",
        }
    }
}

/// The entry-name tag of an MLA cache or a cache write's FP8 format ("" for none).
fn fp8_tag(fp8: Option<Fp8Format>) -> &'static str {
    fp8.map_or("", |format| CacheRows::Fp8 { format, a8: false }.tag())
}

/// [`head_width`] for decode: the width `attn_math::decode::decode_width` picks.
pub(crate) fn decode_head_width(arg: &'static str, d: usize, fp8: bool) -> Result<u32> {
    head_width(arg, d)?;
    Ok(attn_math::decode::decode_width(d as u32, fp8).expect("every head size taken has a width"))
}

/// The MLA kernel's two CTA shapes (`attn_math::mla::NARROW`, `WIDE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MlaTile {
    /// 16 query rows a tile (memory-bound decode).
    Narrow,
    /// 64 query rows a tile (many heads, compute-bound).
    Wide,
}

/// A kernel the host launches. `q`, `src` and `out` are the 16-bit (or f32) types of queries,
/// sources and outputs; `rows` the cache rows the standard kernels read ([`CacheRows`]); `fp8`
/// the FP8 format of an MLA cache or a cache write's destination (else the cache has the
/// query's or source's type). [`KernelId::all`] lists every one the committed modules export.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// `reshape_and_cache_<src>_<cache>`: K/V rows into the paged cache.
    ReshapeAndCache { src: DType, fp8: Option<Fp8Format> },
    /// `concat_and_cache_mla_<src>_<cache>`: MLA latent rows into the latent cache.
    ConcatAndCacheMla { src: DType, fp8: Option<Fp8Format> },
    /// `decode_merge_<out>`: pass 2 of split-K.
    DecodeMerge { out: DType },
    /// `merge_attn_states_<out>`.
    MergeAttnStates { out: DType },
    /// `decode_tc_<q><rows>_d<d>`: tensor-core decode, keys split across warps, 16-row score
    /// tiles (width 256: 16-bit caches at 9 to 16 rows per kv head, FP8 caches).
    DecodeTc { q: DType, rows: CacheRows, head_size: u32 },
    /// `decode_kr_<q><rows>[_long][_r16]_d<d>`: the keys-as-rows decode (`attn_math::keys_rows`);
    /// `long` (FP8 only): the deep-pipeline form for long contexts; `wide` (16-bit caches
    /// 16-bit caches, and FP8 with `long`): 16 query rows a CTA instead of 8.
    DecodeKr { q: DType, rows: CacheRows, long: bool, wide: bool, head_size: u32 },
    /// `decode_km_<q><rows>[_r16]_d<d>`: decode on `wgmma` with the keys on M
    /// (`attn_math::keys_m`, sm_90a only): FP8 rows, and 16-bit ones at 16 rows; `wide`: 16 query
    /// rows a CTA instead of 8.
    DecodeKm { q: DType, rows: CacheRows, wide: bool, head_size: u32 },
    /// `prefill_<q><rows>_dk<qk>_dv<v>`: the `mma.sync` attention-tile kernel.
    Prefill { q: DType, rows: CacheRows, head_size_qk: u32, head_size_v: u32 },
    /// `prefill_local_<q>_dk<d>_dv<d>`: the `mma.sync` prefill kernel with the local masks
    /// (chunked local attention, the symmetric window), 16-bit caches or packed K/V.
    PrefillLocal { q: DType, head_size: u32 },
    /// `prefill_wgs_<q><rows>_d<d>`: Hopper's warp-specialised persistent prefill (sm_90a);
    /// `prefill_wgs_<q>_dk<qk>_dv<v>` where the head sizes differ (QK 192 / V 128).
    PrefillWgs { q: DType, rows: CacheRows, head_size: u32, head_size_v: u32 },
    /// `mla_<q>[<fp8>]_{narrow,wide}`: MLA's latent attention.
    Mla { q: DType, fp8: Option<Fp8Format>, tile: MlaTile },
    /// `mla_sparse_<q>[<fp8>]_{narrow,wide}`: the MLA kernel over each query token's top-k
    /// index list (DeepSeek-V3.2's sparse attention).
    MlaSparse { q: DType, fp8: Option<Fp8Format>, tile: MlaTile },
}

impl KernelId {
    /// The kernel's PTX entry name, as the kernels' export macros spell it.
    pub fn entry_name(&self) -> String {
        let cache = |src: DType, fp8: Option<Fp8Format>| fp8.map_or(src, Fp8Format::dtype).kernel_name();
        match *self {
            KernelId::ReshapeAndCache { src, fp8 } => format!("reshape_and_cache_{}_{}", src.kernel_name(), cache(src, fp8)),
            KernelId::ConcatAndCacheMla { src, fp8 } => format!("concat_and_cache_mla_{}_{}", src.kernel_name(), cache(src, fp8)),
            KernelId::DecodeMerge { out } => format!("decode_merge_{}", out.kernel_name()),
            KernelId::MergeAttnStates { out } => format!("merge_attn_states_{}", out.kernel_name()),
            KernelId::DecodeTc { q, rows, head_size: d } => format!("decode_tc_{}{}_d{d}", q.kernel_name(), rows.tag()),
            KernelId::DecodeKr { q, rows, long, wide, head_size: d } => {
                let (long, wide) = (if long { "_long" } else { "" }, if wide { "_r16" } else { "" });
                format!("decode_kr_{}{}{long}{wide}_d{d}", q.kernel_name(), rows.tag())
            }
            KernelId::DecodeKm { q, rows, wide, head_size: d } => {
                format!("decode_km_{}{}{}_d{d}", q.kernel_name(), rows.tag(), if wide { "_r16" } else { "" })
            }
            KernelId::Prefill { q, rows, head_size_qk: dk, head_size_v: dv } => {
                format!("prefill_{}{}_dk{dk}_dv{dv}", q.kernel_name(), rows.tag())
            }
            KernelId::PrefillLocal { q, head_size: d } => format!("prefill_local_{}_dk{d}_dv{d}", q.kernel_name()),
            KernelId::PrefillWgs { q, rows, head_size: d, head_size_v: dv } if d == dv => {
                format!("prefill_wgs_{}{}_d{d}", q.kernel_name(), rows.tag())
            }
            KernelId::PrefillWgs { q, rows, head_size: dk, head_size_v: dv } => {
                format!("prefill_wgs_{}{}_dk{dk}_dv{dv}", q.kernel_name(), rows.tag())
            }
            KernelId::Mla { q, fp8, tile } => {
                format!("mla_{}{}_{}", q.kernel_name(), fp8_tag(fp8), if tile == MlaTile::Narrow { "narrow" } else { "wide" })
            }
            KernelId::MlaSparse { q, fp8, tile } => {
                format!("mla_sparse_{}{}_{}", q.kernel_name(), fp8_tag(fp8), if tile == MlaTile::Narrow { "narrow" } else { "wide" })
            }
        }
    }

    /// The module (kernel family) that holds the kernel.
    pub(crate) fn family(&self) -> Family {
        match self {
            KernelId::ReshapeAndCache { .. } | KernelId::ConcatAndCacheMla { .. } => Family::CacheWrite,
            KernelId::DecodeMerge { .. } | KernelId::MergeAttnStates { .. } => Family::Merge,
            KernelId::DecodeTc { .. }
            | KernelId::DecodeKr { .. }
            | KernelId::DecodeKm { .. }
            | KernelId::Prefill { .. }
            | KernelId::PrefillLocal { .. }
            | KernelId::PrefillWgs { .. }
            | KernelId::Mla { .. }
            | KernelId::MlaSparse { .. } => Family::Attention,
        }
    }

    /// Whether only the sm_90a module has it (Hopper's `wgmma` prefill and decode kernels).
    #[cfg(test)]
    pub fn hopper_only(&self) -> bool {
        matches!(self, KernelId::PrefillWgs { .. } | KernelId::DecodeKm { .. })
    }

    /// Every kernel the modules export (those of [`hopper_only`](Self::hopper_only) in the
    /// sm_90a one only).
    #[cfg(test)]
    pub fn all() -> Vec<KernelId> {
        use attn_math::{decode, hopper_prefill, keys_m, keys_rows, prefill};
        const HALF: [DType; 2] = [DType::F16, DType::BF16];
        const FLOAT: [DType; 3] = [DType::F16, DType::BF16, DType::F32];
        const FP8: [Option<Fp8Format>; 3] = [None, Some(Fp8Format::E4m3), Some(Fp8Format::E5m2)];
        let mut v = Vec::new();
        for src in FLOAT {
            for fp8 in FP8 {
                v.push(KernelId::ReshapeAndCache { src, fp8 });
                v.push(KernelId::ConcatAndCacheMla { src, fp8 });
            }
            v.push(KernelId::DecodeMerge { out: src });
            v.push(KernelId::MergeAttnStates { out: src });
        }
        for q in HALF {
            for fp8 in FP8 {
                let is_fp8 = fp8.is_some();
                // The standard shapes' rows; each FP8 kernel again below for rows 8-byte aligned.
                let rows = fp8.map_or(CacheRows::Bits16, |format| CacheRows::Fp8 { format, a8: false });
                for head_size in decode::HEAD_SIZES {
                    // The keys-as-rows kernels take every row count to 16 below head size 256
                    // from 16-bit caches, and at head sizes 64 and 128 from FP8 (FP8 at 256: up
                    // to 8 rows).
                    let keys_rows_all = if is_fp8 { &keys_rows::FP8_SHORT_AND_R16_HEAD_SIZES[..] } else { &keys_rows::WIDE_HEAD_SIZES[..] };
                    // The 16-row score tiles where no keys-as-rows kernel of the width exists (FP8
                    // decode runs the width-96 head sizes at 128: `decode::decode_width`).
                    if !keys_rows_all.contains(&head_size) && decode::decode_width(head_size, is_fp8) == Some(head_size) {
                        v.push(KernelId::DecodeTc { q, rows, head_size });
                    }
                    if !is_fp8 || keys_rows::FP8_SHORT_AND_R16_HEAD_SIZES.contains(&head_size) {
                        v.push(KernelId::DecodeKr { q, rows, long: false, wide: false, head_size });
                    }
                    if is_fp8 && keys_rows::FP8_DEEP_HEAD_SIZES.contains(&head_size) {
                        v.push(KernelId::DecodeKr { q, rows, long: true, wide: false, head_size });
                    }
                    if is_fp8 && keys_rows::FP8_SHORT_AND_R16_HEAD_SIZES.contains(&head_size) {
                        v.push(KernelId::DecodeKr { q, rows, long: true, wide: true, head_size });
                    }
                    if !is_fp8 && keys_rows::WIDE_HEAD_SIZES.contains(&head_size) {
                        v.push(KernelId::DecodeKr { q, rows, long: false, wide: true, head_size });
                    }
                    if !is_fp8 && head_size == 128 {
                        v.push(KernelId::DecodeKr { q, rows, long: true, wide: false, head_size });
                    }
                    // Hopper's `wgmma` decode: FP8 up to 8 and 16 rows, 16-bit at 16 (and up to 8 at
                    // width 64).
                    if keys_m::takes(head_size, is_fp8, keys_m::ROWS[0]) {
                        v.push(KernelId::DecodeKm { q, rows, wide: false, head_size });
                    }
                    if keys_m::takes(head_size, is_fp8, keys_m::ROWS[1]) {
                        v.push(KernelId::DecodeKm { q, rows, wide: true, head_size });
                    }
                }
                // FP8 caches are paged, whose K and V have one head size.
                for (dk, dv) in prefill::HEAD_SIZES.into_iter().filter(|&(dk, dv)| !is_fp8 || dk == dv) {
                    v.push(KernelId::Prefill { q, rows, head_size_qk: dk, head_size_v: dv });
                }
                for tile in [MlaTile::Narrow, MlaTile::Wide] {
                    v.push(KernelId::Mla { q, fp8, tile });
                    v.push(KernelId::MlaSparse { q, fp8, tile });
                }
                let wgs_sizes = if is_fp8 { &hopper_prefill::FP8_HEAD_SIZES[..] } else { &hopper_prefill::HEAD_SIZES[..] };
                for &head_size in wgs_sizes {
                    v.push(KernelId::PrefillWgs { q, rows, head_size, head_size_v: head_size });
                }
                if !is_fp8 {
                    for (head_size, head_size_v) in hopper_prefill::QK_V_PAIRS {
                        v.push(KernelId::PrefillWgs { q, rows, head_size, head_size_v });
                    }
                }
            }
            for head_size in decode::HEAD_SIZES {
                v.push(KernelId::PrefillLocal { q, head_size });
            }
        }
        // Each FP8 kernel of the standard shapes again for rows 8-byte aligned (`_a8`).
        let a8: Vec<KernelId> = v.iter().filter_map(|id| id.with_a8()).collect();
        v.extend(a8);
        v
    }

    /// The same kernel for FP8 rows that start only 8-byte aligned (`_a8`), for a standard
    /// kernel over FP8 rows.
    #[cfg(test)]
    fn with_a8(mut self) -> Option<Self> {
        match &mut self {
            KernelId::PrefillWgs { head_size, .. } if !attn_math::hopper_prefill::ws_takes_a8(*head_size) => return None,
            // Every `_a8` head size of width 128 is below 128, where FP8 takes `wgmma` at 9 to 16
            // rows only.
            KernelId::DecodeKm { wide: false, head_size: 128, .. } => return None,
            KernelId::DecodeTc { rows, .. }
            | KernelId::DecodeKr { rows, .. }
            | KernelId::DecodeKm { rows, .. }
            | KernelId::Prefill { rows, .. }
            | KernelId::PrefillWgs { rows, .. } => match rows {
                CacheRows::Fp8 { a8, .. } => *a8 = true,
                CacheRows::Bits16 => return None,
            },
            _ => return None,
        }
        Some(self)
    }
}

impl fmt::Display for KernelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.entry_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptx::{ALL_FAMILIES, TARGETS};
    use std::collections::BTreeSet;

    /// The `.entry` names of an embedded PTX module (the committed one, decompressed).
    fn entries(target: &crate::ptx::PtxTarget, family: Family) -> BTreeSet<String> {
        target
            .module(family)
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix(".visible .entry ").or_else(|| l.trim_start().strip_prefix(".entry ")))
            .map(|rest| rest.split(|c: char| c == '(' || c.is_whitespace()).next().unwrap_or("").to_string())
            .collect()
    }

    /// Every id names an entry of its family's module in every target that should have it,
    /// and every entry of the committed modules is some id's: a renamed, moved or new export
    /// fails here rather than at a launch on the GPU.
    #[test]
    fn every_kernel_id_is_an_entry_of_the_committed_ptx() {
        let all = KernelId::all();
        let names: BTreeSet<String> = all.iter().map(KernelId::entry_name).collect();
        assert_eq!(names.len(), all.len(), "two ids share a name");
        for target in TARGETS {
            for family in ALL_FAMILIES {
                let found = entries(target, family);
                assert!(!found.is_empty(), "{} {family:?}: no .entry found", target.name);
                let want: BTreeSet<String> = all
                    .iter()
                    .filter(|id| id.family() == family && (!id.hopper_only() || target.name == "sm_90a"))
                    .map(KernelId::entry_name)
                    .collect();
                let missing: Vec<_> = want.difference(&found).collect();
                assert!(missing.is_empty(), "{} {family:?}: ids with no entry: {missing:?}", target.name);
                let unknown: Vec<_> = found.difference(&want).collect();
                assert!(unknown.is_empty(), "{} {family:?}: entries no id names: {unknown:?}", target.name);
            }
        }
    }

    #[test]
    fn entry_names() {
        let (f16, bf16) = (DType::F16, DType::BF16);
        let (e4m3, e5m2) = (Fp8Format::E4m3, Fp8Format::E5m2);
        let fp8 = |format, a8| CacheRows::Fp8 { format, a8 };
        let half = CacheRows::Bits16;
        let cases = [
            (KernelId::ReshapeAndCache { src: DType::F32, fp8: Some(e4m3) }, "reshape_and_cache_f32_fp8"),
            (KernelId::ReshapeAndCache { src: bf16, fp8: Some(e5m2) }, "reshape_and_cache_bf16_e5m2"),
            (KernelId::ConcatAndCacheMla { src: bf16, fp8: None }, "concat_and_cache_mla_bf16_bf16"),
            (KernelId::DecodeMerge { out: f16 }, "decode_merge_f16"),
            (KernelId::MergeAttnStates { out: DType::F32 }, "merge_attn_states_f32"),
            (KernelId::DecodeTc { q: bf16, rows: fp8(e4m3, false), head_size: 256 }, "decode_tc_bf16_fp8_d256"),
            (KernelId::DecodeKr { q: f16, rows: half, long: false, wide: false, head_size: 256 }, "decode_kr_f16_d256"),
            (
                KernelId::DecodeKr { q: bf16, rows: fp8(e4m3, false), long: true, wide: false, head_size: 128 },
                "decode_kr_bf16_fp8_long_d128",
            ),
            (KernelId::DecodeKr { q: bf16, rows: half, long: false, wide: true, head_size: 96 }, "decode_kr_bf16_r16_d96"),
            (
                KernelId::DecodeKr { q: f16, rows: fp8(e4m3, false), long: true, wide: true, head_size: 64 },
                "decode_kr_f16_fp8_long_r16_d64",
            ),
            (KernelId::DecodeKr { q: f16, rows: fp8(e5m2, true), long: false, wide: false, head_size: 128 }, "decode_kr_f16_e5m2_a8_d128"),
            (KernelId::DecodeKm { q: bf16, rows: fp8(e4m3, false), wide: false, head_size: 128 }, "decode_km_bf16_fp8_d128"),
            (KernelId::DecodeKm { q: f16, rows: fp8(e5m2, true), wide: true, head_size: 256 }, "decode_km_f16_e5m2_a8_r16_d256"),
            (KernelId::DecodeKm { q: bf16, rows: fp8(e4m3, true), wide: true, head_size: 128 }, "decode_km_bf16_fp8_a8_r16_d128"),
            (KernelId::DecodeKm { q: bf16, rows: half, wide: true, head_size: 64 }, "decode_km_bf16_r16_d64"),
            (KernelId::Prefill { q: f16, rows: half, head_size_qk: 192, head_size_v: 128 }, "prefill_f16_dk192_dv128"),
            (KernelId::PrefillWgs { q: bf16, rows: half, head_size: 128, head_size_v: 128 }, "prefill_wgs_bf16_d128"),
            (KernelId::PrefillWgs { q: f16, rows: half, head_size: 64, head_size_v: 64 }, "prefill_wgs_f16_d64"),
            (KernelId::PrefillWgs { q: bf16, rows: half, head_size: 192, head_size_v: 128 }, "prefill_wgs_bf16_dk192_dv128"),
            (KernelId::PrefillWgs { q: bf16, rows: fp8(e4m3, false), head_size: 96, head_size_v: 96 }, "prefill_wgs_bf16_fp8_d96"),
            (KernelId::PrefillWgs { q: f16, rows: fp8(e4m3, true), head_size: 80, head_size_v: 80 }, "prefill_wgs_f16_fp8_a8_d80"),
            (KernelId::PrefillWgs { q: bf16, rows: fp8(e5m2, false), head_size: 128, head_size_v: 128 }, "prefill_wgs_bf16_e5m2_d128"),
            (
                KernelId::DecodeKr { q: bf16, rows: fp8(e4m3, true), long: true, wide: true, head_size: 64 },
                "decode_kr_bf16_fp8_a8_long_r16_d64",
            ),
            (KernelId::Prefill { q: bf16, rows: fp8(e4m3, true), head_size_qk: 96, head_size_v: 96 }, "prefill_bf16_fp8_a8_dk96_dv96"),
            (KernelId::Prefill { q: bf16, rows: fp8(e5m2, true), head_size_qk: 96, head_size_v: 96 }, "prefill_bf16_e5m2_a8_dk96_dv96"),
            (KernelId::Mla { q: bf16, fp8: Some(e4m3), tile: MlaTile::Narrow }, "mla_bf16_fp8_narrow"),
            (KernelId::Mla { q: bf16, fp8: Some(e5m2), tile: MlaTile::Wide }, "mla_bf16_e5m2_wide"),
            (KernelId::Mla { q: f16, fp8: None, tile: MlaTile::Wide }, "mla_f16_wide"),
            (KernelId::MlaSparse { q: bf16, fp8: Some(e4m3), tile: MlaTile::Narrow }, "mla_sparse_bf16_fp8_narrow"),
            (KernelId::MlaSparse { q: f16, fp8: None, tile: MlaTile::Wide }, "mla_sparse_f16_wide"),
        ];
        for (id, name) in cases {
            assert_eq!(id.entry_name(), name);
            assert_eq!(id.to_string(), name);
        }
    }
}
