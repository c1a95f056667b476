//! Every raw CUDA driver call of the crate is made in this module; the rest of the crate reaches
//! the driver through these functions or through cudarc (its safe API and its `result` module).
//!
//! The submodules hold thin typed wrappers, one per driver call, in the manner of cudarc's
//! `driver::result`: each takes typed arguments, returns a `Result` with the driver's error and
//! leaves the error's context to its caller. A wrapper that is sound for any argument is a safe
//! function; one whose soundness depends on its arguments (contexts, streams, pools, graphs,
//! allocation handles, addresses, pointers) is an `unsafe fn` whose `# Safety` section says
//! what its caller guarantees.
//!
//! Here are the driver calls that the engine and the P2P path share, each with its error's
//! context: making a context current without cudarc's stored-error check, a memset that is
//! waited for, within a bound, on a stream of its own, and the allocation that holds an address.

pub(crate) mod context;
pub(crate) mod device;
pub(crate) mod graph;
pub(crate) mod memory;
pub(crate) mod pool;
pub(crate) mod stream;
pub(crate) mod vmm;

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
    unsafe { context::set_current(ctx.cu_ctx()) }
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
        // SAFETY: `stream` was created above and is destroyed only below.
        .and_then(|()| unsafe { wait_idle(stream, start, MEMSET_WITHIN) });
    // SAFETY: created above and used nowhere else; work still queued (after a wait that gave
    // up) completes before the driver frees the stream.
    let _ = unsafe { result::stream::destroy(stream) };
    set
}

/// Waits, by polling, until `stream` is idle or `within` has passed since `start`.
///
/// # Safety
/// `stream` is a live stream.
unsafe fn wait_idle(stream: CUstream, start: Instant, within: Duration) -> Result<()> {
    let mut backoff = crate::wait::Backoff::new();
    loop {
        // SAFETY: `stream` is live (this function's contract).
        match unsafe { stream::is_idle(stream) } {
            Ok(true) => return Ok(()),
            Ok(false) if start.elapsed() < within => backoff.pause(),
            Ok(false) => {
                return Err(Error::StreamsBusy {
                    waited_ms: crate::wait::millis(start.elapsed()),
                })
            }
            Err(source) => {
                return Err(Error::Cuda {
                    during: "waiting for a memset".into(),
                    source,
                })
            }
        }
    }
}

/// The device allocation that holds an address, as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Allocation {
    /// Ordinal of the GPU that holds it.
    pub(crate) ordinal: usize,
    /// Its first address.
    pub(crate) start: u64,
    /// Its size in bytes.
    pub(crate) size: u64,
    /// Whether it is a plain `cuMemAlloc` / `cudaMalloc` allocation, which every GPU with peer
    /// access to its device reaches; virtual-memory-management and memory-pool allocations
    /// reach a peer only where their owner granted it access.
    pub(crate) plain: bool,
}

/// The device allocation that holds `ptr`, or [`Error::InvalidArgument`] when `ptr` is not
/// device memory the driver knows (host memory, a freed or made-up address).
pub(crate) fn allocation_of(ctx: &CudaContext, ptr: u64) -> Result<Allocation> {
    use sys::CUpointer_attribute as A;
    make_current(ctx).map_err(Error::cuda("binding a context"))?;
    let mut memory_type: u32 = 0;
    let mut ordinal: i32 = -1;
    let mut start: u64 = 0;
    let mut size: usize = 0;
    // A boolean the driver writes as an int: zeroed 8 bytes read as "non-zero or not".
    let mut legacy_ipc: u64 = 0;
    let mut attributes = [
        A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        A::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    ];
    let mut data: [*mut std::ffi::c_void; 5] = [
        (&raw mut memory_type).cast(),
        (&raw mut ordinal).cast(),
        (&raw mut start).cast(),
        (&raw mut size).cast(),
        (&raw mut legacy_ipc).cast(),
    ];
    // SAFETY: five attributes, each with a pointer to a live local at least as large as what
    // the driver writes for it (unsigned int, int, CUdeviceptr, size_t, a boolean int). For an
    // address that is not a CUDA pointer the driver writes zeros and still returns success.
    unsafe { sys::cuPointerGetAttributes(5, attributes.as_mut_ptr(), data.as_mut_ptr(), ptr) }
        .result()
        .map_err(Error::cuda("querying an address"))?;
    if memory_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 || size == 0 {
        return Err(Error::InvalidArgument(format!(
            "{ptr:#x} is not device memory the CUDA driver knows (host memory, or freed?)"
        )));
    }
    Ok(Allocation {
        ordinal: usize::try_from(ordinal).map_err(|_| {
            Error::InvalidArgument(format!("{ptr:#x}: the driver gives no device for it"))
        })?,
        start,
        size: size as u64,
        plain: legacy_ipc != 0,
    })
}
