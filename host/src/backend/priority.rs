//! The order backends are tried in, by attention kind and device (best first). A Hopper backend
//! goes in front of `tensor-core` for `sm_90` here.

use super::config::DeviceInfo;
use super::cpu::CPU;
use super::mla::MLA;
use super::spec::{AttentionKind, BackendSpec};
use super::tensor_core::TENSOR_CORE;

static GPU_STANDARD: [&BackendSpec; 2] = [&TENSOR_CORE, &CPU];
static GPU_MLA: [&BackendSpec; 2] = [&MLA, &CPU];
static NO_GPU: [&BackendSpec; 1] = [&CPU];

/// The candidates for `kind` on `device`, best first. Each still has to accept the model
/// ([`super::validate::refusal_reasons`]); a GPU too old for the GPU backends falls through to
/// the last entry, the CPU.
pub fn priorities(kind: AttentionKind, device: &DeviceInfo) -> &'static [&'static BackendSpec] {
    match (device.compute_capability, kind) {
        (None, _) => &NO_GPU,
        (Some(_), AttentionKind::Standard) => &GPU_STANDARD,
        (Some(_), AttentionKind::Mla) => &GPU_MLA,
    }
}
