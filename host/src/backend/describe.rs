//! A human-readable account of a selection: every candidate in priority order with "chosen" or
//! its refusal reasons, and the chosen backend's CUDA-graph support.

use super::config::{DeviceInfo, ModelConfig};
use super::cpu::CPU;
use super::priority::priorities;
use super::registry::find_backend;
use super::select::{resolve_override, select_requested, OverrideSource};
use super::spec::BackendSpec;
use super::validate::refusal_reasons;
use std::fmt::Write;

/// What [`super::select_backend`] does for `config` on `device` (the override, else
/// `ATTN_BACKEND`, else automatic), and why.
pub fn describe(config: &ModelConfig, device: &DeviceInfo, override_name: Option<&str>) -> String {
    let requested = resolve_override(override_name);
    describe_requested(config, device, requested.as_ref().map(|(name, source)| (name.as_str(), *source)))
}

/// [`describe`] without reading the environment.
pub fn describe_no_env(config: &ModelConfig, device: &DeviceInfo, override_name: Option<&str>) -> String {
    describe_requested(config, device, override_name.map(|name| (name, OverrideSource::Argument)))
}

fn describe_requested(config: &ModelConfig, device: &DeviceInfo, requested: Option<(&str, OverrideSource)>) -> String {
    let selection = select_requested(config, device, requested);
    let mut out = String::new();
    let _ = writeln!(out, "attention backend for {config} on {device}");
    if let Some((name, source)) = requested {
        let _ = writeln!(out, "override: \"{name}\" from {source}");
    }
    // The priority list, then an overridden backend that is not in it.
    let mut candidates: Vec<(&'static BackendSpec, bool)> = priorities(config.kind, device).iter().map(|&b| (b, true)).collect();
    // With a GPU the CPU is no candidate, but an override may name it.
    if device.has_gpu() && !candidates.iter().any(|(b, _)| b.name == CPU.name) {
        candidates.push((&CPU, false));
    }
    if let Some(extra) = requested.and_then(|(name, _)| find_backend(name)) {
        if !candidates.iter().any(|(b, _)| b.name == extra.name) {
            candidates.push((extra, false));
        }
    }
    let chosen = selection.as_ref().ok().map(|s| s.backend.name);
    let mut passed_chosen = false;
    for (i, (backend, ranked)) in candidates.iter().enumerate() {
        let named_only = !ranked && backend.name == CPU.name;
        let unranked = match (ranked, named_only) {
            (true, _) => "",
            (false, true) => " [named only: a GPU is present]",
            (false, false) => " [not a candidate for this model and device]",
        };
        let _ = write!(out, "  {}. {}{unranked}: ", i + 1, backend.name);
        let reasons = refusal_reasons(backend, config, device);
        if Some(backend.name) == chosen {
            let how = if requested.is_some() { " (override)" } else { "" };
            let _ = writeln!(out, "chosen{how}");
            passed_chosen = true;
        } else if reasons.is_empty() {
            let why = if named_only && requested.is_none() {
                "fits, not chosen automatically"
            } else if requested.is_some() {
                "fits, not used (override)"
            } else if passed_chosen {
                "fits, ranked below the chosen backend"
            } else {
                "fits"
            };
            let _ = writeln!(out, "{why}");
        } else {
            let _ = writeln!(out, "refused");
            for reason in &reasons {
                let _ = writeln!(out, "       - {reason}");
            }
        }
    }
    match &selection {
        Ok(s) => {
            let _ = writeln!(out, "chosen: {}: {}", s.backend.name, s.backend.summary);
            let _ = writeln!(out, "CUDA graphs: {}", s.graph_support());
        }
        Err(e) => {
            let _ = writeln!(out, "no backend chosen: {e}");
        }
    }
    out
}
