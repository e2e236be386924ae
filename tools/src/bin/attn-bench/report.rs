//! The table on stdout and the JSON file (`--json PATH`).
//!
//! The JSON: `{"device", "copy_gbps", "matmul_tflops", "rows": [...]}`, the copy ceiling first
//! among the rows, one row a line. A memory-bound row is `{"kernel", "shape", "median_us",
//! "gbps", "pct_of_copy"}`, a compute-bound one has `"tflops", "pct_of_matmul"` instead of the
//! last two.

use crate::bench::{Row, MATMUL_TFLOPS};
use attn_rs::{AttnError, Result};
use serde::Serialize;
use std::io;
use std::path::Path;

#[derive(Serialize)]
struct Report<'a> {
    device: &'a str,
    copy_gbps: f64,
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
    Memory { gbps: f64, pct_of_copy: f64 },
    Compute { tflops: f64, pct_of_matmul: f64 },
}

impl Rate {
    /// Memory-bound rows: GB/s and % of the copy ceiling (`ceiling_gbps`); compute-bound rows:
    /// TFLOP/s and % of the dense bf16 matmul rate.
    fn of(r: &Row, ceiling_gbps: f64) -> Rate {
        if r.flops > 0.0 {
            let tflops = r.flops / (r.median_us * 1e-6) / 1e12;
            Rate::Compute { tflops, pct_of_matmul: 100.0 * tflops / MATMUL_TFLOPS }
        } else {
            Rate::Memory { gbps: r.gbps(), pct_of_copy: 100.0 * r.gbps() / ceiling_gbps }
        }
    }

    /// Rounded as the table and the stored files have them.
    fn rounded(self) -> Rate {
        match self {
            Rate::Memory { gbps, pct_of_copy } => Rate::Memory { gbps: round(gbps, 1), pct_of_copy: round(pct_of_copy, 2) },
            Rate::Compute { tflops, pct_of_matmul } => Rate::Compute { tflops: round(tflops, 1), pct_of_matmul: round(pct_of_matmul, 2) },
        }
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

/// The JSON file's text: the copy ceiling's row, then `rows`.
fn json_text(ceiling: &Row, rows: &[Row], device: &str) -> serde_json::Result<Vec<u8>> {
    let ceil = ceiling.gbps();
    let report = Report {
        device,
        copy_gbps: round(ceil, 1),
        matmul_tflops: MATMUL_TFLOPS,
        rows: std::iter::once(ceiling)
            .chain(rows)
            .map(|r| JsonRow { kernel: &r.name, shape: &r.shape, median_us: round(r.median_us, 3), rate: Rate::of(r, ceil).rounded() })
            .collect(),
    };
    let mut text = Vec::new();
    report.serialize(&mut serde_json::Serializer::with_formatter(&mut text, RowPerLine))?;
    text.push(b'\n');
    Ok(text)
}

/// Prints the table and, with `json_path`, writes the JSON.
pub fn print_and_save(ceiling: &Row, rows: &[Row], device: &str, json_path: Option<&Path>) -> Result<()> {
    let ceil = ceiling.gbps();
    println!("\n{:<44} {:<44} {:>10} {:>9} {:>8}", "kernel", "shape", "median us", "GB/s|TF/s", "% ceil");
    println!("{:<44} {:<44} {:>10.2} {:>9.0} {:>8}", ceiling.name, ceiling.shape, ceiling.median_us, ceil, "100.0");
    for r in rows {
        let (rate, pct, unit) = match Rate::of(r, ceil) {
            Rate::Memory { gbps, pct_of_copy } => (gbps, pct_of_copy, ""),
            Rate::Compute { tflops, pct_of_matmul } => (tflops, pct_of_matmul, " TF"),
        };
        println!("{:<44} {:<44} {:>10.2} {:>9.1}{unit} {:>8.1}", r.name, r.shape, r.median_us, rate, pct);
    }
    if let Some(path) = json_path {
        let json_error = |reason: String| AttnError::InvalidArgument { arg: "--json", reason };
        let text = json_text(ceiling, rows, device).map_err(|e| json_error(e.to_string()))?;
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
        let rows = [row("decode", 100.0, 2.0e8, 0.0), row("prefill", 1000.0, 0.0, 3.0e11)];
        let text = String::from_utf8(json_text(&ceiling, &rows, "GPU").unwrap()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}");
        assert!(lines[0].starts_with(r#"{"device":"GPU","copy_gbps":3009.8,"matmul_tflops":778.0,"rows":["#), "{text}");
        assert_eq!(
            lines[1],
            r#"{"kernel":"copy ceiling (cuMemcpyDtoD)","shape":"s \"q\"","median_us":713.501,"gbps":3009.8,"pct_of_copy":100.0},"#
        );
        assert_eq!(lines[2], r#"{"kernel":"decode","shape":"s \"q\"","median_us":100.0,"gbps":2000.0,"pct_of_copy":66.45},"#);
        assert_eq!(lines[3], r#"{"kernel":"prefill","shape":"s \"q\"","median_us":1000.0,"tflops":300.0,"pct_of_matmul":38.56}"#);
        assert_eq!(lines[4], "]}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["rows"].as_array().unwrap().len(), 3);
    }
}
