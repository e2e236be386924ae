//! Continuous batching over the paged caches: a block allocator, requests waiting and running,
//! and a step loop that schedules a mixed batch (one token for every decoding request first,
//! then prompt chunks: chunked prefill within a token budget, then admissions while blocks and
//! room allow), builds attn-rs's step metadata once, runs the model, samples greedily and
//! retires finished requests.

use crate::error::{Result, ServeError};
use crate::glue::PagedAttention;
use crate::model::{Llama, StepTokens};
use attn_rs::forward::PhaseTimes;
use attn_rs::metadata::StepInput;
use candle_core::D;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A free list of block ids, shared by every layer (a block id is the same block in each
/// layer's cache).
#[derive(Clone, Debug)]
pub struct BlockAllocator {
    free: Vec<u32>,
    total: usize,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize) -> Self {
        BlockAllocator { free: (0..num_blocks as u32).rev().collect(), total: num_blocks }
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_blocks(&self) -> usize {
        self.total
    }

    pub fn allocate(&mut self) -> Option<u32> {
        self.free.pop()
    }

    pub fn release(&mut self, blocks: &mut Vec<u32>) {
        self.free.append(blocks);
        debug_assert!(self.free.len() <= self.total);
    }
}

/// Scheduler limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Requests running at once.
    pub max_running: usize,
    /// Tokens a step computes (decodes take one each; prompt chunks fill the rest).
    pub token_budget: usize,
    /// Keep every step's sampled logits in the outputs (the check).
    pub record_logits: bool,
}

/// A generation request (prompt already tokenized).
#[derive(Clone, Debug)]
pub struct Request {
    pub id: usize,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    /// Stop at a stop token (else generate `max_new_tokens` whatever comes: benchmarks).
    pub stop_at_eos: bool,
}

/// Why a request finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// It generated a stop token (kept as its last token).
    Eos,
    /// It reached `max_new_tokens`.
    Length,
}

/// A finished request.
#[derive(Clone, Debug)]
pub struct Output {
    pub id: usize,
    pub prompt_len: usize,
    pub tokens: Vec<u32>,
    /// Each generated token's logits (when recorded).
    pub logits: Vec<Vec<f32>>,
    /// From the engine's start to the first token.
    pub ttft: Duration,
    /// From the engine's start to the last token.
    pub finished_at: Duration,
    pub stop: Stop,
}

/// What a step did.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepReport {
    pub num_reqs: usize,
    pub num_decodes: usize,
    pub num_tokens: usize,
    pub prefill_tokens: usize,
    /// Tokens sampled.
    pub sampled: usize,
    pub wall: Duration,
    /// Scheduling and the attention metadata build.
    pub metadata: Duration,
    /// attn-rs's cache write and attention over all layers (GPU: CUDA events).
    pub attn: PhaseTimes,
    /// Wall time of the attention calls (glue included; on the GPU: enqueueing only).
    pub attn_calls: Duration,
}

struct Seq {
    req: Request,
    /// Prompt, then generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    computed: usize,
    blocks: Vec<u32>,
    /// Blocks its whole life takes (prompt + max_new_tokens), reserved at admission.
    life_blocks: usize,
    logits: Vec<Vec<f32>>,
    ttft: Option<Duration>,
    done: Option<Stop>,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }
}

/// One scheduled request of a step: index into `running`, query tokens.
#[derive(Clone, Copy)]
struct Pick {
    seq: usize,
    q_len: usize,
}

pub struct Engine<'m> {
    model: &'m Llama,
    attn: PagedAttention,
    cfg: EngineConfig,
    alloc: BlockAllocator,
    block_size: usize,
    /// Blocks the running requests have reserved but not taken yet.
    reserved: usize,
    waiting: VecDeque<Request>,
    running: Vec<Seq>,
    finished: Vec<Output>,
    /// Tokens that end a request (with `stop_at_eos`).
    stop_ids: Vec<u32>,
    started: Instant,
    // Reused step arrays.
    tokens: Vec<u32>,
    positions: Vec<u32>,
    logit_rows: Vec<u32>,
    query_start_loc: Vec<i32>,
    seq_lens: Vec<i32>,
    block_table: Vec<i32>,
    slot_mapping: Vec<i64>,
}

/// A token the engine produced, for streaming.
pub struct TokenEvent {
    pub id: usize,
    pub token: u32,
    /// The request finished with this token.
    pub finished: Option<Stop>,
}

impl<'m> Engine<'m> {
    pub fn new(model: &'m Llama, attn: PagedAttention, cfg: EngineConfig, stop_ids: Vec<u32>) -> Result<Self> {
        if cfg.max_running == 0 || cfg.token_budget < cfg.max_running {
            return Err(ServeError::Config(format!("token budget {} must be at least max running {}", cfg.token_budget, cfg.max_running)));
        }
        let alloc = BlockAllocator::new(attn.num_blocks());
        let block_size = attn.block_size();
        Ok(Engine {
            model,
            attn,
            cfg,
            alloc,
            block_size,
            reserved: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            finished: Vec::new(),
            stop_ids,
            started: Instant::now(),
            tokens: Vec::new(),
            positions: Vec::new(),
            logit_rows: Vec::new(),
            query_start_loc: Vec::new(),
            seq_lens: Vec::new(),
            block_table: Vec::new(),
            slot_mapping: Vec::new(),
        })
    }

    pub fn attention(&mut self) -> &mut PagedAttention {
        &mut self.attn
    }

    /// Times from now (the requests' arrival).
    pub fn restart_clock(&mut self) {
        self.started = Instant::now();
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Queues `req`; refused when its whole life could never fit the cache.
    pub fn add(&mut self, req: Request) -> Result<()> {
        let life = self.blocks_for(req.prompt.len() + req.max_new_tokens);
        if req.prompt.is_empty() || life > self.alloc.num_blocks() {
            return Err(ServeError::Config(format!(
                "request {}: {} prompt tokens + {} new need {life} blocks of {} (the cache has {})",
                req.id,
                req.prompt.len(),
                req.max_new_tokens,
                self.block_size,
                self.alloc.num_blocks()
            )));
        }
        self.waiting.push_back(req);
        Ok(())
    }

    pub fn is_done(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Decodes (one pending token) first, then prompt chunks in admission order, then
    /// admissions; returned decodes first.
    fn schedule(&mut self) -> Vec<Pick> {
        let mut budget = self.cfg.token_budget;
        let mut picks = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if s.computed >= s.req.prompt.len() && budget > 0 {
                picks.push(Pick { seq: i, q_len: s.tokens.len() - s.computed });
                budget -= 1;
            }
        }
        for (i, s) in self.running.iter().enumerate() {
            if s.computed < s.req.prompt.len() && budget > 0 {
                let q = (s.req.prompt.len() - s.computed).min(budget);
                picks.push(Pick { seq: i, q_len: q });
                budget -= q;
            }
        }
        while budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(next) = self.waiting.front() else { break };
            let life = self.blocks_for(next.prompt.len() + next.max_new_tokens);
            if self.alloc.num_free() < self.reserved + life {
                break;
            }
            let req = self.waiting.pop_front().expect("front exists");
            self.reserved += life;
            let q = req.prompt.len().min(budget);
            budget -= q;
            self.running.push(Seq {
                tokens: req.prompt.clone(),
                req,
                computed: 0,
                blocks: Vec::new(),
                life_blocks: life,
                logits: Vec::new(),
                ttft: None,
                done: None,
            });
            picks.push(Pick { seq: self.running.len() - 1, q_len: q });
        }
        // One-token prompt chunks are decodes to attn-rs (decode threshold 1): keep the batch
        // decodes first.
        picks.sort_by_key(|p| p.q_len != 1);
        picks
    }

    /// Runs one step; `on_token` sees every sampled token. `None` when nothing is left.
    pub fn step(&mut self, on_token: &mut dyn FnMut(&TokenEvent)) -> Result<Option<StepReport>> {
        if self.is_done() {
            return Ok(None);
        }
        let started = Instant::now();
        let picks = self.schedule();
        if picks.is_empty() {
            return Err(ServeError::Config("nothing could be scheduled (too few KV-cache blocks?)".into()));
        }
        let mut report = StepReport { num_reqs: picks.len(), ..StepReport::default() };
        self.fill_arrays(&picks, &mut report)?;
        let input = StepInput {
            query_start_loc: &self.query_start_loc,
            seq_lens: &self.seq_lens,
            block_table: &self.block_table,
            block_table_stride: self.block_table.len() / picks.len(),
            slot_mapping: &self.slot_mapping,
            num_actual_tokens: self.tokens.len(),
            num_blocks: self.alloc.num_blocks(),
            block_size: self.block_size,
        };
        let split = self.attn.build(&input)?;
        report.num_decodes = split.num_decodes;
        report.metadata = started.elapsed();

        let step = StepTokens { tokens: &self.tokens, positions: &self.positions, logit_rows: &self.logit_rows };
        let logits = self.model.forward(&step, &mut self.attn)?;
        // Greedy: the argmax on the device, or every row's logits to the host when recorded.
        let (sampled, rows): (Vec<u32>, Vec<Vec<f32>>) = match logits {
            None => (Vec::new(), Vec::new()),
            Some(logits) if self.cfg.record_logits => {
                let rows = logits.to_vec2::<f32>()?;
                (rows.iter().map(|r| crate::reference::argmax(r)).collect(), rows)
            }
            Some(logits) => (logits.argmax(D::Minus1)?.to_vec1::<u32>()?, Vec::new()),
        };
        (report.attn, report.attn_calls) = self.attn.take_times()?;
        let now = self.started.elapsed();
        let mut rows = rows.into_iter();
        let mut sampled = sampled.into_iter();
        for p in &picks {
            let s = &mut self.running[p.seq];
            s.computed += p.q_len;
            if s.computed < s.tokens.len() {
                continue; // a prompt chunk that does not end the prompt
            }
            let token = sampled.next().expect("a logits row per sampling request");
            if let Some(r) = rows.next() {
                s.logits.push(r);
            }
            s.tokens.push(token);
            s.ttft.get_or_insert(now);
            let finished = if s.req.stop_at_eos && self.stop_ids.contains(&token) {
                Some(Stop::Eos)
            } else if s.generated() >= s.req.max_new_tokens {
                Some(Stop::Length)
            } else {
                None
            };
            report.sampled += 1;
            on_token(&TokenEvent { id: s.req.id, token, finished });
            if let Some(stop) = finished {
                s.done = Some(stop);
            }
        }
        self.retire(now);
        report.wall = started.elapsed();
        Ok(Some(report))
    }

    /// Moves finished requests out, giving their blocks and reservations back.
    fn retire(&mut self, now: Duration) {
        let mut i = 0;
        while i < self.running.len() {
            let Some(stop) = self.running[i].done else {
                i += 1;
                continue;
            };
            let mut s = self.running.remove(i);
            self.reserved -= s.life_blocks - s.blocks.len();
            self.alloc.release(&mut s.blocks);
            let prompt_len = s.req.prompt.len();
            self.finished.push(Output {
                id: s.req.id,
                prompt_len,
                tokens: s.tokens.split_off(prompt_len),
                logits: s.logits,
                ttft: s.ttft.unwrap_or(now),
                finished_at: now,
                stop,
            });
        }
    }

    /// The requests finished so far (each once).
    pub fn take_finished(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.finished)
    }

    /// Steps until every request finished; returns them (in finishing order) and every step's
    /// report.
    pub fn run(&mut self, on_token: &mut dyn FnMut(&TokenEvent)) -> Result<(Vec<Output>, Vec<StepReport>)> {
        let mut reports = Vec::new();
        while let Some(r) = self.step(on_token)? {
            reports.push(r);
        }
        Ok((self.take_finished(), reports))
    }

    /// The step's arrays from the picks (growing block tables as needed).
    fn fill_arrays(&mut self, picks: &[Pick], report: &mut StepReport) -> Result<()> {
        let bs = self.block_size;
        self.tokens.clear();
        self.positions.clear();
        self.logit_rows.clear();
        self.query_start_loc.clear();
        self.seq_lens.clear();
        self.block_table.clear();
        self.slot_mapping.clear();
        self.query_start_loc.push(0);
        for p in picks {
            let s = &mut self.running[p.seq];
            let end = s.computed + p.q_len;
            while s.blocks.len() < end.div_ceil(bs) {
                let b = self.alloc.allocate().ok_or_else(|| ServeError::Config("out of KV-cache blocks".into()))?;
                s.blocks.push(b);
                self.reserved -= 1;
            }
            for pos in s.computed..end {
                self.tokens.push(s.tokens[pos]);
                self.positions.push(pos as u32);
                self.slot_mapping.push(s.blocks[pos / bs] as i64 * bs as i64 + (pos % bs) as i64);
            }
            if end == s.tokens.len() {
                self.logit_rows.push(self.tokens.len() as u32 - 1);
            }
            if s.computed < s.req.prompt.len() {
                report.prefill_tokens += p.q_len;
            }
            self.query_start_loc.push(self.tokens.len() as i32);
            self.seq_lens.push(end as i32);
        }
        report.num_tokens = self.tokens.len();
        let stride = picks.iter().map(|p| self.running[p.seq].blocks.len()).max().unwrap_or(0);
        for p in picks {
            let blocks = &self.running[p.seq].blocks;
            self.block_table.extend(blocks.iter().map(|&b| b as i32));
            self.block_table.resize(self.block_table.len() + stride - blocks.len(), 0);
        }
        Ok(())
    }
}
