//! gpucast's own store, which rank 0 hosts: admission (a challenge, then a proof of the job
//! token), then the c10d store commands of [`super::store`] for proven ranks only.
//!
//! Admission is built so that nobody outside the job costs the job anything: a connection that
//! has not proven the token may send one HELLO (a fixed 82 bytes) within one deadline for the
//! whole handshake. At most [`MAX_PENDING`] such connections are kept, at most
//! [`ServerOptions::max_pending_per_addr`] of them from one address, and none is closed to make
//! room before it is [`ServerOptions::pending_floor`] old: a newcomer finds room by evicting an
//! older one of its own address, or, when the store is full, of the address that holds the most
//! (when that is at least two more than the newcomer's), else it is turned away with a message
//! that says so. So a flood from other addresses never takes a rank's place, and a rank, once
//! admitted, has the floor's time to prove the token.
//!
//! Only proven ranks make the store hold data, within limits: keys of [`MAX_KEY_LEN`] bytes,
//! values of a sealed contribution, [`CONN_KEYS`] keys and [`CONN_BYTES`] bytes per connection,
//! [`MAX_STORE_BYTES`] in all, CHECKs of at most a key per rank and one more. A proven
//! connection that sends anything else (an unknown command, an oversize key or value, a GET of
//! a missing key, more than its share) is closed, and a rank whose connection closes after it
//! wrote fails the job. The job's failure is a key of the store ([`FAILED_KEY`]): set by the
//! store (a proven claim that two processes of one launch disagree, shutdown, a departed rank)
//! or by a rank that aborts; from then on the store takes no more writes.

use std::collections::{HashMap, VecDeque};
use std::io::ErrorKind::{TimedOut, WouldBlock};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::auth::{self, Purpose, SEAL_OVERHEAD};
use super::error::{RendezvousError, RendezvousError as E, Result};
use super::store::{decode_error, encode_error, encode_failure, kind, message, query};
use super::store::{read_full, FAILED_KEY};
use super::store::{HEADER_LEN, HELLO_LEN, VALIDATION_MAGIC};
use super::{Throttle, MAX_STORE_BYTES, MAX_VALUE_LEN, MAX_WORLD_SIZE};

/// Longest key the store takes.
pub(crate) const MAX_KEY_LEN: usize = 1024;
/// Longest value the store takes: a sealed contribution, with room to spare.
const MAX_SET_VALUE: usize = MAX_VALUE_LEN + SEAL_OVERHEAD + 1024;
/// Most keys one connection may have written and not seen deleted.
pub(crate) const CONN_KEYS: usize = 64;
/// Most bytes those may hold: four of the largest values (a rank has at most three rounds
/// alive, as rank 0 deletes each round once every rank is past it).
pub(crate) const CONN_BYTES: usize = 4 * (MAX_SET_VALUE + MAX_KEY_LEN);
/// Bytes a key costs beyond its name and value.
const ENTRY_BYTES: usize = 64;
/// Longest the accept loop sleeps in `poll` before it looks at the shutdown flag, in ms.
const ACCEPT_POLL_MS: u16 = 20;
/// How long a proven claim of a registered rank waits at most for that rank's earlier
/// connection, which wrote nothing, to be seen closed (else the claim is a duplicate).
const REGISTERED_GONE_WAIT: Duration = Duration::from_secs(1);

/// How long a dropped server waits at most for its members to finish what they were reading.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// Members quiet this long are done with the store.
const QUIET: Duration = Duration::from_millis(100);
/// Most connections kept at once that have not proven the token.
const MAX_PENDING: usize = 1024;
/// Limit for each read and write of a proven rank's request and reply.
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// Settings of a [`StoreServer`].
#[derive(Clone, Debug)]
pub(crate) struct ServerOptions {
    /// Number of ranks in the job.
    pub world_size: usize,
    /// The key of the job token, which every HELLO must prove.
    pub key: auth::Key,
    /// Most connections that have not proven the token kept from one address. Default 128.
    pub max_pending_per_addr: usize,
    /// Age below which a connection that has not proven the token yet is never closed to make
    /// room for a newer one (the newcomer is turned away instead). Default 500 ms.
    pub pending_floor: Duration,
    /// How long a new connection has to complete its HELLO, all of it. Default 10 s.
    pub handshake_timeout: Duration,
}

impl ServerOptions {
    /// Defaults for a job of `world_size` ranks with token `job_token`.
    pub(crate) fn new(world_size: usize, job_token: &str) -> Self {
        Self {
            world_size,
            key: auth::Key::of(job_token),
            max_pending_per_addr: 128,
            pending_floor: Duration::from_millis(500),
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// The rendezvous store: a TCP server that rank 0 runs on background threads.
///
/// Every connection first gets a fresh nonce; its HELLO must carry a proof of the job token
/// over that nonce (so a recorded HELLO is worth nothing) and gets the store's proof back. A
/// wrong proof closes that connection only. Until every rank has joined, a proven HELLO with a
/// wrong world size, a rank out of range or a rank claimed twice *fails the job*; once the job
/// has formed, such a claim is refused and the job goes on.
///
/// Dropping the server fails the job ("shut down"), lets members finish what they read (at most
/// [`SHUTDOWN_GRACE`]), then closes every connection and joins every thread.
pub(crate) struct StoreServer {
    shared: Arc<Shared>,
    accept: Option<JoinHandle<Vec<JoinHandle<()>>>>,
    local_addr: SocketAddr,
}

struct Shared {
    opts: ServerOptions,
    state: Mutex<State>,
    cond: Condvar,
    /// Logging of strangers' failed proofs and late claims, and of connections turned away.
    refused: Throttle,
    crowded: Throttle,
}

/// A connection that has not proven the token yet.
struct Pending {
    id: u64,
    ip: IpAddr,
    accepted: Instant,
}

struct Member {
    conn: u64,
    peer: SocketAddr,
    /// Whether it has written to the store (then it may not come again).
    wrote: bool,
}

#[derive(Default)]
struct State {
    registered: Vec<Option<Member>>,
    /// Ranks that have learned of the failure (or can no longer be told: disconnected).
    told: Vec<bool>,
    /// Why the job failed, if it has, and the ranks it names as missing: the value of
    /// [`FAILED_KEY`].
    failure: Option<Vec<u8>>,
    /// The keys: value, and the connection that wrote it.
    keys: HashMap<Vec<u8>, (Vec<u8>, u64)>,
    /// Bytes held in `keys`.
    stored: usize,
    /// Keys and bytes each connection has written and not seen deleted.
    usage: HashMap<u64, (usize, usize)>,
    /// Connections that have not proven the token yet, oldest first.
    pending: VecDeque<Pending>,
    /// Every open connection, pending or proven, by id: a handle to close it by.
    conns: HashMap<u64, TcpStream>,
    /// Connections in the middle of a request, and when the last one started.
    busy: usize,
    last_request: Option<Instant>,
    /// Set when the server is dropped.
    shutdown: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn entry_bytes(key: &[u8], value: &[u8]) -> usize {
    key.len() + value.len() + ENTRY_BYTES
}

impl State {
    /// Marks the job failed (the first reason wins): its failure becomes the value of
    /// [`FAILED_KEY`], and the store takes no more writes.
    fn fail(&mut self, cond: &Condvar, reason: &str, missing: &[usize], quiet: bool) {
        if self.failure.is_none() {
            if quiet {
                debug!(%reason, "rendezvous job ended");
            } else {
                warn!(%reason, "rendezvous job failed");
            }
            let value = encode_failure(reason, missing);
            self.stored += entry_bytes(FAILED_KEY.as_bytes(), &value);
            self.failure = Some(value.clone());
            self.keys.insert(FAILED_KEY.into(), (value, u64::MAX));
        }
        cond.notify_all();
    }

    /// Stores `value` under `key` for connection `by`, within its share and the store's; its
    /// rank has then written to the store, and may not come again.
    fn put(&mut self, by: &Conn, key: Vec<u8>, value: Vec<u8>) -> Result<(), String> {
        if let Some(Some(m)) = by.rank.map(|r| &mut self.registered[r]) {
            m.wrote |= m.conn == by.id;
        }
        self.remove(&key);
        let bytes = entry_bytes(&key, &value);
        let (keys, held) = self.usage.get(&by.id).copied().unwrap_or_default();
        if keys >= CONN_KEYS || held + bytes > CONN_BYTES || self.stored + bytes > MAX_STORE_BYTES {
            return Err(format!(
                "over its share ({CONN_KEYS} keys, {CONN_BYTES} bytes) or the store's"
            ));
        }
        self.usage.insert(by.id, (keys + 1, held + bytes));
        self.stored += bytes;
        self.keys.insert(key, (value, by.id));
        Ok(())
    }

    /// Deletes `key`, returning it to the share of the connection that wrote it.
    fn remove(&mut self, key: &[u8]) -> bool {
        let Some((value, owner)) = self.keys.remove(key) else {
            return false;
        };
        let bytes = entry_bytes(key, &value);
        self.stored -= bytes;
        if let Some((keys, held)) = self.usage.get_mut(&owner) {
            *keys -= 1;
            *held -= bytes;
        }
        true
    }

    /// Makes room for one more pending connection from `ip` at `now`: nothing to do below the
    /// limits; else the oldest of `ip`'s own connections at its address's limit, or, the store
    /// being full, the oldest of the address holding the most when that is at least two more
    /// than `ip` holds, is closed (with a message that says why), provided it is
    /// [`ServerOptions::pending_floor`] old. Otherwise the reason the newcomer is turned away.
    fn make_room(&mut self, opts: &ServerOptions, ip: IpAddr, now: Instant) -> Result<(), String> {
        let mine = self.pending.iter().filter(|p| p.ip == ip).count();
        let held = self.pending.len();
        let (from, why) = if mine >= opts.max_pending_per_addr {
            let why = format!("{mine} connections from {ip} have not proven the job token yet");
            (ip, why)
        } else if held >= MAX_PENDING {
            let why =
                format!("{held} connections that have not proven the job token fill the store");
            let mut per_addr: HashMap<IpAddr, usize> = HashMap::new();
            for p in &self.pending {
                *per_addr.entry(p.ip).or_default() += 1;
            }
            match per_addr.into_iter().max_by_key(|(_, n)| *n) {
                Some((most, n)) if n > mine + 1 => (most, why),
                _ => return Err(why),
            }
        } else {
            return Ok(());
        };
        let floor = opts.pending_floor;
        let old_enough =
            |p: &Pending| p.ip == from && now.saturating_duration_since(p.accepted) >= floor;
        let old = self.pending.iter().position(old_enough);
        let Some(old) = old.and_then(|at| self.pending.remove(at)) else {
            return Err(format!("{why}, none of them {floor:?} old"));
        };
        if let Some(stream) = self.conns.get(&old.id) {
            tell_crowded(stream, &format!("{why}; this one was the oldest"));
            let _ = stream.shutdown(Shutdown::Both);
        }
        Ok(())
    }
}

impl StoreServer {
    /// Listens on `addr` (port 0 picks a free port; see [`StoreServer::local_addr`]) and serves
    /// on background threads until dropped.
    ///
    /// Errors: [`RendezvousError::PortInUse`] naming the address when another socket holds the
    /// port, [`RendezvousError::Bind`] for other OS errors, and
    /// [`RendezvousError::InvalidArgument`] for a world size outside 1..=[`MAX_WORLD_SIZE`] or
    /// no room for a pending connection.
    pub(crate) fn bind(addr: SocketAddr, opts: ServerOptions) -> Result<Self> {
        let n = opts.world_size;
        if n == 0 || n > MAX_WORLD_SIZE || opts.max_pending_per_addr == 0 {
            let reason =
                format!("world size {n} is not in 1..={MAX_WORLD_SIZE}, or no connection may wait");
            return Err(RendezvousError::InvalidArgument(reason));
        }
        let bind_err = |source: io::Error| match source.kind() {
            io::ErrorKind::AddrInUse => RendezvousError::PortInUse(addr),
            _ => RendezvousError::Bind { addr, source },
        };
        let listener = TcpListener::bind(addr).map_err(bind_err)?;
        // The longest accept queue the system allows (std asks for 128): a burst of strangers
        // must not fill the queue that a rank's connection waits in.
        if let Err(e) = nix::sys::socket::listen(&listener, nix::sys::socket::Backlog::MAXCONN) {
            debug!(error = %e, "rendezvous store: keeping the default accept queue");
        }
        let local_addr = listener.local_addr().map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let mut state = State::default();
        state.registered.resize_with(n, || None);
        state.told.resize(n, false);
        let shared = Arc::new(Shared {
            opts,
            state: Mutex::new(state),
            cond: Condvar::new(),
            refused: Throttle::default(),
            crowded: Throttle::default(),
        });
        let for_thread = Arc::clone(&shared);
        let accept = thread::Builder::new()
            .name("gpucast-store-accept".into())
            .spawn(move || accept_loop(&for_thread, &listener))
            .map_err(bind_err)?;
        info!(%local_addr, world_size = n, "rendezvous store listening");
        Ok(Self {
            shared,
            accept: Some(accept),
            local_addr,
        })
    }

    /// The address the server listens on.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The reason the job failed, if it has.
    #[cfg(test)]
    pub(crate) fn failure(&self) -> Option<String> {
        let failure = self.shared.lock().failure.clone();
        failure
            .and_then(|f| decode_error(&f))
            .map(|e| e.to_string())
    }

    /// Marks the job failed (the first failure's reason is kept): every rank that looks learns
    /// [`RendezvousError::JobFailed`]. Then keeps serving until every other rank has been told
    /// (or has disconnected) or `deadline` passes, so that ranks still connecting learn the
    /// reason instead of retrying a closed port until their timeout. Rank 0 is this process,
    /// which knows.
    pub(crate) fn fail(&self, reason: &str, missing: &[usize], deadline: Instant) {
        let mut st = self.shared.lock();
        st.fail(&self.shared.cond, reason, missing, false);
        st.told[0] = true;
        let left = deadline.saturating_duration_since(Instant::now());
        let untold = |st: &mut State| st.told.contains(&false);
        let waited = self.shared.cond.wait_timeout_while(st, left, untold);
        if waited.map_or(true, |(_, w)| w.timed_out()) {
            debug!("rendezvous store closing before every rank learned of the failure");
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        let accept = self.accept.take().map(JoinHandle::join);
        let grace_end = super::later(SHUTDOWN_GRACE);
        let mut st = self.shared.lock();
        let missing = (0..st.told.len()).filter(|&r| st.registered[r].is_none());
        let missing: Vec<usize> = missing.collect();
        let reason = "the store on rank 0 shut down";
        st.fail(&self.shared.cond, reason, &missing, true);
        // Members that still read (the last round's values) finish first.
        while st.busy > 0 || st.last_request.is_some_and(|t| t.elapsed() < QUIET) {
            let left = grace_end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let waited = self.shared.cond.wait_timeout(st, left.min(QUIET));
            st = waited.unwrap_or_else(PoisonError::into_inner).0;
        }
        for stream in st.conns.values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        drop(st);
        for h in accept.into_iter().flatten().flatten() {
            let _ = h.join();
        }
        debug!(addr = %self.local_addr, "rendezvous store stopped");
    }
}

/// Tells a connection that has not proven the token, without waiting, why the store closes it
/// (unproven: the client takes it as a reason to try again, and names it if its time runs out).
fn tell_crowded(stream: &TcpStream, reason: &str) {
    use nix::sys::socket::{send, MsgFlags};
    let m = message(kind::CROWDED, reason.as_bytes());
    let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
    let _ = send(stream.as_raw_fd(), &m, flags);
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) -> Vec<JoinHandle<()>> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut handles: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id = 0u64;
    while !shared.lock().shutdown {
        let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        let _ = poll(&mut fds, PollTimeout::from(ACCEPT_POLL_MS));
        let (stream, peer) = match listener.accept() {
            Ok(conn) => conn,
            Err(e) if e.kind() == WouldBlock => continue,
            Err(e) => {
                // Out of file descriptors and the like: wait, do not spin.
                warn!(error = %e, "rendezvous store: accept failed");
                thread::sleep(Duration::from_millis(ACCEPT_POLL_MS.into()));
                continue;
            }
        };
        let accepted = Instant::now();
        handles.retain(|h| !h.is_finished());
        let blocking = stream.set_nonblocking(false);
        let Ok(clone) = blocking.and_then(|()| stream.try_clone()) else {
            continue;
        };
        let (id, ip) = (next_id, peer.ip());
        next_id += 1;
        let mut st = shared.lock();
        if let Err(reason) = st.make_room(&shared.opts, ip, accepted) {
            drop(st);
            if let Some(before) = shared.crowded.allow() {
                warn!(%peer, %reason, before, "rendezvous store: turned a connection away");
            }
            tell_crowded(&stream, &reason);
            continue;
        }
        st.pending.push_back(Pending { id, ip, accepted });
        st.conns.insert(id, clone);
        drop(st);
        let mut conn = Conn {
            shared: Arc::clone(shared),
            stream,
            peer,
            id,
            rank: None,
        };
        let spawned = thread::Builder::new()
            .name("gpucast-store-conn".into())
            .stack_size(256 * 1024)
            .spawn(move || conn.serve(accepted).unwrap_or_default());
        if let Err(e) = spawned.map(|h| handles.push(h)) {
            warn!(%peer, error = %e, "rendezvous store: cannot start a connection thread");
        }
    }
    handles
}

/// Whether the peer of `stream` has closed it (or it broke), looked at without blocking and
/// without taking any byte from whoever reads it.
fn closed(stream: &TcpStream) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    // The peer's end shows as RDHUP even before the server has read what it sent last (a
    // client closes right after its VALIDATE, which has no answer): a peek sees that data.
    let rdhup = PollFlags::from_bits_retain(nix::libc::POLLRDHUP);
    let ended = rdhup | PollFlags::POLLHUP | PollFlags::POLLERR;
    let mut fds = [PollFd::new(stream.as_fd(), ended)];
    let polled = poll(&mut fds, PollTimeout::ZERO).is_ok();
    polled && fds[0].revents().is_some_and(|r| r.intersects(ended))
}

/// One connection, served on its own thread.
struct Conn {
    shared: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    id: u64,
    rank: Option<usize>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.pending.retain(|p| p.id != self.id);
        st.conns.remove(&self.id);
        st.usage.remove(&self.id);
        let Some(r) = self.rank else { return };
        let wrote = match &st.registered[r] {
            Some(m) if m.conn == self.id => m.wrote,
            _ => return,
        };
        st.told[r] = true;
        if wrote {
            let reason = format!("rank {r} closed its connection to the store");
            st.fail(&self.shared.cond, &reason, &[r], true);
        }
        self.shared.cond.notify_all();
    }
}

impl Conn {
    /// Serves the connection until it closes or breaks the rules.
    fn serve(&mut self, accepted: Instant) -> Option<()> {
        let _ = self.stream.set_nodelay(true);
        self.handshake(accepted)?;
        let _ = self.stream.set_write_timeout(Some(IO_TIMEOUT));
        let _ = self.stream.set_read_timeout(Some(IO_TIMEOUT));
        loop {
            let mut q = [0u8; 1];
            match (&self.stream).read(&mut q).map_err(|e| e.kind()) {
                Ok(1) => {}
                Err(WouldBlock | TimedOut) if !self.shared.lock().shutdown => continue,
                _ => return None,
            }
            self.shared.lock().busy += 1;
            self.shared.lock().last_request = Some(Instant::now());
            let served = self.request(q[0]);
            self.shared.lock().busy -= 1;
            self.shared.cond.notify_all();
            if let Err(reason) = served {
                if !self.shared.lock().shutdown {
                    warn!(peer = %self.peer, rank = ?self.rank, %reason, "rendezvous store: closing a rank's connection");
                }
                return None;
            }
        }
    }

    /// Sends the admission message of kind `k` with `body`.
    fn tell(&self, k: u8, body: &[u8]) -> Option<()> {
        (&self.stream).write_all(&message(k, body)).ok()
    }

    /// The challenge, the HELLO and its proof, admission and the store's proof back, all
    /// within the handshake timeout from accept (a proven claim of a registered rank may wait
    /// [`REGISTERED_GONE_WAIT`] more). Some once this connection is a rank's.
    fn handshake(&mut self, accepted: Instant) -> Option<()> {
        let shared = Arc::clone(&self.shared);
        let opts = &shared.opts;
        let hello_by = accepted + opts.handshake_timeout;
        let left = hello_by.saturating_duration_since(Instant::now());
        let left = Some(left.max(Duration::from_millis(1)));
        let _ = self.stream.set_write_timeout(left);
        let server_nonce = auth::random::<{ auth::NONCE_LEN }>().ok()?;
        self.tell(kind::CHALLENGE, &server_nonce)?;
        // Nothing but one HELLO is read from a connection that has not proven the token, all
        // of it by one deadline however it dribbles in.
        let (mut header, mut body) = ([0u8; HEADER_LEN], [0u8; HELLO_LEN]);
        let expected = &message(kind::HELLO, &body)[..HEADER_LEN];
        let read = |buf: &mut [u8]| read_full(&self.stream, buf, hello_by).is_ok();
        if !(read(&mut header) && header == expected && read(&mut body)) {
            debug!(peer = %self.peer, "rendezvous store: no HELLO in time, closing");
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(body[i..i + 4].try_into().unwrap_or_default());
        let (rank, world_size) = (u32_at(0), u32_at(4));
        let claim = [&server_nonce[..], &body[8..40], &body[..8]];
        let proof = |purpose, extra: &[u8]| opts.key.prove(purpose, &claim, extra);
        if !auth::same_secret(&proof(Purpose::Hello, b""), &body[40..]) {
            if let Some(before) = shared.refused.allow() {
                warn!(peer = %self.peer, rank, before, "rendezvous store: refused a connection that did not prove the job token");
            }
            return self.tell(kind::TOKEN_REFUSED, &[]).and(None);
        }
        match self.admit(rank as usize, world_size as usize) {
            Ok(()) => self.tell(kind::WELCOME, &proof(Purpose::Welcome, b"")),
            Err(Some(e)) => {
                // Proven, so that the rank can believe it (and nothing else can pass for it).
                let mut refusal = encode_error(&e);
                refusal.extend_from_slice(&proof(Purpose::Refusal, &refusal));
                self.tell(kind::REFUSED, &refusal).and(None)
            }
            // Evicted: closed without an answer.
            Err(None) => None,
        }
    }

    /// Registers a proven HELLO's rank, or refuses it with an error to send with the store's
    /// proof (failing the job when two processes of one launch disagree before the job has
    /// formed), or with none: then the connection is closed without an answer.
    fn admit(&mut self, rank: usize, world_size: usize) -> Result<(), Option<RendezvousError>> {
        let n = self.shared.opts.world_size;
        let mut st = self.shared.lock();
        // A rank whose earlier connection is gone, before it wrote anything, may come again:
        // its welcome may never have reached it. Its end can reach the store after the new
        // connection's HELLO (on a loaded host), so it is waited for, briefly.
        let gone_by = Instant::now() + REGISTERED_GONE_WAIT;
        while let Some(Some(old @ Member { wrote: false, .. })) = st.registered.get(rank) {
            if st.conns.get(&old.conn).is_none_or(closed) {
                st.registered[rank] = None;
                st.told[rank] = false;
                break;
            }
            let left = gone_by.saturating_duration_since(Instant::now());
            if left.is_zero() || st.shutdown {
                break;
            }
            let pause = left.min(Duration::from_millis(10));
            let waited = self.shared.cond.wait_timeout(st, pause);
            st = waited.unwrap_or_else(PoisonError::into_inner).0;
        }
        // Evicted while its HELLO was on the way: the connection is closed, so it must not
        // take a rank (its welcome could not be delivered). The client reconnects.
        let Some(at) = st.pending.iter().position(|p| p.id == self.id) else {
            return Err(None);
        };
        // The claimed rank learns of a failure through this reply, unless another connection
        // holds that rank (then that one still has to be told).
        let claims_free_rank = rank < n && st.registered[rank].is_none();
        let refusal = if let Some(failed) = st.failure.as_deref().and_then(decode_error) {
            failed
        } else if world_size != n {
            RendezvousError::world_size_mismatch(rank, world_size, n)
        } else if rank >= n {
            RendezvousError::RankOutOfRange { rank, world_size }
        } else if let Some(first) = &st.registered[rank] {
            let (first, then) = (first.peer, self.peer);
            let detail = format!("{first} registered it first, then {then} claimed it too");
            RendezvousError::DuplicateRank { rank, detail }
        } else {
            let (conn, peer, wrote) = (self.id, self.peer, false);
            st.registered[rank] = Some(Member { conn, peer, wrote });
            st.pending.remove(at);
            self.rank = Some(rank);
            self.shared.cond.notify_all();
            return Ok(());
        };
        if st.failure.is_none() && st.registered.iter().all(Option::is_some) {
            // The job has formed: a late or stray claim costs it nothing.
            if let Some(before) = self.shared.refused.allow() {
                warn!(peer = %self.peer, reason = %refusal, before, "rendezvous store: refused a claim after the job formed");
            }
            let reason = format!("every rank of the job has joined already: {refusal}");
            return Err(Some(RendezvousError::Rejected(reason)));
        }
        if claims_free_rank {
            st.told[rank] = true;
        }
        st.fail(&self.shared.cond, &refusal.to_string(), &[], false);
        Err(Some(refusal))
    }

    /// `N` bytes of the request.
    fn read<const N: usize>(&self) -> Result<[u8; N], String> {
        let mut b = [0u8; N];
        let read = (&self.stream).read_exact(&mut b);
        read.map(|()| b).map_err(|e| e.to_string())
    }

    /// A u64 length and that many bytes, refused beyond `max` before any memory is taken.
    fn read_bytes(&self, max: usize) -> Result<Vec<u8>, String> {
        let len = u64::from_le_bytes(self.read()?);
        if len > max as u64 {
            let over = format!("a key or value of {len} bytes, over the limit of {max}");
            return Err(over);
        }
        let mut v = Vec::new();
        match (&self.stream).take(len).read_to_end(&mut v) {
            Ok(n) if n as u64 == len => Ok(v),
            Ok(_) => Err("the connection closed in the middle of a request".into()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Serves one c10d request of query type `q` from a proven rank; an error closes the
    /// connection.
    fn request(&mut self, q: u8) -> Result<(), String> {
        let reply = match q {
            query::VALIDATE => {
                let right = u32::from_le_bytes(self.read()?) == VALIDATION_MAGIC;
                return right
                    .then_some(())
                    .ok_or("a VALIDATE with the wrong magic".into());
            }
            query::SET => {
                let key = self.read_bytes(MAX_KEY_LEN)?;
                let value = self.read_bytes(MAX_SET_VALUE)?;
                let mut st = self.shared.lock();
                if key == FAILED_KEY.as_bytes() {
                    let Some(E::JobFailed { reason, missing }) = decode_error(&value) else {
                        return Err("a malformed abort".into());
                    };
                    self.told(&mut st);
                    st.fail(&self.shared.cond, &reason, &missing, false);
                } else if st.failure.is_none() {
                    st.put(self, key, value)?;
                }
                return Ok(());
            }
            query::GET => {
                let key = self.read_bytes(MAX_KEY_LEN)?;
                let mut st = self.shared.lock();
                if key == FAILED_KEY.as_bytes() {
                    self.told(&mut st);
                }
                let value = st.keys.get(&key).map(|(v, _)| v);
                let value = value.ok_or("a GET of a key that does not exist")?;
                [&(value.len() as u64).to_le_bytes()[..], value].concat()
            }
            query::ADD => {
                let key = self.read_bytes(MAX_KEY_LEN)?;
                let delta = i64::from_le_bytes(self.read()?);
                let mut st = self.shared.lock();
                let parse = |(v, _): &(Vec<u8>, u64)| std::str::from_utf8(v).ok()?.parse().ok();
                let now = st.keys.get(&key).map_or(Some(0), parse);
                let sum = now.and_then(|n: i64| n.checked_add(delta));
                let sum = sum.ok_or("a bad ADD")?;
                if delta != 0 && st.failure.is_none() {
                    st.put(self, key, sum.to_string().into_bytes())?;
                }
                sum.to_le_bytes().to_vec()
            }
            query::CHECK => {
                let count = u64::from_le_bytes(self.read()?);
                if count > self.shared.opts.world_size as u64 + 1 {
                    return Err(format!("a CHECK of {count} keys"));
                }
                let mut all = true;
                for _ in 0..count {
                    let key = self.read_bytes(MAX_KEY_LEN)?;
                    all &= self.shared.lock().keys.contains_key(&key);
                }
                vec![u8::from(!all)]
            }
            query::DELETE_KEY => {
                let key = self.read_bytes(MAX_KEY_LEN)?;
                let gone = key != FAILED_KEY.as_bytes() && self.shared.lock().remove(&key);
                i64::from(gone).to_le_bytes().to_vec()
            }
            _ => return Err(format!("query type {q}, which this store does not serve")),
        };
        (&self.stream).write_all(&reply).map_err(|e| e.to_string())
    }

    /// Records that this rank has learned of the job's failure.
    fn told(&self, st: &mut State) {
        if let Some(t) = self.rank.and_then(|r| st.told.get_mut(r)) {
            *t = true;
        }
        self.shared.cond.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::JobEnv;
    use crate::session::Session;
    use crate::store::Store;
    use std::sync::atomic::{AtomicBool, Ordering};

    // Generous: a loaded host (CI, a flood test) can take seconds for a join that takes
    // milliseconds alone; tests that expect a failure do not wait for it.
    const T: Duration = Duration::from_secs(10);
    const TOKEN: &str = "a token for the unit tests of the store";

    fn server(world_size: usize) -> StoreServer {
        bind(ServerOptions::new(world_size, TOKEN))
    }

    fn bind(opts: ServerOptions) -> StoreServer {
        StoreServer::bind("127.0.0.1:0".parse().unwrap(), opts).unwrap()
    }

    /// An admitted c10d connection of `rank`, or why not.
    fn try_member(
        s: &StoreServer,
        rank: usize,
        world: usize,
        token: &str,
        t: Duration,
    ) -> Result<Store> {
        let key = auth::Key::of(token);
        let admission = (&key, rank, world);
        let addr = s.local_addr().to_string();
        Store::connect(&addr, Some(admission), Instant::now() + t)
    }

    fn member(s: &StoreServer, rank: usize, world: usize) -> Store {
        try_member(s, rank, world, TOKEN, T).unwrap()
    }

    fn env(s: &StoreServer, rank: usize, world: usize) -> JobEnv {
        let mut env = JobEnv::single_node(rank, world, s.local_addr().port()).unwrap();
        env.job_token = TOKEN.into();
        env
    }

    /// Every rank of `world` joins on a thread of its own and runs `f` with its session.
    fn ranks<R: Send + 'static>(
        s: &StoreServer,
        world: usize,
        f: impl Fn(usize, Session) -> R + Send + Sync + Copy + 'static,
    ) -> Vec<R> {
        let envs: Vec<JobEnv> = (0..world).map(|r| env(s, r, world)).collect();
        let threads: Vec<_> = envs
            .into_iter()
            .map(|e| {
                thread::spawn(move || {
                    let session =
                        Session::join(&e, "127.0.0.1", e.master_port, Instant::now() + T).unwrap();
                    f(e.rank, session)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    fn reads_eof(stream: &TcpStream, within: Duration) -> bool {
        stream.set_read_timeout(Some(within)).unwrap();
        let mut buf = [0u8; 4096];
        loop {
            match (&*stream).read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) => return e.kind() == io::ErrorKind::ConnectionReset,
            }
        }
    }

    #[test]
    fn rounds_between_threads_leave_the_store_bounded() {
        let s = server(3);
        let all = ranks(&s, 3, |rank, mut session| {
            (0..5u8)
                .map(|round| {
                    session
                        .all_gather(&[u8::try_from(rank).unwrap(), round], T)
                        .unwrap()
                })
                .collect::<Vec<_>>()
        });
        for got in all {
            assert_eq!(got[4], [vec![0, 4], vec![1, 4], vec![2, 4]]);
        }
        // Rank 0 deleted every round but the last ones: a few keys per rank remain.
        let st = s.shared.lock();
        assert!(st.keys.len() <= 3 * 4 + 1, "{} keys left", st.keys.len());
    }

    #[test]
    fn a_rank_that_leaves_after_writing_fails_the_job_for_the_others() {
        let s = server(3);
        let port = s.local_addr().port();
        let results = ranks(&s, 3, move |rank, mut session| {
            if rank == 1 {
                return None;
            }
            thread::sleep(Duration::from_millis(100));
            let started = Instant::now();
            let e = session.all_gather(b"x", T).unwrap_err();
            Some((e, started.elapsed(), port))
        });
        for (e, took, _) in results.into_iter().flatten() {
            assert!(took < Duration::from_secs(1), "failed after {took:?}");
            assert!(
                e.to_string().contains("rank 1 closed its connection"),
                "{e}"
            );
            assert_eq!(e.missing_ranks(), [1]);
        }
    }

    #[test]
    fn a_wrong_token_is_refused_without_failing_the_job() {
        let s = server(1);
        match try_member(&s, 0, 1, "other-job", Duration::from_millis(300)) {
            Err(e @ RendezvousError::JobTokenMismatch { .. }) => {
                assert!(!format!("{e} {e:?}").contains(TOKEN), "{e:?}");
            }
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("admitted with another token"),
        }
        let st = s.shared.lock();
        assert!(st.failure.is_none() && st.registered[0].is_none());
        drop(st);
        let _rank0 = member(&s, 0, 1);
        assert!(!format!("{:?}", s.shared.opts).contains(TOKEN));
    }

    /// A process on a port of its own that challenges one client like a store, reads its
    /// HELLO, then `answers` (without knowing the token).
    fn fake_store(answer: impl FnOnce(&mut TcpStream) + Send + 'static) -> (u16, JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let fake = thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(&message(kind::CHALLENGE, &[3u8; auth::NONCE_LEN]))
                .unwrap();
            let mut hello = [0u8; HEADER_LEN + HELLO_LEN];
            s.read_exact(&mut hello).unwrap();
            answer(&mut s);
            thread::sleep(Duration::from_millis(500));
        });
        (port, fake)
    }

    fn client_of(port: u16, t: Duration) -> Result<Store> {
        let key = auth::Key::of(TOKEN);
        let admission = (&key, 0, 2);
        Store::connect(
            &format!("127.0.0.1:{port}"),
            Some(admission),
            Instant::now() + t,
        )
    }

    /// A store that answers a HELLO without knowing the token is found out by the client, and
    /// so is one whose refusal is unproven: whatever holds the port cannot end a rank with an
    /// error of its choosing.
    #[test]
    fn welcomes_and_refusals_count_only_when_proven() {
        let (port, fake) = fake_store(|s| {
            s.write_all(&message(kind::WELCOME, &[0u8; auth::PROOF_LEN]))
                .unwrap();
        });
        let e = client_of(port, Duration::from_millis(300)).err().unwrap();
        assert!(
            matches!(e, RendezvousError::StoreNotAuthentic { .. }),
            "{e:?}"
        );
        fake.join().unwrap();
        let (port, fake) = fake_store(|s| {
            let mut lie = encode_error(&RendezvousError::JobFailed {
                reason: "rank 3 ran out of memory".into(),
                missing: vec![3],
            });
            lie.extend_from_slice(&[0u8; auth::PROOF_LEN]);
            s.write_all(&message(kind::REFUSED, &lie)).unwrap();
        });
        let e = client_of(port, Duration::from_millis(300)).err().unwrap();
        assert!(
            matches!(e, RendezvousError::StoreNotAuthentic { .. }),
            "{e:?}"
        );
        fake.join().unwrap();
        // The real store's refusal is believed: a world size of its own is a typed error.
        let s = server(2);
        let e = try_member(&s, 0, 3, TOKEN, T).err().unwrap();
        assert!(
            matches!(
                e,
                RendezvousError::WorldSizeMismatch {
                    client: 3,
                    server: 2,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    /// A rank whose connection dropped right after its welcome (before it wrote anything)
    /// comes again, and is let in.
    #[test]
    fn a_rank_whose_connection_died_may_come_again() {
        for _ in 0..30 {
            let s = server(2);
            drop(member(&s, 0, 2));
            drop(member(&s, 1, 2));
            let got = ranks(&s, 2, |rank, mut session| {
                session
                    .all_gather(&[u8::try_from(rank).unwrap()], T)
                    .unwrap()
            });
            assert_eq!(got[0], [vec![0], vec![1]]);
        }
    }

    /// Before the store has proven the token, what holds the port can make a rank neither
    /// allocate a large message nor wait past its bound by dribbling one.
    #[test]
    fn an_unproven_store_costs_the_client_little() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let fake = thread::spawn(move || {
            // First client: a header announcing 200 MiB. Then: a message, a byte a second.
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(&message(kind::CHALLENGE, &[])[..6]).unwrap();
            s.write_all(&(200u32 << 20).to_le_bytes()).unwrap();
            let (mut s2, _) = listener.accept().unwrap();
            for b in message(kind::CHALLENGE, &[0; 32]) {
                if s2.write_all(&[b]).is_err() {
                    break;
                }
                thread::sleep(Duration::from_secs(1));
            }
            drop(s);
        });
        let mut probe = Store {
            stream: TcpStream::connect(("127.0.0.1", port)).unwrap(),
            peer: String::new(),
            broken: None,
        };
        let e = probe.admission_message(Instant::now() + T).unwrap_err();
        assert!(e.to_string().contains("limit"), "{e}");
        let started = Instant::now();
        let e = client_of(port, Duration::from_millis(500)).err().unwrap();
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(3),
            "the handshake took {took:?}: {e}"
        );
        fake.join().unwrap();
    }

    /// Whatever holds the port cannot end a rank early with an oversize message either: the
    /// rank tries again until its deadline.
    #[test]
    fn an_oversize_unproven_message_is_tried_again() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let fake = thread::spawn(move || {
            listener.set_nonblocking(true).unwrap();
            let until = Instant::now() + Duration::from_millis(600);
            let mut served = 0;
            while Instant::now() < until {
                if let Ok((mut s, _)) = listener.accept() {
                    let mut m = message(kind::CHALLENGE, &[])[..6].to_vec();
                    m.extend_from_slice(&(200u32 << 20).to_le_bytes());
                    let _ = s.write_all(&m);
                    served += 1;
                }
                thread::sleep(Duration::from_millis(1));
            }
            served
        });
        let started = Instant::now();
        let e = client_of(port, Duration::from_millis(400)).err().unwrap();
        assert!(
            started.elapsed() >= Duration::from_millis(400),
            "gave up after {:?}",
            started.elapsed()
        );
        assert!(
            matches!(&e, RendezvousError::Protocol { reason, .. } if reason.contains("limit")),
            "{e:?}"
        );
        assert!(fake.join().unwrap() > 1, "never tried again");
    }

    #[test]
    fn silent_and_garbage_connections_are_closed() {
        let mut opts = ServerOptions::new(2, TOKEN);
        opts.handshake_timeout = Duration::from_millis(200);
        let s = bind(opts);
        let raw = TcpStream::connect(s.local_addr()).unwrap();
        let started = Instant::now();
        assert!(reads_eof(&raw, T));
        assert!(started.elapsed() < Duration::from_secs(2));
        // Not a HELLO: closed as soon as the header is in, without waiting for more.
        let mut raw = TcpStream::connect(s.local_addr()).unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        assert!(reads_eof(&raw, Duration::from_millis(150)));
        assert!(s.failure().is_none());
    }

    /// A HELLO that starts just before the handshake deadline and dribbles in a byte at a time
    /// is cut off at that deadline, not given a fresh limit from its first byte or per byte.
    #[test]
    fn the_whole_hello_has_one_deadline() {
        let mut opts = ServerOptions::new(2, TOKEN);
        opts.handshake_timeout = Duration::from_millis(400);
        let s = bind(opts);
        let mut raw = TcpStream::connect(s.local_addr()).unwrap();
        let started = Instant::now();
        thread::sleep(Duration::from_millis(300));
        let mut closed = None;
        for b in message(kind::HELLO, &[0u8; HELLO_LEN]) {
            if raw.write_all(&[b]).is_err() {
                closed = Some(started.elapsed());
                break;
            }
            thread::sleep(Duration::from_millis(40));
            let mut probe = [0u8; 256];
            raw.set_nonblocking(true).unwrap();
            // The challenge comes first; a zero-length read is the store hanging up.
            if let Ok(0) = raw.read(&mut probe) {
                closed = Some(started.elapsed());
                break;
            }
            raw.set_nonblocking(false).unwrap();
        }
        let closed = closed.expect("the dribbled HELLO was never cut off");
        assert!(
            closed < Duration::from_millis(600),
            "cut off after {closed:?}"
        );
    }

    /// Beyond an address's quota, a newcomer evicts that address's oldest connection once it
    /// is as old as the floor.
    #[test]
    fn pending_connections_beyond_the_quota_evict_the_oldest_past_the_floor() {
        let mut opts = ServerOptions::new(1, TOKEN);
        opts.max_pending_per_addr = 4;
        opts.pending_floor = Duration::ZERO;
        let s = bind(opts);
        let idle: Vec<TcpStream> = (0..10)
            .map(|_| TcpStream::connect(s.local_addr()).unwrap())
            .collect();
        // The six oldest are closed to make room, the four newest kept.
        let closed: Vec<bool> = idle
            .iter()
            .map(|c| reads_eof(c, Duration::from_millis(300)))
            .collect();
        let oldest_six: Vec<bool> = (0..10).map(|i| i < 6).collect();
        assert_eq!(closed, oldest_six);
        assert!(s.shared.lock().pending.len() <= 4);
        // The rank still gets in.
        let _rank0 = member(&s, 0, 1);
        drop(idle);
    }

    /// A connection younger than the floor is never evicted: the newcomer is turned away
    /// instead, told why, and a rank turned away until its deadline says so.
    #[test]
    fn young_connections_are_kept_and_newcomers_told_why_they_are_turned_away() {
        let mut opts = ServerOptions::new(2, TOKEN);
        opts.max_pending_per_addr = 4;
        opts.pending_floor = Duration::from_secs(30);
        let s = bind(opts);
        let first: Vec<TcpStream> = (0..4)
            .map(|_| TcpStream::connect(s.local_addr()).unwrap())
            .collect();
        let deadline = Instant::now() + T;
        while s.shared.lock().pending.len() < 4 {
            assert!(Instant::now() < deadline, "the first four were not kept");
            thread::sleep(Duration::from_millis(5));
        }
        match try_member(&s, 1, 2, TOKEN, Duration::from_millis(300)) {
            Err(RendezvousError::Crowded { reason, .. }) => {
                assert!(reason.contains("4 connections from 127.0.0.1"), "{reason}");
            }
            other => panic!("{:?}", other.err()),
        }
        let st = s.shared.lock();
        assert_eq!(st.pending.len(), 4);
        drop(st);
        // None was evicted: the first four are still open, each with its challenge and nothing
        // after it.
        for mut old in first {
            old.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            let mut buf = [0u8; 256];
            assert_eq!(old.read(&mut buf).unwrap(), HEADER_LEN + auth::NONCE_LEN);
            assert_eq!(buf[5], kind::CHALLENGE);
            assert!(old.read(&mut buf).is_err(), "closed or answered");
        }
    }

    /// Connections evicted as fast as they come (a quota of one): a rank whose proven HELLO
    /// lands on an evicted connection takes no rank, so its retry joins instead of failing the
    /// job as a duplicate.
    #[test]
    fn a_rank_evicted_during_its_hello_joins_on_its_retry() {
        for trial in 0..40 {
            let mut opts = ServerOptions::new(2, TOKEN);
            opts.max_pending_per_addr = 1;
            opts.pending_floor = Duration::ZERO;
            let s = bind(opts);
            let addr = s.local_addr();
            let stop = Arc::new(AtomicBool::new(false));
            let flood = {
                let stop = Arc::clone(&stop);
                thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let _c = TcpStream::connect(addr);
                        thread::sleep(Duration::from_micros(200));
                    }
                })
            };
            let got = ranks(&s, 2, |rank, mut session| {
                session.all_gather(&[u8::try_from(rank).unwrap()], T)
            });
            stop.store(true, Ordering::Relaxed);
            flood.join().unwrap();
            for r in got {
                assert_eq!(
                    r.unwrap_or_else(|e| panic!("trial {trial}: {e}")),
                    [vec![0], vec![1]]
                );
            }
        }
    }

    /// A proven rank that sends what no rank sends (an unknown command, a key or value over its
    /// limit, a CHECK of more keys than the job has, a GET of a missing key) is closed at once,
    /// before the store reads or allocates what it announced.
    #[test]
    fn a_proven_rank_that_misbehaves_is_closed() {
        let s = server(2);
        let key = |k: &[u8]| {
            let mut b = (k.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(k);
            b
        };
        let mut oversize_value = vec![query::SET];
        oversize_value.extend(key(b"k"));
        oversize_value.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let mut oversize_key = vec![query::GET];
        oversize_key.extend_from_slice(&(MAX_KEY_LEN as u64 + 1).to_le_bytes());
        let mut wide_check = vec![query::CHECK];
        wide_check.extend_from_slice(&4u64.to_le_bytes());
        let mut missing = vec![query::GET];
        missing.extend(key(b"nobody set this"));
        for bad in [
            vec![0x63],
            vec![query::VALIDATE, 1, 2, 3, 4],
            oversize_value,
            oversize_key,
            wide_check,
            missing,
        ] {
            let store = member(&s, 0, 2);
            let started = Instant::now();
            (&store.stream).write_all(&bad).unwrap();
            assert!(
                reads_eof(&store.stream, Duration::from_secs(1)),
                "{bad:?} kept the connection open"
            );
            assert!(started.elapsed() < Duration::from_millis(900), "{bad:?}");
        }
        // It wrote nothing: the job goes on, and the rank may come again.
        assert!(s.failure().is_none());
        let _rank0 = member(&s, 0, 2);
    }

    /// A proven rank gets a bounded share of the store: past it, it is closed (and, having
    /// written, fails the job); what it wrote stays within the share.
    #[test]
    fn a_proven_rank_over_its_share_is_closed() {
        let s = server(2);
        let mut store = member(&s, 0, 2);
        let far = Instant::now() + T;
        for i in 0..CONN_KEYS {
            store.set(&format!("k{i}"), b"v", far).unwrap();
        }
        store.add("counter", 1, far).unwrap_err();
        assert!(reads_eof(&store.stream, T));
        let st = s.shared.lock();
        assert_eq!(st.keys.len(), CONN_KEYS + 1, "its keys and the failure");
        drop(st);
        assert!(s
            .failure()
            .unwrap()
            .contains("rank 0 closed its connection"));
        // Bytes: four of the largest values fit, a fifth does not.
        let s = server(1);
        let mut store = member(&s, 0, 1);
        let big = vec![7u8; MAX_SET_VALUE];
        for i in 0..4 {
            store.set(&format!("big{i}"), &big, far).unwrap();
        }
        store.set("big4", &big, far).unwrap();
        assert!(reads_eof(&store.stream, T));
        assert!(s.shared.lock().stored <= CONN_BYTES + 1024);
    }

    #[test]
    fn oversize_contributions_are_refused_by_the_client() {
        let s = server(1);
        let got = ranks(&s, 1, |_, mut session| {
            let big = vec![0u8; crate::MAX_VALUE_LEN + 1];
            let e = session.all_gather(&big, T).unwrap_err();
            (e, session.all_gather(b"v", T))
        });
        let (e, after) = &got[0];
        assert!(matches!(e, RendezvousError::TooLarge { .. }), "{e:?}");
        assert_eq!(after.as_ref().unwrap(), &[b"v".to_vec()]);
    }

    #[test]
    fn dropping_the_server_tells_waiters_and_joins_its_threads() {
        let s = server(2);
        let e0 = env(&s, 0, 2);
        let e1 = env(&s, 1, 2);
        let joining = thread::spawn(move || {
            Session::join(&e1, "127.0.0.1", e1.master_port, Instant::now() + T).unwrap()
        });
        let mut rank0 =
            Session::join(&e0, "127.0.0.1", e0.master_port, Instant::now() + T).unwrap();
        let _rank1 = joining.join().unwrap();
        let waiter = thread::spawn(move || rank0.all_gather(b"x", Duration::from_secs(30)));
        thread::sleep(Duration::from_millis(100));
        let started = Instant::now();
        drop(s);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "drop took {:?}",
            started.elapsed()
        );
        match waiter.join().unwrap() {
            Err(RendezvousError::JobFailed { reason, .. }) => {
                assert!(reason.contains("shut down"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }
}
