//! Tensors kept alive until the GPU work of the calls they were given to has run.
//!
//! A call returns while its work is still queued. Its tensors' memory must outlive that work
//! whatever the caller does (drop the tensor at once, so that its allocator hands the memory
//! to a tensor on another stream): each call keeps its tensors' owners here with an event on
//! every stream the call queued work on, and each later call (and `synchronize`) drops the
//! owners of calls whose events have completed. Completion is polled (`cuEventQuery`), never
//! waited for here, so keeping costs no wait; the list holds only calls still in flight.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use gpucast::cudarc::driver::sys::CUevent_flags;
use gpucast::cudarc::driver::{CudaEvent, CudaStream};
use pyo3::prelude::*;

/// One call's owners and the events after its work, one per stream.
struct Kept {
    events: Vec<CudaEvent>,
    owners: Vec<Py<PyAny>>,
}

/// The owners of calls in flight on a clique's or a communicator's streams.
pub(crate) struct Pending {
    streams: Vec<Arc<CudaStream>>,
    calls: Mutex<VecDeque<Kept>>,
    /// Completed events, for reuse.
    free: Mutex<Vec<CudaEvent>>,
}

impl Pending {
    /// Calls on `streams` (every stream a call may queue work on).
    pub(crate) fn new(streams: Vec<Arc<CudaStream>>) -> Pending {
        Pending {
            streams,
            calls: Mutex::new(VecDeque::new()),
            free: Mutex::new(Vec::new()),
        }
    }

    /// Keeps `owners` until the work queued so far on every stream has run. If an event cannot
    /// be recorded (the context is broken), the owners are kept until the `Pending` is dropped
    /// instead: never released early.
    pub(crate) fn keep(&self, owners: Vec<Py<PyAny>>) {
        if owners.is_empty() {
            return;
        }
        let mut events = Vec::with_capacity(self.streams.len());
        let mut recorded = true;
        for stream in &self.streams {
            let event = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
            let event = match event {
                Some(e) => Ok(e),
                None => stream
                    .context()
                    .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)),
            };
            match event.and_then(|e| e.record(stream).map(|()| e)) {
                Ok(e) => events.push(e),
                Err(_) => recorded = false,
            }
        }
        if !recorded {
            // No event marks the end of this call's work: keep the owners for good.
            std::mem::forget(owners);
            return;
        }
        self.calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(Kept { events, owners });
    }

    /// Drops the owners of every call whose work has run (calls complete in order).
    ///
    /// The owners are dropped after every lock here is released: dropping a tensor can run
    /// Python code, which lets another thread take the GIL and then wait for these locks.
    pub(crate) fn prune(&self) {
        let mut done = Vec::new();
        {
            let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
            while let Some(front) = calls.front() {
                // An event whose query fails stays: its owners are kept.
                if !front
                    .events
                    .iter()
                    .all(|e| e.try_is_complete().unwrap_or(false))
                {
                    break;
                }
                done.extend(calls.pop_front());
            }
        }
        let mut owners = Vec::with_capacity(done.len());
        {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            for kept in done {
                free.extend(kept.events);
                owners.push(kept.owners);
            }
        }
        drop(owners);
    }
}
