//! One process per GPU (ignored without a GPU): each test starts this binary once per rank,
//! with the environment torchrun would set, and every rank checks its own data bit for bit.
//! All ranks draw the data from one shared seed, so each knows what the root sent. With fewer
//! GPUs than ranks, every rank runs on GPU 0: the ranks of one host with the communicator's
//! `shared_devices` (NCCL off, everything else as with a GPU each: the rendezvous, the
//! descriptor exchange, the P2P kernel over shared memory and its faults), the ranks that play
//! separate nodes as nodes of their own to NCCL.
//!
//! `cargo test --release --test procs -- --include-ignored --test-threads 1`

mod common;

use gpucast::prelude::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use gpucast::cudarc::driver::{CudaSlice, CudaStream};
use gpucast::half::bf16;
use gpucast::{BroadcastOptions, BroadcastPath, Communicator, DeviceTensorMut, Element, Error};
use rand::{Rng, SeedableRng};

const WORLD: usize = 2;

/// Starts `WORLD` ranks of `case` with torchrun's variables (plus `extra`, which may depend on
/// the rank) and waits for all of them, killing them after `limit`.
fn run_ranks(case: &str, limit: Duration, extra: impl Fn(usize) -> Vec<(String, String)>) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let seed: u64 = rand::rng().random();
    let token = gpucast::rendezvous::random_token().unwrap();
    eprintln!("case {case}: seed {seed}, store port {port}");
    let mut children: Vec<(usize, Child)> = (0..WORLD)
        .map(|rank| {
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.args(["--exact", "child", "--include-ignored", "--nocapture"])
                .env("PROCS_CASE", case)
                .env("PROCS_SEED", seed.to_string())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", WORLD.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", WORLD.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("GPUCAST_JOB_TOKEN", &token)
                .env_remove("TORCHELASTIC_USE_AGENT_STORE")
                .env("NCCL_NVLS_ENABLE", "0")
                .env("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
                .env("NVSHMEM_DISABLE_NVLS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in extra(rank) {
                cmd.env(k, v);
            }
            (rank, cmd.spawn().expect("spawn a rank"))
        })
        .collect();
    let start = Instant::now();
    let mut failed = Vec::new();
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            if let Some(status) = children[i].1.try_wait().unwrap() {
                // The victim of a kill ends by SIGKILL; any other end is judged as usual.
                let killed = std::env::var("PROCS_VICTIM").ok() == Some(children[i].0.to_string())
                    && std::os::unix::process::ExitStatusExt::signal(&status) == Some(9);
                let (rank, child) = children.remove(i);
                let out = child.wait_with_output().unwrap();
                let text = String::from_utf8_lossy(&out.stdout).into_owned()
                    + &String::from_utf8_lossy(&out.stderr);
                let summary: Vec<&str> = text
                    .lines()
                    .filter(|l| {
                        l.starts_with("RANK") || l.contains("panicked") || l.contains("Error")
                    })
                    .collect();
                eprintln!("rank {rank}: {status}\n{}", summary.join("\n"));
                if !status.success() && !killed {
                    failed.push((rank, text));
                }
            } else {
                i += 1;
            }
        }
        if start.elapsed() > limit {
            for (rank, c) in &mut children {
                let _ = c.kill();
                failed.push((*rank, "killed: no result within the limit".into()));
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some((rank, text)) = failed.first() {
        panic!("case {case}: rank {rank} failed:\n{text}");
    }
}

/// The rank side: dispatches on `PROCS_CASE` (a plain run of this test does nothing).
#[test]
#[ignore = "run by the other tests of this file, once per rank"]
fn child() {
    let Ok(case) = std::env::var("PROCS_CASE") else {
        return;
    };
    let seed: u64 = std::env::var("PROCS_SEED").unwrap().parse().unwrap();
    let mut builder = Communicator::builder();
    if shared_gpu() {
        builder = builder.shared_devices(true).device(0);
    }
    // A timeout finer than GPUCAST_TIMEOUT_MS's milliseconds.
    if let Some(us) = std::env::var("PROCS_TIMEOUT_US")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        builder = builder.timeout(Duration::from_micros(us));
    }
    let comm = builder
        .build()
        .unwrap_or_else(|e| panic!("joining the job: {e}"));
    if shared_gpu() {
        // NCCL is off: a forced NCCL call says so, and the cases below leave NCCL out.
        let mut b = comm.alloc::<u8>(16).unwrap();
        let e = comm
            .with(&BroadcastOptions::path(BroadcastPath::Nccl))
            .broadcast_in_place(0, &mut b)
            .expect_err("NCCL is off where ranks share a GPU");
        assert!(matches!(e, Error::NcclUnavailable(_)), "{e}");
    }
    println!(
        "RANK {} of {}: device {}, host {}, single host {}, P2P {:?}, init {:.0} ms",
        comm.rank(),
        comm.world_size(),
        comm.device(),
        comm.host(),
        comm.single_host(),
        comm.p2p_available().map_err(|e| e.to_string()),
        comm.init_time().as_secs_f64() * 1e3
    );
    match case.as_str() {
        "paths" => paths(&comm, seed),
        "many_small" => many_small(&comm, seed),
        "fused" => fused(&comm, seed),
        "graphs" => graphs(&comm, seed),
        "nodes" => nodes(&comm, seed),
        "faulty" => {
            faulty(comm);
            return;
        }
        "mismatch" => {
            mismatch(&comm);
            return;
        }
        "late_reader" => {
            late_reader(comm, seed);
            return;
        }
        "alternating" => alternating(&comm, seed),
        other => panic!("unknown case {other}"),
    }
    comm.synchronize().unwrap();
    println!("RANK {} done", comm.rank());
}

/// Ranks that pass different lengths to one call: every rank gets [`Error::CallMismatch`]
/// for that call (the rank that posts it second before anything is queued, the other at
/// `synchronize`), within the timeout; never a hang, never a message of the wrong size.
fn mismatch(comm: &Communicator) {
    let rank = comm.rank();
    let mut agreed = comm.alloc::<f32>(1024).unwrap();
    comm.broadcast_in_place(0, &mut agreed).unwrap();
    comm.synchronize().unwrap();
    let n = if rank == 0 { 4096 } else { 8192 };
    let mut b = comm.alloc::<f32>(n).unwrap();
    let start = Instant::now();
    let p2p = BroadcastOptions::path(BroadcastPath::P2p);
    let err = match comm.with(&p2p).broadcast_in_place(0, &mut b) {
        Err(e) => e,
        Ok(()) => comm
            .synchronize()
            .expect_err("a call that differs is an error on every rank"),
    };
    assert!(
        matches!(err, Error::CallMismatch { rank: r, .. } if r == 1 - rank),
        "{err}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    println!("RANK {rank} mismatch after {:?}: {err}", start.elapsed());
}

/// Whether this rank shares GPU 0 with the others (`PROCS_SHARED`, set where there are fewer
/// GPUs than ranks).
fn shared_gpu() -> bool {
    std::env::var_os("PROCS_SHARED").is_some()
}

/// `paths` without NCCL where it is off (ranks sharing a GPU).
fn paths_here(paths: &[BroadcastPath]) -> Vec<BroadcastPath> {
    paths
        .iter()
        .copied()
        .filter(|&p| !(shared_gpu() && p == BroadcastPath::Nccl))
        .collect()
}

/// The variables of a rank of one host: with fewer GPUs than ranks, every rank shares GPU 0.
fn host_env(rank: usize) -> Vec<(String, String)> {
    if gpus() >= WORLD {
        return Vec::new();
    }
    if rank == 0 {
        eprintln!(
            "{} GPU(s) visible: every rank on GPU 0 with shared_devices (NCCL off)",
            gpus()
        );
    }
    vec![("PROCS_SHARED".into(), "1".into())]
}

/// The same random data on every rank.
fn shared_data<T: Element>(n: usize, seed: u64) -> Vec<T> {
    random_vec(n, &mut rand::rngs::StdRng::seed_from_u64(seed))
}

fn poison<T: Element>(stream: &std::sync::Arc<CudaStream>, n: usize, rank: usize) -> CudaSlice<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xbad ^ rank as u64);
    stream.clone_htod(&random_vec::<T>(n, &mut rng)).unwrap()
}

fn one<T: Element>(
    comm: &Communicator,
    root: usize,
    n: usize,
    path: BroadcastPath,
    in_place: bool,
    seed: u64,
) {
    let s = comm.stream();
    let data: Vec<T> = shared_data(n, seed);
    let mut out = poison::<T>(s, n, comm.rank());
    let opts = BroadcastOptions::path(path);
    let what = format!(
        "rank {} {} n={n} root={root} {path:?} in_place={in_place}",
        comm.rank(),
        T::DTYPE
    );
    if in_place {
        if comm.rank() == root {
            s.memcpy_htod(&data, &mut out).unwrap();
        }
        comm.with(&opts)
            .broadcast_in_place(root, &mut out)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    } else {
        let input = (comm.rank() == root).then(|| s.clone_htod(&data).unwrap());
        comm.with(&opts)
            .broadcast(root, input.as_ref(), &mut out)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    assert_bytes_eq(s, &out, &data, &what);
}

fn paths(comm: &Communicator, seed: u64) {
    let mut k = 0u64;
    // The largest sizes are longer than the 32 MiB staging buffer: the staged pull runs in
    // chunks.
    for n in [0usize, 1, 3, 4095, 70_000, 300_001, 10 << 20] {
        for root in 0..comm.world_size() {
            for path in paths_here(&[BroadcastPath::Auto, BroadcastPath::P2p, BroadcastPath::Nccl])
            {
                for in_place in [false, true] {
                    k += 1;
                    let s = seed ^ k;
                    match k % 4 {
                        0 => one::<f32>(comm, root, n, path, in_place, s),
                        1 => one::<bf16>(comm, root, n, path, in_place, s),
                        2 => one::<u8>(comm, root, n * 4 + 1, path, in_place, s),
                        _ => one::<i64>(comm, root, n, path, in_place, s),
                    }
                }
            }
        }
    }
    // The chunked staging path on a size that is not a multiple of the chunk.
    one::<u8>(
        comm,
        1,
        (40 << 20) + 3,
        BroadcastPath::P2p,
        false,
        seed ^ 0xc0ffee,
    );
    one::<u8>(
        comm,
        0,
        (40 << 20) + 3,
        BroadcastPath::P2p,
        true,
        seed ^ 0xc0ffef,
    );
}

/// 10,000 back-to-back small broadcasts, roots and sizes varying, into a ring of outputs that is
/// checked every 500 operations.
fn many_small(comm: &Communicator, seed: u64) {
    let s = comm.stream();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    const RING: usize = 64;
    let max = 64 << 10;
    let mut ring: Vec<CudaSlice<u8>> = (0..RING).map(|_| poison(s, max, comm.rank())).collect();
    let mut expect: Vec<Option<Vec<u8>>> = vec![None; RING];
    let mut inputs: Vec<CudaSlice<u8>> = Vec::new();
    for i in 0..10_000 {
        let root = rng.random_range(0..comm.world_size());
        let len = rng.random_range(1..=max);
        let path = if rng.random_bool(0.5) {
            BroadcastPath::P2p
        } else {
            BroadcastPath::Auto
        };
        let data: Vec<u8> = random_vec(len, &mut rng);
        let slot = i % RING;
        let input = (comm.rank() == root).then(|| s.clone_htod(&data).unwrap());
        comm.with(&BroadcastOptions::path(path))
            .broadcast(root, input.as_ref(), &mut ring[slot].slice_mut(..len))
            .unwrap_or_else(|e| panic!("op {i}: {e}"));
        inputs.extend(input);
        if inputs.len() > 32 {
            inputs.clear();
        }
        expect[slot] = Some(data);
        if i % 500 == 499 {
            comm.synchronize()
                .unwrap_or_else(|e| panic!("after op {i}: {e}"));
            for (slot, e) in expect.iter().enumerate() {
                if let Some(d) = e {
                    let got: Vec<u8> = s.clone_dtoh(&ring[slot].slice(..d.len())).unwrap();
                    assert!(got == *d, "rank {} op ~{i} slot {slot}", comm.rank());
                }
            }
        }
    }
}

fn fused(comm: &Communicator, seed: u64) {
    let s = comm.stream();
    for (k, path) in paths_here(&[BroadcastPath::Auto, BroadcastPath::P2p, BroadcastPath::Nccl])
        .into_iter()
        .enumerate()
    {
        for root in 0..comm.world_size() {
            let sizes = [1usize, 0, 999, 70_000, 500_000, 17];
            let datas: Vec<Vec<u32>> = sizes
                .iter()
                .enumerate()
                .map(|(t, &n)| shared_data(n, seed ^ (k * 100 + root * 10 + t) as u64))
                .collect();
            let mut bufs: Vec<CudaSlice<u32>> = datas
                .iter()
                .map(|d| {
                    if comm.rank() == root {
                        s.clone_htod(d).unwrap()
                    } else {
                        poison(s, d.len(), comm.rank())
                    }
                })
                .collect();
            let list: Vec<&mut dyn DeviceTensorMut> = bufs
                .iter_mut()
                .map(|b| b as &mut dyn DeviceTensorMut)
                .collect();
            let report = comm
                .with(&BroadcastOptions::path(path))
                .broadcast_many_in_place(root, list)
                .unwrap();
            assert_eq!(report.tensors, sizes.len());
            for (t, d) in datas.iter().enumerate() {
                assert_bytes_eq(
                    s,
                    &bufs[t],
                    d,
                    &format!("fused {path:?} root {root} tensor {t}"),
                );
            }
        }
    }
}

/// Graph capture in each process: static buffers rewritten between replays, then a safe
/// capture whose graph borrows (is lent) its buffer.
fn graphs(comm: &Communicator, seed: u64) {
    let s = comm.stream();
    for path in paths_here(&[BroadcastPath::P2p, BroadcastPath::Nccl]) {
        for n in [1000usize, 300_000] {
            let mut buf: CudaSlice<u8> = poison(s, n, comm.rank());
            // SAFETY: `buf` outlives the graph and is only written on this rank's stream.
            let mut graph = unsafe {
                comm.capture_unchecked(|c| {
                    c.with(&BroadcastOptions::path(path))
                        .broadcast_in_place(1, &mut buf)
                })
            }
            .unwrap();
            for replay in 0..4u64 {
                let data: Vec<u8> = shared_data(n, seed ^ replay ^ (n as u64));
                if comm.rank() == 1 {
                    s.memcpy_htod(&data, &mut buf).unwrap();
                }
                graph.launch().unwrap();
                comm.synchronize().unwrap();
                assert_bytes_eq(
                    s,
                    &buf,
                    &data,
                    &format!("graph {path:?} n={n} replay {replay}"),
                );
            }
            drop(graph);
        }
    }
    let data: Vec<i32> = shared_data(5000, seed);
    let mut buf = if comm.rank() == 0 {
        s.clone_htod(&data).unwrap()
    } else {
        poison(s, 5000, comm.rank())
    };
    let mut graph = comm
        .capture(&mut buf, |c, buf| c.broadcast_in_place(0, buf))
        .unwrap();
    graph.launch().unwrap();
    graph.launch().unwrap();
    drop(graph);
    assert_bytes_eq(s, &buf, &data, "safe graph");
}

/// Each process plays its own node: NCCL over sockets, no P2P between the "nodes".
fn nodes(comm: &Communicator, seed: u64) {
    assert!(!comm.single_host(), "GPUCAST_HOST_ID differs per rank");
    assert!(matches!(
        comm.p2p_available(),
        Err(Error::P2pUnavailable(_))
    ));
    assert_eq!(
        comm.route(1024, &BroadcastOptions::default()).unwrap(),
        gpucast::Route::Nccl
    );
    let mut k = 0;
    for n in [1usize, 4097, 1 << 20] {
        for root in 0..comm.world_size() {
            k += 1;
            one::<f32>(comm, root, n, BroadcastPath::Auto, k % 2 == 0, seed ^ k);
        }
    }
    let mut b = comm.alloc::<u8>(10).unwrap();
    assert!(matches!(
        comm.with(&BroadcastOptions::path(BroadcastPath::P2p))
            .broadcast_in_place(0, &mut b),
        Err(Error::P2pUnavailable(_))
    ));
}

/// Bytes of each call of the `late_reader` case: one chunk of the root's 32 MiB staging
/// buffer, so that each call is one kernel.
const LATE_BYTES: usize = (32 << 20) - 5;

/// A late reader across processes. The root queues P2P broadcasts of three alternating
/// messages back to back (it waits for its stream every 16 calls only), so each call's copy
/// into its staging buffer follows the previous call's kernel at once; the peer waits for each
/// call and checks it. With a timeout (`PROCS_TIMEOUT_US`) short enough for the root's wait to
/// end while the peer still copies (two processes time-slice one GPU), the peer must get the
/// message bit for bit or an error, never success with another message's bytes. Each rank
/// stops at its first error (the P2P path then closes) or after `PROCS_CALLS` calls.
fn late_reader(comm: Communicator, seed: u64) {
    let me = comm.rank();
    let s = comm.stream();
    let calls: usize = std::env::var("PROCS_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let messages: Vec<Vec<u8>> = (0..3)
        .map(|k| shared_data(LATE_BYTES, seed ^ (k + 1)))
        .collect();
    let inputs: Vec<CudaSlice<u8>> = if me == 0 {
        messages.iter().map(|m| s.clone_htod(m).unwrap()).collect()
    } else {
        Vec::new()
    };
    let mut out = poison::<u8>(s, LATE_BYTES, me);
    let p2p = BroadcastOptions::path(BroadcastPath::P2p);
    let mut checked = 0;
    let mut first_error = None;
    for i in 0..calls {
        let r = if me == 0 {
            comm.with(&p2p)
                .broadcast(0, Some(&inputs[i % 3]), &mut out)
                .and_then(|()| {
                    if i % 16 == 15 {
                        comm.synchronize()
                    } else {
                        Ok(())
                    }
                })
        } else {
            s.memset_zeros(&mut out).unwrap();
            comm.with(&p2p)
                .broadcast(0, None::<&CudaSlice<u8>>, &mut out)
                .and_then(|()| comm.synchronize())
        };
        if let Err(e) = r {
            first_error = Some(format!("call {i}: {e}"));
            break;
        }
        if me != 0 {
            let got: Vec<u8> = s.clone_dtoh(&out).unwrap();
            let differ = got
                .iter()
                .zip(&messages[i % 3])
                .filter(|(a, b)| a != b)
                .count();
            assert_eq!(
                differ, 0,
                "rank {me} call {i}: success with {differ} of {LATE_BYTES} bytes wrong"
            );
            checked += 1;
        }
    }
    if first_error.is_none() {
        if let Err(e) = comm.synchronize() {
            first_error = Some(format!("at the end: {e}"));
        }
    }
    println!(
        "RANK {me} late_reader: {checked} calls checked bit for bit, first error: {first_error:?}"
    );
    drop(out);
    drop(inputs);
    drop(comm);
}

/// Back-to-back small broadcasts from rank 0, as a benchmark makes them: for 1 KiB then 8 KiB,
/// `Auto` then forced P2P, 500 warm-up calls and a loop of 2000, each ended by a synchronize;
/// `PROCS_ROUNDS` times (default 4: 40,000 calls, past 2^15 packet ops on block 0). Every call
/// must succeed and the last of each loop deliver the root's data. Prints the time per call.
fn alternating(comm: &Communicator, seed: u64) {
    let me = comm.rank();
    let s = comm.stream();
    let rounds: u64 = std::env::var("PROCS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let mut total = 0u64;
    for round in 0..rounds {
        for n in [1usize << 10, 8 << 10] {
            for path in [BroadcastPath::Auto, BroadcastPath::P2p] {
                let data: Vec<u8> = shared_data(n, seed ^ total);
                let input = (me == 0).then(|| s.clone_htod(&data).unwrap());
                let mut out = poison::<u8>(s, n, me);
                let opts = BroadcastOptions::path(path);
                for (phase, calls) in [("warm-up", 500), ("loop", 2000)] {
                    let t0 = Instant::now();
                    for _ in 0..calls {
                        comm.with(&opts)
                            .broadcast(0, input.as_ref(), &mut out)
                            .unwrap_or_else(|e| {
                                panic!("rank {me} call {total} ({n} B, {path:?}): {e}")
                            });
                        total += 1;
                    }
                    comm.synchronize().unwrap_or_else(|e| {
                        panic!("rank {me} after call {total} ({n} B, {path:?} {phase}): {e}")
                    });
                    println!(
                        "RANK {me} round {round} {n} B {path:?} {phase}: {:.1} us per call, \
                         {total} calls so far",
                        t0.elapsed().as_secs_f64() * 1e6 / calls as f64
                    );
                }
                assert_bytes_eq(
                    s,
                    &out,
                    &data,
                    &format!("rank {me} round {round} {n} B {path:?}"),
                );
            }
        }
    }
}

/// Why NCCL between two processes of one host needs two GPUs.
const ONE_GPU_PER_PROCESS: &str =
    "two processes of one host on one GPU cannot form an NCCL communicator";

/// Timeout of the fault cases.
const FAULT_TIMEOUT_MS: u64 = 300;

/// The victim (`PROCS_VICTIM`) broadcasts 50 times, then (`PROCS_FAULT`) kills itself with
/// SIGKILL, or stops calling for three timeouts and goes on. Every rank still running goes on
/// until a call fails, checks the error's type and that it came within the timeout plus 100
/// ms of the call, and that dropping the communicator returns.
fn faulty(comm: Communicator) {
    let victim: usize = std::env::var("PROCS_VICTIM").unwrap().parse().unwrap();
    let path = BroadcastPath::parse(&std::env::var("PROCS_PATH").unwrap()).unwrap();
    let fault = std::env::var("PROCS_FAULT").unwrap();
    let me = comm.rank();
    let mut buf = comm.alloc::<u8>(4096).unwrap();
    let opts = BroadcastOptions::path(path);
    for i in 0..100_000 {
        if me == victim && i == 50 {
            if fault == "kill" {
                println!("RANK {me} killing itself");
                let _ = Command::new("kill")
                    .args(["-9", &std::process::id().to_string()])
                    .status();
                std::thread::sleep(Duration::from_secs(60));
            } else {
                println!("RANK {me} stalling");
                std::thread::sleep(Duration::from_millis(3 * FAULT_TIMEOUT_MS));
            }
        }
        let t0 = Instant::now();
        let r = comm
            .with(&opts)
            .broadcast_in_place(i % 2, &mut buf)
            .and_then(|()| comm.synchronize());
        if let Err(e) = r {
            let took = t0.elapsed();
            println!(
                "RANK {me} detected after {:.1} ms: {e}",
                took.as_secs_f64() * 1e3
            );
            // A rank resuming after a stall finds its peer gone: NCCL may report the closed
            // connection itself while the call is queued.
            let resumed = me == victim;
            match path {
                BroadcastPath::P2p => assert!(matches!(e, Error::Timeout { .. }), "{e}"),
                _ if resumed => assert!(
                    matches!(
                        e,
                        Error::CommunicatorsAborted { .. }
                            | Error::Nccl { .. }
                            | Error::NcclTimeout { .. }
                    ),
                    "{e}"
                ),
                _ => assert!(matches!(e, Error::CommunicatorsAborted { .. }), "{e}"),
            }
            let bound = if resumed { 1000 } else { 100 };
            assert!(
                took <= Duration::from_millis(FAULT_TIMEOUT_MS + bound),
                "detected after {took:?}"
            );
            if path == BroadcastPath::P2p {
                // The next call closes the P2P path of this communicator (across processes
                // the signal areas cannot be reset together): it is then no longer available
                // and Auto stops choosing it.
                let _ = comm.synchronize();
                assert!(
                    comm.p2p_available().is_err(),
                    "P2P still reported available"
                );
                let route = comm.route(1024, &BroadcastOptions::default()).unwrap();
                assert_eq!(route, gpucast::Route::Nccl, "Auto after P2P closed");
            }
            let t1 = Instant::now();
            drop(buf);
            drop(comm);
            let dropped = t1.elapsed();
            println!("RANK {me} dropped the communicator in {dropped:?}");
            assert!(dropped < Duration::from_millis(FAULT_TIMEOUT_MS + 3000));
            return;
        }
        assert!(i < 90_000, "the fault was never noticed");
    }
}

/// Runs the `faulty` case for every path, fault and victim, `GPUCAST_FAULT_ROUNDS` times
/// (default 1); `extra` adds variables per rank. A hang fails the run (`run_ranks` kills ranks
/// still running after a minute).
fn faults(paths: &[&str], extra: impl Fn(usize) -> Vec<(String, String)>) {
    let rounds: usize = std::env::var("GPUCAST_FAULT_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut injected = 0;
    for _ in 0..rounds {
        for path in paths {
            for fault in ["kill", "stall"] {
                for victim in [1usize, 0] {
                    std::env::set_var("PROCS_VICTIM", victim.to_string());
                    run_ranks("faulty", Duration::from_secs(60), |rank| {
                        let mut vars = vec![
                            ("PROCS_PATH".to_string(), path.to_string()),
                            ("PROCS_VICTIM".to_string(), victim.to_string()),
                            ("PROCS_FAULT".to_string(), fault.to_string()),
                            (
                                "GPUCAST_TIMEOUT_MS".to_string(),
                                FAULT_TIMEOUT_MS.to_string(),
                            ),
                        ];
                        vars.extend(extra(rank));
                        vars
                    });
                    injected += 1;
                }
            }
        }
    }
    std::env::remove_var("PROCS_VICTIM");
    println!("faults injected {injected}, every one detected in time, hangs 0");
}

/// A rank killed with SIGKILL, or stalled on the host, in the middle of a run, on each path:
/// every rank still running gets its error within the timeout plus 100 ms, and nothing hangs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_killed_or_stalled_rank_is_detected_on_every_path() {
    if gpus() >= WORLD {
        faults(&["nccl", "p2p"], host_env);
    } else {
        eprintln!("NCCL between processes left out: {ONE_GPU_PER_PROCESS}");
        faults(&["p2p"], host_env);
    }
}

/// The same across "nodes" (NCCL over sockets on loopback, as between hosts). Both ranks may
/// share one GPU here, since NCCL sees two hosts: this runs on a single GPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_killed_or_stalled_rank_is_detected_across_nodes() {
    let gpus = gpus();
    faults(&["nccl"], |rank| nodes_env_on(rank, gpus));
}

/// The rendezvous host (rank 0) is not there: rank 1 gets an error, no hang.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_rendezvous_host_missing_is_an_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t0 = Instant::now();
    let r = gpucast::Communicator::builder()
        .job(
            gpucast::rendezvous::JobEnv::from_lookup(|k| match k {
                "RANK" => Some("1".into()),
                "LOCAL_RANK" => Some("0".into()),
                "WORLD_SIZE" | "LOCAL_WORLD_SIZE" => Some("2".into()),
                "MASTER_ADDR" => Some("127.0.0.1".into()),
                "MASTER_PORT" => Some(port.to_string()),
                _ => None,
            })
            .unwrap(),
        )
        .init_timeout(Duration::from_secs(3))
        .build();
    let e = r.err().expect("no rank 0");
    assert!(matches!(e, Error::Rendezvous(_)), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ranks_that_disagree_on_a_call_all_get_a_mismatch_error() {
    run_ranks("mismatch", Duration::from_secs(120), |rank| {
        let mut vars = host_env(rank);
        vars.push(("GPUCAST_TIMEOUT_MS".into(), "2000".into()));
        vars
    });
}

/// Two processes on GPU 0 (or a GPU each), a timeout of 500 us and messages of one staging
/// chunk: a peer never reports success with bytes of another call (see `late_reader`).
/// `PROCS_LATE_ROUNDS` pairs of processes (default 3).
#[test]
#[ignore = "needs a CUDA GPU"]
fn two_processes_a_late_reader_never_succeeds_with_wrong_data() {
    let rounds: usize = std::env::var("PROCS_LATE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    for _ in 0..rounds {
        run_ranks("late_reader", Duration::from_secs(120), |rank| {
            let mut vars = host_env(rank);
            vars.push(("PROCS_TIMEOUT_US".into(), "500".into()));
            vars
        });
    }
}

/// Two processes sharing GPU 0 (or a GPU each) alternate 1 KiB and 8 KiB broadcasts, `Auto`
/// and P2P, 40,000 calls with the default timeout: every call succeeds (see `alternating`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn two_processes_alternate_small_sizes_forty_thousand_times() {
    run_ranks("alternating", Duration::from_secs(420), host_env);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_processes_every_path_type_root_and_size() {
    run_ranks("paths", Duration::from_secs(240), host_env);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_processes_ten_thousand_small_broadcasts() {
    run_ranks("many_small", Duration::from_secs(240), host_env);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_processes_fused() {
    run_ranks("fused", Duration::from_secs(120), host_env);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_processes_graph_capture() {
    run_ranks("graphs", Duration::from_secs(120), host_env);
}

/// "Two nodes on one host": NCCL is told each process is its own host and uses sockets over
/// loopback; gpucast's host id is overridden, so no P2P between the "nodes". Both ranks may
/// share one GPU here, since NCCL sees two hosts: this runs on a single GPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn two_nodes_on_one_host() {
    let gpus = gpus();
    run_ranks("nodes", Duration::from_secs(180), |rank| {
        nodes_env_on(rank, gpus)
    });
}

/// The variables that make rank `rank` a node of its own to NCCL and to gpucast.
fn nodes_env(rank: usize) -> Vec<(String, String)> {
    [
        ("NCCL_HOSTID", format!("node-{rank}")),
        ("GPUCAST_HOST_ID", format!("node-{rank}")),
        ("NCCL_P2P_DISABLE", "1".into()),
        ("NCCL_SHM_DISABLE", "1".into()),
        ("NCCL_NET", "Socket".into()),
        ("NCCL_SOCKET_IFNAME", "lo".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// [`nodes_env`] on `gpus` visible GPUs: with fewer than `WORLD`, every rank is the only local
/// rank of its node, on GPU 0.
fn nodes_env_on(rank: usize, gpus: usize) -> Vec<(String, String)> {
    let mut vars = nodes_env(rank);
    if gpus < WORLD {
        if rank == 0 {
            eprintln!("{gpus} GPU(s) visible: every rank on GPU 0, each a node of its own");
        }
        vars.push(("LOCAL_RANK".into(), "0".into()));
        vars.push(("LOCAL_WORLD_SIZE".into(), "1".into()));
        vars.push(("GROUP_RANK".into(), rank.to_string()));
    }
    vars
}
