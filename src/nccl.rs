//! The NCCL path: library discovery, communicators of one process, the grouped broadcast.
//!
//! NCCL is loaded at run time. cudarc's own loader looks for `libnccl.so`, `.so.12`, `.so.11`...
//! but not `libnccl.so.2`, the only name that runtime-only installs and the PyPI wheel ship, so
//! this module opens the library itself and calls it with cudarc's `nccl::sys` types.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t};

use crate::error::{Error, Result};

/// Environment variable naming the NCCL library file to load, ahead of the default names.
pub const NCCL_LIBRARY_ENV: &str = "GPUCAST_NCCL_LIBRARY";

const HINT: &str = "install NCCL (e.g. the libnccl2 package, or `pip install nvidia-nccl-cu13` and add \
its nvidia/nccl/lib folder to LD_LIBRARY_PATH), or set GPUCAST_NCCL_LIBRARY to the path of libnccl.so.2";

type RawResult = u32;
type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> RawResult;
type GetErrorStringFn = unsafe extern "C" fn(RawResult) -> *const c_char;
type GetLastErrorFn = unsafe extern "C" fn(ncclComm_t) -> *const c_char;
type CommInitAllFn = unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> RawResult;
type CommFn = unsafe extern "C" fn(ncclComm_t) -> RawResult;
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
    comm_init_all: CommInitAllFn,
    comm_destroy: CommFn,
    comm_get_async_error: CommAsyncErrorFn,
    group_start: GroupFn,
    group_end: GroupFn,
    broadcast: BroadcastFn,
}

/// The file names tried, in order (after [`NCCL_LIBRARY_ENV`] if set).
pub(crate) fn candidate_names(env_override: Option<&str>) -> Vec<String> {
    let mut names = Vec::new();
    if let Some(path) = env_override.filter(|p| !p.is_empty()) {
        names.push(path.to_string());
    }
    names.extend(["libnccl.so.2", "libnccl.so"].map(String::from));
    names
}

impl NcclLib {
    fn open() -> Result<NcclLib, String> {
        let env = std::env::var(NCCL_LIBRARY_ENV).ok();
        let mut tried = Vec::new();
        for name in candidate_names(env.as_deref()) {
            // SAFETY: loading NCCL runs its constructors, which have no preconditions.
            match unsafe { libloading::Library::new(&name) } {
                Ok(lib) => return Self::resolve(lib, name),
                Err(e) => tried.push(format!("{name}: {e}")),
            }
        }
        Err(format!("tried {}", tried.join("; ")))
    }

    fn resolve(lib: libloading::Library, path: String) -> Result<NcclLib, String> {
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
            comm_init_all: sym!("ncclCommInitAll"),
            comm_destroy: sym!("ncclCommDestroy"),
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
        static LIB: OnceLock<Result<NcclLib, String>> = OnceLock::new();
        LIB.get_or_init(NcclLib::open)
            .as_ref()
            .map_err(|detail| Error::LibraryMissing {
                library: "libnccl",
                detail: detail.clone(),
                hint: HINT,
            })
    }

    fn check(
        &self,
        code: RawResult,
        comm: ncclComm_t,
        during: impl FnOnce() -> String,
    ) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString accepts any result code and returns a static string.
        let mut message = unsafe { cstr((self.get_error_string)(code)) };
        // SAFETY: ncclGetLastError accepts a null or live communicator.
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
        self.check(code, std::ptr::null_mut(), || "ncclGetVersion".into())?;
        Ok(split_version(v))
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

/// One rank's part of an NCCL broadcast.
pub(crate) struct RankOp {
    pub rank: usize,
    pub root: usize,
    pub send: u64,
    pub recv: u64,
    pub count: usize,
    pub dtype: ncclDataType_t,
    pub stream: CUstream,
}

/// The NCCL communicators of one process, one per clique rank, destroyed on drop.
pub(crate) struct Comms {
    lib: &'static NcclLib,
    comms: Vec<ncclComm_t>,
}

// SAFETY: an ncclComm_t may be used from any thread as long as calls on one communicator are not
// concurrent; `Comms` is only reached through `&Clique`/`&mut Clique` whose broadcast path takes
// the clique's launch lock, so calls are serialised.
unsafe impl Send for Comms {}
// SAFETY: see the `Send` impl: every use goes through the clique's launch lock.
unsafe impl Sync for Comms {}

impl Comms {
    /// Creates one communicator per device with `ncclCommInitAll` (rank i on `ordinals[i]`).
    pub(crate) fn init_all(ordinals: &[usize]) -> Result<Comms> {
        let lib = NcclLib::get()?;
        let devs: Vec<c_int> = ordinals
            .iter()
            .map(|&o| c_int::try_from(o).expect("ordinals are validated to be < 8"))
            .collect();
        let mut comms = vec![std::ptr::null_mut(); devs.len()];
        let n = c_int::try_from(devs.len()).expect("at most 8 devices");
        // SAFETY: `comms` has room for `n` handles and `devs` holds `n` valid ordinals.
        let code = unsafe { (lib.comm_init_all)(comms.as_mut_ptr(), n, devs.as_ptr()) };
        lib.check(code, std::ptr::null_mut(), || {
            format!("ncclCommInitAll on devices {ordinals:?}")
        })?;
        Ok(Comms { lib, comms })
    }

    /// Enqueues `ncclBroadcast` on every rank inside one NCCL group.
    ///
    /// # Safety
    /// `recv[i]` must point to `count` elements of `dtype` on rank i's device, `send` to as many
    /// on the root's device, and `streams[i]` must be a live stream of rank i's device; the
    /// buffers must stay alive until the streams pass this point.
    pub(crate) unsafe fn broadcast(
        &self,
        root: usize,
        send: u64,
        recv: &[u64],
        count: usize,
        dtype: ncclDataType_t,
        streams: &[CUstream],
    ) -> Result<()> {
        let root_c = c_int::try_from(root).expect("root validated < 8");
        let group = Group::start(self.lib)?;
        for (rank, &comm) in self.comms.iter().enumerate() {
            let sendbuff = if rank == root { send } else { recv[rank] };
            // SAFETY: pointers and stream are valid per this function's contract.
            let code = unsafe {
                (self.lib.broadcast)(
                    sendbuff as *const c_void,
                    recv[rank] as *mut c_void,
                    count,
                    dtype,
                    root_c,
                    comm,
                    streams[rank],
                )
            };
            self.lib
                .check(code, comm, || format!("ncclBroadcast on rank {rank}"))?;
        }
        group.end()
    }

    /// Starts a group, for callers that enqueue several broadcasts at once.
    pub(crate) fn group(&self) -> Result<Group> {
        Group::start(self.lib)
    }

    /// Enqueues one rank's part of a broadcast; call inside [`Comms::group`].
    ///
    /// # Safety
    /// As for [`Comms::broadcast`], for this rank's buffers.
    pub(crate) unsafe fn broadcast_rank(&self, op: RankOp) -> Result<()> {
        let comm = self.comms[op.rank];
        let root_c = c_int::try_from(op.root).expect("root validated < 8");
        // SAFETY: guaranteed by the caller.
        let code = unsafe {
            (self.lib.broadcast)(
                op.send as *const c_void,
                op.recv as *mut c_void,
                op.count,
                op.dtype,
                root_c,
                comm,
                op.stream,
            )
        };
        let rank = op.rank;
        self.lib
            .check(code, comm, || format!("ncclBroadcast on rank {rank}"))
    }

    /// The first asynchronous error any communicator reports, if any.
    pub(crate) fn async_error(&self) -> Result<()> {
        for (rank, &comm) in self.comms.iter().enumerate() {
            let mut state: RawResult = 0;
            // SAFETY: `comm` is live; `state` is a valid out pointer.
            let code = unsafe { (self.lib.comm_get_async_error)(comm, &mut state) };
            self.lib.check(code, comm, || {
                format!("ncclCommGetAsyncError on rank {rank}")
            })?;
            // ncclInProgress (7) is not an error: non-blocking init or a collective is still running.
            if state != 0 && state != 7 {
                self.lib.check(state, comm, || {
                    format!("asynchronous NCCL error on rank {rank}")
                })?;
            }
        }
        Ok(())
    }
}

impl Drop for Comms {
    fn drop(&mut self) {
        for (rank, comm) in std::mem::take(&mut self.comms).into_iter().enumerate() {
            // SAFETY: `comm` is live and is not used again; destroy waits for its pending work.
            let code = unsafe { (self.lib.comm_destroy)(comm) };
            if let Err(e) = self.lib.check(code, std::ptr::null_mut(), || {
                format!("ncclCommDestroy rank {rank}")
            }) {
                tracing::warn!(error = %e, "could not destroy an NCCL communicator");
            }
        }
    }
}

/// An open NCCL group; ends it on drop if [`Group::end`] was not reached (an error path).
pub(crate) struct Group {
    lib: &'static NcclLib,
    open: bool,
}

impl Group {
    fn start(lib: &'static NcclLib) -> Result<Group> {
        // SAFETY: ncclGroupStart has no preconditions.
        let code = unsafe { (lib.group_start)() };
        lib.check(code, std::ptr::null_mut(), || "ncclGroupStart".into())?;
        Ok(Group { lib, open: true })
    }

    /// Ends the group: NCCL launches the enqueued operations now.
    pub(crate) fn end(mut self) -> Result<()> {
        self.open = false;
        // SAFETY: matches the ncclGroupStart of `start`.
        let code = unsafe { (self.lib.group_end)() };
        self.lib
            .check(code, std::ptr::null_mut(), || "ncclGroupEnd".into())
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.open {
            // SAFETY: matches the ncclGroupStart of `start`.
            let code = unsafe { (self.lib.group_end)() };
            if code != 0 {
                tracing::warn!(code, "ncclGroupEnd failed while unwinding a failed group");
            }
        }
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
    fn candidates_put_override_first_and_include_so_2() {
        let c = candidate_names(Some("/opt/nccl/libnccl.so.2"));
        assert_eq!(c[0], "/opt/nccl/libnccl.so.2");
        assert!(c.iter().any(|n| n == "libnccl.so.2"));
        assert_eq!(candidate_names(Some("")).len(), 2);
        assert_eq!(candidate_names(None)[0], "libnccl.so.2");
    }
}
