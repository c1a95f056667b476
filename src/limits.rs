//! The limits every layer shares: how many GPUs, how large a packet message, how many tensors
//! one fused P2P launch takes. A leaf: it uses nothing else of gpucast, so the settings
//! (`config`) and the kernel's ABI (`p2p::abi`) both build on it without depending on each other.

/// Most GPUs in one clique (and most ranks of one job that share a node through P2P).
pub const MAX_GPUS: usize = 8;

/// Most blocks of a packet launch.
pub(crate) const PACKET_MAX_BLOCKS: u32 = 32;

/// Data bytes one block carries in one packet op (its inbox region holds twice this: each
/// 16-byte packet carries 8 data bytes and two flags).
pub(crate) const PACKET_REGION_BYTES: u32 = 8192;

/// Largest message the P2P kernel's packet protocol can carry (its inbox capacity).
pub(crate) const PACKET_MAX_BYTES: usize = (PACKET_MAX_BLOCKS * PACKET_REGION_BYTES) as usize;

/// Most copies in one fused P2P launch (the table travels in the kernel's 4 KiB parameter
/// space).
pub(crate) const LIST_MAX: usize = 120;
