//! What a caller can choose: the path, the size thresholds, per-call options, and every
//! `GPUCAST_*` environment variable. Pure: nothing here calls CUDA, so all of it is tested
//! without a GPU.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};

pub(crate) use crate::limits::{MAX_GPUS, PACKET_MAX_BYTES};

/// Default bound on every wait of a broadcast (a P2P kernel waiting for a peer).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// A clique's timeout and every bound derived from it, each computed here, saturating: a
/// timeout as long as `Duration::MAX` (a caller's "no limit") derives bounds that never
/// overflow, and every derived wait still ends at a stated time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timeouts {
    /// The bound on every wait for a peer: a P2P kernel's, the watchdog's for an NCCL call.
    pub wait: Duration,
}

impl Timeouts {
    /// Bounds derived from `wait`.
    pub(crate) const fn new(wait: Duration) -> Timeouts {
        Timeouts { wait }
    }

    /// The longest a host wait for the streams (or for an abort of NCCL) lasts while the
    /// clique lives: twice the timeout plus two seconds. A P2P kernel waits at most the
    /// timeout for a peer, then the timeout plus half a second plus its message at 4 GB/s for a
    /// reader that claimed its buffer (`p2p::abi::lease_bound_ns`): within this bound for
    /// messages of up to about 6 GB. A longer wait ends in [`Error::StreamsBusy`] with the work
    /// still queued, so buffers stay ordered behind it.
    pub(crate) fn drain(&self) -> Duration {
        self.wait
            .saturating_mul(2)
            .saturating_add(Duration::from_secs(2))
    }

    /// The longest a drop waits for the streams before it aborts NCCL: twice the timeout plus
    /// a second (a P2P kernel's longest wait for messages of up to 2 GB, see
    /// [`Timeouts::drain`]; past it the drop leaks the P2P memory rather than free it under a
    /// running kernel).
    pub(crate) fn drop_drain(&self) -> Duration {
        self.wait
            .saturating_mul(2)
            .saturating_add(Duration::from_secs(1))
    }

    /// The bound on creating NCCL communicators where every rank is in this process: NCCL's
    /// own setup, never less than a minute.
    pub(crate) fn nccl_init(&self) -> Duration {
        self.wait.max(Duration::from_secs(60))
    }
}

/// The path a broadcast takes, as a caller asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum BroadcastPath {
    /// Pick per call from the size and the topology (the default).
    #[default]
    Auto,
    /// Always `ncclBroadcast`.
    Nccl,
    /// Always gpucast's P2P kernel; an error where it cannot run.
    P2p,
    /// Always the copy engines (`cuMemcpyAsync` along a chain of the ranks, no kernel, no SM);
    /// an error where it cannot run (ranks in other processes).
    CopyEngine,
}

impl BroadcastPath {
    /// Parses `auto`, `nccl`, `p2p` or `copy-engine` (also `ce`; case-insensitive).
    pub fn parse(s: &str) -> Option<BroadcastPath> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(BroadcastPath::Auto),
            "nccl" => Some(BroadcastPath::Nccl),
            "p2p" => Some(BroadcastPath::P2p),
            "copy-engine" | "copy_engine" | "ce" => Some(BroadcastPath::CopyEngine),
            _ => None,
        }
    }

    /// Lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            BroadcastPath::Auto => "auto",
            BroadcastPath::Nccl => "nccl",
            BroadcastPath::P2p => "p2p",
            BroadcastPath::CopyEngine => "copy-engine",
        }
    }
}

impl std::str::FromStr for BroadcastPath {
    type Err = Error;

    /// As [`BroadcastPath::parse`], with an error that lists the names.
    fn from_str(s: &str) -> Result<BroadcastPath> {
        BroadcastPath::parse(s).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "unknown path `{s}`: one of auto, nccl, p2p, copy-engine"
            ))
        })
    }
}

impl std::fmt::Display for BroadcastPath {
    /// The name [`BroadcastPath::parse`] reads back.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What actually runs for one broadcast: the resolved form of a [`BroadcastPath`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Route {
    /// Nothing to move (zero length).
    Empty,
    /// `ncclBroadcast` in one group.
    Nccl,
    /// P2P, push protocol: the root writes {data, flag} packets into each peer's inbox; peers
    /// poll their own memory. No start or end barrier. For small messages.
    P2pPacket,
    /// P2P, pull protocol: peers read the root's buffer after its arrival flag, and tell the
    /// root when they are done. For medium and large messages.
    P2pPull,
    /// P2P, chain protocol: each rank reads the message from the rank before it in a chain
    /// that starts at the root, piece by piece, and forwards it, so that every link carries it
    /// once whatever the number of ranks. For large messages on more than two ranks of one
    /// process.
    P2pChain,
    /// The copy engines: each rank pushes the message into the rank after it in a chain that
    /// starts at the root, in chunks, so that every link carries it once. For large messages.
    CopyEngine,
}

impl Route {
    /// Short name used in logs and tables.
    pub fn name(self) -> &'static str {
        match self {
            Route::Empty => "empty",
            Route::Nccl => "nccl",
            Route::P2pPacket => "p2p-packet",
            Route::P2pPull => "p2p-pull",
            Route::P2pChain => "p2p-chain",
            Route::CopyEngine => "copy-engine",
        }
    }

    /// Whether this route runs the P2P kernel.
    pub fn is_p2p(self) -> bool {
        matches!(self, Route::P2pPacket | Route::P2pPull | Route::P2pChain)
    }
}

impl std::fmt::Display for Route {
    /// [`Route::name`].
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Byte sizes at which `Auto`'s choice changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Thresholds {
    /// `Auto` uses P2P for messages of at most this many bytes, NCCL above.
    pub p2p_max_bytes: usize,
    /// The P2P path uses the packet protocol up to this many bytes and the pull protocol above
    /// (capped at the packet inbox's capacity, 256 KiB).
    pub packet_max_bytes: usize,
    /// `Auto` uses the copy engines for messages of at least this many bytes, where they can
    /// run (ranks of one process); `usize::MAX` never.
    pub copy_engine_min_bytes: usize,
    /// The P2P kernel sends messages of at least this many bytes (above the packet switch)
    /// along the chain of ranks ([`Route::P2pChain`]) instead of letting every peer read the
    /// root, where the ranks share one process; `usize::MAX` never.
    pub p2p_chain_min_bytes: usize,
}

/// `Auto`'s defaults by number of GPUs: (GPUs, P2P limit, packet/pull switch, copy-engine
/// start).
///
/// - 2 GPUs, measured on 2 H200 (NV18) by `cargo bench --bench broadcast` (the files of
///   results/h200x2 open with their commit, GPU, driver, NCCL and command; aa6182f and
///   bea5932, timed with the host clock before the bench's event timer): the P2P kernel was
///   faster than NCCL at every size of results/h200x2/table.txt, eager and in graphs, and within
///   2.5% of it in the large runs (213.9 against 208.7 us at 64 MiB eager in
///   results/h200x2/large/table.txt, the one size it lost), so it has no limit of its own; the
///   packet protocol beat pull at every size it can carry; the copy-engine route overtakes the
///   P2P kernel at [`COPY_ENGINE_MIN_2_GPUS`].
/// - 3 to 8 GPUs: the P2P limit and the packet switch are a model, not a measurement
///   (`model_crossover`, in the tests: every peer pulls from the root, so the root's links
///   carry the data N-1 times, while NCCL's ring carries it once); no run on 3 or more GPUs
///   is on record at this code. The packet protocol's root writes twice the payload to each of
///   N-1 peers, so its switch point drops with N. Above the P2P limit `Auto` takes NCCL: the
///   copy-engine chain never (`usize::MAX`) until a run on 3 or more GPUs shows where it wins
///   (on 2 GPUs it lost to the P2P kernel at every size up to 32 MiB, large/table.txt).
pub(crate) const DEFAULT_THRESHOLDS: [(usize, usize, usize, usize); 7] = [
    (2, usize::MAX, PACKET_MAX_BYTES, COPY_ENGINE_MIN_2_GPUS),
    (3, 4 << 20, 64 << 10, usize::MAX),
    (4, 2 << 20, 64 << 10, usize::MAX),
    (5, 2 << 20, 32 << 10, usize::MAX),
    (6, 1 << 20, 32 << 10, usize::MAX),
    (7, 1 << 20, 32 << 10, usize::MAX),
    (8, 1 << 20, 32 << 10, usize::MAX),
];

/// Where `Auto` switches from the P2P kernel to the copy engines on 2 GPUs. From the two
/// committed runs of the final chain on 2 H200 (results/h200x2/large/table.txt and
/// table-run-4.txt, out of place, eager, timed before the bench's event timer): the chain beat
/// the P2P kernel at 64 MiB (196-198 against 214-215 us), 256 MiB (722-728 against 812-817 us)
/// and 1 GiB (2782-2820 against 3023-3046 us), lost at 32 MiB (110-111 against 103-104 us) and
/// at 128 MiB (384-388 against 379-381 us), and tied at 512 MiB. In place, or beside compute
/// (no SM taken: 0.1% compute slowdown against 24% for NCCL and 24.9% for the P2P kernel,
/// results/h200x2/interference), it is the better path anyway.
pub(crate) const COPY_ENGINE_MIN_2_GPUS: usize = 64 << 20;

/// The same switch inside CUDA graphs on 2 GPUs, where the chain waits on flags with stream
/// memory operations. In the same two runs, the chain won at 128 MiB (386-390 against 415-418
/// us for the P2P kernel), 256 MiB (739-745 against 794-799 us) and 1 GiB (2802-2842 against
/// 2986-2993 us), and lost at 64 MiB (221-223 against 207-209 us) and, by 4-5%, at 512 MiB
/// (1604-1613 against 1533-1535 us).
pub(crate) const COPY_ENGINE_MIN_2_GPUS_IN_GRAPHS: usize = 128 << 20;

/// Where the P2P kernel switches from fan-out (every peer reads the root) to the chain on `n`
/// GPUs, given `Auto`'s P2P limit there. With 2 GPUs both carry the message over the one link
/// once, and fan-out needs no hand-off per piece: never. Beyond, fan-out makes the root's links
/// carry the message N-1 times while the chain carries it once per link, so a call forced onto
/// P2P chains above the limit where `Auto` leaves the P2P kernel (the cost model's crossover).
pub(crate) fn chain_min_bytes(n: usize, p2p_max: usize) -> usize {
    if n <= 2 {
        usize::MAX
    } else {
        p2p_max.saturating_add(1)
    }
}

#[cfg(test)]
/// Fixed cost of an eager NCCL broadcast beyond the P2P kernel's, in seconds: a model parameter,
/// near the 2-GPU gap at <= 64 KiB in results/h200x2/table.txt (NCCL 14.1-20.2 us, P2P
/// 5.3-6.1 us eager; aa6182f, host timer). Not measured on 3 or more GPUs.
pub(crate) const MODEL_FIXED_GAP_S: f64 = 14e-6;
#[cfg(test)]
/// Bandwidth of one GPU's NVLink egress, bytes per second: a model parameter, within the 2-GPU
/// figures at 1 GiB in results/h200x2/table.txt (NCCL 361, P2P 369, copy engines 395 GB/s).
pub(crate) const MODEL_LINK_BYTES_PER_S: f64 = 370e9;

#[cfg(test)]
/// The message size above which NCCL's ring beats P2P fan-out from the root on `n` GPUs, by the
/// model `t_p2p = a + (n-1) S / B` against `t_nccl = a + gap + S / B`: `S* = gap B / (n - 2)`.
/// `None` for 1 or 2 GPUs, where fan-out is never slower.
pub(crate) fn model_crossover(n: usize) -> Option<usize> {
    if n <= 2 {
        return None;
    }
    let bytes = MODEL_FIXED_GAP_S * MODEL_LINK_BYTES_PER_S / (n - 2) as f64;
    // The model's output is a few MB: far inside usize.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a positive value of a few million"
    )]
    Some(bytes as usize)
}

/// `Auto`'s P2P limit for eager calls when the ranks are separate processes of one host: the
/// packet protocol's capacity. Peers cannot read the root's buffer there, so a pull message is
/// first copied into the root's shared staging buffer: one more call on the root's stream, which
/// costs more than NCCL's lead in eager mode. Measured on 2 H200 (results/h200x2/procs/
/// broadcast.csv, aa6182f, host timer): staged pull 11.3 and 13.4 us at 512 KiB and 1 MiB
/// against 8.3 and 11.8 us for a raw `ncclBroadcast`.
pub(crate) const DEFAULT_P2P_MAX_ACROSS_PROCESSES: usize = PACKET_MAX_BYTES;

/// The same limit inside CUDA graphs, where the staging copy costs no launch: the staged pull
/// beat a raw `ncclBroadcast` from 1 to 8 MiB (10.4 against 11.1 us at 1 MiB, 33.1 against
/// 35.7 us at 8 MiB), tied at 16 MiB and lost at 64 MiB (224.8 against 199.6 us) on 2 H200
/// (results/h200x2/procs/broadcast.csv, aa6182f, host timer).
pub(crate) const DEFAULT_P2P_MAX_ACROSS_PROCESSES_IN_GRAPHS: usize = 8 << 20;

impl Thresholds {
    /// These thresholds for ranks in separate processes of one host: the P2P limit is capped
    /// at `cap` (a limit the caller set is kept as it is).
    pub(crate) fn across_processes(mut self, caller_set: bool, cap: usize) -> Thresholds {
        if !caller_set {
            self.p2p_max_bytes = self.p2p_max_bytes.min(cap);
        }
        self
    }

    /// Defaults for a clique of `n` GPUs linked by NVLink (the table measured on H200s).
    pub fn for_gpus(n: usize) -> Thresholds {
        let row = DEFAULT_THRESHOLDS
            .iter()
            .rev()
            .find(|r| r.0 <= n.max(2))
            .expect("the table starts at 2 GPUs");
        Thresholds {
            p2p_max_bytes: row.1,
            packet_max_bytes: row.2,
            copy_engine_min_bytes: row.3,
            p2p_chain_min_bytes: chain_min_bytes(n, row.1),
        }
    }
}

/// Per-call choices of a broadcast: `BroadcastOptions::default()` (the clique's settings) or
/// [`BroadcastOptions::path`], then any of the setters.
///
/// The same type is each layer of settings, `None` where the layer leaves a setting to the
/// one below: a call's options over the builder's over the environment's (`GPUCAST_*`) over
/// the defaults. A clique resolves its builder's and the environment's once, when it is built;
/// each call lays its options over those, once. The timeout and the launch threads are set on
/// the builder only (a call's options leave them unset).
///
/// ```
/// use gpucast::{BroadcastOptions, BroadcastPath};
/// let pull = BroadcastOptions::path(BroadcastPath::P2p).packet_threshold(0);
/// assert_eq!(pull.packet_threshold, Some(0));
/// let auto = BroadcastOptions::default().p2p_threshold(1 << 20);
/// assert_eq!(auto.path, None);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BroadcastOptions {
    /// The path of this call; `None` takes the clique's default.
    pub path: Option<BroadcastPath>,
    /// `Auto`'s P2P limit in bytes for this call; `None` takes the clique's.
    pub p2p_threshold: Option<usize>,
    /// The P2P kernel's packet/pull switch point for this call; `None` takes the clique's.
    pub packet_threshold: Option<usize>,
    /// `Auto`'s copy-engine start in bytes for this call; `None` takes the clique's.
    pub copy_engine_threshold: Option<usize>,
    /// The P2P kernel's chain start in bytes for this call; `None` takes the clique's.
    pub p2p_chain_threshold: Option<usize>,
    /// The bound on every wait (builder and environment only).
    pub(crate) timeout: Option<Duration>,
    /// Whether the P2P kernel launches from one thread per GPU (builder and environment only).
    pub(crate) parallel_launch: Option<bool>,
}

impl BroadcastOptions {
    /// Options that force `path`.
    pub fn path(path: BroadcastPath) -> BroadcastOptions {
        BroadcastOptions {
            path: Some(path),
            ..BroadcastOptions::default()
        }
    }

    /// `Auto`'s P2P limit for this call, in bytes.
    #[must_use]
    pub fn p2p_threshold(mut self, bytes: usize) -> BroadcastOptions {
        self.p2p_threshold = Some(bytes);
        self
    }

    /// The P2P kernel's packet/pull switch point for this call, in bytes.
    #[must_use]
    pub fn packet_threshold(mut self, bytes: usize) -> BroadcastOptions {
        self.packet_threshold = Some(bytes);
        self
    }

    /// `Auto`'s copy-engine start for this call, in bytes.
    #[must_use]
    pub fn copy_engine_threshold(mut self, bytes: usize) -> BroadcastOptions {
        self.copy_engine_threshold = Some(bytes);
        self
    }

    /// The P2P kernel's chain start for this call, in bytes.
    #[must_use]
    pub fn p2p_chain_threshold(mut self, bytes: usize) -> BroadcastOptions {
        self.p2p_chain_threshold = Some(bytes);
        self
    }
}

/// Which routes can run for a call, and if one cannot, the error a call forcing it returns.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Available<'a> {
    pub p2p: std::result::Result<(), &'a Error>,
    pub copy_engine: std::result::Result<(), &'a Error>,
    /// `false` only where NCCL is off (a device holding several ranks).
    pub nccl: bool,
    /// Whether the P2P kernel may chain: every rank's buffers are addressable here (the ranks
    /// share one process).
    pub p2p_chain: bool,
}

/// Resolves `path` for a message of `bytes` bytes, given which routes can run.
pub(crate) fn choose(
    path: BroadcastPath,
    bytes: usize,
    available: Available<'_>,
    thresholds: &Thresholds,
) -> Result<Route> {
    if bytes == 0 {
        return Ok(Route::Empty);
    }
    let p2p_route = || {
        if bytes <= thresholds.packet_max_bytes.min(PACKET_MAX_BYTES) {
            Route::P2pPacket
        } else if available.p2p_chain && bytes >= thresholds.p2p_chain_min_bytes {
            Route::P2pChain
        } else {
            Route::P2pPull
        }
    };
    match path {
        BroadcastPath::Nccl => Ok(Route::Nccl),
        BroadcastPath::P2p => match available.p2p {
            Ok(()) => Ok(p2p_route()),
            Err(why) => Err(why.clone()),
        },
        BroadcastPath::CopyEngine => match available.copy_engine {
            Ok(()) => Ok(Route::CopyEngine),
            Err(why) => Err(why.clone()),
        },
        BroadcastPath::Auto => Ok(
            if available.copy_engine.is_ok() && bytes >= thresholds.copy_engine_min_bytes {
                Route::CopyEngine
            } else if available.p2p.is_ok() && bytes <= thresholds.p2p_max_bytes {
                p2p_route()
            } else if available.nccl {
                Route::Nccl
            } else if available.copy_engine.is_ok() {
                Route::CopyEngine
            } else if available.p2p.is_ok() {
                p2p_route()
            } else {
                Route::Nccl
            },
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Environment variables. Every GPUCAST_* variable the library reads is named here and read by
// `BroadcastOptions::from_env`, once per clique; README.md's table lists the same set (a test checks it).

/// `Auto`'s P2P limit (bytes; `K`, `M`, `G` suffixes, powers of 1024).
pub(crate) const P2P_THRESHOLD_ENV: &str = "GPUCAST_P2P_THRESHOLD";
/// The packet/pull switch point (bytes, suffixes allowed).
pub(crate) const PACKET_THRESHOLD_ENV: &str = "GPUCAST_PACKET_THRESHOLD";
/// `Auto`'s copy-engine start (bytes, suffixes allowed).
pub(crate) const COPY_ENGINE_THRESHOLD_ENV: &str = "GPUCAST_COPY_ENGINE_THRESHOLD";
/// Where a P2P broadcast of more than two ranks goes along the chain (bytes, suffixes allowed).
pub(crate) const P2P_CHAIN_THRESHOLD_ENV: &str = "GPUCAST_P2P_CHAIN_THRESHOLD";
/// Bound on every wait, in milliseconds (a positive integer).
pub(crate) const TIMEOUT_ENV: &str = "GPUCAST_TIMEOUT_MS";
/// `1`/`0` (also `on`/`off`, `true`/`false`): launch the P2P kernel from one thread per GPU.
pub(crate) const PARALLEL_LAUNCH_ENV: &str = "GPUCAST_PARALLEL_LAUNCH";
/// Default path of new cliques: `auto`, `nccl`, `p2p` or `copy-engine`.
pub(crate) const PATH_ENV: &str = "GPUCAST_PATH";
/// The NCCL library file to load instead of searching `libnccl.so.2` and `libnccl.so`.
pub(crate) const NCCL_LIBRARY_ENV: &str = "GPUCAST_NCCL_LIBRARY";
/// Overrides the host id ([`host_id`]), e.g. so that tests can pretend two processes are on
/// different nodes.
pub(crate) const HOST_ID_ENV: &str = "GPUCAST_HOST_ID";
/// Read by the NVRTC test only: `1` makes a missing libnvrtc a failure instead of a skip.
#[cfg(test)]
pub(crate) const REQUIRE_NVRTC_ENV: &str = "GPUCAST_REQUIRE_NVRTC";
#[cfg(test)]
use gpucast_rendezvous::{JOB_TOKEN_ENV, MASTER_ADDR_ENV, MASTER_PORT_ENV};

/// Every variable above with a one-line description: the README's table "Environment variables"
/// documents each (checked by a test).
#[cfg(test)]
pub(crate) const ENV_VARS: [(&str, &str); 13] = [
    (PATH_ENV, "default path: auto, nccl, p2p or copy-engine"),
    (
        P2P_THRESHOLD_ENV,
        "Auto's largest P2P message, bytes (4M, 256K, ...)",
    ),
    (
        PACKET_THRESHOLD_ENV,
        "packet/pull switch point of the P2P kernel, bytes",
    ),
    (
        COPY_ENGINE_THRESHOLD_ENV,
        "Auto's smallest copy-engine message, bytes",
    ),
    (
        P2P_CHAIN_THRESHOLD_ENV,
        "smallest P2P message sent along the chain of ranks, bytes",
    ),
    (TIMEOUT_ENV, "bound on every wait, milliseconds (> 0)"),
    (
        PARALLEL_LAUNCH_ENV,
        "1 or 0: launch from one thread per GPU",
    ),
    (NCCL_LIBRARY_ENV, "path of the NCCL library to load"),
    (
        REQUIRE_NVRTC_ENV,
        "tests: 1 makes a missing libnvrtc fail the NVRTC test",
    ),
    (
        MASTER_ADDR_ENV,
        "address of rank 0's rendezvous store (instead of MASTER_ADDR)",
    ),
    (
        MASTER_PORT_ENV,
        "port of rank 0's rendezvous store (instead of MASTER_PORT; under torchrun: a store of gpucast's own)",
    ),
    (
        JOB_TOKEN_ENV,
        "the job's secret, the same on every rank (e.g. openssl rand -hex 32)",
    ),
    (
        HOST_ID_ENV,
        "this process's host id: ranks with equal ids share GPUs through P2P",
    ),
];

impl BroadcastOptions {
    /// The layer the process environment sets.
    pub(crate) fn from_env() -> Result<BroadcastOptions> {
        BroadcastOptions::parse(|name| std::env::var_os(name))
    }

    /// This layer over `lower`: each setting from the first layer that sets it.
    pub(crate) fn over(&self, lower: &BroadcastOptions) -> BroadcastOptions {
        BroadcastOptions {
            path: self.path.or(lower.path),
            p2p_threshold: self.p2p_threshold.or(lower.p2p_threshold),
            packet_threshold: self.packet_threshold.or(lower.packet_threshold),
            copy_engine_threshold: self.copy_engine_threshold.or(lower.copy_engine_threshold),
            p2p_chain_threshold: self.p2p_chain_threshold.or(lower.p2p_chain_threshold),
            timeout: self.timeout.or(lower.timeout),
            parallel_launch: self.parallel_launch.or(lower.parallel_launch),
        }
    }

    /// The thresholds this layer sets, over `t`.
    fn thresholds_over(&self, mut t: Thresholds) -> Thresholds {
        if let Some(b) = self.p2p_threshold {
            t.p2p_max_bytes = b;
        }
        if let Some(b) = self.packet_threshold {
            t.packet_max_bytes = b;
        }
        if let Some(b) = self.copy_engine_threshold {
            t.copy_engine_min_bytes = b;
        }
        if let Some(b) = self.p2p_chain_threshold {
            t.p2p_chain_min_bytes = b;
        }
        t
    }

    /// Rejects what no number of GPUs makes valid (a zero timeout): checked before anything
    /// touches the driver.
    pub(crate) fn check(&self) -> Result<()> {
        if self.timeout.is_some_and(|t| t.is_zero()) {
            return Err(invalid(
                "timeout",
                "must be longer than zero (every wait would fail at once)".into(),
            ));
        }
        Ok(())
    }

    /// Parses the variables through `lookup`; a set but malformed variable is an error.
    pub(crate) fn parse(lookup: impl Fn(&str) -> Option<OsString>) -> Result<BroadcastOptions> {
        let text = |name: &'static str| -> Result<Option<String>> {
            match lookup(name) {
                None => Ok(None),
                Some(v) => v
                    .into_string()
                    .map(Some)
                    .map_err(|v| invalid(name, format!("{v:?} is not valid UTF-8"))),
            }
        };
        let bytes = |name: &'static str| -> Result<Option<usize>> {
            text(name)?
                .map(|v| {
                    parse_bytes(&v).ok_or_else(|| {
                        invalid(
                            name,
                            format!("{v:?} is not a byte count (262144, 256K, 4M)"),
                        )
                    })
                })
                .transpose()
        };
        let path = text(PATH_ENV)?
            .map(|v| {
                BroadcastPath::parse(&v).ok_or_else(|| {
                    invalid(
                        PATH_ENV,
                        format!("{v:?} is not auto, nccl, p2p or copy-engine"),
                    )
                })
            })
            .transpose()?;
        let timeout = text(TIMEOUT_ENV)?
            .map(|v| match v.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
                _ => Err(invalid(
                    TIMEOUT_ENV,
                    format!("{v:?} is not a positive number of milliseconds"),
                )),
            })
            .transpose()?;
        let parallel_launch = text(PARALLEL_LAUNCH_ENV)?
            .map(|v| {
                parse_switch(&v).ok_or_else(|| {
                    invalid(
                        PARALLEL_LAUNCH_ENV,
                        format!("{v:?} is not 1/0, on/off or true/false"),
                    )
                })
            })
            .transpose()?;
        Ok(BroadcastOptions {
            path,
            p2p_threshold: bytes(P2P_THRESHOLD_ENV)?,
            packet_threshold: bytes(PACKET_THRESHOLD_ENV)?,
            copy_engine_threshold: bytes(COPY_ENGINE_THRESHOLD_ENV)?,
            p2p_chain_threshold: bytes(P2P_CHAIN_THRESHOLD_ENV)?,
            timeout,
            parallel_launch,
        })
    }
}

/// The NCCL library named by [`NCCL_LIBRARY_ENV`], if set. A set value must name an existing
/// file: a typo there is an error, not a silent fall-back to another NCCL.
pub(crate) fn nccl_library(lookup: impl Fn(&str) -> Option<OsString>) -> Result<Option<PathBuf>> {
    match lookup(NCCL_LIBRARY_ENV) {
        None => Ok(None),
        Some(v) if v.is_empty() => Err(invalid(NCCL_LIBRARY_ENV, "is set but empty".into())),
        Some(v) => {
            let path = PathBuf::from(v);
            if path.is_file() {
                Ok(Some(path))
            } else {
                Err(invalid(
                    NCCL_LIBRARY_ENV,
                    format!("{} is not a file", path.display()),
                ))
            }
        }
    }
}

/// [`nccl_library`] of the process environment.
pub(crate) fn nccl_library_from_env() -> Result<Option<PathBuf>> {
    nccl_library(|name| std::env::var_os(name))
}

/// Whether the NVRTC test must fail (rather than skip) without libnvrtc.
#[cfg(test)]
pub(crate) fn require_nvrtc() -> bool {
    std::env::var(REQUIRE_NVRTC_ENV).is_ok_and(|v| parse_switch(&v) == Some(true))
}

fn invalid(name: &'static str, reason: String) -> Error {
    Error::InvalidSetting { name, reason }
}

/// `v` trimmed, unless that leaves nothing.
fn nonempty(v: Option<String>) -> Option<String> {
    v.map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

/// The trimmed contents of `path`, unless empty or systemd's placeholder `uninitialized`.
fn read_trimmed(path: &str) -> Option<String> {
    nonempty(std::fs::read_to_string(path).ok()).filter(|s| s != "uninitialized")
}

/// An identifier of the physical host this process runs on: processes with the same id share
/// a node (and may use peer-to-peer links between their GPUs).
///
/// The value of `GPUCAST_HOST_ID` ([`HOST_ID_ENV`]) through `lookup` if set (so tests can
/// pretend to be on different nodes); otherwise the host name (from
/// `/proc/sys/kernel/hostname`, else `HOSTNAME` through `lookup`), then `/` and the contents
/// of `/etc/machine-id` (else `/proc/sys/kernel/random/boot_id`) when readable. Processes in
/// different containers on one machine usually get different ids (their host names differ),
/// which errs on the safe side.
pub(crate) fn host_id(lookup: impl Fn(&str) -> Option<String>) -> String {
    if let Some(id) = nonempty(lookup(HOST_ID_ENV)) {
        return id;
    }
    let hostname =
        read_trimmed("/proc/sys/kernel/hostname").or_else(|| nonempty(lookup("HOSTNAME")));
    let hostname = hostname.unwrap_or_else(|| "unknown-host".to_owned());
    let machine = read_trimmed("/etc/machine-id");
    let machine = machine.or_else(|| read_trimmed("/proc/sys/kernel/random/boot_id"));
    match machine {
        Some(machine) => format!("{hostname}/{machine}"),
        None => hostname,
    }
}

/// `1`, `on`, `true`, `yes` / `0`, `off`, `false`, `no` (case-insensitive).
pub(crate) fn parse_switch(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "on" | "true" | "yes" => Some(true),
        "0" | "off" | "false" | "no" => Some(false),
        _ => None,
    }
}

/// Parses a byte count such as `65536`, `64K`, `64KiB`, `4M`, `1G`.
pub fn parse_bytes(s: &str) -> Option<usize> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().ok()?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// The settings of one clique, resolved from the builder, then the environment, then defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Settings {
    pub path: BroadcastPath,
    pub thresholds: Thresholds,
    /// `Auto`'s thresholds for calls queued inside a capture.
    pub graph_thresholds: Thresholds,
    /// The timeout and its derived bounds.
    pub timeouts: Timeouts,
    pub parallel_launch: bool,
}

impl Settings {
    /// Resolves the settings of a clique or communicator of `gpus` GPUs (on this host), from
    /// the builder's layer over the environment's over the defaults; rejects a zero timeout.
    pub(crate) fn resolve(
        builder: &BroadcastOptions,
        env: &BroadcastOptions,
        gpus: usize,
    ) -> Result<Settings> {
        let layer = builder.over(env);
        layer.check()?;
        let thresholds = layer.thresholds_over(Thresholds::for_gpus(gpus));
        let mut graph_thresholds = thresholds;
        if gpus <= 2 && layer.copy_engine_threshold.is_none() {
            graph_thresholds.copy_engine_min_bytes = COPY_ENGINE_MIN_2_GPUS_IN_GRAPHS;
        }
        Ok(Settings {
            path: layer.path.unwrap_or_default(),
            thresholds,
            graph_thresholds,
            timeouts: Timeouts::new(layer.timeout.unwrap_or(DEFAULT_TIMEOUT)),
            parallel_launch: layer.parallel_launch.unwrap_or(true),
        })
    }

    /// What one call runs with, eager or queued inside a capture (`in_graph`): the call's
    /// options over these settings.
    pub(crate) fn for_call(&self, call: &BroadcastOptions, in_graph: bool) -> CallSettings {
        let settled = if in_graph {
            self.graph_thresholds
        } else {
            self.thresholds
        };
        CallSettings {
            path: call.path.unwrap_or(self.path),
            thresholds: call.thresholds_over(settled),
            in_graph,
        }
    }
}

/// The settings of one call, resolved once ([`Settings::for_call`]) for every route it plans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallSettings {
    pub path: BroadcastPath,
    pub thresholds: Thresholds,
    /// Whether the call is queued inside a capture (what can run there differs).
    pub in_graph: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn host_id_prefers_the_override() {
        assert_eq!(
            host_id(|k| (k == HOST_ID_ENV).then(|| "fake-node-1".to_owned())),
            "fake-node-1"
        );
        let real = host_id(|_| None);
        assert!(!real.is_empty());
        assert_eq!(real, host_id(|_| None), "stable within a boot");
    }

    fn env_of(pairs: &[(&str, &str)]) -> Result<BroadcastOptions> {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        BroadcastOptions::parse(|k| map.get(k).cloned())
    }

    #[test]
    fn environment_values_parse_or_fail_loudly() {
        assert_eq!(env_of(&[]).unwrap(), BroadcastOptions::default());
        let e = env_of(&[
            (PATH_ENV, "P2P"),
            (P2P_THRESHOLD_ENV, "4M"),
            (PACKET_THRESHOLD_ENV, "64KiB"),
            (TIMEOUT_ENV, "250"),
            (PARALLEL_LAUNCH_ENV, "off"),
        ])
        .unwrap();
        assert_eq!(e.path, Some(BroadcastPath::P2p));
        assert_eq!(e.p2p_threshold, Some(4 << 20));
        assert_eq!(e.packet_threshold, Some(64 << 10));
        assert_eq!(e.timeout, Some(Duration::from_millis(250)));
        assert_eq!(e.parallel_launch, Some(false));
        for (name, bad) in [
            (PATH_ENV, "fast"),
            (P2P_THRESHOLD_ENV, "4 parsecs"),
            (PACKET_THRESHOLD_ENV, "-1"),
            (TIMEOUT_ENV, "0"),
            (TIMEOUT_ENV, "soon"),
            (PARALLEL_LAUNCH_ENV, "garbage"),
            (PARALLEL_LAUNCH_ENV, ""),
        ] {
            match env_of(&[(name, bad)]) {
                Err(Error::InvalidSetting { name: n, reason }) => {
                    assert_eq!(n, name);
                    assert!(reason.contains(bad), "{reason}");
                }
                other => panic!("{name}={bad:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn nccl_library_must_name_a_file() {
        let lookup = |v: &'static str| move |k: &str| (k == NCCL_LIBRARY_ENV).then(|| v.into());
        assert_eq!(nccl_library(|_| None).unwrap(), None);
        let err = nccl_library(lookup("/no/such/libnccl.so.2")).unwrap_err();
        assert!(err.to_string().contains("/no/such/libnccl.so.2"), "{err}");
        assert!(nccl_library(lookup("")).is_err());
        let here = std::env::current_exe().unwrap();
        let here_str: &'static str = Box::leak(here.to_string_lossy().into_owned().into());
        assert_eq!(nccl_library(lookup(here_str)).unwrap(), Some(here));
    }

    #[test]
    fn builder_beats_environment_beats_defaults() {
        let env = BroadcastOptions {
            p2p_threshold: Some(1000),
            timeout: Some(Duration::from_millis(5)),
            parallel_launch: Some(false),
            ..BroadcastOptions::default()
        };
        let req = BroadcastOptions {
            p2p_threshold: Some(7),
            ..BroadcastOptions::default()
        };
        let s = Settings::resolve(&req, &env, 4).unwrap();
        assert_eq!(s.thresholds.p2p_max_bytes, 7);
        assert_eq!(
            s.thresholds.packet_max_bytes,
            Thresholds::for_gpus(4).packet_max_bytes
        );
        assert_eq!(s.timeouts.wait, Duration::from_millis(5));
        assert!(!s.parallel_launch);
        assert_eq!(s.path, BroadcastPath::Auto);
        let d = Settings::resolve(
            &BroadcastOptions::default(),
            &BroadcastOptions::default(),
            2,
        )
        .unwrap();
        assert_eq!(d.timeouts.wait, DEFAULT_TIMEOUT);
        assert!(d.parallel_launch);
        let zero = BroadcastOptions {
            timeout: Some(Duration::ZERO),
            ..BroadcastOptions::default()
        };
        assert!(matches!(
            Settings::resolve(&zero, &BroadcastOptions::default(), 2),
            Err(Error::InvalidSetting {
                name: "timeout",
                ..
            })
        ));
        let huge = BroadcastOptions {
            timeout: Some(Duration::MAX),
            ..BroadcastOptions::default()
        };
        let t = Settings::resolve(&huge, &BroadcastOptions::default(), 2)
            .unwrap()
            .timeouts;
        // Every derived bound saturates instead of overflowing.
        assert_eq!(t.drain(), Duration::MAX);
        assert_eq!(t.drop_drain(), Duration::MAX);
        assert_eq!(t.nccl_init(), Duration::MAX);
    }

    #[test]
    fn each_setting_comes_from_the_highest_layer_that_sets_it() {
        // Layers that set everything, each to other values.
        let layer = |k: usize| BroadcastOptions {
            path: Some(
                [
                    BroadcastPath::Nccl,
                    BroadcastPath::P2p,
                    BroadcastPath::CopyEngine,
                ][k],
            ),
            p2p_threshold: Some(10 + k),
            packet_threshold: Some(20 + k),
            copy_engine_threshold: Some(30 + k),
            p2p_chain_threshold: Some(40 + k),
            timeout: Some(Duration::from_millis(50 + k as u64)),
            parallel_launch: Some(k == 1),
        };
        let set = |k: usize| Thresholds {
            p2p_max_bytes: 10 + k,
            packet_max_bytes: 20 + k,
            copy_engine_min_bytes: 30 + k,
            p2p_chain_min_bytes: 40 + k,
        };
        let none = BroadcastOptions::default();
        let (env, builder, call) = (layer(0), layer(1), layer(2));
        for (upper, lower, k) in [(&builder, &env, 1), (&none, &env, 0), (&builder, &none, 1)] {
            let s = Settings::resolve(upper, lower, 2).unwrap();
            assert_eq!(Some(s.path), layer(k).path);
            assert_eq!(
                (s.thresholds, s.graph_thresholds),
                (set(k), set(k)),
                "layer {k}"
            );
            assert_eq!(s.timeouts.wait, Duration::from_millis(50 + k as u64));
            assert_eq!(s.parallel_launch, k == 1);
            // A call's options go over the clique's, eager and inside a capture; a call that
            // sets nothing runs with the clique's.
            for in_graph in [false, true] {
                let c = s.for_call(&call, in_graph);
                assert_eq!(
                    (c.path, c.thresholds, c.in_graph),
                    (BroadcastPath::CopyEngine, set(2), in_graph)
                );
                let c = s.for_call(&none, in_graph);
                assert_eq!((c.path, c.thresholds), (s.path, set(k)));
            }
        }
        // The setters set what the fields say.
        assert_eq!(
            BroadcastOptions::path(BroadcastPath::CopyEngine)
                .p2p_threshold(12)
                .packet_threshold(22)
                .copy_engine_threshold(32)
                .p2p_chain_threshold(42),
            BroadcastOptions {
                timeout: None,
                parallel_launch: None,
                ..call
            }
        );
    }

    #[test]
    fn derived_bounds() {
        let t = Timeouts::new(Duration::from_millis(250));
        assert_eq!(t.drain(), Duration::from_millis(2500));
        assert_eq!(t.drop_drain(), Duration::from_millis(1500));
        assert_eq!(t.nccl_init(), Duration::from_secs(60));
    }

    #[test]
    fn readme_lists_every_variable() {
        let readme = include_str!("../README.md");
        for (name, _) in ENV_VARS {
            assert!(
                readme.contains(&format!("`{name}`")),
                "README.md does not document {name}"
            );
        }
        // And no other module reads the environment: every variable goes through this file,
        // or, for the rendezvous (which uses nothing else of gpucast), through its env.rs.
        let src = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
        if !src.is_dir() {
            // A test binary carried to another machine (the GPU batch) has no source tree.
            eprintln!(
                "SKIPPED source walk: {} is not on this machine",
                src.display()
            );
            return;
        }
        let mut files = vec![src];
        let mut checked = 0;
        while let Some(path) = files.pop() {
            if path.is_dir() {
                files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
            } else if path.extension().is_some_and(|e| e == "rs")
                && !path.ends_with("config.rs")
                && !path.ends_with("rendezvous/env.rs")
            {
                let text = std::fs::read_to_string(&path).unwrap();
                assert!(
                    !text.contains("env::var"),
                    "{} reads the environment: do it in config.rs",
                    path.display()
                );
                checked += 1;
            }
        }
        assert!(checked > 10, "walked only {checked} files");
    }

    #[test]
    fn defaults_follow_the_cost_model() {
        // Two GPUs: fan-out from the root never loses to the ring (measured to 1 GiB).
        assert_eq!(model_crossover(2), None);
        assert_eq!(Thresholds::for_gpus(2).p2p_max_bytes, usize::MAX);
        assert_eq!(Thresholds::for_gpus(1), Thresholds::for_gpus(2));
        for n in 3..=MAX_GPUS {
            let t = Thresholds::for_gpus(n);
            let model = model_crossover(n).unwrap();
            // Within a factor of two of the model's crossover, and shrinking with N.
            assert!(
                t.p2p_max_bytes <= 2 * model && 2 * t.p2p_max_bytes >= model,
                "{n} GPUs: default {} vs model {model}",
                t.p2p_max_bytes
            );
            let fewer = Thresholds::for_gpus(n - 1);
            assert!(t.p2p_max_bytes <= fewer.p2p_max_bytes, "{n} GPUs");
            assert!(t.packet_max_bytes <= fewer.packet_max_bytes, "{n} GPUs");
            assert!(t.packet_max_bytes <= PACKET_MAX_BYTES);
        }
        // Every row of the table is reachable and rows are in order.
        for (i, row) in DEFAULT_THRESHOLDS.iter().enumerate() {
            assert_eq!(row.0, i + 2);
            assert_eq!(Thresholds::for_gpus(row.0).p2p_max_bytes, row.1);
        }
    }

    /// No run on 3 or more GPUs is on record at this code: there `Auto` keeps to the paths
    /// measured against each other on 2 GPUs (P2P up to the model's limit, NCCL above), and in
    /// particular never sends 1-4 MiB down the copy-engine chain, which on 2 GPUs lost to the
    /// P2P kernel at every size up to 32 MiB (results/h200x2/large/table.txt).
    #[test]
    fn auto_takes_nccl_or_p2p_where_no_run_of_three_or_more_gpus_exists() {
        let everything = Available {
            p2p: Ok(()),
            copy_engine: Ok(()),
            nccl: true,
            p2p_chain: true,
        };
        let mut sizes: Vec<usize> = (0..=30).map(|k| 1usize << k).collect();
        sizes.extend([(1 << 20) + 1, (2 << 20) + 1, (4 << 20) + 1, 3 << 20]);
        for n in 3..=MAX_GPUS {
            let t = Thresholds::for_gpus(n);
            for &bytes in &sizes {
                let route = choose(BroadcastPath::Auto, bytes, everything, &t).unwrap();
                let want = if bytes <= t.p2p_max_bytes {
                    route.is_p2p() && route != Route::P2pChain
                } else {
                    route == Route::Nccl
                };
                assert!(want, "{n} GPUs, {bytes} bytes: Auto took {route:?}");
            }
        }
        // Two GPUs keep the measured switch to the copy engines.
        let two = Thresholds::for_gpus(2);
        assert_eq!(
            choose(
                BroadcastPath::Auto,
                COPY_ENGINE_MIN_2_GPUS,
                everything,
                &two
            )
            .unwrap(),
            Route::CopyEngine
        );
        assert!(choose(BroadcastPath::Auto, 4 << 20, everything, &two)
            .unwrap()
            .is_p2p());
    }

    #[test]
    fn processes_cap_the_p2p_limit_unless_the_caller_set_it() {
        let t = Thresholds::for_gpus(2);
        let cap = DEFAULT_P2P_MAX_ACROSS_PROCESSES;
        assert_eq!(t.across_processes(false, cap).p2p_max_bytes, cap);
        assert_eq!(t.across_processes(true, cap), t);
        let small = Thresholds::for_gpus(8);
        assert_eq!(small.across_processes(false, 8 << 20), small);
        // Eager calls hand over to NCCL where a staged pull would start, graphs later.
        const {
            assert!(DEFAULT_P2P_MAX_ACROSS_PROCESSES <= PACKET_MAX_BYTES);
            assert!(DEFAULT_P2P_MAX_ACROSS_PROCESSES_IN_GRAPHS > DEFAULT_P2P_MAX_ACROSS_PROCESSES);
        }
    }

    #[test]
    fn choice_follows_path_size_and_availability() {
        let t = Thresholds {
            p2p_max_bytes: 1 << 20,
            packet_max_bytes: 64 << 10,
            copy_engine_min_bytes: 64 << 20,
            p2p_chain_min_bytes: usize::MAX,
        };
        let no = Error::P2pUnavailable("GPU 0 and 1 lack peer access".into());
        let no_ce = Error::CopyEngineUnavailable("ranks in other processes".into());
        let p2p_only = |p2p| Available {
            p2p,
            copy_engine: Err(&no_ce),
            nccl: true,
            p2p_chain: false,
        };
        let c = |path, bytes, ok: bool| {
            choose(
                path,
                bytes,
                p2p_only(if ok { Ok(()) } else { Err(&no) }),
                &t,
            )
        };
        assert_eq!(c(BroadcastPath::Auto, 0, true).unwrap(), Route::Empty);
        assert_eq!(
            c(BroadcastPath::Auto, 1024, true).unwrap(),
            Route::P2pPacket
        );
        assert_eq!(
            c(BroadcastPath::Auto, 64 << 10, true).unwrap(),
            Route::P2pPacket
        );
        assert_eq!(
            c(BroadcastPath::Auto, (64 << 10) + 1, true).unwrap(),
            Route::P2pPull
        );
        assert_eq!(
            c(BroadcastPath::Auto, 1 << 20, true).unwrap(),
            Route::P2pPull
        );
        assert_eq!(
            c(BroadcastPath::Auto, (1 << 20) + 1, true).unwrap(),
            Route::Nccl
        );
        assert_eq!(c(BroadcastPath::Auto, 1024, false).unwrap(), Route::Nccl);
        assert_eq!(c(BroadcastPath::Nccl, 1024, true).unwrap(), Route::Nccl);
        assert_eq!(
            c(BroadcastPath::P2p, 1 << 30, true).unwrap(),
            Route::P2pPull
        );
        let e = c(BroadcastPath::P2p, 1024, false).unwrap_err();
        assert!(matches!(e, Error::P2pUnavailable(ref m) if m.contains("peer access")));
        // A forced P2P call without NVRTC returns the library error itself.
        let lib = Error::LibraryMissing {
            library: "libnvrtc",
            detail: "not found".into(),
            hint: "install it",
        };
        assert!(matches!(
            choose(BroadcastPath::P2p, 8, p2p_only(Err(&lib)), &t),
            Err(Error::LibraryMissing {
                library: "libnvrtc",
                ..
            })
        ));
        // A packet threshold above what the inbox holds is capped.
        let big = Thresholds {
            p2p_max_bytes: 1 << 30,
            packet_max_bytes: 1 << 30,
            copy_engine_min_bytes: usize::MAX,
            p2p_chain_min_bytes: usize::MAX,
        };
        assert_eq!(
            choose(
                BroadcastPath::P2p,
                PACKET_MAX_BYTES + 1,
                p2p_only(Ok(())),
                &big
            )
            .unwrap(),
            Route::P2pPull
        );
        // With the copy engines, Auto takes them from their threshold on, P2P or not.
        let all = Available {
            p2p: Ok(()),
            copy_engine: Ok(()),
            nccl: true,
            p2p_chain: false,
        };
        assert_eq!(
            choose(BroadcastPath::Auto, (64 << 20) - 1, all, &t).unwrap(),
            Route::Nccl
        );
        assert_eq!(
            choose(BroadcastPath::Auto, 64 << 20, all, &t).unwrap(),
            Route::CopyEngine
        );
        let ce_only = Available {
            p2p: Err(&no),
            copy_engine: Ok(()),
            nccl: true,
            p2p_chain: false,
        };
        assert_eq!(
            choose(BroadcastPath::Auto, 1 << 30, ce_only, &t).unwrap(),
            Route::CopyEngine
        );
        // Without NCCL (several ranks on one device), Auto takes what can run.
        let no_nccl = Available { nccl: false, ..all };
        assert_eq!(
            choose(BroadcastPath::Auto, 2 << 20, no_nccl, &t).unwrap(),
            Route::CopyEngine
        );
        let p2p_no_nccl = Available {
            copy_engine: Err(&no_ce),
            ..no_nccl
        };
        assert_eq!(
            choose(BroadcastPath::Auto, 2 << 20, p2p_no_nccl, &t).unwrap(),
            Route::P2pPull
        );
        assert_eq!(
            choose(BroadcastPath::CopyEngine, 1, all, &t).unwrap(),
            Route::CopyEngine
        );
        assert!(matches!(
            choose(BroadcastPath::CopyEngine, 1, p2p_only(Ok(())), &t),
            Err(Error::CopyEngineUnavailable(_))
        ));
    }

    #[test]
    fn parse_bytes_units() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("64K"), Some(65536));
        assert_eq!(parse_bytes("64KiB"), Some(65536));
        assert_eq!(parse_bytes("4m"), Some(4 << 20));
        assert_eq!(parse_bytes("1G"), Some(1 << 30));
        assert_eq!(parse_bytes("x"), None);
        assert_eq!(parse_bytes("12Q"), None);
        assert_eq!(parse_bytes(""), None);
        assert_eq!(parse_bytes("99999999999999999999G"), None);
    }

    #[test]
    fn graphs_take_the_copy_engines_later_unless_told() {
        let two = Settings::resolve(
            &BroadcastOptions::default(),
            &BroadcastOptions::default(),
            2,
        )
        .unwrap();
        assert_eq!(two.thresholds.copy_engine_min_bytes, COPY_ENGINE_MIN_2_GPUS);
        assert_eq!(
            two.graph_thresholds.copy_engine_min_bytes,
            COPY_ENGINE_MIN_2_GPUS_IN_GRAPHS
        );
        let set = BroadcastOptions {
            copy_engine_threshold: Some(1 << 20),
            ..BroadcastOptions::default()
        };
        let two = Settings::resolve(&set, &BroadcastOptions::default(), 2).unwrap();
        assert_eq!(two.graph_thresholds.copy_engine_min_bytes, 1 << 20);
        let four = Settings::resolve(
            &BroadcastOptions::default(),
            &BroadcastOptions::default(),
            4,
        )
        .unwrap();
        assert_eq!(four.graph_thresholds, four.thresholds);
    }

    #[test]
    fn the_p2p_kernel_chains_large_messages_beyond_two_ranks_of_one_process() {
        let two = Thresholds::for_gpus(2);
        assert_eq!(two.p2p_chain_min_bytes, usize::MAX);
        for n in 3..=MAX_GPUS {
            let t = Thresholds::for_gpus(n);
            assert_eq!(t.p2p_chain_min_bytes, t.p2p_max_bytes + 1, "{n} GPUs");
            assert!(t.p2p_chain_min_bytes > t.packet_max_bytes, "{n} GPUs");
        }
        let t = Thresholds::for_gpus(4);
        let here = Available {
            p2p: Ok(()),
            copy_engine: Ok(()),
            nccl: true,
            p2p_chain: true,
        };
        let c = |bytes, available| choose(BroadcastPath::P2p, bytes, available, &t).unwrap();
        assert_eq!(c(t.p2p_chain_min_bytes, here), Route::P2pChain);
        assert_eq!(c(t.p2p_chain_min_bytes - 1, here), Route::P2pPull);
        assert_eq!(c(1024, here), Route::P2pPacket);
        let apart = Available {
            p2p_chain: false,
            ..here
        };
        assert_eq!(c(1 << 30, apart), Route::P2pPull);
        // Auto takes NCCL there until a run on 4 GPUs places the copy engines; told where they
        // start, it takes them (no SM, the same one copy per link).
        assert_eq!(
            choose(BroadcastPath::Auto, 1 << 30, here, &t).unwrap(),
            Route::Nccl
        );
        let told = Thresholds {
            copy_engine_min_bytes: 64 << 20,
            ..t
        };
        assert_eq!(
            choose(BroadcastPath::Auto, 1 << 30, here, &told).unwrap(),
            Route::CopyEngine
        );
        // The threshold follows builder, environment and call, like the others.
        let env = env_of(&[(P2P_CHAIN_THRESHOLD_ENV, "8M")]).unwrap();
        let s = Settings::resolve(&BroadcastOptions::default(), &env, 2).unwrap();
        assert_eq!(s.thresholds.p2p_chain_min_bytes, 8 << 20);
        assert_eq!(s.graph_thresholds.p2p_chain_min_bytes, 8 << 20);
        let req = BroadcastOptions {
            p2p_chain_threshold: Some(1 << 20),
            ..BroadcastOptions::default()
        };
        let s = Settings::resolve(&req, &env, 2).unwrap();
        assert_eq!(s.thresholds.p2p_chain_min_bytes, 1 << 20);
        let call = BroadcastOptions {
            p2p_chain_threshold: Some(0),
            ..BroadcastOptions::default()
        };
        assert_eq!(s.for_call(&call, true).thresholds.p2p_chain_min_bytes, 0);
        assert!(env_of(&[(P2P_CHAIN_THRESHOLD_ENV, "lots")]).is_err());
    }

    #[test]
    fn paths_parse() {
        assert_eq!(BroadcastPath::parse("CE"), Some(BroadcastPath::CopyEngine));
        for p in [
            BroadcastPath::Auto,
            BroadcastPath::Nccl,
            BroadcastPath::P2p,
            BroadcastPath::CopyEngine,
        ] {
            assert_eq!(BroadcastPath::parse(p.name()), Some(p));
        }
        assert_eq!(BroadcastPath::parse(" NCCL "), Some(BroadcastPath::Nccl));
        assert_eq!(BroadcastPath::parse("ring"), None);
        for p in [
            BroadcastPath::Auto,
            BroadcastPath::Nccl,
            BroadcastPath::P2p,
            BroadcastPath::CopyEngine,
        ] {
            assert_eq!(p.to_string().parse::<BroadcastPath>().unwrap(), p);
        }
        let e = "ring".parse::<BroadcastPath>().unwrap_err().to_string();
        assert!(e.contains("ring") && e.contains("copy-engine"), "{e}");
        assert_eq!(Route::P2pPull.to_string(), "p2p-pull");
    }
}
