//! pyo3 bindings: `smetric._prefix_index`. Long hashing and inserting release the GIL, and so
//! do a match and an insert that have to wait for the index: it sits behind a read-write lock,
//! so one object can serve many threads.

use std::collections::HashSet;

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyIndexError, PyKeyError, PyTypeError, PyValueError};
use pyo3::marker::Ungil;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySlice, PyString};

use crate::index::{IndexError, InstanceStats, PrefixIndex, GLOBAL_TIER};
use crate::keys;
use crate::request::{self, Api, Prompt};

/// Work on fewer blocks than this keeps the GIL: releasing and taking it back costs more than
/// the work, and with several threads calling in (the data plane) every release is a hand-over.
/// Taking the index's lock while holding the GIL is safe: nothing done under that lock needs
/// the GIL.
const DETACH_MIN_BLOCKS: usize = 512;
/// The same threshold for request bodies (bytes) keyed by `key_request_body`.
const DETACH_MIN_BODY: usize = 32 << 10;

fn maybe_detach<T: Ungil>(
    py: Python<'_>,
    work: usize,
    min: usize,
    f: impl Ungil + FnOnce() -> T,
) -> T {
    if work >= min {
        py.detach(f)
    } else {
        f()
    }
}

fn index_error(e: IndexError) -> PyErr {
    match e {
        IndexError::UnknownInstance(_) => PyKeyError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

pub(crate) fn positive(name: &str, value: i64) -> PyResult<usize> {
    if value <= 0 {
        return Err(PyValueError::new_err(format!(
            "{name} must be a positive integer, got {value}"
        )));
    }
    Ok(value as usize)
}

fn non_negative(name: &str, value: i64) -> PyResult<u64> {
    if value < 0 {
        return Err(PyValueError::new_err(format!(
            "{name} must be >= 0, got {value}"
        )));
    }
    Ok(value as u64)
}

/// Chained 64-bit block keys of one prompt. Immutable; crosses into Rust without copying.
#[pyclass(frozen, module = "smetric._prefix_index", name = "BlockKeys", sequence)]
pub struct PyBlockKeys {
    keys: Vec<u64>,
}

#[pymethods]
impl PyBlockKeys {
    /// Keys from per-block ids. `chained=False` chains them (for ids that name one block's
    /// content only); `chained=True` takes them as keys (for ids that already name a whole
    /// prefix: Mooncake trace `hash_ids`, SGLang KV-event block hashes); they must be distinct.
    #[staticmethod]
    #[pyo3(signature = (ids, chained = false))]
    fn from_ids(ids: &Bound<'_, PyAny>, chained: bool) -> PyResult<Self> {
        let raw = extract_ids(ids)?;
        if !chained {
            let keys = ids.py().detach(|| keys::chain_ids(&raw));
            return Ok(PyBlockKeys { keys });
        }
        let repeated = ids.py().detach(|| {
            let mut seen = HashSet::with_capacity(raw.len());
            raw.iter().position(|k| !seen.insert(*k))
        });
        if let Some(pos) = repeated {
            return Err(PyValueError::new_err(format!(
                "chained ids must be distinct: id at position {pos} repeats an earlier one"
            )));
        }
        Ok(PyBlockKeys { keys: raw })
    }

    fn __len__(&self) -> usize {
        self.keys.len()
    }

    fn __getitem__(&self, py: Python<'_>, index: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        if let Ok(slice) = index.cast::<PySlice>() {
            let ind = slice.indices(self.keys.len() as isize)?;
            if ind.step != 1 {
                return Err(PyValueError::new_err("BlockKeys slices must have step 1"));
            }
            let (start, stop) = (ind.start as usize, (ind.stop.max(ind.start)) as usize);
            let sub = PyBlockKeys {
                keys: self.keys[start..stop].to_vec(),
            };
            return Ok(Py::new(py, sub)?.into_any());
        }
        let i: isize = index.extract()?;
        let n = self.keys.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if j < 0 || j >= n {
            return Err(PyIndexError::new_err("BlockKeys index out of range"));
        }
        Ok(self.keys[j as usize].into_pyobject(py)?.into_any().unbind())
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(PyList::new(py, &self.keys)?.try_iter()?.into_any())
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyBlockKeys>()
            .is_ok_and(|o| o.get().keys == self.keys)
    }

    fn __hash__(&self) -> u64 {
        // The last key names the whole chain.
        self.keys.last().copied().unwrap_or(0) ^ self.keys.len() as u64
    }

    fn __repr__(&self) -> String {
        match self.keys.len() {
            0 => "BlockKeys([])".into(),
            1..=4 => format!("BlockKeys({:?})", self.keys),
            n => format!(
                "BlockKeys([{}, {}, ..., {}], len={n})",
                self.keys[0],
                self.keys[1],
                self.keys[n - 1]
            ),
        }
    }

    /// The keys as a list of ints (unsigned 64-bit).
    fn to_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.keys)
    }

    /// Length of the common prefix with another chain, in blocks.
    fn common_prefix(&self, other: &Bound<'_, PyBlockKeys>) -> usize {
        let other = &other.get().keys;
        self.keys
            .iter()
            .zip(other)
            .take_while(|(a, b)| a == b)
            .count()
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Reduced<'py>> {
        let py = slf.py();
        let ctor = py.get_type::<PyBlockKeys>().getattr("from_ids")?;
        Ok((ctor, (PyList::new(py, &slf.get().keys)?, true)))
    }
}

/// What `__reduce__` returns: `(BlockKeys.from_ids, (keys, True))`.
type Reduced<'py> = (Bound<'py, PyAny>, (Bound<'py, PyList>, bool));

fn extract_ids(ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if ids.is_instance_of::<PyString>() || ids.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(
            "ids must be a sequence of ints, not str or bytes",
        ));
    }
    let mut out = Vec::with_capacity(ids.len().unwrap_or(0));
    for item in ids.try_iter()? {
        let item = item?;
        // Signed ids (SGLang's int64 event hashes) keep their bit pattern.
        let v = match item.extract::<u64>() {
            Ok(v) => v,
            Err(_) => item.extract::<i64>()? as u64,
        };
        out.push(v);
    }
    Ok(out)
}

fn bad_token(value: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("token ids must be in 0..2**32, got {value}"))
}

fn tokens_from<T: Copy + TryInto<u32> + std::fmt::Display>(v: Vec<T>) -> PyResult<Vec<u32>> {
    v.into_iter()
        .map(|t| t.try_into().map_err(|_| bad_token(t)))
        .collect()
}

/// Token ids from a list / sequence of ints, or from any buffer of integers (array, numpy).
fn extract_tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let py = obj.py();
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(
            "token_ids must be a sequence of ints, not str or bytes",
        ));
    }
    if let Ok(buf) = PyBuffer::<u32>::get(obj) {
        return buf.to_vec(py);
    }
    if let Ok(buf) = PyBuffer::<i32>::get(obj) {
        return tokens_from(buf.to_vec(py)?);
    }
    if let Ok(buf) = PyBuffer::<i64>::get(obj) {
        return tokens_from(buf.to_vec(py)?);
    }
    if let Ok(buf) = PyBuffer::<u64>::get(obj) {
        return tokens_from(buf.to_vec(py)?);
    }
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for item in obj.try_iter()? {
        let v: i64 = item?.extract()?;
        out.push(u32::try_from(v).map_err(|_| bad_token(v))?);
    }
    Ok(out)
}

/// Block keys of a text prompt (`str`, keyed by its UTF-8 bytes, or `bytes`): one key per full
/// block of `block_bytes`; a trailing partial block gets none.
#[pyfunction]
#[pyo3(signature = (text, block_bytes = 64))]
fn hash_text(text: &Bound<'_, PyAny>, block_bytes: i64) -> PyResult<PyBlockKeys> {
    let block_bytes = positive("block_bytes", block_bytes)?;
    let py = text.py();
    let keys = if let Ok(s) = text.cast::<PyString>() {
        let s = s.to_str()?;
        py.detach(|| keys::hash_text(s.as_bytes(), block_bytes))
    } else if let Ok(b) = text.cast::<PyBytes>() {
        let b = b.as_bytes();
        py.detach(|| keys::hash_text(b, block_bytes))
    } else {
        return Err(PyTypeError::new_err(format!(
            "text must be str or bytes, not {}",
            text.get_type().name()?
        )));
    };
    Ok(PyBlockKeys { keys })
}

/// Block keys of token ids: one key per full block of `block_tokens` ids.
#[pyfunction]
#[pyo3(signature = (token_ids, block_tokens = 16))]
fn hash_tokens(token_ids: &Bound<'_, PyAny>, block_tokens: i64) -> PyResult<PyBlockKeys> {
    let block_tokens = positive("block_tokens", block_tokens)?;
    let tokens = extract_tokens(token_ids)?;
    let keys = token_ids
        .py()
        .detach(|| keys::hash_tokens(&tokens, block_tokens));
    Ok(PyBlockKeys { keys })
}

/// Block keys equal to SGLang's page hashes (the int64 values of its KV events, as unsigned bit
/// patterns), so KV events and predictions land on the same keys.
#[pyfunction]
#[pyo3(signature = (token_ids, page_size))]
fn hash_tokens_sglang(token_ids: &Bound<'_, PyAny>, page_size: i64) -> PyResult<PyBlockKeys> {
    let page_size = positive("page_size", page_size)?;
    let tokens = extract_tokens(token_ids)?;
    let keys = token_ids
        .py()
        .detach(|| keys::sglang_page_hashes(&tokens, page_size));
    Ok(PyBlockKeys { keys })
}

thread_local! {
    /// Each thread's buffers for keying bodies (see `request::Scratch`).
    static SCRATCH: std::cell::RefCell<request::Scratch> = Default::default();
}

/// A keying buffer grown past this (by a body of several MB) is let go after its body.
const SCRATCH_MAX: usize = 4 << 20;

/// What `key_request_body` returns: keys, prompt length (bytes of text or token ids), whether
/// the prompt is token ids, max new tokens (None: the body names none), stream, first turn.
pub(crate) type KeyedBody = (PyBlockKeys, usize, bool, Option<u64>, bool, Option<bool>);

/// A body keyed as `key_request_body` keys it, on this thread's scratch buffers; no Python in
/// it (the data plane calls it outside the GIL).
pub(crate) fn key_body(
    api: Api,
    raw: &[u8],
    text_block_bytes: usize,
    token_block_tokens: usize,
) -> Option<KeyedBody> {
    SCRATCH.with_borrow_mut(|scratch| {
        let keyed = request::view_body(api, raw, scratch).map(|view| {
            let (keys, len, tokens) = match &view.prompt {
                Prompt::Text(text) => (keys::hash_text(text, text_block_bytes), text.len(), false),
                Prompt::Pieces(pieces) => (
                    keys::hash_text_pieces(pieces, text_block_bytes),
                    pieces.iter().map(|p| p.len()).sum(),
                    false,
                ),
                Prompt::Tokens(ids) => {
                    (keys::hash_tokens(ids, token_block_tokens), ids.len(), true)
                }
            };
            (
                PyBlockKeys { keys },
                len,
                tokens,
                view.max_new_tokens,
                view.stream,
                view.is_first_turn,
            )
        });
        scratch.trim(SCRATCH_MAX);
        keyed
    })
}

/// The router's fast path: a generation request keyed straight from its body bytes, as
/// `smetric.request.view_request` would key the parsed body; None where that reference must
/// decide (see `request.rs`).
#[pyfunction]
#[pyo3(signature = (api, body, text_block_bytes, token_block_tokens))]
fn key_request_body(
    api: &str,
    body: &Bound<'_, PyBytes>,
    text_block_bytes: i64,
    token_block_tokens: i64,
) -> PyResult<Option<KeyedBody>> {
    let api = match api {
        "generate" => Api::Generate,
        "chat" => Api::Chat,
        "completions" => Api::Completions,
        other => return Err(PyValueError::new_err(format!("unknown api {other:?}"))),
    };
    let text_block_bytes = positive("text_block_bytes", text_block_bytes)?;
    let token_block_tokens = positive("token_block_tokens", token_block_tokens)?;
    let raw = body.as_bytes();
    Ok(maybe_detach(body.py(), raw.len(), DETACH_MIN_BODY, || {
        key_body(api, raw, text_block_bytes, token_block_tokens)
    }))
}

/// The result of `PrefixIndex.match`.
#[pyclass(frozen, module = "smetric._prefix_index", name = "Match", sequence)]
pub struct PyMatch {
    blocks: Vec<u32>,
    global_blocks: u32,
    query_blocks: usize,
}

#[pymethods]
impl PyMatch {
    /// Leading blocks held, one entry per instance in `PrefixIndex.instances()` order.
    #[getter]
    fn blocks(&self) -> Vec<u32> {
        self.blocks.clone()
    }

    /// Leading blocks held by the global tier (0 without one).
    #[getter]
    fn global_blocks(&self) -> u32 {
        self.global_blocks
    }

    /// Blocks in the query.
    #[getter]
    fn query_blocks(&self) -> usize {
        self.query_blocks
    }

    fn __len__(&self) -> usize {
        self.blocks.len()
    }

    fn __getitem__(&self, i: isize) -> PyResult<u32> {
        let n = self.blocks.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if j < 0 || j >= n {
            return Err(PyIndexError::new_err("Match index out of range"));
        }
        Ok(self.blocks[j as usize])
    }

    /// (position, blocks) of the instance holding the most, first one on ties; None if there
    /// are no instances.
    fn best(&self) -> Option<(usize, u32)> {
        let mut best: Option<(usize, u32)> = None;
        for (i, &b) in self.blocks.iter().enumerate() {
            if best.is_none_or(|(_, bb)| b > bb) {
                best = Some((i, b));
            }
        }
        best
    }

    fn __repr__(&self) -> String {
        format!(
            "Match(blocks={:?}, global_blocks={}, query_blocks={})",
            self.blocks, self.global_blocks, self.query_blocks
        )
    }
}

/// Which leading blocks of a prompt each instance holds (see the `.pyi` for the full contract).
#[pyclass(frozen, module = "smetric._prefix_index", name = "PrefixIndex")]
pub struct PyPrefixIndex {
    inner: RwLock<PrefixIndex>,
}

impl PyPrefixIndex {
    // The lock does not poison: a panic in here is a bug, already raised to its caller as
    // PanicException, and later calls keep working.
    fn read(&self) -> RwLockReadGuard<'_, PrefixIndex> {
        self.inner.read()
    }

    fn write(&self) -> RwLockWriteGuard<'_, PrefixIndex> {
        self.inner.write()
    }

    /// `f` under the read lock, keeping the GIL (a match is microseconds of work, less than a
    /// hand-over of the GIL, and tens of them for a prompt of 100,000 blocks) unless the lock is
    /// taken: then the wait is without the GIL.
    fn with_read<T: Ungil>(
        &self,
        py: Python<'_>,
        f: impl Ungil + Send + FnOnce(&PrefixIndex) -> T,
    ) -> T {
        match self.inner.try_read() {
            Some(index) => f(&index),
            None => py.detach(|| f(&self.read())),
        }
    }

    /// `with_read` for calls that change the index (a touching match).
    fn with_write<T: Ungil>(
        &self,
        py: Python<'_>,
        f: impl Ungil + Send + FnOnce(&mut PrefixIndex) -> T,
    ) -> T {
        match self.inner.try_write() {
            Some(mut index) => f(&mut index),
            None => py.detach(|| f(&mut self.write())),
        }
    }
}

fn stats_dict<'py>(py: Python<'py>, s: &InstanceStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("blocks", s.blocks)?;
    d.set_item("capacity_blocks", s.capacity_blocks)?;
    d.set_item("nodes", s.nodes)?;
    d.set_item("evicted_blocks", s.evicted_blocks)?;
    Ok(d)
}

#[pymethods]
impl PyPrefixIndex {
    #[new]
    #[pyo3(signature = (global_capacity_blocks = None))]
    fn new(global_capacity_blocks: Option<i64>) -> PyResult<Self> {
        let mut index = PrefixIndex::new();
        if let Some(cap) = global_capacity_blocks {
            let cap = non_negative("global_capacity_blocks", cap)?;
            index.add_instance(GLOBAL_TIER, cap).map_err(index_error)?;
        }
        Ok(PyPrefixIndex {
            inner: RwLock::new(index),
        })
    }

    fn add_instance(&self, py: Python<'_>, name: &str, capacity_blocks: i64) -> PyResult<()> {
        let cap = non_negative("capacity_blocks", capacity_blocks)?;
        py.detach(|| self.write().add_instance(name, cap))
            .map_err(index_error)
    }

    fn remove_instance(&self, py: Python<'_>, name: &str) -> PyResult<u64> {
        py.detach(|| self.write().remove_instance(name))
            .map_err(index_error)
    }

    fn set_capacity(&self, py: Python<'_>, name: &str, capacity_blocks: i64) -> PyResult<u64> {
        let cap = non_negative("capacity_blocks", capacity_blocks)?;
        py.detach(|| self.write().set_capacity(name, cap))
            .map_err(index_error)
    }

    fn instances(&self) -> Vec<String> {
        self.read().instances()
    }

    fn __contains__(&self, name: &str) -> bool {
        self.read().has_instance(name)
    }

    #[getter]
    fn has_global_tier(&self) -> bool {
        self.read().has_global_tier()
    }

    #[pyo3(signature = (instance, keys, step = None))]
    fn insert(
        &self,
        py: Python<'_>,
        instance: &str,
        keys: &Bound<'_, PyBlockKeys>,
        step: Option<i64>,
    ) -> PyResult<u64> {
        let keys = &keys.get().keys;
        let step = match step {
            Some(step) => positive("step", step)?,
            None => keys.len().max(1),
        };
        if keys.len() < DETACH_MIN_BLOCKS {
            return self
                .with_write(py, |index| index.insert(instance, keys))
                .map_err(index_error);
        }
        py.detach(|| {
            let mut index = self.write();
            if step >= keys.len() {
                return index.insert(instance, keys);
            }
            // Each step inserts the prompt up to its end (what earlier steps put in is only
            // walked again), then hands the lock to whichever call waits for it, if any. The
            // first step takes in all the blocks already in the tree, so that the steps end only
            // inside the blocks this insert adds: a step ending inside a node that others hold
            // would split it. Only the last step evicts (see `insert_over_capacity`).
            let mut added = 0;
            let mut end = index.known_prefix(keys);
            loop {
                end = (end + step).min(keys.len());
                let step_added = index.insert_over_capacity(instance, &keys[..end]);
                if step_added.is_err() || end == keys.len() {
                    // Also after a failed step: what the steps before it added stays.
                    index.evict_to_capacity(instance)?;
                    return step_added.map(|n| added + n);
                }
                added += step_added?;
                RwLockWriteGuard::bump(&mut index);
            }
        })
        .map_err(index_error)
    }

    fn remove(
        &self,
        py: Python<'_>,
        instance: &str,
        keys: &Bound<'_, PyBlockKeys>,
    ) -> PyResult<u64> {
        let keys = &keys.get().keys;
        py.detach(|| self.write().remove(instance, keys))
            .map_err(index_error)
    }

    fn clear(&self, py: Python<'_>, instance: &str) -> PyResult<u64> {
        py.detach(|| self.write().clear(instance))
            .map_err(index_error)
    }

    #[pyo3(name = "match", signature = (keys, touch = true))]
    fn match_all(&self, py: Python<'_>, keys: &Bound<'_, PyBlockKeys>, touch: bool) -> PyMatch {
        let keys = &keys.get().keys;
        let result = if touch {
            self.with_write(py, |index| index.match_all_touch(keys))
        } else {
            self.with_read(py, |index| index.match_all(keys))
        };
        PyMatch {
            blocks: result.blocks,
            global_blocks: result.global_blocks,
            query_blocks: keys.len(),
        }
    }

    #[pyo3(signature = (instance, keys, touch = true))]
    fn match_instance(
        &self,
        py: Python<'_>,
        instance: &str,
        keys: &Bound<'_, PyBlockKeys>,
        touch: bool,
    ) -> PyResult<u32> {
        let keys = &keys.get().keys;
        (if touch {
            self.with_write(py, |index| index.match_instance_touch(instance, keys))
        } else {
            self.with_read(py, |index| index.match_instance(instance, keys))
        })
        .map_err(index_error)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.read().stats());
        let out = PyDict::new(py);
        let instances = PyDict::new(py);
        for i in &s.instances {
            instances.set_item(&i.name, stats_dict(py, i)?)?;
        }
        out.set_item("instances", instances)?;
        match &s.global {
            Some(g) => out.set_item("global", stats_dict(py, g)?)?,
            None => out.set_item("global", py.None())?,
        }
        out.set_item("nodes", s.nodes)?;
        out.set_item("unique_blocks", s.unique_blocks)?;
        out.set_item("bytes_used", s.bytes_used)?;
        Ok(out)
    }

    /// Checks the tree's internal invariants (raises AssertionError-like panic as RuntimeError);
    /// for tests.
    fn _check_invariants(&self, py: Python<'_>) {
        py.detach(|| self.read().check_invariants())
    }
}

/// `body` with `members` (JSON object members, without braces) added last, the rest byte for
/// byte, or None if it is not a JSON object (`request::inject_members`: PD's bootstrap fields,
/// for the aiohttp data plane; the Rust one calls it directly).
#[pyfunction]
fn inject_members<'py>(
    py: Python<'py>,
    body: &[u8],
    members: &[u8],
) -> Option<Bound<'py, PyBytes>> {
    request::inject_members(body, members).map(|b| PyBytes::new(py, &b))
}

#[pymodule]
fn _prefix_index(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockKeys>()?;
    m.add_class::<PyMatch>()?;
    m.add_class::<PyPrefixIndex>()?;
    m.add_class::<crate::dataplane::PyDataPlane>()?;
    m.add_function(wrap_pyfunction!(hash_text, m)?)?;
    m.add_function(wrap_pyfunction!(hash_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(hash_tokens_sglang, m)?)?;
    m.add_function(wrap_pyfunction!(key_request_body, m)?)?;
    m.add_function(wrap_pyfunction!(inject_members, m)?)?;
    m.add("GLOBAL_TIER", GLOBAL_TIER)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
