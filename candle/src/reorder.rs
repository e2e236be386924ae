//! A step's batch put decodes first, as attn-rs's `forward` takes it, and the row order back.

use crate::error::ensure;
use attn_rs::metadata::StepInput;
use candle_core::{Device, Result, Tensor};

/// A batch put decodes first: the reordered arrays, and where each row came from.
pub(crate) struct Reorder {
    pub(crate) query_start_loc: Vec<i32>,
    pub(crate) seq_lens: Vec<i32>,
    pub(crate) block_table: Vec<i32>,
    pub(crate) block_table_stride: usize,
    pub(crate) slot_mapping: Vec<i64>,
    /// Row `i` of the reordered step is the engine's row `tokens[i]`.
    pub(crate) tokens: Vec<u32>,
    /// For outputs of `.0` rows: the index back into the engine's order.
    pub(crate) index: Option<(usize, Tensor)>,
}

impl Reorder {
    pub(crate) fn new(input: &StepInput<'_>, order: &[usize]) -> Self {
        let (qsl, stride) = (input.query_start_loc, input.block_table_stride);
        let mut r = Reorder {
            query_start_loc: vec![0],
            seq_lens: Vec::with_capacity(order.len()),
            block_table: Vec::with_capacity(order.len() * stride),
            block_table_stride: stride,
            slot_mapping: Vec::with_capacity(input.num_actual_tokens),
            tokens: Vec::with_capacity(input.num_actual_tokens),
            index: None,
        };
        for &req in order {
            let (a, b) = (qsl[req] as usize, qsl[req + 1] as usize);
            r.tokens.extend(a as u32..b as u32);
            r.slot_mapping.extend_from_slice(&input.slot_mapping[a..b]);
            r.query_start_loc.push(r.query_start_loc.last().copied().unwrap_or(0) + (b - a) as i32);
            r.seq_lens.push(input.seq_lens[req]);
            r.block_table.extend_from_slice(&input.block_table[req * stride..(req + 1) * stride]);
        }
        r
    }

    pub(crate) fn input(&self, like: &StepInput<'_>) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.query_start_loc,
            seq_lens: &self.seq_lens,
            block_table: &self.block_table,
            block_table_stride: self.block_table_stride,
            slot_mapping: &self.slot_mapping,
            ..*like
        }
    }

    /// The engine's rows in the step's order, as runs `(first row, rows)`, for tensors of
    /// `rows` rows (padding rows last, as they were).
    pub(crate) fn runs(&self, rows: usize) -> Result<Vec<(usize, usize)>> {
        let nt = self.tokens.len();
        ensure(rows >= nt, "q", || format!("has {rows} rows, the step {nt} tokens"))?;
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for &t in &self.tokens {
            match runs.last_mut() {
                Some((start, len)) if *start + *len == t as usize => *len += 1,
                _ => runs.push((t as usize, 1)),
            }
        }
        if rows > nt {
            runs.push((nt, rows - nt));
        }
        Ok(runs)
    }

    /// The index that puts an output of `rows` rows back in the engine's order.
    pub(crate) fn scatter(&mut self, rows: usize, device: &Device) -> Result<Tensor> {
        if let Some((n, s)) = &self.index {
            if *n == rows {
                return Ok(s.clone());
            }
        }
        let nt = self.tokens.len();
        ensure(rows >= nt, "out", || format!("has {rows} rows, the step {nt} tokens"))?;
        let mut scatter: Vec<u32> = (0..rows as u32).collect();
        for (new, &old) in self.tokens.iter().enumerate() {
            scatter[old as usize] = new as u32;
        }
        let s = Tensor::from_vec(scatter, rows, device)?;
        self.index = Some((rows, s.clone()));
        Ok(s)
    }
}
