//! Rendezvous: the processes of one job (one per GPU, on one or many nodes) find each other
//! and exchange small byte strings at initialisation, within time limits, admitting nobody
//! outside the job.
//!
//! - [`JobEnv`] reads who this process is from what torchrun or Slurm set ([`JobEnv::from_env`]).
//! - [`Rendezvous::connect`] joins the job and returns once all `world_size` ranks have
//!   arrived; then [`Rendezvous::all_gather`], [`Rendezvous::barrier`] and
//!   [`Rendezvous::broadcast_from`]. The ranks meet through gpucast's own TCP store, which
//!   rank 0 hosts, or, under torchrun, through the agent's own store as clients (no port of
//!   gpucast's is opened; see [`StoreKind`]), by one protocol and one code path.
//! - [`Exchange`] is what the rest of gpucast needs; [`FnExchange`] lets MPI or a framework's
//!   process group provide it instead.
//! - [`random_token`] makes a job token.
//!
//! Pure Rust and `std` (plus RustCrypto's HMAC and SHA-2, nix's sockets, and the OS's
//! random source): blocking sockets with timeouts and a few threads on rank 0. This crate
//! uses nothing of gpucast, which re-exports it as `gpucast::rendezvous`.
//!
//! ```no_run
//! use std::time::Duration;
//! use gpucast_rendezvous::{Exchange, JobEnv, Rendezvous};
//!
//! let env = JobEnv::from_env()?;
//! let rdv = Rendezvous::connect(&env, Duration::from_secs(120))?;
//! let nodes = rdv.all_gather(&env.node.to_le_bytes())?;
//! let same_node: Vec<usize> = (0..rdv.world_size()).filter(|&r| nodes[r] == nodes[rdv.rank()]).collect();
//! # let _ = same_node;
//! rdv.barrier()?;
//! # Ok::<(), gpucast_rendezvous::RendezvousError>(())
//! ```
//!
//! # Who gets in
//!
//! The job token ([`JobEnv::job_token`], from `GPUCAST_JOB_TOKEN`) is the job's secret. It
//! never leaves the process: not in a message, a log line, an error or a `Debug` form.
//!
//! - Every process derives a key from the token once: PBKDF2-HMAC-SHA256 with 2^17 rounds
//!   (why not scrypt or Argon2: see below). gpucast's store sends every new connection a fresh
//!   random nonce; the HELLO must carry HMAC-SHA256(key, both nonces, rank, world size),
//!   checked in constant time, and the store answers with its own proof over the same nonces,
//!   for a welcome and for a refusal alike. A process without the token registers nothing and
//!   sends the store no command; a recorded HELLO is useless on any other connection; a process
//!   that took the port first can pass neither as the store nor for its refusals: a rank takes
//!   any answer nobody proved ("token refused" and "turned away" included) as a reason to try
//!   again until its deadline, then names the last one.
//! - Until a HELLO is proven, a connection may send nothing but that one HELLO (82 bytes),
//!   within one deadline for the whole handshake (10 s); anything else closes it. At most
//!   1,024 such connections are kept, at most 128 from one address, and none is closed to make
//!   room before it is 500 ms old: a newcomer evicts an older one of its own address or, the
//!   store being full, of the address holding the most (when that is at least two more than
//!   its own), else it is turned away with a message that says why
//!   ([`RendezvousError::Crowded`]). Strangers that connect, idle, dribble or reconnect, and
//!   floods from other addresses, cost a rank at most a retried connection; a flood from the
//!   rank's own address, or from so many addresses that each holds one place, can delay it.
//! - A proven rank gets bounded room: keys of at most 1 KiB, values of at most a sealed
//!   contribution, 64 keys and four values' bytes per connection, [`MAX_STORE_BYTES`] in all,
//!   CHECKs of at most a key per rank and one more. A proven connection that sends anything
//!   else (an unknown command, an oversize key or value, a GET of a missing key, more than its
//!   share) is closed before the store reads or allocates what it announced.
//! - Every value a rank puts in a store, gpucast's or torchrun's (which admits anyone who
//!   reaches its port), carries HMAC-SHA256 under a key derived from the token, over the value
//!   and its rank, round and instance and, after a first round of fresh nonces and a round that
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
//! launch disagree); once every rank has joined, such a claim is refused and the job goes on.
//! A rank that aborts (any local failure, including its own timeout) fails the job, and so does
//! a rank whose connection to gpucast's store closes after it wrote there. Every other rank
//! then fails with [`RendezvousError::JobFailed`] and the reason at its next look at the store,
//! instead of waiting out its timeout. A timeout names the missing ranks.
//!
//! # The protocol
//!
//! One protocol, spoken by one client: the subset of PyTorch's c10d `TCPStore` protocol that
//! gpucast needs, against torchrun's agent store and gpucast's own store (which rank 0 hosts)
//! alike. Integers are little-endian; strings and byte strings are a u64 length and the bytes.
//! The client first sends VALIDATE (query type 0, the u32 `0x3C85F7CE`), then requests: SET (1:
//! key, value; no reply), GET (3: key; reply: value), ADD (4: key, i64; reply: the sum, i64),
//! CHECK (5: a u64 count of keys, the keys; reply: a byte, 0 when all exist, 1 when not),
//! DELETE_KEY (8: key; reply: i64).
//!
//! On gpucast's own store an admission handshake comes first. Its messages are a 10-byte
//! header (magic `GCRV`, version 4, kind, u32 body length) and the body:
//!
//! | kind | from | body |
//! |---|---|---|
//! | `C` challenge | store, unasked | its nonce (32 bytes) |
//! | `H` hello | rank | rank u32, world size u32, its nonce (32 bytes), proof (32 bytes) |
//! | `W` welcome | store | its proof (32 bytes) |
//! | `R` refused | store | the refusal, then its proof over it (32 bytes) |
//! | `T` token refused | store, unproven | empty |
//! | `B` turned away | store, unproven | the reason (UTF-8) |
//!
//! A refusal is a code (1 world-size mismatch `[rank, client, server]`, 2 rank out of range
//! `[rank, world]`, 3 duplicate rank `[rank]` + detail, 4 job failed `[missing...]` + reason, 5
//! rejected + reason), a u32 count of u64 numbers, the numbers, then UTF-8 text. Proofs are
//! HMAC-SHA256 keyed by the token's key over a label (`gpucast rendezvous v4: hello`, `...:
//! welcome` or `...: refusal`) and the length-prefixed store's nonce, rank's nonce, rank and
//! world size (8 bytes) and, for a refusal, the refusal. The key is PBKDF2-HMAC-SHA256 of the
//! token, salt `gpucast rendezvous v3: job token`, 2^17 rounds, 32 bytes. A rank takes only
//! `C` first and only `W` or `R` with a proof that holds for an answer; every store message it
//! reads before that is at most 64 KiB, all of it within a second past the rank's deadline.
//!
//! The rounds of a rendezvous, on either store, under the prefix `/worker/attempt_<restart>`
//! (torchrun's) or `/gpucast-own`: each rank adds 1 to `.../gpucast/instance/<rank>`, which
//! numbers this rendezvous of the launch; then rounds `hello`, `confirm`, `0`, `1`, ...: each
//! rank SETs `.../gpucast/<instance>/<round>/<rank>` (its value, then HMAC-SHA256 of it under a
//! key derived from the token and prefix, over the round's label, the session id once there is
//! one, the instance, the round and the rank) and ADDs 1 to `.../<round>/count`; a rank waits
//! by reading that counter, then CHECKs the round's keys, and GETs each. Rank 0 deletes a round
//! once every rank is past it. An abort is `.../<instance>/abort-hello` or `.../abort` in
//! torchrun's store (sealed: the sender, its nonce, the failure as a refusal); gpucast's own
//! store keeps the job's failure itself under `/gpucast/failed` (a refusal, code 4), which the
//! store sets and a rank that aborts sets too, and from then on takes no writes.
//!
//! # Limits
//!
//! All-gather contributions [`MAX_VALUE_LEN`] bytes, a whole round [`MAX_GATHER_BYTES`], all
//! gpucast's store holds [`MAX_STORE_BYTES`], job tokens [`MAX_TOKEN_LEN`], world size
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
    env_var, JobEnv, StoreKind, TokenSource, DEFAULT_MASTER_PORT, JOB_TOKEN_ENV, MASTER_ADDR_ENV,
    MASTER_PORT_ENV, SLURM_PORT_BASE, SLURM_PORT_SPAN,
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
    let far = now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600));
    now.checked_add(timeout).or(far).unwrap_or(now)
}

/// Lets the first few of a kind of event be logged, then one in 1024, so that strangers who
/// make the same mistake (or attack) many times cannot flood the log.
#[derive(Default)]
pub(crate) struct Throttle(std::sync::atomic::AtomicU64);

impl Throttle {
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
        let t = Throttle::default();
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
