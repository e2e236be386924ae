//! Streaming generated text per request to a terminal: each request's text is buffered and
//! written as `[id] text` pieces at line ends, or at a space once a piece is long enough, so
//! that interleaved requests stay readable.

use crate::tokenizer::{TextStream, Tokenizer};
use std::collections::HashMap;
use std::io::Write;

/// Characters a piece collects before it is written at the next space.
const PIECE: usize = 64;

#[derive(Default)]
struct Pending {
    decoder: TextStream,
    text: String,
    full: String,
}

pub struct Streamer<'t, W: Write> {
    tok: &'t Tokenizer,
    out: W,
    reqs: HashMap<usize, Pending>,
}

impl<'t, W: Write> Streamer<'t, W> {
    pub fn new(tok: &'t Tokenizer, out: W) -> Self {
        Streamer { tok, out, reqs: HashMap::new() }
    }

    /// Request `id` produced `token` (a stop token is not shown); `last` flushes it.
    pub fn token(&mut self, id: usize, token: u32, last: bool) -> std::io::Result<()> {
        let p = self.reqs.entry(id).or_default();
        if !self.tok.is_stop(token) {
            let piece = p.decoder.push(self.tok, token);
            p.text += &piece;
            p.full += &piece;
        }
        if last {
            let rest = p.decoder.finish();
            p.text += &rest;
            p.full += &rest;
        }
        loop {
            let cut = match p.text.find('\n') {
                Some(at) => Some((at, at + 1)),
                None if p.text.len() >= PIECE => p.text[PIECE..].find(' ').map(|at| (PIECE + at, PIECE + at)),
                None => None,
            };
            let Some((end, next)) = cut else { break };
            let line: String = p.text[..end].to_owned();
            p.text.drain(..next);
            writeln!(self.out, "[{id}] {line}")?;
        }
        if last {
            if !p.text.is_empty() {
                writeln!(self.out, "[{id}] {}", p.text)?;
                p.text.clear();
            }
            writeln!(self.out, "[{id}] <end>")?;
        }
        self.out.flush()
    }

    /// The whole text request `id` produced.
    pub fn text(&self, id: usize) -> &str {
        self.reqs.get(&id).map_or("", |p| p.full.as_str())
    }
}
