//! The library's error type. Every refusal names the argument and the value that caused it.

use crate::dtype::DType;

pub type Result<T> = std::result::Result<T, AttnError>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttnError {
    /// No CUDA driver library, or it sees no GPU (or not the one asked for).
    #[error("no CUDA driver or no GPU ({0})")]
    NoDevice(String),
    /// A shape, length or count that does not fit the operation.
    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument { arg: &'static str, reason: String },
    /// A dtype the operation (or this backend) cannot take.
    #[error("unsupported dtype for `{arg}`: {dtype:?} ({reason})")]
    UnsupportedDType { arg: &'static str, dtype: DType, reason: &'static str },
    /// A kernel met slots past the cache's capacity (it wrote nothing for them). `first`: the
    /// first such slot recorded, when one was.
    #[error("{}; those tokens were not written", describe_slot(first))]
    SlotOutOfRange { first: Option<BadSlot> },
    /// A kernel met block-table entries outside the cache (it read nothing from them). `first`:
    /// the first such entry, when it was recorded: the CPU path records it; the GPU attention
    /// kernels raise the status bit alone (recording it cost registers in their key loops), and
    /// [`BatchMetadata::find_bad_block`](crate::batch::BatchMetadata::find_bad_block) names it.
    /// `forward` refuses such entries before launch, naming request and entry.
    #[error("{}; those blocks were not read", describe_block(first))]
    BlockOutOfRange { first: Option<BadBlock> },
    /// No embedded kernel module runs on this GPU.
    #[error("unsupported GPU: compute capability {major}.{minor} (kernels are built for {available})")]
    UnsupportedDevice { major: i32, minor: i32, available: String },
    /// The chosen backend cannot do this yet: `missing` names the kernel (or part) that does
    /// not exist. Raised before anything is launched.
    #[error("{what} is not available: {missing}")]
    MissingKernel { what: &'static str, missing: &'static str },
    /// The CUDA driver reported an error (or is not installed).
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
}

/// A block id outside the cache: `block_table[request][entry] == block`, and the cache has
/// `num_blocks` blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadBlock {
    pub request: u32,
    pub entry: u32,
    pub block: i64,
    pub num_blocks: u64,
}

/// A slot past the cache: `slot_mapping[token] == slot`, and the cache has `num_slots` slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadSlot {
    pub token: u32,
    pub slot: i64,
    pub num_slots: u64,
}

fn describe_block(first: &Option<BadBlock>) -> String {
    match first {
        Some(b) => format!(
            "block id {} at request {}, block-table entry {} is outside the cache's {} blocks",
            b.block, b.request, b.entry, b.num_blocks
        ),
        None => "block_table had entries outside the cache (BatchMetadata::find_bad_block names the first)".to_string(),
    }
}

fn describe_slot(first: &Option<BadSlot>) -> String {
    match first {
        Some(s) => format!("slot {} of token {} is at or past the cache's {} slots", s.slot, s.token, s.num_slots),
        None => "slot_mapping had entries at or past the cache capacity".to_string(),
    }
}

impl AttnError {
    pub(crate) fn invalid(arg: &'static str, reason: impl Into<String>) -> Self {
        AttnError::InvalidArgument { arg, reason: reason.into() }
    }
}

/// `Err(InvalidArgument)` unless `cond`.
pub(crate) fn ensure(cond: bool, arg: &'static str, reason: impl FnOnce() -> String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(AttnError::invalid(arg, reason()))
    }
}
