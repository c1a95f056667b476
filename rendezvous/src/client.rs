//! A connection from one rank to the store.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use super::auth::{self, Handshake, Purpose};
use super::error::{clip, RendezvousError, Result};
use super::wire::{self, op, FrameError, FrameTimes, Request, MAX_REPLY_PAYLOAD};
use super::{DEFAULT_IO_TIMEOUT, MAX_TOKEN_LEN, MAX_VALUE_LEN, MAX_WORLD_SIZE};

/// How much longer than the server's own deadline a client waits for the reply (the server
/// answers a timed-out wait itself, with the missing ranks).
const REPLY_SLACK: Duration = Duration::from_secs(1);
/// Largest frame read from a store before it has proven the job token (a challenge, a welcome
/// or an error message).
const MAX_UNPROVEN_REPLY: usize = 64 * 1024;
/// Longest single TCP connect attempt.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);
/// First and longest pause between connect attempts.
const BACKOFF_START: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(250);

/// One rank's connection to the [`super::server::StoreServer`].
///
/// Every method takes a timeout and returns by then (plus a second of slack for the reply).
/// After an I/O or protocol error the connection is unusable and every later call fails with
/// [`RendezvousError::Io`]; errors the server replies with (timeouts, a failed job) leave it
/// usable.
#[derive(Debug)]
pub(crate) struct StoreClient {
    stream: TcpStream,
    server: SocketAddr,
    world_size: Option<usize>,
    broken: Option<String>,
}

pub(crate) fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A TCP connection to `host:port`, resolving the name and retrying (refused, unreachable,
/// unknown host) with backoff until `timeout` has passed.
pub(crate) fn connect_tcp(
    host: &str,
    port: u16,
    timeout: Duration,
) -> Result<(TcpStream, SocketAddr)> {
    let start = Instant::now();
    let deadline = super::later(timeout);
    let mut backoff = BACKOFF_START;
    let mut last_error = None;
    loop {
        match (host, port).to_socket_addrs() {
            Ok(addrs) => {
                for addr in addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    let attempt = left.min(CONNECT_ATTEMPT).max(Duration::from_millis(1));
                    match TcpStream::connect_timeout(&addr, attempt) {
                        Ok(stream) => return Ok((stream, addr)),
                        Err(e) => last_error = Some(e),
                    }
                }
            }
            Err(e) => last_error = Some(e),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(RendezvousError::ConnectTimeout {
                addr: host_port(host, port),
                waited: start.elapsed(),
                last_error,
            });
        }
        thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

impl StoreClient {
    /// Connects to the store at `host:port`, resolving the name and retrying (refused,
    /// unreachable, unknown host) with backoff until `timeout` has passed: rank 0 may start its
    /// server after the others start connecting.
    pub(crate) fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self> {
        let (stream, addr) = connect_tcp(host, port, timeout)?;
        Self::from_stream(stream, addr)
    }

    fn from_stream(stream: TcpStream, server: SocketAddr) -> Result<Self> {
        let io_err = |source| RendezvousError::Io {
            peer: server.to_string(),
            during: "setting up the connection".into(),
            source,
        };
        stream.set_nodelay(true).map_err(io_err)?;
        stream
            .set_write_timeout(Some(DEFAULT_IO_TIMEOUT))
            .map_err(io_err)?;
        Ok(Self {
            stream,
            server,
            world_size: None,
            broken: None,
        })
    }

    /// The error of a connection made unusable by an earlier one.
    fn check_usable(&self, during: &str) -> Result<()> {
        match &self.broken {
            Some(why) => Err(RendezvousError::unusable(
                &self.server.to_string(),
                during,
                why,
            )),
            None => Ok(()),
        }
    }

    /// Sends one request frame and reads the reply frame. Error replies become their error.
    fn call(&mut self, request: &Request, during: &str, wait: Duration) -> Result<wire::Frame> {
        let frame = self.call_raw(request, during, wait)?;
        self.error_reply(frame, during)
    }

    /// [`StoreClient::call`], keeping an error reply as a frame.
    fn call_raw(&mut self, request: &Request, during: &str, wait: Duration) -> Result<wire::Frame> {
        self.check_usable(during)?;
        let peer = self.server.to_string();
        let frame = request.encode().map_err(|source| RendezvousError::Io {
            peer: peer.clone(),
            during: during.to_owned(),
            source,
        })?;
        let sent = (&self.stream)
            .write_all(&frame)
            .and_then(|()| (&self.stream).flush());
        match sent {
            Ok(()) => self.receive_raw(during, wait),
            Err(e) => Err(self.broken_by(FrameError::Io(e), during)),
        }
    }

    /// An error reply as its error; any other frame as it is.
    fn error_reply(&self, frame: wire::Frame, during: &str) -> Result<wire::Frame> {
        if frame.op != op::ERROR {
            return Ok(frame);
        }
        let peer = self.server.to_string();
        Err(
            wire::decode_error(&frame.payload, &peer).unwrap_or_else(|reason| {
                RendezvousError::Protocol {
                    peer: peer.clone(),
                    reason: format!("malformed error reply during {during}: {reason}"),
                }
            }),
        )
    }

    /// Reads the next frame, expected within `wait` (plus slack). Until the store has proven
    /// the token (`self.world_size` is set by a verified welcome), frames are small and the
    /// whole of one must arrive by that time too: whatever holds the port must not make this
    /// rank allocate or wait beyond its bound.
    fn receive_raw(&mut self, during: &str, wait: Duration) -> Result<wire::Frame> {
        let by = super::later(wait.saturating_add(REPLY_SLACK));
        let proven = self.world_size.is_some();
        let times = FrameTimes {
            start_by: Some(by),
            within: DEFAULT_IO_TIMEOUT,
            end_by: (!proven).then_some(by),
        };
        let max = if proven {
            MAX_REPLY_PAYLOAD
        } else {
            MAX_UNPROVEN_REPLY
        };
        match wire::read_frame(&mut &self.stream, max, times) {
            Ok(f) => Ok(f),
            Err(e) => Err(self.broken_by(e, during)),
        }
    }

    /// Marks the connection unusable after `e` and returns it as the rendezvous error.
    fn broken_by(&mut self, e: FrameError, during: &str) -> RendezvousError {
        let peer = self.server.to_string();
        let err = match e {
            FrameError::Closed => RendezvousError::Io {
                peer,
                during: during.to_owned(),
                source: io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the store closed the connection (rank 0 may have exited)",
                ),
            },
            FrameError::Idle(t) => RendezvousError::Io {
                peer,
                during: during.to_owned(),
                source: io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no reply from the store within {t:?}"),
                ),
            },
            FrameError::Io(source) => RendezvousError::Io {
                peer,
                during: during.to_owned(),
                source,
            },
            other => RendezvousError::Protocol {
                peer,
                reason: format!("bad reply during {during}: {other}"),
            },
        };
        self.broken = Some(err.to_string());
        err
    }

    fn expect(&mut self, frame: &wire::Frame, want: u8, during: &str) -> Result<()> {
        if frame.op == want {
            return Ok(());
        }
        let reason = format!(
            "reply op {:#04x} during {during}, expected {want:#04x}",
            frame.op
        );
        self.broken = Some(reason.clone());
        Err(RendezvousError::Protocol {
            peer: self.server.to_string(),
            reason,
        })
    }

    /// Registers this connection as `rank` of a job of `world_size` ranks, proving
    /// `job_token` over the store's fresh nonce and checking the store's proof back.
    ///
    /// The server answers at once. A world size other than the server's
    /// ([`RendezvousError::WorldSizeMismatch`]), a rank out of range or a rank already
    /// registered ([`RendezvousError::DuplicateRank`]) fail the whole job while it forms, and
    /// are [`RendezvousError::Rejected`] once it has; a different token is
    /// [`RendezvousError::JobTokenMismatch`] and leaves the job alone; a store that cannot prove
    /// the token is [`RendezvousError::StoreNotAuthentic`].
    pub(crate) fn hello(
        &mut self,
        rank: usize,
        world_size: usize,
        job_token: &str,
        timeout: Duration,
    ) -> Result<()> {
        let too_big = |what: &str, v: usize| RendezvousError::InvalidArgument {
            reason: format!("{what} {v} does not fit the protocol (at most {MAX_WORLD_SIZE})"),
        };
        if world_size > MAX_WORLD_SIZE {
            return Err(too_big("world size", world_size));
        }
        if job_token.len() > MAX_TOKEN_LEN {
            return Err(RendezvousError::TooLarge {
                what: "job token".into(),
                len: job_token.len(),
                max: MAX_TOKEN_LEN,
            });
        }
        let rank32 = u32::try_from(rank).map_err(|_| too_big("rank", rank))?;
        let world32 = u32::try_from(world_size).map_err(|_| too_big("world size", world_size))?;
        let during = format!("hello as rank {rank} of {world_size}");
        self.check_usable(&during)?;
        let store = self.server.to_string();
        let not_authentic = |this: &mut Self| {
            this.broken = Some("the store could not prove the job token".into());
            RendezvousError::StoreNotAuthentic {
                store: store.clone(),
            }
        };
        // The store speaks first, and before it has proven the token nothing it says is taken
        // at its word: only its challenge, its proven welcome or its proven refusal.
        let challenge = self.receive_raw(&during, timeout)?;
        let server_nonce = match (challenge.op, wire::decode_challenge(&challenge.payload)) {
            (op::CHALLENGE, Ok(n)) => n,
            (op::ERROR, _) => {
                return Err(self
                    .unproven_error(&challenge.payload, &store)
                    .unwrap_or_else(|| not_authentic(self)))
            }
            _ => return Err(not_authentic(self)),
        };
        let nonce = auth::random()?;
        let key = auth::Key::of(job_token);
        let handshake = Handshake {
            key: &key,
            server_nonce: &server_nonce,
            client_nonce: &nonce,
            rank: rank32,
            world_size: world32,
        };
        let proof = handshake.prove(Purpose::Hello, b"");
        let req = Request::Hello {
            rank: rank32,
            world_size: world32,
            nonce,
            proof,
        };
        let frame = self.call_raw(&req, &during, timeout)?;
        match frame.op {
            op::OK => {
                let genuine = wire::decode_welcome(&frame.payload)
                    .is_ok_and(|p| handshake.verify(Purpose::Welcome, b"", &p));
                if !genuine {
                    return Err(not_authentic(self));
                }
                self.world_size = Some(world_size);
                Ok(())
            }
            op::ERROR => {
                let split = frame.payload.len().checked_sub(auth::PROOF_LEN);
                let proven = split.filter(|&at| {
                    let (refusal, claimed) = frame.payload.split_at(at);
                    handshake.verify(Purpose::Refusal, refusal, claimed)
                });
                if let Some(at) = proven {
                    self.broken = Some("the store refused this rank".into());
                    let refusal = wire::Frame {
                        op: op::ERROR,
                        payload: frame.payload[..at].to_vec(),
                    };
                    return self.error_reply(refusal, &during).map(drop);
                }
                self.unproven_error(&frame.payload, &store)
                    .map_or_else(|| Err(not_authentic(self)), Err)
            }
            other => {
                self.broken = Some(format!("reply op {other:#04x} to a HELLO"));
                Err(RendezvousError::Protocol {
                    peer: store,
                    reason: format!("reply op {other:#04x} during {during}"),
                })
            }
        }
    }

    /// The two errors the store says without proof during a handshake (it cannot prove the
    /// token to a process whose token differs, nor spend a proof on a connection it turns away
    /// in a flood): the refusal of this process's token, and [`RendezvousError::Crowded`].
    /// Whatever holds the port can send them too, so they are reasons to try again until the
    /// deadline (see `connect_and_hello`), never a final answer by themselves. Any other
    /// unproven error is `None`: not this job's store.
    fn unproven_error(&mut self, payload: &[u8], store: &str) -> Option<RendezvousError> {
        let e = wire::decode_error(payload, store).ok()?;
        match e {
            RendezvousError::JobTokenMismatch { .. } => {
                self.broken = Some("the store refused the job token".into());
                Some(RendezvousError::JobTokenMismatch {
                    store: store.to_owned(),
                })
            }
            RendezvousError::Crowded { .. } => {
                self.broken = Some("the store turned the connection away".into());
                Some(e)
            }
            _ => None,
        }
    }

    /// Waits until every rank has said hello. On timeout the error names the missing ranks.
    pub(crate) fn wait_all(&mut self, timeout: Duration) -> Result<()> {
        let req = Request::WaitAll {
            timeout_ms: wire::millis(timeout),
        };
        let frame = self.call(&req, "waiting for all ranks", timeout)?;
        self.expect(&frame, op::OK, "waiting for all ranks")
    }

    fn check_value(what: &str, len: usize) -> Result<()> {
        if len > MAX_VALUE_LEN {
            return Err(RendezvousError::TooLarge {
                what: what.to_owned(),
                len,
                max: MAX_VALUE_LEN,
            });
        }
        Ok(())
    }

    /// Contributes `value` to all-gather round `round` and returns every rank's contribution in
    /// rank order once all have contributed. Every rank must use the same round numbers in the
    /// same order; a timeout names the ranks that have not contributed.
    pub(crate) fn all_gather(
        &mut self,
        round: u64,
        value: &[u8],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        Self::check_value("all-gather contribution", value.len())?;
        let req = Request::Gather {
            round,
            timeout_ms: wire::millis(timeout),
            value: value.to_vec(),
        };
        let during = format!("all-gather round {round}");
        let frame = self.call(&req, &during, timeout)?;
        self.expect(&frame, op::GATHERED, &during)?;
        let values =
            wire::decode_gathered(&frame.payload).map_err(|reason| RendezvousError::Protocol {
                peer: self.server.to_string(),
                reason: format!("malformed all-gather reply: {reason}"),
            })?;
        if let Some(n) = self.world_size {
            if values.len() != n {
                return Err(RendezvousError::Protocol {
                    peer: self.server.to_string(),
                    reason: format!(
                        "all-gather reply has {} entries for {n} ranks",
                        values.len()
                    ),
                });
            }
        }
        Ok(values)
    }

    /// Fails the job for every rank with `reason` (clipped to 4 KiB) and `missing`, the ranks
    /// it blames, if any.
    pub(crate) fn abort(
        &mut self,
        reason: &str,
        missing: &[usize],
        timeout: Duration,
    ) -> Result<()> {
        let req = Request::Abort {
            missing: missing
                .iter()
                .take(MAX_WORLD_SIZE)
                .filter_map(|&r| u32::try_from(r).ok())
                .collect(),
            reason: clip(reason, 4096).to_owned(),
        };
        let frame = self.call(&req, "abort", timeout)?;
        self.expect(&frame, op::OK, "abort")
    }
}
