//! Prefill on Hopper's warpgroup MMA (sm_90a only), from 16-bit caches:
//! - [`prefill_hopper`]: `prefill_wg_*`, one CTA of two warpgroups a work item;
//! - [`prefill_specialized`]: `prefill_wgs_*`, persistent CTAs with a producer warpgroup, its key
//!   step's pieces in [`steps`].

pub(crate) mod prefill_hopper;
pub(crate) mod prefill_specialized;
mod steps;
