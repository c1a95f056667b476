//! The P2P kernel's source and its run-time compilation with NVRTC, cached per architecture.

use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::plan::{self, layout};

/// The kernel file, without the shared #defines.
const KERNEL: &str = include_str!("kernel.cu");

/// Names of the kernels in the module.
pub(crate) const PACKET_KERNEL: &str = "gpucast_packet";
pub(crate) const PULL_KERNEL: &str = "gpucast_pull";
pub(crate) const PULL_LIST_KERNEL: &str = "gpucast_pull_list";

/// The full source handed to NVRTC: layout and geometry constants from `plan`, then the kernels.
pub(crate) fn source() -> String {
    let defines = [
        ("GPUCAST_MAX_GPUS", plan::MAX_GPUS),
        ("GPUCAST_THREADS", plan::THREADS as usize),
        ("GPUCAST_PACKET_SLOTS", plan::PACKET_SLOTS as usize),
        (
            "GPUCAST_PACKET_REGION_BYTES",
            plan::PACKET_REGION_BYTES as usize,
        ),
        ("GPUCAST_PACKET_SEQ", layout::PACKET_SEQ),
        ("GPUCAST_PULL_SEQ", layout::PULL_SEQ),
        ("GPUCAST_PACKET_ACK", layout::PACKET_ACK),
        ("GPUCAST_ARRIVE", layout::ARRIVE),
        ("GPUCAST_DONE", layout::DONE),
        ("GPUCAST_INBOX_OFFSET", layout::INBOX_OFFSET),
        ("GPUCAST_LIST_MAX", plan::LIST_MAX),
    ];
    let mut src = String::with_capacity(KERNEL.len() + 512);
    for (name, value) in defines {
        src.push_str(&format!("#define {name} {value}u\n"));
    }
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

/// Compiles the kernels to PTX for compute capability `major.minor`, once per process per
/// architecture.
pub(crate) fn ptx_for(major: i32, minor: i32) -> Result<String> {
    type Entry = ((i32, i32), Result<String, String>);
    static CACHE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
    if !nvrtc_present() {
        return Err(Error::LibraryMissing {
            library: "libnvrtc",
            detail: "no libnvrtc.so found on the library search path".into(),
            hint: NVRTC_HINT,
        });
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

    #[test]
    fn source_defines_every_layout_constant_the_kernel_uses() {
        let src = source();
        for word in src.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("GPUCAST_") && word.len() > "GPUCAST_".len() {
                assert!(
                    src.contains(&format!("#define {word} ")),
                    "{word} is used by kernel.cu but not defined by source()"
                );
            }
        }
    }

    /// The kernel compiles with NVRTC for the architectures we target. Needs libnvrtc (CI
    /// installs it from PyPI); without it this test fails rather than passing silently, unless
    /// GPUCAST_SKIP_NVRTC_TEST=1 says to skip it.
    #[test]
    fn kernel_compiles_with_nvrtc() {
        if !nvrtc_present() {
            if std::env::var("GPUCAST_SKIP_NVRTC_TEST").as_deref() == Ok("1") {
                eprintln!("SKIPPED: libnvrtc not found and GPUCAST_SKIP_NVRTC_TEST=1");
                return;
            }
            panic!("libnvrtc not found: {NVRTC_HINT} (or set GPUCAST_SKIP_NVRTC_TEST=1 to skip)");
        }
        for (major, minor) in [(8, 0), (9, 0)] {
            let ptx = ptx_for(major, minor).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                ptx.contains(".entry gpucast_packet"),
                "no packet kernel in PTX"
            );
            assert!(
                ptx.contains(".entry gpucast_pull("),
                "no pull kernel in PTX"
            );
            assert!(
                ptx.contains(".entry gpucast_pull_list("),
                "no list kernel in PTX"
            );
            // The flag protocol relies on these instructions being emitted as written.
            assert!(ptx.contains("ld.acquire.sys.global.u32"));
            assert!(ptx.contains("st.release.sys.global.u32"));
            assert!(ptx.contains("st.volatile.global.v4.u32"));
            assert!(ptx.contains("%globaltimer"));
            // 16-byte vector loads in the pull body.
            assert!(ptx.contains("ld.global.v4.u32") || ptx.contains("ld.global.v4.b32"));
        }
    }
}
