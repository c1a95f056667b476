//! The buffer contract, threads and captures, on two ranks (GPUs 0 and 1, or both on GPU 0 when
//! it is alone, without NCCL; ignored without a GPU): every buffer of a call may be dropped,
//! reused or overwritten, on its own stream, right after the call returns, whichever stream it
//! was allocated on. The clique's streams are held back by a host function that sleeps, so that
//! a missing order shows as wrong data instead of passing by luck.
//!
//! `cargo test --release --test contract -- --include-ignored --test-threads 1`

#![allow(
    clippy::needless_range_loop,
    reason = "ranks index several parallel arrays"
)]

mod common;

use gpucast::prelude::*;
use std::sync::Arc;

use common::*;
use gpucast::cudarc::driver::{result, CudaContext, CudaSlice, CudaStream, DevicePtrMut};
use gpucast::{BroadcastOptions, BroadcastPath, Clique, DeviceTensor, DeviceTensorMut, Error};

/// How long the clique's streams are held back around each call.
const HOLD_MS: u64 = 150;

/// Where the buffers of a case are allocated.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// `clique.stream(rank)`.
    CliqueStreams,
    /// A second stream of the clique's own context (`clique.context(rank).new_stream()`).
    SecondStream,
    /// A stream of a `CudaContext` created separately by the caller.
    OwnContext,
}

fn streams_of(clique: &Clique, source: Source) -> Vec<Arc<CudaStream>> {
    (0..clique.len())
        .map(|r| match source {
            Source::CliqueStreams => clique.stream(r).clone(),
            Source::SecondStream => clique.context(r).new_stream().unwrap(),
            Source::OwnContext => CudaContext::new(clique.ordinals()[r])
                .unwrap()
                .new_stream()
                .unwrap(),
        })
        .collect()
}

/// Sets every byte of `buf` to `byte`, on `s`, through cudarc's write access.
fn fill(s: &Arc<CudaStream>, buf: &mut CudaSlice<u32>, byte: u8) {
    let bytes = buf.len() * 4;
    let (ptr, _g) = buf.device_ptr_mut(s);
    // SAFETY: `ptr` is the live allocation of `buf` (bytes long) on `s`'s device.
    unsafe { result::memset_d8_async(ptr, byte, bytes, s.cu_stream()) }.unwrap();
}

fn upload(s: &Arc<CudaStream>, data: &[u32]) -> CudaSlice<u32> {
    s.clone_htod(data).unwrap()
}

fn poisoned(streams: &[Arc<CudaStream>], n: usize) -> Vec<CudaSlice<u32>> {
    streams
        .iter()
        .map(|s| {
            // SAFETY: filled right below before any read.
            let mut b = unsafe { s.alloc::<u32>(n) }.unwrap();
            fill(s, &mut b, 0xEE);
            b
        })
        .collect()
}

fn hold_back(clique: &Clique) {
    for r in 0..clique.len() {
        stall(clique, r, HOLD_MS);
    }
}

fn sync_all(clique: &Clique, streams: &[Arc<CudaStream>]) {
    clique.synchronize().unwrap();
    for s in streams {
        s.synchronize().unwrap();
    }
}

fn address(s: &Arc<CudaStream>, b: &mut CudaSlice<u32>) -> u64 {
    b.device_ptr_mut(s).0
}

fn pattern(n: usize, byte: u8) -> Vec<u32> {
    vec![u32::from_ne_bytes([byte; 4]); n]
}

/// The single-broadcast cases for one source, path and size.
fn single_cases(
    clique: &Clique,
    source: Source,
    path: BroadcastPath,
    n: usize,
    rng: &mut impl rand::RngCore,
) {
    let streams = streams_of(clique, source);
    let opts = BroadcastOptions::path(path);
    let tag = format!("{source:?} {path:?} n={n}");
    let root = 0;

    // 0. The input is written on its own stream, held back, right before the call: the
    //    broadcast must see that write.
    let old: Vec<u32> = random_vec(n, rng);
    let mut input = upload(&streams[root], &old);
    let mut outputs = poisoned(&streams, n);
    sync_all(clique, &streams);
    stall_stream(&streams[root], HOLD_MS);
    fill(&streams[root], &mut input, 0x6B);
    clique
        .with(&opts)
        .broadcast(root, &input, &mut outputs)
        .unwrap();
    sync_all(clique, &streams);
    for r in 0..clique.len() {
        assert_bytes_eq(
            &streams[r],
            &outputs[r],
            &pattern(n, 0x6B),
            &format!("{tag}: input written just before, rank {r}"),
        );
    }

    // 0'. The outputs are written on their streams, held back, right before the call: the
    //    broadcast must come after those writes.
    let data: Vec<u32> = random_vec(n, rng);
    let input = upload(&streams[root], &data);
    let mut outputs = poisoned(&streams, n);
    sync_all(clique, &streams);
    for r in 0..clique.len() {
        stall_stream(&streams[r], HOLD_MS);
        fill(&streams[r], &mut outputs[r], 0x2D);
    }
    clique
        .with(&opts)
        .broadcast(root, &input, &mut outputs)
        .unwrap();
    sync_all(clique, &streams);
    for r in 0..clique.len() {
        assert_bytes_eq(
            &streams[r],
            &outputs[r],
            &data,
            &format!("{tag}: outputs written just before, rank {r}"),
        );
    }

    // 1. The input is dropped right after the call and its memory reused and zeroed.
    let data: Vec<u32> = random_vec(n, rng);
    let mut input = upload(&streams[root], &data);
    let mut outputs = poisoned(&streams, n);
    sync_all(clique, &streams);
    let old = address(&streams[root], &mut input);
    hold_back(clique);
    clique
        .with(&opts)
        .broadcast(root, &input, &mut outputs)
        .unwrap();
    drop(input);
    // SAFETY: zeroed right below.
    let mut reused = unsafe { streams[root].alloc::<u32>(n) }.unwrap();
    fill(&streams[root], &mut reused, 0);
    let was_reused = address(&streams[root], &mut reused) == old;
    sync_all(clique, &streams);
    for r in 0..clique.len() {
        assert_bytes_eq(
            &streams[r],
            &outputs[r],
            &data,
            &format!("{tag}: input dropped, rank {r}"),
        );
    }
    eprintln!("{tag}: dropped input's memory reused at once: {was_reused}");

    // 2. The input is overwritten right after the call.
    let data: Vec<u32> = random_vec(n, rng);
    let mut input = upload(&streams[root], &data);
    let mut outputs = poisoned(&streams, n);
    sync_all(clique, &streams);
    hold_back(clique);
    clique
        .with(&opts)
        .broadcast(root, &input, &mut outputs)
        .unwrap();
    fill(&streams[root], &mut input, 0x5A);
    sync_all(clique, &streams);
    for r in 0..clique.len() {
        assert_bytes_eq(
            &streams[r],
            &outputs[r],
            &data,
            &format!("{tag}: input overwritten, rank {r}"),
        );
    }

    // 3. The outputs are overwritten right after the call: the overwrite wins.
    let data: Vec<u32> = random_vec(n, rng);
    let input = upload(&streams[root], &data);
    let mut outputs = poisoned(&streams, n);
    sync_all(clique, &streams);
    hold_back(clique);
    clique
        .with(&opts)
        .broadcast(root, &input, &mut outputs)
        .unwrap();
    for r in 0..clique.len() {
        fill(&streams[r], &mut outputs[r], 0xC3);
    }
    sync_all(clique, &streams);
    for r in 0..clique.len() {
        assert_bytes_eq(
            &streams[r],
            &outputs[r],
            &pattern(n, 0xC3),
            &format!("{tag}: outputs overwritten, rank {r}"),
        );
    }

    // 4. The outputs are dropped right after the call; memory allocated next on their streams
    //    must not receive the broadcast.
    let data: Vec<u32> = random_vec(n, rng);
    let input = upload(&streams[root], &data);
    let outputs = poisoned(&streams, n);
    let mut outputs = outputs;
    sync_all(clique, &streams);
    hold_back(clique);
    clique
        .with(&opts)
        .broadcast(root, &input, &mut outputs)
        .unwrap();
    drop(outputs);
    let mut next: Vec<CudaSlice<u32>> = streams
        .iter()
        .map(|s| {
            // SAFETY: filled right below.
            let mut b = unsafe { s.alloc::<u32>(n) }.unwrap();
            fill(s, &mut b, 0x11);
            b
        })
        .collect();
    sync_all(clique, &streams);
    for r in 0..clique.len() {
        assert_bytes_eq(
            &streams[r],
            &next[r],
            &pattern(n, 0x11),
            &format!("{tag}: outputs dropped, rank {r}"),
        );
        let _ = address(&streams[r], &mut next[r]);
    }

    // 5. In place: the root's buffer is overwritten right after the call.
    let data: Vec<u32> = random_vec(n, rng);
    let mut bufs = poisoned(&streams, n);
    streams[root].memcpy_htod(&data, &mut bufs[root]).unwrap();
    sync_all(clique, &streams);
    hold_back(clique);
    clique
        .with(&opts)
        .broadcast_in_place(root, &mut bufs)
        .unwrap();
    fill(&streams[root], &mut bufs[root], 0x77);
    sync_all(clique, &streams);
    for r in 0..clique.len() {
        let want = if r == root {
            pattern(n, 0x77)
        } else {
            data.clone()
        };
        assert_bytes_eq(
            &streams[r],
            &bufs[r],
            &want,
            &format!("{tag}: in place, rank {r}"),
        );
    }
}

/// Fused calls: inputs dropped and reused; in place with the root's buffers overwritten.
fn fused_cases(clique: &Clique, source: Source, path: BroadcastPath, rng: &mut impl rand::RngCore) {
    let streams = streams_of(clique, source);
    let opts = BroadcastOptions::path(path);
    let tag = format!("fused {source:?} {path:?}");
    let root = 1;
    let sizes = [256usize, 25_000, 2 << 20];

    // The inputs are written right before the call on their stream, held back (a device-side
    // fill: a copy from pageable memory would wait for the stream first); the clique's streams
    // are held back too, so that dropping the inputs right after shows.
    let datas: Vec<Vec<u32>> = sizes
        .iter()
        .enumerate()
        .map(|(t, &n)| pattern(n, [0x60, 0x61, 0x62][t]))
        .collect();
    let mut inputs: Vec<CudaSlice<u32>> = sizes
        .iter()
        .map(|&n| upload(&streams[root], &random_vec::<u32>(n, rng)))
        .collect();
    let mut outputs: Vec<Vec<CudaSlice<u32>>> = (0..clique.len())
        .map(|r| {
            sizes
                .iter()
                .map(|&n| poisoned(&streams[r..=r], n).remove(0))
                .collect()
        })
        .collect();
    sync_all(clique, &streams);
    stall_stream(&streams[root], HOLD_MS);
    for (t, input) in inputs.iter_mut().enumerate() {
        fill(&streams[root], input, [0x60, 0x61, 0x62][t]);
    }
    hold_back(clique);
    {
        let ins: Vec<&dyn DeviceTensor> = inputs.iter().map(|t| t as &dyn DeviceTensor).collect();
        let mut outs: Vec<Vec<&mut dyn DeviceTensorMut>> = outputs
            .iter_mut()
            .map(|row| {
                row.iter_mut()
                    .map(|t| t as &mut dyn DeviceTensorMut)
                    .collect()
            })
            .collect();
        clique
            .with(&opts)
            .broadcast_many(root, &ins, &mut outs)
            .unwrap();
    }
    drop(inputs);
    let _reused: Vec<CudaSlice<u32>> = sizes
        .iter()
        .map(|&n| {
            // SAFETY: zeroed right below.
            let mut b = unsafe { streams[root].alloc::<u32>(n) }.unwrap();
            fill(&streams[root], &mut b, 0);
            b
        })
        .collect();
    sync_all(clique, &streams);
    for r in 0..clique.len() {
        for (t, d) in datas.iter().enumerate() {
            assert_bytes_eq(
                &streams[r],
                &outputs[r][t],
                d,
                &format!("{tag}: inputs dropped, rank {r} tensor {t}"),
            );
        }
    }

    // In place, the root's buffers overwritten right after.
    let datas: Vec<Vec<u32>> = sizes.iter().map(|&n| random_vec(n, rng)).collect();
    let mut bufs: Vec<Vec<CudaSlice<u32>>> = (0..clique.len())
        .map(|r| {
            sizes
                .iter()
                .zip(&datas)
                .map(|(&n, d)| {
                    if r == root {
                        upload(&streams[r], d)
                    } else {
                        poisoned(&streams[r..=r], n).remove(0)
                    }
                })
                .collect()
        })
        .collect();
    sync_all(clique, &streams);
    hold_back(clique);
    {
        let mut lists: Vec<Vec<&mut dyn DeviceTensorMut>> = bufs
            .iter_mut()
            .map(|row| {
                row.iter_mut()
                    .map(|t| t as &mut dyn DeviceTensorMut)
                    .collect()
            })
            .collect();
        clique
            .with(&opts)
            .broadcast_many_in_place(root, &mut lists)
            .unwrap();
    }
    for b in &mut bufs[root] {
        fill(&streams[root], b, 0x3C);
    }
    sync_all(clique, &streams);
    for r in 0..clique.len() {
        for (t, d) in datas.iter().enumerate() {
            let want = if r == root {
                pattern(sizes[t], 0x3C)
            } else {
                d.clone()
            };
            assert_bytes_eq(
                &streams[r],
                &bufs[r][t],
                &want,
                &format!("{tag}: in place, rank {r} tensor {t}"),
            );
        }
    }
}

/// Every source of buffers, both paths, single and fused, in place and out of place, small
/// (packet protocol) and large (pull protocol) messages.
#[test]
#[ignore = "needs a CUDA GPU"]
fn buffers_may_be_dropped_reused_or_overwritten_right_after_a_call() {
    let mut rng = rng();
    for source in [
        Source::CliqueStreams,
        Source::SecondStream,
        Source::OwnContext,
    ] {
        // A fresh clique per source: a second stream turns cudarc's event tracking on for the
        // clique's contexts, and the first source must be tested without it.
        let clique = two_ranks();
        for path in paths_to_test(
            &clique,
            &[
                BroadcastPath::P2p,
                BroadcastPath::Nccl,
                BroadcastPath::CopyEngine,
            ],
        ) {
            for n in [4096usize, 4 << 20] {
                single_cases(&clique, source, path, n, &mut rng);
            }
            fused_cases(&clique, source, path, &mut rng);
        }
    }
}

/// A graph borrows its buffers; when it is dropped they may be dropped and their memory reused
/// at once, although replays are still held back on the clique's streams.
#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_buffers_may_be_dropped_right_after_the_graph() {
    let mut rng = rng();
    for source in [Source::CliqueStreams, Source::SecondStream] {
        let clique = two_ranks();
        let streams = streams_of(&clique, source);
        for path in graph_paths_to_test(
            &clique,
            &[
                BroadcastPath::P2p,
                BroadcastPath::Nccl,
                BroadcastPath::CopyEngine,
            ],
        ) {
            let n = 1 << 20;
            let data: Vec<u32> = random_vec(n, &mut rng);
            let mut input = upload(&streams[0], &data);
            let mut outputs = poisoned(&streams, n);
            sync_all(&clique, &streams);
            let mut graph = clique
                .capture((&mut input, &mut outputs), |c, (input, outputs)| {
                    c.with(&BroadcastOptions::path(path))
                        .broadcast(0, input, outputs)
                })
                .unwrap();
            for _ in 0..3 {
                hold_back(&clique);
                graph.launch().unwrap();
            }
            drop(graph);
            // The replays are still held back: reading the outputs on their own streams must
            // wait for them.
            for r in 0..2 {
                let got: Vec<u32> = streams[r].clone_dtoh(&outputs[r]).unwrap();
                assert!(
                    got == data,
                    "{source:?} {path:?}: rank {r} read before the replay ended"
                );
            }
            hold_back(&clique);
            let mut graph = clique
                .capture((&mut input, &mut outputs), |c, (input, outputs)| {
                    c.with(&BroadcastOptions::path(path))
                        .broadcast(0, input, outputs)
                })
                .unwrap();
            graph.launch().unwrap();
            drop(graph);
            drop(input);
            drop(outputs);
            let next: Vec<CudaSlice<u32>> = streams
                .iter()
                .map(|s| {
                    // SAFETY: filled right below.
                    let mut b = unsafe { s.alloc::<u32>(n) }.unwrap();
                    fill(s, &mut b, 0x42);
                    b
                })
                .collect();
            sync_all(&clique, &streams);
            for r in 0..2 {
                assert_bytes_eq(
                    &streams[r],
                    &next[r],
                    &pattern(n, 0x42),
                    &format!("{source:?} {path:?} rank {r}"),
                );
            }
        }
    }
}

/// A clique call inside its own capture closure is an error, not a deadlock; the capture still
/// ends cleanly and the clique keeps working.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_call_inside_the_capture_closure_is_an_error() {
    let clique = two_ranks();
    let mut rng = rng();
    let mut input = clique.stream(0).clone_htod(&[1u32; 64]).unwrap();
    let mut outputs = clique.alloc_outputs::<u32>(64).unwrap();
    let mut inner = None;
    let r = clique.capture((&mut input, &mut outputs), |c, (input, outputs)| {
        inner = Some(clique.synchronize());
        c.broadcast(0, input, outputs)
    });
    assert!(
        matches!(inner, Some(Err(Error::CaptureInProgress))),
        "{inner:?}"
    );
    let mut graph = r.unwrap();
    graph.launch().unwrap();
    drop(graph);
    clique.synchronize().unwrap();
    assert_bytes_eq(
        clique.stream(1),
        &outputs[1],
        &[1u32; 64],
        "after the capture",
    );
    // An error returned by the closure discards the capture and leaves the streams usable.
    let failed = clique.capture((&mut input, &mut outputs), |c, (input, outputs)| {
        c.broadcast(0, &input, &mut outputs[..1])
    });
    assert!(matches!(failed, Err(Error::OutputCount { .. })));
    let data: Vec<u32> = random_vec(999, &mut rng);
    let input = clique.stream(1).clone_htod(&data).unwrap();
    let mut outs = clique.alloc_outputs::<u32>(999).unwrap();
    clique.broadcast(1, &input, &mut outs).unwrap();
    clique.synchronize().unwrap();
    assert_bytes_eq(
        clique.stream(0),
        &outs[0],
        &data,
        "eager after a failed capture",
    );
}

/// Several threads broadcast on one clique at once, one of them capturing graphs meanwhile:
/// every eager broadcast runs (none is swallowed by a capture) and every replay is right. The
/// eager threads keep their buffers on streams of their own: work queued straight onto the
/// clique's streams by another thread during a capture would be captured (CUDA's rule).
#[test]
#[ignore = "needs a CUDA GPU"]
fn threads_share_a_clique_and_captures_swallow_nothing() {
    let clique = two_ranks();
    // The capturing thread alternates these; the eager threads cycle through `eager_paths`.
    let capture_paths = paths_to_test(&clique, &[BroadcastPath::P2p, BroadcastPath::Nccl]);
    let eager_paths = paths_to_test(
        &clique,
        &[
            BroadcastPath::Auto,
            BroadcastPath::P2p,
            BroadcastPath::Nccl,
            BroadcastPath::CopyEngine,
        ],
    );
    let seed_rng = &mut rng();
    let seeds: Vec<u64> = (0..4).map(|_| rand::Rng::random(seed_rng)).collect();
    // Made before any capture: a context's first `new_stream` synchronises the context.
    let own: Vec<Vec<Arc<CudaStream>>> = (0..4)
        .map(|_| streams_of(&clique, Source::SecondStream))
        .collect();
    std::thread::scope(|scope| {
        for ((t, &seed), streams) in seeds.iter().enumerate().zip(own) {
            let (clique, capture_paths, eager_paths) = (&clique, &capture_paths, &eager_paths);
            scope.spawn(move || {
                let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
                if t == 0 {
                    // The capturing thread: the only one that touches the clique's streams.
                    for round in 0..20 {
                        let n = 1000 + round * 777;
                        let data: Vec<u32> = random_vec(n, &mut rng);
                        let mut input = clique.stream(1).clone_htod(&data).unwrap();
                        let mut outputs = poisoned_outputs::<u32>(clique, n, &mut rng);
                        let path = capture_paths[round % capture_paths.len()];
                        let mut graph = clique
                            .capture((&mut input, &mut outputs), |c, (input, outputs)| {
                                c.with(&BroadcastOptions::path(path))
                                    .broadcast(1, &input, outputs)
                            })
                            .unwrap();
                        graph.launch().unwrap();
                        graph.launch().unwrap();
                        drop(graph);
                        clique.synchronize().unwrap();
                        for r in 0..2 {
                            assert_bytes_eq(
                                clique.stream(r),
                                &outputs[r],
                                &data,
                                &format!("thread 0 round {round} rank {r}"),
                            );
                        }
                    }
                    return;
                }
                let mut pending = Vec::new();
                for i in 0..150 {
                    let n = rand::Rng::random_range(&mut rng, 1..200_000usize);
                    let root = (i + t) % 2;
                    let data: Vec<u32> = random_vec(n, &mut rng);
                    let input = upload(&streams[root], &data);
                    let mut outputs = poisoned(&streams, n);
                    let path = eager_paths[i % eager_paths.len()];
                    clique
                        .with(&BroadcastOptions::path(path))
                        .broadcast(root, &input, &mut outputs)
                        .unwrap();
                    pending.push((data, outputs));
                }
                for (i, (data, outputs)) in pending.iter().enumerate() {
                    for r in 0..2 {
                        assert_bytes_eq(
                            &streams[r],
                            &outputs[r],
                            data,
                            &format!("thread {t} op {i} rank {r}"),
                        );
                    }
                }
            });
        }
    });
    clique.synchronize().unwrap();
}

/// The raw entry: device pointers and the caller's own streams, ordered both ways.
#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_pointers_on_the_callers_streams() {
    let clique = two_ranks();
    let mut rng = rng();
    let streams = streams_of(&clique, Source::SecondStream);
    let paths = paths_to_test(
        &clique,
        &[
            BroadcastPath::P2p,
            BroadcastPath::Nccl,
            BroadcastPath::CopyEngine,
        ],
    );
    for (n, path) in [
        (3000usize, BroadcastPath::P2p),
        (3 << 20, BroadcastPath::P2p),
        (5000, BroadcastPath::Nccl),
        (3 << 20, BroadcastPath::CopyEngine),
    ]
    .into_iter()
    .filter(|(_, path)| paths.contains(path))
    {
        let data: Vec<u32> = random_vec(n, &mut rng);
        let mut input = upload(&streams[0], &data);
        let mut outputs = poisoned(&streams, n);
        let src = address(&streams[0], &mut input);
        let dsts: Vec<u64> = (0..2)
            .map(|r| address(&streams[r], &mut outputs[r]))
            .collect();
        let raw: Vec<_> = streams.iter().map(|s| s.cu_stream()).collect();
        hold_back(&clique);
        let b = gpucast::RawBroadcast {
            root: 0,
            src,
            dsts: &dsts,
            count: n,
            dtype: gpucast::DType::U32,
            streams: &raw,
        };
        // SAFETY: the buffers are live allocations of n u32 on the right devices, in the
        // primary contexts, and outlive the streams' progress past this call (synchronised
        // below before they are dropped).
        unsafe { clique.broadcast_raw(&b, &BroadcastOptions::path(path)) }.unwrap();
        // Work queued on the caller's streams afterwards sees the result.
        let got: Vec<u32> = streams[1].clone_dtoh(&outputs[1]).unwrap();
        assert!(got == data, "raw {n} {path:?}");
        sync_all(&clique, &streams);
        assert_bytes_eq(&streams[0], &outputs[0], &data, "raw root");
    }
    // Bad raw arguments are errors before anything runs.
    let b = gpucast::RawBroadcast {
        root: 0,
        src: 0,
        dsts: &[0],
        count: 1,
        dtype: gpucast::DType::U8,
        streams: &[clique.stream(0).cu_stream()],
    };
    // SAFETY: rejected before any pointer is used.
    let e = unsafe { clique.broadcast_raw(&b, &BroadcastOptions::default()) };
    assert!(matches!(e, Err(Error::OutputCount { .. })));
}

/// A buffer from a non-primary context is a clear error.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_buffer_of_another_context_is_rejected() {
    let clique = two_ranks();
    let other = CudaContext::new_non_primary(clique.ordinals()[1], 0).unwrap();
    let foreign_stream = other.new_stream().unwrap();
    let input = clique.stream(0).clone_htod(&[7u8; 100]).unwrap();
    let mut outputs = vec![
        clique.stream(0).alloc_zeros::<u8>(100).unwrap(),
        foreign_stream.alloc_zeros::<u8>(100).unwrap(),
    ];
    let e = clique.broadcast(0, &input, &mut outputs).unwrap_err();
    assert!(matches!(e, Error::ForeignContext { rank: 1, .. }), "{e}");
}

/// Dropping a clique while a rank is held back and the other waits for it returns within the
/// timeout plus a little: no hang, no panic.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dropping_a_busy_clique_does_not_hang() {
    let clique = two_ranks_with(Clique::builder().timeout(std::time::Duration::from_millis(300)));
    let input = clique.stream(0).clone_htod(&[3u8; 300_000]).unwrap();
    let mut outputs = clique.alloc_outputs::<u8>(300_000).unwrap();
    clique.synchronize().unwrap();
    p2p_with_a_rank_held_back(&clique, 1, 1500, &input, &mut outputs);
    drop((input, outputs));
    let t0 = std::time::Instant::now();
    drop(clique);
    let took = t0.elapsed();
    assert!(
        took < std::time::Duration::from_secs(5),
        "drop took {took:?}"
    );
}

/// An NCCL call that fails inside a group (NCCL_CHECK_POINTERS rejects a host pointer for one
/// rank) aborts the communicators instead of launching half a group: the call returns an
/// error, later NCCL calls say the communicators were aborted, and P2P still works. Runs in a
/// child process so that NCCL reads the variable at initialisation.
#[test]
#[ignore = "needs 2 CUDA GPUs"]
fn a_failed_nccl_group_aborts_instead_of_hanging() {
    if too_few_gpus(2, "NCCL between two ranks needs a GPU per rank") {
        return;
    }
    if std::env::var("CONTRACT_CHILD").is_ok() {
        let clique = two_ranks();
        let input = clique.stream(0).clone_htod(&[5u32; 1024]).unwrap();
        let mut outputs = clique.alloc_outputs::<u32>(1024).unwrap();
        let src = outputs[0].device_ptr_mut(clique.stream(0)).0;
        let host = vec![0u32; 1024];
        let dsts = [src, host.as_ptr() as u64];
        let streams = [clique.stream(0).cu_stream(), clique.stream(1).cu_stream()];
        let b = gpucast::RawBroadcast {
            root: 0,
            src,
            dsts: &dsts,
            count: 1024,
            dtype: gpucast::DType::U32,
            streams: &streams,
        };
        // SAFETY: NCCL_CHECK_POINTERS makes NCCL reject the host pointer before it is used.
        let first =
            unsafe { clique.broadcast_raw(&b, &BroadcastOptions::path(BroadcastPath::Nccl)) };
        assert!(matches!(first, Err(Error::Nccl { .. })), "{first:?}");
        let second = clique
            .with(&BroadcastOptions::path(BroadcastPath::Nccl))
            .broadcast(0, &input, &mut outputs);
        assert!(
            matches!(second, Err(Error::CommunicatorsAborted { .. })),
            "{second:?}"
        );
        clique
            .with(&BroadcastOptions::path(BroadcastPath::P2p))
            .broadcast(0, &input, &mut outputs)
            .unwrap();
        clique.synchronize().unwrap();
        assert_bytes_eq(
            clique.stream(1),
            &outputs[1],
            &[5u32; 1024],
            "P2P after the abort",
        );
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_failed_nccl_group_aborts_instead_of_hanging",
            "--include-ignored",
            "--nocapture",
        ])
        .env("CONTRACT_CHILD", "1")
        .env("NCCL_CHECK_POINTERS", "1")
        .env("NCCL_NVLS_ENABLE", "0")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{text}");
}
