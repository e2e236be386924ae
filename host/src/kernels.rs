//! [`KernelId`]: every kernel the host launches, by what tells the kernels apart (family, types,
//! head sizes, pipeline). Plans and launches carry a `KernelId`; its PTX entry name
//! ([`KernelId::entry_name`], the name the kernels' export macros give it) is made only where
//! the device looks the function up in its module.

use crate::dtype::DType;
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

/// Whether an FP8 cache's rows at head size `d` may start only 8-byte aligned (an odd multiple
/// of 8): the `_fp8_a8` kernels, which copy each 16-byte chunk as two 8-byte halves, run them.
pub(crate) fn fp8_rows_a8(fp8: bool, d: usize) -> bool {
    fp8 && d % 16 == 8
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
/// sources and outputs; `fp8`: an FP8 E4M3 cache (else the cache has the query's or source's
/// type); `a8` (with `fp8`): its rows start only 8-byte aligned (`_fp8_a8`: a head size that is
/// an odd multiple of 8, [`fp8_rows_a8`]). [`KernelId::all`] lists every one the committed
/// modules export.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// `reshape_and_cache_<src>_<cache>`: K/V rows into the paged cache.
    ReshapeAndCache { src: DType, fp8: bool },
    /// `concat_and_cache_mla_<src>_<cache>`: MLA latent rows into the latent cache.
    ConcatAndCacheMla { src: DType, fp8: bool },
    /// `decode_merge_<out>`: pass 2 of split-K.
    DecodeMerge { out: DType },
    /// `merge_attn_states_<out>`.
    MergeAttnStates { out: DType },
    /// `decode_tc_<q>[_fp8[_a8]]_d<d>`: tensor-core decode, keys split across warps, 16-row score
    /// tiles (width 256: 16-bit caches at 9 to 16 rows per kv head, FP8 caches).
    DecodeTc { q: DType, fp8: bool, a8: bool, head_size: u32 },
    /// `decode_kr_<q>[_fp8[_a8]][_long][_r16]_d<d>`: the keys-as-rows decode (`attn_math::keys_rows`);
    /// `long` (FP8 only): the deep-pipeline form for long contexts; `wide` (16-bit caches
    /// 16-bit caches, and FP8 with `long`): 16 query rows a CTA instead of 8.
    DecodeKr { q: DType, fp8: bool, a8: bool, long: bool, wide: bool, head_size: u32 },
    /// `prefill_<q>[_fp8[_a8]]_dk<qk>_dv<v>`: the `mma.sync` attention-tile kernel.
    Prefill { q: DType, fp8: bool, a8: bool, head_size_qk: u32, head_size_v: u32 },
    /// `prefill_local_<q>_dk<d>_dv<d>`: the `mma.sync` prefill kernel with the local masks
    /// (chunked local attention, the symmetric window), 16-bit caches or packed K/V.
    PrefillLocal { q: DType, head_size: u32 },
    /// `prefill_wgs_<q>[_fp8[_a8]]_d<d>`: Hopper's warp-specialised persistent prefill (sm_90a).
    PrefillWgs { q: DType, fp8: bool, a8: bool, head_size: u32 },
    /// `mla_<q>[_fp8]_{narrow,wide}`: MLA's latent attention.
    Mla { q: DType, fp8: bool, tile: MlaTile },
    /// `mla_sparse_<q>[_fp8]_{narrow,wide}`: the MLA kernel over each query token's top-k
    /// index list (DeepSeek-V3.2's sparse attention).
    MlaSparse { q: DType, fp8: bool, tile: MlaTile },
}

impl KernelId {
    /// The kernel's PTX entry name, as the kernels' export macros spell it.
    pub fn entry_name(&self) -> String {
        let fp8 = |on: bool| if on { "_fp8" } else { "" };
        // The FP8 kernels for rows that start only 8-byte aligned ([`fp8_rows_a8`]).
        let rows = |on: bool, a8: bool| match (on, a8) {
            (true, true) => "_fp8_a8",
            _ => fp8(on),
        };
        let cache = |src: DType, on: bool| if on { DType::Fp8E4m3.kernel_name() } else { src.kernel_name() };
        match *self {
            KernelId::ReshapeAndCache { src, fp8 } => format!("reshape_and_cache_{}_{}", src.kernel_name(), cache(src, fp8)),
            KernelId::ConcatAndCacheMla { src, fp8 } => format!("concat_and_cache_mla_{}_{}", src.kernel_name(), cache(src, fp8)),
            KernelId::DecodeMerge { out } => format!("decode_merge_{}", out.kernel_name()),
            KernelId::MergeAttnStates { out } => format!("merge_attn_states_{}", out.kernel_name()),
            KernelId::DecodeTc { q, fp8: f, a8, head_size: d } => format!("decode_tc_{}{}_d{d}", q.kernel_name(), rows(f, a8)),
            KernelId::DecodeKr { q, fp8: f, a8, long, wide, head_size: d } => {
                let (long, wide) = (if long { "_long" } else { "" }, if wide { "_r16" } else { "" });
                format!("decode_kr_{}{}{long}{wide}_d{d}", q.kernel_name(), rows(f, a8))
            }
            KernelId::Prefill { q, fp8: f, a8, head_size_qk: dk, head_size_v: dv } => {
                format!("prefill_{}{}_dk{dk}_dv{dv}", q.kernel_name(), rows(f, a8))
            }
            KernelId::PrefillLocal { q, head_size: d } => format!("prefill_local_{}_dk{d}_dv{d}", q.kernel_name()),
            KernelId::PrefillWgs { q, fp8: f, a8, head_size: d } => format!("prefill_wgs_{}{}_d{d}", q.kernel_name(), rows(f, a8)),
            KernelId::Mla { q, fp8: f, tile } => {
                format!("mla_{}{}_{}", q.kernel_name(), fp8(f), if tile == MlaTile::Narrow { "narrow" } else { "wide" })
            }
            KernelId::MlaSparse { q, fp8: f, tile } => {
                format!("mla_sparse_{}{}_{}", q.kernel_name(), fp8(f), if tile == MlaTile::Narrow { "narrow" } else { "wide" })
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
            | KernelId::Prefill { .. }
            | KernelId::PrefillLocal { .. }
            | KernelId::PrefillWgs { .. }
            | KernelId::Mla { .. }
            | KernelId::MlaSparse { .. } => Family::Attention,
        }
    }

    /// Whether only the sm_90a module has it (Hopper's `wgmma` prefill kernels).
    #[cfg(test)]
    pub fn hopper_only(&self) -> bool {
        matches!(self, KernelId::PrefillWgs { .. })
    }

    /// Every kernel the modules export (those of [`hopper_only`](Self::hopper_only) in the
    /// sm_90a one only).
    #[cfg(test)]
    pub fn all() -> Vec<KernelId> {
        use attn_math::{decode, hopper_prefill, keys_rows, prefill};
        const HALF: [DType; 2] = [DType::F16, DType::BF16];
        const FLOAT: [DType; 3] = [DType::F16, DType::BF16, DType::F32];
        let mut v = Vec::new();
        for src in FLOAT {
            for fp8 in [false, true] {
                v.push(KernelId::ReshapeAndCache { src, fp8 });
                v.push(KernelId::ConcatAndCacheMla { src, fp8 });
            }
            v.push(KernelId::DecodeMerge { out: src });
            v.push(KernelId::MergeAttnStates { out: src });
        }
        for q in HALF {
            for fp8 in [false, true] {
                for head_size in decode::HEAD_SIZES {
                    // The keys-as-rows kernels take every row count to 16 below head size 256
                    // from 16-bit caches, and at head sizes 64 and 128 from FP8.
                    let keys_rows_all = if fp8 { &keys_rows::FP8_HEAD_SIZES[..] } else { &keys_rows::WIDE_HEAD_SIZES[..] };
                    // The 16-row score tiles where no keys-as-rows kernel of the width exists (FP8
                    // decode runs the width-96 head sizes at 128: `decode::decode_width`).
                    if !keys_rows_all.contains(&head_size) && decode::decode_width(head_size, fp8) == Some(head_size) {
                        v.push(KernelId::DecodeTc { q, fp8, a8: false, head_size });
                    }
                    if !fp8 || keys_rows::FP8_HEAD_SIZES.contains(&head_size) {
                        v.push(KernelId::DecodeKr { q, fp8, a8: false, long: false, wide: false, head_size });
                    }
                    if fp8 && keys_rows::FP8_HEAD_SIZES.contains(&head_size) {
                        v.push(KernelId::DecodeKr { q, fp8, a8: false, long: true, wide: false, head_size });
                    }
                    if fp8 && keys_rows::FP8_HEAD_SIZES.contains(&head_size) {
                        v.push(KernelId::DecodeKr { q, fp8, a8: false, long: true, wide: true, head_size });
                    }
                    if !fp8 && keys_rows::WIDE_HEAD_SIZES.contains(&head_size) {
                        v.push(KernelId::DecodeKr { q, fp8, a8: false, long: false, wide: true, head_size });
                    }
                }
                // FP8 caches are paged, whose K and V have one head size.
                for (dk, dv) in prefill::HEAD_SIZES.into_iter().filter(|&(dk, dv)| !fp8 || dk == dv) {
                    v.push(KernelId::Prefill { q, fp8, a8: false, head_size_qk: dk, head_size_v: dv });
                }
                for tile in [MlaTile::Narrow, MlaTile::Wide] {
                    v.push(KernelId::Mla { q, fp8, tile });
                    v.push(KernelId::MlaSparse { q, fp8, tile });
                }
            }
            for head_size in decode::HEAD_SIZES {
                v.push(KernelId::PrefillLocal { q, head_size });
            }
            for head_size in hopper_prefill::HEAD_SIZES {
                v.push(KernelId::PrefillWgs { q, fp8: false, a8: false, head_size });
            }
            for head_size in hopper_prefill::FP8_HEAD_SIZES {
                v.push(KernelId::PrefillWgs { q, fp8: true, a8: false, head_size });
            }
        }
        // Each FP8 kernel of the standard shapes again for rows 8-byte aligned (`_fp8_a8`).
        let a8: Vec<KernelId> = v
            .iter()
            .filter_map(|id| match *id {
                KernelId::DecodeTc { fp8: true, .. }
                | KernelId::DecodeKr { fp8: true, .. }
                | KernelId::Prefill { fp8: true, .. }
                | KernelId::PrefillWgs { fp8: true, .. } => Some(id.with_a8()),
                _ => None,
            })
            .collect();
        v.extend(a8);
        v
    }

    /// The same kernel for FP8 rows that start only 8-byte aligned (`_fp8_a8`).
    #[cfg(test)]
    fn with_a8(mut self) -> Self {
        match &mut self {
            KernelId::DecodeTc { a8, .. }
            | KernelId::DecodeKr { a8, .. }
            | KernelId::Prefill { a8, .. }
            | KernelId::PrefillWgs { a8, .. } => *a8 = true,
            _ => {}
        }
        self
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
        let cases = [
            (KernelId::ReshapeAndCache { src: DType::F32, fp8: true }, "reshape_and_cache_f32_fp8"),
            (KernelId::ConcatAndCacheMla { src: bf16, fp8: false }, "concat_and_cache_mla_bf16_bf16"),
            (KernelId::DecodeMerge { out: f16 }, "decode_merge_f16"),
            (KernelId::MergeAttnStates { out: DType::F32 }, "merge_attn_states_f32"),
            (KernelId::DecodeTc { q: bf16, fp8: true, a8: false, head_size: 256 }, "decode_tc_bf16_fp8_d256"),
            (KernelId::DecodeKr { q: f16, fp8: false, a8: false, long: false, wide: false, head_size: 256 }, "decode_kr_f16_d256"),
            (KernelId::DecodeKr { q: bf16, fp8: true, a8: false, long: true, wide: false, head_size: 64 }, "decode_kr_bf16_fp8_long_d64"),
            (KernelId::DecodeKr { q: bf16, fp8: false, a8: false, long: false, wide: true, head_size: 96 }, "decode_kr_bf16_r16_d96"),
            (KernelId::DecodeKr { q: f16, fp8: true, a8: false, long: true, wide: true, head_size: 64 }, "decode_kr_f16_fp8_long_r16_d64"),
            (KernelId::Prefill { q: f16, fp8: false, a8: false, head_size_qk: 192, head_size_v: 128 }, "prefill_f16_dk192_dv128"),
            (KernelId::PrefillWgs { q: bf16, fp8: false, a8: false, head_size: 128 }, "prefill_wgs_bf16_d128"),
            (KernelId::PrefillWgs { q: f16, fp8: false, a8: false, head_size: 64 }, "prefill_wgs_f16_d64"),
            (KernelId::PrefillWgs { q: bf16, fp8: true, a8: false, head_size: 96 }, "prefill_wgs_bf16_fp8_d96"),
            (KernelId::PrefillWgs { q: f16, fp8: true, a8: true, head_size: 80 }, "prefill_wgs_f16_fp8_a8_d80"),
            (
                KernelId::DecodeKr { q: bf16, fp8: true, a8: true, long: true, wide: true, head_size: 64 },
                "decode_kr_bf16_fp8_a8_long_r16_d64",
            ),
            (KernelId::Prefill { q: bf16, fp8: true, a8: true, head_size_qk: 96, head_size_v: 96 }, "prefill_bf16_fp8_a8_dk96_dv96"),
            (KernelId::Mla { q: bf16, fp8: true, tile: MlaTile::Narrow }, "mla_bf16_fp8_narrow"),
            (KernelId::Mla { q: f16, fp8: false, tile: MlaTile::Wide }, "mla_f16_wide"),
            (KernelId::MlaSparse { q: bf16, fp8: true, tile: MlaTile::Narrow }, "mla_sparse_bf16_fp8_narrow"),
            (KernelId::MlaSparse { q: f16, fp8: false, tile: MlaTile::Wide }, "mla_sparse_f16_wide"),
        ];
        for (id, name) in cases {
            assert_eq!(id.entry_name(), name);
            assert_eq!(id.to_string(), name);
        }
    }
}
