//! The table on stdout and the JSON file (`--json PATH`).
//!
//! The JSON: `{"device", "copy_gbps", "read_gbps", "matmul_tflops", "rows": [...]}`, the copy
//! and read ceilings first among the rows, one row a line. A memory-bound row is `{"kernel",
//! "shape", "median_us", "gbps", "pct_of_copy", "pct_of_read"}`, a compute-bound one has
//! `"tflops", "pct_of_matmul"` instead of the last three.
//!
//! Both ceilings are given for memory-bound rows: a cache write moves bytes as a copy does,
//! attention reads its cache and writes little, so "% of read" is its figure.

use crate::bench::{Row, MATMUL_TFLOPS};
use attn_rs::{AttnError, Result};
use serde::Serialize;
use std::io;
use std::path::Path;

#[derive(Serialize)]
struct Report<'a> {
    device: &'a str,
    copy_gbps: f64,
    read_gbps: f64,
    matmul_tflops: f64,
    rows: Vec<JsonRow<'a>>,
}

#[derive(Serialize)]
struct JsonRow<'a> {
    kernel: &'a str,
    shape: &'a str,
    median_us: f64,
    #[serde(flatten)]
    rate: Rate,
}

/// A row's rate and its share of the ceiling it is measured against.
#[derive(Serialize)]
#[serde(untagged)]
enum Rate {
    Memory { gbps: f64, pct_of_copy: f64, pct_of_read: f64 },
    Compute { tflops: f64, pct_of_matmul: f64 },
}

impl Rate {
    /// Memory-bound rows: GB/s and % of the copy and read ceilings; compute-bound rows: TFLOP/s
    /// and % of the dense bf16 matmul rate.
    fn of(r: &Row, c: Ceilings) -> Rate {
        if r.flops > 0.0 {
            let tflops = r.flops / (r.median_us * 1e-6) / 1e12;
            Rate::Compute { tflops, pct_of_matmul: 100.0 * tflops / MATMUL_TFLOPS }
        } else {
            Rate::Memory { gbps: r.gbps(), pct_of_copy: 100.0 * r.gbps() / c.copy_gbps, pct_of_read: 100.0 * r.gbps() / c.read_gbps }
        }
    }

    /// Rounded as the table and the stored files have them.
    fn rounded(self) -> Rate {
        match self {
            Rate::Memory { gbps, pct_of_copy, pct_of_read } => {
                Rate::Memory { gbps: round(gbps, 1), pct_of_copy: round(pct_of_copy, 2), pct_of_read: round(pct_of_read, 2) }
            }
            Rate::Compute { tflops, pct_of_matmul } => Rate::Compute { tflops: round(tflops, 1), pct_of_matmul: round(pct_of_matmul, 2) },
        }
    }
}

/// The measured bandwidth ceilings (GB/s).
#[derive(Clone, Copy)]
struct Ceilings {
    copy_gbps: f64,
    read_gbps: f64,
}

impl Ceilings {
    fn of(copy: &Row, read: &Row) -> Ceilings {
        Ceilings { copy_gbps: copy.gbps(), read_gbps: read.gbps() }
    }
}

fn round(x: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (x * scale).round() / scale
}

/// Compact JSON with each element of an array on a line of its own (the rows, one a line).
struct RowPerLine;

impl serde_json::ser::Formatter for RowPerLine {
    fn begin_array_value<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        w.write_all(if first { b"\n" } else { b",\n" })
    }

    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b"\n]")
    }
}

/// The JSON file's text: the ceilings' rows, then `rows`.
fn json_text(copy: &Row, read: &Row, rows: &[Row], device: &str) -> serde_json::Result<Vec<u8>> {
    let c = Ceilings::of(copy, read);
    let report = Report {
        device,
        copy_gbps: round(c.copy_gbps, 1),
        read_gbps: round(c.read_gbps, 1),
        matmul_tflops: MATMUL_TFLOPS,
        rows: [copy, read]
            .into_iter()
            .chain(rows)
            .map(|r| JsonRow { kernel: &r.name, shape: &r.shape, median_us: round(r.median_us, 3), rate: Rate::of(r, c).rounded() })
            .collect(),
    };
    let mut text = Vec::new();
    report.serialize(&mut serde_json::Serializer::with_formatter(&mut text, RowPerLine))?;
    text.push(b'\n');
    Ok(text)
}

/// Prints the table and, with `json_path`, writes the JSON. `copy` and `read` are the ceilings'
/// rows. The table's last two columns: % of copy and % of read for memory-bound rows; % of the
/// matmul rate, then nothing, for compute-bound ones.
pub fn print_and_save(copy: &Row, read: &Row, rows: &[Row], device: &str, json_path: Option<&Path>) -> Result<()> {
    let c = Ceilings::of(copy, read);
    println!("\n{:<44} {:<44} {:>10} {:>9} {:>8} {:>8}", "kernel", "shape", "median us", "GB/s|TF/s", "% ceil", "% read");
    for r in [copy, read].into_iter().chain(rows) {
        let (rate, pct, pct_read, unit) = match Rate::of(r, c) {
            Rate::Memory { gbps, pct_of_copy, pct_of_read } => (gbps, pct_of_copy, format!("{pct_of_read:.1}"), "   "),
            Rate::Compute { tflops, pct_of_matmul } => (tflops, pct_of_matmul, String::new(), " TF"),
        };
        println!("{:<44} {:<44} {:>10.2} {:>9.1}{unit} {:>8.1} {:>8}", r.name, r.shape, r.median_us, rate, pct, pct_read);
    }
    if let Some(path) = json_path {
        let json_error = |reason: String| AttnError::InvalidArgument { arg: "--json", reason };
        let text = json_text(copy, read, rows, device).map_err(|e| json_error(e.to_string()))?;
        std::fs::write(path, text).map_err(|e| json_error(format!("{}: {e}", path.display())))?;
        println!("\nJSON written to {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, median_us: f64, bytes: f64, flops: f64) -> Row {
        Row { name: name.into(), shape: "s \"q\"".into(), median_us, bytes, flops }
    }

    #[test]
    fn json_keeps_the_stored_files_shape() {
        let ceiling = row("copy ceiling (cuMemcpyDtoD)", 713.5012, 2.0 * (1u64 << 30) as f64, 0.0);
        let read = row("read ceiling", 400.0, 1.2e9, 0.0);
        let rows = [row("decode", 100.0, 2.0e8, 0.0), row("prefill", 1000.0, 0.0, 3.0e11)];
        let text = String::from_utf8(json_text(&ceiling, &read, &rows, "GPU").unwrap()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 6, "{text}");
        assert!(lines[0].starts_with(r#"{"device":"GPU","copy_gbps":3009.8,"read_gbps":3000.0,"matmul_tflops":778.0,"rows":["#), "{text}");
        assert_eq!(
            lines[1],
            r#"{"kernel":"copy ceiling (cuMemcpyDtoD)","shape":"s \"q\"","median_us":713.501,"gbps":3009.8,"pct_of_copy":100.0,"pct_of_read":100.33},"#
        );
        assert_eq!(
            lines[2],
            r#"{"kernel":"read ceiling","shape":"s \"q\"","median_us":400.0,"gbps":3000.0,"pct_of_copy":99.67,"pct_of_read":100.0},"#
        );
        assert_eq!(
            lines[3],
            r#"{"kernel":"decode","shape":"s \"q\"","median_us":100.0,"gbps":2000.0,"pct_of_copy":66.45,"pct_of_read":66.67},"#
        );
        assert_eq!(lines[4], r#"{"kernel":"prefill","shape":"s \"q\"","median_us":1000.0,"tflops":300.0,"pct_of_matmul":38.56}"#);
        assert_eq!(lines[5], "]}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["rows"].as_array().unwrap().len(), 4);
    }
}
