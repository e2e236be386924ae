//! GPT-2 byte-level BPE built from the GGUF's own arrays (`tokenizer.ggml.tokens`,
//! `tokenizer.ggml.merges`, `tokenizer.ggml.token_type`, the bos/eos ids).
//!
//! Encoding: control tokens (type 3, e.g. `<|im_start|>`) are matched literally first; the text
//! between them is pre-tokenized as `tokenizer.ggml.pre = "smollm"` does (every digit alone,
//! then the GPT-2 split: contractions, ` ?letters`, ` ?digits`, ` ?other`, whitespace runs that
//! leave their last character to the next word), each piece's bytes are mapped to the GPT-2
//! byte alphabet and merged by rank. Letters, digits and whitespace are Rust's
//! `char::is_alphabetic`, `is_numeric` and `is_whitespace` (the regex classes `\p{L}`, `\p{N}`,
//! `\s`; they differ only for combining marks that Unicode counts as alphabetic).

use crate::gguf::{Gguf, GgufError};
use std::collections::HashMap;

/// GGUF token type of control tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, ...).
const TYPE_CONTROL: i32 = 3;
/// GGUF token type of user-defined tokens (matched literally, like control tokens).
const TYPE_USER_DEFINED: i32 = 4;

pub struct Tokenizer {
    tokens: Vec<String>,
    /// Byte-level string -> id.
    vocab: HashMap<String, u32>,
    /// (left, right) -> (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Literal tokens, longest first.
    specials: Vec<(String, u32)>,
    is_special: Vec<bool>,
    /// Byte -> id of its one-character token (the unknown token's id for the few bytes the
    /// vocabulary lacks).
    byte_token: [u32; 256],
    /// Byte-level character -> byte.
    char_byte: HashMap<char, u8>,
    pub bos_id: u32,
    pub eos_id: u32,
    /// Ids that end a generation: eos, and `<|endoftext|>` / `<|im_end|>` when present.
    stop_ids: Vec<u32>,
}

/// GPT-2's byte alphabet: printable bytes stand for themselves, the others (control bytes,
/// space, DEL, NBSP...) for the characters from U+0100 on, in byte order.
fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        out[b as usize] = if printable {
            char::from_u32(b).expect("a byte is a char")
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below U+0200")
        };
    }
    out
}

impl Tokenizer {
    pub fn from_gguf(g: &Gguf) -> Result<Self, GgufError> {
        let tokens = g.strings("tokenizer.ggml.tokens")?;
        let merges_txt = g.strings("tokenizer.ggml.merges")?;
        let types = g.i32s("tokenizer.ggml.token_type").unwrap_or_else(|_| vec![1; tokens.len()]);
        let model = g.string("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(GgufError::Unsupported(format!("tokenizer.ggml.model \"{model}\" (only \"gpt2\" byte-level BPE)")));
        }
        if types.len() != tokens.len() {
            return Err(GgufError::Unsupported(format!("{} token types for {} tokens", types.len(), tokens.len())));
        }
        let vocab: HashMap<String, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let mut merges = HashMap::with_capacity(merges_txt.len());
        for (rank, m) in merges_txt.iter().enumerate() {
            let (a, b) = m.split_once(' ').ok_or_else(|| GgufError::Unsupported(format!("merge {rank} \"{m}\" has no space")))?;
            let id = |s: &str| vocab.get(s).copied().ok_or_else(|| GgufError::Unsupported(format!("merge {rank}: \"{s}\" is not a token")));
            let merged = id(&format!("{a}{b}"))?;
            merges.entry((id(a)?, id(b)?)).or_insert((rank as u32, merged));
        }
        let chars = byte_chars();
        let unknown = g.u32("tokenizer.ggml.unknown_token_id").ok();
        let mut byte_token = [0u32; 256];
        for (b, c) in chars.iter().enumerate() {
            byte_token[b] = vocab
                .get(&c.to_string())
                .copied()
                .or(unknown)
                .ok_or_else(|| GgufError::Unsupported(format!("byte {b:#04x} has no token and there is no unknown token")))?;
        }
        let char_byte = chars.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let is_special: Vec<bool> = types.iter().map(|&t| t == TYPE_CONTROL || t == TYPE_USER_DEFINED).collect();
        let mut specials: Vec<(String, u32)> =
            tokens.iter().enumerate().filter(|&(i, t)| is_special[i] && !t.is_empty()).map(|(i, t)| (t.clone(), i as u32)).collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let bos_id = g.u32("tokenizer.ggml.bos_token_id")?;
        let eos_id = g.u32("tokenizer.ggml.eos_token_id")?;
        let mut stop_ids = vec![eos_id];
        for name in ["<|endoftext|>", "<|im_end|>"] {
            if let Some(&id) = vocab.get(name) {
                if !stop_ids.contains(&id) {
                    stop_ids.push(id);
                }
            }
        }
        Ok(Tokenizer { tokens, vocab, merges, specials, is_special, byte_token, char_byte, bos_id, eos_id, stop_ids })
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn token_id(&self, s: &str) -> Option<u32> {
        self.vocab.get(s).copied()
    }

    pub fn is_stop(&self, id: u32) -> bool {
        self.stop_ids.contains(&id)
    }

    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// Token ids of `text`, control tokens written out (`<|im_start|>`) becoming their ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            // The earliest control token (the longest at a position).
            let found = self
                .specials
                .iter()
                .filter_map(|(s, id)| rest.find(s.as_str()).map(|at| (at, s.len(), *id)))
                .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            match found {
                Some((at, len, id)) => {
                    self.encode_plain(&rest[..at], &mut out);
                    out.push(id);
                    rest = &rest[at + len..];
                }
                None => {
                    self.encode_plain(rest, &mut out);
                    break;
                }
            }
        }
        out
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        for piece in pre_tokenize(text) {
            self.bpe(piece, out);
        }
    }

    /// Merges one pre-token's bytes by rank.
    fn bpe(&self, piece: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<u32> = piece.bytes().map(|b| self.byte_token[b as usize]).collect();
        loop {
            let best =
                syms.windows(2).enumerate().filter_map(|(i, w)| self.merges.get(&(w[0], w[1])).map(|&(rank, id)| (rank, i, id))).min();
            let Some((_, i, id)) = best else { break };
            syms[i] = id;
            syms.remove(i + 1);
        }
        out.extend_from_slice(&syms);
    }

    /// The bytes a token stands for (control tokens: their text).
    pub fn token_bytes(&self, id: u32, out: &mut Vec<u8>) {
        let Some(t) = self.tokens.get(id as usize) else { return };
        if self.is_special[id as usize] {
            out.extend_from_slice(t.as_bytes());
            return;
        }
        for c in t.chars() {
            match self.char_byte.get(&c) {
                Some(&b) => out.push(b),
                None => out.extend_from_slice(c.to_string().as_bytes()),
            }
        }
    }

    /// The text of `ids` (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            self.token_bytes(id, &mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Turns generated tokens into text as they come, holding back an incomplete UTF-8 sequence.
#[derive(Default)]
pub struct TextStream {
    pending: Vec<u8>,
}

impl TextStream {
    /// The text `id` completes (maybe empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        tok.token_bytes(id, &mut self.pending);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            // An incomplete sequence at the end waits for the next token; an invalid one is
            // replaced now.
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => self.pending.len(),
        };
        let rest = self.pending.split_off(valid);
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending = rest;
        text
    }

    /// What is left (an incomplete sequence, replaced).
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

/// `smollm` pre-tokenization: digits alone, then the GPT-2 split of the text between them.
pub fn pre_tokenize(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, c) in text.char_indices() {
        if c.is_numeric() {
            gpt2_split(&text[start..i], &mut out);
            out.push(&text[i..i + c.len_utf8()]);
            start = i + c.len_utf8();
        }
    }
    gpt2_split(&text[start..], &mut out);
    out
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_alphabetic() {
        Class::Letter
    } else if c.is_numeric() {
        Class::Number
    } else if c.is_whitespace() {
        Class::Space
    } else {
        Class::Other
    }
}

/// GPT-2's pattern `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
fn gpt2_split<'a>(text: &'a str, out: &mut Vec<&'a str>) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let n = chars.len();
    let at = |i: usize| if i < n { chars[i].0 } else { text.len() };
    let mut i = 0;
    while i < n {
        let c = chars[i].1;
        // Contractions.
        if c == '\'' {
            let rest = &text[at(i + 1)..];
            if let Some(len) = ["s", "t", "re", "ve", "m", "ll", "d"].iter().find(|s| rest.starts_with(**s)).map(|s| s.len()) {
                let end = at(i + 1) + len;
                out.push(&text[at(i)..end]);
                while i < n && chars[i].0 < end {
                    i += 1;
                }
                continue;
            }
        }
        // An optional space before a run of one class.
        let (lead, first) =
            if c == ' ' && i + 1 < n && class(chars[i + 1].1) != Class::Space { (1, class(chars[i + 1].1)) } else { (0, class(c)) };
        if first != Class::Space {
            let mut j = i + lead;
            while j < n && class(chars[j].1) == first {
                j += 1;
            }
            out.push(&text[at(i)..at(j)]);
            i = j;
            continue;
        }
        // Whitespace: the run, less its last character when a non-space follows (it goes with
        // the next piece), unless that leaves nothing.
        let mut j = i;
        while j < n && class(chars[j].1) == Class::Space {
            j += 1;
        }
        let end = if j < n && j - i > 1 { j - 1 } else { j };
        out.push(&text[at(i)..at(end)]);
        i = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_like_gpt2_with_single_digits() {
        assert_eq!(pre_tokenize("Hello world"), ["Hello", " world"]);
        assert_eq!(pre_tokenize("it's 2024!"), ["it", "'s", " ", "2", "0", "2", "4", "!"]);
        assert_eq!(pre_tokenize("a  b"), ["a", " ", " b"]);
        assert_eq!(pre_tokenize("a\n\nb "), ["a", "\n", "\n", "b", " "]);
        assert_eq!(pre_tokenize("x \n  y"), ["x", " \n ", " y"]);
        assert_eq!(pre_tokenize("(ok) ..."), ["(", "ok", ")", " ..."]);
    }

    #[test]
    fn byte_alphabet_is_a_bijection() {
        let chars = byte_chars();
        let set: std::collections::HashSet<char> = chars.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(chars[b' ' as usize], 'Ġ');
        assert_eq!(chars[b'\n' as usize], 'Ċ');
    }
}
