//! Picks the backend for a model, once per model: the override if there is one (it must accept
//! the model: no silent fallback), else the best-ranked backend that accepts it. On a machine
//! with a GPU that is a GPU backend or a refusal listing every backend's reasons: `cpu` runs
//! there only when named.

use super::config::{DeviceInfo, ModelConfig};
use super::cpu::CPU;
use super::priority::priorities;
use super::reason::Reason;
use super::registry::{backend_names, find_backend};
use super::spec::{BackendSpec, GraphSupport};
use super::validate::refusal_reasons;
use crate::error::{AttnError, Result};
use std::fmt;

/// The environment variable naming a backend to use instead of the automatic choice.
pub const OVERRIDE_ENV: &str = "ATTN_BACKEND";

/// Where an override came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverrideSource {
    /// The `backend` argument of [`select_backend`].
    Argument,
    /// The `ATTN_BACKEND` environment variable ([`OVERRIDE_ENV`]).
    Env,
}

impl fmt::Display for OverrideSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OverrideSource::Argument => f.write_str("the override argument"),
            OverrideSource::Env => write!(f, "{OVERRIDE_ENV}"),
        }
    }
}

/// A backend that did not fit, and every reason why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The backend refused.
    pub backend: &'static BackendSpec,
    /// Every reason it cannot run the model (never empty).
    pub reasons: Vec<Reason>,
}

/// The chosen backend and how it was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// The chosen backend.
    pub backend: &'static BackendSpec,
    /// `Some` when an override named it.
    pub overridden_by: Option<OverrideSource>,
    /// The better-ranked backends, best first, each with why it was refused (empty after an
    /// override or when the first candidate fits).
    pub refused: Vec<Refusal>,
}

impl Selection {
    /// The chosen backend's registry name (`tensor-core`, `mla`, `cpu`).
    pub fn name(&self) -> &'static str {
        self.backend.name
    }

    /// How far CUDA graphs capture the chosen backend.
    pub fn graph_support(&self) -> GraphSupport {
        self.backend.graph_support
    }
}

/// `ATTN_BACKEND`, if set and not blank.
pub fn override_from_env() -> Option<String> {
    let value = std::env::var_os(OVERRIDE_ENV)?;
    let value = value.to_string_lossy().trim().to_owned();
    (!value.is_empty()).then_some(value)
}

/// The backend for `config` on `device`: the one `override_name` names, else the one
/// [`OVERRIDE_ENV`] names, else the best-ranked one that accepts the model.
///
/// Errors (`InvalidArgument` for `backend`): an unknown override (listing the known names), an
/// override whose backend refuses the model (with all its reasons), or no backend that fits
/// (every candidate with its reasons).
pub fn select_backend(config: &ModelConfig, device: &DeviceInfo, override_name: Option<&str>) -> Result<Selection> {
    let requested = resolve_override(override_name);
    select_requested(config, device, requested.as_ref().map(|(name, source)| (name.as_str(), *source)))
}

/// [`select_backend`] without reading the environment: `None` is the automatic choice.
pub fn select_backend_no_env(config: &ModelConfig, device: &DeviceInfo, override_name: Option<&str>) -> Result<Selection> {
    select_requested(config, device, override_name.map(|name| (name, OverrideSource::Argument)))
}

/// The argument, else the environment.
pub(crate) fn resolve_override(override_name: Option<&str>) -> Option<(String, OverrideSource)> {
    match override_name {
        Some(name) => Some((name.to_owned(), OverrideSource::Argument)),
        None => override_from_env().map(|name| (name, OverrideSource::Env)),
    }
}

pub(crate) fn select_requested(config: &ModelConfig, device: &DeviceInfo, requested: Option<(&str, OverrideSource)>) -> Result<Selection> {
    if let Some((name, source)) = requested {
        let backend = find_backend(name).ok_or_else(|| {
            invalid(format!("unknown backend \"{name}\" (from {source}); known backends: {}", backend_names().join(", ")))
        })?;
        let reasons = refusal_reasons(backend, config, device);
        if !reasons.is_empty() {
            return Err(invalid(format!(
                "backend \"{}\" (from {source}) cannot run {config} on {device}: {}",
                backend.name,
                join_reasons(&reasons)
            )));
        }
        return Ok(Selection { backend, overridden_by: Some(source), refused: Vec::new() });
    }
    let mut refused = Vec::new();
    for &backend in priorities(config.kind, device) {
        let reasons = refusal_reasons(backend, config, device);
        if reasons.is_empty() {
            return Ok(Selection { backend, overridden_by: None, refused });
        }
        refused.push(Refusal { backend, reasons });
    }
    if device.has_gpu() {
        // Every backend's reasons: the CPU's own, and that it is not automatic here.
        let mut reasons = refusal_reasons(&CPU, config, device);
        reasons.push(Reason::GpuPresent);
        refused.push(Refusal { backend: &CPU, reasons });
    }
    let each: Vec<String> = refused.iter().map(|r| format!("{}: {}", r.backend.name, join_reasons(&r.reasons))).collect();
    Err(invalid(format!("no backend fits {config} on {device}. {}", each.join(". "))))
}

fn join_reasons(reasons: &[Reason]) -> String {
    reasons.iter().map(Reason::to_string).collect::<Vec<_>>().join("; ")
}

fn invalid(reason: String) -> AttnError {
    AttnError::InvalidArgument { arg: "backend", reason }
}
