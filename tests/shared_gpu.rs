//! Long runs of small P2P broadcasts between ranks that share a GPU (all on GPU 0 where it is
//! alone): the packet protocol's per-block op counters, tags and slots go past 2^15, 2^16 and
//! 2^17 ops without a lost packet or a spurious timeout. The run across processes is in
//! `procs.rs` (`two_processes_alternate_small_sizes_forty_thousand_times`).
//!
//! `cargo test --release --test shared_gpu -- --include-ignored`

mod common;

use gpucast::prelude::*;
use std::time::Instant;

use common::*;
use gpucast::cudarc::driver::CudaSlice;
use gpucast::{BroadcastOptions, BroadcastPath, Clique, Route};

/// 1 KiB and 8 KiB broadcasts from rank 0 (one packet block, then four), `Auto` then forced
/// P2P, 500 warm-up calls and 2000 more each, each loop ended by a synchronize: 14 rounds,
/// 140,000 calls, as a benchmark makes them. Every call succeeds and every loop's outputs hold
/// the root's data. Prints the time per call.
#[test]
#[ignore = "needs a CUDA GPU"]
fn small_broadcasts_alternating_sizes_pass_two_to_the_seventeen_ops() {
    let clique = clique_on(Clique::builder(), &spread(2, 0));
    clique
        .p2p_available()
        .expect("P2P between the two ranks of this test");
    let mut rng = rng();
    let mut total = 0u64;
    for round in 0..14 {
        for n in [1usize << 10, 8 << 10] {
            for path in [BroadcastPath::Auto, BroadcastPath::P2p] {
                let opts = BroadcastOptions::path(path);
                assert_eq!(clique.route(n, &opts).unwrap(), Route::P2pPacket);
                let data: Vec<u8> = random_vec(n, &mut rng);
                let input = clique.stream(0).clone_htod(&data).unwrap();
                let mut outputs: Vec<CudaSlice<u8>> = poisoned_outputs(&clique, n, &mut rng);
                for (phase, calls) in [("warm-up", 500), ("loop", 2000)] {
                    let t0 = Instant::now();
                    for _ in 0..calls {
                        clique
                            .with(&opts)
                            .broadcast(0, &input, &mut outputs)
                            .unwrap_or_else(|e| panic!("call {total} ({n} B, {path:?}): {e}"));
                        total += 1;
                    }
                    clique.synchronize().unwrap_or_else(|e| {
                        panic!("after call {total} ({n} B, {path:?} {phase}): {e}")
                    });
                    if round % 4 == 0 {
                        eprintln!(
                            "round {round} {n} B {path:?} {phase}: {:.1} us per call",
                            t0.elapsed().as_secs_f64() * 1e6 / f64::from(calls)
                        );
                    }
                }
                for (rank, out) in outputs.iter().enumerate() {
                    assert_bytes_eq(
                        clique.stream(rank),
                        out,
                        &data,
                        &format!("round {round} {n} B {path:?} rank {rank}"),
                    );
                }
            }
        }
    }
    eprintln!("{total} calls");
}
