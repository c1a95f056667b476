//! Kernel launches on several GPUs at once: one worker thread per GPU after the first.
//!
//! A kernel launch costs 3.5-4 us of host time in the VMs we measured on, so launching the P2P
//! kernel on N GPUs from one thread costs N launches back to back, which is most of an eager
//! broadcast of a small tensor. Each worker keeps its GPU's context current and launches the
//! jobs the calling thread hands it, while the calling thread launches on the first GPU, so the
//! launches overlap. A call returns only when every launch has been enqueued, so the stream
//! order callers see is the same as with sequential launches.
//!
//! Workers spin for a short while after each job (back-to-back broadcasts find them awake),
//! then park until the next job.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUcontext, CUfunction, CUstream};

use super::Params;

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(200);
/// How long the caller waits for a worker to take and launch a job before reporting an error.
const HANDOFF_LIMIT: Duration = Duration::from_secs(10);

/// One launch of a `Params` kernel.
#[derive(Clone, Copy)]
pub(crate) struct Job {
    pub func: CUfunction,
    pub blocks: u32,
    pub threads: u32,
    pub stream: CUstream,
    pub params: Params,
}

struct Slot {
    /// Written by the caller while the worker is idle (`done == posted`), read by the worker
    /// after it sees `posted` advance.
    job: UnsafeCell<Option<Job>>,
    posted: AtomicU64,
    done: AtomicU64,
    /// CUresult of the last job (0 = success).
    result: AtomicU32,
    stop: AtomicBool,
}

// SAFETY: `job` is handed over through `posted` (Release by the caller, Acquire by the worker)
// and back through `done`; the caller writes it only when the worker has finished the previous
// job, so the two never access it at the same time. The raw CUDA handles in a `Job` are
// thread-safe driver objects.
unsafe impl Sync for Slot {}
// SAFETY: as above.
unsafe impl Send for Slot {}

struct Worker {
    slot: Arc<Slot>,
    thread: Thread,
    handle: Option<JoinHandle<()>>,
}

/// Launch workers for ranks 1..n.
pub(crate) struct Launcher {
    workers: Vec<Worker>,
}

impl Launcher {
    /// Starts one worker per context after the first.
    pub(crate) fn new(ctxs: &[CUcontext]) -> std::io::Result<Launcher> {
        let mut workers = Vec::new();
        for (rank, &ctx) in ctxs.iter().enumerate().skip(1) {
            let slot = Arc::new(Slot {
                job: UnsafeCell::new(None),
                posted: AtomicU64::new(0),
                done: AtomicU64::new(0),
                result: AtomicU32::new(0),
                stop: AtomicBool::new(false),
            });
            let s = slot.clone();
            let ctx_addr = ctx as usize;
            let handle = std::thread::Builder::new()
                .name(format!("gpucast-launch-{rank}"))
                .spawn(move || worker(s, ctx_addr as CUcontext))?;
            workers.push(Worker {
                slot,
                thread: handle.thread().clone(),
                handle: Some(handle),
            });
        }
        Ok(Launcher { workers })
    }

    /// Launches `jobs[0]` on this thread and `jobs[r]` on worker r, and returns once all are
    /// enqueued: the first failure as (rank, CUresult), if any.
    ///
    /// # Safety
    /// Each job must be a valid launch (live function of its rank's context, live stream of the
    /// same context, parameters the kernel accepts). `jobs.len()` is the number of workers + 1.
    pub(crate) unsafe fn launch_all(
        &self,
        jobs: &[Job],
        ctx0: CUcontext,
    ) -> Result<(), (usize, sys::CUresult)> {
        debug_assert_eq!(jobs.len(), self.workers.len() + 1);
        let mut tickets = [0u64; crate::plan::MAX_GPUS];
        for (i, (w, job)) in self.workers.iter().zip(&jobs[1..]).enumerate() {
            let t = w.slot.posted.load(Ordering::Relaxed) + 1;
            // SAFETY: the worker is idle: every earlier ticket was waited for below before the
            // previous call returned, so nothing else touches `job` now.
            unsafe { *w.slot.job.get() = Some(*job) };
            w.slot.posted.store(t, Ordering::Release);
            w.thread.unpark();
            tickets[i] = t;
        }
        // SAFETY: per this function's contract.
        let first = unsafe {
            sys::cuCtxSetCurrent(ctx0)
                .result()
                .and_then(|()| launch(&jobs[0]))
        };
        let mut failure = first.err().map(|e| (0, e.0));
        let started = Instant::now();
        for (i, w) in self.workers.iter().enumerate() {
            while w.slot.done.load(Ordering::Acquire) != tickets[i] {
                if started.elapsed() > HANDOFF_LIMIT {
                    return Err((i + 1, sys::CUresult::CUDA_ERROR_LAUNCH_TIMEOUT));
                }
                std::hint::spin_loop();
            }
            let code = w.slot.result.load(Ordering::Relaxed);
            if code != 0 && failure.is_none() {
                // SAFETY: `code` was stored from a `CUresult` by the worker.
                failure = Some((i + 1, unsafe {
                    std::mem::transmute::<u32, sys::CUresult>(code)
                }));
            }
        }
        failure.map_or(Ok(()), Err)
    }
}

/// Launches `job` in the current context.
///
/// # Safety
/// `job` is a valid launch in the current context.
pub(super) unsafe fn launch(job: &Job) -> Result<(), cudarc::driver::DriverError> {
    // SAFETY: guaranteed by the caller.
    unsafe { super::launch_one(job.func, job.blocks, job.threads, job.stream, job.params) }
}

fn worker(slot: Arc<Slot>, ctx: CUcontext) {
    // SAFETY: the context outlives the launcher (the clique drops the launcher first).
    let bound = unsafe { sys::cuCtxSetCurrent(ctx) }.result();
    let mut seen = 0u64;
    let mut idle_since = Instant::now();
    loop {
        let posted = slot.posted.load(Ordering::Acquire);
        if posted != seen {
            seen = posted;
            // SAFETY: the caller published the job before `posted` (Release/Acquire) and does
            // not touch it again until `done` reaches `posted`.
            let job = unsafe { (*slot.job.get()).take() };
            let code = match (&bound, job) {
                (Err(e), _) => e.0 as u32,
                // SAFETY: the caller of `launch_all` guarantees a valid launch.
                (Ok(()), Some(job)) => unsafe { launch(&job) }.map_or_else(|e| e.0 as u32, |()| 0),
                (Ok(()), None) => 0,
            };
            slot.result.store(code, Ordering::Relaxed);
            slot.done.store(seen, Ordering::Release);
            idle_since = Instant::now();
            continue;
        }
        if slot.stop.load(Ordering::Acquire) {
            return;
        }
        if idle_since.elapsed() < SPIN {
            std::hint::spin_loop();
        } else {
            std::thread::park_timeout(Duration::from_millis(50));
        }
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        for w in &self.workers {
            w.slot.stop.store(true, Ordering::Release);
            w.thread.unpark();
        }
        for w in &mut self.workers {
            if let Some(h) = w.handle.take() {
                if h.join().is_err() {
                    tracing::warn!("a launch worker panicked");
                }
            }
        }
    }
}
