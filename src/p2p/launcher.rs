//! Kernel launches on several GPUs at once: one worker thread per GPU after the first.
//!
//! A kernel launch costs microseconds of host time (the launch floor of the benchmark's
//! `launch-floor` column), so launching the P2P kernel on N GPUs from one thread costs N
//! launches back to back, which is most of an eager
//! broadcast of a small tensor. Each worker keeps its GPU's context current and launches the
//! job the calling thread hands it, while the calling thread launches on the first GPU, so the
//! launches overlap. A call returns only when every launch has been enqueued (or cancelled), so
//! the stream order callers see is the same as with sequential launches.
//!
//! Hand-off protocol, per worker slot: the caller writes the job while the slot is `EMPTY`,
//! then publishes `POSTED`; the worker claims it with a `POSTED -> TAKEN` compare-exchange,
//! launches, and publishes `DONE`; the caller reads the result and sets `EMPTY` again. A caller
//! that waits too long cancels with a `POSTED -> EMPTY` compare-exchange: if that wins, the
//! worker never sees the job, so nothing is launched after the call returns; if it loses, the
//! worker is inside its launch call and the caller waits for it to return.
//!
//! Workers spin for a short while after each job (back-to-back broadcasts find them awake),
//! then park until the next job.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUcontext, CUfunction, CUstream};

use super::abi::Params;

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(200);
/// Longest a parked worker sleeps before it looks at its slot again (an unpark wakes it
/// sooner): a stop takes effect within this.
const PARK: Duration = Duration::from_millis(50);

const EMPTY: u32 = 0;
const POSTED: u32 = 1;
const TAKEN: u32 = 2;
const DONE: u32 = 3;

/// One launch of a `Params` kernel.
#[derive(Clone, Copy)]
pub(crate) struct Job {
    pub func: CUfunction,
    pub blocks: u32,
    pub threads: u32,
    pub stream: CUstream,
    pub params: Params,
}

// SAFETY: a `Job` holds driver handles (a function and a stream) and plain parameters; driver
// handles may be used from any thread.
unsafe impl Send for Job {}

struct Slot {
    /// Written by the caller only while `state` is EMPTY; read by the worker only after it won
    /// the POSTED -> TAKEN exchange.
    job: UnsafeCell<Option<Job>>,
    state: AtomicU32,
    /// CUresult of the last job (0 = success), published by the DONE store.
    result: AtomicU32,
    stop: AtomicBool,
}

// SAFETY: `job` is only touched by the side that owns the slot per `state` (caller: EMPTY;
// worker: TAKEN), and ownership moves through Release/Acquire operations on `state`, so the two
// threads never access it at the same time. `Job` itself is `Send`.
unsafe impl Sync for Slot {}

impl Slot {
    fn new() -> Slot {
        Slot {
            job: UnsafeCell::new(None),
            state: AtomicU32::new(EMPTY),
            result: AtomicU32::new(0),
            stop: AtomicBool::new(false),
        }
    }

    /// Caller: hands `job` to the worker. The slot must be EMPTY.
    fn post(&self, job: Job) {
        assert_eq!(self.state.load(Ordering::Acquire), EMPTY, "slot busy");
        // SAFETY: the slot is EMPTY, so the worker does not touch `job`.
        unsafe { *self.job.get() = Some(job) };
        self.state.store(POSTED, Ordering::Release);
    }

    /// Worker: takes the posted job, if any (the slot is then the worker's until `finish`).
    fn claim(&self) -> Option<Job> {
        if self.state.load(Ordering::Acquire) == POSTED
            && self
                .state
                .compare_exchange(POSTED, TAKEN, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            // SAFETY: winning the exchange hands the slot to this thread until DONE.
            unsafe { (*self.job.get()).take() }
        } else {
            None
        }
    }

    /// Worker: publishes the result of the claimed job.
    fn finish(&self, code: u32) {
        self.result.store(code, Ordering::Relaxed);
        self.state.store(DONE, Ordering::Release);
    }

    /// Caller: waits for the worker's result, or cancels the job if the worker has not taken it
    /// `limit` after `since`. `Some(code)` when it ran, `None` when cancelled. Leaves the slot
    /// EMPTY either way.
    fn collect(&self, since: Instant, limit: Duration) -> Option<u32> {
        loop {
            if self.state.load(Ordering::Acquire) == DONE {
                let code = self.result.load(Ordering::Relaxed);
                self.state.store(EMPTY, Ordering::Relaxed);
                return Some(code);
            }
            if since.elapsed() > limit
                && self
                    .state
                    .compare_exchange(POSTED, EMPTY, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                // SAFETY: the exchange made the slot EMPTY before the worker claimed it, so the
                // worker will never read `job`.
                unsafe { *self.job.get() = None };
                return None;
            }
            std::hint::spin_loop();
        }
    }
}

struct Worker {
    slot: Arc<Slot>,
    thread: Thread,
    handle: Option<JoinHandle<()>>,
}

/// Why `launch_all` failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LaunchFailure {
    /// A launch returned this error on this rank.
    Driver { rank: usize, code: sys::CUresult },
    /// A worker did not take its job in time; the job was cancelled (never launched). Other
    /// ranks may have launched.
    Stalled { rank: usize },
}

/// Launch workers for ranks 1..n.
pub(crate) struct Launcher {
    workers: Vec<Worker>,
}

/// A context handle that may move to a worker thread.
struct SendCtx(CUcontext);
// SAFETY: a CUcontext is a driver handle that any thread may make current.
unsafe impl Send for SendCtx {}

impl Launcher {
    /// Starts one worker per context after the first.
    ///
    /// # Safety
    /// Every context is live and stays live until the launcher is dropped (its workers make
    /// them current).
    pub(crate) unsafe fn new(ctxs: &[CUcontext]) -> std::io::Result<Launcher> {
        let binds = ctxs.iter().skip(1).map(|&ctx| {
            let ctx = SendCtx(ctx);
            move || {
                let ctx = ctx;
                // SAFETY: the context stays live while the launcher lives (this function's
                // contract), and the launcher's drop ends this worker.
                unsafe { crate::driver::context::set_current(ctx.0) }
            }
        });
        Launcher::start("gpucast-launch", binds)
    }

    /// Starts one worker per item of `binds`, named `{name}-{rank}` (ranks from 1); each first
    /// calls its `bind` (making its context current) and launches only if that succeeded.
    fn start<B>(name: &str, binds: impl Iterator<Item = B>) -> std::io::Result<Launcher>
    where
        B: FnOnce() -> Result<(), cudarc::driver::DriverError> + Send + 'static,
    {
        let mut workers = Vec::new();
        for (i, bind) in binds.enumerate() {
            let slot = Arc::new(Slot::new());
            let s = slot.clone();
            let handle = std::thread::Builder::new()
                .name(format!("{name}-{}", i + 1))
                .spawn(move || worker(&s, bind))?;
            workers.push(Worker {
                slot,
                thread: handle.thread().clone(),
                handle: Some(handle),
            });
        }
        Ok(Launcher { workers })
    }

    /// Launches `jobs[0]` on this thread (in context `ctx0`) and `jobs[r]` on worker r, and
    /// returns once every job is launched or cancelled. A worker that has not taken its job
    /// within `limit` has it cancelled.
    ///
    /// # Safety
    /// Each job must be a valid launch (live function of its rank's context, live stream of the
    /// same context, parameters the kernel accepts). `jobs.len()` is the number of workers + 1.
    /// Calls must not overlap (the engine's lock serialises them).
    pub(crate) unsafe fn launch_all(
        &self,
        jobs: &[Job],
        ctx0: CUcontext,
        limit: Duration,
    ) -> Result<(), LaunchFailure> {
        assert_eq!(jobs.len(), self.workers.len() + 1, "one job per rank");
        for (w, job) in self.workers.iter().zip(&jobs[1..]) {
            w.slot.post(*job);
            w.thread.unpark();
        }
        // SAFETY: per this function's contract.
        let first =
            unsafe { crate::driver::context::set_current(ctx0).and_then(|()| launch(&jobs[0])) };
        let mut failure = first
            .err()
            .map(|e| LaunchFailure::Driver { rank: 0, code: e.0 });
        let started = Instant::now();
        for (i, w) in self.workers.iter().enumerate() {
            let rank = i + 1;
            match w.slot.collect(started, limit) {
                None => failure = failure.or(Some(LaunchFailure::Stalled { rank })),
                Some(0) => {}
                Some(code) => {
                    // SAFETY: `code` was stored from a `CUresult` by the worker.
                    let code = unsafe { std::mem::transmute::<u32, sys::CUresult>(code) };
                    failure = failure.or(Some(LaunchFailure::Driver { rank, code }));
                }
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

fn worker(slot: &Slot, bind: impl FnOnce() -> Result<(), cudarc::driver::DriverError>) {
    let bound = bind();
    let mut idle_since = Instant::now();
    loop {
        if let Some(job) = slot.claim() {
            let code = match &bound {
                Err(e) => e.0 as u32,
                // SAFETY: the caller of `launch_all` guarantees a valid launch.
                Ok(()) => unsafe { launch(&job) }.map_or_else(|e| e.0 as u32, |()| 0),
            };
            slot.finish(code);
            idle_since = Instant::now();
            continue;
        }
        if slot.stop.load(Ordering::Acquire) {
            return;
        }
        if idle_since.elapsed() < SPIN {
            std::hint::spin_loop();
        } else {
            std::thread::park_timeout(PARK);
        }
    }
}

impl Drop for Launcher {
    /// Stops the workers and joins them. A worker between jobs (every worker, once
    /// `launch_all` has returned: it waits for each job it posted, or cancels it before it is
    /// taken) sees the stop at its next look at its slot, at once when spinning or unparked,
    /// within [`PARK`] otherwise: the drop ends within that.
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn job() -> Job {
        Job {
            func: std::ptr::null_mut(),
            blocks: 1,
            threads: 1,
            stream: std::ptr::null_mut(),
            params: Params {
                src: 0,
                dst: 0,
                bytes: 0,
                signal: [0; crate::config::MAX_GPUS],
                error_slot: 0,
                timeout_ns: 0,
                lease_ns: 0,
                rank: 0,
                nranks: 0,
                root: 0,
                unit: 0,
                head: 0,
                chunk: 0,
                from: 0,
            },
        }
    }

    /// How many of this process's threads have a name that starts with `prefix`, once that
    /// is `want` or a second has passed (a thread names itself once it runs).
    pub(crate) fn threads_named(prefix: &str, want: usize) -> usize {
        let count = || {
            std::fs::read_dir("/proc/self/task")
                .map(|tasks| {
                    tasks
                        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                        .filter(|name| name.starts_with(prefix))
                        .count()
                })
                .unwrap_or(0)
        };
        let t0 = Instant::now();
        loop {
            let n = count();
            if n == want || t0.elapsed() > Duration::from_secs(1) {
                return n;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Workers with no context (nothing is launched): what a test needs of a launcher.
    pub(crate) fn idle_launcher(name: &str, workers: usize) -> Launcher {
        Launcher::start(name, (0..workers).map(|_| || Ok(()))).unwrap()
    }

    /// Dropping a launcher ends its workers, parked or not, within the park interval.
    #[test]
    fn dropping_the_launcher_ends_its_workers_within_the_park_interval() {
        let name = "gl-drop-test";
        let launcher = idle_launcher(name, 3);
        // Past their spin: the workers are parked.
        assert_eq!(threads_named(name, 3), 3);
        std::thread::sleep(SPIN * 5);
        let t0 = Instant::now();
        drop(launcher);
        assert!(t0.elapsed() < PARK * 4, "{:?}", t0.elapsed());
        assert_eq!(threads_named(name, 0), 0);
    }

    #[test]
    fn a_job_nobody_takes_is_cancelled_and_never_runs() {
        let slot = Slot::new();
        slot.post(job());
        let t0 = Instant::now();
        assert_eq!(slot.collect(t0, Duration::from_millis(20)), None);
        assert!(t0.elapsed() >= Duration::from_millis(20));
        // A worker waking up late finds nothing to launch, and the slot is free again.
        assert!(slot.claim().is_none());
        slot.post(job());
        assert!(slot.claim().is_some());
    }

    #[test]
    fn a_taken_job_is_waited_for_past_the_limit() {
        let slot = Arc::new(Slot::new());
        slot.post(job());
        let worker = {
            let slot = slot.clone();
            std::thread::spawn(move || {
                let j = slot.claim().expect("posted");
                // A launch call that outlasts the caller's limit.
                std::thread::sleep(Duration::from_millis(60));
                slot.finish(j.blocks + 6);
            })
        };
        while slot.state.load(Ordering::Acquire) != TAKEN {
            std::hint::spin_loop();
        }
        assert_eq!(
            slot.collect(Instant::now(), Duration::from_millis(5)),
            Some(7)
        );
        worker.join().unwrap();
        assert_eq!(slot.state.load(Ordering::Acquire), EMPTY);
    }

    #[test]
    fn results_come_back_in_order_over_many_hand_offs() {
        let slot = Arc::new(Slot::new());
        let stop = Arc::new(AtomicBool::new(false));
        let worker = {
            let (slot, stop) = (slot.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    if let Some(j) = slot.claim() {
                        slot.finish(j.blocks);
                    }
                }
            })
        };
        for i in 1..2000u32 {
            let mut j = job();
            j.blocks = i;
            slot.post(j);
            assert_eq!(
                slot.collect(Instant::now(), Duration::from_secs(10)),
                Some(i)
            );
        }
        stop.store(true, Ordering::Release);
        worker.join().unwrap();
    }
}
