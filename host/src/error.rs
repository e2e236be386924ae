//! The library's error type. Every refusal names the argument and the value that caused it.

use crate::dtype::DType;

/// The result of every fallible call of the library.
pub type Result<T> = std::result::Result<T, AttnError>;

/// Why a call was refused or failed.
///
/// Refusals ([`InvalidArgument`](Self::InvalidArgument),
/// [`UnsupportedDType`](Self::UnsupportedDType), [`MissingKernel`](Self::MissingKernel)) happen
/// before anything is enqueued: the call had no effect. [`SlotOutOfRange`](Self::SlotOutOfRange),
/// [`BlockOutOfRange`](Self::BlockOutOfRange) and [`IndexOutOfRange`](Self::IndexOutOfRange) come from reading a [`DeviceStatus`](crate::DeviceStatus)
/// (or from the CPU path): the kernels skipped that work and wrote or read nothing out of
/// bounds. [`Driver`](Self::Driver) is the CUDA driver's own error (for example a launch that
/// failed, or a stream in an error state).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttnError {
    /// No CUDA driver library, or it sees no GPU (or not the one asked for).
    #[error("no CUDA driver or no GPU ({0})")]
    NoDevice(String),
    /// A shape, length or count that does not fit the operation.
    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument {
        /// The argument (or field, e.g. `block_table`, `workspace`) that was refused.
        arg: &'static str,
        /// What was wrong with it, with the values involved.
        reason: String,
    },
    /// A dtype the operation (or this backend) cannot take.
    #[error("unsupported dtype for `{arg}`: {dtype:?} ({reason})")]
    UnsupportedDType {
        /// The argument whose dtype was refused.
        arg: &'static str,
        /// The dtype it had.
        dtype: DType,
        /// Which dtypes the operation takes there.
        reason: &'static str,
    },
    /// A kernel met slots past the cache's capacity (it wrote nothing for them). `first`: the
    /// first such slot recorded, when one was.
    #[error("{}; those tokens were not written", describe_slot(first))]
    SlotOutOfRange {
        /// The first offending slot, when one was recorded.
        first: Option<BadSlot>,
    },
    /// A kernel met block-table entries outside the cache (it read nothing from them). `first`:
    /// the first such entry, when it was recorded: the CPU path records it; the GPU attention
    /// kernels raise the status bit alone (recording it cost registers in their key loops), and
    /// [`BatchMetadata::find_bad_block`](crate::batch::BatchMetadata::find_bad_block) names it.
    /// `forward` refuses such entries before launch, naming request and entry.
    #[error("{}; those blocks were not read", describe_block(first))]
    BlockOutOfRange {
        /// The first offending block-table entry, when one was recorded.
        first: Option<BadBlock>,
    },
    /// Sparse MLA met index entries that are neither -1 (padding) nor a position of the token's
    /// request (it read nothing for them). `first`: the first one recorded.
    #[error("{}; those entries were not read", describe_index(first))]
    IndexOutOfRange {
        /// The first offending entry, when one was recorded.
        first: Option<BadIndex>,
    },
    /// No embedded kernel module runs on this GPU.
    #[error("unsupported GPU: compute capability {major}.{minor} (kernels are built for {available})")]
    UnsupportedDevice {
        /// The GPU's compute capability, major part (8 for sm_80).
        major: i32,
        /// The GPU's compute capability, minor part.
        minor: i32,
        /// The targets embedded in this build (`sm_80, sm_90a`).
        available: String,
    },
    /// The chosen backend cannot do this yet: `missing` names the kernel (or part) that does
    /// not exist. Raised before anything is launched.
    #[error("{what} is not available: {missing}")]
    MissingKernel {
        /// The operation asked for.
        what: &'static str,
        /// The kernel or part of the backend it lacks.
        missing: &'static str,
    },
    /// NCCL, the collective library of context-parallel decode, is missing or reported an
    /// error.
    #[error("NCCL: {0}")]
    Nccl(String),
    /// The CUDA driver reported an error (or is not installed).
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
}

/// A block id outside the cache: `block_table[request][entry] == block`, and the cache has
/// `num_blocks` blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadBlock {
    /// The request (row of the block table), in batch order.
    pub request: u32,
    /// The entry within the request's row (the request's `entry`-th block).
    pub entry: u32,
    /// The block id found there (negative ids are outside the cache too).
    pub block: i64,
    /// Blocks in the cache the call was made with.
    pub num_blocks: u64,
}

/// A slot past the cache: `slot_mapping[token] == slot`, and the cache has `num_slots` slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadSlot {
    /// The token (row of the sources and of `slot_mapping`).
    pub token: u32,
    /// The slot found there (`block * block_size + offset`).
    pub slot: i64,
    /// Slots in the cache (`num_blocks * block_size`).
    pub num_slots: u64,
}

/// A sparse attention index outside its request: `indices[token][entry] == index`, and the
/// token's request has `seq_len` keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadIndex {
    /// The query token (row of the index tensor).
    pub token: u32,
    /// The entry within the token's row.
    pub entry: u32,
    /// The value found there (negative values other than -1 are outside too).
    pub index: i64,
    /// Keys of the token's request.
    pub seq_len: u64,
}

fn describe_index(first: &Option<BadIndex>) -> String {
    match first {
        Some(b) => {
            format!("sparse index {} at token {}, entry {} is outside its request's {} positions", b.index, b.token, b.entry, b.seq_len)
        }
        None => "indices had entries outside their requests".to_string(),
    }
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
