//! The P2P kernel's source and its run-time compilation with NVRTC, cached per architecture.

use std::sync::Mutex;

use super::abi;
use crate::error::{Error, Result};

/// The kernel file, without the shared #defines.
const KERNEL: &str = include_str!("kernel.cu");

/// Names of the kernels in the module.
pub(crate) const PACKET_KERNEL: &str = "gpucast_packet";
pub(crate) const PULL_KERNEL: &str = "gpucast_pull";
pub(crate) const PULL_LIST_KERNEL: &str = "gpucast_pull_list";
pub(crate) const CHAIN_KERNEL: &str = "gpucast_chain";

/// The full source handed to NVRTC: the ABI's constants as #defines, its types and parameter
/// structs (with a `static_assert` on each size), then the kernels.
pub(crate) fn source() -> String {
    let mut src = String::with_capacity(KERNEL.len() + 4096);
    for (name, value) in abi::defines() {
        src.push_str(&format!("#define {name} {value}u\n"));
    }
    src.push_str(&abi::c_structs());
    src.push_str(KERNEL);
    src
}

/// Whether libnvrtc can be loaded (cudarc panics on first use when it cannot).
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library names; no NVRTC function is called.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Hint shown when libnvrtc is missing.
pub(crate) const NVRTC_HINT: &str = "install NVRTC for the CUDA major version gpucast was built for \
(the CUDA toolkit's lib64, or `pip install nvidia-cuda-nvrtc` for CUDA 13 / `nvidia-cuda-nvrtc-cu12` \
for CUDA 12) and put the folder holding libnvrtc.so.<major> on LD_LIBRARY_PATH";

/// The error of a missing libnvrtc.
pub(crate) fn nvrtc_missing() -> Error {
    Error::LibraryMissing {
        library: "libnvrtc",
        detail: "no libnvrtc.so.<CUDA major> found on the library search path".into(),
        hint: NVRTC_HINT,
    }
}

/// Compiles the kernels to PTX for compute capability `major.minor`, once per process per
/// architecture.
pub(crate) fn ptx_for(major: i32, minor: i32) -> Result<String> {
    type Entry = ((i32, i32), Result<String, String>);
    static CACHE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
    if !nvrtc_present() {
        return Err(nvrtc_missing());
    }
    let arch = format!("compute_{major}{minor}");
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let cached = cache
        .iter()
        .find(|(k, _)| *k == (major, minor))
        .map(|(_, v)| v.clone());
    let result = match cached {
        Some(r) => r,
        None => {
            let r = compile(&arch);
            cache.push(((major, minor), r.clone()));
            r
        }
    };
    result.map_err(|message| Error::Compile { arch, message })
}

fn compile(arch: &str) -> Result<String, String> {
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some("gpucast_p2p.cu".into()),
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source(), opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    })?;
    tracing::debug!(
        arch,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "compiled the P2P kernels"
    );
    Ok(ptx.to_src())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn source_defines_every_constant_the_kernel_uses() {
        let src = source();
        for word in src.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("GPUCAST_") && word.len() > "GPUCAST_".len() {
                assert!(
                    src.contains(&format!("#define {word} ")),
                    "{word} is used by kernel.cu but not defined by source()"
                );
            }
        }
        for s in &abi::STRUCTS {
            assert!(src.contains(&format!("static_assert(sizeof({})", s.name)));
        }
    }

    /// The kernel compiles with NVRTC for the architectures we target, and its struct-size
    /// `static_assert`s hold. Without libnvrtc the test says on stderr that it skipped (written
    /// past the test harness's capture, so it shows in `cargo test` output) and passes, unless
    /// GPUCAST_REQUIRE_NVRTC=1 (set by CI after it installs NVRTC) makes that a failure.
    #[test]
    fn kernel_compiles_with_nvrtc() {
        if !nvrtc_present() {
            assert!(
                !crate::config::require_nvrtc(),
                "libnvrtc not found and GPUCAST_REQUIRE_NVRTC=1: {NVRTC_HINT}"
            );
            let _ = writeln!(
                std::io::stderr().lock(),
                "SKIPPED kernel_compiles_with_nvrtc: libnvrtc not found ({NVRTC_HINT})"
            );
            return;
        }
        for (major, minor) in [(8, 0), (9, 0)] {
            let ptx = ptx_for(major, minor).unwrap_or_else(|e| panic!("{e}"));
            assert!(ptx.contains(".entry gpucast_packet"), "no packet kernel");
            assert!(ptx.contains(".entry gpucast_pull("), "no pull kernel");
            assert!(ptx.contains(".entry gpucast_pull_list("), "no list kernel");
            // The flag protocol relies on these instructions being emitted as written.
            assert!(ptx.contains("ld.acquire.sys.global.u32"));
            assert!(ptx.contains("st.release.sys.global.u32"));
            assert!(ptx.contains("st.volatile.global.v4.u32"));
            assert!(ptx.contains("%globaltimer"));
            // Long waits back off; a reader's end of a lease is ordered after its reads.
            assert!(ptx.contains("nanosleep"), "no back-off in the waits");
            assert!(ptx.contains("fence.sc.sys"));
            assert!(ptx.contains("st.relaxed.sys.global.u32"));
            // 16-byte vector loads in the pull body.
            assert!(ptx.contains("ld.global.v4.u32") || ptx.contains("ld.global.v4.b32"));
        }
        // A drifted layout fails to compile: the static_asserts are live.
        let broken = source().replacen("u32 rank;", "u64 rank;", 1);
        let opts = cudarc::nvrtc::CompileOptions {
            options: vec!["--gpu-architecture=compute_90".into(), "--std=c++17".into()],
            ..Default::default()
        };
        match cudarc::nvrtc::compile_ptx_with_opts(broken, opts) {
            Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => {
                let log = log.to_string_lossy();
                assert!(log.contains("differs from abi.rs"), "{log}");
            }
            other => panic!("a drifted layout compiled: {:?}", other.map(|_| ())),
        }
    }
}
