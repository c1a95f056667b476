//! The store that rank 0 hosts: registration, a key-value map and all-gather rounds.

use std::collections::HashMap;
use std::io::{self, BufWriter};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::error::{rank_list, RendezvousError, Result};
use super::wire::{self, op, Frame, FrameError, Request, MAX_REQUEST_PAYLOAD};
use super::{
    DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_IO_TIMEOUT, EXTRA_CONNECTIONS, MAX_GATHER_BYTES,
    MAX_STORE_BYTES, MAX_TOKEN_LEN, MAX_WORLD_SIZE,
};

/// How often the accept loop looks at the shutdown flag when no connection arrives.
const ACCEPT_POLL: Duration = Duration::from_millis(10);
/// How long a dropped server lets replies already decided (a completed round) go out before it
/// closes every connection.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// Stack of a connection thread (they hold little: frames live on the heap).
const CONN_STACK: usize = 256 * 1024;

/// Settings of a [`StoreServer`].
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Number of ranks in the job; a HELLO with another world size fails the job.
    pub world_size: usize,
    /// The job token every HELLO must carry (see [`super::JobEnv::job_token`]).
    pub job_token: String,
    /// Most connections open at once; more are refused with an error frame. Default:
    /// `world_size + 64`.
    pub max_connections: usize,
    /// How long a new connection has to send its HELLO. Default 10 s.
    pub handshake_timeout: Duration,
    /// Limit for reading the rest of a frame once it has started, and for writing a reply.
    /// Default 30 s.
    pub io_timeout: Duration,
}

impl ServerOptions {
    /// Defaults for a job of `world_size` ranks with token `job_token`.
    pub fn new(world_size: usize, job_token: impl Into<String>) -> Self {
        Self {
            world_size,
            job_token: job_token.into(),
            max_connections: world_size.saturating_add(EXTRA_CONNECTIONS),
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            io_timeout: DEFAULT_IO_TIMEOUT,
        }
    }
}

/// The rendezvous store: a TCP server that rank 0 runs on background threads.
///
/// It registers ranks (HELLO), answers when all have arrived, keeps a key-value map and runs
/// all-gather rounds. It checks every HELLO: a wrong job token is refused (that connection
/// only); a wrong world size, a rank out of range or a rank claimed twice *fails the job*: the
/// offender gets the specific error and every pending and later request of every rank gets
/// [`RendezvousError::JobFailed`] with the reason, so no rank waits out its timeout. Any rank
/// can fail the job the same way (ABORT). A rank that disconnects before contributing to an
/// all-gather that others wait on fails the job too.
///
/// Malformed input (bad magic or version, oversize lengths, garbage) closes that connection
/// with a logged reason; limits on keys, values, stored bytes and connections bound memory.
///
/// Dropping the server stops it: no new connections, waiting requests are answered (with
/// their result if it is ready, else with an error), then every connection is closed and every
/// thread joined.
pub struct StoreServer {
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
    state: Mutex<State>,
    cond: Condvar,
    shutdown: AtomicBool,
}

#[derive(Clone)]
struct Failure {
    reason: String,
    missing: Vec<usize>,
}

struct Member {
    conn: u64,
    peer: SocketAddr,
}

#[derive(Default)]
struct Round {
    values: Vec<Option<Vec<u8>>>,
    count: usize,
    bytes: usize,
    done: Option<Arc<Vec<Vec<u8>>>>,
    fetched: usize,
}

struct State {
    registered: Vec<Option<Member>>,
    /// Ranks that have learned of the failure (or can no longer be told: disconnected).
    told: Vec<bool>,
    /// Ranks whose connection closed after HELLO.
    departed: Vec<bool>,
    failure: Option<Failure>,
    kv: HashMap<String, Arc<Vec<u8>>>,
    rounds: HashMap<u64, Round>,
    /// Bytes held in `kv` and `rounds`.
    stored: usize,
    open: usize,
    /// Connections between reading a request and finishing its reply.
    busy: usize,
    streams: HashMap<u64, TcpStream>,
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
    /// Marks the job failed (the first reason wins) and wakes every waiter.
    fn fail(&mut self, cond: &Condvar, reason: String, missing: Vec<usize>) {
        if self.failure.is_none() {
            warn!(%reason, "rendezvous job failed");
            self.failure = Some(Failure { reason, missing });
        }
        cond.notify_all();
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
    /// [`RendezvousError::InvalidArgument`] for a world size outside 1..=[`MAX_WORLD_SIZE`] or
    /// a token over [`MAX_TOKEN_LEN`] bytes.
    pub fn bind(addr: SocketAddr, options: ServerOptions) -> Result<Self> {
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
        let bind_err = |source: io::Error| {
            if source.kind() == io::ErrorKind::AddrInUse {
                RendezvousError::PortInUse { addr }
            } else {
                RendezvousError::Bind { addr, source }
            }
        };
        let listener = TcpListener::bind(addr).map_err(bind_err)?;
        let local_addr = listener.local_addr().map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let n = options.world_size;
        let shared = Arc::new(Shared {
            opts: options,
            state: Mutex::new(State {
                registered: (0..n).map(|_| None).collect(),
                told: vec![false; n],
                departed: vec![false; n],
                failure: None,
                kv: HashMap::new(),
                rounds: HashMap::new(),
                stored: 0,
                open: 0,
                busy: 0,
                streams: HashMap::new(),
            }),
            cond: Condvar::new(),
            shutdown: AtomicBool::new(false),
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
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Marks the job failed with `reason`: every pending and later request of every rank gets
    /// [`RendezvousError::JobFailed`]. The first failure's reason is kept.
    pub fn fail(&self, reason: &str) {
        self.fail_with(reason.to_owned(), Vec::new());
    }

    pub(crate) fn fail_with(&self, reason: String, missing: Vec<usize>) {
        self.shared.lock().fail(&self.shared.cond, reason, missing);
    }

    /// The reason the job failed, if it has.
    pub fn failure(&self) -> Option<String> {
        self.shared
            .lock()
            .failure
            .as_ref()
            .map(|f| f.reason.clone())
    }

    /// The ranks that have said HELLO so far.
    pub fn registered_ranks(&self) -> Vec<usize> {
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
        let grace_end = Instant::now() + SHUTDOWN_GRACE.min(self.shared.opts.io_timeout);
        let mut st = self.shared.lock();
        while st.busy > 0 {
            let left = grace_end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = self.shared.wait_on(st, left);
        }
        for stream in st.streams.values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        drop(st);
        for h in handles {
            let _ = h.join();
        }
        debug!(addr = %self.local_addr, "rendezvous store stopped");
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) -> Vec<JoinHandle<()>> {
    let mut handles: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id = 0u64;
    while !shared.shutting_down() {
        let (stream, peer) = match listener.accept() {
            Ok(conn) => conn,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Out of file descriptors and the like: wait, do not spin.
                warn!(error = %e, "rendezvous store: accept failed");
                thread::sleep(ACCEPT_POLL * 10);
                continue;
            }
        };
        handles.retain(|h| !h.is_finished());
        if let Err(e) = stream.set_nonblocking(false) {
            warn!(%peer, error = %e, "rendezvous store: dropping connection");
            continue;
        }
        let id = next_id;
        next_id += 1;
        {
            let mut st = shared.lock();
            if st.open >= shared.opts.max_connections {
                let open = st.open;
                drop(st);
                warn!(%peer, open, limit = shared.opts.max_connections, "rendezvous store: too many connections, refusing one");
                let reason = format!(
                    "too many connections ({open} open, limit {})",
                    shared.opts.max_connections
                );
                let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
                let mut w = &stream;
                let _ = wire::write_frame(
                    &mut w,
                    op::ERROR,
                    &[&wire::encode_error(&RendezvousError::Rejected { reason })],
                );
                continue;
            }
            match stream.try_clone() {
                Ok(clone) => {
                    st.streams.insert(id, clone);
                    st.open += 1;
                }
                Err(e) => {
                    warn!(%peer, error = %e, "rendezvous store: dropping connection");
                    continue;
                }
            }
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
                    rank: None,
                };
                conn.serve();
            });
        match spawned {
            Ok(h) => handles.push(h),
            Err(e) => {
                warn!(%peer, error = %e, "rendezvous store: cannot start a connection thread");
                let mut st = shared.lock();
                st.open -= 1;
                st.streams.remove(&id);
            }
        }
    }
    handles
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
    rank: Option<usize>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.open -= 1;
        st.streams.remove(&self.id);
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
        let opts = &self.shared.opts;
        let _ = self.stream.set_nodelay(true);
        let _ = self.stream.set_write_timeout(Some(opts.io_timeout));
        let hello_deadline = Instant::now() + opts.handshake_timeout;
        loop {
            let idle = match self.rank {
                Some(_) => None,
                None => Some(hello_deadline.saturating_duration_since(Instant::now())),
            };
            let frame = wire::read_frame(
                &mut &self.stream,
                MAX_REQUEST_PAYLOAD,
                idle,
                self.shared.opts.io_timeout,
            );
            let frame = match frame {
                Ok(f) => f,
                Err(FrameError::Closed) => {
                    debug!(peer = %self.peer, rank = ?self.rank, "rendezvous connection closed");
                    return;
                }
                Err(e) => {
                    if self.shared.shutting_down() {
                        return;
                    }
                    warn!(peer = %self.peer, rank = ?self.rank, reason = %e, "rendezvous store: closing connection");
                    // A peer that speaks the protocol learns why; garbage gets no answer.
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
        warn!(peer = %self.peer, rank = ?self.rank, %reason, "rendezvous store: bad request, closing connection");
        let _ = self.send_error(&RendezvousError::Protocol {
            peer: self.peer.to_string(),
            reason: format!("the store rejected a request: {reason}"),
        });
        false
    }

    /// Answers one request; false closes the connection.
    fn handle(&mut self, frame: Frame) -> bool {
        let req = match Request::decode(frame.op, frame.payload) {
            Ok(r) => r,
            Err(reason) => return self.protocol_error(reason),
        };
        let Some(rank) = self.rank else {
            return match req {
                Request::Hello {
                    rank,
                    world_size,
                    token,
                } => self.hello(rank, world_size, &token),
                _ => self.protocol_error("the first request must be HELLO".into()),
            };
        };
        match req {
            Request::Hello { .. } => {
                self.protocol_error("HELLO sent twice on one connection".into())
            }
            Request::WaitAll { timeout_ms } => self.wait_all(timeout_ms),
            Request::Set { key, value } => self.set(key, value),
            Request::Get { key, timeout_ms } => self.get(&key, timeout_ms),
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

    fn hello(&mut self, rank: u32, world_size: u32, token: &str) -> bool {
        let opts = &self.shared.opts;
        let n = opts.world_size;
        let rank = usize::try_from(rank).unwrap_or(usize::MAX);
        let world_size = usize::try_from(world_size).unwrap_or(usize::MAX);
        if token != opts.job_token {
            warn!(peer = %self.peer, rank, client = token, server = %opts.job_token, "rendezvous store: job token mismatch, refusing connection");
            let _ = self.send_error(&RendezvousError::JobTokenMismatch {
                client: token.to_owned(),
                server: opts.job_token.clone(),
            });
            return false;
        }
        let mut st = self.shared.lock();
        // The claimed rank learns of a failure through this reply, unless another connection
        // holds that rank (then that one still has to be told).
        let claims_free_rank = rank < n && st.registered[rank].is_none();
        if let Some(f) = st.failure.clone() {
            if claims_free_rank {
                st.told[rank] = true;
            }
            drop(st);
            let _ = self.send_error(&RendezvousError::JobFailed {
                reason: f.reason,
                missing: f.missing,
            });
            return false;
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
            if claims_free_rank {
                st.told[rank] = true;
            }
            st.fail(&self.shared.cond, e.to_string(), Vec::new());
            drop(st);
            let _ = self.send_error(&e);
            return false;
        }
        st.registered[rank] = Some(Member {
            conn: self.id,
            peer: self.peer,
        });
        self.rank = Some(rank);
        self.shared.cond.notify_all();
        drop(st);
        debug!(peer = %self.peer, rank, "rendezvous: rank said hello");
        self.ok()
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

    /// Sends the error for a wait that did not produce a value.
    fn wait_failed<T>(&self, outcome: Outcome<T>, what: &str, timeout_ms: u32) -> bool {
        match outcome {
            Outcome::Ready(_) => true,
            Outcome::Failed(f) => self.send_failure(&f),
            Outcome::Shutdown(missing) => self.send_error(&RendezvousError::JobFailed {
                reason: format!("the store on rank 0 shut down while this rank waited for {what}"),
                missing,
            }),
            Outcome::TimedOut(missing) => self.send_error(&RendezvousError::Timeout {
                what: what.to_owned(),
                timeout: Duration::from_millis(u64::from(timeout_ms)),
                missing,
            }),
        }
    }

    fn wait_all(&self, timeout_ms: u32) -> bool {
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
                self.wait_failed(other, &what, timeout_ms)
            }
        }
    }

    fn set(&self, key: String, value: Vec<u8>) -> bool {
        let mut st = self.shared.lock();
        if let Some(f) = st.failure.clone() {
            drop(st);
            return self.send_failure(&f);
        }
        let old = st.kv.get(&key).map_or(0, |v| v.len());
        let total = st.stored - old + value.len();
        if total > MAX_STORE_BYTES {
            drop(st);
            return self.send_error(&RendezvousError::Rejected {
                reason: format!(
                    "the store is full: setting {key:?} ({} bytes) would hold {total} bytes, more than {MAX_STORE_BYTES}",
                    value.len()
                ),
            });
        }
        st.stored = total;
        st.kv.insert(key, Arc::new(value));
        self.shared.cond.notify_all();
        drop(st);
        self.ok()
    }

    fn get(&self, key: &str, timeout_ms: u32) -> bool {
        let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
        let outcome = self.wait(deadline, |st, _| st.kv.get(key).cloned(), |_| Vec::new());
        match outcome {
            Outcome::Ready(v) => self.send(op::VALUE, &[&v]),
            other => self.wait_failed(other, &format!("key {key:?}"), timeout_ms),
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
        let stored = st.stored;
        let r = st.rounds.entry(round).or_insert_with(|| Round {
            values: vec![None; n],
            ..Round::default()
        });
        let problem = if r.done.is_some() || r.values[rank].is_some() {
            Some(format!(
                "rank {rank} contributed twice to all-gather round {round}"
            ))
        } else if r.bytes + len > MAX_GATHER_BYTES {
            Some(format!(
                "all-gather round {round} would hold more than {MAX_GATHER_BYTES} bytes (rank {rank} adds {len})"
            ))
        } else if stored + len > MAX_STORE_BYTES {
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
        st.stored += len;
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
            other => self.wait_failed(other, &format!("all-gather round {round}"), timeout_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::StoreClient;
    use std::io::Read;

    const T: Duration = Duration::from_secs(3);

    fn server(world_size: usize) -> StoreServer {
        StoreServer::bind(
            "127.0.0.1:0".parse().unwrap(),
            ServerOptions::new(world_size, "tok"),
        )
        .unwrap()
    }

    fn client(s: &StoreServer, rank: usize, world_size: usize) -> StoreClient {
        let mut c = StoreClient::connect("127.0.0.1", s.local_addr().port(), T).unwrap();
        c.hello(rank, world_size, "tok", T).unwrap();
        c
    }

    #[test]
    fn set_get_and_gather_between_threads() {
        let s = server(2);
        let port = s.local_addr().port();
        let other = thread::spawn(move || {
            let mut c = StoreClient::connect("127.0.0.1", port, T).unwrap();
            c.hello(1, 2, "tok", T).unwrap();
            c.wait_all(T).unwrap();
            // Waits for rank 0 to set it.
            let v = c.get("from-0", T).unwrap();
            c.set("from-1", &v.iter().rev().copied().collect::<Vec<_>>(), T)
                .unwrap();
            (0..3u8)
                .map(|round| c.all_gather(u64::from(round), &[1, round], T).unwrap())
                .collect::<Vec<_>>()
        });
        let mut c = client(&s, 0, 2);
        c.wait_all(T).unwrap();
        assert_eq!(s.registered_ranks(), [0, 1]);
        c.set("from-0", b"abc", T).unwrap();
        assert_eq!(c.get("from-1", T).unwrap(), b"cba");
        for round in 0..3u8 {
            let all = c.all_gather(u64::from(round), &[0, round], T).unwrap();
            assert_eq!(all, [vec![0, round], vec![1, round]]);
        }
        let theirs = other.join().unwrap();
        assert_eq!(theirs[2], [vec![0, 2], vec![1, 2]]);
        // Finished rounds are freed; only the two keys remain.
        assert_eq!(s.shared.lock().rounds.len(), 0);
        assert_eq!(s.shared.lock().stored, 6);
        match c.get("never-set", Duration::from_millis(100)) {
            Err(RendezvousError::Timeout { what, .. }) => assert!(what.contains("never-set")),
            other => panic!("{other:?}"),
        }
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
        let e2 = c2.set("k", b"v", T).unwrap_err();
        assert_eq!(e2.to_string(), e.to_string());
        assert!(s.failure().unwrap().contains("rank 1"));
    }

    #[test]
    fn a_wrong_token_is_refused_without_failing_the_job() {
        let s = server(1);
        let mut stray = StoreClient::connect("127.0.0.1", s.local_addr().port(), T).unwrap();
        match stray.hello(0, 1, "other-job", T) {
            Err(RendezvousError::JobTokenMismatch { client, server }) => {
                assert_eq!((client.as_str(), server.as_str()), ("other-job", "tok"));
            }
            other => panic!("{other:?}"),
        }
        assert!(s.failure().is_none());
        let mut c = client(&s, 0, 1);
        c.wait_all(T).unwrap();
        assert_eq!(c.all_gather(0, b"ok", T).unwrap(), [b"ok".to_vec()]);
    }

    #[test]
    fn silent_connections_are_closed_after_the_handshake_limit() {
        let mut opts = ServerOptions::new(2, "tok");
        opts.handshake_timeout = Duration::from_millis(200);
        let s = StoreServer::bind("127.0.0.1:0".parse().unwrap(), opts).unwrap();
        let mut raw = TcpStream::connect(s.local_addr()).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        let started = Instant::now();
        let mut reply = Vec::new();
        raw.read_to_end(&mut reply).unwrap();
        assert!(started.elapsed() < Duration::from_secs(2));
        let f = wire::read_frame(&mut reply.as_slice(), 1 << 20, None, T).unwrap();
        assert_eq!(f.op, op::ERROR);
        let e = wire::decode_error(&f.payload, "server").unwrap();
        assert!(e.to_string().contains("no request within"), "{e}");
        assert!(s.failure().is_none());
    }

    #[test]
    fn connections_beyond_the_limit_are_refused() {
        let mut opts = ServerOptions::new(2, "tok");
        opts.max_connections = 1;
        let s = StoreServer::bind("127.0.0.1:0".parse().unwrap(), opts).unwrap();
        let _first = client(&s, 0, 2);
        let mut second = StoreClient::connect("127.0.0.1", s.local_addr().port(), T).unwrap();
        match second.hello(1, 2, "tok", T) {
            Err(RendezvousError::Rejected { reason }) => {
                assert!(reason.contains("too many connections"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn oversize_requests_are_refused_by_the_client() {
        let s = server(1);
        let mut c = client(&s, 0, 1);
        let big = vec![0u8; crate::rendezvous::MAX_VALUE_LEN + 1];
        assert!(matches!(
            c.set("k", &big, T),
            Err(RendezvousError::TooLarge { .. })
        ));
        assert!(matches!(
            c.all_gather(0, &big, T),
            Err(RendezvousError::TooLarge { .. })
        ));
        let key = "k".repeat(crate::rendezvous::MAX_KEY_LEN + 1);
        assert!(matches!(
            c.get(&key, T),
            Err(RendezvousError::TooLarge { .. })
        ));
        // The connection is still fine.
        c.set("k", b"v", T).unwrap();
    }

    #[test]
    fn dropping_the_server_answers_waiters_and_joins_its_threads() {
        let s = server(2);
        let mut c0 = client(&s, 0, 2);
        let _idle = client(&s, 1, 2);
        let waiter = thread::spawn(move || c0.get("never", Duration::from_secs(30)));
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
