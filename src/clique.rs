//! The clique: GPUs of one process with their contexts, streams, peer access, NCCL
//! communicators and P2P signal areas; and the broadcast that runs on them.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cudarc::driver::sys::{self, CUstream};
use cudarc::driver::{
    result, CudaContext, CudaEvent, CudaGraph, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice,
};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::nccl::{Comms, NcclLib};
use crate::p2p::P2p;
use crate::plan::{self, BufferInfo, Path, Route, Thresholds, MAX_GPUS};
use crate::topology::{Link, Topology};

/// Environment variable bounding every P2P wait, in milliseconds.
pub const TIMEOUT_ENV: &str = "GPUCAST_TIMEOUT_MS";

/// Default bound on a P2P wait.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

const CUDA_HINT: &str =
    "install the NVIDIA driver (it provides libcuda.so.1); in a container, start it with \
GPU access (e.g. `docker run --gpus all` with the NVIDIA container toolkit)";

/// The CUDA version of the driver API gpucast was built against (its `cuda-*` feature).
const BUILT_CUDA: i32 = if cfg!(feature = "cuda-13000") {
    13000
} else if cfg!(feature = "cuda-12090") {
    12090
} else if cfg!(feature = "cuda-12080") {
    12080
} else if cfg!(feature = "cuda-12060") {
    12060
} else {
    12040
};

/// Per-call choices of [`Clique::broadcast_with`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BroadcastOptions {
    /// Path for this call; `None` takes the clique's default.
    pub path: Option<Path>,
    /// `Auto`'s P2P limit in bytes for this call; `None` takes the clique's.
    pub p2p_threshold: Option<usize>,
    /// The P2P kernel's packet/pull switch point for this call; `None` takes the clique's.
    pub packet_threshold: Option<usize>,
}

impl BroadcastOptions {
    /// Options that force `path`.
    pub fn path(path: Path) -> BroadcastOptions {
        BroadcastOptions {
            path: Some(path),
            ..BroadcastOptions::default()
        }
    }
}

/// Builds a [`Clique`]: which GPUs, the default path, thresholds and the P2P timeout.
///
/// Settings not given come from the environment ([`plan::P2P_THRESHOLD_ENV`],
/// [`plan::PACKET_THRESHOLD_ENV`], [`TIMEOUT_ENV`]) and then from built-in defaults.
#[derive(Debug, Clone, Default)]
pub struct CliqueBuilder {
    devices: Option<Vec<usize>>,
    path: Path,
    p2p_threshold: Option<usize>,
    packet_threshold: Option<usize>,
    timeout: Option<Duration>,
}

impl CliqueBuilder {
    /// Use these CUDA device ordinals; rank `i` of the clique is `ordinals[i]`. Default: every
    /// visible GPU (at most 8).
    pub fn devices(mut self, ordinals: &[usize]) -> Self {
        self.devices = Some(ordinals.to_vec());
        self
    }

    /// Default path of every broadcast (default [`Path::Auto`]).
    pub fn path(mut self, path: Path) -> Self {
        self.path = path;
        self
    }

    /// `Auto` takes the P2P kernel for messages of at most this many bytes.
    pub fn p2p_threshold(mut self, bytes: usize) -> Self {
        self.p2p_threshold = Some(bytes);
        self
    }

    /// The P2P kernel uses its packet protocol up to this many bytes, the pull protocol above.
    pub fn packet_threshold(mut self, bytes: usize) -> Self {
        self.packet_threshold = Some(bytes);
        self
    }

    /// Longest a P2P kernel waits for a peer before it gives up and reports [`Error::Timeout`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Creates the clique.
    pub fn build(self) -> Result<Clique> {
        Clique::create(self)
    }
}

/// A set of GPUs of this process that broadcast to each other.
///
/// Rank `i` of the clique is the i-th device given at creation. Each rank has its own CUDA
/// context (the device's primary context), a non-blocking stream on which every broadcast is
/// enqueued, an NCCL communicator, and a small signal area for the P2P kernel.
///
/// # Ordering
/// Broadcasts are asynchronous: they are enqueued on [`Clique::stream`] of each rank and run in
/// that stream's order. Work of your own that produces an input or consumes an output is ordered
/// with them by running it on the same streams, or with [`Clique::wait_for`] /
/// [`Clique::record`] events, or by [`Clique::synchronize`]. The clique's contexts do not track
/// cudarc events per buffer (that costs microseconds per call); buffers allocated on another
/// stream with event tracking on are still waited for when they are passed in.
///
/// Calls on one clique are serialised internally (all GPUs must see P2P operations in the same
/// order), so a clique may be shared between threads.
pub struct Clique {
    ordinals: Vec<usize>,
    ctxs: Vec<Arc<CudaContext>>,
    streams: Vec<Arc<CudaStream>>,
    raw_streams: Vec<CUstream>,
    topology: Topology,
    thresholds: Thresholds,
    pub(crate) default_path: Path,
    pub(crate) comms: Option<Comms>,
    pub(crate) p2p: std::result::Result<P2p, String>,
    launch: Mutex<()>,
}

// SAFETY: every field is Send except the raw stream handles, which are plain identifiers of
// streams owned by `streams`; the driver API is thread-safe.
unsafe impl Send for Clique {}
// SAFETY: as for Send; the broadcast path takes `launch` before touching comms or kernels.
unsafe impl Sync for Clique {}

fn check_libcuda() -> Result<()> {
    // SAFETY: only tries to dlopen libcuda; calls nothing in it.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::LibraryMissing {
            library: "libcuda",
            detail: "libcuda.so could not be opened".into(),
            hint: CUDA_HINT,
        })
    }
}

/// Number of CUDA devices visible to this process.
///
/// A missing driver library is [`Error::LibraryMissing`]; a driver with no device is `Ok(0)`.
pub fn device_count() -> Result<usize> {
    check_libcuda()?;
    match CudaContext::device_count() {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => Ok(0),
        Err(e) => Err(Error::Cuda {
            during: "counting CUDA devices".into(),
            source: e,
        }),
    }
}

fn check_driver_version() -> Result<()> {
    let mut v = 0;
    // SAFETY: `v` is a valid out pointer; the driver is initialised by device_count.
    unsafe { sys::cuDriverGetVersion(&mut v).result() }
        .map_err(Error::cuda("reading the driver version"))?;
    if v < BUILT_CUDA {
        return Err(Error::DriverTooOld {
            driver_major: v / 1000,
            driver_minor: (v % 1000) / 10,
            built_major: BUILT_CUDA / 1000,
            built_minor: (BUILT_CUDA % 1000) / 10,
        });
    }
    Ok(())
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

    fn create(b: CliqueBuilder) -> Result<Clique> {
        let available = device_count()?;
        let ordinals = match b.devices {
            Some(d) => d,
            None if available == 0 => {
                return Err(Error::NoDevice("the driver reports no CUDA device".into()))
            }
            None => (0..available.min(MAX_GPUS)).collect(),
        };
        plan::validate_devices(&ordinals, available)?;
        check_driver_version()?;
        let nccl = NcclLib::get()?;
        let n = ordinals.len();

        let mut thresholds = Thresholds::for_gpus(n);
        if let Some(t) = b
            .p2p_threshold
            .or(plan::bytes_from_env(plan::P2P_THRESHOLD_ENV)?)
        {
            thresholds.p2p_max_bytes = t;
        }
        if let Some(t) = b
            .packet_threshold
            .or(plan::bytes_from_env(plan::PACKET_THRESHOLD_ENV)?)
        {
            thresholds.packet_max_bytes = t;
        }
        let timeout = match b.timeout {
            Some(t) => t,
            None => timeout_from_env()?.unwrap_or(DEFAULT_TIMEOUT),
        };

        let mut ctxs = Vec::with_capacity(n);
        let mut streams = Vec::with_capacity(n);
        for &o in &ordinals {
            let ctx = CudaContext::new(o)
                .map_err(Error::cuda(format!("creating a context on device {o}")))?;
            // SAFETY: the clique orders all of its work by stream (see "Ordering" above); buffers
            // made on these contexts are used on the clique's streams or ordered by the caller.
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx
                .new_stream()
                .map_err(Error::cuda(format!("creating a stream on device {o}")))?;
            ctxs.push(ctx);
            streams.push(stream);
        }
        let raw_streams = streams.iter().map(|s| s.cu_stream()).collect();
        let topology = enable_peer_access(&ordinals, &ctxs)?;
        let comms = Comms::init_all(&ordinals)?;

        let p2p = match topology.p2p_support() {
            Err(why) => Err(why),
            Ok(()) => P2p::new(&ctxs, u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX))
                .map_err(|e| e.to_string()),
        };
        if let Err(why) = &p2p {
            tracing::warn!(reason = %why, "P2P path unavailable: Auto will use NCCL");
        }
        let (maj, min, patch) = nccl.version()?;
        tracing::info!(
            devices = ?ordinals,
            nccl = %format!("{maj}.{min}.{patch}"),
            nccl_library = %nccl.path,
            p2p = p2p.is_ok(),
            p2p_threshold = thresholds.p2p_max_bytes,
            packet_threshold = thresholds.packet_max_bytes,
            "clique created\n{topology}"
        );
        Ok(Clique {
            ordinals,
            ctxs,
            streams,
            raw_streams,
            topology,
            thresholds,
            default_path: b.path,
            comms: Some(comms),
            p2p,
            launch: Mutex::new(()),
        })
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
        &self.ctxs[rank]
    }

    /// The stream on which rank `rank`'s part of every broadcast runs. Allocate buffers and run
    /// producers and consumers on it for the simplest ordering.
    ///
    /// # Panics
    /// If `rank >= self.len()`.
    pub fn stream(&self, rank: usize) -> &Arc<CudaStream> {
        &self.streams[rank]
    }

    /// Which pairs have peer access and over what link.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The thresholds `Auto` uses.
    pub fn thresholds(&self) -> Thresholds {
        self.thresholds
    }

    /// `Ok` if the P2P kernel can run on this clique, otherwise why not.
    pub fn p2p_available(&self) -> std::result::Result<(), &str> {
        self.p2p.as_ref().map(|_| ()).map_err(|s| s.as_str())
    }

    /// Launch the P2P kernel on every GPU at once, from one worker thread per GPU after the
    /// first (`true`, the default on several GPUs unless `GPUCAST_PARALLEL_LAUNCH=0`), or from
    /// the calling thread one GPU after the other (`false`). Launches cost several microseconds
    /// each, so overlapping them shortens eager broadcasts of small tensors; idle workers spin
    /// for 200 us after each broadcast, then sleep.
    pub fn set_parallel_launch(&self, on: bool) {
        if let Ok(p2p) = &self.p2p {
            p2p.set_parallel_launch(on);
        }
    }

    /// Whether P2P launches go through the per-GPU threads (see [`Clique::set_parallel_launch`]).
    pub fn parallel_launch(&self) -> bool {
        self.p2p.as_ref().is_ok_and(P2p::parallel_launch)
    }

    /// The route a broadcast of `bytes` bytes would take with `options`.
    pub fn route(&self, bytes: usize, options: &BroadcastOptions) -> Result<Route> {
        let mut t = self.thresholds;
        if let Some(p) = options.p2p_threshold {
            t.p2p_max_bytes = p;
        }
        if let Some(p) = options.packet_threshold {
            t.packet_max_bytes = p;
        }
        plan::choose(
            options.path.unwrap_or(self.default_path),
            bytes,
            self.p2p_available(),
            &t,
        )
    }

    /// Broadcasts `input` (on the root's GPU) into `outputs[i]` on every rank `i`, the root's
    /// own output included.
    ///
    /// `root` is a clique rank (an index into [`Clique::ordinals`]), not a device ordinal.
    /// `outputs` holds one buffer per rank, in rank order, each as long as `input`. Arguments are
    /// checked before anything is enqueued; a zero-length broadcast does nothing.
    ///
    /// The copy is enqueued on the clique's streams and runs asynchronously; see the type's
    /// "Ordering" section. The path is chosen by the clique's default ([`Path::Auto`] unless
    /// the builder set another).
    pub fn broadcast<T, I, O>(&self, root: usize, input: &I, outputs: &mut [O]) -> Result<()>
    where
        T: Element,
        I: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        self.broadcast_with(root, input, outputs, &BroadcastOptions::default())
    }

    /// [`Clique::broadcast`] with per-call options (path, threshold).
    pub fn broadcast_with<T, I, O>(
        &self,
        root: usize,
        input: &I,
        outputs: &mut [O],
        options: &BroadcastOptions,
    ) -> Result<()>
    where
        T: Element,
        I: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        let infos: Vec<BufferInfo> = outputs.iter().map(|o| info(o)).collect();
        let len = plan::validate_broadcast(&self.ordinals, root, Some(info(input)), &infos)?;
        let bytes = len * std::mem::size_of::<T>();
        let route = self.route(bytes, options)?;
        if route == Route::Empty {
            return Ok(());
        }
        let _guard = self.lock()?;
        let (src, _read) = input.device_ptr(&self.streams[root]);
        let mut dsts = [0u64; MAX_GPUS];
        let mut writes = Vec::with_capacity(outputs.len());
        for (rank, out) in outputs.iter_mut().enumerate() {
            let (ptr, w) = out.device_ptr_mut(&self.streams[rank]);
            dsts[rank] = ptr;
            writes.push(w);
        }
        // SAFETY: validation proved every buffer is on its rank's device and `len` long; the
        // borrows keep them alive until this returns, and the stream order (or cudarc's event
        // guards dropped after the launch) keeps them alive for the enqueued work.
        unsafe { self.enqueue(route, root, src, &dsts[..self.len()], len, T::DTYPE) }
    }

    /// In-place broadcast: `buffers[root]` is the source and every other rank's buffer
    /// receives it. One buffer per rank, in rank order, all of one length.
    pub fn broadcast_in_place<T, B>(&self, root: usize, buffers: &mut [B]) -> Result<()>
    where
        T: Element,
        B: DevicePtrMut<T>,
    {
        self.broadcast_in_place_with(root, buffers, &BroadcastOptions::default())
    }

    /// [`Clique::broadcast_in_place`] with per-call options.
    pub fn broadcast_in_place_with<T, B>(
        &self,
        root: usize,
        buffers: &mut [B],
        options: &BroadcastOptions,
    ) -> Result<()>
    where
        T: Element,
        B: DevicePtrMut<T>,
    {
        let infos: Vec<BufferInfo> = buffers.iter().map(|o| info(o)).collect();
        let len = plan::validate_broadcast(&self.ordinals, root, None, &infos)?;
        let bytes = len * std::mem::size_of::<T>();
        let route = self.route(bytes, options)?;
        if route == Route::Empty {
            return Ok(());
        }
        let _guard = self.lock()?;
        let mut dsts = [0u64; MAX_GPUS];
        let mut writes = Vec::with_capacity(buffers.len());
        for (rank, buf) in buffers.iter_mut().enumerate() {
            let (ptr, w) = buf.device_ptr_mut(&self.streams[rank]);
            dsts[rank] = ptr;
            writes.push(w);
        }
        // SAFETY: as in `broadcast_with`; the root's buffer is both source and destination,
        // which both paths handle (NCCL in place; the kernel skips the root's self-copy).
        unsafe { self.enqueue(route, root, dsts[root], &dsts[..self.len()], len, T::DTYPE) }
    }

    /// Takes the launch lock; first reports (and recovers from) a P2P timeout of an earlier
    /// call, so that no new work is queued behind a broken protocol state.
    pub(crate) fn lock(&self) -> Result<MutexGuard<'_, ()>> {
        let guard = self.launch.lock().unwrap_or_else(|e| e.into_inner());
        if let Ok(p2p) = &self.p2p {
            if let Some(err) = p2p.take_error() {
                self.drain_and_recover(p2p)?;
                return Err(err);
            }
        }
        Ok(guard)
    }

    fn drain_and_recover(&self, p2p: &P2p) -> Result<()> {
        for (rank, s) in self.streams.iter().enumerate() {
            s.synchronize().map_err(Error::cuda(format!(
                "draining rank {rank} after a P2P timeout"
            )))?;
        }
        p2p.recover()
    }

    /// Enqueues one broadcast of `count` elements along `route`.
    ///
    /// # Safety
    /// `src` holds `count` elements on the root's device; `dsts[i]` as many on rank i's device;
    /// all stay valid until the streams pass this point.
    pub(crate) unsafe fn enqueue(
        &self,
        route: Route,
        root: usize,
        src: u64,
        dsts: &[u64],
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        let bytes = count * dtype.size();
        let span = tracing::debug_span!(
            "broadcast",
            root,
            bytes,
            dtype = dtype.name(),
            path = route.name()
        );
        let _enter = span.enter();
        match route {
            Route::Empty => Ok(()),
            Route::Nccl => {
                let comms = self.comms.as_ref().expect("comms live until drop");
                // SAFETY: per this function's contract.
                unsafe { comms.broadcast(root, src, dsts, count, dtype.nccl(), &self.raw_streams) }
            }
            Route::P2pPacket | Route::P2pPull => {
                let p2p = self
                    .p2p
                    .as_ref()
                    .map_err(|why| Error::P2pUnavailable(why.clone()))?;
                let (geometry, params) = p2p.params(route, root, src, bytes);
                // SAFETY: per this function's contract; `launch` covers every rank in order.
                unsafe { p2p.launch(route, geometry, params, dsts, &self.raw_streams) }
            }
        }
    }

    /// Blocks until every broadcast enqueued so far has finished on every GPU, then reports any
    /// asynchronous failure: a P2P timeout (after which the signal areas are reset) or an NCCL
    /// error.
    pub fn synchronize(&self) -> Result<()> {
        for (rank, s) in self.streams.iter().enumerate() {
            s.synchronize()
                .map_err(Error::cuda(format!("synchronising rank {rank}")))?;
        }
        if let Ok(p2p) = &self.p2p {
            if let Some(err) = p2p.take_error() {
                p2p.recover()?;
                return Err(err);
            }
        }
        self.comms.as_ref().map_or(Ok(()), |c| c.async_error())
    }

    /// Makes each clique stream wait for the work queued so far on `streams[rank]` (one per
    /// rank, on that rank's device): broadcasts enqueued afterwards see what it produced.
    pub fn wait_for(&self, streams: &[&CudaStream]) -> Result<()> {
        if streams.len() != self.len() {
            return Err(Error::OutputCount {
                what: "streams",
                expected: self.len(),
                got: streams.len(),
            });
        }
        for (rank, s) in streams.iter().enumerate() {
            let found = s.context().ordinal();
            if found != self.ordinals[rank] {
                return Err(Error::WrongDevice {
                    what: format!("stream {rank}"),
                    rank,
                    expected: self.ordinals[rank],
                    found,
                });
            }
        }
        for (rank, s) in streams.iter().enumerate() {
            self.streams[rank].join(s).map_err(Error::cuda(format!(
                "ordering rank {rank} after a caller stream"
            )))?;
        }
        Ok(())
    }

    /// Records one event per rank after the work queued so far on the clique's streams. Make
    /// your stream wait on `events[rank]` (`stream.wait(&events[rank])`) before it reads that
    /// rank's output.
    pub fn record(&self) -> Result<Vec<CudaEvent>> {
        self.streams
            .iter()
            .enumerate()
            .map(|(rank, s)| {
                s.record_event(None)
                    .map_err(Error::cuda(format!("recording an event on rank {rank}")))
            })
            .collect()
    }

    /// Captures the broadcasts that `f` enqueues into one CUDA graph per GPU, to be replayed
    /// with [`CliqueGraph::launch`]. The P2P kernel keeps its counters on the device, so every
    /// replay runs the protocol afresh; buffers passed inside `f` must outlive the graph.
    pub fn capture<F>(&self, f: F) -> Result<CliqueGraph<'_>>
    where
        F: FnOnce(&Clique) -> Result<()>,
    {
        // Relaxed: the GPUs' captures run side by side on this thread, and ending one (which
        // instantiates its graph) while another is still capturing is an "unsafe" call in the
        // global and thread-local modes (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED).
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        let mut begun = 0;
        let mut status = Ok(());
        for s in &self.streams {
            if let Err(e) = s.begin_capture(mode) {
                status = Err(Error::Cuda {
                    during: "beginning a graph capture".into(),
                    source: e,
                });
                break;
            }
            begun += 1;
        }
        if status.is_ok() {
            status = f(self);
        }
        let mut graphs = Vec::with_capacity(begun);
        for s in &self.streams[..begun] {
            let flags = sys::CUgraphInstantiate_flags(0);
            match s.end_capture(flags) {
                Ok(Some(g)) => graphs.push(g),
                Ok(None) => {
                    // A GPU without a graph would leave its peers waiting at every replay.
                    if status.is_ok() {
                        status = Err(Error::Cuda {
                            during: "ending a graph capture (a GPU's capture produced no graph)"
                                .into(),
                            source: result::DriverError(
                                sys::cudaError_enum::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                            ),
                        });
                    }
                }
                Err(e) => {
                    if status.is_ok() {
                        status = Err(Error::Cuda {
                            during: "ending a graph capture".into(),
                            source: e,
                        });
                    }
                }
            }
        }
        status?;
        Ok(CliqueGraph {
            clique: self,
            graphs,
        })
    }

    /// Copies `bytes` bytes from the root's `src` into every other rank's `dsts[rank]` with the
    /// copy engines (`cuMemcpyPeerAsync`), without ordering the GPUs against each other: the
    /// caller orders them (the benchmark uses it as a reference for link bandwidth).
    ///
    /// # Safety
    /// Raw device addresses: `src` must hold `bytes` bytes on the root's device and each
    /// `dsts[rank]` as many on that rank's device, valid until the streams pass this point.
    #[doc(hidden)]
    pub unsafe fn copy_engine_raw(
        &self,
        root: usize,
        src: u64,
        dsts: &[u64],
        bytes: usize,
    ) -> Result<()> {
        for (rank, &dst) in dsts.iter().enumerate().take(self.len()) {
            if rank == root {
                continue;
            }
            self.ctxs[rank]
                .bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            // SAFETY: per this function's contract; both contexts are live.
            unsafe {
                result::memcpy_peer_async(
                    self.ctxs[rank].cu_ctx(),
                    dst,
                    self.ctxs[root].cu_ctx(),
                    src,
                    bytes,
                    self.raw_streams[rank],
                )
            }
            .map_err(Error::cuda(format!("copying to rank {rank}")))?;
        }
        Ok(())
    }

    /// Raw stream handles in rank order (for the benchmark's reference measurements).
    #[doc(hidden)]
    pub fn raw_streams(&self) -> &[CUstream] {
        &self.raw_streams
    }
}

fn info<T, S: DeviceSlice<T>>(s: &S) -> BufferInfo {
    BufferInfo {
        ordinal: s.stream().context().ordinal(),
        len: s.len(),
    }
}

fn timeout_from_env() -> Result<Option<Duration>> {
    match std::env::var(TIMEOUT_ENV) {
        Err(_) => Ok(None),
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(ms) if ms > 0 => Ok(Some(Duration::from_millis(ms))),
            _ => Err(Error::InvalidSetting {
                name: TIMEOUT_ENV,
                reason: format!("{v:?} is not a positive number of milliseconds"),
            }),
        },
    }
}

/// Enables peer access (context and stream-ordered memory pool) between every pair that
/// supports it, and returns what was found.
fn enable_peer_access(ordinals: &[usize], ctxs: &[Arc<CudaContext>]) -> Result<Topology> {
    let n = ordinals.len();
    let mut links = vec![vec![Link::None; n]; n];
    for i in 0..n {
        links[i][i] = Link::SelfLink;
        for j in 0..n {
            if i == j {
                continue;
            }
            let (di, dj) = (ctxs[i].cu_device(), ctxs[j].cu_device());
            let mut can = 0;
            // SAFETY: valid device handles and out pointer.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, di, dj).result() }
                .map_err(Error::cuda("querying peer access"))?;
            if can == 0 {
                continue;
            }
            ctxs[i]
                .bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            // SAFETY: both contexts are live; enabling twice reports ALREADY_ENABLED, accepted.
            let r = unsafe { sys::cuCtxEnablePeerAccess(ctxs[j].cu_ctx(), 0) };
            if r != sys::cudaError_enum::CUDA_SUCCESS
                && r != sys::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            {
                return Err(Error::Cuda {
                    during: format!(
                        "enabling peer access from device {} to {}",
                        ordinals[i], ordinals[j]
                    ),
                    source: result::DriverError(r),
                });
            }
            // cudarc allocates from the device's current memory pool; peer access to that
            // memory needs the pool's own access list, which cuCtxEnablePeerAccess does not set.
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            // SAFETY: valid device handle and out pointer.
            unsafe { sys::cuDeviceGetMemPool(&mut pool, dj).result() }
                .map_err(Error::cuda("finding a device's memory pool"))?;
            let desc = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: i32::try_from(ordinals[i]).expect("ordinal < 8"),
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: `pool` is device j's live pool; `desc` is one valid descriptor.
            unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1).result() }.map_err(Error::cuda(
                format!(
                    "granting device {} access to device {}'s memory pool",
                    ordinals[i], ordinals[j]
                ),
            ))?;
            let mut atomics = 0;
            // SAFETY: valid devices and out pointer.
            unsafe {
                sys::cuDeviceGetP2PAttribute(
                    &mut atomics,
                    sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                    di,
                    dj,
                )
                .result()
            }
            .map_err(Error::cuda("querying peer attributes"))?;
            links[i][j] = if atomics != 0 {
                Link::NvLink
            } else {
                Link::Pcie
            };
        }
    }
    let names = ctxs
        .iter()
        .map(|c| c.name().unwrap_or_else(|_| "unknown".into()))
        .collect();
    Ok(Topology::new(ordinals.to_vec(), names, links))
}

impl Drop for Clique {
    fn drop(&mut self) {
        for (rank, s) in self.streams.iter().enumerate() {
            if let Err(e) = s.synchronize() {
                tracing::warn!(rank, error = %e, "could not synchronise a stream while dropping the clique");
            }
        }
        // Communicators before the contexts and streams they use.
        drop(self.comms.take());
        drop(std::mem::replace(&mut self.p2p, Err(String::new())));
    }
}

/// A captured sequence of broadcasts: one CUDA graph per GPU of a clique.
pub struct CliqueGraph<'a> {
    clique: &'a Clique,
    graphs: Vec<CudaGraph>,
}

impl CliqueGraph<'_> {
    /// Replays the captured broadcasts on every GPU (asynchronously, on the clique's streams).
    pub fn launch(&self) -> Result<()> {
        let _guard = self.clique.lock()?;
        for (rank, g) in self.graphs.iter().enumerate() {
            g.launch()
                .map_err(Error::cuda(format!("launching the graph of rank {rank}")))?;
        }
        Ok(())
    }

    /// Uploads each graph to its device ahead of the first launch.
    pub fn upload(&self) -> Result<()> {
        for g in &self.graphs {
            g.upload().map_err(Error::cuda("uploading a graph"))?;
        }
        Ok(())
    }
}
