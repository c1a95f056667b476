//! The crate's one error type.

use cudarc::driver::DriverError;

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in gpucast, with the context needed to act on it.
///
/// Argument errors ([`Error::RootOutOfRange`], [`Error::OutputCount`], [`Error::WrongDevice`],
/// [`Error::LengthMismatch`], ...) are returned before any GPU work is enqueued.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A shared library could not be loaded (or lacks a symbol we need).
    #[error("{library} could not be loaded: {detail}. Fix: {hint}")]
    LibraryMissing {
        /// Which library (`"libcuda"`, `"libnccl"`, `"libnvrtc"`).
        library: &'static str,
        /// What was tried and what failed.
        detail: String,
        /// How to fix it.
        hint: &'static str,
    },
    /// No CUDA device is visible, or an empty device list was given.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// More devices than a clique supports.
    #[error("a clique holds at most {max} GPUs, {requested} were given")]
    TooManyDevices {
        /// Number of devices asked for.
        requested: usize,
        /// The limit ([`crate::limits::MAX_GPUS`]).
        max: usize,
    },
    /// The same device ordinal appears twice.
    #[error("device {ordinal} appears more than once in the device list")]
    DuplicateDevice {
        /// The repeated ordinal.
        ordinal: usize,
    },
    /// A device ordinal is not present on this machine.
    #[error("device {ordinal} does not exist ({available} CUDA devices visible)")]
    DeviceOutOfRange {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        available: usize,
    },
    /// The root rank is not a member of the clique.
    #[error("root {root} is out of range for a clique of {size} GPUs (roots are clique ranks 0..{size})")]
    RootOutOfRange {
        /// The root given.
        root: usize,
        /// Clique size.
        size: usize,
    },
    /// Wrong number of output buffers (one per GPU of the clique is needed).
    #[error("expected {expected} {what} (one per GPU of the clique), got {got}")]
    OutputCount {
        /// What was counted (`"outputs"`, `"buffers"`).
        what: &'static str,
        /// Clique size.
        expected: usize,
        /// Number given.
        got: usize,
    },
    /// A buffer lives on a different GPU than its position requires.
    #[error("{what} must be on device {expected} (clique rank {rank}) but is on device {found}")]
    WrongDevice {
        /// Which buffer (`"input"`, `"output 1"`).
        what: String,
        /// Its clique rank.
        rank: usize,
        /// Device ordinal it should be on.
        expected: usize,
        /// Device ordinal it is on.
        found: usize,
    },
    /// A buffer's length differs from the input's.
    #[error("{what} has {got} elements, the input has {expected}")]
    LengthMismatch {
        /// Which buffer.
        what: String,
        /// The input's length.
        expected: usize,
        /// This buffer's length.
        got: usize,
    },
    /// A buffer belongs to a CUDA context other than the clique's context on its device (a
    /// kernel of one context cannot address another context's memory).
    #[error("{what} belongs to another CUDA context of device {ordinal} (clique rank {rank}); allocate it on a stream of the device's primary context, e.g. `clique.stream({rank})` or a stream of `CudaContext::new({ordinal})`")]
    ForeignContext {
        /// Which buffer.
        what: String,
        /// Its clique rank.
        rank: usize,
        /// The device ordinal.
        ordinal: usize,
    },
    /// A size in bytes does not fit in the address space (elements times element size).
    #[error("{what}: {elements} elements of {element_size} bytes overflow a byte count")]
    TooLarge {
        /// Which buffer or list.
        what: String,
        /// Number of elements.
        elements: usize,
        /// Bytes per element.
        element_size: usize,
    },
    /// An argument that does not fit the call (e.g. an input on a process without the root).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Two tensor lists of a fused broadcast have different lengths, or a list is malformed.
    #[error("invalid tensor list: {0}")]
    InvalidList(String),
    /// The NCCL path is off in this clique (one device holds several ranks).
    #[error("the NCCL path cannot run here: {0}")]
    NcclUnavailable(String),
    /// The copy-engine path was forced where it cannot run: ranks in other processes, no peer
    /// access, inside a graph where ranks share a device, or a graph whose flags were
    /// replaced.
    #[error("the copy-engine path cannot run here: {0}")]
    CopyEngineUnavailable(String),
    /// The P2P path was forced where it cannot run.
    #[error("the P2P path cannot run here: {0}")]
    P2pUnavailable(String),
    /// An invalid setting (threshold, timeout, environment variable).
    #[error("invalid setting {name}: {reason}")]
    InvalidSetting {
        /// The setting's name.
        name: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA error during {during}: {source}")]
    Cuda {
        /// What gpucast was doing.
        during: String,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// The installed driver is older than the CUDA version this crate was built for.
    #[error("the CUDA driver supports CUDA {driver_major}.{driver_minor}, but gpucast was built for CUDA {built_major}.{built_minor}. Fix: update the driver, or build gpucast with an older `cuda-*` feature")]
    DriverTooOld {
        /// Driver's CUDA major version.
        driver_major: i32,
        /// Driver's CUDA minor version.
        driver_minor: i32,
        /// Build major version.
        built_major: i32,
        /// Build minor version.
        built_minor: i32,
    },
    /// An NCCL call failed.
    #[error("NCCL error during {during}: {message} (ncclResult_t {code})")]
    Nccl {
        /// What gpucast was doing.
        during: String,
        /// NCCL's result code.
        code: u32,
        /// NCCL's error string and last error message.
        message: String,
    },
    /// An NCCL call did not finish within the timeout (creating the communicators: a rank
    /// did not join; the first broadcast: a peer did not connect). The communicators were
    /// aborted.
    #[error("NCCL did not finish {during} within {waited_ms} ms; the communicators were aborted")]
    NcclTimeout {
        /// What gpucast was doing.
        during: String,
        /// How long it waited.
        waited_ms: u64,
    },
    /// The clique's NCCL communicators were aborted after a failure (`ncclCommAbort`), so that no
    /// rank waits forever for a peer; the NCCL path stays unusable for this clique. Broadcasts
    /// in flight when it happened have undefined outputs.
    #[error("the NCCL communicators were aborted ({reason}); outputs of calls {undefined_calls:?} are undefined; the NCCL path is closed until `recover()` (or a new communicator)")]
    CommunicatorsAborted {
        /// What made gpucast abort them.
        reason: String,
        /// The calls (numbered as [`crate::clique::Clique::calls`] counts them) that were still
        /// running when the communicators were aborted: their outputs are undefined. Empty
        /// when the error is reported again, to a later call.
        undefined_calls: Vec<u64>,
    },
    /// Work on the clique's streams did not finish within the bound `synchronize` waits
    /// (twice the timeout plus two seconds): work the caller queued on them, or a rank held
    /// back. Nothing was aborted; the work is still queued.
    #[error(
        "the streams did not finish within {waited_ms} ms (work queued on them is still running)"
    )]
    StreamsBusy {
        /// How long it waited.
        waited_ms: u64,
    },
    /// Another call held the clique longer than the bound a call waits for it (twice the
    /// timeout plus two seconds): a capture closure that waits for this call's thread, or a
    /// call stuck in the driver. Nothing was queued.
    #[error("another call held the clique for {waited_ms} ms (a capture closure waiting for this thread, or a call stuck in the driver); nothing was queued")]
    Busy {
        /// How long it waited.
        waited_ms: u64,
    },
    /// A launch thread did not take its launch in time. No job is left posted; ranks launched
    /// before the stall time out on their own, and the P2P state is reset before the next call.
    #[error("the launch thread of clique rank {rank} did not take its launch within {waited_ms} ms; the broadcast was cancelled and its outputs are undefined")]
    LaunchStalled {
        /// Rank whose launch thread stalled.
        rank: usize,
        /// How long the caller waited.
        waited_ms: u64,
    },
    /// A clique method was called while one of its streams is being captured: from inside
    /// that clique's own capture closure, on the capturing thread (it would wait for the
    /// capture to end, which waits for it), or while the caller captures a rank's stream
    /// (`Clique::stream`, `Communicator::stream`) into a graph of its own, which gpucast could
    /// not count or keep its memory alive for. Nothing was queued.
    #[error("a clique call was made while one of its streams is being captured (inside its own capture closure, or a capture the caller began on a rank's stream): queue broadcasts through a gpucast capture instead")]
    CaptureInProgress,
    /// Finding the other processes of the job, or exchanging data with them at
    /// initialisation, failed (a rank missing, a mismatch, a timeout: see the cause).
    #[error("rendezvous: {0}")]
    Rendezvous(std::sync::Arc<gpucast_rendezvous::RendezvousError>),
    /// Compiling the P2P kernel with NVRTC failed.
    #[error("NVRTC could not compile the P2P kernel for {arch}: {message}")]
    Compile {
        /// The target architecture.
        arch: String,
        /// NVRTC's message and log.
        message: String,
    },
    /// A P2P kernel waited longer than the clique's timeout for a peer. The clique's signal
    /// buffers were reset; the data of the broadcasts in flight is undefined.
    #[error("P2P broadcast timed out on clique rank {rank} ({phase}, block {block}, op {op}) after {timeout_ms} ms: a peer did not arrive. Signal buffers were reset")]
    Timeout {
        /// Rank whose kernel gave up.
        rank: usize,
        /// What it was waiting for.
        phase: &'static str,
        /// Thread block that gave up.
        block: u32,
        /// That block's operation counter.
        op: u32,
        /// The clique's timeout.
        timeout_ms: u64,
    },
    /// Ranks of one job made different calls: a rank on this host posted call `call` with
    /// other lengths, element types, root or paths than this rank. The rank that posts second
    /// gets this before anything is queued; the other at its next call or `synchronize`
    /// (instead of the timeout its call then ends in).
    #[error("ranks disagree on call {call}: rank {rank} passed {theirs}, this rank {mine}. Every rank must make the same calls, in the same order, with the same lengths, types, root and paths; this call's outputs are undefined")]
    CallMismatch {
        /// The call's number among this communicator's calls (from 0).
        call: u64,
        /// The peer whose call differs.
        rank: usize,
        /// What the peer passed.
        theirs: String,
        /// What this rank passed.
        mine: String,
    },
}

impl Error {
    pub(crate) fn cuda(during: impl Into<String>) -> impl FnOnce(DriverError) -> Error {
        let during = during.into();
        move |source| Error::Cuda { during, source }
    }
}

impl From<gpucast_rendezvous::RendezvousError> for Error {
    fn from(e: gpucast_rendezvous::RendezvousError) -> Error {
        Error::Rendezvous(std::sync::Arc::new(e))
    }
}
