//! Behaviour that does not need a GPU: library discovery, settings and argument errors, as a
//! machine without a GPU, CUDA driver or NCCL sees them. Each test asserts on both kinds of
//! machine.

use std::process::Command;
use std::time::Duration;

use gpucast::{device_count, nccl_version, Clique, Error};

fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    unsafe { gpucast::cudarc::driver::sys::is_culib_present() }
}

/// Without a driver every entry point says which library is missing and how to fix it; with
/// one, no entry point claims it is missing. (The error's construction is unit-tested in
/// `clique::setup` on every machine.)
#[test]
fn a_missing_driver_is_a_typed_error_with_a_fix() {
    let result = Clique::new(&[0]);
    if driver_present() {
        assert!(
            !matches!(
                result,
                Err(Error::LibraryMissing {
                    library: "libcuda",
                    ..
                })
            ),
            "libcuda is present"
        );
        assert!(device_count().is_ok());
        return;
    }
    for r in [
        result.map(|_| ()),
        device_count().map(|_| ()),
        Clique::all().map(|_| ()),
    ] {
        match r {
            Err(
                e @ Error::LibraryMissing {
                    library: "libcuda", ..
                },
            ) => {
                let msg = e.to_string();
                assert!(msg.contains("libcuda") && msg.contains("Fix:"), "{msg}");
            }
            other => panic!("expected LibraryMissing(libcuda), got {other:?}"),
        }
    }
}

#[test]
fn missing_nccl_is_a_typed_error_with_a_fix() {
    match nccl_version() {
        Ok((major, minor, _)) => {
            assert!(major >= 2 && minor > 0, "odd NCCL version {major}.{minor}")
        }
        Err(
            e @ Error::LibraryMissing {
                library: "libnccl", ..
            },
        ) => {
            let msg = e.to_string();
            // The loader's reason for each name tried, and the fix.
            assert!(msg.contains("libnccl.so.2: "), "{msg}");
            assert!(msg.contains("GPUCAST_NCCL_LIBRARY"), "{msg}");
        }
        Err(other) => panic!("unexpected error {other}"),
    }
}

/// A bad device list is reported before the driver is touched, so the same error comes back
/// on a machine with or without a GPU.
#[test]
fn device_list_errors_come_before_any_gpu_work() {
    assert!(matches!(Clique::new(&[]), Err(Error::NoDevice(_))));
    assert!(matches!(
        Clique::new(&[0, 0]),
        Err(Error::DuplicateDevice { ordinal: 0 })
    ));
    assert!(matches!(
        Clique::new(&[0, 1, 2, 3, 4, 5, 6, 7, 8]),
        Err(Error::TooManyDevices { requested: 9, .. })
    ));
    // A device that does not exist needs the driver to know.
    let r = Clique::new(&[0, 99]);
    if driver_present() {
        assert!(matches!(
            r,
            Err(Error::DeviceOutOfRange { ordinal: 99, .. })
        ));
    } else {
        assert!(matches!(r, Err(Error::LibraryMissing { .. })));
    }
}

/// A rank whose machine cannot run it (no driver, or no such device) says so at once instead
/// of first waiting for peers that may never come: here rank 1 of a job whose rank 0 never
/// starts, with a 3 s bound on the rendezvous.
#[test]
fn a_communicator_checks_its_device_before_waiting_for_peers() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let job = gpucast::rendezvous::JobEnv::single_node(1, 2, port).unwrap();
    let started = std::time::Instant::now();
    let r = gpucast::Communicator::builder()
        .job(job)
        .device(if driver_present() { 4096 } else { 0 })
        .init_timeout(Duration::from_secs(3))
        .build();
    let took = started.elapsed();
    let e = r.err().expect("no rank 0 and no usable device");
    if driver_present() {
        assert!(
            matches!(e, Error::DeviceOutOfRange { ordinal: 4096, .. }),
            "{e}"
        );
    } else {
        assert!(
            matches!(
                e,
                Error::LibraryMissing {
                    library: "libcuda",
                    ..
                }
            ),
            "{e}"
        );
    }
    assert!(
        took < Duration::from_secs(1),
        "the error came after {took:?}"
    );
}

/// The ranks that can run hear at once why one cannot, rather than waiting out their own
/// timeout for it: rank 1 cannot run while rank 0 waits (rank 1 joins rank 0's store just to
/// abort), then rank 0 cannot run while rank 1 waits (rank 0 hosts its store just to say so).
#[test]
fn the_other_ranks_hear_at_once_why_a_rank_cannot_run() {
    use gpucast::rendezvous::{Exchange, JobEnv, Rendezvous, RendezvousError};
    let bad_device = if driver_present() { 4096 } else { 0 };
    for failing in [1usize, 0] {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let waiting = 1 - failing;
        let token = gpucast::rendezvous::random_token().unwrap();
        let theirs = token.clone();
        let peer = std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let mut job = JobEnv::single_node(waiting, 2, port).unwrap();
            job.job_token = theirs;
            // The failing rank may complete the rendezvous before it aborts: the first
            // exchange after it fails then.
            let r = Rendezvous::connect(&job, Duration::from_secs(20))
                .and_then(|rdv| rdv.all_gather(b"cards"));
            (r.map(drop), started.elapsed())
        });
        std::thread::sleep(Duration::from_millis(200));
        let mut job = JobEnv::single_node(failing, 2, port).unwrap();
        job.job_token = token;
        let r = gpucast::Communicator::builder()
            .job(job)
            .device(bad_device)
            .init_timeout(Duration::from_secs(20))
            .build();
        assert!(r.is_err(), "rank {failing} has no usable device");
        let (outcome, took) = peer.join().unwrap();
        match outcome {
            Err(RendezvousError::JobFailed { reason, .. }) => {
                assert!(
                    reason.contains(&format!("rank {failing} cannot take part")),
                    "{reason}"
                );
            }
            other => panic!("rank {waiting}: expected the job to fail, got {other:?}"),
        }
        assert!(
            took < Duration::from_secs(5),
            "rank {waiting} heard after {took:?}"
        );
    }
}

/// A zero timeout is rejected like `GPUCAST_TIMEOUT_MS=0`, before any GPU work.
#[test]
fn a_zero_timeout_is_rejected() {
    let r = Clique::builder()
        .devices(&[0])
        .timeout(Duration::ZERO)
        .build();
    assert!(
        matches!(
            r,
            Err(Error::InvalidSetting {
                name: "timeout",
                ..
            })
        ),
        "{:?}",
        r.map(|_| ())
    );
}

#[test]
fn errors_display_their_context() {
    let e = Error::WrongDevice {
        what: "output 1".into(),
        rank: 1,
        expected: 3,
        found: 0,
    };
    assert_eq!(
        e.to_string(),
        "output 1 must be on device 3 (clique rank 1) but is on device 0"
    );
    let e = Error::Timeout {
        rank: 0,
        phase: "waiting for the root's packets",
        block: 2,
        op: 9,
        timeout_ms: 300,
    };
    let s = e.to_string();
    assert!(
        s.contains("rank 0") && s.contains("300 ms") && s.contains("reset"),
        "{s}"
    );
}

/// Runs this test binary's `child` test in a new process with `vars` set, and returns whether
/// it passed and what it printed.
fn run_child(vars: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "child", "--include-ignored", "--nocapture"]);
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("spawn the test binary");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Set environment variables are parsed, and a malformed one is an error naming it, not a
/// silent default: each case runs in its own process so the variables reach the library.
#[test]
fn malformed_environment_variables_are_errors() {
    for (var, value) in [
        ("GPUCAST_PARALLEL_LAUNCH", "garbage"),
        ("GPUCAST_TIMEOUT_MS", "0"),
        ("GPUCAST_P2P_THRESHOLD", "lots"),
        ("GPUCAST_PATH", "ring"),
        ("GPUCAST_NCCL_LIBRARY", "/no/such/libnccl.so.2"),
    ] {
        let (ok, text) = run_child(&[("NO_GPU_CHILD_EXPECT", var), (var, value)]);
        assert!(
            ok,
            "{var}={value}: the child did not see the expected error:\n{text}"
        );
    }
    // And the child really checks: a well-formed value does not produce the error.
    let (ok, _) = run_child(&[
        ("NO_GPU_CHILD_EXPECT", "GPUCAST_PARALLEL_LAUNCH"),
        ("GPUCAST_PARALLEL_LAUNCH", "1"),
    ]);
    assert!(!ok, "a valid value was reported as an error");
}

/// Child side of `malformed_environment_variables_are_errors`.
#[test]
#[ignore = "run by malformed_environment_variables_are_errors in a child process"]
fn child() {
    let Ok(var) = std::env::var("NO_GPU_CHILD_EXPECT") else {
        return;
    };
    let r = if var == "GPUCAST_NCCL_LIBRARY" {
        nccl_version().map(|_| ())
    } else {
        Clique::new(&[0]).map(|_| ())
    };
    match r {
        Err(Error::InvalidSetting { name, reason }) => {
            assert_eq!(name, var);
            println!("{name}: {reason}");
        }
        other => panic!("{var}: expected InvalidSetting, got {other:?}"),
    }
}
