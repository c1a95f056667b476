//! The one wire protocol and its one client: the subset of PyTorch's c10d `TCPStore` protocol
//! that gpucast uses, spoken to torchrun's agent store and to gpucast's own store alike, with
//! gpucast's admission handshake in front of it on its own store.
//!
//! c10d (PyTorch's `TCPStoreBackend.hpp`): the client first sends VALIDATE (query type 0, then
//! the u32 magic `0x3C85F7CE`); every request is a one-byte query type and its arguments,
//! little-endian, strings and byte strings as a u64 length and the bytes. gpucast uses SET (no
//! reply), GET (reply: u64 length, value), ADD (reply: the sum, i64), CHECK (a u64 count of
//! keys, then the keys; reply: 0 when all exist, 1 when not) and DELETE_KEY (reply: i64).
//!
//! Admission, on gpucast's own store only: messages of a 10-byte header (magic `GCRV`, version
//! 4, kind, u32 body length) and a body. See the crate's documentation.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use super::auth::{self, Purpose};
use super::error::{RendezvousError, RendezvousError as E, Result};
use super::session::{ABORT_RANKS, ABORT_REASON, REQUEST_SLACK};

/// Query types of the c10d store protocol.
pub(crate) mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const DELETE_KEY: u8 = 8;
}
/// What VALIDATE carries.
pub(crate) const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// Longest value PyTorch's store servers accept (the libuv server's limit).
pub(crate) const TORCH_MAX_VALUE: usize = 8 << 20;
/// The key under which gpucast's own store keeps the job's failure (a refusal's encoding of
/// [`RendezvousError::JobFailed`]); a rank that aborts sets it.
pub(crate) const FAILED_KEY: &str = "/gpucast/failed";

/// Kinds of admission messages.
pub(crate) mod kind {
    /// Store: its 32-byte nonce.
    pub const CHALLENGE: u8 = b'C';
    /// Client: rank u32, world size u32, its nonce, its proof.
    pub const HELLO: u8 = b'H';
    /// Store: its proof.
    pub const WELCOME: u8 = b'W';
    /// Store: a refusal's encoding, then its proof over it.
    pub const REFUSED: u8 = b'R';
    /// Store, unproven: the HELLO's proof does not hold.
    pub const TOKEN_REFUSED: u8 = b'T';
    /// Store, unproven: no room among unproven connections; the reason as text.
    pub const CROWDED: u8 = b'B';
}
/// Bytes of an admission message's header.
pub(crate) const HEADER_LEN: usize = 10;
/// Bytes of a HELLO's body.
pub(crate) const HELLO_LEN: usize = 4 + 4 + auth::NONCE_LEN + auth::PROOF_LEN;
/// Longest admission message body a client reads from a store that has proven nothing.
const MAX_UNPROVEN: usize = 64 * 1024;
/// Longest single TCP connect attempt.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);

/// An admission message: header, then `body`.
pub(crate) fn message(kind: u8, body: &[u8]) -> Vec<u8> {
    let len = u32::try_from(body.len()).unwrap_or(u32::MAX).to_le_bytes();
    [&b"GCRV\x04"[..], &[kind], &len, body].concat()
}

/// The store's refusals (and its job failure) as bytes: a code, a u32 count of u64 numbers,
/// the numbers, then UTF-8 text. Variants without a code of their own travel as "rejected".
pub(crate) fn encode_error(e: &RendezvousError) -> Vec<u8> {
    let (code, nums, text) = match e {
        E::WorldSizeMismatch {
            rank: r,
            client: c,
            server: s,
        } => (1, vec![*r, *c, *s], String::new()),
        E::RankOutOfRange { rank, world_size } => (2, vec![*rank, *world_size], String::new()),
        E::DuplicateRank { rank, detail } => (3, vec![*rank], detail.clone()),
        E::JobFailed { reason, missing } => (4, missing.clone(), reason.clone()),
        E::Rejected(reason) => (5, vec![], reason.clone()),
        other => (5, vec![], other.to_string()),
    };
    let mut out = vec![code];
    out.extend_from_slice(&u32::try_from(nums.len()).unwrap_or(0).to_le_bytes());
    out.extend(nums.iter().flat_map(|&v| (v as u64).to_le_bytes()));
    out.extend_from_slice(text.as_bytes());
    out
}

/// The encoding of the job's failure: `reason` and the `missing` ranks, within what an abort
/// carries (the reason cut at a character boundary).
pub(crate) fn encode_failure(reason: &str, missing: &[usize]) -> Vec<u8> {
    let end = (0..=reason.len().min(ABORT_REASON)).rfind(|&i| reason.is_char_boundary(i));
    let reason = reason[..end.unwrap_or(0)].to_owned();
    let missing = missing[..missing.len().min(ABORT_RANKS)].to_vec();
    encode_error(&E::JobFailed { reason, missing })
}

/// The error `bytes` encode, if they are one.
pub(crate) fn decode_error(bytes: &[u8]) -> Option<RendezvousError> {
    let (&code, rest) = bytes.split_first()?;
    let count = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let end = count.checked_mul(8)?.checked_add(4)?;
    let word = |c: &[u8]| usize::try_from(u64::from_le_bytes(c.try_into().unwrap_or_default()));
    let nums = rest.get(4..end)?.chunks_exact(8);
    let nums: Vec<usize> = nums.map(|c| word(c).unwrap_or(usize::MAX)).collect();
    let text = String::from_utf8_lossy(&rest[end..]).into_owned();
    Some(match (code, nums.as_slice()) {
        (1, &[rank, client, server, ..]) => E::world_size_mismatch(rank, client, server),
        (2, &[rank, world_size, ..]) => E::RankOutOfRange { rank, world_size },
        (3, &[rank, ..]) => E::DuplicateRank { rank, detail: text },
        (4, missing) => E::JobFailed {
            reason: text,
            missing: missing.to_vec(),
        },
        (5, _) => E::Rejected(text),
        _ => return None,
    })
}

/// `host:port`, with brackets around an IPv6 address.
pub(crate) fn host_port(host: &str, port: u16) -> String {
    match host.contains(':') && !host.starts_with('[') {
        true => format!("[{host}]:{port}"),
        false => format!("{host}:{port}"),
    }
}

/// A TCP connection to `host:port`: one try of each address the name resolves to.
fn connect_tcp(host_port: &str, deadline: Instant) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the name resolves to no address");
    for addr in host_port.to_socket_addrs()? {
        let left = deadline.saturating_duration_since(Instant::now());
        let limit = left.clamp(Duration::from_millis(1), CONNECT_ATTEMPT);
        match TcpStream::connect_timeout(&addr, limit) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Fills `buf` from `from` by `deadline`, however slowly the bytes come.
pub(crate) fn read_full(mut from: &TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let late = "the peer did not answer in time";
            return Err(io::Error::new(io::ErrorKind::TimedOut, late));
        }
        from.set_read_timeout(Some(left))?;
        match from.read(&mut buf[got..]) {
            Ok(0) => {
                let closed = "the peer closed the connection (rank 0 may have exited)";
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, closed));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// What a rank proves to gpucast's own store before it speaks c10d there (nothing to
/// torchrun's): the key of the job token, and the rank and world size it claims.
pub(crate) type Admission<'a> = Option<(&'a auth::Key, usize, usize)>;

/// A c10d connection to a store (torchrun's, or gpucast's own once admitted). Every call
/// returns by its deadline; after an I/O or protocol error the connection is unusable.
pub(crate) struct Store {
    pub(crate) stream: TcpStream,
    pub(crate) peer: String,
    pub(crate) broken: Option<String>,
}

impl Store {
    /// Connects to `addr` (`host:port`) and, with `admission`, proves the token and checks the
    /// store's proof; then validates the c10d connection. Retries until `deadline` while the
    /// failure is on the connection or on what answered without proof (garbage, "token
    /// refused", "turned away", a welcome it could not prove): then the last such failure is
    /// the error.
    pub(crate) fn connect(addr: &str, admission: Admission<'_>, deadline: Instant) -> Result<Self> {
        // What answers may take a second longer, so that a failure says what it was.
        let slack = deadline.checked_add(REQUEST_SLACK).unwrap_or(deadline);
        let attempt = |stream: TcpStream| -> Result<Store> {
            let _ = stream.set_nodelay(true);
            let mut store = Store {
                stream,
                peer: addr.to_owned(),
                broken: None,
            };
            if let Some(claim) = admission {
                store.admit(claim, slack)?;
            }
            let validate = [&[query::VALIDATE][..], &VALIDATION_MAGIC.to_le_bytes()].concat();
            store.send(&validate, slack, "validating the connection")?;
            // A CHECK of a key nobody sets: any c10d store answers it, anything else does not
            // (gpucast's own store has proven itself already).
            if admission.is_some() {
                return Ok(store);
            }
            match store.check(&["/gpucast/validate".to_owned()], slack) {
                Err(e @ (E::Io { .. } | E::Protocol { .. })) => Err(E::protocol(
                    &store.peer,
                    format!("no c10d store answers there: {e}"),
                )),
                probe => probe.map(|_| store),
            }
        };
        let (start, mut backoff) = (Instant::now(), Duration::from_millis(5));
        let (mut last, mut last_error) = (None, None);
        loop {
            // Refused, unreachable, unknown host: rank 0 may not listen yet.
            match connect_tcp(addr, deadline) {
                Err(e) => last_error = Some(e),
                Ok(stream) => match attempt(stream) {
                    Ok(store) => return Ok(store),
                    // A closed connection says less than a reason given before it.
                    Err(E::Io { .. })
                        if !matches!(last, None | Some(E::Io { .. } | E::Protocol { .. })) => {}
                    Err(e @ (E::Io { .. } | E::Protocol { .. } | E::StoreNotAuthentic { .. }))
                    | Err(e @ (E::JobTokenMismatch { .. } | E::Crowded { .. })) => last = Some(e),
                    Err(e) => return Err(e),
                },
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(last.unwrap_or(E::ConnectTimeout {
                    addr: addr.to_owned(),
                    waited: start.elapsed(),
                    last_error,
                }));
            }
            thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(Duration::from_millis(250));
        }
    }

    /// The admission handshake: the store's challenge, this rank's HELLO, the store's proven
    /// welcome or proven refusal. Nothing the store says unproven is taken at its word.
    fn admit(&mut self, claim: (&auth::Key, usize, usize), deadline: Instant) -> Result<()> {
        let (key, rank, world) = claim;
        let (k, body) = self.admission_message(deadline)?;
        let server_nonce: [u8; auth::NONCE_LEN] = match body.as_slice().try_into() {
            Ok(n) if k == kind::CHALLENGE => n,
            _ => return Err(self.unproven(k, &body)),
        };
        let client_nonce = auth::random::<{ auth::NONCE_LEN }>()?;
        let word = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
        let claimed = [word(rank), word(world)].concat();
        let claim = [&server_nonce[..], &client_nonce, &claimed];
        let proof = |purpose, extra: &[u8]| key.prove(purpose, &claim, extra);
        let hello = [&claimed[..], &client_nonce, &proof(Purpose::Hello, b"")].concat();
        self.send(&message(kind::HELLO, &hello), deadline, "saying hello")?;
        let (k, body) = self.admission_message(deadline)?;
        let (refusal, tag) = body.split_at(body.len().saturating_sub(auth::PROOF_LEN));
        match k {
            kind::WELCOME if auth::same_secret(&proof(Purpose::Welcome, b""), &body) => Ok(()),
            kind::REFUSED if auth::same_secret(&proof(Purpose::Refusal, refusal), tag) => {
                Err(decode_error(refusal).unwrap_or_else(|| self.fail("a malformed refusal")))
            }
            k => Err(self.unproven(k, &body)),
        }
    }

    /// What an unproven answer of kind `k` means: a reason to try again, never a verdict.
    fn unproven(&self, k: u8, body: &[u8]) -> RendezvousError {
        let store = self.peer.clone();
        let reason = String::from_utf8_lossy(body).into_owned();
        match k {
            kind::TOKEN_REFUSED => E::JobTokenMismatch(store),
            kind::CROWDED => E::Crowded { store, reason },
            _ => E::StoreNotAuthentic(store),
        }
    }

    /// Marks the connection unusable, for `reason`: a protocol error.
    fn fail(&mut self, reason: impl Into<String>) -> RendezvousError {
        let reason = reason.into();
        self.broken = Some(reason.clone());
        E::protocol(&self.peer, reason)
    }

    /// One admission message, all of it by `deadline`, of at most 64 KiB.
    pub(crate) fn admission_message(&mut self, deadline: Instant) -> Result<(u8, Vec<u8>)> {
        let during = "the admission handshake";
        let mut h = [0u8; HEADER_LEN];
        self.receive(&mut h, deadline, during)?;
        if h[..5] != message(0, &[])[..5] {
            return Err(self.fail("what answers is not gpucast's store (protocol version 4)"));
        }
        let len = u32::from_le_bytes([h[6], h[7], h[8], h[9]]) as usize;
        if len > MAX_UNPROVEN {
            // Unproven, like every answer before the store's proof: a reason to try again.
            let too_long =
                format!("an admission message of {len} bytes, over the limit of {MAX_UNPROVEN}");
            return Err(self.fail(too_long));
        }
        let mut body = vec![0u8; len];
        self.receive(&mut body, deadline, during)?;
        Ok((h[5], body))
    }

    /// The error of `source` during `during`, which makes the connection unusable (the first
    /// such error is the reason later calls give).
    fn io_error(&mut self, during: &str, source: io::Error) -> RendezvousError {
        self.broken
            .get_or_insert_with(|| format!("{during}: {source}"));
        E::Io {
            peer: self.peer.clone(),
            during: during.to_owned(),
            source,
        }
    }

    /// Writes all of `bytes` by `deadline`.
    fn send(&mut self, bytes: &[u8], deadline: Instant, during: &str) -> Result<()> {
        let left = deadline.saturating_duration_since(Instant::now());
        let left = Some(left.max(Duration::from_millis(1)));
        let mut sent = self.stream.set_write_timeout(left);
        if let Some(why) = &self.broken {
            let why = format!("the connection is unusable after an earlier error: {why}");
            sent = Err(io::Error::new(io::ErrorKind::NotConnected, why));
        }
        let sent = sent.and_then(|()| self.stream.write_all(bytes));
        sent.map_err(|e| self.io_error(during, e))
    }

    /// Fills `buf` by `deadline`.
    fn receive(&mut self, buf: &mut [u8], deadline: Instant, during: &str) -> Result<()> {
        read_full(&self.stream, buf, deadline).map_err(|e| self.io_error(during, e))
    }

    /// Sends request `q` with `args` (keys, or a key and a value; a count first when `q` is
    /// CHECK) and `tail`, and reads a reply of `reply` bytes.
    fn call(
        &mut self,
        q: u8,
        args: &[impl AsRef<[u8]>],
        tail: &[u8],
        reply: usize,
        deadline: Instant,
    ) -> Result<[u8; 8]> {
        let key = String::from_utf8_lossy(args.first().map_or(&[], AsRef::as_ref));
        let during = format!("request {q} on {key}");
        let mut req = vec![q];
        if q == query::CHECK {
            req.extend_from_slice(&(args.len() as u64).to_le_bytes());
        }
        // Each as c10d sends a string: a u64 length, then the bytes.
        for a in args.iter().map(AsRef::as_ref) {
            req.extend([&(a.len() as u64).to_le_bytes()[..], a].concat());
        }
        req.extend_from_slice(tail);
        self.send(&req, deadline, &during)?;
        let mut b = [0u8; 8];
        self.receive(&mut b[..reply], deadline, &during)?;
        Ok(b)
    }

    /// Stores `value` under `key`.
    pub(crate) fn set(&mut self, key: &str, value: &[u8], deadline: Instant) -> Result<()> {
        let args = [key.as_bytes(), value];
        self.call(query::SET, &args, &[], 0, deadline).map(drop)
    }

    /// The value of `key` (which must exist: check first), refused beyond `max` bytes before
    /// any memory is taken.
    pub(crate) fn get(&mut self, key: &str, max: usize, deadline: Instant) -> Result<Vec<u8>> {
        let len = u64::from_le_bytes(self.call(query::GET, &[key], &[], 8, deadline)?);
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > max {
            self.broken = Some(format!("a {len}-byte reply"));
            let what = format!("the store's value of {key}");
            return Err(E::TooLarge { what, len, max });
        }
        let mut value = vec![0u8; len];
        self.receive(&mut value, deadline, &format!("getting {key}"))?;
        Ok(value)
    }

    /// Adds `delta` to the integer under `key` (0 if unset) and returns the sum.
    pub(crate) fn add(&mut self, key: &str, delta: i64, deadline: Instant) -> Result<i64> {
        let sum = self.call(query::ADD, &[key], &delta.to_le_bytes(), 8, deadline)?;
        Ok(i64::from_le_bytes(sum))
    }

    /// Deletes `key`.
    pub(crate) fn delete(&mut self, key: &str, deadline: Instant) -> Result<()> {
        self.call(query::DELETE_KEY, &[key], &[], 8, deadline)
            .map(drop)
    }

    /// Whether every key of `keys` exists.
    pub(crate) fn check(&mut self, keys: &[String], deadline: Instant) -> Result<bool> {
        match self.call(query::CHECK, keys, &[], 1, deadline)?[0] {
            0 => Ok(true),
            1 => Ok(false),
            other => Err(self.fail(format!("CHECK answered {other}, expected 0 or 1"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After an error the connection sends nothing more: a later call fails at once, naming
    /// the error that broke it.
    #[test]
    fn a_broken_connection_sends_nothing() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (peer, _) = listener.accept().unwrap();
        let broken = Some("an earlier error".to_owned());
        let mut store = Store {
            stream,
            peer: "the test's peer".into(),
            broken,
        };
        let e = store
            .set("k", b"v", Instant::now() + Duration::from_secs(1))
            .unwrap_err();
        assert!(
            matches!(&e, E::Io { source, .. } if source.kind() == io::ErrorKind::NotConnected
                && source.to_string().contains("an earlier error")),
            "{e:?}"
        );
        peer.set_nonblocking(true).unwrap();
        let read = (&peer).read(&mut [0u8; 1]);
        assert!(
            matches!(&read, Err(e) if e.kind() == io::ErrorKind::WouldBlock),
            "it sent something: {read:?}"
        );
    }

    #[test]
    fn admission_messages_have_the_documented_layout() {
        let m = message(kind::HELLO, &[7; HELLO_LEN]);
        assert_eq!(&m[..6], b"GCRV\x04H");
        assert_eq!(m[6..HEADER_LEN], 72u32.to_le_bytes());
        assert_eq!(m.len(), HEADER_LEN + HELLO_LEN);
    }

    /// Every refusal the store sends comes back as the same error, and no bytes (cut,
    /// flipped, or a count of numbers beyond the message) make decoding panic or allocate
    /// beyond the message.
    #[test]
    fn refusals_round_trip_and_garbage_decodes_to_nothing_worse() {
        let errors = [
            E::WorldSizeMismatch {
                rank: 1,
                client: 4,
                server: 3,
            },
            E::RankOutOfRange {
                rank: 9,
                world_size: 2,
            },
            E::DuplicateRank {
                rank: 1,
                detail: "a then b".into(),
            },
            E::JobFailed {
                reason: "rank 2 aborted: out of memory".into(),
                missing: vec![2, 5],
            },
            E::Rejected("late".into()),
        ];
        for e in &errors {
            let bytes = encode_error(e);
            let back = decode_error(&bytes).unwrap();
            assert_eq!(format!("{back:?}"), format!("{e:?}"));
            assert_eq!(back.missing_ranks(), e.missing_ranks());
            for cut in 0..bytes.len() {
                let _ = decode_error(&bytes[..cut]);
            }
        }
        // Anything else travels as a rejection with its message.
        let other = E::InvalidArgument("x".into());
        let back = decode_error(&encode_error(&other)).unwrap();
        assert!(matches!(&back, E::Rejected(reason) if reason.contains("invalid argument")));
        let mut huge = vec![4u8];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_error(&huge).is_none());
        assert!(decode_error(&[9, 0, 0, 0, 0]).is_none());
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            let noise: Vec<u8> = (0..(x % 64))
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x.to_le_bytes()[0] % 8
                })
                .collect();
            let _ = decode_error(&noise);
        }
    }
}
