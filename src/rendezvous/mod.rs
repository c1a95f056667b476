//! Rendezvous: the processes of one job (one per GPU, on one or many nodes) find each other
//! and exchange small byte strings at initialisation, within time limits.
//!
//! - [`JobEnv`] reads who this process is from what torchrun or Slurm set ([`JobEnv::from_env`]).
//! - [`Rendezvous::connect`] joins the job: rank 0 hosts a small TCP store ([`StoreServer`]),
//!   every rank connects to it ([`StoreClient`]), and the call returns once all `world_size`
//!   ranks have arrived. Then [`Rendezvous::all_gather`], [`Rendezvous::barrier`] and
//!   [`Rendezvous::broadcast_from`].
//! - [`Exchange`] is what the rest of gpucast needs; [`FnExchange`] lets MPI or a framework's
//!   process group provide it instead.
//! - [`host_id`] tells which ranks share a node.
//!
//! Pure Rust and `std`: blocking sockets with timeouts and a few threads on rank 0.
//!
//! ```no_run
//! use std::time::Duration;
//! use gpucast::rendezvous::{JobEnv, Rendezvous, host_id};
//!
//! let env = JobEnv::from_env()?;
//! let rdv = Rendezvous::connect(&env, Duration::from_secs(120))?;
//! let hosts = rdv.all_gather(host_id(gpucast::rendezvous::env_var).as_bytes())?;
//! let same_node: Vec<usize> = (0..rdv.world_size()).filter(|&r| hosts[r] == hosts[rdv.rank()]).collect();
//! # let _ = same_node;
//! rdv.barrier()?;
//! # Ok::<(), gpucast::rendezvous::RendezvousError>(())
//! ```
//!
//! # Failure behaviour
//!
//! Every wait is bounded. The store checks every HELLO against rank 0's world size, the rank
//! range, the job token and the ranks already registered. A mismatch, a duplicate rank, a rank
//! that aborts (any local failure, including its own timeout), or a rank that disconnects
//! before contributing to an all-gather others wait on, *fails the job*: the store answers
//! every pending and later request of every rank with [`RendezvousError::JobFailed`] and the
//! reason, so no rank waits out its timeout. A timeout names the missing ranks.
//!
//! # Wire format (version 1)
//!
//! Every message is a frame: a 12-byte header, then the payload. Integers are little-endian.
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `GCRV` ([`MAGIC`]) |
//! | 4 | version, 1 ([`PROTOCOL_VERSION`]) |
//! | 5 | op |
//! | 6..8 | reserved, zero |
//! | 8..12 | payload length (u32) |
//!
//! Requests (client to server), one reply each; the first request of a connection is HELLO:
//!
//! | op | name | payload |
//! |---|---|---|
//! | 0x01 | HELLO | rank u32, world size u32, token length u16, token |
//! | 0x02 | WAIT_ALL | timeout ms u32 |
//! | 0x03 | SET | key length u16, key (UTF-8), value (rest of payload) |
//! | 0x04 | GET | timeout ms u32, key length u16, key |
//! | 0x05 | GATHER | round u64, timeout ms u32, value (rest) |
//! | 0x06 | ABORT | missing-rank count u32, ranks u32 each, reason (rest, UTF-8) |
//!
//! Replies: 0x80 OK (empty), 0x81 VALUE (the value), 0x82 GATHERED (count u32, then per rank a
//! length u32 and the bytes), 0x83 ERROR (code u8, count u32 and that many u64 numbers, count
//! u16 and that many strings of u32 length + UTF-8). Error codes: 1 world-size mismatch
//! `[rank, client, server]`, 2 rank out of range `[rank, world]`, 3 duplicate rank `[rank]` +
//! detail, 4 token mismatch + `[client, server]` tokens, 5 timeout `[ms, missing...]` + what,
//! 6 job failed `[missing...]` + reason, 7 rejected + reason, 8 too large `[len, max]` + what,
//! 9 protocol + reason.
//!
//! A bad magic closes the connection silently; a bad version, non-zero reserved bytes or an
//! oversize length closes it after an ERROR reply; each with a `tracing` warning. The length
//! is checked before any payload memory is taken, and payload buffers grow only as bytes
//! arrive.
//!
//! # Limits
//!
//! Keys [`MAX_KEY_LEN`] bytes, values and all-gather contributions [`MAX_VALUE_LEN`], a whole
//! all-gather round [`MAX_GATHER_BYTES`], everything the store holds [`MAX_STORE_BYTES`], job
//! tokens [`MAX_TOKEN_LEN`], world size [`MAX_WORLD_SIZE`]. The server accepts `world_size + 64`
//! connections at once, gives a new connection 10 s to say hello, and a started frame 30 s to
//! arrive (see [`ServerOptions`]).

mod client;
mod env;
mod error;
mod exchange;
mod server;
mod wire;

use std::time::Duration;

pub use crate::config::env_var;
pub use client::StoreClient;
pub use env::{
    expand_hostlist, host_id, JobEnv, DEFAULT_MASTER_PORT, HOST_ID_ENV, JOB_TOKEN_ENV,
    MASTER_ADDR_ENV, MASTER_PORT_ENV, SLURM_PORT_BASE, SLURM_PORT_SPAN,
};
pub use error::{RendezvousError, Result};
pub use exchange::{Exchange, FnExchange, Rendezvous};
pub use server::{ServerOptions, StoreServer};
pub use wire::{FRAME_HEADER_LEN, MAGIC, PROTOCOL_VERSION};

/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 1024;
/// Longest value or all-gather contribution, in bytes (16 MiB).
pub const MAX_VALUE_LEN: usize = 16 << 20;
/// Most bytes of one all-gather round, all ranks together (256 MiB).
pub const MAX_GATHER_BYTES: usize = 256 << 20;
/// Most bytes the store holds at once, keys' values and unfinished rounds together (1 GiB).
pub const MAX_STORE_BYTES: usize = 1 << 30;
/// Longest job token, in bytes.
pub const MAX_TOKEN_LEN: usize = 256;
/// Largest world size.
pub const MAX_WORLD_SIZE: usize = 1 << 20;

/// Connections the server accepts beyond one per rank.
const EXTRA_CONNECTIONS: usize = 64;
/// Default time a new connection has to say hello.
const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time to finish reading a started frame or writing a reply.
const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);
