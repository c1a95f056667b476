//! `--interference`: how much broadcasts slow a compute-bound kernel running beside them on
//! every GPU, and how much it slows them, per path.
//!
//! ```text
//! cargo bench --bench broadcast -- --interference                  # every GPU, 20 x 1 GiB
//! cargo bench --bench broadcast -- --interference --paths nccl,copy-engine --compute-ms 100
//! ```
//!
//! # What is measured
//!
//! The compute kernel is an FMA loop over registers (no memory traffic but one store per
//! thread), compiled at run time with NVRTC and launched with [`BLOCKS_PER_SM`] blocks per SM of
//! each GPU on a stream of its own (never the clique's). Its loop count is calibrated at start so
//! that one launch takes about [`LAUNCH_MS`], and a batch holds enough launches for
//! `--compute-ms`. For every path (default nccl, p2p, copy-engine, copy-engine-raw), after one
//! broadcast's output has been checked bit for bit on every rank, each repeat measures, every
//! time from a synchronised machine and in this order:
//!
//! - the compute batch alone, on every GPU;
//! - `--interference-count` broadcasts of `--interference-bytes` from the root alone, back to
//!   back on the clique's streams, always the same buffers;
//! - both: the compute batch queued first, the broadcasts right after.
//!
//! Each stream gets a timing event before and after its work; a time is the slowest GPU's
//! (end - start) on that stream, so the compute time runs until the last GPU finished its batch.
//! The wall clock of "both" runs from the first call that queues work until every stream of
//! every GPU has finished. The report gives the medians over `--interference-repeats`.

use gpucast::prelude::*;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use gpucast::cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use gpucast::cudarc::driver::{
    result, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};
use gpucast::{BroadcastOptions, BroadcastPath, Clique};

use crate::report::interference::{self as ireport, median, InterferenceRow};
use crate::report::{self};
use crate::{env_or, xorshift_fill, Args, Watchdog};

/// The paths measured by default.
const DEFAULT_PATHS: [&str; 4] = ["nccl", "p2p", "copy-engine", "copy-engine-raw"];

/// Threads per block of the compute kernel.
const THREADS: u32 = 256;
/// Blocks per SM: every SM busy, with room left (1024 of 2048 threads, few registers) for the
/// blocks of a broadcast kernel to be scheduled beside them, as beside a matmul.
const BLOCKS_PER_SM: u32 = 4;
/// Target time of one compute launch: close to a bf16 8192^3 matmul on an H200 (about 1.4 ms),
/// so that the batch and the broadcasts interleave at a realistic grain, and long enough that
/// launch costs do not count.
const LAUNCH_MS: f64 = 2.0;

/// Eight independent FMA chains per thread keep the FMA pipes full; nothing but the final
/// store touches memory. The chains stay bounded (|a| < 1), and the store keeps the compiler
/// from dropping the loop.
const KERNEL: &str = r#"
extern "C" __global__ void gpucast_fma(float *out, unsigned int iters, float a, float b) {
    float x[8];
    #pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = (float)(threadIdx.x + j) * 1e-3f;
    for (unsigned int i = 0; i < iters; ++i) {
        #pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = fmaf(x[j], a, b);
    }
    float s = 0.0f;
    #pragma unroll
    for (int j = 0; j < 8; ++j) s += x[j];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"#;

/// The compute-bound kernel on every GPU of the clique, each on a stream of its own.
struct Compute {
    streams: Vec<Arc<CudaStream>>,
    funcs: Vec<CudaFunction>,
    outs: Vec<CudaSlice<f32>>,
    configs: Vec<LaunchConfig>,
    /// Loop count of one launch.
    iters: u32,
    /// Launches per batch.
    launches: usize,
}

impl Compute {
    fn new(clique: &Clique) -> Result<Compute> {
        let ptx = gpucast::cudarc::nvrtc::compile_ptx(KERNEL)
            .map_err(|e| anyhow!("compiling the compute kernel: {e:?}"))?;
        let mut c = Compute {
            streams: Vec::new(),
            funcs: Vec::new(),
            outs: Vec::new(),
            configs: Vec::new(),
            iters: 1 << 12,
            launches: 1,
        };
        for r in 0..clique.len() {
            let ctx = clique.context(r);
            let sms =
                ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let blocks = u32::try_from(sms)? * BLOCKS_PER_SM;
            let stream = ctx.new_stream()?;
            c.funcs
                .push(ctx.load_module(ptx.clone())?.load_function("gpucast_fma")?);
            c.outs
                .push(stream.alloc_zeros::<f32>(usize::try_from(blocks * THREADS)?)?);
            c.configs.push(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            });
            c.streams.push(stream);
        }
        Ok(c)
    }

    /// Queues `n` launches on every GPU's compute stream.
    fn enqueue(&mut self, n: usize) -> Result<()> {
        let (a, b) = (0.999_999f32, 1e-6f32);
        for r in 0..self.streams.len() {
            for _ in 0..n {
                let mut launch = self.streams[r].launch_builder(&self.funcs[r]);
                launch
                    .arg(&mut self.outs[r])
                    .arg(&self.iters)
                    .arg(&a)
                    .arg(&b);
                // SAFETY: the arguments match gpucast_fma(float*, unsigned, float, float), and
                // the kernel writes one float per thread of the grid, which `outs[r]` holds.
                unsafe { launch.launch(self.configs[r]) }?;
            }
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        for s in &self.streams {
            s.synchronize()?;
        }
        Ok(())
    }

    /// `n` launches on every GPU, alone: the slowest GPU's time (ms).
    fn time(&mut self, n: usize) -> Result<f64> {
        self.synchronize()?;
        let start = timing_events(&self.streams)?;
        self.enqueue(n)?;
        slowest_ms(&start, &timing_events(&self.streams)?)
    }

    /// Sets the loop count so that one launch takes about [`LAUNCH_MS`] on the slowest GPU, then
    /// the launches per batch so that a batch takes about `compute_ms`; returns a batch's time.
    fn calibrate(&mut self, compute_ms: f64) -> Result<f64> {
        // The first launches load the module.
        self.time(3)?;
        let mut t = self.time(1)?;
        while t < LAUNCH_MS / 10.0 && self.iters <= u32::MAX / 8 {
            self.iters *= 8;
            t = self.time(1)?;
        }
        let iters = (f64::from(self.iters) * LAUNCH_MS / t).round();
        self.iters = u32::try_from(iters as u64).unwrap_or(u32::MAX).max(1);
        // A second of full load first: the clocks settle where they stay under the batches.
        self.time((1000.0 / LAUNCH_MS) as usize)?;
        let per_launch = self.time(20)? / 20.0;
        self.launches = ((compute_ms / per_launch).round() as usize).max(1);
        self.time(self.launches)
    }
}

/// One timing event per stream, recorded now.
fn timing_events(streams: &[Arc<CudaStream>]) -> Result<Vec<CudaEvent>> {
    // `Clique::record` makes events without timing, so the bench records its own.
    Ok(streams
        .iter()
        .map(|s| s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
        .collect::<std::result::Result<_, _>>()?)
}

/// The longest `end[i] - start[i]` in ms (waits for the events).
fn slowest_ms(start: &[CudaEvent], end: &[CudaEvent]) -> Result<f64> {
    let mut slowest = 0.0f64;
    for (s, e) in start.iter().zip(end) {
        slowest = slowest.max(f64::from(s.elapsed_ms(e)?));
    }
    Ok(slowest)
}

/// How a path broadcasts.
enum How {
    /// `clique.with(&options).broadcast` with these options.
    Options(BroadcastOptions),
    /// `Clique::copy_engine_raw`: the copy engines without gpucast's ordering.
    CopyEngineRaw,
}

/// How `name` broadcasts; `None`, with a printed note, for a path this build or machine lacks.
fn how_for(clique: &Clique, name: &str) -> Result<Option<How>> {
    if name == "copy-engine-raw" {
        return Ok(Some(How::CopyEngineRaw));
    }
    let Some(path) = BroadcastPath::parse(name) else {
        if name == "copy-engine" {
            // The copy-engine path is being added to gpucast on another branch.
            println!("# copy-engine: skipped, this build of gpucast has no such path");
            return Ok(None);
        }
        bail!("unknown path {name} (nccl, p2p, auto, copy-engine, copy-engine-raw)");
    };
    if path == BroadcastPath::P2p {
        if let Err(e) = clique.p2p_available() {
            println!("# {name}: skipped, P2P is unavailable: {e}");
            return Ok(None);
        }
    }
    Ok(Some(How::Options(BroadcastOptions::path(path))))
}

/// The broadcasts of a measurement: `count` from `root`, back to back, the same buffers each
/// time, in place (the root's buffer is the source, as when a model's weights are broadcast):
/// no path then spends a copy on the root's own output, and the copy engines run alone.
struct Broadcasts {
    input: CudaSlice<u8>,
    outputs: Vec<CudaSlice<u8>>,
    host: Vec<u8>,
    root: usize,
    count: usize,
}

impl Broadcasts {
    fn once(&mut self, clique: &Clique, how: &How) -> Result<()> {
        match how {
            How::Options(opts) => {
                clique
                    .with(opts)
                    .broadcast_in_place(self.root, &mut self.outputs)?;
            }
            How::CopyEngineRaw => {
                let dsts: Vec<u64> = self
                    .outputs
                    .iter_mut()
                    .enumerate()
                    .map(|(r, o)| o.device_ptr_mut(clique.stream(r)).0)
                    .collect();
                let src = dsts[self.root];
                // SAFETY: every buffer holds `input.len()` bytes on its rank's device and lives
                // in `self` until the streams have passed the copies (every measurement ends
                // synchronised); the input is only read.
                unsafe { clique.copy_engine_raw(self.root, src, &dsts, self.host.len()) }?;
            }
        }
        Ok(())
    }

    fn run(&mut self, clique: &Clique, how: &How) -> Result<()> {
        for _ in 0..self.count {
            self.once(clique, how)?;
        }
        Ok(())
    }

    /// One broadcast into poisoned outputs, then every rank's output compared with the input.
    fn verify(&mut self, clique: &Clique, how: &How) -> Result<()> {
        for (r, o) in self.outputs.iter_mut().enumerate() {
            let s = clique.stream(r);
            if r == self.root {
                s.memcpy_dtod(&self.input, o)?;
                continue;
            }
            let (p, _g) = o.device_ptr_mut(s);
            // SAFETY: `p` points to `host.len()` bytes on this stream's device.
            unsafe { result::memset_d8_async(p, 0xA5 ^ r as u8, self.host.len(), s.cu_stream()) }?;
        }
        self.once(clique, how)?;
        clique.synchronize()?;
        for r in 0..clique.len() {
            let got: Vec<u8> = clique.stream(r).clone_dtoh(&self.outputs[r])?;
            if got != self.host {
                let i = got.iter().zip(&self.host).position(|(a, b)| a != b);
                bail!(
                    "rank {r} output differs from the input at byte {}",
                    i.unwrap_or(0)
                );
            }
        }
        Ok(())
    }
}

/// One measurement's times (ms): the compute batch and the broadcasts (NaN when not run), and
/// the wall clock until everything finished.
struct Sample {
    compute: f64,
    bcast: f64,
    wall: f64,
}

/// From a synchronised machine: the compute batch (when `with_compute`) and then the broadcasts
/// (when given) queued, everything synchronised.
fn measure(
    clique: &Clique,
    compute: &mut Compute,
    with_compute: bool,
    bcasts: Option<(&mut Broadcasts, &How)>,
) -> Result<Sample> {
    compute.synchronize()?;
    clique.synchronize()?;
    let clique_streams: Vec<Arc<CudaStream>> = (0..clique.len())
        .map(|r| clique.stream(r).clone())
        .collect();
    let t0 = Instant::now();
    let mut compute_events = None;
    if with_compute {
        let start = timing_events(&compute.streams)?;
        compute.enqueue(compute.launches)?;
        compute_events = Some((start, timing_events(&compute.streams)?));
    }
    let mut bcast_events = None;
    if let Some((b, how)) = bcasts {
        let start = timing_events(&clique_streams)?;
        b.run(clique, how)?;
        bcast_events = Some((start, timing_events(&clique_streams)?));
    }
    compute.synchronize()?;
    clique.synchronize()?;
    let wall = t0.elapsed().as_secs_f64() * 1e3;
    let time = |events: Option<(Vec<CudaEvent>, Vec<CudaEvent>)>| {
        events.map_or(Ok(f64::NAN), |(s, e)| slowest_ms(&s, &e))
    };
    Ok(Sample {
        compute: time(compute_events)?,
        bcast: time(bcast_events)?,
        wall,
    })
}

/// Runs the interference mode (see the module docs) and writes interference.{csv,txt,png} to
/// `--out`.
pub(crate) fn run(args: &Args) -> Result<()> {
    let bytes = report::parse_size(&args.interference_bytes)
        .filter(|&b| b > 0)
        .context("bad --interference-bytes")?;
    let (count, repeats) = (args.interference_count, args.interference_repeats);
    if count == 0 || repeats == 0 || !args.compute_ms.is_finite() || args.compute_ms <= 0.0 {
        bail!("--interference-count, --interference-repeats and --compute-ms must be positive");
    }
    let ngpus = match args.gpus {
        Some(g) => g,
        None => gpucast::device_count()?.min(gpucast::MAX_GPUS),
    };
    if ngpus < 2 {
        bail!("the benchmark needs at least 2 GPUs ({ngpus} visible)");
    }
    if args.root >= ngpus {
        bail!("root {} is not one of the {ngpus} GPUs", args.root);
    }
    let ordinals: Vec<usize> = (0..ngpus).collect();
    let clique = Clique::new(&ordinals)?;
    let contexts: Vec<_> = (0..clique.len()).map(|r| clique.context(r)).collect();
    let stamp = crate::run_stamp(&contexts, "");
    let (a, b, c) = gpucast::nccl_version()?;
    println!("# gpucast interference benchmark");
    println!(
        "# GPUs: {ngpus}, root {}, {count} x {} broadcasts, NCCL {a}.{b}.{c}, \
         NCCL_NVLS_ENABLE={}",
        args.root,
        report::format_size(bytes),
        env_or("NCCL_NVLS_ENABLE")
    );
    println!("{}", clique.topology());

    let mut compute = Compute::new(&clique)?;
    let batch_ms = compute.calibrate(args.compute_ms)?;
    println!(
        "# compute: {} x {THREADS} threads per GPU ({BLOCKS_PER_SM} blocks per SM), {} FMA \
         iterations per launch, {} launches per batch: {batch_ms:.2} ms alone",
        compute.configs[0].grid_dim.0, compute.iters, compute.launches
    );

    let len = usize::try_from(bytes)?;
    let mut host = vec![0u8; len];
    xorshift_fill(&mut host, 0x9e37_79b9_7f4a_7c15);
    let mut bcasts = Broadcasts {
        input: clique.stream(args.root).clone_htod(&host)?,
        outputs: clique.alloc_outputs::<u8>(len)?,
        host,
        root: args.root,
        count,
    };
    let names: Vec<String> = match &args.paths {
        Some(p) => p.clone(),
        None => DEFAULT_PATHS.iter().map(|p| p.to_string()).collect(),
    };
    std::fs::create_dir_all(&args.out)?;
    let watchdog = Watchdog::start(None, None);
    let mut rows = Vec::new();
    for name in &names {
        watchdog.at(&format!("{name}: checking"));
        let Some(how) = how_for(&clique, name)? else {
            continue;
        };
        bcasts
            .verify(&clique, &how)
            .with_context(|| format!("checking {name} at {len} bytes"))?;
        // Warm-up: the path's first broadcasts set up what it needs.
        bcasts.run(&clique, &how)?;
        clique.synchronize()?;
        let mut s: [Vec<f64>; 5] = Default::default();
        for i in 0..repeats {
            watchdog.at(&format!("{name}: repeat {i}"));
            let alone = measure(&clique, &mut compute, true, None)?;
            let bcast = measure(&clique, &mut compute, false, Some((&mut bcasts, &how)))?;
            let both = measure(&clique, &mut compute, true, Some((&mut bcasts, &how)))?;
            for (v, x) in s.iter_mut().zip([
                alone.compute,
                both.compute,
                bcast.bcast,
                both.bcast,
                both.wall,
            ]) {
                v.push(x);
            }
        }
        let m = |i: usize| median(&s[i]).context("no samples");
        let row = InterferenceRow {
            gpus: ngpus,
            root: args.root,
            path: name.clone(),
            bytes,
            broadcasts: count,
            launches: compute.launches,
            repeats,
            compute_alone_ms: m(0)?,
            compute_loaded_ms: m(1)?,
            bcast_alone_ms: m(2)?,
            bcast_loaded_ms: m(3)?,
            total_ms: m(4)?,
        };
        println!(
            "{name}: compute {:.2} -> {:.2} ms, broadcasts {:.2} -> {:.2} ms, both {:.2} ms",
            row.compute_alone_ms,
            row.compute_loaded_ms,
            row.bcast_alone_ms,
            row.bcast_loaded_ms,
            row.total_ms
        );
        rows.push(row);
    }
    watchdog.done();
    drop(bcasts);
    drop(compute);
    drop(clique);

    let table = ireport::format_interference_table(&rows);
    let summary = ireport::interference_summary(&rows);
    println!("{table}");
    for line in &summary {
        println!("{line}");
    }
    let mut csv = stamp.header().into_bytes();
    ireport::write_interference_csv(&rows, &mut csv)?;
    std::fs::write(args.out.join("interference.csv"), csv)?;
    crate::write_stamped(
        &args.out.join("interference.txt"),
        &stamp,
        &format!("{table}\n{}\n", summary.join("\n")),
    )?;
    let title = format!(
        "interference: {ngpus} GPUs, {count} x {} broadcasts beside a {batch_ms:.0} ms compute \
         batch",
        report::format_size(bytes)
    );
    if let Err(e) = ireport::plot_interference(&rows, &args.out.join("interference.png"), &title) {
        println!("# plot failed: {e}");
    }
    println!("# wrote {}", args.out.display());
    Ok(())
}
