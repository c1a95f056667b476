//! The public face: a [`Clique`] of GPUs of this process and the broadcasts that run on it.
//!
//! - `setup`: driver checks, contexts and streams, peer access, topology;
//! - `args`: argument checks (pure);
//! - `access`: buffers to addresses, and their ordering with the streams they live on;
//! - `broadcast`: the broadcast family, one trait per argument shape; `graph`: CUDA graph
//!   capture and replay.

mod access;
pub(crate) mod args;
mod broadcast;
mod calls;
mod communicator;
mod core;
mod graph;
mod setup;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};

use crate::config::{BroadcastOptions, BroadcastPath, Route, Thresholds};
use crate::dtype::{DType, Element};
#[allow(
    unused_imports,
    reason = "used by intra-doc links, and by the testing hooks"
)]
use crate::error::Error;
use crate::error::Result;
use crate::ranks::JobRank;
use crate::topology::Topology;
pub(crate) use core::Core;

use broadcast::sealed;
pub use broadcast::{CliqueBroadcast, RankBroadcast, WithOptions};
pub use communicator::{Communicator, CommunicatorBuilder, DEFAULT_INIT_TIMEOUT};
pub use graph::{Capture, CliqueGraph, GraphBuffers};
pub use setup::device_count;

/// The settings every builder shares, set in its layer of settings (a field
/// `requested: BroadcastOptions`, laid over the environment's when it builds): path, thresholds
/// and timeout.
macro_rules! settings_setters {
    () => {
        /// Default path of every broadcast (default [`BroadcastPath::Auto`]).
        pub fn path(mut self, path: BroadcastPath) -> Self {
            self.requested.path = Some(path);
            self
        }

        /// `Auto` takes the P2P kernel for messages of at most this many bytes.
        pub fn p2p_threshold(mut self, bytes: usize) -> Self {
            self.requested.p2p_threshold = Some(bytes);
            self
        }

        /// The P2P kernel uses its packet protocol up to this many bytes, the pull protocol
        /// above.
        pub fn packet_threshold(mut self, bytes: usize) -> Self {
            self.requested.packet_threshold = Some(bytes);
            self
        }

        /// `Auto` takes the copy engines for messages of at least this many bytes, where they
        /// can run (ranks of one process).
        pub fn copy_engine_threshold(mut self, bytes: usize) -> Self {
            self.requested.copy_engine_threshold = Some(bytes);
            self
        }

        /// The P2P kernel sends messages of at least this many bytes along the chain of
        /// ranks (each reads its predecessor and forwards) instead of every peer reading the
        /// root; ranks of one process only. By default from `Auto`'s copy-engine start on more
        /// than 2 GPUs, never on 2.
        pub fn p2p_chain_threshold(mut self, bytes: usize) -> Self {
            self.requested.p2p_chain_threshold = Some(bytes);
            self
        }

        /// Longest any wait of a broadcast may take (a P2P kernel waiting for a peer) before it
        /// is reported as [`Error::Timeout`]. Must be longer than zero.
        pub fn timeout(mut self, timeout: std::time::Duration) -> Self {
            self.requested.timeout = Some(timeout);
            self
        }
    };
}
use settings_setters;

/// Builds a [`Clique`]: which GPUs (or which streams), the default path, thresholds, the
/// timeout and the launch threads.
///
/// Settings not given here come from the environment (`GPUCAST_*`, see the README's table),
/// then from built-in defaults. Invalid settings are errors, before any GPU work.
#[derive(Debug, Default)]
pub struct CliqueBuilder {
    shared_devices: bool,
    devices: Option<Vec<usize>>,
    streams: Option<Vec<Arc<CudaStream>>>,
    requested: BroadcastOptions,
}

impl CliqueBuilder {
    /// Use these CUDA device ordinals; rank `i` of the clique is `ordinals[i]`. Default: every
    /// visible GPU (at most 8).
    pub fn devices(mut self, ordinals: &[usize]) -> Self {
        self.devices = Some(ordinals.to_vec());
        self
    }

    /// Lets [`CliqueBuilder::devices`] name a device more than once: one GPU then holds
    /// several ranks, each with a stream and buffers of its own. This is for testing what
    /// runs on many GPUs (the copy-engine chain, the P2P kernel) with fewer: the P2P kernel
    /// and the copy engines work between ranks of one device, NCCL does not (it needs one
    /// device per rank), so the NCCL path is off in such a clique ([`Error::NcclUnavailable`])
    /// and `Auto` never takes it. Neither do the copy engines run inside a graph there
    /// ([`Error::CopyEngineUnavailable`]; crate docs, "Threads"). Ranks of one device share its
    /// bandwidth: do not benchmark it. Their copies are device-local and their kernels run
    /// side by side in one context, so such a clique shows the protocols, their waits and
    /// faults, and every byte, but no link speed: a timing from it is not one of separate GPUs.
    /// (Separate processes on one GPU time-slice it instead: see
    /// [`CommunicatorBuilder::shared_devices`].)
    pub fn shared_devices(mut self, on: bool) -> Self {
        self.shared_devices = on;
        self
    }

    /// Run on the caller's streams, one per rank in rank order (for example the stream a
    /// framework's device hands out): rank `i` is `streams[i]`'s device, and every broadcast of
    /// rank `i` is queued on `streams[i]`, so it is ordered with the caller's own work on that
    /// stream without any event. Each stream must belong to its device's primary context
    /// (`CudaContext::new`), on distinct devices. Overrides [`CliqueBuilder::devices`].
    pub fn streams(mut self, streams: Vec<Arc<CudaStream>>) -> Self {
        self.streams = Some(streams);
        self
    }

    settings_setters!();

    /// Launch the P2P kernel from one thread per GPU (default `true`; see
    /// [`Clique::set_parallel_launch`]).
    pub fn parallel_launch(mut self, on: bool) -> Self {
        self.requested.parallel_launch = Some(on);
        self
    }

    /// Creates the clique.
    pub fn build(self) -> Result<Clique> {
        let devices = match (self.streams, self.devices) {
            (Some(s), _) => setup::Devices::Streams(s),
            (None, Some(d)) => setup::Devices::Ordinals(d),
            (None, None) => setup::Devices::All,
        };
        let built = setup::create(devices, &self.requested, self.shared_devices)?;
        let n = built.engine.len();
        let job = core::Placement {
            globals: (0..n).map(JobRank).collect(),
            world: n,
            copy_engine: crate::copy::support(&built.topology),
            nccl_on: built.nccl_on,
            calls: None,
        };
        let clique = Clique {
            ordinals: built.topology.ordinals().to_vec(),
            core: Core::new(built.engine, job),
            topology: built.topology,
        };
        tracing::info!(
            devices = ?clique.ordinals,
            nccl = ?crate::nccl::nccl_version().ok(),
            nccl_library = ?crate::nccl::NcclLib::get().map(|l| l.path.as_str()).ok(),
            p2p = clique.core.p2p_available().is_ok(),
            thresholds = ?clique.thresholds(),
            "clique created\n{}", clique.topology
        );
        Ok(clique)
    }
}

/// A set of GPUs of this process that broadcast to each other.
///
/// Rank `i` of the clique is the i-th device given at creation. Each rank has the device's
/// primary context, a stream on which every broadcast of that rank is queued, an NCCL
/// communicator, and a small signal area for the P2P kernel.
///
/// # Ordering
/// Broadcasts are asynchronous: each call queues its work on every rank's
/// [`Clique::stream`] and returns. What a caller may rely on when a call returns:
///
/// - every buffer passed in may be dropped, reused or overwritten at once, on any stream,
///   the context's default stream (`ctx.default_stream()`) and the per-thread stream included:
///   work queued on a buffer's own stream before the call is seen by the broadcast, and the
///   buffer's free and later work on its stream, or on any other stream through cudarc's
///   per-buffer events, come after it;
/// - the clique's streams are cudarc streams, so cudarc tracks every buffer of a clique context
///   with events (its multi-stream mode): each buffer of a call costs an event wait or two
///   before it and one event record after it; a buffer on another stream than its rank's
///   clique stream costs one more record and wait on each side;
/// - to read an output with work cudarc does not see (raw launches, another library), order
///   it with [`Clique::record`] (or make the clique wait for your stream with
///   [`Clique::wait_for`]), or call [`Clique::synchronize`].
///
/// # Threads
/// A clique is `Send` and `Sync`. Every call goes through one lock (the engine), so calls
/// from several threads are serialised in some order, the same on every GPU; a capture holds
/// the lock until it ends, so no other thread's broadcast lands in a graph. A capture records
/// on streams of its own ([`Capture::stream`]), never on `clique.stream(rank)`: work another
/// thread (or the capture closure) queues there, allocations included, stays eager.
///
/// Where one GPU holds several ranks (`shared_devices`), that device's memory pool reuses
/// freed memory only once the free is known complete, never by making one rank's stream wait
/// for another's (which could hold a broadcast's kernel behind its peer's until the timeout).
///
/// # Failures
/// Every P2P wait is bounded by the clique's timeout: a rank that does not arrive gives
/// [`Error::Timeout`] and the signal areas are reset. A watchdog thread aborts the NCCL
/// communicators when an NCCL broadcast that started on every rank has not finished within the
/// timeout, or NCCL reports an error ([`Error::CommunicatorsAborted`], naming the calls with
/// undefined outputs); so does an NCCL call that fails in the middle of a group.
/// [`Clique::synchronize`] waits a bounded time, [`Clique::recover`] rebuilds what failed, and
/// dropping a clique never hangs.
pub struct Clique {
    core: Core,
    topology: Topology,
    ordinals: Vec<usize>,
}

impl Clique {
    /// A clique of the given devices (1 to 8 distinct CUDA ordinals), with default settings.
    ///
    /// ```no_run
    /// let clique = gpucast::Clique::new(&[0, 1])?;
    /// println!("{}", clique.topology());
    /// # Ok::<(), gpucast::Error>(())
    /// ```
    pub fn new(ordinals: &[usize]) -> Result<Clique> {
        Clique::builder().devices(ordinals).build()
    }

    /// A clique of every visible GPU (at most the first 8), with default settings.
    pub fn all() -> Result<Clique> {
        Clique::builder().build()
    }

    /// A builder for other settings.
    pub fn builder() -> CliqueBuilder {
        CliqueBuilder::default()
    }

    /// Number of GPUs.
    pub fn len(&self) -> usize {
        self.ordinals.len()
    }

    /// Always false: a clique has at least one GPU.
    pub fn is_empty(&self) -> bool {
        self.ordinals.is_empty()
    }

    /// CUDA ordinal of each rank.
    pub fn ordinals(&self) -> &[usize] {
        &self.ordinals
    }

    /// The CUDA context of rank `rank` (the device's primary context).
    ///
    /// # Panics
    /// If `rank >= self.len()`.
    pub fn context(&self, rank: usize) -> &Arc<CudaContext> {
        &self.core.engine.rank(rank).ctx
    }

    /// The stream on which rank `rank`'s part of every broadcast runs. Allocate buffers and run
    /// producers and consumers on it for the simplest (and cheapest) ordering.
    ///
    /// # Panics
    /// If `rank >= self.len()`.
    pub fn stream(&self, rank: usize) -> &Arc<CudaStream> {
        self.core.stream(rank)
    }

    /// Which pairs have peer access and over what link.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The thresholds `Auto` uses.
    pub fn thresholds(&self) -> Thresholds {
        self.core.engine.settings().thresholds
    }

    /// The default path of this clique's broadcasts.
    pub fn path(&self) -> BroadcastPath {
        self.core.path()
    }

    /// The bound on every wait.
    pub fn timeout(&self) -> Duration {
        self.core.engine.settings().timeouts.wait
    }

    /// `Ok` if the P2P kernel can run on this clique, otherwise the error a forced P2P call
    /// returns ([`Error::P2pUnavailable`], or [`Error::LibraryMissing`] without NVRTC).
    pub fn p2p_available(&self) -> Result<()> {
        self.core.p2p_available()
    }

    /// Launch the P2P kernel on every GPU at once, from one worker thread per GPU after the
    /// first (`true`, the default on several GPUs), or from the calling thread one GPU after the
    /// other (`false`). Launches cost several microseconds each, so overlapping them shortens
    /// eager broadcasts of small tensors; idle workers spin for 200 us after each broadcast,
    /// then sleep.
    pub fn set_parallel_launch(&self, on: bool) -> Result<()> {
        self.core.engine.lock()?.set_parallel_launch(on);
        Ok(())
    }

    /// Whether P2P launches go through the per-GPU threads (see [`Clique::set_parallel_launch`]).
    pub fn parallel_launch(&self) -> Result<bool> {
        Ok(self.core.engine.lock()?.parallel_launch())
    }

    /// Hands NCCL broadcasts to the watchdog (`true`, the default) or not. Without it an NCCL
    /// broadcast whose peer never arrives waits forever: this exists to measure what the
    /// watchdog costs (the benchmark's `nccl-nowatch`), not for use.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn set_watchdog(&self, on: bool) {
        self.core.engine.set_watchdog(on);
    }

    /// Waits for every queued broadcast, then sets the P2P packet protocol's op counters on
    /// every rank as if op `value` had just finished everywhere: test support, so that the
    /// counters' wrap past `u32::MAX` runs in a test (it takes 2^32 packet broadcasts
    /// otherwise). Not for use.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn set_packet_counters_for_test(&self, value: u32) -> Result<()> {
        self.core.engine.lock()?.set_packet_counters(value)
    }

    /// Makes the next graph launch fail at part `part` of rank `rank`'s graph, without queueing
    /// that part (a graph has one part, or where ranks share a GPU one per P2P step and a last
    /// one); disarmed after that launch whether or not it reached the part. Test support for a
    /// graph launch that reached some ranks and not others. Not for use.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn fail_graph_launch_for_test(&self, rank: usize, part: usize) {
        self.core.engine.fail_graph_launch(rank, part);
    }

    /// Aborts the clique's NCCL communicators as its watchdog does after a fault: later NCCL
    /// calls fail with [`Error::CommunicatorsAborted`] until [`Clique::recover`]. Test
    /// support (with one GPU no NCCL peer can be late). Not for use.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn abort_nccl_for_test(&self) -> Result<()> {
        self.core
            .engine
            .lock()?
            .abort_nccl("aborted by a test".into())
    }

    /// The route a broadcast of `bytes` bytes would take with `options`.
    pub fn route(&self, bytes: usize, options: &BroadcastOptions) -> Result<Route> {
        self.core.route(bytes, options)
    }

    /// Captures the broadcasts that `f` queues through its [`Capture`] into one CUDA graph per
    /// GPU, to be replayed with [`CliqueGraph::launch`]. The graph owns `buffers` and lends
    /// them out between replays ([`CliqueGraph::buffers_mut`]): an input may be rewritten or
    /// an output read between replays, on any stream. `f` gets the capture and the buffers;
    /// every buffer a captured call takes must lie inside them. The P2P kernel keeps its
    /// counters on the device, so every replay runs the protocol afresh, and eager calls may
    /// be mixed with replays.
    ///
    /// ```no_run
    /// use gpucast::prelude::*;
    /// let clique = gpucast::Clique::new(&[0, 1])?;
    /// let input = clique.stream(0).clone_htod(&[1u8; 4096]).unwrap();
    /// let outputs = clique.alloc_outputs::<u8>(4096)?;
    /// let mut graph = clique.capture((input, outputs), |c, (input, outputs)| {
    ///     c.broadcast(0, input, outputs)
    /// })?;
    /// for _ in 0..10 {
    ///     graph.launch()?;
    /// }
    /// let (_input, outputs) = graph.into_buffers();
    /// clique.synchronize()?;
    /// # Ok::<(), gpucast::Error>(())
    /// ```
    pub fn capture<'c, B, F>(&'c self, buffers: B, f: F) -> Result<CliqueGraph<'c, B>>
    where
        B: GraphBuffers,
        F: FnOnce(&mut Capture<'c, Clique>, &mut B) -> Result<()>,
    {
        self.core.capture(buffers, f)
    }

    /// [`Clique::capture`] of buffers that the caller keeps alive and orders itself (static
    /// graph inputs and outputs): the graph holds no buffers, and launches do no per-buffer
    /// ordering.
    ///
    /// # Safety
    /// Every buffer passed to the capture, or touched by work queued on its streams
    /// ([`Capture::stream`]; neither a stream nor a clone of it may be used once the closure
    /// has returned, since it records every later capture of the clique), must stay allocated,
    /// and must not be freed (even by a stream-ordered free on another stream) while any replay
    /// of the graph may still run; work that produces its inputs or reads its outputs must be
    /// ordered with the clique's streams (run it on them, or use [`Clique::wait_for`] /
    /// [`Clique::record`]). The contract covers every call made through this closure's
    /// [`Capture`], also after it was swapped (`std::mem::swap`) into another capture's closure:
    /// an unchecked capture checks nothing, wherever it ends up.
    pub unsafe fn capture_unchecked<'c, F>(&'c self, f: F) -> Result<CliqueGraph<'c>>
    where
        F: FnOnce(&mut Capture<'c, Clique>) -> Result<()>,
    {
        // SAFETY: the same contract.
        unsafe { self.core.capture_unchecked(f) }
    }

    /// Broadcasts raw device addresses: for code that keeps its own `CUdeviceptr`s and streams
    /// (DLPack, tch-rs, burn/cubecl). `b.src` holds `b.count` elements of `b.dtype` on the
    /// root's device; `b.dsts[rank]` receives them on every rank (the root's entry may equal
    /// `src`: in place). The broadcast is ordered after the work queued so far on each rank's
    /// `b.streams[rank]`, and each of those streams is ordered after the broadcast, so work and
    /// stream-ordered frees queued there afterwards see the result.
    ///
    /// # Safety
    /// - `src` and every `dsts[rank]` point to at least `count * dtype.size()` bytes of device
    ///   memory of their rank's device, allocated in its primary context (`cudaMalloc`,
    ///   `cuMemAlloc`, or the device's default memory pool); for the P2P path peers read the
    ///   root's memory, which needs exactly such an allocation. Destinations do not overlap
    ///   each other or `src` (except the root's own, which may equal `src`).
    /// - `streams[rank]` is a live stream of rank `rank`'s device's primary context.
    /// - The memory stays allocated until every `streams[rank]` has passed this point (a
    ///   stream-ordered free queued on it afterwards is fine), and nothing else writes the
    ///   destinations or the source meanwhile unless ordered through those streams.
    pub unsafe fn broadcast_raw(
        &self,
        b: &RawBroadcast<'_>,
        options: &BroadcastOptions,
    ) -> Result<()> {
        // SAFETY: the same contract.
        unsafe { self.core.broadcast_raw(b, options) }
    }

    /// One zeroed output buffer of `len` elements per rank, each on its rank's stream: what
    /// [`Clique::broadcast`] needs for an input of `len` elements.
    pub fn alloc_outputs<T: Element>(&self, len: usize) -> Result<Vec<CudaSlice<T>>> {
        self.core.alloc_outputs(len)
    }

    /// Blocks until every broadcast queued so far has finished on every GPU, then reports any
    /// asynchronous failure: a P2P timeout (after which the signal areas are reset) or an NCCL
    /// error.
    pub fn synchronize(&self) -> Result<()> {
        self.core.synchronize()
    }

    /// Makes each clique stream wait for the work queued so far on `streams[rank]` (one per
    /// rank, on that rank's device): broadcasts queued afterwards see what it produced.
    pub fn wait_for(&self, streams: &[&CudaStream]) -> Result<()> {
        self.core.wait_for(streams)
    }

    /// Records one event per rank after the work queued so far on the clique's streams. Make
    /// your stream wait on `events[rank]` (`stream.wait(&events[rank])`) before it reads that
    /// rank's output.
    pub fn record(&self) -> Result<Vec<CudaEvent>> {
        self.core.record()
    }

    /// Rebuilds what a failure closed, in this process: waits for the clique's streams (at most
    /// twice the timeout plus two seconds), resets the P2P signal areas and the copy-engine
    /// flags, forgets errors not yet reported, and when the NCCL communicators were aborted
    /// ([`Error::CommunicatorsAborted`]) creates new ones. Broadcasts after it are as on a new
    /// clique. Buffers written by the calls that failed keep undefined contents.
    pub fn recover(&self) -> Result<()> {
        let ctxs: Vec<Arc<CudaContext>> =
            (0..self.len()).map(|r| self.context(r).clone()).collect();
        let timeout = self.core.engine.settings().timeouts.nccl_init();
        self.core
            .engine
            .recover(|| crate::nccl::Comms::init_all(&ctxs, timeout))
    }

    /// Number of calls queued so far on this clique: broadcasts (single or fused, the first is
    /// call 1) and graph launches. [`Error::CommunicatorsAborted`] names the calls whose
    /// outputs are undefined by these numbers.
    pub fn calls(&self) -> u64 {
        self.core.engine.calls()
    }

    /// Copies `bytes` bytes from the root's `src` into every other rank's `dsts[rank]` with the
    /// copy engines (`cuMemcpyPeerAsync` on each receiving rank's stream), without ordering the
    /// ranks against each other: a reference for the benchmark.
    ///
    /// # Safety
    /// Raw device addresses: `src` must hold `bytes` bytes on the root's device and each
    /// `dsts[rank]` as many on that rank's device, valid until the streams pass this point; the
    /// caller orders the root's stream with the copies.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub unsafe fn copy_engine_raw(
        &self,
        root: usize,
        src: u64,
        dsts: &[u64],
        bytes: usize,
    ) -> Result<()> {
        let _engine = self.core.engine.lock()?;
        for (rank, &dst) in dsts.iter().enumerate().take(self.len()) {
            if rank == root {
                continue;
            }
            self.context(rank)
                .bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            // SAFETY: per this function's contract; both contexts are live.
            unsafe {
                cudarc::driver::result::memcpy_peer_async(
                    self.context(rank).cu_ctx(),
                    dst,
                    self.context(root).cu_ctx(),
                    src,
                    bytes,
                    self.stream(rank).cu_stream(),
                )
            }
            .map_err(Error::cuda(format!("copying to rank {rank}")))?;
        }
        Ok(())
    }
}

/// A broadcast of raw device addresses, for [`Clique::broadcast_raw`].
#[derive(Debug, Clone, Copy)]
pub struct RawBroadcast<'a> {
    /// The root rank.
    pub root: usize,
    /// The source, on the root's device.
    pub src: CUdeviceptr,
    /// One destination per rank, in rank order.
    pub dsts: &'a [CUdeviceptr],
    /// Number of elements.
    pub count: usize,
    /// Element type.
    pub dtype: DType,
    /// The caller's stream of each rank: the broadcast is ordered after the work queued on it
    /// so far, and it after the broadcast.
    pub streams: &'a [CUstream],
}
