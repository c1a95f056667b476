//! Whether work on a fresh stream waits behind unrelated work on another stream of the same
//! context. A stream held by a host function that sleeps 3 s stands for a caller's long work;
//! then 16 fresh streams are made one after the other (the driver maps streams onto its
//! hardware queues, `CUDA_DEVICE_MAX_CONNECTIONS` of them, 8 by default), each with one small
//! memset, and the time until each is idle is printed. A stream that shares a hardware queue
//! with the held one waits the whole 3 s. Done for streams of default priority and for
//! streams of the greatest priority.
//!
//! `cargo run --release -p gpucast-bench --example queue_aliasing`

use std::ffi::c_void;
use std::time::{Duration, Instant};

use anyhow::Result;
use gpucast::cudarc::driver::sys;
use gpucast::cudarc::driver::{result, CudaContext};

const HOLD_MS: u64 = 3000;

extern "C" fn sleep_host(ms: *mut c_void) {
    std::thread::sleep(Duration::from_millis(ms as u64));
}

/// Milliseconds until `stream` is idle, polled every 100 us, at most 5 s.
fn idle_after(stream: sys::CUstream, t0: Instant) -> Result<f64> {
    loop {
        // SAFETY: a live stream made by the caller.
        let r = unsafe { sys::cuStreamQuery(stream) };
        if r == sys::CUresult::CUDA_SUCCESS || t0.elapsed() > Duration::from_secs(5) {
            return Ok(t0.elapsed().as_secs_f64() * 1e3);
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

fn main() -> Result<()> {
    let ctx = CudaContext::new(0)?;
    ctx.bind_to_thread()?;
    let (least, greatest) = result::stream::get_priority_range()?;
    println!("# priorities: least {least}, greatest {greatest}");
    println!(
        "# CUDA_DEVICE_MAX_CONNECTIONS={}",
        std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").unwrap_or_else(|_| "unset".into())
    );
    // SAFETY: a plain allocation in the current context, freed at the end.
    let buf = unsafe { result::malloc_sync(4096) }?;
    for (name, priority) in [("default", 0), ("greatest", greatest)] {
        let held = result::stream::create(result::stream::StreamKind::NonBlocking)?;
        // SAFETY: the callback only sleeps; its argument is a plain integer.
        unsafe { result::stream::launch_host_function(held, sleep_host, HOLD_MS as *mut c_void) }?;
        let mut row = Vec::new();
        for _ in 0..16 {
            let s = result::stream::create_with_priority(
                result::stream::StreamKind::NonBlocking,
                priority,
            )?;
            let t0 = Instant::now();
            // SAFETY: `buf` holds 4096 bytes of this context; `s` is live.
            unsafe { sys::cuMemsetD32Async(buf, 0, 1024, s) }.result()?;
            row.push(idle_after(s, t0)?);
            // SAFETY: made above, used nowhere else.
            unsafe { result::stream::destroy(s) }?;
        }
        let waited = row.iter().filter(|&&ms| ms > 100.0).count();
        println!(
            "{name:>9} priority: {waited} of 16 fresh streams waited for the held one; ms: {}",
            row.iter()
                .map(|ms| format!("{ms:.1}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        idle_after(held, Instant::now())?;
        // SAFETY: made above, idle.
        unsafe { result::stream::destroy(held) }?;
    }
    // SAFETY: allocated above, every stream idle.
    unsafe { result::free_sync(buf) }?;
    Ok(())
}
