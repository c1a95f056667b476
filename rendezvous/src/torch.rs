//! torchrun's own store: a client of PyTorch's c10d `TCPStore` protocol, and the all-gather
//! that gpucast runs over it under torchrun, so that a job needs no port besides torchrun's.
//!
//! The protocol (PyTorch's `TCPStoreBackend.hpp`; its libuv and classic servers agree): the
//! client first sends VALIDATE (query type 0, then the u32 magic `0x3C85F7CE`); every request
//! is a one-byte query type and its arguments in the host's byte order (little-endian on every
//! machine gpucast runs on), strings and byte strings as a u64 length and the bytes. gpucast
//! uses SET (no reply), GET (reply: u64 length, value), ADD (reply: the sum, i64), CHECK (a u64
//! count of keys, then the keys; reply: 0 when all exist, 1 when not) and DELETE_KEY (reply:
//! i64). Keys are what Python's `PrefixStore(prefix, store)` would send: `/`, the prefix, `/`,
//! the key (`TCPStore` adds the leading `/` itself).
//!
//! The store authenticates nobody: any process that reaches the port reads and writes every
//! key. So every value gpucast puts there is sealed (HMAC-SHA256 under a key derived from the
//! job token and the prefix: readable, but not forgeable) and bound to its place (the
//! instance, the round, the rank) and,
//! after the first round, to a session id made of every rank's fresh nonce, so that a value
//! recorded in an earlier launch is refused as well. A value that does not open is an error
//! that names it, never data. Rank 0 deletes a round's keys once every rank is past it.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::auth::{self, Sealer, SEAL_OVERHEAD};
use super::client::{connect_tcp, host_port};
use super::env::{JobEnv, StoreKind};
use super::error::{clip, RendezvousError, Result};
use super::{later, MAX_GATHER_BYTES, MAX_VALUE_LEN};

// A sealed contribution always fits in a value of torch's store.
const _: () = assert!(MAX_VALUE_LEN + SEAL_OVERHEAD <= TORCH_MAX_VALUE);

/// Query types of the c10d store protocol.
mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const DELETE_KEY: u8 = 8;
}
/// What VALIDATE carries.
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// CHECK's reply when every key exists.
const READY: u8 = 0;
/// CHECK's reply when some key is missing.
const NOT_READY: u8 = 1;
/// Longest value PyTorch's store servers accept (the libuv server's limit).
pub(crate) const TORCH_MAX_VALUE: usize = 8 << 20;
/// Requests may run this long past the end of the wait they serve, so that a wait that times
/// out can still name what it missed (the same slack as gpucast's own store's replies).
const REQUEST_SLACK: Duration = Duration::from_secs(1);
/// First and longest pause between two looks at the keys of a round.
const POLL_START: Duration = Duration::from_micros(200);
const POLL_MAX: Duration = Duration::from_millis(10);

/// A connection to a c10d `TCPStore`. Every call returns by its deadline; after an I/O error
/// the connection is unusable.
pub(crate) struct TorchStore {
    stream: TcpStream,
    peer: String,
    broken: Option<String>,
}

fn push_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    buf.extend_from_slice(bytes);
}

impl TorchStore {
    /// Connects (retrying until `deadline`, as the agent may still be starting), validates
    /// and checks that a c10d store answers.
    pub(crate) fn connect(host: &str, port: u16, deadline: Instant) -> Result<TorchStore> {
        let left = deadline.saturating_duration_since(Instant::now());
        let (stream, _) = connect_tcp(host, port, left)?;
        let mut store = TorchStore {
            stream,
            peer: host_port(host, port),
            broken: None,
        };
        let _ = store.stream.set_nodelay(true);
        let mut hello = vec![query::VALIDATE];
        hello.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        store.send(&hello, deadline, "validating the connection")?;
        // A CHECK of a key nobody sets: any c10d store answers it, anything else does not.
        store
            .check(&["/gpucast/validate".to_owned()], deadline)
            .map_err(|e| match e {
                RendezvousError::Io { .. } | RendezvousError::Protocol { .. } => {
                    RendezvousError::Protocol {
                        peer: store.peer.clone(),
                        reason: format!(
                            "no c10d TCPStore answers there (torchrun's agent store is expected \
                             under TORCHELASTIC_USE_AGENT_STORE): {e}"
                        ),
                    }
                }
                other => other,
            })?;
        Ok(store)
    }

    /// The store's `host:port`.
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    fn io_error(&mut self, during: &str, source: io::Error) -> RendezvousError {
        self.broken = Some(format!("{during}: {source}"));
        RendezvousError::Io {
            peer: self.peer.clone(),
            during: during.to_owned(),
            source,
        }
    }

    fn usable(&self, during: &str) -> Result<()> {
        match &self.broken {
            Some(why) => Err(RendezvousError::unusable(&self.peer, during, why)),
            None => Ok(()),
        }
    }

    /// Writes all of `bytes` by `deadline` (checked between partial writes, not per write).
    fn send(&mut self, bytes: &[u8], deadline: Instant, during: &str) -> Result<()> {
        self.usable(during)?;
        let mut sent = 0;
        while sent < bytes.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let e =
                    io::Error::new(io::ErrorKind::TimedOut, "the store took no request in time");
                return Err(self.io_error(during, e));
            }
            if let Err(e) = self.stream.set_write_timeout(Some(left)) {
                return Err(self.io_error(during, e));
            }
            match self.stream.write(&bytes[sent..]) {
                Ok(0) => {
                    let e =
                        io::Error::new(io::ErrorKind::WriteZero, "the store closed the connection");
                    return Err(self.io_error(during, e));
                }
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error(during, e)),
            }
        }
        Ok(())
    }

    fn receive(&mut self, buf: &mut [u8], deadline: Instant, during: &str) -> Result<()> {
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let e = io::Error::new(io::ErrorKind::TimedOut, "no reply from the store in time");
                return Err(self.io_error(during, e));
            }
            if let Err(e) = self.stream.set_read_timeout(Some(left)) {
                return Err(self.io_error(during, e));
            }
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => {
                    let e = io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the store closed the connection",
                    );
                    return Err(self.io_error(during, e));
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error(during, e)),
            }
        }
        Ok(())
    }

    fn receive_u8(&mut self, deadline: Instant, during: &str) -> Result<u8> {
        let mut b = [0u8; 1];
        self.receive(&mut b, deadline, during)?;
        Ok(b[0])
    }

    fn receive_i64(&mut self, deadline: Instant, during: &str) -> Result<i64> {
        let mut b = [0u8; 8];
        self.receive(&mut b, deadline, during)?;
        Ok(i64::from_le_bytes(b))
    }

    /// Stores `value` under `key`.
    pub(crate) fn set(&mut self, key: &str, value: &[u8], deadline: Instant) -> Result<()> {
        if value.len() > TORCH_MAX_VALUE {
            return Err(RendezvousError::TooLarge {
                what: format!("the value of {key}"),
                len: value.len(),
                max: TORCH_MAX_VALUE,
            });
        }
        let mut req = vec![query::SET];
        push_bytes(&mut req, key.as_bytes());
        push_bytes(&mut req, value);
        self.send(&req, deadline, &format!("setting {key}"))
    }

    /// The value of `key` (which must exist: check first), refused beyond `max` bytes before
    /// any memory is taken.
    pub(crate) fn get(&mut self, key: &str, max: usize, deadline: Instant) -> Result<Vec<u8>> {
        let during = format!("getting {key}");
        let mut req = vec![query::GET];
        push_bytes(&mut req, key.as_bytes());
        self.send(&req, deadline, &during)?;
        let mut len = [0u8; 8];
        self.receive(&mut len, deadline, &during)?;
        let len = u64::from_le_bytes(len);
        // Bounded before any memory is taken: neither the store nor a process that wrote the
        // key can make this rank allocate more than the value may hold.
        let max = max.min(TORCH_MAX_VALUE);
        if len > max as u64 {
            self.broken = Some(format!("a {len}-byte reply"));
            return Err(RendezvousError::TooLarge {
                what: format!("the store's value of {key}"),
                len: usize::try_from(len).unwrap_or(usize::MAX),
                max,
            });
        }
        let mut value = vec![0u8; usize::try_from(len).unwrap_or(0)];
        self.receive(&mut value, deadline, &during)?;
        Ok(value)
    }

    /// Adds `delta` to the integer under `key` (0 if unset) and returns the sum.
    pub(crate) fn add(&mut self, key: &str, delta: i64, deadline: Instant) -> Result<i64> {
        let during = format!("adding to {key}");
        let mut req = vec![query::ADD];
        push_bytes(&mut req, key.as_bytes());
        req.extend_from_slice(&delta.to_le_bytes());
        self.send(&req, deadline, &during)?;
        self.receive_i64(deadline, &during)
    }

    /// Whether every key of `keys` exists.
    pub(crate) fn check(&mut self, keys: &[String], deadline: Instant) -> Result<bool> {
        let during = "checking for keys";
        let mut req = vec![query::CHECK];
        req.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            push_bytes(&mut req, k.as_bytes());
        }
        self.send(&req, deadline, during)?;
        match self.receive_u8(deadline, during)? {
            READY => Ok(true),
            NOT_READY => Ok(false),
            other => {
                self.broken = Some(format!("CHECK answered {other}"));
                Err(RendezvousError::Protocol {
                    peer: self.peer.clone(),
                    reason: format!("CHECK answered {other}, expected 0 or 1"),
                })
            }
        }
    }

    /// Deletes `key`.
    pub(crate) fn delete(&mut self, key: &str, deadline: Instant) -> Result<()> {
        let during = format!("deleting {key}");
        let mut req = vec![query::DELETE_KEY];
        push_bytes(&mut req, key.as_bytes());
        self.send(&req, deadline, &during)?;
        self.receive_i64(deadline, &during).map(drop)
    }
}

/// The rounds of one [`super::Rendezvous`] over torchrun's store.
///
/// Rounds: `hello` (every rank's fresh nonce and world size), `confirm` (a value sealed under
/// the session id that the nonces give, so that a rank goes on only once every rank has seen
/// the same hellos: a hello recorded in an earlier launch cannot pass), then the all-gather
/// rounds 0, 1, ... Each rank writes its value, then adds one to the round's counter; a rank
/// waits by reading that one counter (not every key, which would load the store with
/// world x world key lookups) and checks the keys once it is full.
pub(crate) struct TorchSession {
    store: TorchStore,
    sealer: Sealer,
    /// The wire prefix of this instance's keys, ending in `/`.
    base: String,
    /// Which gpucast rendezvous of this launch this is (1, 2, ...), alike on every rank.
    instance: u64,
    rank: usize,
    world: usize,
    /// This rank's fresh nonce of the first round.
    nonce: [u8; 32],
    /// Digest of every rank's nonce, once the first round is done: binds later values, and
    /// aborts, to this session.
    session: Option<[u8; 32]>,
    /// A genuine abort seen during the first round, reported if that round fails.
    early_abort: Option<(String, Vec<usize>)>,
    /// Whether an abort that failed authentication was seen (reported once).
    forged_abort: bool,
}

fn u64s(parts: &[u64]) -> Vec<u8> {
    parts.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Bytes of a first-round value: the nonce and the world size.
const HELLO_PLAIN: usize = 32 + 8;
/// Ranks an abort lists at most.
const ABORT_RANKS: usize = 1 << 12;
/// Longest reason an abort carries.
const ABORT_REASON: usize = 4096;
/// Longest sealed abort.
const ABORT_MAX: usize = 4 + 32 + 4 + 4 * ABORT_RANKS + ABORT_REASON + 64 + SEAL_OVERHEAD;
/// Most ranks a job through torchrun's store may have: PyTorch's libuv store takes at most
/// this many keys in one CHECK.
pub(crate) const TORCH_MAX_WORLD: usize = 128 * 1024;

/// Which round a key belongs to.
#[derive(Clone, Copy)]
enum Round {
    Hello,
    Confirm,
    Gather(u64),
}

impl Round {
    fn name(self) -> String {
        match self {
            Round::Hello => "hello".into(),
            Round::Confirm => "confirm".into(),
            Round::Gather(r) => r.to_string(),
        }
    }
}

impl TorchSession {
    /// Joins the job through torchrun's store: takes this rendezvous's instance number, then
    /// runs the first two rounds (every rank's nonce and world size, then a confirmation under
    /// the session id), within `deadline`.
    pub(crate) fn join(env: &JobEnv, deadline: Instant) -> Result<TorchSession> {
        let StoreKind::Torch { prefix } = &env.store else {
            return Err(RendezvousError::InvalidArgument {
                reason: "the job does not use torchrun's store".into(),
            });
        };
        if env.world_size > TORCH_MAX_WORLD {
            return Err(RendezvousError::InvalidArgument {
                reason: format!(
                    "{} ranks: a job through torchrun's store has at most {TORCH_MAX_WORLD} \
                     (set GPUCAST_MASTER_PORT to host gpucast's own store)",
                    env.world_size
                ),
            });
        }
        // Said by rank 0 only, so once per job.
        let weak = auth::weakness(&env.job_token, env.token_source).filter(|_| env.rank == 0);
        if let Some(reason) = weak {
            auth::warn_weak_token(
                reason,
                "gpucast's values in torchrun's store, which any process that reaches \
                 MASTER_PORT can read, carry tags made with a key derived from it",
            );
        }
        let hard = deadline.checked_add(REQUEST_SLACK).unwrap_or(deadline);
        let mut store = TorchStore::connect(&env.master_addr, env.master_port, deadline)?;
        let key = |k: &str| format!("/{prefix}/gpucast/{k}");
        let instance = store.add(&key(&format!("instance/{}", env.rank)), 1, hard)?;
        let instance = u64::try_from(instance).map_err(|_| RendezvousError::Protocol {
            peer: store.peer().to_owned(),
            reason: format!("the instance counter is {instance}"),
        })?;
        let mut s = TorchSession {
            store,
            sealer: Sealer::new(&auth::Key::of(&env.job_token), prefix.as_bytes()),
            base: key(&format!("{instance}/")),
            instance,
            rank: env.rank,
            world: env.world_size,
            nonce: auth::random()?,
            session: None,
            early_abort: None,
            forged_abort: false,
        };
        debug!(rank = env.rank, instance, base = %s.base, "rendezvous through torchrun's store");
        let first = s.hello(deadline).and_then(|()| s.confirm(deadline));
        if let Err(e) = &first {
            s.abort_after(e);
        }
        first.map(|()| s)
    }

    fn aad(&self, what: &[u8], round: Round, rank: usize) -> Vec<u8> {
        let mut aad = what.to_vec();
        if let Some(session) = &self.session {
            aad.extend_from_slice(session);
        }
        let r = match round {
            Round::Hello => u64::MAX,
            Round::Confirm => u64::MAX - 1,
            Round::Gather(r) => r,
        };
        aad.extend(u64s(&[self.instance, r, rank as u64]));
        aad
    }

    fn key(&self, round: Round, rank: usize) -> String {
        format!("{}{}/{rank}", self.base, round.name())
    }

    fn counter(&self, round: Round) -> String {
        format!("{}{}/count", self.base, round.name())
    }

    fn keys(&self, round: Round) -> Vec<String> {
        (0..self.world).map(|r| self.key(round, r)).collect()
    }

    /// The abort key of the first round (bound to its sender's nonce) and of the session.
    fn abort_key(&self) -> String {
        match self.session {
            None => format!("{}abort-hello", self.base),
            Some(_) => format!("{}abort", self.base),
        }
    }

    fn abort_aad(&self) -> Vec<u8> {
        let mut aad = b"gpucast abort".to_vec();
        if let Some(session) = &self.session {
            aad.extend_from_slice(session);
        }
        aad.extend(u64s(&[self.instance]));
        aad
    }

    fn forged(&self, what: String) -> RendezvousError {
        RendezvousError::Forged {
            what,
            store: self.store.peer().to_owned(),
        }
    }

    /// Rank `r`'s first-round value, opened: its nonce and world size.
    fn open_hello(&self, r: usize, sealed: &[u8]) -> Option<([u8; 32], u64)> {
        let plain = self
            .sealer
            .open(&self.aad(b"gpucast hello", Round::Hello, r), sealed)?;
        let nonce: [u8; 32] = plain.get(..32)?.try_into().ok()?;
        let world = u64::from_le_bytes(plain.get(32..HELLO_PLAIN)?.try_into().ok()?);
        (plain.len() == HELLO_PLAIN).then_some((nonce, world))
    }

    /// Writes this rank's sealed `plain` for `round` and counts it in.
    fn put(&mut self, round: Round, what: &[u8], plain: &[u8], hard: Instant) -> Result<()> {
        let sealed = self.sealer.seal(&self.aad(what, round, self.rank), plain);
        self.store.set(&self.key(round, self.rank), &sealed, hard)?;
        self.store.add(&self.counter(round), 1, hard).map(drop)
    }

    /// The first round: every rank's fresh nonce (the session id) and world size.
    fn hello(&mut self, deadline: Instant) -> Result<()> {
        let hard = deadline.checked_add(REQUEST_SLACK).unwrap_or(deadline);
        let mut plain = self.nonce.to_vec();
        plain.extend_from_slice(&(self.world as u64).to_le_bytes());
        self.put(Round::Hello, b"gpucast hello", &plain, hard)?;
        let what = format!("hello from all {} ranks", self.world);
        let timeout = deadline.saturating_duration_since(Instant::now());
        if let Err(e) = self.wait_round(Round::Hello, deadline, &what, timeout) {
            // Another rank's abort of this round says more than the timeout it caused.
            return Err(match (e, self.early_abort.take()) {
                (RendezvousError::Timeout { .. }, Some((reason, missing))) => {
                    RendezvousError::JobFailed { reason, missing }
                }
                (e, _) => e,
            });
        }
        let mut nonces = Vec::with_capacity(self.world);
        for (r, k) in self.keys(Round::Hello).iter().enumerate() {
            let sealed = self.store.get(k, HELLO_PLAIN + SEAL_OVERHEAD, hard)?;
            let (nonce, world) = self
                .open_hello(r, &sealed)
                .ok_or_else(|| self.forged(format!("rank {r}'s hello")))?;
            if world != self.world as u64 {
                return Err(RendezvousError::WorldSizeMismatch {
                    rank: r,
                    client: usize::try_from(world).unwrap_or(usize::MAX),
                    server: self.world,
                });
            }
            nonces.push(nonce);
        }
        if nonces[self.rank] != self.nonce {
            return Err(RendezvousError::DuplicateRank {
                rank: self.rank,
                detail: "another process of the job wrote this rank's hello in torchrun's store"
                    .into(),
            });
        }
        let mut parts: Vec<&[u8]> = vec![b"gpucast session"];
        let instance = self.instance.to_le_bytes();
        parts.push(&instance);
        parts.extend(nonces.iter().map(|n| n.as_slice()));
        self.session = Some(auth::digest(&parts));
        Ok(())
    }

    /// The second round: an empty value sealed under the session id, from every rank. A rank
    /// that saw other hellos (one recorded in an earlier launch, planted for a rank that never
    /// came) has another session id, and its confirmation does not open here.
    fn confirm(&mut self, deadline: Instant) -> Result<()> {
        let hard = deadline.checked_add(REQUEST_SLACK).unwrap_or(deadline);
        self.put(Round::Confirm, b"gpucast confirm", &[], hard)?;
        let what = format!(
            "every one of the {} ranks to confirm the session",
            self.world
        );
        let timeout = deadline.saturating_duration_since(Instant::now());
        self.wait_round(Round::Confirm, deadline, &what, timeout)?;
        for (r, k) in self.keys(Round::Confirm).iter().enumerate() {
            let sealed = self.store.get(k, SEAL_OVERHEAD, hard)?;
            let aad = self.aad(b"gpucast confirm", Round::Confirm, r);
            if self.sealer.open(&aad, &sealed).is_none() {
                return Err(self.forged(format!(
                    "rank {r}'s confirmation (it saw other ranks' hellos than this rank)"
                )));
            }
        }
        if self.rank == 0 {
            // Every rank wrote its confirmation after reading every hello.
            self.forget(Round::Hello, hard);
        }
        Ok(())
    }

    /// Deletes a round's keys and counter (rank 0, once every rank is past it).
    fn forget(&mut self, round: Round, hard: Instant) {
        let mut old = self.keys(round);
        old.push(self.counter(round));
        for k in old {
            if let Err(e) = self.store.delete(&k, hard) {
                debug!(error = %e, "rendezvous: could not delete a finished key");
                return;
            }
        }
    }

    /// Every rank's contribution to round `round`, in rank order.
    pub(crate) fn all_gather(
        &mut self,
        round: u64,
        mine: &[u8],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        if mine.len() > MAX_VALUE_LEN {
            return Err(RendezvousError::TooLarge {
                what: "all-gather contribution".into(),
                len: mine.len(),
                max: MAX_VALUE_LEN,
            });
        }
        let deadline = later(timeout);
        let hard = deadline.checked_add(REQUEST_SLACK).unwrap_or(deadline);
        let this = Round::Gather(round);
        self.put(this, b"gpucast round", mine, hard)?;
        let what = format!("all-gather round {round}");
        self.wait_round(this, deadline, &what, timeout)?;
        // Each value is read at most as long as a contribution can be, and opened at once: a
        // process that overwrites keys with junk costs no more memory than a real round.
        let mut out = Vec::with_capacity(self.world);
        let mut total = 0usize;
        for (r, k) in self.keys(this).iter().enumerate() {
            let sealed = self.store.get(k, MAX_VALUE_LEN + SEAL_OVERHEAD, hard)?;
            let aad = self.aad(b"gpucast round", this, r);
            let plain = self.sealer.open(&aad, &sealed).ok_or_else(|| {
                self.forged(format!(
                    "rank {r}'s contribution to all-gather round {round}"
                ))
            })?;
            total += plain.len();
            if total > MAX_GATHER_BYTES {
                return Err(RendezvousError::TooLarge {
                    what: format!("all-gather round {round}"),
                    len: total,
                    max: MAX_GATHER_BYTES,
                });
            }
            out.push(plain);
        }
        if out[self.rank] != mine {
            return Err(RendezvousError::DuplicateRank {
                rank: self.rank,
                detail: format!(
                    "another process of the job wrote this rank's contribution to round {round}"
                ),
            });
        }
        if self.rank == 0 {
            // Every rank wrote this round after reading the previous one: that one is done.
            let previous = match round {
                0 => Round::Confirm,
                r => Round::Gather(r - 1),
            };
            self.forget(previous, hard);
        }
        Ok(out)
    }

    /// Waits until every rank has counted itself into `round` and its keys exist, an abort of
    /// this session appears, or `deadline` passes (requests may take a second longer, to name
    /// the missing ranks).
    fn wait_round(
        &mut self,
        round: Round,
        deadline: Instant,
        what: &str,
        timeout: Duration,
    ) -> Result<()> {
        let hard = deadline.checked_add(REQUEST_SLACK).unwrap_or(deadline);
        let counter = self.counter(round);
        let keys = self.keys(round);
        let abort = vec![self.abort_key()];
        let world = i64::try_from(self.world).unwrap_or(i64::MAX);
        let mut pause = POLL_START;
        loop {
            // One counter per look; the keys once it says everyone is in (a stranger can
            // raise the counter, never make the keys exist).
            if self.store.add(&counter, 0, hard)? >= world && self.store.check(&keys, hard)? {
                return Ok(());
            }
            if self.store.check(&abort, hard)? {
                // The round may have filled between the two looks, and a rank that saw it full
                // have aborted since: then this round is done, and the abort is the next one's.
                if self.store.add(&counter, 0, hard)? >= world && self.store.check(&keys, hard)? {
                    return Ok(());
                }
                self.read_abort(hard)?;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // Every key there though the counter is short (written without being counted:
                // a stranger's, or a rank's that died in between): let the values speak.
                if self.store.check(&keys, hard)? {
                    return Ok(());
                }
                // Name the missing ranks, a key each, as far as the second allows.
                let mut missing = Vec::new();
                for (r, k) in keys.iter().enumerate() {
                    if Instant::now() >= hard {
                        break;
                    }
                    if !self.store.check(std::slice::from_ref(k), hard)? {
                        missing.push(r);
                    }
                }
                return Err(RendezvousError::Timeout {
                    what: what.to_owned(),
                    timeout,
                    missing,
                });
            }
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(POLL_MAX);
        }
    }

    /// Reads the abort another rank left. In a session, one that opens under the session's
    /// key fails this rank at once. In the first round, one whose sender's nonce matches that
    /// sender's hello is kept, and reported if the round fails: it cannot prove itself of
    /// this launch yet (a hello and an abort recorded together in an earlier launch would pass).
    fn read_abort(&mut self, hard: Instant) -> Result<()> {
        let sealed = self.store.get(&self.abort_key(), ABORT_MAX, hard)?;
        let parsed = self.sealer.open(&self.abort_aad(), &sealed).and_then(|p| {
            let sender = u32::from_le_bytes(p.get(..4)?.try_into().ok()?) as usize;
            let nonce: [u8; 32] = p.get(4..36)?.try_into().ok()?;
            let count = u32::from_le_bytes(p.get(36..40)?.try_into().ok()?) as usize;
            let end = 40usize.checked_add(count.checked_mul(4)?)?;
            let missing: Vec<usize> = p
                .get(40..end)?
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
                .collect();
            let reason = String::from_utf8_lossy(p.get(end..)?).into_owned();
            Some((sender, nonce, missing, reason))
        });
        let Some((sender, nonce, missing, reason)) = parsed else {
            if !self.forged_abort {
                self.forged_abort = true;
                warn!(store = %self.store.peer(), "rendezvous: ignoring an abort in torchrun's store that is not of this job");
            }
            return Ok(());
        };
        if self.session.is_some() {
            return Err(RendezvousError::JobFailed { reason, missing });
        }
        // First round: the sender's hello must be there and carry the same nonce.
        let key = vec![self.key(Round::Hello, sender.min(self.world))];
        if sender < self.world && self.store.check(&key, hard)? {
            let hello = self.store.get(&key[0], HELLO_PLAIN + SEAL_OVERHEAD, hard)?;
            if self
                .open_hello(sender, &hello)
                .is_some_and(|(n, _)| auth::same_secret(&n, &nonce))
            {
                self.early_abort = Some((reason, missing));
            }
        }
        Ok(())
    }

    /// Fails the job for every rank with `reason`.
    pub(crate) fn abort(
        &mut self,
        reason: &str,
        missing: &[usize],
        timeout: Duration,
    ) -> Result<()> {
        let listed = &missing[..missing.len().min(ABORT_RANKS)];
        let mut plain = u32::try_from(self.rank)
            .unwrap_or(u32::MAX)
            .to_le_bytes()
            .to_vec();
        plain.extend_from_slice(&self.nonce);
        plain.extend_from_slice(&u32::try_from(listed.len()).unwrap_or(0).to_le_bytes());
        for &r in listed {
            plain.extend_from_slice(&u32::try_from(r).unwrap_or(u32::MAX).to_le_bytes());
        }
        plain.extend_from_slice(
            format!("rank {} aborted: {}", self.rank, clip(reason, ABORT_REASON)).as_bytes(),
        );
        let sealed = self.sealer.seal(&self.abort_aad(), &plain);
        let key = self.abort_key();
        self.store.set(&key, &sealed, later(timeout))
    }

    /// After a local failure, tells the others (best effort), unless the failure came from
    /// them or from the store itself.
    pub(crate) fn abort_after(&mut self, e: &RendezvousError) {
        if !e.is_worth_an_abort() {
            return;
        }
        let reason = e.to_string();
        if let Err(abort_err) = self.abort(&reason, e.missing_ranks(), Duration::from_millis(500)) {
            debug!(rank = self.rank, error = %abort_err, "rendezvous: abort not delivered");
        }
    }
}
