//! Passing file descriptors between the processes of one host, once at initialisation: each
//! process listens on an abstract Unix socket, publishes its name with a random 32-byte nonce
//! through the job's exchange (which only the job's processes got through), and hands its
//! descriptors (SCM_RIGHTS) to each peer that runs as the same user and presents the nonce.
//! Every socket is closed when the exchange ends; the received descriptors are owned by the
//! caller.
//!
//! An abstract socket is listed in /proc/net/unix for every user of the network namespace, and
//! anyone may connect to it. So the owner checks the peer's credentials (`SO_PEERCRED`) as soon
//! as it accepts, before reading a byte, and closes another user's connection at once; each
//! connection is served on a thread of its own within a short deadline, so a silent or failing
//! peer holds up nobody else. The fetching side checks the owner's credentials before it sends
//! the nonce, receives descriptors close-on-exec, owns (and so closes) every descriptor it
//! received on every path, takes exactly the number it expects and only kinds that can back
//! memory. (A filesystem socket in a private directory would hide the name, but processes in
//! different mount namespaces that share a network namespace, such as containers, would no
//! longer find each other.)

use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sys::socket::{getsockopt, sendmsg, sockopt, ControlMessage, MsgFlags};

use crate::error::{Error, Result};
use crate::util::{random_bytes, same_secret, Throttle};

/// Logging of refused and failed connections (strangers may make many).
static REFUSED: Throttle = Throttle::new();

/// Bytes of the nonce a peer presents.
const NONCE_LEN: usize = 32;
/// Longest a connection may take to present its nonce and take its descriptors.
const PER_PEER: Duration = Duration::from_secs(2);
/// Connections served at once; more wait for a free thread by being refused and retried.
const MAX_ACTIVE: usize = 32;
/// Longest header a peer's message may carry.
const MAX_HEADER: usize = 4096;
/// Bounds of a socket card: the nonce, then a name of at most 100 bytes.
const MAX_NAME: usize = 100;

/// What a process publishes so that its peers can fetch its descriptors. Its `Debug` form
/// leaves the nonce out.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Card {
    /// The abstract socket name it listens on.
    pub socket: String,
    /// The nonce a peer must present.
    pub nonce: [u8; NONCE_LEN],
}

impl std::fmt::Debug for Card {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Card")
            .field("socket", &self.socket)
            .finish_non_exhaustive()
    }
}

impl Card {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = self.nonce.to_vec();
        v.extend_from_slice(self.socket.as_bytes());
        v
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Card> {
        if bytes.len() <= NONCE_LEN || bytes.len() > NONCE_LEN + MAX_NAME {
            return Err(ipc_error(format!(
                "a peer's socket card has {} bytes",
                bytes.len()
            )));
        }
        let (n, s) = bytes.split_at(NONCE_LEN);
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(n);
        let socket = String::from_utf8(s.to_vec())
            .ok()
            .filter(|s| s.starts_with("gpucast-") && s.bytes().all(|b| b.is_ascii_graphic()))
            .ok_or_else(|| ipc_error("a peer's socket name is not one of gpucast's".into()))?;
        Ok(Card { socket, nonce })
    }
}

fn ipc_error(reason: String) -> Error {
    Error::P2pUnavailable(format!("sharing GPU memory between processes: {reason}"))
}

fn io(during: &str) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| ipc_error(format!("{during}: {e}"))
}

fn random<const N: usize>() -> Result<[u8; N]> {
    random_bytes::<N>().map_err(|e| ipc_error(e.to_string()))
}

/// The user id of the process at the other end of `conn`.
fn peer_uid(conn: &UnixStream) -> Option<u32> {
    getsockopt(conn, sockopt::PeerCredentials)
        .ok()
        .map(|c| c.uid())
}

/// A listener for this process's descriptors.
pub(crate) struct Server {
    listener: UnixListener,
    card: Card,
}

impl Server {
    /// Binds a fresh abstract socket with a fresh nonce.
    pub(crate) fn bind() -> Result<Server> {
        let nonce = random::<NONCE_LEN>()?;
        let tag: String = random::<8>()?.iter().map(|b| format!("{b:02x}")).collect();
        let socket = format!("gpucast-{}-{tag}", std::process::id());
        let addr = SocketAddr::from_abstract_name(socket.as_bytes())
            .map_err(io("naming an abstract socket"))?;
        let listener = UnixListener::bind_addr(&addr).map_err(io("binding an abstract socket"))?;
        listener
            .set_nonblocking(true)
            .map_err(io("configuring a socket"))?;
        Ok(Server {
            listener,
            card: Card { socket, nonce },
        })
    }

    pub(crate) fn card(&self) -> &Card {
        &self.card
    }

    /// Serves `fds` (with `header` in the message body) to `peers` connections of this user
    /// that present the nonce, or until the deadline. Another user's connection is closed
    /// before anything is read from it; a connection without the nonce, or one that fails,
    /// gets nothing and costs nobody else anything.
    pub(crate) fn serve(
        &self,
        header: &[u8],
        fds: &[OwnedFd],
        peers: usize,
        deadline: Instant,
    ) -> Result<()> {
        if header.len() > MAX_HEADER {
            return Err(ipc_error(format!("a {}-byte header", header.len())));
        }
        let raw: Vec<i32> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        let uid = nix::unistd::getuid().as_raw();
        let served = AtomicUsize::new(0);
        let (raw, served_ref, nonce) = (&raw, &served, &self.card.nonce);
        std::thread::scope(|scope| {
            // Each handler with a handle on its connection, to cut it when serving ends; a
            // finished handler's entry goes, and with it that descriptor.
            let mut handlers: Vec<(std::thread::ScopedJoinHandle<'_, ()>, Option<UnixStream>)> =
                Vec::new();
            let outcome = loop {
                if served.load(Ordering::Acquire) >= peers {
                    break Ok(());
                }
                // Checked on every turn: a flood of connections must not outlast the deadline.
                if Instant::now() > deadline {
                    break Err(ipc_error(format!(
                        "only {} of {peers} peer processes fetched this process's memory in time",
                        served.load(Ordering::Acquire)
                    )));
                }
                match self.listener.accept() {
                    Ok((conn, _)) => {
                        match peer_uid(&conn) {
                            Some(u) if u == uid => {}
                            other => {
                                if let Some(before) = REFUSED.allow() {
                                    tracing::warn!(uid = ?other, before, "a connection from another user was refused");
                                }
                                continue;
                            }
                        }
                        handlers.retain(|(h, _)| !h.is_finished());
                        if handlers.len() >= MAX_ACTIVE {
                            tracing::debug!("descriptor exchange busy: refusing a connection");
                            continue;
                        }
                        let cut = conn.try_clone().ok();
                        let by = deadline.min(Instant::now() + PER_PEER);
                        let handler = scope.spawn(move || match serve_one(conn, nonce, header, raw, by) {
                            Ok(()) => {
                                served_ref.fetch_add(1, Ordering::AcqRel);
                            }
                            Err(e) => {
                                if let Some(before) = REFUSED.allow() {
                                    tracing::warn!(error = %e, before, "a peer was not served its descriptors");
                                }
                            }
                        });
                        handlers.push((handler, cut));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::Interrupted | std::io::ErrorKind::ConnectionAborted
                        ) => {}
                    // Out of descriptors (a flood): the peers still come, so wait and go on.
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                        handlers.retain(|(h, _)| !h.is_finished());
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => break Err(io("accepting a peer")(e)),
                }
            };
            // Done or out of time: cut what is still open, so that every handler returns now.
            for (_, cut) in &handlers {
                if let Some(c) = cut {
                    let _ = c.shutdown(std::net::Shutdown::Both);
                }
            }
            outcome
        })
    }
}

/// One peer: its nonce within `by`, then the header and the descriptors.
fn serve_one(
    mut conn: UnixStream,
    nonce: &[u8; NONCE_LEN],
    header: &[u8],
    raw: &[i32],
    by: Instant,
) -> std::io::Result<()> {
    let left = by
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(left))?;
    conn.set_write_timeout(Some(left))?;
    let mut got = [0u8; NONCE_LEN];
    conn.read_exact(&mut got)?;
    if !same_secret(&got, nonce) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "a connection without the job's nonce",
        ));
    }
    let len = u32::try_from(header.len())
        .unwrap_or(u32::MAX)
        .to_le_bytes();
    let iov = [IoSlice::new(&len), IoSlice::new(header)];
    let cmsg = [ControlMessage::ScmRights(raw)];
    sendmsg::<()>(conn.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)
        .map_err(std::io::Error::from)?;
    Ok(())
}

/// What one `recvmsg` brought: bytes, the descriptors (owned: dropping them closes them) and
/// whether the kernel had to drop descriptors or bytes for want of room.
struct Received {
    bytes: usize,
    fds: Vec<OwnedFd>,
    truncated: bool,
}

/// `recvmsg` with room for `max_fds` descriptors, received close-on-exec. Every descriptor
/// the kernel installed is owned by the result before anything else is looked at.
fn recv_with_fds(conn: &UnixStream, body: &mut [u8], max_fds: usize) -> std::io::Result<Received> {
    let fd_bytes = u32::try_from(max_fds.max(1) * std::mem::size_of::<libc::c_int>())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    // u64 words: aligned for cmsghdr.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: body.as_mut_ptr().cast(),
        iov_len: body.len(),
    };
    // SAFETY: msghdr is a plain C struct for which all-zero is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: `msg` points to `iov` (over `body`) and `control`, both alive and of the
        // lengths given, for the duration of the call.
        let n = unsafe { libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: `msg` was filled by recvmsg: CMSG_FIRSTHDR/NXTHDR walk the control messages the
    // kernel wrote within `msg_controllen` bytes of `control`, and CMSG_DATA points inside one.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            let hdr = &*cmsg;
            if hdr.cmsg_level == libc::SOL_SOCKET && hdr.cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let header_len = data as usize - cmsg as usize;
                let count = (hdr.cmsg_len as usize).saturating_sub(header_len)
                    / std::mem::size_of::<libc::c_int>();
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                    // The kernel installed `fd` in this process for this message alone: it is
                    // ours to own and close.
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok(Received {
        bytes: usize::try_from(n).unwrap_or(0),
        fds,
        truncated: msg.msg_flags & (libc::MSG_CTRUNC | libc::MSG_TRUNC) != 0,
    })
}

/// Whether `fd` is of a kind that can back GPU memory (a device file, a memory file, or an
/// anonymous inode), not a socket, pipe, directory, block device or path-only descriptor.
fn check_memory_descriptor(fd: &OwnedFd) -> Result<()> {
    let st = nix::sys::stat::fstat(fd.as_fd())
        .map_err(|e| ipc_error(format!("fstat of a received descriptor: {e}")))?;
    let kind = st.st_mode & libc::S_IFMT;
    let flags = nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_GETFL)
        .map_err(|e| ipc_error(format!("flags of a received descriptor: {e}")))?;
    let path_only = flags & libc::O_PATH != 0;
    if path_only || !matches!(kind, 0 | libc::S_IFCHR | libc::S_IFREG) {
        return Err(ipc_error(format!(
            "a peer process sent a descriptor that is no memory (file type {kind:#o}{})",
            if path_only { ", path only" } else { "" }
        )));
    }
    Ok(())
}

/// Connects to the abstract socket `name`, retrying until `deadline` while nobody listens or
/// its queue is full. Non-blocking, so that a full queue (a flood) cannot hold the connect
/// past the deadline.
fn connect_by(name: &str, deadline: Instant) -> Result<UnixStream> {
    use nix::errno::Errno;
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
    let addr = UnixAddr::new_abstract(name.as_bytes())
        .map_err(|e| ipc_error(format!("naming an abstract socket: {e}")))?;
    loop {
        let fd = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(|e| ipc_error(format!("creating a socket: {e}")))?;
        match connect(fd.as_raw_fd(), &addr) {
            Ok(()) => {
                let conn = UnixStream::from(fd);
                conn.set_nonblocking(false)
                    .map_err(io("configuring a socket"))?;
                return Ok(conn);
            }
            Err(e @ (Errno::EAGAIN | Errno::ECONNREFUSED | Errno::ENOENT | Errno::EINPROGRESS)) => {
                if Instant::now() > deadline {
                    return Err(ipc_error(format!("connecting to a peer process: {e}")));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(ipc_error(format!("connecting to a peer process: {e}"))),
        }
    }
}

/// Fetches a peer's descriptors: its header bytes and exactly `expect` descriptors.
pub(crate) fn fetch(
    card: &Card,
    expect: usize,
    deadline: Instant,
) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut conn = connect_by(&card.socket, deadline)?;
    // The nonce goes only to a process of this user.
    let uid = nix::unistd::getuid().as_raw();
    match peer_uid(&conn) {
        Some(u) if u == uid => {}
        other => {
            return Err(ipc_error(format!(
                "the socket {} belongs to another user ({other:?}), not this job's peer",
                card.socket
            )))
        }
    }
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(10));
    conn.set_read_timeout(Some(left))
        .and_then(|()| conn.set_write_timeout(Some(left)))
        .map_err(io("configuring a socket"))?;
    conn.write_all(&card.nonce)
        .map_err(io("greeting a peer process"))?;
    let mut body = vec![0u8; 4 + MAX_HEADER];
    let got = recv_with_fds(&conn, &mut body, expect).map_err(io("receiving descriptors"))?;
    // From here every received descriptor is owned by `got.fds`: any error closes them all.
    if got.truncated || got.fds.len() != expect {
        return Err(ipc_error(format!(
            "a peer process sent {}{} descriptors, {expect} expected",
            if got.truncated { "more than " } else { "" },
            got.fds.len()
        )));
    }
    for fd in &got.fds {
        check_memory_descriptor(fd)?;
    }
    if got.bytes < 4 {
        return Err(ipc_error("a peer's message was cut short".into()));
    }
    let len = u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize;
    if len > MAX_HEADER {
        return Err(ipc_error(format!("a peer's header of {len} bytes")));
    }
    if got.bytes < 4 + len {
        conn.read_exact(&mut body[got.bytes..4 + len])
            .map_err(io("receiving a peer's header"))?;
    }
    Ok((body[4..4 + len].to_vec(), got.fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn cards_round_trip_and_reject_garbage() {
        let c = Card {
            socket: "gpucast-1-abc".into(),
            nonce: [42; NONCE_LEN],
        };
        assert_eq!(Card::decode(&c.encode()).unwrap(), c);
        assert!(!format!("{c:?}").contains("42"), "{c:?}");
        assert!(Card::decode(&[1, 2, 3]).is_err());
        assert!(Card::decode(&[0u8; NONCE_LEN]).is_err());
        assert!(Card::decode(&[0u8; 300]).is_err());
        let mut other = vec![0u8; NONCE_LEN];
        other.extend_from_slice(b"systemd-private");
        assert!(Card::decode(&other).is_err(), "not a name of gpucast's");
    }

    /// A regular file of this test's own, for a descriptor that can be mapped.
    fn scratch_file(tag: &str) -> (std::path::PathBuf, std::fs::File) {
        let path = std::env::temp_dir().join(format!(
            "gpucast-ipc-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        (path, f)
    }

    /// Descriptors of one thread's "process" reach another through the socket, and the
    /// received descriptor refers to the same open file.
    #[test]
    fn descriptors_pass_between_threads() {
        use std::io::{Seek, SeekFrom};
        let server = Server::bind().unwrap();
        let card = server.card().clone();
        let (path, mut file) = scratch_file("pass");
        let shared: OwnedFd = file.try_clone().unwrap().into();
        let deadline = Instant::now() + Duration::from_secs(5);
        let client = std::thread::spawn(move || fetch(&card, 1, deadline));
        server.serve(b"hello", &[shared], 1, deadline).unwrap();
        let (header, mut fds) = client.join().unwrap().unwrap();
        assert_eq!(header, b"hello");
        let mut got = std::fs::File::from(fds.pop().unwrap());
        got.write_all(b"xyz").unwrap();
        file.seek(SeekFrom::Start(0)).unwrap();
        let mut buf = [0u8; 3];
        file.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"xyz");
        std::fs::remove_file(path).unwrap();
    }

    fn nonce_bytes(card: &Card) -> Vec<u8> {
        card.nonce.to_vec()
    }

    /// A connection that says nothing, made before the real peer: the peer is still served.
    #[test]
    fn a_silent_connection_does_not_stall_the_others() {
        let server = Server::bind().unwrap();
        let card = server.card().clone();
        let w: OwnedFd = std::fs::File::open("/dev/zero").unwrap().into();
        let deadline = Instant::now() + Duration::from_secs(3);
        let addr = SocketAddr::from_abstract_name(card.socket.as_bytes()).unwrap();
        let silent = UnixStream::connect_addr(&addr).unwrap();
        let c = card.clone();
        let client = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let started = Instant::now();
            let got = fetch(&c, 1, Instant::now() + Duration::from_secs(1));
            (got, started.elapsed())
        });
        let served = server.serve(b"h", &[w], 1, deadline);
        let (got, took) = client.join().unwrap();
        drop(silent);
        assert!(got.is_ok(), "the real peer was not served: {:?}", got.err());
        assert!(took < Duration::from_millis(500), "served after {took:?}");
        served.unwrap();
    }

    /// One peer that leaves before its descriptors are sent does not end service for another.
    #[test]
    fn one_bad_peer_does_not_end_service() {
        let server = Server::bind().unwrap();
        let card = server.card().clone();
        let w: OwnedFd = std::fs::File::open("/dev/zero").unwrap().into();
        let deadline = Instant::now() + Duration::from_millis(1500);
        let addr = SocketAddr::from_abstract_name(card.socket.as_bytes()).unwrap();
        // Says the nonce and leaves at once: the send to it fails.
        let mut quitter = UnixStream::connect_addr(&addr).unwrap();
        quitter.write_all(&nonce_bytes(&card)).unwrap();
        drop(quitter);
        let c = card.clone();
        let client = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            fetch(&c, 1, Instant::now() + Duration::from_secs(1))
        });
        let _ = server.serve(b"h", &[w], 2, deadline);
        let got = client.join().unwrap();
        assert!(got.is_ok(), "the good peer was not served: {:?}", got.err());
    }

    /// A connection from another user is closed at once, before the server reads a byte of it.
    /// Needs root (to start the other user's process) and python3; skips otherwise.
    #[test]
    fn another_user_is_turned_away_before_any_read() {
        use std::os::unix::process::CommandExt;
        if !nix::unistd::getuid().is_root() {
            eprintln!("SKIPPED: needs root to run a process as another user");
            return;
        }
        let server = Server::bind().unwrap();
        let card = server.card().clone();
        let (_r, w) = nix::unistd::pipe().unwrap();
        // Connects as uid 65534, sends nothing, and reports how long until the server hangs up.
        let script = format!(
            "import socket,time\n\
             s=socket.socket(socket.AF_UNIX,socket.SOCK_STREAM)\n\
             s.connect('\\0{}')\n\
             s.settimeout(3)\n\
             t=time.time()\n\
             try:\n  d=s.recv(1)\nexcept Exception:\n  d=b'timeout'\n\
             print(round((time.time()-t)*1000), d)\n",
            card.socket
        );
        let child = std::process::Command::new("python3")
            .args(["-c", &script])
            .uid(65534)
            .gid(65534)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn();
        let Ok(child) = child else {
            eprintln!("SKIPPED: python3 is not available");
            return;
        };
        let deadline = Instant::now() + Duration::from_millis(1500);
        let _ = server.serve(b"h", &[w], 1, deadline);
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let ms: u64 = text
            .split_whitespace()
            .next()
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| {
                panic!(
                    "python said {text:?} / {:?}",
                    String::from_utf8_lossy(&out.stderr)
                )
            });
        assert!(
            ms < 300 && text.contains("b''"),
            "another user's connection stayed open {ms} ms: {text}"
        );
    }

    /// A flood of connections from another user, refused as fast as they come: serving still
    /// ends at its deadline. Needs root and python3, as above; skips otherwise.
    #[test]
    fn a_flood_does_not_outlast_the_deadline() {
        use std::os::unix::process::CommandExt;
        if !nix::unistd::getuid().is_root() {
            eprintln!("SKIPPED: needs root to run a process as another user");
            return;
        }
        let server = Server::bind().unwrap();
        let card = server.card().clone();
        let w: OwnedFd = std::fs::File::open("/dev/zero").unwrap().into();
        // Eight threads of uid 65534 that connect and close for 3 s.
        let script = format!(
            "import socket,threading,time\n\
             end=time.time()+3\n\
             def f():\n  while time.time()<end:\n    s=socket.socket(socket.AF_UNIX,socket.SOCK_STREAM)\n    s.settimeout(0.2)\n    try:\n      s.connect('\\0{}')\n    except Exception:\n      pass\n    s.close()\n\
             ts=[threading.Thread(target=f) for _ in range(8)]\n\
             [t.start() for t in ts]\n[t.join() for t in ts]\n",
            card.socket
        );
        let child = std::process::Command::new("python3")
            .args(["-c", &script])
            .uid(65534)
            .gid(65534)
            .spawn();
        let Ok(mut child) = child else {
            eprintln!("SKIPPED: python3 is not available");
            return;
        };
        std::thread::sleep(Duration::from_millis(300));
        let started = Instant::now();
        let served = server.serve(b"h", &[w], 1, started + Duration::from_millis(300));
        let took = started.elapsed();
        drop(server);
        child.wait().unwrap();
        assert!(served.is_err(), "nobody with the nonce came");
        assert!(
            took < Duration::from_millis(800),
            "serving ended after {took:?}"
        );
    }

    /// A fake peer that answers with `fds`: fetch must close everything it got on every error
    /// path, and set close-on-exec on what it keeps.
    fn fake_peer(fds: Vec<OwnedFd>) -> (Card, std::thread::JoinHandle<()>) {
        let tag: String = random::<8>()
            .unwrap()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let name = format!("gpucast-test-{}-{tag}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixListener::bind_addr(&addr).unwrap();
        let card = Card {
            socket: name,
            nonce: [7; NONCE_LEN],
        };
        let h = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut nonce = vec![0u8; NONCE_LEN];
            let _ = conn.read_exact(&mut nonce);
            let raw: Vec<i32> = fds.iter().map(AsRawFd::as_raw_fd).collect();
            let len = 4u32.to_le_bytes();
            let body = 1u32.to_le_bytes();
            let iov = [IoSlice::new(&len), IoSlice::new(&body)];
            let cmsg = [ControlMessage::ScmRights(&raw)];
            let _ = sendmsg::<()>(conn.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None);
            std::thread::sleep(Duration::from_millis(200));
        });
        (card, h)
    }

    /// Descriptors of this process open on `path` (other tests open and close descriptors
    /// of their own meanwhile, so a count of all of them is no measure).
    fn fds_on(path: &std::path::Path) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| target == path)
            .count()
    }

    #[test]
    fn too_many_descriptors_are_all_closed() {
        let path = std::env::temp_dir().join(format!("gpucast-fds-{}", std::process::id()));
        std::fs::write(&path, b"").unwrap();
        let path = path.canonicalize().unwrap();
        for sent in [2, 20, 250] {
            let fds: Vec<OwnedFd> = (0..sent)
                .map(|_| std::fs::File::open(&path).unwrap().into())
                .collect();
            let (card, peer) = fake_peer(fds);
            let got = fetch(&card, 1, Instant::now() + Duration::from_secs(2));
            assert!(got.is_err(), "{sent} descriptors for 1 were accepted");
            peer.join().unwrap();
        }
        let left = fds_on(&path);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(left, 0, "{left} descriptors leaked");
    }

    #[test]
    fn only_memory_descriptors_are_accepted_and_kept_close_on_exec() {
        // A socket is no memory.
        let (a, _b) = UnixStream::pair().unwrap();
        let (card, peer) = fake_peer(vec![a.into()]);
        let got = fetch(&card, 1, Instant::now() + Duration::from_secs(2));
        peer.join().unwrap();
        assert!(got.is_err(), "a socket was accepted as a memory descriptor");
        // A pipe is no memory either.
        let (_r, w) = nix::unistd::pipe().unwrap();
        let (card, peer) = fake_peer(vec![w]);
        let got = fetch(&card, 1, Instant::now() + Duration::from_secs(2));
        peer.join().unwrap();
        assert!(got.is_err(), "a pipe was accepted as a memory descriptor");
        // A device file that can be mapped is accepted, close-on-exec.
        let f = std::fs::File::open("/dev/zero").unwrap();
        let (card, peer) = fake_peer(vec![f.into()]);
        let (_, fds) = fetch(&card, 1, Instant::now() + Duration::from_secs(2)).unwrap();
        peer.join().unwrap();
        let flags = nix::fcntl::fcntl(fds[0].as_fd(), nix::fcntl::FcntlArg::F_GETFD).unwrap();
        assert!(
            nix::fcntl::FdFlag::from_bits_truncate(flags).contains(nix::fcntl::FdFlag::FD_CLOEXEC),
            "a received descriptor would leak into exec'd children"
        );
    }

    #[test]
    fn a_wrong_nonce_gets_nothing() {
        let server = Server::bind().unwrap();
        let mut card = server.card().clone();
        card.nonce[0] ^= 1;
        let (_r, w) = nix::unistd::pipe().unwrap();
        let deadline = Instant::now() + Duration::from_millis(300);
        let client = std::thread::spawn(move || fetch(&card, 1, deadline));
        let served = server.serve(b"", &[w], 1, deadline);
        assert!(served.is_err(), "nobody with the nonce came");
        assert!(client.join().unwrap().is_err());
    }
}
