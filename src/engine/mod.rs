//! The engine: the streams, NCCL communicators and P2P state of the ranks this process drives,
//! behind one lock. Every broadcast (single or fused, eager or captured), every graph launch,
//! synchronisation and recovery goes through [`Engine::lock`], so all ranks see P2P operations
//! in one order and no call interleaves with another.
//!
//! The engine works on raw device addresses ([`Item`]); turning typed buffers into addresses
//! and ordering them with the streams they live on is `clique::access`'s job.
//!
//! # The sequence of a call
//!
//! Every broadcast, eager or captured, single or fused, takes the same steps, the first four
//! before anything is queued (so a refused call changes nothing):
//!
//! 1. **check**: the buffers against the ranks (`clique::args`: count, device, context, type,
//!    length, root); across processes, the call's card is posted to the call log
//!    (`clique::calls`) and compared with the peers';
//! 2. **route**: each tensor's path from the call's options over the settings
//!    (`config::choose`: `Auto`'s thresholds, what can run here);
//! 3. **plan**: the tensors grouped into launch steps ([`crate::plan`]: one P2P launch per
//!    list, one NCCL group, the copy-engine chain);
//! 4. **lock**: [`Engine::lock`] (bounded: `Error::Busy`), then the plan made again if the P2P
//!    path closed meanwhile;
//! 5. **order**: the buffers' pending work before the call (`clique::access::ordered`: cudarc's
//!    read and write guards, and the foreign streams' events);
//! 6. **run**: [`EngineGuard::run`] queues each step on the ranks' streams, or the capture
//!    streams: the P2P kernel (`p2p`), an NCCL group handed to its watchdog (`nccl`,
//!    `nccl::watchdog`), the copy-engine chain with the root's own copy forked and joined
//!    (`copy::State::broadcast`);
//!    a failed step inside a capture fails the whole capture;
//! 7. **record**: the guards dropped after the work is queued, so that the buffers' later work
//!    and frees, on any stream, come after the call, when it fails or panics halfway too.

mod graphs;
pub(crate) mod streams;

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUstream};
use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream};

use crate::config::{Settings, MAX_GPUS};
use crate::copy;
use crate::error::{Error, Result};
pub(crate) use crate::item::Item;
use crate::nccl::{self, watchdog, Comms, Nccl};
use crate::p2p::{self, P2p};
use crate::plan::Step;
use crate::ranks::{JobRank, Local, Root};
use graphs::Ended;
pub(crate) use graphs::GraphExec;
use streams::EngineStream;

/// One rank this process drives.
pub(crate) struct Rank {
    /// Its rank in the job (its index in a clique).
    pub global: JobRank,
    /// The device's primary context.
    pub ctx: Arc<CudaContext>,
    /// The stream every broadcast of this rank runs on.
    stream: EngineStream,
    /// A second stream, never used for work: capture reads buffer addresses through it, so
    /// that cudarc's guard waits land outside the capture.
    side: EngineStream,
    /// Work of one call that runs beside `stream`, forked from it and joined back within the
    /// call (see [`EngineGuard::fork_aux`]): the root's own copy of a copy-engine broadcast,
    /// and where ranks share a device, the P2P kernels and graph launches of every rank
    /// ([`EngineGuard::spinning`]). Never handed out: only the engine queues work here, under
    /// its lock.
    aux: EngineStream,
    /// Captures record on this stream, never handed out as the rank's stream: work that the
    /// caller (or another thread) queues on `stream` while a capture runs stays eager instead
    /// of landing in the graph, and allocations on it stay ordinary allocations.
    capture: EngineStream,
}

impl Rank {
    /// Job rank `global` on `ctx` with `stream` (the caller's) or a new stream.
    pub(crate) fn new(
        global: JobRank,
        ctx: Arc<CudaContext>,
        stream: Option<Arc<CudaStream>>,
    ) -> Result<Rank> {
        let stream = match stream {
            Some(s) => EngineStream::Callers(s),
            None => EngineStream::create(&ctx, None)?,
        };
        let fork = || EngineStream::create(&ctx, Some(stream.get()));
        Ok(Rank {
            global,
            side: fork()?,
            aux: fork()?,
            capture: fork()?,
            stream,
            ctx,
        })
    }
}

/// What the lock protects.
struct State {
    /// The NCCL path.
    nccl: nccl::State,
    /// Where ranks share a device: per rank, the graphs of the capture in progress ended so
    /// far, one per P2P step ([`EngineGuard::cut_capture`]).
    segments: Vec<Vec<Ended>>,
    /// A cut of the capture in progress failed: the capture's error, returned by every later
    /// step and by its end (whatever is captured after it is discarded).
    capture_failed: Option<Error>,
    /// The P2P path, its generation and its availability.
    p2p: p2p::State,
    /// One reusable event per rank, for ordering a rank's stream with another stream.
    events: Vec<CudaEvent>,
    /// Per rank: the fork and join events of its `aux` stream.
    aux_events: Vec<(CudaEvent, CudaEvent)>,
    /// The copy-engine path's own state.
    ce: copy::State,
    /// A P2P launch reached some ranks and not others: drain and reset before the next call.
    desynced: bool,
}

/// The engine of one clique.
pub(crate) struct Engine {
    ranks: Vec<Rank>,
    /// Two ranks are on one device (a clique built with `shared_devices`).
    shared_device: bool,
    settings: Settings,
    /// Taken out only by the drop, which hands it to [`release`].
    state: ManuallyDrop<Mutex<State>>,
    /// Whether the P2P path can run, or why not: what the P2P state says, readable without
    /// the lock (routes are chosen before it is taken). Closed for good after a failure across
    /// processes.
    p2p_status: Arc<p2p::Status>,
    /// Calls queued so far (broadcasts and graph launches): errors name calls by number.
    /// Written under the lock, read without it (`Clique::calls` inside a capture closure).
    calls: AtomicU64,
    /// Set while a capture holds the lock, with the capturing thread: a call from that thread
    /// (inside its capture closure) would wait for itself, so it is an error instead.
    capturing: AtomicBool,
    capture_thread: Mutex<Option<ThreadId>>,
    /// Watches NCCL work (absent where NCCL is off).
    watchdog: Option<watchdog::Watchdog>,
    /// Whether NCCL work is handed to the watchdog (on unless turned off for a measurement).
    watching: AtomicBool,
    /// Instantiated graphs holding NCCL broadcasts that are still alive. Destroying an NCCL
    /// communicator waits for every graph that captured it, so where one outlives the engine
    /// (`mem::forget`), the communicators are leaked instead.
    nccl_graphs: Arc<AtomicUsize>,
    /// A graph launch to fail, for tests of a launch that reached some ranks only (see
    /// [`Engine::fail_graph_launch`]): 0 for none, else `(rank << 32 | part) + 1`.
    fail_launch: AtomicU64,
}

/// The engine, locked: every operation on streams, NCCL and P2P state takes one of these.
pub(crate) struct EngineGuard<'e> {
    engine: &'e Engine,
    state: MutexGuard<'e, State>,
}

impl Engine {
    /// An engine over `ranks` with their NCCL communicators and P2P state (or the reason
    /// there is none).
    pub(crate) fn new(
        ranks: Vec<Rank>,
        settings: Settings,
        nccl: Nccl,
        p2p: std::result::Result<P2p, Error>,
    ) -> Result<Engine> {
        if let Err(why) = &p2p {
            tracing::warn!(reason = %why, "P2P path unavailable: Auto will use NCCL");
        }
        let new_events = || {
            ranks
                .iter()
                .map(|r| r.ctx.new_event(None))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(Error::cuda("creating the ordering events"))
        };
        let events = new_events()?;
        let aux_events = new_events()?.into_iter().zip(new_events()?).collect();
        let ce = copy::State::new(new_events()?);
        let shared_device = ranks.iter().enumerate().any(|(i, a)| {
            ranks[..i]
                .iter()
                .any(|b| b.ctx.ordinal() == a.ctx.ordinal())
        });
        let (p2p, p2p_status) = p2p::State::new(p2p);
        let live = matches!(nccl, Nccl::Live(_));
        let nccl = nccl::State::new(nccl);
        let nccl_graphs = Arc::new(AtomicUsize::new(0));
        let watchdog = if live {
            Some(watchdog::Watchdog::start(
                nccl.shared(),
                settings.timeouts.wait,
            )?)
        } else {
            None
        };
        Ok(Engine {
            ranks,
            shared_device,
            settings,
            state: ManuallyDrop::new(Mutex::new(State {
                nccl,
                segments: Vec::new(),
                capture_failed: None,
                p2p,
                events,
                aux_events,
                ce,
                desynced: false,
            })),
            p2p_status,
            calls: AtomicU64::new(0),
            capturing: AtomicBool::new(false),
            capture_thread: Mutex::new(None),
            watchdog,
            watching: AtomicBool::new(true),
            nccl_graphs,
            fail_launch: AtomicU64::new(0),
        })
    }

    #[cfg(feature = "testing")]
    /// Hands NCCL work to the watchdog (`true`, the default) or not: without it an NCCL
    /// broadcast whose peer never comes waits forever. For measuring what the watchdog costs.
    pub(crate) fn set_watchdog(&self, on: bool) {
        self.watching.store(on, Ordering::Relaxed);
    }

    #[cfg(feature = "testing")]
    /// Makes the next graph launch fail (as a driver error) at part `part` of rank `rank`'s
    /// graph, without queueing that part: test support for a graph launch that reached some
    /// ranks and not others. Disarmed after that launch, whether or not it reached the part.
    pub(crate) fn fail_graph_launch(&self, rank: usize, part: usize) {
        self.fail_launch
            .store(launch_code(rank, part), Ordering::Relaxed);
    }

    /// Whether the launch of `part` of `rank`'s graph is the one to fail (then disarmed).
    fn launch_fails(&self, rank: usize, part: usize) -> bool {
        let armed = self.fail_launch.load(Ordering::Relaxed);
        armed != 0
            && armed == launch_code(rank, part)
            && self
                .fail_launch
                .compare_exchange(armed, 0, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// The watchdog, while NCCL work is handed to it.
    fn watcher(&self) -> Option<&watchdog::Watchdog> {
        self.watchdog
            .as_ref()
            .filter(|_| self.watching.load(Ordering::Relaxed))
    }

    /// Why the copy engines cannot run inside a capture here, if they cannot
    /// ([`copy::graph_support`]).
    pub(crate) fn copy_engine_in_graph(&self) -> std::result::Result<(), Error> {
        copy::graph_support(self.shared_device)
    }

    /// Number of ranks.
    pub(crate) fn len(&self) -> usize {
        self.ranks.len()
    }

    pub(crate) fn rank(&self, rank: usize) -> &Rank {
        &self.ranks[rank]
    }

    /// The stream of `rank`.
    pub(crate) fn stream(&self, rank: usize) -> &Arc<CudaStream> {
        self.ranks[rank].stream.get()
    }

    /// The stream captures of `rank` record on (see [`Rank`]).
    pub(crate) fn capture_stream(&self, rank: usize) -> &Arc<CudaStream> {
        self.ranks[rank].capture.get()
    }

    /// The side stream of `rank` (see [`Rank`]).
    pub(crate) fn side_stream(&self, rank: usize) -> &Arc<CudaStream> {
        self.ranks[rank].side.get()
    }

    pub(crate) fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Takes the lock. First, when an earlier call left the P2P protocol broken (a kernel timed
    /// out, or a launch reached only some ranks), drains every stream and resets the signal
    /// areas, so that no new work queues behind a broken state; a timeout is then reported.
    ///
    /// A rank's stream that the caller is capturing into a graph of its own (cudarc's
    /// `begin_capture` on `Clique::stream`) is refused with [`Error::CaptureInProgress`]: the
    /// graph would hold gpucast's work without gpucast counting it (and replay it after the
    /// clique freed what it uses).
    pub(crate) fn lock(&self) -> Result<EngineGuard<'_>> {
        let mut guard = self.guard()?;
        self.refuse_callers_capture()?;
        guard.recover_if_needed()?;
        if let Some(fault) = self.fault() {
            return Err(fault);
        }
        Ok(guard)
    }

    /// [`Error::CaptureInProgress`] if a rank's own stream is being captured (by the caller:
    /// gpucast captures on the ranks' capture streams).
    fn refuse_callers_capture(&self) -> Result<()> {
        for (rank, r) in self.ranks.iter().enumerate() {
            // SAFETY: the stream is live (the engine holds it).
            match unsafe { crate::driver::stream::is_capturing(r.stream.get().cu_stream()) } {
                Ok(false) => {}
                Ok(true) => return Err(Error::CaptureInProgress),
                Err(e) => {
                    return Err(Error::Cuda {
                        during: format!("asking whether rank {rank}'s stream is being captured"),
                        source: e,
                    })
                }
            }
        }
        Ok(())
    }

    /// The watchdog's abort not reported yet, if any (reported once).
    fn fault(&self) -> Option<Error> {
        self.watchdog
            .as_ref()
            .and_then(watchdog::Watchdog::take_fault)
    }

    /// Rebuilds what failures closed, without a new process: waits for the streams (bounded,
    /// see `drain`), resets the P2P signal areas and the copy-engine flags, drops errors not yet
    /// reported, and when the NCCL communicators were aborted replaces them with `rebuild()`.
    pub(crate) fn recover(&self, rebuild: impl FnOnce() -> Result<Comms>) -> Result<()> {
        let mut guard = self.guard()?;
        drop(self.fault());
        guard.drain(false)?;
        guard.state.ce.release = false;
        guard.set_ce_flags(0)?;
        drop(guard.state.p2p.first_error());
        guard.reset_p2p()?;
        guard.state.desynced = false;
        let mut nccl = guard.nccl()?;
        if matches!(*nccl, Nccl::Aborted(_)) {
            *nccl = guard.state.nccl.adopt(rebuild()?);
            tracing::info!("NCCL communicators rebuilt");
        }
        Ok(())
    }

    /// `Ok` if the P2P path can run now, otherwise the error a forced P2P call returns.
    pub(crate) fn p2p_status(&self) -> std::result::Result<(), Error> {
        self.with_p2p_status(|s| s.map_err(Clone::clone))
    }

    /// Runs `f` with whether the P2P path can run (or why not), without copying the reason.
    pub(crate) fn with_p2p_status<R>(
        &self,
        f: impl FnOnce(std::result::Result<(), &Error>) -> R,
    ) -> R {
        self.p2p_status.with(f)
    }

    /// Number of calls queued so far (see `Clique::calls`).
    pub(crate) fn calls(&self) -> u64 {
        self.calls.load(Ordering::Acquire)
    }

    /// The bare lock (no recovery): an error on the capturing thread, where it would wait for
    /// itself.
    fn guard(&self) -> Result<EngineGuard<'_>> {
        if self.capturing.load(Ordering::Acquire) && self.capture_owned_here() {
            return Err(Error::CaptureInProgress);
        }
        // Bounded: a call stuck in the driver, or a capture closure that waits for a thread
        // calling this clique, must not hold every other caller forever.
        let limit = self.settings.timeouts.drain();
        let mut state = None;
        crate::wait::until(limit, || {
            state = match self.state.try_lock() {
                Ok(s) => Some(s),
                Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            };
            state.is_some()
        });
        match state {
            Some(state) => Ok(EngineGuard {
                engine: self,
                state,
            }),
            _ => Err(Error::Busy {
                waited_ms: crate::wait::millis(limit),
            }),
        }
    }

    fn capture_owned_here(&self) -> bool {
        let owner = self
            .capture_thread
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *owner == Some(std::thread::current().id())
    }

    /// Waits until every stream is idle or `limit` passes; whether they all became idle.
    fn wait_idle(&self, limit: Duration) -> bool {
        // A stream in error never counts as idle here: its work may still run.
        crate::wait::until(limit, || self.streams_idle().unwrap_or(false))
    }

    /// Whether every stream has finished its work; a stream's CUDA error, naming its rank.
    fn streams_idle(&self) -> Result<bool> {
        let mut idle = true;
        for (rank, r) in self.ranks.iter().enumerate() {
            // `aux` too: its work is joined back into `stream`, unless the join failed.
            for stream in [&r.stream, &r.aux] {
                // SAFETY: the stream is live (owned by the engine).
                match unsafe { crate::driver::stream::is_idle(stream.get().cu_stream()) } {
                    Ok(true) => {}
                    Ok(false) => idle = false,
                    Err(e) => {
                        return Err(Error::Cuda {
                            during: format!("draining rank {rank}"),
                            source: e,
                        })
                    }
                }
            }
        }
        Ok(idle)
    }
}

impl EngineGuard<'_> {
    fn n(&self) -> usize {
        self.engine.ranks.len()
    }

    /// Sets every copy-engine flag to `value` ([`copy::State::set_flags`]).
    fn set_ce_flags(&mut self, value: u32) -> Result<()> {
        self.state.ce.set_flags(value)
    }

    /// Closes the P2P path for good with `why`; its state is dropped, or leaked (`leak`) where
    /// a reset may still write it.
    fn close_p2p(&mut self, why: Error, leak: bool) {
        self.state.p2p.close(why, leak);
    }

    /// Resets the P2P signal areas (the streams drained). When the reset does not finish, the
    /// path closes and its state is leaked.
    fn reset_p2p(&mut self) -> Result<()> {
        self.state
            .p2p
            .reset_with("resetting its signal areas", P2p::recover)
    }

    /// Counts a call; its number.
    fn next_call(&mut self) -> u64 {
        // Only under the lock: load and store cannot interleave with another writer.
        let call = self.engine.calls.load(Ordering::Acquire) + 1;
        self.engine.calls.store(call, Ordering::Release);
        call
    }

    /// The stream of `rank` (its own, not its capture stream).
    pub(crate) fn stream(&self, rank: usize) -> &Arc<CudaStream> {
        self.engine.stream(rank)
    }

    /// Whether a capture holds the lock (set once every rank's capture has begun).
    fn capturing(&self) -> bool {
        self.engine.capturing.load(Ordering::Acquire)
    }

    /// The stream `rank`'s work goes to now: its capture stream while a capture records, else
    /// its own.
    pub(crate) fn work_stream(&self, rank: usize) -> CUstream {
        let r = &self.engine.ranks[rank];
        if self.capturing() {
            r.capture.get().cu_stream()
        } else {
            r.stream.get().cu_stream()
        }
    }

    /// [`EngineGuard::work_stream`] of every rank.
    fn work_streams(&self) -> [CUstream; MAX_GPUS] {
        let mut raw = [std::ptr::null_mut(); MAX_GPUS];
        for (r, slot) in raw.iter_mut().enumerate().take(self.n()) {
            *slot = self.work_stream(r);
        }
        raw
    }

    /// The longest a host wait for the streams (or for an abort of NCCL) lasts: twice the
    /// timeout, plus two seconds.
    fn drain_limit(&self) -> Duration {
        self.engine.settings.timeouts.drain()
    }

    fn recover_if_needed(&mut self) -> Result<()> {
        let error = self.state.p2p.first_error();
        if error.is_none() && !self.state.desynced {
            return Ok(());
        }
        self.drain(false)?;
        self.state.ce.release = false;
        self.set_ce_flags(0)?;
        // Across processes every process would have to reset its signal area at the same
        // point: until a coordinated reset exists, the P2P path closes after a timeout.
        if self.state.p2p.across_processes() {
            let why = error.clone().unwrap_or_else(|| {
                Error::P2pUnavailable("a launch reached only some ranks".into())
            });
            let closed = Error::P2pUnavailable(format!(
                "the P2P path of this communicator closed after a failure across processes \
                 ({why}); NCCL still works, create a new communicator to use P2P again"
            ));
            self.close_p2p(closed, false);
            self.state.desynced = false;
            return Err(why);
        }
        self.reset_p2p()?;
        let desynced = std::mem::take(&mut self.state.desynced);
        match error {
            // After a launch that reached only some ranks, that call already reported it.
            Some(_) if desynced => Ok(()),
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Waits for every stream, by polling, so that the wait stays bounded: it ends when the
    /// streams are idle, when the watchdog aborts NCCL (that error), when a P2P kernel times
    /// out (that error, if `report_p2p`), or after twice the timeout plus two seconds
    /// ([`Error::StreamsBusy`]).
    fn drain(&mut self, report_p2p: bool) -> Result<()> {
        let limit = self.drain_limit();
        let start = Instant::now();
        let mut backoff = crate::wait::Backoff::new();
        loop {
            if self.engine.streams_idle()? {
                return Ok(());
            }
            // After a graph launch that reached only some ranks, copy-engine waits of the ranks
            // launched wait for flags nobody will write: set them, again at every turn, as a
            // chain waits on each flag once per chunk of its window (reset to 0 by the reader).
            if self.state.ce.release {
                self.set_ce_flags(1)?;
            }
            // A P2P kernel that timed out: report it now (the reset waits for idle streams, at
            // the next call).
            if let Some(e) = report_p2p.then(|| self.state.p2p.first_error()).flatten() {
                self.state.desynced = true;
                return Err(e);
            }
            if let Some(fault) = self.engine.fault() {
                return Err(fault);
            }
            if start.elapsed() > limit {
                return Err(Error::StreamsBusy {
                    waited_ms: crate::wait::millis(start.elapsed()),
                });
            }
            backoff.pause();
        }
    }

    /// The NCCL state. The watchdog holds it while it names the calls an abort leaves undefined
    /// (aborts themselves finish on a thread of their own); waiting for it is bounded like
    /// [`EngineGuard::drain`].
    fn nccl(&self) -> Result<MutexGuard<'_, Nccl>> {
        self.state.nccl.lock(self.drain_limit())
    }

    /// The P2P path's availability.
    pub(crate) fn p2p(&mut self) -> Result<&mut P2p> {
        self.state.p2p.get()
    }

    /// Enqueues `steps` over `items` from `root`, on every rank's stream.
    ///
    /// # Safety
    /// Every address of `items` is valid for its `count` elements of `dtype` on its rank's
    /// device (the root's `src` readable by every peer), and stays valid until the streams pass
    /// this point; `steps` name tensors of `items` only.
    pub(crate) unsafe fn run(&mut self, root: Root, items: &[Item], steps: &[Step]) -> Result<()> {
        self.capture_failed()?;
        // SAFETY: per this function's contract.
        let ran = unsafe { self.run_steps(root, items, steps) };
        if let Err(e) = &ran {
            // Inside a capture, steps before the failure (or part of the failed one) may be in
            // the graph: the whole capture fails, so that no graph replays a call whose buffers
            // its owner did not keep.
            if self.capturing() && self.state.capture_failed.is_none() {
                self.state.capture_failed = Some(e.clone());
            }
        }
        ran
    }

    /// The steps of [`EngineGuard::run`].
    ///
    /// # Safety
    /// As for [`EngineGuard::run`].
    unsafe fn run_steps(&mut self, root: Root, items: &[Item], steps: &[Step]) -> Result<()> {
        let Root {
            job: root,
            local: root_local,
        } = root;
        let n = self.n();
        let call = self.next_call();
        self.room_for(call)?;
        let streams = self.work_streams();
        for step in steps {
            match step {
                Step::P2pOne { tensor, protocol } => {
                    let capturing = self.capturing();
                    self.state.p2p.note_step(capturing);
                    let it = &items[*tensor];
                    let r = self.spinning(|e, streams| {
                        // SAFETY: per this function's contract; `streams` are the ranks'
                        // streams or forked from them.
                        unsafe {
                            e.p2p()?.launch(
                                *protocol,
                                root.0,
                                it.src,
                                it.bytes(),
                                &it.dsts[..n],
                                streams,
                            )
                        }
                    });
                    self.note_p2p(r)?;
                    self.cut_capture()?;
                }
                Step::P2pList { tensors } => {
                    let capturing = self.capturing();
                    self.state.p2p.note_step(capturing);
                    let copies: Vec<Vec<(u64, u64, usize)>> = (0..n)
                        .map(|rank| {
                            tensors
                                .iter()
                                .map(|&t| (items[t].src, items[t].dsts[rank], items[t].bytes()))
                                .collect()
                        })
                        .collect();
                    let r = self.spinning(|e, streams| {
                        // SAFETY: as for `P2pOne`.
                        unsafe { e.p2p()?.launch_list(root.0, &copies, streams) }
                    });
                    self.note_p2p(r)?;
                    self.cut_capture()?;
                }
                Step::CopyEngine { tensors } => {
                    // SAFETY: per this function's contract.
                    unsafe { self.copy_engine(root_local, items, tensors) }?;
                }
                Step::NcclGroup { tensors } => {
                    let first = self.engine.ranks[0].stream.get();
                    let mut own = [first; MAX_GPUS];
                    for (slot, r) in own.iter_mut().zip(&self.engine.ranks) {
                        *slot = r.stream.get();
                    }
                    let group = nccl::Group {
                        call,
                        root: root.0,
                        root_local: root_local.map(|l| l.0),
                        items,
                        tensors,
                        streams: &streams[..n],
                        own: &own[..n],
                        capturing: self.capturing(),
                    };
                    let (limit, wait) = (self.drain_limit(), self.engine.settings.timeouts.wait);
                    let watchdog = self.engine.watchdog.as_ref();
                    let watching = self.engine.watcher().is_some();
                    // SAFETY: per this function's contract; `own` are the ranks' own streams.
                    unsafe {
                        self.state
                            .nccl
                            .broadcast(&group, watchdog, watching, limit, wait)
                    }?;
                }
            }
        }
        Ok(())
    }

    /// Enqueues the copy-engine broadcast ([`copy`]) of `tensors` of `items` from local rank
    /// `root` (`None` where the root is not a rank of this process: an error), the root's own
    /// output included when out of place.
    ///
    /// # Safety
    /// As for [`EngineGuard::run`].
    unsafe fn copy_engine(
        &mut self,
        root: Option<Local>,
        items: &[Item],
        tensors: &[usize],
    ) -> Result<()> {
        let capturing = self.capturing();
        // Routes are chosen with this in mind (`Core`); a last line where they were not.
        if capturing {
            self.engine.copy_engine_in_graph()?;
        }
        let engine = self.engine;
        let Some(Local(root)) = root else {
            return Err(Error::CopyEngineUnavailable(
                "the root is not a rank of this process".into(),
            ));
        };
        let call = copy::Call::plan(root, self.n(), items, tensors, capturing);
        self.state.ce.captured |= capturing;
        let lanes: Vec<copy::Lane<'_>> = engine
            .ranks
            .iter()
            .enumerate()
            .map(|(r, rank)| copy::Lane {
                ctx: &rank.ctx,
                stream: self.work_stream(r),
                global: rank.global.0,
            })
            .collect();
        let beside = copy::Beside {
            ctx: &engine.ranks[root].ctx,
            main: self.work_stream(root),
            aux: self.aux_stream(root),
            fork: self.state.aux_events[root].0.cu_event(),
            join: self.state.aux_events[root].1.cu_event(),
            global: engine.ranks[root].global.0,
        };
        // SAFETY: the lanes are the engine's ranks in order, their streams the ranks' own (or
        // their capture streams); `beside` the root's streams and events, used only under the
        // lock; the buffers per this function's contract; and a copy-engine step is planned
        // only where every pair has peer access (`copy::support`), so every buffer is
        // reachable from every device.
        unsafe {
            self.state
                .ce
                .broadcast(&lanes, root, items, tensors, &call, &beside)
        }
    }

    /// [`nccl::State::watch`] with this engine's bound.
    pub(crate) fn watch_nccl(
        &self,
        w: &watchdog::Watchdog,
        begun: watchdog::Begun,
        own: &[&Arc<CudaStream>],
        call: u64,
        what: watchdog::Watched,
        comms: u64,
    ) -> Result<()> {
        let limit = self.drain_limit();
        self.state
            .nccl
            .watch(w, begun, own, call, what, comms, limit)
    }

    /// Aborts the NCCL communicators with id `comms` (if still live) for `reason`, naming the
    /// calls queued with the watchdog: where NCCL work may have reached the GPU unwatched.
    pub(crate) fn abort_comms(&self, reason: String, comms: u64) {
        let limit = self.drain_limit();
        self.state
            .nccl
            .abort_if_live(self.engine.watchdog.as_ref(), comms, reason, limit);
    }

    /// A P2P launch that failed on some rank leaves the others waiting for it: reset before the
    /// next call (`recover_if_needed`).
    fn note_p2p(&mut self, r: Result<()>) -> Result<()> {
        if r.is_err() {
            self.state.desynced = true;
        }
        r
    }

    /// Forks rank `rank`'s `aux` stream from the stream its work goes to now: what is queued
    /// on `aux` next starts after everything queued there so far. Returns `aux`.
    pub(crate) fn fork_aux(&mut self, rank: usize) -> Result<CUstream> {
        let (main, aux) = (self.work_stream(rank), self.aux_stream(rank));
        let fork = self.state.aux_events[rank].0.cu_event();
        // SAFETY: one of the rank's events; both are the rank's own streams (the engine's).
        unsafe { self.order_with(rank, fork, main, aux) }
            .map_err(Error::cuda(format!("forking rank {rank}'s second stream")))?;
        Ok(aux)
    }

    /// Joins rank `rank`'s `aux` stream back (see [`EngineGuard::fork_aux`]): what is queued
    /// next on the rank's stream starts after everything queued on `aux` so far.
    pub(crate) fn join_aux(&mut self, rank: usize) -> Result<()> {
        let (main, aux) = (self.work_stream(rank), self.aux_stream(rank));
        let join = self.state.aux_events[rank].1.cu_event();
        // SAFETY: as in `fork_aux`.
        unsafe { self.order_with(rank, join, aux, main) }
            .map_err(Error::cuda(format!("joining rank {rank}'s second stream")))
    }

    fn aux_stream(&self, rank: usize) -> CUstream {
        self.engine.ranks[rank].aux.get().cu_stream()
    }

    /// Runs `launch`, which queues kernels of one call that wait for each other (P2P kernels,
    /// or graphs holding them), with the stream to queue each rank's kernel on.
    ///
    /// Such kernels finish only if every rank's kernel starts. A device runs its streams'
    /// work through a few hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 by default), each
    /// in the order the work was queued, so that streams beyond that number share a queue.
    /// Where two ranks share a device, work that another thread queues on rank 0's stream
    /// between the launches of rank 0's and rank 1's kernels waits for rank 0's kernel (it
    /// follows it on that stream); in a queue shared with rank 1's stream it then holds back
    /// rank 1's launch, while rank 0's kernel waits for rank 1's until it times out. So there
    /// each rank's kernel goes to its `aux` stream, which only the engine uses, under its
    /// lock: forked from the rank's stream before the first launch, joined back after the last
    /// one. Work queued on the ranks' streams meanwhile waits for nothing of this call. On
    /// distinct devices a device's queues hold no other rank's kernel, and the kernels go to
    /// the ranks' streams. In a capture, the order of launches is the graph's.
    fn spinning<R>(
        &mut self,
        launch: impl FnOnce(&mut Self, &[CUstream]) -> Result<R>,
    ) -> Result<R> {
        let n = self.n();
        let mut streams = self.work_streams();
        if !self.engine.shared_device || self.capturing() {
            return launch(self, &streams[..n]);
        }
        for (rank, stream) in streams.iter_mut().enumerate().take(n) {
            // A failed fork leaves the ranks forked so far waiting for their own stream only.
            *stream = self.fork_aux(rank)?;
        }
        // Joined whatever `launch` did, a panic included (some ranks may have launched), so
        // that no rank's stream moves past work queued on its `aux`.
        let launched =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| launch(self, &streams[..n])));
        let mut joined = Ok(());
        for rank in 0..n {
            joined = joined.and(self.join_aux(rank));
        }
        if joined.is_err() {
            // A rank's stream could move on, and the caller free a buffer, while its `aux`
            // still runs: wait for every stream here instead (the kernels time out), as long
            // as a drain waits at most, and drain and reset before the next call.
            self.state.desynced = true;
            let limit = self.drain_limit();
            let start = Instant::now();
            if !self.engine.wait_idle(limit) {
                joined = joined.and(Err(Error::StreamsBusy {
                    waited_ms: crate::wait::millis(start.elapsed()),
                }));
            }
        }
        let launched = launched.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        joined.map(|()| launched)
    }

    /// Makes rank `rank`'s stream wait for the work queued so far on `other`.
    ///
    /// # Safety
    /// `other` is a live stream of rank `rank`'s context.
    pub(crate) unsafe fn stream_waits_for(&mut self, rank: usize, other: CUstream) -> Result<()> {
        let own = self.engine.ranks[rank].stream.get().cu_stream();
        // SAFETY: `own` is the rank's own stream; `other` per this function's contract.
        unsafe { self.order(rank, other, own) }.map_err(Error::cuda(format!(
            "ordering rank {rank} after a buffer's stream"
        )))
    }

    /// Makes `other` wait for the work queued so far on rank `rank`'s stream.
    ///
    /// # Safety
    /// `other` is a live stream of rank `rank`'s context.
    pub(crate) unsafe fn waits_for_stream(&mut self, rank: usize, other: CUstream) -> Result<()> {
        let own = self.engine.ranks[rank].stream.get().cu_stream();
        // SAFETY: `own` is the rank's own stream; `other` per this function's contract.
        unsafe { self.order(rank, own, other) }.map_err(Error::cuda(format!(
            "ordering a buffer's stream after rank {rank}"
        )))
    }

    /// Waits until call `call` may be queued without a launch blocking in the driver behind
    /// NCCL work that never finishes ([`watchdog::Watchdog::room`]); the watchdog's fault if
    /// it aborted that work meanwhile. Nothing to wait for inside a capture (nothing runs).
    fn room_for(&mut self, call: u64) -> Result<()> {
        let Some(w) = self.engine.watchdog.as_ref().filter(|_| !self.capturing()) else {
            return Ok(());
        };
        // Without a wait, the fault was looked for when the lock was taken, just before.
        if !w.room(call, self.engine.settings.timeouts.drain())? {
            return Ok(());
        }
        match self.engine.fault() {
            Some(fault) => Err(fault),
            None => Ok(()),
        }
    }

    /// Makes every rank's own stream wait for the work queued so far on every other rank's.
    pub(crate) fn join_ranks(&mut self) -> Result<()> {
        for earlier in 0..self.n() {
            let event = self.state.events[earlier].cu_event();
            let from = self.engine.ranks[earlier].stream.get().cu_stream();
            for later in (0..self.n()).filter(|&r| r != earlier) {
                let to = self.engine.ranks[later].stream.get().cu_stream();
                // SAFETY: `event` is rank `earlier`'s event and `from` its own stream; `to` is a
                // live stream of another rank (a stream may wait for an event of another
                // context of the process).
                unsafe { self.order_with(earlier, event, from, to) }.map_err(Error::cuda(
                    format!("ordering rank {later}'s stream after rank {earlier}'s"),
                ))?;
            }
        }
        Ok(())
    }

    /// Makes `later` wait for the work queued so far on `earlier`, with rank `rank`'s event.
    ///
    /// # Safety
    /// Both streams are live streams of rank `rank`'s context.
    unsafe fn order(
        &mut self,
        rank: usize,
        earlier: CUstream,
        later: CUstream,
    ) -> std::result::Result<(), result::DriverError> {
        let event = self.state.events[rank].cu_event();
        // SAFETY: one of the rank's events; the streams per this function's contract.
        unsafe { self.order_with(rank, event, earlier, later) }
    }

    /// [`EngineGuard::order`] with `event`, one of rank `rank`'s events.
    ///
    /// # Safety
    /// `event` is one of rank `rank`'s events in the engine's state, `earlier` is a live
    /// stream of the rank's context (the event is recorded there), and `later` is a live
    /// stream of any context of the process (`cuStreamWaitEvent` takes an event of another
    /// context and device).
    unsafe fn order_with(
        &self,
        rank: usize,
        event: sys::CUevent,
        earlier: CUstream,
        later: CUstream,
    ) -> std::result::Result<(), result::DriverError> {
        // SAFETY: `event` and both streams per this function's contract; the event is reused
        // only under the engine's lock (`&self` of a guard).
        unsafe { crate::driver::stream::order(&self.engine.ranks[rank].ctx, event, earlier, later) }
    }

    /// Blocks until every stream has finished, then reports a P2P timeout (after resetting the
    /// signal areas) or an asynchronous NCCL error.
    pub(crate) fn synchronize(&mut self) -> Result<()> {
        self.drain(true)?;
        self.recover_if_needed()?;
        if let Some(fault) = self.engine.fault() {
            return Err(fault);
        }
        let mut nccl = self.nccl()?;
        match &mut *nccl {
            Nccl::Live(comms) => comms.async_error(),
            // The watchdog publishes its fault while it holds the communicators, after the
            // abort: an abort seen here (the lock taken after that) has its fault published,
            // which the look above may have come too early for.
            Nccl::Aborted(_) => match self.engine.fault() {
                Some(fault) => Err(fault),
                None => Ok(()),
            },
            Nccl::Off(_) => Ok(()),
        }
    }

    #[cfg(feature = "testing")]
    /// Drains the streams, then sets the P2P packet counters of every rank to `value` (see
    /// [`P2p::set_packet_counters`]; test support).
    pub(crate) fn set_packet_counters(&mut self, value: u32) -> Result<()> {
        self.synchronize()?;
        self.p2p()?;
        self.state
            .p2p
            .reset_with("setting its packet counters", |p2p| {
                p2p.set_packet_counters(value)
            })
    }

    #[cfg(feature = "testing")]
    /// Aborts the NCCL communicators with `reason`, as the watchdog does after a fault (test
    /// support: with one GPU no NCCL peer can be late).
    pub(crate) fn abort_nccl(&mut self, reason: String) -> Result<()> {
        let mut nccl = self.nccl()?;
        nccl::abort_watched(self.engine.watchdog.as_ref(), &mut nccl, reason);
        Ok(())
    }

    /// Turns the P2P launch threads on or off.
    pub(crate) fn set_parallel_launch(&mut self, on: bool) {
        if let Some(p2p) = self.state.p2p.live_mut() {
            p2p.set_parallel_launch(on);
        }
    }

    /// Whether P2P launches go through the launch threads.
    pub(crate) fn parallel_launch(&self) -> bool {
        self.state.p2p.live().is_some_and(P2p::parallel_launch)
    }

    /// Marks this thread as the one capturing (or not any more); see [`Engine::lock`].
    pub(crate) fn set_capturing(&mut self, on: bool) {
        let mut owner = self
            .engine
            .capture_thread
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *owner = on.then(|| std::thread::current().id());
        self.engine.capturing.store(on, Ordering::Release);
    }
}

/// How [`Engine::fail_launch`] names part `part` of rank `rank`'s graph (never 0).
fn launch_code(rank: usize, part: usize) -> u64 {
    ((rank as u64) << 32 | part as u64) + 1
}

impl Drop for Engine {
    /// Never hangs and never panics: waits for the streams at most twice the timeout plus a
    /// second; if work is still running then (an NCCL peer that will never come), aborts NCCL
    /// and waits a second more; then for the NCCL aborts still running as long again; if the
    /// streams are still busy, leaks the P2P memory rather than free it under a running
    /// kernel. What is left to free goes to [`release`] (at most [`RELEASE_WAIT`] more).
    fn drop(&mut self) {
        // A P2P kernel's longest wait for messages of up to 2 GB (see `Timeouts::drop_drain`).
        let limit = self.settings.timeouts.drop_drain();
        drop(self.watchdog.take());
        let mut idle = self.wait_idle(limit);
        let shared = self
            .state
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .nccl
            .shared();
        // The communicators to destroy, in the release.
        let mut comms = None;
        // The watchdog holds NCCL briefly when it aborts (the abort itself is detached).
        match nccl::lock_within(&shared, Duration::from_secs(1)) {
            Some(mut nccl) => {
                if !idle {
                    nccl.abort("the clique was dropped while work was still running".into());
                    idle = self.wait_idle(Duration::from_secs(1));
                }
                if idle {
                    let old = std::mem::replace(&mut *nccl, Nccl::Aborted("dropped".into()));
                    if self.nccl_graphs.load(Ordering::Acquire) > 0 {
                        tracing::warn!(
                            "a graph with NCCL broadcasts outlives its clique (forgotten): its \
                             NCCL communicators are leaked, as destroying them would wait for it"
                        );
                        std::mem::forget(old);
                    } else {
                        comms = Some(old);
                    }
                }
            }
            None => idle = false,
        }
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        // Aborts of this engine's communicators finish on threads of their own; NCCL frees
        // their memory there, which waits for the device, and with it for other work of the
        // process. Waited for here, bounded, so that a clique's drop leaves nothing of its own
        // running; not where a graph with NCCL steps outlives the clique (forgotten): an abort
        // that waits for it never ends.
        let forgotten = self.nccl_graphs.load(Ordering::Acquire) > 0;
        if !state
            .nccl
            .wait_for_aborts(if forgotten { Duration::ZERO } else { limit })
        {
            tracing::warn!(
                "an abort of this clique's NCCL communicators did not finish within the drop's \
                 bound (it waits for a graph that captured them, or for work on the device): \
                 it goes on in the background"
            );
        }
        if !idle {
            tracing::warn!(
                "GPU work still running while dropping a clique: its P2P buffers are leaked"
            );
            state.ce.leak_flags();
        }
        let p2p = state.p2p.take_path(idle);
        // SAFETY: `self.state` is never used again: this is the end of the drop, and the
        // engine's fields dropped after it do not touch it.
        let state = unsafe { ManuallyDrop::take(&mut self.state) };
        let ranks = std::mem::take(&mut self.ranks);
        release(move || {
            // The order the engine has always dropped them in.
            drop(comms);
            drop(p2p);
            drop(ranks);
            drop(state);
        });
    }
}

/// How long a drop waits for the release of its streams and device memory: freeing device
/// memory (`cuMemFree`, and NCCL's in `ncclCommDestroy`) waits for every stream of the device,
/// the caller's unrelated work included. Past this the release goes on in the background.
const RELEASE_WAIT: Duration = Duration::from_millis(500);

/// Runs the end of a dropped engine (its NCCL communicators destroyed, its P2P memory, streams
/// and copy-engine flags freed) on a thread of its own, waited for at most [`RELEASE_WAIT`]:
/// with the device idle it is over before the drop returns; beside the caller's unrelated work
/// it finishes when that work does, without holding the caller. The engine's own work has
/// ended by then (or what it may still use was leaked).
fn release(end: impl FnOnce() + Send + 'static) {
    if !crate::wait::detached_within(RELEASE_WAIT, "gpucast-release", end) {
        tracing::debug!(
            "a dropped clique's device memory is freed in the background: the device still \
             runs other work"
        );
    }
}
