//! The chat prompt: the GGUF's own `tokenizer.chat_template` (a Jinja template, SmolLM2's is
//! ChatML with a default system message) rendered with minijinja.

use crate::gguf::{Gguf, GgufError};
use minijinja::{context, Environment, Error, ErrorKind};

pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    pub fn from_gguf(g: &Gguf, bos: &str, eos: &str) -> Result<Self, GgufError> {
        let source = g.string("tokenizer.chat_template")?;
        Self::new(source, bos, eos).map_err(|e| GgufError::Metadata { key: "tokenizer.chat_template".into(), what: e.to_string() })
    }

    pub fn new(source: String, bos: &str, eos: &str) -> Result<Self, Error> {
        let mut env = Environment::new();
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
        env.add_template_owned("chat", source)?;
        Ok(ChatTemplate { env, bos: bos.to_owned(), eos: eos.to_owned() })
    }

    /// The prompt of one user turn, ending with the assistant's header.
    pub fn user_prompt(&self, user: &str) -> Result<String, Error> {
        let messages = vec![context! { role => "user", content => user }];
        self.env.get_template("chat")?.render(context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos,
            eos_token => self.eos,
        })
    }
}
