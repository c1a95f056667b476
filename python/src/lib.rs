//! `gpucast._native`: the Python face of gpucast. Tensors come in as torch tensors, DLPack
//! producers (`__dlpack__`) or `__cuda_array_interface__` objects, without copies; each call is
//! ordered after the work queued on the tensor's current stream, and that stream waits for the
//! call, as a torch operation on that stream would be. Calls release the GIL.

mod errors;
mod exchange;
mod pending;
mod tensors;

use gpucast::prelude::*;
use std::mem::ManuallyDrop;
use std::time::Duration;

use gpucast::cudarc::driver::{sys, CudaContext, CudaStream};
use gpucast::{
    BroadcastOptions, BroadcastPath, Clique, CliqueBuilder, Communicator, CommunicatorBuilder,
    DeviceTensor, DeviceTensorMut, Error, ExternalSlice,
};
use pyo3::prelude::*;
use pyo3::types::PyList;

use errors::to_py;
use pending::Pending;
use tensors::{describe_with, external, Desc, Memo, Seen, Where};

/// Runs `$body` with `$T` the Rust element type of `$dtype`.
macro_rules! typed {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            gpucast::DType::F32 => {
                type $T = f32;
                $body
            }
            gpucast::DType::F64 => {
                type $T = f64;
                $body
            }
            gpucast::DType::F16 => {
                type $T = gpucast::half::f16;
                $body
            }
            gpucast::DType::BF16 => {
                type $T = gpucast::half::bf16;
                $body
            }
            gpucast::DType::I8 => {
                type $T = i8;
                $body
            }
            gpucast::DType::U8 => {
                type $T = u8;
                $body
            }
            gpucast::DType::I32 => {
                type $T = i32;
                $body
            }
            gpucast::DType::U32 => {
                type $T = u32;
                $body
            }
            gpucast::DType::I64 => {
                type $T = i64;
                $body
            }
            gpucast::DType::U64 => {
                type $T = u64;
                $body
            }
            other => Err(Error::InvalidArgument(format!(
                "element type {other} has no buffer type here"
            ))),
        }
    };
}

/// The settings both builders take, from Python keyword arguments.
#[derive(Default)]
struct Settings {
    path: Option<BroadcastPath>,
    timeout: Option<Duration>,
    p2p_threshold: Option<usize>,
    packet_threshold: Option<usize>,
    copy_engine_threshold: Option<usize>,
    p2p_chain_threshold: Option<usize>,
}

/// A byte count from an int or a string such as `"64K"`.
fn bytes_arg(name: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    let Some(v) = value else { return Ok(None) };
    if let Ok(n) = v.extract::<usize>() {
        return Ok(Some(n));
    }
    let parsed = v
        .extract::<String>()
        .ok()
        .and_then(|s| gpucast::parse_bytes(&s));
    match parsed {
        Some(n) => Ok(Some(n)),
        None => Err(errors::argument(format!(
            "{name} must be a byte count (an int >= 0, or a string such as \"64K\"), not {v}"
        ))),
    }
}

fn path_arg(path: Option<&str>) -> PyResult<Option<BroadcastPath>> {
    path.map(|p| p.parse::<BroadcastPath>().map_err(to_py))
        .transpose()
}

fn seconds_arg(name: &str, s: Option<f64>) -> PyResult<Option<Duration>> {
    match s {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(errors::argument(format!(
            "{name} must be a number of seconds > 0, not {s}"
        ))),
    }
}

impl Settings {
    fn from_args(
        path: Option<&str>,
        timeout: Option<f64>,
        p2p_threshold: Option<&Bound<'_, PyAny>>,
        packet_threshold: Option<&Bound<'_, PyAny>>,
        copy_engine_threshold: Option<&Bound<'_, PyAny>>,
        p2p_chain_threshold: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Settings> {
        Ok(Settings {
            path: path_arg(path)?,
            timeout: seconds_arg("timeout", timeout)?,
            p2p_threshold: bytes_arg("p2p_threshold", p2p_threshold)?,
            packet_threshold: bytes_arg("packet_threshold", packet_threshold)?,
            copy_engine_threshold: bytes_arg("copy_engine_threshold", copy_engine_threshold)?,
            p2p_chain_threshold: bytes_arg("p2p_chain_threshold", p2p_chain_threshold)?,
        })
    }
}

/// Applies [`Settings`] to either builder (both have the same setters).
macro_rules! apply_settings {
    ($builder:expr, $s:expr) => {{
        let mut b = $builder;
        let s = $s;
        if let Some(v) = s.path {
            b = b.path(v);
        }
        if let Some(v) = s.timeout {
            b = b.timeout(v);
        }
        if let Some(v) = s.p2p_threshold {
            b = b.p2p_threshold(v);
        }
        if let Some(v) = s.packet_threshold {
            b = b.packet_threshold(v);
        }
        if let Some(v) = s.copy_engine_threshold {
            b = b.copy_engine_threshold(v);
        }
        if let Some(v) = s.p2p_chain_threshold {
            b = b.p2p_chain_threshold(v);
        }
        b
    }};
}

fn options(path: Option<&str>) -> PyResult<BroadcastOptions> {
    Ok(match path_arg(path)? {
        Some(p) => BroadcastOptions::path(p),
        None => BroadcastOptions::default(),
    })
}

/// Wraps a stream handle of another library (torch's current stream, the legacy default
/// stream) for ordering.
///
/// # Safety
/// `handle` is a live stream of `ctx` (the primary context of its device) or one of the
/// legacy and per-thread default stream handles (0, 1, 2), and stays live until the work
/// queued on it by the call that uses the wrapper has run.
unsafe fn borrowed(ctx: &std::sync::Arc<CudaContext>, handle: u64) -> std::sync::Arc<CudaStream> {
    // SAFETY: per this function's contract; the wrapper never destroys the handle, and gpucast
    // orders its own work with the stream through events (both ways).
    unsafe { ctx.wrap_borrowed_stream(handle as _) }
}

/// Restores the thread's current CUDA context when dropped: the binding's driver calls make
/// the ranks' contexts current, and torch reads its current device from it.
struct KeepCurrent(Option<sys::CUcontext>);

impl KeepCurrent {
    /// Inside a method of a clique or communicator (the driver library is loaded).
    fn new() -> KeepCurrent {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: an out pointer to a local; the driver library is loaded.
        match unsafe { sys::cuCtxGetCurrent(&mut ctx) } {
            sys::CUresult::CUDA_SUCCESS => KeepCurrent(Some(ctx)),
            // Before CUDA's initialisation no context is current: none is, again, after.
            sys::CUresult::CUDA_ERROR_NOT_INITIALIZED => KeepCurrent(Some(std::ptr::null_mut())),
            _ => KeepCurrent(None),
        }
    }

    /// Before a clique or communicator is built: nothing to restore without a driver (and no
    /// call may touch the library then).
    fn before_init() -> KeepCurrent {
        static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        // SAFETY: only tries to load the driver library (as gpucast's own check does).
        if *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() }) {
            KeepCurrent::new()
        } else {
            KeepCurrent(None)
        }
    }
}

impl Drop for KeepCurrent {
    fn drop(&mut self) {
        if let Some(ctx) = self.0 {
            // SAFETY: the context that was current on this thread (or null: none), which the
            // process's owner of it keeps alive; only made current again.
            let _ = unsafe { sys::cuCtxSetCurrent(ctx) };
        }
    }
}

/// A `stream=` handle given by the caller: the default handles (0, 1, 2), or a stream of
/// `ctx` (a handle of another device's context would order nothing the call touches).
fn check_stream(ctx: &std::sync::Arc<CudaContext>, stream: Option<u64>) -> PyResult<()> {
    let Some(handle) = stream.filter(|&h| h > 2) else {
        return Ok(());
    };
    let mut owner: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the driver writes the out pointer, a live local. The handle is the Python
    // caller's: the driver dereferences it, so it must be a live stream of this process, which
    // `stream=` documents as the caller's promise (as torch does for external streams). A
    // handle that was never a stream (the default handles are filtered above) fails with an
    // error return; one of a stream already destroyed cannot be checked here.
    let r = unsafe { sys::cuStreamGetCtx(handle as sys::CUstream, &mut owner) };
    if r != sys::CUresult::CUDA_SUCCESS || owner != ctx.cu_ctx() {
        return Err(errors::argument(format!(
            "stream={handle:#x} is not a stream of device {}'s primary context (stream= names \
             one stream: in a clique of several GPUs leave it out, and each tensor's current \
             stream is used)",
            ctx.ordinal()
        )));
    }
    Ok(())
}

/// One rank of a job that runs one process per GPU (torchrun, Slurm): see
/// `gpucast.Communicator`.
#[pyclass(module = "gpucast._native", name = "Communicator", frozen)]
struct PyCommunicator {
    inner: ManuallyDrop<Communicator>,
    pending: ManuallyDrop<Pending>,
}

impl Drop for PyCommunicator {
    /// Drops the communicator, then the tensors of its finished calls, and leaves the
    /// thread's current CUDA context as it was (both make contexts current).
    fn drop(&mut self) {
        let _current = KeepCurrent::new();
        // A fence after every call's work, which the drop below waits for: the tensors of the
        // calls since the last fence are released, not leaked, when it completes.
        self.pending.fence();
        // SAFETY: each field is taken or dropped once, here, and never used after.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        // The drop waits for the GPUs (bounded by the timeout: see the Rust type's drop): without
        // the GIL, so that the process's other Python threads run meanwhile.
        Python::attach(|py| py.detach(move || drop(inner)));
        // SAFETY: as above; the tensors of finished calls are Python objects, dropped with the
        // GIL held.
        unsafe { ManuallyDrop::drop(&mut self.pending) };
    }
}

#[pymethods]
impl PyCommunicator {
    /// Joins the job described by the environment (torchrun's or Slurm's variables).
    #[staticmethod]
    #[pyo3(signature = (*, device=None, shared_devices=false, init_timeout=None, path=None,
        timeout=None, p2p_threshold=None, packet_threshold=None, copy_engine_threshold=None,
        p2p_chain_threshold=None))]
    #[allow(clippy::too_many_arguments)]
    fn from_env(
        py: Python<'_>,
        device: Option<usize>,
        shared_devices: bool,
        init_timeout: Option<f64>,
        path: Option<&str>,
        timeout: Option<f64>,
        p2p_threshold: Option<&Bound<'_, PyAny>>,
        packet_threshold: Option<&Bound<'_, PyAny>>,
        copy_engine_threshold: Option<&Bound<'_, PyAny>>,
        p2p_chain_threshold: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyCommunicator> {
        let settings = Settings::from_args(
            path,
            timeout,
            p2p_threshold,
            packet_threshold,
            copy_engine_threshold,
            p2p_chain_threshold,
        )?;
        let init_timeout = seconds_arg("init_timeout", init_timeout)?;
        let b = apply_settings!(Communicator::builder(), settings);
        PyCommunicator::join(py, b, device, shared_devices, init_timeout)
    }

    /// Joins an explicit group: processes of separate launches that agree on an address, as
    /// `StatelessProcessGroup.create`. Rank 0 hosts gpucast's store on `master_addr:master_port`
    /// (on every interface when the address is not one of its host's); every rank proves
    /// `token` (default: `GPUCAST_JOB_TOKEN`, else none, which the store warns about when it
    /// listens beyond loopback). `device` defaults to `local_rank`, which defaults to `rank`
    /// (with `local_world_size` defaulting to `world_size`: every rank on one host).
    #[new]
    #[pyo3(signature = (*, rank, world_size, master_addr="127.0.0.1", master_port, token=None,
        device=None, local_rank=None, local_world_size=None, shared_devices=false,
        init_timeout=None, path=None, timeout=None, p2p_threshold=None, packet_threshold=None,
        copy_engine_threshold=None, p2p_chain_threshold=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        master_addr: &str,
        master_port: i64,
        token: Option<String>,
        device: Option<usize>,
        local_rank: Option<usize>,
        local_world_size: Option<usize>,
        shared_devices: bool,
        init_timeout: Option<f64>,
        path: Option<&str>,
        timeout: Option<f64>,
        p2p_threshold: Option<&Bound<'_, PyAny>>,
        packet_threshold: Option<&Bound<'_, PyAny>>,
        copy_engine_threshold: Option<&Bound<'_, PyAny>>,
        p2p_chain_threshold: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyCommunicator> {
        let settings = Settings::from_args(
            path,
            timeout,
            p2p_threshold,
            packet_threshold,
            copy_engine_threshold,
            p2p_chain_threshold,
        )?;
        let init_timeout = seconds_arg("init_timeout", init_timeout)?;
        let job = explicit_job(
            rank,
            world_size,
            master_addr,
            master_port,
            token,
            local_rank,
            local_world_size,
        )?;
        let b = apply_settings!(Communicator::builder(), settings).job(job);
        PyCommunicator::join(py, b, device, shared_devices, init_timeout)
    }

    /// Joins a group whose processes meet through the caller's all-gather (a framework's store
    /// or process group, MPI): `all_gather(bytes) -> list[bytes]` returns every rank's bytes
    /// in rank order. It is called with the GIL, from the thread that builds the communicator.
    #[staticmethod]
    #[pyo3(signature = (all_gather, *, rank, world_size, device=None, shared_devices=false,
        init_timeout=None, path=None, timeout=None, p2p_threshold=None, packet_threshold=None,
        copy_engine_threshold=None, p2p_chain_threshold=None))]
    #[allow(clippy::too_many_arguments)]
    fn from_exchange(
        py: Python<'_>,
        all_gather: Py<PyAny>,
        rank: usize,
        world_size: usize,
        device: Option<usize>,
        shared_devices: bool,
        init_timeout: Option<f64>,
        path: Option<&str>,
        timeout: Option<f64>,
        p2p_threshold: Option<&Bound<'_, PyAny>>,
        packet_threshold: Option<&Bound<'_, PyAny>>,
        copy_engine_threshold: Option<&Bound<'_, PyAny>>,
        p2p_chain_threshold: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyCommunicator> {
        if !all_gather.bind(py).is_callable() {
            return Err(errors::argument(
                "all_gather must be a callable: bytes -> list of every rank's bytes".into(),
            ));
        }
        let settings = Settings::from_args(
            path,
            timeout,
            p2p_threshold,
            packet_threshold,
            copy_engine_threshold,
            p2p_chain_threshold,
        )?;
        let init_timeout = seconds_arg("init_timeout", init_timeout)?;
        // The job's rank and size (checked); its address is never used: the exchange is the
        // caller's.
        let job = gpucast::rendezvous::JobEnv::single_node(
            rank,
            world_size,
            gpucast::rendezvous::DEFAULT_MASTER_PORT,
        )
        .map_err(rendezvous_error)?;
        let gather = move |mine: &[u8]| -> Result<Vec<Vec<u8>>, String> {
            Python::attach(|py| {
                let all = all_gather
                    .call1(py, (pyo3::types::PyBytes::new(py, mine),))
                    .map_err(|e| format!("all_gather raised {e}"))?;
                all.extract::<Vec<Vec<u8>>>(py)
                    .map_err(|e| format!("all_gather must return a list of bytes ({e})"))
            })
        };
        let exchange = gpucast::rendezvous::FnExchange::new(rank, world_size, gather)
            .map_err(rendezvous_error)?;
        let b = apply_settings!(Communicator::builder(), settings)
            .job(job)
            .exchange(exchange);
        PyCommunicator::join(py, b, device, shared_devices, init_timeout)
    }

    /// This process's rank in the job.
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// Number of ranks in the job.
    #[getter]
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    /// This process's rank on its host.
    #[getter]
    fn local_rank(&self) -> usize {
        self.inner.local_rank()
    }

    /// The CUDA device of this rank.
    #[getter]
    fn device(&self) -> usize {
        self.inner.device()
    }

    /// Whether every rank runs on this host (then the P2P kernel can run between them).
    #[getter]
    fn single_host(&self) -> bool {
        self.inner.single_host()
    }

    /// The route a broadcast of `nbytes` bytes takes (`"p2p-packet"`, `"nccl"`, ...).
    #[pyo3(signature = (nbytes, *, path=None))]
    fn route(&self, nbytes: usize, path: Option<&str>) -> PyResult<String> {
        let options = options(path)?;
        Ok(self
            .inner
            .route(nbytes, &options)
            .map_err(to_py)?
            .to_string())
    }

    /// Broadcasts, in place, rank `src`'s `tensor` into every other rank's `tensor`.
    #[pyo3(signature = (tensor, src=0, *, path=None, stream=None))]
    fn broadcast(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        src: usize,
        path: Option<&str>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        // As in `broadcast_many`: a call refused here still takes its number in the call log.
        self.inner
            .as_one_call(|| self.one_kept(py, tensor, src, path, stream))
    }

    /// Broadcasts many tensors, in place, in one fused call: every rank passes the same list
    /// of tensors (lengths and types); rank `src`'s are the sources.
    #[pyo3(signature = (tensors, src=0, *, path=None, stream=None))]
    fn broadcast_many(
        &self,
        py: Python<'_>,
        tensors: &Bound<'_, PyAny>,
        src: usize,
        path: Option<&str>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        // A call refused here, before gpucast saw it, still takes its number in the call log
        // (the peers made it and wait for this rank's card).
        self.inner
            .as_one_call(|| self.many_kept(py, tensors, src, path, stream))
    }
    /// Waits (bounded) until this rank's broadcasts so far have finished, and reports any
    /// failure of them.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let _current = KeepCurrent::new();
        // Fenced before the wait, so that the fence has completed after it.
        self.pending.fence();
        let comm = &self.inner;
        py.detach(|| comm.synchronize()).map_err(to_py)?;
        self.pending.prune();
        Ok(())
    }

    /// The CUDA stream (a raw `cudaStream_t` as an int) that this rank's broadcasts run on.
    #[getter]
    fn stream_handle(&self) -> u64 {
        self.inner.stream().cu_stream() as u64
    }

    fn __repr__(&self) -> String {
        format!(
            "gpucast.Communicator(rank={}, world_size={}, device={})",
            self.inner.rank(),
            self.inner.world_size(),
            self.inner.device()
        )
    }
}

/// A rendezvous error as Python's: a bad rank, size, address or token is the caller's
/// argument (`ArgumentError`).
fn rendezvous_error(e: gpucast::rendezvous::RendezvousError) -> PyErr {
    match e {
        gpucast::rendezvous::RendezvousError::InvalidArgument(reason) => errors::argument(reason),
        e => to_py(e.into()),
    }
}

/// The job of an explicit group (see `Communicator.__init__`).
fn explicit_job(
    rank: usize,
    world_size: usize,
    master_addr: &str,
    master_port: i64,
    token: Option<String>,
    local_rank: Option<usize>,
    local_world_size: Option<usize>,
) -> PyResult<gpucast::rendezvous::JobEnv> {
    use gpucast::rendezvous::{env_var, JobEnv, TokenSource, JOB_TOKEN_ENV};
    let bad = rendezvous_error;
    let master_port = match u16::try_from(master_port) {
        Ok(p) if p > 0 => p,
        _ => {
            return Err(errors::argument(format!(
                "master_port must be a TCP port in 1..=65535 that every rank agrees on, not \
                 {master_port}"
            )))
        }
    };
    let mut job = JobEnv::single_node(rank, world_size, master_port).map_err(bad)?;
    job.master_addr = master_addr.trim().to_owned();
    job.local_rank = local_rank.unwrap_or(rank);
    job.local_world_size = local_world_size.unwrap_or(world_size);
    // The token: the caller's, else the launcher's in the environment, else none (the store
    // warns when it listens beyond loopback with a guessable token, as for every job).
    match token.or_else(|| env_var(JOB_TOKEN_ENV)) {
        Some(t) => {
            job.job_token = t;
            job.token_source = TokenSource::Explicit;
        }
        None => job.token_source = TokenSource::Unset,
    }
    job.validate().map_err(bad)?;
    Ok(job)
}

impl PyCommunicator {
    /// Builds the communicator of `b` with the settings every constructor takes.
    fn join(
        py: Python<'_>,
        b: CommunicatorBuilder,
        device: Option<usize>,
        shared_devices: bool,
        init_timeout: Option<Duration>,
    ) -> PyResult<PyCommunicator> {
        let mut b = b.shared_devices(shared_devices);
        if let Some(d) = device {
            b = b.device(d);
        }
        if let Some(t) = init_timeout {
            b = b.init_timeout(t);
        }
        let _current = KeepCurrent::before_init();
        let inner = py.detach(|| b.build()).map_err(to_py)?;
        let pending = Pending::new(vec![inner.stream().clone()]);
        Ok(PyCommunicator {
            inner: ManuallyDrop::new(inner),
            pending: ManuallyDrop::new(pending),
        })
    }

    /// `broadcast` itself: one typed buffer through `comm.with(&options).broadcast_in_place`,
    /// the call a Rust program makes.
    fn one_kept(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        src: usize,
        path: Option<&str>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        let options = options(path)?;
        let _current = KeepCurrent::new();
        check_stream(self.inner.context(), stream)?;
        let at = Where::at(self.inner.device(), stream).reading(self.inner.rank() == src);
        let desc = describe_with(tensor, at, &mut Memo::default())?;
        let ctx = self.inner.context().clone();
        let comm = &self.inner;
        kept(py, &self.pending, desc, |d| {
            typed!(d.dtype, T => {
                // SAFETY: the description is of a live tensor of this rank's device (checked
                // by `describe_with`), kept alive by `kept` until the call's work has run; the
                // stream is the tensor's (torch's current stream, or the caller's).
                let mut buf =
                    unsafe { ExternalSlice::<T>::new(d.ptr, d.len, borrowed(&ctx, d.stream)) }?;
                comm.with(&options).broadcast_in_place(src, &mut buf)
            })
        })
    }

    /// `broadcast_many` itself.
    fn many_kept(
        &self,
        py: Python<'_>,
        tensors: &Bound<'_, PyAny>,
        src: usize,
        path: Option<&str>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        let options = options(path)?;
        let _current = KeepCurrent::new();
        check_stream(self.inner.context(), stream)?;
        let at = Where::at(self.inner.device(), stream).reading(self.inner.rank() == src);
        let mut memo = Memo::default();
        let descs = items(tensors)?
            .iter()
            .map(|t| describe_with(t, at, &mut memo))
            .collect::<PyResult<Vec<Desc>>>()?;
        let ctx = self.inner.context().clone();
        let comm = &self.inner;
        kept(py, &self.pending, descs, |ds| {
            let mut bufs: Vec<Box<Buffer>> = Vec::with_capacity(ds.len());
            let mut seen = Seen::default();
            for d in ds {
                // SAFETY: as in `broadcast`, for each tensor.
                let stream = unsafe { borrowed(&ctx, d.stream) };
                // SAFETY: as in `broadcast`; `seen` lists buffers of the call's tensors, held
                // as these are.
                bufs.push(unsafe { external(d, stream, &mut seen) }?.0);
            }
            let list = bufs
                .iter_mut()
                .map(|b| -> &mut dyn DeviceTensorMut { &mut **b })
                .collect();
            comm.with(&options)
                .broadcast_many_in_place(src, list)
                .map(|_| ())
        })
    }
}

/// Several GPUs (ranks) driven by this one process: see `gpucast.Clique`.
#[pyclass(module = "gpucast._native", name = "Clique", frozen)]
struct PyClique {
    inner: ManuallyDrop<Clique>,
    devices: Vec<usize>,
    /// Whether the clique spans several GPUs (then peers reach each other's tensors).
    several_gpus: bool,
    pending: ManuallyDrop<Pending>,
}

impl Drop for PyClique {
    /// As for `PyCommunicator`.
    fn drop(&mut self) {
        let _current = KeepCurrent::new();
        // A fence after every call's work, which the drop below waits for: the tensors of the
        // calls since the last fence are released, not leaked, when it completes.
        self.pending.fence();
        // SAFETY: each field is taken or dropped once, here, and never used after.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        // The drop waits for the GPUs (bounded by the timeout: see the Rust type's drop): without
        // the GIL, so that the process's other Python threads run meanwhile.
        Python::attach(|py| py.detach(move || drop(inner)));
        // SAFETY: as above; the tensors of finished calls are Python objects, dropped with the
        // GIL held.
        unsafe { ManuallyDrop::drop(&mut self.pending) };
    }
}

impl PyClique {
    /// Where each rank's tensors must be, with the caller's stream if given.
    fn at(&self, rank: usize, stream: Option<u64>) -> Where {
        Where::at(self.devices[rank], stream)
    }

    fn check_count(&self, what: &str, got: usize) -> PyResult<()> {
        if got == self.devices.len() {
            Ok(())
        } else {
            Err(to_py(Error::InvalidArgument(format!(
                "{what}: {got} given, the clique has {} ranks",
                self.devices.len()
            ))))
        }
    }

    fn root(&self, src: usize) -> PyResult<usize> {
        if src < self.devices.len() {
            Ok(src)
        } else {
            Err(to_py(Error::RootOutOfRange {
                root: src,
                size: self.devices.len(),
            }))
        }
    }

    /// Buffers of rank `rank` from descriptions that are kept alive by the caller.
    ///
    /// # Safety
    /// Every `Desc` describes a live tensor of rank `rank`'s device, kept alive until the work
    /// queued by the call that uses the buffers has run.
    /// `seen`: the allocations of the call's buffers made so far (see [`Seen`]).
    unsafe fn buffers_of(
        &self,
        rank: usize,
        descs: &[Desc],
        seen: &mut Seen,
    ) -> gpucast::Result<Vec<Box<Buffer>>> {
        let ctx = self.inner.context(rank);
        descs
            .iter()
            .map(|d| {
                // SAFETY: per this function's contract.
                let stream = unsafe { borrowed(ctx, d.stream) };
                // SAFETY: per this function's contract; the buffers `seen` lists are of the
                // call's tensors, held by the caller as these are.
                let (buf, plain) = unsafe { external(d, stream, seen) }?;
                if !plain && self.several_gpus {
                    return Err(Error::InvalidArgument(format!(
                        "a tensor of rank {rank} is memory of a pool or a cuMemMap mapping \
                         (PyTorch's expandable_segments or cudaMallocAsync allocator), which the \
                         clique's other GPUs may not reach: use the default allocator, or a \
                         Communicator (one process per GPU)"
                    )));
                }
                Ok(buf)
            })
            .collect()
    }

    /// [`PyClique::buffers_of`] for one list per rank.
    ///
    /// # Safety
    /// As for [`PyClique::buffers_of`], `lists[rank]` being rank `rank`'s.
    unsafe fn buffers(
        &self,
        lists: &[Vec<Desc>],
        seen: &mut Seen,
    ) -> gpucast::Result<Vec<Vec<Box<Buffer>>>> {
        lists
            .iter()
            .enumerate()
            // SAFETY: per this function's contract.
            .map(|(rank, list)| unsafe { self.buffers_of(rank, list, seen) })
            .collect()
    }
}

/// What [`tensors::external`] returns.
type Buffer = dyn DeviceTensorMut;

/// One list of buffers per rank, lent as gpucast's output lists.
fn lend(lists: &mut [Vec<Box<Buffer>>]) -> Vec<Vec<&mut dyn DeviceTensorMut>> {
    lists
        .iter_mut()
        .map(|l| {
            l.iter_mut()
                .map(|b| -> &mut dyn DeviceTensorMut { &mut **b })
                .collect()
        })
        .collect()
}

/// What owns the memory of described tensors.
trait Owners {
    /// Moves the owners to `out`; returns the bytes of the memory they own for the call.
    fn owners(self, out: &mut Vec<Py<PyAny>>) -> usize;
}

impl Owners for Desc {
    fn owners(self, out: &mut Vec<Py<PyAny>>) -> usize {
        out.push(self.keep);
        self.len.saturating_mul(self.dtype.size())
    }
}

impl<T: Owners> Owners for Vec<T> {
    fn owners(self, out: &mut Vec<Py<PyAny>>) -> usize {
        self.into_iter()
            .fold(0, |bytes, t| bytes.saturating_add(t.owners(out)))
    }
}

impl<A: Owners, B: Owners> Owners for (A, B) {
    fn owners(self, out: &mut Vec<Py<PyAny>>) -> usize {
        self.0.owners(out).saturating_add(self.1.owners(out))
    }
}

/// Runs a call over the tensors `descs` describes: runs `call` without the GIL, then keeps the
/// tensors until the work `call` queued has run (also when it failed: it may have queued
/// some); keeping drops the tensors of calls that have finished, now and then.
fn kept<D: Owners + Sync>(
    py: Python<'_>,
    pending: &Pending,
    descs: D,
    call: impl FnOnce(&D) -> gpucast::Result<()> + Send,
) -> PyResult<()> {
    let result = py.detach(|| call(&descs));
    // Moving the owners runs no Python code (no reference count reaches zero).
    pending.keep(|owners| descs.owners(owners));
    result.map_err(to_py)
}

#[pymethods]
impl PyClique {
    /// A clique of the GPUs `devices` (default: every visible GPU).
    #[new]
    #[pyo3(signature = (devices=None, *, shared_devices=false, path=None, timeout=None,
        p2p_threshold=None, packet_threshold=None, copy_engine_threshold=None,
        p2p_chain_threshold=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        devices: Option<Vec<usize>>,
        shared_devices: bool,
        path: Option<&str>,
        timeout: Option<f64>,
        p2p_threshold: Option<&Bound<'_, PyAny>>,
        packet_threshold: Option<&Bound<'_, PyAny>>,
        copy_engine_threshold: Option<&Bound<'_, PyAny>>,
        p2p_chain_threshold: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyClique> {
        let settings = Settings::from_args(
            path,
            timeout,
            p2p_threshold,
            packet_threshold,
            copy_engine_threshold,
            p2p_chain_threshold,
        )?;
        let mut b: CliqueBuilder =
            apply_settings!(Clique::builder(), settings).shared_devices(shared_devices);
        if let Some(d) = &devices {
            b = b.devices(d);
        }
        let _current = KeepCurrent::before_init();
        let inner = py.detach(|| b.build()).map_err(to_py)?;
        let devices: Vec<usize> = (0..inner.len())
            .map(|r| inner.context(r).ordinal())
            .collect();
        let pending = Pending::new((0..inner.len()).map(|r| inner.stream(r).clone()).collect());
        let several_gpus = devices.iter().any(|&d| d != devices[0]);
        Ok(PyClique {
            inner: ManuallyDrop::new(inner),
            devices,
            several_gpus,
            pending: ManuallyDrop::new(pending),
        })
    }

    /// The CUDA device of each rank.
    #[getter]
    fn devices(&self) -> Vec<usize> {
        self.devices.clone()
    }

    fn __len__(&self) -> usize {
        self.devices.len()
    }

    /// The route a broadcast of `nbytes` bytes takes.
    #[pyo3(signature = (nbytes, *, path=None))]
    fn route(&self, nbytes: usize, path: Option<&str>) -> PyResult<String> {
        let options = options(path)?;
        Ok(self
            .inner
            .route(nbytes, &options)
            .map_err(to_py)?
            .to_string())
    }

    /// Copies `tensor` (on rank `src`'s GPU) into `outputs[rank]` for every rank (the root's
    /// own output included).
    #[pyo3(signature = (src, tensor, outputs, *, path=None, stream=None))]
    fn broadcast(
        &self,
        py: Python<'_>,
        src: usize,
        tensor: &Bound<'_, PyAny>,
        outputs: &Bound<'_, PyList>,
        path: Option<&str>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        let options = options(path)?;
        let root = self.root(src)?;
        self.check_count("outputs", outputs.len())?;
        let _current = KeepCurrent::new();
        self.check_stream(stream)?;
        let (input, outs) = self.describe_one(tensor, outputs, root, stream)?;
        kept(py, &self.pending, (input, outs), |(input, outs)| {
            // SAFETY: the descriptions are of live tensors of each rank's device (checked by
            // `describe_with`), kept alive by `kept` until the call's work has run.
            unsafe { self.single(root, input, outs, &options) }
        })
    }

    /// Runs `iters` broadcasts of `tensor` into `outputs` back to back from Rust, as a Rust
    /// program calls `clique.with(&options).broadcast` (the buffers wrapped once): the bench's
    /// reference for the cost of the Python door.
    #[pyo3(signature = (src, tensor, outputs, iters, *, path=None))]
    fn _rust_loop(
        &self,
        py: Python<'_>,
        src: usize,
        tensor: &Bound<'_, PyAny>,
        outputs: &Bound<'_, PyList>,
        iters: usize,
        path: Option<&str>,
    ) -> PyResult<()> {
        let options = options(path)?;
        let root = self.root(src)?;
        self.check_count("outputs", outputs.len())?;
        let _current = KeepCurrent::new();
        let (input, outs) = self.describe_one(tensor, outputs, root, None)?;
        kept(py, &self.pending, (input, outs), |(input, outs)| {
            // SAFETY: as in `broadcast`.
            unsafe { self.single_loop(root, input, outs, &options, iters) }
        })
    }

    /// Broadcasts, in place, `tensors[src]` into `tensors[rank]` of every other rank.
    #[pyo3(signature = (src, tensors, *, path=None, stream=None))]
    fn broadcast_in_place(
        &self,
        py: Python<'_>,
        src: usize,
        tensors: &Bound<'_, PyList>,
        path: Option<&str>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        let options = options(path)?;
        let root = self.root(src)?;
        self.check_count("tensors", tensors.len())?;
        let _current = KeepCurrent::new();
        self.check_stream(stream)?;
        let mut memo = Memo::default();
        let descs = tensors
            .iter()
            .enumerate()
            .map(|(rank, t)| {
                describe_with(&t, self.at(rank, stream).reading(rank == root), &mut memo)
            })
            .collect::<PyResult<Vec<Desc>>>()?;
        let lists: Vec<Vec<Desc>> = descs.into_iter().map(|d| vec![d]).collect();
        kept(py, &self.pending, lists, |lists| {
            // SAFETY: as in `broadcast`.
            let mut bufs = unsafe { self.buffers(lists, &mut Seen::default()) }?;
            self.inner
                .with(&options)
                .broadcast_many_in_place(root, &mut lend(&mut bufs))
                .map(|_| ())
        })
    }

    /// Many tensors out of place in one fused call: `inputs[t]` is tensor `t` on rank `src`'s
    /// GPU, `outputs[rank][t]` its destination on every rank (the root's included).
    #[pyo3(signature = (src, inputs, outputs, *, path=None, stream=None))]
    fn broadcast_many(
        &self,
        py: Python<'_>,
        src: usize,
        inputs: &Bound<'_, PyAny>,
        outputs: &Bound<'_, PyList>,
        path: Option<&str>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        let options = options(path)?;
        let root = self.root(src)?;
        self.check_count("output lists", outputs.len())?;
        let _current = KeepCurrent::new();
        self.check_stream(stream)?;
        let mut memo = Memo::default();
        // Every iterable is read before any tensor is: no code of the caller's runs between
        // reading a tensor and queueing the call (see `items`).
        let inputs = items(inputs)?;
        let outputs = outputs
            .iter()
            .map(|l| items(&l))
            .collect::<PyResult<Vec<_>>>()?;
        let ins = inputs
            .iter()
            .map(|t| describe_with(t, self.at(root, stream).reading(true), &mut memo))
            .collect::<PyResult<Vec<_>>>()?;
        let outs = self.describe_items(&outputs, stream, None, &mut memo)?;
        kept(py, &self.pending, (ins, outs), |(ins, outs)| {
            let mut seen = Seen::default();
            // SAFETY: as in `broadcast`.
            let inp = unsafe { self.buffers_of(root, ins, &mut seen) }?;
            // SAFETY: as in `broadcast`.
            let mut out = unsafe { self.buffers(outs, &mut seen) }?;
            let inputs: Vec<&dyn DeviceTensor> = inp.iter().map(|b| &**b as _).collect();
            self.inner
                .with(&options)
                .broadcast_many(root, &inputs, &mut lend(&mut out))
                .map(|_| ())
        })
    }

    /// Many tensors in place in one fused call: `tensors[rank][t]` is tensor `t` of rank
    /// `rank` (rank `src`'s are the sources).
    #[pyo3(signature = (src, tensors, *, path=None, stream=None))]
    fn broadcast_many_in_place(
        &self,
        py: Python<'_>,
        src: usize,
        tensors: &Bound<'_, PyList>,
        path: Option<&str>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        let options = options(path)?;
        let root = self.root(src)?;
        self.check_count("tensor lists", tensors.len())?;
        let _current = KeepCurrent::new();
        self.check_stream(stream)?;
        let lists = self.describe_lists(tensors, stream, Some(root), &mut Memo::default())?;
        kept(py, &self.pending, lists, |lists| {
            // SAFETY: as in `broadcast`.
            let mut bufs = unsafe { self.buffers(lists, &mut Seen::default()) }?;
            self.inner
                .with(&options)
                .broadcast_many_in_place(root, &mut lend(&mut bufs))
                .map(|_| ())
        })
    }

    /// Waits (bounded) until every rank's broadcasts so far have finished, and reports any
    /// failure of them.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let _current = KeepCurrent::new();
        // Fenced before the wait, so that the fence has completed after it.
        self.pending.fence();
        let clique = &self.inner;
        py.detach(|| clique.synchronize()).map_err(to_py)?;
        self.pending.prune();
        Ok(())
    }

    /// The CUDA stream (a raw `cudaStream_t` as an int) that rank `rank`'s broadcasts run on.
    fn stream_handle(&self, rank: usize) -> PyResult<u64> {
        self.root(rank)?;
        Ok(self.inner.stream(rank).cu_stream() as u64)
    }

    fn __repr__(&self) -> String {
        format!("gpucast.Clique(devices={:?})", self.devices)
    }
}

impl PyClique {
    /// The descriptions of one broadcast's input (on rank `root`) and outputs (one per rank).
    fn describe_one(
        &self,
        tensor: &Bound<'_, PyAny>,
        outputs: &Bound<'_, PyList>,
        root: usize,
        stream: Option<u64>,
    ) -> PyResult<(Desc, Vec<Desc>)> {
        let mut memo = Memo::default();
        let input = describe_with(tensor, self.at(root, stream).reading(true), &mut memo)?;
        let outs = outputs
            .iter()
            .enumerate()
            .map(|(rank, o)| describe_with(&o, self.at(rank, stream), &mut memo))
            .collect::<PyResult<Vec<Desc>>>()?;
        Ok((input, outs))
    }

    /// Typed buffers of one broadcast: rank `root`'s input and every rank's output.
    ///
    /// # Safety
    /// As for [`PyClique::buffers_of`], for the input on rank `root` and `outs[rank]`.
    unsafe fn typed<T: gpucast::Element>(
        &self,
        root: usize,
        input: &Desc,
        outs: &[Desc],
    ) -> gpucast::Result<(ExternalSlice<T>, Vec<ExternalSlice<T>>)> {
        // The buffers made so far are of the call's described tensors, all held by the caller
        // until the call's work has run: their memory stays allocated.
        let mut seen = Seen::default();
        // The last stream wrapper made: buffers of one context and stream handle share one.
        let mut last: Option<std::sync::Arc<CudaStream>> = None;
        let mut slice = |rank: usize, d: &Desc| {
            let ctx = self.inner.context(rank);
            let stream = match &last {
                Some(s)
                    if std::sync::Arc::ptr_eq(s.context(), ctx)
                        && s.cu_stream() as u64 == d.stream =>
                {
                    s.clone()
                }
                _ => {
                    // SAFETY: per this function's contract (the handle is the tensor's stream).
                    let s = unsafe { borrowed(ctx, d.stream) };
                    last = Some(s.clone());
                    s
                }
            };
            // SAFETY: per this function's contract, and as above for `seen`.
            let s = unsafe { seen.slice::<T>(d, stream) }?;
            if !s.is_plain_allocation() && self.several_gpus {
                return Err(Error::InvalidArgument(format!(
                    "a tensor of rank {rank} is memory of a pool or a cuMemMap mapping \
                     (PyTorch's expandable_segments or cudaMallocAsync allocator), which the \
                     clique's other GPUs may not reach: use the default allocator, or a \
                     Communicator (one process per GPU)"
                )));
            }
            Ok(s)
        };
        let i = slice(root, input)?;
        let o = outs
            .iter()
            .enumerate()
            .map(|(rank, d)| slice(rank, d))
            .collect::<gpucast::Result<Vec<_>>>()?;
        Ok((i, o))
    }

    /// One broadcast of one tensor through `clique.with(&options).broadcast`, the call a Rust program
    /// makes (tensors of different types go through the fused call, which names the error).
    ///
    /// # Safety
    /// As for [`PyClique::typed`].
    unsafe fn single(
        &self,
        root: usize,
        input: &Desc,
        outs: &[Desc],
        options: &BroadcastOptions,
    ) -> gpucast::Result<()> {
        // SAFETY: per this function's contract.
        unsafe { self.single_loop(root, input, outs, options, 1) }
    }

    /// [`PyClique::single`] `iters` times with the same buffers.
    ///
    /// # Safety
    /// As for [`PyClique::typed`].
    unsafe fn single_loop(
        &self,
        root: usize,
        input: &Desc,
        outs: &[Desc],
        options: &BroadcastOptions,
        iters: usize,
    ) -> gpucast::Result<()> {
        if outs.iter().any(|o| o.dtype != input.dtype) {
            let mut seen = Seen::default();
            // SAFETY: per this function's contract.
            let inp = unsafe { self.buffers_of(root, std::slice::from_ref(input), &mut seen) }?;
            // SAFETY: per this function's contract.
            let mut out = unsafe { self.buffers_of_each(outs, &mut seen) }?;
            let inputs: Vec<&dyn DeviceTensor> = inp.iter().map(|b| &**b as _).collect();
            return self
                .inner
                .with(options)
                .broadcast_many(root, &inputs, &mut lend(&mut out))
                .map(|_| ());
        }
        typed!(input.dtype, T => {
            // SAFETY: per this function's contract.
            let (i, mut o) = unsafe { self.typed::<T>(root, input, outs) }?;
            for _ in 0..iters {
                self.inner.with(options).broadcast(root, &i, &mut o)?;
            }
            Ok(())
        })
    }

    /// One list of one buffer per rank.
    ///
    /// # Safety
    /// As for [`PyClique::buffers_of`], `outs[rank]` being rank `rank`'s.
    unsafe fn buffers_of_each(
        &self,
        outs: &[Desc],
        seen: &mut Seen,
    ) -> gpucast::Result<Vec<Vec<Box<Buffer>>>> {
        outs.iter()
            .enumerate()
            // SAFETY: per this function's contract.
            .map(|(rank, d)| unsafe { self.buffers_of(rank, std::slice::from_ref(d), seen) })
            .collect()
    }

    /// Descriptions of `lists[rank][t]`, one list per rank (rank `source`'s only read). Every
    /// list is read before any tensor is (see [`items`]).
    fn describe_lists(
        &self,
        lists: &Bound<'_, PyList>,
        stream: Option<u64>,
        source: Option<usize>,
        memo: &mut Memo,
    ) -> PyResult<Vec<Vec<Desc>>> {
        let lists = lists
            .iter()
            .map(|l| items(&l))
            .collect::<PyResult<Vec<_>>>()?;
        self.describe_items(&lists, stream, source, memo)
    }

    /// [`PyClique::describe_lists`] of lists already read.
    fn describe_items(
        &self,
        lists: &[Vec<Bound<'_, PyAny>>],
        stream: Option<u64>,
        source: Option<usize>,
        memo: &mut Memo,
    ) -> PyResult<Vec<Vec<Desc>>> {
        lists
            .iter()
            .enumerate()
            .map(|(rank, list)| {
                let at = self.at(rank, stream).reading(source == Some(rank));
                list.iter().map(|t| describe_with(t, at, memo)).collect()
            })
            .collect()
    }

    /// A `stream=` handle given by the caller must be a stream of every rank's context.
    fn check_stream(&self, stream: Option<u64>) -> PyResult<()> {
        (0..self.devices.len()).try_for_each(|r| check_stream(self.inner.context(r), stream))
    }
}

/// The objects `iterable` yields, read at once. A call reads every iterable it is given
/// before it reads any tensor: a generator's code (which could resize a tensor read before, or
/// swap its storage) runs before the addresses are taken, never between taking them and
/// queueing the work.
fn items<'py>(iterable: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    iterable.try_iter()?.collect()
}

/// A fresh job token (64 hex characters from the operating system's random source), for a
/// launcher to hand every rank of an explicit group.
#[pyfunction]
fn random_token() -> PyResult<String> {
    gpucast::rendezvous::random_token().map_err(|e| to_py(e.into()))
}

/// NCCL's version as `(major, minor, patch)`.
#[pyfunction]
fn nccl_version() -> PyResult<(i32, i32, i32)> {
    gpucast::nccl_version().map_err(to_py)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCommunicator>()?;
    m.add_class::<PyClique>()?;
    m.add_function(wrap_pyfunction!(nccl_version, m)?)?;
    m.add_function(wrap_pyfunction!(random_token, m)?)?;
    m.add_function(wrap_pyfunction!(tensors::describe_tensor, m)?)?;
    m.add("MAX_GPUS", gpucast::MAX_GPUS)?;
    Ok(())
}
