//! Streams: whether one is idle, its context, and the 32-bit memory operations (a wait for a
//! word, a write of one) queued on it.

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{self, CUcontext, CUdeviceptr, CUstream};

/// Orders `later` after the work queued so far on `earlier`: `event` is recorded on `earlier`
/// and `later` waits for it. `ctx`, the event's context, is made current without cudarc's
/// `bind_to_thread`: an error cudarc stored from unrelated work must not stop this ordering (a
/// buffer's stream would then move on before a call's work on the buffer).
///
/// # Safety
/// `event` is an event of `ctx` that nothing records concurrently, `earlier` is a live stream
/// of `ctx`, and `later` is a live stream of any context of the process (`cuStreamWaitEvent`
/// takes an event of another context and device).
pub(crate) unsafe fn order(
    ctx: &cudarc::driver::CudaContext,
    event: sys::CUevent,
    earlier: CUstream,
    later: CUstream,
) -> Result<(), DriverError> {
    super::make_current(ctx)?;
    // SAFETY: `event` and both streams per this function's contract; both calls only enqueue.
    unsafe {
        cudarc::driver::result::event::record(event, earlier)?;
        cudarc::driver::result::stream::wait_event(
            later,
            event,
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
}

/// Whether `stream` has finished all the work queued on it (`cuStreamQuery`): `Ok(false)`
/// where the driver reports `CUDA_ERROR_NOT_READY`, any other failure as the error. A stream
/// in error is never idle here.
///
/// # Safety
/// `stream` is a live stream.
pub(crate) unsafe fn is_idle(stream: CUstream) -> Result<bool, DriverError> {
    // SAFETY: `stream` is live (this function's contract).
    match unsafe { sys::cuStreamQuery(stream) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(DriverError(e)),
    }
}

/// Whether `stream` is being captured into a graph (`cuStreamIsCapturing`): active or
/// invalidated captures alike.
///
/// # Safety
/// `stream` is a live stream.
pub(crate) unsafe fn is_capturing(stream: CUstream) -> Result<bool, DriverError> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `stream` is live (this function's contract); `status` is a live local, a valid
    // out pointer.
    unsafe { sys::cuStreamIsCapturing(stream, &mut status) }.result()?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// The context that `stream` belongs to (`cuStreamGetCtx`).
///
/// # Safety
/// `stream` is a live stream.
pub(crate) unsafe fn context(stream: CUstream) -> Result<CUcontext, DriverError> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: `stream` is live (this function's contract); `ctx` is a live local, a valid out
    // pointer.
    unsafe { sys::cuStreamGetCtx(stream, &mut ctx) }.result()?;
    Ok(ctx)
}

/// Queues on `stream` a wait until the 32-bit word at `addr` satisfies `value` under `flags`
/// (`cuStreamWaitValue32_v2`; `flags` are `CUstreamWaitValue_flags`).
///
/// # Safety
/// `stream` is a live stream; `addr` is a 32-bit word of device memory that `stream`'s device
/// can reach and that stays allocated until the stream has passed the wait.
pub(crate) unsafe fn wait_value_32(
    stream: CUstream,
    addr: CUdeviceptr,
    value: u32,
    flags: u32,
) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { sys::cuStreamWaitValue32_v2(stream, addr, value, flags) }.result()
}

/// Queues on `stream` a write of `value` into the 32-bit word at `addr`
/// (`cuStreamWriteValue32_v2`; `flags` are `CUstreamWriteValue_flags`).
///
/// # Safety
/// `stream` is a live stream; `addr` is a 32-bit word of device memory that `stream`'s device
/// can reach, that the caller may write and that stays allocated until the stream has passed
/// the write.
pub(crate) unsafe fn write_value_32(
    stream: CUstream,
    addr: CUdeviceptr,
    value: u32,
    flags: u32,
) -> Result<(), DriverError> {
    // SAFETY: per this function's contract.
    unsafe { sys::cuStreamWriteValue32_v2(stream, addr, value, flags) }.result()
}
