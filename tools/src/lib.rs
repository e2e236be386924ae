//! Programs around the `attn-rs` library that are not part of it: the simulated serving engine
//! ([`sim`], run by the `engine-sim` binary) and the benchmarks (`attn-bench`, `step-bench`,
//! `metadata-bench`). Each binary documents its flags under `--help`.

pub mod sim;
