//! GPU tests: two ranks on GPUs 0 and 1 with peer access, or both on GPU 0 when it is alone
//! (`shared_devices`: no NCCL between them, so the NCCL cases are left out there, and the checks
//! that need two devices are skipped with a printed reason). Ignored by a plain `cargo test`;
//! run them with `cargo test --release --test gpu -- --include-ignored --test-threads 1`.
//!
//! Every test uses random inputs, poisons outputs before each call and compares bit for bit.

#![allow(
    clippy::needless_range_loop,
    reason = "ranks index several parallel arrays"
)]

mod common;

use gpucast::prelude::*;
use std::time::Duration;

use common::*;
use gpucast::cudarc::driver::{result, CudaSlice, DevicePtrMut};
use gpucast::half::{bf16, f16};
use gpucast::{BroadcastOptions, BroadcastPath, Clique, Element, Error, Route};
use rand::{Rng, RngCore};

const PATHS: [BroadcastPath; 4] = [
    BroadcastPath::Nccl,
    BroadcastPath::P2p,
    BroadcastPath::CopyEngine,
    BroadcastPath::Auto,
];

/// Runs `$f::<T>(args)` for each of the ten element types.
macro_rules! for_each_type {
    ($f:ident($($arg:expr),*)) => {
        $f::<f32>($($arg),*);
        $f::<f64>($($arg),*);
        $f::<f16>($($arg),*);
        $f::<bf16>($($arg),*);
        $f::<i8>($($arg),*);
        $f::<u8>($($arg),*);
        $f::<i32>($($arg),*);
        $f::<u32>($($arg),*);
        $f::<i64>($($arg),*);
        $f::<u64>($($arg),*);
    };
}

fn check_broadcast<T: Element>(
    clique: &Clique,
    root: usize,
    n: usize,
    path: BroadcastPath,
    rng: &mut impl RngCore,
) {
    let data: Vec<T> = random_vec(n, rng);
    let input = clique.stream(root).clone_htod(&data).unwrap();
    let mut outputs = poisoned_outputs::<T>(clique, n, rng);
    clique
        .with(&BroadcastOptions::path(path))
        .broadcast(root, &input, &mut outputs)
        .unwrap_or_else(|e| panic!("{} n={n} root={root} {path:?}: {e}", T::DTYPE));
    clique.synchronize().unwrap();
    for (rank, out) in outputs.iter().enumerate() {
        let what = format!("{} n={n} root={root} {path:?} rank {rank}", T::DTYPE);
        assert_bytes_eq(clique.stream(rank), out, &data, &what);
    }
    // The input is untouched.
    assert_bytes_eq(clique.stream(root), &input, &data, "input after broadcast");
}

fn every_root_length_path<T: Element>(
    clique: &Clique,
    paths: &[BroadcastPath],
    rng: &mut impl RngCore,
) {
    for root in 0..clique.len() {
        for n in [0usize, 1, 3, 4095, (1 << 20) + 7] {
            for &path in paths {
                check_broadcast::<T>(clique, root, n, path, rng);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_type_root_length_and_path() {
    let clique = two_ranks();
    let paths = paths_to_test(&clique, &PATHS);
    let mut rng = rng();
    for_each_type!(every_root_length_path(&clique, &paths, &mut rng));
}

/// 256 MiB per type, every root and path. Outputs are poisoned on the device with a random byte.
fn large<T: Element>(clique: &Clique, paths: &[BroadcastPath], rng: &mut impl RngCore) {
    let n = (256usize << 20) / std::mem::size_of::<T>();
    let data: Vec<T> = random_vec(n, rng);
    for root in 0..clique.len() {
        let input = clique.stream(root).clone_htod(&data).unwrap();
        for &path in paths {
            let mut outputs: Vec<CudaSlice<T>> = (0..clique.len())
                // SAFETY: poisoned right below before any read.
                .map(|r| unsafe { clique.stream(r).alloc::<T>(n) }.unwrap())
                .collect();
            for (r, out) in outputs.iter_mut().enumerate() {
                let s = clique.stream(r);
                let (ptr, _g) = out.device_ptr_mut(s);
                // SAFETY: `ptr` is a live allocation of n elements on this stream's device.
                unsafe {
                    result::memset_d8_async(ptr, rng.random(), n * size_of::<T>(), s.cu_stream())
                }
                .unwrap();
            }
            clique
                .with(&BroadcastOptions::path(path))
                .broadcast(root, &input, &mut outputs)
                .unwrap();
            clique.synchronize().unwrap();
            for (rank, out) in outputs.iter().enumerate() {
                let what = format!("{} 256MiB root={root} {path:?} rank {rank}", T::DTYPE);
                assert_bytes_eq(clique.stream(rank), out, &data, &what);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_type_256_mib() {
    let clique = two_ranks();
    let paths = paths_to_test(&clique, &PATHS);
    let mut rng = rng();
    for_each_type!(large(&clique, &paths, &mut rng));
}

/// Views at every small offset: the P2P kernels must handle any alignment of source and
/// destination, and write nothing outside the view.
#[test]
#[ignore = "needs a CUDA GPU"]
fn views_at_any_alignment_write_exactly_their_bytes() {
    let clique = two_ranks();
    let mut rng = rng();
    let offsets = [0usize, 1, 2, 3, 5, 8, 13, 16];
    // The P2P kernel's chain, which two ranks take only when told (pieces of 32 KiB and up).
    let chain = p2p_chain();
    let options: Vec<BroadcastOptions> = paths_to_test(
        &clique,
        &[
            BroadcastPath::P2p,
            BroadcastPath::Nccl,
            BroadcastPath::CopyEngine,
        ],
    )
    .into_iter()
    .map(BroadcastOptions::path)
    .collect();
    for len in [1usize, 17, 1000, 70_000, 300_000, (3 << 20) + 5] {
        for (i, &src_off) in offsets.iter().enumerate() {
            let dst_off = offsets[(i * 3 + len) % offsets.len()];
            for opts in options.iter().chain([&chain]) {
                let path = if opts == &chain {
                    "P2P chain".to_string()
                } else {
                    format!("{:?}", opts.path.unwrap())
                };
                let total = len + 32;
                let src_all: Vec<u8> = random_vec(total, &mut rng);
                let input = clique.stream(0).clone_htod(&src_all).unwrap();
                let guards: Vec<Vec<u8>> = (0..2).map(|_| random_vec(total, &mut rng)).collect();
                let mut outs: Vec<CudaSlice<u8>> = (0..2)
                    .map(|r| clique.stream(r).clone_htod(&guards[r]).unwrap())
                    .collect();
                {
                    let view = input.slice(src_off..src_off + len);
                    let mut views: Vec<_> = outs
                        .iter_mut()
                        .map(|o| o.slice_mut(dst_off..dst_off + len))
                        .collect();
                    clique.with(opts).broadcast(0, &view, &mut views).unwrap();
                }
                clique.synchronize().unwrap();
                for (rank, out) in outs.iter().enumerate() {
                    let mut want = guards[rank].clone();
                    want[dst_off..dst_off + len].copy_from_slice(&src_all[src_off..src_off + len]);
                    let what = format!("len={len} src+{src_off} dst+{dst_off} {path} rank {rank}");
                    assert_bytes_eq(clique.stream(rank), out, &want, &what);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn in_place_every_root_and_path() {
    let clique = two_ranks();
    let paths = paths_to_test(&clique, &PATHS);
    let mut rng = rng();
    for n in [1usize, 4095, 40_000, (1 << 20) + 7] {
        for root in 0..2 {
            for &path in &paths {
                check_in_place::<bf16>(&clique, root, n, path, &mut rng);
            }
        }
    }
}

#[test]
#[ignore = "needs 1 CUDA GPU"]
fn single_gpu_clique() {
    let clique = Clique::new(&[0]).unwrap();
    let mut rng = rng();
    for n in [1usize, 4095, (1 << 20) + 7] {
        for path in PATHS {
            check_broadcast::<f32>(&clique, 0, n, path, &mut rng);
        }
    }
}

/// 1,000 back-to-back broadcasts with alternating roots into distinct outputs, checked at the end.
#[test]
#[ignore = "needs a CUDA GPU"]
fn thousand_back_to_back_alternating_roots() {
    let clique = two_ranks();
    let mut rng = rng();
    let n = 1024;
    let ops = 1000;
    let data: Vec<Vec<u32>> = (0..ops).map(|_| random_vec(n, &mut rng)).collect();
    let inputs: Vec<CudaSlice<u32>> = data
        .iter()
        .enumerate()
        .map(|(i, d)| clique.stream(i % 2).clone_htod(d).unwrap())
        .collect();
    let mut outputs: Vec<Vec<CudaSlice<u32>>> = (0..ops)
        .map(|_| poisoned_outputs(&clique, n, &mut rng))
        .collect();
    clique.synchronize().unwrap();
    assert!(
        clique.parallel_launch().unwrap(),
        "two ranks launch from worker threads by default"
    );
    for i in 0..ops {
        // The second half launches from this thread alone: both launch modes interleave.
        clique.set_parallel_launch(i < ops / 2).unwrap();
        clique
            .broadcast(i % 2, &inputs[i], &mut outputs[i])
            .unwrap();
    }
    clique.set_parallel_launch(true).unwrap();
    clique.synchronize().unwrap();
    for i in 0..ops {
        for rank in 0..2 {
            assert_bytes_eq(
                clique.stream(rank),
                &outputs[i][rank],
                &data[i],
                &format!("op {i} rank {rank}"),
            );
        }
    }
}

/// 100,000 back-to-back small broadcasts, alternating roots, sizes (so grids differ from op to
/// op) and paths, checked at random points and at the end. A stale or torn packet, or a counter
/// that drifts between GPUs, shows up as wrong data or a timeout.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hundred_thousand_mixed_small_broadcasts() {
    let clique = two_ranks_with(Clique::builder().timeout(Duration::from_secs(5)));
    // Where NCCL is off, the calls that would be forced onto it take `Auto` instead.
    let nccl = nccl_to_test(&clique);
    let mut rng = rng();
    const K: usize = 16; // distinct inputs per root
    const R: usize = 32; // output ring
    let max = 320 << 10; // bytes; above the packet limit, so pull runs too
    let data: Vec<Vec<Vec<u8>>> = (0..2)
        .map(|_| (0..K).map(|_| random_vec(max, &mut rng)).collect())
        .collect();
    let inputs: Vec<Vec<CudaSlice<u8>>> = (0..2)
        .map(|r| {
            data[r]
                .iter()
                .map(|d| clique.stream(r).clone_htod(d).unwrap())
                .collect()
        })
        .collect();
    let mut ring: Vec<Vec<CudaSlice<u8>>> = (0..R)
        .map(|_| poisoned_outputs(&clique, max, &mut rng))
        .collect();
    // What each ring slot should hold: (root, input index, length).
    let mut expect: Vec<Option<(usize, usize, usize)>> = vec![None; R];
    let sizes = [
        1usize, 7, 16, 100, 1000, 4096, 8191, 65536, 65537, 100_000, 262_145, max,
    ];
    let ops = 100_000;
    let mut routes = [0usize; 4];
    let check =
        |ring: &Vec<Vec<CudaSlice<u8>>>, expect: &Vec<Option<(usize, usize, usize)>>, at: usize| {
            clique
                .synchronize()
                .unwrap_or_else(|e| panic!("after op {at}: {e}"));
            for (slot, e) in expect.iter().enumerate() {
                if let Some((root, k, len)) = *e {
                    for rank in 0..2 {
                        let got: Vec<u8> = clique
                            .stream(rank)
                            .clone_dtoh(&ring[slot][rank].slice(..len))
                            .unwrap();
                        assert!(
                        got == data[root][k][..len],
                        "op ~{at}, slot {slot}, rank {rank}, root {root}, len {len}: wrong data"
                    );
                    }
                }
            }
        };
    for i in 0..ops {
        let root = if rng.random_bool(0.5) { 0 } else { 1 };
        let k = rng.random_range(0..K);
        let len = sizes[rng.random_range(0..sizes.len())];
        let path = match rng.random_range(0..20) {
            0 if nccl => BroadcastPath::Nccl,
            0..=9 => BroadcastPath::Auto,
            _ => BroadcastPath::P2p,
        };
        let slot = i % R;
        let opts = BroadcastOptions::path(path);
        let route = clique.route(len, &opts).unwrap();
        routes[match route {
            Route::Nccl => 0,
            Route::P2pPacket => 1,
            Route::P2pPull => 2,
            _ => 3,
        }] += 1;
        let input = inputs[root][k].slice(..len);
        let mut outs: Vec<_> = ring[slot].iter_mut().map(|o| o.slice_mut(..len)).collect();
        clique
            .with(&opts)
            .broadcast(root, &input, &mut outs)
            .unwrap();
        drop(outs);
        expect[slot] = Some((root, k, len));
        if rng.random_range(0..5000) == 0 {
            check(&ring, &expect, i);
        }
    }
    check(&ring, &expect, ops);
    eprintln!(
        "routes: nccl {} packet {} pull {}",
        routes[0], routes[1], routes[2]
    );
    assert!(
        routes[1] > 0 && routes[2] > 0,
        "both P2P routes ran: {routes:?}"
    );
    if nccl {
        assert!(routes[0] > 0, "NCCL ran: {routes:?}");
    } else {
        assert_eq!(routes[0], 0, "Auto takes NCCL where it is off: {routes:?}");
    }
}

/// A captured sequence (both roots, packet, pull and NCCL) replayed several times; the inputs
/// change between replays, so a replay that reused stale data or stale counters would fail.
/// The buffers are rewritten between replays, which the unchecked capture allows (its contract:
/// they live on and are written on the clique's streams).
#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_capture_replays_correctly() {
    let clique = two_ranks();
    let mut rng = rng();
    let mut cases = vec![
        (0usize, 1000usize, BroadcastPath::P2p),
        (1, 50_000, BroadcastPath::P2p),
        (0, 300_000, BroadcastPath::P2p),
        (1, 4096, BroadcastPath::Nccl),
        (1, 7, BroadcastPath::Auto),
        (0, 5_000_001, BroadcastPath::CopyEngine),
        (1, 3, BroadcastPath::CopyEngine),
    ];
    let paths = graph_paths_to_test(
        &clique,
        &[
            BroadcastPath::P2p,
            BroadcastPath::Nccl,
            BroadcastPath::Auto,
            BroadcastPath::CopyEngine,
        ],
    );
    cases.retain(|case| paths.contains(&case.2));
    let mut inputs: Vec<CudaSlice<u8>> = cases
        .iter()
        .map(|&(r, n, _)| clique.stream(r).clone_htod(&vec![0u8; n]).unwrap())
        .collect();
    let mut outputs: Vec<Vec<CudaSlice<u8>>> = cases
        .iter()
        .map(|&(_, n, _)| poisoned_outputs(&clique, n, &mut rng))
        .collect();
    clique.synchronize().unwrap();
    // SAFETY: the buffers outlive the graph (dropped after it, below) and are only written on
    // the clique's streams, in order with the replays.
    let mut graph = unsafe {
        clique.capture_unchecked(|c| {
            for ((input, outs), &(root, _, path)) in
                inputs.iter().zip(outputs.iter_mut()).zip(&cases)
            {
                c.with(&BroadcastOptions::path(path))
                    .broadcast(root, input, outs)?;
            }
            Ok(())
        })
    }
    .unwrap();
    for replay in 0..5 {
        let datas: Vec<Vec<u8>> = cases
            .iter()
            .map(|&(_, n, _)| random_vec(n, &mut rng))
            .collect();
        for (i, &(root, _, _)) in cases.iter().enumerate() {
            clique
                .stream(root)
                .memcpy_htod(&datas[i], &mut inputs[i])
                .unwrap();
        }
        clique.synchronize().unwrap();
        graph.launch().unwrap();
        clique.synchronize().unwrap();
        for (i, &(root, n, path)) in cases.iter().enumerate() {
            for rank in 0..2 {
                assert_bytes_eq(
                    clique.stream(rank),
                    &outputs[i][rank],
                    &datas[i],
                    &format!("replay {replay} case {i} (root {root}, {n} B, {path:?}) rank {rank}"),
                );
            }
        }
    }
    drop(graph);
    // Eager calls after the graph still line up with the device counters.
    check_broadcast::<u8>(&clique, 1, 3000, BroadcastPath::P2p, &mut rng);
    check_broadcast::<u8>(&clique, 0, 200_000, BroadcastPath::P2p, &mut rng);
}

/// The safe capture: the graph owns its buffers; replays interleave with eager calls, and
/// the outputs are right once the graph hands them back.
#[test]
#[ignore = "needs a CUDA GPU"]
fn safe_graph_with_mixed_paths_and_fused_lists() {
    use gpucast::{DeviceTensor, DeviceTensorMut};
    let clique = two_ranks();
    // The single broadcast goes through NCCL, or the copy engines where NCCL is off, or P2P
    // where ranks share a GPU (no copy engines in a graph there).
    let single_path = if nccl_to_test(&clique) {
        BroadcastPath::Nccl
    } else if shares_a_gpu(&clique) {
        BroadcastPath::P2p
    } else {
        BroadcastPath::CopyEngine
    };
    let mut rng = rng();
    let sizes = [3usize, 5000, 300_000];
    let datas: Vec<Vec<u8>> = sizes.iter().map(|&n| random_vec(n, &mut rng)).collect();
    let inputs: Vec<CudaSlice<u8>> = datas
        .iter()
        .map(|d| clique.stream(1).clone_htod(d).unwrap())
        .collect();
    let single = poisoned_outputs::<u8>(&clique, sizes[2], &mut rng);
    let lists = poisoned_lists(&clique, &sizes, &mut rng);
    let buffers = (inputs, single, lists);
    let mut graph = clique
        .capture(buffers, |c, (inputs, single, lists)| {
            c.with(&BroadcastOptions::path(single_path))
                .broadcast(1, &inputs[2], single)?;
            let ins: Vec<&dyn DeviceTensor> =
                inputs.iter().map(|t| t as &dyn DeviceTensor).collect();
            let mut outs: Vec<Vec<&mut dyn DeviceTensorMut>> = lists
                .iter_mut()
                .map(|row| {
                    row.iter_mut()
                        .map(|t| t as &mut dyn DeviceTensorMut)
                        .collect()
                })
                .collect();
            let report = c
                .with(&BroadcastOptions::path(BroadcastPath::P2p))
                .broadcast_many(1, &ins, &mut outs)?;
            assert_eq!((report.p2p_tensors, report.p2p_launches), (3, 1));
            Ok(())
        })
        .unwrap();
    for _ in 0..3 {
        graph.launch().unwrap();
        check_broadcast::<u32>(&clique, 0, 4096, BroadcastPath::P2p, &mut rng);
    }
    let (_inputs, single, lists) = graph.into_buffers();
    clique.synchronize().unwrap();
    for rank in 0..2 {
        assert_bytes_eq(clique.stream(rank), &single[rank], &datas[2], "single");
        for (t, d) in datas.iter().enumerate() {
            assert_bytes_eq(
                clique.stream(rank),
                &lists[rank][t],
                d,
                &format!("list {t}"),
            );
        }
    }
}

/// A peer that never shows up within the timeout gives `Error::Timeout` (not a hang), and the
/// clique recovers: the next broadcasts are correct.
#[test]
#[ignore = "needs a CUDA GPU"]
fn timeouts_are_reported_and_the_clique_recovers() {
    let clique = two_ranks_with(Clique::builder().timeout(Duration::from_millis(300)));
    let paths = paths_to_test(&clique, &[BroadcastPath::P2p, BroadcastPath::Nccl]);
    let mut rng = rng();
    // (bytes, which rank stalls): pull with a late peer makes the root time out waiting for
    // "done"; packets with a late root make the peer time out waiting for data.
    for (n, late, phase) in [
        (400_000usize, 1usize, "finish reading"),
        (2048, 0, "packets"),
    ] {
        let data: Vec<u8> = random_vec(n, &mut rng);
        let input = clique.stream(0).clone_htod(&data).unwrap();
        let mut outputs = poisoned_outputs::<u8>(&clique, n, &mut rng);
        clique.synchronize().unwrap();
        p2p_with_a_rank_held_back(&clique, late, 1500, &input, &mut outputs);
        let started = std::time::Instant::now();
        match clique.synchronize() {
            Err(Error::Timeout { phase: p, .. }) => assert!(p.contains(phase), "phase {p:?}"),
            other => panic!("expected a timeout ({phase}), got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(10));
        for &path in &paths {
            for m in [100usize, 5000, 200_000] {
                check_broadcast::<u8>(&clique, 1, m, path, &mut rng);
                check_broadcast::<u8>(&clique, 0, m, path, &mut rng);
            }
        }
    }
}

/// Inputs and outputs from cudarc's stream-ordered pool and from plain cuMemAlloc both work on
/// the P2P path (the pull protocol reads the root's buffer from the peer).
#[test]
#[ignore = "needs a CUDA GPU"]
fn pool_and_plain_allocations() {
    let clique = two_ranks();
    let paths = paths_to_test(&clique, &[BroadcastPath::P2p, BroadcastPath::Nccl]);
    let mut rng = rng();
    for n in [3000usize, 500_000] {
        for plain_input in [false, true] {
            let data: Vec<u8> = random_vec(n, &mut rng);
            let input = if plain_input {
                clique.context(0).bind_to_thread().unwrap();
                // SAFETY: a fresh allocation of n bytes on device 0, wrapped once and filled below.
                let ptr = unsafe { result::malloc_sync(n) }.unwrap();
                // SAFETY: `ptr` is a live cuMemAlloc allocation of n bytes, owned by the slice.
                let mut s = unsafe { clique.stream(0).upgrade_device_ptr::<u8>(ptr, n) };
                clique.stream(0).memcpy_htod(&data, &mut s).unwrap();
                s
            } else {
                clique.stream(0).clone_htod(&data).unwrap()
            };
            let mut outputs = poisoned_outputs::<u8>(&clique, n, &mut rng);
            for &path in &paths {
                clique
                    .with(&BroadcastOptions::path(path))
                    .broadcast(0, &input, &mut outputs)
                    .unwrap();
                clique.synchronize().unwrap();
                for rank in 0..2 {
                    assert_bytes_eq(
                        clique.stream(rank),
                        &outputs[rank],
                        &data,
                        &format!("plain={plain_input} n={n} {path:?}"),
                    );
                }
            }
        }
    }
}

/// Work on the caller's own streams is ordered with broadcasts through wait_for and record.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ordering_with_caller_streams() {
    let clique = two_ranks();
    let mut rng = rng();
    let n = 1 << 20;
    let mine: Vec<_> = (0..2)
        .map(|r| clique.context(r).new_stream().unwrap())
        .collect();
    let data: Vec<u32> = random_vec(n, &mut rng);
    let input = mine[0].clone_htod(&data).unwrap();
    let mut outputs = poisoned_outputs::<u32>(&clique, n, &mut rng);
    clique.wait_for(&[&mine[0], &mine[1]]).unwrap();
    clique.broadcast(0, &input, &mut outputs).unwrap();
    let events = clique.record().unwrap();
    for r in 0..2 {
        mine[r].wait(&events[r]).unwrap();
        let got: Vec<u32> = mine[r].clone_dtoh(&outputs[r]).unwrap();
        assert!(got == data, "rank {r}");
    }
}

/// Bad arguments are reported before anything is enqueued: the outputs keep their poison.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_arguments_enqueue_nothing() {
    let clique = two_ranks();
    let mut rng = rng();
    let n = 100;
    let data: Vec<u8> = random_vec(n, &mut rng);
    let input_on_1 = clique.stream(1).clone_htod(&data).unwrap();
    let input_on_0 = clique.stream(0).clone_htod(&data).unwrap();
    let poison: Vec<Vec<u8>> = (0..2).map(|_| random_vec(n, &mut rng)).collect();
    let mut outputs: Vec<CudaSlice<u8>> = (0..2)
        .map(|r| clique.stream(r).clone_htod(&poison[r]).unwrap())
        .collect();
    // Ranks of one device take each other's buffers: a wrong device needs two GPUs.
    let two_devices = clique.ordinals()[0] != clique.ordinals()[1];
    if two_devices {
        assert!(matches!(
            clique.broadcast(0, &input_on_1, &mut outputs),
            Err(Error::WrongDevice { .. })
        ));
    } else {
        eprintln!("wrong-device checks skipped: both ranks are on GPU 0");
    }
    assert!(matches!(
        clique.broadcast(2, &input_on_0, &mut outputs),
        Err(Error::RootOutOfRange { .. })
    ));
    assert!(matches!(
        clique.broadcast(0, &input_on_0, &mut outputs[..1]),
        Err(Error::OutputCount { .. })
    ));
    let short = input_on_0.slice(..50);
    assert!(matches!(
        clique.broadcast(0, &short, &mut outputs),
        Err(Error::LengthMismatch { .. })
    ));
    if two_devices {
        let mut swapped: Vec<_> = outputs.iter_mut().rev().map(|o| o.slice_mut(..)).collect();
        assert!(matches!(
            clique.broadcast(0, &input_on_0, &mut swapped),
            Err(Error::WrongDevice { .. })
        ));
    }
    clique.synchronize().unwrap();
    for r in 0..2 {
        assert_bytes_eq(
            clique.stream(r),
            &outputs[r],
            &poison[r],
            "untouched output",
        );
    }
    let empty = input_on_0.slice(0..0);
    let mut empties: Vec<_> = outputs.iter_mut().map(|o| o.slice_mut(0..0)).collect();
    clique.broadcast(0, &empty, &mut empties).unwrap();
    drop(empties);
    clique.synchronize().unwrap();
    for r in 0..2 {
        assert_bytes_eq(
            clique.stream(r),
            &outputs[r],
            &poison[r],
            "untouched after an empty broadcast",
        );
    }
}

/// A fused broadcast of many tensors of mixed types and sizes, on every path, both roots,
/// out of place and in place; the report counts what went where.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_mixed_types_and_sizes() {
    use gpucast::{DeviceTensor, DeviceTensorMut};
    let clique = two_ranks();
    let paths = paths_to_test(&clique, &PATHS);
    let mut rng = rng();
    // (type tag, elements): odd sizes, zero, tiny, above the P2P list limit in count.
    let mut specs: Vec<(u8, usize)> = vec![
        (0, 0),
        (1, 1),
        (2, 3),
        (3, 4095),
        (4, (1 << 20) + 7),
        (5, 5 << 20),
        (6, 100_000),
        (7, 17),
    ];
    for i in 0..150 {
        specs.push(((i % 8) as u8, rng.random_range(1..5000)));
    }
    for root in 0..2 {
        for &path in &paths {
            for in_place in [false, true] {
                // Each tensor as raw bytes, typed by its tag when uploaded.
                let datas: Vec<Vec<u8>> = specs
                    .iter()
                    .map(|&(tag, n)| random_vec(n * tag_size(tag), &mut rng))
                    .collect();
                let inputs: Vec<Tensor> = specs
                    .iter()
                    .zip(&datas)
                    .map(|(&(tag, _), d)| Tensor::upload(&clique, root, tag, d))
                    .collect();
                let mut outs: Vec<Vec<Tensor>> = (0..2)
                    .map(|r| {
                        specs
                            .iter()
                            .zip(&datas)
                            .map(|(&(tag, n), d)| {
                                if in_place && r == root {
                                    Tensor::upload(&clique, r, tag, d)
                                } else {
                                    Tensor::upload(
                                        &clique,
                                        r,
                                        tag,
                                        &random_vec::<u8>(n * tag_size(tag), &mut rng),
                                    )
                                }
                            })
                            .collect()
                    })
                    .collect();
                let opts = BroadcastOptions::path(path);
                let report = {
                    let mut lists: Vec<Vec<&mut dyn DeviceTensorMut>> = outs
                        .iter_mut()
                        .map(|row| row.iter_mut().map(Tensor::as_mut).collect())
                        .collect();
                    if in_place {
                        clique
                            .with(&opts)
                            .broadcast_many_in_place(root, &mut lists)
                            .unwrap()
                    } else {
                        let ins: Vec<&dyn DeviceTensor> =
                            inputs.iter().map(Tensor::as_ref).collect();
                        clique
                            .with(&opts)
                            .broadcast_many(root, &ins, &mut lists)
                            .unwrap()
                    }
                };
                clique.synchronize().unwrap();
                assert_eq!(report.tensors, specs.len());
                assert_eq!(
                    report.p2p_tensors + report.nccl_tensors + report.copy_engine_tensors,
                    specs.len() - 1,
                    "the empty tensor is skipped"
                );
                match path {
                    BroadcastPath::Nccl => assert_eq!(report.p2p_tensors, 0),
                    BroadcastPath::P2p => {
                        assert_eq!(report.nccl_tensors, 0);
                        assert!(
                            report.p2p_launches >= 2,
                            "158 tensors need two list launches"
                        );
                    }
                    _ => {}
                }
                for (rank, row) in outs.iter().enumerate() {
                    for (t, tensor) in row.iter().enumerate() {
                        let got = tensor.download(&clique, rank);
                        assert!(got == datas[t], "root {root} {path:?} in_place={in_place} rank {rank} tensor {t} ({:?}) differs", specs[t]);
                    }
                }
            }
        }
    }
    // Validation: a type mismatch is rejected before anything runs.
    let a = Tensor::upload(&clique, 0, 0, &[0u8; 8]);
    let mut o0 = Tensor::upload(&clique, 0, 0, &[0u8; 8]);
    let mut o1 = Tensor::upload(&clique, 1, 2, &[0u8; 8]);
    let mut lists: Vec<Vec<&mut dyn DeviceTensorMut>> = vec![vec![o0.as_mut()], vec![o1.as_mut()]];
    let err = clique
        .broadcast_many(0, &[a.as_ref()], &mut lists)
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidList(ref m) if m.contains("tensor 0")),
        "{err}"
    );
}

fn tag_size(tag: u8) -> usize {
    [4, 8, 2, 2, 1, 1, 4, 8][tag as usize]
}

/// A tensor of one of eight element types, for the fused test.
enum Tensor {
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
    F16(CudaSlice<f16>),
    Bf16(CudaSlice<bf16>),
    I8(CudaSlice<i8>),
    U8(CudaSlice<u8>),
    I32(CudaSlice<i32>),
    U64(CudaSlice<u64>),
}

impl Tensor {
    fn upload(clique: &Clique, rank: usize, tag: u8, bytes: &[u8]) -> Tensor {
        let s = clique.stream(rank);
        match tag {
            0 => Tensor::F32(s.clone_htod(&from_bytes::<f32>(bytes)).unwrap()),
            1 => Tensor::F64(s.clone_htod(&from_bytes::<f64>(bytes)).unwrap()),
            2 => Tensor::F16(s.clone_htod(&from_bytes::<f16>(bytes)).unwrap()),
            3 => Tensor::Bf16(s.clone_htod(&from_bytes::<bf16>(bytes)).unwrap()),
            4 => Tensor::I8(s.clone_htod(&from_bytes::<i8>(bytes)).unwrap()),
            5 => Tensor::U8(s.clone_htod(&from_bytes::<u8>(bytes)).unwrap()),
            6 => Tensor::I32(s.clone_htod(&from_bytes::<i32>(bytes)).unwrap()),
            _ => Tensor::U64(s.clone_htod(&from_bytes::<u64>(bytes)).unwrap()),
        }
    }

    fn download(&self, clique: &Clique, rank: usize) -> Vec<u8> {
        let s = clique.stream(rank);
        match self {
            Tensor::F32(t) => as_bytes(&s.clone_dtoh(t).unwrap()).to_vec(),
            Tensor::F64(t) => as_bytes(&s.clone_dtoh(t).unwrap()).to_vec(),
            Tensor::F16(t) => as_bytes(&s.clone_dtoh(t).unwrap()).to_vec(),
            Tensor::Bf16(t) => as_bytes(&s.clone_dtoh(t).unwrap()).to_vec(),
            Tensor::I8(t) => as_bytes(&s.clone_dtoh(t).unwrap()).to_vec(),
            Tensor::U8(t) => as_bytes(&s.clone_dtoh(t).unwrap()).to_vec(),
            Tensor::I32(t) => as_bytes(&s.clone_dtoh(t).unwrap()).to_vec(),
            Tensor::U64(t) => as_bytes(&s.clone_dtoh(t).unwrap()).to_vec(),
        }
    }

    fn as_ref(&self) -> &dyn gpucast::DeviceTensor {
        match self {
            Tensor::F32(t) => t,
            Tensor::F64(t) => t,
            Tensor::F16(t) => t,
            Tensor::Bf16(t) => t,
            Tensor::I8(t) => t,
            Tensor::U8(t) => t,
            Tensor::I32(t) => t,
            Tensor::U64(t) => t,
        }
    }

    fn as_mut(&mut self) -> &mut dyn gpucast::DeviceTensorMut {
        match self {
            Tensor::F32(t) => t,
            Tensor::F64(t) => t,
            Tensor::F16(t) => t,
            Tensor::Bf16(t) => t,
            Tensor::I8(t) => t,
            Tensor::U8(t) => t,
            Tensor::I32(t) => t,
            Tensor::U64(t) => t,
        }
    }
}
