//! The simulated engine's scheduler (vLLM's, simplified): each step a token budget is spent on
//! one token per decoding request, then on prompt chunks (chunked prefill) of the requests
//! still in their prompt, then on admitting waiting requests while blocks and room allow. The
//! batch is ordered decodes first, and its arrays are what an engine hands to the metadata
//! builder ([`StepArrays::input`]).
//!
//! For an encoder-decoder model ([`Scheduler::with_encoder`]) each request also has an encoder
//! input of a fixed length, whose blocks come from a second pool (the encoder and
//! cross-attention layers' caches) and are all taken when the request is admitted. A step's
//! batch then holds an encoder step over the requests admitted in it (each whole, within an
//! encoder token budget, at least one request) and, for the decoder tokens, the
//! cross-attention step's arrays (each request's encoder length and encoder blocks); the
//! requests admitted in a step are in its decoder batch too (their first prompt chunk), after
//! their encoder step. A request's query tokens in a step never pass its encoder length (the
//! cross-attention step's sequences must hold them).

use super::allocator::{AllocError, BlockAllocator, BlockTable};
use super::requests::RequestSpec;
use attn_rs::metadata::{is_decode, StepInput};
use std::collections::VecDeque;

/// Scheduler limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Requests running at once.
    pub max_running: usize,
    /// Tokens a step computes (at least `max_running`, so every decode fits).
    pub token_budget: usize,
    /// Requests with at most this many query tokens are decodes (ordered first).
    pub decode_threshold: usize,
}

/// A running request.
#[derive(Clone, Debug)]
struct Running {
    spec: RequestSpec,
    table: BlockTable,
    /// Its encoder input's blocks (encoder-decoder models).
    encoder: BlockTable,
    /// Tokens whose K/V are in the cache.
    computed: usize,
    generated: usize,
}

impl Running {
    fn in_prompt(&self) -> bool {
        self.computed < self.spec.prompt_len
    }
}

/// One request of a step's batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduled {
    pub id: usize,
    /// Query tokens this step (its new tokens).
    pub q_len: usize,
    /// Tokens cached before this step.
    pub context: usize,
}

impl Scheduled {
    pub fn seq_len(&self) -> usize {
        self.context + self.q_len
    }
}

/// The engine's arrays for one step (rows in batch order).
#[derive(Clone, Debug, Default)]
pub struct StepArrays {
    pub query_start_loc: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub block_table: Vec<i32>,
    pub block_table_stride: usize,
    pub slot_mapping: Vec<i64>,
}

impl StepArrays {
    pub fn num_tokens(&self) -> usize {
        self.slot_mapping.len()
    }

    /// The metadata builder's input for a cache of `num_blocks` blocks of `block_size`.
    pub fn input(&self, num_blocks: usize, block_size: usize) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.query_start_loc,
            seq_lens: &self.seq_lens,
            block_table: &self.block_table,
            block_table_stride: self.block_table_stride,
            slot_mapping: &self.slot_mapping,
            num_actual_tokens: self.num_tokens(),
            num_blocks,
            block_size,
        }
    }
}

/// A step's batch: who runs (decodes first) and the arrays.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub reqs: Vec<Scheduled>,
    pub arrays: StepArrays,
    pub num_decodes: usize,
    pub num_decode_tokens: usize,
    /// Encoder-decoder models: the encoder step run before the decoder tokens (the requests
    /// admitted this step, each whole: `q_len` its encoder length, `context` 0; none when no
    /// request was admitted) ...
    pub encoder_reqs: Vec<Scheduled>,
    /// ... its arrays (slots in the encoder pool's blocks) ...
    pub encoder: StepArrays,
    /// ... and the cross-attention step of the decoder tokens: `arrays`' query start
    /// locations, each request's encoder length and encoder blocks, every slot -1.
    pub cross: StepArrays,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    pub fn num_tokens(&self) -> usize {
        self.arrays.num_tokens()
    }

    /// Tokens of the encoder step (0 without one).
    pub fn num_encoder_tokens(&self) -> usize {
        self.encoder.num_tokens()
    }
}

/// An encoder-decoder model's encoder side: every request's encoder input has `len` tokens,
/// in blocks of `alloc`; an encoder step takes at most `budget` tokens (at least one request).
#[derive(Clone, Debug)]
struct EncoderPool {
    alloc: BlockAllocator,
    len: usize,
    budget: usize,
}

/// Requests waiting, running and finished, and the blocks they hold.
pub struct Scheduler {
    config: SchedulerConfig,
    alloc: BlockAllocator,
    /// Not arrived yet, in arrival order.
    pending: VecDeque<RequestSpec>,
    waiting: VecDeque<RequestSpec>,
    running: Vec<Running>,
    finished: usize,
    /// Blocks the running requests will still take (admission keeps them free).
    committed: usize,
    encoder: Option<EncoderPool>,
}

impl Scheduler {
    /// `requests` in arrival order; each must fit the cache alone.
    pub fn new(config: SchedulerConfig, alloc: BlockAllocator, requests: Vec<RequestSpec>) -> Result<Self, AllocError> {
        let bs = alloc.block_size();
        if let Some(r) = requests.iter().find(|r| BlockTable::blocks_for(r.total_tokens(), bs) > alloc.num_blocks()) {
            return Err(AllocError::OutOfBlocks {
                needed: BlockTable::blocks_for(r.total_tokens(), bs),
                free: alloc.num_free(),
                total: alloc.num_blocks(),
            });
        }
        assert!(config.max_running > 0 && config.token_budget >= config.max_running, "{config:?}");
        Ok(Scheduler {
            config,
            alloc,
            pending: requests.into(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            finished: 0,
            committed: 0,
            encoder: None,
        })
    }

    /// The same scheduler for an encoder-decoder model: each request's encoder input has `len`
    /// tokens (at least 1), whose blocks `alloc` holds, and an encoder step takes whole
    /// requests up to `budget` tokens (always one, whatever the budget). Refused when one
    /// request's encoder blocks do not fit `alloc`.
    pub fn with_encoder(self, alloc: BlockAllocator, len: usize, budget: usize) -> Result<Self, AllocError> {
        assert!(len > 0, "an encoder input of no tokens");
        let needed = BlockTable::blocks_for(len, alloc.block_size());
        if needed > alloc.num_blocks() {
            return Err(AllocError::OutOfBlocks { needed, free: alloc.num_free(), total: alloc.num_blocks() });
        }
        Ok(Scheduler { encoder: Some(EncoderPool { alloc, len, budget }), ..self })
    }

    /// The encoder pool (encoder-decoder models).
    pub fn encoder_allocator(&self) -> Option<&BlockAllocator> {
        self.encoder.as_ref().map(|e| &e.alloc)
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_finished(&self) -> usize {
        self.finished
    }

    pub fn allocator(&self) -> &BlockAllocator {
        &self.alloc
    }

    /// Whether every request has finished.
    pub fn is_done(&self) -> bool {
        self.pending.is_empty() && self.waiting.is_empty() && self.running.is_empty()
    }

    /// The next step's batch. `step` moves on to the next arrival when nothing is left to run
    /// (an idle engine), so a returned batch is empty only when all is done.
    pub fn schedule(&mut self, step: &mut usize) -> Result<Batch, AllocError> {
        if self.running.is_empty() && self.waiting.is_empty() {
            if let Some(next) = self.pending.front() {
                *step = (*step).max(next.arrival_step);
            }
        }
        while self.pending.front().is_some_and(|r| r.arrival_step <= *step) {
            self.waiting.extend(self.pending.pop_front());
        }
        let bs = self.alloc.block_size();
        let mut budget = self.config.token_budget;
        // A request's query tokens in a step stay within its encoder length.
        let chunk = self.encoder.as_ref().map_or(usize::MAX, |e| e.len);
        let mut picked: Vec<(usize, usize)> = Vec::new(); // (running index, q_len)
                                                          // Decodes: one token each, then the prompts in progress, in admission order.
        for (i, r) in self.running.iter().enumerate() {
            if !r.in_prompt() && budget > 0 {
                picked.push((i, 1));
                budget -= 1;
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            if r.in_prompt() && budget > 0 {
                let q = (r.spec.prompt_len - r.computed).min(budget).min(chunk);
                picked.push((i, q));
                budget -= q;
            }
        }
        // Admissions: room, budget, and blocks for the request's whole life (and its encoder
        // input's blocks, within the encoder step's budget).
        let mut admitted = Vec::new();
        let mut encoder_tokens = 0;
        while budget > 0 && self.running.len() < self.config.max_running {
            let Some(next) = self.waiting.front() else { break };
            let life = BlockTable::blocks_for(next.total_tokens(), bs);
            if self.alloc.num_free() < self.committed + life {
                break;
            }
            let mut encoder = BlockTable::new();
            if let Some(e) = &mut self.encoder {
                let over_budget = encoder_tokens > 0 && encoder_tokens + e.len > e.budget;
                if over_budget || BlockTable::blocks_for(e.len, e.alloc.block_size()) > e.alloc.num_free() {
                    break;
                }
                encoder.grow_to(e.len, &mut e.alloc)?;
                encoder_tokens += e.len;
            }
            let spec = self.waiting.pop_front().expect("front exists");
            self.committed += life;
            self.running.push(Running { spec, table: BlockTable::new(), encoder, computed: 0, generated: 0 });
            admitted.push(self.running.len() - 1);
            let q = spec.prompt_len.min(budget).min(chunk);
            picked.push((self.running.len() - 1, q));
            budget -= q;
        }
        // Decodes first (stable), as the attention metadata wants.
        let threshold = self.config.decode_threshold;
        picked.sort_by_key(|&(_, q)| !is_decode(q as i64, threshold));
        let mut batch = Batch::default();
        let a = &mut batch.arrays;
        a.query_start_loc.push(0);
        for &(i, q) in &picked {
            let r = &mut self.running[i];
            let before = r.table.blocks().len();
            r.table.grow_to(r.computed + q, &mut self.alloc)?;
            self.committed -= r.table.blocks().len() - before;
            for pos in r.computed..r.computed + q {
                a.slot_mapping.push(r.table.slot(pos, bs));
            }
            a.query_start_loc.push(a.slot_mapping.len() as i32);
            a.seq_lens.push((r.computed + q) as i32);
            batch.reqs.push(Scheduled { id: r.spec.id, q_len: q, context: r.computed });
            if is_decode(q as i64, threshold) {
                batch.num_decodes += 1;
                batch.num_decode_tokens += q;
            }
        }
        let rows: Vec<usize> = picked.iter().map(|&(i, _)| i).collect();
        block_table(a, rows.iter().map(|&i| self.running[i].table.blocks()));
        if let Some(e) = &self.encoder {
            // The encoder step: the admitted requests whole, slots for every token.
            let enc = &mut batch.encoder;
            enc.query_start_loc.push(0);
            for &i in &admitted {
                let r = &self.running[i];
                enc.slot_mapping.extend((0..e.len).map(|pos| r.encoder.slot(pos, e.alloc.block_size())));
                enc.query_start_loc.push(enc.slot_mapping.len() as i32);
                enc.seq_lens.push(e.len as i32);
                batch.encoder_reqs.push(Scheduled { id: r.spec.id, q_len: e.len, context: 0 });
            }
            block_table(enc, admitted.iter().map(|&i| self.running[i].encoder.blocks()));
            // The cross-attention step: the decoder's tokens over each request's encoder blocks.
            let cross = &mut batch.cross;
            cross.query_start_loc.clone_from(&batch.arrays.query_start_loc);
            cross.seq_lens = vec![e.len as i32; rows.len()];
            cross.slot_mapping = vec![-1; batch.arrays.num_tokens()];
            block_table(cross, rows.iter().map(|&i| self.running[i].encoder.blocks()));
        }
        Ok(batch)
    }

    /// Books a computed batch: each request's new tokens are cached; a request whose prompt is
    /// done generated a token (its last prompt chunk made the first); finished requests give
    /// their blocks back. Returns the ids that finished.
    pub fn complete(&mut self, batch: &Batch) -> Result<Vec<usize>, AllocError> {
        for s in &batch.reqs {
            let r = self.running.iter_mut().find(|r| r.spec.id == s.id).expect("a scheduled request is running");
            r.computed += s.q_len;
            if !r.in_prompt() {
                r.generated += 1;
            }
        }
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.generated >= r.spec.gen_len {
                let mut r = self.running.remove(i);
                let life = BlockTable::blocks_for(r.spec.total_tokens(), self.alloc.block_size());
                self.committed -= life - r.table.blocks().len();
                r.table.release(&mut self.alloc)?;
                if let Some(e) = &mut self.encoder {
                    r.encoder.release(&mut e.alloc)?;
                }
                self.finished += 1;
                done.push(r.spec.id);
            } else {
                i += 1;
            }
        }
        Ok(done)
    }
}

/// `a`'s block table: one row per request of `rows`' blocks, as wide as the longest, padded with
/// 0.
fn block_table<'a>(a: &mut StepArrays, rows: impl Iterator<Item = &'a [i32]> + Clone) {
    a.block_table_stride = rows.clone().map(<[i32]>::len).max().unwrap_or(0);
    for blocks in rows {
        a.block_table.extend_from_slice(blocks);
        a.block_table.resize(a.block_table.len() + a.block_table_stride - blocks.len(), 0);
    }
}
