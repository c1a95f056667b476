//! Load a model's weights on one GPU and give every GPU a copy, in one fused broadcast.
//!
//! ```text
//! cargo run --release --example broadcast_weights                      # synthetic ~1.5 GB bf16 model
//! cargo run --release --example broadcast_weights -- --file model.safetensors
//! cargo run --release --example broadcast_weights -- --size 4G --save /tmp/m.safetensors
//! cargo run --release --example broadcast_weights -- --compare          # vs one call per tensor, vs PyTorch
//! cargo run --release --example broadcast_weights -- --procs 2          # one process per GPU
//! cargo build --release --example broadcast_weights                     # then, under torchrun:
//! export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
//! torchrun --nproc-per-node 2 --no-python target/release/examples/broadcast_weights
//! ```
//!
//! Every copy on every GPU is checked bit for bit against the host's bytes.
//!
//! By default one process drives every GPU (a `Clique`). With `--procs N` the example starts N
//! ranks of itself with torchrun's variables (store on 127.0.0.1, rank `r` on GPU `r`; see
//! `examples/common/job.rs`), and under torchrun it runs as a rank by itself (`RANK` and
//! `WORLD_SIZE` set). Then every rank builds a `gpucast::Communicator` and builds the model's
//! host bytes the same way (the synthetic model is deterministic; a `--file` is read by every
//! rank), the root uploads its copy, every other rank allocates and poisons its tensors, and
//! one fused in-place `broadcast_many` copies every tensor. Every rank checks every tensor bit
//! for bit against its host bytes and prints one line; rank 0 prints the median time of
//! `--repeats` more calls, each from a barrier of the job's store to the end of the call on
//! the last rank (latest end - earliest start over the ranks, on the host's clock).

#[path = "../common/job.rs"]
mod job;
mod model;

use gpucast::prelude::*;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use gpucast::cudarc::driver::{result, CudaSlice, CudaStream};
use gpucast::half::{bf16, f16};
use gpucast::{
    BroadcastOptions, BroadcastPath, Clique, DType, DeviceTensor, DeviceTensorMut, FusedReport,
};
use indicatif::{ProgressBar, ProgressStyle};
use model::{human_bytes, HostTensor, ModelSpec};

#[derive(Parser, Debug)]
#[command(
    about = "Broadcast a model's weights from one GPU to every GPU, fused, and check every copy"
)]
struct Args {
    /// A .safetensors file to load; without it a synthetic model is built.
    #[arg(long)]
    file: Option<PathBuf>,
    /// Size of the synthetic model (bytes; K/M/G suffixes). Default: a Llama-3.2-1B-shaped
    /// model of about 1.5 GB.
    #[arg(long)]
    size: Option<String>,
    /// Element type of the synthetic model.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Save the synthetic model to this .safetensors file.
    #[arg(long)]
    save: Option<PathBuf>,
    /// CUDA devices (default: every visible GPU, at most 8).
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    /// Root rank (the GPU the weights are loaded on).
    #[arg(long, default_value_t = 0)]
    root: usize,
    /// Path: auto, nccl or p2p.
    #[arg(long, default_value = "auto")]
    path: String,
    /// Timed repeats (the median is reported).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Also time one broadcast per tensor and PyTorch's broadcast_coalesced on the same tensors.
    #[arg(long)]
    compare: bool,
    /// Python interpreter for the PyTorch comparison.
    #[arg(long, default_value = "python3")]
    python: String,
    /// One process per GPU: start N ranks of this example (torchrun's variables, store on
    /// 127.0.0.1, rank r on GPU r), each with a Communicator. Under torchrun the example runs
    /// that way by itself.
    #[arg(long)]
    procs: Option<usize>,
}

/// A tensor on one GPU, of any of the ten element types.
enum GpuTensor {
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
    F16(CudaSlice<f16>),
    Bf16(CudaSlice<bf16>),
    I8(CudaSlice<i8>),
    U8(CudaSlice<u8>),
    I32(CudaSlice<i32>),
    U32(CudaSlice<u32>),
    I64(CudaSlice<i64>),
    U64(CudaSlice<u64>),
}

/// Expands `$body` once per variant with `$t` bound to the inner slice.
macro_rules! each {
    ($value:expr, $t:ident => $body:expr) => {
        match $value {
            GpuTensor::F32($t) => $body,
            GpuTensor::F64($t) => $body,
            GpuTensor::F16($t) => $body,
            GpuTensor::Bf16($t) => $body,
            GpuTensor::I8($t) => $body,
            GpuTensor::U8($t) => $body,
            GpuTensor::I32($t) => $body,
            GpuTensor::U32($t) => $body,
            GpuTensor::I64($t) => $body,
            GpuTensor::U64($t) => $body,
        }
    };
}

impl GpuTensor {
    /// Allocates `len` elements of `dtype` on `stream`'s device (contents undefined).
    fn alloc(stream: &std::sync::Arc<CudaStream>, dtype: DType, len: usize) -> Result<GpuTensor> {
        // SAFETY: every arm allocates uninitialised memory, which the example writes (upload or
        // broadcast, after a poison fill) before it reads it.
        Ok(unsafe {
            match dtype {
                DType::F32 => GpuTensor::F32(stream.alloc(len)?),
                DType::F64 => GpuTensor::F64(stream.alloc(len)?),
                DType::F16 => GpuTensor::F16(stream.alloc(len)?),
                DType::BF16 => GpuTensor::Bf16(stream.alloc(len)?),
                DType::I8 => GpuTensor::I8(stream.alloc(len)?),
                DType::U8 => GpuTensor::U8(stream.alloc(len)?),
                DType::I32 => GpuTensor::I32(stream.alloc(len)?),
                DType::U32 => GpuTensor::U32(stream.alloc(len)?),
                DType::I64 => GpuTensor::I64(stream.alloc(len)?),
                DType::U64 => GpuTensor::U64(stream.alloc(len)?),
                other => bail!("unsupported element type {other}"),
            }
        })
    }

    fn as_dyn(&self) -> &dyn DeviceTensor {
        each!(self, t => t as &dyn DeviceTensor)
    }

    fn as_dyn_mut(&mut self) -> &mut dyn DeviceTensorMut {
        each!(self, t => t as &mut dyn DeviceTensorMut)
    }

    /// Copies host bytes in (the byte count must match).
    fn upload(&mut self, stream: &CudaStream, bytes: &[u8]) -> Result<()> {
        ensure!(
            bytes.len() == self.as_dyn().num_bytes(),
            "size mismatch on upload"
        );
        if bytes.is_empty() {
            return Ok(());
        }
        let (ptr, _g) = self.as_dyn_mut().write_ptr(stream);
        // SAFETY: `ptr` holds exactly bytes.len() bytes on this stream's device; the copy is
        // synchronous with respect to the host buffer.
        unsafe { result::memcpy_htod_sync(ptr, bytes) }?;
        Ok(())
    }

    /// Copies the device bytes out.
    fn download(&self, stream: &CudaStream) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.as_dyn().num_bytes()];
        if out.is_empty() {
            return Ok(out);
        }
        let (ptr, _g) = self.as_dyn().read_ptr(stream);
        stream.synchronize()?;
        // SAFETY: `ptr` holds out.len() bytes; the stream was synchronised, so the data is final.
        unsafe { result::memcpy_dtoh_sync(&mut out, ptr) }?;
        Ok(out)
    }

    /// One single-tensor broadcast of this (root) tensor into `outs` (one per rank).
    fn broadcast_one(
        &self,
        clique: &Clique,
        root: usize,
        outs: &mut [&mut GpuTensor],
        opts: &BroadcastOptions,
    ) -> Result<()> {
        macro_rules! typed {
            ($variant:ident, $src:expr) => {{
                let mut dst: Vec<_> = outs
                    .iter_mut()
                    .map(|o| match o {
                        GpuTensor::$variant(d) => Ok(d.slice_mut(..)),
                        _ => Err(anyhow::anyhow!("output type differs from the input's")),
                    })
                    .collect::<Result<_>>()?;
                clique.with(opts).broadcast(root, $src, &mut dst)?;
            }};
        }
        match self {
            GpuTensor::F32(s) => typed!(F32, s),
            GpuTensor::F64(s) => typed!(F64, s),
            GpuTensor::F16(s) => typed!(F16, s),
            GpuTensor::Bf16(s) => typed!(Bf16, s),
            GpuTensor::I8(s) => typed!(I8, s),
            GpuTensor::U8(s) => typed!(U8, s),
            GpuTensor::I32(s) => typed!(I32, s),
            GpuTensor::U32(s) => typed!(U32, s),
            GpuTensor::I64(s) => typed!(I64, s),
            GpuTensor::U64(s) => typed!(U64, s),
        }
        Ok(())
    }
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg:>10} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec})",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() -> Result<()> {
    // RUST_LOG=gpucast=debug shows the clique's creation and one span per broadcast (its path).
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .init();
    let args = Args::parse();
    let path = BroadcastPath::parse(&args.path)
        .with_context(|| format!("unknown --path {}", args.path))?;
    let opts = BroadcastOptions::path(path);
    // A rank of a job (started by --procs or torchrun), or the launcher of one.
    if job::in_job() {
        return run_rank(&args, &opts);
    }
    if let Some(n) = args.procs {
        ensure!(
            args.root < n,
            "--root {} is not one of the {n} ranks",
            args.root
        );
        return job::launch(n);
    }

    // 1. The GPUs first: a machine without them fails before any work.
    let clique = match &args.devices {
        Some(d) => Clique::new(d)?,
        None => Clique::all()?,
    };
    ensure!(
        args.root < clique.len(),
        "--root {} but only {} GPUs",
        args.root,
        clique.len()
    );
    let n = clique.len();
    println!("{}", clique.topology());

    // 2. The weights, on the host.
    let tensors = host_tensors(&args, true)?;
    if let Some(save) = &args.save {
        model::save_safetensors(&tensors, save)?;
        println!("saved {}", save.display());
    }
    let (count, total) = model::summarize(&tensors);
    println!("{count} tensors, {}", human_bytes(total));

    // 3. Upload to the root; allocate every rank's copy.
    let pb = bar(total, "uploading");
    let mut inputs = Vec::with_capacity(count);
    for t in &tensors {
        let mut g = GpuTensor::alloc(clique.stream(args.root), t.dtype, t.len())?;
        g.upload(clique.stream(args.root), &t.data)?;
        inputs.push(g);
        pb.inc(t.data.len() as u64);
    }
    pb.finish_and_clear();
    let mut replicas: Vec<Vec<GpuTensor>> = (0..n)
        .map(|r| {
            tensors
                .iter()
                .map(|t| GpuTensor::alloc(clique.stream(r), t.dtype, t.len()))
                .collect()
        })
        .collect::<Result<_>>()?;
    clique.synchronize()?;

    // 4. The fused broadcast: one call for the whole model. Timed after one warm-up call.
    let fused_once = |replicas: &mut Vec<Vec<GpuTensor>>| -> Result<(f64, FusedReport)> {
        let ins: Vec<&dyn DeviceTensor> = inputs.iter().map(GpuTensor::as_dyn).collect();
        let mut outs: Vec<Vec<&mut dyn DeviceTensorMut>> = replicas
            .iter_mut()
            .map(|row| row.iter_mut().map(GpuTensor::as_dyn_mut).collect())
            .collect();
        clique.synchronize()?;
        let t0 = Instant::now();
        let report = clique
            .with(&opts)
            .broadcast_many(args.root, &ins, &mut outs)?;
        clique.synchronize()?;
        Ok((t0.elapsed().as_secs_f64(), report))
    };
    poison(&clique, &mut replicas)?;
    let (_, report) = fused_once(&mut replicas)?;
    verify(&clique, &tensors, &replicas)?;
    let mut times = Vec::new();
    for _ in 0..args.repeats.max(1) {
        times.push(fused_once(&mut replicas)?.0);
    }
    let fused = median(times);
    println!(
        "fused:      {count} tensors, {} per GPU in {:.2} ms = {:.1} GB/s (P2P: {} tensors / {} in {} launches; NCCL: {} tensors / {} in {} groups)",
        human_bytes(total),
        fused * 1e3,
        total as f64 / fused / 1e9,
        report.p2p_tensors,
        human_bytes(report.p2p_bytes as u64),
        report.p2p_launches,
        report.nccl_tensors,
        human_bytes(report.nccl_bytes as u64),
        report.nccl_groups,
    );
    println!("verified: every tensor on every one of {n} GPUs matches the host bytes");

    if args.compare {
        // One broadcast call per tensor, same path setting.
        let mut times = Vec::new();
        for rep in 0..=args.repeats.max(1) {
            clique.synchronize()?;
            let t0 = Instant::now();
            for (i, input) in inputs.iter().enumerate() {
                let mut outs: Vec<&mut GpuTensor> =
                    replicas.iter_mut().map(|row| &mut row[i]).collect();
                input.broadcast_one(&clique, args.root, &mut outs, &opts)?;
            }
            clique.synchronize()?;
            if rep > 0 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        verify(&clique, &tensors, &replicas)?;
        let per_tensor = median(times);
        println!(
            "per tensor: {count} calls in {:.2} ms = {:.1} GB/s; fused is {:.2}x faster",
            per_tensor * 1e3,
            total as f64 / per_tensor / 1e9,
            per_tensor / fused
        );
        match torch_coalesced(&args, &tensors, &clique) {
            Ok(Some(t)) => println!(
                "PyTorch broadcast_coalesced: {:.2} ms = {:.1} GB/s; fused is {:.2}x faster",
                t * 1e3,
                total as f64 / t / 1e9,
                t / fused
            ),
            Ok(None) => println!(
                "PyTorch: skipped ({} has no torch with {n} GPUs)",
                args.python
            ),
            Err(e) => println!("PyTorch: failed: {e:#}"),
        }
    }
    Ok(())
}

/// The model's tensors on the host: the `--file`, or the synthetic model (the same bytes on
/// every call). `verbose` shows progress bars and the synthetic model's shape.
fn host_tensors(args: &Args, verbose: bool) -> Result<Vec<HostTensor>> {
    let show = |len: u64, what: &str| {
        if verbose {
            bar(len, what)
        } else {
            ProgressBar::hidden()
        }
    };
    Ok(match &args.file {
        Some(file) => {
            let size = std::fs::metadata(file)
                .with_context(|| format!("cannot read {}", file.display()))?
                .len();
            let pb = show(size, "loading");
            let t = model::load_safetensors(file, Some(&pb))?;
            pb.finish_and_clear();
            t
        }
        None => {
            let dtype = DType::parse(&args.dtype)
                .with_context(|| format!("unknown --dtype {}", args.dtype))?;
            let spec = match &args.size {
                Some(s) => ModelSpec::scaled_to(
                    gpucast::parse_bytes(s).context("bad --size")? as u64,
                    dtype,
                ),
                None if dtype == DType::BF16 => ModelSpec::default_1b(),
                None => ModelSpec::scaled_to(ModelSpec::default_1b().total_bytes(), dtype),
            };
            let pb = show(spec.total_bytes(), "building");
            let t = model::synthesize(&spec, 0x5eed, Some(&pb));
            pb.finish_and_clear();
            if verbose {
                println!("synthetic model: {spec:?}");
            }
            t
        }
    })
}

/// The model's layout (names, types, lengths), to check that every rank has the same one.
fn layout(tensors: &[HostTensor]) -> String {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same digest in every process.
    let mut h = std::hash::DefaultHasher::new();
    for t in tensors {
        (&t.name, t.dtype.name(), t.len()).hash(&mut h);
    }
    let (count, total) = model::summarize(tensors);
    format!("{count} tensors, {total} bytes, layout {:016x}", h.finish())
}

/// One rank of a job (started by `--procs` or torchrun): see the module docs.
fn run_rank(args: &Args, opts: &BroadcastOptions) -> Result<()> {
    let (job, comm) = job::Job::join(Duration::from_secs(300))?;
    let (rank, world, root) = (job.rank, job.world, args.root);
    if let Some(n) = args.procs {
        ensure!(
            n == world,
            "--procs {n}, but this job has {world} ranks (WORLD_SIZE)"
        );
    }
    ensure!(root < world, "--root {root} is not a rank of {world}");
    if rank == 0 {
        if args.devices.is_some() {
            println!(
                "note: --devices is ignored with one process per GPU (rank r uses GPU LOCAL_RANK)"
            );
        }
        if args.compare {
            println!("note: --compare runs with one process only; skipped");
        }
        println!(
            "{world} ranks, one GPU each, root {root}; P2P: {:?}; communicator init {:.0} ms (rank 0)",
            comm.p2p_available(),
            comm.init_time().as_secs_f64() * 1e3
        );
    }
    comm.context().bind_to_thread()?;
    let stream = comm.stream().clone();

    // 1. The host bytes, on every rank (the root's to upload, the others' to check against).
    let tensors = job.agree(host_tensors(args, rank == root))?;
    if rank == root {
        if let Some(save) = &args.save {
            model::save_safetensors(&tensors, save)?;
            println!("saved {}", save.display());
        }
    }
    let (count, total) = model::summarize(&tensors);
    let mine = layout(&tensors);
    let layouts = job.all_gather(mine.as_bytes())?;
    for (r, l) in layouts.iter().enumerate() {
        ensure!(
            *l == layouts[root],
            "rank {r} has {}, the root {}: every rank must read the same model",
            String::from_utf8_lossy(l),
            String::from_utf8_lossy(&layouts[root])
        );
    }
    if rank == root {
        println!("{count} tensors, {}", human_bytes(total));
    }

    // 2. Every rank's tensors: the root uploads its copy, the others are poisoned.
    let mut bufs: Vec<GpuTensor> = tensors
        .iter()
        .map(|t| GpuTensor::alloc(&stream, t.dtype, t.len()))
        .collect::<Result<_>>()?;
    if rank == root {
        let pb = bar(total, "uploading");
        for (g, t) in bufs.iter_mut().zip(&tensors) {
            comm.context().bind_to_thread()?;
            g.upload(&stream, &t.data)?;
            pb.inc(t.data.len() as u64);
        }
        pb.finish_and_clear();
    } else {
        poison_on(&stream, &mut bufs)?;
    }
    comm.synchronize()?;

    // 3. One fused in-place broadcast of every tensor, checked on every rank.
    let fused = |bufs: &mut Vec<GpuTensor>| -> Result<FusedReport> {
        let list: Vec<&mut dyn DeviceTensorMut> =
            bufs.iter_mut().map(GpuTensor::as_dyn_mut).collect();
        Ok(comm.with(opts).broadcast_many_in_place(root, list)?)
    };
    let first = fused(&mut bufs).and_then(|r| {
        comm.synchronize()?;
        Ok(r)
    });
    let report = job.agree(first)?;
    comm.context().bind_to_thread()?;
    let checked = check_rank(&stream, &tensors, &bufs, rank == root);
    match &checked {
        Ok(()) => println!(
            "rank {rank} of {world} (GPU {}): all {count} tensors ({}) match the host bytes bit for bit",
            comm.device(),
            human_bytes(total)
        ),
        Err(e) => println!(
            "rank {rank} of {world} (GPU {}): MISMATCH: {e:#}",
            comm.device()
        ),
    }
    job.agree(checked)?;

    // 4. Timing: from a barrier of the store to the end of the call on the last rank.
    let mut samples = Vec::new();
    for _ in 0..args.repeats.max(1) {
        comm.synchronize()?;
        job.barrier()?;
        let t0 = Instant::now();
        fused(&mut bufs)?;
        comm.synchronize()?;
        samples.push((job.stamp(t0), job.stamp(Instant::now())));
    }
    if let Some(spans) = job.spans(&samples)? {
        let t = median(spans);
        println!(
            "fused:      {count} tensors, {} per GPU in {:.2} ms = {:.1} GB/s (P2P: {} tensors / {} in {} launches; NCCL: {} tensors / {} in {} groups)",
            human_bytes(total),
            t * 1e3,
            total as f64 / t / 1e9,
            report.p2p_tensors,
            human_bytes(report.p2p_bytes as u64),
            report.p2p_launches,
            report.nccl_tensors,
            human_bytes(report.nccl_bytes as u64),
            report.nccl_groups,
        );
        println!(
            "            one process per GPU, {world} ranks; median of {} calls, each from a barrier to the end on the last rank{}",
            samples.len(),
            if job.single_host {
                ""
            } else {
                " (several hosts: the slowest rank's own time)"
            }
        );
        println!("verified: every tensor on every one of {world} ranks matches the host bytes");
    }
    // Every rank releases its GPU first; rank 0's store must outlive the others' use of it.
    drop(bufs);
    drop(comm);
    job.barrier()?;
    Ok(())
}

/// Fills every replica with a byte pattern, so that a tensor the broadcast missed is caught.
fn poison(clique: &Clique, replicas: &mut [Vec<GpuTensor>]) -> Result<()> {
    for (rank, row) in replicas.iter_mut().enumerate() {
        let stream = clique.stream(rank);
        for t in row.iter_mut() {
            let bytes = t.as_dyn().num_bytes();
            if bytes == 0 {
                continue;
            }
            let (ptr, _g) = t.as_dyn_mut().write_ptr(stream);
            // SAFETY: `ptr` holds `bytes` bytes on this stream's device.
            unsafe { result::memset_d8_async(ptr, 0xA5, bytes, stream.cu_stream()) }?;
        }
    }
    clique.synchronize()?;
    Ok(())
}

/// Fills every tensor of `row` (on `stream`'s device) with a byte pattern.
fn poison_on(stream: &CudaStream, row: &mut [GpuTensor]) -> Result<()> {
    stream.context().bind_to_thread()?;
    for t in row.iter_mut() {
        let bytes = t.as_dyn().num_bytes();
        if bytes == 0 {
            continue;
        }
        let (ptr, _g) = t.as_dyn_mut().write_ptr(stream);
        // SAFETY: `ptr` holds `bytes` bytes on this stream's device.
        unsafe { result::memset_d8_async(ptr, 0xA5, bytes, stream.cu_stream()) }?;
    }
    stream.synchronize()?;
    Ok(())
}

/// Compares every tensor of this rank with the host bytes.
fn check_rank(
    stream: &CudaStream,
    tensors: &[HostTensor],
    row: &[GpuTensor],
    progress: bool,
) -> Result<()> {
    let total: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
    let pb = if progress {
        bar(total, "verifying")
    } else {
        ProgressBar::hidden()
    };
    for (t, g) in tensors.iter().zip(row) {
        let got = g.download(stream)?;
        if got != t.data {
            let at = got
                .iter()
                .zip(&t.data)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            bail!("tensor {} differs from the host at byte {at}", t.name);
        }
        pb.inc(got.len() as u64);
    }
    pb.finish_and_clear();
    Ok(())
}

/// Compares every tensor on every rank with the host bytes.
fn verify(clique: &Clique, tensors: &[HostTensor], replicas: &[Vec<GpuTensor>]) -> Result<()> {
    let total: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
    let pb = bar(total * replicas.len() as u64, "verifying");
    for (rank, row) in replicas.iter().enumerate() {
        for (t, g) in tensors.iter().zip(row) {
            let got = g.download(clique.stream(rank))?;
            if got != t.data {
                let at = got
                    .iter()
                    .zip(&t.data)
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                bail!(
                    "rank {rank}: tensor {} differs from the host at byte {at}",
                    t.name
                );
            }
            pb.inc(got.len() as u64);
        }
    }
    pb.finish_and_clear();
    Ok(())
}

/// Times `torch.cuda.comm.broadcast_coalesced` on the same tensors (saved to a temporary
/// safetensors file and loaded on the root GPU by the script). `None` when torch is absent.
fn torch_coalesced(args: &Args, tensors: &[HostTensor], clique: &Clique) -> Result<Option<f64>> {
    let has_torch = Command::new(&args.python)
        .args(["-c", "import torch, safetensors"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !has_torch {
        return Ok(None);
    }
    let file = match &args.file {
        Some(f) => f.clone(),
        None => {
            let f = std::env::temp_dir().join(format!(
                "gpucast-weights-{}.safetensors",
                std::process::id()
            ));
            model::save_safetensors(tensors, &f)?;
            f
        }
    };
    let devices: Vec<String> = clique.ordinals().iter().map(|o| o.to_string()).collect();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/broadcast_weights/torch_coalesced.py"
    );
    let script = if std::path::Path::new(script).exists() {
        script.to_string()
    } else {
        "examples/broadcast_weights/torch_coalesced.py".to_string()
    };
    let out = Command::new(&args.python)
        .arg(script)
        .arg(&file)
        .args(["--devices", &devices.join(",")])
        .args(["--root", &args.root.to_string()])
        .args(["--repeats", &args.repeats.max(1).to_string()])
        .output()
        .context("running torch_coalesced.py")?;
    if args.file.is_none() {
        std::fs::remove_file(&file).ok();
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "torch_coalesced.py failed: {}{}",
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("median_s "))
        .context("no median_s line from the script")?;
    Ok(Some(line.trim().parse()?))
}
