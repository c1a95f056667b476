//! The P2P kernel's ABI, shared by Rust and `kernel.cu`: parameter structs, the signal-area
//! layout, launch geometry and the alignment split of a copy. Pure; tested without a GPU.
//!
//! `compile::source` hands these numbers to the kernel as `#define`s and appends a
//! `static_assert` for the size and every field offset of each parameter struct, so a layout
//! that drifts from this file fails the kernel's compilation; a CPU test also reads the struct
//! definitions in `kernel.cu` and compares them with the Rust ones.

use std::mem::{offset_of, size_of};

use cudarc::driver::DeviceRepr;

pub(crate) use crate::limits::{
    LIST_MAX, MAX_GPUS, PACKET_MAX_BLOCKS, PACKET_MAX_BYTES, PACKET_REGION_BYTES,
};

/// Threads per block of every P2P kernel.
pub(crate) const THREADS: u32 = 512;
/// Most blocks of a P2P launch; also the number of per-block counter slots.
pub(crate) const MAX_BLOCKS: u32 = 64;
/// Slots in each block's packet ring (back-pressure depth: how many ops a root may run ahead).
pub(crate) const PACKET_SLOTS: u32 = 4;
/// Data bytes a packet block aims for (fewer bytes per block, more blocks polling in parallel).
pub(crate) const PACKET_BYTES_PER_BLOCK: usize = 2048;
/// Bytes a pull block aims for before the grid stops growing.
pub(crate) const PULL_BYTES_PER_BLOCK: usize = 16 << 10;
/// Smallest piece of a chained message: a hand-off per piece costs a fence and a flag.
pub(crate) const CHAIN_PIECE_MIN: usize = 32 << 10;
/// Largest piece of a chained message.
pub(crate) const CHAIN_PIECE_MAX: usize = 1 << 20;
/// Pieces each block of a chained launch aims for: the chain fills in N-2 piece times, so a
/// deep pipeline keeps that fill small (6/64 of the time on 8 GPUs).
pub(crate) const CHAIN_PIECES_PER_BLOCK: usize = 64;

/// Kernel parameters of one broadcast; `struct Params` in kernel.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Params {
    pub src: u64,
    pub dst: u64,
    pub bytes: u64,
    pub signal: [u64; MAX_GPUS],
    pub error_slot: u64,
    pub timeout_ns: u64,
    /// How long an owner waits for a reader that claimed its buffer ([`lease_bound_ns`]).
    pub lease_ns: u64,
    pub rank: u32,
    pub nranks: u32,
    pub root: u32,
    pub unit: u32,
    pub head: u32,
    pub chunk: u32,
    /// Chain protocol: the buffer this rank reads (its predecessor's output, or the root's
    /// input); elsewhere 0.
    pub from: u64,
}

// SAFETY: `repr(C)`, `Copy`, integers only; its layout is checked against kernel.cu at every
// kernel compilation (`static_assert`s from `STRUCTS`) and by a CPU test.
unsafe impl DeviceRepr for Params {}

/// One copy of a fused launch; `struct ListEntry` in kernel.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ListEntry {
    pub src: u64,
    pub dst: u64,
    pub bytes: u64,
    pub unit: u32,
    pub head: u32,
}

/// Parameters of the fused pull kernel; `struct ListParams` in kernel.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ListParams {
    pub signal: [u64; MAX_GPUS],
    pub error_slot: u64,
    pub timeout_ns: u64,
    /// As in [`Params`], for the whole list.
    pub lease_ns: u64,
    pub rank: u32,
    pub nranks: u32,
    pub root: u32,
    pub count: u32,
    pub entries: [ListEntry; LIST_MAX],
}

// SAFETY: as for `Params`.
unsafe impl DeviceRepr for ListParams {}

// The kernel parameter space is 4 KiB.
const _: () = assert!(size_of::<ListParams>() <= 4096);

/// A parameter struct as the kernel sees it: its name, its size in Rust, and its fields in
/// order as (name, C type, array length, byte offset in Rust). `compile::source` writes the C
/// definitions from this table, so the kernel has no copy of its own.
pub(crate) struct StructAbi {
    pub name: &'static str,
    pub size: usize,
    pub fields: &'static [(&'static str, &'static str, usize, usize)],
}

/// Every struct shared with kernel.cu, in dependency order.
pub(crate) const STRUCTS: [StructAbi; 3] = [
    StructAbi {
        name: "Params",
        size: size_of::<Params>(),
        fields: &[
            ("src", "u64", 1, offset_of!(Params, src)),
            ("dst", "u64", 1, offset_of!(Params, dst)),
            ("bytes", "u64", 1, offset_of!(Params, bytes)),
            ("signal", "u64", MAX_GPUS, offset_of!(Params, signal)),
            ("error_slot", "u64", 1, offset_of!(Params, error_slot)),
            ("timeout_ns", "u64", 1, offset_of!(Params, timeout_ns)),
            ("lease_ns", "u64", 1, offset_of!(Params, lease_ns)),
            ("rank", "u32", 1, offset_of!(Params, rank)),
            ("nranks", "u32", 1, offset_of!(Params, nranks)),
            ("root", "u32", 1, offset_of!(Params, root)),
            ("unit", "u32", 1, offset_of!(Params, unit)),
            ("head", "u32", 1, offset_of!(Params, head)),
            ("chunk", "u32", 1, offset_of!(Params, chunk)),
            ("from", "u64", 1, offset_of!(Params, from)),
        ],
    },
    StructAbi {
        name: "ListEntry",
        size: size_of::<ListEntry>(),
        fields: &[
            ("src", "u64", 1, offset_of!(ListEntry, src)),
            ("dst", "u64", 1, offset_of!(ListEntry, dst)),
            ("bytes", "u64", 1, offset_of!(ListEntry, bytes)),
            ("unit", "u32", 1, offset_of!(ListEntry, unit)),
            ("head", "u32", 1, offset_of!(ListEntry, head)),
        ],
    },
    StructAbi {
        name: "ListParams",
        size: size_of::<ListParams>(),
        fields: &[
            ("signal", "u64", MAX_GPUS, offset_of!(ListParams, signal)),
            ("error_slot", "u64", 1, offset_of!(ListParams, error_slot)),
            ("timeout_ns", "u64", 1, offset_of!(ListParams, timeout_ns)),
            ("lease_ns", "u64", 1, offset_of!(ListParams, lease_ns)),
            ("rank", "u32", 1, offset_of!(ListParams, rank)),
            ("nranks", "u32", 1, offset_of!(ListParams, nranks)),
            ("root", "u32", 1, offset_of!(ListParams, root)),
            ("count", "u32", 1, offset_of!(ListParams, count)),
            (
                "entries",
                "ListEntry",
                LIST_MAX,
                offset_of!(ListParams, entries),
            ),
        ],
    },
];

/// The C prelude of the kernel: the integer types and the parameter structs of [`STRUCTS`],
/// each followed by a `static_assert` on its size.
pub(crate) fn c_structs() -> String {
    let mut c = String::from("typedef unsigned int u32;\ntypedef unsigned long long u64;\n");
    for s in &STRUCTS {
        c.push_str(&format!("struct {} {{\n", s.name));
        for (field, ty, count, _) in s.fields {
            if *count == 1 {
                c.push_str(&format!("    {ty} {field};\n"));
            } else {
                c.push_str(&format!("    {ty} {field}[{count}];\n"));
            }
        }
        c.push_str(&format!(
            "}};\nstatic_assert(sizeof({0}) == {1}, \"size of {0} differs from abi.rs\");\n",
            s.name, s.size
        ));
    }
    c
}

/// Word offsets (u32) of the signal area, one per GPU. Every flag word has one writer.
pub(crate) mod layout {
    use super::{MAX_BLOCKS, MAX_GPUS, PACKET_MAX_BLOCKS, PACKET_REGION_BYTES, PACKET_SLOTS};
    const B: usize = MAX_BLOCKS as usize;
    /// `[block]`: this GPU's packet-op counter (written by itself).
    pub(crate) const PACKET_SEQ: usize = 0;
    /// `[block]`: this GPU's pull-op counter (written by itself).
    pub(crate) const PULL_SEQ: usize = PACKET_SEQ + B;
    /// `[block][gpu]`: last packet op GPU `gpu` finished (written by `gpu`).
    pub(crate) const PACKET_ACK: usize = PULL_SEQ + B;
    /// `[block][root]`: pull op the root `root` has reached (written by `root`).
    pub(crate) const ARRIVE: usize = PACKET_ACK + B * MAX_GPUS;
    /// `[block][peer]`: pull op `peer` finished reading (written by `peer`).
    pub(crate) const DONE: usize = ARRIVE + B * MAX_GPUS;
    /// `[block]`: pieces this GPU's block has passed along chains so far (written by itself).
    pub(crate) const CHAIN_SEQ: usize = DONE + B * MAX_GPUS;
    /// `[block][pred]`: pieces the predecessor `pred` has made readable (written by `pred`).
    pub(crate) const CHAIN_READY: usize = CHAIN_SEQ + B;
    /// `[block][succ]`: pieces the successor `succ` has finished reading (written by `succ`).
    pub(crate) const CHAIN_DONE: usize = CHAIN_READY + B * MAX_GPUS;
    /// Words of one block's lease: claim, release and op count, then one cancel per owner,
    /// then one expiry per owner, 64-bit each.
    pub(crate) const LEASE_WORDS: usize = 2 * (3 + 2 * MAX_GPUS);
    /// `[block][LEASE_WORDS]`, 8-byte aligned: this GPU's lease on the root's buffer in a pull
    /// op: the op it claimed (before its first read) and released (after its last), its count
    /// of pull ops, per root the last op that root gave up waiting for (written by the root),
    /// and per root the last op that root stopped waiting for this reader's release on (written
    /// by the root, after [`super::lease_bound_ns`]). See the kernel's "Leases": an owner's
    /// kernel does not end while a reader that claimed its buffer reads it, within that bound.
    pub(crate) const PULL_LEASE: usize = (CHAIN_DONE + B * MAX_GPUS).next_multiple_of(2);
    /// `[block][LEASE_WORDS]`: the same lease on the predecessor's buffer in a chain op.
    pub(crate) const CHAIN_LEASE: usize = PULL_LEASE + LEASE_WORDS * B;
    /// Words of flags.
    pub(crate) const SIGNAL_WORDS: usize = CHAIN_LEASE + LEASE_WORDS * B;
    /// Byte offset of the packet inbox, after the flags.
    pub(crate) const INBOX_OFFSET: usize = (SIGNAL_WORDS * 4).next_multiple_of(4096);
    /// Bytes of inbox: a ring of slots per block, each twice a block's data region.
    pub(crate) const INBOX_BYTES: usize =
        PACKET_MAX_BLOCKS as usize * PACKET_SLOTS as usize * PACKET_REGION_BYTES as usize * 2;
    /// Bytes to allocate per GPU.
    pub(crate) const TOTAL_BYTES: usize = INBOX_OFFSET + INBOX_BYTES;
}

/// The `#define`s the kernel source needs, from the constants above.
pub(crate) fn defines() -> [(&'static str, usize); 17] {
    [
        ("GPUCAST_MAX_GPUS", MAX_GPUS),
        ("GPUCAST_THREADS", THREADS as usize),
        ("GPUCAST_PACKET_SLOTS", PACKET_SLOTS as usize),
        ("GPUCAST_PACKET_REGION_BYTES", PACKET_REGION_BYTES as usize),
        ("GPUCAST_PACKET_SEQ", layout::PACKET_SEQ),
        ("GPUCAST_PULL_SEQ", layout::PULL_SEQ),
        ("GPUCAST_PACKET_ACK", layout::PACKET_ACK),
        ("GPUCAST_ARRIVE", layout::ARRIVE),
        ("GPUCAST_DONE", layout::DONE),
        ("GPUCAST_CHAIN_SEQ", layout::CHAIN_SEQ),
        ("GPUCAST_CHAIN_READY", layout::CHAIN_READY),
        ("GPUCAST_CHAIN_DONE", layout::CHAIN_DONE),
        ("GPUCAST_PULL_LEASE", layout::PULL_LEASE),
        ("GPUCAST_CHAIN_LEASE", layout::CHAIN_LEASE),
        ("GPUCAST_LEASE_WORDS", layout::LEASE_WORDS),
        ("GPUCAST_INBOX_OFFSET", layout::INBOX_OFFSET),
        ("GPUCAST_LIST_MAX", LIST_MAX),
    ]
}

/// Part of [`lease_bound_ns`] that does not depend on the message.
pub(crate) const LEASE_GRACE_NS: u64 = 500_000_000;
/// Slowest copy [`lease_bound_ns`] allows a reader, in bytes per nanosecond (4 GB/s: a few
/// times below a PCIe peer read, a hundred times below NVLink or a device-local copy).
pub(crate) const LEASE_BYTES_PER_NS: u64 = 4;

/// The longest an owner (the root of a pull, a rank of a chain) waits, after its own wait for
/// a reader ran into `timeout_ns`, for that reader to let go of its buffer once the reader has
/// claimed it. A reader that has claimed only copies (a chain reader may also wait up to the
/// timeout for each piece its predecessor forwards), so its remaining work is bounded by its
/// share of the `bytes` of the launch: the timeout, plus [`LEASE_GRACE_NS`], plus the message
/// at [`LEASE_BYTES_PER_NS`]. Saturates: a timeout of `u64::MAX` stays `u64::MAX`.
///
/// A P2P kernel therefore waits at most `timeout_ns + lease_bound_ns(timeout_ns, bytes)`: for
/// messages of up to 2 GB within twice the timeout plus one second.
pub(crate) fn lease_bound_ns(timeout_ns: u64, bytes: u64) -> u64 {
    timeout_ns
        .saturating_add(LEASE_GRACE_NS)
        .saturating_add(bytes / LEASE_BYTES_PER_NS)
}

/// Grid of one P2P launch. Identical on every GPU: it depends on the size alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    /// Blocks.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
    /// Packet protocol: data bytes per block (a multiple of 16). Chain: bytes per piece (a
    /// multiple of 16 KiB). Pull: 0.
    pub chunk: u32,
}

/// Geometry of a packet launch for `bytes` (1 ..= [`PACKET_MAX_BYTES`]).
pub(crate) fn packet_geometry(bytes: usize) -> Geometry {
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
pub(crate) fn pull_geometry(bytes: usize) -> Geometry {
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

/// Geometry of a chained launch for `bytes` (> 0): pieces of [`CHAIN_PIECE_MIN`] to
/// [`CHAIN_PIECE_MAX`] bytes, about [`CHAIN_PIECES_PER_BLOCK`] per block, and no block without
/// a piece. Piece `j` is bytes `[j * chunk, (j + 1) * chunk)` and belongs to block
/// `j % blocks`; the split depends on the size alone, so every rank of the chain agrees on it.
pub(crate) fn chain_geometry(bytes: usize) -> Geometry {
    assert!(bytes > 0, "chain of 0 bytes");
    let piece = bytes
        .div_ceil(MAX_BLOCKS as usize * CHAIN_PIECES_PER_BLOCK)
        .next_multiple_of(16 << 10)
        .clamp(CHAIN_PIECE_MIN, CHAIN_PIECE_MAX);
    let blocks = bytes.div_ceil(piece).min(MAX_BLOCKS as usize);
    Geometry {
        blocks: u32::try_from(blocks).expect("at most MAX_BLOCKS"),
        threads: THREADS,
        chunk: u32::try_from(piece).expect("at most CHAIN_PIECE_MAX"),
    }
}

/// The pieces block `block` of a chained launch of `bytes` bytes carries (as the kernel
/// counts them).
#[cfg(test)]
pub(crate) fn chain_pieces_of_block(bytes: usize, g: Geometry, block: u32) -> u64 {
    let pieces = bytes.div_ceil(g.chunk as usize) as u64;
    let (b, blocks) = (u64::from(block), u64::from(g.blocks));
    if pieces > b {
        (pieces - b).div_ceil(blocks)
    } else {
        0
    }
}

/// How a copy between two addresses is split so that the body uses the widest access both
/// sides allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Alignment {
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
pub(crate) fn co_alignment(src: u64, dst: u64, bytes: u64) -> Alignment {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads `struct NAME { ... };` from C source and computes each field's offset by C's
    /// rules (natural alignment of u32, u64 and nested structs).
    fn c_layout(src: &str, name: &str) -> (usize, usize, Vec<(String, usize)>) {
        let start = src
            .find(&format!("struct {name} {{"))
            .unwrap_or_else(|| panic!("no struct {name}"));
        let body = &src[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
        let mut offset = 0usize;
        let mut max_align = 1usize;
        let mut fields = Vec::new();
        for line in body.lines() {
            let decl = line.trim();
            if decl.is_empty() {
                continue;
            }
            let decl = decl.strip_suffix(';').expect("one field per line");
            let (ty, rest) = decl.split_once(' ').unwrap();
            let (field, count) = match rest.split_once('[') {
                Some((f, n)) => (f.trim(), n.trim_end_matches(']').parse::<usize>().unwrap()),
                None => (rest.trim(), 1),
            };
            let (size, align) = match ty {
                "u32" => (4, 4),
                "u64" => (8, 8),
                other => {
                    let (s, a, _) = c_layout(src, other);
                    (s, a)
                }
            };
            offset = offset.next_multiple_of(align);
            max_align = max_align.max(align);
            fields.push((field.to_string(), offset));
            offset += size * count;
        }
        (offset.next_multiple_of(max_align), max_align, fields)
    }

    #[test]
    fn generated_structs_match_the_rust_layout() {
        let c = c_structs();
        for s in &STRUCTS {
            let (size, _, fields) = c_layout(&c, s.name);
            assert_eq!(size, s.size, "size of {}", s.name);
            let rust: Vec<(String, usize)> = s
                .fields
                .iter()
                .map(|&(f, _, _, o)| (f.to_string(), o))
                .collect();
            assert_eq!(fields, rust, "fields of {}", s.name);
        }
        // The kernel file has no copy of its own.
        let kernel = include_str!("kernel.cu");
        for s in &STRUCTS {
            assert!(
                !kernel.contains(&format!("struct {} {{", s.name)),
                "{}",
                s.name
            );
        }
    }

    /// The owner's wait for a claimed reader covers the timeout and the reader's copy at the
    /// slowest rate allowed, never wraps, and keeps a kernel's whole wait (the timeout, then
    /// this) within what the engine's drains allow for messages up to 2 GB.
    #[test]
    fn lease_bound_covers_the_copy_and_saturates() {
        let ms = 1_000_000u64;
        assert_eq!(lease_bound_ns(200_000, 0), 200_000 + LEASE_GRACE_NS);
        assert_eq!(
            lease_bound_ns(10_000 * ms, 1 << 30),
            10_000 * ms + LEASE_GRACE_NS + (1 << 30) / 4
        );
        assert!(lease_bound_ns(0, 32 << 20) >= (32 << 20) / LEASE_BYTES_PER_NS);
        assert_eq!(lease_bound_ns(u64::MAX, 1), u64::MAX);
        assert_eq!(lease_bound_ns(u64::MAX - 1, u64::MAX), u64::MAX);
        for timeout in [200_000u64, 300 * ms, 10_000 * ms] {
            let whole = timeout + lease_bound_ns(timeout, 2_000_000_000);
            assert!(whole <= 2 * timeout + 1_000 * ms, "{timeout}: {whole}");
        }
    }

    #[test]
    fn layout_fits_and_does_not_overlap() {
        use layout::*;
        const {
            assert!(PACKET_SEQ < PULL_SEQ && PULL_SEQ < PACKET_ACK && PACKET_ACK < ARRIVE);
            assert!(ARRIVE < DONE && DONE < CHAIN_SEQ && CHAIN_SEQ < CHAIN_READY);
            assert!(CHAIN_READY < CHAIN_DONE && CHAIN_DONE < PULL_LEASE);
            assert!(PULL_LEASE.is_multiple_of(2) && CHAIN_LEASE.is_multiple_of(2));
            assert!(PULL_LEASE + LEASE_WORDS * (MAX_BLOCKS as usize) <= CHAIN_LEASE);
            assert!(CHAIN_LEASE + LEASE_WORDS * (MAX_BLOCKS as usize) <= SIGNAL_WORDS);
            assert!(INBOX_OFFSET >= SIGNAL_WORDS * 4 && INBOX_OFFSET.is_multiple_of(4096));
            assert!(TOTAL_BYTES < 4 << 20, "signal area should stay small");
            assert!(PACKET_MAX_BLOCKS <= MAX_BLOCKS);
        }
        assert_eq!(CHAIN_SEQ - DONE, MAX_BLOCKS as usize * MAX_GPUS);
        assert_eq!(CHAIN_READY - CHAIN_SEQ, MAX_BLOCKS as usize);
        assert!(CHAIN_DONE + MAX_BLOCKS as usize * MAX_GPUS <= PULL_LEASE);
        assert_eq!(
            CHAIN_LEASE + LEASE_WORDS * MAX_BLOCKS as usize,
            SIGNAL_WORDS
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
    #[should_panic(expected = "packet message")]
    fn packet_geometry_rejects_oversize() {
        packet_geometry(PACKET_MAX_BYTES + 1);
    }

    #[test]
    fn pull_geometry_grows_then_caps() {
        assert_eq!(pull_geometry(1).blocks, 1);
        assert_eq!(pull_geometry(PULL_BYTES_PER_BLOCK).blocks, 1);
        assert_eq!(pull_geometry(PULL_BYTES_PER_BLOCK + 1).blocks, 2);
        assert_eq!(pull_geometry(1 << 30).blocks, MAX_BLOCKS);
    }

    #[test]
    fn chain_geometry_gives_every_block_pieces_and_covers_every_byte() {
        for bytes in [
            1usize,
            16,
            (32 << 10) - 1,
            32 << 10,
            (32 << 10) + 1,
            (4 << 20) + 3,
            (13 << 20) + 5,
            64 << 20,
            (1 << 30) + 7,
            8 << 30,
        ] {
            let g = chain_geometry(bytes);
            let piece = g.chunk as usize;
            assert!(
                (CHAIN_PIECE_MIN..=CHAIN_PIECE_MAX).contains(&piece),
                "{bytes}"
            );
            assert_eq!(piece % (16 << 10), 0, "pieces keep 16-byte units whole");
            assert!(g.blocks >= 1 && g.blocks <= MAX_BLOCKS, "{bytes}: {g:?}");
            let per_block: Vec<u64> = (0..g.blocks)
                .map(|b| chain_pieces_of_block(bytes, g, b))
                .collect();
            assert!(per_block.iter().all(|&c| c >= 1), "{bytes}: a block idles");
            let total: u64 = per_block.iter().sum();
            assert_eq!(total, bytes.div_ceil(piece) as u64, "{bytes}");
            // Blocks differ by at most one piece.
            let (lo, hi) = (per_block.iter().min(), per_block.iter().max());
            assert!(hi.unwrap() - lo.unwrap() <= 1, "{bytes}");
        }
        // Large messages are deep pipelines of whole blocks.
        let g = chain_geometry(1 << 30);
        assert_eq!(g.blocks, MAX_BLOCKS);
        assert_eq!(
            chain_pieces_of_block(1 << 30, g, 0),
            CHAIN_PIECES_PER_BLOCK as u64
        );
    }

    #[test]
    fn co_alignment_splits_exactly() {
        let a = co_alignment(0x1000, 0x2000, 100);
        assert_eq!((a.unit, a.head, a.body_units, a.tail), (16, 0, 6, 4));
        let a = co_alignment(0x1003, 0x2003, 100);
        assert_eq!((a.unit, a.head), (16, 13));
        let a = co_alignment(0x1004, 0x2008, 64);
        assert_eq!(a.unit, 4);
        let a = co_alignment(0x1001, 0x2002, 7);
        assert_eq!((a.unit, a.head, a.body_units, a.tail), (1, 0, 7, 0));
        for src in 0..32u64 {
            for dst in 0..32u64 {
                for bytes in [0u64, 1, 5, 16, 33, 1000] {
                    let a = co_alignment(src, dst, bytes);
                    let u = a.unit as u64;
                    assert_eq!(a.head as u64 + a.body_units * u + a.tail as u64, bytes);
                    assert!(a.head < a.unit.max(1) && a.tail < a.unit.max(1));
                    if a.body_units > 0 {
                        assert_eq!((src + a.head as u64) % u, 0);
                        assert_eq!((dst + a.head as u64) % u, 0);
                    }
                }
            }
        }
    }
}
