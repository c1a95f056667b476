//! `raw-nccl` (one process per GPU) and `nccl-raw` (one process): `ncclBroadcast` on
//! communicators of the bench's own, next to gpucast's paths.
//!
//! NCCL is opened here with `libloading` under the names gpucast itself tries
//! (`GPUCAST_NCCL_LIBRARY` alone when set, else `libnccl.so.2`, then `libnccl.so`): cudarc's
//! loader does not look for `libnccl.so.2`, the only name that runtime installs and the PyPI
//! wheel ship (and it panics when it finds nothing). The loader hands back the library gpucast
//! already loaded, so both communicators run on the same NCCL. The calls take cudarc's
//! `nccl::sys` types.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use gpucast::cudarc::driver::sys::CUstream;
use gpucast::cudarc::nccl::sys::{ncclComm_t, ncclDataType_t};

/// `ncclUniqueId`: 128 opaque bytes that rank 0 makes and every rank receives.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([u8; 128]);

type GetUniqueIdFn = unsafe extern "C" fn(*mut UniqueId) -> u32;
type CommInitRankFn = unsafe extern "C" fn(*mut ncclComm_t, c_int, UniqueId, c_int) -> u32;
type CommInitAllFn = unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> u32;
type CommDestroyFn = unsafe extern "C" fn(ncclComm_t) -> u32;
type GroupFn = unsafe extern "C" fn() -> u32;
type GetErrorStringFn = unsafe extern "C" fn(u32) -> *const c_char;
type BroadcastFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    CUstream,
) -> u32;

/// The entry points the bench calls, and the library that holds them.
struct Lib {
    get_unique_id: GetUniqueIdFn,
    comm_init_rank: CommInitRankFn,
    comm_init_all: CommInitAllFn,
    comm_destroy: CommDestroyFn,
    group_start: GroupFn,
    group_end: GroupFn,
    get_error_string: GetErrorStringFn,
    broadcast: BroadcastFn,
    /// Declared last: the function pointers above point into it.
    _lib: libloading::Library,
}

impl Lib {
    fn open() -> Result<Lib> {
        let names: Vec<String> = match std::env::var("GPUCAST_NCCL_LIBRARY") {
            Ok(p) if !p.is_empty() => vec![p],
            _ => vec!["libnccl.so.2".into(), "libnccl.so".into()],
        };
        let mut tried = Vec::new();
        for name in &names {
            // SAFETY: loading NCCL runs its constructors, which have no preconditions.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => {
                    macro_rules! sym {
                        ($name:literal) => {
                            // SAFETY: the type matches NCCL's C prototype of this symbol (nccl.h,
                            // 2.x).
                            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                                .with_context(|| format!("{name} lacks {}", $name))?
                        };
                    }
                    return Ok(Lib {
                        get_unique_id: sym!("ncclGetUniqueId"),
                        comm_init_rank: sym!("ncclCommInitRank"),
                        comm_init_all: sym!("ncclCommInitAll"),
                        comm_destroy: sym!("ncclCommDestroy"),
                        group_start: sym!("ncclGroupStart"),
                        group_end: sym!("ncclGroupEnd"),
                        get_error_string: sym!("ncclGetErrorString"),
                        broadcast: sym!("ncclBroadcast"),
                        _lib: lib,
                    });
                }
                Err(e) => tried.push(format!("{name}: {e}")),
            }
        }
        bail!("cannot load NCCL for raw-nccl ({})", tried.join("; "))
    }

    fn check(&self, code: u32, what: &str) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString takes any result code and returns a static string.
        let p = unsafe { (self.get_error_string)(code) };
        let text = if p.is_null() {
            String::new()
        } else {
            // SAFETY: a NUL-terminated static string from NCCL.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        bail!("{what}: NCCL error {code} ({text})")
    }
}

/// One rank of a plain NCCL communicator over the same ranks as the bench's `Communicator`.
pub struct RawNccl {
    lib: Lib,
    comm: ncclComm_t,
    rank: usize,
}

impl RawNccl {
    /// Every rank calls this together: rank 0 makes the unique id, `share` hands its 128
    /// bytes to every rank (through the store; every rank calls it exactly once, whatever
    /// failed before), then each rank joins with `ncclCommInitRank` on the device of `ctx`.
    pub fn new(
        rank: usize,
        world: usize,
        ctx: &gpucast::cudarc::driver::CudaContext,
        share: impl FnOnce(&[u8]) -> Result<Vec<u8>>,
    ) -> Result<RawNccl> {
        let lib = Lib::open();
        let made = match (&lib, rank) {
            (Ok(lib), 0) => {
                let mut id = UniqueId([0; 128]);
                // SAFETY: `id` is a valid out pointer of the right size.
                lib.check(unsafe { (lib.get_unique_id)(&mut id) }, "ncclGetUniqueId")
                    .map(|()| id.0.to_vec())
            }
            _ => Ok(Vec::new()),
        };
        // Rank 0 sends nothing when it failed; the others then stop below.
        let got = share(made.as_deref().unwrap_or_default())?;
        let lib = lib?;
        made?;
        ensure!(
            got.len() == 128,
            "rank 0 sent no NCCL id ({} bytes; it reports why)",
            got.len()
        );
        let mut id = UniqueId([0; 128]);
        id.0.copy_from_slice(&got);
        // NCCL works on the current device: this rank's.
        ctx.bind_to_thread().context("binding the context")?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let (n, r) = (
            c_int::try_from(world).context("world size")?,
            c_int::try_from(rank).context("rank")?,
        );
        // SAFETY: `comm` is a valid out pointer; every rank passes the same id and size.
        let code = unsafe { (lib.comm_init_rank)(&mut comm, n, id, r) };
        lib.check(code, &format!("ncclCommInitRank (rank {rank} of {world})"))?;
        Ok(RawNccl { lib, comm, rank })
    }

    /// In place: `bytes` bytes at `ptr` on rank `root` into `ptr` on every other rank, queued
    /// on `stream` (captured when the stream is capturing).
    ///
    /// # Safety
    /// `ptr` addresses at least `bytes` bytes of this rank's device memory, valid until the
    /// stream (or the graph captured from it) has run the broadcast; `stream` belongs to this
    /// rank's device.
    pub unsafe fn broadcast(
        &self,
        ptr: u64,
        bytes: usize,
        root: usize,
        stream: CUstream,
    ) -> Result<()> {
        let root = c_int::try_from(root).context("root")?;
        // SAFETY: per this function's contract; in place (send = receive) is allowed.
        let code = unsafe {
            broadcast_bytes(self.lib.broadcast, ptr, ptr, bytes, root, self.comm, stream)
        };
        self.lib.check(code, "ncclBroadcast")
    }

    /// Destroys the communicator; every rank calls it at the same point, after its work has
    /// finished and the graphs that captured it are gone. (Without this call the communicator
    /// is left to the process's exit.)
    pub fn destroy(self) -> Result<()> {
        // SAFETY: a live communicator, used by no pending work or graph (the caller's promise).
        let code = unsafe { (self.lib.comm_destroy)(self.comm) };
        self.lib
            .check(code, &format!("ncclCommDestroy (rank {})", self.rank))
    }
}

/// Plain NCCL communicators over the GPUs of one process (`ncclCommInitAll`), driven the way
/// gpucast's NCCL path drives its own (one group call per broadcast, from one thread:
/// [`RawNcclAll::broadcast`]) or from one thread per GPU ([`RawNcclAll::broadcast_threads`]).
pub struct RawNcclAll {
    /// Declared first: dropped (stopped and joined) before the communicators they use.
    workers: Vec<Worker>,
    lib: Lib,
    comms: Vec<ncclComm_t>,
}

/// One broadcast handed to a worker: written before `seq` is published, read after.
#[derive(Default)]
struct Slot {
    seq: AtomicU64,
    done: AtomicU64,
    code: AtomicU32,
    send: AtomicU64,
    recv: AtomicU64,
    bytes: AtomicUsize,
    root: AtomicUsize,
    stream: AtomicUsize,
    stop: AtomicBool,
}

/// A thread that calls `ncclBroadcast` on one communicator when its slot says so.
struct Worker {
    slot: Arc<Slot>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    /// Wakes the worker if it parked.
    fn wake(&self) {
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.slot.stop.store(true, Ordering::Release);
        self.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long an idle worker spins before it parks: the same as gpucast's P2P launch threads
/// (`src/p2p/launcher.rs`), so that back-to-back calls find both awake and an idle run pays
/// both one wake-up, and neither burns a core through the rest of the run.
const SPIN: std::time::Duration = std::time::Duration::from_micros(200);

/// Waits until `f` holds: spins while the last work is less than [`SPIN`] old, then parks
/// (woken by [`Worker::wake`], or every 50 ms in case a wake-up came before the park).
fn wait_parked(f: impl Fn() -> bool) {
    let idle_since = std::time::Instant::now();
    while !f() {
        if idle_since.elapsed() < SPIN {
            std::hint::spin_loop();
        } else {
            std::thread::park_timeout(std::time::Duration::from_millis(50));
        }
    }
}

/// Spins until `f` holds, yielding the core now and then.
fn spin_until(f: impl Fn() -> bool) {
    let mut n = 0u32;
    while !f() {
        n = n.wrapping_add(1);
        if n.is_multiple_of(4096) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

impl RawNcclAll {
    /// One communicator per device of `ordinals` (distinct devices).
    pub fn new(ordinals: &[usize]) -> Result<RawNcclAll> {
        let lib = Lib::open()?;
        let devs = ordinals
            .iter()
            .map(|&o| c_int::try_from(o).context("device ordinal"))
            .collect::<Result<Vec<_>>>()?;
        let n = c_int::try_from(devs.len()).context("device count")?;
        let mut comms = vec![std::ptr::null_mut(); devs.len()];
        // SAFETY: `comms` has room for one communicator per device of `devs`.
        let code = unsafe { (lib.comm_init_all)(comms.as_mut_ptr(), n, devs.as_ptr()) };
        lib.check(code, "ncclCommInitAll")?;
        let broadcast = lib.broadcast;
        let workers = comms
            .iter()
            .skip(1)
            .map(|&comm| {
                let slot = Arc::new(Slot::default());
                let mine = slot.clone();
                // Raw handles cross to the thread as integers; the thread is joined before the
                // communicator is destroyed (field order of `RawNcclAll`).
                let comm = comm as usize;
                let thread = std::thread::Builder::new()
                    .name("nccl-raw-worker".into())
                    .spawn(move || worker(&mine, broadcast, comm))
                    .context("starting an NCCL worker thread")?;
                Ok(Worker {
                    slot,
                    thread: Some(thread),
                })
            })
            .collect::<Result<_>>()?;
        Ok(RawNcclAll {
            workers,
            lib,
            comms,
        })
    }

    /// [`RawNcclAll::broadcast`] with each rank's `ncclBroadcast` called from a thread of its
    /// own (rank 0's from this one), no group: the fastest way to drive NCCL on several GPUs
    /// from one process. Returns once every rank's call returned.
    ///
    /// # Safety
    /// As for [`RawNcclAll::broadcast`].
    pub unsafe fn broadcast_threads(
        &self,
        root: usize,
        src: u64,
        dsts: &[u64],
        bytes: usize,
        streams: &[CUstream],
    ) -> Result<()> {
        let root_c = c_int::try_from(root).context("root")?;
        for (r, w) in self.workers.iter().enumerate() {
            let r = r + 1;
            let slot = &w.slot;
            slot.send
                .store(if r == root { src } else { dsts[r] }, Ordering::Relaxed);
            slot.recv.store(dsts[r], Ordering::Relaxed);
            slot.bytes.store(bytes, Ordering::Relaxed);
            slot.root.store(root, Ordering::Relaxed);
            slot.stream.store(streams[r] as usize, Ordering::Relaxed);
            slot.seq.fetch_add(1, Ordering::Release);
            w.wake();
        }
        let send = if root == 0 { src } else { dsts[0] };
        // SAFETY: per this function's contract.
        let code = unsafe {
            broadcast_bytes(
                self.lib.broadcast,
                send,
                dsts[0],
                bytes,
                root_c,
                self.comms[0],
                streams[0],
            )
        };
        let mut first = self.lib.check(code, "ncclBroadcast (rank 0)");
        for w in &self.workers {
            let want = w.slot.seq.load(Ordering::Relaxed);
            spin_until(|| w.slot.done.load(Ordering::Acquire) == want);
            if first.is_ok() {
                first = self.lib.check(
                    w.slot.code.load(Ordering::Relaxed),
                    "ncclBroadcast (a worker)",
                );
            }
        }
        first
    }

    /// `bytes` bytes at `src` on rank `root` into `dsts[r]` on every rank `r`, each rank's
    /// part queued on `streams[r]`, in one group.
    ///
    /// # Safety
    /// `src` and every `dsts[r]` address at least `bytes` bytes of their rank's device memory,
    /// valid until the streams have run the broadcast; `streams[r]` belongs to rank `r`'s
    /// device.
    pub unsafe fn broadcast(
        &self,
        root: usize,
        src: u64,
        dsts: &[u64],
        bytes: usize,
        streams: &[CUstream],
    ) -> Result<()> {
        let root_c = c_int::try_from(root).context("root")?;
        // One communicator: one ncclBroadcast, a group of its own (the fastest way to drive
        // it); several: one group.
        let grouped = self.comms.len() > 1;
        if grouped {
            // SAFETY: ncclGroupStart has no preconditions.
            let code = unsafe { (self.lib.group_start)() };
            self.lib.check(code, "ncclGroupStart")?;
        }
        let mut first = Ok(());
        for (r, comm) in self.comms.iter().enumerate() {
            let send = if r == root { src } else { dsts[r] };
            // SAFETY: per this function's contract.
            let code = unsafe {
                broadcast_bytes(
                    self.lib.broadcast,
                    send,
                    dsts[r],
                    bytes,
                    root_c,
                    *comm,
                    streams[r],
                )
            };
            if first.is_ok() {
                first = self.lib.check(code, "ncclBroadcast");
            }
        }
        if !grouped {
            return first;
        }
        // SAFETY: matches the group start above.
        let code = unsafe { (self.lib.group_end)() };
        let end = self.lib.check(code, "ncclGroupEnd");
        first.and(end)
    }
}

impl Drop for RawNcclAll {
    fn drop(&mut self) {
        for &comm in &self.comms {
            // SAFETY: a live communicator; the bench drops this after its streams finished.
            let code = unsafe { (self.lib.comm_destroy)(comm) };
            if let Err(e) = self.lib.check(code, "ncclCommDestroy") {
                eprintln!("# {e}");
            }
        }
    }
}

/// A worker's loop: waits for a new sequence number in `slot`, calls `ncclBroadcast` on `comm`
/// with the slot's arguments, publishes the result.
fn worker(slot: &Slot, broadcast: BroadcastFn, comm: usize) {
    let mut seen = 0u64;
    loop {
        wait_parked(|| {
            slot.seq.load(Ordering::Acquire) != seen || slot.stop.load(Ordering::Acquire)
        });
        if slot.stop.load(Ordering::Acquire) {
            return;
        }
        seen = slot.seq.load(Ordering::Acquire);
        let root = c_int::try_from(slot.root.load(Ordering::Relaxed)).unwrap_or(c_int::MAX);
        // SAFETY: the caller of `broadcast_threads` vouches for the pointers and the stream
        // and waits for `done`; `comm` is alive until this thread is joined.
        let code = unsafe {
            broadcast_bytes(
                broadcast,
                slot.send.load(Ordering::Relaxed),
                slot.recv.load(Ordering::Relaxed),
                slot.bytes.load(Ordering::Relaxed),
                root,
                comm as ncclComm_t,
                slot.stream.load(Ordering::Relaxed) as CUstream,
            )
        };
        slot.code.store(code, Ordering::Relaxed);
        slot.done.store(seen, Ordering::Release);
    }
}

/// `ncclBroadcast` through `f` of `bytes` bytes from `send` (read on the root) into `recv`.
///
/// # Safety
/// `f` is NCCL's `ncclBroadcast`; `send` and `recv` address `bytes` bytes of the device of
/// `comm`, valid until `stream` (of that device) has run the broadcast.
unsafe fn broadcast_bytes(
    f: BroadcastFn,
    send: u64,
    recv: u64,
    bytes: usize,
    root: c_int,
    comm: ncclComm_t,
    stream: CUstream,
) -> u32 {
    // SAFETY: per this function's contract; in place (send = receive) is allowed.
    unsafe {
        f(
            send as *const c_void,
            recv as *mut c_void,
            bytes,
            ncclDataType_t::ncclUint8,
            root,
            comm,
            stream,
        )
    }
}
