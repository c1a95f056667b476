//! The benchmark with one process per GPU: every rank builds a `gpucast::Communicator` and the
//! ranks broadcast together, as a training or inference job does under torchrun.
//!
//! ```text
//! cargo bench --bench broadcast -- --procs 2                 # starts 2 ranks of itself
//! cargo bench --bench broadcast --no-run                     # prints the executable, then:
//! export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
//! torchrun --nproc-per-node 2 --no-python target/release/deps/broadcast-<hash> --out target/bench
//! ```
//!
//! `--procs N` re-executes the bench N times (same arguments minus `--procs`) with torchrun's
//! variables, `MASTER_ADDR=127.0.0.1` and a free port (see `examples/common/job.rs`); under torchrun the bench
//! sees `RANK` and `WORLD_SIZE` and runs as a rank by itself. Rank `r` uses GPU `LOCAL_RANK`.
//!
//! # What is measured
//!
//! For each size of the sweep (`-b`, `-e`, `-f`, `-d`, as in one process) and each mode:
//!
//! - `p2p`, `auto`, `nccl` (also `p2p-packet`, `p2p-pull`): gpucast through the Communicator,
//!   in place from the root into rotating slices of a pool on every rank (the root's pool holds
//!   the data; up to 64 slices, so that back-to-back ops do not sit in L2);
//! - `raw-nccl`: `ncclBroadcast` in place on a communicator of the bench's own (its unique id
//!   shared through the job's store), on the Communicator's stream, the same slices;
//! - `launch-floor`: one empty kernel per process per op, on the same stream.
//!
//! Eager mode issues the ops one by one; graph mode captures up to 500 ops into one CUDA graph
//! per rank (gpucast's capture for its paths and the floor, `cuStreamBeginCapture` on the stream
//! for `raw-nccl`) and replays it; a graph row's route is the one its capture took. Before a size is timed every path's output is checked once on
//! every rank: the other ranks' slice is poisoned, one op runs, and every rank compares its
//! slice with the root's data; a mismatch stops the run on every rank, naming the rank, path,
//! size and byte.
//!
//! # Timing
//!
//! Per repeat: every rank synchronizes its stream, meets the others in a barrier of the job's
//! TCP store (outside the timed region; no GPU work), queues a timing event on its stream,
//! issues `iters` ops back to back (eager) or replays its graph of at most 500 ops as often as
//! the repeat needs (about `--target-ms` of work, 200 ms by default, in both modes), and
//! queues a second event (`benches/timer/mod.rs`, the single-process bench's timer). Rank 0
//! gathers every rank's span between its two events through the store after the repeats; the
//! time of a repeat is the longest span over the ranks, divided by the ops it ran. The row's time is
//! the median over the repeats, with their min and max. The repeats of the paths of one size
//! run round-robin, so that a drift of the machine touches every path alike. Rows have `gpus`
//! = the number of ranks.
//!
//! # Output
//!
//! Rank 0 prints each point as it is measured and, at the end, the nccl-tests style table
//! (speedups against `raw-nccl`) and the headline ratios, and writes `broadcast-procs.csv`,
//! `table-procs.txt` and `broadcast-procs.png` in `--out` (`partial-procs.csv` as points
//! complete). With `--torch` on (the default `auto`: when `--python` has torch), rank 0 then
//! runs `benches/torch_broadcast.py --which dist,symm` (torch.distributed.broadcast and the
//! symmetric-memory one-shot all-reduce, one process per GPU) and merges its `torch-dist` and
//! `torch-symm` rows. By then every rank has released its GPU and the other ranks are done.

// The launcher and rank helper the weights example shares (it ships with the library's
// examples; the bench is not published).
#[path = "../../../examples/common/job.rs"]
pub mod job;
pub mod nccl;

use gpucast::prelude::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use gpucast::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use gpucast::cudarc::driver::{result, CudaGraph, CudaSlice, CudaStream, DevicePtrMut};
use gpucast::{Communicator, DType};

use crate::report::{self, Mode, Row};
use crate::{options_for, sets_for, xorshift_fill, Args, EmptyKernel, Watchdog, POOL_MIN};
use job::Job;
use nccl::RawNccl;

/// Paths measured by default with one process per GPU.
const DEFAULT_PATHS: &str = "p2p,auto,nccl,raw-nccl,launch-floor";
/// Every path this mode knows.
const KNOWN_PATHS: [&str; 7] = [
    "p2p",
    "auto",
    "nccl",
    "raw-nccl",
    "launch-floor",
    "p2p-packet",
    "p2p-pull",
];
/// Bound on joining the job (the store, NCCL, P2P) and on each exchange through the store.
const INIT_TIMEOUT: Duration = Duration::from_secs(120);
/// Seed of the root's data (every rank makes the same bytes to check against).
const SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// What the options ask for.
struct Plan {
    sizes: Vec<usize>,
    dtype: DType,
    modes: Vec<Mode>,
    paths: Vec<String>,
}

/// Reads and checks the options; `notes` prints what is left out and why.
fn plan(args: &Args, notes: bool) -> Result<Plan> {
    let (sizes, dtype, modes) = crate::sweep(args)?;
    let requested: Vec<String> = match &args.paths {
        Some(p) => p.iter().map(|s| s.trim().to_string()).collect(),
        None => DEFAULT_PATHS.split(',').map(String::from).collect(),
    };
    let mut paths: Vec<String> = Vec::new();
    for p in requested {
        if KNOWN_PATHS.contains(&p.as_str()) {
            if !paths.contains(&p) {
                paths.push(p);
            }
        } else if p == "copy-engine" || p == "p2p-1thread" {
            if notes {
                println!("# {p}: measured with one process only; left out");
            }
        } else {
            bail!(
                "unknown path {p:?} (one process per GPU measures {})",
                KNOWN_PATHS.join(", ")
            );
        }
    }
    ensure!(!paths.is_empty(), "no path to measure");
    ensure!(
        !modes.contains(&Mode::Idle),
        "idle mode is measured in one process only"
    );
    if notes && args.gpus.is_some() {
        println!("# --gpus is ignored with one process per GPU: the number of ranks counts");
    }
    Ok(Plan {
        sizes,
        dtype,
        modes,
        paths,
    })
}

/// `--procs N`: checks the options, then starts N ranks of this bench and waits for them.
pub fn launch(args: &Args, n: usize) -> Result<()> {
    ensure!(
        n >= 2,
        "--procs {n}: the benchmark needs at least 2 processes"
    );
    plan(args, false)?;
    job::launch(n)
}

/// A captured sequence of ops: gpucast's graph (its paths and the launch floor) or one from
/// the stream's own capture (`raw-nccl`).
enum Graph<'c> {
    Gpucast(gpucast::CliqueGraph<'c>),
    Raw(CudaGraph),
}

impl Graph<'_> {
    fn launch(&mut self) -> Result<()> {
        match self {
            Graph::Gpucast(g) => g.launch()?,
            Graph::Raw(g) => g.launch()?,
        }
        Ok(())
    }

    fn upload(&self) -> Result<()> {
        match self {
            Graph::Gpucast(g) => g.upload()?,
            Graph::Raw(g) => g.upload()?,
        }
        Ok(())
    }
}

/// A path made ready to time at one size, and its samples.
struct Timer<'c> {
    /// The route taken: for a graph, the one its capture took (graph thresholds).
    route: String,
    iters: usize,
    sets: usize,
    graph: Option<Graph<'c>>,
    /// Graph mode: launches of the graph per repeat (each replays `iters` ops), so that a
    /// repeat lasts about `--target-ms` as an eager one does.
    launches: usize,
    /// (start, end) stamps of each repeat on this rank.
    samples: Vec<(u64, u64)>,
}

/// One rank's side of the measurement.
struct Bench<'c> {
    comm: &'c Communicator,
    job: &'c Job,
    stream: Arc<CudaStream>,
    /// The rotating pool (the root's holds `host`).
    pool: CudaSlice<u8>,
    /// The pool's device address, for raw NCCL and memsets (read once, outside any capture).
    base: u64,
    host: Vec<u8>,
    raw: Option<RawNccl>,
    floor: EmptyKernel,
    root: usize,
    p2p: bool,
}

/// Maps an error of the bench's code to gpucast's, inside a capture closure.
fn in_capture(e: anyhow::Error) -> gpucast::Error {
    gpucast::Error::InvalidList(format!("{e:#}"))
}

impl<'c> Bench<'c> {
    fn raw(&self) -> Result<&RawNccl> {
        self.raw.as_ref().context("raw-nccl was not set up")
    }

    /// One op of `path` on rotating set `set` (eager).
    fn op(&mut self, path: &str, bytes: usize, set: usize) -> Result<()> {
        let off = set * bytes;
        match path {
            "launch-floor" => self.floor.launch_on(std::slice::from_ref(&self.stream)),
            "raw-nccl" => {
                let (ptr, stream) = (self.base + off as u64, self.stream.cu_stream());
                // SAFETY: the pool holds `off + bytes` bytes (sets_for), and outlives the op.
                unsafe { self.raw()?.broadcast(ptr, bytes, self.root, stream) }
            }
            p => {
                let opts = options_for(p)?;
                let mut slice = self.pool.slice_mut(off..off + bytes);
                self.comm
                    .with(&opts)
                    .broadcast_in_place(self.root, &mut slice)?;
                Ok(())
            }
        }
    }

    /// Captures `iters` ops of `path` into one graph; with it, the route the capture took
    /// (`-` for the raw paths).
    fn capture(
        &mut self,
        path: &str,
        bytes: usize,
        iters: usize,
        sets: usize,
    ) -> Result<(Graph<'c>, String)> {
        self.comm.synchronize()?;
        if path == "raw-nccl" {
            let raw = self.raw.as_ref().context("raw-nccl was not set up")?;
            self.stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let mut queued = Ok(());
            for i in 0..iters {
                let ptr = self.base + ((i % sets) * bytes) as u64;
                // SAFETY: as in `op`; the pool outlives the graph (graphs are dropped first).
                queued = unsafe { raw.broadcast(ptr, bytes, self.root, self.stream.cu_stream()) };
                if queued.is_err() {
                    break;
                }
            }
            // Ends the capture in every case, so that the stream leaves capture mode.
            let ended = self.stream.end_capture(CUgraphInstantiate_flags(0));
            queued?;
            let graph = ended?.context("the capture recorded nothing")?;
            return Ok((Graph::Raw(graph), "-".to_string()));
        }
        let (root, comm) = (self.root, self.comm);
        let pool = &mut self.pool;
        let floor = &self.floor;
        let mut route = "-".to_string();
        // SAFETY: the pool outlives the graph (every graph is dropped before the pool), and the
        // only other work on it runs on this rank's stream, in order with the replays.
        let graph = unsafe {
            comm.capture_unchecked(|c| {
                if path != "launch-floor" {
                    let opts = options_for(path).map_err(in_capture)?;
                    route = c.route(bytes, &opts)?.name().to_string();
                }
                for i in 0..iters {
                    if path == "launch-floor" {
                        floor
                            .launch_on(std::slice::from_ref(c.stream(0)))
                            .map_err(in_capture)?;
                    } else {
                        let opts = options_for(path).map_err(in_capture)?;
                        let off = (i % sets) * bytes;
                        let mut slice = pool.slice_mut(off..off + bytes);
                        c.with(&opts).broadcast_in_place(root, &mut slice)?;
                    }
                }
                Ok(())
            })
        }?;
        Ok((Graph::Gpucast(graph), route))
    }

    /// About two seconds of mixed work before anything is timed (idle GPUs run at low clocks).
    /// Rank 0's clock decides when to stop, so every rank issues the same ops.
    fn warm_up(&mut self) -> Result<()> {
        let t0 = Instant::now();
        let mut mix: Vec<(&str, usize)> = vec![("nccl", 1 << 20), ("launch-floor", 1)];
        if self.p2p {
            mix.extend([("p2p", 4096), ("p2p", 1 << 20)]);
        }
        if self.raw.is_some() {
            mix.push(("raw-nccl", 1 << 20));
        }
        loop {
            for i in 0..16 {
                for &(path, bytes) in &mix {
                    self.op(path, bytes, i % 4)?;
                }
            }
            self.comm.synchronize()?;
            let more = self
                .job
                .broadcast_bytes(0, &[u8::from(t0.elapsed().as_secs_f64() < 2.0)])?;
            if more != [1] {
                return Ok(());
            }
        }
    }

    /// Poisons the other ranks' first slice, runs one op of `path` and compares this rank's
    /// slice (the root's too) with the root's data.
    fn verify(&mut self, path: &str, bytes: usize) -> Result<()> {
        if path == "launch-floor" {
            return Ok(());
        }
        let rank = self.job.rank;
        if rank != self.root {
            self.comm.context().bind_to_thread()?;
            // SAFETY: the pool holds at least `bytes` bytes at `base`, on this stream's device.
            unsafe {
                result::memset_d8_async(
                    self.base,
                    0xA5 ^ rank as u8,
                    bytes,
                    self.stream.cu_stream(),
                )
            }?;
        }
        self.op(path, bytes, 0)?;
        self.comm.synchronize()?;
        let got: Vec<u8> = self.stream.clone_dtoh(&self.pool.slice(..bytes))?;
        let want = &self.host[..bytes];
        if got != want {
            let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            bail!(
                "{path}: the buffer differs from the root's data at byte {i} of {bytes} \
                 (got {:#04x}, want {:#04x})",
                got[i],
                want[i]
            );
        }
        Ok(())
    }

    /// Warms `path` up at `bytes` (eager) or captures its graph; `None` for a point that does
    /// not apply (the packet protocol above its capacity, a capture that failed on any rank).
    fn prepare(
        &mut self,
        path: &str,
        mode: Mode,
        bytes: usize,
        target_ms: f64,
    ) -> Result<Option<Timer<'c>>> {
        let sets = sets_for(bytes, self.pool.len());
        // Iterations so that a repeat holds about target_ms of work (estimate: 10 us + 300 GB/s),
        // the same on every rank (as in one process: a repeat of about 200 ms by default).
        let est_us = 10.0 + bytes as f64 / 300e3;
        let iters = ((target_ms * 1e3 / est_us) as usize).clamp(4, 200_000);
        let route = match path {
            "raw-nccl" | "launch-floor" => "-".to_string(),
            p => self.comm.route(bytes, &options_for(p)?)?.name().to_string(),
        };
        if path == "p2p-packet" && bytes > gpucast::testing::PACKET_MAX_BYTES {
            return Ok(None);
        }
        match mode {
            Mode::Idle => bail!("idle mode is measured in one process only"),
            Mode::Eager => {
                for i in 0..iters.min(50) {
                    self.op(path, bytes, i % sets)?;
                }
                self.comm.synchronize()?;
                Ok(Some(Timer {
                    route,
                    iters,
                    sets,
                    graph: None,
                    launches: 1,
                    samples: Vec::new(),
                }))
            }
            Mode::Graph => {
                let launches = iters.div_ceil(500);
                let iters = iters.min(500);
                let captured = self.capture(path, bytes, iters, sets);
                // Every rank replays, or none: a replay waits for its peers.
                if !self.job.all(captured.is_ok())? {
                    let why = match &captured {
                        Ok(_) => "on another rank".to_string(),
                        Err(e) => format!("{e:#}"),
                    };
                    println!(
                        "# rank {}: graph capture of {path} failed ({why}); skipped",
                        self.job.rank
                    );
                    drop(captured);
                    self.comm.synchronize().ok();
                    return Ok(None);
                }
                let (mut graph, route) = captured?;
                graph.upload()?;
                graph.launch()?;
                self.comm.synchronize()?;
                Ok(Some(Timer {
                    route,
                    iters,
                    sets,
                    graph: Some(graph),
                    launches,
                    samples: Vec::new(),
                }))
            }
        }
    }

    /// One repeat of a prepared point: barrier, then `iters` ops (or `launches` replays),
    /// stamped.
    fn sample(&mut self, path: &str, bytes: usize, timer: &mut Timer<'c>) -> Result<()> {
        self.comm.synchronize()?;
        self.job.barrier()?;
        let starts = crate::timer::marks(&[&self.stream])?;
        match &mut timer.graph {
            Some(graph) => {
                for _ in 0..timer.launches {
                    graph.launch()?;
                }
            }
            None => {
                for i in 0..timer.iters {
                    self.op(path, bytes, i % timer.sets)?;
                }
            }
        }
        let ends = crate::timer::marks(&[&self.stream])?;
        self.comm.synchronize()?;
        // This rank's span by its stream's events, as from a common start: rank 0 takes the
        // longest (`Job::spans`).
        let ns = f64::from(crate::timer::slowest_ms(&starts, &ends)?) * 1e6;
        timer.samples.push((0, ns as u64));
        Ok(())
    }
}

/// One rank of the job (started by `--procs` or torchrun).
pub fn run(args: &Args) -> Result<()> {
    let (job, comm) = Job::join(INIT_TIMEOUT)?;
    let (rank, world) = (job.rank, job.world);
    let plan = plan(args, rank == 0)?;
    if let Some(n) = args.procs {
        ensure!(
            n == world,
            "--procs {n}, but this job has {world} ranks (WORLD_SIZE)"
        );
    }
    ensure!(world >= 2, "the benchmark needs at least 2 ranks ({world})");
    ensure!(
        args.root < world,
        "--root {} is not a rank of {world}",
        args.root
    );
    comm.context().bind_to_thread()?;
    let note = format!("rank 0 of {world}, one process per GPU; the GPU line is rank 0's");
    let stamp = crate::run_stamp(&[comm.context()], &note);
    let rows = measure(args, &plan, &job, &comm, &stamp)?;
    // Every rank releases its GPU state first (gpucast's and NCCL's communicators included),
    // then the ranks meet one last time: rank 0's store must outlive the others' use of it.
    drop(comm);
    job.barrier()?;
    if rank != 0 {
        return Ok(());
    }
    let Some(rows) = rows else {
        bail!("rank 0 measured nothing");
    };
    finish(args, &plan, world, job.single_host, rows, &stamp)
}

/// The sweep on this rank; rank 0 gets the rows.
fn measure(
    args: &Args,
    plan: &Plan,
    job: &Job,
    comm: &Communicator,
    stamp: &report::Stamp,
) -> Result<Option<Vec<Row>>> {
    let (rank, world, root) = (job.rank, job.world, args.root);
    std::fs::create_dir_all(&args.out)?;
    let watchdog = Watchdog::start(
        (rank == 0).then(|| args.out.join("partial-procs.csv")),
        Some(stamp),
    );
    watchdog.at("setup");

    // P2P: every rank must agree before a forced P2P path is used.
    let p2p = job.all(comm.p2p_available().is_ok())?;
    let mut paths = plan.paths.clone();
    if !p2p {
        if rank == 0 {
            println!(
                "# P2P unavailable on some rank ({:?}): the p2p paths are left out",
                comm.p2p_available().err().map(|e| e.to_string())
            );
        }
        paths.retain(|p| !p.starts_with("p2p"));
    }
    let floor = job.agree(EmptyKernel::on(&[comm.context()]))?;
    let raw = if paths.iter().any(|p| p == "raw-nccl") {
        watchdog.at("raw-nccl setup");
        let made = RawNccl::new(rank, world, comm.context(), |mine| {
            job.broadcast_bytes(0, mine)
        });
        Some(job.agree(made)?)
    } else {
        None
    };

    let max_size = *plan.sizes.iter().max().expect("a non-empty sweep");
    let pool_bytes = POOL_MIN.max(2 * max_size);
    let mut host = vec![0u8; pool_bytes];
    xorshift_fill(&mut host, SEED);
    let stream = comm.stream().clone();
    let mut pool = if rank == root {
        stream.clone_htod(&host)?
    } else {
        stream.alloc_zeros::<u8>(pool_bytes)?
    };
    let base = {
        let (p, _guard) = pool.device_ptr_mut(&stream);
        p
    };
    comm.synchronize()?;
    let mut bench = Bench {
        comm,
        job,
        stream,
        pool,
        base,
        host,
        raw,
        floor,
        root,
        p2p,
    };

    if rank == 0 {
        let (a, b, c) = gpucast::nccl_version()?;
        println!("# gpucast broadcast benchmark, one process per GPU");
        println!(
            "# ranks: {world} (one host: {}), root {root}, dtype {}, GPU of rank 0: {}",
            job.single_host,
            plan.dtype,
            comm.device()
        );
        println!(
            "# NCCL {a}.{b}.{c}, NCCL_PROTO={}, NCCL_ALGO={}, NCCL_NVLS_ENABLE={}",
            crate::env_or("NCCL_PROTO"),
            crate::env_or("NCCL_ALGO"),
            crate::env_or("NCCL_NVLS_ENABLE")
        );
        println!("# thresholds: {:?}", comm.thresholds());
        println!("# P2P: {:?}", comm.p2p_available());
        println!(
            "# communicator init: {:.0} ms (rank 0)",
            comm.init_time().as_secs_f64() * 1e3
        );
        println!(
            "# time per op: (latest end - earliest start over the ranks{}) / iters, median of {} repeats",
            if job.single_host {
                ""
            } else {
                "; several hosts: the slowest rank's own span"
            },
            args.repeats
        );
    }

    watchdog.at("warm-up");
    bench.warm_up()?;
    let mut rows = Vec::new();
    // Eager first, then graph mode with NCCL's captures last, as in one process.
    for &mode in &plan.modes {
        let mut order: Vec<&String> = paths.iter().collect();
        if mode == Mode::Graph {
            order.sort_by_key(|p| p.as_str() == "nccl" || p.as_str() == "raw-nccl");
        }
        for &bytes in &plan.sizes {
            let mut prepared: Vec<(&str, Timer<'_>)> = Vec::new();
            for path in &order {
                let point = format!(
                    "{path} {} {}",
                    mode.name(),
                    report::format_size(bytes as u64)
                );
                watchdog.at(&point);
                if mode == plan.modes[0] {
                    let checked = bench
                        .verify(path, bytes)
                        .with_context(|| format!("checking {path} at {bytes} bytes"));
                    job.agree(checked)?;
                }
                if let Some(timer) = bench
                    .prepare(path, mode, bytes, args.target_ms)
                    .with_context(|| format!("preparing {point}"))?
                {
                    prepared.push((path.as_str(), timer));
                }
            }
            for _ in 0..args.repeats {
                for (path, timer) in &mut prepared {
                    watchdog.at(&format!("{path} {} {bytes}", mode.name()));
                    bench
                        .sample(path, bytes, timer)
                        .with_context(|| format!("timing {path} at {bytes} bytes"))?;
                }
            }
            for (path, timer) in prepared {
                let spans = job.spans(&timer.samples)?;
                let Some(spans) = spans else {
                    continue;
                };
                let ops = (timer.iters * timer.launches) as f64;
                let per_op: Vec<f64> = spans.iter().map(|s| s * 1e6 / ops).collect();
                let st = report::stats(&per_op).context("no samples")?;
                let row = Row {
                    gpus: world,
                    mode,
                    path: path.to_string(),
                    route: timer.route.clone(),
                    bytes: bytes as u64,
                    count: (bytes / plan.dtype.size()) as u64,
                    dtype: plan.dtype.name().to_string(),
                    root,
                    time_us: st.median,
                    min_us: st.min,
                    max_us: st.max,
                };
                println!(
                    "{path} {} {}: {:.2} us ({:.1} GB/s, {})",
                    mode.name(),
                    report::format_size(bytes as u64),
                    row.time_us,
                    row.busbw_gbps(),
                    row.route
                );
                watchdog.record(&row);
                rows.push(row);
                // `timer` (and its graph) is dropped here, before the pool.
            }
        }
    }
    watchdog.at("teardown");
    comm.synchronize()?;
    let Bench { raw, pool, .. } = bench;
    if let Some(raw) = raw {
        raw.destroy()?;
    }
    drop(pool);
    comm.synchronize()?;
    watchdog.done();
    Ok((rank == 0).then_some(rows))
}

/// Rank 0, after the others have left: PyTorch's rows, the table, the summary, the files.
fn finish(
    args: &Args,
    plan: &Plan,
    world: usize,
    single_host: bool,
    mut rows: Vec<Row>,
    stamp: &report::Stamp,
) -> Result<()> {
    let write = |rows: &[Row]| -> Result<()> {
        let csv = crate::stamped_csv(rows, stamp)?;
        std::fs::write(args.out.join("broadcast-procs.csv"), csv)?;
        Ok(())
    };
    // gpucast's rows are on disk before PyTorch runs.
    write(&rows)?;
    if !single_host {
        println!("# PyTorch skipped: the ranks are on several hosts (its script runs on one)");
    } else if crate::torch_wanted(args, world) {
        let csv = args.out.join("torch-procs.csv");
        if let Some(torch) =
            crate::torch_rows(args, plan.dtype, world, Some("dist,symm"), &csv, stamp)?
        {
            rows.extend(torch);
        }
    } else {
        println!(
            "# PyTorch skipped: {} has no torch with {world} GPUs (or --torch no)",
            args.python
        );
    }

    let table = report::format_table(&rows, "raw-nccl");
    println!("{table}");
    let small = 64u64 << 10;
    let large = 1u64 << 20;
    let mut summary = Vec::new();
    for &mode in &plan.modes {
        let m = mode.name();
        for (a, b) in [("p2p", "raw-nccl"), ("p2p", "torch-symm")] {
            if let Some(line) = report::ratio_line(&rows, mode, a, b, 0..=small, "<= 64K") {
                summary.push(format!("{m}: {line}"));
            }
        }
        for line in report::ratio_summary(&rows, mode, small) {
            summary.push(format!("{m}: {line}"));
        }
        for b in ["raw-nccl", "torch-dist"] {
            if let Some((ratio, bytes)) =
                report::worst_ratio(&rows, mode, "auto", b, large..=u64::MAX)
            {
                let words = if ratio > 1.0 {
                    format!("worst {ratio:.2}x slower at {}", report::format_size(bytes))
                } else {
                    format!(
                        "never slower (worst {ratio:.2}x the time at {})",
                        report::format_size(bytes)
                    )
                };
                summary.push(format!("{m}: >= 1M: auto vs {b}: {words}"));
            }
        }
    }
    for line in &summary {
        println!("{line}");
    }
    write(&rows)?;
    crate::write_stamped(
        &args.out.join("table-procs.txt"),
        stamp,
        &format!("{table}\n{}\n", summary.join("\n")),
    )?;
    // The headline against raw ncclBroadcast, one process per GPU: the fastest way a user
    // drives NCCL there.
    let sizes: Vec<u64> = plan.sizes.iter().map(|&b| b as u64).collect();
    let mut md = String::new();
    for p in ["p2p", "auto"] {
        if rows.iter().any(|r| r.path == p) && rows.iter().any(|r| r.path == "raw-nccl") {
            md.push_str(&report::headline_table(
                &rows,
                p,
                &["raw-nccl"],
                &sizes,
                &plan.modes,
            ));
            md.push('\n');
        }
    }
    if !md.is_empty() {
        crate::write_stamped(&args.out.join("headline-procs.md"), stamp, &md)?;
    }
    let title = format!(
        "broadcast, {world} processes (one GPU each), {}, root {}",
        plan.dtype, args.root
    );
    if let Err(e) = report::plot(&rows, &args.out.join("broadcast-procs.png"), &title) {
        println!("# plot failed: {e}");
    }
    println!("# wrote {}", args.out.display());
    Ok(())
}
