//! The watchdog: one thread per engine with live NCCL communicators. NCCL kernels wait for
//! their peers without a bound, so a stalled or dead rank would leave every stream behind a
//! broadcast blocked forever, and with it any thread synchronising with those streams.
//!
//! Each NCCL broadcast (and each graph launch that holds one) is queued here with an event
//! before and after it on every local rank's stream. The thread sleeps while nothing is
//! queued; otherwise it looks every [`POLL`]: when a broadcast has started on some local rank
//! (a start event passed: that rank's NCCL kernel waits for its peers) and has not finished
//! `timeout` later, or NCCL reports an asynchronous error, it keeps the error for the next
//! call, naming the calls whose outputs are undefined, then aborts the communicators
//! (`ncclCommAbort`: their kernels return, the streams move on). This is the P2P kernel's rule
//! too: a rank that waits longer than the timeout for a peer is a fault.
//!
//! NCCL's abort waits for the kernels already queued on the communicators (they see the abort
//! flag and return at once), so a local rank held back by work queued before the broadcast
//! delays the abort's end, never frees what a queued kernel still uses. The thread does the
//! abort; callers see the error at once and wait for the abort only if they need NCCL again
//! (bounded, see `Engine::nccl`).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream};

use crate::error::{Error, Result};
use crate::nccl::{millis, Nccl};

/// How often the thread looks at queued work: the detection delay beyond the timeout.
pub(crate) const POLL: Duration = Duration::from_millis(5);

/// One watched call.
struct Pending {
    call: u64,
    what: String,
    start: Vec<CudaEvent>,
    end: Vec<CudaEvent>,
    /// When the thread first saw every start event passed.
    started: Option<Instant>,
}

#[derive(Default)]
struct Queue {
    pending: VecDeque<Pending>,
    /// Event pairs of finished calls, for reuse.
    spare: Vec<(Vec<CudaEvent>, Vec<CudaEvent>)>,
    /// The abort not yet reported to a caller.
    fault: Option<Error>,
    stop: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    nccl: Arc<Mutex<Nccl>>,
    timeout: Duration,
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The handle an engine holds; dropping it stops the thread (without waiting for it).
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts watching calls on `nccl` with `timeout`.
    pub(crate) fn start(nccl: Arc<Mutex<Nccl>>, timeout: Duration) -> Result<Watchdog> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            nccl,
            timeout,
        });
        let inner = shared.clone();
        let thread = std::thread::Builder::new()
            .name("gpucast-watchdog".into())
            .spawn(move || watch(&inner))
            .map_err(|e| Error::InvalidArgument(format!("starting the watchdog thread: {e}")))?;
        Ok(Watchdog {
            shared,
            thread: Some(thread),
        })
    }

    /// Records the start events of a call on `streams` (one per local rank). The caller queues
    /// the call, then hands the result to [`Watchdog::watch`].
    pub(crate) fn begin(&self, streams: &[&Arc<CudaStream>]) -> Result<Begun> {
        let spare = self.shared.queue().spare.pop();
        let (start, end) = match spare {
            Some(pair) => pair,
            None => {
                let make = || {
                    streams
                        .iter()
                        .map(|s| s.context().new_event(None))
                        .collect::<std::result::Result<Vec<_>, _>>()
                        .map_err(Error::cuda("creating watchdog events"))
                };
                (make()?, make()?)
            }
        };
        for (e, s) in start.iter().zip(streams) {
            e.record(s)
                .map_err(Error::cuda("recording a watchdog event"))?;
        }
        Ok(Begun { start, end })
    }

    /// Records the end events of call number `call` (described by `what`) and queues it.
    pub(crate) fn watch(
        &self,
        begun: Begun,
        streams: &[&Arc<CudaStream>],
        call: u64,
        what: String,
    ) -> Result<()> {
        for (e, s) in begun.end.iter().zip(streams) {
            e.record(s)
                .map_err(Error::cuda("recording a watchdog event"))?;
        }
        let mut q = self.shared.queue();
        // The thread sleeps without a deadline only while nothing is queued; otherwise it looks
        // again within POLL by itself, and a wake-up (a system call) would be wasted.
        let asleep = q.pending.is_empty();
        q.pending.push_back(Pending {
            call,
            what,
            start: begun.start,
            end: begun.end,
            started: None,
        });
        drop(q);
        if asleep {
            self.shared.wake.notify_one();
        }
        Ok(())
    }

    /// The abort not reported yet, if any (reported once).
    pub(crate) fn take_fault(&self) -> Option<Error> {
        self.shared.queue().fault.take()
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.queue().stop = true;
        self.shared.wake.notify_one();
        // Not joined: an abort in progress may take a while, and the thread owns what it uses.
        drop(self.thread.take());
    }
}

/// Start events of a call being queued.
pub(crate) struct Begun {
    start: Vec<CudaEvent>,
    end: Vec<CudaEvent>,
}

/// Whether an event has passed. An error other than "not ready" (a context gone bad) counts
/// as passed: the work will not finish, and the next call reports the error itself.
fn passed(e: &CudaEvent) -> bool {
    e.try_is_complete().unwrap_or(true)
}

fn all_passed(events: &[CudaEvent]) -> bool {
    events.iter().all(passed)
}

fn any_passed(events: &[CudaEvent]) -> bool {
    events.iter().any(passed)
}

/// The thread's loop.
fn watch(shared: &Shared) {
    let mut q = shared.queue();
    loop {
        while q.pending.is_empty() && !q.stop {
            q = shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        if q.stop {
            return;
        }
        let now = Instant::now();
        while q.pending.front().is_some_and(|p| all_passed(&p.end)) {
            let done = q.pending.pop_front().expect("checked");
            q.spare.push((done.start, done.end));
        }
        let mut late = None;
        for p in q.pending.iter_mut() {
            if p.started.is_none() && any_passed(&p.start) {
                p.started = Some(now);
            }
            if let Some(t) = p.started {
                if now.duration_since(t) > shared.timeout && late.is_none() {
                    late = Some(format!(
                        "call {} ({}) did not finish within {} ms of starting: a peer did not \
                         arrive",
                        p.call,
                        p.what,
                        millis(shared.timeout)
                    ));
                }
            }
        }
        let reason = match late {
            Some(r) => Some(r),
            None if !q.pending.is_empty() => {
                // Ask NCCL without holding the queue: a caller may be queueing meanwhile.
                drop(q);
                let error = match shared.nccl.try_lock() {
                    Ok(nccl) => match &*nccl {
                        Nccl::Live(comms) => comms.async_error().err(),
                        _ => None,
                    },
                    Err(_) => None,
                };
                q = shared.queue();
                error.map(|e| format!("NCCL reported an error while a broadcast ran: {e}"))
            }
            None => None,
        };
        if let Some(reason) = reason {
            let undefined: Vec<u64> = q.pending.iter().map(|p| p.call).collect();
            let spare: Vec<_> = q.pending.drain(..).map(|p| (p.start, p.end)).collect();
            q.spare.extend(spare);
            // The error first: callers learn of the fault while the abort waits for queued
            // kernels.
            q.fault = Some(Error::CommunicatorsAborted {
                reason: reason.clone(),
                undefined_calls: undefined.clone(),
            });
            drop(q);
            tracing::error!(%reason, ?undefined, "aborting NCCL");
            shared
                .nccl
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .abort(reason);
            q = shared.queue();
            continue;
        }
        let (guard, _) = shared
            .wake
            .wait_timeout(q, POLL)
            .unwrap_or_else(|e| e.into_inner());
        q = guard;
    }
}
