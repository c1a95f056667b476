//! The copy-engine chain and the P2P kernel beyond two ranks, on the GPUs at hand: the ranks
//! are spread over the visible GPUs, and where there are fewer GPUs than ranks one GPU holds
//! several ranks (`CliqueBuilder::shared_devices`, no NCCL). With ranks 0 and 2 on GPU 0 and
//! ranks 1 and 3 on GPU 1, every hop of a chain of four crosses NVLink or stays on a device, and
//! chunks flow through every rank, as on four GPUs.
//!
//! With one GPU, all ranks sit on it; with four or more, each rank has a GPU of its own. Run
//! with `cargo test --release --test chain -- --include-ignored --test-threads 1`.

mod common;

use common::*;
use gpucast::cudarc::driver::CudaSlice;
use gpucast::prelude::*;
use gpucast::{BroadcastOptions, BroadcastPath, Clique, Element};
use rand::RngCore;

/// A clique of four ranks spread over the visible GPUs from GPU `first` ([`spread`]): on two
/// GPUs they alternate over GPUs 0 and 1 (`first` first), on one all sit on GPU 0.
fn four_ranks(first: usize) -> Clique {
    clique_on(Clique::builder(), &spread(4, first))
}

fn check<T: Element>(
    clique: &Clique,
    root: usize,
    n: usize,
    path: BroadcastPath,
    rng: &mut impl RngCore,
) {
    check_with::<T>(clique, root, n, &BroadcastOptions::path(path), rng);
}

fn check_with<T: Element>(
    clique: &Clique,
    root: usize,
    n: usize,
    options: &BroadcastOptions,
    rng: &mut impl RngCore,
) {
    let data: Vec<T> = random_vec(n, rng);
    let input = clique.stream(root).clone_htod(&data).unwrap();
    let mut outputs = poisoned_outputs::<T>(clique, n, rng);
    clique
        .with(options)
        .broadcast(root, &input, &mut outputs)
        .unwrap_or_else(|e| panic!("{} n={n} root={root} {options:?}: {e}", T::DTYPE));
    drop(input);
    clique.synchronize().unwrap();
    for (rank, out) in outputs.iter().enumerate() {
        let what = format!(
            "{} ranks, {} n={n} root={root} {options:?} rank {rank}",
            clique.len(),
            T::DTYPE
        );
        assert_bytes_eq(clique.stream(rank), out, &data, &what);
    }
}

/// Sizes that give one chunk, several chunks and a short last chunk on 3 and 4 ranks
/// (chunks are at least 4 MiB there).
const SIZES: [usize; 5] = [1, 4097, (4 << 20) + 3, (13 << 20) + 5, 40 << 20];

#[test]
#[ignore = "needs a CUDA GPU (two for NVLink hops)"]
fn four_ranks_on_two_gpus_every_root_and_path() {
    let clique = four_ranks(0);
    // NCCL needs one device per rank: where ranks share a GPU the path is off, and
    // `paths_to_test` checks that a call forced onto it is refused with its reason.
    let paths = paths_to_test(
        &clique,
        &[
            BroadcastPath::CopyEngine,
            BroadcastPath::P2p,
            BroadcastPath::Auto,
            BroadcastPath::Nccl,
        ],
    );
    let mut rng = rng();
    for root in 0..4 {
        for &bytes in &SIZES {
            for &path in &paths {
                check::<u8>(&clique, root, bytes, path, &mut rng);
            }
        }
    }
    check::<f32>(&clique, 3, 3_000_001, BroadcastPath::CopyEngine, &mut rng);
    check::<u64>(&clique, 1, 2_000_003, BroadcastPath::CopyEngine, &mut rng);
}

#[test]
#[ignore = "needs 1 CUDA GPU"]
fn three_ranks_on_one_gpu() {
    let clique = clique_on(Clique::builder(), &[0, 0, 0]);
    let mut rng = rng();
    for root in 0..3 {
        for &bytes in &SIZES {
            for path in [BroadcastPath::CopyEngine, BroadcastPath::P2p] {
                check::<u8>(&clique, root, bytes, path, &mut rng);
            }
        }
    }
}

/// In place and fused lists along the chain.
#[test]
#[ignore = "needs a CUDA GPU (two for NVLink hops)"]
fn chain_in_place_and_fused() {
    let clique = four_ranks(1);
    let mut rng = rng();
    for root in [0usize, 2, 3] {
        check_in_place::<u8>(
            &clique,
            root,
            (9 << 20) + 11,
            BroadcastPath::CopyEngine,
            &mut rng,
        );
        // Beyond 2 MiB on 4 ranks, the P2P kernel chains.
        check_in_place::<u8>(&clique, root, (9 << 20) + 11, BroadcastPath::P2p, &mut rng);
    }
    let sizes = [5usize, 0, (6 << 20) + 1, 4096, 3 << 20];
    let datas: Vec<Vec<u8>> = sizes.iter().map(|&n| random_vec(n, &mut rng)).collect();
    let inputs: Vec<CudaSlice<u8>> = datas
        .iter()
        .map(|d| clique.stream(2).clone_htod(d).unwrap())
        .collect();
    for path in [BroadcastPath::CopyEngine, BroadcastPath::P2p] {
        let mut lists = poisoned_lists(&clique, &sizes, &mut rng);
        let (ins, mut outs) = as_tensors(&inputs, &mut lists);
        let report = clique
            .with(&BroadcastOptions::path(path))
            .broadcast_many(2, &ins, &mut outs)
            .unwrap();
        match path {
            BroadcastPath::CopyEngine => assert_eq!(report.copy_engine_tensors, 4),
            // Two chained launches, one fused launch of the two small tensors.
            _ => assert_eq!((report.p2p_tensors, report.p2p_launches), (4, 3)),
        }
        drop(outs);
        clique.synchronize().unwrap();
        for (r, list) in lists.iter().enumerate() {
            for (t, buf) in list.iter().enumerate() {
                assert_bytes_eq(
                    clique.stream(r),
                    buf,
                    &datas[t],
                    &format!("fused tensor {t} rank {r} {path:?}"),
                );
            }
        }
    }
}

/// Chained P2P broadcasts queued back to back from every root, with no wait between them:
/// each rank's counters and hand-offs must line up call after call, and a rank must not
/// overwrite its output while its successor still reads the previous call's data from it.
#[test]
#[ignore = "needs a CUDA GPU (two for NVLink hops)"]
fn p2p_chain_back_to_back_from_every_root() {
    let clique = four_ranks(0);
    let mut rng = rng();
    let sizes: Vec<usize> = (0..12)
        .map(|i| match i % 3 {
            0 => (3 << 20) + 4099 * i,
            1 => (17 << 20) + i,
            _ => 100_000 + i, // a fan-out pull between chains
        })
        .collect();
    let datas: Vec<Vec<u8>> = sizes.iter().map(|&n| random_vec(n, &mut rng)).collect();
    let inputs: Vec<CudaSlice<u8>> = datas
        .iter()
        .enumerate()
        .map(|(i, d)| clique.stream(i % 4).clone_htod(d).unwrap())
        .collect();
    let mut outputs: Vec<Vec<CudaSlice<u8>>> = sizes
        .iter()
        .map(|&n| poisoned_outputs(&clique, n, &mut rng))
        .collect();
    clique.synchronize().unwrap();
    for (i, (input, outs)) in inputs.iter().zip(outputs.iter_mut()).enumerate() {
        clique
            .with(&BroadcastOptions::path(BroadcastPath::P2p))
            .broadcast(i % 4, input, outs)
            .unwrap();
    }
    // The same outputs twice in a row from different roots: the second call's data wins.
    let n = 20 << 20;
    let mut shared_outs = poisoned_outputs::<u8>(&clique, n, &mut rng);
    let (first, second): (Vec<u8>, Vec<u8>) = (random_vec(n, &mut rng), random_vec(n, &mut rng));
    let a = clique.stream(1).clone_htod(&first).unwrap();
    let b = clique.stream(3).clone_htod(&second).unwrap();
    clique
        .with(&BroadcastOptions::path(BroadcastPath::P2p))
        .broadcast(1, &a, &mut shared_outs)
        .unwrap();
    clique
        .with(&BroadcastOptions::path(BroadcastPath::P2p))
        .broadcast(3, &b, &mut shared_outs)
        .unwrap();
    drop((a, b));
    clique.synchronize().unwrap();
    for (i, outs) in outputs.iter().enumerate() {
        for (rank, out) in outs.iter().enumerate() {
            let what = format!("call {i} ({} B, root {}) rank {rank}", sizes[i], i % 4);
            assert_bytes_eq(clique.stream(rank), out, &datas[i], &what);
        }
    }
    for (rank, out) in shared_outs.iter().enumerate() {
        assert_bytes_eq(
            clique.stream(rank),
            out,
            &second,
            &format!("reused rank {rank}"),
        );
    }
}

/// The P2P chain between two ranks (two GPUs, every hop over NVLink, or both on GPU 0 when it is
/// alone), told to run at any size: every root, dtype and size, in place.
#[test]
#[ignore = "needs a CUDA GPU"]
fn p2p_chain_between_two_gpus() {
    let clique = two_ranks();
    let mut rng = rng();
    let chain = p2p_chain();
    for root in 0..2 {
        for n in [
            1usize,
            17,
            4097,
            (32 << 10) + 1,
            (1 << 20) + 3,
            (64 << 20) + 13,
        ] {
            check_with::<u8>(&clique, root, n, &chain, &mut rng);
        }
        check_with::<f32>(&clique, root, 3_000_001, &chain, &mut rng);
        check_with::<half::bf16>(&clique, root, 5_000_003, &chain, &mut rng);
        check_with::<u64>(&clique, root, 2_000_003, &chain, &mut rng);
        // In place: the root's successor reads the root's buffer itself.
        check_in_place_with::<u8>(&clique, root, (5 << 20) + 9, &chain, &mut rng);
    }
}

/// A captured chain (stream memory operations instead of events) replays with new data each
/// time, between eager calls.
#[test]
#[ignore = "needs a CUDA GPU (two for NVLink hops)"]
fn captured_chain_replays() {
    let clique = four_ranks(0);
    let mut rng = rng();
    for path in graph_paths_to_test(&clique, &[BroadcastPath::CopyEngine, BroadcastPath::P2p]) {
        captured_replays(&clique, path, &mut rng);
    }
}

fn captured_replays(clique: &Clique, path: BroadcastPath, rng: &mut impl RngCore) {
    let cases = [(0usize, (10 << 20) + 3), (3, 1000), (1, 5 << 20)];
    let mut inputs: Vec<CudaSlice<u8>> = cases
        .iter()
        .map(|&(r, n)| clique.stream(r).clone_htod(&vec![0u8; n]).unwrap())
        .collect();
    let mut outputs: Vec<Vec<CudaSlice<u8>>> = cases
        .iter()
        .map(|&(_, n)| poisoned_outputs(clique, n, rng))
        .collect();
    clique.synchronize().unwrap();
    // SAFETY: the buffers outlive the graph (dropped after it) and are written only on the
    // clique's streams, in order with the replays.
    let mut graph = unsafe {
        clique.capture_unchecked(|c| {
            for (input, (outs, &(root, _))) in inputs.iter().zip(outputs.iter_mut().zip(&cases)) {
                c.with(&BroadcastOptions::path(path))
                    .broadcast(root, input, outs)?;
            }
            Ok(())
        })
    }
    .unwrap();
    for replay in 0..4 {
        let datas: Vec<Vec<u8>> = cases.iter().map(|&(_, n)| random_vec(n, rng)).collect();
        for (i, &(root, _)) in cases.iter().enumerate() {
            clique
                .stream(root)
                .memcpy_htod(&datas[i], &mut inputs[i])
                .unwrap();
        }
        graph.launch().unwrap();
        clique.synchronize().unwrap();
        for (i, &(root, n)) in cases.iter().enumerate() {
            for (rank, out) in outputs[i].iter().enumerate() {
                assert_bytes_eq(
                    clique.stream(rank),
                    out,
                    &datas[i],
                    &format!("{path:?} replay {replay} case {i} (root {root}, {n} B) rank {rank}"),
                );
            }
        }
        check::<u8>(clique, replay % 4, (4 << 20) + 1, path, rng);
    }
}

/// A graph of many copy-engine broadcasts (each waits on flags): every rank's graph must go
/// out although the first one's device stalls on flags the second one writes. Where the two
/// ranks share GPU 0 (it is alone), such a capture is refused: both graphs' flag waits could
/// sit in one hardware queue, with no timeout; eager copy-engine calls still run.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_graph_of_many_copy_engine_broadcasts() {
    let clique = two_ranks();
    let mut rng = rng();
    let n = 256 << 10;
    let data: Vec<u8> = random_vec(n, &mut rng);
    let mut input = clique.stream(0).clone_htod(&vec![0u8; n]).unwrap();
    let mut outputs = poisoned_outputs::<u8>(&clique, n, &mut rng);
    let ce = BroadcastOptions::path(BroadcastPath::CopyEngine);
    if shares_a_gpu(&clique) {
        let refused = clique.capture((&mut input, &mut outputs), |c, (input, outputs)| {
            c.with(&ce).broadcast(0, input, outputs)
        });
        assert!(
            matches!(refused, Err(gpucast::Error::CopyEngineUnavailable(ref m)) if m.contains("graph")),
            "a copy-engine capture on a shared GPU: {:?}",
            refused.err()
        );
        // Auto in a graph takes another path there, even where told to take the copy engines
        // from one byte on.
        let auto = BroadcastOptions::default().copy_engine_threshold(1);
        assert_eq!(
            clique.route(n, &auto).unwrap(),
            gpucast::Route::CopyEngine,
            "eager"
        );
        clique.stream(0).memcpy_htod(&data, &mut input).unwrap();
        let mut graph = clique
            .capture((&mut input, &mut outputs), |c, (input, outputs)| {
                let route = c.route(n, &auto)?;
                assert!(
                    route.is_p2p(),
                    "Auto in a graph on a shared GPU took {route:?}"
                );
                c.with(&auto).broadcast(0, input, outputs)
            })
            .unwrap();
        graph.launch().unwrap();
        drop(graph);
        for (rank, out) in outputs.iter().enumerate() {
            assert_bytes_eq(
                clique.stream(rank),
                out,
                &data,
                &format!("Auto graph, rank {rank}"),
            );
        }
        let fresh: Vec<u8> = random_vec(n, &mut rng);
        clique.stream(0).memcpy_htod(&fresh, &mut input).unwrap();
        clique.with(&ce).broadcast(0, &input, &mut outputs).unwrap();
        for (rank, out) in outputs.iter().enumerate() {
            assert_bytes_eq(
                clique.stream(rank),
                out,
                &fresh,
                &format!("eager, rank {rank}"),
            );
        }
        return;
    }
    // SAFETY: the buffers outlive the graph (dropped after it) and are written only on the
    // clique's streams, in order with the replays.
    let mut graph = unsafe {
        clique.capture_unchecked(|c| {
            for _ in 0..1000 {
                c.with(&BroadcastOptions::path(BroadcastPath::CopyEngine))
                    .broadcast(0, &input, &mut outputs)?;
            }
            Ok(())
        })
    }
    .unwrap();
    for replay in 0..3 {
        clique.stream(0).memcpy_htod(&data, &mut input).unwrap();
        graph.launch().unwrap();
        clique.synchronize().unwrap();
        for (rank, out) in outputs.iter().enumerate() {
            assert_bytes_eq(
                clique.stream(rank),
                out,
                &data,
                &format!("replay {replay} rank {rank}"),
            );
        }
    }
}
