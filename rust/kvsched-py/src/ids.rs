//! The caller's request ids by slot, shared copy-on-write between the scheduler and its step outputs.
//!
//! An output must name its requests for as long as Python holds it, even after they finish and their slots
//! are reused. An output keeps the table as it was when its step was scheduled (one `Arc` clone) and its
//! handles, and looks ids up on access: building a vector of id references per output instead would write
//! the reference count of every scheduled request's id string, once when the output is built and once when it
//! is dropped, a cost that grows with the batch. The table is split into chunks of `CHUNK` slots: `set` copies
//! only the outer vector and the chunk it writes, and only while an output still shares them.

use std::sync::Arc;

use kvsched_core as core;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

use crate::errors::py_error;

const CHUNK: usize = 64;

type Chunk = [Option<Py<PyString>>; CHUNK];

/// Request ids by slot. A slot keeps its last request's id until a new request takes the slot.
#[derive(Clone, Default)]
pub(crate) struct IdTable {
    chunks: Vec<Arc<Chunk>>,
}

fn empty_chunk() -> Arc<Chunk> {
    Arc::new(std::array::from_fn(|_| None))
}

impl IdTable {
    /// Files `id` under `slot` in `table`, copying what an output still shares.
    pub(crate) fn set(py: Python<'_>, table: &mut Arc<IdTable>, slot: usize, id: Py<PyString>) {
        let t = Arc::make_mut(table);
        let c = slot / CHUNK;
        while t.chunks.len() <= c {
            t.chunks.push(empty_chunk());
        }
        let chunk = &mut t.chunks[c];
        if Arc::get_mut(chunk).is_none() {
            let copy: Chunk = std::array::from_fn(|i| chunk[i].as_ref().map(|s| s.clone_ref(py)));
            *chunk = Arc::new(copy);
        }
        if let Some(ch) = Arc::get_mut(chunk) {
            ch[slot % CHUNK] = Some(id);
        }
    }

    /// The id filed under `slot`, if any.
    #[inline]
    pub(crate) fn get(&self, slot: u32) -> Option<&Py<PyString>> {
        let s = slot as usize;
        self.chunks.get(s / CHUNK).and_then(|c| c[s % CHUNK].as_ref())
    }

    /// The id of `h`'s request (an `InternalError` if its slot has none: a scheduler bug).
    pub(crate) fn id<'py>(&self, py: Python<'py>, h: core::ReqHandle) -> PyResult<&Bound<'py, PyString>> {
        self.get(h.slot)
            .map(|s| s.bind(py))
            .ok_or_else(|| py_error(py, "InternalError", format!("no request id for slot {}", h.slot)))
    }

    /// The ids of `handles`' requests as a new list (every handle's slot has an id: checked before building).
    pub(crate) fn list<'py>(
        &self,
        py: Python<'py>,
        handles: impl ExactSizeIterator<Item = core::ReqHandle> + Clone,
    ) -> PyResult<Bound<'py, PyList>> {
        for h in handles.clone() {
            self.id(py, h)?;
        }
        PyList::new(py, handles.map(|h| self.get(h.slot).map(|s| s.bind(py))))
    }
}
