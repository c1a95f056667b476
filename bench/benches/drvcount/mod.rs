//! Driver calls per broadcast, when the process runs on the counting libcuda shim of
//! `ci/cuda-count` (its directory first in `LD_LIBRARY_PATH`): the shim exports
//! `gpucast_count_*`, found here by name in the process's global scope (the shim puts itself
//! there) or in the already loaded `libcuda.so.1`. Without the shim, [`counter`] is `None` and
//! nothing is measured.

use std::ffi::{c_char, CStr};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_LAZY};

/// Calls counted per path and size in eager mode, outside the timed repeats.
pub const CALLS: usize = 1000;

/// `RTLD_NOLOAD` of glibc: look for a library already loaded, load nothing.
const RTLD_NOLOAD: std::ffi::c_int = 0x4;

/// The shim's counters.
pub struct Counter {
    slots: usize,
    name: unsafe extern "C" fn(usize) -> *const c_char,
    snapshot: unsafe extern "C" fn(*mut u64, usize) -> usize,
    /// Keeps the handle the functions came from open.
    _lib: Library,
}

/// The shim's counters, if the process runs on it (looked up once).
pub fn counter() -> Option<&'static Counter> {
    static COUNTER: OnceLock<Option<Counter>> = OnceLock::new();
    COUNTER.get_or_init(find).as_ref()
}

fn find() -> Option<Counter> {
    let mut libs = vec![Library::this()];
    // SAFETY: RTLD_NOLOAD only returns a handle of a library already loaded; nothing runs.
    if let Ok(lib) = unsafe { Library::open(Some("libcuda.so.1"), RTLD_LAZY | RTLD_NOLOAD) } {
        libs.push(lib);
    }
    libs.into_iter().find_map(|lib| {
        // SAFETY: the signatures of ci/cuda-count/shim.c's API; the pointers stay valid while
        // `lib` is open, and the Counter keeps it open.
        unsafe {
            let slots = *lib
                .get::<unsafe extern "C" fn() -> usize>(b"gpucast_count_slots\0")
                .ok()?;
            let name = *lib
                .get::<unsafe extern "C" fn(usize) -> *const c_char>(b"gpucast_count_name\0")
                .ok()?;
            let snapshot = *lib
                .get::<unsafe extern "C" fn(*mut u64, usize) -> usize>(b"gpucast_count_snapshot\0")
                .ok()?;
            Some(Counter {
                slots: slots(),
                name,
                snapshot,
                _lib: lib,
            })
        }
    })
}

impl Counter {
    /// Every counter now (the exported names', then the spares').
    pub fn snapshot(&self) -> Vec<u64> {
        let mut v = vec![0u64; self.slots];
        // SAFETY: `v` holds `slots` counters, the most the shim writes.
        let n = unsafe { (self.snapshot)(v.as_mut_ptr(), v.len()) };
        v.truncate(n);
        v
    }

    /// Calls per broadcast between two snapshots over `calls` broadcasts: the total, then
    /// each entry point called, most called first.
    pub fn per_call(&self, before: &[u64], after: &[u64], calls: usize) -> String {
        let mut deltas: Vec<(u64, String)> = before
            .iter()
            .zip(after)
            .enumerate()
            .filter(|(_, (b, a))| a > b)
            .map(|(i, (b, a))| {
                // SAFETY: `i` is below the shim's slot count; the name, when not null, is a
                // C string the shim keeps for its lifetime.
                let name = unsafe {
                    let p = (self.name)(i);
                    if p.is_null() {
                        format!("slot {i}")
                    } else {
                        CStr::from_ptr(p).to_string_lossy().into_owned()
                    }
                };
                (a - b, name)
            })
            .collect();
        deltas.sort_by(|x, y| y.0.cmp(&x.0).then_with(|| x.1.cmp(&y.1)));
        let total: u64 = deltas.iter().map(|d| d.0).sum();
        let per = |n: u64| n as f64 / calls as f64;
        let parts: Vec<String> = deltas
            .iter()
            .map(|(n, name)| format!("{name} {:.2}", per(*n)))
            .collect();
        format!(
            "{:.2} per call over {calls} calls ({})",
            per(total),
            parts.join(", ")
        )
    }
}
