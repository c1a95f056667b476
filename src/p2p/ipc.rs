//! Passing file descriptors between the processes of one host, once at initialisation: each
//! process listens on an abstract Unix socket, publishes its name (through the job's exchange)
//! with a random nonce, and hands its descriptors (SCM_RIGHTS) to each peer that connects with
//! that nonce and runs as the same user. Every socket is closed when the exchange ends; the
//! received descriptors are owned by the caller.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use nix::sys::socket::{
    getsockopt, recvmsg, sendmsg, sockopt, ControlMessage, ControlMessageOwned, MsgFlags,
};

use crate::error::{Error, Result};

/// What a process publishes so that its peers can fetch its descriptors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Card {
    /// The abstract socket name it listens on.
    pub socket: String,
    /// The nonce a peer must present.
    pub nonce: u64,
}

impl Card {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = self.nonce.to_le_bytes().to_vec();
        v.extend_from_slice(self.socket.as_bytes());
        v
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Card> {
        if bytes.len() < 9 || bytes.len() > 200 {
            return Err(ipc_error(format!(
                "a peer's socket card has {} bytes",
                bytes.len()
            )));
        }
        let (n, s) = bytes.split_at(8);
        Ok(Card {
            nonce: u64::from_le_bytes(n.try_into().expect("8 bytes")),
            socket: String::from_utf8(s.to_vec())
                .map_err(|_| ipc_error("a peer's socket name is not UTF-8".into()))?,
        })
    }
}

fn ipc_error(reason: String) -> Error {
    Error::P2pUnavailable(format!("sharing GPU memory between processes: {reason}"))
}

fn io(during: &str) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| ipc_error(format!("{during}: {e}"))
}

/// A random 64-bit value (the standard library's per-process hash keys are random).
fn random_u64() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(std::process::id().into());
    h.finish()
}

/// A listener for this process's descriptors.
pub(crate) struct Server {
    listener: UnixListener,
    card: Card,
}

impl Server {
    /// Binds a fresh abstract socket.
    pub(crate) fn bind() -> Result<Server> {
        let nonce = random_u64();
        let socket = format!("gpucast-{}-{:016x}", std::process::id(), random_u64());
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

    /// Serves `fds` (with `header` in the message body) to `peers` connections, or until the
    /// deadline. A connection without the nonce or from another user gets nothing.
    pub(crate) fn serve(
        &self,
        header: &[u8],
        fds: &[OwnedFd],
        peers: usize,
        deadline: Instant,
    ) -> Result<()> {
        let raw: Vec<i32> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        let uid = nix::unistd::getuid();
        let mut served = 0;
        while served < peers {
            match self.listener.accept() {
                Ok((mut conn, _)) => {
                    conn.set_nonblocking(false)
                        .map_err(io("configuring a socket"))?;
                    let left = deadline.saturating_duration_since(Instant::now());
                    conn.set_read_timeout(Some(left.max(Duration::from_millis(10))))
                        .map_err(io("configuring a socket"))?;
                    let mut nonce = [0u8; 8];
                    if conn.read_exact(&mut nonce).is_err()
                        || u64::from_le_bytes(nonce) != self.card.nonce
                    {
                        tracing::warn!("a connection without the job's nonce was refused");
                        continue;
                    }
                    match getsockopt(&conn, sockopt::PeerCredentials) {
                        Ok(cred) if cred.uid() == uid.as_raw() => {}
                        _ => {
                            tracing::warn!("a connection from another user was refused");
                            continue;
                        }
                    }
                    let len = u32::try_from(header.len())
                        .expect("small header")
                        .to_le_bytes();
                    let iov = [IoSlice::new(&len), IoSlice::new(header)];
                    let cmsg = [ControlMessage::ScmRights(&raw)];
                    sendmsg::<()>(conn.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)
                        .map_err(|e| ipc_error(format!("sending descriptors: {e}")))?;
                    served += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        return Err(ipc_error(format!(
                            "only {served} of {peers} peer processes fetched this process's memory in time"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(io("accepting a peer")(e)),
            }
        }
        Ok(())
    }
}

/// Fetches a peer's descriptors: its header bytes and `expect` descriptors.
pub(crate) fn fetch(
    card: &Card,
    expect: usize,
    deadline: Instant,
) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
    let addr = SocketAddr::from_abstract_name(card.socket.as_bytes())
        .map_err(io("naming an abstract socket"))?;
    let mut conn = loop {
        match UnixStream::connect_addr(&addr) {
            Ok(c) => break c,
            Err(e) if Instant::now() > deadline => {
                return Err(io("connecting to a peer process")(e))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    };
    let left = deadline.saturating_duration_since(Instant::now());
    conn.set_read_timeout(Some(left.max(Duration::from_millis(10))))
        .map_err(io("configuring a socket"))?;
    conn.write_all(&card.nonce.to_le_bytes())
        .map_err(io("greeting a peer process"))?;
    let mut body = vec![0u8; 4 + 4096];
    let mut cmsg_buf = nix::cmsg_space!([i32; 16]);
    let (got, fds) = {
        let mut iov = [IoSliceMut::new(&mut body)];
        let msg = recvmsg::<()>(
            conn.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg_buf),
            MsgFlags::empty(),
        )
        .map_err(|e| ipc_error(format!("receiving descriptors: {e}")))?;
        let mut fds = Vec::new();
        for c in msg
            .cmsgs()
            .map_err(|e| ipc_error(format!("reading descriptors: {e}")))?
        {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: SCM_RIGHTS installed these descriptors in this process for us alone.
                fds.extend(
                    raw.into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        (msg.bytes, fds)
    };
    if fds.len() != expect || got < 4 {
        return Err(ipc_error(format!(
            "a peer process sent {} descriptors ({got} bytes), {expect} expected",
            fds.len()
        )));
    }
    let len = u32::from_le_bytes(body[..4].try_into().expect("4 bytes")) as usize;
    if 4 + len > got {
        return Err(ipc_error("a peer's message was cut short".into()));
    }
    Ok((body[4..4 + len].to_vec(), fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn cards_round_trip_and_reject_garbage() {
        let c = Card {
            socket: "gpucast-1-abc".into(),
            nonce: 42,
        };
        assert_eq!(Card::decode(&c.encode()).unwrap(), c);
        assert!(Card::decode(&[1, 2, 3]).is_err());
        assert!(Card::decode(&[0u8; 300]).is_err());
    }

    /// Descriptors of one thread's "process" reach another through the socket, and the
    /// received descriptor refers to the same open file.
    #[test]
    fn descriptors_pass_between_threads() {
        let server = Server::bind().unwrap();
        let card = server.card().clone();
        let (r, w) = nix::unistd::pipe().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let client = std::thread::spawn(move || fetch(&card, 1, deadline));
        server.serve(b"hello", &[w], 1, deadline).unwrap();
        let (header, mut fds) = client.join().unwrap().unwrap();
        assert_eq!(header, b"hello");
        let w2 = fds.pop().unwrap();
        nix::unistd::write(w2.as_fd(), b"xyz").unwrap();
        let mut buf = [0u8; 3];
        nix::unistd::read(r.as_fd(), &mut buf).unwrap();
        assert_eq!(&buf, b"xyz");
    }

    #[test]
    fn a_wrong_nonce_gets_nothing() {
        let server = Server::bind().unwrap();
        let mut card = server.card().clone();
        card.nonce ^= 1;
        let (_r, w) = nix::unistd::pipe().unwrap();
        let deadline = Instant::now() + Duration::from_millis(300);
        let client = std::thread::spawn(move || fetch(&card, 1, deadline));
        let served = server.serve(b"", &[w], 1, deadline);
        assert!(served.is_err(), "nobody with the nonce came");
        assert!(client.join().unwrap().is_err());
    }
}
