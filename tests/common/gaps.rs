//! Rows with a gap after every head: a kernel that reads past a head's columns meets NaN (its
//! result turns NaN), one that writes past them changes the gap (checked). The head sizes
//! below a kernel's width (80 on the width-96 kernels) are where such reads and writes would be.

use attn_rs::{Element, RowsDesc};

/// Elements between one head's last column and the next head's first.
pub const GAP: usize = 8;

/// `num_tokens x num_heads` rows of `head_size`, each head followed by [`GAP`] elements.
pub fn gapped_rows(num_tokens: usize, num_heads: usize, head_size: usize) -> RowsDesc {
    let head_stride = head_size + GAP;
    RowsDesc { num_tokens, num_heads, head_size, token_stride: num_heads * head_stride, head_stride }
}

/// Whether element `i` of a buffer laid out as `rows` is in a gap (not a row's column).
pub fn in_gap(rows: &RowsDesc, i: usize) -> bool {
    let within_token = i % rows.token_stride;
    within_token >= rows.num_heads * rows.head_stride || within_token % rows.head_stride >= rows.head_size
}

/// `buf`'s rows (laid out as `rows`) packed densely, `[tokens, heads, head_size]`.
pub fn packed<T: Copy>(buf: &[T], rows: &RowsDesc) -> Vec<T> {
    let mut out = Vec::with_capacity(rows.num_tokens * rows.num_heads * rows.head_size);
    for t in 0..rows.num_tokens {
        for h in 0..rows.num_heads {
            let at = t * rows.token_stride + h * rows.head_stride;
            out.extend_from_slice(&buf[at..at + rows.head_size]);
        }
    }
    out
}

/// `dense` (`[tokens, heads, head_size]`) laid out as `rows`, the gaps filled with `gap`.
pub fn spread<T: Element>(dense: &[T], rows: &RowsDesc, gap: T) -> Vec<T> {
    let mut out = vec![gap; rows.required_len()];
    for t in 0..rows.num_tokens {
        for h in 0..rows.num_heads {
            let (at, from) = (t * rows.token_stride + h * rows.head_stride, (t * rows.num_heads + h) * rows.head_size);
            out[at..at + rows.head_size].copy_from_slice(&dense[from..from + rows.head_size]);
        }
    }
    out
}

/// Checks that every gap element of `buf` (laid out as `rows`) still holds what it was filled
/// with (compared as `f32` bits: NaN poison included).
pub fn check_gaps<T: Element>(buf: &[T], rows: &RowsDesc, fill: T) -> Result<(), String> {
    let want = fill.to_f32().to_bits();
    match (0..buf.len()).find(|&i| in_gap(rows, i) && buf[i].to_f32().to_bits() != want) {
        None => Ok(()),
        Some(i) => Err(format!(
            "element {i} (token {}, past head {}) in a gap after the rows was written: {}",
            i / rows.token_stride,
            (i % rows.token_stride) / rows.head_stride,
            buf[i].to_f32()
        )),
    }
}
