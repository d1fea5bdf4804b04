//! The router's error type. Every variant is something a caller can provoke; the Python binding maps each one
//! to a class of kvsched's exception hierarchy. A failed call leaves the router as it was.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RouterError {
    /// A bad `RouterConfig` field.
    #[error("{0}")]
    InvalidConfig(String),
    /// A bad argument to a call (a token id out of range, an event whose block size is not the router's...).
    #[error("{0}")]
    InvalidArgument(String),
    #[error("unknown replica {0:?}")]
    UnknownReplica(String),
    #[error("{0}")]
    DuplicateReplica(String),
    #[error("unknown request {0:?}: not in flight (never routed, finished, or moved off a lost replica)")]
    UnknownRequest(String),
    #[error("request {0:?} is already in flight")]
    DuplicateRequest(String),
    /// No replica can take the request: none registered, none healthy, or none among the candidates given.
    #[error("{0}")]
    NoReplica(String),
    /// An internal invariant failed: a bug in kvsched, reported instead of panicking.
    #[error("internal error: {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, RouterError>;
