//! Helpers shared by the GPU tests: random typed data, poisoning, byte views.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use gpucast::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use gpucast::prelude::*;
use gpucast::{Clique, Element};
use rand::{Rng, RngCore, SeedableRng};
use std::sync::Arc;

/// Seeded RNG, printed so a failure can be replayed with GPUCAST_TEST_SEED.
pub fn rng() -> rand::rngs::StdRng {
    let seed = std::env::var("GPUCAST_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random::<u64>());
    eprintln!("seed {seed} (set GPUCAST_TEST_SEED to replay)");
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// `n` elements of random bits.
pub fn random_vec<T: Element>(n: usize, rng: &mut impl RngCore) -> Vec<T> {
    let mut bytes = vec![0u8; n * std::mem::size_of::<T>()];
    rng.fill_bytes(&mut bytes);
    from_bytes(&bytes)
}

/// Reinterprets bytes as elements.
pub fn from_bytes<T: Element>(bytes: &[u8]) -> Vec<T> {
    let size = std::mem::size_of::<T>();
    assert_eq!(bytes.len() % size, 0);
    let n = bytes.len() / size;
    let mut v: Vec<T> = Vec::with_capacity(n);
    // SAFETY: every Element type is plain old data with no invalid bit patterns (integers,
    // IEEE floats, f16/bf16), and `v` has capacity for `n` elements = `bytes.len()` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr() as *mut u8, bytes.len());
        v.set_len(n);
    }
    v
}

/// The bytes of a slice of elements.
pub fn as_bytes<T: Element>(v: &[T]) -> &[u8] {
    // SAFETY: Element types are plain old data; the byte view covers exactly the slice.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// One poisoned output per rank of `n` elements, allocated on the clique's streams.
pub fn poisoned_outputs<T: Element>(
    clique: &Clique,
    n: usize,
    rng: &mut impl RngCore,
) -> Vec<CudaSlice<T>> {
    (0..clique.len())
        .map(|r| {
            let poison: Vec<T> = random_vec(n, rng);
            clique.stream(r).clone_htod(&poison).expect("upload poison")
        })
        .collect()
}

/// Downloads `buf` (on `stream`'s device) and compares it bit for bit with `expected`.
pub fn assert_bytes_eq<T: Element>(
    stream: &Arc<CudaStream>,
    buf: &impl DevicePtr<T>,
    expected: &[T],
    what: &str,
) {
    let got: Vec<T> = stream.clone_dtoh(buf).expect("download");
    let (g, e) = (as_bytes(&got), as_bytes(expected));
    assert_eq!(g.len(), e.len(), "{what}: length");
    if let Some(i) = g.iter().zip(e).position(|(a, b)| a != b) {
        let bad = g.iter().zip(e).filter(|(a, b)| a != b).count();
        panic!(
            "{what}: {bad} of {} bytes differ, first at byte {i} (got {:#04x}, want {:#04x})",
            g.len(),
            g[i],
            e[i]
        );
    }
}

/// The number of visible GPUs, or a panic without a CUDA driver.
pub fn gpus() -> usize {
    gpucast::device_count().expect("a CUDA driver")
}

/// Whether fewer than `n` GPUs are visible; if so, prints that the test is skipped and `why`.
pub fn too_few_gpus(n: usize, why: &str) -> bool {
    let visible = gpus();
    if visible < n {
        eprintln!("skipped: needs {n} GPUs, {visible} visible ({why})");
    }
    visible < n
}

/// The devices of `ranks` ranks spread over the visible GPUs, starting at GPU `first`: rank
/// `r` is on GPU `(first + r) % g`, `g` the smaller of the GPU and rank counts (all on GPU 0
/// when it is alone).
pub fn spread(ranks: usize, first: usize) -> Vec<usize> {
    let g = gpus().min(ranks).max(1);
    (0..ranks).map(|r| (first + r) % g).collect()
}

/// A clique of the ranks on `devices` from `builder`, with `shared_devices` on when a device
/// holds several ranks.
pub fn clique_on(builder: gpucast::CliqueBuilder, devices: &[usize]) -> Clique {
    let shared = (1..devices.len()).any(|i| devices[..i].contains(&devices[i]));
    builder
        .devices(devices)
        .shared_devices(shared)
        .build()
        .unwrap_or_else(|e| panic!("a clique on devices {devices:?}: {e}"))
}

/// Two ranks with default settings: on GPUs 0 and 1, or both on GPU 0 when it is alone.
pub fn two_ranks() -> Clique {
    two_ranks_with(Clique::builder())
}

/// [`two_ranks`] from a builder that holds other settings (a timeout, say). Prints, once per
/// process, which devices the two ranks are on.
pub fn two_ranks_with(builder: gpucast::CliqueBuilder) -> Clique {
    static PRINTED: std::sync::Once = std::sync::Once::new();
    let devices = spread(2, 0);
    PRINTED.call_once(|| {
        if devices[0] == devices[1] {
            eprintln!("two ranks share GPU 0 (one GPU visible): NCCL is off between them");
        } else {
            eprintln!("two ranks on GPUs 0 and 1");
        }
    });
    clique_on(builder, &devices)
}

/// Whether the NCCL path runs in `clique`: every rank has a device of its own.
pub fn nccl_on(clique: &Clique) -> bool {
    let d = clique.ordinals();
    (1..d.len()).all(|i| !d[..i].contains(&d[i]))
}

/// Whether the NCCL cases run in `clique` ([`nccl_on`]). Where NCCL is off, prints so and
/// checks that a call forced onto NCCL is refused with [`Error::NcclUnavailable`].
///
/// [`Error::NcclUnavailable`]: gpucast::Error::NcclUnavailable
pub fn nccl_to_test(clique: &Clique) -> bool {
    if nccl_on(clique) {
        return true;
    }
    let input = clique.stream(0).clone_htod(&[7u8; 64]).expect("upload");
    let mut outputs = clique.alloc_outputs::<u8>(64).expect("outputs");
    let forced = gpucast::BroadcastOptions::path(gpucast::BroadcastPath::Nccl);
    match clique.with(&forced).broadcast(0, &input, &mut outputs) {
        Err(gpucast::Error::NcclUnavailable(why)) => {
            eprintln!("NCCL not tested on devices {:?}: {why}", clique.ordinals());
        }
        other => panic!("NCCL forced on devices {:?}: {other:?}", clique.ordinals()),
    }
    false
}

/// `paths` less [`BroadcastPath::Nccl`] where [`nccl_to_test`] says NCCL is off in `clique`.
///
/// [`BroadcastPath::Nccl`]: gpucast::BroadcastPath::Nccl
pub fn paths_to_test(
    clique: &Clique,
    paths: &[gpucast::BroadcastPath],
) -> Vec<gpucast::BroadcastPath> {
    let nccl = !paths.contains(&gpucast::BroadcastPath::Nccl) || nccl_to_test(clique);
    paths
        .iter()
        .copied()
        .filter(|&p| nccl || p != gpucast::BroadcastPath::Nccl)
        .collect()
}

/// Whether two ranks of `clique` share a GPU (`shared_devices`).
pub fn shares_a_gpu(clique: &Clique) -> bool {
    let ordinals: Vec<usize> = (0..clique.len())
        .map(|r| clique.context(r).ordinal())
        .collect();
    (1..ordinals.len()).any(|i| ordinals[..i].contains(&ordinals[i]))
}

/// [`paths_to_test`] for broadcasts inside a capture: also less
/// [`BroadcastPath::CopyEngine`] where ranks share a GPU, which refuses the copy engines in a
/// graph (a graph's flag wait could hold back the other rank's graph in a shared hardware
/// queue).
///
/// [`BroadcastPath::CopyEngine`]: gpucast::BroadcastPath::CopyEngine
pub fn graph_paths_to_test(
    clique: &Clique,
    paths: &[gpucast::BroadcastPath],
) -> Vec<gpucast::BroadcastPath> {
    let shared = shares_a_gpu(clique);
    if shared && paths.contains(&gpucast::BroadcastPath::CopyEngine) {
        eprintln!("copy engines not tested in graphs: ranks share a GPU");
    }
    paths_to_test(clique, paths)
        .into_iter()
        .filter(|&p| !shared || p != gpucast::BroadcastPath::CopyEngine)
        .collect()
}

unsafe extern "C" fn sleep_host(arg: *mut std::ffi::c_void) {
    std::thread::sleep(std::time::Duration::from_millis(arg as u64));
}

/// Holds `rank`'s stream on the host for `ms`, so that its next work starts late by that much.
pub fn stall(clique: &Clique, rank: usize, ms: u64) {
    stall_stream(clique.stream(rank), ms);
}

/// Holds `stream` on the host for `ms`.
pub fn stall_stream(stream: &CudaStream, ms: u64) {
    // SAFETY: the callback only sleeps (no CUDA calls) and its argument is a plain integer.
    unsafe {
        gpucast::cudarc::driver::result::stream::launch_host_function(
            stream.cu_stream(),
            sleep_host,
            ms as *mut _,
        )
    }
    .unwrap();
}

/// Holds rank `late` back `ms` on its stream, then queues a P2P broadcast of `input` from rank
/// 0 into `outputs` (a peer's wait for it runs into the timeout when `ms` is longer).
pub fn p2p_with_a_rank_held_back<T: Element>(
    clique: &Clique,
    late: usize,
    ms: u64,
    input: &CudaSlice<T>,
    outputs: &mut [CudaSlice<T>],
) {
    stall(clique, late, ms);
    let p2p = gpucast::BroadcastOptions::path(gpucast::BroadcastPath::P2p);
    clique
        .with(&p2p)
        .broadcast(0, input, outputs)
        .expect("queueing a P2P broadcast");
}

/// One list per rank of poisoned `u8` outputs of `sizes[t]` bytes, on each rank's stream.
pub fn poisoned_lists(
    clique: &Clique,
    sizes: &[usize],
    rng: &mut impl RngCore,
) -> Vec<Vec<CudaSlice<u8>>> {
    (0..clique.len())
        .map(|r| {
            sizes
                .iter()
                .map(|&n| {
                    clique
                        .stream(r)
                        .clone_htod(&random_vec::<u8>(n, rng))
                        .expect("upload poison")
                })
                .collect()
        })
        .collect()
}

/// Inputs and output lists as the trait objects a fused call takes.
pub fn as_tensors<'a, T: Element>(
    inputs: &'a [CudaSlice<T>],
    lists: &'a mut [Vec<CudaSlice<T>>],
) -> (
    Vec<&'a dyn gpucast::DeviceTensor>,
    Vec<Vec<&'a mut dyn gpucast::DeviceTensorMut>>,
) {
    let ins = inputs
        .iter()
        .map(|t| t as &dyn gpucast::DeviceTensor)
        .collect();
    let outs = lists
        .iter_mut()
        .map(|row| {
            row.iter_mut()
                .map(|t| t as &mut dyn gpucast::DeviceTensorMut)
                .collect()
        })
        .collect();
    (ins, outs)
}

/// Options that make the P2P kernel use its chain protocol at any size (on two ranks the
/// default thresholds never take it).
pub fn p2p_chain() -> gpucast::BroadcastOptions {
    gpucast::BroadcastOptions::path(gpucast::BroadcastPath::P2p)
        .packet_threshold(0)
        .p2p_chain_threshold(0)
}

/// An in-place broadcast of `n` random elements from `root` on `path` (every other rank's
/// buffer holds other random data first), checked bit for bit on every rank.
pub fn check_in_place<T: Element>(
    clique: &Clique,
    root: usize,
    n: usize,
    path: gpucast::BroadcastPath,
    rng: &mut impl RngCore,
) {
    check_in_place_with::<T>(clique, root, n, &gpucast::BroadcastOptions::path(path), rng);
}

/// [`check_in_place`] with any options.
pub fn check_in_place_with<T: Element>(
    clique: &Clique,
    root: usize,
    n: usize,
    options: &gpucast::BroadcastOptions,
    rng: &mut impl RngCore,
) {
    let data: Vec<T> = random_vec(n, rng);
    let mut bufs: Vec<CudaSlice<T>> = (0..clique.len())
        .map(|r| {
            let init = if r == root {
                data.clone()
            } else {
                random_vec(n, rng)
            };
            clique.stream(r).clone_htod(&init).expect("upload")
        })
        .collect();
    clique
        .with(options)
        .broadcast_in_place(root, &mut bufs)
        .unwrap_or_else(|e| panic!("in place n={n} root={root} {options:?}: {e}"));
    clique.synchronize().unwrap();
    for (rank, b) in bufs.iter().enumerate() {
        let what = format!(
            "in place, {} ranks, n={n} root={root} {options:?} rank {rank}",
            clique.len()
        );
        assert_bytes_eq(clique.stream(rank), b, &data, &what);
    }
}

/// Four threads, each making `calls` random P2P broadcasts on `clique` (random sizes over the
/// three protocols, random roots; one call in four a fused call of three small tensors, the
/// list kernel) with inputs and outputs made and read on the clique's streams, checked bit
/// for bit; three such runs, `seed` for each thread's choices.
pub fn broadcast_from_threads(clique: &Clique, seed: u64, calls: usize) {
    for run in 0..3u64 {
        std::thread::scope(|s| {
            for thread in 0..4u64 {
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (run << 8) ^ thread);
                    for call in 0..calls {
                        if rng.random_range(0..4) == 0 {
                            fused_from_thread(
                                clique,
                                &mut rng,
                                &format!("run {run} thread {thread} call {call}"),
                            );
                            continue;
                        }
                        let n = match rng.random_range(0..3) {
                            0 => rng.random_range(1..=64 << 10),
                            1 => rng.random_range(64 << 10..=4 << 20),
                            _ => rng.random_range(1..=16),
                        };
                        let root = rng.random_range(0..clique.len());
                        let data: Vec<u8> = random_vec(n, &mut rng);
                        let input = clique.stream(root).clone_htod(&data).unwrap();
                        let mut outputs = clique.alloc_outputs::<u8>(n).unwrap();
                        let opts = gpucast::BroadcastOptions::path(gpucast::BroadcastPath::P2p);
                        clique
                            .with(&opts)
                            .broadcast(root, &input, &mut outputs)
                            .unwrap_or_else(|e| {
                                panic!("run {run} thread {thread} call {call} ({n} B): {e}")
                            });
                        drop(input);
                        let rank = rng.random_range(0..clique.len());
                        let got = clique.stream(rank).clone_dtoh(&outputs[rank]).unwrap();
                        assert!(
                            got == data,
                            "run {run} thread {thread} call {call}: wrong data"
                        );
                    }
                });
            }
        });
        clique.synchronize().unwrap();
    }
}

/// One fused P2P call of three random small tensors from a random root, checked bit for bit.
fn fused_from_thread(clique: &Clique, rng: &mut impl RngCore, what: &str) {
    let root = rng.random_range(0..clique.len());
    let sizes: Vec<usize> = (0..3).map(|_| rng.random_range(1..=16 << 10)).collect();
    let datas: Vec<Vec<u8>> = sizes.iter().map(|&n| random_vec(n, rng)).collect();
    let inputs: Vec<CudaSlice<u8>> = datas
        .iter()
        .map(|d| clique.stream(root).clone_htod(d).unwrap())
        .collect();
    let mut lists = poisoned_lists(clique, &sizes, rng);
    {
        let (ins, mut outs) = as_tensors(&inputs, &mut lists);
        let opts = gpucast::BroadcastOptions::path(gpucast::BroadcastPath::P2p);
        clique
            .with(&opts)
            .broadcast_many(root, &ins, &mut outs)
            .unwrap_or_else(|e| panic!("{what}, fused: {e}"));
    }
    drop(inputs);
    let rank = rng.random_range(0..clique.len());
    for (t, data) in datas.iter().enumerate() {
        let got = clique.stream(rank).clone_dtoh(&lists[rank][t]).unwrap();
        assert!(got == *data, "{what}, fused tensor {t}: wrong data");
    }
}

/// Runs `f` on a thread of its own and returns what it returns, or fails the test when it has
/// not returned within `limit` (the thread is left behind: the process ends with the test).
pub fn within<T: Send + 'static>(
    limit: std::time::Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} did not return within {limit:?}"))
}
