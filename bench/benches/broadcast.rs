//! Broadcast benchmark: NCCL vs gpucast's P2P kernel vs Auto, with the copy engine, the
//! bare-launch floor and (when python3 has torch) PyTorch side by side, nccl-tests style.
//!
//! `cargo bench --bench broadcast -- --help` lists the options. Every size's outputs are checked
//! bit for bit once per path before it is timed. Each repeat (about 200 ms of work by default)
//! is timed by CUDA events on every rank's stream, the slowest rank counting; the median of the
//! repeats (7 by default) is reported with their minimum and maximum.
//!
//! ```text
//! cargo bench --bench broadcast                          # one process, every GPU (a Clique)
//! cargo bench --bench broadcast -- --procs 2             # one process per GPU (a Communicator)
//! cargo bench --bench broadcast --no-run                 # prints the bench executable's path, then:
//! export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
//! torchrun --nproc-per-node 2 --no-python target/release/deps/broadcast-<hash> --out target/bench
//! ```
//!
//! With `--procs N` (or under torchrun) the bench measures one process per GPU instead; see
//! `benches/procs/mod.rs` for what it measures and how it times it. With `--interference` it
//! measures broadcasts beside a compute-bound kernel on every GPU instead of the size sweep; see
//! `benches/interference/mod.rs`.
//!
//! Run on the counting libcuda shim of `ci/cuda-count` (its directory first in
//! `LD_LIBRARY_PATH`), eager mode also prints each path and size's driver calls per call, over
//! [`drvcount::CALLS`] calls made before the timing (see `benches/drvcount/mod.rs`).

#![allow(
    clippy::cast_possible_truncation,
    reason = "sizes, counts and iteration numbers stay far below 2^32 (and usize is 64-bit here)"
)]

mod drvcount;
mod interference;
mod procs;
mod report;
mod timer;

use gpucast::prelude::*;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use gpucast::cudarc::driver::{
    result, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
};
use gpucast::{BroadcastOptions, BroadcastPath, Clique, DType};
use indicatif::{ProgressBar, ProgressStyle};
use report::{Mode, Row};

#[derive(Parser, Debug)]
#[command(about = "gpucast broadcast benchmark: NCCL vs P2P vs Auto (and PyTorch)")]
struct Args {
    /// Smallest message (bytes; K/M/G suffixes).
    #[arg(short = 'b', long, default_value = "1K")]
    min_bytes: String,
    /// Largest message.
    #[arg(short = 'e', long, default_value = "1G")]
    max_bytes: String,
    /// Size step factor.
    #[arg(short = 'f', long, default_value_t = 2)]
    factor: u64,
    /// Element type (f32, bf16, f16, f64, i8, u8, i32, u32, i64, u64).
    #[arg(short = 'd', long, default_value = "f32")]
    dtype: String,
    /// Root rank.
    #[arg(short = 'r', long, default_value_t = 0)]
    root: usize,
    /// Number of GPUs (2 up to all visible; default all, at most 8). Not with --procs (one GPU
    /// per process there).
    #[arg(short = 'g', long)]
    gpus: Option<usize>,
    /// Put every rank on GPU 0 (`--gpus` ranks, default 2; `shared_devices`): per-call costs
    /// only, on a machine with one GPU. NCCL is off there and bandwidths mean nothing.
    #[arg(long)]
    shared: bool,
    /// One process per GPU: start N ranks of this bench (torchrun's variables, store on
    /// 127.0.0.1, GPU = local rank) and measure the Communicator. Under torchrun the bench
    /// runs that way by itself.
    #[arg(long)]
    procs: Option<usize>,
    /// Paths to measure: nccl, p2p, auto, copy-engine (gpucast's route), copy-engine-raw
    /// (bare cuMemcpyPeerAsync into each peer, unordered, eager only), launch-floor; nccl-raw
    /// (ncclBroadcast on communicators of the bench's own, one group call from one thread, no
    /// gpucast in between); nccl-threads (the same communicators, each rank's ncclBroadcast
    /// from a thread of its own, eager and idle only); nccl-nowatch (gpucast's NCCL path with
    /// its watchdog off, eager and idle only: what the watchdog costs); nccl-untracked (the
    /// NCCL call with cudarc's event tracking off on the contexts, eager and idle only: what
    /// those events cost); nccl-untracked-nowatch (both off: gpucast's own host work over
    /// nccl-raw); p2p-1thread (the P2P kernel launched from one thread, GPU after GPU);
    /// p2p-untracked (the P2P call with cudarc's event tracking off, eager and idle only); and
    /// the P2P kernel
    /// with its protocol forced: p2p-packet (only up to the packet limit), p2p-pull (fan-out),
    /// p2p-chain (each rank forwards to the next; any number of GPUs). Default: nccl,
    /// nccl-raw, nccl-threads, p2p, p2p-1thread, auto, copy-engine, copy-engine-raw,
    /// launch-floor (on one GPU: nccl, nccl-raw, nccl-nowatch, nccl-untracked,
    /// nccl-untracked-nowatch, launch-floor). With one process
    /// per GPU: p2p, auto, nccl, raw-nccl (ncclBroadcast on a communicator of its own),
    /// launch-floor, p2p-packet, p2p-pull; default p2p, auto, nccl, raw-nccl, launch-floor. With
    /// --interference: nccl, p2p, auto, copy-engine (gpucast's path), copy-engine-raw (the bare
    /// copies); default all but auto.
    #[arg(long, value_delimiter = ',')]
    paths: Option<Vec<String>>,
    /// Modes: eager (calls back to back), graph (captured, replayed), idle (single calls, each
    /// after 10 ms with the GPUs idle, nine per repeat taken in turn with the other paths'; the
    /// median of all of them).
    #[arg(long, value_delimiter = ',', default_value = "eager,graph")]
    modes: Vec<String>,
    /// Timed repeats per point (the median is reported).
    #[arg(long, default_value_t = 7)]
    repeats: usize,
    /// Target milliseconds of work per repeat (sets the iterations per repeat, and the graph
    /// launches per repeat in graph mode). Each repeat is timed by CUDA events on every rank.
    #[arg(long, default_value_t = 200.0)]
    target_ms: f64,
    /// Output folder for the CSV, the table and the plot.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// Also run benches/torch_broadcast.py and merge its numbers (auto: when python3 has torch).
    #[arg(long, default_value = "auto")]
    torch: String,
    /// Python interpreter for the PyTorch side.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Instead of the size sweep: a compute-bound kernel on every GPU beside broadcasts, per
    /// path; reports the compute slowdown and the broadcast time (interference.{csv,txt,png}).
    #[arg(long)]
    interference: bool,
    /// With --interference: bytes per broadcast.
    #[arg(long, default_value = "1G")]
    interference_bytes: String,
    /// With --interference: broadcasts back to back per measurement.
    #[arg(long, default_value_t = 20)]
    interference_count: usize,
    /// With --interference: repeats of each measurement (the medians are reported).
    #[arg(long, default_value_t = 5)]
    interference_repeats: usize,
    /// With --interference: target milliseconds of one compute batch alone (sets its launches).
    #[arg(long, default_value_t = 55.0)]
    compute_ms: f64,
    /// Ignored: `cargo bench` passes it to every bench binary.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The paths measured by default in one process.
const DEFAULT_PATHS: &str =
    "nccl,nccl-raw,nccl-threads,p2p,p2p-1thread,auto,copy-engine,copy-engine-raw,launch-floor";

/// The paths measured by default on a clique of one GPU (NCCL with one rank).
const DEFAULT_PATHS_1GPU: &str =
    "nccl,nccl-raw,nccl-nowatch,nccl-untracked,nccl-untracked-nowatch,launch-floor";

/// Single calls per repeat in idle mode, each after [`IDLE_GAP`]. The paths take turns call by
/// call (a host that drifts between two calls touches every path alike), and a point reports
/// the median of all its calls: one call that meets a hiccup of the host does not move it.
const IDLE_CALLS: usize = 9;
const IDLE_GAP: std::time::Duration = std::time::Duration::from_millis(10);

/// Rotating buffers: an input pool on the root and an output pool on every rank, used as
/// `sets` consecutive slices so that back-to-back iterations do not hit a warm L2.
struct Pools {
    input: CudaSlice<u8>,
    outputs: Vec<CudaSlice<u8>>,
    host_input: Vec<u8>,
    /// The pools' device addresses, read once: the raw paths (copy-engine-raw, nccl-raw) take
    /// no cudarc guard per op. Sound because every use of the pools, raw or through gpucast,
    /// is queued on the clique's streams (rank `r`'s pools on rank `r`'s stream).
    input_ptr: u64,
    output_ptrs: Vec<u64>,
    /// nccl-raw's communicators, when measured.
    raw: Option<procs::nccl::RawNcclAll>,
}

const POOL_MIN: usize = 512 << 20;

fn sets_for(bytes: usize, pool: usize) -> usize {
    (pool / bytes).clamp(1, 64)
}

fn xorshift_fill(buf: &mut [u8], mut seed: u64) {
    for chunk in buf.chunks_mut(8) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let b = seed.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// The sweep the options ask for: sizes (whole elements of the type), the type, the modes.
fn sweep(args: &Args) -> Result<(Vec<usize>, DType, Vec<Mode>)> {
    let min = report::parse_size(&args.min_bytes).context("bad --min-bytes")?;
    let max = report::parse_size(&args.max_bytes).context("bad --max-bytes")?;
    let dtype = DType::parse(&args.dtype).context("bad --dtype")?;
    let sizes: Vec<usize> = report::size_sweep(min, max, args.factor)
        .into_iter()
        .map(|s| (s as usize / dtype.size()).max(1) * dtype.size())
        .collect();
    if sizes.is_empty() {
        bail!("no sizes between {min} and {max}");
    }
    let modes: Vec<Mode> = args
        .modes
        .iter()
        .map(|m| Mode::parse(m).with_context(|| format!("unknown mode {m}")))
        .collect::<Result<_>>()?;
    Ok((sizes, dtype, modes))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.interference {
        if args.procs.is_some() || procs::job::in_job() {
            bail!("--interference runs in one process (a Clique), not with --procs or torchrun");
        }
        return interference::run(&args);
    }
    // A rank of a job (started by --procs or torchrun), or the launcher of one.
    if procs::job::in_job() {
        return procs::run(&args);
    }
    if let Some(n) = args.procs {
        return procs::launch(&args, n);
    }
    let (sizes, dtype, modes) = sweep(&args)?;
    let ngpus = match (args.gpus, args.shared) {
        (Some(g), _) => g,
        (None, true) => 2,
        (None, false) => gpucast::device_count()?.min(gpucast::MAX_GPUS),
    };
    if ngpus < 1 || (args.shared && ngpus < 2) {
        bail!("the benchmark needs a GPU ({ngpus} asked for; --shared needs 2 ranks or more)");
    }
    let clique = if args.shared {
        println!("# every rank on GPU 0 (--shared): per-call costs only");
        Clique::builder()
            .devices(&vec![0; ngpus])
            .shared_devices(true)
            .build()?
    } else {
        let ordinals: Vec<usize> = (0..ngpus).collect();
        Clique::new(&ordinals)?
    };
    let contexts: Vec<&Arc<CudaContext>> = (0..clique.len()).map(|r| clique.context(r)).collect();
    let stamp = run_stamp(&contexts, "");
    print!("{}", stamp.header());
    let (a, b, c) = gpucast::nccl_version()?;
    println!("# gpucast broadcast benchmark");
    println!("# GPUs: {ngpus}, root {}, dtype {dtype}", args.root);
    println!(
        "# NCCL {a}.{b}.{c}, NCCL_PROTO={}, NCCL_ALGO={}, NCCL_NVLS_ENABLE={}",
        env_or("NCCL_PROTO"),
        env_or("NCCL_ALGO"),
        env_or("NCCL_NVLS_ENABLE")
    );
    println!("# thresholds: {:?}", clique.thresholds());
    println!("# P2P: {:?}", clique.p2p_available());
    println!("{}", clique.topology());

    let max_size = *sizes.iter().max().expect("non-empty");
    let pool = POOL_MIN.max(2 * max_size);
    let mut host_input = vec![0u8; pool];
    xorshift_fill(&mut host_input, 0x9e37_79b9_7f4a_7c15);
    let paths: Vec<String> = match &args.paths {
        Some(p) => p.clone(),
        None if ngpus == 1 => DEFAULT_PATHS_1GPU.split(',').map(String::from).collect(),
        None => DEFAULT_PATHS.split(',').map(String::from).collect(),
    };
    let nccl_runs = !args.shared;
    let paths: Vec<String> = paths
        .into_iter()
        .filter(|p| {
            let keep = nccl_runs || !p.starts_with("nccl");
            if !keep {
                println!("# {p}: NCCL is off where ranks share a GPU; left out");
            }
            keep
        })
        .collect();
    let input = clique.stream(args.root).clone_htod(&host_input)?;
    let outputs: Vec<CudaSlice<u8>> = (0..ngpus)
        .map(|r| clique.stream(r).alloc_zeros::<u8>(pool))
        .collect::<std::result::Result<_, _>>()?;
    let input_ptr = input.device_ptr(clique.stream(args.root)).0;
    let output_ptrs = outputs
        .iter()
        .enumerate()
        .map(|(r, o)| o.device_ptr(clique.stream(r)).0)
        .collect();
    let raw = if paths.iter().any(|p| p == "nccl-raw" || p == "nccl-threads") {
        Some(procs::nccl::RawNcclAll::new(clique.ordinals())?)
    } else {
        None
    };
    let mut pools = Pools {
        input,
        outputs,
        host_input,
        input_ptr,
        output_ptrs,
        raw,
    };
    let floor = EmptyKernel::new(&clique)?;

    warm_up(&clique, &mut pools, args.root, &floor, nccl_runs)?;
    let total = sizes.len() * paths.len() * modes.len();
    let bar = ProgressBar::new(total as u64);
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}").expect("template"));
    std::fs::create_dir_all(&args.out)?;
    let watchdog = Watchdog::start(Some(args.out.join("partial.csv")), Some(&stamp));
    let mut rows = Vec::new();
    // Eager first, then graph mode with NCCL last: a point that misbehaves late in the sweep
    // costs as little as possible (the watchdog ends the run with what was measured).
    for &mode in &modes {
        let mut order: Vec<&String> = paths.iter().collect();
        if mode == Mode::Graph {
            order.sort_by_key(|p| p.as_str() == "nccl");
        }
        for &bytes in &sizes {
            // Every path of this size is prepared first, then the repeats go round-robin over
            // the paths, so that a drift of the machine (clocks, other tenants) touches every
            // path alike and the ratios compare like with like.
            let mut prepared = Vec::new();
            for path in &order {
                let point = format!(
                    "{path} {} {}",
                    mode.name(),
                    report::format_size(bytes as u64)
                );
                watchdog.at(&point);
                bar.set_message(point.clone());
                if mode == modes[0] {
                    verify(&clique, &mut pools, path, args.root, bytes, &floor)
                        .with_context(|| format!("checking {path} at {bytes} bytes"))?;
                }
                if let Some(timer) = prepare(
                    &clique, &mut pools, path, mode, args.root, bytes, &args, &floor,
                )
                .with_context(|| format!("preparing {point}"))?
                {
                    prepared.push((path.as_str(), timer, Vec::new()));
                }
            }
            // In idle mode every single call is a sample, so the paths take turns call by call.
            let rounds = match mode {
                Mode::Idle => args.repeats * IDLE_CALLS,
                _ => args.repeats,
            };
            for _ in 0..rounds {
                for (path, timer, samples) in &mut prepared {
                    watchdog.at(&format!("{path} {} {}", mode.name(), bytes));
                    samples.push(
                        sample(&clique, &mut pools, path, timer, args.root, bytes, &floor)
                            .with_context(|| format!("timing {path} at {bytes} bytes"))?,
                    );
                }
            }
            for (path, timer, samples) in prepared {
                let st = report::stats(&samples).context("no samples")?;
                let row = Row {
                    gpus: clique.len(),
                    mode,
                    path: path.to_string(),
                    route: timer.route.clone(),
                    bytes: bytes as u64,
                    count: (bytes / dtype.size()) as u64,
                    dtype: dtype.name().to_string(),
                    root: args.root,
                    time_us: st.median,
                    min_us: st.min,
                    max_us: st.max,
                };
                bar.println(format!(
                    "{path} {} {}: {:.2} us ({:.1} GB/s, {})",
                    mode.name(),
                    report::format_size(bytes as u64),
                    row.time_us,
                    row.busbw_gbps(),
                    row.route
                ));
                watchdog.record(&row);
                rows.push(row);
                bar.inc(1);
            }
        }
    }
    watchdog.done();
    bar.finish_and_clear();
    drop(pools);
    drop(floor);
    drop(clique);

    std::fs::create_dir_all(&args.out)?;
    if torch_wanted(&args, 2) {
        if let Some(torch_rows) = torch_rows(
            &args,
            dtype,
            ngpus,
            None,
            &args.out.join("torch.csv"),
            &stamp,
        )? {
            rows.extend(torch_rows);
        }
    } else {
        println!(
            "# PyTorch skipped: {} has no torch with 2 GPUs (or --torch no)",
            args.python
        );
    }

    // The baseline: the fastest way a user drives NCCL measured in this run, per size (one
    // group call from one thread, `nccl-raw`, or one thread per GPU, `nccl-threads`), named in
    // the table's `fastest-nccl` route column; gpucast's own NCCL path (`nccl`) where neither
    // was measured.
    let nccl_ways = ["nccl-raw", "nccl-threads"];
    let mut with_best = rows.clone();
    with_best.extend(report::best_of(&rows, "fastest-nccl", &nccl_ways));
    let baseline = if with_best.len() > rows.len() {
        "fastest-nccl"
    } else {
        "nccl"
    };
    let table = report::format_table(&with_best, baseline);
    println!("{table}");
    let mut summary = Vec::new();
    for &mode in &modes {
        for p in ["p2p", "auto"] {
            let small = 0..=64 << 10;
            if let Some(l) =
                report::ratio_line(&with_best, mode, p, "fastest-nccl", small, "<= 64K")
            {
                summary.push(format!(
                    "{}: fair: {l} (fastest-nccl: per size the fastest of {})",
                    mode.name(),
                    nccl_ways.join(", ")
                ));
            }
        }
    }
    for &mode in &modes {
        if let Some(x) = report::last_win(&rows, mode, "p2p", "nccl") {
            summary.push(format!(
                "{}: P2P beats NCCL up to {} (last size where it wins)",
                mode.name(),
                report::format_size(x)
            ));
        }
        if let Some(x) = report::crossover(&rows, mode, "p2p", "nccl") {
            summary.push(format!(
                "{}: crossover (NCCL at least as fast from here on): {}",
                mode.name(),
                report::format_size(x)
            ));
        }
        for line in report::ratio_summary(&rows, mode, 64 << 10) {
            summary.push(format!("{}: {line}", mode.name()));
        }
        // What gpucast's NCCL path adds to a bare ncclBroadcast, and what its watchdog and
        // cudarc's per-buffer events cost, in microseconds per call.
        for (a, b) in [
            ("nccl", "nccl-raw"),
            ("nccl", "nccl-nowatch"),
            ("nccl-nowatch", "nccl-raw"),
            ("p2p", "p2p-untracked"),
        ] {
            let small = 0..=64 << 10;
            if let Some(l) = report::difference_line(&rows, mode, a, b, small, "<= 64K") {
                summary.push(format!("{}: {l}", mode.name()));
            }
        }
        // The copy-engine route against the bare copies it is made of, and against NCCL.
        for b in ["copy-engine-raw", "nccl", "p2p"] {
            let large = 64 << 20..=u64::MAX;
            if let Some(l) = report::ratio_line(&rows, mode, "copy-engine", b, large, ">= 64M") {
                summary.push(format!("{}: {l}", mode.name()));
            }
        }
    }
    for line in &summary {
        println!("{line}");
    }
    std::fs::write(args.out.join("broadcast.csv"), stamped_csv(&rows, &stamp)?)?;
    write_stamped(
        &args.out.join("table.txt"),
        &stamp,
        &format!("{table}\n{}\n", summary.join("\n")),
    )?;
    // The headline against the fastest way to drive NCCL measured here, and the call-cost
    // budget, as Markdown for results/ (each only where its paths were measured).
    let mut md = String::new();
    for p in ["p2p", "auto"] {
        if rows.iter().any(|r| r.path == p) && baseline == "fastest-nccl" {
            let sizes: Vec<u64> = sizes.iter().map(|&b| b as u64).collect();
            md.push_str(&report::headline_table(
                &rows, p, &nccl_ways, &sizes, &modes,
            ));
            md.push('\n');
        }
    }
    if !md.is_empty() {
        write_stamped(&args.out.join("headline.md"), &stamp, &md)?;
    }
    let budget_paths = [
        "nccl-untracked",
        "nccl-untracked-nowatch",
        "nccl-nowatch",
        "p2p-untracked",
    ];
    if rows.iter().any(|r| budget_paths.contains(&r.path.as_str())) {
        let budget = report::budget_table(&rows, &modes, 0..=64 << 10);
        println!("{budget}");
        write_stamped(&args.out.join("budget.md"), &stamp, &budget)?;
    }
    let title = format!("broadcast, {ngpus} GPUs, {dtype}, root {}", args.root);
    if let Err(e) = report::plot(&rows, &args.out.join("broadcast.png"), &title) {
        println!("# plot failed: {e}");
    }
    println!("# wrote {}", args.out.display());
    Ok(())
}

/// Whether to run the PyTorch side: `--torch yes/no`, or (auto) when `--python` has torch and
/// sees at least `gpus` GPUs.
fn torch_wanted(args: &Args, gpus: usize) -> bool {
    match args.torch.as_str() {
        "yes" | "true" | "1" => true,
        "no" | "false" | "0" => false,
        _ => {
            let mut cmd = Command::new(&args.python);
            cmd.arg("-c").arg(format!(
                "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= {gpus} else 1)"
            ));
            for var in procs::job::JOB_VARS {
                cmd.env_remove(var);
            }
            for (k, v) in procs::job::NO_MULTICAST {
                cmd.env(k, v);
            }
            cmd.status().map(|s| s.success()).unwrap_or(false)
        }
    }
}

/// Runs benches/torch_broadcast.py over the same sweep on `gpus` GPUs (`which`: its `--which`,
/// default its own) into `csv` and reads its rows back; `None` (with a printed reason) when the
/// script fails. The script runs without the variables of this job, with multicast off.
fn torch_rows(
    args: &Args,
    dtype: DType,
    gpus: usize,
    which: Option<&str>,
    csv: &std::path::Path,
    stamp: &report::Stamp,
) -> Result<Option<Vec<Row>>> {
    let modes_arg = args.modes.join(",");
    let mut cmd = Command::new(&args.python);
    cmd.arg(script_path("bench/benches/torch_broadcast.py"))
        .args(["--sizes", &format!("{}:{}", args.min_bytes, args.max_bytes)])
        .args(["--factor", &args.factor.to_string()])
        .args(["--dtype", torch_dtype(dtype)])
        .args(["--root", &args.root.to_string()])
        .args(["--gpus", &gpus.to_string()])
        .args(["--modes", &modes_arg])
        .args(["--target-ms", &args.target_ms.to_string()])
        .args(["--repeats", &args.repeats.to_string()]);
    if let Some(w) = which {
        cmd.args(["--which", w]);
    }
    cmd.arg("--csv").arg(csv);
    for var in procs::job::JOB_VARS {
        cmd.env_remove(var);
    }
    cmd.env_remove("TORCHELASTIC_USE_AGENT_STORE");
    for (k, v) in procs::job::NO_MULTICAST {
        cmd.env(k, v);
    }
    println!("# PyTorch: a separate run of benches/torch_broadcast.py, after the Rust paths (not interleaved with them)");
    let status = cmd.status().context("running benches/torch_broadcast.py")?;
    if status.success() {
        let f = std::io::BufReader::new(std::fs::File::open(csv)?);
        let torch_rows = report::read_csv(f).map_err(anyhow::Error::msg)?;
        println!("# merged {} PyTorch rows", torch_rows.len());
        // The script's own file, stamped as the run's: a separate run after the Rust paths.
        let note = "PyTorch rows: bench/benches/torch_broadcast.py, run after the Rust paths, \
                    not interleaved with them";
        let mut stamp = stamp.clone();
        stamp.command.push_str(&format!("  [{note}]"));
        std::fs::write(csv, stamped_csv(&torch_rows, &stamp)?)?;
        Ok(Some(torch_rows))
    } else {
        println!("# PyTorch script failed ({status}); its numbers are skipped");
        Ok(None)
    }
}

/// A file of this repository (a path from its root): from the build's checkout if it is still
/// there, else relative to the working directory (the GPU machine runs the staged binary from a
/// copy of the repository).
fn script_path(relative: &str) -> PathBuf {
    let built = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join(relative);
    if built.exists() {
        built
    } else {
        PathBuf::from(relative)
    }
}

/// The stamp every table and CSV of this run opens with ([`report::Stamp`]): the commit
/// (`GPUCAST_COMMIT`, which ci/gpu-run.sh sets from the staged .gpu/COMMIT, else the commit the
/// bench was built from), the GPUs of `contexts` (one per rank), the driver, NCCL, and this
/// process's command line with `note` after it.
fn run_stamp(contexts: &[&Arc<CudaContext>], note: &str) -> report::Stamp {
    let staged = std::env::var("GPUCAST_COMMIT").ok();
    let commit = report::commit_of(staged.as_deref(), option_env!("GPUCAST_BUILD_COMMIT"));
    let mut gpus: Vec<(usize, String)> = contexts
        .iter()
        .map(|c| {
            let name = c.name().unwrap_or_else(|e| format!("unnamed ({e})"));
            (c.ordinal(), name)
        })
        .collect();
    let ranks = gpus.len();
    gpus.sort();
    gpus.dedup();
    let mut by_name: std::collections::BTreeMap<&str, Vec<usize>> = Default::default();
    for (ordinal, name) in &gpus {
        by_name.entry(name).or_default().push(*ordinal);
    }
    let mut gpu = by_name
        .iter()
        .map(|(name, ordinals)| {
            let list: Vec<String> = ordinals.iter().map(usize::to_string).collect();
            format!("{}x {name} (GPU {})", ordinals.len(), list.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ");
    if ranks > gpus.len() {
        gpu.push_str(&format!("; {ranks} ranks share them"));
    }
    let module = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|t| report::driver_from_proc(&t))
        .unwrap_or_else(|| "unknown (no /proc/driver/nvidia/version)".into());
    let mut cuda = 0;
    // SAFETY: a plain out-parameter; the driver is loaded (the contexts above exist).
    let cuda = match unsafe { gpucast::cudarc::driver::sys::cuDriverGetVersion(&mut cuda) } {
        gpucast::cudarc::driver::sys::CUresult::CUDA_SUCCESS => {
            format!("CUDA {}.{}", cuda / 1000, (cuda % 1000) / 10)
        }
        e => format!("CUDA version unknown ({e:?})"),
    };
    let nccl = match gpucast::nccl_version() {
        Ok((a, b, c)) => format!(
            "{a}.{b}.{c}, NCCL_PROTO={}, NCCL_ALGO={}, NCCL_NVLS_ENABLE={}",
            env_or("NCCL_PROTO"),
            env_or("NCCL_ALGO"),
            env_or("NCCL_NVLS_ENABLE")
        ),
        Err(e) => format!("not loaded ({e})"),
    };
    let args: Vec<String> = std::env::args().collect();
    let mut command = report::shell_line(&args);
    if !note.is_empty() {
        command.push_str(&format!("  [{note}]"));
    }
    report::Stamp {
        commit,
        gpu,
        driver: format!("{module} ({cuda})"),
        nccl,
        command,
    }
}

/// Writes `body` to `path` after `stamp`'s header.
fn write_stamped(path: &std::path::Path, stamp: &report::Stamp, body: &str) -> Result<()> {
    std::fs::write(path, format!("{}{body}", stamp.header()))
        .with_context(|| format!("writing {}", path.display()))
}

/// `rows` as CSV after `stamp`'s header.
fn stamped_csv(rows: &[Row], stamp: &report::Stamp) -> Result<String> {
    let mut csv = stamp.header().into_bytes();
    report::write_csv(rows, &mut csv)?;
    Ok(String::from_utf8(csv)?)
}

fn env_or(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| "unset".into())
}

fn torch_dtype(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::I8 => "int8",
        DType::U8 => "uint8",
        DType::I32 => "int32",
        DType::I64 => "int64",
        _ => "float32",
    }
}

/// Ends the run (exit code 3) if one point makes no progress for a minute, after printing where
/// it stopped; every finished point is appended to `csv` (`partial.csv`) as it completes.
struct Watchdog {
    state: Arc<std::sync::Mutex<(String, Instant, bool)>>,
    csv: Option<PathBuf>,
}

impl Watchdog {
    fn start(csv: Option<PathBuf>, stamp: Option<&report::Stamp>) -> Watchdog {
        let state = Arc::new(std::sync::Mutex::new((
            String::from("start"),
            Instant::now(),
            false,
        )));
        let s = state.clone();
        if let Some(csv) = &csv {
            let header = stamp.map(report::Stamp::header).unwrap_or_default();
            std::fs::write(csv, format!("{header}{}\n", report::CSV_HEADER)).ok();
        }
        std::thread::spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_secs(5));
            let Ok((point, since, done)) = s.lock().map(|g| g.clone()) else {
                return;
            };
            if done {
                return;
            }
            if since.elapsed().as_secs() > 60 {
                eprintln!("watchdog: no progress for 60 s at {point}; exiting with what was measured (partial.csv)");
                std::process::exit(3);
            }
        });
        Watchdog { state, csv }
    }

    fn at(&self, point: &str) {
        if let Ok(mut g) = self.state.lock() {
            *g = (point.to_string(), Instant::now(), false);
        }
    }

    fn record(&self, row: &Row) {
        use std::io::Write;
        let Some(csv) = &self.csv else {
            return;
        };
        let mut text = Vec::new();
        if report::write_csv(std::slice::from_ref(row), &mut text).is_ok() {
            let text = String::from_utf8_lossy(&text);
            let body: String = text.lines().skip(1).map(|l| format!("{l}\n")).collect();
            if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(csv) {
                f.write_all(body.as_bytes()).ok();
            }
        }
    }

    fn done(&self) {
        if let Ok(mut g) = self.state.lock() {
            g.2 = true;
        }
    }
}

/// An empty kernel, launched once per GPU per op: the floor of any design that launches a
/// kernel on every GPU.
struct EmptyKernel {
    funcs: Vec<CudaFunction>,
}

impl EmptyKernel {
    fn new(clique: &Clique) -> Result<EmptyKernel> {
        let contexts: Vec<&Arc<CudaContext>> =
            (0..clique.len()).map(|r| clique.context(r)).collect();
        EmptyKernel::on(&contexts)
    }

    /// The kernel loaded in each of `contexts` (launch it with one stream per context, in order).
    fn on(contexts: &[&Arc<CudaContext>]) -> Result<EmptyKernel> {
        let ptx =
            gpucast::cudarc::nvrtc::compile_ptx("extern \"C\" __global__ void gpucast_empty() {}")
                .map_err(|e| anyhow::anyhow!("compiling the empty kernel: {e:?}"))?;
        let funcs = contexts
            .iter()
            .map(|ctx| {
                let m = ctx.load_module(ptx.clone())?;
                m.load_function("gpucast_empty")
            })
            .collect::<std::result::Result<_, _>>()?;
        Ok(EmptyKernel { funcs })
    }

    fn launch(&self, clique: &Clique) -> Result<()> {
        let streams: Vec<_> = (0..clique.len())
            .map(|r| clique.stream(r).clone())
            .collect();
        self.launch_on(&streams)
    }

    fn launch_on(&self, streams: &[Arc<CudaStream>]) -> Result<()> {
        for (r, f) in self.funcs.iter().enumerate() {
            // SAFETY: a live context of the clique.
            unsafe { result::ctx::set_current(streams[r].context().cu_ctx()) }?;
            // SAFETY: the empty kernel takes no parameters.
            unsafe {
                result::launch_kernel(
                    f.cu_function(),
                    (1, 1, 1),
                    (32, 1, 1),
                    0,
                    streams[r].cu_stream(),
                    &mut [],
                )
            }?;
        }
        Ok(())
    }
}

/// Broadcast options of a path name (`p2p-packet`, `p2p-pull` and `p2p-chain` force the
/// kernel's protocol).
fn options_for(path: &str) -> Result<BroadcastOptions> {
    Ok(match path {
        "p2p-packet" => BroadcastOptions::path(BroadcastPath::P2p)
            .packet_threshold(gpucast::testing::PACKET_MAX_BYTES),
        // Named here, not parsed: a path and its variants (`-untracked`, `-nowatch`) pay the
        // same bench work per call, so their differences are the library's alone.
        "p2p" | "p2p-1thread" | "p2p-untracked" => BroadcastOptions::path(BroadcastPath::P2p),
        "nccl" | "nccl-nowatch" | "nccl-untracked" | "nccl-untracked-nowatch" => {
            BroadcastOptions::path(BroadcastPath::Nccl)
        }
        "p2p-pull" => BroadcastOptions::path(BroadcastPath::P2p)
            .packet_threshold(0)
            .p2p_chain_threshold(usize::MAX),
        "p2p-chain" => BroadcastOptions::path(BroadcastPath::P2p)
            .packet_threshold(0)
            .p2p_chain_threshold(0),
        p => BroadcastOptions::path(
            BroadcastPath::parse(p).with_context(|| format!("unknown path {p}"))?,
        ),
    })
}

/// One op of `path` on rotating set `set`.
fn run_op(
    clique: &Clique,
    pools: &mut Pools,
    path: &str,
    root: usize,
    bytes: usize,
    set: usize,
    floor: &EmptyKernel,
) -> Result<()> {
    let off = set * bytes;
    match path {
        "launch-floor" => floor.launch(clique),
        "copy-engine-raw" => {
            let src = pools.input_ptr + off as u64;
            let dsts: Vec<u64> = pools.output_ptrs.iter().map(|p| p + off as u64).collect();
            // SAFETY: the pools hold `pool` bytes and `off + bytes <= pool` (sets_for); their
            // every use is on the clique's streams (see `Pools`).
            unsafe { clique.copy_engine_raw(root, src, &dsts, bytes) }?;
            Ok(())
        }
        "nccl-raw" | "nccl-threads" => {
            let raw = pools.raw.as_ref().context("nccl-raw was not set up")?;
            let dsts: Vec<u64> = pools.output_ptrs.iter().map(|p| p + off as u64).collect();
            let streams: Vec<_> = (0..clique.len())
                .map(|r| clique.stream(r).cu_stream())
                .collect();
            let src = pools.input_ptr + off as u64;
            // SAFETY: as for copy-engine-raw; each rank's part goes on its own stream.
            unsafe {
                if path == "nccl-raw" {
                    raw.broadcast(root, src, &dsts, bytes, &streams)
                } else {
                    raw.broadcast_threads(root, src, &dsts, bytes, &streams)
                }
            }
        }
        p => {
            let opts = options_for(p)?;
            let input = pools.input.slice(off..off + bytes);
            let mut outs: Vec<_> = pools
                .outputs
                .iter_mut()
                .map(|o| o.slice_mut(off..off + bytes))
                .collect();
            // p2p-1thread: the same kernel, launched from this thread one GPU after the other.
            let sequential = p == "p2p-1thread";
            if sequential {
                clique.set_parallel_launch(false)?;
            }
            // p2p-untracked, nccl-untracked(-nowatch): the same call without cudarc's
            // per-buffer events (`disable_event_tracking` on the contexts, as a user who orders
            // buffers themselves would), to measure what they cost. Sound here only: every
            // bench buffer lives on its rank's clique stream and nothing else touches it.
            let untracked = p.ends_with("untracked") || p.contains("untracked-");
            if untracked {
                for r in 0..clique.len() {
                    // SAFETY: see above; turned back on right after the call.
                    unsafe { clique.context(r).disable_event_tracking() };
                }
            }
            let nowatch = p.ends_with("nowatch");
            if nowatch {
                clique.set_watchdog(false);
            }
            let r = clique.with(&opts).broadcast(root, &input, &mut outs);
            if nowatch {
                clique.set_watchdog(true);
            }
            if untracked {
                for r in 0..clique.len() {
                    // SAFETY: restores the default.
                    unsafe { clique.context(r).enable_event_tracking() };
                }
            }
            if sequential {
                clique.set_parallel_launch(true)?;
            }
            r?;
            Ok(())
        }
    }
}

/// One op of `path` on rotating set `set`, queued into a capture.
fn graph_op(
    c: &mut gpucast::Capture<'_, gpucast::Clique>,
    pools: &mut Pools,
    path: &str,
    root: usize,
    bytes: usize,
    set: usize,
    floor: &EmptyKernel,
) -> gpucast::Result<()> {
    let off = set * bytes;
    match path {
        "launch-floor" => {
            // SAFETY: the capture is the unchecked one (`capture_unchecked`, whose contract the
            // caller keeps); the empty kernel touches no memory.
            let streams: Vec<_> = (0..floor.funcs.len())
                .map(|r| unsafe { c.stream(r) }.clone())
                .collect();
            floor
                .launch_on(&streams)
                .map_err(|e| gpucast::Error::InvalidList(e.to_string()))
        }
        "copy-engine-raw" => Err(gpucast::Error::InvalidList(
            "cuMemcpyPeerAsync cannot be captured".into(),
        )),
        "nccl-raw" => {
            let in_capture = |e: anyhow::Error| gpucast::Error::InvalidList(format!("{e:#}"));
            let raw = pools
                .raw
                .as_ref()
                .context("nccl-raw was not set up")
                .map_err(in_capture)?;
            let dsts: Vec<u64> = pools.output_ptrs.iter().map(|p| p + off as u64).collect();
            // SAFETY: the capture is the unchecked one, and the pools outlive the graph (below).
            let streams: Vec<_> = (0..dsts.len())
                .map(|r| unsafe { c.stream(r) }.cu_stream())
                .collect();
            // SAFETY: as in `run_op`; the capture streams record the calls into the graph,
            // which replays them on the clique's streams, and the pools outlive the graph.
            unsafe { raw.broadcast(root, pools.input_ptr + off as u64, &dsts, bytes, &streams) }
                .map_err(in_capture)
        }
        p => {
            let opts = options_for(p).map_err(|e| gpucast::Error::InvalidList(e.to_string()))?;
            let input = pools.input.slice(off..off + bytes);
            let mut outs: Vec<_> = pools
                .outputs
                .iter_mut()
                .map(|o| o.slice_mut(off..off + bytes))
                .collect();
            c.with(&opts).broadcast(root, &input, &mut outs)
        }
    }
}

/// About two seconds of mixed work before anything is timed: idle GPUs run at low clocks and
/// the first sizes of a sweep would otherwise be measured on a cold machine.
fn warm_up(
    clique: &Clique,
    pools: &mut Pools,
    root: usize,
    floor: &EmptyKernel,
    nccl_runs: bool,
) -> Result<()> {
    let t0 = Instant::now();
    let mut i = 0;
    let p2p_runs = clique.p2p_available().is_ok();
    while t0.elapsed().as_secs_f64() < 2.0 {
        for (path, bytes) in [
            ("nccl", 1 << 20),
            ("p2p", 4096),
            ("p2p", 1 << 20),
            ("launch-floor", 0),
        ] {
            if (path == "nccl" && !nccl_runs) || (path == "p2p" && !p2p_runs) {
                continue;
            }
            run_op(clique, pools, path, root, bytes.max(1), i % 4, floor)?;
        }
        i += 1;
        if i % 64 == 0 {
            clique.synchronize()?;
        }
    }
    clique.synchronize()?;
    Ok(())
}

/// Runs one op of `path` into poisoned outputs and compares every rank's output with the input.
fn verify(
    clique: &Clique,
    pools: &mut Pools,
    path: &str,
    root: usize,
    bytes: usize,
    floor: &EmptyKernel,
) -> Result<()> {
    if path == "launch-floor" {
        return Ok(());
    }
    for (r, o) in pools.outputs.iter_mut().enumerate() {
        let s: &Arc<CudaStream> = clique.stream(r);
        let (p, _g) = o.device_ptr_mut(s);
        // SAFETY: `p` points to the pool of `pool` >= bytes bytes on this stream's device.
        unsafe { result::memset_d8_async(p, 0xA5 ^ r as u8, bytes, s.cu_stream()) }?;
    }
    run_op(clique, pools, path, root, bytes, 0, floor)?;
    clique.synchronize()?;
    let want = &pools.host_input[..bytes];
    for r in 0..clique.len() {
        if path == "copy-engine-raw" && r == root {
            continue;
        }
        let got: Vec<u8> = clique
            .stream(r)
            .clone_dtoh(&pools.outputs[r].slice(..bytes))?;
        if got != want {
            let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            bail!("{path}: rank {r} output differs from the input at byte {i} of {bytes}");
        }
    }
    Ok(())
}

/// A path made ready to time at one size: warmed up (eager) or captured (graph).
struct Timer<'c> {
    mode: Mode,
    route: String,
    iters: usize,
    sets: usize,
    graph: Option<gpucast::CliqueGraph<'c>>,
    /// Graph mode: launches of the graph per repeat (each replays `iters` broadcasts).
    launches: usize,
}

/// Warms `path` up at `bytes` (eager) or captures its graph; `None` for a point that does not
/// apply (the packet protocol above its capacity, a path that cannot be captured).
#[allow(
    clippy::too_many_arguments,
    reason = "one call site; a struct would only rename them"
)]
fn prepare<'c>(
    clique: &'c Clique,
    pools: &mut Pools,
    path: &str,
    mode: Mode,
    root: usize,
    bytes: usize,
    args: &Args,
    floor: &EmptyKernel,
) -> Result<Option<Timer<'c>>> {
    let sets = sets_for(bytes, pools.input.len());
    // Iterations so that a repeat holds about target_ms of work (estimate: 10 us + 300 GB/s).
    let est_us = 10.0 + bytes as f64 / 300e3;
    let iters = ((args.target_ms * 1e3 / est_us) as usize).clamp(4, 200_000);
    let route = match options_for(path) {
        Ok(opts) => clique.route(bytes, &opts)?.name().to_string(),
        Err(_) => "-".to_string(),
    };
    if path == "p2p-packet" && bytes > gpucast::testing::PACKET_MAX_BYTES {
        return Ok(None);
    }
    // Switches around a call (events off, watchdog off) have no meaning inside a capture.
    if mode == Mode::Graph
        && matches!(
            path,
            "p2p-untracked"
                | "nccl-nowatch"
                | "nccl-untracked"
                | "nccl-untracked-nowatch"
                | "p2p-1thread"
                | "nccl-threads"
        )
    {
        return Ok(None);
    }
    match mode {
        Mode::Idle => {
            run_op(clique, pools, path, root, bytes, 0, floor)?;
            clique.synchronize()?;
            Ok(Some(Timer {
                mode,
                route,
                iters: 1,
                sets,
                graph: None,
                launches: 1,
            }))
        }
        Mode::Eager => {
            for i in 0..iters.min(50) {
                run_op(clique, pools, path, root, bytes, i % sets, floor)?;
            }
            clique.synchronize()?;
            // On the counting libcuda shim (ci/cuda-count): driver calls per call, counted over
            // calls of their own (every thread's, the watchdog's included), before the timing.
            if let Some(counter) = drvcount::counter() {
                let before = counter.snapshot();
                for i in 0..drvcount::CALLS {
                    run_op(clique, pools, path, root, bytes, i % sets, floor)?;
                }
                let after = counter.snapshot();
                clique.synchronize()?;
                println!(
                    "# driver calls, {path} eager {}: {}",
                    report::format_size(bytes as u64),
                    counter.per_call(&before, &after, drvcount::CALLS)
                );
            }
            Ok(Some(Timer {
                mode,
                route,
                iters,
                sets,
                graph: None,
                launches: 1,
            }))
        }
        Mode::Graph => {
            let launches = iters.div_ceil(500);
            let iters = iters.min(500);
            clique.synchronize()?;
            // The route label is the one the capture takes (graph thresholds).
            let mut route = route;
            // SAFETY: the pools outlive the graph (dropped before them), and the only other
            // work on them runs on the clique's streams, in order with the replays.
            let captured = unsafe {
                clique.capture_unchecked(|c| {
                    if let Ok(opts) = options_for(path) {
                        route = c.route(bytes, &opts)?.name().to_string();
                    }
                    for i in 0..iters {
                        graph_op(c, pools, path, root, bytes, i % sets, floor)?;
                    }
                    Ok(())
                })
            };
            let mut graph = match captured {
                Ok(g) => g,
                Err(e) => {
                    println!("# graph capture of {path} failed: {e}; skipped");
                    clique.synchronize().ok();
                    return Ok(None);
                }
            };
            graph.upload()?;
            graph.launch()?;
            clique.synchronize()?;
            Ok(Some(Timer {
                mode,
                route,
                iters,
                sets,
                graph: Some(graph),
                launches,
            }))
        }
    }
}

/// One repeat of a prepared point: microseconds per broadcast, timed by CUDA events on every
/// rank's stream (from a mark queued on the idle stream before the first broadcast to one
/// queued after the last; the slowest rank counts), so the wait for the end adds nothing. In
/// idle mode a repeat is a single call, queued [`IDLE_GAP`] after every stream drained.
fn sample(
    clique: &Clique,
    pools: &mut Pools,
    path: &str,
    timer: &mut Timer<'_>,
    root: usize,
    bytes: usize,
    floor: &EmptyKernel,
) -> Result<f64> {
    clique.synchronize()?;
    if timer.mode == Mode::Idle {
        std::thread::sleep(IDLE_GAP);
    }
    let starts = mark(clique)?;
    let mut ops = timer.iters;
    match &mut timer.graph {
        Some(graph) => {
            for _ in 0..timer.launches {
                graph.launch()?;
            }
            ops *= timer.launches;
        }
        None => {
            for i in 0..timer.iters {
                run_op(clique, pools, path, root, bytes, i % timer.sets, floor)?;
            }
        }
    }
    let ends = mark(clique)?;
    clique.synchronize()?;
    Ok(f64::from(timer::slowest_ms(&starts, &ends)?) * 1e3 / ops as f64)
}

/// A timing event on every rank's stream, after the work queued there so far.
fn mark(clique: &Clique) -> Result<Vec<CudaEvent>> {
    let streams: Vec<&Arc<CudaStream>> = (0..clique.len()).map(|r| clique.stream(r)).collect();
    timer::marks(&streams)
}
