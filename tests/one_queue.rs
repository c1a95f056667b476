//! Two ranks of one GPU, driven from several threads, with the device's hardware work queues
//! cut to one (`CUDA_DEVICE_MAX_CONNECTIONS=1`, set before CUDA starts in this process). Every
//! stream then shares that queue, which runs its work in the order it was queued: anything
//! queued on rank 0's stream between the launches of rank 0's and rank 1's kernels of one P2P
//! call, and waiting for rank 0's kernel, sits in front of rank 1's launch, while rank 0's
//! kernel waits for rank 1's. With the default of 8 queues the same happens whenever two
//! ranks' streams land on one queue, which is rare and so once made a flaky test
//! (`promises::threads_share_a_clique_whose_ranks_share_a_gpu`).
//!
//! Run with `cargo test --release --test one_queue -- --include-ignored --test-threads 1`.

mod common;

use gpucast::prelude::*;
use std::sync::Once;
use std::time::Duration;

use common::*;
use gpucast::cudarc::driver::CudaSlice;
use gpucast::{BroadcastOptions, BroadcastPath, Clique};
use rand::{Rng, SeedableRng};

/// `ranks` ranks sharing GPU 0 on a device with one hardware work queue.
fn one_queue(ranks: usize) -> Clique {
    static ONE_QUEUE: Once = Once::new();
    // Before any CUDA call of this process: every test starts here, and the first one waits
    // for nothing else.
    ONE_QUEUE.call_once(|| std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "1"));
    clique_on(
        Clique::builder().timeout(Duration::from_secs(3)),
        &vec![0; ranks],
    )
}

fn shared_pair_one_queue() -> Clique {
    one_queue(2)
}

/// Three ranks: the chain protocol for the larger sizes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn eager_calls_from_threads_on_three_ranks_of_one_hardware_queue() {
    let clique = one_queue(3);
    broadcast_from_threads(&clique, rng().random(), 30);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn eager_calls_from_threads_on_one_hardware_queue() {
    let clique = shared_pair_one_queue();
    broadcast_from_threads(&clique, rng().random(), 60);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_replays_beside_eager_calls_on_one_hardware_queue() {
    let clique = shared_pair_one_queue();
    let seed: u64 = rng().random();
    let p2p = BroadcastOptions::path(BroadcastPath::P2p);
    std::thread::scope(|s| {
        // Packet and pull sizes; odd, so that no copy is aligned end to end.
        for (i, n) in [1001usize, (1 << 20) + 13].into_iter().enumerate() {
            let (clique, p2p) = (&clique, &p2p);
            s.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (i as u64 + 100));
                let input: CudaSlice<u8> = clique.stream(0).alloc_zeros(n).unwrap();
                let outputs = clique.alloc_outputs::<u8>(n).unwrap();
                let mut graph = clique
                    .capture((input, outputs), |c, (input, outputs)| {
                        c.with(p2p).broadcast(0, input, outputs)
                    })
                    .unwrap();
                for step in 0..100 {
                    let data: Vec<u8> = random_vec(n, &mut rng);
                    let (input, _) = graph.buffers_mut();
                    clique.stream(0).memcpy_htod(&data, input).unwrap();
                    graph
                        .launch()
                        .unwrap_or_else(|e| panic!("{n} B, replay {step}: {e}"));
                    let (_, outputs) = graph.buffers();
                    let got = clique.stream(1).clone_dtoh(&outputs[1]).unwrap();
                    assert!(got == data, "{n} B, replay {step}: wrong data");
                }
            });
        }
        broadcast_from_threads(&clique, seed, 40);
    });
    clique.synchronize().unwrap();
}

/// A graph of several P2P broadcasts (both roots, packet and pull sizes): each rank's second
/// kernel waits for its first, so in one rank's graph it would be queued ahead of the other
/// rank's first kernel, which the first waits for. Replayed with new data each time, beside
/// eager calls from other threads.
#[test]
#[ignore = "needs a CUDA GPU"]
fn graphs_of_several_broadcasts_on_one_hardware_queue() {
    let clique = shared_pair_one_queue();
    let seed: u64 = rng().random();
    let p2p = BroadcastOptions::path(BroadcastPath::P2p);
    let cases = [(0usize, 1001usize), (1, 70_001), (0, 3000), (1, 17)];
    std::thread::scope(|s| {
        let (clique, p2p) = (&clique, &p2p);
        s.spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 7);
            let inputs: Vec<CudaSlice<u8>> = cases
                .iter()
                .map(|&(root, n)| clique.stream(root).alloc_zeros(n).unwrap())
                .collect();
            let outputs: Vec<Vec<CudaSlice<u8>>> = cases
                .iter()
                .map(|&(_, n)| clique.alloc_outputs::<u8>(n).unwrap())
                .collect();
            let mut graph = clique
                .capture((inputs, outputs), |c, (inputs, outputs)| {
                    for (i, &(root, _)) in cases.iter().enumerate() {
                        c.with(p2p).broadcast(root, &inputs[i], &mut outputs[i])?;
                    }
                    Ok(())
                })
                .unwrap();
            for step in 0..50 {
                let datas: Vec<Vec<u8>> = cases
                    .iter()
                    .map(|&(_, n)| random_vec(n, &mut rng))
                    .collect();
                let (inputs, _) = graph.buffers_mut();
                for (i, &(root, _)) in cases.iter().enumerate() {
                    clique
                        .stream(root)
                        .memcpy_htod(&datas[i], &mut inputs[i])
                        .unwrap();
                }
                graph
                    .launch()
                    .unwrap_or_else(|e| panic!("replay {step}: {e}"));
                let (_, outputs) = graph.buffers();
                for (i, data) in datas.iter().enumerate() {
                    for (rank, out) in outputs[i].iter().enumerate() {
                        let got = clique.stream(rank).clone_dtoh(out).unwrap();
                        assert!(
                            got == *data,
                            "replay {step}, broadcast {i}, rank {rank}: wrong data"
                        );
                    }
                }
            }
        });
        broadcast_from_threads(clique, seed, 20);
    });
    clique.synchronize().unwrap();
}
