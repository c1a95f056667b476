//! Virtual memory management: physical allocations that other processes can import through
//! POSIX file descriptors, address ranges, and the mappings between them.
//!
//! An allocation handle (`CUmemGenericAllocationHandle`) is an opaque value the driver may not
//! check, so every call that takes one is `unsafe`.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{self, CUdeviceptr, CUmemAllocationProp, CUmemGenericAllocationHandle};

/// The allocation granularity `option` asks for, for allocations described by `prop`
/// (`cuMemGetAllocationGranularity`).
///
/// # Safety
/// `prop.win32HandleMetaData` is null, or valid for the Win32 handle type `prop` requests.
pub(crate) unsafe fn granularity(
    prop: &CUmemAllocationProp,
    option: sys::CUmemAllocationGranularity_flags,
) -> Result<usize, DriverError> {
    let mut granularity = 0usize;
    // SAFETY: `prop` is a valid property struct (its one pointer per this function's
    // contract); `granularity` is a live local, a valid out pointer.
    unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, prop, option) }.result()?;
    Ok(granularity)
}

/// A physical allocation of `size` bytes described by `prop` (`cuMemCreate`, with no flags:
/// the driver accepts none). The caller releases the handle ([`release`]).
///
/// # Safety
/// As for [`granularity`].
pub(crate) unsafe fn create(
    size: usize,
    prop: &CUmemAllocationProp,
) -> Result<CUmemGenericAllocationHandle, DriverError> {
    let mut handle: CUmemGenericAllocationHandle = 0;
    // SAFETY: `prop` is a valid property struct (its one pointer per this function's
    // contract); `handle` is a live local, a valid out pointer.
    unsafe { sys::cuMemCreate(&mut handle, size, prop, 0) }.result()?;
    Ok(handle)
}

/// Imports the allocation that another process exported as the POSIX file descriptor `fd`
/// (`cuMemImportFromShareableHandle`). The descriptor stays the caller's: the driver reads it
/// during the call. The caller releases the handle ([`release`]).
pub(crate) fn import_fd(fd: BorrowedFd<'_>) -> Result<CUmemGenericAllocationHandle, DriverError> {
    let mut handle: CUmemGenericAllocationHandle = 0;
    // SAFETY: `fd` is open for the whole call (it is borrowed), and the driver takes a POSIX
    // descriptor by value in the pointer argument; `handle` is a live local, a valid out
    // pointer.
    unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            fd.as_raw_fd() as usize as *mut std::ffi::c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    }
    .result()?;
    Ok(handle)
}

/// A POSIX file descriptor for the allocation `handle`, which another process can import
/// (`cuMemExportToShareableHandle`, with no flags: the driver accepts none).
///
/// # Safety
/// `handle` is a live allocation handle of this process, created with the POSIX
/// file-descriptor handle type among its requested ones.
pub(crate) unsafe fn export_fd(
    handle: CUmemGenericAllocationHandle,
) -> Result<OwnedFd, DriverError> {
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: `handle` is such a handle (this function's contract); for a POSIX descriptor the
    // driver writes an int, and `fd` is a live local int.
    unsafe {
        sys::cuMemExportToShareableHandle(
            std::ptr::addr_of_mut!(fd).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    }
    .result()?;
    // SAFETY: the driver returned a fresh descriptor that this process now owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A fresh reservation of `size` bytes of addresses (`cuMemAddressReserve`: anywhere, at the
/// default alignment, with no flags). The caller frees it ([`free_addresses`]).
pub(crate) fn reserve(size: usize) -> Result<CUdeviceptr, DriverError> {
    let mut va: CUdeviceptr = 0;
    // SAFETY: `va` is a live local, a valid out pointer; a reservation at no fixed address
    // touches no memory.
    unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) }.result()?;
    Ok(va)
}

/// Maps the allocation `handle`, from its start, at `va` for `size` bytes (`cuMemMap`, offset
/// 0, with no flags: the driver accepts none).
///
/// # Safety
/// `va` starts a reservation of this process of at least `size` bytes with nothing mapped
/// there, and `handle` is a live allocation handle of at least `size` bytes.
pub(crate) unsafe fn map(
    va: CUdeviceptr,
    size: usize,
    handle: CUmemGenericAllocationHandle,
) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { sys::cuMemMap(va, size, 0, handle, 0) }.result()
}

/// Sets the access of the one location `desc` names to the `size` bytes mapped at `va`
/// (`cuMemSetAccess`).
///
/// # Safety
/// `va` starts `size` bytes that this process has mapped.
pub(crate) unsafe fn set_access(
    va: CUdeviceptr,
    size: usize,
    desc: &sys::CUmemAccessDesc,
) -> Result<(), DriverError> {
    // SAFETY: `va` is mapped for `size` bytes (this function's contract); `desc` is one valid
    // descriptor.
    unsafe { sys::cuMemSetAccess(va, size, desc, 1) }.result()
}

/// Unmaps the `size` bytes mapped at `va` (`cuMemUnmap`).
///
/// # Safety
/// `va` starts a mapping of this process of `size` bytes that nothing uses any more (no
/// kernel, copy or host access).
pub(crate) unsafe fn unmap(va: CUdeviceptr, size: usize) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { sys::cuMemUnmap(va, size) }.result()
}

/// Frees the reservation of `size` bytes at `va` (`cuMemAddressFree`).
///
/// # Safety
/// `va` starts a reservation of this process of `size` bytes that nothing uses again.
pub(crate) unsafe fn free_addresses(va: CUdeviceptr, size: usize) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { sys::cuMemAddressFree(va, size) }.result()
}

/// Releases the allocation `handle` (`cuMemRelease`); its memory is freed once no mapping of
/// it is left.
///
/// # Safety
/// `handle` is a live allocation handle that the caller owns and does not use again.
pub(crate) unsafe fn release(handle: CUmemGenericAllocationHandle) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { sys::cuMemRelease(handle) }.result()
}
