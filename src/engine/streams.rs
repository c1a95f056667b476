//! Streams the engine uses: per rank, the stream its broadcasts run on, and three more that
//! never carry a caller's work (see [`super::Rank`]).
//!
//! Every stream the engine creates is a cudarc stream (`CudaStream::fork`), which puts
//! the context in cudarc's multi-stream mode: cudarc then records a read or write event for
//! every buffer access it orders and makes every stream wait for them, the context's default
//! stream and the per-thread stream included. That is what orders a caller's later work on any
//! stream with a broadcast (see `clique::access`); in single-stream mode cudarc tracks nothing,
//! and work on the default stream would race with the clique's non-blocking streams.

use std::sync::Arc;

use cudarc::driver::sys::CUstream;
use cudarc::driver::{result, CudaContext, CudaStream};

use crate::error::{Error, Result};

/// A stream of the engine: created by it, or the caller's.
pub(crate) enum EngineStream {
    /// Created by the engine (destroyed by cudarc when the last holder drops it).
    Owned(Arc<CudaStream>),
    /// Handed in by the caller (`CliqueBuilder::streams`).
    Callers(Arc<CudaStream>),
}

impl EngineStream {
    /// A new non-blocking stream of `ctx`, counted by cudarc (multi-stream mode), forked from
    /// `parent` (a stream of `ctx`): it starts after the work queued there so far. Without a
    /// parent it is forked from a fresh, empty stream, so it depends on nothing: not on the
    /// context's default stream (which waits for every blocking stream, and which another
    /// thread's capture in global mode forbids touching). Forking, unlike `new_stream`, never
    /// blocks the host (the latter synchronises the whole context when it switches modes,
    /// waiting for any work the caller has queued there, without bound).
    pub(crate) fn create(
        ctx: &Arc<CudaContext>,
        parent: Option<&Arc<CudaStream>>,
    ) -> Result<EngineStream> {
        let failed = Error::cuda(format!("creating a stream on device {}", ctx.ordinal()));
        if let Some(p) = parent {
            return p.fork().map(EngineStream::Owned).map_err(failed);
        }
        ctx.bind_to_thread()
            .map_err(Error::cuda("binding a context"))?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(
            Error::cuda(format!("creating a stream on device {}", ctx.ordinal())),
        )?;
        // SAFETY: `raw` is a live stream of `ctx`, used only through this wrapper, which is
        // dropped (it does not destroy the stream) before `raw` is destroyed below.
        let empty = unsafe { ctx.wrap_borrowed_stream(raw) };
        let forked = empty.fork();
        drop(empty);
        // SAFETY: created above; nothing else holds it. The fork's join (an event recorded on
        // it) is already queued, and the driver frees the stream once that is done.
        if let Err(e) = unsafe { result::stream::destroy(raw) } {
            tracing::warn!(error = %e, "could not destroy a stream");
        }
        forked.map(EngineStream::Owned).map_err(failed)
    }

    /// The stream.
    pub(crate) fn get(&self) -> &Arc<CudaStream> {
        match self {
            EngineStream::Owned(s) | EngineStream::Callers(s) => s,
        }
    }
}

/// Why a caller's stream handle cannot carry a rank's work, if it cannot: the legacy default
/// stream (which captures refuse and which synchronises with every blocking stream) and the
/// per-thread default stream (a different stream on each thread, and the engine launches from
/// several threads) are names, not streams of their own.
pub(crate) fn special_handle(stream: CUstream) -> Option<&'static str> {
    match stream as usize {
        0 => Some("the context's default (null) stream"),
        1 => Some("the legacy default stream handle (CU_STREAM_LEGACY)"),
        2 => Some("the per-thread default stream handle (CU_STREAM_PER_THREAD)"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::special_handle;

    #[test]
    fn the_default_stream_handles_are_refused_and_real_streams_are_not() {
        for raw in [0usize, 1, 2] {
            assert!(special_handle(raw as _).is_some(), "{raw}");
        }
        assert!(special_handle(0x7f00_1234_5000usize as _).is_none());
    }
}
