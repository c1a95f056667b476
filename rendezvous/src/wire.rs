//! Frames and messages of the store protocol (see the module documentation for the layout).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::auth::{Nonce, Proof, NONCE_LEN, PROOF_LEN};
use super::error::{clip, RendezvousError};
use super::MAX_VALUE_LEN;

/// The first four bytes of every frame.
pub(crate) const MAGIC: [u8; 4] = *b"GCRV";
/// The protocol version this build speaks; a frame of another version closes the connection.
pub(crate) const PROTOCOL_VERSION: u8 = 3;
/// Bytes in a frame header: magic (4), version (1), op (1), reserved zero (2), payload length
/// (4, little-endian).
pub(crate) const FRAME_HEADER_LEN: usize = 12;

/// Bytes of a HELLO payload: rank, world size, the client's nonce and its proof.
pub(crate) const HELLO_LEN: usize = 4 + 4 + NONCE_LEN + PROOF_LEN;
/// Largest request payload the server reads from an authenticated rank: a contribution plus
/// the fixed fields.
pub(crate) const MAX_REQUEST_PAYLOAD: usize = MAX_VALUE_LEN + 64;
/// Largest reply payload a client reads: an all-gather of [`super::MAX_GATHER_BYTES`] plus
/// 4 bytes per rank of up to [`super::MAX_WORLD_SIZE`] ranks.
pub(crate) const MAX_REPLY_PAYLOAD: usize =
    super::MAX_GATHER_BYTES + 4 * super::MAX_WORLD_SIZE + 64;

/// Bytes read at a time into a growing payload buffer: a header that claims a large payload
/// costs memory only as the bytes actually arrive.
const READ_CHUNK: usize = 64 * 1024;

/// Operation codes (0x03 and 0x04, SET and GET of the first version, are retired).
pub(crate) mod op {
    pub const HELLO: u8 = 0x01;
    pub const WAIT_ALL: u8 = 0x02;
    pub const GATHER: u8 = 0x05;
    pub const ABORT: u8 = 0x06;
    pub const OK: u8 = 0x80;
    pub const GATHERED: u8 = 0x82;
    pub const ERROR: u8 = 0x83;
    pub const CHALLENGE: u8 = 0x84;
}

/// A frame read off a connection.
#[derive(Debug)]
pub(crate) struct Frame {
    pub op: u8,
    pub payload: Vec<u8>,
}

/// Why no frame could be read.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The peer closed the connection between frames.
    Closed,
    /// The peer closed the connection inside a frame.
    Truncated {
        got: usize,
        expected: usize,
    },
    BadMagic([u8; 4]),
    BadVersion(u8),
    BadReserved(u16),
    TooLarge {
        len: usize,
        max: usize,
    },
    /// No frame started within the idle limit.
    Idle(Duration),
    /// A frame started but did not complete within the frame limit.
    Slow(Duration),
    Io(io::Error),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Closed => write!(f, "connection closed"),
            Self::Truncated { got, expected } => {
                write!(
                    f,
                    "connection closed after {got} of {expected} bytes of a frame"
                )
            }
            Self::BadMagic(m) => write!(
                f,
                "bad magic {m:02x?} (expected {MAGIC:02x?}): not a gpucast peer"
            ),
            Self::BadVersion(v) => write!(
                f,
                "protocol version {v}, this build speaks {PROTOCOL_VERSION}"
            ),
            Self::BadReserved(r) => write!(f, "reserved header bytes are {r:#06x}, not zero"),
            Self::TooLarge { len, max } => {
                write!(
                    f,
                    "frame announces a {len}-byte payload, more than the {max}-byte limit"
                )
            }
            Self::Idle(t) => write!(f, "no request within {t:?}"),
            Self::Slow(t) => write!(f, "frame not completed within {t:?}"),
            Self::Io(e) => write!(f, "{e}"),
        }
    }
}

/// A reader whose per-read time limit can be set (a socket; a byte slice in tests).
pub(crate) trait TimedRead: Read {
    fn set_timeout(&mut self, limit: Option<Duration>) -> io::Result<()>;
}

impl TimedRead for &TcpStream {
    fn set_timeout(&mut self, limit: Option<Duration>) -> io::Result<()> {
        // A zero timeout is an error for the OS; a millisecond is as good as expired.
        self.set_read_timeout(limit.map(|t| t.max(Duration::from_millis(1))))
    }
}

impl TimedRead for &[u8] {
    fn set_timeout(&mut self, _: Option<Duration>) -> io::Result<()> {
        Ok(())
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Encodes a frame header.
pub(crate) fn header(op: u8, len: usize) -> io::Result<[u8; FRAME_HEADER_LEN]> {
    let len = u32::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame payload over 4 GiB"))?;
    let mut h = [0u8; FRAME_HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = PROTOCOL_VERSION;
    h[5] = op;
    h[8..].copy_from_slice(&len.to_le_bytes());
    Ok(h)
}

/// Checks a frame header; returns the op and payload length.
pub(crate) fn parse_header(
    h: &[u8; FRAME_HEADER_LEN],
    max_payload: usize,
) -> Result<(u8, usize), FrameError> {
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    if h[4] != PROTOCOL_VERSION {
        return Err(FrameError::BadVersion(h[4]));
    }
    let reserved = u16::from_le_bytes([h[6], h[7]]);
    if reserved != 0 {
        return Err(FrameError::BadReserved(reserved));
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if len > max_payload {
        return Err(FrameError::TooLarge {
            len,
            max: max_payload,
        });
    }
    Ok((h[5], len))
}

/// When a frame must arrive.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FrameTimes {
    /// Its first byte must come by then (no limit if `None`).
    pub start_by: Option<Instant>,
    /// The rest must follow within this time of the first byte...
    pub within: Duration,
    /// ...and by this instant, if given (one deadline for a whole handshake).
    pub end_by: Option<Instant>,
}

/// Reads one frame within `times`. The header is checked before any payload memory is taken,
/// and the payload buffer grows only as bytes arrive.
pub(crate) fn read_frame<R: TimedRead>(
    r: &mut R,
    max_payload: usize,
    times: FrameTimes,
) -> Result<Frame, FrameError> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    let idle = times
        .start_by
        .map(|t| t.saturating_duration_since(Instant::now()));
    if idle.is_some_and(|t| t.is_zero()) {
        return Err(FrameError::Idle(Duration::ZERO));
    }
    r.set_timeout(idle).map_err(FrameError::Io)?;
    let mut got = loop {
        match r.read(&mut h) {
            Ok(0) => return Err(FrameError::Closed),
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Err(FrameError::Idle(idle.unwrap_or_default())),
            Err(e) => return Err(FrameError::Io(e)),
        }
    };
    let frame_limit = times.within;
    let mut deadline = super::later(frame_limit);
    if let Some(end) = times.end_by {
        deadline = deadline.min(end);
    }
    let read_some = |r: &mut R, buf: &mut [u8]| -> Result<usize, FrameError> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FrameError::Slow(frame_limit));
            }
            r.set_timeout(Some(left)).map_err(FrameError::Io)?;
            match r.read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => return Err(FrameError::Slow(frame_limit)),
                Err(e) => return Err(FrameError::Io(e)),
            }
        }
    };
    while got < FRAME_HEADER_LEN {
        match read_some(r, &mut h[got..])? {
            0 => {
                return Err(FrameError::Truncated {
                    got,
                    expected: FRAME_HEADER_LEN,
                })
            }
            n => got += n,
        }
    }
    let (op, len) = parse_header(&h, max_payload)?;
    let mut payload = Vec::new();
    while payload.len() < len {
        let start = payload.len();
        let chunk = (len - start).min(READ_CHUNK);
        payload.resize(start + chunk, 0);
        match read_some(r, &mut payload[start..])? {
            0 => {
                return Err(FrameError::Truncated {
                    got: FRAME_HEADER_LEN + start,
                    expected: FRAME_HEADER_LEN + len,
                })
            }
            n => payload.truncate(start + n),
        }
    }
    Ok(Frame { op, payload })
}

/// Writes a frame whose payload is the concatenation of `parts`.
pub(crate) fn write_frame(w: &mut impl Write, op: u8, parts: &[&[u8]]) -> io::Result<()> {
    let len = parts.iter().map(|p| p.len()).sum();
    w.write_all(&header(op, len)?)?;
    for p in parts {
        w.write_all(p)?;
    }
    w.flush()
}

/// Cursor over a payload; every read is bounds-checked.
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            return Err(format!(
                "payload of {} bytes ends before {what} ({n} bytes at offset {})",
                self.buf.len(),
                self.pos
            ));
        };
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    pub fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N, what)?);
        Ok(a)
    }

    pub fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.array::<1>(what)?[0])
    }

    pub fn u16(&mut self, what: &str) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub fn len32(&mut self, what: &str) -> Result<usize, String> {
        usize::try_from(self.u32(what)?).map_err(|e| e.to_string())
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn finish(&self, what: &str) -> Result<(), String> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(format!(
                "{} stray bytes after {what}",
                self.buf.len() - self.pos
            ))
        }
    }
}

fn u32_len(len: usize) -> io::Result<[u8; 4]> {
    u32::try_from(len)
        .map(u32::to_le_bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "length over 4 GiB"))
}

/// Milliseconds on the wire, saturating at `u32::MAX` (49 days).
pub(crate) fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

/// A request from a client to the server.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Request {
    Hello {
        rank: u32,
        world_size: u32,
        nonce: Nonce,
        proof: Proof,
    },
    WaitAll {
        timeout_ms: u32,
    },
    Gather {
        round: u64,
        timeout_ms: u32,
        value: Vec<u8>,
    },
    Abort {
        missing: Vec<u32>,
        reason: String,
    },
}

impl Request {
    /// The whole frame, header included.
    pub fn encode(&self) -> io::Result<Vec<u8>> {
        let mut p = Vec::new();
        let op = match self {
            Self::Hello {
                rank,
                world_size,
                nonce,
                proof,
            } => {
                p.extend_from_slice(&rank.to_le_bytes());
                p.extend_from_slice(&world_size.to_le_bytes());
                p.extend_from_slice(nonce);
                p.extend_from_slice(proof);
                op::HELLO
            }
            Self::WaitAll { timeout_ms } => {
                p.extend_from_slice(&timeout_ms.to_le_bytes());
                op::WAIT_ALL
            }
            Self::Gather {
                round,
                timeout_ms,
                value,
            } => {
                p.extend_from_slice(&round.to_le_bytes());
                p.extend_from_slice(&timeout_ms.to_le_bytes());
                p.extend_from_slice(value);
                op::GATHER
            }
            Self::Abort { missing, reason } => {
                p.extend_from_slice(&u32_len(missing.len())?);
                for r in missing {
                    p.extend_from_slice(&r.to_le_bytes());
                }
                p.extend_from_slice(reason.as_bytes());
                op::ABORT
            }
        };
        let mut frame = header(op, p.len())?.to_vec();
        frame.extend_from_slice(&p);
        Ok(frame)
    }

    /// Parses a request payload (the header has been checked). Takes the payload by value so
    /// that a value is moved, not copied.
    pub fn decode(op: u8, mut payload: Vec<u8>) -> Result<Self, String> {
        let mut c = Cursor::new(&payload);
        let req = match op {
            op::HELLO => {
                let rank = c.u32("rank")?;
                let world_size = c.u32("world size")?;
                let nonce = c.array::<NONCE_LEN>("nonce")?;
                let proof = c.array::<PROOF_LEN>("proof")?;
                c.finish("HELLO")?;
                Self::Hello {
                    rank,
                    world_size,
                    nonce,
                    proof,
                }
            }
            op::WAIT_ALL => {
                let timeout_ms = c.u32("timeout")?;
                c.finish("WAIT_ALL")?;
                Self::WaitAll { timeout_ms }
            }
            op::GATHER => {
                let round = c.u64("round")?;
                let timeout_ms = c.u32("timeout")?;
                let start = c.position();
                if payload.len() - start > MAX_VALUE_LEN {
                    return Err(format!(
                        "all-gather contribution of {} bytes exceeds {MAX_VALUE_LEN}",
                        payload.len() - start
                    ));
                }
                payload.drain(..start);
                Self::Gather {
                    round,
                    timeout_ms,
                    value: payload,
                }
            }
            op::ABORT => {
                let n = c.len32("rank count")?;
                let list = c.bytes(n.saturating_mul(4), "missing ranks")?;
                let missing = list
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let rest = c.bytes(payload.len() - c.position(), "reason")?;
                let reason = String::from_utf8_lossy(rest).into_owned();
                Self::Abort { missing, reason }
            }
            other => return Err(format!("unknown request op {other:#04x}")),
        };
        Ok(req)
    }
}

/// Parses the payload of a `CHALLENGE`: the store's nonce.
pub(crate) fn decode_challenge(payload: &[u8]) -> Result<Nonce, String> {
    let mut c = Cursor::new(payload);
    let nonce = c.array::<NONCE_LEN>("the store's nonce")?;
    c.finish("CHALLENGE")?;
    Ok(nonce)
}

/// Parses the payload of the `OK` that answers a HELLO: the store's proof.
pub(crate) fn decode_welcome(payload: &[u8]) -> Result<Proof, String> {
    let mut c = Cursor::new(payload);
    let proof = c.array::<PROOF_LEN>("the store's proof")?;
    c.finish("welcome")?;
    Ok(proof)
}

/// Encodes the payload of the `GATHERED` reply header part: the count and each length, as
/// slices to interleave with the values.
pub(crate) fn gathered_lengths(values: &[Vec<u8>]) -> io::Result<(Vec<u8>, Vec<[u8; 4]>)> {
    let count = u32_len(values.len())?.to_vec();
    let lens = values
        .iter()
        .map(|v| u32_len(v.len()))
        .collect::<io::Result<Vec<_>>>()?;
    Ok((count, lens))
}

/// Writes a `GATHERED` reply without copying the values.
pub(crate) fn write_gathered(w: &mut impl Write, values: &[Vec<u8>]) -> io::Result<()> {
    let (count, lens) = gathered_lengths(values)?;
    let mut parts: Vec<&[u8]> = Vec::with_capacity(1 + 2 * values.len());
    parts.push(&count);
    for (len, v) in lens.iter().zip(values) {
        parts.push(len);
        parts.push(v);
    }
    write_frame(w, op::GATHERED, &parts)
}

/// Parses a `GATHERED` payload.
pub(crate) fn decode_gathered(payload: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut c = Cursor::new(payload);
    let n = c.len32("rank count")?;
    // Each entry takes at least its 4-byte length: bound the count before allocating.
    if n > (payload.len() - 4) / 4 {
        return Err(format!("{n} entries cannot fit in {} bytes", payload.len()));
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let len = c.len32("entry length")?;
        out.push(c.bytes(len, &format!("entry {i}"))?.to_vec());
    }
    c.finish("GATHERED")?;
    Ok(out)
}

/// Error codes of the `ERROR` reply.
mod code {
    pub const WORLD_SIZE_MISMATCH: u8 = 1;
    pub const RANK_OUT_OF_RANGE: u8 = 2;
    pub const DUPLICATE_RANK: u8 = 3;
    pub const TOKEN_MISMATCH: u8 = 4;
    pub const TIMEOUT: u8 = 5;
    pub const JOB_FAILED: u8 = 6;
    pub const REJECTED: u8 = 7;
    pub const TOO_LARGE: u8 = 8;
    pub const PROTOCOL: u8 = 9;
    pub const CROWDED: u8 = 10;
}

/// Encodes an error as an `ERROR` payload: code (u8), number count (u32), numbers (u64 each),
/// string count (u16), strings (u32 length + UTF-8 each). Variants that have no code of their
/// own travel as `REJECTED` with their message.
pub(crate) fn encode_error(e: &RendezvousError) -> Vec<u8> {
    let n = |v: usize| u64::try_from(v).unwrap_or(u64::MAX);
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let (code, nums, strs): (u8, Vec<u64>, Vec<String>) = match e {
        RendezvousError::WorldSizeMismatch {
            rank,
            client,
            server,
        } => (
            code::WORLD_SIZE_MISMATCH,
            vec![n(*rank), n(*client), n(*server)],
            vec![],
        ),
        RendezvousError::RankOutOfRange { rank, world_size } => (
            code::RANK_OUT_OF_RANGE,
            vec![n(*rank), n(*world_size)],
            vec![],
        ),
        RendezvousError::DuplicateRank { rank, detail } => {
            (code::DUPLICATE_RANK, vec![n(*rank)], vec![detail.clone()])
        }
        // The token never travels: the refusal carries no strings at all.
        RendezvousError::JobTokenMismatch { .. } => (code::TOKEN_MISMATCH, vec![], vec![]),
        RendezvousError::Timeout {
            what,
            timeout,
            missing,
        } => (
            code::TIMEOUT,
            std::iter::once(ms(*timeout))
                .chain(missing.iter().map(|&r| n(r)))
                .collect(),
            vec![what.clone()],
        ),
        RendezvousError::JobFailed { reason, missing } => (
            code::JOB_FAILED,
            missing.iter().map(|&r| n(r)).collect(),
            vec![reason.clone()],
        ),
        RendezvousError::TooLarge { what, len, max } => {
            (code::TOO_LARGE, vec![n(*len), n(*max)], vec![what.clone()])
        }
        RendezvousError::Protocol { reason, .. } => (code::PROTOCOL, vec![], vec![reason.clone()]),
        RendezvousError::Rejected { reason } => (code::REJECTED, vec![], vec![reason.clone()]),
        RendezvousError::Crowded { reason, .. } => (code::CROWDED, vec![], vec![reason.clone()]),
        other => (code::REJECTED, vec![], vec![other.to_string()]),
    };
    // At most one number per rank plus one, and two strings: the counts always fit.
    let nums = &nums[..nums.len().min(super::MAX_WORLD_SIZE + 1)];
    let mut p = vec![code];
    p.extend_from_slice(&u32::try_from(nums.len()).unwrap_or(0).to_le_bytes());
    for v in nums {
        p.extend_from_slice(&v.to_le_bytes());
    }
    p.extend_from_slice(&u16::try_from(strs.len()).unwrap_or(0).to_le_bytes());
    for s in &strs {
        // Messages are short; clip anything absurd at 64 KiB on a character boundary.
        let s = clip(s, 64 * 1024);
        p.extend_from_slice(&u32::try_from(s.len()).unwrap_or(0).to_le_bytes());
        p.extend_from_slice(s.as_bytes());
    }
    p
}

/// Parses an `ERROR` payload back into the error it encodes. `peer` names the server for
/// protocol errors.
pub(crate) fn decode_error(payload: &[u8], peer: &str) -> Result<RendezvousError, String> {
    let mut c = Cursor::new(payload);
    let code = c.u8("error code")?;
    let n_nums = c.len32("number count")?;
    let raw = c.bytes(n_nums.saturating_mul(8), "numbers")?;
    let nums: Vec<usize> = raw
        .chunks_exact(8)
        .map(|b| {
            let v = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
            usize::try_from(v).unwrap_or(usize::MAX)
        })
        .collect();
    let n_strs = usize::from(c.u16("string count")?);
    let mut strs = Vec::new();
    for i in 0..n_strs {
        let len = c.len32("string length")?;
        let b = c.bytes(len, &format!("string {i}"))?;
        strs.push(String::from_utf8_lossy(b).into_owned());
    }
    c.finish("ERROR")?;
    let num = |i: usize| {
        nums.get(i)
            .copied()
            .ok_or_else(|| format!("error code {code} lacks number {i}"))
    };
    let text = |i: usize| strs.get(i).cloned().unwrap_or_default();
    Ok(match code {
        code::WORLD_SIZE_MISMATCH => RendezvousError::WorldSizeMismatch {
            rank: num(0)?,
            client: num(1)?,
            server: num(2)?,
        },
        code::RANK_OUT_OF_RANGE => RendezvousError::RankOutOfRange {
            rank: num(0)?,
            world_size: num(1)?,
        },
        code::DUPLICATE_RANK => RendezvousError::DuplicateRank {
            rank: num(0)?,
            detail: text(0),
        },
        code::TOKEN_MISMATCH => RendezvousError::JobTokenMismatch {
            store: peer.to_owned(),
        },
        code::TIMEOUT => RendezvousError::Timeout {
            what: text(0),
            timeout: Duration::from_millis(u64::try_from(num(0)?).unwrap_or(u64::MAX)),
            missing: nums[1..].to_vec(),
        },
        code::JOB_FAILED => RendezvousError::JobFailed {
            reason: text(0),
            missing: nums,
        },
        code::TOO_LARGE => RendezvousError::TooLarge {
            what: text(0),
            len: num(0)?,
            max: num(1)?,
        },
        code::PROTOCOL => RendezvousError::Protocol {
            peer: peer.to_owned(),
            reason: text(0),
        },
        code::REJECTED => RendezvousError::Rejected { reason: text(0) },
        code::CROWDED => RendezvousError::Crowded {
            store: peer.to_owned(),
            reason: text(0),
        },
        other => RendezvousError::Rejected {
            reason: format!("unknown error code {other}: {}", strs.join("; ")),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(bytes: &[u8], max: usize) -> Result<Frame, FrameError> {
        let mut r = bytes;
        let times = FrameTimes {
            start_by: None,
            within: Duration::from_secs(1),
            end_by: None,
        };
        read_frame(&mut r, max, times)
    }

    #[test]
    fn header_layout() {
        let h = header(op::GATHER, 0x0102_0304).unwrap();
        assert_eq!(h, [b'G', b'C', b'R', b'V', 3, 0x05, 0, 0, 4, 3, 2, 1]);
        assert_eq!(
            parse_header(&h, usize::MAX).unwrap(),
            (op::GATHER, 0x0102_0304)
        );
    }

    #[test]
    fn requests_round_trip() {
        let reqs = [
            Request::Hello {
                rank: 3,
                world_size: 8,
                nonce: [7; NONCE_LEN],
                proof: [9; PROOF_LEN],
            },
            Request::WaitAll { timeout_ms: 1500 },
            Request::Gather {
                round: 0,
                timeout_ms: 7,
                value: vec![],
            },
            Request::Gather {
                round: u64::MAX,
                timeout_ms: 0,
                value: b"hello".to_vec(),
            },
            Request::Abort {
                missing: vec![2, 7],
                reason: "rank 1 gave up".into(),
            },
        ];
        for req in reqs {
            let bytes = req.encode().unwrap();
            let frame = read(&bytes, MAX_REQUEST_PAYLOAD).unwrap();
            assert_eq!(Request::decode(frame.op, frame.payload).unwrap(), req);
        }
    }

    #[test]
    fn truncated_frames_are_reported() {
        let bytes = Request::Gather {
            round: 1,
            timeout_ms: 5,
            value: vec![7; 100],
        }
        .encode()
        .unwrap();
        assert!(matches!(read(&[], 1 << 20), Err(FrameError::Closed)));
        for cut in [
            1,
            5,
            FRAME_HEADER_LEN - 1,
            FRAME_HEADER_LEN,
            bytes.len() - 1,
        ] {
            match read(&bytes[..cut], 1 << 20) {
                Err(FrameError::Truncated { got, expected }) => {
                    assert_eq!(got, cut);
                    let want = if cut < FRAME_HEADER_LEN {
                        FRAME_HEADER_LEN
                    } else {
                        bytes.len()
                    };
                    assert_eq!(expected, want);
                }
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
    }

    #[test]
    fn bad_headers_are_rejected_before_allocating() {
        let mut h = header(op::GATHER, 10).unwrap();
        h[0] = b'X';
        assert!(matches!(read(&h, 100), Err(FrameError::BadMagic(_))));
        let mut h = header(op::GATHER, 10).unwrap();
        h[4] = 1;
        assert!(matches!(read(&h, 100), Err(FrameError::BadVersion(1))));
        let mut h = header(op::GATHER, 10).unwrap();
        h[7] = 1;
        assert!(matches!(
            read(&h, 100),
            Err(FrameError::BadReserved(0x0100))
        ));
        // A header that announces 4 GiB - 1 is refused from the header alone.
        let h = header(op::GATHER, u32::MAX as usize).unwrap();
        match read(&h, MAX_REQUEST_PAYLOAD) {
            Err(FrameError::TooLarge { len, max }) => {
                assert_eq!((len, max), (u32::MAX as usize, MAX_REQUEST_PAYLOAD));
            }
            other => panic!("{other:?}"),
        }
        // Just at the limit the header passes, and the missing payload is a truncation.
        let h = header(op::GATHER, 100).unwrap();
        assert!(matches!(read(&h, 100), Err(FrameError::Truncated { .. })));
    }

    #[test]
    fn malformed_payloads_are_errors_not_panics() {
        let bad: &[(u8, &[u8])] = &[
            (op::HELLO, &[1, 0, 0]),
            (op::HELLO, &[0u8; HELLO_LEN - 1]),
            (op::HELLO, &[0u8; HELLO_LEN + 1]),
            (op::WAIT_ALL, &[1, 2, 3, 4, 5]),
            (0x03, &[5, 0, b'a']),
            (0x04, &[0, 0, 0, 0, 0x10, 0]),
            (op::GATHER, &[1, 2, 3]),
            (op::ABORT, &[0xff, 0xff, 0xff, 0xff]),
            (0x7f, &[]),
            (op::OK, &[]),
        ];
        for (op, payload) in bad {
            assert!(
                Request::decode(*op, payload.to_vec()).is_err(),
                "{op:#x} {payload:?}"
            );
        }
        // A valid HELLO payload has exactly HELLO_LEN bytes.
        assert!(Request::decode(op::HELLO, vec![0u8; HELLO_LEN]).is_ok());
        assert!(decode_challenge(&[0u8; NONCE_LEN - 1]).is_err());
        assert!(decode_welcome(&[0u8; PROOF_LEN + 1]).is_err());
        // Every truncation of every valid ERROR and GATHERED payload fails cleanly.
        let err = encode_error(&RendezvousError::Timeout {
            what: "x".into(),
            timeout: Duration::from_secs(1),
            missing: vec![1, 2],
        });
        for cut in 0..err.len() {
            assert!(decode_error(&err[..cut], "peer").is_err());
        }
        let values = vec![b"ab".to_vec(), vec![], b"c".to_vec()];
        let mut buf = Vec::new();
        write_gathered(&mut buf, &values).unwrap();
        let payload = &buf[FRAME_HEADER_LEN..];
        assert_eq!(decode_gathered(payload).unwrap(), values);
        for cut in 0..payload.len() {
            assert!(decode_gathered(&payload[..cut]).is_err());
        }
        // A count far beyond the payload is refused before allocating.
        assert!(decode_gathered(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn errors_round_trip() {
        let errs = [
            RendezvousError::WorldSizeMismatch {
                rank: 1,
                client: 4,
                server: 3,
            },
            RendezvousError::RankOutOfRange {
                rank: 9,
                world_size: 4,
            },
            RendezvousError::DuplicateRank {
                rank: 2,
                detail: "a then b".into(),
            },
            RendezvousError::JobTokenMismatch {
                store: "peer".into(),
            },
            RendezvousError::Timeout {
                what: "all-gather round 3".into(),
                timeout: Duration::from_millis(2500),
                missing: vec![2, 3],
            },
            RendezvousError::JobFailed {
                reason: "rank 1 aborted".into(),
                missing: vec![5],
            },
            RendezvousError::TooLarge {
                what: "value".into(),
                len: 10,
                max: 5,
            },
            RendezvousError::Rejected {
                reason: "busy".into(),
            },
        ];
        for e in errs {
            let back = decode_error(&encode_error(&e), "peer").unwrap();
            assert_eq!(back.to_string(), e.to_string());
        }
        let other = RendezvousError::InvalidArgument { reason: "r".into() };
        let back = decode_error(&encode_error(&other), "peer").unwrap();
        assert!(
            matches!(back, RendezvousError::Rejected { reason } if reason.contains("invalid argument"))
        );
    }
}
