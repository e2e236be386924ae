//! The library's error type. Every refusal names the argument and the value that caused it.

use crate::dtype::DType;

pub type Result<T> = std::result::Result<T, AttnError>;

#[derive(Debug, thiserror::Error)]
pub enum AttnError {
    /// A shape, length or count that does not fit the operation.
    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument { arg: &'static str, reason: String },
    /// A dtype the operation (or this backend) cannot take.
    #[error("unsupported dtype for `{arg}`: {dtype:?} ({reason})")]
    UnsupportedDType { arg: &'static str, dtype: DType, reason: &'static str },
    /// A kernel met slots past the cache's capacity (it wrote nothing for them).
    #[error("slot_mapping had entries at or past the cache capacity; those tokens were not written")]
    SlotOutOfRange,
    /// A kernel met block-table entries outside the cache (it read nothing from them).
    #[error("block_table had entries outside the cache; those blocks were not read")]
    BlockOutOfRange,
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
