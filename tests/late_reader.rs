//! A reader that has claimed its owner's buffer (a P2P pull peer reading the root's input, a
//! chain rank reading its predecessor's) is still copying when its owner's wait for it runs
//! into a tiny timeout. The owner's kernel must not end while the reader reads: once it has
//! ended, the owner's stream moves on and the caller may overwrite or free the buffer (every
//! buffer may be reused as soon as a call returns). Every rank must end with either the root's
//! data, bit for bit, or an error, and never with bytes the caller wrote into the root's buffer
//! after the call.
//!
//! The ranks share the GPUs present (all on GPU 0 where it is alone, `shared_devices`), so a
//! reader copies 1 GiB for milliseconds while the root's wait times out after 200 us.
//!
//! `cargo test --release --test late_reader -- --include-ignored --test-threads 1`

mod common;

use gpucast::prelude::*;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use gpucast::cudarc::driver::{CudaSlice, CudaStream};
use gpucast::{BroadcastOptions, BroadcastPath, Clique, Error, Route};

/// The clique's timeout: far shorter than a reader's copy of [`BYTES`].
const TIMEOUT: Duration = Duration::from_micros(200);
/// Bytes of each broadcast: odd, so that the copies have a head and a tail.
const BYTES: usize = (1 << 30) + 3;
/// Bytes of the pattern the buffers are tiled with.
const CHUNK: usize = 4 << 20;
/// What the peers' buffers hold before the broadcast (no zero byte, and not the root's data).
const POISON: u8 = 0x5a;

/// A buffer of `n` bytes on `stream`: `chunk` repeated.
fn tiled(stream: &Arc<CudaStream>, chunk: &[u8], n: usize) -> CudaSlice<u8> {
    let src = stream.clone_htod(chunk).expect("upload");
    let mut buf = stream.alloc_zeros::<u8>(n).expect("alloc");
    let mut off = 0;
    while off < n {
        let len = chunk.len().min(n - off);
        stream
            .memcpy_dtod(&src.slice(..len), &mut buf.slice_mut(off..off + len))
            .expect("tile");
        off += len;
    }
    buf
}

/// How `got` compares with `chunk` repeated: the bytes that differ, and the zero bytes (the
/// root's data and the poison hold none: a zero was read after the caller zeroed the root's
/// buffer).
fn compare(got: &[u8], chunk: &[u8]) -> (usize, usize) {
    let mut differ = 0;
    let mut zeros = 0;
    for (i, &g) in got.iter().enumerate() {
        differ += usize::from(g != chunk[i % chunk.len()]);
        zeros += usize::from(g == 0);
    }
    (differ, zeros)
}

/// Rounds of one in-place broadcast of [`BYTES`] from rank 0 on `ranks` ranks with `options`
/// (which must take `route`), rank 1 held back `stalls[round]` ms first (0: not held back). As
/// soon as the call returns, the caller zeroes the root's buffer on the root's stream. After
/// `synchronize`, a rank's buffer holds the root's data (when the call succeeded), or no byte
/// of the zeroing (when it failed: a timeout).
fn late_readers(ranks: usize, options: &BroadcastOptions, route: Route, stalls: &[u64]) {
    let devices = spread(ranks, 0);
    let clique = clique_on(
        Clique::builder().timeout(TIMEOUT).parallel_launch(false),
        &devices,
    );
    clique
        .p2p_available()
        .expect("P2P between the ranks of this test");
    assert_eq!(clique.route(BYTES, options).unwrap(), route);
    let mut rng = rng();
    let poison = vec![POISON; CHUNK];
    let (mut succeeded, mut failed) = (0, 0);
    for (round, &stall_ms) in stalls.iter().enumerate() {
        let mut data: Vec<u8> = random_vec(CHUNK, &mut rng);
        for b in &mut data {
            if *b == 0 || *b == POISON {
                *b = 1;
            }
        }
        let mut bufs: Vec<CudaSlice<u8>> = (0..ranks)
            .map(|r| {
                let fill = if r == 0 { &data } else { &poison };
                tiled(clique.stream(r), fill, BYTES)
            })
            .collect();
        clique.synchronize().expect("setting up the buffers");
        if stall_ms > 0 {
            stall(&clique, 1, stall_ms);
        }
        let queued = clique.with(options).broadcast_in_place(0, &mut bufs);
        // The caller reuses the root's buffer as soon as the call returns, on the root's
        // stream: ordered after the broadcast there, as the contract promises.
        clique
            .stream(0)
            .memset_zeros(&mut bufs[0])
            .expect("zeroing the root's buffer");
        let outcome = queued.and_then(|()| clique.synchronize());
        match &outcome {
            Ok(()) => succeeded += 1,
            Err(Error::Timeout { .. }) => failed += 1,
            Err(e) => panic!("round {round}: an error other than a timeout: {e}"),
        }
        for (rank, buf) in bufs.iter().enumerate().skip(1) {
            let got: Vec<u8> = clique.stream(rank).clone_dtoh(buf).expect("download");
            let (differ, zeros) = compare(&got, &data);
            eprintln!(
                "round {round} (rank 1 held back {stall_ms} ms): rank {rank} {} with {differ} \
                 bytes differing from the root's data, {zeros} zeroed",
                if outcome.is_ok() {
                    "succeeded"
                } else {
                    "failed"
                }
            );
            assert_eq!(
                zeros, 0,
                "round {round}, rank {rank}: {zeros} bytes read from the root's buffer after \
                 the caller zeroed it (the root's kernel ended while this rank still read it); \
                 outcome {outcome:?}"
            );
            if outcome.is_ok() {
                assert_eq!(
                    differ, 0,
                    "round {round}, rank {rank}: the call succeeded with wrong data"
                );
            }
        }
    }
    eprintln!("{succeeded} rounds succeeded, {failed} failed with a timeout");
}

/// Rounds on `ranks` ranks, with rank 1 on time, held back 1 ms, on time, held back 5 ms.
const STALLS: [u64; 5] = [0, 0, 1, 0, 5];

/// The pull protocol: every peer reads the root's buffer; the root's wait for the peers times
/// out after 200 us while they copy 1 GiB each.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_late_pull_reader_never_reads_a_buffer_the_caller_reused() {
    let pull = BroadcastOptions::path(BroadcastPath::P2p)
        .packet_threshold(0)
        .p2p_chain_threshold(usize::MAX);
    late_readers(4, &pull, Route::P2pPull, &STALLS);
}

/// The chain protocol: rank 1 reads the root's buffer piece by piece, rank 2 reads rank 1's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_late_chain_reader_never_reads_a_buffer_the_caller_reused() {
    late_readers(3, &p2p_chain(), Route::P2pChain, &STALLS);
}
