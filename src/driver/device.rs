//! The driver and its devices: the driver's CUDA version, and what two devices can do with
//! each other's memory.
//!
//! A `CUdevice` is an ordinal that the driver checks (an unknown one is
//! `CUDA_ERROR_INVALID_DEVICE`), so these calls are sound for any argument.

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{self, CUdevice};

/// The CUDA version the installed driver supports, as `1000 * major + 10 * minor`
/// (`cuDriverGetVersion`).
pub(crate) fn version() -> Result<i32, DriverError> {
    let mut v = 0;
    // SAFETY: `v` is a live local, a valid out pointer for the int the driver writes.
    unsafe { sys::cuDriverGetVersion(&mut v) }.result()?;
    Ok(v)
}

/// Whether `device` can access the memory of `peer` (`cuDeviceCanAccessPeer`).
pub(crate) fn can_access_peer(device: CUdevice, peer: CUdevice) -> Result<bool, DriverError> {
    let mut can = 0;
    // SAFETY: `can` is a live local, a valid out pointer for the int the driver writes; the
    // devices are checked by the driver.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, device, peer) }.result()?;
    Ok(can != 0)
}

/// The value of the peer attribute `attr` from `src` to `dst` (`cuDeviceGetP2PAttribute`).
pub(crate) fn p2p_attribute(
    attr: sys::CUdevice_P2PAttribute,
    src: CUdevice,
    dst: CUdevice,
) -> Result<i32, DriverError> {
    let mut value = 0;
    // SAFETY: every peer attribute is an int, and `value` is a live local, a valid out pointer
    // for it; the devices are checked by the driver.
    unsafe { sys::cuDeviceGetP2PAttribute(&mut value, attr, src, dst) }.result()?;
    Ok(value)
}
