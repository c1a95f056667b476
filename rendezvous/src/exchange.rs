//! The [`Exchange`] trait, the store-backed [`Rendezvous`] and the closure-backed
//! [`FnExchange`].

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, info};

use super::env::{JobEnv, StoreKind};
use super::error::{RendezvousError, Result};
use super::server::{ServerOptions, StoreServer};
use super::session::{Session, ABORT_TIMEOUT};

/// Longest time rank 0 keeps the store up after a failed rendezvous, for ranks still coming.
const FAILURE_LINGER: Duration = Duration::from_secs(30);

/// What gpucast's initialisation needs from the processes of a job: who am I, how many are we,
/// and an all-gather of small byte strings.
///
/// [`Rendezvous`] implements it over gpucast's own TCP store; [`FnExchange`] wraps a closure so
/// that MPI or a framework's process group can drive it instead.
pub trait Exchange {
    /// This process's rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of processes.
    fn world_size(&self) -> usize;

    /// Every rank's `mine`, in rank order (this rank's own bytes at index `rank()`). Every rank
    /// must call it the same number of times, in the same order; calls never mix.
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()> {
        self.all_gather(&[]).map(drop)
    }

    /// `bytes` of rank `root`, on every rank (other ranks' `bytes` are ignored).
    fn broadcast_from(&self, root: usize, bytes: &[u8]) -> Result<Vec<u8>> {
        let n = self.world_size();
        if root >= n {
            let reason = format!("broadcast root {root} is out of range for {n} ranks");
            return Err(RendezvousError::InvalidArgument(reason));
        }
        let mine = if self.rank() == root { bytes } else { &[] };
        let mut all = self.all_gather(mine)?;
        if all.len() <= root {
            let reason = format!("{} entries, none for root {root}", all.len());
            return Err(RendezvousError::BadGather(reason));
        }
        Ok(all.swap_remove(root))
    }
}

/// An [`Exchange`] driven by a caller-supplied all-gather closure (MPI's `Allgatherv`, a
/// framework's process group, ...).
///
/// The closure gets this rank's bytes and returns every rank's, in rank order. Its errors
/// become [`RendezvousError::External`] with their message; a result with the wrong number of
/// entries, or whose own entry differs from what was passed, is [`RendezvousError::BadGather`].
pub struct FnExchange<F> {
    rank: usize,
    world_size: usize,
    gather: F,
}

impl<F> fmt::Debug for FnExchange<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FnExchange")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

impl<F> FnExchange<F> {
    /// Wraps `gather` for rank `rank` of `world_size` (checked: `rank < world_size`).
    pub fn new(rank: usize, world_size: usize, gather: F) -> Result<Self> {
        if rank >= world_size {
            let reason = format!("rank {rank} is not below the world size {world_size}");
            return Err(RendezvousError::InvalidArgument(reason));
        }
        Ok(Self {
            rank,
            world_size,
            gather,
        })
    }
}

impl<F: Fn(&[u8]) -> Result<Vec<Vec<u8>>, E>, E: fmt::Display> Exchange for FnExchange<F> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let all = (self.gather)(mine).map_err(|e| RendezvousError::External(e.to_string()))?;
        let (n, r, len) = (self.world_size, self.rank, mine.len());
        let reason = if all.len() != n {
            format!("{} entries for a world of {n} ranks", all.len())
        } else if all[r] != mine {
            let got = all[r].len();
            format!("entry {r} ({got} bytes) is not what rank {r} contributed ({len} bytes)")
        } else {
            return Ok(all);
        };
        Err(RendezvousError::BadGather(reason))
    }
}

/// The processes of one job, connected through a store: gpucast's own, which rank 0 hosts
/// ([`StoreKind::Own`]), or torchrun's ([`StoreKind::Torch`]).
///
/// With its own store, rank 0 listens on the master port and every rank (rank 0 too) connects
/// and proves the job token. Under torchrun every rank joins the agent's store as a client and
/// no port is opened. Both speak the same protocol and run the same rounds. All collective calls ([`Rendezvous::all_gather`], [`Rendezvous::barrier`],
/// [`Rendezvous::broadcast_from`]) are bounded by the timeout given to
/// [`Rendezvous::connect`] (see [`Rendezvous::set_timeout`]). When a rank fails locally (a
/// timeout, an oversize contribution), it aborts the job so that every other rank fails at
/// once with the reason instead of waiting out its own timeout.
///
/// Keep rank 0's `Rendezvous` alive until the other ranks are done with theirs (end with a
/// [`Rendezvous::barrier`]): with gpucast's own store, dropping it stops the store.
pub struct Rendezvous {
    env: JobEnv,
    timeout: Duration,
    /// The connection to the store (`None` for a job of one process).
    session: Mutex<Option<Session>>,
    /// Declared last: dropped after rank 0's own connection.
    server: Option<StoreServer>,
}

impl fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rendezvous")
            .field("env", &self.env)
            .field("timeout", &self.timeout)
            .field("server", &self.server_addr())
            .finish_non_exhaustive()
    }
}

/// The addresses rank 0 tries to listen on, in order. A one-node job whose `MASTER_ADDR` is a
/// loopback address listens there. Otherwise: each address `MASTER_ADDR` resolves to here that
/// is not loopback (only one of this host's own addresses can be bound, so the others fail
/// and are skipped), then the unspecified address of `MASTER_ADDR`'s family (all interfaces),
/// for the common setup where the name resolves to 127.0.1.1 on its own node but to a
/// routable address elsewhere.
fn listen_addrs(env: &JobEnv) -> Vec<SocketAddr> {
    let resolved = (env.master_addr.as_str(), env.master_port).to_socket_addrs();
    let resolved: Vec<SocketAddr> = resolved.map(Iterator::collect).unwrap_or_default();
    let one_node = env.local_world_size == env.world_size;
    if one_node && !resolved.is_empty() && resolved.iter().all(|a| a.ip().is_loopback()) {
        return vec![resolved[0]];
    }
    let mut addrs = resolved.clone();
    addrs.retain(|a| !a.ip().is_loopback() && !a.ip().is_unspecified());
    let ip = match resolved.first() {
        Some(a) if a.is_ipv6() => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    addrs.push(SocketAddr::new(ip, env.master_port));
    addrs
}

/// Starts rank 0's store on the first of `listen_addrs(env)` that this host can bind.
fn host_store(env: &JobEnv) -> Result<StoreServer> {
    let reason = "no address to listen on".into();
    let mut bound = Err(RendezvousError::InvalidArgument(reason));
    for addr in listen_addrs(env) {
        bound = StoreServer::bind(addr, ServerOptions::new(env.world_size, &env.job_token));
        match &bound {
            Err(RendezvousError::Bind { source, .. })
                if source.kind() == std::io::ErrorKind::AddrNotAvailable => {}
            Ok(s) if s.local_addr().ip().is_unspecified() => {
                debug!(master = %env.master(), "rendezvous: MASTER_ADDR is no address of this host; listening on every interface");
                break;
            }
            _ => break,
        }
    }
    bound
}

/// Where rank 0 reaches its own server: its host and port.
fn local_target(listening: SocketAddr) -> (String, u16) {
    let ip = match listening.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    (ip.to_string(), listening.port())
}

impl Rendezvous {
    /// Finds the other processes of the job described by `env`, within `timeout`.
    ///
    /// With gpucast's own store ([`StoreKind::Own`]) rank 0 starts it on `MASTER_PORT`: on
    /// `MASTER_ADDR` itself when that is a loopback address and the job has one node, else on
    /// the address `MASTER_ADDR` resolves to here, or on every interface when it resolves to
    /// no address of this host. Every rank connects (retrying until the deadline, since rank 0
    /// may start last), proves the job token and checks the store's proof. Under torchrun
    /// ([`StoreKind::Torch`]) every rank joins the agent's store instead. Then, in either
    /// store, by the same code, every rank waits until all `world_size` ranks have put their
    /// sealed nonce there and confirmed the session they make. A token
    /// that does not look random (empty, torchrun's run id, Slurm's job id, under 128 bits
    /// for its length and alphabet, repetitive) is said once, by rank 0 on standard error, on
    /// loopback too, with how to set a secret one. An answer nobody proved ("token refused",
    /// "turned away", a closed connection) is tried again until the deadline.
    ///
    /// Errors: [`RendezvousError::PortInUse`] on rank 0 if the port is taken;
    /// [`RendezvousError::ConnectTimeout`] if the store cannot be reached; the store's last
    /// refusal if it kept closing the connection; [`RendezvousError::JobTokenMismatch`] /
    /// [`RendezvousError::StoreNotAuthentic`] when this process and the store do not share the
    /// token, or [`RendezvousError::Crowded`] when the store kept turning it away, until the
    /// deadline; [`RendezvousError::Timeout`] naming the missing ranks if not all arrive in time;
    /// [`RendezvousError::WorldSizeMismatch`] / [`RendezvousError::DuplicateRank`] /
    /// [`RendezvousError::RankOutOfRange`] for the offending process and
    /// [`RendezvousError::JobFailed`] for all others. After a failure, rank 0 keeps its store
    /// up until every rank has heard of it, the deadline passes or 30 s have passed, whichever
    /// comes first, so that ranks still starting learn the reason instead of retrying a closed
    /// port until their own timeout. A job of one process opens no socket.
    pub fn connect(env: &JobEnv, timeout: Duration) -> Result<Self> {
        env.validate()?;
        let start = Instant::now();
        let deadline = super::later(timeout);
        let rendezvous = |session, server| Self {
            env: env.clone(),
            timeout,
            session: Mutex::new(session),
            server,
        };
        if env.world_size == 1 {
            return Ok(rendezvous(None, None));
        }
        let server = match env.store {
            StoreKind::Own if env.rank == 0 => Some(host_store(env)?),
            _ => None,
        };
        let (host, port) = match &server {
            Some(s) => local_target(s.local_addr()),
            None => (env.master_addr.clone(), env.master_port),
        };
        let joined = Session::join(env, &host, port, deadline);
        if let (Err(e), Some(server)) = (&joined, &server) {
            let reason = format!("rank 0 could not complete the rendezvous: {e}");
            let linger = deadline.min(Instant::now() + FAILURE_LINGER);
            server.fail(&reason, e.missing_ranks(), linger);
        }
        let session = joined?;
        info!(rank = env.rank, world_size = env.world_size, master = %env.master(), elapsed = ?start.elapsed(), "rendezvous complete");
        Ok(rendezvous(Some(session), server))
    }

    /// Tells the other ranks of the job that this one cannot take part (`reason`), so that
    /// they fail at once with it instead of waiting out their timeout, without holding up the
    /// caller: a thread does it, best effort, within `within`. With gpucast's own store, rank
    /// 0 hosts it just long enough for every rank to hear the reason, and any other rank
    /// joins it and aborts; under torchrun, the rank joins torchrun's store with the others
    /// and aborts there. Nothing is sent when the process exits first, or the others do not
    /// come within `within`.
    pub fn announce_failure(env: &JobEnv, reason: String, within: Duration) {
        if env.world_size == 1 || env.validate().is_err() {
            return;
        }
        let env = env.clone();
        let spawned = thread::Builder::new()
            .name("gpucast-announce".into())
            .spawn(move || {
                let deadline = super::later(within);
                let told = match env.store {
                    StoreKind::Own if env.rank == 0 => {
                        host_store(&env).map(|server| server.fail(&reason, &[], deadline))
                    }
                    _ => Session::join(&env, &env.master_addr, env.master_port, deadline)
                        .and_then(|mut s| s.abort(&reason, &[], ABORT_TIMEOUT)),
                };
                if let Err(e) = told {
                    debug!(rank = env.rank, error = %e, "rendezvous: the other ranks were not told of this rank's failure");
                }
            });
        if let Err(e) = spawned {
            debug!(error = %e, "rendezvous: no thread to tell the other ranks of this rank's failure");
        }
    }

    /// Changes the time limit of each later collective call.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The store's address as rank 0 listens on it (`None` on other ranks and for one process).
    pub fn server_addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(StoreServer::local_addr)
    }

    fn session(&self) -> MutexGuard<'_, Option<Session>> {
        self.session.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Fails the job for every rank with `reason` (e.g. a local error during initialisation),
    /// so that the others stop waiting.
    pub fn abort(&self, reason: &str) -> Result<()> {
        let abort = |s: &mut Session| s.abort(reason, &[], self.timeout);
        self.session().as_mut().map_or(Ok(()), abort)
    }
}

impl Exchange for Rendezvous {
    fn rank(&self) -> usize {
        self.env.rank
    }

    fn world_size(&self) -> usize {
        self.env.world_size
    }

    /// Every rank's `mine`, in rank order. Each call is a new round: every rank must make the
    /// same sequence of collective calls. Contributions are limited to
    /// [`super::MAX_VALUE_LEN`] bytes, and a round to [`super::MAX_GATHER_BYTES`]. When this
    /// rank fails (a timeout, an oversize contribution), it aborts the job for the others.
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let Some(session) = &mut *self.session() else {
            return Ok(vec![mine.to_vec()]);
        };
        let result = session.all_gather(mine, self.timeout);
        result.inspect_err(|e| session.abort_after(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank turned away until its deadline (every place held by connections younger than
    /// the floor) says so, rather than blaming a closed connection or an exited rank 0.
    #[test]
    fn a_rank_kept_out_by_a_full_store_names_the_crowd() {
        let mut opts = ServerOptions::new(2, "a token of the crowded job, long enough");
        opts.max_pending_per_addr = 2;
        opts.pending_floor = Duration::from_secs(60);
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), opts).unwrap();
        let port = server.local_addr().port();
        let idle: Vec<_> = (0..2)
            .map(|_| std::net::TcpStream::connect(server.local_addr()).unwrap())
            .collect();
        thread::sleep(Duration::from_millis(100));
        let mut env = JobEnv::single_node(1, 2, port).unwrap();
        env.job_token = "a token of the crowded job, long enough".into();
        let started = Instant::now();
        let deadline = Instant::now() + Duration::from_millis(700);
        let key = crate::auth::Key::of(&env.job_token);
        let admission = (&key, 1, 2);
        let addr = format!("127.0.0.1:{port}");
        let e = crate::store::Store::connect(&addr, Some(admission), deadline)
            .err()
            .unwrap();
        assert!(
            started.elapsed() >= Duration::from_millis(600),
            "gave up early"
        );
        match &e {
            RendezvousError::Crowded { reason, .. } => {
                assert!(reason.contains("2 connections from 127.0.0.1"), "{reason}");
                assert!(e.to_string().contains("floods its port"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        drop(idle);
    }

    #[test]
    fn fn_exchange_maps_results_and_errors() {
        // Four ranks simulated by a closure that knows the others' bytes.
        let ex = FnExchange::new(2, 4, |mine: &[u8]| -> Result<Vec<Vec<u8>>, String> {
            Ok((0..4u8)
                .map(|r| if r == 2 { mine.to_vec() } else { vec![r; 3] })
                .collect())
        })
        .unwrap();
        assert_eq!((ex.rank(), ex.world_size()), (2, 4));
        let all = ex.all_gather(b"me").unwrap();
        assert_eq!(all[2], b"me");
        assert_eq!(all[0], [0, 0, 0]);
        ex.barrier().unwrap();
        assert_eq!(ex.broadcast_from(1, b"ignored").unwrap(), [1, 1, 1]);
        assert!(matches!(
            ex.broadcast_from(4, b""),
            Err(RendezvousError::InvalidArgument { .. })
        ));

        let failing = FnExchange::new(0, 2, |_: &[u8]| -> Result<Vec<Vec<u8>>, std::io::Error> {
            Err(std::io::Error::other("MPI_Allgather returned 5"))
        })
        .unwrap();
        match failing.all_gather(b"x") {
            Err(RendezvousError::External(message)) => {
                assert_eq!(message, "MPI_Allgather returned 5");
            }
            other => panic!("{other:?}"),
        }

        let short = FnExchange::new(0, 3, |m: &[u8]| -> Result<_, String> {
            Ok(vec![m.to_vec()])
        })
        .unwrap();
        assert!(matches!(
            short.all_gather(b"x"),
            Err(RendezvousError::BadGather { .. })
        ));
        let wrong_self = FnExchange::new(0, 1, |_: &[u8]| -> Result<_, String> {
            Ok(vec![b"y".to_vec()])
        })
        .unwrap();
        assert!(matches!(
            wrong_self.all_gather(b"x"),
            Err(RendezvousError::BadGather { .. })
        ));
        assert!(
            FnExchange::new(3, 3, |_: &[u8]| -> Result<Vec<Vec<u8>>, String> {
                Ok(vec![])
            })
            .is_err()
        );

        // Usable as a trait object.
        let dyn_ex: &dyn Exchange = &ex;
        assert_eq!(dyn_ex.all_gather(b"d").unwrap().len(), 4);
    }

    #[test]
    fn rendezvous_can_be_shared_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Rendezvous>();
        send_sync::<StoreServer>();
        send_sync::<crate::store::Store>();
        send_sync::<RendezvousError>();
    }

    #[test]
    fn one_process_needs_no_network() {
        let env = JobEnv::single_node(0, 1, 29500).unwrap();
        let rdv = Rendezvous::connect(&env, Duration::from_secs(1)).unwrap();
        assert_eq!(rdv.all_gather(b"solo").unwrap(), vec![b"solo".to_vec()]);
        rdv.barrier().unwrap();
        assert_eq!(rdv.broadcast_from(0, b"b").unwrap(), b"b");
        assert!(rdv.server_addr().is_none());
    }

    #[test]
    fn listen_address_policy() {
        let addrs = |env: &JobEnv| -> Vec<SocketAddr> { listen_addrs(env) };
        let one = |s: &str| -> Vec<SocketAddr> { vec![s.parse().unwrap()] };
        let local = JobEnv::single_node(0, 2, 4242).unwrap();
        assert_eq!(addrs(&local), one("127.0.0.1:4242"));
        let mut multi = local.clone();
        multi.local_world_size = 1;
        assert_eq!(addrs(&multi), one("0.0.0.0:4242"));
        let mut v6 = multi.clone();
        v6.master_addr = "::1".into();
        assert_eq!(addrs(&v6), one("[::]:4242"));
        // A routable address is tried first, all interfaces only if it is not this host's.
        let mut routable = local;
        routable.master_addr = "192.0.2.7".into();
        assert_eq!(
            addrs(&routable),
            [
                "192.0.2.7:4242".parse().unwrap(),
                "0.0.0.0:4242".parse().unwrap()
            ]
        );
        routable.local_world_size = 1;
        routable.job_token = "x".repeat(32);
        let server = host_store(&{
            let mut e = routable.clone();
            e.master_port = 0;
            e
        })
        .unwrap();
        assert!(
            server.local_addr().ip().is_unspecified(),
            "192.0.2.7 is no address of this host"
        );
        assert_eq!(
            local_target("0.0.0.0:5".parse().unwrap()),
            ("127.0.0.1".to_owned(), 5)
        );
        assert_eq!(
            local_target("[::]:5".parse().unwrap()),
            ("::1".to_owned(), 5)
        );
    }
}
