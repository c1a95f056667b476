//! Streams the engine uses: one per rank for the broadcasts, one per rank on the side.
//!
//! The engine's own streams are plain driver streams wrapped with `wrap_borrowed_stream`, so
//! that they do not count as a "second stream" of the context in cudarc's eyes: while a context
//! has no stream made by `new_stream`, cudarc treats it as single-stream and records no
//! per-buffer events, which keeps the common case (buffers allocated and used on the clique's
//! stream) free of event calls. Once the caller creates a stream of that context, cudarc tracks
//! every buffer with events, and the engine's calls honour them (see `clique::access`).
//!
//! Because cudarc does not destroy a borrowed stream, the engine does: when the clique goes
//! away, a stream nobody else holds is destroyed; one still held (buffers allocated on it keep
//! an `Arc` to their stream) is parked and destroyed by a later sweep once the last holder is
//! gone.

use std::sync::{Arc, Mutex};

use cudarc::driver::{result, CudaContext, CudaStream};

use crate::error::{Error, Result};

/// Streams whose engine is gone but which something still holds.
static PARKED: Mutex<Vec<Arc<CudaStream>>> = Mutex::new(Vec::new());

/// A stream of the engine: created by it (destroyed when unused), or the caller's.
pub(crate) enum EngineStream {
    /// Created by the engine.
    Owned(Arc<CudaStream>),
    /// Handed in by the caller (`CliqueBuilder::streams`); never destroyed here.
    Callers(Arc<CudaStream>),
}

impl EngineStream {
    /// A new non-blocking stream of `ctx`, not counted as a cudarc stream of it.
    pub(crate) fn create(ctx: &Arc<CudaContext>) -> Result<EngineStream> {
        ctx.bind_to_thread()
            .map_err(Error::cuda("binding a context"))?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(
            Error::cuda(format!("creating a stream on device {}", ctx.ordinal())),
        )?;
        // SAFETY: `raw` is a live stream of `ctx`; it is destroyed only when no other holder of
        // the wrapper remains (`Drop`, `sweep`), so it outlives every use. Ordering with other
        // streams is the engine's job (module docs).
        Ok(EngineStream::Owned(unsafe {
            ctx.wrap_borrowed_stream(raw)
        }))
    }

    /// The stream.
    pub(crate) fn get(&self) -> &Arc<CudaStream> {
        match self {
            EngineStream::Owned(s) | EngineStream::Callers(s) => s,
        }
    }
}

/// Destroys parked streams that nothing holds any more.
pub(crate) fn sweep() {
    let mut parked = PARKED.lock().unwrap_or_else(|e| e.into_inner());
    parked.retain(|s| {
        let held = Arc::strong_count(s) > 1;
        if !held {
            destroy(s);
        }
        held
    });
}

fn destroy(s: &Arc<CudaStream>) {
    if s.context().bind_to_thread().is_ok() {
        // SAFETY: the engine created this stream and no other holder of its wrapper remains.
        if let Err(e) = unsafe { result::stream::destroy(s.cu_stream()) } {
            tracing::warn!(error = %e, "could not destroy a stream");
        }
    }
}

impl Drop for EngineStream {
    fn drop(&mut self) {
        if let EngineStream::Owned(s) = self {
            let s = s.clone();
            // `s` and the enum's own Arc: two when nobody else holds the stream.
            if Arc::strong_count(&s) > 2 {
                PARKED.lock().unwrap_or_else(|e| e.into_inner()).push(s);
            } else {
                destroy(&s);
            }
        }
    }
}
