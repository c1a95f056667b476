//! The corners of the API where a call meets something other than a demo: a timeout as long as
//! `Duration::MAX`, a capture the caller began on a rank's stream, a captured call that failed
//! and whose error the closure ignored, many NCCL calls queued behind a stream that does not
//! move, and a capture closure that waits for a thread calling the same clique.
//!
//! Every test adapts to the GPUs present: two ranks on GPUs 0 and 1 where there are two, two
//! ranks sharing GPU 0 otherwise; NCCL on a clique of one GPU. Run with
//! `cargo test --release --test corners -- --include-ignored --test-threads 1`.

mod common;

use gpucast::prelude::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use gpucast::cudarc::driver::sys::CUstreamCaptureMode;
use gpucast::cudarc::driver::CudaSlice;
use gpucast::{BroadcastOptions, BroadcastPath, Clique, Error};

/// A clique of one GPU (NCCL runs there with one rank) from `builder`.
fn one_gpu(builder: gpucast::CliqueBuilder) -> Clique {
    clique_on(builder, &[0])
}

/// Broadcasts random bytes from rank 0 on `path` and checks every output bit for bit.
fn broadcast_and_check(clique: &Clique, path: BroadcastPath, n: usize, what: &str) {
    let mut rng = rng();
    let data: Vec<u8> = random_vec(n, &mut rng);
    let input = clique.stream(0).clone_htod(&data).unwrap();
    let mut outputs: Vec<CudaSlice<u8>> = poisoned_outputs(clique, n, &mut rng);
    clique
        .with(&BroadcastOptions::path(path))
        .broadcast(0, &input, &mut outputs)
        .unwrap_or_else(|e| panic!("{what}: {path:?}: {e}"));
    clique
        .synchronize()
        .unwrap_or_else(|e| panic!("{what}: {path:?}: synchronize: {e}"));
    for (r, out) in outputs.iter().enumerate() {
        assert_bytes_eq(
            clique.stream(r),
            out,
            &data,
            &format!("{what}: {path:?}, rank {r}"),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_timeout_of_duration_max_means_no_limit_and_never_panics() {
    let pair = two_ranks_with(Clique::builder().timeout(Duration::MAX));
    for path in [BroadcastPath::Auto, BroadcastPath::P2p] {
        for n in [1024, (1 << 20) + 13] {
            broadcast_and_check(&pair, path, n, "pair, timeout Duration::MAX");
        }
    }
    let one = one_gpu(Clique::builder().timeout(Duration::MAX));
    for path in [BroadcastPath::Auto, BroadcastPath::Nccl] {
        broadcast_and_check(&one, path, 4096, "one GPU, timeout Duration::MAX");
    }
    // The drops derive their bounds from the timeout too.
    within(Duration::from_secs(20), "dropping the cliques", move || {
        drop(pair);
        drop(one);
    });
}

/// Begins a capture of the caller's own on `clique.stream(0)`, makes an eager call on
/// `path`, ends the capture, and returns the call's result.
fn call_during_callers_capture(
    clique: &Clique,
    path: BroadcastPath,
    mode: CUstreamCaptureMode,
) -> gpucast::Result<()> {
    let input = clique.stream(0).alloc_zeros::<u8>(4096).unwrap();
    let mut outputs = clique.alloc_outputs::<u8>(4096).unwrap();
    clique.synchronize().unwrap();
    let stream = clique.stream(0).clone();
    stream.begin_capture(mode).unwrap();
    let r = clique
        .with(&BroadcastOptions::path(path))
        .broadcast(0, &input, &mut outputs);
    // The capture ends (a graph, or none where it was invalidated) before anything else.
    let _ = stream.end_capture(
        gpucast::cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
    );
    r
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_eager_call_on_a_stream_the_caller_captures_is_refused() {
    let cases: Vec<(Clique, BroadcastPath)> = vec![
        (two_ranks(), BroadcastPath::P2p),
        (two_ranks(), BroadcastPath::Auto),
        (one_gpu(Clique::builder()), BroadcastPath::Nccl),
    ];
    for (clique, path) in cases {
        for mode in [
            CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        ] {
            let what = format!("{path:?} on devices {:?}, {mode:?}", clique.ordinals());
            match call_during_callers_capture(&clique, path, mode) {
                Err(Error::CaptureInProgress) => {}
                other => panic!("{what}: a call during the caller's capture gave {other:?}"),
            }
            // Nothing of gpucast's is in the caller's graph: the clique goes on as before.
            broadcast_and_check(&clique, path, 4096, &what);
        }
        // And its drop waits for nothing: no graph the caller holds has gpucast's work.
        let start = Instant::now();
        within(Duration::from_secs(30), "dropping the clique", move || {
            drop(clique)
        });
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{path:?}: the drop took {:?}",
            start.elapsed()
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_call_that_failed_fails_the_whole_capture() {
    // A 1 us timeout bounds the hand-off of a launch to the per-GPU launch threads; parked
    // (idle for over 50 ms before each capture), they do not take it that fast, so a captured
    // P2P step fails (LaunchStalled), possibly after earlier steps of the capture were recorded.
    let clique = two_ranks_with(
        Clique::builder()
            .timeout(Duration::from_micros(1))
            .parallel_launch(true),
    );
    if clique.p2p_available().is_err() {
        panic!("P2P unavailable: {:?}", clique.p2p_available());
    }
    let p2p = BroadcastOptions::path(BroadcastPath::P2p);
    let n = 1 << 16;
    let mut failed_calls = 0;
    for attempt in 0..20 {
        std::thread::sleep(Duration::from_millis(80));
        let input: CudaSlice<u8> = clique.stream(0).alloc_zeros(n).unwrap();
        let outputs = clique.alloc_outputs::<u8>(n).unwrap();
        let mut inner = Vec::new();
        let graph = clique.capture((input, outputs), |c, (input, outputs)| {
            // Two calls: the second may fail after the first was recorded. Their errors are
            // ignored, as a careless closure would.
            for _ in 0..2 {
                let r = c.with(&p2p).broadcast(0, input, outputs);
                if let Err(e) = &r {
                    eprintln!("attempt {attempt}: a captured call failed: {e}");
                }
                inner.push(r.is_ok());
            }
            Ok(())
        });
        if inner.iter().any(|ok| !ok) {
            failed_calls += 1;
            assert!(
                graph.is_err(),
                "attempt {attempt}: a captured call failed ({inner:?}) but the capture \
                 returned a graph"
            );
        }
        drop(graph);
        // Recover whatever the failed launches left (P2P kernels time out by themselves).
        let _ = clique.synchronize();
    }
    assert!(
        failed_calls > 0,
        "no captured call failed in 20 attempts: the test showed nothing"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_calls_queued_behind_a_stream_that_does_not_move_end_within_the_bound() {
    let timeout = Duration::from_millis(500);
    let clique = Arc::new(one_gpu(Clique::builder().timeout(timeout)));
    let input = clique.stream(0).alloc_zeros::<u8>(4).unwrap();
    let mut outputs = clique.alloc_outputs::<u8>(4).unwrap();
    clique.synchronize().unwrap();
    let nccl = BroadcastOptions::path(BroadcastPath::Nccl);
    // The stream does not move for 8 s: far more calls than the driver's launch queue holds
    // are queued behind it.
    stall(&clique, 0, 8000);
    let start = Instant::now();
    let c = clique.clone();
    let (calls, first_error) = within(Duration::from_secs(30), "queueing 5000 calls", move || {
        let mut first_error = None;
        let mut calls = 0;
        for _ in 0..5000 {
            calls += 1;
            if let Err(e) = c.with(&nccl).broadcast(0, &input, &mut outputs) {
                first_error = Some((e, start.elapsed()));
                break;
            }
        }
        (calls, first_error)
    });
    let (error, at) = first_error.unwrap_or_else(|| {
        panic!(
            "5000 NCCL calls queued behind an 8 s stall without an error, the last after {:?}",
            start.elapsed()
        )
    });
    eprintln!("call {calls} failed after {at:?}: {error}");
    // Twice the timeout plus two seconds is the bound of every wait; a call blocked in the
    // driver until the stall ends would take 8 s.
    assert!(
        at < Duration::from_secs(5),
        "the first error came after {at:?}: {error}"
    );
    assert!(
        matches!(
            error,
            Error::StreamsBusy { .. } | Error::CommunicatorsAborted { .. } | Error::Busy { .. }
        ),
        "{error:?}"
    );
    // The drop is bounded too, while the stall still runs.
    within(Duration::from_secs(30), "dropping the clique", move || {
        drop(clique)
    });
    // The process must not end while the stall's host function (and the NCCL abort behind it)
    // still runs.
    std::thread::sleep(Duration::from_secs(10).saturating_sub(start.elapsed()));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_capture_closure_that_waits_for_a_thread_calling_the_clique_ends() {
    let clique = Arc::new(two_ranks_with(
        Clique::builder().timeout(Duration::from_millis(200)),
    ));
    let c = clique.clone();
    let (graph_ok, thread_result) = within(
        Duration::from_secs(30),
        "a capture closure that joins a thread calling the clique",
        move || {
            let mut seen = None;
            let graph = c.capture((), |_, ()| {
                let other = c.clone();
                seen = Some(
                    std::thread::spawn(move || other.synchronize())
                        .join()
                        .unwrap(),
                );
                Ok(())
            });
            (graph.is_ok(), seen)
        },
    );
    match thread_result {
        Some(Err(Error::Busy { .. })) => {}
        other => panic!("the other thread's call gave {other:?}"),
    }
    assert!(graph_ok, "the capture itself failed");
    clique.synchronize().unwrap();
}

/// Unrelated work of the caller: a stream of the rank's context (not the clique's) held on the
/// host for `ms`.
fn unrelated_work(clique: &Clique, ms: u64) -> Arc<gpucast::cudarc::driver::CudaStream> {
    let other = clique.context(0).new_stream().unwrap();
    stall_stream(&other, ms);
    other
}

/// Freeing device memory waits for every stream of the device: the drop hands that to a
/// thread of its own, so the caller's unrelated work does not hold the drop (and the memory
/// is freed once that work ends: a clique built afterwards runs as before).
#[test]
#[ignore = "needs a CUDA GPU"]
fn dropping_a_clique_does_not_wait_for_the_callers_unrelated_work() {
    for devices in [vec![0, 0], vec![0]] {
        let clique = clique_on(Clique::builder(), &devices);
        let path = if devices.len() == 1 {
            BroadcastPath::Nccl
        } else {
            BroadcastPath::P2p
        };
        broadcast_and_check(&clique, path, 4096, "before the drop");
        let other = unrelated_work(&clique, 3000);
        let start = Instant::now();
        drop(clique);
        let took = start.elapsed();
        assert!(
            took < Duration::from_millis(1500),
            "devices {devices:?}: the drop took {took:?} beside 3 s of unrelated work"
        );
        other.synchronize().unwrap();
        // The memory freed in the background meanwhile: a new clique runs as before.
        let again = clique_on(Clique::builder(), &devices);
        broadcast_and_check(&again, path, 4096, "after the drop");
    }
}
