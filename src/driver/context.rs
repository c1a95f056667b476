//! Contexts: making one current on the calling thread, and peer access from the current one.

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{self, CUcontext};

/// Makes `ctx` current on the calling thread (`cuCtxSetCurrent`). Like
/// [`super::make_current`], and unlike cudarc's `bind_to_thread`, it reports no error stored
/// by cudarc; it takes a raw handle (the P2P launch threads hold no `CudaContext`).
///
/// # Safety
/// `ctx` is a live context.
pub(crate) unsafe fn set_current(ctx: CUcontext) -> Result<(), DriverError> {
    // SAFETY: `ctx` is live (this function's contract).
    unsafe { sys::cuCtxSetCurrent(ctx) }.result()
}

/// Lets the current context access the memory of `peer` (`cuCtxEnablePeerAccess`, with no
/// flags: the driver accepts none). Where that access is already enabled it returns
/// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`, for the caller to judge.
///
/// # Safety
/// `peer` is a live context.
pub(crate) unsafe fn enable_peer_access(peer: CUcontext) -> Result<(), DriverError> {
    // SAFETY: `peer` is live (this function's contract).
    unsafe { sys::cuCtxEnablePeerAccess(peer, 0) }.result()
}
