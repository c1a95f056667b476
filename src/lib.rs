//! # gpucast
//!
//! Broadcast a tensor from one GPU to every other GPU, as fast as the links allow: within one
//! process (a clique) or across the processes of a job, one per GPU (a communicator).
//!
//! A [`Clique`] holds up to eight GPUs of this process: a context and a stream per GPU, peer
//! access between every pair that supports it, one NCCL communicator per GPU, and a small signal
//! area per GPU for gpucast's own kernel. [`Clique::broadcast`] copies the root's buffer into an
//! output on every GPU along one of three paths:
//!
//! - **NCCL**: `ncclBroadcast` in one group (NCCL is loaded at run time, `libnccl.so.2` included).
//! - **P2P**: a kernel that every GPU runs, synchronised through flags in device memory. Small
//!   messages use a *packet* protocol (the root writes {data, flag} packets straight into each
//!   peer's inbox; no barrier at all); medium ones a *pull* protocol (peers read the root's
//!   buffer over NVLink after its arrival flag and report when done). Counters live on the
//!   device, so the kernel can be captured in a CUDA graph; every wait is bounded by a timeout.
//! - **Copy engine**: no kernel at all. Each rank pushes the message into the rank after it in
//!   a chain that starts at the root (`cuMemcpyAsync` on its own copy engine, chunked beyond
//!   two ranks so that every link carries it once), ordered by events, or by stream memory
//!   operations inside a graph. It leaves every SM to the caller's compute.
//!
//! A [`Communicator`] is one rank of a job that runs one process per GPU (torchrun, Slurm,
//! MPI): the same broadcasts, each process passing its own buffer, after a rendezvous through
//! torchrun's own store or a TCP store that rank 0 hosts, which admit only processes that know
//! the job's secret token ([`rendezvous`]); ranks on one host share P2P memory.
//!
//! [`BroadcastPath::Auto`] (the default) takes the copy engines for large messages, P2P for
//! smaller ones when every pair of GPUs has peer access, and NCCL otherwise, at thresholds
//! measured on 2 H200 (and a cost model beyond two GPUs: "Choosing the path" below).
//! The caller can force a path or move the thresholds per clique, per call, or by environment
//! variable.
//!
//! ## Failures
//!
//! No wait is unbounded: P2P kernels time out on their own, and a watchdog thread aborts NCCL
//! work that does not finish within the timeout once started (a dead peer process), so every
//! stream moves on. Errors name what failed and which calls have undefined outputs;
//! [`Clique::recover`] rebuilds what failed without a new process. "Failure model" below has
//! the whole table.
//!
//! ## Example
//!
//! ```no_run
//! use gpucast::prelude::*;
//! use gpucast::{Clique, BroadcastPath, BroadcastOptions};
//!
//! let clique = Clique::new(&[0, 1])?;
//! let n = 1 << 20;
//! // The root (rank 0) holds the data; every rank gets an output buffer on its own GPU.
//! let input = clique.stream(0).clone_htod(&vec![1.5f32; n])?;
//! let mut outputs = clique.alloc_outputs::<f32>(n)?;
//! clique.broadcast(0, &input, &mut outputs)?;
//! // Or force a path for one call:
//! clique.with(&BroadcastOptions::path(BroadcastPath::Nccl)).broadcast(0, &input, &mut outputs)?;
//! clique.synchronize()?;
//! assert_eq!(clique.stream(1).clone_dtoh(&outputs[1])?, vec![1.5f32; n]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Choosing the CUDA version
//!
//! cudarc binds one version of the driver and NVRTC APIs, picked by a cargo feature. gpucast
//! forwards it: the default is `cuda-13000` (driver 580 or newer, `libnvrtc.so.13`). For CUDA 12
//! use `default-features = false, features = ["cuda-12080"]` (or `cuda-12040`, `cuda-12060`,
//! `cuda-12090`); enable exactly one. A driver older than the feature is reported as
//! [`Error::DriverTooOld`].
//!
//! ## Libraries at run time
//!
//! Nothing is linked at build time. `libcuda` (from the driver) and `libnccl` are needed to
//! create a clique; `libnvrtc` to compile the P2P kernel (once per architecture per process).
//! Each missing library is an [`Error::LibraryMissing`] naming it and the fix; without NVRTC,
//! `Auto` falls back to NCCL with a warning and a forced P2P path returns that error.
//! `GPUCAST_NCCL_LIBRARY` names the NCCL file to load; the README's table "Environment variables"
//! lists every variable.
//!
//! ## Buffers, ordering and threads
//!
//! The API takes cudarc buffers ([`cudarc::driver::CudaSlice`] and its views), whose lengths,
//! devices and contexts are checked before any work is queued. Work is asynchronous and runs on
//! the clique's streams ([`Clique::stream`]); any buffer passed to a call may be dropped, reused
//! or overwritten, on any stream, as soon as the call returns ("Ordering" below). A clique may
//! be shared between threads: its calls go through one lock ("Threads" below).
//! [`Clique::broadcast_raw`] is the `unsafe` door for code that keeps raw device pointers.
//!
//! ## One process per GPU (torchrun, Slurm, MPI)
//!
//! ```no_run
//! # use gpucast::prelude::*;
//! # let weights = vec![0.5f32; 1 << 20];
//! let comm = gpucast::Communicator::from_env()?;   // RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
//! let mut buf = comm.alloc::<f32>(1 << 20)?;        // on GPU LOCAL_RANK, on comm.stream()
//! if comm.rank() == 0 {
//!     comm.stream().memcpy_htod(&weights, &mut buf)?;
//! }
//! comm.broadcast_in_place(0, &mut buf)?;            // like torch.distributed.broadcast
//! comm.synchronize()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! - **Rendezvous**: under torchrun, every rank joins torchrun's own store (the agent's c10d
//!   `TCPStore` on `MASTER_ADDR:MASTER_PORT`) as a client, so a cluster opens no port for gpucast;
//!   otherwise (Slurm, `--procs`, by hand) rank 0 hosts a small TCP store of gpucast's on
//!   `MASTER_ADDR:MASTER_PORT` (`GPUCAST_MASTER_PORT` picks another port, and under torchrun makes
//!   gpucast host its own). Every wait is bounded (`.init_timeout(..)`, default 300 s); the driver
//!   and the device are checked before any waiting for peers; a wrong world size or a rank claimed
//!   twice fails every rank fast, and the ranks that never came are named. Who can join a
//!   job: `docs/SECURITY.md` in the repository. MPI or a framework's process group can drive
//!   the same steps:
//!   `Communicator::builder().exchange(FnExchange::new(rank, size, all_gather)?)`.
//! - **NCCL**: rank 0's `ncclGetUniqueId` goes to every rank, each calls `ncclCommInitRankConfig`;
//!   across nodes NCCL does the networking. `comm.init_time()` reports the whole setup.
//! - **P2P on one host**: each rank allocates its signal area and a 32 MiB staging buffer as
//!   shareable memory (`cuMemCreate`, POSIX file descriptors), hands the descriptors to the other
//!   processes once over an abstract Unix socket (same user, a random nonce that only the job's
//!   ranks received) and maps theirs, so a broadcast needs no exchange between processes. Packets
//!   go straight into the peers' inboxes; a pull goes through the root's staging buffer (in 32 MiB
//!   chunks). Ranks on several hosts (the host id is the machine's, or `GPUCAST_HOST_ID`) use NCCL.
//!   Across processes `Auto` takes P2P up to 256 KiB in eager calls (the staging copy costs a call
//!   on the root) and up to 8 MiB inside CUDA graphs, as measured (`comm.thresholds()` shows them).
//! - Every rank passes a buffer of the same length and type and uses the same settings (checked at
//!   initialisation). Each name means what it means on a clique: `broadcast(root, Some(&input) on
//!   the root / None elsewhere, &mut out)` is out of place, `broadcast_in_place(root, &mut buf)` in
//!   place; `broadcast_many(root, inputs, outputs)` and `broadcast_many_in_place(root, buffers)`
//!   broadcast many tensors in one call, one buffer per tensor on every rank (the methods of
//!   [`RankBroadcast`]); `capture` works as on a clique. `comm.with(&options)` makes any call
//!   with `BroadcastOptions`. A clique (one process holding several GPUs) stays the way to drive
//!   several GPUs from one process.
//! - After a P2P timeout across processes the communicator's P2P path closes (every process would
//!   have to reset its signal area at the same point); NCCL keeps working.
//!
//! ## Choosing the path
//!
//! | setting | per clique | per call |
//! |---|---|---|
//! | path (`Auto`, `Nccl`, `P2p`, `CopyEngine`) | `Clique::builder().path(..)` | `BroadcastOptions::path(..)` |
//! | largest P2P message for `Auto` | `.p2p_threshold(bytes)` | `BroadcastOptions::default().p2p_threshold(bytes)` |
//! | packet/pull switch | `.packet_threshold(bytes)` | `BroadcastOptions::default().packet_threshold(bytes)` |
//! | smallest copy-engine message for `Auto` | `.copy_engine_threshold(bytes)` | `BroadcastOptions::default().copy_engine_threshold(bytes)` |
//! | smallest P2P message sent along the chain (more than 2 ranks) | `.p2p_chain_threshold(bytes)` | `BroadcastOptions::default().p2p_chain_threshold(bytes)` |
//! | launch threads | `.parallel_launch(bool)`, `clique.set_parallel_launch(bool)` | |
//! | timeout | `.timeout(duration)` | |
//!
//! `Auto` takes the copy engines from their threshold up (ranks of one process with peer access
//! between every pair), else P2P when every pair of GPUs has peer access (over NVLink, or exactly
//! two GPUs) and the message is at most the P2P threshold, else NCCL. On 2 GPUs the thresholds
//! were measured on 2 H200 (P2P at every size; the copy engines from 64 MiB eager and 128 MiB in
//! CUDA graphs); on 3 to 8 GPUs P2P's limit (4 MiB down to 1 MiB) comes from a cost model and
//! `Auto` takes NCCL above it, never the copy engines, until a run on that many GPUs places them
//! (the constants of `src/config.rs` name the file or model behind each value;
//! [`Clique::thresholds`] shows the values in use). A call forced onto P2P on more than two ranks
//! of one process sends messages above the P2P limit along the P2P chain; on 2 GPUs both
//! protocols cross the one link once, and the chain is taken only when told
//! (`p2p_chain_threshold`).
//!
//! `Clique::builder().devices(&[0, 1, 0, 1]).shared_devices(true)` puts several ranks on one GPU,
//! for testing what runs on many GPUs (the copy-engine chain, the P2P kernel) with fewer; NCCL is
//! off in such a clique, and so are the copy engines inside a graph.
//! `Communicator::builder().shared_devices(true).device(0)` on every rank does the same for a
//! job of several processes (the rendezvous, the descriptor exchange and the P2P kernel over
//! shared memory run as with a GPU each; NCCL is off). Both check protocols, faults and every
//! byte, not speed: copies between ranks of one GPU are device-local, and processes on one GPU
//! time-slice it, so a P2P kernel waiting for another process holds the GPU for its slice (a
//! small broadcast then takes about a millisecond) and a timeout shorter than a few slices
//! fails calls that separate GPUs would complete.
//!
//! ## Ordering
//!
//! Every call is asynchronous: it queues its work on each rank's `clique.stream(rank)` and
//! returns. When it returns, **every buffer passed in may be dropped, reused or overwritten at
//! once, on any stream**:
//!
//! - work queued on a buffer's own stream before the call is seen by the broadcast, and the
//!   buffer's free and later work on its stream come after it;
//! - work on any other stream that reaches the buffer through cudarc, **the context's default
//!   stream (`ctx.default_stream()`) and the per-thread stream included**, comes after it too: the
//!   clique's streams are cudarc streams, so cudarc tracks every buffer of a clique context with
//!   read and write events, and gpucast's calls record them after the broadcast;
//! - that tracking costs each buffer an event wait or two before the call and one record after
//!   it, each a driver call on the calling thread (see "What the ordering costs" below); graphs
//!   pay none of it per replay; a buffer on another stream than its rank's clique stream costs
//!   one more record and wait on each side;
//! - a buffer from another CUDA context than the device's primary one is `Error::ForeignContext`;
//!   a stream handle that names no stream of its own (the default, legacy or per-thread handle)
//!   is refused by `CliqueBuilder::streams` (`Error::InvalidArgument`).
//!
//! To order work that cudarc does not see (raw launches, another library) with an output, run it
//! on `clique.stream(rank)`, make your stream wait on `clique.record()`'s events, or call
//! `clique.synchronize()`. `clique.wait_for(..)` orders the clique after your streams.
//!
//! ## What the ordering costs, and how to go without it
//!
//! The promise above is cudarc's: every cudarc operation records and waits for per-buffer events,
//! and gpucast's calls pay them like any other. Measured on one H100 (2026-12-06, commit 6a84fb1,
//! two ranks sharing the GPU; `results/h100x1-shared/gpu-6a84fb1/budget-p2p.md` in the
//! repository, opening with its commit and command), an eager P2P call of 1 to 64 KiB took
//! 1.70 us more with tracking on than with it off; on a 1-GPU clique's NCCL path, 1.00 us (commit
//! 085c965, the median of four runs, `results/h100x1-shared/gpu-085c965/budget-nccl-1.md` to
//! `budget-nccl-4.md`). They are cudarc's own driver
//! calls: per buffer, a wait for each of its events and a record (counted in
//! `results/h100x1-shared/gpu-716baf6.md`). A call after 10 ms with the GPU idle pays more for
//! them: 1.53 us at 085c965, 10.6 to 13.9 us on three slower machines at commit 84afbf0
//! (`results/h100x1-shared/gpu-84afbf0.md`, `results/h200x1-shared/gpu-84afbf0.md`). Two ways
//! to go without it:
//!
//! - CUDA graphs: [`Clique::capture`] records the calls once; a
//!   replay queues no per-buffer event at all.
//! - cudarc's own switch, `unsafe { ctx.disable_event_tracking() }` on the contexts
//!   ([`Clique::context`]): calls then record and wait for nothing, and ordering buffers across
//!   streams becomes the caller's job (run every use of a buffer on its rank's clique stream, or
//!   order the streams with events both ways). It turns off the guards of every stream of that
//!   context, not only gpucast's.
//!
//! The bench measures the whole budget of a call on one GPU (launch floor, cudarc's events,
//! gpucast's own host work, the watchdog; eager and after 10 ms idle): `results/README.md` in the
//! repository, "The cost of a call".
//!
//! ## Threads
//!
//! A `Clique` is `Send` and `Sync`. All its calls (broadcasts, fused calls, graph launches,
//! synchronisation, recovery) go through one lock, so calls from several threads run one after the
//! other, in the same order on every GPU. A capture holds the lock until it ends: another thread's
//! broadcast waits instead of landing in the graph, and a clique call made inside the capture's own
//! closure returns `Error::CaptureInProgress` instead of deadlocking (`calls()` and
//! `alloc_outputs()` work there). A capture records on streams of its own (`Capture::stream`,
//! `unsafe`: the graph does not keep what work queued there touches), never on
//! `clique.stream(rank)`: work that another thread, or the closure, queues there stays eager,
//! allocations included.
//!
//! Work that other threads queue straight onto the clique's streams while a call is being queued
//! lands between the launches of that call on two ranks. On GPUs of their own, where it makes one
//! rank's stream wait for another's (an event recorded on rank 0's stream and waited for on rank
//! 1's, in that moment), a P2P kernel may wait for a peer held behind it: that ends as
//! `Error::Timeout`, never as a hang.
//!
//! Where one GPU holds several ranks (`shared_devices`), any such work would do: a device runs all
//! its streams through a few hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 by default), each
//! in the order work was queued, so work queued on rank 0's stream after rank 0's kernel, in a
//! queue shared with rank 1's stream, holds back rank 1's kernel, which rank 0's kernel waits
//! for. So there the P2P kernels and graph launches of a call go to streams that only gpucast
//! uses, forked from the ranks' streams before the first launch and joined back after the last
//! (`tests/one_queue.rs` runs threads on one hardware queue); the memory pool also reuses freed
//! memory only once the free is known complete. A graph could meet the same inside itself where
//! a launch queues a rank's kernels one behind the other (its second kernel ahead of the other
//! rank's first), so there a capture makes one graph per rank and P2P step, and a replay launches
//! them step by step, every rank in turn, as eager calls do. This is a precaution: on an H200
//! (driver 580) a graph of four P2P broadcasts also replays on one hardware queue without it.
//! Such a clique refuses the copy engines inside a graph (`Error::CopyEngineUnavailable`;
//! `Auto` takes P2P there): a captured copy-engine broadcast waits on flags that the other
//! rank's graph writes, with no timeout.
//!
//! ## Failure model
//!
//! Nothing gpucast does waits without a bound. One timeout (default 10 s, `.timeout(..)` or
//! `GPUCAST_TIMEOUT_MS`) bounds every wait for a peer:
//!
//! | what happens | detected by | how fast | what the caller gets |
//! |---|---|---|---|
//! | a peer never arrives at a P2P kernel (stalled, dead, its process killed) | the kernel itself (a clock in every wait) | the timeout | `Error::Timeout` (rank, wait, op) from `synchronize` or the next call |
//! | an NCCL broadcast started on a local rank does not finish (a peer process killed or stalled, a local rank held back) | the watchdog thread, every 5 ms | the timeout plus at most 5 ms | `Error::CommunicatorsAborted` with `undefined_calls`: the calls (numbered as `calls()` counts) whose outputs are undefined |
//! | NCCL reports an asynchronous error while a broadcast runs (a peer's socket closed) | the watchdog | within one look of the watchdog (5 ms) | the same |
//! | creating the communicators: a rank never joins; the rendezvous host (rank 0) is gone | bounded waits (`init_timeout`, default 300 s); the store's connection | the bound | `Error::NcclTimeout` / `Error::Rendezvous` |
//! | an NCCL call fails inside a group | the call | at once | that error; the communicators are aborted rather than left half-launched |
//! | a rank held back by work queued before the call on its own stream, while a peer's kernel waits for it (P2P, NCCL) | as above: a wait longer than the timeout is a fault, whatever the reason | the timeout | as above |
//! | a rank held back where nothing waits for it (a packet receiver, the copy engines) | nothing to detect | | the call completes late and right |
//! | one process per GPU: ranks on one host pass different lengths, element types, roots or paths to one call (or make calls in another order) | the call log: each rank posts a card of every call into shared host memory and reads its peers' cards of the same call | the rank that posts second: at once, before anything is queued; the other: at `synchronize` or its next call | `Error::CallMismatch` naming the call, the peer and both calls (`ArgumentError` in Python). Across hosts calls are not compared: a difference ends in a timeout |
//!
//! What the caller does next:
//! - `synchronize()` waits by polling, at most twice the timeout plus two seconds
//!   (`Error::StreamsBusy` if the caller's own work keeps the streams busy longer); it returns as
//!   soon as a fault is known, without waiting for the stalled rank. A communicator's
//!   `synchronize()`, after its own work succeeded, also waits (at most the timeout) until the
//!   peers on its host have posted the calls it made, so that the root of a small message, whose
//!   part ends without its peers, hears of a call that differs.
//! - After an error, the outputs of the calls in flight are undefined; every other buffer is
//!   intact, and every buffer may still be dropped (the buffer contract holds). A P2P rank whose
//!   buffer others read (the root of a pull, each link of a chain) ends its kernel only once no
//!   reader will touch that buffer again: each reader holds a lease on it, claimed before its
//!   first read and given back after its last, and an owner that gave up waiting cancels the
//!   lease. A reader that arrives after that reads nothing and reports `Error::Timeout`
//!   ("arrived after the rank it reads from had given up"); one that had claimed the buffer is
//!   waited for until it lets go, and the call succeeds if it finished (the timeout bounds how
//!   long a peer takes to show up, not its copy). That wait is bounded too: the timeout plus
//!   half a second plus the message at 4 GB/s. A reader that outlasts it (a GPU that does not
//!   run it) reports an error, never success, since its owner's stream has moved on; in one
//!   process such a reader may go on reading an input the caller has freed since, which faults
//!   its context rather than report. For a chain's middle rank (a wait for each piece, then
//!   one for its reader) and for messages above about 6 GB, a kernel's waits can add up past
//!   the host's wait for the streams (twice the timeout plus two seconds): `synchronize` then
//!   reports `Error::StreamsBusy` with the work still queued (buffers stay ordered behind it),
//!   and a drop leaks the P2P memory rather than free it under the kernel.
//! - `Clique::recover()` makes the clique whole in the same process: it waits for the streams,
//!   resets the P2P signal areas and the copy-engine flags, and creates new NCCL communicators if
//!   they were aborted. Broadcasts after it are as on a new clique (the fault suite checks them bit
//!   for bit after every fault). Without it, P2P timeouts reset themselves at the next call; an
//!   aborted NCCL path stays closed (`CommunicatorsAborted`).
//! - One process per GPU: after a peer process died, the survivors' P2P path closes (their signal
//!   areas cannot be reset in step) and their NCCL communicators are aborted; the survivors create
//!   a new `Communicator` with a new rendezvous (`Communicator::builder().job(..)` with the new
//!   world size and ranks). Dropping a communicator or clique never hangs and never panics: it
//!   waits for its streams at most twice the timeout plus a second (aborting NCCL and waiting a
//!   second more if work is still running), for its NCCL aborts still running as long again, and
//!   for the release of its memory (below) half a second.
//! - NCCL's abort waits for the NCCL kernels already queued (they return at once when they run),
//!   so an abort never frees what a queued kernel uses. It also waits until every CUDA graph that
//!   captured the communicators is destroyed, so it always finishes on a thread of its own:
//!   neither the watchdog nor a caller (who may own such a graph, or be capturing one) waits for
//!   it, and callers get the error at once. NCCL frees the communicators' memory on that thread,
//!   which can wait for the device, and so for any other work of the process running there:
//!   until it is done, other CUDA calls of the process may wait too (seen on one H200: a P2P
//!   recovery right after an abort waited behind unrelated work; `results/h200x1-shared/` in
//!   the repository). Dropping the clique or communicator waits for its aborts still running
//!   (bounded like the rest of the drop: twice the timeout plus a second), so an abort beside
//!   unrelated work holds the drop that long. It does not
//!   wait where a graph with NCCL steps outlives it (forgotten: an abort may wait for that graph
//!   forever), and an abort still running at the bound goes on in the background.
//! - Dropping a clique releases its device memory (P2P signal areas, copy-engine flags, NCCL's
//!   communicators) with driver calls (`cuMemFree` and the like) that wait for all work on the
//!   device, the caller's unrelated work on other streams included. The release runs on a
//!   thread of its own, waited for at most half a second: beside unrelated work the drop
//!   returns then, and the memory is freed when that work ends (before, a drop beside 3 s of
//!   unrelated work took 3.0 s on one H100: `results/h100x1-shared/gpu-279e76f.md` in the
//!   repository). Until then other CUDA calls of the process that wait for the device (a
//!   `cuMemFree`, creating a clique) may wait for it too, and a process that exits meanwhile
//!   ends it mid-way (the operating system takes the memory back). Its driver calls go through
//!   cudarc, which, like any thread using a context, takes an error it stored on the context
//!   and puts it back: a call on another thread in that instant misses it.
//! - A graph captured before its P2P path closed (or before the copy-engine flags had to be
//!   replaced, or before its NCCL communicators were aborted) is refused at launch
//!   (`Error::P2pUnavailable` / `Error::CopyEngineUnavailable` / `Error::CommunicatorsAborted`):
//!   its addresses point into state that is gone, or its NCCL kernels would return without
//!   writing; capture it again.
//! - An error that cudarc stored on a buffer's context (a failed wait or record of an earlier
//!   operation, which makes cudarc skip the ordering of every later one there) is reported by the
//!   next call before it queues anything, or, if it arose while the call's own events were
//!   recorded, after it was queued.
//! - A launch thread that does not take its launch within the timeout has the launch cancelled
//!   (`Error::LaunchStalled`); nothing is launched after the call returned.
//! - Known limits: creating a clique or a communicator waits for work the caller already queued on
//!   the device's primary context, because loading the P2P kernel's module (`cuModuleLoadData`)
//!   does (`results/h200x1-shared/creation-wait.md` in the repository times each step); a
//!   copy-engine graph's flag waits have no clock of their own (a launch that reached only some
//!   ranks releases them at the next call; a peer's graph held back forever by other work holds
//!   them too).
//! - Bad input and settings are errors before any GPU work; a missing `libcuda`, `libnccl` or
//!   `libnvrtc` is `Error::LibraryMissing` with the fix (without NVRTC, `Auto` uses NCCL and a
//!   forced P2P call returns that error).

#![deny(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]
#![warn(unreachable_pub)]

mod clique;
mod config;
mod copy;
mod driver;
mod dtype;
mod engine;
mod error;
mod item;
mod limits;
mod nccl;
mod p2p;
mod plan;
mod ranks;
/// The rendezvous: the crate `gpucast-rendezvous`, which uses nothing of gpucast. The rest of
/// gpucast sees it through [`rendezvous::Exchange`].
pub use gpucast_rendezvous as rendezvous;
mod tensor;
mod topology;
mod util;
mod wait;

pub use clique::{
    device_count, Capture, Clique, CliqueBroadcast, CliqueBuilder, CliqueGraph, Communicator,
    CommunicatorBuilder, GraphBuffers, RankBroadcast, RawBroadcast, WithOptions,
    DEFAULT_INIT_TIMEOUT,
};

/// The broadcast traits, whose methods every receiver (a clique, a communicator, a capture,
/// and their `with(&options)` views) shares: `use gpucast::prelude::*;`.
pub mod prelude {
    pub use crate::clique::{CliqueBroadcast, RankBroadcast};
}
#[doc(hidden)]
pub use config::parse_bytes;
pub use config::{BroadcastOptions, BroadcastPath, Route, Thresholds, DEFAULT_TIMEOUT};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use limits::MAX_GPUS;

/// Limits that the tests and the benchmark probe (the `testing` feature): not part of the API.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing {
    /// Largest message the P2P kernel's packet protocol carries.
    pub const PACKET_MAX_BYTES: usize = crate::limits::PACKET_MAX_BYTES;
}
pub use nccl::nccl_version;
pub use plan::FusedReport;
pub use tensor::{CheckedAllocation, DeviceTensor, DeviceTensorMut, ExternalSlice};
pub use topology::{Link, Topology};

/// Re-export of the cudarc version gpucast is built with, so callers name the same buffer types.
pub use cudarc;
/// Re-export of `half`, for the `f16` and `bf16` element types.
pub use half;
