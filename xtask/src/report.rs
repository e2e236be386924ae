//! `ptx-report`: assemble every committed PTX module with `ptxas` for its target and tabulate
//! the per-kernel resources. Fails when a module does not assemble.

use crate::ptx::{check_self_contained, committed_path, read_committed};
use crate::repo_root;
use crate::toolchain::{FAMILIES, TARGETS};
use std::path::PathBuf;
use std::process::Command;

/// `$PTXAS`, else the repo's `.venv-ptxas` (made by `.ci/run`), else `ptxas` on the PATH.
pub(crate) fn find_ptxas() -> PathBuf {
    if let Some(p) = std::env::var_os("PTXAS") {
        return PathBuf::from(p);
    }
    let venv = repo_root().join(".venv-ptxas/lib");
    if let Ok(entries) = std::fs::read_dir(&venv) {
        for py in entries.flatten() {
            let p = py.path().join("site-packages/nvidia/cu13/bin/ptxas");
            if p.exists() {
                return p;
            }
        }
    }
    PathBuf::from("ptxas")
}

#[derive(Default)]
struct Row {
    kernel: String,
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
    stack: u32,
    smem: u32,
}

/// The number just before `unit` in `line` ("24 bytes stack frame" -> 24).
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let head = &line[..line.find(unit)?];
    head.split(|c: char| !c.is_ascii_digit()).rfind(|s| !s.is_empty())?.parse().ok()
}

fn parse(report: &str) -> Vec<Row> {
    let mut rows: Vec<Row> = Vec::new();
    // ptxas also reports the non-entry functions (e.g. panic paths); only the lines under
    // "Function properties for <kernel>" belong to the kernel.
    let mut current = String::new();
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            rows.push(Row { kernel: rest.split('\'').next().unwrap_or("").to_string(), ..Row::default() });
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = rest.trim().to_string();
        } else if let Some(row) = rows.last_mut().filter(|r| r.kernel == current) {
            if line.contains("stack frame") {
                row.stack = number_before(line, "bytes stack frame").unwrap_or(0);
                row.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                row.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            }
            if line.contains("registers") {
                row.registers = number_before(line, "registers").unwrap_or(0);
                row.smem = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    rows
}

/// Kernels known to spill a few registers, with the most stack they may use. The prefill shape
/// holds 128 f32 accumulators per thread (two 16-row tiles at head size 128, or one at 256), and
/// the MLA kernels' FP8 narrow shape and 16-bit wide shape on sm_90a (the seesaw order: 8-16
/// bytes, stored before the key loop and loaded after it) spill as little;
/// ptxas parks a few words of row bookkeeping on the stack before the key loop and reloads them
/// in the epilogue (8-64 bytes; `nvdisasm` shows no local access inside the loop at head size
/// 128). Anything else with a stack frame fails the report: that is how a register array that
/// went to local memory shows (see docs/cache-writes.md). The Hopper prefill kernels of 16-bit
/// caches (`prefill_wgs_<q>_d*`) spill nothing at widths 64 to 128 with their producer at 72
/// registers and the compute warps at 208 (`hopper_prefill::WS_PRODUCER_REGS`; at 56 / 224 the
/// producer spilled 16 bytes, once an item), and 96 bytes at width 256, whose compute warps hold
/// O in 128 registers: 32 before the output went through shared memory, none of it in the key
/// loop (at 56 / 224 registers it was 104, with 9 local loads a key tile in the producer's loop,
/// docs/prefill.md). The FP8 producer kernels
/// (`prefill_wgs_<q>_{fp8,e5m2}_d*`; at widths 80 to 128 on e4m3 stages) spill 8-64 bytes: the
/// compute warps park item-level values before their key loop, and the producer one word
/// across its key loop; neither key loop has a local access (the e4m3 kernels of widths 112
/// and 128 spill more, listed below with where).
const SMALL_SPILLS_ALLOWED: &[(&str, u32)] = &[
    // Width 256 from an FP8 cache: the compute warps at 216 registers (item-level values, and
    // the rows' output addresses beside O while it goes out through shared memory) beside a
    // converting producer at 72 with at most one local load and store a tile (docs/prefill.md).
    ("prefill_wgs_bf16_fp8_d256", 112),
    ("prefill_wgs_f16_fp8_d256", 112),
    ("prefill_wgs_bf16_e5m2_d256", 112),
    ("prefill_wgs_f16_e5m2_d256", 112),
    // e4m3 stages, whose compute warps hold the queries' A fragments (16 registers,
    // docs/prefill.md "The e4m3 queries as register fragments", and "A uniform key loop on
    // e4m3 stages" for the sizes now). Width 128 (216 / 72 registers at 16-byte rows, 208 / 88
    // at 8-byte ones): 112 bytes, 120 at 8-byte rows since the stages' bad-key masks (the 8
    // bytes more not located); the compute warps' key loop has no local
    // access, or 2 loads a tile at 8-byte rows (head sizes that are odd multiples of 8); the
    // rest is item-level values and the producer's tile loop, which waits for the compute
    // warps. Width 112: 96 bytes, at most 2 local accesses a tile in the key loop.
    ("prefill_wgs_bf16_fp8_a8_d128", 120),
    ("prefill_wgs_f16_fp8_a8_d128", 120),
    ("prefill_wgs_bf16_e5m2_a8_d128", 120),
    ("prefill_wgs_f16_e5m2_a8_d128", 120),
    ("prefill_wgs_bf16_fp8_d128", 112),
    ("prefill_wgs_f16_fp8_d128", 112),
    ("prefill_wgs_bf16_e5m2_d128", 112),
    ("prefill_wgs_f16_e5m2_d128", 112),
    ("prefill_wgs_bf16_fp8_d112", 96),
    ("prefill_wgs_f16_fp8_d112", 96),
    ("prefill_wgs_bf16_e5m2_d112", 96),
    ("prefill_wgs_f16_e5m2_d112", 96),
    ("prefill_wgs_bf16_fp8_a8_d112", 96),
    ("prefill_wgs_f16_fp8_a8_d112", 96),
    ("prefill_wgs_bf16_e5m2_a8_d112", 96),
    ("prefill_wgs_f16_e5m2_a8_d112", 96),
    ("prefill_wgs_bf16_fp8_", 64),
    ("prefill_wgs_f16_fp8_", 64),
    ("prefill_wgs_bf16_e5m2_", 64),
    ("prefill_wgs_f16_e5m2_", 64),
    // Width 256 (16-bit): O's 128 registers; the output through the warps' query rows parks
    // the rows' addresses and scales once an item, after the key loop, which has no local
    // access (docs/prefill.md, "The output through the warp's own query rows").
    ("prefill_wgs_bf16_d256", 96),
    ("prefill_wgs_f16_d256", 96),
    // QK 192 / V 128 (16-bit): 24 bytes, words the compute warps store in their set-up and load
    // once an item, around the key loop (docs/prefill.md); 32 since the stages' bad-key masks
    // (the 8 bytes more not located).
    ("prefill_wgs_bf16_dk192_dv128", 32),
    ("prefill_wgs_f16_dk192_dv128", 32),
    ("prefill_wgs_bf16_d", 0),
    ("prefill_wgs_f16_d", 0),
    ("prefill_", 64),
    ("mla_", 64),
    // sm_80, which has no FP8 conversion instruction and converts with integer operations: 8
    // bytes at four CTAs an SM (128 registers), and at width 256 (255 registers, the 8-byte
    // copies' addresses beside the queries' 32 and the accumulators' 64 registers; 16 with the
    // split merge's fold at the end, outside the key loop). On sm_90a these kernels spill nothing.
    ("decode_kr_bf16_fp8_a8_d64", 8),
    ("decode_kr_f16_fp8_a8_d64", 8),
    ("decode_kr_bf16_fp8_a8_long_d256", 16),
    ("decode_kr_f16_fp8_a8_long_d256", 16),
    // sm_80, f16 queries, 16 rows at width 128 (255 registers): one word in the split merge's
    // fold, after the key loop.
    ("decode_kr_f16_fp8_a8_long_r16_d128", 8),
];

fn stack_allowed(kernel: &str) -> u32 {
    SMALL_SPILLS_ALLOWED.iter().find(|(prefix, _)| kernel.starts_with(prefix)).map_or(0, |&(_, bytes)| bytes)
}

pub fn ptx_report() -> Result<(), String> {
    let ptxas = find_ptxas();
    let (mut spills, mut stack) = (0, 0);
    // Kernels with static shared memory: it would come before the dynamic window (sized at
    // launch), which every kernel's layouts start at offset 0 of, with their `wgmma` and TMA
    // operands at multiples of 1024 bytes from it (the 128-byte swizzle's atoms): a static
    // variable would move them off that alignment, and nothing in the PTX would say so.
    let mut static_smem = Vec::new();
    for (t, family) in TARGETS.iter().flat_map(|t| FAMILIES.iter().map(move |f| (t, f))) {
        let path = committed_path(t.name, family, "ptx");
        let text = String::from_utf8(read_committed(t.name, family, "ptx")?).map_err(|e| format!("{}: {e}", path.display()))?;
        if text.is_empty() {
            return Err(format!("{}: missing (run build-ptx)", path.display()));
        }
        check_self_contained(t.name, &text)?;
        // ptxas reads a file: the module uncompressed, beside its output.
        let ptx_file = std::env::temp_dir().join(format!("attn-{}-{family}.ptx", t.name));
        std::fs::write(&ptx_file, &text).map_err(|e| format!("{}: {e}", ptx_file.display()))?;
        let out_file = std::env::temp_dir().join(format!("attn-{}.cubin", t.name));
        let out = Command::new(&ptxas)
            .arg(format!("-arch={}", t.name))
            .args(["-v", "-O3"])
            .arg(&ptx_file)
            .arg("-o")
            .arg(&out_file)
            .output()
            .map_err(|e| format!("cannot run {} ({e}); set PTXAS or run .ci/run once", ptxas.display()))?;
        let log = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(format!("ptxas failed on {}:\n{log}", path.display()));
        }
        let _ = std::fs::remove_file(out_file);
        let _ = std::fs::remove_file(ptx_file);
        // `ptxas` serialising `wgmma` chains (C7510-C7520: an accumulator read in flight, too
        // few registers, a divergent path) undoes what the Hopper prefill kernels are built for.
        let serialised: Vec<&str> = log.lines().filter(|l| l.contains("wgmma.mma_async instructions are serialized")).collect();
        if !serialised.is_empty() {
            return Err(format!("{}/{family}: ptxas serialises wgmma:\n{}", t.name, serialised.join("\n")));
        }
        println!("\n{}/{family} ({})", t.name, path.display());
        println!("{:<40} {:>5} {:>7} {:>7} {:>6} {:>6}", "kernel", "regs", "spillST", "spillLD", "stack", "smem");
        for r in parse(&log) {
            spills += r.spill_stores + r.spill_loads;
            if r.stack > stack_allowed(&r.kernel) {
                stack += r.stack;
            }
            if r.smem > 0 {
                static_smem.push(format!("{}/{} ({} bytes)", t.name, r.kernel, r.smem));
            }
            println!("{:<40} {:>5} {:>7} {:>7} {:>6} {:>6}", r.kernel, r.registers, r.spill_stores, r.spill_loads, r.stack, r.smem);
        }
    }
    if spills > 0 {
        println!("\nwarning: {spills} bytes of register spills in total");
    }
    if stack > 0 {
        return Err(format!("{stack} bytes of unexpected stack frames: a register array went to local memory"));
    }
    if !static_smem.is_empty() {
        return Err(format!(
            "static shared memory moves the dynamic window off the 1024-byte alignment the kernels' layouts assume: {}",
            static_smem.join(", ")
        ));
    }
    Ok(())
}
