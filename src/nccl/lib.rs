//! Loading NCCL at run time and resolving the entry points gpucast calls.
//!
//! cudarc's own loader looks for `libnccl.so`, `.so.12`, `.so.11`... but not `libnccl.so.2`,
//! the only name that runtime-only installs and the PyPI wheel ship, so gpucast opens the
//! library itself and calls it with cudarc's `nccl::sys` types.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t};

use crate::config;
use crate::error::{Error, Result};

const HINT: &str = "install NCCL (e.g. the libnccl2 package, or `pip install nvidia-nccl-cu13` and add \
its nvidia/nccl/lib folder to LD_LIBRARY_PATH), or set GPUCAST_NCCL_LIBRARY to the path of libnccl.so.2";

pub(crate) type RawResult = u32;
/// `ncclInProgress`: a non-blocking call has not finished yet.
pub(crate) const IN_PROGRESS: RawResult = 7;

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> RawResult;
type GetErrorStringFn = unsafe extern "C" fn(RawResult) -> *const c_char;
type GetLastErrorFn = unsafe extern "C" fn(ncclComm_t) -> *const c_char;
type GetUniqueIdFn = unsafe extern "C" fn(*mut UniqueId) -> RawResult;
type CommInitRankConfigFn =
    unsafe extern "C" fn(*mut ncclComm_t, c_int, UniqueId, c_int, *mut Config) -> RawResult;

/// `ncclUniqueId`: 128 opaque bytes that rank 0 makes and every rank of a job receives.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId(pub [u8; 128]);

/// `ncclConfig_t` as NCCL 2.17 defined it; later releases accept it (they read `size` and
/// `version` and default the fields they added).
#[repr(C)]
pub(crate) struct Config {
    size: usize,
    magic: u32,
    version: u32,
    pub blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

impl Config {
    /// `NCCL_CONFIG_INITIALIZER`: every field undefined, so NCCL picks its defaults.
    pub(crate) fn new() -> Config {
        const UNDEF: c_int = c_int::MIN;
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 2_17_00,
            blocking: UNDEF,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
            split_share: UNDEF,
        }
    }
}
pub(crate) type CommFn = unsafe extern "C" fn(ncclComm_t) -> RawResult;
type CommAsyncErrorFn = unsafe extern "C" fn(ncclComm_t, *mut RawResult) -> RawResult;
type GroupFn = unsafe extern "C" fn() -> RawResult;
type BroadcastFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    CUstream,
) -> RawResult;

/// The NCCL entry points gpucast uses, resolved once per process.
pub(crate) struct NcclLib {
    _lib: libloading::Library,
    /// Which file was opened.
    pub(crate) path: String,
    get_version: GetVersionFn,
    get_error_string: GetErrorStringFn,
    get_last_error: GetLastErrorFn,
    pub(crate) get_unique_id: GetUniqueIdFn,
    pub(crate) comm_init_rank_config: CommInitRankConfigFn,
    pub(crate) comm_destroy: CommFn,
    pub(crate) comm_abort: CommFn,
    pub(crate) comm_get_async_error: CommAsyncErrorFn,
    pub(crate) group_start: GroupFn,
    pub(crate) group_end: GroupFn,
    pub(crate) broadcast: BroadcastFn,
}

/// The file names tried, in order: the one `GPUCAST_NCCL_LIBRARY` names alone when it is set,
/// otherwise the names a runtime install and the PyPI wheel ship.
pub(crate) fn candidate_names(env_override: Option<&std::path::Path>) -> Vec<String> {
    match env_override {
        Some(path) => vec![path.to_string_lossy().into_owned()],
        None => ["libnccl.so.2", "libnccl.so"].map(String::from).to_vec(),
    }
}

impl NcclLib {
    fn open() -> Result<NcclLib> {
        let env = config::nccl_library_from_env()?;
        Self::open_first(candidate_names(env.as_deref()))
    }

    /// Opens the first of `names` that loads, or says why each failed.
    fn open_first(names: Vec<String>) -> Result<NcclLib> {
        let mut tried = Vec::new();
        for name in names {
            // SAFETY: loading NCCL runs its constructors, which have no preconditions.
            match unsafe { libloading::Library::new(&name) } {
                // The loader's own message (dlerror, the error's source) says why: missing
                // file, wrong ELF class, a dependency not found.
                Err(e) => tried.push(format!("{name}: {}", with_sources(&e))),
                Ok(lib) => return Self::resolve(lib, name).map_err(missing),
            }
        }
        Err(missing(format!("tried {}", tried.join("; "))))
    }

    fn resolve(lib: libloading::Library, path: String) -> std::result::Result<NcclLib, String> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the type given matches NCCL's C prototype of this symbol (nccl.h, 2.x).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{path} lacks {}: {e}", $name))?
            };
        }
        Ok(NcclLib {
            get_version: sym!("ncclGetVersion"),
            get_error_string: sym!("ncclGetErrorString"),
            get_last_error: sym!("ncclGetLastError"),
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank_config: sym!("ncclCommInitRankConfig"),
            comm_destroy: sym!("ncclCommDestroy"),
            comm_abort: sym!("ncclCommAbort"),
            comm_get_async_error: sym!("ncclCommGetAsyncError"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
            broadcast: sym!("ncclBroadcast"),
            path,
            _lib: lib,
        })
    }

    /// The process-wide NCCL, or the error explaining why it could not be loaded.
    pub(crate) fn get() -> Result<&'static NcclLib> {
        static LIB: OnceLock<Result<NcclLib>> = OnceLock::new();
        LIB.get_or_init(NcclLib::open)
            .as_ref()
            .map_err(Clone::clone)
    }

    /// `Ok` for ncclSuccess, else an error with NCCL's message and its last-error text (of
    /// `comm`, or of the thread's last call where there is none).
    pub(crate) fn check(
        &self,
        code: RawResult,
        comm: Option<&super::Comm>,
        during: impl FnOnce() -> String,
    ) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString accepts any result code and returns a static string.
        let mut message = unsafe { cstr((self.get_error_string)(code)) };
        let comm = comm.map_or(std::ptr::null_mut(), |c| c.0);
        // SAFETY: ncclGetLastError accepts a null or live communicator, and a `Comm` holds a
        // live one (it is consumed when its communicator ends).
        let last = unsafe { cstr((self.get_last_error)(comm)) };
        if !last.is_empty() {
            message = format!("{message}: {last}");
        }
        Err(Error::Nccl {
            during: during(),
            code,
            message,
        })
    }

    /// NCCL's version as (major, minor, patch).
    pub(crate) fn version(&self) -> Result<(i32, i32, i32)> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out pointer.
        let code = unsafe { (self.get_version)(&mut v) };
        self.check(code, None, || "ncclGetVersion".into())?;
        Ok(split_version(v))
    }
}

/// An error and its chain of sources, as one line.
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn missing(detail: String) -> Error {
    Error::LibraryMissing {
        library: "libnccl",
        detail,
        hint: HINT,
    }
}

/// NCCL encodes 2.28.3 as 22803 (since 2.9; older releases used major*1000+minor*100+patch).
pub(crate) fn split_version(code: i32) -> (i32, i32, i32) {
    if code >= 10000 {
        (code / 10000, (code % 10000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    }
}

/// # Safety
/// `p` is null or a NUL-terminated string that outlives the call.
unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: guaranteed by the caller.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// NCCL's version, or the error saying why NCCL cannot be loaded.
pub fn nccl_version() -> Result<(i32, i32, i32)> {
    NcclLib::get()?.version()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_split() {
        assert_eq!(split_version(22803), (2, 28, 3));
        assert_eq!(split_version(2708), (2, 7, 8));
    }

    #[test]
    fn an_override_is_the_only_candidate() {
        let p = std::path::Path::new("/opt/nccl/libnccl.so.2");
        assert_eq!(candidate_names(Some(p)), vec!["/opt/nccl/libnccl.so.2"]);
        assert_eq!(candidate_names(None), vec!["libnccl.so.2", "libnccl.so"]);
    }

    #[test]
    fn a_failed_open_keeps_the_loaders_reason() {
        let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let names = vec!["/no/such/dir/libnccl.so.2".to_string(), manifest.into()];
        let err = NcclLib::open_first(names).err().expect("nothing to load");
        let text = err.to_string();
        assert!(matches!(
            err,
            Error::LibraryMissing {
                library: "libnccl",
                ..
            }
        ));
        // dlerror's words for both failures, and the fix.
        assert!(
            text.contains("/no/such/dir/libnccl.so.2: ") && text.contains("No such file"),
            "{text}"
        );
        assert!(text.contains(&format!("{manifest}: ")), "{text}");
        assert!(text.contains("GPUCAST_NCCL_LIBRARY"), "{text}");
    }
}
