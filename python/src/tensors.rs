//! Tensors from Python, without copies: torch tensors (read through torch's DLPack exchange
//! API, or their own methods), DLPack producers (`__dlpack__`, `__dlpack_device__`) and
//! `__cuda_array_interface__` objects.
//!
//! Each becomes a [`Desc`]: its device address, its length in one of gpucast's element types,
//! the stream its library queues work on (torch's or CuPy's current stream, the stream a
//! `__cuda_array_interface__` names, else the legacy default stream, unless the caller names
//! one), and the Python object that owns the memory, which the caller keeps alive until the
//! call's work has run.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use gpucast::cudarc::driver::CudaStream;
use gpucast::half::{bf16, f16};
use gpucast::{CheckedAllocation, DType, DeviceTensorMut, ExternalSlice};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyDict, PyTuple};
use pyo3::{intern, IntoPyObjectExt};

use crate::errors::argument;
use crate::exchange::Exchange;

/// The legacy default stream, as a driver handle.
const LEGACY: u64 = 0;

/// A tensor as a call sees it.
pub(crate) struct Desc {
    /// Device address of its first byte.
    pub(crate) ptr: u64,
    /// Length in elements of `dtype`.
    pub(crate) len: usize,
    /// The element type the bytes are carried as.
    pub(crate) dtype: DType,
    /// The stream handle to order the call with.
    pub(crate) stream: u64,
    /// What owns the memory (the tensor, or a DLPack capsule and its producer).
    pub(crate) keep: Py<PyAny>,
}

/// Where a call wants a tensor: on which device (`None`: any, and host memory too, for the
/// parsing tests), with which stream if the caller named one.
#[derive(Clone, Copy)]
pub(crate) struct Where {
    device: Option<usize>,
    stream: Option<u64>,
    /// Whether the call writes the tensor (a read-only `__cuda_array_interface__` is refused).
    writes: bool,
}

impl Where {
    /// A tensor the call writes, on `device`.
    pub(crate) fn at(device: usize, stream: Option<u64>) -> Where {
        Where {
            device: Some(device),
            stream,
            writes: true,
        }
    }

    /// The same place, for a tensor the call only reads when `read_only`.
    pub(crate) fn reading(self, read_only: bool) -> Where {
        Where {
            writes: self.writes && !read_only,
            ..self
        }
    }
}

/// Element type and how many elements of it one source element is (2 for complex types).
fn carried(dtype: DType) -> (DType, usize) {
    (dtype, 1)
}

/// torch's `str(dtype)` as a carried type. Types outside gpucast's ten travel as a type of
/// their size (bool and 8-bit floats as u8, 16-bit integers as f16 bits, complex as pairs).
fn torch_dtype(name: &str) -> Option<(DType, usize)> {
    let name = name.strip_prefix("torch.")?;
    Some(match name {
        "float32" => carried(DType::F32),
        "float64" => carried(DType::F64),
        "float16" => carried(DType::F16),
        "bfloat16" => carried(DType::BF16),
        "int8" => carried(DType::I8),
        "uint8" => carried(DType::U8),
        "int32" => carried(DType::I32),
        "uint32" => carried(DType::U32),
        "int64" => carried(DType::I64),
        "uint64" => carried(DType::U64),
        "bool" => carried(DType::U8),
        "int16" | "uint16" => carried(DType::F16),
        "complex32" => (DType::F16, 2),
        "complex64" => (DType::F32, 2),
        "complex128" => (DType::F64, 2),
        n if n.starts_with("float8_") => carried(DType::U8),
        _ => return None,
    })
}

/// DLPack's `(code, bits, lanes)` as a carried type.
fn dlpack_dtype(code: u8, bits: u8, lanes: u16) -> Option<(DType, usize)> {
    if lanes != 1 {
        return None;
    }
    Some(match (code, bits) {
        (0, 8) => carried(DType::I8),
        (0, 16) | (1, 16) => carried(DType::F16),
        (0, 32) => carried(DType::I32),
        (0, 64) => carried(DType::I64),
        (1, 8) => carried(DType::U8),
        (1, 32) => carried(DType::U32),
        (1, 64) => carried(DType::U64),
        (2, 16) => carried(DType::F16),
        (2, 32) => carried(DType::F32),
        (2, 64) => carried(DType::F64),
        (4, 16) => carried(DType::BF16),
        (5, 32) => (DType::F16, 2),
        (5, 64) => (DType::F32, 2),
        (5, 128) => (DType::F64, 2),
        // kDLBool, and the 8-bit float codes of DLPack 1.1 (7..=11).
        (6, 8) | (7..=11, 8) => carried(DType::U8),
        _ => return None,
    })
}

/// `__cuda_array_interface__`'s `typestr` as a carried type.
fn typestr_dtype(typestr: &str) -> Option<(DType, usize)> {
    let b = typestr.as_bytes();
    if b.len() < 3 || !matches!(b[0], b'<' | b'|' | b'=') {
        return None;
    }
    Some(match &typestr[1..] {
        "f2" => carried(DType::F16),
        "f4" => carried(DType::F32),
        "f8" => carried(DType::F64),
        "i1" => carried(DType::I8),
        "u1" | "b1" => carried(DType::U8),
        "i2" | "u2" => carried(DType::F16),
        "i4" => carried(DType::I32),
        "u4" => carried(DType::U32),
        "i8" => carried(DType::I64),
        "u8" => carried(DType::U64),
        "c8" => (DType::F32, 2),
        "c16" => (DType::F64, 2),
        _ => return None,
    })
}

/// Whether `strides` (in elements) describe a C-contiguous tensor of `shape`; dimensions of
/// size 1 may have any stride, and an empty tensor is contiguous (torch's `is_contiguous()`).
pub(crate) fn contiguous(shape: &[i64], strides: &[i64]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expected: i64 = 1;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n != 1 && s != expected {
            return false;
        }
        expected = expected.saturating_mul(n);
    }
    true
}

/// Number of elements of `shape`, or an error for a negative or overflowing one.
fn elements(shape: &[i64]) -> PyResult<usize> {
    shape.iter().try_fold(1usize, |acc, &n| {
        usize::try_from(n)
            .ok()
            .and_then(|n| acc.checked_mul(n))
            .ok_or_else(|| argument(format!("bad tensor shape {shape:?}")))
    })
}

/// A length in source elements as a length in carried elements.
fn carried_len(n: usize, per: usize, dtype: DType) -> PyResult<(usize, DType)> {
    n.checked_mul(per)
        .map(|len| (len, dtype))
        .ok_or_else(|| argument("tensor too large".to_string()))
}

fn not_cuda(what: &str) -> PyErr {
    argument(format!(
        "{what} is not in CUDA device memory: gpucast broadcasts between GPUs (move it with \
         .cuda() or .to(device))"
    ))
}

fn wrong_device(found: usize, expected: usize) -> PyErr {
    argument(format!(
        "tensor is on cuda:{found}, this rank's device is cuda:{expected}"
    ))
}

/// What one call's tensors share, read once per call: torch's current stream of each device
/// (a call's tensors are read with the GIL held, so the current stream cannot change between
/// them), and the last torch tensor type and dtype seen (held, so that their addresses are
/// theirs while the memo lives), which spare the process's caches and their locks.
#[derive(Default)]
pub(crate) struct Memo {
    /// Each device's torch stream (most calls see one device: no Vec).
    streams: Known<(usize, u64)>,
    /// A type read as a torch tensor's.
    torch_type: Option<Py<PyAny>>,
    /// A torch dtype object and its carried type.
    dtype: Option<(Py<PyAny>, DType, usize)>,
    /// Whether no torch function mode is on, read at the call's first tensor of an exact torch
    /// type (modes are per thread, and only the call's own reads run Python code in this
    /// thread until it ends).
    modes_off: Option<bool>,
}

impl Memo {
    fn torch(&mut self, py: Python<'_>, device: usize) -> PyResult<u64> {
        let known = self.streams.as_slice();
        if let Some(&(_, s)) = known.iter().find(|(d, _)| *d == device) {
            return Ok(s);
        }
        let s = match Exchange::get(py).and_then(|x| x.current_stream(py, device)) {
            Some(s) => s,
            None => torch_current_stream(py, device)?,
        };
        self.streams.add((device, s));
        Ok(s)
    }
}

/// Python objects of the process's life (torch's dtypes and tensor types), each with a value,
/// read without a lock: the list only grows, up to `N`, and holds a reference to each object,
/// so that no address in it is ever another object's.
struct Registry<V: Copy, const N: usize> {
    slots: [OnceLock<(Py<PyAny>, V)>; N],
    /// Slots set so far (each is set before this is raised past it).
    len: AtomicUsize,
    /// Taken by additions only.
    add: Mutex<()>,
}

impl<V: Copy, const N: usize> Registry<V, N> {
    const fn new() -> Self {
        Registry {
            slots: [const { OnceLock::new() }; N],
            len: AtomicUsize::new(0),
            add: Mutex::new(()),
        }
    }

    /// The value of `obj`, if listed.
    fn find(&self, obj: &Bound<'_, PyAny>) -> Option<V> {
        let n = self.len.load(Ordering::Acquire);
        self.slots[..n]
            .iter()
            .filter_map(OnceLock::get)
            .find(|(o, _)| o.as_ptr() == obj.as_ptr())
            .map(|&(_, v)| v)
    }

    /// Lists `obj` with `v`, unless the list is full.
    fn add(&self, obj: &Bound<'_, PyAny>, v: V) {
        let _adding = self.add.lock().unwrap_or_else(|p| p.into_inner());
        let n = self.len.load(Ordering::Relaxed);
        if n < N && self.slots[n].set((obj.clone().unbind(), v)).is_ok() {
            self.len.store(n + 1, Ordering::Release);
        }
    }
}

/// torch dtype objects already read, with their carried types (torch's dtypes are singletons
/// that live as long as the interpreter): saves formatting `str(dtype)` on every call. torch
/// has a few dozen dtypes; the bound only guards against a producer of fresh ones.
static TORCH_DTYPES: Registry<(DType, usize), 64> = Registry::new();

/// The carried type of torch dtype object `dtype`.
fn torch_dtype_of(dtype: &Bound<'_, PyAny>, memo: &mut Memo) -> PyResult<(DType, usize)> {
    if let Some((o, d, per)) = &memo.dtype {
        if o.as_ptr() == dtype.as_ptr() {
            return Ok((*d, *per));
        }
    }
    let (d, per) = torch_dtype_cached(dtype)?;
    memo.dtype = Some((dtype.clone().unbind(), d, per));
    Ok((d, per))
}

/// [`torch_dtype_of`] through the process's cache.
fn torch_dtype_cached(dtype: &Bound<'_, PyAny>) -> PyResult<(DType, usize)> {
    if let Some(known) = TORCH_DTYPES.find(dtype) {
        return Ok(known);
    }
    let name = dtype.str()?.to_string();
    let (d, per) =
        torch_dtype(&name).ok_or_else(|| argument(format!("unsupported dtype {name}")))?;
    TORCH_DTYPES.add(dtype, (d, per));
    Ok((d, per))
}

/// `torch._C._cuda_getCurrentRawStream`, looked up once.
fn torch_current_stream(py: Python<'_>, device: usize) -> PyResult<u64> {
    // A PyOnceLock: the lookup runs Python (an import), which may let the GIL go.
    static RAW: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();
    let raw = RAW.get_or_init(py, || {
        py.import("torch")
            .and_then(|t| t.getattr("_C"))
            .and_then(|c| c.getattr("_cuda_getCurrentRawStream"))
            .ok()
            .map(Bound::unbind)
    });
    match raw {
        Some(f) => f.bind(py).call1((device,))?.extract(),
        None => py
            .import("torch")?
            .getattr("cuda")?
            .call_method1("current_stream", (device,))?
            .getattr("cuda_stream")?
            .extract(),
    }
}

/// The module of `obj`'s type (`"torch"`, `"cupy._core.core"`, ...).
fn module_of(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .getattr(intern!(obj.py(), "__module__"))
        .and_then(|m| m.extract::<String>())
        .unwrap_or_default()
}

/// A torch tensor of an exact type (`torch.Tensor`, `torch.nn.Parameter`) through torch's
/// DLPack exchange API: one C call for the device, shape, strides and address, then its dtype,
/// instead of five method calls. Only a tensor that [`describe_torch_methods`] would accept
/// with the same description is taken here: on a CUDA device (the expected one), contiguous,
/// not empty (the address of an empty tensor is left to `data_ptr()`), of a supported dtype,
/// while no torch function mode is on (a mode sees the method calls, and could answer them).
/// `None`: anything else, which the methods then read (and refuse with their errors).
fn describe_torch_fast(t: &Bound<'_, PyAny>, at: Where, memo: &mut Memo) -> PyResult<Option<Desc>> {
    let py = t.py();
    let Some(x) = Exchange::get(py) else {
        return Ok(None);
    };
    if !x.is_exact(t) || !*memo.modes_off.get_or_insert_with(|| x.modes_off(py)) {
        return Ok(None);
    }
    let Some(v) = x.view(t) else {
        return Ok(None);
    };
    // As `get_device()` and `is_cuda` decide it: DLPack's CUDA device of index `device_id` is
    // torch's `cuda:<device_id>`.
    let device = match (v.device_type, usize::try_from(v.device_id), at.device) {
        (KDL_CUDA, Ok(d), Some(expected)) if d == expected => d,
        (KDL_CUDA, Ok(d), None) => d,
        _ => return Ok(None),
    };
    let Some(numel) = v.numel.filter(|&n| n > 0 && v.contiguous) else {
        return Ok(None);
    };
    // The dtype through the object, as the methods read it: DLPack's type cannot tell uint8
    // from torch's uint1 to uint7 (nor int8 from int1 to int7), which torch exports alike.
    let Ok((dtype, per)) = torch_dtype_of(&t.getattr(intern!(py, "dtype"))?, memo) else {
        return Ok(None);
    };
    let Ok((len, dtype)) = carried_len(numel, per, dtype) else {
        return Ok(None);
    };
    lazy_bits(t, per)?;
    let stream = match at.stream {
        Some(s) => s,
        None => memo.torch(py, device)?,
    };
    Ok(Some(Desc {
        ptr: v.ptr,
        len,
        dtype,
        stream,
        keep: t.clone().unbind(),
    }))
}

/// A torch tensor: through the exchange API where it decides ([`describe_torch_fast`]), else
/// through its own methods.
fn describe_torch(t: &Bound<'_, PyAny>, at: Where, memo: &mut Memo) -> PyResult<Desc> {
    match describe_torch_fast(t, at, memo)? {
        Some(d) => Ok(d),
        None => describe_torch_methods(t, at, memo),
    }
}

/// An argument error for a tensor whose values are its memory's negated or conjugated (torch's
/// lazy negative and conjugate bits, set by views such as `conj()` and the `imag` of one): its
/// memory holds other values than it reads as, and gpucast would copy the memory. `per` is the
/// dtype's parts per element (2: complex, the only kind with a conjugate bit).
fn lazy_bits(t: &Bound<'_, PyAny>, per: usize) -> PyResult<()> {
    let py = t.py();
    let refuse = |bit: &Bound<'_, pyo3::types::PyString>, resolve: &str| -> PyResult<()> {
        if !t.call_method0(bit)?.extract::<bool>()? {
            return Ok(());
        }
        Err(argument(format!(
            "tensor is a lazy view whose memory holds other values than it reads as \
             (tensor.{bit}() is True): pass tensor.{resolve}()"
        )))
    };
    refuse(intern!(py, "is_neg"), "resolve_neg")?;
    if per == 2 {
        refuse(intern!(py, "is_conj"), "resolve_conj")?;
    }
    Ok(())
}

/// A torch tensor, read through its own methods (no DLPack capsule per call).
fn describe_torch_methods(t: &Bound<'_, PyAny>, at: Where, memo: &mut Memo) -> PyResult<Desc> {
    let py = t.py();
    // -1 for a tensor in host memory (or on the meta device), else its device's index, CUDA's
    // or another accelerator's: `is_cuda` is read only where the index alone does not decide.
    // A tensor of another accelerator with the expected index gets through here, and is
    // refused by the address check of its buffer (not CUDA device memory), as an argument
    // error too.
    let index: i64 = t.call_method0(intern!(py, "get_device"))?.extract()?;
    let is_cuda = || -> PyResult<bool> { t.getattr(intern!(py, "is_cuda"))?.extract() };
    let device = match (usize::try_from(index), at.device) {
        (Ok(d), Some(expected)) if d == expected => d,
        (Ok(d), expected) if is_cuda()? => match expected {
            Some(expected) => return Err(wrong_device(d, expected)),
            None => d,
        },
        _ => return Err(not_cuda("tensor")),
    };
    if !t
        .call_method0(intern!(py, "is_contiguous"))?
        .extract::<bool>()?
    {
        return Err(argument(
            "tensor is not contiguous: pass tensor.contiguous() (and copy the result back)"
                .to_string(),
        ));
    }
    let (dtype, per) = torch_dtype_of(&t.getattr(intern!(py, "dtype"))?, memo)?;
    let numel: usize = t.call_method0(intern!(py, "numel"))?.extract()?;
    let (len, dtype) = carried_len(numel, per, dtype)?;
    lazy_bits(t, per)?;
    let ptr: u64 = t.call_method0(intern!(py, "data_ptr"))?.extract()?;
    let stream = match at.stream {
        Some(s) => s,
        None => memo.torch(py, device)?,
    };
    Ok(Desc {
        ptr,
        len,
        dtype,
        stream,
        keep: t.clone().unbind(),
    })
}

/// DLPack's structs (v0.8, the unversioned capsule every producer hands out by default; the
/// `DLTensor` of every version since).
#[repr(C)]
pub(crate) struct DLDevice {
    pub(crate) device_type: i32,
    pub(crate) device_id: i32,
}

#[repr(C)]
pub(crate) struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
pub(crate) struct DLTensor {
    pub(crate) data: *mut c_void,
    pub(crate) device: DLDevice,
    pub(crate) ndim: i32,
    dtype: DLDataType,
    pub(crate) shape: *const i64,
    pub(crate) strides: *const i64,
    pub(crate) byte_offset: u64,
}

// The layout of DLPack's `DLTensor` on a 64-bit target, in bytes.
#[cfg(target_pointer_width = "64")]
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(offset_of!(DLTensor, device) == 8 && offset_of!(DLTensor, ndim) == 16);
    assert!(offset_of!(DLTensor, dtype) == 20 && offset_of!(DLTensor, shape) == 24);
    assert!(offset_of!(DLTensor, strides) == 32 && offset_of!(DLTensor, byte_offset) == 40);
    assert!(size_of::<DLTensor>() == 48);
};

impl DLTensor {
    /// A blank one, for a producer to fill.
    pub(crate) fn empty() -> DLTensor {
        DLTensor {
            data: std::ptr::null_mut(),
            device: DLDevice {
                device_type: 0,
                device_id: 0,
            },
            ndim: 0,
            dtype: DLDataType {
                code: 0,
                bits: 0,
                lanes: 0,
            },
            shape: std::ptr::null(),
            strides: std::ptr::null(),
            byte_offset: 0,
        }
    }
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

const KDL_CPU: i32 = 1;
pub(crate) const KDL_CUDA: i32 = 2;
/// The most dimensions a DLPack tensor may claim here (bounds what a hostile producer costs).
pub(crate) const MAX_DIMS: i32 = 64;

/// A DLPack producer: `__dlpack_device__` first (so a host array is refused before any
/// capsule), then `__dlpack__(stream=...)`; the capsule stays unconsumed, so its own
/// destructor returns the tensor to its producer when the caller drops it.
fn describe_dlpack(obj: &Bound<'_, PyAny>, at: Where, stream: u64) -> PyResult<Desc> {
    let py = obj.py();
    let (device_type, device_id): (i32, i32) = obj
        .call_method0(intern!(py, "__dlpack_device__"))?
        .extract()?;
    let host_ok = at.device.is_none() && device_type == KDL_CPU;
    if device_type != KDL_CUDA && !host_ok {
        return Err(not_cuda(&format!(
            "tensor (DLPack device type {device_type})"
        )));
    }
    if let Some(expected) = at.device {
        let found = usize::try_from(device_id).map_err(|_| argument("bad DLPack device".into()))?;
        if found != expected {
            return Err(wrong_device(found, expected));
        }
    }
    let kwargs = PyDict::new(py);
    if !host_ok {
        // DLPack names the legacy default stream 1 (0 is ambiguous there).
        kwargs.set_item("stream", if stream == LEGACY { 1 } else { stream })?;
    }
    let capsule = obj
        .call_method(intern!(py, "__dlpack__"), (), Some(&kwargs))
        .map_err(|e| {
            let err = argument(format!("the tensor's __dlpack__ failed: {e}"));
            err.set_cause(py, Some(e));
            err
        })?;
    let refused = || argument("__dlpack__ did not return a \"dltensor\" capsule".to_string());
    if capsule.cast::<PyCapsule>().is_err() {
        return Err(refused());
    }
    // SAFETY: `capsule` is a live capsule; PyCapsule_GetPointer checks its name ("dltensor",
    // else it returns null with an exception set) and reads nothing else.
    let managed =
        unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr()) };
    if managed.is_null() {
        drop(PyErr::take(py));
        return Err(refused());
    }
    // SAFETY: a "dltensor" capsule holds a DLManagedTensor, valid while the capsule is alive
    // and unconsumed (we hold it, and never rename it).
    let t = unsafe { &(*managed.cast::<DLManagedTensor>()).dl_tensor };
    if !(0..=MAX_DIMS).contains(&t.ndim) {
        return Err(argument(format!(
            "DLPack tensor with {} dimensions",
            t.ndim
        )));
    }
    let ndim = t.ndim as usize;
    if ndim > 0 && t.shape.is_null() {
        return Err(argument("DLPack tensor without a shape".to_string()));
    }
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: DLPack's `shape` (not null, checked above) points to `ndim` int64 values
        // owned by the managed tensor.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    if !t.strides.is_null() && ndim > 0 {
        // SAFETY: as for `shape`: a non-null `strides` holds `ndim` int64 values.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        if !contiguous(shape, strides) {
            return Err(argument(format!(
                "tensor is not contiguous (shape {shape:?}, strides {strides:?})"
            )));
        }
    }
    let DLDataType { code, bits, lanes } = t.dtype;
    let (dtype, per) = dlpack_dtype(code, bits, lanes).ok_or_else(|| {
        argument(format!(
            "unsupported DLPack dtype (code {code}, bits {bits}, lanes {lanes})"
        ))
    })?;
    let (len, dtype) = carried_len(elements(shape)?, per, dtype)?;
    let ptr = (t.data as u64)
        .checked_add(t.byte_offset)
        .ok_or_else(|| argument("bad DLPack byte offset".to_string()))?;
    Ok(Desc {
        ptr,
        len,
        dtype,
        stream,
        keep: PyTuple::new(py, [obj.clone(), capsule])?
            .into_any()
            .unbind(),
    })
}

/// A `__cuda_array_interface__` (version 2 or 3) object.
fn describe_cai(obj: &Bound<'_, PyAny>, cai: &Bound<'_, PyAny>, at: Where) -> PyResult<Desc> {
    let cai = cai
        .cast::<PyDict>()
        .map_err(|_| argument("__cuda_array_interface__ is not a dict".to_string()))?;
    let item = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        cai.get_item(key)?
            .ok_or_else(|| argument(format!("__cuda_array_interface__ has no `{key}`")))
    };
    let (ptr, readonly): (u64, bool) = item("data")?.extract()?;
    if readonly && at.writes {
        return Err(argument(
            "the tensor is read-only (__cuda_array_interface__), and this call writes it".into(),
        ));
    }
    if cai.get_item("mask")?.is_some_and(|m| !m.is_none()) {
        return Err(argument("masked arrays are not supported".to_string()));
    }
    let shape: Vec<i64> = item("shape")?.extract()?;
    if shape.len() > MAX_DIMS as usize {
        return Err(argument(format!("tensor with {} dimensions", shape.len())));
    }
    let typestr: String = item("typestr")?.extract()?;
    let (dtype, per) = typestr_dtype(&typestr)
        .ok_or_else(|| argument(format!("unsupported typestr {typestr:?}")))?;
    let size = (dtype.size() * per) as i64;
    if let Some(strides) = cai.get_item("strides")?.filter(|s| !s.is_none()) {
        let strides: Vec<i64> = strides.extract()?;
        let in_elements: Vec<i64> = strides.iter().map(|s| s / size).collect();
        let whole = strides.iter().all(|s| s % size == 0);
        if strides.len() != shape.len() || !whole || !contiguous(&shape, &in_elements) {
            return Err(argument(format!(
                "tensor is not contiguous (shape {shape:?}, strides {strides:?} bytes)"
            )));
        }
    }
    let (len, dtype) = carried_len(elements(&shape)?, per, dtype)?;
    // Version 3: the stream the producer's work is on; 1 and 2 name the default streams.
    let named = match cai.get_item("stream")? {
        Some(s) if !s.is_none() => Some(match s.extract::<u64>()? {
            1 => LEGACY,
            s => s,
        }),
        _ => None,
    };
    Ok(Desc {
        ptr,
        len,
        dtype,
        stream: at.stream.or(named).unwrap_or(LEGACY),
        keep: obj.clone().unbind(),
    })
}

/// CuPy's current stream, for a CuPy array.
fn cupy_current_stream(py: Python<'_>) -> PyResult<u64> {
    py.import("cupy")?
        .getattr("cuda")?
        .call_method0("get_current_stream")?
        .getattr("ptr")?
        .extract()
}

/// Types whose instances were read as torch tensors (`torch.Tensor`, `nn.Parameter`, a
/// subclass): a type seen before skips the `isinstance` check. The bound is for programs that
/// make tensor subclasses on the fly.
static TORCH_TYPES: Registry<(), 32> = Registry::new();

/// Whether `obj` is read as a torch tensor.
fn is_torch(obj: &Bound<'_, PyAny>, memo: &mut Memo) -> PyResult<bool> {
    let ty = obj.get_type();
    if memo
        .torch_type
        .as_ref()
        .is_some_and(|t| t.as_ptr() == ty.as_ptr())
    {
        return Ok(true);
    }
    let torch = is_torch_type(obj, &ty)?;
    if torch {
        memo.torch_type = Some(ty.into_any().unbind());
    }
    Ok(torch)
}

/// [`is_torch`] through the process's list of types: an instance of `torch.Tensor` (a
/// subclass's too, wherever it is defined, so that it is ordered on torch's current stream),
/// once torch is imported (an object of another library never imports it).
fn is_torch_type(obj: &Bound<'_, PyAny>, ty: &Bound<'_, pyo3::types::PyType>) -> PyResult<bool> {
    if TORCH_TYPES.find(ty.as_any()).is_some() {
        return Ok(true);
    }
    let torch = match torch_tensor_type(obj.py())? {
        Some(tensor) => obj.is_instance(tensor.bind(obj.py()))?,
        None => false,
    };
    if torch {
        TORCH_TYPES.add(ty.as_any(), ());
    }
    Ok(torch)
}

/// `torch.Tensor`, once torch is imported: found in `sys.modules` (never imported from here),
/// both looked up once, so that an object of another library costs one dictionary lookup
/// while torch is not imported, and an `isinstance` check after.
fn torch_tensor_type(py: Python<'_>) -> PyResult<Option<&'static Py<PyAny>>> {
    static MODULES: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static TENSOR: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    if let Some(tensor) = TENSOR.get(py) {
        return Ok(Some(tensor));
    }
    let modules = MODULES.get_or_try_init(py, || {
        let sys = py.import(intern!(py, "sys"))?;
        sys.getattr(intern!(py, "modules")).map(Bound::unbind)
    })?;
    let Ok(torch) = modules.bind(py).get_item(intern!(py, "torch")) else {
        return Ok(None);
    };
    let tensor = torch.getattr(intern!(py, "Tensor"))?.unbind();
    Ok(Some(TENSOR.get_or_init(py, || tensor)))
}

/// Reads a tensor for a call that wants it `at`.
pub(crate) fn describe(obj: &Bound<'_, PyAny>, at: Where) -> PyResult<Desc> {
    describe_with(obj, at, &mut Memo::default())
}

/// [`describe`] for one of a call's tensors, which share `memo`.
pub(crate) fn describe_with(obj: &Bound<'_, PyAny>, at: Where, memo: &mut Memo) -> PyResult<Desc> {
    let py = obj.py();
    // An exact torch type (once the exchange API was looked up, at the first torch tensor) is
    // a torch tensor's without the type checks.
    if Exchange::loaded(py).is_some_and(|x| x.is_exact(obj)) {
        return describe_torch(obj, at, memo);
    }
    if is_torch(obj, memo)? {
        return describe_torch(obj, at, memo);
    }
    let module = module_of(obj);
    if obj.hasattr(intern!(py, "__dlpack__"))? {
        let stream = match at.stream {
            Some(s) => s,
            None if module.starts_with("cupy") => cupy_current_stream(py)?,
            None => LEGACY,
        };
        return describe_dlpack(obj, at, stream);
    }
    if let Ok(cai) = obj.getattr(intern!(py, "__cuda_array_interface__")) {
        return describe_cai(obj, &cai, at);
    }
    Err(argument(format!(
        "expected a tensor (torch.Tensor, or an object with __dlpack__ or \
         __cuda_array_interface__), got {}",
        obj.get_type().name()?
    )))
}

/// How gpucast reads a tensor: a dict of its address, length, element type and stream.
/// `device=None` accepts any device, host memory included (for tests of the reading).
#[pyfunction]
#[pyo3(signature = (tensor, device=None, stream=None))]
pub(crate) fn describe_tensor<'py>(
    tensor: &Bound<'py, PyAny>,
    device: Option<usize>,
    stream: Option<u64>,
) -> PyResult<Bound<'py, PyDict>> {
    let py = tensor.py();
    let d = describe(
        tensor,
        Where {
            device,
            stream,
            writes: false,
        },
    )?;
    let out = PyDict::new(py);
    out.set_item("ptr", d.ptr)?;
    out.set_item("len", d.len)?;
    out.set_item("dtype", d.dtype.name())?;
    out.set_item("nbytes", d.len * d.dtype.size())?;
    out.set_item("stream", d.stream)?;
    out.set_item("owner", d.keep.into_bound_py_any(py)?)?;
    Ok(out)
}

/// The allocations a call's buffers were checked against: the call's later buffers in one of
/// them are checked against it without asking the driver again ([`ExternalSlice::new_in`]).
/// Live for one call only, while the call holds every described tensor (so every allocation
/// listed stays allocated).
#[derive(Default)]
pub(crate) struct Seen(Known<CheckedAllocation>);

/// A short list without repeats that needs no Vec for its first entry: the allocations of a
/// [`Seen`] (a call's tensors often share one, a segment of torch's caching allocator), the
/// streams of a [`Memo`] (a call's tensors are often on one device).
#[derive(Default)]
enum Known<A> {
    #[default]
    None,
    One([A; 1]),
    Many(Vec<A>),
}

impl<A: Copy + PartialEq> Known<A> {
    fn as_slice(&self) -> &[A] {
        match self {
            Known::None => &[],
            Known::One(a) => a,
            Known::Many(v) => v,
        }
    }

    /// Lists `a` unless it is listed.
    fn add(&mut self, a: A) {
        if self.as_slice().contains(&a) {
            return;
        }
        *self = match std::mem::take(self) {
            Known::None => Known::One([a]),
            Known::One([b]) => Known::Many(vec![b, a]),
            Known::Many(mut v) => {
                v.push(a);
                Known::Many(v)
            }
        };
    }
}

impl Seen {
    /// A buffer of `T` of the described memory, ordered with `stream`.
    ///
    /// # Safety
    /// As for [`external`]; and the memory of every buffer made through `self` so far is
    /// still allocated.
    pub(crate) unsafe fn slice<T: gpucast::Element>(
        &mut self,
        d: &Desc,
        stream: Arc<CudaStream>,
    ) -> gpucast::Result<ExternalSlice<T>> {
        // SAFETY: per this function's contract.
        let s = unsafe { ExternalSlice::<T>::new_in(d.ptr, d.len, stream, self.0.as_slice()) }?;
        if let Some(a) = s.allocation() {
            self.0.add(a);
        }
        Ok(s)
    }
}

/// A gpucast buffer of the described memory, ordered with `stream`.
///
/// # Safety
/// `d` describes live device memory of `stream`'s device (allocated in its primary context),
/// which stays allocated until the work queued on `stream` by the call given the buffer has
/// run, and `stream` stays live until then (the contract of [`ExternalSlice::new`]); the
/// memory of every buffer made through `seen` so far is still allocated.
///
/// Also returns whether the memory is a plain allocation that any GPU with peer access
/// reaches ([`ExternalSlice::is_plain_allocation`]).
pub(crate) unsafe fn external(
    d: &Desc,
    stream: Arc<CudaStream>,
    seen: &mut Seen,
) -> gpucast::Result<(Box<dyn DeviceTensorMut>, bool)> {
    macro_rules! boxed {
        ($t:ty) => {{
            // SAFETY: per this function's contract.
            let s = unsafe { seen.slice::<$t>(d, stream) }?;
            let plain = s.is_plain_allocation();
            (Box::new(s) as Box<dyn DeviceTensorMut>, plain)
        }};
    }
    Ok(match d.dtype {
        DType::F32 => boxed!(f32),
        DType::F64 => boxed!(f64),
        DType::F16 => boxed!(f16),
        DType::BF16 => boxed!(bf16),
        DType::I8 => boxed!(i8),
        DType::U8 => boxed!(u8),
        DType::I32 => boxed!(i32),
        DType::U32 => boxed!(u32),
        DType::I64 => boxed!(i64),
        DType::U64 => boxed!(u64),
        other => {
            return Err(gpucast::Error::InvalidArgument(format!(
                "element type {other} has no buffer type here"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_of_a_transpose_are_not_contiguous_but_unit_dimensions_are_free() {
        assert!(contiguous(&[2, 3], &[3, 1]));
        assert!(!contiguous(&[2, 3], &[1, 2]));
        assert!(contiguous(&[2, 1, 3], &[3, 99, 1]));
        assert!(contiguous(&[0, 5], &[7, 7]));
        assert!(contiguous(&[], &[]));
    }

    #[test]
    fn every_element_type_has_a_carrier_of_its_size() {
        for (name, size) in [
            ("torch.float32", 4),
            ("torch.bfloat16", 2),
            ("torch.bool", 1),
            ("torch.int16", 2),
            ("torch.complex64", 8),
            ("torch.float8_e4m3fn", 1),
        ] {
            let (d, per) = torch_dtype(name).unwrap();
            assert_eq!(d.size() * per, size, "{name}");
        }
        assert!(torch_dtype("torch.quint8").is_none());
        assert_eq!(dlpack_dtype(4, 16, 1), Some((DType::BF16, 1)));
        assert_eq!(dlpack_dtype(2, 32, 4), None);
        assert_eq!(typestr_dtype("<c16"), Some((DType::F64, 2)));
        assert_eq!(typestr_dtype(">f4"), None);
    }

    #[test]
    fn the_seen_list_holds_each_allocation_once_in_order() {
        let mut k = Known::default();
        assert!(k.as_slice().is_empty());
        for (a, want) in [
            (7, &[7][..]),
            (7, &[7]),
            (9, &[7, 9]),
            (7, &[7, 9]),
            (3, &[7, 9, 3]),
        ] {
            k.add(a);
            assert_eq!(k.as_slice(), want);
        }
    }
}
