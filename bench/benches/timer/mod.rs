//! The bench's one timer: a CUDA event on every rank's stream before the timed work and one
//! after it; a repeat lasts as long as its slowest rank's span. The GPU stamps both events, so
//! waiting for the end (however the host waits) adds nothing to the figure, and the figure's
//! resolution is the events' (about half a microsecond per repeat, divided by the operations
//! in the repeat). `tests/timer.rs` checks that it resolves 10 us on operations as long as a
//! 1 GiB broadcast.

use std::sync::Arc;

use anyhow::Result;
use gpucast::cudarc::driver::{sys, CudaEvent, CudaStream};

/// A timing event on each of `streams`, after the work queued there so far.
pub fn marks(streams: &[&Arc<CudaStream>]) -> Result<Vec<CudaEvent>> {
    streams
        .iter()
        .enumerate()
        .map(|(r, s)| {
            s.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| anyhow::anyhow!("recording a timing event on rank {r}: {e}"))
        })
        .collect()
}

/// The longest span over the ranks from `starts[r]` to `ends[r]`, in milliseconds (the ends
/// must have been reached: synchronize first).
pub fn slowest_ms(starts: &[CudaEvent], ends: &[CudaEvent]) -> Result<f32> {
    let mut ms = 0f32;
    for (start, end) in starts.iter().zip(ends) {
        ms = ms.max(start.elapsed_ms(end)?);
    }
    Ok(ms)
}
