//! Memory that cudarc does not own (`ExternalSlice`): a raw `cuMemAlloc` allocation and a
//! stream of the caller's own, as a framework (torch, CuPy, tch-rs) hands them over. Each call
//! is ordered with that stream both ways, and the address is checked against its allocation.
//!
//! Every test adapts to the GPUs present (two ranks on GPUs 0 and 1, or sharing GPU 0). Run
//! with `cargo test --release --test external -- --include-ignored --test-threads 1`.

mod common;

use gpucast::prelude::*;
use std::sync::Arc;

use common::*;
use gpucast::cudarc::driver::{result, CudaStream};
use gpucast::{BroadcastOptions, BroadcastPath, Clique, Error, ExternalSlice};

/// A raw allocation of `bytes` on `clique`'s rank `rank`, freed on drop (after its work).
struct Raw {
    ptr: u64,
    stream: Arc<CudaStream>,
}

impl Raw {
    fn new(clique: &Clique, rank: usize, bytes: usize, stream: &Arc<CudaStream>) -> Raw {
        clique.context(rank).bind_to_thread().unwrap();
        // SAFETY: a plain allocation in the bound (primary) context, freed in `drop`.
        let ptr = unsafe { result::malloc_sync(bytes) }.expect("cuMemAlloc");
        Raw {
            ptr,
            stream: stream.clone(),
        }
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        self.stream.synchronize().unwrap();
        // SAFETY: allocated by `Raw::new`; the work on its stream has finished.
        unsafe { result::free_sync(self.ptr) }.unwrap();
    }
}

/// A stream created outside cudarc (as another library's), wrapped for ordering.
fn foreign_stream(clique: &Clique, rank: usize) -> Arc<CudaStream> {
    let ctx = clique.context(rank);
    ctx.bind_to_thread().unwrap();
    let raw = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
    // SAFETY: `raw` is a live stream of `ctx`, never destroyed in this test process (a leak of
    // one stream per test), and every use of it is ordered here.
    unsafe { ctx.wrap_borrowed_stream(raw) }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn external_memory_on_a_stream_of_its_own_is_ordered_both_ways() {
    let clique = two_ranks();
    let mut rng = rng();
    for (path, n) in [
        (BroadcastPath::P2p, 1024usize),
        (BroadcastPath::P2p, 1 << 20),
        (BroadcastPath::CopyEngine, 1 << 20),
    ] {
        let streams: Vec<_> = (0..clique.len())
            .map(|r| foreign_stream(&clique, r))
            .collect();
        let input = Raw::new(&clique, 0, n * 4, &streams[0]);
        let outs: Vec<Raw> = (0..clique.len())
            .map(|r| Raw::new(&clique, r, n * 4, &streams[r]))
            .collect();
        // SAFETY: each range is a live cuMemAlloc allocation of its rank's device, freed only
        // after its stream finished; the streams are live streams of those contexts.
        let mut input_buf =
            unsafe { ExternalSlice::<f32>::new(input.ptr, n, streams[0].clone()) }.unwrap();
        let mut out_bufs: Vec<ExternalSlice<f32>> = outs
            .iter()
            .enumerate()
            // SAFETY: as above.
            .map(|(r, o)| unsafe { ExternalSlice::new(o.ptr, n, streams[r].clone()) }.unwrap())
            .collect();
        assert!(input_buf.is_plain_allocation());
        for (r, o) in out_bufs.iter_mut().enumerate() {
            let poison: Vec<f32> = random_vec(n, &mut rng);
            streams[r].memcpy_htod(&poison, o).unwrap();
        }
        let data: Vec<f32> = random_vec(n, &mut rng);
        // The write of the input, on its own stream, lands 200 ms late: the call waits for it.
        stall_stream(&streams[0], 200);
        streams[0].memcpy_htod(&data, &mut input_buf).unwrap();
        // The clique's own last rank held back: work on the outputs' streams after the call
        // must wait for the broadcast.
        stall(&clique, clique.len() - 1, 200);
        clique
            .with(&BroadcastOptions::path(path))
            .broadcast(0, &input_buf, &mut out_bufs)
            .unwrap();
        for (r, o) in out_bufs.iter().enumerate() {
            assert_bytes_eq(&streams[r], o, &data, &format!("{path:?} {n} rank {r}"));
        }
        clique.synchronize().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn external_memory_is_checked_against_its_allocation() {
    let clique = two_ranks();
    let stream = foreign_stream(&clique, 0);
    let raw = Raw::new(&clique, 0, 4096, &stream);
    // SAFETY: a live allocation of 4096 bytes of GPU 0 and a live stream of its context.
    let ok = unsafe { ExternalSlice::<f32>::new(raw.ptr, 1024, stream.clone()) }.unwrap();
    assert!(ok.is_plain_allocation());
    // SAFETY: only the checks run (it is never used for work); the stream is live.
    let past = unsafe { ExternalSlice::<f32>::new(raw.ptr, 1025, stream.clone()) };
    assert!(
        matches!(&past, Err(Error::InvalidArgument(m)) if m.contains("past the end")),
        "{past:?}"
    );
    // SAFETY: only the checks run (it is never used for work); the stream is live.
    let misaligned = unsafe { ExternalSlice::<f32>::new(raw.ptr + 2, 4, stream.clone()) };
    assert!(
        matches!(&misaligned, Err(Error::InvalidArgument(m)) if m.contains("aligned")),
        "{misaligned:?}"
    );
    let host = [0u8; 64];
    // SAFETY: only the checks run (it is never used for work); the stream is live.
    let on_host = unsafe { ExternalSlice::<u8>::new(host.as_ptr() as u64, 64, stream.clone()) };
    assert!(
        matches!(&on_host, Err(Error::InvalidArgument(m)) if m.contains("not device memory")),
        "{on_host:?}"
    );
    // SAFETY: only the checks run (it is never used for work); the stream is live.
    let empty = unsafe { ExternalSlice::<f32>::new(0, 0, stream.clone()) }.unwrap();
    assert!(empty.is_plain_allocation());
    // Memory of the stream-ordered pool (what cudarc allocates) is not a plain allocation.
    let pooled = clique.stream(0).alloc_zeros::<f32>(1024).unwrap();
    let (ptr, _guard) = gpucast::cudarc::driver::DevicePtr::device_ptr(&pooled, clique.stream(0));
    // SAFETY: only the checks run (it is never used for work); the stream is live.
    let pool = unsafe { ExternalSlice::<f32>::new(ptr, 1024, clique.stream(0).clone()) }.unwrap();
    assert!(!pool.is_plain_allocation(), "pool memory reported plain");
    if clique.context(1).ordinal() != 0 {
        // Memory of GPU 0 named with a stream of GPU 1.
        let other = foreign_stream(&clique, 1);
        // SAFETY: only the checks run (it is never used for work); the stream is live.
        let wrong = unsafe { ExternalSlice::<f32>::new(raw.ptr, 16, other) };
        assert!(matches!(wrong, Err(Error::WrongDevice { .. })), "{wrong:?}");
    }
    // Against a known allocation (`raw`'s, still allocated): the same checks and errors.
    let known = [ok.allocation().expect("a checked allocation")];
    assert_eq!(empty.allocation(), None);
    // SAFETY: only the checks run (it is never used for work); `raw` is still allocated.
    let inside =
        unsafe { ExternalSlice::<f32>::new_in(raw.ptr + 1024, 768, stream.clone(), &known) };
    assert_eq!(inside.unwrap().allocation(), ok.allocation());
    // SAFETY: as above.
    let past = unsafe { ExternalSlice::<f32>::new_in(raw.ptr + 1024, 769, stream.clone(), &known) };
    assert!(
        matches!(&past, Err(Error::InvalidArgument(m)) if m.contains("past the end")),
        "{past:?}"
    );
    // Outside it, the driver is asked: the pool's memory is still found not plain.
    // SAFETY: as above; the pool's memory is still allocated.
    let pool = unsafe { ExternalSlice::<f32>::new_in(ptr, 1024, clique.stream(0).clone(), &known) };
    assert!(
        !pool.unwrap().is_plain_allocation(),
        "pool memory reported plain"
    );
    if clique.context(1).ordinal() != 0 {
        let other = foreign_stream(&clique, 1);
        // SAFETY: as above.
        let wrong = unsafe { ExternalSlice::<f32>::new_in(raw.ptr, 16, other, &known) };
        assert!(matches!(wrong, Err(Error::WrongDevice { .. })), "{wrong:?}");
    }
}
