//! The bench's timer (`benches/timer/mod.rs`) on a GPU: it must tell apart two operations as long
//! as a 1 GiB broadcast (2.3 ms) that differ by 10 us, with as few operations per repeat as
//! the old settings gave 1 GiB (4). The operations are a kernel that spins on the GPU's clock,
//! so the only error left is the timer's.
//!
//! `GPUCAST_TEST_TIMER=polled` times the same repeats as the bench did before its event
//! timer (the host clock around the repeat, ended by gpucast's bounded synchronize, which polls
//! with sleeps growing to 1 ms): that variant fails this test.

#[path = "../benches/timer/mod.rs"]
mod timer;

use std::time::Instant;

use gpucast::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use gpucast::Clique;

/// About a 1 GiB broadcast on one H200 pair.
const BASE_NS: u64 = 2_300_000;
const STEP_NS: u64 = 10_000;
/// Operations per repeat: what `--target-ms 10` gave 1 GiB before the event timer.
const OPS: usize = 4;
const REPEATS: usize = 9;

const SPIN: &str = r#"
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"#;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Microseconds per operation of one repeat of `OPS` spins of `ns` each.
fn repeat(clique: &Clique, spin: &CudaFunction, ns: u64, polled: bool) -> f64 {
    let stream = clique.stream(0);
    clique.synchronize().unwrap();
    let t0 = Instant::now();
    let starts = timer::marks(&[stream]).unwrap();
    for _ in 0..OPS {
        let mut launch = stream.launch_builder(spin);
        launch.arg(&ns);
        // SAFETY: the kernel takes one u64 by value and touches no memory.
        unsafe { launch.launch(LaunchConfig::for_num_elems(1)) }.unwrap();
    }
    let ends = timer::marks(&[stream]).unwrap();
    clique.synchronize().unwrap();
    if polled {
        t0.elapsed().as_secs_f64() * 1e6 / OPS as f64
    } else {
        f64::from(timer::slowest_ms(&starts, &ends).unwrap()) * 1e3 / OPS as f64
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_timer_resolves_10_us_on_operations_as_long_as_a_1_gib_broadcast() {
    let polled = std::env::var("GPUCAST_TEST_TIMER").is_ok_and(|v| v == "polled");
    let clique = Clique::new(&[0]).unwrap();
    let ptx = gpucast::cudarc::nvrtc::compile_ptx(SPIN).unwrap();
    let spin = clique
        .context(0)
        .load_module(ptx)
        .unwrap()
        .load_function("spin")
        .unwrap();
    // Warm up the clocks.
    for _ in 0..20 {
        repeat(&clique, &spin, BASE_NS, polled);
    }
    let (mut short, mut long) = (Vec::new(), Vec::new());
    for _ in 0..REPEATS {
        short.push(repeat(&clique, &spin, BASE_NS, polled));
        long.push(repeat(&clique, &spin, BASE_NS + STEP_NS, polled));
    }
    let step = median(long.clone()) - median(short.clone());
    let spread = |v: &[f64]| {
        v.iter().copied().fold(f64::MIN, f64::max) - v.iter().copied().fold(f64::MAX, f64::min)
    };
    println!(
        "{} timer: {:.2} us and {:.2} us per op, step {step:.2} us (spread {:.2} / {:.2} us)",
        if polled { "polled" } else { "event" },
        median(short.clone()),
        median(long.clone()),
        spread(&short),
        spread(&long)
    );
    assert!(
        (step - STEP_NS as f64 / 1e3).abs() <= 2.0,
        "a 10 us step measured as {step:.2} us"
    );
    // Repeats of one operation must agree within two steps (on one H200 the event timer's
    // spread was 3.5-10.3 us, the polled timer's 22-238 us).
    let step_us = STEP_NS as f64 / 1e3;
    assert!(
        spread(&short) <= 2.0 * step_us && spread(&long) <= 2.0 * step_us,
        "repeats of one operation spread over {:.2} / {:.2} us",
        spread(&short),
        spread(&long)
    );
}
