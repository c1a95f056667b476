//! Device memory: copies queued on a stream, and the device address of mapped host memory.

use std::ffi::c_void;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{self, CUdeviceptr, CUstream};

/// Queues on `stream` a copy of `len` bytes from `src` to `dst` (`cuMemcpyAsync`): with unified
/// addressing the driver finds both devices from the addresses.
///
/// # Safety
/// `stream` is a live stream of the current context; `src` and `dst` each hold `len` bytes
/// that the driver can reach from it, `dst` memory the caller may write, both valid until the
/// stream has passed the copy.
pub(crate) unsafe fn copy_async(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    len: usize,
    stream: CUstream,
) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { sys::cuMemcpyAsync(dst, src, len, stream) }.result()
}

/// Queues on `stream` a copy of `len` bytes from device memory at `src` to device memory at
/// `dst` (`cuMemcpyDtoDAsync_v2`).
///
/// # Safety
/// As for [`copy_async`].
pub(crate) unsafe fn copy_dtod_async(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    len: usize,
    stream: CUstream,
) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream) }.result()
}

/// The device address, in the current context, of the mapped host memory at `host`
/// (`cuMemHostGetDevicePointer_v2`, with no flags: the driver accepts none).
///
/// # Safety
/// `host` points into a live page-locked host allocation made with `CU_MEMHOSTALLOC_DEVICEMAP`.
pub(crate) unsafe fn host_device_pointer(host: *mut c_void) -> Result<CUdeviceptr, DriverError> {
    let mut dev: CUdeviceptr = 0;
    // SAFETY: `host` is such an allocation (this function's contract); `dev` is a live local,
    // a valid out pointer.
    unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }.result()?;
    Ok(dev)
}
