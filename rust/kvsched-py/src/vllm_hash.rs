//! `vllm_sha256_block_hashes`: vLLM's default prefix-cache block hashes (SHA-256 of the pickled block), for
//! `kvsched.vllm`, which must keep vLLM's `Request.block_hashes` filled. Conversion only; the encoding is the
//! core's `pickle_hash`.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::convert::{int_arg, token_list, type_name};
use crate::errors::{guard, py_error, type_error};
use kvsched_core::pickle_hash::sha256_pickle_block_hashes;

/// vLLM's SHA-256 hashes of the full blocks of `token_ids`, chained from `parent` (the hash of the block
/// before them; a trailing partial block is left out). Only for blocks without extra keys (no LoRA,
/// multimodal input, prompt embeddings or cache salt in them).
#[pyfunction]
pub(crate) fn vllm_sha256_block_hashes<'py>(
    py: Python<'py>,
    parent: &Bound<'py, PyAny>,
    token_ids: &Bound<'py, PyAny>,
    block_size: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyList>> {
    let parent = parent
        .downcast::<PyBytes>()
        .map_err(|_| type_error(py, format!("parent must be bytes, got {}", type_name(parent))))?;
    let tokens = token_list(token_ids, "token_ids", "InvalidRequestError")?;
    let block_size = int_arg(block_size, "block_size", "InvalidRequestError")?;
    let block_size = usize::try_from(block_size).map_err(|_| {
        py_error(py, "InvalidRequestError", format!("block_size must be positive, got {block_size}"))
    })?;
    let hashes = guard(py, || sha256_pickle_block_hashes(parent.as_bytes(), &tokens, block_size))?;
    PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, h)))
}
