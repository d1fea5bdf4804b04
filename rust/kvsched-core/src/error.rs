//! The core's error type. Every variant is something a caller can provoke; running out of KV blocks is an
//! outcome of scheduling, never an error (a tenant's full waiting queue is an error of `add_request`: the request
//! is refused). The Python binding maps each variant to one exception class.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SchedError {
    #[error("{0}")]
    InvalidConfig(String),
    #[error("{0}")]
    InvalidRequest(String),
    #[error("{0}")]
    DuplicateRequest(String),
    #[error("{0}")]
    UnknownRequest(String),
    #[error("{0}")]
    InvalidOutput(String),
    /// `add_request` refused a request because its tenant already has `max_waiting_per_tenant` (or its
    /// `tenant_max_waiting`) requests waiting. Nothing changed; the same request may be added later.
    #[error("{0}")]
    QueueFull(String),
    /// An internal invariant failed: a bug in kvsched, reported instead of panicking.
    #[error("internal error: {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, SchedError>;
