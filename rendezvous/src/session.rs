//! The rounds of a rendezvous, run over the one store protocol ([`super::store`]) against
//! torchrun's store or gpucast's own, by one code path.
//!
//! Every value a rank puts in the store carries HMAC-SHA256 under a key derived from the job
//! token and the key prefix, over the value and its instance, round, rank and, after the first
//! round, the session id that every rank's fresh nonce makes: readable, but not forgeable, and
//! refused when recorded in an earlier launch. A value that does not open is an error that
//! names it, never data. Rank 0 deletes a round's keys once every rank is past it.
//!
//! Aborts differ by store: in torchrun's store (which anyone who reaches it can write) they are
//! sealed like values; gpucast's own store, which has proven the token and admits only ranks
//! that have, keeps the job's failure itself under [`FAILED_KEY`], which a rank that aborts sets.

use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::auth::{self, Sealer, SEAL_OVERHEAD};
use super::env::{JobEnv, StoreKind};
use super::error::{RendezvousError, RendezvousError as E, Result};
use super::store::{decode_error, encode_failure, host_port, Store, FAILED_KEY, TORCH_MAX_VALUE};
use super::{later, MAX_GATHER_BYTES, MAX_VALUE_LEN};

// A sealed contribution always fits in a value of torch's store.
const _: () = assert!(MAX_VALUE_LEN + SEAL_OVERHEAD <= TORCH_MAX_VALUE);

/// Requests may run this long past the end of the wait they serve, so that a wait that times
/// out can still name what it missed.
pub(crate) const REQUEST_SLACK: Duration = Duration::from_secs(1);
/// First and longest pause between two looks at the keys of a round.
const POLL_START: Duration = Duration::from_micros(200);
const POLL_MAX: Duration = Duration::from_millis(10);

/// The rounds of one [`super::Rendezvous`] through a store.
///
/// Rounds: `hello` (every rank's fresh nonce and world size), `confirm` (a value sealed under
/// the session id that the nonces give, so that a rank goes on only once every rank has seen
/// the same hellos: a hello recorded in an earlier launch cannot pass), then the all-gather
/// rounds 0, 1, ... Each rank writes its value, then adds one to the round's counter; a rank
/// waits by reading that one counter (not every key, which would load the store with
/// world x world key lookups) and checks the keys once it is full.
pub(crate) struct Session {
    store: Store,
    /// gpucast's own store, which keeps the job's failure itself.
    own: bool,
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
    /// A genuine abort seen during the first round, reported if that round times out.
    early_abort: Option<RendezvousError>,
    /// Whether an abort that failed authentication was seen (reported once).
    forged_abort: bool,
    /// The next all-gather round.
    next_round: u64,
}

/// Bytes of a first-round value: the nonce and the world size.
const HELLO_PLAIN: usize = 32 + 8;
/// Ranks an abort lists at most.
pub(crate) const ABORT_RANKS: usize = 1 << 12;
/// How long a rank waits for the store to accept its abort after a local failure.
pub(crate) const ABORT_TIMEOUT: Duration = Duration::from_millis(500);
/// Longest reason an abort carries.
pub(crate) const ABORT_REASON: usize = 4096;
/// Longest abort (sealed, or the failure gpucast's own store keeps).
const ABORT_MAX: usize = 4 + 32 + 4 + 8 * ABORT_RANKS + ABORT_REASON + 64 + SEAL_OVERHEAD;

/// The first two rounds' numbers: every rank's nonce and world size, then the confirmation
/// of the session id; the all-gather rounds are 0, 1, ..., each round numbered one past the
/// one before it (wrapping).
const HELLO: u64 = u64::MAX - 1;
const CONFIRM: u64 = u64::MAX;

/// A round's name in keys, and what its values are, in errors.
fn round_name(round: u64) -> (String, String) {
    match round {
        HELLO => ("hello".into(), "hello".into()),
        CONFIRM => ("confirm".into(), "confirmation of the session".into()),
        r => (r.to_string(), format!("contribution to round {r}")),
    }
}

impl Session {
    /// Joins the job through the store at `host:port` (gpucast's own, which this rank is
    /// admitted to first, or torchrun's): takes this rendezvous's instance number, then runs
    /// the first two rounds (every rank's nonce and world size, then a confirmation under the
    /// session id), within `deadline`.
    pub(crate) fn join(env: &JobEnv, host: &str, port: u16, deadline: Instant) -> Result<Session> {
        let (prefix, own) = match &env.store {
            StoreKind::Torch { prefix } => (prefix.as_str(), false),
            StoreKind::Own => ("gpucast-own", true),
        };
        // Said by rank 0 only, so once per job.
        let weak = auth::weakness(&env.job_token, env.token_source).filter(|_| env.rank == 0);
        if let Some(reason) = weak {
            let exposure = if own {
                &format!("gpucast's rendezvous store listens on port {port}, which every user of this host (and beyond it, unless on loopback) can reach")
            } else {
                "gpucast's values in torchrun's store, which any process that reaches \
                 MASTER_PORT can read, carry tags made with a key derived from it"
            };
            auth::warn_weak_token(reason, exposure);
        }
        let hard = deadline.checked_add(REQUEST_SLACK).unwrap_or(deadline);
        let key = auth::Key::of(&env.job_token);
        let admission = own.then_some((&key, env.rank, env.world_size));
        let mut store = Store::connect(&host_port(host, port), admission, deadline)?;
        let k = |k: &str| format!("/{prefix}/gpucast/{k}");
        let instance = store.add(&k(&format!("instance/{}", env.rank)), 1, hard)?;
        let bad = format!("the instance counter is {instance}");
        let instance = u64::try_from(instance).map_err(|_| E::protocol(&store.peer, bad))?;
        let mut s = Session {
            store,
            own,
            sealer: Sealer::new(&key, prefix.as_bytes()),
            base: k(&format!("{instance}/")),
            instance,
            rank: env.rank,
            world: env.world_size,
            nonce: auth::random()?,
            session: None,
            early_abort: None,
            forged_abort: false,
            next_round: 0,
        };
        debug!(rank = env.rank, instance, base = %s.base, "rendezvous through a store");
        // The second round: an empty value sealed under the session id, from every rank. A
        // rank that saw other hellos (one recorded in an earlier launch, planted for a rank
        // that never came) has another session id, and its confirmation does not open here.
        let first = s.hello(deadline);
        let first = first.and_then(|()| s.round(CONFIRM, &[], deadline));
        first.inspect_err(|e| s.abort_after(e)).map(|_| s)
    }

    /// What a value of `round` from `rank` is sealed for.
    fn aad(&self, round: u64, rank: usize) -> Vec<u8> {
        let label: &[u8] = match round {
            HELLO => b"gpucast hello",
            CONFIRM => b"gpucast confirm",
            _ => b"gpucast round",
        };
        self.bind(label, &[round, rank as u64])
    }

    /// `label`, the session id once there is one, the instance and `more`.
    fn bind(&self, label: &[u8], more: &[u64]) -> Vec<u8> {
        let mut aad = [label, self.session.as_ref().map_or(&[], |s| &s[..])].concat();
        let nums = [&[self.instance][..], more].concat();
        aad.extend(nums.iter().flat_map(|v| v.to_le_bytes()));
        aad
    }

    /// The key of `round`'s `name`: a rank, or `count` for its counter.
    fn key(&self, round: u64, name: impl std::fmt::Display) -> String {
        format!("{}{}/{name}", self.base, round_name(round).0)
    }

    fn keys(&self, round: u64) -> Vec<String> {
        (0..self.world).map(|r| self.key(round, r)).collect()
    }

    /// The abort key of the first round (bound to its sender's nonce) and of the session; in
    /// gpucast's own store, the failure it keeps.
    fn abort_key(&self) -> String {
        match self.session {
            _ if self.own => FAILED_KEY.to_owned(),
            None => format!("{}abort-hello", self.base),
            Some(_) => format!("{}abort", self.base),
        }
    }

    /// One round: writes this rank's sealed `plain` and counts it in; waits until every rank has
    /// counted itself in and its keys exist, an abort of this session appears, or `deadline`
    /// passes (requests may take a second longer, to name the missing ranks); then reads each
    /// value (at most a contribution's bytes, or, in the first two rounds, whose values are
    /// alike in length on every rank, as many as this rank's; opened at once: a process that
    /// overwrites keys with junk costs no more memory than a real round) and returns them in
    /// rank order. Rank 0 then deletes the round before, which every rank is past.
    fn round(&mut self, round: u64, plain: &[u8], deadline: Instant) -> Result<Vec<Vec<u8>>> {
        // The first two rounds' values have one length on every rank.
        let fixed = round >= HELLO;
        let max = if fixed { plain.len() } else { MAX_VALUE_LEN };
        let hard = deadline.checked_add(REQUEST_SLACK).unwrap_or(deadline);
        let timeout = deadline.saturating_duration_since(Instant::now());
        let (counter, keys) = (self.key(round, "count"), self.keys(round));
        let sealed = self.sealer.seal(&self.aad(round, self.rank), plain);
        self.store.set(&keys[self.rank], &sealed, hard)?;
        self.store.add(&counter, 1, hard)?;
        let abort = vec![self.abort_key()];
        let world = i64::try_from(self.world).unwrap_or(i64::MAX);
        let mut pause = POLL_START;
        loop {
            // An abort seen before the round is full is this round's; once the round is full,
            // an abort (of a rank that saw it full, then failed) is the next one's.
            let aborted = self.store.check(&abort, hard)?;
            // One counter per look; the keys once it says everyone is in (a stranger can
            // raise the counter, never make the keys exist).
            if self.store.add(&counter, 0, hard)? >= world && self.store.check(&keys, hard)? {
                break;
            }
            if aborted {
                self.read_abort(hard)?;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // Every key there though the counter is short (written without being counted:
                // a stranger's, or a rank's that died in between): let the values speak.
                if self.store.check(&keys, hard)? {
                    break;
                }
                // Another rank's abort of the first round says more than the timeout it caused.
                if let Some(failure) = self.early_abort.take().filter(|_| round == HELLO) {
                    return Err(failure);
                }
                // Name the missing ranks, a key each, as far as the second allows.
                let mut missing = Vec::new();
                let in_time = |_: &_| Instant::now() < hard;
                for (r, k) in keys.iter().enumerate().take_while(in_time) {
                    if !self.store.check(std::slice::from_ref(k), hard)? {
                        missing.push(r);
                    }
                }
                return Err(RendezvousError::Timeout {
                    what: format!("every rank's {}", round_name(round).1),
                    timeout,
                    missing,
                });
            }
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(POLL_MAX);
        }
        let (mut out, mut len) = (Vec::with_capacity(self.world), 0usize);
        let what = round_name(round).1;
        for (r, k) in keys.iter().enumerate() {
            let sealed = self.store.get(k, max + SEAL_OVERHEAD, hard)?;
            let Some(value) = self.sealer.open(&self.aad(round, r), &sealed) else {
                let (what, store) = (format!("rank {r}'s {what}"), self.store.peer.clone());
                return Err(RendezvousError::Forged { what, store });
            };
            len += value.len();
            if len > MAX_GATHER_BYTES {
                let (what, max) = (format!("all-gather round {round}"), MAX_GATHER_BYTES);
                return Err(RendezvousError::TooLarge { what, len, max });
            }
            out.push(value);
        }
        if out[self.rank] != plain {
            let detail = format!("another process of the job wrote this rank's {what}");
            let rank = self.rank;
            return Err(RendezvousError::DuplicateRank { rank, detail });
        }
        if self.rank == 0 && round != HELLO {
            let previous = round.wrapping_sub(1);
            let mut old = self.keys(previous);
            old.push(self.key(previous, "count"));
            if let Err(e) = old.iter().try_for_each(|k| self.store.delete(k, hard)) {
                debug!(error = %e, "rendezvous: could not delete a finished key");
            }
        }
        Ok(out)
    }

    /// The first round: every rank's fresh nonce (the session id) and world size.
    fn hello(&mut self, deadline: Instant) -> Result<()> {
        let plain = [&self.nonce[..], &(self.world as u64).to_le_bytes()].concat();
        let hellos = self.round(HELLO, &plain, deadline)?;
        let instance = self.instance.to_le_bytes();
        let mut parts: Vec<&[u8]> = vec![&instance];
        for (r, hello) in hellos.iter().enumerate() {
            let world = hello.get(32..).and_then(|w| w.try_into().ok());
            let world = world.map_or(u64::MAX, u64::from_le_bytes);
            if world != self.world as u64 {
                let client = usize::try_from(world).unwrap_or(usize::MAX);
                return Err(E::world_size_mismatch(r, client, self.world));
            }
            parts.push(&hello[..32]);
        }
        self.session = Some(auth::mac(&[], b"gpucast session", &parts));
        Ok(())
    }

    /// Every rank's contribution to the next round, in rank order. Each call is a round.
    pub(crate) fn all_gather(&mut self, mine: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let round = self.next_round;
        self.next_round += 1;
        if mine.len() > MAX_VALUE_LEN {
            let (what, len, max) = ("all-gather contribution".into(), mine.len(), MAX_VALUE_LEN);
            return Err(RendezvousError::TooLarge { what, len, max });
        }
        self.round(round, mine, later(timeout))
    }

    /// Reads the abort another rank left. In a session, one that opens under the session's
    /// key fails this rank at once. In the first round, one whose sender's nonce matches that
    /// sender's hello is kept, and reported if the round fails: it cannot prove itself of
    /// this launch yet (a hello and an abort recorded together in an earlier launch would pass).
    fn read_abort(&mut self, hard: Instant) -> Result<()> {
        let value = self.store.get(&self.abort_key(), ABORT_MAX, hard)?;
        let malformed = || RendezvousError::protocol(&self.store.peer, "a malformed failure");
        if self.own {
            // gpucast's own store proved the token, and only proven ranks write to it.
            return Err(decode_error(&value).unwrap_or_else(malformed));
        }
        let opened = self.sealer.open(&self.bind(b"gpucast abort", &[]), &value);
        let parsed = opened.and_then(|p| {
            let sender = usize::try_from(u64::from_le_bytes(p.get(..8)?.try_into().ok()?));
            let nonce: [u8; 32] = p.get(8..40)?.try_into().ok()?;
            Some((sender.ok()?, nonce, decode_error(&p[40..])?))
        });
        let Some((sender, nonce, failure)) = parsed else {
            if !std::mem::replace(&mut self.forged_abort, true) {
                warn!(store = %self.store.peer, "rendezvous: ignoring an abort in the store that is not of this job");
            }
            return Ok(());
        };
        if self.session.is_some() {
            return Err(failure);
        }
        // First round: the sender's hello must be there and carry the same nonce.
        let key = vec![self.key(HELLO, sender)];
        if sender < self.world && self.store.check(&key, hard)? {
            let hello = self.store.get(&key[0], HELLO_PLAIN + SEAL_OVERHEAD, hard)?;
            let hello = self.sealer.open(&self.aad(HELLO, sender), &hello);
            if hello.is_some_and(|h| h.len() == HELLO_PLAIN && auth::same_secret(&h[..32], &nonce))
            {
                self.early_abort = Some(failure);
            }
        }
        Ok(())
    }

    /// Fails the job for every rank with reason `why`: in torchrun's store, a sealed value of
    /// this rank, its nonce and the failure; in gpucast's own, the failure the store keeps.
    pub(crate) fn abort(&mut self, why: &str, missing: &[usize], timeout: Duration) -> Result<()> {
        let reason = format!("rank {} aborted: {why}", self.rank);
        let mut value = encode_failure(&reason, missing);
        if !self.own {
            let plain = [&(self.rank as u64).to_le_bytes()[..], &self.nonce, &value].concat();
            value = self.sealer.seal(&self.bind(b"gpucast abort", &[]), &plain);
        }
        self.store.set(&self.abort_key(), &value, later(timeout))
    }

    /// After a local failure, tells the others (best effort), unless the failure came from
    /// them or from the store itself.
    pub(crate) fn abort_after(&mut self, e: &RendezvousError) {
        if matches!(e, E::JobFailed { .. } | E::Io { .. } | E::Protocol { .. }) {
            return;
        }
        if let Err(abort_err) = self.abort(&e.to_string(), e.missing_ranks(), ABORT_TIMEOUT) {
            debug!(rank = self.rank, error = %abort_err, "rendezvous: abort not delivered");
        }
    }
}
