//! Behaviour that does not need a GPU: library discovery and argument errors as a machine
//! without a GPU, CUDA driver or NCCL sees them. Each test asserts on both kinds of machine.

use gpucast::{device_count, nccl_version, Clique, Error};

fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    unsafe { gpucast::cudarc::driver::sys::is_culib_present() }
}

#[test]
fn missing_driver_is_a_typed_error_with_a_fix() {
    let result = Clique::new(&[0, 1]);
    if driver_present() {
        // Whatever happens on a machine with a driver, it is never a missing-libcuda error.
        if let Err(Error::LibraryMissing { library, .. }) = &result {
            assert_ne!(*library, "libcuda");
        }
        return;
    }
    match result {
        Err(
            e @ Error::LibraryMissing {
                library: "libcuda", ..
            },
        ) => {
            let msg = e.to_string();
            assert!(msg.contains("libcuda") && msg.contains("Fix:"), "{msg}");
        }
        Err(other) => panic!("expected LibraryMissing(libcuda), got {other}"),
        Ok(_) => panic!("a clique without a CUDA driver"),
    }
    assert!(matches!(
        device_count(),
        Err(Error::LibraryMissing {
            library: "libcuda",
            ..
        })
    ));
    assert!(matches!(
        Clique::all(),
        Err(Error::LibraryMissing {
            library: "libcuda",
            ..
        })
    ));
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
            assert!(
                msg.contains("libnccl.so.2") && msg.contains("GPUCAST_NCCL_LIBRARY"),
                "{msg}"
            );
        }
        Err(other) => panic!("unexpected error {other}"),
    }
}

#[test]
fn device_list_errors_come_before_any_gpu_work() {
    // Validation of the list itself does not depend on the machine.
    assert!(matches!(
        gpucast::plan::validate_devices(&[0, 1, 2, 3, 4, 5, 6, 7, 8], 16),
        Err(Error::TooManyDevices { .. })
    ));
    if !driver_present() {
        // Without a driver the first error is the missing library, even for a bad list.
        assert!(matches!(
            Clique::new(&[0, 0]),
            Err(Error::LibraryMissing { .. })
        ));
        return;
    }
    assert!(matches!(Clique::new(&[]), Err(Error::NoDevice(_))));
    assert!(matches!(
        Clique::new(&[0, 0]),
        Err(Error::DuplicateDevice { ordinal: 0 })
    ));
    assert!(matches!(
        Clique::new(&[0, 99]),
        Err(Error::DeviceOutOfRange { ordinal: 99, .. })
    ));
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
