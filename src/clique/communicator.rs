//! One rank of a job that runs one process per GPU (torchrun, Slurm, MPI): the communicator.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};

use super::{setup, Capture, CliqueGraph, Core, GraphBuffers, RankBroadcast};
use crate::config::{
    host_id, BroadcastOptions, BroadcastPath, Route, Settings, Thresholds,
    DEFAULT_P2P_MAX_ACROSS_PROCESSES, DEFAULT_P2P_MAX_ACROSS_PROCESSES_IN_GRAPHS, MAX_GPUS,
};
use crate::dtype::Element;
use crate::engine::{Engine, Rank};
use crate::error::{Error, Result};
use crate::nccl::{Comms, Nccl, UniqueId};
use crate::p2p::P2p;
use crate::ranks::JobRank;
use gpucast_rendezvous::{Exchange, JobEnv, Rendezvous};

/// Longest a rank that cannot take part keeps trying to tell the others (in the background).
const ANNOUNCE_WITHIN: Duration = Duration::from_secs(30);

/// Default bound on finding the other ranks and setting up NCCL and P2P with them.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(300);

/// Builds a [`Communicator`]: who this rank is, how it finds the others, and the same settings
/// as [`super::CliqueBuilder`] (which every rank must choose alike).
#[derive(Default)]
pub struct CommunicatorBuilder {
    job: Option<JobEnv>,
    device: Option<usize>,
    exchange: Option<Box<dyn Exchange + Send + Sync>>,
    init_timeout: Option<Duration>,
    shared_devices: bool,
    requested: BroadcastOptions,
}

impl std::fmt::Debug for CommunicatorBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommunicatorBuilder")
            .field("job", &self.job)
            .field("device", &self.device)
            .field("exchange", &self.exchange.as_ref().map(|_| "caller's"))
            .field("init_timeout", &self.init_timeout)
            .field("shared_devices", &self.shared_devices)
            .field("requested", &self.requested)
            .finish()
    }
}

impl CommunicatorBuilder {
    /// Who this process is in the job (default: [`JobEnv::from_env`], what torchrun or Slurm
    /// set).
    pub fn job(mut self, job: JobEnv) -> Self {
        self.job = Some(job);
        self
    }

    /// The CUDA device of this rank (default: its local rank, as torchrun assigns GPUs).
    pub fn device(mut self, ordinal: usize) -> Self {
        self.device = Some(ordinal);
        self
    }

    /// Exchange initialisation data through the caller's all-gather (MPI, a framework's process
    /// group) instead of gpucast's store. Its rank and size define the job.
    pub fn exchange(mut self, exchange: impl Exchange + Send + Sync + 'static) -> Self {
        self.exchange = Some(Box::new(exchange));
        self
    }

    /// Bound on the whole initialisation: the rendezvous, NCCL's and P2P's setup (default 300 s).
    pub fn init_timeout(mut self, timeout: Duration) -> Self {
        self.init_timeout = Some(timeout);
        self
    }

    /// Lets several ranks of the job use one GPU (every rank must choose alike): for testing
    /// what runs across processes (the rendezvous, the descriptor exchange, the P2P kernel
    /// over shared memory, its faults) with fewer GPUs. NCCL needs one GPU per rank, so the
    /// NCCL path is off in such a job ([`Error::NcclUnavailable`]) and `Auto` never takes it;
    /// ranks of one GPU share its bandwidth: do not benchmark it.
    ///
    /// What such a job can and cannot show: it runs every protocol and checks every byte, but
    /// processes on one GPU time-slice it (the GPU runs one process's kernels at a time and
    /// switches every millisecond or so), so a P2P kernel waiting for another process's kernel
    /// keeps the GPU until its slice ends. A small broadcast then takes about a millisecond
    /// (ranks of one process on one GPU: microseconds), and copies are device-local: no timing
    /// of such a job says anything about links, NCCL or separate GPUs. A timeout shorter than
    /// a few time slices fails calls that would succeed on separate GPUs.
    pub fn shared_devices(mut self, on: bool) -> Self {
        self.shared_devices = on;
        self
    }

    super::settings_setters!();

    /// Joins the job: every rank of it must call this.
    pub fn build(self) -> Result<Communicator> {
        Communicator::create(self)
    }
}

/// One rank of a job that runs one process per GPU.
///
/// Every rank builds one ([`Communicator::from_env`] under torchrun or Slurm, or
/// [`Communicator::builder`] with the caller's exchange), then every rank calls the same
/// broadcasts in the same order, each with its own buffer: the root's buffer is the source,
/// the others receive it (as `torch.distributed.broadcast`). Ranks on one host (the same host
/// id: host name and machine id, or `GPUCAST_HOST_ID`) use gpucast's P2P kernel over shared
/// memory that they map once at initialisation, with no exchange per call; a job across hosts
/// uses NCCL.
///
/// Ordering, threads and failures are as for [`super::Clique`]: every buffer may be dropped or
/// reused as soon as a call returns, calls go through one lock, every P2P wait is bounded.
/// Every rank must pass buffers of the same length and type and use the same settings (the
/// settings are checked at initialisation; on one host each call is checked against the peers'
/// through a call log in shared memory, [`Error::CallMismatch`]; across hosts a length that
/// differs is caught only as a timeout). After a P2P timeout across processes the communicator's P2P path closes (NCCL
/// keeps working): create a new communicator to use it again.
pub struct Communicator {
    core: Core,
    job: JobEnv,
    host: String,
    same_host: bool,
    init_time: Duration,
}

/// What every rank tells the others first: its host, its settings, its device.
fn card(host: &str, settings: &Settings, shared: bool, ordinal: usize) -> Vec<u8> {
    format!(
        "{host}\n{:?}|{}|{}|{:?}|shared devices {shared}\n{ordinal}",
        settings.path,
        settings.thresholds.p2p_max_bytes,
        settings.thresholds.packet_max_bytes,
        settings.timeouts.wait
    )
    .into_bytes()
}

/// Round 1: every rank's host, settings and device. Every rank must have chosen the same
/// settings; whether every rank is on this host.
fn round_cards(
    exchange: &(dyn Exchange + Send + Sync),
    host: &str,
    settings: &Settings,
    shared: bool,
    ordinal: usize,
) -> Result<bool> {
    let rank = exchange.rank();
    let mine = card(host, settings, shared, ordinal);
    let cards = exchange.all_gather(&mine)?;
    let line = |c: &[u8], i: usize| {
        String::from_utf8_lossy(c)
            .split('\n')
            .nth(i)
            .unwrap_or_default()
            .to_string()
    };
    for (r, c) in cards.iter().enumerate() {
        if line(c, 1) != line(&mine, 1) {
            return Err(Error::InvalidSetting {
                name: "settings",
                reason: format!(
                    "rank {r} uses {}, rank {rank} uses {}: every rank must choose the same path, thresholds, timeout and shared_devices",
                    line(c, 1),
                    line(&mine, 1)
                ),
            });
        }
    }
    Ok(cards.iter().all(|c| line(c, 0) == host))
}

/// Round 2: NCCL's id from rank 0, then this rank's communicator (none where ranks may share
/// a GPU: NCCL refuses two ranks on one device).
fn round_nccl(
    exchange: &(dyn Exchange + Send + Sync),
    ctx: &Arc<CudaContext>,
    shared: bool,
    init_timeout: Duration,
) -> Result<Nccl> {
    if shared {
        return Ok(Nccl::Off(
            "the job lets ranks share a GPU (`shared_devices`), and NCCL needs one device per \
             rank"
                .into(),
        ));
    }
    let (rank, world) = (exchange.rank(), exchange.world_size());
    let id = if rank == 0 {
        Comms::unique_id()?.0.to_vec()
    } else {
        Vec::new()
    };
    let id = exchange.broadcast_from(0, &id)?;
    let id = UniqueId(
        id.try_into()
            .map_err(|_| Error::InvalidArgument("rank 0's NCCL id is not 128 bytes".into()))?,
    );
    Ok(Nccl::Live(Comms::init_ranks(
        &id,
        world,
        &[(rank, ctx.clone())],
        init_timeout,
    )?))
}

/// Rounds 3 and 4 (on one host): shared memory for the P2P kernel, or why there is none.
fn rounds_p2p(
    exchange: &(dyn Exchange + Send + Sync),
    ctx: &Arc<CudaContext>,
    same_host: bool,
    settings: &Settings,
    deadline: Instant,
) -> Result<P2p> {
    let (rank, world) = (exchange.rank(), exchange.world_size());
    if !same_host {
        Err(Error::P2pUnavailable(
            "the ranks are on several hosts: P2P runs within one host only".into(),
        ))
    } else if world > MAX_GPUS {
        Err(Error::P2pUnavailable(format!(
            "{world} ranks on one host: the P2P kernel takes at most {MAX_GPUS}"
        )))
    } else if world == 1 {
        P2p::new(std::slice::from_ref(ctx), settings.timeouts.wait, false)
    } else {
        P2p::new_ipc(ctx, rank, world, exchange, settings.timeouts.wait, deadline)
    }
}

impl Communicator {
    /// Joins the job described by the environment torchrun or Slurm set (`RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, ...), on GPU `LOCAL_RANK`,
    /// through torchrun's own store under torchrun, else a TCP store that rank 0 hosts (see
    /// [`gpucast_rendezvous::Rendezvous::connect`]). Set `GPUCAST_JOB_TOKEN` to the same secret
    /// on every rank: it is what keeps other processes out of the job.
    pub fn from_env() -> Result<Communicator> {
        Communicator::builder().build()
    }

    /// A builder for other settings.
    pub fn builder() -> CommunicatorBuilder {
        CommunicatorBuilder::default()
    }

    fn create(b: CommunicatorBuilder) -> Result<Communicator> {
        let started = Instant::now();
        let init_timeout = b.init_timeout.unwrap_or(DEFAULT_INIT_TIMEOUT);
        if init_timeout.is_zero() {
            return Err(Error::InvalidSetting {
                name: "init_timeout",
                reason: "must be longer than zero".into(),
            });
        }
        let deadline = crate::util::later(init_timeout);
        let job = match b.job {
            Some(j) => j,
            None => JobEnv::from_env()?,
        };
        let env = BroadcastOptions::from_env()?;
        let mut settings = Settings::resolve(&b.requested, &env, job.local_world_size.max(1))?;
        let limit_set = b.requested.over(&env).p2p_threshold.is_some();
        // What this machine can tell alone comes before waiting for peers that may never come;
        // the peers hear it from a thread of gpucast's rendezvous (a caller's exchange has its
        // own way to fail).
        let ordinal = b.device.unwrap_or(job.local_rank);
        let usable = setup::device_count().and_then(|available| {
            if ordinal < available {
                Ok(())
            } else {
                Err(Error::DeviceOutOfRange { ordinal, available })
            }
        });
        if let Err(e) = usable {
            if b.exchange.is_none() {
                let reason = format!("rank {} cannot take part: {e}", job.rank);
                Rendezvous::announce_failure(&job, reason, init_timeout.min(ANNOUNCE_WITHIN));
            }
            return Err(e);
        }
        let exchange: Box<dyn Exchange + Send + Sync> = match b.exchange {
            Some(x) => x,
            None => Box::new(Rendezvous::connect(&job, init_timeout)?),
        };
        let (rank, world) = (exchange.rank(), exchange.world_size());
        if rank != job.rank || world != job.world_size {
            return Err(Error::InvalidArgument(format!(
                "the exchange says rank {rank} of {world}, the job rank {} of {}",
                job.rank, job.world_size
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(Error::cuda(format!(
            "creating a context on device {ordinal}"
        )))?;

        let host = host_id(gpucast_rendezvous::env_var);
        let shared = b.shared_devices;
        let same_host = round_cards(exchange.as_ref(), &host, &settings, shared, ordinal)?;
        if same_host && world > 1 {
            settings.thresholds = settings
                .thresholds
                .across_processes(limit_set, DEFAULT_P2P_MAX_ACROSS_PROCESSES);
            settings.graph_thresholds = settings
                .graph_thresholds
                .across_processes(limit_set, DEFAULT_P2P_MAX_ACROSS_PROCESSES_IN_GRAPHS);
        }
        let nccl = round_nccl(exchange.as_ref(), &ctx, shared, init_timeout)?;
        let p2p = rounds_p2p(exchange.as_ref(), &ctx, same_host, &settings, deadline);
        let calls = if same_host && world > 1 {
            super::calls::setup(exchange.as_ref(), deadline)?
        } else {
            None
        };
        let status = p2p.as_ref().map(|_| ()).map_err(Clone::clone);
        let engine = Engine::new(
            vec![Rank::new(JobRank(rank), ctx, None)?],
            settings,
            nccl,
            p2p,
        )?;
        let init_time = started.elapsed();
        tracing::info!(
            rank,
            world,
            device = ordinal,
            %host,
            same_host,
            p2p = status.is_ok(),
            init_ms = init_time.as_secs_f64() * 1e3,
            "communicator created"
        );
        Ok(Communicator {
            core: Core::new(
                engine,
                super::core::Placement {
                    globals: vec![JobRank(rank)],
                    world,
                    copy_engine: Err(Error::CopyEngineUnavailable(
                        "the ranks are separate processes: a rank's copy engines cannot \
                         address the buffers of another process"
                            .into(),
                    )),
                    nccl_on: !shared,
                    calls,
                },
            ),
            job,
            host,
            same_host,
            init_time,
        })
    }

    /// This process's rank in the job.
    pub fn rank(&self) -> usize {
        self.core.globals[0].0
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.core.world
    }

    /// This process's rank among the ranks of its node.
    pub fn local_rank(&self) -> usize {
        self.job.local_rank
    }

    /// The index of this process's node.
    pub fn node(&self) -> usize {
        self.job.node
    }

    /// The host id this rank reported (`GPUCAST_HOST_ID` or the machine's).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// Whether every rank of the job is on this host.
    pub fn single_host(&self) -> bool {
        self.same_host
    }

    /// How long the initialisation took (rendezvous, NCCL, P2P).
    pub fn init_time(&self) -> Duration {
        self.init_time
    }

    /// CUDA ordinal of this rank's device.
    pub fn device(&self) -> usize {
        self.core.places[0].ordinal
    }

    /// This rank's CUDA context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.core.engine.rank(0).ctx
    }

    /// The stream every broadcast of this rank runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.core.stream(0)
    }

    /// `Ok` if the P2P kernel can run, otherwise the error a forced P2P call returns.
    pub fn p2p_available(&self) -> Result<()> {
        self.core.p2p_available()
    }

    /// The thresholds `Auto` uses.
    pub fn thresholds(&self) -> Thresholds {
        self.core.engine.settings().thresholds
    }

    /// The route a broadcast of `bytes` bytes would take with `options`.
    pub fn route(&self, bytes: usize, options: &BroadcastOptions) -> Result<Route> {
        self.core.route(bytes, options)
    }

    /// Hands NCCL broadcasts to the watchdog (`true`, the default) or not. Without it an NCCL
    /// broadcast whose peer never arrives waits forever: this exists to measure what the
    /// watchdog costs (the benchmark's `nccl-nowatch`), not for use.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn set_watchdog(&self, on: bool) {
        self.core.engine.set_watchdog(on);
    }

    /// Captures the broadcasts that `f` queues into a CUDA graph that owns `buffers` (see
    /// [`super::Clique::capture`]); inside, `c.broadcast_in_place(root, buffer)` as eagerly.
    pub fn capture<'c, B, F>(&'c self, buffers: B, f: F) -> Result<CliqueGraph<'c, B>>
    where
        B: GraphBuffers,
        F: FnOnce(&mut Capture<'c, Communicator>, &mut B) -> Result<()>,
    {
        self.core.capture(buffers, f)
    }

    /// [`Communicator::capture`] of buffers that the caller keeps alive and orders itself.
    ///
    /// # Safety
    /// As for [`super::Clique::capture_unchecked`].
    pub unsafe fn capture_unchecked<'c, F>(&'c self, f: F) -> Result<CliqueGraph<'c>>
    where
        F: FnOnce(&mut Capture<'c, Communicator>) -> Result<()>,
    {
        // SAFETY: the same contract.
        unsafe { self.core.capture_unchecked(f) }
    }

    /// Runs `f`: checks of a binding's own (the Python package's) and then one broadcast of
    /// this communicator. When `f` fails before its broadcast reached gpucast, the call still
    /// takes its number in the call log, as a failed call: the peers on this host, which made
    /// it, get [`Error::CallMismatch`] instead of a timeout, and this rank's later calls keep
    /// their numbers. A Rust program that calls gpucast directly needs none of this.
    pub fn as_one_call<R, E>(
        &self,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        let posted = self.core.calls_posted();
        let result = f();
        if result.is_err() && self.core.calls_posted() == posted {
            self.core.post_failed_call();
        }
        result
    }

    /// A zeroed buffer of `len` elements on this rank's stream.
    pub fn alloc<T: Element>(&self, len: usize) -> Result<CudaSlice<T>> {
        Ok(self.core.alloc_outputs(len)?.remove(0))
    }

    /// Number of calls queued so far by this rank (see [`crate::clique::Clique::calls`]).
    pub fn calls(&self) -> u64 {
        self.core.engine.calls()
    }

    /// Waits until this rank's broadcasts so far have finished, then reports any failure: a
    /// P2P wait that timed out, or the watchdog's abort of NCCL after a peer did not arrive
    /// within the timeout (a dead or stalled process), or a call that a peer on this host made
    /// with other arguments ([`Error::CallMismatch`]). After its own work, it waits up to the
    /// timeout for the peers on this host to post the calls this rank made (so that a
    /// difference is reported here too); the whole wait is bounded (three times the timeout
    /// plus two seconds). After an abort the NCCL path of this communicator stays closed: the
    /// surviving processes create a new `Communicator` (a new rendezvous) to go on.
    pub fn synchronize(&self) -> Result<()> {
        self.core.synchronize()
    }

    /// Makes this rank's stream wait for the work queued so far on `stream`.
    pub fn wait_for(&self, stream: &CudaStream) -> Result<()> {
        self.core.wait_for(&[stream])
    }

    /// An event after the work queued so far on this rank's stream.
    pub fn record(&self) -> Result<CudaEvent> {
        Ok(self.core.record()?.remove(0))
    }
}

impl super::sealed::Eager for Communicator {
    fn core(&self) -> &Core {
        &self.core
    }
}

impl RankBroadcast for Communicator {}

#[cfg(test)]
mod tests {
    use super::*;
    use gpucast_rendezvous::RendezvousError;

    /// Rank 0 of a job whose other ranks send `others`.
    struct Fake {
        others: Vec<Vec<u8>>,
    }

    impl Exchange for Fake {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            self.others.len() + 1
        }
        fn all_gather(&self, mine: &[u8]) -> std::result::Result<Vec<Vec<u8>>, RendezvousError> {
            Ok(std::iter::once(mine.to_vec())
                .chain(self.others.iter().cloned())
                .collect())
        }
    }

    fn settings(timeout_ms: u64) -> Settings {
        let req = BroadcastOptions {
            timeout: Some(Duration::from_millis(timeout_ms)),
            ..BroadcastOptions::default()
        };
        Settings::resolve(&req, &BroadcastOptions::default(), 1).unwrap()
    }

    #[test]
    fn ranks_with_the_same_settings_join_and_learn_whether_they_share_a_host() {
        let s = settings(5000);
        let same = Fake {
            others: vec![card("host-a", &s, false, 1), card("host-a", &s, false, 2)],
        };
        assert!(round_cards(&same, "host-a", &s, false, 0).unwrap());
        let apart = Fake {
            others: vec![card("host-b", &s, false, 0)],
        };
        assert!(!round_cards(&apart, "host-a", &s, false, 0).unwrap());
    }

    #[test]
    fn a_rank_with_other_settings_is_named_before_anything_else_is_set_up() {
        let (mine, theirs) = (settings(5000), settings(7000));
        let other_timeout = Fake {
            others: vec![
                card("host-a", &mine, false, 1),
                card("host-a", &theirs, false, 2),
            ],
        };
        match round_cards(&other_timeout, "host-a", &mine, false, 0) {
            Err(Error::InvalidSetting { name, reason }) => {
                assert_eq!(name, "settings");
                assert!(reason.starts_with("rank 2 uses"), "{reason}");
            }
            other => panic!("expected InvalidSetting, got {other:?}"),
        }
        let other_sharing = Fake {
            others: vec![card("host-a", &mine, true, 1)],
        };
        assert!(matches!(
            round_cards(&other_sharing, "host-a", &mine, false, 0),
            Err(Error::InvalidSetting { .. })
        ));
    }
}
