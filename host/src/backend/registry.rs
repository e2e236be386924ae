//! Every backend the library has, and lookup by name. Adding a backend: a module with its
//! `BackendSpec`, one entry here, and its place in [`super::priority`].

use super::cpu::CPU;
use super::mla::MLA;
use super::spec::BackendSpec;
use super::tensor_core::TENSOR_CORE;

/// Every backend, in registration order (ranking is [`priorities`](super::priorities)'s).
pub static REGISTRY: &[&BackendSpec] = &[&TENSOR_CORE, &MLA, &CPU];

/// The backend called `name` (case-insensitive; `_` reads as `-`, so `TENSOR_CORE` works).
pub fn find_backend(name: &str) -> Option<&'static BackendSpec> {
    let name = name.trim().to_ascii_lowercase().replace('_', "-");
    REGISTRY.iter().copied().find(|b| b.name == name)
}

/// The registered names, in registry order.
pub fn backend_names() -> Vec<&'static str> {
    REGISTRY.iter().map(|b| b.name).collect()
}
