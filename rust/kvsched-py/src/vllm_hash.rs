//! `vllm_sha256_block_hashes`: vLLM's default prefix-cache block hashes (SHA-256 of the pickled block), for
//! `kvsched.vllm`, which must keep vLLM's `Request.block_hashes` filled. Conversion only; the encoding is the
//! core's `pickle_hash`.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::convert::{int_arg, paired_lists, positive_block_size, token_list, type_name};
use crate::errors::{guard, type_error};
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
    let block_size = positive_block_size(block_size)?;
    let hashes = guard(py, || sha256_pickle_block_hashes(parent.as_bytes(), &tokens, block_size))?;
    PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, h)))
}

/// The batched form of `vllm_sha256_block_hashes` for the requests whose block filled at a step: for each `i`,
/// appends to `hash_lists[i]` (a request's `block_hashes`, vLLM's hashes of its first full blocks) the hashes
/// of the full blocks of `token_lists[i]` past them, chained from its last hash. A request with no hash yet is
/// skipped (its block 0 may key a cache salt, which this hash leaves out): returns the indices skipped, for the
/// caller's own hasher. Every argument is checked and every hash computed before any list changes.
#[pyfunction]
pub(crate) fn vllm_sha256_extend_block_hashes<'py>(
    py: Python<'py>,
    hash_lists: &Bound<'py, PyAny>,
    token_lists: &Bound<'py, PyAny>,
    block_size: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyList>> {
    let (hash_lists, token_lists) = paired_lists(hash_lists, "hash_lists", token_lists, "token_lists")?;
    let block_size = positive_block_size(block_size)?;
    let mut skipped: Vec<usize> = Vec::new();
    let mut new: Vec<(Bound<'py, PyList>, Vec<[u8; 32]>)> = Vec::with_capacity(hash_lists.len());
    let mut tokens: Vec<i64> = Vec::new();
    for (i, (hashes, token_ids)) in hash_lists.iter().zip(token_lists.iter()).enumerate() {
        let hashes = hashes.downcast_into::<PyList>().map_err(|e| {
            type_error(py, format!("hash_lists[{i}] must be a list, got {}", type_name(&e.into_inner())))
        })?;
        let token_ids = token_ids.downcast_into::<PyList>().map_err(|e| {
            type_error(py, format!("token_lists[{i}] must be a list, got {}", type_name(&e.into_inner())))
        })?;
        let n = hashes.len();
        if n == 0 {
            skipped.push(i);
            continue;
        }
        let last = hashes.get_item(n - 1)?;
        let parent = last.downcast::<PyBytes>().map_err(|_| {
            type_error(py, format!("hash_lists[{i}] must hold bytes, got {}", type_name(&last)))
        })?;
        let start = n.saturating_mul(block_size);
        let end = start + token_ids.len().saturating_sub(start) / block_size * block_size;
        tokens.clear();
        for j in start..end {
            tokens.push(int_arg(&token_ids.get_item(j)?, "token_lists", "InvalidRequestError")?);
        }
        let chain = guard(py, || sha256_pickle_block_hashes(parent.as_bytes(), &tokens, block_size))?;
        if !chain.is_empty() {
            new.push((hashes, chain));
        }
    }
    for (hashes, chain) in new {
        for h in chain {
            hashes.append(PyBytes::new(py, &h))?;
        }
    }
    PyList::new(py, skipped)
}
