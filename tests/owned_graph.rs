//! Graphs that own their buffers (`Clique::capture_owned`): inputs rewritten and outputs read
//! between replays from safe code, on other streams than the clique's; a buffer replaced while
//! lent out, and a buffer the graph does not own, are errors before anything is queued.

mod common;

use common::*;
use gpucast::cudarc::driver::CudaSlice;
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
    {
        paths.push(BroadcastPath::CopyEngine);
    }
    paths
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_owned_graph_lends_its_buffers_between_replays() {
    let clique = two_ranks();
    let mut rng = rng();
    for path in paths(&clique) {
        let opts = BroadcastOptions::path(path);
        let input: CudaSlice<u8> = clique.stream(0).alloc_zeros(N).unwrap();
        let outputs = clique.alloc_outputs::<u8>(N).unwrap();
        let mut graph = clique
            .capture_owned((input, outputs), |c, (input, outputs)| {
                c.broadcast_with(0, input, outputs, &opts)
            })
            .unwrap_or_else(|e| panic!("{path:?}: capture: {e}"));
        for step in 0..5 {
            let data: Vec<u8> = random_vec(N, &mut rng);
            let (input, outputs) = graph.buffers_mut();
            // Written on the context's default stream, not the clique's: the launch must wait.
            let default0 = clique.context(0).default_stream();
            default0.memcpy_htod(&data, input).unwrap();
            for (r, out) in outputs.iter_mut().enumerate() {
                clique
                    .context(r)
                    .default_stream()
                    .memset_zeros(out)
                    .unwrap();
            }
            graph.launch().unwrap();
            // Read on the default streams right after the launch returned: ordered after it.
            let (_, outputs) = graph.buffers();
            for (r, out) in outputs.iter().enumerate() {
                let got = clique.context(r).default_stream().clone_dtoh(out).unwrap();
                assert!(
                    got == data,
                    "{path:?} step {step}: rank {r}'s output differs from the input"
                );
            }
        }
        let (input, _) = graph.into_buffers();
        drop(input);
        clique.synchronize().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_buffer_replaced_while_lent_out_makes_the_launch_an_error() {
    let clique = two_ranks();
    let input: CudaSlice<u8> = clique.stream(0).alloc_zeros(N).unwrap();
    let outputs = clique.alloc_outputs::<u8>(N).unwrap();
    let mut graph = clique
        .capture_owned((input, outputs), |c, (input, outputs)| {
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
    assert_eq!(clique.calls(), calls, "nothing may be queued");
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
    let captured = clique.capture_owned(outputs, |c, outputs| c.broadcast(0, &outside, outputs));
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
