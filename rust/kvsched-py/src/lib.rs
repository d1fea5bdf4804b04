//! `kvsched._core`: thin PyO3 bindings of `kvsched-core`. Conversions and error mapping only.
//!
//! Every Python argument is converted before the scheduler is borrowed, so no Python code (a hostile
//! `__index__`, a generator) can run while the core is mid-call; every core call goes through `guard`, which
//! turns a Rust panic into `kvsched.InternalError` instead of letting `PanicException` escape. The step hot
//! path builds no per-request Python objects: ids are kept once per request (at `add_request`) and looked up,
//! arrays are moved into numpy without copying, and list/array views are built lazily on first access.
//!
//! Module layout: `errors` (error mapping, the panic guard), `convert` (argument conversion), `config` (config
//! conversion), `encoder` (encoder-input conversion), `connector` (a Python KV connector behind the core's
//! trait), `ids` (request ids by slot, shared with the outputs), `output` (the per-step result classes),
//! `scheduler` (the `Scheduler` class), `router` (the `Router` class of `kvsched.router`), `vllm_hash` (vLLM's
//! SHA-256 block hash, for `kvsched.vllm`), `vllm_rows` (sampled tokens into vLLM's token lists, count columns as lists of ints). This file only
//! registers them.

mod config;
mod connector;
mod convert;
mod ec_connector;
mod encoder;
mod errors;
mod hit_cap;
mod ids;
mod output;
mod router;
mod scheduler;
mod vllm_hash;
mod vllm_rows;

use kvsched_core as core;
use pyo3::prelude::*;

use crate::output::{PyModelInputs, PySchedulerOutput, PyUpdateResult};
use crate::scheduler::PyScheduler;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PySchedulerOutput>()?;
    m.add_class::<PyUpdateResult>()?;
    m.add_class::<PyModelInputs>()?;
    m.add_class::<router::PyRouter>()?;
    m.add_function(wrap_pyfunction!(vllm_hash::vllm_sha256_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(vllm_hash::vllm_sha256_extend_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(vllm_rows::extend_lists_by_rows, m)?)?;
    m.add_function(wrap_pyfunction!(vllm_rows::int_list, m)?)?;
    m.add_function(wrap_pyfunction!(config::_default_config, m)?)?;
    m.add_function(wrap_pyfunction!(config::_validate_config, m)?)?;
    m.add("MAX_TOKEN_ID", core::MAX_TOKEN_ID)?;
    Ok(())
}

/// The extension's own allocations (request records, token and block lists, the per-step output vectors) come
/// from mimalloc, as polars' extension takes a dedicated allocator too: a step allocates and frees many small
/// vectors, which mimalloc serves faster than the system allocator (docs/benchmarks.md compares the two).
/// Python's objects and numpy's buffers keep their own allocators; arrays handed to numpy from Rust vectors are
/// freed by Rust, through this allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
