//! Rendezvous: the processes of one job (one per GPU, on one or many nodes) find each other
//! and exchange small byte strings at initialisation, within time limits, admitting nobody
//! outside the job.
//!
//! - [`JobEnv`] reads who this process is from what torchrun or Slurm set ([`JobEnv::from_env`]).
//! - [`Rendezvous::connect`] joins the job and returns once all `world_size` ranks have
//!   arrived; then [`Rendezvous::all_gather`], [`Rendezvous::barrier`] and
//!   [`Rendezvous::broadcast_from`]. The ranks meet through gpucast's own TCP store, which
//!   rank 0 hosts, or, under torchrun, through the agent's own store as clients (no port of
//!   gpucast's is opened; see [`StoreKind`]).
//! - [`Exchange`] is what the rest of gpucast needs; [`FnExchange`] lets MPI or a framework's
//!   process group provide it instead.
//! - [`host_id`] tells which ranks share a node; [`random_token`] makes a job token.
//!
//! Pure Rust and `std` (plus RustCrypto's HMAC and SHA-2, nix's sockets, and the OS's
//! random source): blocking sockets with timeouts and a few threads on rank 0. This crate
//! uses nothing of gpucast, which re-exports it as `gpucast::rendezvous`.
//!
//! ```no_run
//! use std::time::Duration;
//! use gpucast_rendezvous::{JobEnv, Rendezvous, host_id};
//!
//! let env = JobEnv::from_env()?;
//! let rdv = Rendezvous::connect(&env, Duration::from_secs(120))?;
//! let hosts = rdv.all_gather(host_id(gpucast_rendezvous::env_var).as_bytes())?;
//! let same_node: Vec<usize> = (0..rdv.world_size()).filter(|&r| hosts[r] == hosts[rdv.rank()]).collect();
//! # let _ = same_node;
//! rdv.barrier()?;
//! # Ok::<(), gpucast_rendezvous::RendezvousError>(())
//! ```
//!
//! # Who gets in
//!
//! The job token ([`JobEnv::job_token`], from `GPUCAST_JOB_TOKEN`) is the job's secret. It
//! never leaves the process: not in a frame, a log line, an error or a `Debug` form.
//!
//! - Every process derives a key from the token once: PBKDF2-HMAC-SHA256 with 2^17 rounds
//!   (why not scrypt or Argon2: see below). gpucast's store sends every new connection a fresh
//!   random nonce; the HELLO must carry HMAC-SHA256(key, both nonces, rank, world size),
//!   checked in constant time, and the store answers with its own proof over the same nonces,
//!   for a welcome and for a refusal alike. A process without the token registers nothing; a
//!   recorded HELLO is useless on any other connection; a process that took the port first can
//!   pass neither as the store nor for its refusals: a rank takes any answer nobody proved
//!   ("token refused" and "turned away" included) as a reason to try again until its deadline,
//!   then names the last one.
//! - Until a HELLO is proven, a connection may send one frame of at most a HELLO's size,
//!   within one deadline for the whole handshake (10 s). At most 1,024 such connections are
//!   kept, at most 128 from one address, and none is closed to make room before it is 500 ms
//!   old: a newcomer evicts an older one of its own address or, the store being full, of the
//!   address holding the most (when that is at least two more than its own), else it is
//!   turned away with an error that says why ([`RendezvousError::Crowded`]). Strangers that
//!   connect, idle, dribble or reconnect, and floods from other addresses, cost a rank at most
//!   a retried connection; a flood from the rank's own address, or from so many addresses
//!   that each holds one place, can delay it.
//! - Under torchrun, whose store admits anyone who reaches its port, every value gpucast puts
//!   there carries HMAC-SHA256 under a key derived from the token, over the value and its
//!   rank, round and instance and, after a first round of fresh nonces and a round that
//!   confirms them, the session id they make: a value written by a process without the token
//!   is refused ([`RendezvousError::Forged`]), and one recorded in an earlier launch can at
//!   most keep a rank's place empty until the timeout, never stand for it. Values are not
//!   encrypted: whoever reaches torchrun's store reads them (the NCCL id among them, which
//!   PyTorch writes there in the clear too), as they could read torch's own.
//! - The token must be random, with at least 128 bits (`openssl rand -hex 32`,
//!   [`random_token`]). One captured exchange (a HELLO, or a sealed value in torchrun's store,
//!   which anyone who reaches its port can read) lets anyone test guesses offline, one key
//!   derivation per guess: a random token is out of reach, a guessable one is found. A token
//!   that does not look random (empty, torchrun's run id: `"none"` by default and in the
//!   process list otherwise, Slurm's job id, fewer than 128 bits for its length and alphabet,
//!   repetitive) protects nothing. gpucast accepts it, so that jobs that never set one keep
//!   working, and says so once on standard error, on loopback too (every local user can reach
//!   127.0.0.1), with how to set a secret one: `export GPUCAST_JOB_TOKEN=$(openssl rand -hex
//!   32)`. Launchers that start the ranks themselves make one with [`random_token`].
//! - Why PBKDF2 and not a memory-hard derivation: the derivation only multiplies the cost of
//!   each guess of a weak token (2^17 HMACs instead of one: a 2-million-word list takes hours
//!   of a core, not 0.2 s), and does nothing for a random one, which needs no help. scrypt or
//!   Argon2 would also blunt GPUs, at the price of crates of their own, for what stays a delay;
//!   PBKDF2 is written on the HMAC-SHA256 the proofs use. Its salt is fixed (both sides derive
//!   the key before anything is proven), so one derived word list serves against every capture.
//!
//! Beyond admission, a connection is not encrypted: a process that can read or inject the
//! traffic between two nodes (on the path) is outside what this defends against, as it is for
//! NCCL's own bootstrap.
//!
//! # Failure behaviour
//!
//! Every wait is bounded. While the job forms, a proven HELLO with a world size other than rank
//! 0's, a rank out of range or a rank claimed twice *fails the job* (two processes of one
//! launch disagree): the store answers every pending and later request of every rank with
//! [`RendezvousError::JobFailed`] and the reason, so no rank waits out its timeout. Once every
//! rank has joined, such a claim is refused and the job goes on. A rank that aborts (any local
//! failure, including its own timeout), or disconnects before contributing to an all-gather
//! that others wait on, fails the job too. A timeout names the missing ranks.
//!
//! # Wire format of gpucast's store (version 3)
//!
//! Every message is a frame: a 12-byte header, then the payload. Integers are little-endian.
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `GCRV` |
//! | 4 | version, 3 |
//! | 5 | op |
//! | 6..8 | reserved, zero |
//! | 8..12 | payload length (u32) |
//!
//! The store speaks first: CHALLENGE (0x84, its 32-byte nonce). Then requests (client to
//! server), one reply each; the first is HELLO:
//!
//! | op | name | payload |
//! |---|---|---|
//! | 0x01 | HELLO | rank u32, world size u32, client nonce (32 bytes), proof (32 bytes) |
//! | 0x02 | WAIT_ALL | timeout ms u32 |
//! | 0x05 | GATHER | round u64 (0, 1, 2, ... in order), timeout ms u32, value (rest) |
//! | 0x06 | ABORT | missing-rank count u32, ranks u32 each, reason (rest, UTF-8) |
//!
//! Replies: 0x80 OK (after HELLO: the store's 32-byte proof; else empty), 0x82 GATHERED (count
//! u32, then per rank a length u32 and the bytes), 0x83 ERROR (code u8, count u32 and that many
//! u64 numbers, count u16 and that many strings of u32 length + UTF-8). Error codes: 1
//! world-size mismatch `[rank, client, server]`, 2 rank out of range `[rank, world]`, 3
//! duplicate rank `[rank]` + detail, 4 token refused (nothing else), 5 timeout `[ms,
//! missing...]` + what, 6 job failed `[missing...]` + reason, 7 rejected + reason, 8 too large
//! `[len, max]` + what, 9 protocol + reason, 10 crowded + reason. Proofs are HMAC-SHA256 keyed by the token's key over a
//! label (`gpucast rendezvous v3: hello`, `...: welcome` or `...: refusal`) and the
//! length-prefixed server nonce, client nonce, rank, world size and, for a refusal, the error
//! payload. The ERROR that answers a proven HELLO carries the store's refusal proof after the
//! error; any other ERROR during the handshake is unproven: code 4 (the refusal of the client's
//! proof, which the store cannot prove to a process whose token differs) and code 10 (turned
//! away: no room among unproven connections, reason as a string, sent instead of the challenge
//! or before an eviction) make the client try again until its deadline; any other makes it
//! call the store not authentic (and try again too). The key is PBKDF2-HMAC-SHA256 of the
//! token, salt `gpucast rendezvous v3: job token`, 2^17 rounds, 32 bytes.
//!
//! A bad magic closes the connection silently; a bad version, non-zero reserved bytes or an
//! oversize length closes it after an ERROR reply. The length is checked before any payload
//! memory is taken, and payload buffers grow only as bytes arrive.
//!
//! # Limits
//!
//! All-gather contributions [`MAX_VALUE_LEN`] bytes, a whole round [`MAX_GATHER_BYTES`], all
//! the store holds [`MAX_STORE_BYTES`] (each rank takes the rounds in order, so at most two are
//! alive; a failed job frees them), job tokens [`MAX_TOKEN_LEN`], world size
//! [`MAX_WORLD_SIZE`].

mod auth;
mod env;
mod error;
mod exchange;
mod server;
mod session;
mod store;

use std::time::Duration;

pub use auth::random_token;
pub use env::{
    env_var, expand_hostlist, host_id, JobEnv, StoreKind, TokenSource, DEFAULT_MASTER_PORT,
    HOST_ID_ENV, JOB_TOKEN_ENV, MASTER_ADDR_ENV, MASTER_PORT_ENV, SLURM_PORT_BASE, SLURM_PORT_SPAN,
};
pub use error::{RendezvousError, Result};
pub use exchange::{Exchange, FnExchange, Rendezvous};

/// Longest all-gather contribution, in bytes (4 MiB: it fits in torchrun's store as well).
pub const MAX_VALUE_LEN: usize = 4 << 20;
/// Most bytes of one all-gather round, all ranks together (256 MiB).
pub const MAX_GATHER_BYTES: usize = 256 << 20;
/// Most bytes gpucast's store holds at once (1 GiB).
pub const MAX_STORE_BYTES: usize = 1 << 30;
/// Longest job token, in bytes.
pub const MAX_TOKEN_LEN: usize = 256;
/// Largest world size.
pub const MAX_WORLD_SIZE: usize = 1 << 20;

/// `timeout` from now, or far in the future when that is beyond what an `Instant` holds (a
/// caller may pass `Duration::MAX` for "no limit").
pub(crate) fn later(timeout: Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

/// Lets the first few of a kind of event be logged, then one in 1024, so that strangers who
/// make the same mistake (or attack) many times cannot flood the log.
pub(crate) struct Throttle(std::sync::atomic::AtomicU64);

impl Throttle {
    /// A throttle that has seen nothing yet.
    pub(crate) const fn new() -> Self {
        Self(std::sync::atomic::AtomicU64::new(0))
    }

    /// Whether this occurrence is to be logged, and how many came before it.
    pub(crate) fn allow(&self) -> Option<u64> {
        let n = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (n < 8 || n.is_multiple_of(1024)).then_some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_throttle_lets_the_first_few_through_then_one_in_1024() {
        let t = Throttle::new();
        let allowed = (0..5000).filter(|_| t.allow().is_some()).count();
        assert_eq!(allowed, 8 + 4, "0..8, then 1024, 2048, 3072, 4096");
    }

    #[test]
    fn far_deadlines_do_not_overflow() {
        let far = later(Duration::MAX);
        assert!(far > std::time::Instant::now() + Duration::from_secs(3600 * 24 * 365));
        let near = later(Duration::from_millis(5));
        assert!(near <= std::time::Instant::now() + Duration::from_millis(5));
    }
}
