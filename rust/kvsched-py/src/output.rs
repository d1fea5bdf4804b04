//! The per-step result pyclasses: `SchedulerOutput`, `UpdateResult`, `ModelInputs`, and the lazy arrays behind
//! them.
//!
//! Nothing here is built per request on the hot path: arrays stay Rust vectors until Python first asks for one
//! (then they move into numpy without a copy), and id lists are built on first access, from the scheduler's
//! id table as it was when the step was scheduled (`ids.rs`), then cached. A dropped `SchedulerOutput` hands
//! the vectors numpy did not take back to its scheduler for a later step (`SpareOutput`).

use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

use kvsched_core as core;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use crate::ids::IdTable;

/// A Rust vector that becomes a numpy array (moved, not copied) the first time Python asks for it.
pub(crate) struct LazyArray<T: numpy::Element> {
    raw: Vec<T>,
    array: Cached<T>,
}

impl<T: numpy::Element> LazyArray<T> {
    pub(crate) fn new(raw: Vec<T>) -> Self {
        LazyArray { raw, array: Cached::default() }
    }

    pub(crate) fn get<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<T>> {
        self.array.get(py, &mut self.raw)
    }
}

pub(crate) fn cached_list<'py>(
    py: Python<'py>,
    cache: &mut Option<Py<PyList>>,
    make: impl FnOnce() -> PyResult<Bound<'py, PyList>>,
) -> PyResult<Bound<'py, PyList>> {
    if let Some(l) = cache {
        return Ok(l.bind(py).clone());
    }
    let l = make()?;
    *cache = Some(l.clone().unbind());
    Ok(l)
}

// ---------------------------------------------------------------------------------------------------------
// SchedulerOutput

/// One step's decisions (see docs/semantics.md). Arrays and lists are built on first access.
#[pyclass(module = "kvsched._core", name = "SchedulerOutput")]
pub(crate) struct PySchedulerOutput {
    /// The step as the core built it (boxed: handing it over copies a pointer, not ~430 bytes). Its arrays
    /// move into numpy on first access, each then kept in `arrays`. Taken out only by `Drop`, which leaves it
    /// in `spare`.
    pub(crate) out: ManuallyDrop<Box<core::SchedulerOutput>>,
    /// Shared with the scheduler that built the step: a dropped output leaves its core output here (if the
    /// slot is free), and the next step is built in its vectors (those numpy has not taken).
    pub(crate) spare: Arc<SpareOutput>,
    /// The id table as it was when the step was scheduled: it names the step's requests.
    pub(crate) ids: Arc<IdTable>,
    pub(crate) preempted_ids: Vec<Py<PyString>>,
    pub(crate) arrays: Arrays,
    pub(crate) req_ids_cache: Option<Py<PyList>>,
    /// What the KV connector's `build_connector_meta(out)` returned (None without a connector).
    #[pyo3(get)]
    pub(crate) kv_connector_metadata: Option<Py<PyAny>>,
}

/// One core output handed back by a dropped `SchedulerOutput` for the scheduler's next step (no reference to
/// the scheduler itself, so an output held anywhere keeps no cycle alive).
#[derive(Default)]
pub(crate) struct SpareOutput(Mutex<Option<Box<core::SchedulerOutput>>>);

impl SpareOutput {
    /// The output left here, if any.
    pub(crate) fn take(&self) -> Option<Box<core::SchedulerOutput>> {
        self.0.try_lock().ok().and_then(|mut slot| slot.take())
    }

    /// Leaves `out` here if the slot is free (else it is dropped).
    fn put(&self, out: Box<core::SchedulerOutput>) {
        if let Ok(mut slot) = self.0.try_lock() {
            if slot.is_none() {
                *slot = Some(out);
            }
        }
    }
}

impl Drop for PySchedulerOutput {
    fn drop(&mut self) {
        // SAFETY: `out` is taken once, here, and nothing reads it after: the object is being destroyed.
        let out = unsafe { ManuallyDrop::take(&mut self.out) };
        self.spare.put(out);
    }
}

/// A numpy array made from a vector of the output on first access (moved, not copied), then kept.
pub(crate) struct Cached<T: numpy::Element>(Option<Py<PyArray1<T>>>);

impl<T: numpy::Element> Default for Cached<T> {
    fn default() -> Self {
        Cached(None)
    }
}

impl<T: numpy::Element> Cached<T> {
    fn get<'py>(&mut self, py: Python<'py>, src: &mut Vec<T>) -> Bound<'py, PyArray1<T>> {
        if let Some(a) = &self.0 {
            return a.bind(py).clone();
        }
        let a = std::mem::take(src).into_pyarray(py);
        self.0 = Some(a.clone().unbind());
        a
    }
}

/// The output's arrays handed to numpy so far.
#[derive(Default)]
pub(crate) struct Arrays {
    num_scheduled_tokens: Cached<i32>,
    num_computed_tokens: Cached<i32>,
    new_block_ids: Cached<i32>,
    new_block_ids_indptr: Cached<i32>,
    spec_token_ids: Cached<i32>,
    spec_token_ids_indptr: Cached<i32>,
    swap_out: Cached<i32>,
    swap_in: Cached<i32>,
    scheduled_encoder_inputs: Cached<i32>,
    scheduled_encoder_inputs_indptr: Cached<i32>,
    scheduled_encoder_loads: Cached<i32>,
    scheduled_encoder_loads_indptr: Cached<i32>,
    free_encoder_hashes: Cached<u64>,
}

/// A flattened pair list as an `(m, 2)` int32 array (a view of the moved vector, no copy).
fn pairs<'py>(
    py: Python<'py>,
    cache: &mut Cached<i32>,
    flat: &mut Vec<i32>,
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let a = cache.get(py, flat);
    let m = a.len() / 2;
    a.reshape([m, 2])
}

#[pymethods]
impl PySchedulerOutput {
    #[getter]
    fn step_id(&self) -> u64 {
        self.out.step_id
    }

    #[getter]
    fn total_num_scheduled_tokens(&self) -> u64 {
        self.out.total_num_scheduled_tokens
    }

    /// No entry is a prefill chunk or carries drafts: each samples exactly one token.
    #[getter]
    fn one_token_each(&self) -> bool {
        self.out.one_token_each
    }

    #[getter]
    fn req_ids<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let (handles, ids) = (&self.out.handles, &self.ids);
        cached_list(py, &mut self.req_ids_cache, || ids.list(py, handles.iter().copied()))
    }

    #[getter]
    fn num_reqs(&self) -> usize {
        self.out.handles.len()
    }

    #[getter]
    fn num_scheduled_tokens<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.arrays.num_scheduled_tokens.get(py, &mut self.out.num_scheduled_tokens)
    }

    #[getter]
    fn num_computed_tokens<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.arrays.num_computed_tokens.get(py, &mut self.out.num_computed_tokens)
    }

    #[getter]
    fn new_block_ids<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.arrays.new_block_ids.get(py, &mut self.out.new_block_ids)
    }

    /// Group `group`'s new block ids, laid out as `new_block_ids` (CSR offsets:
    /// `group_new_block_ids_indptr(group)`); the primary group's (the first that is not Mamba; group 0 with one
    /// group) are `new_block_ids`.
    fn group_new_block_ids<'py>(
        &mut self,
        py: Python<'py>,
        group: usize,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let Some(slot) = group_slot(&self.out, group)? else {
            return Ok(self.new_block_ids(py));
        };
        let num_groups = self.out.group_new_block_ids.len() + 1;
        match self.out.group_new_block_ids.get(slot) {
            Some(ids) => Ok(ids.clone().into_pyarray(py)),
            None => Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "group must be in [0, {num_groups}), got {group}"
            ))),
        }
    }

    /// The CSR offsets of `group_new_block_ids(group)`: `new_block_ids_indptr` for every group but a
    /// cross-attention or Mamba one.
    fn group_new_block_ids_indptr<'py>(
        &mut self,
        py: Python<'py>,
        group: usize,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let Some(slot) = group_slot(&self.out, group)? else {
            return Ok(self.new_block_ids_indptr(py));
        };
        let num_groups = self.out.group_new_block_ids_indptr.len() + 1;
        match self.out.group_new_block_ids_indptr.get(slot) {
            Some(ptr) => Ok(ptr.clone().into_pyarray(py)),
            None => Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "group must be in [0, {num_groups}), got {group}"
            ))),
        }
    }

    /// With a Mamba group: every attention-group block this step allocated, group by group, each group's in
    /// allocation order (vLLM's `new_block_ids_to_zero`); empty otherwise.
    #[getter]
    fn zero_block_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.out.zero_block_ids.clone().into_pyarray(py)
    }

    /// `(m, 2)` int32: with prefix hits inside a block, the block copies (source, destination) to make before the
    /// forward pass, group by group (vLLM's `kv_cache_block_copies`); empty otherwise.
    #[getter]
    fn kv_cache_block_copies<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let flat: Vec<i32> =
            self.out.kv_cache_block_copies.iter().flat_map(|&(s, d)| [s as i32, d as i32]).collect();
        let rows = flat.len() / 2;
        flat.into_pyarray(py).reshape([rows, 2])
    }

    #[getter]
    fn new_block_ids_indptr<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.arrays.new_block_ids_indptr.get(py, &mut self.out.new_block_ids_indptr)
    }

    #[getter]
    fn spec_token_ids<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.arrays.spec_token_ids.get(py, &mut self.out.spec_token_ids)
    }

    #[getter]
    fn spec_token_ids_indptr<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.arrays.spec_token_ids_indptr.get(py, &mut self.out.spec_token_ids_indptr)
    }

    /// `(m, 2)` int32: (GPU block, CPU block) copies to make before this step's forward pass.
    #[getter]
    fn swap_out<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        pairs(py, &mut self.arrays.swap_out, &mut self.out.swap_out)
    }

    /// `(m, 2)` int32: (CPU block, GPU block) copies to make after `swap_out`, before the forward pass.
    #[getter]
    fn swap_in<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        pairs(py, &mut self.arrays.swap_in, &mut self.out.swap_in)
    }

    /// int32 CSR values aligned with `req_ids`: indices of the encoder inputs the runner computes this step.
    #[getter]
    fn scheduled_encoder_inputs<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.arrays.scheduled_encoder_inputs.get(py, &mut self.out.scheduled_encoder_inputs)
    }

    /// int32 offsets into `scheduled_encoder_inputs`, `num_reqs + 1` of them.
    #[getter]
    fn scheduled_encoder_inputs_indptr<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        // The core leaves the CSR empty for a step without encoder work: zeros, built on first access.
        let o: &mut core::SchedulerOutput = &mut self.out;
        if self.arrays.scheduled_encoder_inputs_indptr.0.is_none()
            && o.scheduled_encoder_inputs_indptr.is_empty()
        {
            o.scheduled_encoder_inputs_indptr.resize(o.handles.len() + 1, 0);
        }
        self.arrays.scheduled_encoder_inputs_indptr.get(py, &mut o.scheduled_encoder_inputs_indptr)
    }

    /// int32 CSR values aligned with `req_ids`: indices of the encoder inputs the encoder-cache connector loads
    /// this step (allocated in the encoder cache, not computed).
    #[getter]
    fn scheduled_encoder_loads<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.arrays.scheduled_encoder_loads.get(py, &mut self.out.scheduled_encoder_loads)
    }

    /// int32 offsets into `scheduled_encoder_loads`, `num_reqs + 1` of them.
    #[getter]
    fn scheduled_encoder_loads_indptr<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        let o: &mut core::SchedulerOutput = &mut self.out;
        if self.arrays.scheduled_encoder_loads_indptr.0.is_none()
            && o.scheduled_encoder_loads_indptr.is_empty()
        {
            o.scheduled_encoder_loads_indptr.resize(o.handles.len() + 1, 0);
        }
        self.arrays.scheduled_encoder_loads_indptr.get(py, &mut o.scheduled_encoder_loads_indptr)
    }

    /// uint64: encoder-cache entries evicted since the previous step (the runner drops their outputs).
    #[getter]
    fn free_encoder_hashes<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.arrays.free_encoder_hashes.get(py, &mut self.out.free_encoder_hashes)
    }

    #[getter]
    fn new_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let o = &self.out;
        self.ids.list(py, o.new_reqs.iter().map(|&i| o.handles[i as usize]))
    }

    #[getter]
    fn resumed_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let o = &self.out;
        self.ids.list(py, o.resumed_reqs.iter().map(|&i| o.handles[i as usize]))
    }

    #[getter]
    fn preempted_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.preempted_ids.iter().map(|s| s.bind(py)))
    }

    #[getter]
    fn finished_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.out.finished_req_ids.iter().map(|s| PyString::new(py, s)))
    }

    /// `{req_id: num_scheduled_tokens}`, built on demand (not for the hot path).
    fn num_scheduled_tokens_by_id<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let counts = self.num_scheduled_tokens(py);
        let counts = counts.readonly();
        let d = PyDict::new(py);
        for (&h, n) in self.out.handles.iter().zip(counts.as_array().iter()) {
            d.set_item(self.ids.id(py, h)?, *n)?;
        }
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.out.handles.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(step_id={}, num_reqs={}, total_num_scheduled_tokens={}, num_new={}, num_resumed={}, \
             num_preempted={}, num_finished={})",
            self.out.step_id,
            self.out.handles.len(),
            self.out.total_num_scheduled_tokens,
            self.out.new_reqs.len(),
            self.out.resumed_reqs.len(),
            self.preempted_ids.len(),
            self.out.finished_req_ids.len()
        )
    }
}

// ---------------------------------------------------------------------------------------------------------
// UpdateResult and ModelInputs

/// What applying one step's sampled tokens did.
#[pyclass(module = "kvsched._core", name = "UpdateResult")]
pub(crate) struct PyUpdateResult {
    /// `{req_id: params}` from the KV connector's `request_finished` for the requests this call finished.
    pub(crate) kv_transfer_params: Option<Py<PyDict>>,
    pub(crate) finished_ids: Vec<Arc<str>>,
    pub(crate) finish_reasons: LazyArray<i8>,
    pub(crate) stop_reasons: LazyArray<i64>,
    pub(crate) num_new_tokens: LazyArray<i32>,
    pub(crate) finished_cache: Option<Py<PyList>>,
    pub(crate) part_finished_ids: Vec<Arc<str>>,
    pub(crate) part_finish_reasons: Vec<i8>,
    pub(crate) part_stop_reasons: Vec<i64>,
}

#[pymethods]
impl PyUpdateResult {
    #[getter]
    fn finished_req_ids<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let ids = &self.finished_ids;
        cached_list(py, &mut self.finished_cache, || {
            PyList::new(py, ids.iter().map(|s| PyString::new(py, s)))
        })
    }

    #[getter]
    fn kv_transfer_params<'py>(&self, py: Python<'py>) -> Bound<'py, PyDict> {
        match &self.kv_transfer_params {
            Some(d) => d.bind(py).clone(),
            None => PyDict::new(py),
        }
    }

    #[getter]
    fn finish_reasons<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i8>> {
        self.finish_reasons.get(py)
    }

    #[getter]
    fn stop_reasons<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.stop_reasons.get(py)
    }

    #[getter]
    fn num_new_tokens<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.num_new_tokens.get(py)
    }

    /// Streaming-input sessions whose current input part stopped in this update (they continue).
    #[getter]
    fn part_finished_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.part_finished_ids.iter().map(|s| PyString::new(py, s)))
    }

    #[getter]
    fn part_finish_reasons<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i8>> {
        PyArray1::from_slice(py, &self.part_finish_reasons)
    }

    #[getter]
    fn part_stop_reasons<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.part_stop_reasons)
    }

    fn __repr__(&self) -> String {
        format!("UpdateResult(num_finished={})", self.finished_ids.len())
    }
}

/// The flat int32 batch layout of one step for a paged-attention runner.
#[pyclass(module = "kvsched._core", name = "ModelInputs", frozen)]
pub(crate) struct PyModelInputs {
    #[pyo3(get)]
    pub(crate) input_token_ids: Py<PyArray1<i32>>,
    #[pyo3(get)]
    pub(crate) input_positions: Py<PyArray1<i32>>,
    #[pyo3(get)]
    pub(crate) slot_mapping: Py<PyArray1<i32>>,
    #[pyo3(get)]
    pub(crate) query_start_loc: Py<PyArray1<i32>>,
    #[pyo3(get)]
    pub(crate) seq_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    pub(crate) block_table: Py<PyAny>,
    #[pyo3(get)]
    pub(crate) logits_indices: Py<PyArray1<i32>>,
    #[pyo3(get)]
    pub(crate) num_reqs: usize,
    #[pyo3(get)]
    pub(crate) num_tokens: usize,
    #[pyo3(get)]
    pub(crate) max_seq_len: i32,
    #[pyo3(get)]
    pub(crate) max_query_len: i32,
}

#[pymethods]
impl PyModelInputs {
    fn __repr__(&self) -> String {
        format!(
            "ModelInputs(num_reqs={}, num_tokens={}, max_seq_len={}, max_query_len={})",
            self.num_reqs, self.num_tokens, self.max_seq_len, self.max_query_len
        )
    }
}

/// Where group `group`'s ids sit in `out.group_new_block_ids` (`Ok(None)`: the primary group's, which are
/// `new_block_ids`); `IndexError` for a group the config does not have.
fn group_slot(out: &core::SchedulerOutput, group: usize) -> PyResult<Option<usize>> {
    let num_groups = out.group_new_block_ids.len() + 1;
    let primary = out.primary_group;
    match group {
        g if g >= num_groups => Err(pyo3::exceptions::PyIndexError::new_err(format!(
            "group must be in [0, {num_groups}), got {g}"
        ))),
        g if g == primary => Ok(None),
        g => Ok(Some(if g < primary { g } else { g - 1 })),
    }
}
