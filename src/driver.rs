//! Driver calls that the engine and the P2P path share, each bounded and with its error's
//! context: making a context current without cudarc's stored-error check, and a memset that
//! is waited for on a stream of its own.

use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUstream};
use cudarc::driver::{result, CudaContext};

use crate::error::{Error, Result};

/// Makes `ctx` current on this thread. Unlike cudarc's `bind_to_thread`, it does not first
/// report (and so consume) an error cudarc stored from an earlier operation on the context (a
/// guard's wait that failed inside a capture, say): what must happen whatever came before
/// (ending a capture, an ordering, a graph's destruction) uses this.
pub(crate) fn make_current(ctx: &CudaContext) -> std::result::Result<(), result::DriverError> {
    // SAFETY: `ctx` holds a live context.
    unsafe { sys::cuCtxSetCurrent(ctx.cu_ctx()) }.result()
}

/// Longest [`memset_now`] waits for its memset.
pub(crate) const MEMSET_WITHIN: Duration = Duration::from_secs(10);

/// Sets `words` 32-bit words at `ptr` (device memory of `ctx`) to `value` and waits until that
/// is done, on a stream of its own: the wait covers the memset alone, not the caller's other
/// work on the context nor the legacy stream, and it ends within [`MEMSET_WITHIN`]
/// ([`Error::StreamsBusy`] otherwise, the memset then still pending: the caller must neither
/// free nor reuse the memory).
///
/// # Safety
/// `ptr` holds at least `words` 32-bit words of memory of `ctx`'s device, not freed before
/// this returns (nor after it, on `StreamsBusy`).
pub(crate) unsafe fn memset_now(
    ctx: &CudaContext,
    ptr: u64,
    value: u32,
    words: usize,
) -> Result<()> {
    let start = Instant::now();
    make_current(ctx).map_err(Error::cuda("binding a context"))?;
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
        .map_err(Error::cuda("creating a stream for a memset"))?;
    // SAFETY: per this function's contract; `stream` is a live stream of the current context.
    let set = unsafe { sys::cuMemsetD32Async(ptr, value, words, stream) }
        .result()
        .map_err(Error::cuda("queueing a memset"))
        .and_then(|()| wait_idle(stream, start, MEMSET_WITHIN));
    // SAFETY: created above and used nowhere else; work still queued (after a wait that gave
    // up) completes before the driver frees the stream.
    let _ = unsafe { result::stream::destroy(stream) };
    set
}

/// Waits, by polling, until `stream` is idle or `within` has passed since `start`.
fn wait_idle(stream: CUstream, start: Instant, within: Duration) -> Result<()> {
    let mut backoff = crate::wait::Backoff::new();
    loop {
        // SAFETY: `stream` is a live stream of the current context.
        match unsafe { sys::cuStreamQuery(stream) } {
            sys::CUresult::CUDA_SUCCESS => return Ok(()),
            sys::CUresult::CUDA_ERROR_NOT_READY if start.elapsed() < within => backoff.pause(),
            sys::CUresult::CUDA_ERROR_NOT_READY => {
                return Err(Error::StreamsBusy {
                    waited_ms: crate::nccl::millis(start.elapsed()),
                })
            }
            e => {
                return Err(Error::Cuda {
                    during: "waiting for a memset".into(),
                    source: result::DriverError(e),
                })
            }
        }
    }
}
