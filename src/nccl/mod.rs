//! The NCCL path: communicators, grouped broadcasts, and abort.

mod lib;

use std::ffi::{c_int, c_void};
use std::time::{Duration, Instant};

use crate::wait::Backoff;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t};

use crate::error::{Error, Result};
pub use lib::nccl_version;
pub(crate) use lib::{Config, NcclLib, UniqueId};

/// One communicator handle. NCCL allows a communicator to be used from any thread, one call at
/// a time: it is `Send`, and `Comms` is only reached under the engine's lock.
struct Comm(ncclComm_t);

// SAFETY: an ncclComm_t is a heap object of the NCCL library, not tied to the thread that made
// it; calls on it must not overlap, which the engine's lock guarantees (`Comms` is not `Sync`).
unsafe impl Send for Comm {}

/// One rank's part of a broadcast.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RankOp {
    pub send: u64,
    pub recv: u64,
    pub stream: CUstream,
}

/// The NCCL communicators of the ranks this process drives, one per rank, released on drop
/// (destroyed when idle, aborted otherwise).
pub(crate) struct Comms {
    lib: &'static NcclLib,
    comms: Vec<Comm>,
}

impl Comms {
    /// One communicator per rank of a clique of this process (rank i on `ctxs[i]`), within
    /// `timeout`.
    pub(crate) fn init_all(
        ctxs: &[&cudarc::driver::CudaContext],
        timeout: Duration,
    ) -> Result<Comms> {
        let id = Comms::unique_id()?;
        let ranks: Vec<_> = ctxs.iter().enumerate().map(|(r, c)| (r, *c)).collect();
        Comms::init_ranks(&id, ctxs.len(), &ranks, timeout)
    }

    /// A fresh unique id (on the job's rank 0), to be shared with every rank.
    pub(crate) fn unique_id() -> Result<UniqueId> {
        let lib = NcclLib::get()?;
        let mut id = UniqueId([0; 128]);
        // SAFETY: `id` is a valid out pointer of ncclUniqueId's size.
        let code = unsafe { (lib.get_unique_id)(&mut id) };
        lib.check(code, std::ptr::null_mut(), || "ncclGetUniqueId".into())?;
        Ok(id)
    }

    /// One communicator per local rank of a job of `world` ranks that shares `id`:
    /// `ranks[i]` is (global rank, context) of local rank i. Waits until every rank of the job
    /// has joined (`ncclCommInitRankConfig`, in one group for several local ranks), at most
    /// `timeout`: the communicators are non-blocking, so that no NCCL call can block for
    /// longer than gpucast lets it.
    pub(crate) fn init_ranks(
        id: &UniqueId,
        world: usize,
        ranks: &[(usize, &cudarc::driver::CudaContext)],
        timeout: Duration,
    ) -> Result<Comms> {
        let deadline = Instant::now() + timeout;
        let lib = NcclLib::get()?;
        let n = c_int::try_from(world).expect("world sizes are validated");
        let mut raw = vec![std::ptr::null_mut(); ranks.len()];
        let grouped = ranks.len() > 1;
        if grouped {
            // SAFETY: no preconditions.
            let code = unsafe { (lib.group_start)() };
            lib.check(code, std::ptr::null_mut(), || "ncclGroupStart".into())?;
        }
        let mut status = Ok(());
        let pending = |code| if code == lib::IN_PROGRESS { 0 } else { code };
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
            config.blocking = 0;
            let rank = c_int::try_from(*global).expect("ranks are validated");
            // SAFETY: `slot` is an out pointer, `id` the job's id, `config` a valid config.
            let code = unsafe { (lib.comm_init_rank_config)(slot, n, *id, rank, &mut config) };
            if let Err(e) = lib.check(pending(code), std::ptr::null_mut(), || {
                format!("ncclCommInitRankConfig for rank {global} of {world}")
            }) {
                status = Err(e);
                break;
            }
        }
        if grouped {
            // SAFETY: matches the ncclGroupStart above.
            let code = unsafe { (lib.group_end)() };
            status = status.and(lib.check(pending(code), std::ptr::null_mut(), || {
                "ncclGroupEnd after ncclCommInitRankConfig".into()
            }));
        }
        let comms = Comms {
            lib,
            comms: raw.into_iter().filter(|c| !c.is_null()).map(Comm).collect(),
        };
        if status.is_ok() {
            status = comms.wait_ready(deadline, || {
                format!("creating the NCCL communicators of a job of {world} ranks (a rank did not join)")
            });
        }
        match status {
            Ok(()) => Ok(comms),
            Err(e) => {
                comms.abort();
                Err(e)
            }
        }
    }

    /// Enqueues, inside one NCCL group, a broadcast of every `(count, dtype, ops)` entry, where
    /// `ops[rank]` is that rank's part.
    ///
    /// On a failure inside the group the group is ended (NCCL cancels a group in which a call
    /// failed) and `Err` is returned: the caller must abort the communicators, since a rank
    /// whose part was enqueued could otherwise wait forever for a peer whose part was not.
    ///
    /// # Safety
    /// Each `recv` points to `count` elements of `dtype` on its rank's device, each `send` as
    /// many (the root's source; the others' equal their `recv`), each stream is a live stream of
    /// its rank's device; the buffers stay valid until the streams pass this point.
    pub(crate) unsafe fn broadcast_group<'a>(
        &mut self,
        root: usize,
        entries: impl Iterator<Item = (usize, ncclDataType_t, &'a [RankOp])>,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let root_c = c_int::try_from(root).expect("root is validated to be < 8");
        // SAFETY: ncclGroupStart has no preconditions.
        let code = unsafe { (self.lib.group_start)() };
        self.lib
            .check(code, std::ptr::null_mut(), || "ncclGroupStart".into())?;
        let mut failure = None;
        'outer: for (count, dtype, ops) in entries {
            for (rank, (op, comm)) in ops.iter().zip(&self.comms).enumerate() {
                // SAFETY: pointers and stream are valid per this function's contract.
                let code = unsafe {
                    (self.lib.broadcast)(
                        op.send as *const c_void,
                        op.recv as *mut c_void,
                        count,
                        dtype,
                        root_c,
                        comm.0,
                        op.stream,
                    )
                };
                if let Err(e) = self
                    .lib
                    .check(code, comm.0, || format!("ncclBroadcast on rank {rank}"))
                {
                    failure = Some(e);
                    break 'outer;
                }
            }
        }
        // SAFETY: matches the ncclGroupStart above (also on failure: it resets this thread's
        // group state, and NCCL drops a group in which a call failed).
        let code = unsafe { (self.lib.group_end)() };
        if let Some(e) = failure {
            return Err(e);
        }
        if code == lib::IN_PROGRESS {
            // Non-blocking communicators finish the group's work (connecting to peers on the
            // first call) in the background.
            return self.wait_ready(deadline, || "queueing a grouped ncclBroadcast".into());
        }
        self.lib
            .check(code, std::ptr::null_mut(), || "ncclGroupEnd".into())
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
            self.lib.check(code, comm.0, || {
                format!("ncclCommGetAsyncError on rank {rank}")
            })?;
            match state {
                0 => {}
                lib::IN_PROGRESS => busy = true,
                e => self
                    .lib
                    .check(e, comm.0, || format!("{} (rank {rank})", during()))?,
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
        for (rank, comm) in std::mem::take(&mut self.comms).into_iter().enumerate() {
            // SAFETY: `comm` is live and never used again.
            let code = unsafe { (self.lib.comm_abort)(comm.0) };
            // A non-blocking communicator may finish its abort in the background.
            let code = if code == lib::IN_PROGRESS { 0 } else { code };
            if let Err(e) = self.lib.check(code, std::ptr::null_mut(), || {
                format!("ncclCommAbort rank {rank}")
            }) {
                tracing::warn!(error = %e, "could not abort an NCCL communicator");
            }
        }
    }
}

impl Drop for Comms {
    /// Destroys the communicators. The engine only lets this run when their streams are idle
    /// (it aborts them otherwise), so `ncclCommDestroy` has nothing to wait for.
    fn drop(&mut self) {
        for (rank, comm) in std::mem::take(&mut self.comms).into_iter().enumerate() {
            // SAFETY: `comm` is live and is not used again.
            let code = unsafe { (self.lib.comm_destroy)(comm.0) };
            let code = if code == lib::IN_PROGRESS { 0 } else { code };
            if let Err(e) = self.lib.check(code, std::ptr::null_mut(), || {
                format!("ncclCommDestroy rank {rank}")
            }) {
                tracing::warn!(error = %e, "could not destroy an NCCL communicator");
            }
        }
    }
}

/// Whole milliseconds of `d`, saturating.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
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

    /// Aborts the communicators (if live) and remembers why.
    pub(crate) fn abort(&mut self, reason: String) {
        if let Nccl::Live(_) = self {
            if let Nccl::Live(comms) = std::mem::replace(self, Nccl::Aborted(reason.clone())) {
                tracing::warn!(%reason, "aborting the NCCL communicators");
                comms.abort();
            }
        }
    }
}
