//! The P2P path: per-GPU signal areas, the compiled kernels, launches and error recovery.
//!
//! Protocol and memory-ordering notes are in `kernel.cu`; the shared layout and geometry in
//! `abi`.

pub(crate) mod abi;
pub(crate) mod compile;
pub(crate) mod ipc;
mod launcher;
mod shared;
mod state;

pub(crate) use state::{State, Status};

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::{self, CUdeviceptr, CUfunction, CUstream};
use cudarc::driver::{result, CudaContext, CudaFunction, CudaModule, DeviceRepr};

use crate::config::MAX_GPUS;
use crate::error::{Error, Result};
use abi::{layout, ListEntry, ListParams, Params};
use gpucast_rendezvous::Exchange;
use shared::SharedMemory;

/// The P2P kernel's protocols: what a P2P route becomes once it is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// The root writes the message into every peer's packet buffer
    /// ([`crate::config::Route::P2pPacket`]).
    Packet,
    /// Every peer reads the root's input ([`crate::config::Route::P2pPull`]).
    Pull,
    /// Each rank reads its predecessor's output ([`crate::config::Route::P2pChain`]).
    Chain,
}

/// One GPU's share of the P2P path.
struct RankKernels {
    ctx: Arc<CudaContext>,
    _module: Arc<CudaModule>,
    packet: CudaFunction,
    pull: CudaFunction,
    pull_list: CudaFunction,
    chain: CudaFunction,
    /// Flags + packet inbox ([`layout::TOTAL_BYTES`]): plain `cuMemAlloc` memory that every peer
    /// reaches through peer access (one process), or the head of this rank's shared memory.
    signal: CUdeviceptr,
    /// Whether `signal` is a `cuMemAlloc` allocation of its own (freed on drop).
    plain: bool,
    /// This rank's error slot, as the device sees it.
    error_dev: u64,
}

/// Host-mapped error slots, one u64 per rank, that kernels write when a wait times out.
struct HostSlots(*mut u64);

// SAFETY: the pointer is a pinned, portable host allocation of MAX_GPUS u64 owned by `P2p`; it
// is only accessed with volatile reads and writes of whole words (the device writes it too).
unsafe impl Send for HostSlots {}
// SAFETY: as for `Send`: shared access is volatile word reads, and writes happen under the
// engine's lock.
unsafe impl Sync for HostSlots {}

impl HostSlots {
    fn read(&self, rank: usize) -> u64 {
        assert!(rank < MAX_GPUS);
        // SAFETY: `self.0` points to MAX_GPUS live u64 and rank < MAX_GPUS.
        unsafe { std::ptr::read_volatile(self.0.add(rank)) }
    }

    fn clear(&self) {
        for rank in 0..MAX_GPUS {
            // SAFETY: as in `read`.
            unsafe { std::ptr::write_volatile(self.0.add(rank), 0) };
        }
    }
}

/// Across processes, peers cannot read the root's own buffers: the root copies a pull
/// message into its staging buffer (shared memory every peer has mapped) and peers read that.
struct Staging {
    /// Every rank's staging buffer, as mapped in this process.
    ptrs: [u64; MAX_GPUS],
    /// Bytes of each.
    bytes: usize,
    /// This rank's allocation and the peers' mappings; released on drop.
    _memory: Vec<SharedMemory>,
}

/// Bytes of each rank's staging buffer across processes; longer pull messages go in chunks.
const STAGING_BYTES: usize = 32 << 20;

/// What rank `peer` published in the first round across processes: the size of its shareable
/// allocation (u64) and its socket card. The size must cover the `needed` bytes every kernel
/// addresses, and be at most twice that (the allocation granularity rounds it up a little):
/// a smaller mapping would let kernels run past its end, a larger one is no allocation of
/// gpucast's.
fn peer_card(bytes: &[u8], peer: usize, needed: usize) -> Result<(usize, ipc::Card)> {
    let bad = |why: String| Error::P2pUnavailable(format!("rank {peer}'s P2P card: {why}"));
    let (size, card) = bytes
        .split_first_chunk::<8>()
        .ok_or_else(|| bad(format!("{} bytes", bytes.len())))?;
    let size = usize::try_from(u64::from_le_bytes(*size)).unwrap_or(usize::MAX);
    if size < needed || size > needed.saturating_mul(2) {
        return Err(bad(format!(
            "a mapping of {size} bytes, where {needed} to {} are expected",
            needed.saturating_mul(2)
        )));
    }
    Ok((size, ipc::Card::decode(card)?))
}

/// The P2P path of one engine: kernels, signal areas and launch threads.
pub(crate) struct P2p {
    ranks: Vec<RankKernels>,
    /// The job rank of each local rank.
    global: Vec<u32>,
    /// Ranks taking part (the job).
    nranks: u32,
    errors: HostSlots,
    /// Every rank's signal area, by job rank, as this process addresses it.
    signals: [u64; MAX_GPUS],
    /// Across processes: the staging buffers.
    staging: Option<Staging>,
    timeout_ns: u64,
    /// Worker threads that launch on ranks 1.. while the caller launches on rank 0.
    launcher: Option<launcher::Launcher>,
    /// Whether `launch` uses the workers.
    parallel: bool,
    /// How long the caller waits for a worker to take its launch.
    handoff_limit: Duration,
}

impl P2p {
    /// One process, every rank local: compiles (or reuses) the kernels, loads them on every
    /// GPU, allocates and zeroes the signal areas and the error slots. Peer access must already
    /// be enabled between all pairs.
    pub(crate) fn new(ctxs: &[Arc<CudaContext>], timeout: Duration, parallel: bool) -> Result<P2p> {
        let n = ctxs.len();
        let global = (0..n).map(|r| u32::try_from(r).expect("<= 8")).collect();
        let mut p2p = P2p::with_kernels(ctxs, global, n, timeout)?;
        for (local, r) in p2p.ranks.iter_mut().enumerate() {
            r.ctx
                .bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            // SAFETY: plain device allocation in the current (rank's) context; freed in Drop.
            let signal = unsafe { result::malloc_sync(layout::TOTAL_BYTES) }.map_err(
                Error::cuda(format!("allocating the signal area on rank {local}")),
            )?;
            r.signal = signal;
            r.plain = true;
            p2p.signals[local] = signal;
        }
        if n > 1 {
            let raw: Vec<_> = ctxs.iter().map(|c| c.cu_ctx()).collect();
            // SAFETY: the contexts are the ranks' primary contexts, which `p2p.ranks` keeps
            // (`RankKernels::ctx`) until `P2p`'s drop, and that drop ends the launcher first.
            match unsafe { launcher::Launcher::new(&raw) } {
                Ok(l) => p2p.launcher = Some(l),
                Err(e) => {
                    tracing::warn!(error = %e, "no launch threads: launching from the caller's thread")
                }
            }
        }
        p2p.set_parallel_launch(parallel);
        if let Err(e) = p2p.zero_signals_sync() {
            p2p.abandon();
            return Err(e);
        }
        Ok(p2p)
    }

    /// One rank per process on one host: rank `rank` of `world` on `ctx`. Allocates this rank's
    /// signal area and staging buffer in shareable memory, hands it to the other processes and
    /// maps theirs, through `peers` and a Unix socket per process, once. Every rank of the job
    /// must call it together; every rank gets an error if any rank fails.
    pub(crate) fn new_ipc(
        ctx: &Arc<CudaContext>,
        rank: usize,
        world: usize,
        peers: &dyn Exchange,
        timeout: Duration,
        deadline: std::time::Instant,
    ) -> Result<P2p> {
        let signal_bytes = layout::TOTAL_BYTES.next_multiple_of(2 << 20);
        let local = (|| -> Result<_> {
            let rank32 = u32::try_from(rank).expect("world <= 8");
            let p2p = P2p::with_kernels(std::slice::from_ref(ctx), vec![rank32], world, timeout)?;
            let memory = SharedMemory::alloc(ctx, signal_bytes + STAGING_BYTES)?;
            let fd = memory.export()?;
            let server = ipc::Server::bind()?;
            Ok((p2p, memory, fd, server))
        })();
        // Round 1: every rank's socket card and allocation size, or nothing after a failure.
        let card = match &local {
            Ok((_, memory, _, server)) => {
                let mut c = (memory.size() as u64).to_le_bytes().to_vec();
                c.extend(server.card().encode());
                c
            }
            Err(_) => Vec::new(),
        };
        let cards = peers.all_gather(&card)?;
        if let Some(bad) = cards.iter().position(Vec::is_empty) {
            return Err(match local {
                Err(e) => e,
                Ok(_) => Error::P2pUnavailable(format!(
                    "rank {bad} could not set up shared memory for P2P"
                )),
            });
        }
        let (mut p2p, memory, fd, server) = local?;
        // The descriptors: serve ours to every peer while fetching theirs.
        let mut fetched: Vec<(usize, std::os::fd::OwnedFd, usize)> = Vec::new();
        let header = u32::try_from(rank).expect("world <= 8").to_le_bytes();
        let outcome = std::thread::scope(|scope| -> Result<()> {
            let served = scope
                .spawn(|| server.serve(&header, std::slice::from_ref(&fd), world - 1, deadline));
            let mut first_error = None;
            for (peer, c) in cards.iter().enumerate() {
                if peer == rank {
                    continue;
                }
                let got = (|| -> Result<_> {
                    let (size, card) = peer_card(c, peer, signal_bytes + STAGING_BYTES)?;
                    let (head, mut fds) = ipc::fetch(&card, 1, deadline)?;
                    if head != u32::try_from(peer).expect("world <= 8").to_le_bytes() {
                        return Err(Error::P2pUnavailable(format!(
                            "the socket of rank {peer} answered for another rank"
                        )));
                    }
                    Ok((fds.pop().expect("one descriptor"), size))
                })();
                match got {
                    Ok((fd, size)) => fetched.push((peer, fd, size)),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
            let served = served.join().unwrap_or_else(|_| {
                Err(Error::P2pUnavailable(
                    "the descriptor server panicked".into(),
                ))
            });
            match first_error {
                Some(e) => Err(e),
                None => served,
            }
        });
        drop(fd);
        drop(server);
        let mut mapped = vec![memory];
        let outcome = outcome.and_then(|()| {
            for (peer, fd, size) in fetched {
                let m = SharedMemory::import(ctx, fd, size)?;
                p2p.signals[peer] = m.ptr();
                mapped.push(m);
                let _ = peer;
            }
            let own = mapped[0].ptr();
            p2p.signals[rank] = own;
            p2p.ranks[0].signal = own;
            p2p.zero_signals_sync()
        });
        if matches!(outcome, Err(Error::StreamsBusy { .. })) {
            // A memset may still write the mapping: leak it rather than unmap it.
            std::mem::forget(mapped);
            p2p.abandon();
            let why = Error::P2pUnavailable("zeroing the signal area did not finish".into());
            let _ = peers.all_gather(&[0]);
            return Err(why);
        }
        // Round 2: everyone mapped everything (and zeroed its own area) before any kernel runs.
        let flags = peers.all_gather(&[u8::from(outcome.is_ok())])?;
        outcome?;
        if let Some(bad) = flags.iter().position(|f| f.first() != Some(&1)) {
            return Err(Error::P2pUnavailable(format!(
                "rank {bad} could not map its peers' shared memory"
            )));
        }
        // Each rank's staging buffer follows its signal area; the mappings are in rank order
        // of `signals`.
        let mut ptrs = [0u64; MAX_GPUS];
        for (r, p) in ptrs.iter_mut().enumerate().take(world) {
            *p = p2p.signals[r] + signal_bytes as u64;
        }
        p2p.staging = Some(Staging {
            ptrs,
            bytes: STAGING_BYTES,
            _memory: mapped,
        });
        Ok(p2p)
    }

    /// The kernels of every local context and the host error slots; no signal area yet.
    fn with_kernels(
        ctxs: &[Arc<CudaContext>],
        global: Vec<u32>,
        world: usize,
        timeout: Duration,
    ) -> Result<P2p> {
        ctxs[0]
            .bind_to_thread()
            .map_err(Error::cuda("binding a context"))?;
        // SAFETY: a fresh pinned, portable, device-mapped host allocation of MAX_GPUS u64.
        let host = unsafe {
            result::malloc_host(
                MAX_GPUS * 8,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        }
        .map_err(Error::cuda("allocating the host-mapped error slots"))?;
        // Built up in place so that an error part-way frees what was allocated (Drop).
        let mut p2p = P2p {
            ranks: Vec::with_capacity(ctxs.len()),
            global,
            nranks: u32::try_from(world).expect("world <= 8"),
            errors: HostSlots(host.cast::<u64>()),
            signals: [0; MAX_GPUS],
            staging: None,
            timeout_ns: u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
            launcher: None,
            parallel: false,
            handoff_limit: timeout,
        };
        p2p.errors.clear();
        for (local, ctx) in ctxs.iter().enumerate() {
            let (major, minor) = ctx
                .compute_capability()
                .map_err(Error::cuda("reading the compute capability"))?;
            let ptx = compile::ptx_for(major, minor)?;
            let module =
                ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                    .map_err(Error::cuda(format!(
                        "loading the P2P kernels on rank {local}"
                    )))?;
            let load = |name| {
                module
                    .load_function(name)
                    .map_err(Error::cuda(format!("finding {name} on rank {local}")))
            };
            let (packet, pull, pull_list, chain) = (
                load(compile::PACKET_KERNEL)?,
                load(compile::PULL_KERNEL)?,
                load(compile::PULL_LIST_KERNEL)?,
                load(compile::CHAIN_KERNEL)?,
            );
            ctx.bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            // SAFETY: the host slots are a live DEVICEMAP|PORTABLE allocation of MAX_GPUS u64
            // and local < MAX_GPUS.
            let error_dev = unsafe {
                crate::driver::memory::host_device_pointer(p2p.errors.0.add(local).cast::<c_void>())
            }
            .map_err(Error::cuda("mapping the error slot"))?;
            p2p.ranks.push(RankKernels {
                ctx: ctx.clone(),
                _module: module,
                packet,
                pull,
                pull_list,
                chain,
                signal: 0,
                plain: false,
                error_dev,
            });
        }
        Ok(p2p)
    }

    /// Zeroes every signal area and waits for it (at creation and after a timeout), on a
    /// stream of its own: the wait covers the memsets alone, not the caller's other work on
    /// the context, and ends within [`crate::driver::MEMSET_WITHIN`] per rank. On [`Error::StreamsBusy`] a
    /// memset is still pending: the areas must then be neither used nor freed (see
    /// [`P2p::abandon`]).
    fn zero_signals_sync(&self) -> Result<()> {
        for r in &self.ranks {
            // SAFETY: `signal` is a live allocation of TOTAL_BYTES (a multiple of 4) on this
            // context, kept (leaked) on StreamsBusy by every caller.
            unsafe { crate::driver::memset_now(&r.ctx, r.signal, 0, layout::TOTAL_BYTES / 4) }?;
        }
        Ok(())
    }

    /// Leaks this P2P state (signal areas, shared mappings, error slots, contexts) after a reset
    /// that did not finish: a memset may still write the areas, so they are never freed or
    /// reused. The launch threads end (within the launcher's park interval, 50 ms): no launch
    /// is in flight, since every launch borrows this state.
    pub(crate) fn abandon(self) {
        tracing::warn!("a reset of the P2P signal areas did not finish: they are leaked");
        self.leak();
    }

    /// Leaks the memory (a kernel may still use it), not the launch threads: they end.
    pub(crate) fn leak(mut self) {
        drop(self.launcher.take());
        std::mem::forget(self);
    }

    fn base_params(&self, root: usize, src: u64, bytes: usize, chunk: u32) -> Params {
        Params {
            src,
            dst: 0,
            bytes: bytes as u64,
            signal: self.signals,
            error_slot: 0,
            timeout_ns: self.timeout_ns,
            lease_ns: abi::lease_bound_ns(self.timeout_ns, bytes as u64),
            rank: 0,
            nranks: self.nranks,
            root: u32::try_from(root).expect("<= 8"),
            unit: 1,
            head: 0,
            chunk,
            from: 0,
        }
    }

    /// Launches the kernel of `protocol` on every local rank: the root (a job
    /// rank) copies `bytes` bytes from `src`, and local rank i writes them to `dsts[i]`. Across
    /// processes a pull goes through the root's staging buffer, in chunks of its size.
    ///
    /// # Safety
    /// As for [`P2p::launch_kernels`]; across processes, peers never read `src` itself.
    pub(crate) unsafe fn launch(
        &mut self,
        protocol: Protocol,
        root: usize,
        src: u64,
        bytes: usize,
        dsts: &[u64],
        streams: &[CUstream],
    ) -> Result<()> {
        if protocol == Protocol::Chain && self.staging.is_some() {
            return Err(Error::P2pUnavailable(
                "the P2P chain reads every rank's output: ranks of one process only".into(),
            ));
        }
        let Some(st) = self.staging.as_ref().filter(|_| protocol == Protocol::Pull) else {
            // SAFETY: per this function's contract.
            return unsafe { self.launch_kernels(protocol, root, src, bytes, dsts, streams) };
        };
        let (staged, chunk_max) = (st.ptrs[root], st.bytes);
        let mut off = 0;
        while off < bytes {
            let len = (bytes - off).min(chunk_max);
            let mut chunk_dsts = [0u64; MAX_GPUS];
            for (local, r) in self.ranks.iter().enumerate() {
                if self.global[local] as usize == root {
                    r.ctx
                        .bind_to_thread()
                        .map_err(Error::cuda("binding a context"))?;
                    // SAFETY: `src + off` holds `len` bytes (contract) and the staging buffer
                    // at least `chunk_max`; queued on the root's stream (live, of the context
                    // made current just above: contract) before its kernel. The previous
                    // chunk's (or call's) kernel precedes it there, and it ends only once every
                    // peer has read the staging buffer, or will never read it, or (a peer that
                    // claimed it and outlasted `abi::lease_bound_ns`) has its op expired: that
                    // peer may then read this copy's bytes, but the staging buffer stays mapped
                    // as long as this state, and the peer reports an error instead of success.
                    unsafe {
                        crate::driver::memory::copy_dtod_async(
                            staged,
                            src + off as u64,
                            len,
                            streams[local],
                        )
                    }
                    .map_err(Error::cuda("staging a P2P message"))?;
                    // In place, the root's buffer already holds the data: its kernel skips
                    // the copy when its destination is the source.
                    chunk_dsts[local] = if dsts[local] == src {
                        staged
                    } else {
                        dsts[local] + off as u64
                    };
                } else {
                    chunk_dsts[local] = dsts[local] + off as u64;
                }
            }
            // SAFETY: per this function's contract, for this chunk.
            unsafe {
                self.launch_kernels(
                    protocol,
                    root,
                    staged,
                    len,
                    &chunk_dsts[..self.ranks.len()],
                    streams,
                )
            }?;
            off += len;
        }
        Ok(())
    }

    /// Launches the kernel of `protocol` on every local rank, reading `src`.
    ///
    /// # Safety
    /// `src` holds `bytes` readable bytes on the root's device (readable by every peer for the
    /// pull route), `dsts[i]` as many writable bytes on rank i's device, and `streams[i]` is a
    /// live stream of rank i's context. All of it stays valid until the streams pass this point.
    /// Every P2P launch of this engine goes through `&mut self`, so all ranks see them in one
    /// order.
    unsafe fn launch_kernels(
        &mut self,
        protocol: Protocol,
        root: usize,
        src: u64,
        bytes: usize,
        dsts: &[u64],
        streams: &[CUstream],
    ) -> Result<()> {
        let geometry = match protocol {
            Protocol::Packet => abi::packet_geometry(bytes),
            Protocol::Pull => abi::pull_geometry(bytes),
            Protocol::Chain => abi::chain_geometry(bytes),
        };
        let mut params = self.base_params(root, src, bytes, geometry.chunk);
        let n = self.ranks.len();
        let from = if protocol == Protocol::Chain {
            self.chain_sources(root, src, dsts)?
        } else {
            [0; MAX_GPUS]
        };
        let mut jobs = [launcher::Job {
            func: std::ptr::null_mut(),
            blocks: geometry.blocks,
            threads: geometry.threads,
            stream: std::ptr::null_mut(),
            params,
        }; MAX_GPUS];
        for (rank, r) in self.ranks.iter().enumerate() {
            params.rank = self.global[rank];
            params.dst = dsts[rank];
            params.error_slot = r.error_dev;
            params.from = from[rank];
            // The buffer this rank copies from: its chain source, or the root's input.
            let read = if protocol == Protocol::Chain {
                params.from
            } else {
                params.src
            };
            let a = abi::co_alignment(read, params.dst, params.bytes);
            params.unit = a.unit;
            params.head = a.head;
            let func: CUfunction = match protocol {
                Protocol::Packet => r.packet.cu_function(),
                Protocol::Pull => r.pull.cu_function(),
                Protocol::Chain => r.chain.cu_function(),
            };
            jobs[rank] = launcher::Job {
                func,
                blocks: geometry.blocks,
                threads: geometry.threads,
                stream: streams[rank],
                params,
            };
        }
        let jobs = &jobs[..n];
        if let (Some(l), true) = (&self.launcher, self.parallel) {
            // SAFETY: every job is a launch of this engine's kernels on its rank's stream with
            // parameters valid per this function's contract; `&mut self` serialises calls.
            let outcome =
                unsafe { l.launch_all(jobs, self.ranks[0].ctx.cu_ctx(), self.handoff_limit) };
            return outcome.map_err(|f| match f {
                launcher::LaunchFailure::Driver { rank, code } => Error::Cuda {
                    during: format!("launching the P2P kernel on rank {rank}"),
                    source: result::DriverError(code),
                },
                launcher::LaunchFailure::Stalled { rank } => Error::LaunchStalled {
                    rank,
                    waited_ms: u64::try_from(self.handoff_limit.as_millis()).unwrap_or(u64::MAX),
                },
            });
        }
        for (rank, (r, job)) in self.ranks.iter().zip(jobs).enumerate() {
            // SAFETY: the context is live (owned by the engine) and the job is a valid launch
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

    /// What each local rank reads in a chain from `root` (a job rank): the root's input for
    /// the root itself (its own copy) and for its successor, the predecessor's output for the
    /// others. Every rank of the chain must be local.
    fn chain_sources(&self, root: usize, src: u64, dsts: &[u64]) -> Result<[u64; MAX_GPUS]> {
        let n = self.nranks as usize;
        let local_of = |global: usize| self.global.iter().position(|&g| g as usize == global);
        let mut from = [0u64; MAX_GPUS];
        for (local, &global) in self.global.iter().enumerate() {
            let global = global as usize;
            let pred = (global + n - 1) % n;
            from[local] = if global == root || pred == root {
                src
            } else {
                let p = local_of(pred).ok_or_else(|| {
                    Error::P2pUnavailable(format!(
                        "rank {pred} is not in this process: the P2P chain needs every rank"
                    ))
                })?;
                dsts[p]
            };
        }
        Ok(from)
    }

    /// Turns the per-GPU launch threads on or off (no effect without them).
    pub(crate) fn set_parallel_launch(&mut self, on: bool) {
        self.parallel = on && self.launcher.is_some();
    }

    /// Whether launches currently go through the per-GPU threads.
    pub(crate) fn parallel_launch(&self) -> bool {
        self.parallel
    }

    /// Launches one fused pull over `copies[rank]` (each a list of (src, dst, bytes), the same
    /// length and sizes on every rank).
    ///
    /// # Safety
    /// As for [`P2p::launch`], for every listed copy.
    pub(crate) unsafe fn launch_list(
        &mut self,
        root: usize,
        copies: &[Vec<(u64, u64, usize)>],
        streams: &[CUstream],
    ) -> Result<()> {
        let count = copies[0].len();
        assert!(
            count <= abi::LIST_MAX,
            "planned lists hold at most LIST_MAX"
        );
        let total: usize = copies[0].iter().map(|c| c.2).sum();
        if total == 0 {
            return Ok(());
        }
        let geometry = abi::pull_geometry(total);
        let mut params = ListParams {
            signal: self.signals,
            error_slot: 0,
            timeout_ns: self.timeout_ns,
            lease_ns: abi::lease_bound_ns(self.timeout_ns, total as u64),
            rank: 0,
            nranks: self.nranks,
            root: u32::try_from(root).expect("<= 8"),
            count: u32::try_from(count).expect("<= LIST_MAX"),
            entries: [ListEntry::default(); abi::LIST_MAX],
        };
        assert!(
            self.staging.is_none(),
            "fused P2P lists run in one process only"
        );
        for (rank, r) in self.ranks.iter().enumerate() {
            params.rank = self.global[rank];
            params.error_slot = r.error_dev;
            for (e, &(src, dst, bytes)) in params.entries.iter_mut().zip(&copies[rank]) {
                let a = abi::co_alignment(src, dst, bytes as u64);
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
    pub(crate) fn first_error(&self) -> Option<Error> {
        (0..self.ranks.len()).find_map(|local| {
            let record = self.errors.read(local);
            (record != 0)
                .then(|| decode_timeout(self.global[local] as usize, record, self.timeout_ns))
        })
    }

    /// Whether the ranks are in several processes (recovery then needs every process).
    pub(crate) fn across_processes(&self) -> bool {
        self.staging.is_some()
    }

    /// After a timeout or a cancelled launch: the caller has drained every stream; zero the
    /// signals and error slots so the next broadcast starts from op 1 everywhere.
    pub(crate) fn recover(&self) -> Result<()> {
        self.zero_signals_sync()?;
        self.errors.clear();
        Ok(())
    }

    #[cfg(feature = "testing")]
    /// Resets every local rank's signal area ([`P2p::recover`]), then sets its packet-op
    /// counters and packet acknowledgements to `value`, as if every rank had finished packet
    /// op `value` on every block: the next packet broadcast is op `value + 1`. Every word of
    /// the inboxes is set to `value` too, so no slot holds the tag of an op to come (a zeroed
    /// inbox would hold tag 0, which the first ops after a `value` close to `u32::MAX`
    /// reach before their root wrote the slot). Test support, so that the counters' wrap past
    /// `u32::MAX` can be run (2^32 broadcasts would take hours). The caller has drained every
    /// stream; in one process only (peers in other processes keep their counters).
    pub(crate) fn set_packet_counters(&self, value: u32) -> Result<()> {
        if self.across_processes() {
            return Err(Error::InvalidArgument(
                "packet counters can only be set where every rank is in this process".into(),
            ));
        }
        self.recover()?;
        for r in &self.ranks {
            for (word, words) in [
                (layout::PACKET_SEQ, abi::MAX_BLOCKS as usize),
                (layout::PACKET_ACK, abi::MAX_BLOCKS as usize * MAX_GPUS),
                (layout::INBOX_OFFSET / 4, layout::INBOX_BYTES / 4),
            ] {
                // SAFETY: `signal` is a live allocation of TOTAL_BYTES on this context, and
                // the ranges lie inside it (two in its flag words, in `layout`'s order, which a
                // test checks; the inbox last, ending at TOTAL_BYTES); on StreamsBusy the
                // memset may still run, into memory that stays allocated as long as this
                // state lives (the caller closes the path and leaks it then).
                unsafe {
                    crate::driver::memset_now(&r.ctx, r.signal + 4 * word as u64, value, words)
                }?;
            }
        }
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
    let mut arg = std::ptr::addr_of_mut!(params).cast::<c_void>();
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
        5 => "waiting for the predecessor's piece in the chain",
        6 => "waiting for the successor in the chain to finish reading",
        7 => {
            "waiting for a reader that claimed this rank's buffer to let go of it, past the \
              bound of its copy (that reader reports an error, not its data)"
        }
        8 => "arrived after the rank it reads from had given up: nothing was read",
        9 => {
            "the rank it read from stopped waiting for it while it read: its data may be \
              wrong, so it is not reported as success"
        }
        _ => "unknown wait",
    };
    Error::Timeout {
        rank,
        phase,
        block: u32::try_from((record >> 32) & 0xffff).expect("16 bits"),
        op: u32::try_from(record & 0xffff_ffff).expect("32 bits"),
        timeout_ms: timeout_ns / 1_000_000,
    }
}

impl Drop for P2p {
    /// Frees the signal areas and error slots. The engine drops the P2P state only when no
    /// kernel can still use them (streams drained), or leaks it.
    fn drop(&mut self) {
        // Stop the launch threads first: they hold the contexts current.
        self.launcher = None;
        for r in self.ranks.iter().filter(|r| r.plain) {
            // Not cudarc's bind_to_thread: an error it stored would skip the free (a leak).
            if crate::driver::make_current(&r.ctx).is_ok() {
                // SAFETY: allocated by `malloc_sync` in this context; no kernel uses it any more.
                if let Err(e) = unsafe { result::free_sync(r.signal) } {
                    tracing::warn!(error = %e, "could not free a signal area");
                }
            }
        }
        // `cuMemFreeHost` needs a current context: the thread that drops this may have none.
        if let Some(r) = self.ranks.first() {
            let _ = crate::driver::make_current(&r.ctx);
        }
        // SAFETY: allocated by `malloc_host`; no kernel uses it any more.
        if let Err(e) = unsafe { result::free_host(self.errors.0.cast::<c_void>()) } {
            tracing::warn!(error = %e, "could not free the error slots");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An abandoned state leaks its memory but not its launch threads: they end.
    #[test]
    fn abandoning_the_state_ends_its_launch_threads() {
        let name = "gl-abandon-test";
        let p2p = P2p {
            ranks: Vec::new(),
            global: vec![0, 1, 2],
            nranks: 3,
            // Never freed: `abandon` forgets the state.
            errors: HostSlots(std::ptr::null_mut()),
            signals: [0; MAX_GPUS],
            staging: None,
            timeout_ns: 0,
            launcher: Some(launcher::tests::idle_launcher(name, 2)),
            parallel: true,
            handoff_limit: Duration::ZERO,
        };
        let started = launcher::tests::threads_named(name, 2);
        p2p.abandon();
        assert_eq!(started, 2);
        assert_eq!(launcher::tests::threads_named(name, 0), 0);
    }

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
        // Every phase the kernel reports has a name.
        for phase in 1..=9u64 {
            let e = decode_timeout(0, (1u64 << 56) | (phase << 48) | 7, 1_000_000);
            assert!(
                !e.to_string().contains("unknown wait"),
                "phase {phase}: {e}"
            );
        }
        let expired = decode_timeout(0, (1u64 << 56) | (9u64 << 48) | 7, 1_000_000);
        assert!(
            expired.to_string().contains("not reported as success"),
            "{expired}"
        );
    }

    /// Memory the driver exports (a POSIX descriptor of `cuMemCreate` memory) passes the
    /// descriptor exchange's checks (close-on-exec, only memory kinds) and maps again: what is
    /// written through one mapping is read through the other. One GPU, two threads.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn exported_memory_passes_the_descriptor_exchange() {
        use std::time::Instant;
        let ctx = CudaContext::new(0).unwrap();
        let mem = SharedMemory::alloc(&ctx, 1 << 20).unwrap();
        let fd = mem.export().unwrap();
        let server = ipc::Server::bind().unwrap();
        let card = server.card().clone();
        let deadline = Instant::now() + Duration::from_secs(10);
        let fetcher = std::thread::spawn(move || ipc::fetch(&card, 1, deadline));
        server.serve(b"rank", &[fd], 1, deadline).unwrap();
        let (head, mut fds) = fetcher.join().unwrap().unwrap();
        assert_eq!(head, b"rank");
        let imported = SharedMemory::import(&ctx, fds.pop().unwrap(), mem.size()).unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3).to_le_bytes()[0]).collect();
        let mut back = vec![0u8; data.len()];
        ctx.bind_to_thread().unwrap();
        // SAFETY: both mappings are live, at least `data.len()` bytes long, of this context's
        // device; the copies are synchronous.
        unsafe {
            result::memcpy_htod_sync(mem.ptr(), &data).unwrap();
            result::memcpy_dtoh_sync(&mut back, imported.ptr()).unwrap();
        }
        assert_eq!(back, data);
    }

    /// A peer's card is checked, never trusted: short cards, sizes that do not cover what the
    /// kernels address and bad socket cards are errors, not panics.
    #[test]
    fn peer_cards_are_checked() {
        let needed = 34 << 20;
        let card = ipc::Server::bind().unwrap().card().encode();
        let with = |size: u64| {
            let mut c = size.to_le_bytes().to_vec();
            c.extend_from_slice(&card);
            c
        };
        let (size, _) = peer_card(&with(needed as u64), 1, needed).unwrap();
        assert_eq!(size, needed);
        assert!(peer_card(&with(2 * needed as u64), 1, needed).is_ok());
        for short in 0..8 {
            assert!(
                peer_card(&vec![1u8; short], 1, needed).is_err(),
                "{short} bytes"
            );
        }
        assert!(peer_card(&with(needed as u64 - 1), 1, needed).is_err());
        assert!(peer_card(&with(2 * needed as u64 + 1), 1, needed).is_err());
        assert!(peer_card(&with(u64::MAX), 1, needed).is_err());
        assert!(peer_card(&(needed as u64).to_le_bytes(), 1, needed).is_err());
        let e = peer_card(&with(0), 3, needed).unwrap_err();
        assert!(e.to_string().contains("rank 3"), "{e}");
    }
}
