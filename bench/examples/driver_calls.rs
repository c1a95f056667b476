//! What the host pays per driver call that an eager broadcast makes, on GPU 0: an empty kernel
//! launch, an event record, a stream's wait for an event, the context lookup cudarc does before
//! each of them, and one cudarc access guard (wait, then record on drop) of a tracked buffer.
//! Then, on a clique of GPU 0 alone, what one eager NCCL broadcast of 1 KiB costs the host:
//! `ncclBroadcast` in a group on communicators of its own, the same with cudarc's guards of
//! the two buffers, and gpucast's NCCL path with its watchdog off and on.
//! Each figure is the median over 9 rounds of 20 000 calls, host time, nothing synchronised
//! inside a round (the NCCL rows synchronise every 500 calls).
//!
//! `cargo run --release -p gpucast-bench --example driver_calls`

use gpucast::prelude::*;
use std::time::Instant;

use anyhow::Result;
#[allow(
    dead_code,
    reason = "the bench's module; only its one-process part is used here"
)]
#[path = "../benches/procs/nccl.rs"]
mod nccl;

use gpucast::cudarc;
use gpucast::cudarc::driver::{result, CudaContext, DevicePtr, DevicePtrMut};
use gpucast::{BroadcastOptions, BroadcastPath, Clique};

const CALLS: usize = 20_000;

fn median_ns(mut round: impl FnMut() -> Result<()>, sync: impl Fn() -> Result<()>) -> Result<f64> {
    let mut per_call = Vec::new();
    for _ in 0..9 {
        let t0 = Instant::now();
        for _ in 0..CALLS {
            round()?;
        }
        per_call.push(t0.elapsed().as_secs_f64() * 1e9 / CALLS as f64);
        sync()?;
    }
    per_call.sort_by(f64::total_cmp);
    Ok(per_call[per_call.len() / 2])
}

fn main() -> Result<()> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let sync = || Ok(stream.synchronize()?);
    let ptx = cudarc::nvrtc::compile_ptx("extern \"C\" __global__ void empty() {}")?;
    let func = ctx.load_module(ptx)?.load_function("empty")?;
    let event = ctx.new_event(None)?;
    let mut buf = stream.alloc_zeros::<u8>(1024)?;
    anyhow::ensure!(
        ctx.is_managing_stream_synchronization(),
        "cudarc does not track buffers here"
    );
    let mut rows = Vec::new();

    rows.push((
        "cuCtxGetCurrent",
        median_ns(|| Ok(result::ctx::get_current().map(drop)?), sync)?,
    ));
    rows.push((
        "cuEventRecord",
        median_ns(|| Ok(event.record(&stream)?), sync)?,
    ));
    rows.push((
        "cuStreamWaitEvent (same stream)",
        median_ns(|| Ok(stream.wait(&event)?), sync)?,
    ));
    rows.push((
        "cuLaunchKernel (empty)",
        median_ns(
            || {
                // SAFETY: the empty kernel takes no parameters; the stream is live.
                unsafe {
                    result::launch_kernel(
                        func.cu_function(),
                        (1, 1, 1),
                        (32, 1, 1),
                        0,
                        stream.cu_stream(),
                        &mut [],
                    )
                }?;
                Ok(())
            },
            sync,
        )?,
    ));
    for tracked in [true, false] {
        if !tracked {
            // SAFETY: nothing else uses this context while tracking is off; turned back on below.
            unsafe { ctx.disable_event_tracking() };
        }
        let t = median_ns(
            || {
                let (_p, g) = buf.device_ptr_mut(&stream);
                drop(g);
                Ok(())
            },
            sync,
        )?;
        rows.push((
            if tracked {
                "guard of a written buffer, tracked"
            } else {
                "guard of a written buffer, untracked"
            },
            t,
        ));
        // SAFETY: restores the default.
        unsafe { ctx.enable_event_tracking() };
    }
    let clique = Clique::new(&[0])?;
    let s0 = clique.stream(0).clone();
    let input = s0.alloc_zeros::<u8>(1024)?;
    let mut outputs = clique.alloc_outputs::<u8>(1024)?;
    let raw = nccl::RawNcclAll::new(&[0])?;
    let (src, dst) = (input.device_ptr(&s0).0, outputs[0].device_ptr(&s0).0);
    let every = std::cell::Cell::new(0usize);
    let paced = |f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
        f()?;
        every.set(every.get() + 1);
        if every.get().is_multiple_of(500) {
            clique.synchronize()?;
        }
        Ok(())
    };
    let csync = || Ok(clique.synchronize()?);
    let nccl = BroadcastOptions::path(BroadcastPath::Nccl);
    rows.push((
        "ncclBroadcast, one group, raw pointers",
        median_ns(
            || {
                // SAFETY: 1 KiB buffers of GPU 0, alive until the end; one stream.
                paced(&mut || unsafe { raw.broadcast(0, src, &[dst], 1024, &[s0.cu_stream()]) })
            },
            csync,
        )?,
    ));
    rows.push((
        "the same with cudarc's guards of both",
        median_ns(
            || {
                paced(&mut || {
                    let (a, ga) = input.device_ptr(&s0);
                    let (b, gb) = outputs[0].device_ptr_mut(&s0);
                    // SAFETY: as above.
                    unsafe { raw.broadcast(0, a, &[b], 1024, &[s0.cu_stream()]) }?;
                    drop((ga, gb));
                    Ok(())
                })
            },
            csync,
        )?,
    ));
    for on in [false, true] {
        clique.set_watchdog(on);
        let t = median_ns(
            || paced(&mut || Ok(clique.with(&nccl).broadcast(0, &input, &mut outputs)?)),
            csync,
        )?;
        rows.push((
            if on {
                "gpucast NCCL path"
            } else {
                "gpucast NCCL path, watchdog off"
            },
            t,
        ));
    }
    println!("# host time per call, GPU 0, median of 9 rounds of {CALLS} calls");
    for (name, ns) in rows {
        println!("{name:<40} {:>8.0} ns", ns);
    }
    Ok(())
}
