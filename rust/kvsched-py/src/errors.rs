//! Error mapping: core `SchedError`s to the `kvsched._errors` classes, and the guard every core call runs in.
//!
//! Each `SchedError` variant maps to one Python exception class (all rooted at `kvsched.SchedulerError`, mixing
//! in the stdlib type that fits). `guard` also catches a Rust panic and turns it into `kvsched.InternalError`, so
//! PyO3's `PanicException` (which escapes `except Exception`) never reaches the caller.

use std::panic::{catch_unwind, AssertUnwindSafe};

use kvsched_core as core;
use kvsched_core::SchedError;
use pyo3::prelude::*;
use pyo3::types::PyType;

pub(crate) fn py_error(py: Python<'_>, class: &str, msg: String) -> PyErr {
    let cls = py
        .import("kvsched._errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.downcast_into::<PyType>().map_err(PyErr::from));
    match cls {
        Ok(cls) => PyErr::from_type(cls, msg),
        Err(e) => e,
    }
}

pub(crate) fn map_err(py: Python<'_>, e: SchedError) -> PyErr {
    let class = match &e {
        SchedError::InvalidConfig(_) => "InvalidConfigError",
        SchedError::InvalidRequest(_) => "InvalidRequestError",
        SchedError::DuplicateRequest(_) => "DuplicateRequestError",
        SchedError::UnknownRequest(_) => "UnknownRequestError",
        SchedError::InvalidOutput(_) => "InvalidOutputError",
        SchedError::Internal(_) => "InternalError",
    };
    py_error(py, class, e.to_string())
}

pub(crate) fn type_error(py: Python<'_>, msg: String) -> PyErr {
    py_error(py, "SchedulerTypeError", msg)
}

/// Runs a core call, mapping its error and catching any panic.
pub(crate) fn guard<T>(py: Python<'_>, f: impl FnOnce() -> core::Result<T>) -> PyResult<T> {
    guard_with(py, f, map_err)
}

/// Runs a call whose errors `map` turns into exceptions (the core's, the router's), catching any panic.
pub(crate) fn guard_with<T, E>(
    py: Python<'_>,
    f: impl FnOnce() -> Result<T, E>,
    map: impl FnOnce(Python<'_>, E) -> PyErr,
) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(map(py, e)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(py_error(py, "InternalError", format!("kvsched core panicked: {what}")))
        }
    }
}
