//! Pure decisions, no CUDA calls: argument validation, the choice of path, launch geometry, the
//! signal-buffer layout. Everything here is tested without a GPU.

use crate::error::{Error, Result};

/// Most GPUs in one clique.
pub const MAX_GPUS: usize = 8;

/// The path a broadcast takes, as a caller asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Path {
    /// Pick per call from the size and the topology (the default).
    #[default]
    Auto,
    /// Always `ncclBroadcast`.
    Nccl,
    /// Always gpucast's P2P kernel; an error where it cannot run.
    P2p,
}

impl Path {
    /// Parses `auto`, `nccl` or `p2p` (case-insensitive).
    pub fn parse(s: &str) -> Option<Path> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Some(Path::Auto),
            "nccl" => Some(Path::Nccl),
            "p2p" => Some(Path::P2p),
            _ => None,
        }
    }

    /// Lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Path::Auto => "auto",
            Path::Nccl => "nccl",
            Path::P2p => "p2p",
        }
    }
}

/// What actually runs for one broadcast: the resolved form of a [`Path`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// Nothing to move (zero length).
    Empty,
    /// `ncclBroadcast` in one group.
    Nccl,
    /// P2P, push protocol: the root writes {data, flag} packets into each peer's inbox; peers
    /// poll their own memory. No start or end barrier. For small messages.
    P2pPacket,
    /// P2P, pull protocol: peers read the root's buffer after its arrival flag, and tell the
    /// root when they are done. For medium messages.
    P2pPull,
}

impl Route {
    /// Short name used in logs and tables.
    pub fn name(self) -> &'static str {
        match self {
            Route::Empty => "empty",
            Route::Nccl => "nccl",
            Route::P2pPacket => "p2p-packet",
            Route::P2pPull => "p2p-pull",
        }
    }

    /// Whether this route runs the P2P kernel.
    pub fn is_p2p(self) -> bool {
        matches!(self, Route::P2pPacket | Route::P2pPull)
    }
}

/// Byte sizes at which the choice changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// `Auto` uses P2P for messages of at most this many bytes, NCCL above.
    pub p2p_max_bytes: usize,
    /// The P2P path uses the packet protocol up to this many bytes and the pull protocol above
    /// (capped at [`PACKET_MAX_BYTES`]).
    pub packet_max_bytes: usize,
}

/// Environment variable that overrides the default `Auto` threshold (bytes; `K`, `M`, `G`
/// suffixes allowed, powers of 1024).
pub const P2P_THRESHOLD_ENV: &str = "GPUCAST_P2P_THRESHOLD";
/// Environment variable that overrides the packet/pull switch point (bytes, suffixes allowed).
pub const PACKET_THRESHOLD_ENV: &str = "GPUCAST_PACKET_THRESHOLD";

impl Thresholds {
    /// Defaults for a clique of `n` GPUs linked by NVLink.
    ///
    /// Two GPUs: measured on 2 H200 (NV18) by `cargo bench --bench broadcast` (results/h200x2,
    /// 2026-11-30): the P2P kernel was faster than NCCL at every size from 1 KiB to 1 GiB, eager
    /// and in graphs (1 GiB: 372 vs 362 GB/s), so there is no crossover and `Auto` always takes
    /// P2P. Four and eight GPUs have not been measured: every peer then reads the root over the
    /// root's own links, which share its outbound bandwidth, while NCCL's ring does not, so the
    /// limits are set lower (after Modular's switch to a two-stage broadcast at 6 MiB for 4 GPUs
    /// and 2 MiB for 8).
    pub fn for_gpus(n: usize) -> Thresholds {
        let p2p_max_bytes = match n {
            0..=2 => DEFAULT_P2P_MAX_2GPU,
            3..=4 => 2 << 20,
            _ => 1 << 20,
        };
        Thresholds {
            p2p_max_bytes,
            packet_max_bytes: DEFAULT_PACKET_MAX,
        }
    }
}

/// Default `Auto` limit for 2 GPUs (see [`Thresholds::for_gpus`]): no limit.
pub const DEFAULT_P2P_MAX_2GPU: usize = usize::MAX;
/// Default packet/pull switch point: the packet protocol's capacity. On 2 H200 the packet
/// protocol was faster than pull at every size it can carry (eager, 2026-11-30: 7.2 vs 9.6 us at
/// 256 KiB), since pull pays two flag round trips and a remote-read latency.
pub const DEFAULT_PACKET_MAX: usize = PACKET_MAX_BYTES;

/// Why the P2P path cannot run on a clique, if it cannot.
pub type P2pAvailability<'a> = std::result::Result<(), &'a str>;

/// Resolves `path` for a message of `bytes` bytes.
pub fn choose(
    path: Path,
    bytes: usize,
    p2p: P2pAvailability<'_>,
    thresholds: &Thresholds,
) -> Result<Route> {
    if bytes == 0 {
        return Ok(Route::Empty);
    }
    let p2p_route = || {
        if bytes <= thresholds.packet_max_bytes.min(PACKET_MAX_BYTES) {
            Route::P2pPacket
        } else {
            Route::P2pPull
        }
    };
    match path {
        Path::Nccl => Ok(Route::Nccl),
        Path::P2p => match p2p {
            Ok(()) => Ok(p2p_route()),
            Err(why) => Err(Error::P2pUnavailable(why.to_string())),
        },
        Path::Auto => Ok(match p2p {
            Ok(()) if bytes <= thresholds.p2p_max_bytes => p2p_route(),
            _ => Route::Nccl,
        }),
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

/// Reads a byte-count environment variable: `Ok(None)` when unset, an error when unparsable.
pub fn bytes_from_env(name: &'static str) -> Result<Option<usize>> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => parse_bytes(&v)
            .map(Some)
            .ok_or_else(|| Error::InvalidSetting {
                name,
                reason: format!("{v:?} is not a byte count (e.g. 262144, 256K, 4M)"),
            }),
    }
}

// ---------------------------------------------------------------------------------------------
// Validation

/// Checks a device list for a clique: 1 to 8 distinct ordinals, each below `available`.
pub fn validate_devices(ordinals: &[usize], available: usize) -> Result<()> {
    if ordinals.is_empty() {
        return Err(Error::NoDevice("the device list is empty".into()));
    }
    if ordinals.len() > MAX_GPUS {
        return Err(Error::TooManyDevices {
            requested: ordinals.len(),
            max: MAX_GPUS,
        });
    }
    for (i, &o) in ordinals.iter().enumerate() {
        if ordinals[..i].contains(&o) {
            return Err(Error::DuplicateDevice { ordinal: o });
        }
        if o >= available {
            return Err(Error::DeviceOutOfRange {
                ordinal: o,
                available,
            });
        }
    }
    Ok(())
}

/// Where a buffer lives and how long it is, as validation sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferInfo {
    /// Device ordinal of the buffer.
    pub ordinal: usize,
    /// Number of elements.
    pub len: usize,
}

/// Checks a broadcast's arguments against a clique whose rank `i` is on `ordinals[i]`.
///
/// `input` is `None` for the in-place form (the root's entry of `outputs` is then the source).
/// Returns the element count.
pub fn validate_broadcast(
    ordinals: &[usize],
    root: usize,
    input: Option<BufferInfo>,
    outputs: &[BufferInfo],
) -> Result<usize> {
    let n = ordinals.len();
    if root >= n {
        return Err(Error::RootOutOfRange { root, size: n });
    }
    let what = if input.is_some() {
        "outputs"
    } else {
        "buffers"
    };
    if outputs.len() != n {
        return Err(Error::OutputCount {
            what,
            expected: n,
            got: outputs.len(),
        });
    }
    let reference = input.unwrap_or(outputs[root]);
    if let Some(inp) = input {
        check_device("input", root, ordinals[root], inp.ordinal)?;
    }
    for (rank, out) in outputs.iter().enumerate() {
        let label = || {
            if input.is_some() {
                format!("output {rank}")
            } else {
                format!("buffer {rank}")
            }
        };
        if out.ordinal != ordinals[rank] {
            return Err(Error::WrongDevice {
                what: label(),
                rank,
                expected: ordinals[rank],
                found: out.ordinal,
            });
        }
        if out.len != reference.len {
            return Err(Error::LengthMismatch {
                what: label(),
                expected: reference.len,
                got: out.len,
            });
        }
    }
    Ok(reference.len)
}

fn check_device(what: &str, rank: usize, expected: usize, found: usize) -> Result<()> {
    if expected == found {
        Ok(())
    } else {
        Err(Error::WrongDevice {
            what: what.to_string(),
            rank,
            expected,
            found,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Signal-buffer layout and launch geometry of the P2P kernels. The kernel source receives these
// numbers as #defines, so Rust and CUDA share one definition.

/// Threads per block of both P2P kernels.
pub const THREADS: u32 = 512;
/// Most blocks of a P2P launch; also the number of per-block counter slots.
pub const MAX_BLOCKS: u32 = 64;
/// Slots in each block's packet ring (back-pressure depth: how many ops a root may run ahead).
pub const PACKET_SLOTS: u32 = 4;
/// Most blocks of a packet launch.
pub const PACKET_MAX_BLOCKS: u32 = 32;
/// Data bytes one block carries in one packet op (its inbox region holds twice this: each
/// 16-byte packet carries 8 data bytes and two flags).
pub const PACKET_REGION_BYTES: u32 = 8192;
/// Largest message the packet protocol can carry.
pub const PACKET_MAX_BYTES: usize = (PACKET_MAX_BLOCKS * PACKET_REGION_BYTES) as usize;
/// Data bytes a packet block aims for (fewer bytes per block, more blocks polling in parallel).
pub const PACKET_BYTES_PER_BLOCK: usize = 2048;
/// Bytes a pull block aims for before the grid stops growing.
pub const PULL_BYTES_PER_BLOCK: usize = 16 << 10;

/// Most copies in one fused P2P launch (the descriptor table travels in the kernel's 4 KiB
/// parameter space: 96 bytes of header plus 32 bytes per entry).
pub const LIST_MAX: usize = 120;
/// Most operations NCCL accepts between `ncclGroupStart` and `ncclGroupEnd`.
pub const NCCL_GROUP_MAX_OPS: usize = 2048;

/// Word offsets (u32) of the signal area, one per GPU. Every flag word has one writer.
pub mod layout {
    use super::{MAX_BLOCKS, MAX_GPUS, PACKET_MAX_BLOCKS, PACKET_REGION_BYTES, PACKET_SLOTS};
    const B: usize = MAX_BLOCKS as usize;
    /// `[block]`: this GPU's packet-op counter (written by itself).
    pub const PACKET_SEQ: usize = 0;
    /// `[block]`: this GPU's pull-op counter (written by itself).
    pub const PULL_SEQ: usize = PACKET_SEQ + B;
    /// `[block][gpu]`: last packet op GPU `gpu` finished (written by `gpu`).
    pub const PACKET_ACK: usize = PULL_SEQ + B;
    /// `[block][root]`: pull op the root `root` has reached (written by `root`).
    pub const ARRIVE: usize = PACKET_ACK + B * MAX_GPUS;
    /// `[block][peer]`: pull op `peer` finished reading (written by `peer`).
    pub const DONE: usize = ARRIVE + B * MAX_GPUS;
    /// Words of flags.
    pub const SIGNAL_WORDS: usize = DONE + B * MAX_GPUS;
    /// Byte offset of the packet inbox, after the flags.
    pub const INBOX_OFFSET: usize = (SIGNAL_WORDS * 4).next_multiple_of(4096);
    /// Bytes of inbox: a ring of slots per block, each twice a block's data region.
    pub const INBOX_BYTES: usize =
        PACKET_MAX_BLOCKS as usize * PACKET_SLOTS as usize * PACKET_REGION_BYTES as usize * 2;
    /// Bytes to allocate per GPU.
    pub const TOTAL_BYTES: usize = INBOX_OFFSET + INBOX_BYTES;
}

/// Grid of one P2P launch. Identical on every GPU: it depends on the size alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Blocks.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
    /// Packet protocol: data bytes per block (a multiple of 16). Pull: 0.
    pub chunk: u32,
}

/// Geometry of a packet launch for `bytes` (1 ..= [`PACKET_MAX_BYTES`]).
pub fn packet_geometry(bytes: usize) -> Geometry {
    assert!(
        bytes > 0 && bytes <= PACKET_MAX_BYTES,
        "packet message of {bytes} bytes"
    );
    let want = bytes
        .div_ceil(PACKET_BYTES_PER_BLOCK)
        .clamp(1, PACKET_MAX_BLOCKS as usize);
    let chunk = bytes.div_ceil(want).next_multiple_of(16);
    let blocks = bytes.div_ceil(chunk);
    Geometry {
        blocks: u32::try_from(blocks).expect("at most PACKET_MAX_BLOCKS"),
        threads: THREADS,
        chunk: u32::try_from(chunk).expect("at most PACKET_REGION_BYTES"),
    }
}

/// Geometry of a pull launch for `bytes` (> 0).
pub fn pull_geometry(bytes: usize) -> Geometry {
    assert!(bytes > 0, "pull of 0 bytes");
    let blocks = bytes
        .div_ceil(PULL_BYTES_PER_BLOCK)
        .clamp(1, MAX_BLOCKS as usize);
    Geometry {
        blocks: u32::try_from(blocks).expect("at most MAX_BLOCKS"),
        threads: THREADS,
        chunk: 0,
    }
}

/// How a copy between two addresses is split so that the body uses the widest access both
/// sides allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alignment {
    /// Access width of the body in bytes: 16, 8, 4, 2 or 1.
    pub unit: u32,
    /// Bytes copied one at a time before the body (< `unit`).
    pub head: u32,
    /// Units in the body.
    pub body_units: u64,
    /// Bytes copied one at a time after the body (< `unit`).
    pub tail: u32,
}

/// The widest width `w` with `src % w == dst % w`, and the head/body/tail split of `bytes`.
pub fn co_alignment(src: u64, dst: u64, bytes: u64) -> Alignment {
    let unit = [16u64, 8, 4, 2, 1]
        .into_iter()
        .find(|w| src % w == dst % w)
        .unwrap_or(1);
    let head = ((unit - src % unit) % unit).min(bytes);
    let body_units = (bytes - head) / unit;
    let tail = bytes - head - body_units * unit;
    Alignment {
        unit: u32::try_from(unit).expect("<= 16"),
        head: u32::try_from(head).expect("< 16"),
        body_units,
        tail: u32::try_from(tail).expect("< 16"),
    }
}

// ---------------------------------------------------------------------------------------------
// Fused broadcasts of many tensors

/// How a fused broadcast of many tensors is split into launches.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FusedPlan {
    /// P2P launches: each a list of tensor indices (at most [`LIST_MAX`]) copied by one kernel.
    pub p2p: Vec<Vec<usize>>,
    /// NCCL groups: each a list of tensor indices broadcast inside one `ncclGroupStart/End`.
    pub nccl: Vec<Vec<usize>>,
}

impl FusedPlan {
    /// Tensors that go by P2P.
    pub fn p2p_tensors(&self) -> usize {
        self.p2p.iter().map(Vec::len).sum()
    }

    /// Tensors that go by NCCL.
    pub fn nccl_tensors(&self) -> usize {
        self.nccl.iter().map(Vec::len).sum()
    }
}

/// Splits tensors of `bytes[i]` bytes between the paths. Zero-length tensors are skipped.
///
/// `Auto` sends each tensor by the path a single broadcast of its size would take (P2P up to
/// the threshold, NCCL above); P2P tensors are packed into launches of at most [`LIST_MAX`]
/// entries, NCCL tensors into groups of at most [`NCCL_GROUP_MAX_OPS`] / `nranks` broadcasts.
pub fn plan_fused(
    bytes: &[usize],
    path: Path,
    p2p: P2pAvailability<'_>,
    thresholds: &Thresholds,
    nranks: usize,
) -> Result<FusedPlan> {
    let mut to_p2p = Vec::new();
    let mut to_nccl = Vec::new();
    for (i, &b) in bytes.iter().enumerate() {
        match choose(path, b, p2p, thresholds)? {
            Route::Empty => {}
            Route::Nccl => to_nccl.push(i),
            Route::P2pPacket | Route::P2pPull => to_p2p.push(i),
        }
    }
    let per_group = (NCCL_GROUP_MAX_OPS / nranks.max(1)).max(1);
    Ok(FusedPlan {
        p2p: to_p2p.chunks(LIST_MAX).map(<[usize]>::to_vec).collect(),
        nccl: to_nccl.chunks(per_group).map(<[usize]>::to_vec).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_plan_splits_by_size_and_limits() {
        let t = Thresholds {
            p2p_max_bytes: 1000,
            packet_max_bytes: 100,
        };
        let sizes = [10usize, 0, 5000, 1000, 1001, 3];
        let plan = plan_fused(&sizes, Path::Auto, Ok(()), &t, 2).unwrap();
        assert_eq!(plan.p2p, vec![vec![0, 3, 5]]);
        assert_eq!(plan.nccl, vec![vec![2, 4]]);
        let all_nccl = plan_fused(&sizes, Path::Auto, Err("no NVRTC"), &t, 2).unwrap();
        assert_eq!((all_nccl.p2p_tensors(), all_nccl.nccl_tensors()), (0, 5));
        let forced = plan_fused(&sizes, Path::P2p, Ok(()), &t, 2).unwrap();
        assert_eq!((forced.p2p_tensors(), forced.nccl_tensors()), (5, 0));
        assert!(plan_fused(&sizes, Path::P2p, Err("no peer access"), &t, 2).is_err());
        assert!(plan_fused(&[], Path::Auto, Ok(()), &t, 2).unwrap() == FusedPlan::default());

        let many = vec![8usize; 1000];
        let p = plan_fused(&many, Path::P2p, Ok(()), &t, 8).unwrap();
        assert!(p.p2p.iter().all(|b| b.len() <= LIST_MAX));
        assert_eq!(p.p2p.len(), 1000usize.div_ceil(LIST_MAX));
        assert_eq!(p.p2p.concat(), (0..1000).collect::<Vec<_>>());
        let n = plan_fused(&many, Path::Nccl, Ok(()), &t, 8).unwrap();
        assert!(n.nccl.iter().all(|g| g.len() * 8 <= NCCL_GROUP_MAX_OPS));
        assert_eq!(n.nccl.concat(), (0..1000).collect::<Vec<_>>());
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
    }

    #[test]
    fn layout_fits_and_does_not_overlap() {
        use layout::*;
        const {
            assert!(PACKET_SEQ < PULL_SEQ && PULL_SEQ < PACKET_ACK && PACKET_ACK < ARRIVE);
            assert!(ARRIVE < DONE && DONE < SIGNAL_WORDS);
            assert!(INBOX_OFFSET >= SIGNAL_WORDS * 4 && INBOX_OFFSET % 4096 == 0);
            assert!(TOTAL_BYTES < 4 << 20, "signal area should stay small");
            assert!(PACKET_MAX_BLOCKS <= MAX_BLOCKS);
        }
        // Flag arrays are indexed [block][gpu]: the last word of DONE is still inside the area.
        assert_eq!(
            DONE + (MAX_BLOCKS as usize - 1) * MAX_GPUS + MAX_GPUS - 1,
            SIGNAL_WORDS - 1
        );
    }

    #[test]
    fn packet_geometry_covers_every_byte_without_empty_blocks() {
        for bytes in [
            1usize,
            15,
            16,
            17,
            2047,
            2048,
            2049,
            65536,
            100_003,
            PACKET_MAX_BYTES,
        ] {
            let g = packet_geometry(bytes);
            assert!(
                g.blocks >= 1 && g.blocks <= PACKET_MAX_BLOCKS,
                "{bytes}: {g:?}"
            );
            assert_eq!(g.chunk % 16, 0);
            assert!(g.chunk <= PACKET_REGION_BYTES, "{bytes}: {g:?}");
            let covered = g.blocks as usize * g.chunk as usize;
            assert!(covered >= bytes, "{bytes}: {g:?}");
            assert!(
                (g.blocks as usize - 1) * (g.chunk as usize) < bytes,
                "empty block: {g:?}"
            );
        }
    }

    #[test]
    #[should_panic]
    fn packet_geometry_rejects_oversize() {
        packet_geometry(PACKET_MAX_BYTES + 1);
    }

    #[test]
    fn pull_geometry_grows_then_caps() {
        assert_eq!(pull_geometry(1).blocks, 1);
        assert_eq!(pull_geometry(PULL_BYTES_PER_BLOCK + 1).blocks, 2);
        assert_eq!(pull_geometry(1 << 30).blocks, MAX_BLOCKS);
    }

    #[test]
    fn co_alignment_splits_exactly() {
        let a = co_alignment(0x1000, 0x2000, 100);
        assert_eq!((a.unit, a.head, a.body_units, a.tail), (16, 0, 6, 4));
        let a = co_alignment(0x1003, 0x2003, 100);
        assert_eq!((a.unit, a.head), (16, 13));
        assert_eq!(a.head as u64 + a.body_units * 16 + a.tail as u64, 100);
        let a = co_alignment(0x1004, 0x2008, 64);
        assert_eq!(a.unit, 4);
        let a = co_alignment(0x1001, 0x2002, 7);
        assert_eq!((a.unit, a.head, a.body_units, a.tail), (1, 0, 7, 0));
        let a = co_alignment(0x1001, 0x2001, 3);
        assert_eq!(
            a.head as u64 + a.body_units * a.unit as u64 + a.tail as u64,
            3
        );
        for src in 0..32u64 {
            for dst in 0..32u64 {
                for bytes in [0u64, 1, 5, 16, 33, 1000] {
                    let a = co_alignment(src, dst, bytes);
                    let u = a.unit as u64;
                    assert_eq!(a.head as u64 + a.body_units * u + a.tail as u64, bytes);
                    if a.body_units > 0 {
                        assert_eq!((src + a.head as u64) % u, 0);
                        assert_eq!((dst + a.head as u64) % u, 0);
                    }
                }
            }
        }
    }

    #[test]
    fn choice_follows_path_size_and_availability() {
        let t = Thresholds {
            p2p_max_bytes: 1 << 20,
            packet_max_bytes: 64 << 10,
        };
        assert_eq!(choose(Path::Auto, 0, Ok(()), &t).unwrap(), Route::Empty);
        assert_eq!(
            choose(Path::Auto, 1024, Ok(()), &t).unwrap(),
            Route::P2pPacket
        );
        assert_eq!(
            choose(Path::Auto, 64 << 10, Ok(()), &t).unwrap(),
            Route::P2pPacket
        );
        assert_eq!(
            choose(Path::Auto, (64 << 10) + 1, Ok(()), &t).unwrap(),
            Route::P2pPull
        );
        assert_eq!(
            choose(Path::Auto, 1 << 20, Ok(()), &t).unwrap(),
            Route::P2pPull
        );
        assert_eq!(
            choose(Path::Auto, (1 << 20) + 1, Ok(()), &t).unwrap(),
            Route::Nccl
        );
        assert_eq!(
            choose(Path::Auto, 1024, Err("no NVRTC"), &t).unwrap(),
            Route::Nccl
        );
        assert_eq!(choose(Path::Nccl, 1024, Ok(()), &t).unwrap(), Route::Nccl);
        assert_eq!(
            choose(Path::P2p, 1 << 30, Ok(()), &t).unwrap(),
            Route::P2pPull
        );
        let e = choose(Path::P2p, 1024, Err("GPU 0 and 1 lack peer access"), &t).unwrap_err();
        assert!(matches!(e, Error::P2pUnavailable(ref m) if m.contains("peer access")));
        // A packet threshold above what the inbox holds is capped.
        let big = Thresholds {
            p2p_max_bytes: 1 << 30,
            packet_max_bytes: 1 << 30,
        };
        assert_eq!(
            choose(Path::P2p, PACKET_MAX_BYTES + 1, Ok(()), &big).unwrap(),
            Route::P2pPull
        );
    }

    #[test]
    fn defaults_shrink_with_more_gpus() {
        let t2 = Thresholds::for_gpus(2);
        let t4 = Thresholds::for_gpus(4);
        let t8 = Thresholds::for_gpus(8);
        assert!(t2.p2p_max_bytes >= t4.p2p_max_bytes && t4.p2p_max_bytes >= t8.p2p_max_bytes);
        assert!(t2.packet_max_bytes <= PACKET_MAX_BYTES);
    }

    #[test]
    fn device_lists() {
        assert!(validate_devices(&[0, 1], 2).is_ok());
        assert!(matches!(validate_devices(&[], 2), Err(Error::NoDevice(_))));
        assert!(matches!(
            validate_devices(&[0, 1, 0], 2),
            Err(Error::DuplicateDevice { ordinal: 0 })
        ));
        assert!(matches!(
            validate_devices(&[0, 2], 2),
            Err(Error::DeviceOutOfRange {
                ordinal: 2,
                available: 2
            })
        ));
        let nine: Vec<usize> = (0..9).collect();
        assert!(matches!(
            validate_devices(&nine, 16),
            Err(Error::TooManyDevices {
                requested: 9,
                max: 8
            })
        ));
    }

    fn buf(ordinal: usize, len: usize) -> BufferInfo {
        BufferInfo { ordinal, len }
    }

    #[test]
    fn broadcast_arguments() {
        let ords = [3, 5];
        let outs = [buf(3, 10), buf(5, 10)];
        assert_eq!(
            validate_broadcast(&ords, 1, Some(buf(5, 10)), &outs).unwrap(),
            10
        );
        assert_eq!(validate_broadcast(&ords, 0, None, &outs).unwrap(), 10);
        assert!(matches!(
            validate_broadcast(&ords, 2, Some(buf(3, 10)), &outs),
            Err(Error::RootOutOfRange { root: 2, size: 2 })
        ));
        assert!(matches!(
            validate_broadcast(&ords, 0, Some(buf(3, 10)), &outs[..1]),
            Err(Error::OutputCount {
                expected: 2,
                got: 1,
                ..
            })
        ));
        assert!(matches!(
            validate_broadcast(&ords, 0, Some(buf(5, 10)), &outs),
            Err(Error::WrongDevice { ref what, expected: 3, found: 5, .. }) if what == "input"
        ));
        assert!(matches!(
            validate_broadcast(&ords, 0, Some(buf(3, 10)), &[buf(3, 10), buf(3, 10)]),
            Err(Error::WrongDevice { rank: 1, .. })
        ));
        assert!(matches!(
            validate_broadcast(&ords, 0, Some(buf(3, 10)), &[buf(3, 10), buf(5, 9)]),
            Err(Error::LengthMismatch {
                expected: 10,
                got: 9,
                ..
            })
        ));
        assert!(matches!(
            validate_broadcast(&ords, 1, None, &[buf(3, 9), buf(5, 10)]),
            Err(Error::LengthMismatch { ref what, .. }) if what == "buffer 0"
        ));
        assert_eq!(
            validate_broadcast(&ords, 0, Some(buf(3, 0)), &[buf(3, 0), buf(5, 0)]).unwrap(),
            0
        );
    }
}
