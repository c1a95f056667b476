//! The promises of the crate docs' "Ordering", "Threads" and "Failure model", each tried where it
//! was once broken: work on the context's default and per-thread streams right after a call;
//! threads sharing a clique whose ranks share a GPU; allocations and calls inside a capture
//! closure; two captures swapped; a late reader after its root gave up; a recovery beside a
//! caller's busy stream; forgotten graphs; stream handles that are names, not streams; packet
//! ops across the wrap of their counters; a graph launch that reached some ranks only.
//!
//! Every test adapts to the GPUs present: two ranks on GPUs 0 and 1 where there are two, two
//! ranks sharing GPU 0 otherwise (NCCL is then tried on a clique of one GPU). Run with
//! `cargo test --release --test promises -- --include-ignored --test-threads 1`.

mod common;

use gpucast::prelude::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use gpucast::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use gpucast::{BroadcastOptions, BroadcastPath, Clique, Error};
use rand::{Rng, RngCore};

/// Two ranks: on two GPUs where there are two, else sharing GPU 0.
fn pair_with(timeout: Duration) -> Clique {
    two_ranks_with(Clique::builder().timeout(timeout))
}

/// Two ranks sharing GPU 0, whatever the machine has.
fn shared_pair(timeout: Duration) -> Clique {
    clique_on(Clique::builder().timeout(timeout), &[0, 0])
}

/// The cliques and paths the ordering tests run on: P2P and the copy engines on a pair; NCCL
/// on the pair where its ranks have GPUs of their own, else on a clique of one GPU.
fn ordering_cases() -> Vec<(Clique, BroadcastPath, usize)> {
    let two = gpucast::device_count().expect("a CUDA driver") >= 2;
    let mut cases = vec![
        (pair_with(Duration::from_secs(10)), BroadcastPath::P2p, 4096),
        (
            pair_with(Duration::from_secs(10)),
            BroadcastPath::P2p,
            1 << 20,
        ),
        (
            pair_with(Duration::from_secs(10)),
            BroadcastPath::CopyEngine,
            1 << 20,
        ),
    ];
    let nccl = if two {
        pair_with(Duration::from_secs(10))
    } else {
        eprintln!("one GPU: NCCL is tried on a clique of one rank");
        Clique::new(&[0]).expect("a clique of GPU 0")
    };
    cases.push((nccl, BroadcastPath::Nccl, 1 << 20));
    cases
}

/// What runs on the other stream right after the call returns.
#[derive(Debug, Clone, Copy)]
enum After {
    /// Zero the last rank's output.
    ZeroOutput,
    /// Zero the input.
    ZeroInput,
    /// Read the last rank's output.
    ReadOutput,
}

/// Which stream a caller names.
#[derive(Debug, Clone, Copy)]
enum Named {
    Default,
    PerThread,
}

fn named(ctx: &Arc<CudaContext>, which: Named) -> Arc<CudaStream> {
    match which {
        Named::Default => ctx.default_stream(),
        Named::PerThread => ctx.per_thread_stream(),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_default_and_per_thread_streams_are_ordered_with_every_path() {
    let mut rng = rng();
    let mut failures = Vec::new();
    for (clique, path, n) in ordering_cases() {
        let last = clique.len() - 1;
        for which in [Named::Default, Named::PerThread] {
            for after in [After::ZeroOutput, After::ZeroInput, After::ReadOutput] {
                let data: Vec<u8> = random_vec(n, &mut rng);
                let input = clique.stream(0).clone_htod(&data).unwrap();
                let mut input = input;
                let mut outputs: Vec<CudaSlice<u8>> = poisoned_outputs(&clique, n, &mut rng);
                clique.synchronize().unwrap();
                // The clique's streams start the broadcast 200 ms late.
                for r in 0..clique.len() {
                    stall(&clique, r, 200);
                }
                let opts = BroadcastOptions::path(path);
                clique
                    .with(&opts)
                    .broadcast(0, &input, &mut outputs)
                    .unwrap();
                let out_stream = named(clique.context(last), which);
                let in_stream = named(clique.context(0), which);
                let (want, got): (Vec<u8>, Vec<u8>) = match after {
                    After::ZeroOutput => {
                        out_stream.memset_zeros(&mut outputs[last]).unwrap();
                        out_stream.synchronize().unwrap();
                        clique.synchronize().unwrap();
                        let got = clique.stream(last).clone_dtoh(&outputs[last]).unwrap();
                        (vec![0; n], got)
                    }
                    After::ZeroInput => {
                        in_stream.memset_zeros(&mut input).unwrap();
                        in_stream.synchronize().unwrap();
                        clique.synchronize().unwrap();
                        let got = clique.stream(last).clone_dtoh(&outputs[last]).unwrap();
                        (data.clone(), got)
                    }
                    After::ReadOutput => {
                        let got = out_stream.clone_dtoh(&outputs[last]).unwrap();
                        clique.synchronize().unwrap();
                        (data.clone(), got)
                    }
                };
                if got != want {
                    let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                    failures.push(format!(
                        "{path:?} {n} B, {which:?} stream, {after:?}: {bad} of {n} bytes wrong"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "unordered:\n{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn threads_share_a_clique_whose_ranks_share_a_gpu() {
    let clique = shared_pair(Duration::from_secs(3));
    assert!(clique.parallel_launch().unwrap(), "launch threads on");
    if std::env::var_os("GPUCAST_TEST_POOL_DEPENDENCIES").is_some() {
        eprintln!("memory pool reuse through stream dependencies turned back on");
        allow_pool_dependencies(clique.context(0));
    }
    broadcast_from_threads(&clique, rng().random(), 150);
}

/// The hazard behind the test above, made likely: while one thread broadcasts between two ranks
/// of one GPU, another frees memory on rank 0's stream and allocates the same size on rank 1's.
/// Where the pool may reuse that memory by making rank 1's stream wait for rank 0's (its default
/// policy, `GPUCAST_TEST_POOL_DEPENDENCIES=1` puts it back), such a wait can land between the two
/// ranks' launches of one call and hold rank 1's kernel behind rank 0's, which waits for it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn allocations_on_two_ranks_streams_never_hold_a_broadcast() {
    let clique = shared_pair(Duration::from_secs(2));
    if std::env::var_os("GPUCAST_TEST_POOL_DEPENDENCIES").is_some() {
        eprintln!("memory pool reuse through stream dependencies turned back on");
        allow_pool_dependencies(clique.context(0));
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    let n = 1 << 20;
    let pull = BroadcastOptions::path(BroadcastPath::P2p).packet_threshold(0);
    std::thread::scope(|s| {
        let (clique, stop) = (&clique, &stop);
        s.spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let a = clique.stream(0).alloc_zeros::<u8>(n).unwrap();
                drop(a);
                let b = clique.stream(1).alloc_zeros::<u8>(n).unwrap();
                drop(b);
            }
        });
        let mut rng = rng();
        let data: Vec<u8> = random_vec(n, &mut rng);
        let input = clique.stream(0).clone_htod(&data).unwrap();
        let mut outputs = clique.alloc_outputs::<u8>(n).unwrap();
        let outcome = (0..2000).try_for_each(|call| {
            clique
                .with(&pull)
                .broadcast(0, &input, &mut outputs)
                .and_then(|()| {
                    if call % 100 == 99 {
                        clique.synchronize()
                    } else {
                        Ok(())
                    }
                })
                .map_err(|e| format!("call {call}: {e}"))
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        outcome.unwrap();
        clique.synchronize().unwrap();
        assert_bytes_eq(clique.stream(1), &outputs[1], &data, "rank 1");
    });
}

/// Puts back the memory pool's default reuse policy on `ctx`'s device (to show what it costs).
fn allow_pool_dependencies(ctx: &Arc<CudaContext>) {
    use gpucast::cudarc::driver::sys;
    ctx.bind_to_thread().unwrap();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut on: i32 = 1;
    // SAFETY: out pointer and an int attribute of the device's live pool.
    unsafe {
        sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device())
            .result()
            .unwrap();
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
            (&raw mut on).cast(),
        )
        .result()
        .unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn allocations_and_call_counts_inside_a_capture_closure() {
    let clique = Arc::new(shared_pair(Duration::from_secs(5)));
    let c = clique.clone();
    within(
        Duration::from_secs(30),
        "a capture that allocates",
        move || {
            let clique = c;
            let mut rng = rng();
            let n = 100_000;
            let data: Vec<u8> = random_vec(n, &mut rng);
            let mut input = clique.stream(0).clone_htod(&data).unwrap();
            let mut outputs = clique.alloc_outputs::<u8>(n).unwrap();
            let mut made = None;
            let mut counted = None;
            let graph = clique
                .capture((&mut input, &mut outputs), |cap, (input, outputs)| {
                    made = Some(clique.alloc_outputs::<u8>(n)?);
                    counted = Some(clique.calls());
                    cap.broadcast(0, input, outputs)
                })
                .unwrap();
            assert!(counted.is_some());
            drop(graph);
            // Buffers allocated inside the closure are ordinary buffers.
            let mut made = made.unwrap();
            clique.broadcast(0, &input, &mut made).unwrap();
            clique.synchronize().unwrap();
            for (rank, out) in made.iter().enumerate() {
                assert_bytes_eq(clique.stream(rank), out, &data, &format!("rank {rank}"));
            }
        },
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_swapped_capture_keeps_its_graph_with_its_own_clique() {
    let a = shared_pair(Duration::from_secs(3));
    let b = shared_pair(Duration::from_secs(3));
    let mut rng = rng();
    let n = 1 << 20;
    let pull = BroadcastOptions::path(BroadcastPath::P2p).packet_threshold(0);
    let data: Vec<u8> = random_vec(n, &mut rng);
    let mut input = a.stream(0).clone_htod(&data).unwrap();
    let mut outs_b = b.alloc_outputs::<u8>(n).unwrap();
    std::thread::scope(|s| {
        let (a, b) = (&a, &b);
        let (input, outs_b, pull) = (&mut input, &mut outs_b, &pull);
        let replays = s.spawn(move || {
            let mut inner = None;
            let mut outer = a
                .capture((input, outs_b), |ca, (input, outs_b)| {
                    // SAFETY: the unchecked capture, swapped into `ca`, records the call of
                    // `input` and `outs_b`, which the outer graph holds until it is dropped,
                    // after its replays and the inner graph's (empty) ones.
                    inner = Some(unsafe {
                        b.capture_unchecked(|cb| {
                            std::mem::swap(ca, cb);
                            Ok(())
                        })
                    }?);
                    // `ca` now records on `b`'s streams.
                    ca.with(pull).broadcast(0, input, outs_b)
                })
                .unwrap();
            let mut inner = inner.unwrap();
            for _ in 0..200 {
                outer.launch().unwrap();
                inner.launch().unwrap();
            }
        });
        // Meanwhile `b` broadcasts on its own: its P2P state must never see two calls at once.
        let mut outs = b.alloc_outputs::<u8>(n).unwrap();
        let other: Vec<u8> = random_vec(n, &mut rng);
        let from = b.stream(0).clone_htod(&other).unwrap();
        for call in 0..200 {
            b.with(pull)
                .broadcast(0, &from, &mut outs)
                .unwrap_or_else(|e| panic!("b's call {call}: {e}"));
        }
        b.synchronize().unwrap();
        assert_bytes_eq(b.stream(1), &outs[1], &other, "b's own broadcast");
        replays.join().unwrap();
    });
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    assert_bytes_eq(
        b.stream(1),
        &outs_b[1],
        &data,
        "the swapped capture's broadcast",
    );
}

/// One late-reader case: `rank 1` is held back past the timeout, the root gives up, and the
/// caller overwrites the input at once on the root's stream. Rank 1 must then read nothing.
fn late_reader(options: &BroadcastOptions, what: &str) {
    let clique = shared_pair(Duration::from_millis(300));
    let mut rng = rng();
    let n = 4 << 20;
    let data: Vec<u8> = random_vec(n, &mut rng);
    let mut input = clique.stream(0).clone_htod(&data).unwrap();
    let poison: Vec<u8> = random_vec(n, &mut rng);
    let mut outputs = vec![
        clique.alloc_outputs::<u8>(n).unwrap().remove(0),
        clique.stream(1).clone_htod(&poison).unwrap(),
    ];
    clique.synchronize().unwrap();
    stall(&clique, 1, 1500);
    clique
        .with(options)
        .broadcast(0, &input, &mut outputs)
        .unwrap();
    // The root's call has ended (it gave up) long before rank 1 starts: the input is the
    // caller's again.
    let after = vec![0xa5u8; n];
    clique.stream(0).memcpy_htod(&after, &mut input).unwrap();
    let outcome = clique.synchronize();
    assert!(
        matches!(outcome, Err(Error::Timeout { .. })),
        "{what}: a timeout, got {outcome:?}"
    );
    clique.recover().unwrap();
    let got = clique.stream(1).clone_dtoh(&outputs[1]).unwrap();
    let from_after = got
        .iter()
        .zip(&poison)
        .filter(|(g, p)| g != p && **g == 0xa5)
        .count();
    assert_eq!(
        from_after, 0,
        "{what}: rank 1 read {from_after} bytes of the root's buffer after the root's call ended"
    );
    assert!(got == poison, "{what}: rank 1's output changed");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_late_pull_reader_never_reads_after_the_root_gave_up() {
    let pull = BroadcastOptions::path(BroadcastPath::P2p).packet_threshold(0);
    late_reader(&pull, "pull");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_late_chain_reader_never_reads_after_its_predecessor_gave_up() {
    late_reader(&p2p_chain(), "chain");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn stream_handles_that_are_names_are_refused() {
    let ctx = CudaContext::new(0).unwrap();
    let own = ctx.new_stream().unwrap();
    for (name, s) in [
        ("default", ctx.default_stream()),
        ("per-thread", ctx.per_thread_stream()),
    ] {
        let built = Clique::builder()
            .shared_devices(true)
            .streams(vec![s, own.clone()])
            .build();
        assert!(
            matches!(built, Err(Error::InvalidArgument(ref m)) if m.contains("default")),
            "{name}: {:?}",
            built.err()
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forgetting_a_graph_never_hangs_the_clique_s_drop() {
    let mut cases: Vec<(&str, Clique, BroadcastPath)> = vec![(
        "P2P on a shared pair",
        shared_pair(Duration::from_secs(2)),
        BroadcastPath::P2p,
    )];
    cases.push((
        "NCCL on one GPU",
        Clique::builder()
            .devices(&[0])
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap(),
        BroadcastPath::Nccl,
    ));
    for (what, clique, path) in cases {
        let clique = Arc::new(clique);
        let c = clique.clone();
        within(Duration::from_secs(60), what, move || {
            let n = 1 << 16;
            let input = c.stream(0).clone_htod(&vec![7u8; n]).unwrap();
            let outputs = c.alloc_outputs::<u8>(n).unwrap();
            let opts = BroadcastOptions::path(path);
            let mut graph = c
                .capture((input, outputs), |cap, (input, outputs)| {
                    cap.with(&opts).broadcast(0, input, outputs)
                })
                .unwrap();
            graph.launch().unwrap();
            std::mem::forget(graph);
            c.synchronize().unwrap();
            drop(c);
        });
        within(Duration::from_secs(60), what, move || drop(clique));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn recovery_does_not_wait_for_the_callers_unrelated_work() {
    let clique = shared_pair(Duration::from_millis(200));
    let busy = clique.context(0).new_stream().unwrap();
    let mut rng = rng();
    let n = 1 << 20;
    let input = clique
        .stream(0)
        .clone_htod(&random_vec::<u8>(n, &mut rng))
        .unwrap();
    let mut outputs = clique.alloc_outputs::<u8>(n).unwrap();
    p2p_with_a_rank_held_back(&clique, 1, 600, &input, &mut outputs);
    assert!(
        clique.synchronize().is_err(),
        "the held-back rank times out"
    );
    // Unrelated work on the same context, queued before the reset.
    stall_stream(&busy, 5000);
    let start = Instant::now();
    clique.recover().unwrap();
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(2500),
        "recovery took {took:?} behind 5 s of unrelated work"
    );
    check_in_place::<u8>(&clique, 1, 5000, BroadcastPath::P2p, &mut rng);
    busy.synchronize().unwrap();
    let _ = rng.next_u32();
}

/// Packet ops keep their order and their back-pressure across the wrap of the 32-bit op
/// counters: the counters start one to three ops short of `u32::MAX`, and a peer held back
/// makes the root run ahead until every slot of its ring is in use, so its ring of four slots
/// straddles the wrap and it must wait for the acknowledgement of an op numbered before the
/// wrap. A kernel that is not wrap-aware (`seq > SLOTS` before waiting, as it once was)
/// reuses a slot the peer has not read: the peer then waits for a tag that is gone (`Timeout`)
/// or reads newer data.
#[test]
#[ignore = "needs a CUDA GPU"]
fn packet_ops_keep_their_back_pressure_across_the_counters_wrap() {
    let clique = pair_with(Duration::from_secs(2));
    clique
        .p2p_available()
        .expect("P2P between the two ranks of this test");
    let mut rng = rng();
    let p2p = BroadcastOptions::path(BroadcastPath::P2p);
    let max = gpucast::testing::PACKET_MAX_BYTES;
    for round in 0..3u32 {
        // The first op is u32::MAX - round: the wrap falls within the first four.
        clique
            .set_packet_counters_for_test(u32::MAX - 1 - round)
            .unwrap();
        let sizes: Vec<usize> = (0..14)
            .map(|i| match i % 4 {
                0 => max,
                1 => max - 1 - rng.random_range(0..64),
                2 => 1 + rng.random_range(0..4096),
                _ => max - 16 * rng.random_range(1..64),
            })
            .collect();
        for &n in &sizes {
            assert_eq!(clique.route(n, &p2p).unwrap(), gpucast::Route::P2pPacket);
        }
        let inputs: Vec<(usize, Vec<u8>)> = sizes
            .iter()
            .enumerate()
            // The last calls alternate roots: rank 1's ring is used past the wrap too.
            .map(|(i, &n)| (if i >= 10 { i % 2 } else { 0 }, random_vec(n, &mut rng)))
            .collect();
        let sources: Vec<CudaSlice<u8>> = inputs
            .iter()
            .map(|(root, data)| clique.stream(*root).clone_htod(data).unwrap())
            .collect();
        let mut outputs: Vec<Vec<CudaSlice<u8>>> = sizes
            .iter()
            .map(|&n| poisoned_outputs::<u8>(&clique, n, &mut rng))
            .collect();
        clique.synchronize().unwrap();
        // Rank 1 starts 50 ms late: rank 0, root of the first ten calls, fills its ring.
        stall(&clique, 1, 50);
        for (((root, _), src), outs) in inputs.iter().zip(&sources).zip(&mut outputs) {
            clique.with(&p2p).broadcast(*root, src, outs).unwrap();
        }
        clique
            .synchronize()
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        for (call, ((root, data), outs)) in inputs.iter().zip(&outputs).enumerate() {
            for (rank, out) in outs.iter().enumerate() {
                assert_bytes_eq(
                    clique.stream(rank),
                    out,
                    data,
                    &format!(
                        "round {round}, call {call} ({} B from rank {root}), rank {rank}",
                        data.len()
                    ),
                );
            }
        }
    }
}

/// A graph's inputs and, per input, one output per rank.
type Buffers = (Vec<CudaSlice<u8>>, Vec<Vec<CudaSlice<u8>>>);

/// A graph launch that reaches some ranks and not others (the launch of one rank's graph, or of
/// one part of it, fails): the call is an error at once, and the clique then works again,
/// eager and by replay, bit for bit. The graph holds packet broadcasts from rank 0 only, so no
/// rank launched waits for the missing one (a root never waits for its peers within four
/// ops): nothing times out, and only the mark the failed launch leaves brings the reset
/// before the next call. Without it the ranks' op counters disagree and the next call times
/// out.

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_graph_launch_that_reaches_some_ranks_only_is_recovered_from() {
    let timeout = Duration::from_millis(300);
    let clique = pair_with(timeout);
    clique
        .p2p_available()
        .expect("P2P between the two ranks of this test");
    let mut rng = rng();
    // Packets at every size of the graph (the limit is the inbox's).
    let p2p = BroadcastOptions::path(BroadcastPath::P2p)
        .packet_threshold(gpucast::testing::PACKET_MAX_BYTES);
    let sizes = [3000usize, gpucast::testing::PACKET_MAX_BYTES - 5];
    let roots = [0usize, 0];
    let inputs: Vec<CudaSlice<u8>> = sizes
        .iter()
        .zip(roots)
        .map(|(&n, root)| clique.stream(root).alloc_zeros(n).unwrap())
        .collect();
    let outputs: Vec<Vec<CudaSlice<u8>>> = sizes
        .iter()
        .map(|&n| clique.alloc_outputs::<u8>(n).unwrap())
        .collect();
    let mut graph = clique
        .capture((inputs, outputs), |c, (inputs, outputs)| {
            for ((input, outs), root) in inputs.iter().zip(outputs.iter_mut()).zip(roots) {
                c.with(&p2p).broadcast(root, input, outs)?;
            }
            Ok(())
        })
        .unwrap();
    // One part per rank on two GPUs; where ranks share a GPU, one per P2P step (and a last
    // one where anything follows the last step).
    let parts = if shares_a_gpu(&clique) { 2 } else { 1 };
    let replay = |graph: &mut gpucast::CliqueGraph<'_, Buffers>,
                  rng: &mut rand::rngs::StdRng,
                  what: &str| {
        let data: Vec<Vec<u8>> = sizes.iter().map(|&n| random_vec(n, rng)).collect();
        let (inputs, outputs) = graph.buffers_mut();
        for ((input, d), root) in inputs.iter_mut().zip(&data).zip(roots) {
            clique.stream(root).memcpy_htod(d, input).unwrap();
        }
        for outs in outputs.iter_mut() {
            for (rank, out) in outs.iter_mut().enumerate() {
                clique.stream(rank).memset_zeros(out).unwrap();
            }
        }
        graph.launch().unwrap_or_else(|e| panic!("{what}: {e}"));
        clique
            .synchronize()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let (_, outputs) = graph.buffers();
        for (t, (outs, d)) in outputs.iter().zip(&data).enumerate() {
            for (rank, out) in outs.iter().enumerate() {
                assert_bytes_eq(
                    clique.stream(rank),
                    out,
                    d,
                    &format!("{what}: tensor {t}, rank {rank}"),
                );
            }
        }
    };
    replay(&mut graph, &mut rng, "the first replay");
    let mut cases = vec![(1, 0), (0, 0)];
    if parts > 1 {
        cases.extend([(0, 1), (1, 1)]);
    }
    for (rank, part) in cases {
        let what = format!("after a launch that failed at rank {rank}, part {part}");
        clique.fail_graph_launch_for_test(rank, part);
        let t0 = Instant::now();
        match graph.launch() {
            Err(Error::Cuda { during, .. }) => {
                assert!(during.contains(&format!("rank {rank}")), "{what}: {during}")
            }
            other => panic!("{what}: expected the injected launch failure, got {other:?}"),
        }
        // The ranks launched waited for no one.
        clique
            .synchronize()
            .unwrap_or_else(|e| panic!("{what}: synchronize: {e}"));
        let took = t0.elapsed();
        assert!(
            took < timeout * 3 + Duration::from_secs(2),
            "{what}: took {took:?}"
        );
        // An eager call and a replay are right again.
        let n = 1 << 16;
        let data: Vec<u8> = random_vec(n, &mut rng);
        let input = clique.stream(1).clone_htod(&data).unwrap();
        let mut outs = poisoned_outputs::<u8>(&clique, n, &mut rng);
        clique
            .with(&p2p)
            .broadcast(1, &input, &mut outs)
            .unwrap_or_else(|e| panic!("{what}: eager call: {e}"));
        clique
            .synchronize()
            .unwrap_or_else(|e| panic!("{what}: eager call: {e}"));
        for (r, out) in outs.iter().enumerate() {
            assert_bytes_eq(
                clique.stream(r),
                out,
                &data,
                &format!("{what}: eager, rank {r}"),
            );
        }
        replay(&mut graph, &mut rng, &what);
    }
}

/// An NCCL abort (the watchdog's answer to a late peer) while a graph that captured the
/// communicators is alive. NCCL's abort waits until every graph that captured them is
/// destroyed, so done on the caller's thread it would wait for a graph that thread owns,
/// forever: the abort must return at once. The live graph must then refuse to launch (on
/// several ranks its NCCL kernels would return without writing) before and after `recover`,
/// while new eager calls and new captures work bit for bit after `recover`. On two GPUs or
/// more it runs on GPUs 0 and 1; with one, on a clique of one GPU, where NCCL turns a
/// broadcast into a local copy that leaves the abort nothing to wait for (the refusal is
/// tested there, the wait is not).
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_nccl_abort_beside_a_live_graph_returns_and_the_graph_is_refused_after() {
    let devices: &[usize] = if gpus() >= 2 { &[0, 1] } else { &[0] };
    let clique = Arc::new(
        Clique::builder()
            .devices(devices)
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap(),
    );
    let ranks = clique.len();
    let nccl = BroadcastOptions::path(BroadcastPath::Nccl);
    let n = (1 << 16) + 3;
    type Bufs = (CudaSlice<u8>, Vec<CudaSlice<u8>>);
    let check =
        |graph: &mut gpucast::CliqueGraph<'_, Bufs>, rng: &mut rand::rngs::StdRng, what: &str| {
            let data: Vec<u8> = random_vec(n, rng);
            let (input, outputs) = graph.buffers_mut();
            clique.stream(0).memcpy_htod(&data, input).unwrap();
            for (rank, out) in outputs.iter_mut().enumerate() {
                clique.stream(rank).memset_zeros(out).unwrap();
            }
            graph.launch().unwrap_or_else(|e| panic!("{what}: {e}"));
            clique.synchronize().unwrap();
            for (rank, out) in graph.buffers().1.iter().enumerate() {
                assert_bytes_eq(
                    clique.stream(rank),
                    out,
                    &data,
                    &format!("{what}, rank {rank}"),
                );
            }
        };
    let capture = || {
        let input = clique.stream(0).alloc_zeros::<u8>(n).unwrap();
        let outputs = clique.alloc_outputs::<u8>(n).unwrap();
        clique
            .capture((input, outputs), |c, (input, outputs)| {
                c.with(&nccl).broadcast(0, input, outputs)
            })
            .unwrap()
    };
    let mut rng = rng();
    let mut graph = capture();
    check(&mut graph, &mut rng, "a replay before the abort");
    let c = clique.clone();
    within(
        Duration::from_secs(30),
        &format!("an NCCL abort beside a live graph ({ranks} rank(s))"),
        move || c.abort_nccl_for_test().unwrap(),
    );
    let refused = |graph: &mut gpucast::CliqueGraph<'_, Bufs>, what: &str| match graph.launch() {
        Err(Error::CommunicatorsAborted { .. }) => {}
        other => panic!("{what}: a graph of aborted communicators launched: {other:?}"),
    };
    refused(&mut graph, "after the abort");
    let input = clique.stream(0).clone_htod(&vec![5u8; n]).unwrap();
    let mut outs = clique.alloc_outputs::<u8>(n).unwrap();
    match clique.with(&nccl).broadcast(0, &input, &mut outs) {
        Err(Error::CommunicatorsAborted { .. }) => {}
        other => panic!("an eager NCCL call after the abort: {other:?}"),
    }
    let c = clique.clone();
    within(
        Duration::from_secs(60),
        "recover after the abort",
        move || c.recover().unwrap(),
    );
    refused(&mut graph, "after recover");
    let data: Vec<u8> = random_vec(n, &mut rng);
    let input = clique.stream(0).clone_htod(&data).unwrap();
    let mut outs = poisoned_outputs::<u8>(&clique, n, &mut rng);
    clique.with(&nccl).broadcast(0, &input, &mut outs).unwrap();
    clique.synchronize().unwrap();
    for (rank, out) in outs.iter().enumerate() {
        assert_bytes_eq(
            clique.stream(rank),
            out,
            &data,
            &format!("an eager call after recover, rank {rank}"),
        );
    }
    let mut again = capture();
    check(&mut again, &mut rng, "a new graph after recover");
    // The old graph goes: the abort waiting for it can finish.
    drop(graph);
    check(&mut again, &mut rng, "the new graph after the old one went");
    drop(again);
    let c = clique.clone();
    drop(clique);
    within(Duration::from_secs(60), "dropping the clique", move || {
        drop(c)
    });
}

/// An error cudarc stored on a buffer's context (an earlier operation of the caller's that
/// failed, say) fails a call before any buffer's guard is taken, and leaves every buffer's
/// events as they were; so too where it is stored on the context object of one of two ranks
/// sharing the GPU (each rank has its own object of the one CUDA context, each with its own
/// stored error). Were the guards taken, each would skip its wait (binding the context
/// fails on the error) and, once the call had reported the error, record its event on a stream
/// that never waited: a write still pending on another stream would be forgotten, and a later
/// reader ordered by that event would read before it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_error_stored_before_a_call_leaves_every_buffer_s_events_as_they_were() {
    use gpucast::cudarc::driver::{sys::cudaError_enum, DriverError};
    let mut rng = rng();
    let clique = shared_pair(Duration::from_secs(10));
    let ctx = clique.context(1).clone();
    let n = 1 << 20;
    let input = clique
        .stream(0)
        .clone_htod(&random_vec::<u8>(n, &mut rng))
        .unwrap();
    let mut outputs: Vec<CudaSlice<u8>> = poisoned_outputs(&clique, n, &mut rng);
    clique.synchronize().unwrap();
    // Rank 1's output gets a write on a stream of the caller's, 1.5 s late (a copy between
    // device buffers: nothing of it waits on the host): its write event is that stream's,
    // pending.
    let writer = ctx.new_stream().unwrap();
    let written: Vec<u8> = random_vec(n, &mut rng);
    let source = writer.clone_htod(&written).unwrap();
    writer.synchronize().unwrap();
    stall_stream(&writer, 1500);
    writer.memcpy_dtod(&source, &mut outputs[1]).unwrap();
    ctx.record_err::<()>(Err(DriverError(cudaError_enum::CUDA_ERROR_UNKNOWN)));
    let failed = clique.broadcast(0, &input, &mut outputs);
    assert!(
        matches!(&failed, Err(Error::Cuda { .. })),
        "the stored error is the call's: {failed:?}"
    );
    // A reader on a third stream waits for the output's write event: still the writer's.
    let reader = ctx.new_stream().unwrap();
    let got = reader.clone_dtoh(&outputs[1]).unwrap();
    let wrong = got.iter().zip(&written).filter(|(a, b)| a != b).count();
    assert_eq!(
        wrong, 0,
        "{wrong} of {n} bytes read before the pending write"
    );
    assert!(ctx.check_err().is_ok(), "the error was reported once");
    clique.synchronize().unwrap();
}
