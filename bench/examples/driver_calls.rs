//! What the host pays per driver call that an eager broadcast makes, on GPU 0: an empty kernel
//! launch, an event record, a stream's wait for an event, the context lookup cudarc does before
//! each of them, and one cudarc access guard (wait, then record on drop) of a tracked buffer.
//! Each figure is the median over 9 rounds of 20 000 calls, host time, nothing synchronised
//! inside a round.
//!
//! `cargo run --release -p gpucast-bench --example driver_calls`

use std::time::Instant;

use anyhow::Result;
use gpucast::cudarc;
use gpucast::cudarc::driver::{result, CudaContext, DevicePtrMut};

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
    println!("# host time per call, GPU 0, median of 9 rounds of {CALLS} calls");
    for (name, ns) in rows {
        println!("{name:<40} {:>8.0} ns", ns);
    }
    Ok(())
}
