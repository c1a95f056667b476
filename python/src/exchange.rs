//! torch's DLPack C exchange API (`torch.Tensor.__dlpack_c_exchange_api__`, DLPack 1.3): C
//! functions that fill a `DLTensor` view of a tensor (device, shape, strides, address) and read
//! torch's current stream of a device, without a Python call or an allocation. One call of it
//! replaces four of the tensor's own methods (`get_device`, `is_contiguous`, `numel`,
//! `data_ptr`), where it gives the same facts: see [`Exchange::view`].

use std::ffi::{c_int, c_void, CStr};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyCapsule;

use crate::tensors::{DLTensor, KDL_CUDA, MAX_DIMS};

/// `DLPackVersion`.
#[repr(C)]
struct Version {
    major: u32,
    minor: u32,
}

/// `DLPackExchangeAPIHeader`.
#[repr(C)]
struct Header {
    version: Version,
    prev_api: *const Header,
}

/// `DLPackDLTensorFromPyObjectNoSync`.
type ViewFn = unsafe extern "C" fn(py_object: *mut c_void, out: *mut DLTensor) -> c_int;

/// `DLPackCurrentWorkStream` (the device type is `DLDeviceType`, an enum of underlying type
/// `int32_t` in the C++ that torch is built as).
type StreamFn =
    unsafe extern "C" fn(device_type: i32, device_id: i32, out: *mut *mut c_void) -> c_int;

/// `DLPackExchangeAPI` of DLPack major version 1. The three functions not used here are kept
/// as untyped pointers: they are never called.
#[repr(C)]
struct Api {
    header: Header,
    managed_tensor_allocator: *const c_void,
    managed_tensor_from_py_object_no_sync: *const c_void,
    managed_tensor_to_py_object_no_sync: *const c_void,
    dltensor_from_py_object_no_sync: Option<ViewFn>,
    current_work_stream: Option<StreamFn>,
}

// The layout of torch's `ATen/dlpack.h` (DLPack 1.3) on a 64-bit target, in bytes.
#[cfg(target_pointer_width = "64")]
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(offset_of!(Header, prev_api) == 8 && size_of::<Header>() == 16);
    assert!(offset_of!(Api, dltensor_from_py_object_no_sync) == 40);
    assert!(offset_of!(Api, current_work_stream) == 48 && size_of::<Api>() == 56);
};

/// The capsule's name, as DLPack specifies it.
const CAPSULE: &CStr = c"dlpack_exchange_api";

/// What one call of the exchange API tells of a tensor.
pub(crate) struct View {
    /// DLPack's device type and index.
    pub(crate) device_type: i32,
    pub(crate) device_id: i32,
    /// Address of the first element (`data + byte_offset`).
    pub(crate) ptr: u64,
    /// Number of elements (the product of the shape), `None` when it does not fit in `usize`
    /// or a dimension is negative.
    pub(crate) numel: Option<usize>,
    /// Whether the strides are C-contiguous for the shape, as torch's `is_contiguous()`
    /// decides it (dimensions of size 1 may have any stride, an empty tensor is contiguous).
    pub(crate) contiguous: bool,
}

/// torch's exchange API, as found at the first torch tensor.
pub(crate) struct Exchange {
    /// `torch.Tensor` and `torch.nn.Parameter` (held, so their addresses stay theirs): an
    /// instance of exactly one of these types has no `__torch_function__` of its own, so its
    /// methods read the C++ tensor that the view reads (unless a torch function mode is on).
    exact: Vec<Py<PyAny>>,
    view: ViewFn,
    /// `torch._C._is_torch_function_mode_enabled`.
    modes_on: Py<PyAny>,
    /// The current stream of a CUDA device, as `torch._C._cuda_getCurrentRawStream` reads it
    /// (both are `at::cuda::getCurrentCUDAStream(device).stream()`): only in a CUDA build of
    /// torch that has that function.
    stream: Option<StreamFn>,
}

static EXCHANGE: PyOnceLock<Option<Exchange>> = PyOnceLock::new();

/// The table `obj` holds, if it is a capsule named [`CAPSULE`]; null otherwise.
fn table(obj: &Bound<'_, PyAny>) -> *const Header {
    let Ok(capsule) = obj.cast::<PyCapsule>() else {
        return std::ptr::null();
    };
    // SAFETY: `capsule` is a live capsule; PyCapsule_GetPointer checks its name (null with an
    // exception set otherwise) and reads nothing else.
    let p = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), CAPSULE.as_ptr()) };
    if p.is_null() {
        drop(PyErr::take(obj.py()));
    }
    p.cast()
}

impl Exchange {
    /// torch's exchange API, when the torch imported has one of DLPack major version 1 with a
    /// view function (torch 2.11 has one); `None` otherwise (an older torch, or anything
    /// unexpected), and then tensors are read through their methods alone.
    pub(crate) fn get(py: Python<'_>) -> Option<&Exchange> {
        EXCHANGE
            .get_or_init(py, || Exchange::load(py).ok().flatten())
            .as_ref()
    }

    /// [`Exchange::get`] once it has been looked up, without looking it up (which imports
    /// torch).
    pub(crate) fn loaded(py: Python<'_>) -> Option<&Exchange> {
        EXCHANGE.get(py).and_then(Option::as_ref)
    }

    fn load(py: Python<'_>) -> PyResult<Option<Exchange>> {
        let torch = py.import("torch")?;
        let tensor = torch.getattr("Tensor")?;
        let parameter = torch.getattr("nn")?.getattr("Parameter")?;
        let capsule = tensor.getattr("__dlpack_c_exchange_api__")?;
        let c = torch.getattr("_C")?;
        // The class attribute can be replaced (by another library, or the user), and a table
        // of another producer may answer differently (a null stream, say): only torch's own
        // table, as torch's C module hands it out, is used.
        let own = table(&c.call_method0("_dlpack_exchange_api")?);
        let mut header = table(&capsule);
        if header.is_null() || header != own {
            return Ok(None);
        }
        // DLPack: a table of a later major version may link to tables of earlier ones.
        for _ in 0..8 {
            // SAFETY: a non-null "dlpack_exchange_api" capsule points to the producer's
            // DLPackExchangeAPI, which lives as long as the process (DLPack's contract); each
            // table starts with the header, whose layout every version keeps, and `prev_api`
            // is null or another such table.
            let h = unsafe { &*header };
            if h.version.major == 1 {
                break;
            }
            header = h.prev_api;
            if header.is_null() {
                return Ok(None);
            }
        }
        // SAFETY: as above; a table of major version 1 has this layout.
        let api = unsafe { &*header.cast::<Api>() };
        if api.header.version.major != 1 {
            return Ok(None);
        }
        let Some(view) = api.dltensor_from_py_object_no_sync else {
            return Ok(None);
        };
        let modes_on = c.getattr("_is_torch_function_mode_enabled")?;
        let cuda_build = !torch.getattr("version")?.getattr("cuda")?.is_none();
        let stream = api
            .current_work_stream
            .filter(|_| cuda_build && c.hasattr("_cuda_getCurrentRawStream").unwrap_or(false));
        // A Parameter whose type names another table is read through its methods.
        let mut exact = vec![tensor.clone().unbind()];
        if parameter
            .getattr("__dlpack_c_exchange_api__")
            .is_ok_and(|p| table(&p) == own)
        {
            exact.push(parameter.unbind());
        }
        Ok(Some(Exchange {
            exact,
            view,
            modes_on: modes_on.unbind(),
            stream,
        }))
    }

    /// Whether `obj` is exactly a `torch.Tensor` or a `torch.nn.Parameter`.
    pub(crate) fn is_exact(&self, obj: &Bound<'_, PyAny>) -> bool {
        let ty = obj.get_type();
        self.exact.iter().any(|t| t.as_ptr() == ty.as_ptr())
    }

    /// Whether no torch function mode is on (then the methods of a tensor of an exact type
    /// dispatch to nothing but themselves); `false` when that cannot be told.
    pub(crate) fn modes_off(&self, py: Python<'_>) -> bool {
        matches!(
            self.modes_on
                .bind(py)
                .call0()
                .and_then(|on| on.extract::<bool>()),
            Ok(false)
        )
    }

    /// The view of `tensor`; `None` when it is not of an exact type ([`Exchange::is_exact`]),
    /// torch cannot describe it in DLPack (a sparse, nested or quantized tensor, the meta
    /// device, ...: the exception is cleared) or its view is not a plain strided one.
    pub(crate) fn view(&self, tensor: &Bound<'_, PyAny>) -> Option<View> {
        if !self.is_exact(tensor) {
            return None;
        }
        let py = tensor.py();
        let mut t = DLTensor::empty();
        // SAFETY: the GIL is held (`py`); `tensor` is a live object of a type the table was
        // found on (torch.Tensor, or a Parameter whose type names the same table: checked
        // above and at load), as the function requires; `t` is a writable DLTensor. It returns
        // 0, or -1 with an exception set.
        if unsafe { (self.view)(tensor.as_ptr().cast(), &mut t) } != 0 {
            drop(PyErr::take(py));
            return None;
        }
        if !(0..=MAX_DIMS).contains(&t.ndim) {
            return None;
        }
        let ndim = t.ndim as usize;
        if ndim > 0 && (t.shape.is_null() || t.strides.is_null()) {
            return None;
        }
        let (shape, strides): (&[i64], &[i64]) = if ndim == 0 {
            (&[], &[])
        } else {
            // SAFETY: after a successful call `shape` and `strides` (not null, checked above)
            // each point to `ndim` int64 values of the tensor's own, valid while the tensor
            // lives unchanged: they are read here, before any Python code runs.
            unsafe {
                (
                    std::slice::from_raw_parts(t.shape, ndim),
                    std::slice::from_raw_parts(t.strides, ndim),
                )
            }
        };
        let numel = shape.iter().try_fold(1usize, |acc, &n| {
            usize::try_from(n).ok().and_then(|n| acc.checked_mul(n))
        });
        Some(View {
            device_type: t.device.device_type,
            device_id: t.device.device_id,
            ptr: (t.data as u64).checked_add(t.byte_offset)?,
            numel,
            contiguous: crate::tensors::contiguous(shape, strides),
        })
    }

    /// torch's current stream of CUDA device `device` (a raw handle), as
    /// `torch._C._cuda_getCurrentRawStream(device)` returns it; `None` where this torch has no
    /// such function, `device` is past torch's device indices, or it failed (the exception is
    /// cleared: the caller asks torch's Python function, which raises it again).
    pub(crate) fn current_stream(&self, py: Python<'_>, device: usize) -> Option<u64> {
        let f = self.stream?;
        // torch narrows the id to its device index (`int8_t`): a larger one would name another
        // device.
        let id = i32::from(i8::try_from(device).ok()?);
        let mut out: *mut c_void = std::ptr::null_mut();
        // SAFETY: the GIL is held (`py`); `out` is a writable pointer; the function returns 0,
        // or -1 with an exception set.
        if unsafe { f(KDL_CUDA, id, &mut out) } != 0 {
            drop(PyErr::take(py));
            return None;
        }
        Some(out as u64)
    }
}
