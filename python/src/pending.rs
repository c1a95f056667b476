//! Tensors kept alive until the GPU work of the calls they were given to has run.
//!
//! A call returns while its work is still queued. Its tensors' memory must outlive that work
//! whatever the caller does (drop the tensor at once, so that its allocator hands the memory
//! to a tensor on another stream): each call keeps its tensors' owners here with an event on
//! every stream the call queued work on, and each later call (and `synchronize`) drops the
//! owners of calls whose events have completed. Completion is polled (`cuEventQuery`), never
//! waited for here, so keeping costs no wait; the list holds only calls still in flight.
//! Owners whose call's end cannot be known (an event that could not be recorded) and owners of
//! calls still running when the `Pending` goes are never released: leaked, not freed early.

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

impl Kept {
    fn done(&self) -> bool {
        self.events
            .iter()
            .all(|e| e.try_is_complete().unwrap_or(false))
    }
}

/// The owners of calls in flight on a clique's or a communicator's streams.
pub(crate) struct Pending {
    streams: Vec<Arc<CudaStream>>,
    calls: Mutex<VecDeque<Kept>>,
    /// Completed events for reuse, one list per stream (an event records only on a stream of
    /// its own context).
    free: Mutex<Vec<Vec<CudaEvent>>>,
}

impl Pending {
    /// Calls on `streams` (every stream a call may queue work on).
    pub(crate) fn new(streams: Vec<Arc<CudaStream>>) -> Pending {
        let free = Mutex::new(streams.iter().map(|_| Vec::new()).collect());
        Pending {
            streams,
            calls: Mutex::new(VecDeque::new()),
            free,
        }
    }

    /// Keeps `owners` until the work queued so far on every stream has run.
    pub(crate) fn keep(&self, owners: Vec<Py<PyAny>>) {
        if owners.is_empty() {
            return;
        }
        let mut events = Vec::with_capacity(self.streams.len());
        let mut recorded = true;
        for (i, stream) in self.streams.iter().enumerate() {
            let spare = self.free.lock().unwrap_or_else(|p| p.into_inner())[i].pop();
            let event = match spare {
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
            // Nothing marks the end of this call's work: its tensors are leaked, never freed
            // early (and the calls after it are not held up).
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
            while calls.front().is_some_and(Kept::done) {
                done.extend(calls.pop_front());
            }
        }
        let mut owners = Vec::with_capacity(done.len());
        {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            for kept in done {
                for (i, e) in kept.events.into_iter().enumerate() {
                    free[i].push(e);
                }
                owners.push(kept.owners);
            }
        }
        drop(owners);
    }
}

impl Drop for Pending {
    /// Owners of calls whose work may still run (the clique or communicator could not wait
    /// for it, or never knew its end) are leaked rather than released.
    fn drop(&mut self) {
        let calls = std::mem::take(self.calls.get_mut().unwrap_or_else(|p| p.into_inner()));
        for kept in calls {
            if !kept.done() {
                std::mem::forget(kept.owners);
            }
        }
    }
}
