//! The store that rank 0 hosts: admission (a challenge, then a proof of the job token), then
//! all-gather rounds and aborts among the job's ranks.
//!
//! Admission is built so that nobody outside the job costs the job anything: a connection that
//! has not proven the token may send one small frame (a HELLO) within one deadline for the
//! whole handshake. At most [`ServerOptions::max_pending`] such connections are kept, at most
//! [`ServerOptions::max_pending_per_addr`] of them from one address, and none is closed to make
//! room before it is [`ServerOptions::pending_floor`] old: a newcomer finds room by evicting an
//! older one of its own address, or, when the store is full, of the address that holds the most
//! (when that is at least two more than the newcomer's), else it is turned away with an error
//! that says so. So a flood from other addresses never takes a rank's place, and a rank, once
//! admitted, has the floor's time to prove the token. Only proven ranks can make the store hold
//! data, in rounds that each rank takes in order, so at most two rounds are ever alive.

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufWriter};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::auth::{self, Handshake, Purpose};
use super::error::{rank_list, RendezvousError, Result};
use super::wire::{self, op, Frame, FrameError, FrameTimes, Request};
use super::wire::{HELLO_LEN, MAX_REQUEST_PAYLOAD};
use super::{
    Throttle, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_IO_TIMEOUT, DEFAULT_MAX_PENDING,
    DEFAULT_MAX_PENDING_PER_ADDR, DEFAULT_PENDING_FLOOR, MAX_GATHER_BYTES, MAX_STORE_BYTES,
    MAX_TOKEN_LEN, MAX_WORLD_SIZE,
};

/// Longest the accept loop sleeps in `poll` before it looks at the shutdown flag.
const ACCEPT_POLL: Duration = Duration::from_millis(20);
/// How long a dropped server lets replies already decided (a completed round) go out before it
/// closes every connection.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// Stack of a connection thread (they hold little: frames live on the heap).
const CONN_STACK: usize = 256 * 1024;
/// Bytes a round costs beyond its contributions: its bookkeeping, per rank.
const ROUND_BYTES_PER_RANK: usize = 32;

/// Settings of a [`StoreServer`]. Its `Debug` form leaves the token out.
#[derive(Clone)]
pub(crate) struct ServerOptions {
    /// Number of ranks in the job.
    pub world_size: usize,
    /// The job token every HELLO must prove.
    pub job_token: String,
    /// Most connections kept at once that have not proven the token. Default 1024.
    pub max_pending: usize,
    /// Most of them from one address. Default 128.
    pub max_pending_per_addr: usize,
    /// Age below which a connection that has not proven the token yet is never closed to make
    /// room for a newer one (the newcomer is turned away instead). Default 500 ms.
    pub pending_floor: Duration,
    /// How long a new connection has to complete its HELLO, all of it. Default 10 s.
    pub handshake_timeout: Duration,
    /// Limit for reading the rest of a rank's frame once it has started, and for writing a
    /// reply. Default 30 s.
    pub io_timeout: Duration,
}

impl std::fmt::Debug for ServerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerOptions")
            .field("world_size", &self.world_size)
            .field(
                "job_token",
                &format_args!("<{} bytes, not shown>", self.job_token.len()),
            )
            .field("max_pending", &self.max_pending)
            .field("max_pending_per_addr", &self.max_pending_per_addr)
            .field("pending_floor", &self.pending_floor)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("io_timeout", &self.io_timeout)
            .finish()
    }
}

impl ServerOptions {
    /// Defaults for a job of `world_size` ranks with token `job_token`.
    pub(crate) fn new(world_size: usize, job_token: impl Into<String>) -> Self {
        Self {
            world_size,
            job_token: job_token.into(),
            max_pending: DEFAULT_MAX_PENDING,
            max_pending_per_addr: DEFAULT_MAX_PENDING_PER_ADDR,
            pending_floor: DEFAULT_PENDING_FLOOR,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            io_timeout: DEFAULT_IO_TIMEOUT,
        }
    }
}

/// The rendezvous store: a TCP server that rank 0 runs on background threads.
///
/// Every connection first gets a fresh nonce; its HELLO must carry a proof of the job token
/// over that nonce (so a recorded HELLO is worth nothing) and gets the store's proof back. A
/// wrong proof closes that connection only. Until every rank has joined, a proven HELLO with a
/// wrong world size, a rank out of range or a rank claimed twice *fails the job* (two processes
/// of one launch disagree); once the job has formed, such a claim is refused and the job goes
/// on. Any rank can fail the job (ABORT); a rank that gives up waiting, or disconnects before
/// contributing to a round that others wait on, fails it too. A failed job answers every
/// pending and later request with [`RendezvousError::JobFailed`] and frees what it held.
///
/// Dropping the server stops it: no new connections, waiting requests are answered (with
/// their result if it is ready, else with an error), then every connection is closed and every
/// thread joined.
pub(crate) struct StoreServer {
    shared: Arc<Shared>,
    accept: Option<JoinHandle<Vec<JoinHandle<()>>>>,
    local_addr: SocketAddr,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("local_addr", &self.local_addr)
            .field("world_size", &self.shared.opts.world_size)
            .finish_non_exhaustive()
    }
}

struct Shared {
    opts: ServerOptions,
    /// The key derived from the job token.
    key: auth::Key,
    state: Mutex<State>,
    cond: Condvar,
    shutdown: AtomicBool,
    /// Logging of strangers' failed proofs and late claims.
    refused: Throttle,
    /// Logging of connections turned away for want of room.
    crowded: Throttle,
}

#[derive(Clone)]
struct Failure {
    reason: String,
    missing: Vec<usize>,
}

/// A connection that has not proven the token yet.
struct Pending {
    id: u64,
    ip: IpAddr,
    since: Instant,
    /// A handle to close it by.
    stream: TcpStream,
}

struct Member {
    conn: u64,
    peer: SocketAddr,
}

#[derive(Default)]
struct Round {
    values: Vec<Option<Vec<u8>>>,
    count: usize,
    /// Bytes this round holds, bookkeeping included (counted in `State::stored`).
    bytes: usize,
    done: Option<Arc<Vec<Vec<u8>>>>,
    fetched: usize,
}

struct State {
    registered: Vec<Option<Member>>,
    /// Every rank has said hello once.
    complete: bool,
    /// Ranks that have learned of the failure (or can no longer be told: disconnected).
    told: Vec<bool>,
    /// Ranks whose connection closed after HELLO.
    departed: Vec<bool>,
    failure: Option<Failure>,
    /// The round each rank contributes to next: rounds go in order, so at most two are alive.
    next_round: Vec<u64>,
    rounds: HashMap<u64, Round>,
    /// Bytes held in `rounds`.
    stored: usize,
    /// Connections that have not proven the token yet, oldest first.
    pending: VecDeque<Pending>,
    /// How many of them each address holds.
    pending_per_addr: HashMap<IpAddr, usize>,
    /// Connections of proven ranks.
    members: HashMap<u64, TcpStream>,
    /// Pending connections closed to make room for newer ones.
    evicted: u64,
    /// Connections turned away for want of room.
    turned_away: u64,
    /// Connections between reading a request and finishing its reply.
    busy: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait_on<'a>(&self, g: MutexGuard<'a, State>, limit: Duration) -> MutexGuard<'a, State> {
        match self.cond.wait_timeout(g, limit) {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        }
    }

    fn shutting_down(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }
}

impl State {
    /// Marks the job failed (the first reason wins), frees every round (no request can use
    /// them any more) and wakes every waiter.
    fn fail(&mut self, cond: &Condvar, reason: String, missing: Vec<usize>) {
        if self.failure.is_none() {
            warn!(%reason, "rendezvous job failed");
            self.failure = Some(Failure { reason, missing });
        }
        self.rounds.clear();
        self.stored = 0;
        cond.notify_all();
    }

    fn add_pending(&mut self, p: Pending) {
        *self.pending_per_addr.entry(p.ip).or_insert(0) += 1;
        self.pending.push_back(p);
    }

    /// Forgets pending connection `id`, if it is one, and returns it.
    fn remove_pending(&mut self, id: u64) -> Option<Pending> {
        let at = self.pending.iter().position(|p| p.id == id)?;
        let p = self.pending.remove(at)?;
        if let Some(n) = self.pending_per_addr.get_mut(&p.ip) {
            *n -= 1;
            if *n == 0 {
                self.pending_per_addr.remove(&p.ip);
            }
        }
        Some(p)
    }

    /// Makes room for one more pending connection from `ip` at `now`: nothing to do below the
    /// limits; else the oldest of `ip`'s own connections at its address's limit, or, the store
    /// being full, the oldest of the address holding the most when that is at least two more
    /// than `ip` holds, is closed (with an error that says why), provided it is
    /// [`ServerOptions::pending_floor`] old. Otherwise the reason the newcomer is turned away.
    fn make_room(&mut self, opts: &ServerOptions, ip: IpAddr, now: Instant) -> Result<(), String> {
        let mine = self.pending_per_addr.get(&ip).copied().unwrap_or(0);
        let (from, why) = if mine >= opts.max_pending_per_addr {
            (
                ip,
                format!("{mine} connections from {ip} have not proven the job token yet"),
            )
        } else if self.pending.len() >= opts.max_pending {
            let why = format!(
                "{} connections that have not proven the job token fill the store",
                self.pending.len()
            );
            match self.pending_per_addr.iter().max_by_key(|(_, n)| **n) {
                Some((&most, &n)) if n > mine + 1 => (most, why),
                _ => return Err(why),
            }
        } else {
            return Ok(());
        };
        let floor = opts.pending_floor;
        let victim = self
            .pending
            .iter()
            .find(|p| p.ip == from && now.saturating_duration_since(p.since) >= floor)
            .map(|p| p.id);
        let Some(old) = victim.and_then(|id| self.remove_pending(id)) else {
            return Err(format!("{why}, none of them {floor:?} old"));
        };
        tell_crowded(&old.stream, format!("{why}; this one was the oldest"));
        let _ = old.stream.shutdown(Shutdown::Both);
        self.evicted += 1;
        Ok(())
    }

    fn unregistered(&self) -> Vec<usize> {
        (0..self.registered.len())
            .filter(|&r| self.registered[r].is_none())
            .collect()
    }
}

impl StoreServer {
    /// Listens on `addr` (port 0 picks a free port; see [`StoreServer::local_addr`]) and serves
    /// on background threads until dropped.
    ///
    /// Errors: [`RendezvousError::PortInUse`] naming the address when another socket holds the
    /// port, [`RendezvousError::Bind`] for other OS errors, and
    /// [`RendezvousError::InvalidArgument`] for a world size outside 1..=[`MAX_WORLD_SIZE`],
    /// a token over [`MAX_TOKEN_LEN`] bytes or no room for a pending connection.
    pub(crate) fn bind(addr: SocketAddr, options: ServerOptions) -> Result<Self> {
        if options.world_size == 0 || options.world_size > MAX_WORLD_SIZE {
            return Err(RendezvousError::InvalidArgument {
                reason: format!(
                    "world size {} is not in 1..={MAX_WORLD_SIZE}",
                    options.world_size
                ),
            });
        }
        if options.job_token.len() > MAX_TOKEN_LEN {
            return Err(RendezvousError::InvalidArgument {
                reason: format!("job token over {MAX_TOKEN_LEN} bytes"),
            });
        }
        if options.max_pending == 0 || options.max_pending_per_addr == 0 {
            return Err(RendezvousError::InvalidArgument {
                reason: "max_pending and max_pending_per_addr must be at least 1".into(),
            });
        }
        let bind_err = |source: io::Error| {
            if source.kind() == io::ErrorKind::AddrInUse {
                RendezvousError::PortInUse { addr }
            } else {
                RendezvousError::Bind { addr, source }
            }
        };
        // Derived before the port opens (it takes a while on purpose), so that a connection
        // never waits for it.
        let key = auth::Key::of(&options.job_token);
        let listener = TcpListener::bind(addr).map_err(bind_err)?;
        // The longest accept queue the system allows (std asks for 128): a burst of strangers
        // must not fill the queue that a rank's connection waits in.
        if let Err(e) = nix::sys::socket::listen(&listener, nix::sys::socket::Backlog::MAXCONN) {
            debug!(error = %e, "rendezvous store: keeping the default accept queue");
        }
        let local_addr = listener.local_addr().map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let n = options.world_size;
        let shared = Arc::new(Shared {
            key,
            opts: options,
            state: Mutex::new(State {
                registered: (0..n).map(|_| None).collect(),
                complete: false,
                told: vec![false; n],
                departed: vec![false; n],
                failure: None,
                next_round: vec![0; n],
                rounds: HashMap::new(),
                stored: 0,
                pending: VecDeque::new(),
                pending_per_addr: HashMap::new(),
                members: HashMap::new(),
                evicted: 0,
                turned_away: 0,
                busy: 0,
            }),
            cond: Condvar::new(),
            shutdown: AtomicBool::new(false),
            refused: Throttle::new(),
            crowded: Throttle::new(),
        });
        let for_thread = Arc::clone(&shared);
        let accept = thread::Builder::new()
            .name("gpucast-store-accept".into())
            .spawn(move || accept_loop(&for_thread, &listener))
            .map_err(|source| RendezvousError::Bind {
                addr: local_addr,
                source,
            })?;
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

    /// Marks the job failed: every pending and later request of every rank gets
    /// [`RendezvousError::JobFailed`]. The first failure's reason is kept.
    pub(crate) fn fail_with(&self, reason: String, missing: Vec<usize>) {
        self.shared.lock().fail(&self.shared.cond, reason, missing);
    }

    /// Records that `rank` knows of the failure already (the rank that caused it, in this
    /// process), so that lingering waits only for the others.
    pub(crate) fn mark_told(&self, rank: usize) {
        if let Some(t) = self.shared.lock().told.get_mut(rank) {
            *t = true;
        }
    }

    /// The reason the job failed, if it has.
    #[cfg(test)]
    pub(crate) fn failure(&self) -> Option<String> {
        self.shared
            .lock()
            .failure
            .as_ref()
            .map(|f| f.reason.clone())
    }

    /// The ranks that have said HELLO so far.
    #[cfg(test)]
    pub(crate) fn registered_ranks(&self) -> Vec<usize> {
        let st = self.shared.lock();
        (0..st.registered.len())
            .filter(|&r| st.registered[r].is_some())
            .collect()
    }

    /// After a failure: keeps serving until every rank has been told (or has disconnected) or
    /// `deadline` passes, so that ranks still connecting learn the reason instead of retrying
    /// a closed port until their timeout.
    pub(crate) fn linger_until_told(&self, deadline: Instant) {
        let mut st = self.shared.lock();
        if let Some(f) = &st.failure {
            let untold: Vec<usize> = (0..st.told.len()).filter(|&r| !st.told[r]).collect();
            if !untold.is_empty() {
                warn!(
                    reason = %f.reason,
                    untold = %rank_list(&untold),
                    within = ?deadline.saturating_duration_since(Instant::now()),
                    "rendezvous failed; keeping the store up until these ranks have been told"
                );
            }
        }
        loop {
            if st.failure.is_none() || st.told.iter().all(|&t| t) {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let untold: Vec<usize> = (0..st.told.len()).filter(|&r| !st.told[r]).collect();
                debug!(untold = %rank_list(&untold), "store closing before every rank learned of the failure");
                return;
            }
            st = self.shared.wait_on(st, left);
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.cond.notify_all();
        let handles = self
            .accept
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        let grace_end = super::later(SHUTDOWN_GRACE.min(self.shared.opts.io_timeout));
        let mut st = self.shared.lock();
        while st.busy > 0 {
            let left = grace_end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = self.shared.wait_on(st, left);
        }
        for p in &st.pending {
            let _ = p.stream.shutdown(Shutdown::Both);
        }
        for stream in st.members.values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        drop(st);
        for h in handles {
            let _ = h.join();
        }
        debug!(addr = %self.local_addr, "rendezvous store stopped");
    }
}

/// Tells a connection that has not proven the token, without waiting, why the store closes it
/// (an ERROR it cannot prove: the client takes it as a reason to try again, and names it if
/// its time runs out).
fn tell_crowded(stream: &TcpStream, reason: String) {
    use nix::sys::socket::{send, MsgFlags};
    use std::os::fd::AsRawFd;
    let e = RendezvousError::Crowded {
        store: String::new(),
        reason,
    };
    let mut frame = Vec::new();
    if wire::write_frame(&mut frame, op::ERROR, &[&wire::encode_error(&e)]).is_ok() {
        let _ = send(
            stream.as_raw_fd(),
            &frame,
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
        );
    }
}

/// Waits up to [`ACCEPT_POLL`] for a connection to arrive on `listener`.
fn wait_readable(listener: &TcpListener) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
    let ms = u16::try_from(ACCEPT_POLL.as_millis()).unwrap_or(u16::MAX);
    if poll(&mut fds, PollTimeout::from(ms)).is_err() {
        thread::sleep(Duration::from_millis(1));
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) -> Vec<JoinHandle<()>> {
    let mut handles: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id = 0u64;
    while !shared.shutting_down() {
        let (stream, peer) = match listener.accept() {
            Ok(conn) => conn,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                wait_readable(listener);
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Out of file descriptors and the like: wait, do not spin.
                warn!(error = %e, "rendezvous store: accept failed");
                thread::sleep(ACCEPT_POLL * 5);
                continue;
            }
        };
        let accepted = Instant::now();
        handles.retain(|h| !h.is_finished());
        if let Err(e) = stream.set_nonblocking(false) {
            debug!(%peer, error = %e, "rendezvous store: dropping connection");
            continue;
        }
        let Ok(clone) = stream.try_clone() else {
            debug!(%peer, "rendezvous store: dropping connection (no descriptor for it)");
            continue;
        };
        let id = next_id;
        next_id += 1;
        {
            let mut st = shared.lock();
            if let Err(reason) = st.make_room(&shared.opts, peer.ip(), accepted) {
                st.turned_away += 1;
                drop(st);
                if let Some(before) = shared.crowded.allow() {
                    warn!(%peer, %reason, before, "rendezvous store: turned a connection away");
                }
                tell_crowded(&stream, reason);
                continue;
            }
            st.add_pending(Pending {
                id,
                ip: peer.ip(),
                since: accepted,
                stream: clone,
            });
        }
        let for_thread = Arc::clone(shared);
        let spawned = thread::Builder::new()
            .name("gpucast-store-conn".into())
            .stack_size(CONN_STACK)
            .spawn(move || {
                let mut conn = Conn {
                    shared: for_thread,
                    stream,
                    peer,
                    id,
                    accepted,
                    rank: None,
                };
                conn.serve();
            });
        match spawned {
            Ok(h) => handles.push(h),
            Err(e) => {
                warn!(%peer, error = %e, "rendezvous store: cannot start a connection thread");
                shared.lock().remove_pending(id);
            }
        }
    }
    handles
}

/// What becomes of a proven HELLO.
enum Admission {
    /// The connection is the rank's.
    Admitted,
    /// Refused with this error (sent with the store's proof).
    Refused(RendezvousError),
    /// Closed without an answer: the connection was evicted, or cannot be kept.
    Dropped,
}

/// Whether the peer of `stream` has closed it (or it broke), looked at without blocking and
/// without taking any byte from whoever reads it.
fn closed(stream: &TcpStream) -> bool {
    use nix::sys::socket::{recv, MsgFlags};
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    match recv(
        stream.as_raw_fd(),
        &mut b,
        MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
    ) {
        Ok(0) => true,
        Ok(_) => false,
        Err(nix::errno::Errno::EAGAIN) | Err(nix::errno::Errno::EINTR) => false,
        Err(_) => true,
    }
}

/// How a wait ended.
enum Outcome<T> {
    Ready(T),
    Failed(Failure),
    Shutdown(Vec<usize>),
    TimedOut(Vec<usize>),
}

/// One connection, served on its own thread.
struct Conn {
    shared: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    id: u64,
    accepted: Instant,
    rank: Option<usize>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.remove_pending(self.id);
        st.members.remove(&self.id);
        if let Some(r) = self.rank {
            if st.registered[r].as_ref().is_some_and(|m| m.conn == self.id) {
                st.departed[r] = true;
                st.told[r] = true;
            }
        }
        self.shared.cond.notify_all();
    }
}

/// Counts a connection as busy while it answers a request.
struct Busy(Arc<Shared>);

impl Busy {
    fn new(shared: Arc<Shared>) -> Self {
        shared.lock().busy += 1;
        Self(shared)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.lock().busy -= 1;
        self.0.cond.notify_all();
    }
}

impl Conn {
    fn serve(&mut self) {
        let _ = self.stream.set_nodelay(true);
        if !self.handshake() {
            return;
        }
        let io_timeout = self.shared.opts.io_timeout;
        let _ = self.stream.set_write_timeout(Some(io_timeout));
        loop {
            let times = FrameTimes {
                start_by: None,
                within: io_timeout,
                end_by: None,
            };
            let frame = match wire::read_frame(&mut &self.stream, MAX_REQUEST_PAYLOAD, times) {
                Ok(f) => f,
                Err(FrameError::Closed) => {
                    debug!(peer = %self.peer, rank = ?self.rank, "rendezvous connection closed");
                    return;
                }
                Err(e) => {
                    if !self.shared.shutting_down() {
                        warn!(peer = %self.peer, rank = ?self.rank, reason = %e, "rendezvous store: closing a rank's connection");
                        self.refuse_frame(&e);
                    }
                    return;
                }
            };
            let busy = Busy::new(Arc::clone(&self.shared));
            let keep = self.handle(frame);
            drop(busy);
            if !keep {
                return;
            }
        }
    }

    /// Tells a peer that speaks the protocol why its frame was refused; garbage gets nothing.
    fn refuse_frame(&self, e: &FrameError) {
        if matches!(
            e,
            FrameError::BadVersion(_)
                | FrameError::BadReserved(_)
                | FrameError::TooLarge { .. }
                | FrameError::Idle(_)
        ) {
            let _ = self.send_error(&RendezvousError::Protocol {
                peer: self.peer.to_string(),
                reason: format!("the store closed the connection: {e}"),
            });
        }
    }

    /// The challenge, the HELLO and its proof, admission and the store's proof back, all
    /// within the handshake timeout from accept. True once this connection is a rank's.
    fn handshake(&mut self) -> bool {
        let shared = Arc::clone(&self.shared);
        let opts = &shared.opts;
        let hello_by = self
            .accepted
            .checked_add(opts.handshake_timeout)
            .unwrap_or_else(|| super::later(opts.handshake_timeout));
        let left = hello_by.saturating_duration_since(Instant::now());
        let _ = self
            .stream
            .set_write_timeout(Some(left.max(Duration::from_millis(1))));
        let server_nonce = match auth::random() {
            Ok(n) => n,
            Err(e) => {
                warn!(error = %e, "rendezvous store: no nonce for a connection");
                return false;
            }
        };
        if !self.send(op::CHALLENGE, &[&server_nonce]) {
            return false;
        }
        let times = FrameTimes {
            start_by: Some(hello_by),
            within: opts.handshake_timeout,
            end_by: Some(hello_by),
        };
        // Nothing longer than a HELLO is read from a connection that has not proven the token.
        let frame = match wire::read_frame(&mut &self.stream, HELLO_LEN, times) {
            Ok(f) => f,
            Err(FrameError::Closed) => return false,
            Err(e) => {
                debug!(peer = %self.peer, reason = %e, "rendezvous store: no HELLO, closing");
                if !self.shared.shutting_down() {
                    self.refuse_frame(&e);
                }
                return false;
            }
        };
        let (rank, world_size, nonce, proof) = match Request::decode(frame.op, frame.payload) {
            Ok(Request::Hello {
                rank,
                world_size,
                nonce,
                proof,
            }) => (rank, world_size, nonce, proof),
            Ok(_) => return self.protocol_error("the first request must be HELLO".into()),
            Err(reason) => return self.protocol_error(reason),
        };
        let handshake = Handshake {
            key: &shared.key,
            server_nonce: &server_nonce,
            client_nonce: &nonce,
            rank,
            world_size,
        };
        if !handshake.verify(Purpose::Hello, b"", &proof) {
            if let Some(before) = shared.refused.allow() {
                warn!(peer = %self.peer, rank, before, "rendezvous store: refused a connection that did not prove the job token");
            }
            let _ = self.send_error(&RendezvousError::JobTokenMismatch {
                store: String::new(),
            });
            return false;
        }
        match self.admit(rank, world_size) {
            Admission::Admitted => {
                let welcome = handshake.prove(Purpose::Welcome, b"");
                self.send(op::OK, &[&welcome])
            }
            Admission::Refused(e) => {
                // Proven, so that the rank can believe it (and nothing else can pass for it).
                let refusal = wire::encode_error(&e);
                let proof = handshake.prove(Purpose::Refusal, &refusal);
                let _ = self.send(op::ERROR, &[&refusal, &proof]);
                false
            }
            Admission::Dropped => false,
        }
    }

    fn send(&self, op: u8, parts: &[&[u8]]) -> bool {
        let mut w = BufWriter::with_capacity(64 * 1024, &self.stream);
        match wire::write_frame(&mut w, op, parts) {
            Ok(()) => true,
            Err(e) => {
                debug!(peer = %self.peer, rank = ?self.rank, error = %e, "rendezvous store: reply not delivered");
                false
            }
        }
    }

    fn send_error(&self, e: &RendezvousError) -> bool {
        self.send(op::ERROR, &[&wire::encode_error(e)])
    }

    fn ok(&self) -> bool {
        self.send(op::OK, &[])
    }

    /// Answers with the job's failure and records that this rank knows.
    fn send_failure(&self, f: &Failure) -> bool {
        if let Some(r) = self.rank {
            self.shared.lock().told[r] = true;
        }
        self.send_error(&RendezvousError::JobFailed {
            reason: f.reason.clone(),
            missing: f.missing.clone(),
        })
    }

    fn protocol_error(&self, reason: String) -> bool {
        debug!(peer = %self.peer, rank = ?self.rank, %reason, "rendezvous store: bad request, closing connection");
        let _ = self.send_error(&RendezvousError::Protocol {
            peer: self.peer.to_string(),
            reason: format!("the store rejected a request: {reason}"),
        });
        false
    }

    /// Answers one request of a proven rank; false closes the connection.
    fn handle(&mut self, frame: Frame) -> bool {
        let Some(rank) = self.rank else {
            return false;
        };
        let req = match Request::decode(frame.op, frame.payload) {
            Ok(r) => r,
            Err(reason) => return self.protocol_error(reason),
        };
        match req {
            Request::Hello { .. } => {
                self.protocol_error("HELLO sent twice on one connection".into())
            }
            Request::WaitAll { timeout_ms } => self.wait_all(rank, timeout_ms),
            Request::Gather {
                round,
                timeout_ms,
                value,
            } => self.gather(rank, round, timeout_ms, value),
            Request::Abort { missing, reason } => {
                let missing = missing
                    .into_iter()
                    .filter_map(|r| usize::try_from(r).ok())
                    .collect();
                let mut st = self.shared.lock();
                st.told[rank] = true;
                st.fail(
                    &self.shared.cond,
                    format!("rank {rank} aborted: {reason}"),
                    missing,
                );
                drop(st);
                self.ok()
            }
        }
    }

    /// Registers a proven HELLO's rank, or refuses it (failing the job when two processes of
    /// one launch disagree before the job has formed).
    fn admit(&mut self, rank: u32, world_size: u32) -> Admission {
        let n = self.shared.opts.world_size;
        let rank = usize::try_from(rank).unwrap_or(usize::MAX);
        let world_size = usize::try_from(world_size).unwrap_or(usize::MAX);
        let mut st = self.shared.lock();
        // Evicted while its HELLO was on the way: the connection is closed, so it must not
        // take a rank (its welcome could not be delivered). The client reconnects.
        if !st.pending.iter().any(|p| p.id == self.id) {
            debug!(peer = %self.peer, rank, "rendezvous store: a proven HELLO on an evicted connection");
            return Admission::Dropped;
        }
        // A member the store cannot close at shutdown would hold Drop forever: no member
        // without its handle (out of descriptors, in a flood).
        let Ok(handle) = self.stream.try_clone() else {
            warn!(peer = %self.peer, rank, "rendezvous store: no descriptor to keep for a rank; it will reconnect");
            return Admission::Dropped;
        };
        // A rank whose earlier connection is gone, before it contributed to anything, may come
        // again: its welcome may never have reached it.
        if rank < n && st.next_round[rank] == 0 {
            if let Some(old) = &st.registered[rank] {
                let gone = st.departed[rank] || st.members.get(&old.conn).is_none_or(closed);
                if gone {
                    debug!(peer = %self.peer, rank, "rendezvous store: a rank comes again");
                    st.registered[rank] = None;
                    st.departed[rank] = false;
                    st.told[rank] = false;
                }
            }
        }
        // The claimed rank learns of a failure through this reply, unless another connection
        // holds that rank (then that one still has to be told).
        let claims_free_rank = rank < n && st.registered[rank].is_none();
        if let Some(f) = st.failure.clone() {
            if claims_free_rank {
                st.told[rank] = true;
            }
            return Admission::Refused(RendezvousError::JobFailed {
                reason: f.reason,
                missing: f.missing,
            });
        }
        let refusal = if world_size != n {
            Some(RendezvousError::WorldSizeMismatch {
                rank,
                client: world_size,
                server: n,
            })
        } else if rank >= n {
            Some(RendezvousError::RankOutOfRange {
                rank,
                world_size: n,
            })
        } else if let Some(first) = &st.registered[rank] {
            Some(RendezvousError::DuplicateRank {
                rank,
                detail: format!(
                    "{} registered it first, then {} claimed it too",
                    first.peer, self.peer
                ),
            })
        } else {
            None
        };
        if let Some(e) = refusal {
            if st.complete {
                // The job has formed: a late or stray claim costs it nothing.
                drop(st);
                if let Some(before) = self.shared.refused.allow() {
                    warn!(peer = %self.peer, reason = %e, before, "rendezvous store: refused a claim after the job formed");
                }
                return Admission::Refused(RendezvousError::Rejected {
                    reason: format!("every rank of the job has joined already: {e}"),
                });
            }
            if claims_free_rank {
                st.told[rank] = true;
            }
            st.fail(&self.shared.cond, e.to_string(), Vec::new());
            return Admission::Refused(e);
        }
        st.registered[rank] = Some(Member {
            conn: self.id,
            peer: self.peer,
        });
        st.complete = st.registered.iter().all(Option::is_some);
        st.remove_pending(self.id);
        st.members.insert(self.id, handle);
        self.rank = Some(rank);
        self.shared.cond.notify_all();
        drop(st);
        debug!(peer = %self.peer, rank, "rendezvous: rank said hello");
        Admission::Admitted
    }

    /// Waits on the shared state until `ready` yields a value, the job fails, the server shuts
    /// down or `deadline` passes. `missing` names the ranks still awaited.
    fn wait<T>(
        &self,
        deadline: Instant,
        mut ready: impl FnMut(&mut State, &Condvar) -> Option<T>,
        missing: impl Fn(&State) -> Vec<usize>,
    ) -> Outcome<T> {
        let mut st = self.shared.lock();
        loop {
            if let Some(v) = ready(&mut st, &self.shared.cond) {
                return Outcome::Ready(v);
            }
            if let Some(f) = &st.failure {
                return Outcome::Failed(f.clone());
            }
            if self.shared.shutting_down() {
                return Outcome::Shutdown(missing(&st));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Outcome::TimedOut(missing(&st));
            }
            st = self.shared.wait_on(st, left);
        }
    }

    /// Sends the error for a wait that did not produce a value. A rank that gave up waiting
    /// fails the job (it will not come back for the result), which frees what it held.
    fn wait_failed<T>(
        &self,
        rank: usize,
        outcome: Outcome<T>,
        what: &str,
        timeout_ms: u32,
    ) -> bool {
        match outcome {
            Outcome::Ready(_) => true,
            Outcome::Failed(f) => self.send_failure(&f),
            Outcome::Shutdown(missing) => self.send_error(&RendezvousError::JobFailed {
                reason: format!("the store on rank 0 shut down while this rank waited for {what}"),
                missing,
            }),
            Outcome::TimedOut(missing) => {
                let e = RendezvousError::Timeout {
                    what: what.to_owned(),
                    timeout: Duration::from_millis(u64::from(timeout_ms)),
                    missing: missing.clone(),
                };
                let mut st = self.shared.lock();
                st.told[rank] = true;
                st.fail(
                    &self.shared.cond,
                    format!("rank {rank} gave up: {e}"),
                    missing,
                );
                drop(st);
                self.send_error(&e)
            }
        }
    }

    fn wait_all(&self, rank: usize, timeout_ms: u32) -> bool {
        let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
        let outcome = self.wait(
            deadline,
            |st, _| st.registered.iter().all(Option::is_some).then_some(()),
            State::unregistered,
        );
        match outcome {
            Outcome::Ready(()) => self.ok(),
            other => {
                let what = format!("hello from all {} ranks", self.shared.opts.world_size);
                self.wait_failed(rank, other, &what, timeout_ms)
            }
        }
    }

    fn gather(&self, rank: usize, round: u64, timeout_ms: u32, value: Vec<u8>) -> bool {
        let n = self.shared.opts.world_size;
        let mut st = self.shared.lock();
        if let Some(f) = st.failure.clone() {
            drop(st);
            return self.send_failure(&f);
        }
        let len = value.len();
        let expected = st.next_round[rank];
        let fresh = !st.rounds.contains_key(&round);
        let bookkeeping = if fresh {
            n.saturating_mul(ROUND_BYTES_PER_RANK)
        } else {
            0
        };
        let held = st.rounds.get(&round).map_or(0, |r| r.bytes);
        let problem = if round != expected {
            Some(format!(
                "rank {rank} contributed to all-gather round {round}, but its next round is {expected}"
            ))
        } else if held + bookkeeping + len > MAX_GATHER_BYTES {
            Some(format!(
                "all-gather round {round} would hold more than {MAX_GATHER_BYTES} bytes (rank {rank} adds {len})"
            ))
        } else if st.stored + bookkeeping + len > MAX_STORE_BYTES {
            Some(format!(
                "the store is full: all-gather round {round} would make it hold more than {MAX_STORE_BYTES} bytes"
            ))
        } else {
            None
        };
        if let Some(reason) = problem {
            st.fail(&self.shared.cond, reason, Vec::new());
            let f = st.failure.clone();
            drop(st);
            return f.is_some_and(|f| self.send_failure(&f));
        }
        st.next_round[rank] += 1;
        st.stored += bookkeeping + len;
        let r = st.rounds.entry(round).or_insert_with(|| Round {
            values: vec![None; n],
            bytes: bookkeeping,
            ..Round::default()
        });
        r.values[rank] = Some(value);
        r.count += 1;
        r.bytes += len;
        if r.count == n {
            let values = r
                .values
                .iter_mut()
                .map(|v| v.take().unwrap_or_default())
                .collect();
            r.done = Some(Arc::new(values));
        }
        self.shared.cond.notify_all();
        drop(st);

        let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
        let ready = |st: &mut State, cond: &Condvar| {
            let r = st.rounds.get_mut(&round)?;
            if let Some(done) = r.done.clone() {
                r.fetched += 1;
                if r.fetched == n {
                    let bytes = r.bytes;
                    st.rounds.remove(&round);
                    st.stored -= bytes;
                }
                return Some(done);
            }
            // A rank that left before contributing never will: fail now rather than time out.
            let missing: Vec<usize> = (0..n).filter(|&i| r.values[i].is_none()).collect();
            if let Some(gone) = missing.iter().copied().find(|&i| st.departed[i]) {
                st.fail(
                    cond,
                    format!("rank {gone} closed its connection before contributing to all-gather round {round}"),
                    missing,
                );
            }
            None
        };
        let missing = |st: &State| match st.rounds.get(&round) {
            Some(r) => (0..n).filter(|&i| r.values[i].is_none()).collect(),
            None => Vec::new(),
        };
        match self.wait(deadline, ready, missing) {
            Outcome::Ready(values) => {
                let mut w = BufWriter::with_capacity(64 * 1024, &self.stream);
                match wire::write_gathered(&mut w, &values) {
                    Ok(()) => true,
                    Err(e) => {
                        debug!(peer = %self.peer, rank, error = %e, "rendezvous store: all-gather reply not delivered");
                        false
                    }
                }
            }
            other => self.wait_failed(
                rank,
                other,
                &format!("all-gather round {round}"),
                timeout_ms,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::StoreClient;
    use std::io::{Read, Write};

    const T: Duration = Duration::from_secs(3);
    const TOKEN: &str = "a token for the unit tests of the store";

    fn server(world_size: usize) -> StoreServer {
        StoreServer::bind(
            "127.0.0.1:0".parse().unwrap(),
            ServerOptions::new(world_size, TOKEN),
        )
        .unwrap()
    }

    fn client(s: &StoreServer, rank: usize, world_size: usize) -> StoreClient {
        let mut c = StoreClient::connect("127.0.0.1", s.local_addr().port(), T).unwrap();
        c.hello(rank, world_size, TOKEN, T).unwrap();
        c
    }

    #[test]
    fn gather_between_threads_frees_every_finished_round() {
        let s = server(2);
        let port = s.local_addr().port();
        let other = thread::spawn(move || {
            let mut c = StoreClient::connect("127.0.0.1", port, T).unwrap();
            c.hello(1, 2, TOKEN, T).unwrap();
            c.wait_all(T).unwrap();
            (0..3u8)
                .map(|round| c.all_gather(u64::from(round), &[1, round], T).unwrap())
                .collect::<Vec<_>>()
        });
        let mut c = client(&s, 0, 2);
        c.wait_all(T).unwrap();
        assert_eq!(s.registered_ranks(), [0, 1]);
        for round in 0..3u8 {
            let all = c.all_gather(u64::from(round), &[0, round], T).unwrap();
            assert_eq!(all, [vec![0, round], vec![1, round]]);
        }
        let theirs = other.join().unwrap();
        assert_eq!(theirs[2], [vec![0, 2], vec![1, 2]]);
        // Finished rounds are freed, bookkeeping included.
        let st = s.shared.lock();
        assert_eq!((st.rounds.len(), st.stored), (0, 0));
    }

    #[test]
    fn a_rank_that_leaves_before_contributing_fails_the_round() {
        let s = server(3);
        let mut c0 = client(&s, 0, 3);
        let c1 = client(&s, 1, 3);
        let mut c2 = client(&s, 2, 3);
        c0.wait_all(T).unwrap();
        drop(c1);
        let started = Instant::now();
        let e = c0.all_gather(0, b"x", T).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1), "failed fast");
        match &e {
            RendezvousError::JobFailed { reason, missing } => {
                assert!(reason.contains("rank 1 closed its connection"), "{reason}");
                assert_eq!(missing, &[1, 2]);
            }
            other => panic!("{other:?}"),
        }
        // Every later request of every rank gets the same reason.
        let e2 = c2.all_gather(0, b"v", T).unwrap_err();
        assert_eq!(e2.to_string(), e.to_string());
        assert!(s.failure().unwrap().contains("rank 1"));
    }

    #[test]
    fn a_wrong_token_is_refused_without_failing_the_job() {
        let s = server(1);
        let mut stray = StoreClient::connect("127.0.0.1", s.local_addr().port(), T).unwrap();
        match stray.hello(0, 1, "other-job", T) {
            Err(e @ RendezvousError::JobTokenMismatch { .. }) => {
                assert!(!e.to_string().contains(TOKEN), "{e}");
                assert!(!format!("{e:?}").contains(TOKEN), "{e:?}");
            }
            other => panic!("{other:?}"),
        }
        assert!(s.failure().is_none());
        assert!(s.registered_ranks().is_empty());
        let mut c = client(&s, 0, 1);
        c.wait_all(T).unwrap();
        assert_eq!(c.all_gather(0, b"ok", T).unwrap(), [b"ok".to_vec()]);
        assert!(!format!("{:?}", s.shared.opts).contains(TOKEN));
    }

    /// A process on a port of its own that challenges one client like a store, reads its
    /// HELLO, then `answers` (without knowing the token).
    fn fake_store(answer: impl FnOnce(&mut TcpStream) + Send + 'static) -> (u16, JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let fake = thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            wire::write_frame(&mut s, op::CHALLENGE, &[&[3u8; auth::NONCE_LEN]]).unwrap();
            let mut hello = [0u8; wire::FRAME_HEADER_LEN + HELLO_LEN];
            s.read_exact(&mut hello).unwrap();
            answer(&mut s);
            thread::sleep(Duration::from_millis(200));
        });
        (port, fake)
    }

    /// A store that answers a HELLO without knowing the token is found out by the client.
    #[test]
    fn a_store_that_cannot_prove_the_token_is_found_out() {
        // "Welcome", with a proof it cannot have.
        let (port, fake) = fake_store(|s| {
            wire::write_frame(s, op::OK, &[&[0u8; auth::PROOF_LEN]]).unwrap();
        });
        let mut c = StoreClient::connect("127.0.0.1", port, T).unwrap();
        let e = c.hello(0, 2, TOKEN, T).unwrap_err();
        assert!(
            matches!(e, RendezvousError::StoreNotAuthentic { .. }),
            "{e:?}"
        );
        fake.join().unwrap();
    }

    /// An error from what holds the port, unproven, does not end a rank with the text it
    /// chooses: it is "not this job's store"; the store's own refusals carry its proof.
    #[test]
    fn refusals_count_only_when_proven() {
        let (port, fake) = fake_store(|s| {
            let lie = wire::encode_error(&RendezvousError::JobFailed {
                reason: "rank 3 ran out of memory".into(),
                missing: vec![3],
            });
            wire::write_frame(s, op::ERROR, &[&lie, &[0u8; auth::PROOF_LEN]]).unwrap();
        });
        let mut c = StoreClient::connect("127.0.0.1", port, T).unwrap();
        let e = c.hello(0, 2, TOKEN, T).unwrap_err();
        assert!(
            matches!(e, RendezvousError::StoreNotAuthentic { .. }),
            "{e:?}"
        );
        fake.join().unwrap();
        // The real store's refusal is believed: a world size of its own is a typed error.
        let s = server(2);
        let mut c = StoreClient::connect("127.0.0.1", s.local_addr().port(), T).unwrap();
        let e = c.hello(0, 3, TOKEN, T).unwrap_err();
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

    /// A rank whose connection dropped right after its welcome (it may never have read it)
    /// comes again, before and after the job has formed, and is let in: its old connection is
    /// gone, and it had contributed nothing.
    #[test]
    fn a_rank_whose_connection_died_may_come_again() {
        for _ in 0..30 {
            let s = server(2);
            let c0 = client(&s, 0, 2);
            drop(c0);
            let mut again = client(&s, 0, 2);
            let c1 = client(&s, 1, 2);
            drop(c1);
            let mut c1 = client(&s, 1, 2);
            let other = thread::spawn(move || {
                c1.wait_all(T).unwrap();
                c1.all_gather(0, b"b", T).unwrap()
            });
            again.wait_all(T).unwrap();
            assert_eq!(
                again.all_gather(0, b"a", T).unwrap(),
                [b"a".to_vec(), b"b".to_vec()]
            );
            other.join().unwrap();
            assert!(s.failure().is_none());
        }
    }

    /// Before the store has proven the token, what holds the port can make a rank neither
    /// allocate a large frame nor wait past its hello's bound by dribbling one.
    #[test]
    fn an_unproven_store_costs_the_client_little() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let fake = thread::spawn(move || {
            // First client: a header announcing 200 MiB. Second: a frame, a byte a second.
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(&wire::header(op::CHALLENGE, 200 << 20).unwrap())
                .unwrap();
            let (mut s2, _) = listener.accept().unwrap();
            let frame = wire::header(op::CHALLENGE, auth::NONCE_LEN).unwrap();
            for b in frame {
                if s2.write_all(&[b]).is_err() {
                    break;
                }
                thread::sleep(Duration::from_secs(1));
            }
            drop(s);
        });
        let mut c = StoreClient::connect("127.0.0.1", port, T).unwrap();
        let e = c.hello(0, 2, TOKEN, T).unwrap_err();
        assert!(e.to_string().contains("limit"), "{e}");
        let mut c = StoreClient::connect("127.0.0.1", port, T).unwrap();
        let started = Instant::now();
        let e = c
            .hello(0, 2, TOKEN, Duration::from_millis(500))
            .unwrap_err();
        let took = started.elapsed();
        drop(c);
        assert!(took < Duration::from_secs(3), "hello took {took:?}: {e}");
        fake.join().unwrap();
    }

    #[test]
    fn silent_connections_are_closed_after_the_handshake_limit() {
        let mut opts = ServerOptions::new(2, TOKEN);
        opts.handshake_timeout = Duration::from_millis(200);
        let s = StoreServer::bind("127.0.0.1:0".parse().unwrap(), opts).unwrap();
        let mut raw = TcpStream::connect(s.local_addr()).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        let started = Instant::now();
        let mut reply = Vec::new();
        raw.read_to_end(&mut reply).unwrap();
        assert!(started.elapsed() < Duration::from_secs(2));
        let times = FrameTimes {
            start_by: None,
            within: T,
            end_by: None,
        };
        let mut r = reply.as_slice();
        let challenge = wire::read_frame(&mut r, 1 << 20, times).unwrap();
        assert_eq!(challenge.op, op::CHALLENGE);
        let f = wire::read_frame(&mut r, 1 << 20, times).unwrap();
        assert_eq!(f.op, op::ERROR);
        let e = wire::decode_error(&f.payload, "server").unwrap();
        assert!(e.to_string().contains("no request within"), "{e}");
        assert!(s.failure().is_none());
    }

    /// A HELLO that starts just before the handshake deadline and dribbles in a byte at a time
    /// is cut off at that deadline, not given a fresh limit from its first byte or per byte.
    #[test]
    fn the_whole_hello_has_one_deadline() {
        let mut opts = ServerOptions::new(2, TOKEN);
        opts.handshake_timeout = Duration::from_millis(400);
        let s = StoreServer::bind("127.0.0.1:0".parse().unwrap(), opts).unwrap();
        let mut raw = TcpStream::connect(s.local_addr()).unwrap();
        let started = Instant::now();
        thread::sleep(Duration::from_millis(300));
        let frame = wire::header(op::HELLO, HELLO_LEN).unwrap();
        let mut closed = None;
        for b in frame.iter().chain([0u8; HELLO_LEN].iter()) {
            if raw.write_all(&[*b]).is_err() {
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
            "cut off after {closed:?}, the deadline was 400 ms after connecting"
        );
    }

    /// Beyond an address's quota, a newcomer evicts that address's oldest connection once it
    /// is as old as the floor.
    #[test]
    fn pending_connections_beyond_the_quota_evict_the_oldest_past_the_floor() {
        let mut opts = ServerOptions::new(1, TOKEN);
        opts.max_pending_per_addr = 4;
        opts.pending_floor = Duration::ZERO;
        let s = StoreServer::bind("127.0.0.1:0".parse().unwrap(), opts).unwrap();
        let idle: Vec<TcpStream> = (0..10)
            .map(|_| TcpStream::connect(s.local_addr()).unwrap())
            .collect();
        let deadline = Instant::now() + T;
        while s.shared.lock().evicted < 6 {
            assert!(Instant::now() < deadline, "no eviction");
            thread::sleep(Duration::from_millis(5));
        }
        assert!(s.shared.lock().pending.len() <= 4);
        // The rank still gets in.
        let mut c = client(&s, 0, 1);
        c.wait_all(T).unwrap();
        drop(idle);
    }

    /// A connection younger than the floor is never evicted: the newcomer is turned away
    /// instead, told why, and a rank turned away until its deadline says so.
    #[test]
    fn young_connections_are_kept_and_newcomers_told_why_they_are_turned_away() {
        let mut opts = ServerOptions::new(2, TOKEN);
        opts.max_pending_per_addr = 4;
        opts.pending_floor = Duration::from_secs(30);
        let s = StoreServer::bind("127.0.0.1:0".parse().unwrap(), opts).unwrap();
        let first: Vec<TcpStream> = (0..4)
            .map(|_| TcpStream::connect(s.local_addr()).unwrap())
            .collect();
        let deadline = Instant::now() + T;
        while s.shared.lock().pending.len() < 4 {
            assert!(Instant::now() < deadline, "the first four were not kept");
            thread::sleep(Duration::from_millis(5));
        }
        let mut c = StoreClient::connect("127.0.0.1", s.local_addr().port(), T).unwrap();
        match c.hello(1, 2, TOKEN, T) {
            Err(RendezvousError::Crowded { reason, .. }) => {
                assert!(reason.contains("4 connections from 127.0.0.1"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        let st = s.shared.lock();
        assert_eq!((st.evicted, st.pending.len()), (0, 4));
        assert!(st.turned_away >= 1);
        drop(st);
        // The first four are still open: each has its challenge and nothing after it.
        for mut old in first {
            old.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            let mut buf = [0u8; 256];
            let n = old.read(&mut buf).unwrap();
            assert_eq!(n, wire::FRAME_HEADER_LEN + auth::NONCE_LEN);
            assert_eq!(buf[5], op::CHALLENGE);
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
            let s = StoreServer::bind("127.0.0.1:0".parse().unwrap(), opts).unwrap();
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
            let ranks: Vec<_> = (0..2usize)
                .map(|rank| {
                    thread::spawn(move || -> Result<Vec<Vec<u8>>> {
                        let deadline = Instant::now() + Duration::from_secs(10);
                        let mut c = loop {
                            let mut c = StoreClient::connect("127.0.0.1", addr.port(), T)?;
                            match c.hello(rank, 2, TOKEN, T) {
                                Ok(()) => break c,
                                Err(
                                    RendezvousError::Io { .. } | RendezvousError::Crowded { .. },
                                ) if Instant::now() < deadline => {}
                                Err(e) => return Err(e),
                            }
                        };
                        c.wait_all(T)?;
                        c.all_gather(0, &[u8::try_from(rank).unwrap()], T)
                    })
                })
                .collect();
            let results: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
            stop.store(true, Ordering::Relaxed);
            flood.join().unwrap();
            for r in results {
                assert_eq!(
                    r.unwrap_or_else(|e| panic!("trial {trial}: {e}")),
                    [vec![0], vec![1]]
                );
            }
        }
    }

    #[test]
    fn rounds_go_in_order_and_a_rank_that_gives_up_frees_them() {
        let s = server(2);
        let mut c0 = client(&s, 0, 2);
        let _c1 = client(&s, 1, 2);
        c0.wait_all(T).unwrap();
        // A round far ahead is refused (and, as misbehaviour of a rank, fails the job).
        let e = c0.all_gather(1 << 40, b"x", T).unwrap_err();
        assert!(
            matches!(&e, RendezvousError::JobFailed { reason, .. } if reason.contains("next round is 0")),
            "{e:?}"
        );
        let st = s.shared.lock();
        assert_eq!((st.rounds.len(), st.stored), (0, 0));
        drop(st);

        let s = server(2);
        let mut c0 = client(&s, 0, 2);
        let _c1 = client(&s, 1, 2);
        c0.wait_all(T).unwrap();
        let e = c0
            .all_gather(0, &[7u8; 1 << 20], Duration::from_millis(100))
            .unwrap_err();
        assert!(matches!(e, RendezvousError::Timeout { .. }), "{e:?}");
        let st = s.shared.lock();
        assert_eq!(
            (st.rounds.len(), st.stored),
            (0, 0),
            "a timed-out round still holds memory"
        );
        assert!(st.failure.as_ref().unwrap().reason.contains("gave up"));
    }

    #[test]
    fn oversize_requests_are_refused_by_the_client() {
        let s = server(1);
        let mut c = client(&s, 0, 1);
        let big = vec![0u8; crate::MAX_VALUE_LEN + 1];
        assert!(matches!(
            c.all_gather(0, &big, T),
            Err(RendezvousError::TooLarge { .. })
        ));
        // The connection is still fine.
        assert_eq!(c.all_gather(0, b"v", T).unwrap(), [b"v".to_vec()]);
    }

    #[test]
    fn dropping_the_server_answers_waiters_and_joins_its_threads() {
        let s = server(2);
        let mut c0 = client(&s, 0, 2);
        let _idle = client(&s, 1, 2);
        let waiter = thread::spawn(move || c0.all_gather(0, b"x", Duration::from_secs(30)));
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
