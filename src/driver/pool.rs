//! Stream-ordered memory pools: a device's current pool, its reuse policy and which devices
//! may access its memory.

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{self, CUdevice, CUmemoryPool};

/// The memory pool that `device` currently allocates from (`cuDeviceGetMemPool`), which is
/// where cudarc's stream-ordered allocations come from.
pub(crate) fn current(device: CUdevice) -> Result<CUmemoryPool, DriverError> {
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a live local, a valid out pointer; the device is checked by the
    // driver (an unknown one is CUDA_ERROR_INVALID_DEVICE).
    unsafe { sys::cuDeviceGetMemPool(&mut pool, device) }.result()?;
    Ok(pool)
}

/// Sets the attribute `attr` of `pool` to `value` (`cuMemPoolSetAttribute`), for the
/// attributes whose value is an int (the `CU_MEMPOOL_ATTR_REUSE_*` ones).
///
/// # Safety
/// `pool` is a live memory pool, and `attr` is an attribute whose value is an int.
pub(crate) unsafe fn set_int_attribute(
    pool: CUmemoryPool,
    attr: sys::CUmemPool_attribute,
    value: i32,
) -> Result<(), DriverError> {
    let mut value = value;
    // SAFETY: `pool` is live and `attr` takes an int (this function's contract); `value` is a
    // live local int.
    unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&raw mut value).cast()) }.result()
}

/// Sets the access to `pool`'s memory of the one location `desc` names
/// (`cuMemPoolSetAccess`).
///
/// # Safety
/// `pool` is a live memory pool.
pub(crate) unsafe fn set_access(
    pool: CUmemoryPool,
    desc: &sys::CUmemAccessDesc,
) -> Result<(), DriverError> {
    // SAFETY: `pool` is live (this function's contract); `desc` is one valid descriptor.
    unsafe { sys::cuMemPoolSetAccess(pool, desc, 1) }.result()
}
