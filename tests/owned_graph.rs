//! Graphs that own their buffers (`Clique::capture`): inputs rewritten and outputs read
//! between replays from safe code, on other streams than the clique's; a buffer replaced while
//! lent out, and a buffer the graph does not own, are errors before anything is queued.

mod common;

use common::*;
use gpucast::cudarc::driver::CudaSlice;
use gpucast::prelude::*;
use gpucast::{BroadcastOptions, BroadcastPath, Clique, Error};

/// Bytes per broadcast: above the packet limit, and odd.
const N: usize = (1 << 20) + 13;

fn paths(clique: &Clique) -> Vec<BroadcastPath> {
    let mut paths = vec![BroadcastPath::Auto];
    if clique.p2p_available().is_ok() {
        paths.push(BroadcastPath::P2p);
    }
    if clique
        .route(N, &BroadcastOptions::path(BroadcastPath::CopyEngine))
        .is_ok()
        && !graph_paths_to_test(clique, &[BroadcastPath::CopyEngine]).is_empty()
    {
        paths.push(BroadcastPath::CopyEngine);
    }
    paths
}

/// How long the tests hold a stream back, so that work that is not ordered runs first.
const HOLD_MS: u64 = 200;

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_owned_graph_lends_its_buffers_between_replays() {
    let clique = two_ranks();
    let mut rng = rng();
    // The input lives on a stream of the caller's (not the clique's): the launch orders it
    // through that stream too.
    let user = clique.context(0).new_stream().unwrap();
    for path in paths(&clique) {
        let opts = BroadcastOptions::path(path);
        let input: CudaSlice<u8> = user.alloc_zeros(N).unwrap();
        let outputs = clique.alloc_outputs::<u8>(N).unwrap();
        let mut graph = clique
            .capture((input, outputs), |c, (input, outputs)| {
                c.with(&opts).broadcast(0, input, outputs)
            })
            .unwrap_or_else(|e| panic!("{path:?}: capture: {e}"));
        for step in 0..3 {
            let data: Vec<u8> = random_vec(N, &mut rng);
            let (input, outputs) = graph.buffers_mut();
            // Written on the context's default stream, held back first: a launch that did not
            // wait for it would broadcast the previous input.
            let default0 = clique.context(0).default_stream();
            stall_stream(&default0, HOLD_MS);
            default0.memcpy_htod(&data, input).unwrap();
            for (r, out) in outputs.iter_mut().enumerate() {
                clique
                    .context(r)
                    .default_stream()
                    .memset_zeros(out)
                    .unwrap();
            }
            // The replay itself held back: a read that did not wait for it would see zeros.
            stall(&clique, 1, HOLD_MS);
            graph.launch().unwrap();
            let (_, outputs) = graph.buffers();
            for (r, out) in outputs.iter().enumerate() {
                let got = clique.context(r).default_stream().clone_dtoh(out).unwrap();
                assert!(
                    got == data,
                    "{path:?} step {step}: rank {r}'s output differs from the input"
                );
            }
        }
        // Handed back and dropped at once, on their streams: ordered after the last replay.
        let (input, outputs) = graph.into_buffers();
        drop((input, outputs));
        clique.synchronize().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn owned_graphs_of_in_place_and_fused_calls_replay_what_was_written() {
    let clique = two_ranks();
    let mut rng = rng();
    // An in-place broadcast from rank 1, and a fused one of two tensors from rank 0.
    let first = clique.alloc_outputs::<u8>(4096).unwrap();
    let lens = [N, 77];
    let inputs: Vec<CudaSlice<u8>> = lens
        .iter()
        .map(|&n| clique.stream(0).alloc_zeros(n).unwrap())
        .collect();
    let outputs: Vec<Vec<CudaSlice<u8>>> = (0..clique.len())
        .map(|r| {
            lens.iter()
                .map(|&n| clique.stream(r).alloc_zeros(n).unwrap())
                .collect()
        })
        .collect();
    let mut graph = clique
        .capture((first, inputs, outputs), |c, (first, inputs, outputs)| {
            c.broadcast_in_place(1, first)?;
            let ins: Vec<&dyn gpucast::DeviceTensor> = inputs
                .iter()
                .map(|t| t as &dyn gpucast::DeviceTensor)
                .collect();
            let mut lists: Vec<Vec<&mut dyn gpucast::DeviceTensorMut>> = outputs
                .iter_mut()
                .map(|l| {
                    l.iter_mut()
                        .map(|b| b as &mut dyn gpucast::DeviceTensorMut)
                        .collect()
                })
                .collect();
            c.broadcast_many(0, &ins, &mut lists).map(|_| ())
        })
        .unwrap();
    for step in 0..2 {
        let (first, inputs, _) = graph.buffers_mut();
        let once: Vec<u8> = random_vec(4096, &mut rng);
        clique.stream(1).memcpy_htod(&once, &mut first[1]).unwrap();
        let mut many = Vec::new();
        for (t, input) in inputs.iter_mut().enumerate() {
            let data: Vec<u8> = random_vec(lens[t], &mut rng);
            clique.stream(0).memcpy_htod(&data, input).unwrap();
            many.push(data);
        }
        graph.launch().unwrap();
        let (first, _, outputs) = graph.buffers();
        for r in 0..clique.len() {
            let what = format!("step {step}, rank {r}");
            assert_bytes_eq(
                clique.stream(r),
                &first[r],
                &once,
                &format!("{what}, in place"),
            );
            for (t, want) in many.iter().enumerate() {
                assert_bytes_eq(
                    clique.stream(r),
                    &outputs[r][t],
                    want,
                    &format!("{what}, tensor {t}"),
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_buffer_replaced_while_lent_out_makes_the_launch_an_error() {
    let clique = two_ranks();
    let input: CudaSlice<u8> = clique.stream(0).alloc_zeros(N).unwrap();
    let outputs = clique.alloc_outputs::<u8>(N).unwrap();
    let mut graph = clique
        .capture((input, outputs), |c, (input, outputs)| {
            c.broadcast(0, input, outputs)
        })
        .unwrap();
    graph.launch().unwrap();
    clique.synchronize().unwrap();
    // A shorter buffer in place of the input: the captured range is no longer inside it.
    let (input, outputs) = graph.buffers_mut();
    *input = clique.stream(0).alloc_zeros(N / 2).unwrap();
    let poison = vec![0xA5u8; N];
    for (r, out) in outputs.iter_mut().enumerate() {
        clique.stream(r).memcpy_htod(&poison, out).unwrap();
    }
    let calls = clique.calls();
    match graph.launch() {
        Err(Error::InvalidArgument(why)) => assert!(why.contains("replaced"), "{why}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert_eq!(clique.calls(), calls, "the graph must not be launched");
    clique.synchronize().unwrap();
    for (r, out) in graph.buffers().1.iter().enumerate() {
        assert_bytes_eq(clique.stream(r), out, &poison, &format!("rank {r}"));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_buffer_the_graph_does_not_own_is_refused_at_capture() {
    let clique = two_ranks();
    let outside: CudaSlice<u8> = clique.stream(0).alloc_zeros(N).unwrap();
    let outputs = clique.alloc_outputs::<u8>(N).unwrap();
    let captured = clique.capture(outputs, |c, outputs| c.broadcast(0, &outside, outputs));
    match captured {
        Err(Error::InvalidArgument(why)) => assert!(why.contains("not inside"), "{why}"),
        Err(e) => panic!("expected InvalidArgument, got {e}"),
        Ok(_) => panic!("a graph that reads a buffer it does not own was made"),
    }
    // The clique is usable afterwards.
    let mut outputs = clique.alloc_outputs::<u8>(N).unwrap();
    clique.broadcast(0, &outside, &mut outputs).unwrap();
    clique.synchronize().unwrap();
}
