//! The order backends are tried in, by attention kind and device (best first). A Hopper backend
//! goes in front of `tensor-core` for `sm_90` here. On a machine with a GPU only GPU backends
//! are candidates: `cpu` runs there only when an override names it.

use super::config::DeviceInfo;
use super::cpu::CPU;
use super::mla::MLA;
use super::spec::{AttentionKind, BackendSpec};
use super::tensor_core::TENSOR_CORE;

static GPU_STANDARD: [&BackendSpec; 1] = [&TENSOR_CORE];
static GPU_MLA: [&BackendSpec; 1] = [&MLA];
static NO_GPU: [&BackendSpec; 1] = [&CPU];

/// The candidates for `kind` on `device`, best first. Each still has to accept the model
/// ([`super::validate::refusal_reasons`]). With a GPU they are GPU backends only: a model none
/// of them takes is refused, never handed to the CPU (whose tensors are host memory).
pub fn priorities(kind: AttentionKind, device: &DeviceInfo) -> &'static [&'static BackendSpec] {
    match (device.compute_capability, kind) {
        (None, _) => &NO_GPU,
        (Some(_), AttentionKind::Standard) => &GPU_STANDARD,
        (Some(_), AttentionKind::Mla) => &GPU_MLA,
    }
}
