//! How errors reach candle users: every op returns [`candle_core::Result`], as candle's own ops
//! do. A refusal by attn-rs keeps its message (which names the argument and the value, e.g.
//! "invalid argument `q`: has 4 heads, the model 8") inside [`candle_core::Error::Wrapped`]; a
//! refusal by this crate (a layout it cannot pass without a copy, a tensor on another device) is
//! a [`candle_core::Error::Msg`] of the same form. Both carry a backtrace when
//! `RUST_BACKTRACE` asks for one, as candle's errors do.

use attn_rs::AttnError;

/// An attn-rs error as a candle error (its message kept).
pub(crate) fn attn(e: AttnError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// A refusal of argument `arg`, in attn-rs's wording.
pub(crate) fn invalid(arg: &str, reason: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("invalid argument `{arg}`: {reason}")).bt()
}

/// `Err(invalid(arg, reason()))` unless `cond`.
pub(crate) fn ensure(cond: bool, arg: &str, reason: impl FnOnce() -> String) -> candle_core::Result<()> {
    if cond {
        Ok(())
    } else {
        Err(invalid(arg, reason()))
    }
}

/// Converts attn-rs results.
pub(crate) trait AttnResult<T> {
    fn c(self) -> candle_core::Result<T>;
}

impl<T> AttnResult<T> for attn_rs::Result<T> {
    fn c(self) -> candle_core::Result<T> {
        self.map_err(attn)
    }
}
