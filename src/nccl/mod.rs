//! The NCCL path: communicators, grouped broadcasts, and abort.

mod lib;
pub(crate) mod watchdog;

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaContext, CudaStream};

use std::time::{Duration, Instant};
use watchdog::{Watchdog, Watched};

use crate::wait::Backoff;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys::ncclComm_t;

use crate::error::{Error, Result};
use crate::item::Item;
use crate::wait::millis;
pub use lib::nccl_version;
pub(crate) use lib::{Config, NcclLib, UniqueId};

/// One communicator handle, live while this exists (made only here from a communicator NCCL
/// created, consumed when it ends). NCCL allows a communicator to be used from any thread, one
/// call at a time: it is `Send`, and `Comms` is only reached through the mutex that holds the
/// engine's `Nccl`.
pub(crate) struct Comm(ncclComm_t);

// SAFETY: an ncclComm_t is a heap object of the NCCL library, not tied to the thread that made
// it; calls on it must not overlap, which the mutex around the engine's `Nccl` guarantees (the
// engine and its watchdog reach the communicators only through it; `Comms` is not `Sync`), and
// an abort on a thread of its own takes the communicators out of it first.
unsafe impl Send for Comm {}

/// The NCCL communicators of the ranks this process drives, one per rank, released on drop
/// (destroyed when idle, aborted otherwise).
pub(crate) struct Comms {
    lib: &'static NcclLib,
    comms: Vec<Comm>,
    /// Unique in the process: a graph that captured these communicators names them by it.
    id: u64,
    /// Detached aborts still running ([`Comms::abort_detached`]), counted with those of the
    /// other communicators of the same engine ([`State::adopt`]).
    aborting: Arc<AtomicUsize>,
}

/// Decrements its counter when dropped.
struct CountDown(Arc<AtomicUsize>);

impl Drop for CountDown {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The next [`Comms::id`].
static NEXT_COMMS_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Comms {
    /// One communicator per rank of a clique of this process (rank i on `ctxs[i]`), within
    /// `timeout`.
    pub(crate) fn init_all(ctxs: &[Arc<CudaContext>], timeout: Duration) -> Result<Comms> {
        let id = Comms::unique_id()?;
        let ranks: Vec<_> = ctxs.iter().cloned().enumerate().collect();
        Comms::init_ranks(&id, ctxs.len(), &ranks, timeout)
    }

    /// A fresh unique id (on the job's rank 0), to be shared with every rank.
    pub(crate) fn unique_id() -> Result<UniqueId> {
        let lib = NcclLib::get()?;
        let mut id = UniqueId([0; 128]);
        // SAFETY: `id` is a valid out pointer of ncclUniqueId's size.
        let code = unsafe { (lib.get_unique_id)(&mut id) };
        lib.check(code, None, || "ncclGetUniqueId".into())?;
        Ok(id)
    }

    /// One communicator per local rank of a job of `world` ranks that shares `id`:
    /// `ranks[i]` is (global rank, context) of local rank i, ready within `timeout`.
    ///
    /// The communicators are blocking ones: a non-blocking NCCL communicator starts a thread at
    /// every group end, which made every eager broadcast many times slower in the first
    /// fault-handling version (ae63f9d; measured on 2 H200, no committed file). What may block
    /// is bounded instead: joining the job (`ncclCommInitRankConfig`) and connecting to the
    /// peers (a first one-byte broadcast, which sets up the ring every broadcast uses) run on a
    /// helper thread that this call waits for at most `timeout`. If it gives up, the helper aborts the
    /// communicators when (if ever) NCCL returns.
    pub(crate) fn init_ranks(
        id: &UniqueId,
        world: usize,
        ranks: &[(usize, Arc<CudaContext>)],
        timeout: Duration,
    ) -> Result<Comms> {
        let lib = NcclLib::get()?;
        let id = *id;
        let ranks = ranks.to_vec();
        let (tx, rx) = std::sync::mpsc::channel();
        let abandoned = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let gave_up = abandoned.clone();
        std::thread::Builder::new()
            .name("gpucast-nccl-init".into())
            .spawn(move || {
                let made = join_and_connect(lib, &id, world, &ranks);
                if gave_up.load(std::sync::atomic::Ordering::Acquire) {
                    if let Ok(comms) = made {
                        comms.abort();
                    }
                } else {
                    drop(tx.send(made));
                }
            })
            .map_err(|e| Error::InvalidArgument(format!("starting the NCCL init thread: {e}")))?;
        match rx.recv_timeout(timeout) {
            Ok(made) => made,
            Err(_) => {
                abandoned.store(true, std::sync::atomic::Ordering::Release);
                // The helper may have sent just before the flag was set.
                if let Ok(Ok(comms)) = rx.try_recv() {
                    comms.abort();
                }
                Err(Error::NcclTimeout {
                    during: format!(
                        "creating the NCCL communicators of a job of {world} ranks (a rank did not join)"
                    ),
                    waited_ms: millis(timeout),
                })
            }
        }
    }

    /// Enqueues, inside one NCCL group (none around a single call: one communicator, one
    /// tensor), a broadcast of each of `tensors` from job rank `root`
    /// (local rank `root_local` here, if this process holds it), local rank `r`'s part on
    /// `streams[r]`: the root sends its `src` and every rank receives into its `dsts[r]` (the
    /// other ranks' send buffer is their receive buffer, as NCCL ignores it).
    ///
    /// On a failure inside the group the group is ended (NCCL cancels a group in which a call
    /// failed) and `Err` is returned: the caller must abort the communicators, since a rank
    /// whose part was enqueued could otherwise wait forever for a peer whose part was not.
    ///
    /// # Safety
    /// Each tensor's `dsts[r]` points to `count` elements of `dtype` on local rank `r`'s device
    /// (its `src` too on the root's), each stream is a live stream of its rank's device; the
    /// buffers stay valid until the streams pass this point.
    pub(crate) unsafe fn broadcast_group<'a>(
        &mut self,
        root: usize,
        root_local: Option<usize>,
        tensors: impl Iterator<Item = &'a Item> + Clone,
        streams: &[CUstream],
        timeout: Duration,
    ) -> Result<()> {
        let root_c = c_int::try_from(root).expect("root is validated to be < 8");
        // One communicator and one tensor: one ncclBroadcast, which is a group of its own (the
        // explicit group would only nest it).
        let grouped = self.comms.len() * tensors.clone().take(2).count() > 1;
        if grouped {
            // SAFETY: ncclGroupStart has no preconditions.
            let code = unsafe { (self.lib.group_start)() };
            self.lib.check(code, None, || "ncclGroupStart".into())?;
        }
        let mut failure = None;
        let mut last = 0;
        'outer: for it in tensors {
            for (rank, comm) in self.comms.iter().enumerate() {
                let send = if root_local == Some(rank) {
                    it.src
                } else {
                    it.dsts[rank]
                };
                // SAFETY: pointers and stream are valid per this function's contract.
                last = unsafe {
                    (self.lib.broadcast)(
                        send as *const c_void,
                        it.dsts[rank] as *mut c_void,
                        it.count,
                        it.dtype.nccl(),
                        root_c,
                        comm.0,
                        streams[rank],
                    )
                };
                if last == lib::IN_PROGRESS && !grouped {
                    break 'outer;
                }
                if let Err(e) = self
                    .lib
                    .check(last, Some(comm), || format!("ncclBroadcast on rank {rank}"))
                {
                    failure = Some(e);
                    break 'outer;
                }
            }
        }
        let code = if grouped {
            // SAFETY: matches the ncclGroupStart above (also on failure: it resets this
            // thread's group state, and NCCL drops a group in which a call failed).
            unsafe { (self.lib.group_end)() }
        } else {
            last
        };
        if let Some(e) = failure {
            return Err(e);
        }
        if code == lib::IN_PROGRESS {
            // gpucast makes blocking communicators, but NCCL_COMM_BLOCKING=0 in the environment
            // overrides that: a non-blocking one finishes the group's work in the background.
            // The deadline is read from the clock only here, off the common path.
            let deadline = crate::util::later(timeout);
            return self.wait_ready(deadline, || "queueing a grouped ncclBroadcast".into());
        }
        self.lib.check(code, None, || "ncclGroupEnd".into())
    }

    /// Polls every communicator until none is in progress, an error shows, or `deadline`
    /// passes ([`Error::NcclTimeout`]; the caller aborts).
    fn wait_ready(&self, deadline: Instant, during: impl Fn() -> String) -> Result<()> {
        let start = Instant::now();
        let mut backoff = Backoff::new();
        while self.busy(&during)? {
            if Instant::now() >= deadline {
                return Err(Error::NcclTimeout {
                    during: during(),
                    waited_ms: millis(start.elapsed()),
                });
            }
            backoff.pause();
        }
        Ok(())
    }

    /// Whether a communicator still has a call in progress; the first error any reports
    /// (`during` says what the call was).
    fn busy(&self, during: impl Fn() -> String) -> Result<bool> {
        let mut busy = false;
        for (rank, comm) in self.comms.iter().enumerate() {
            let mut state: lib::RawResult = 0;
            // SAFETY: `comm` is live; `state` is a valid out pointer.
            let code = unsafe { (self.lib.comm_get_async_error)(comm.0, &mut state) };
            self.lib.check(code, Some(comm), || {
                format!("ncclCommGetAsyncError on rank {rank}")
            })?;
            match state {
                0 => {}
                lib::IN_PROGRESS => busy = true,
                e => self
                    .lib
                    .check(e, Some(comm), || format!("{} (rank {rank})", during()))?,
            }
        }
        Ok(busy)
    }

    /// The first asynchronous error any communicator reports, if any.
    pub(crate) fn async_error(&self) -> Result<()> {
        self.busy(|| "asynchronous NCCL error".into()).map(|_| ())
    }

    /// Aborts every communicator: NCCL stops their kernels and frees them without waiting for
    /// peers. Consumes the communicators.
    pub(crate) fn abort(mut self) {
        let abort = self.lib.comm_abort;
        self.release(abort, "ncclCommAbort");
    }

    /// [`Comms::abort`] on a thread of its own, never joined. `ncclCommAbort` stops the
    /// communicators' kernels at once, then waits (in `commDestroySync`) until every CUDA graph
    /// that captured them is destroyed before it returns: where such a graph is alive, or a
    /// capture in progress holds them, the thread that owns it could otherwise wait for itself.
    /// If no thread can be started, the communicators are leaked unaborted (their kernels then
    /// end only when their peers come, and every wait of the engine gives up on them, bounded),
    /// never destroyed here: that would wait too.
    fn abort_detached(self) {
        let aborting = self.aborting.clone();
        aborting.fetch_add(1, Ordering::AcqRel);
        let done = aborting.clone();
        let slot = Arc::new(Mutex::new(Some(self)));
        let taken = slot.clone();
        let spawned = std::thread::Builder::new()
            .name("gpucast-nccl-abort".into())
            .spawn(move || {
                // Counted down however the abort ends, a panic included.
                let _done = CountDown(done);
                let comms = taken.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(comms) = comms {
                    comms.abort();
                }
            });
        if let Err(e) = spawned {
            aborting.fetch_sub(1, Ordering::AcqRel);
            tracing::error!(
                error = %e,
                "no thread for an NCCL abort: the communicators are leaked unaborted, and NCCL \
                 work still queued may never end: create a new clique or communicator"
            );
            if let Some(comms) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
                std::mem::forget(comms);
            }
        }
    }

    /// Ends every communicator with `end` (`ncclCommDestroy` or `ncclCommAbort`), logging
    /// failures: nothing is left to use afterwards.
    fn release(&mut self, end: lib::CommFn, name: &str) {
        for (rank, comm) in std::mem::take(&mut self.comms).into_iter().enumerate() {
            // SAFETY: `comm` is live and never used again.
            let code = unsafe { end(comm.0) };
            // A non-blocking communicator may finish in the background.
            let code = if code == lib::IN_PROGRESS { 0 } else { code };
            if let Err(e) = self.lib.check(code, None, || format!("{name} rank {rank}")) {
                tracing::warn!(error = %e, "could not end an NCCL communicator");
            }
        }
    }
}

impl Drop for Comms {
    /// Destroys the communicators. The engine only lets this run when their streams are idle
    /// (it aborts them otherwise), so `ncclCommDestroy` has nothing to wait for.
    fn drop(&mut self) {
        let destroy = self.lib.comm_destroy;
        self.release(destroy, "ncclCommDestroy");
    }
}

/// Joins the job and connects to the peers, on the calling thread (see [`Comms::init_ranks`]).
fn join_and_connect(
    lib: &'static NcclLib,
    id: &UniqueId,
    world: usize,
    ranks: &[(usize, Arc<CudaContext>)],
) -> Result<Comms> {
    let n = c_int::try_from(world).expect("world sizes are validated");
    let mut raw = vec![std::ptr::null_mut(); ranks.len()];
    let grouped = ranks.len() > 1;
    if grouped {
        // SAFETY: no preconditions.
        let code = unsafe { (lib.group_start)() };
        lib.check(code, None, || "ncclGroupStart".into())?;
    }
    let mut status = Ok(());
    for ((global, ctx), slot) in ranks.iter().zip(&mut raw) {
        // NCCL takes the device from the calling thread's current context.
        if let Err(e) = ctx.bind_to_thread() {
            status = Err(Error::Cuda {
                during: "binding a context for NCCL".into(),
                source: e,
            });
            break;
        }
        let mut config = Config::new();
        config.blocking = 1;
        let rank = c_int::try_from(*global).expect("ranks are validated");
        // SAFETY: `slot` is an out pointer, `id` the job's id, `config` a valid config.
        let code = unsafe { (lib.comm_init_rank_config)(slot, n, *id, rank, &mut config) };
        if let Err(e) = lib.check(code, None, || {
            format!("ncclCommInitRankConfig for rank {global} of {world}")
        }) {
            status = Err(e);
            break;
        }
    }
    if grouped {
        // SAFETY: matches the ncclGroupStart above.
        let code = unsafe { (lib.group_end)() };
        status = status.and(lib.check(code, None, || {
            "ncclGroupEnd after ncclCommInitRankConfig".into()
        }));
    }
    let mut comms = Comms {
        lib,
        comms: raw.into_iter().filter(|c| !c.is_null()).map(Comm).collect(),
        id: NEXT_COMMS_ID.fetch_add(1, Ordering::Relaxed),
        aborting: Arc::default(),
    };
    if status.is_ok() {
        status = connect(&mut comms, ranks);
    }
    match status {
        Ok(()) => Ok(comms),
        Err(e) => {
            comms.abort();
            Err(e)
        }
    }
}

/// A one-byte broadcast from rank 0 on fresh streams, waited for: NCCL connects each
/// communicator to its ring peers at its first broadcast, which blocks until they are there.
fn connect(comms: &mut Comms, ranks: &[(usize, Arc<CudaContext>)]) -> Result<()> {
    let mut bufs = Vec::new();
    let mut streams = Vec::new();
    let mut status = (|| {
        for (_, ctx) in ranks {
            ctx.bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            // SAFETY: a plain allocation and a plain stream of the current context, both
            // released below once the stream is idle.
            let buf = unsafe { cudarc::driver::result::malloc_sync(16) }
                .map_err(Error::cuda("allocating NCCL's first buffer"))?;
            bufs.push((ctx.clone(), buf));
            let stream = cudarc::driver::result::stream::create(
                cudarc::driver::result::stream::StreamKind::NonBlocking,
            )
            .map_err(Error::cuda("creating a stream for NCCL's first broadcast"))?;
            streams.push((ctx.clone(), stream));
        }
        // Every rank sends from and receives into its own buffer (no root's source apart).
        let dsts: Vec<u64> = bufs.iter().map(|(_, b)| *b).collect();
        let item = Item::new(0, &dsts, 1, crate::dtype::DType::U8);
        let raw: Vec<CUstream> = streams.iter().map(|(_, s)| *s).collect();
        // SAFETY: each buffer holds 16 bytes on its rank's device, each stream is live; both
        // outlive the broadcast (synchronised below).
        unsafe {
            // The helper thread's caller bounds the whole; a year stands for no bound here.
            let unbounded = Duration::from_secs(365 * 24 * 3600);
            comms.broadcast_group(0, None, std::iter::once(&item), &raw, unbounded)
        }?;
        for ((ctx, s), rank) in streams.iter().zip(0..) {
            ctx.bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            // SAFETY: a live stream of the current context.
            unsafe { cudarc::driver::result::stream::synchronize(*s) }.map_err(Error::cuda(
                format!("NCCL's first broadcast on rank {rank}"),
            ))?;
        }
        Ok(())
    })();
    for (ctx, s) in streams {
        if ctx.bind_to_thread().is_ok() {
            // SAFETY: idle (synchronised above) or never used.
            let _ = unsafe { cudarc::driver::result::stream::destroy(s) };
        }
    }
    for (ctx, b) in bufs {
        if ctx.bind_to_thread().is_ok() {
            // SAFETY: the streams that used it are idle or gone.
            let r = unsafe { cudarc::driver::result::free_sync(b) };
            if status.is_ok() {
                status = r.map_err(Error::cuda("freeing NCCL's first buffer"));
            }
        }
    }
    status
}

/// The NCCL path of an engine: live, aborted after a failure, or off in this clique.
pub(crate) enum Nccl {
    Live(Comms),
    Aborted(String),
    Off(String),
}

impl Nccl {
    /// The live communicators, or the error that says why there are none.
    pub(crate) fn live(&mut self) -> Result<&mut Comms> {
        match self {
            Nccl::Live(c) => Ok(c),
            Nccl::Aborted(reason) => Err(Error::CommunicatorsAborted {
                reason: reason.clone(),
                undefined_calls: Vec::new(),
            }),
            Nccl::Off(reason) => Err(Error::NcclUnavailable(reason.clone())),
        }
    }

    /// Aborts the communicators (if live) and remembers why. The abort finishes on a thread of
    /// its own ([`Comms::abort_detached`]: it waits for every graph that captured them, which
    /// a caller may own, or which a capture in progress is recording), so this returns at
    /// once; the communicators count as aborted from here on.
    pub(crate) fn abort(&mut self, reason: String) {
        if let Nccl::Live(_) = self {
            if let Nccl::Live(comms) = std::mem::replace(self, Nccl::Aborted(reason.clone())) {
                tracing::warn!(%reason, "aborting the NCCL communicators");
                comms.abort_detached();
            }
        }
    }

    /// The id of the live communicators ([`Comms::id`]), 0 where there are none.
    pub(crate) fn live_id(&self) -> u64 {
        match self {
            Nccl::Live(c) => c.id,
            Nccl::Aborted(_) | Nccl::Off(_) => 0,
        }
    }
}

/// What an engine keeps of its NCCL path: the communicators, shared with the watchdog (which
/// aborts them without the engine's lock), and whether the capture in progress holds an NCCL
/// step.
pub(crate) struct State {
    comms: Arc<Mutex<Nccl>>,
    captured: bool,
    /// Aborts of this engine's communicators still running on threads of their own.
    aborting: Arc<AtomicUsize>,
}

impl State {
    pub(crate) fn new(nccl: Nccl) -> State {
        let aborting = Arc::<AtomicUsize>::default();
        let nccl = match nccl {
            Nccl::Live(comms) => counted(comms, &aborting),
            other => other,
        };
        State {
            comms: Arc::new(Mutex::new(nccl)),
            captured: false,
            aborting,
        }
    }

    /// `comms` as this engine's live communicators: their aborts count among its own.
    pub(crate) fn adopt(&self, comms: Comms) -> Nccl {
        counted(comms, &self.aborting)
    }

    /// Waits, by polling, until no abort of this engine's communicators is running, at most
    /// `limit`; whether none is. An abort waits (inside NCCL) for every graph that captured
    /// the communicators, so one whose graph was forgotten never ends.
    pub(crate) fn wait_for_aborts(&self, limit: Duration) -> bool {
        crate::wait::until(limit, || self.aborting.load(Ordering::Acquire) == 0)
    }

    /// The communicators, for the watchdog.
    pub(crate) fn shared(&self) -> Arc<Mutex<Nccl>> {
        self.comms.clone()
    }

    /// The communicators, locked within `limit` (the watchdog holds them briefly, to abort them
    /// or to ask for an asynchronous error); `None` when that did not happen in time.
    pub(crate) fn lock_within(&self, limit: Duration) -> Option<MutexGuard<'_, Nccl>> {
        lock_within(&self.comms, limit)
    }

    /// The communicators, locked within `limit`, else [`Error::NcclTimeout`].
    pub(crate) fn lock(&self, limit: Duration) -> Result<MutexGuard<'_, Nccl>> {
        self.lock_within(limit).ok_or_else(|| Error::NcclTimeout {
            during: "waiting for the NCCL communicators (held by the watchdog)".into(),
            waited_ms: millis(limit),
        })
    }

    /// Queues the grouped broadcast `g` and, outside a capture and where `watching`, hands it
    /// to `watchdog`. A failure to queue it aborts the communicators: a rank whose part went
    /// out would wait forever for one whose part did not (the calls queued before lose their
    /// kernels too, and `watchdog` names them). `limit` bounds the wait for the communicators,
    /// `wait` NCCL's own queueing on non-blocking communicators.
    ///
    /// # Safety
    /// As for [`Comms::broadcast_group`], for `g`'s tensors and streams; `g.own` are the local
    /// ranks' own live streams.
    pub(crate) unsafe fn broadcast(
        &mut self,
        g: &Group<'_>,
        watchdog: Option<&Watchdog>,
        watching: bool,
        limit: Duration,
        wait: Duration,
    ) -> Result<()> {
        let watch = watchdog.filter(|_| watching && !g.capturing);
        let mut nccl = self.lock(limit)?;
        let id = nccl.live_id();
        let comms = nccl.live()?;
        // Only once NCCL is known to be live: an aborted path records nothing.
        let begun = watch.map(|w| w.begin(g.own)).transpose()?;
        let tensors = g.tensors.iter().map(|&t| &g.items[t]);
        // SAFETY: per this function's contract.
        let queued =
            unsafe { comms.broadcast_group(g.root, g.root_local, tensors, g.streams, wait) };
        if let Err(e) = queued {
            if let (Some(w), Some(begun)) = (watch, begun) {
                w.reuse(begun);
            }
            abort_watched(
                watchdog,
                &mut nccl,
                format!("a grouped broadcast failed: {e}"),
            );
            drop(nccl);
            // Inside a capture the graph may hold some of its kernels: the capture fails at
            // its end (its communicators are aborted).
            self.note_step(g.capturing);
            return Err(e);
        }
        drop(nccl);
        self.note_step(g.capturing);
        if let (Some(w), Some(begun)) = (watch, begun) {
            let what = Watched::Broadcast {
                tensors: g.tensors.len(),
                bytes: g.tensors.iter().map(|&t| g.items[t].bytes()).sum(),
                root: g.root,
            };
            self.watch(w, begun, g.own, g.call, what, id, limit)?;
        }
        Ok(())
    }

    /// Queues call `call` (NCCL work on the communicators with id `comms`, which may have
    /// reached the GPU) with the watchdog `w`. Where that fails other than because those
    /// communicators are being aborted (the error then names the call), they are aborted:
    /// nothing would bound the work's wait for its peers otherwise.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn watch(
        &self,
        w: &Watchdog,
        begun: watchdog::Begun,
        own: &[&Arc<CudaStream>],
        call: u64,
        what: Watched,
        comms: u64,
        limit: Duration,
    ) -> Result<()> {
        match w.watch(begun, own, call, what, comms) {
            Err(e) if !matches!(e, Error::CommunicatorsAborted { .. }) => {
                let reason = format!("watching NCCL call {call} failed: {e}");
                self.abort_if_live(Some(w), comms, reason, limit);
                Err(e)
            }
            watched => watched,
        }
    }

    /// Aborts the communicators with id `comms`, if they are still the live ones, for
    /// `reason` (naming the calls queued with `watchdog` on them); nothing where they cannot
    /// be locked within `limit`.
    pub(crate) fn abort_if_live(
        &self,
        watchdog: Option<&Watchdog>,
        comms: u64,
        reason: String,
        limit: Duration,
    ) {
        if let Some(mut nccl) = self.lock_within(limit) {
            if nccl.live_id() == comms {
                abort_watched(watchdog, &mut nccl, reason);
            }
        }
    }

    /// Notes an NCCL step queued while `capturing`.
    pub(crate) fn note_step(&mut self, capturing: bool) {
        self.captured |= capturing;
    }

    /// Ends the capture in progress: whether its graph holds an NCCL step.
    pub(crate) fn end_capture(&mut self) -> bool {
        std::mem::take(&mut self.captured)
    }
}

/// One grouped broadcast as the engine hands it over: call number `call`, of `tensors` of
/// `items` from job rank `root` (local rank `root_local` here, if this process holds it), local
/// rank `r`'s part queued on `streams[r]` (its own stream, or its capture stream), and `own[r]`
/// its own stream, where the watchdog's events go.
pub(crate) struct Group<'a> {
    pub call: u64,
    pub root: usize,
    pub root_local: Option<usize>,
    pub items: &'a [Item],
    pub tensors: &'a [usize],
    pub streams: &'a [CUstream],
    pub own: &'a [&'a Arc<CudaStream>],
    pub capturing: bool,
}

/// Aborts the communicators in `nccl` (locked) for `reason`, first naming the calls queued
/// with `watchdog` on them, which lose their kernels to the abort too.
pub(crate) fn abort_watched(watchdog: Option<&Watchdog>, nccl: &mut Nccl, reason: String) {
    if let Some(w) = watchdog {
        w.fail_all(&reason, nccl.live_id());
    }
    nccl.abort(reason);
}

/// `comms` as live communicators whose detached aborts count in `aborting`.
fn counted(mut comms: Comms, aborting: &Arc<AtomicUsize>) -> Nccl {
    comms.aborting = aborting.clone();
    Nccl::Live(comms)
}

/// Locks `m`, waiting at most `limit`.
pub(crate) fn lock_within(m: &Mutex<Nccl>, limit: Duration) -> Option<MutexGuard<'_, Nccl>> {
    let mut guard = None;
    // The clock is read only once the first try failed (`wait::until`): not on every call.
    crate::wait::until(limit, || {
        guard = match m.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        guard.is_some()
    });
    guard
}
