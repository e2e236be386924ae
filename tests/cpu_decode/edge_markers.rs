//! The long-context masking inputs of the GPU tests (`common::masking`): the planted edge
//! markers make a mask one key off visible in every row.

use crate::reference::random_q;
use crate::{compare, masking};
use attn_rs::cpu::{self, DecodeResult};
use attn_rs::AttnOptions;
use attn_rs::RowsDesc;
use half::bf16;
use rand::rngs::SmallRng;
use rand::SeedableRng;

/// The reference over packed keys (`keys` rows; the first `seq_len` are the sequence) for the
/// last `q_len` positions, under `window`.
fn packed_reference(
    q: &[bf16],
    q_rows: RowsDesc,
    k: &[bf16],
    v: &[bf16],
    kv_rows: RowsDesc,
    seq_len: usize,
    window: usize,
) -> DecodeResult {
    let mut opts = AttnOptions::new(q_rows.head_size);
    opts.window = Some(window as u32);
    cpu::prefill(&cpu::PrefillRef {
        q,
        q_rows,
        kv: cpu::KvRef::Packed { k, k_rows: kv_rows, v, v_rows: kv_rows, key_start_loc: &[0, kv_rows.num_tokens as i32] },
        head_size_v: q_rows.head_size,
        query_start_loc: &[0, q_rows.num_tokens as i32],
        seq_lens: &[seq_len as i32],
        causal: true,
        opts,
        alibi_slopes: None,
        sinks: None,
        scales: None,
    })
    .unwrap()
}

/// With the planted inputs, a kernel whose mask is one key off at either edge moves every row
/// far past the per-row tolerance: the reference with the window one key wider (the key just
/// outside it admitted) or narrower (its first key dropped), and with every query one position
/// later (the next token's key admitted; not the last token, whose next key does not exist)
/// or earlier (its own key dropped), the window's first key kept, differs from the true one by
/// at least 5x the bf16 row tolerance in every row. The GPU cases' shapes (query tokens,
/// window, head size) on one head (a group's heads share their queries), the prefill chunks
/// under windows a little longer than the chunk to keep this quick: the chunk's query count
/// sets how many planted keys a row sees, while a window's random keys add only about 1/300
/// of the two dominant keys' weight per 1000 keys, which the 9000-key window covers.
#[test]
fn edge_markers_make_one_key_masking_errors_visible_in_every_row() {
    let mut rng = SmallRng::seed_from_u64(58);
    let floor = 5.0 * compare::row_tolerance(attn_rs::DType::BF16);
    let shapes =
        [(1, 4093, 128), (4, 3001, 128), (3, 9000, 128), (2, 5003, 128), (1, 2050, 64), (128, 181, 64), (200, 257, 64), (96, 150, 128)];
    for (q_len, window, d) in shapes {
        // Only the window's keys enter the reference: a shorter sequence than the GPU cases'
        // 20000 keys gives the same rows.
        let seq_len = window + q_len + 100;
        let q_rows = RowsDesc::contiguous(q_len, 1, d);
        // One key past the sequence, for the queries moved one position later.
        let kv_rows = RowsDesc::contiguous(seq_len + 1, 1, d);
        let mut q: Vec<bf16> = random_q(&mut rng, q_rows.required_len(), 1.0);
        let mut k: Vec<bf16> = random_q(&mut rng, kv_rows.required_len(), 1.0);
        let v: Vec<bf16> = random_q(&mut rng, kv_rows.required_len(), 1.0);
        let m = masking::MarkedRequest { q0: 0, q_len, seq_len, window, num_kv_heads: 1, softmax_scale: AttnOptions::new(d).softmax_scale };
        masking::plant_edge_markers(&mut rng, &m, &mut q, q_rows, &mut k, |pos, kvh, x| kv_rows.offset(pos, kvh, x));
        let run = |len: usize, w: usize| packed_reference(&q, q_rows, &k, &v, kv_rows, len, w);
        let base = run(seq_len, window);
        for (what, off, rows) in [
            ("window one key wider", run(seq_len, window + 1), q_len),
            ("window one key narrower", run(seq_len, window - 1), q_len),
            ("diagonal one key later", run(seq_len + 1, window + 1), q_len - 1),
            ("diagonal one key earlier", run(seq_len - 1, window - 1), q_len),
        ] {
            let n = rows * d;
            let least = compare::row_errors(&off.out[..n], &base.out[..n], d).fold(f64::INFINITY, f64::min);
            assert!(least >= floor, "q_len {q_len}, window {window}, d {d}: {what} moves a row by only {least:.2e}");
        }
    }
}
