//! The kernels, built to PTX by `cargo xtask build-ptx` and committed under `host/ptx/`, embedded
//! here so that an engine depending on this crate needs neither nightly Rust nor the CUDA toolkit.
//! Each target has one module per kernel family; the device loads a family on first use. The
//! modules are committed compressed (`<family>.{ptx,cubin}.zst`, zstd level 19: a seventeenth of
//! the PTX text's size), so the published crate holds them with room for more; the features
//! (`sm80`, `sm90a`) select which targets' modules a binary embeds, and a module is decompressed
//! when a device loads it (tens of milliseconds).
//!
//! Next to each PTX module is its SASS (`.cubin`, assembled by `ptxas` for the target). On a GPU
//! that runs it, the device loads the SASS: no driver JIT. The JIT of the attention module alone
//! took 23-30 s on a fresh H100 machine. Elsewhere (a newer GPU, or if the driver refuses the
//! cubin) it loads the PTX and the driver JIT-compiles it; `ATTN_FORCE_PTX_JIT=1` forces that.
//! `ATTN_PTX_TARGET=sm_80` picks the Ampere module on a newer GPU (to test its code paths there).

use std::io::Read;

/// The kernel families (one PTX module each). Must match xtask's `FAMILIES`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Family {
    CacheWrite = 0,
    /// The split-K merge (`decode_merge_*`) and `merge_attn_states_*`.
    Merge = 1,
    /// The attention kernels: tensor-core prefill and decode, keys-as-rows decode, the Hopper
    /// prefill kernels and MLA.
    Attention = 2,
}

pub(crate) const NUM_FAMILIES: usize = 3;
pub(crate) const ALL_FAMILIES: [Family; NUM_FAMILIES] = [Family::CacheWrite, Family::Merge, Family::Attention];

/// One target's modules and the compute capabilities it runs on.
pub(crate) struct PtxTarget {
    pub name: &'static str,
    /// One PTX module per [`Family`], zstd-compressed.
    modules: [&'static [u8]; NUM_FAMILIES],
    /// The same modules assembled by `ptxas` for this target, zstd-compressed.
    cubins: [&'static [u8]; NUM_FAMILIES],
    /// Compute capabilities that run the cubins: the target's own, and newer minor versions of
    /// the same major where the architecture allows it (sm_80 SASS runs on 8.6 and 8.9).
    pub sass_min_cc: u32,
    pub sass_max_cc: u32,
    /// Runs on devices whose compute capability is in `min_cc..=max_cc` (major * 10 + minor).
    pub min_cc: u32,
    pub max_cc: u32,
}

#[allow(unused_macros)] // with neither target feature
macro_rules! embedded {
    ($name:literal, $file:literal) => {
        include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/", $name, "/", $file, ".zst"))
    };
}

#[allow(unused_macros)]
macro_rules! target {
    ($name:literal, $min:expr, $max:expr, $sass_max:expr) => {
        PtxTarget {
            name: $name,
            modules: [embedded!($name, "cache_write.ptx"), embedded!($name, "merge.ptx"), embedded!($name, "attention.ptx")],
            cubins: [embedded!($name, "cache_write.cubin"), embedded!($name, "merge.cubin"), embedded!($name, "attention.cubin")],
            min_cc: $min,
            max_cc: $max,
            sass_min_cc: $min,
            sass_max_cc: $sass_max,
        }
    };
}

/// Decompresses an embedded module (the crate's own files: it cannot fail unless the build is
/// corrupt).
fn inflate(packed: &[u8]) -> Vec<u8> {
    const CORRUPT: &str = "an embedded kernel module does not decompress: the build is corrupt";
    let mut decoder = ruzstd::decoding::StreamingDecoder::new(packed).expect(CORRUPT);
    let mut out = Vec::new();
    decoder.read_to_end(&mut out).expect(CORRUPT);
    out
}

impl PtxTarget {
    /// Whether a device of compute capability `cc` runs this target's SASS.
    pub fn runs_sass(&self, cc: u32) -> bool {
        (self.sass_min_cc..=self.sass_max_cc).contains(&cc)
    }

    /// The family's PTX text.
    pub fn module(&self, family: Family) -> String {
        String::from_utf8(inflate(self.modules[family as usize])).expect("embedded PTX is ASCII")
    }

    /// The family's SASS (a cubin).
    pub fn cubin(&self, family: Family) -> Vec<u8> {
        inflate(self.cubins[family as usize])
    }
}

/// Best first: the first target whose range holds the device's capability is used.
/// The targets the `sm90a` and `sm80` features select.
pub(crate) const TARGETS: &[PtxTarget] = &[
    // sm_90a code uses Hopper-only instructions and runs on compute capability 9.0 exactly.
    #[cfg(feature = "sm90a")]
    target!("sm_90a", 90, 90, 90),
    // Ampere SASS runs on 8.x; its PTX is JIT-compiled by the driver for every newer GPU.
    #[cfg(feature = "sm80")]
    target!("sm_80", 80, u32::MAX, 89),
];

/// The target a device of capability `cc` uses: the best that runs there, or the one named by
/// `ATTN_PTX_TARGET` if it runs there (e.g. `sm_80` on an H100: the Ampere code paths, JIT-compiled,
/// for testing them on the GPU we have).
pub(crate) fn target_for(cc: u32) -> Option<&'static PtxTarget> {
    let runs = |m: &&PtxTarget| (m.min_cc..=m.max_cc).contains(&cc);
    let forced = std::env::var("ATTN_PTX_TARGET").ok();
    match forced.as_deref() {
        Some(name) => TARGETS.iter().filter(runs).find(|m| m.name == name),
        None => TARGETS.iter().find(runs),
    }
}

pub(crate) fn available_targets() -> String {
    TARGETS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every embedded module decodes (no GPU needed): the PTX to text that declares its
    /// target and kernels, the SASS to an ELF file.
    #[test]
    fn embedded_modules_decode() {
        for t in TARGETS {
            for family in ALL_FAMILIES {
                let ptx = t.module(family);
                assert!(ptx.contains(&format!(".target {}", t.name)), "{}/{family:?}: no .target line", t.name);
                assert!(ptx.contains(".entry "), "{}/{family:?}: no kernel", t.name);
                assert_eq!(&t.cubin(family)[..4], b"\x7fELF", "{}/{family:?}: the SASS is not an ELF file", t.name);
            }
        }
    }
}
