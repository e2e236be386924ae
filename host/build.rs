//! Compresses the committed kernels (`ptx/<target>/<family>.{ptx,cubin}`) into `OUT_DIR` for the
//! GPU targets the crate's features select, so that a binary embeds only those, deflated (about
//! a fifth of their size); `src/ptx.rs` inflates a module when a device first loads it.

use std::path::Path;

const FAMILIES: [&str; 3] = ["cache_write", "merge", "attention"];
/// (target, the Cargo feature that selects it)
const TARGETS: [(&str, &str); 2] = [("sm_80", "SM80"), ("sm_90a", "SM90A")];

fn main() {
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    for (target, feature) in TARGETS {
        if std::env::var_os(format!("CARGO_FEATURE_{feature}")).is_none() {
            continue;
        }
        std::fs::create_dir_all(Path::new(&out).join(target)).expect("create OUT_DIR/<target>");
        for family in FAMILIES {
            for ext in ["ptx", "cubin"] {
                let src = format!("ptx/{target}/{family}.{ext}");
                println!("cargo:rerun-if-changed={src}");
                let data = std::fs::read(&src).unwrap_or_else(|e| panic!("{src}: {e}"));
                // Level 1: the build script usually runs unoptimised, and the higher levels
                // gain little on PTX text.
                let packed = miniz_oxide::deflate::compress_to_vec(&data, 1);
                let dst = Path::new(&out).join(format!("{target}/{family}.{ext}.deflate"));
                std::fs::write(&dst, packed).unwrap_or_else(|e| panic!("{}: {e}", dst.display()));
            }
        }
    }
}
