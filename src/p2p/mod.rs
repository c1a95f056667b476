//! The P2P path: per-GPU signal areas, the compiled kernels, launches and error recovery.
//!
//! Protocol and memory-ordering notes are in `kernel.cu`; the layout and geometry in `plan`.

pub(crate) mod compile;
mod launcher;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr, CUfunction, CUstream};
use cudarc::driver::{result, CudaContext, CudaFunction, CudaModule, DeviceRepr};

use crate::error::{Error, Result};
use crate::plan::{self, layout, Geometry, Route, MAX_GPUS};

/// Kernel parameters; must match `struct Params` in kernel.cu field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Params {
    pub src: u64,
    pub dst: u64,
    pub bytes: u64,
    pub signal: [u64; MAX_GPUS],
    pub error_slot: u64,
    pub timeout_ns: u64,
    pub rank: u32,
    pub nranks: u32,
    pub root: u32,
    pub unit: u32,
    pub head: u32,
    pub chunk: u32,
    pub pad: [u32; 2],
}

// SAFETY: `Params` is `repr(C)`, `Copy`, holds only integers, and matches the kernel's layout
// (13 u64 then 8 u32: 136 bytes, 8-aligned).
unsafe impl DeviceRepr for Params {}

const _: () = assert!(std::mem::size_of::<Params>() == 136);

/// One copy of a fused launch; matches `struct ListEntry` in kernel.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ListEntry {
    pub src: u64,
    pub dst: u64,
    pub bytes: u64,
    pub unit: u32,
    pub head: u32,
}

/// Parameters of the fused pull kernel; matches `struct ListParams` in kernel.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ListParams {
    pub signal: [u64; MAX_GPUS],
    pub error_slot: u64,
    pub timeout_ns: u64,
    pub rank: u32,
    pub nranks: u32,
    pub root: u32,
    pub count: u32,
    pub entries: [ListEntry; plan::LIST_MAX],
}

// SAFETY: `repr(C)`, `Copy`, integers only, laid out as the kernel's `ListParams`.
unsafe impl DeviceRepr for ListParams {}

// The kernel parameter space is 4 KiB.
const _: () = assert!(std::mem::size_of::<ListParams>() <= 4096);

/// One GPU's share of the P2P path.
struct RankState {
    ctx: Arc<CudaContext>,
    _module: Arc<CudaModule>,
    packet: CudaFunction,
    pull: CudaFunction,
    pull_list: CudaFunction,
    /// Flags + packet inbox ([`layout::TOTAL_BYTES`]), plain `cuMemAlloc` memory that every peer
    /// maps through peer access.
    signal: CUdeviceptr,
    /// This rank's error slot, as the device sees it.
    error_dev: u64,
}

/// Host-mapped error slots, one u64 per rank.
struct ErrorSlots {
    host: *mut u64,
}

/// The P2P path of one clique.
pub(crate) struct P2p {
    ranks: Vec<RankState>,
    errors: ErrorSlots,
    signals: [u64; MAX_GPUS],
    timeout_ns: u64,
    /// Worker threads that launch on ranks 1.. while the caller launches on rank 0.
    launcher: Option<launcher::Launcher>,
    /// Whether `launch` uses the workers.
    parallel: AtomicBool,
}

/// Environment variable: `0` launches the P2P kernel on every GPU from the calling thread, one
/// after the other, instead of from one thread per GPU.
pub const PARALLEL_LAUNCH_ENV: &str = "GPUCAST_PARALLEL_LAUNCH";

// SAFETY: the raw pointers are a pinned host allocation and device addresses owned by this value;
// the driver calls on them are thread-safe, and the clique serialises launches.
unsafe impl Send for P2p {}
// SAFETY: as for Send; shared access only reads the host slots (volatile) or launches under the
// clique's lock.
unsafe impl Sync for P2p {}

impl P2p {
    /// Compiles (or reuses) the kernels, loads them on every GPU, allocates and zeroes the
    /// signal areas and the error slots. Peer access must already be enabled between all pairs.
    pub(crate) fn new(ctxs: &[Arc<CudaContext>], timeout_ns: u64) -> Result<P2p> {
        let n = ctxs.len();
        // SAFETY: a fresh pinned, portable, device-mapped host allocation of MAX_GPUS u64.
        let host = unsafe {
            ctxs[0]
                .bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            result::malloc_host(
                MAX_GPUS * 8,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
            .map_err(Error::cuda("allocating the host-mapped error slots"))?
        } as *mut u64;
        // Built up in place so that an error part-way frees what was allocated (Drop).
        let mut p2p = P2p {
            ranks: Vec::with_capacity(n),
            errors: ErrorSlots { host },
            signals: [0; MAX_GPUS],
            timeout_ns,
            launcher: None,
            parallel: AtomicBool::new(false),
        };
        p2p.errors.clear();
        for (rank, ctx) in ctxs.iter().enumerate() {
            let (major, minor) = ctx
                .compute_capability()
                .map_err(Error::cuda("reading the compute capability"))?;
            let ptx = compile::ptx_for(major, minor)?;
            let module =
                ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                    .map_err(Error::cuda(format!(
                        "loading the P2P kernels on rank {rank}"
                    )))?;
            let packet = module
                .load_function(compile::PACKET_KERNEL)
                .map_err(Error::cuda("finding the packet kernel"))?;
            let pull = module
                .load_function(compile::PULL_KERNEL)
                .map_err(Error::cuda("finding the pull kernel"))?;
            let pull_list = module
                .load_function(compile::PULL_LIST_KERNEL)
                .map_err(Error::cuda("finding the fused pull kernel"))?;
            let mut error_dev: CUdeviceptr = 0;
            ctx.bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            // SAFETY: `host` is a live DEVICEMAP|PORTABLE allocation of MAX_GPUS u64 and
            // rank < MAX_GPUS; `error_dev` is an out pointer.
            unsafe {
                sys::cuMemHostGetDevicePointer_v2(&mut error_dev, host.add(rank) as *mut c_void, 0)
                    .result()
            }
            .map_err(Error::cuda("mapping the error slot"))?;
            // SAFETY: plain device allocation in the current (rank's) context; freed in Drop.
            let signal = unsafe { result::malloc_sync(layout::TOTAL_BYTES) }.map_err(
                Error::cuda(format!("allocating the signal area on rank {rank}")),
            )?;
            p2p.signals[rank] = signal;
            p2p.ranks.push(RankState {
                ctx: ctx.clone(),
                _module: module,
                packet,
                pull,
                pull_list,
                signal,
                error_dev,
            });
        }
        if n > 1 {
            let raw: Vec<_> = ctxs.iter().map(|c| c.cu_ctx()).collect();
            match launcher::Launcher::new(&raw) {
                Ok(l) => {
                    p2p.launcher = Some(l);
                    let off = std::env::var(PARALLEL_LAUNCH_ENV).is_ok_and(|v| v.trim() == "0");
                    p2p.parallel.store(!off, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "no launch threads: launching from the caller's thread")
                }
            }
        }
        p2p.zero_signals_sync()?;
        Ok(p2p)
    }

    /// Zeroes every signal area and waits for it (used at creation and after a timeout).
    fn zero_signals_sync(&self) -> Result<()> {
        for r in &self.ranks {
            r.ctx
                .bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            // SAFETY: `signal` is a live allocation of TOTAL_BYTES on this context.
            unsafe { result::memset_d8_sync(r.signal, 0, layout::TOTAL_BYTES) }
                .map_err(Error::cuda("zeroing a signal area"))?;
        }
        for r in &self.ranks {
            r.ctx
                .synchronize()
                .map_err(Error::cuda("synchronising after zeroing signals"))?;
        }
        Ok(())
    }

    /// The per-rank kernel parameters of one broadcast (everything but `dst`).
    pub(crate) fn params(
        &self,
        route: Route,
        root: usize,
        src: u64,
        bytes: usize,
    ) -> (Geometry, Params) {
        let geometry = match route {
            Route::P2pPacket => plan::packet_geometry(bytes),
            _ => plan::pull_geometry(bytes),
        };
        let params = Params {
            src,
            dst: 0,
            bytes: bytes as u64,
            signal: self.signals,
            error_slot: 0,
            timeout_ns: self.timeout_ns,
            rank: 0,
            nranks: u32::try_from(self.ranks.len()).expect("<= 8"),
            root: u32::try_from(root).expect("<= 8"),
            unit: 1,
            head: 0,
            chunk: geometry.chunk,
            pad: [0; 2],
        };
        (geometry, params)
    }

    /// Launches the kernel of `route` on every rank: rank i copies into `dsts[i]`.
    ///
    /// # Safety
    /// `params.src` must be `bytes` readable bytes on the root's device (readable by every peer
    /// for the pull route), `dsts[i]` as many writable bytes on rank i's device, and `streams[i]`
    /// a live stream of rank i's context. All of it must stay valid until the streams pass this
    /// point. Every rank must be launched (this function does) in the same order as every other
    /// P2P launch of this clique.
    pub(crate) unsafe fn launch(
        &self,
        route: Route,
        geometry: Geometry,
        mut params: Params,
        dsts: &[u64],
        streams: &[CUstream],
    ) -> Result<()> {
        let n = self.ranks.len();
        let mut jobs = [None; MAX_GPUS];
        for (rank, r) in self.ranks.iter().enumerate() {
            params.rank = u32::try_from(rank).expect("<= 8");
            params.dst = dsts[rank];
            params.error_slot = r.error_dev;
            let func: CUfunction = if route == Route::P2pPacket {
                r.packet.cu_function()
            } else {
                let a = plan::co_alignment(params.src, params.dst, params.bytes);
                params.unit = a.unit;
                params.head = a.head;
                r.pull.cu_function()
            };
            jobs[rank] = Some(launcher::Job {
                func,
                blocks: geometry.blocks,
                threads: geometry.threads,
                stream: streams[rank],
                params,
            });
        }
        let jobs: Vec<launcher::Job> = jobs[..n]
            .iter()
            .map(|j| j.expect("one job per rank"))
            .collect();
        if let (Some(l), true) = (&self.launcher, self.parallel.load(Ordering::Relaxed)) {
            // SAFETY: every job is a launch of this clique's kernels on its rank's stream with
            // parameters valid per this function's contract.
            return unsafe { l.launch_all(&jobs, self.ranks[0].ctx.cu_ctx()) }.map_err(
                |(rank, code)| Error::Cuda {
                    during: format!("launching the P2P kernel on rank {rank}"),
                    source: result::DriverError(code),
                },
            );
        }
        for (rank, (r, job)) in self.ranks.iter().zip(&jobs).enumerate() {
            // SAFETY: the context is live (owned by the clique) and the job is a valid launch
            // in it per this function's contract.
            unsafe {
                result::ctx::set_current(r.ctx.cu_ctx()).and_then(|()| launcher::launch(job))
            }
            .map_err(Error::cuda(format!(
                "launching the P2P kernel on rank {rank}"
            )))?;
        }
        Ok(())
    }

    /// Turns the per-GPU launch threads on or off (no effect on a one-GPU clique).
    pub(crate) fn set_parallel_launch(&self, on: bool) {
        self.parallel
            .store(on && self.launcher.is_some(), Ordering::Relaxed);
    }

    /// Whether launches currently go through the per-GPU threads.
    pub(crate) fn parallel_launch(&self) -> bool {
        self.parallel.load(Ordering::Relaxed)
    }

    /// Launches one fused pull over `copies[rank]` (each a list of (src, dst, bytes), the same
    /// length and sizes on every rank).
    ///
    /// # Safety
    /// As for [`P2p::launch`], for every listed copy.
    pub(crate) unsafe fn launch_list(
        &self,
        root: usize,
        copies: &[Vec<(u64, u64, usize)>],
        streams: &[CUstream],
    ) -> Result<()> {
        let count = copies[0].len();
        assert!(
            count <= plan::LIST_MAX,
            "planned batches hold at most LIST_MAX entries"
        );
        let total: usize = copies[0].iter().map(|c| c.2).sum();
        if total == 0 {
            return Ok(());
        }
        let geometry = plan::pull_geometry(total);
        let mut params = ListParams {
            signal: self.signals,
            error_slot: 0,
            timeout_ns: self.timeout_ns,
            rank: 0,
            nranks: u32::try_from(self.ranks.len()).expect("<= 8"),
            root: u32::try_from(root).expect("<= 8"),
            count: u32::try_from(count).expect("<= LIST_MAX"),
            entries: [ListEntry::default(); plan::LIST_MAX],
        };
        for (rank, r) in self.ranks.iter().enumerate() {
            params.rank = u32::try_from(rank).expect("<= 8");
            params.error_slot = r.error_dev;
            for (e, &(src, dst, bytes)) in params.entries.iter_mut().zip(&copies[rank]) {
                let a = plan::co_alignment(src, dst, bytes as u64);
                *e = ListEntry {
                    src,
                    dst,
                    bytes: bytes as u64,
                    unit: a.unit,
                    head: a.head,
                };
            }
            // SAFETY: the context is live; its fused kernel takes one `ListParams` by value and
            // the listed pointers are valid per this function's contract.
            unsafe {
                result::ctx::set_current(r.ctx.cu_ctx()).and_then(|()| {
                    launch_one(
                        r.pull_list.cu_function(),
                        geometry.blocks,
                        geometry.threads,
                        streams[rank],
                        params,
                    )
                })
            }
            .map_err(Error::cuda(format!(
                "launching the fused P2P kernel on rank {rank}"
            )))?;
        }
        Ok(())
    }

    /// The first timeout any rank's kernel reported, if any (does not wait for the GPUs).
    pub(crate) fn take_error(&self) -> Option<Error> {
        for rank in 0..self.ranks.len() {
            let record = self.errors.read(rank);
            if record != 0 {
                return Some(decode_timeout(rank, record, self.timeout_ns));
            }
        }
        None
    }

    /// After a timeout: the caller has drained every stream; zero the signals and error slots so
    /// the next broadcast starts from op 1 everywhere.
    pub(crate) fn recover(&self) -> Result<()> {
        self.zero_signals_sync()?;
        self.errors.clear();
        Ok(())
    }
}

/// Launches `func` (which takes one `P` by value) in the current context.
///
/// # Safety
/// `func` belongs to the current context, `stream` too, and the kernel's only parameter has the
/// layout of `P`, whose pointers are valid for the launch.
unsafe fn launch_one<P: DeviceRepr>(
    func: CUfunction,
    blocks: u32,
    threads: u32,
    stream: CUstream,
    mut params: P,
) -> std::result::Result<(), result::DriverError> {
    let mut arg = (&mut params) as *mut P as *mut c_void;
    // SAFETY: guaranteed by the caller; the driver copies the parameter before returning.
    unsafe {
        result::launch_kernel(
            func,
            (blocks, 1, 1),
            (threads, 1, 1),
            0,
            stream,
            std::slice::from_mut(&mut arg),
        )
    }
}

/// Decodes a kernel's timeout record: code (8 bits) | phase (8) | block (16) | op counter (32).
pub(crate) fn decode_timeout(rank: usize, record: u64, timeout_ns: u64) -> Error {
    let phase = match (record >> 48) & 0xff {
        1 => "root waiting for a peer to free its packet slot",
        2 => "waiting for the root's packets",
        3 => "waiting for the root to arrive",
        4 => "root waiting for peers to finish reading",
        _ => "unknown wait",
    };
    Error::Timeout {
        rank,
        phase,
        block: ((record >> 32) & 0xffff) as u32,
        op: (record & 0xffff_ffff) as u32,
        timeout_ms: timeout_ns / 1_000_000,
    }
}

impl ErrorSlots {
    fn read(&self, rank: usize) -> u64 {
        // SAFETY: `host` points to MAX_GPUS u64 of live pinned memory; the device writes it, so
        // the read is volatile.
        unsafe { std::ptr::read_volatile(self.host.add(rank)) }
    }

    fn clear(&self) {
        for rank in 0..MAX_GPUS {
            // SAFETY: as in `read`.
            unsafe { std::ptr::write_volatile(self.host.add(rank), 0) };
        }
    }
}

impl Drop for P2p {
    fn drop(&mut self) {
        for r in &self.ranks {
            if r.ctx.bind_to_thread().is_ok() {
                // SAFETY: allocated by `malloc_sync` in this context; no kernel uses it any more
                // (the clique synchronised its streams before dropping the P2P state).
                if let Err(e) = unsafe { result::free_sync(r.signal) } {
                    tracing::warn!(error = %e, "could not free a signal area");
                }
            }
        }
        // SAFETY: allocated by `malloc_host`; no kernel uses it any more.
        if let Err(e) = unsafe { result::free_host(self.errors.host as *mut c_void) } {
            tracing::warn!(error = %e, "could not free the error slots");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_records_decode() {
        let record = (1u64 << 56) | (3u64 << 48) | (17u64 << 32) | 4242;
        match decode_timeout(1, record, 2_000_000_000) {
            Error::Timeout {
                rank,
                phase,
                block,
                op,
                timeout_ms,
            } => {
                assert_eq!((rank, block, op, timeout_ms), (1, 17, 4242, 2000));
                assert!(phase.contains("arrive"));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn params_layout_matches_the_kernel() {
        assert_eq!(std::mem::offset_of!(Params, signal), 24);
        assert_eq!(std::mem::offset_of!(Params, error_slot), 88);
        assert_eq!(std::mem::offset_of!(Params, rank), 104);
        assert_eq!(std::mem::offset_of!(Params, chunk), 124);
    }
}
