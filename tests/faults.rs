//! Fault injection in one process: a rank held back on its stream (a host function that
//! sleeps) under the P2P kernel and NCCL, eager and in a graph replay. Where a rank waits for
//! the one held back (a P2P pull or packet peer, an NCCL kernel), the fault must give its typed
//! error within the timeout plus 100 ms, never hang, and leave a clique that `recover` makes
//! whole: the broadcasts after it are checked bit for bit. Where nothing waits (a packet
//! receiver held back, the copy engines), the call must complete late and right.
//!
//! `GPUCAST_FAULT_ROUNDS` (default 2) repeats the whole set; each round prints its detection
//! times and the last line counts faults, errors and hangs. With one GPU the two ranks share
//! it (no NCCL). Run with
//! `cargo test --release --test faults -- --include-ignored --test-threads 1 --nocapture`.

mod common;

use gpucast::prelude::*;
use std::time::{Duration, Instant};

use common::*;
use gpucast::cudarc::driver::CudaSlice;
use gpucast::{BroadcastOptions, BroadcastPath, Clique, Error};
use rand::RngCore;

const TIMEOUT: Duration = Duration::from_millis(200);
/// How far past the timeout an error may come.
const SLACK: Duration = Duration::from_millis(100);

fn clique() -> Clique {
    two_ranks_with(Clique::builder().timeout(TIMEOUT))
}

fn check(clique: &Clique, root: usize, n: usize, path: BroadcastPath, rng: &mut impl RngCore) {
    check_with(clique, root, n, &BroadcastOptions::path(path), rng);
}

fn check_with(
    clique: &Clique,
    root: usize,
    n: usize,
    options: &BroadcastOptions,
    rng: &mut impl RngCore,
) {
    let path = options.path;
    let data: Vec<u8> = random_vec(n, rng);
    let input = clique.stream(root).clone_htod(&data).unwrap();
    let mut outputs = poisoned_outputs::<u8>(clique, n, rng);
    clique
        .with(options)
        .broadcast(root, &input, &mut outputs)
        .unwrap_or_else(|e| panic!("after recovery, {path:?} {n} B: {e}"));
    clique.synchronize().unwrap();
    for (rank, out) in outputs.iter().enumerate() {
        assert_bytes_eq(
            clique.stream(rank),
            out,
            &data,
            &format!("after recovery, {path:?} {n} B rank {rank}"),
        );
    }
}

/// Everything runs after a fault and recovery.
fn all_paths_work(clique: &Clique, rng: &mut impl RngCore) {
    for n in [100usize, 300_000, 9 << 20] {
        check(clique, 0, n, BroadcastPath::P2p, rng);
        check(clique, 1, n, BroadcastPath::CopyEngine, rng);
        check_with(clique, 1, n, &p2p_chain(), rng);
        if nccl_on(clique) {
            check(clique, 1, n, BroadcastPath::Nccl, rng);
        }
    }
}

/// Holds rank `held` back by `hold`, queues one broadcast on `path` from rank 0 and times
/// `synchronize`.
fn held_back(
    clique: &Clique,
    path: BroadcastPath,
    n: usize,
    held: usize,
    hold: Duration,
) -> (gpucast::Result<()>, Duration) {
    held_back_with(clique, &BroadcastOptions::path(path), n, held, hold)
}

fn held_back_with(
    clique: &Clique,
    options: &BroadcastOptions,
    n: usize,
    held: usize,
    hold: Duration,
) -> (gpucast::Result<()>, Duration) {
    let input: CudaSlice<u8> = clique.stream(0).alloc_zeros(n).unwrap();
    let mut outputs = clique.alloc_outputs::<u8>(n).unwrap();
    clique.synchronize().unwrap();
    stall(clique, held, u64::try_from(hold.as_millis()).unwrap());
    let t0 = Instant::now();
    clique
        .with(options)
        .broadcast(0, &input, &mut outputs)
        .unwrap();
    let r = clique.synchronize();
    (r, t0.elapsed())
}

#[derive(Default)]
struct Counts {
    faults: usize,
    errors: usize,
    late_ok: usize,
    hangs: usize,
    worst: Duration,
}

impl Counts {
    /// A fault that must give `Error::Timeout` (the P2P kernel) or, for NCCL,
    /// `Error::CommunicatorsAborted` naming the call, within the timeout plus `SLACK`.
    fn timed_out(&mut self, what: &str, r: gpucast::Result<()>, took: Duration) {
        self.faults += 1;
        match r {
            Err(Error::Timeout { .. }) => self.errors += 1,
            Err(Error::CommunicatorsAborted {
                undefined_calls, ..
            }) if !undefined_calls.is_empty() => self.errors += 1,
            other => panic!("{what}: expected a timeout or an abort, got {other:?}"),
        }
        assert!(
            took <= TIMEOUT + SLACK,
            "{what}: detected after {took:?} (timeout {TIMEOUT:?})"
        );
        self.worst = self.worst.max(took);
        println!("  {what}: Timeout after {:.1} ms", took.as_secs_f64() * 1e3);
    }
}

#[test]
#[ignore = "needs a CUDA GPU (two for the NCCL faults)"]
fn stalled_ranks_are_detected_and_recovered_from() {
    let rounds: usize = std::env::var("GPUCAST_FAULT_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let clique = clique();
    let mut rng = rng();
    let mut counts = Counts::default();
    let hold = TIMEOUT * 3;
    let watchdog = Instant::now();
    for round in 0..rounds {
        println!("round {round}");
        // The P2P kernel: a peer waits for a root held back (packet and pull protocols), and
        // the root of a pull waits for a peer held back.
        for (n, held) in [(4096usize, 0usize), (1 << 20, 0), (1 << 20, 1)] {
            let (r, took) = held_back(&clique, BroadcastPath::P2p, n, held, hold);
            counts.timed_out(&format!("P2P {n} B, rank {held} held back"), r, took);
            clique.recover().unwrap();
            all_paths_work(&clique, &mut rng);
        }
        // The chain: the root's successor waits for a root held back, and the root waits for
        // its successor held back to finish reading.
        for held in [0usize, 1] {
            let (r, took) = held_back_with(&clique, &p2p_chain(), 3 << 20, held, hold);
            counts.timed_out(&format!("P2P chain, rank {held} held back"), r, took);
            clique.recover().unwrap();
            all_paths_work(&clique, &mut rng);
        }
        // A graph replay with the root held back (rank 1's part runs and waits for it).
        let n = 50_000;
        let input: CudaSlice<u8> = clique.stream(0).alloc_zeros(n).unwrap();
        let outputs = clique.alloc_outputs::<u8>(n).unwrap();
        let mut graph = clique
            .capture((input, outputs), |c, (input, outputs)| {
                c.with(&BroadcastOptions::path(BroadcastPath::P2p))
                    .broadcast(0, input, outputs)
            })
            .unwrap();
        graph.launch().unwrap();
        clique.synchronize().unwrap();
        stall(&clique, 0, u64::try_from(hold.as_millis()).unwrap());
        let t0 = Instant::now();
        graph.launch().unwrap();
        let r = clique.synchronize();
        counts.timed_out("graph replay, root held back", r, t0.elapsed());
        clique.recover().unwrap();
        graph.launch().unwrap();
        clique.synchronize().unwrap();
        drop(graph);
        all_paths_work(&clique, &mut rng);
        // NCCL: the root's kernel waits for rank 1 held back (or rank 1's for the root); the
        // watchdog aborts the communicators, and recovery makes new ones.
        if nccl_on(&clique) {
            for (n, held) in [(4096usize, 1usize), (1 << 20, 0)] {
                let (r, took) = held_back(&clique, BroadcastPath::Nccl, n, held, hold);
                counts.timed_out(&format!("NCCL {n} B, rank {held} held back"), r, took);
                clique.recover().unwrap();
                all_paths_work(&clique, &mut rng);
            }
        }
        // Nothing waits for a rank held back on its own stream here: a packet receiver (the
        // root does not wait for it) and the copy engines (ordered by events, no kernel). The
        // call completes late and right, with no error.
        for (path, n) in [
            (BroadcastPath::P2p, 4096usize),
            (BroadcastPath::CopyEngine, 1 << 20),
        ] {
            let held = TIMEOUT * 2;
            let (r, took) = held_back(&clique, path, n, 1, held);
            r.unwrap_or_else(|e| panic!("{path:?} with rank 1 held back: {e}"));
            assert!(
                took >= held && took < held + Duration::from_secs(1),
                "{path:?}: {took:?}"
            );
            counts.late_ok += 1;
            println!("  {path:?} {n} B, rank 1 held back {held:?}: completed after {took:?}");
            check(&clique, 0, n, path, &mut rng);
        }
        // A hang would stop the loop; the test binary's limit catches it.
        if watchdog.elapsed() > Duration::from_secs(3600) {
            counts.hangs += 1;
            break;
        }
    }
    println!(
        "faults {} errors {} completed-late {} hangs {} worst detection {:.1} ms (timeout {} ms)",
        counts.faults,
        counts.errors,
        counts.late_ok,
        counts.hangs,
        counts.worst.as_secs_f64() * 1e3,
        TIMEOUT.as_millis()
    );
    assert_eq!(counts.errors, counts.faults);
}
