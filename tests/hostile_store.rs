//! Hostile clients against a live rendezvous: each test runs the ranks of a job as threads of
//! this process (rank 0 hosts the store on a free port of 127.0.0.1), attacks that port from raw
//! sockets, and checks that the job still forms in time, that nothing secret comes back, and
//! that the store's memory stays bounded. No GPU is needed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use gpucast::rendezvous::{Exchange, JobEnv, Rendezvous, RendezvousError};

/// The job's secret: long and random-looking, so that finding it in a reply is no accident.
const SECRET: &str = "s3cr3t-7f1c9a2e4b8d6053-only-the-job-knows";

/// These tests hold hundreds of sockets at once (several tests run in parallel): lift the soft
/// limit on open files to the hard one, as a machine with a low default would otherwise fail
/// them for want of descriptors.
fn enough_descriptors() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the one struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max.min(65536);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn free_port() -> u16 {
    enough_descriptors();
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn job(rank: usize, world: usize, port: u16, token: &str) -> JobEnv {
    let mut env = JobEnv::single_node(rank, world, port).unwrap();
    env.job_token = token.to_owned();
    env
}

/// One rank on its own thread: joins, passes a barrier (so rank 0 keeps the store up until
/// everyone is in), and returns how long joining took.
fn spawn_rank(
    rank: usize,
    world: usize,
    port: u16,
    timeout: Duration,
) -> JoinHandle<Result<Duration, RendezvousError>> {
    thread::spawn(move || {
        let started = Instant::now();
        let rdv = Rendezvous::connect(&job(rank, world, port, SECRET), timeout)?;
        let joined = started.elapsed();
        let all = rdv.all_gather(&[u8::try_from(rank).unwrap(); 3])?;
        assert_eq!(all.len(), world);
        for (r, v) in all.iter().enumerate() {
            assert_eq!(v, &[u8::try_from(r).unwrap(); 3]);
        }
        rdv.barrier()?;
        Ok(joined)
    })
}

/// Waits until something listens on `port` (rank 0's store is up).
fn wait_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        assert!(Instant::now() < deadline, "the store never listened");
        thread::sleep(Duration::from_millis(5));
    }
}

/// Reads whatever the peer sends until it closes the connection or `limit` passes.
fn read_all(s: &mut TcpStream, limit: Duration) -> Vec<u8> {
    let deadline = Instant::now() + limit;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return out;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// An admission message header of gpucast's store: magic, version, kind, body length.
fn header(version: u8, kind: u8, len: u32) -> Vec<u8> {
    let mut h = b"GCRV".to_vec();
    h.extend_from_slice(&[version, kind]);
    h.extend_from_slice(&len.to_le_bytes());
    h
}

/// The version the store speaks, from the challenge it sends unasked.
fn store_version(addr: SocketAddr) -> u8 {
    let mut s = TcpStream::connect(addr).unwrap();
    let got = read_all(&mut s, Duration::from_millis(300));
    assert!(got.starts_with(b"GCRV") && got.len() >= 5, "{got:?}");
    got[4]
}

/// A HELLO of the right shape for `rank` of `world`, with a proof made without the token.
fn forged_hello(version: u8, rank: u32, world: u32, proof: u8) -> Vec<u8> {
    let mut f = header(version, b'H', 72);
    f.extend_from_slice(&rank.to_le_bytes());
    f.extend_from_slice(&world.to_le_bytes());
    f.extend_from_slice(&[9; 32]);
    f.extend_from_slice(&[proof; 32]);
    f
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Resident memory of this process, in bytes.
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// How long a job of `world` ranks takes to form and pass two rounds when nobody attacks it.
fn normal_join(world: usize) -> Duration {
    let port = free_port();
    let started = Instant::now();
    let ranks: Vec<_> = (0..world)
        .map(|r| spawn_rank(r, world, port, Duration::from_secs(10)))
        .collect();
    for r in ranks {
        r.join().unwrap().unwrap();
    }
    started.elapsed()
}

/// A wrong token gets no secret back: not the store's token, in no reply, and the job forms.
#[test]
fn a_wrong_token_learns_nothing_and_hurts_nobody() {
    let port = free_port();
    let rank0 = spawn_rank(0, 2, port, Duration::from_secs(10));
    wait_listening(port);
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let version = store_version(addr);
    for proof in [0u8, 1, 0xff] {
        let mut s = TcpStream::connect(addr).unwrap();
        // The store's challenge, then a HELLO whose proof was made without the token.
        let mut got = read_all(&mut s, Duration::from_millis(100));
        let _ = s.write_all(&forged_hello(version, 1, 2, proof));
        let answer = read_all(&mut s, Duration::from_secs(3));
        assert_eq!(answer, header(version, b'T', 0), "not refused as unproven");
        got.extend(answer);
        assert!(
            !contains(&got, SECRET.as_bytes()),
            "the store sent its token to a forged HELLO: {:?}",
            String::from_utf8_lossy(&got)
        );
    }
    // A well-formed attempt with another token, claiming the free rank before the job forms:
    // refused as such. Were it admitted, the real rank 1 would fail the job as a duplicate.
    match Rendezvous::connect(
        &job(1, 2, port, "the token of another job, long enough"),
        Duration::from_secs(2),
    ) {
        Err(e @ RendezvousError::JobTokenMismatch { .. }) => {
            assert!(!e.to_string().contains(SECRET), "{e}");
        }
        other => panic!("expected JobTokenMismatch, got {other:?}"),
    }
    let rank1 = spawn_rank(1, 2, port, Duration::from_secs(10));
    rank0.join().unwrap().unwrap();
    rank1.join().unwrap().unwrap();
}

/// Nothing prints the token: not the job's debug form, not the errors about it.
#[test]
fn the_token_is_never_printed() {
    let env = job(0, 2, 4000, SECRET);
    assert!(!format!("{env:?}").contains(SECRET), "{env:?}");
    let long = format!("{SECRET}{}", "x".repeat(300));
    let e = JobEnv::from_lookup(|k| match k {
        "RANK" => Some("0".into()),
        "WORLD_SIZE" => Some("1".into()),
        "GPUCAST_JOB_TOKEN" => Some(long.clone()),
        _ => None,
    })
    .unwrap_err();
    assert!(!e.to_string().contains(SECRET), "{e}");
    assert!(!format!("{e:?}").contains(SECRET), "{e:?}");
    let builder = gpucast::Communicator::builder().job(env);
    assert!(!format!("{builder:?}").contains(SECRET), "{builder:?}");
}

/// 500 idle connections that never say a word, opened before the ranks come: the job still
/// forms within a second of its normal time.
#[test]
fn five_hundred_idle_connections_do_not_delay_the_job() {
    let normal = normal_join(3);
    let port = free_port();
    let rank0 = spawn_rank(0, 3, port, Duration::from_secs(20));
    wait_listening(port);
    let idle: Vec<TcpStream> = (0..500)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", port)).ok())
        .collect();
    assert!(
        idle.len() > 400,
        "only {} connections were accepted",
        idle.len()
    );
    let started = Instant::now();
    let others: Vec<_> = (1..3)
        .map(|r| spawn_rank(r, 3, port, Duration::from_secs(20)))
        .collect();
    for r in others {
        r.join().unwrap().unwrap();
    }
    rank0.join().unwrap().unwrap();
    let took = started.elapsed();
    println!("500 idle connections: joined in {took:?}, {normal:?} alone");
    assert!(
        took < normal + Duration::from_secs(1),
        "the job took {took:?} beside 500 idle connections, {normal:?} alone"
    );
    drop(idle);
}

/// Sockets that reconnect as soon as the store drops them, and sockets that dribble a HELLO
/// one byte at a time, all the while the ranks join.
#[test]
fn reconnecting_and_dribbling_sockets_do_not_keep_the_ranks_out() {
    let normal = normal_join(3);
    let port = free_port();
    let rank0 = spawn_rank(0, 3, port, Duration::from_secs(20));
    wait_listening(port);
    let stop = Arc::new(AtomicBool::new(false));
    let mut attackers = Vec::new();
    for i in 0..80 {
        let stop = Arc::clone(&stop);
        attackers.push(thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
                    thread::sleep(Duration::from_millis(1));
                    continue;
                };
                if i % 2 == 0 {
                    // Idle until the store closes it.
                    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
                    let mut b = [0u8; 64];
                    while !stop.load(Ordering::Relaxed) {
                        match s.read(&mut b) {
                            Ok(0) => break,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                            Err(_) => break,
                            Ok(_) => {}
                        }
                    }
                } else {
                    // A HELLO, one byte every 50 ms.
                    for b in forged_hello(4, 1, 3, 0) {
                        if stop.load(Ordering::Relaxed) || s.write_all(&[b]).is_err() {
                            break;
                        }
                        thread::sleep(Duration::from_millis(50));
                    }
                }
            }
        }));
    }
    thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let others: Vec<_> = (1..3)
        .map(|r| spawn_rank(r, 3, port, Duration::from_secs(20)))
        .collect();
    let results: Vec<_> = others.into_iter().map(|r| r.join().unwrap()).collect();
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        a.join().unwrap();
    }
    for r in results {
        r.unwrap();
    }
    rank0.join().unwrap().unwrap();
    println!("80 reconnecting and dribbling sockets: joined in {took:?}, {normal:?} alone");
    assert!(
        took < normal + Duration::from_secs(1),
        "the job took {took:?} beside 80 hostile sockets, {normal:?} alone"
    );
}

/// Messages that announce a large body before any HELLO, then stream it: the store must not
/// buffer them (66 connections of 16 MiB each would be over 1 GiB).
#[test]
fn large_frames_before_hello_cost_no_memory() {
    let port = free_port();
    let rank0 = spawn_rank(0, 2, port, Duration::from_secs(30));
    wait_listening(port);
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let version = store_version(addr);
    let before = rss();
    let streams: Vec<_> = (0..66)
        .map(|_| {
            thread::spawn(move || {
                let Ok(mut s) = TcpStream::connect(addr) else {
                    return;
                };
                let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
                if s.write_all(&header(version, b'H', (16 << 20) - 64))
                    .is_err()
                {
                    return;
                }
                let chunk = vec![0x5au8; 1 << 20];
                for _ in 0..16 {
                    if s.write_all(&chunk).is_err() {
                        return;
                    }
                }
                thread::sleep(Duration::from_millis(500));
            })
        })
        .collect();
    // Sample the peak while the streams are held.
    let mut peak = 0;
    let sample_until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < sample_until {
        peak = peak.max(rss().saturating_sub(before));
        thread::sleep(Duration::from_millis(20));
    }
    for s in streams {
        s.join().unwrap();
    }
    println!(
        "66 frames of 16 MiB before HELLO: resident memory grew by at most {} KiB",
        peak >> 10
    );
    assert!(
        peak < 128 << 20,
        "resident memory grew by {} MiB while 66 clients streamed frames before HELLO",
        peak >> 20
    );
    let rank1 = spawn_rank(1, 2, port, Duration::from_secs(10));
    rank0.join().unwrap().unwrap();
    rank1.join().unwrap().unwrap();
}

/// Forwards one connection to the store and keeps what the client sent.
fn proxy(listener: TcpListener, store: SocketAddr, sent: Arc<Mutex<Vec<u8>>>) {
    let (client, _) = listener.accept().unwrap();
    let server = TcpStream::connect(store).unwrap();
    let (mut c_read, mut s_write) = (client.try_clone().unwrap(), server.try_clone().unwrap());
    let up = thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = c_read.read(&mut buf) {
            if n == 0 || s_write.write_all(&buf[..n]).is_err() {
                break;
            }
            sent.lock().unwrap().extend_from_slice(&buf[..n]);
        }
        let _ = s_write.shutdown(std::net::Shutdown::Write);
    });
    let (mut s_read, mut c_write) = (server, client);
    let mut buf = [0u8; 4096];
    while let Ok(n) = s_read.read(&mut buf) {
        if n == 0 || c_write.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = c_write.shutdown(std::net::Shutdown::Write);
    up.join().unwrap();
}

/// Admission messages at the start of `bytes`: (kind, body) of each complete one, up to the
/// first that is not one (the c10d requests after a HELLO).
fn frames(bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while rest.len() >= 10 && rest.starts_with(b"GCRV") {
        let len = u32::from_le_bytes(rest[6..10].try_into().unwrap()) as usize;
        if rest.len() < 10 + len {
            break;
        }
        out.push((rest[5], rest[10..10 + len].to_vec()));
        rest = &rest[10 + len..];
    }
    out
}

/// What rank 1 sent to the store through a proxy, replayed on a fresh connection while the
/// job is still forming (rank 2 has not come yet): refused as not proving the token, without
/// registering anyone or failing the job; rank 2 then joins and all three work.
#[test]
fn a_captured_hello_replays_nowhere() {
    let port = free_port();
    let store: SocketAddr = ([127, 0, 0, 1], port).into();
    let world = 3;
    let member = move |rank: usize, via: u16| {
        thread::spawn(move || {
            let mut env = job(rank, world, port, SECRET);
            env.master_port = via;
            let rdv = Rendezvous::connect(&env, Duration::from_secs(15))?;
            let all = rdv.all_gather(b"after")?;
            rdv.barrier()?;
            Ok::<_, RendezvousError>(all)
        })
    };
    let rank0 = member(0, port);
    wait_listening(port);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_port = listener.local_addr().unwrap().port();
    let sent = Arc::new(Mutex::new(Vec::new()));
    let captured = Arc::clone(&sent);
    let proxy = thread::spawn(move || proxy(listener, store, captured));
    let rank1 = member(1, proxy_port);
    // The first message rank 1 sends is its HELLO (10-byte header, then the body).
    let deadline = Instant::now() + Duration::from_secs(5);
    let hello = loop {
        let bytes = sent.lock().unwrap().clone();
        if let Some((kind, payload)) = frames(&bytes).first() {
            assert_eq!(*kind, b'H');
            let mut f = bytes[..10].to_vec();
            f.extend_from_slice(payload);
            break f;
        }
        assert!(Instant::now() < deadline, "nothing captured");
        thread::sleep(Duration::from_millis(5));
    };
    thread::sleep(Duration::from_millis(200));
    let mut replay = TcpStream::connect(store).unwrap();
    let _ = replay.write_all(&hello);
    let reply = read_all(&mut replay, Duration::from_secs(2));
    let answers = frames(&reply);
    // The store's challenge (a fresh nonce), then "token refused": the proof does not hold.
    assert_eq!(answers.len(), 2, "{answers:?}");
    assert_eq!(answers[0].0, b'C');
    assert_eq!(answers[1], (b'T', vec![]), "not refused as unproven");
    let rank2 = member(2, port);
    let want = vec![b"after".to_vec(); world];
    for r in [rank0, rank1, rank2] {
        assert_eq!(r.join().unwrap().unwrap(), want);
    }
    drop(replay);
    proxy.join().unwrap();
}

/// After the job formed, a process with the token that claims a rank again, or another world
/// size, gets an error; the job goes on.
#[test]
fn late_claims_after_the_rendezvous_do_not_fail_the_job() {
    let port = free_port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            thread::spawn(move || {
                let rdv =
                    Rendezvous::connect(&job(rank, 2, port, SECRET), Duration::from_secs(10))?;
                rdv.barrier()?;
                thread::sleep(Duration::from_millis(1000));
                let all = rdv.all_gather(b"still")?;
                rdv.barrier()?;
                Ok::<_, RendezvousError>(all)
            })
        })
        .collect();
    wait_listening(port);
    thread::sleep(Duration::from_millis(300));
    let dup = Rendezvous::connect(&job(1, 2, port, SECRET), Duration::from_millis(500));
    assert!(dup.is_err(), "a second rank 1 was admitted");
    let mut three = job(2, 3, port, SECRET);
    three.local_world_size = 3;
    let wrong = Rendezvous::connect(&three, Duration::from_millis(500));
    assert!(wrong.is_err(), "a rank of another world size was admitted");
    for r in ranks {
        assert_eq!(
            r.join().unwrap().unwrap(),
            [b"still".to_vec(), b"still".to_vec()]
        );
    }
}

/// A "store" that accepts and closes every connection at once: the error says so, rather than
/// blaming a connect that succeeded every time.
#[test]
fn the_final_error_names_the_real_cause() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    listener.set_nonblocking(true).unwrap();
    let closer = thread::spawn(move || {
        while !stop2.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((s, _)) => drop(s),
                Err(_) => thread::sleep(Duration::from_millis(1)),
            }
        }
    });
    let started = Instant::now();
    let e = Rendezvous::connect(&job(1, 2, port, SECRET), Duration::from_millis(800)).unwrap_err();
    stop.store(true, Ordering::Relaxed);
    closer.join().unwrap();
    assert!(started.elapsed() < Duration::from_secs(3));
    let msg = e.to_string();
    assert!(
        !matches!(e, RendezvousError::ConnectTimeout { .. }),
        "every connect succeeded, yet the error blames connecting: {msg}"
    );
    assert!(msg.contains("closed"), "{msg}");
}

/// A timeout too long for the clock ("no limit") is a far deadline, not a panic.
#[test]
fn huge_timeouts_are_far_deadlines() {
    let port = free_port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            thread::spawn(move || {
                let mut rdv = Rendezvous::connect(&job(rank, 2, port, SECRET), Duration::MAX)?;
                rdv.set_timeout(Duration::MAX);
                let all = rdv.all_gather(b"far")?;
                rdv.barrier()?;
                Ok::<_, RendezvousError>(all)
            })
        })
        .collect();
    for r in ranks {
        assert_eq!(
            r.join().unwrap().unwrap(),
            [b"far".to_vec(), b"far".to_vec()]
        );
    }
}

/// A connection to `to` from the loopback address `from` (any of 127.0.0.0/8), as a host with
/// many addresses would open it.
fn connect_from(from: std::net::Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(to) = to else {
        return Err(std::io::Error::other("IPv4 only"));
    };
    let sockaddr = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::sa_family_t::try_from(libc::AF_INET).unwrap(),
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let (src, dst) = (sockaddr(from, 0), sockaddr(*to.ip(), to.port()));
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_in>()).unwrap();
    // SAFETY: a new socket; on success its descriptor is owned by the TcpStream made from it
    // and nothing else, on failure it is closed here. bind and connect read the sockaddr_in
    // structs above for `len` bytes, their exact size.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let ok = libc::bind(fd, (&raw const src).cast(), len) == 0
            && libc::connect(fd, (&raw const dst).cast(), len) == 0;
        if !ok {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            return Err(e);
        }
        Ok(TcpStream::from_raw_fd(fd))
    }
}

/// Forwards every connection made to `listener` to `store`, holding each chunk `delay` in
/// each direction (a distant rank), until `stop`.
fn delaying_proxy(
    listener: TcpListener,
    store: SocketAddr,
    delay: Duration,
    stop: Arc<AtomicBool>,
) -> JoinHandle<()> {
    fn pump(mut from: TcpStream, mut to: TcpStream, delay: Duration) -> [JoinHandle<()>; 2] {
        let (tx, rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
        let reader = thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                let n = from.read(&mut buf).unwrap_or(0);
                let _ = tx.send((Instant::now() + delay, buf[..n].to_vec()));
                if n == 0 {
                    return;
                }
            }
        });
        let writer = thread::spawn(move || {
            while let Ok((due, bytes)) = rx.recv() {
                thread::sleep(due.saturating_duration_since(Instant::now()));
                if bytes.is_empty() || to.write_all(&bytes).is_err() {
                    let _ = to.shutdown(std::net::Shutdown::Write);
                    return;
                }
            }
        });
        [reader, writer]
    }
    thread::spawn(move || {
        listener.set_nonblocking(true).unwrap();
        let mut pumps = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let Ok((client, _)) = listener.accept() else {
                thread::sleep(Duration::from_millis(1));
                continue;
            };
            client.set_nonblocking(false).unwrap();
            let Ok(server) = TcpStream::connect(store) else {
                continue;
            };
            let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            pumps.extend(pump(client, server, delay));
            pumps.extend(pump(s2, c2, delay));
        }
        drop(pumps);
    })
}

/// Opens about `per_second` connections a second to `to` from the 256 addresses 127.1.0.x,
/// each held `hold` without a word, until `stop`; returns how many were opened.
fn flood(
    to: SocketAddr,
    per_second: u32,
    hold: Duration,
    stop: Arc<AtomicBool>,
) -> JoinHandle<u64> {
    const THREADS: u32 = 4;
    let workers: Vec<JoinHandle<u64>> = (0..THREADS)
        .map(|t| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let started = Instant::now();
                let mut held = std::collections::VecDeque::new();
                let mut opened = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let due = started.elapsed().as_secs_f64() * f64::from(per_second / THREADS);
                    if (opened as f64) >= due {
                        thread::sleep(Duration::from_micros(500));
                        continue;
                    }
                    // 127.1.0.0 to 127.1.0.255, in turn.
                    let host = (opened * u64::from(THREADS) + u64::from(t)) % 256;
                    let from = std::net::Ipv4Addr::new(127, 1, 0, u8::try_from(host).unwrap());
                    if let Ok(s) = connect_from(from, to) {
                        held.push_back((Instant::now(), s));
                    }
                    opened += 1;
                    while held.front().is_some_and(|(at, _)| at.elapsed() > hold) {
                        held.pop_front();
                    }
                }
                opened
            })
        })
        .collect();
    thread::spawn(move || workers.into_iter().map(|w| w.join().unwrap()).sum())
}

/// How long rank 1 of a job of two, reached through a proxy that adds `delay` each way, takes
/// to join, with or without a flood of `per_second` connections a second from 256 other
/// loopback addresses; and how many flood connections were opened a second.
fn distant_join(delay: Duration, per_second: u32) -> (Result<Duration, RendezvousError>, f64) {
    let port = free_port();
    let store: SocketAddr = ([127, 0, 0, 1], port).into();
    let rank0 = spawn_rank(0, 2, port, Duration::from_secs(10));
    wait_listening(port);
    let stop = Arc::new(AtomicBool::new(false));
    let flood_started = Instant::now();
    let flooding = (per_second > 0).then(|| {
        flood(
            store,
            per_second,
            Duration::from_millis(1500),
            Arc::clone(&stop),
        )
    });
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let via = listener.local_addr().unwrap().port();
    let proxy = delaying_proxy(listener, store, delay, Arc::clone(&stop));
    if flooding.is_some() {
        // The flood fills the store's queue before the rank comes.
        thread::sleep(Duration::from_millis(500));
    }
    let rank1 = thread::spawn(move || {
        let started = Instant::now();
        let mut env = job(1, 2, port, SECRET);
        env.master_port = via;
        let rdv = Rendezvous::connect(&env, Duration::from_secs(6))?;
        let joined = started.elapsed();
        rdv.all_gather(&[1; 3])?;
        rdv.barrier()?;
        Ok(joined)
    });
    let joined = rank1.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    let rate = flooding.map_or(0.0, |f| {
        let opened = f.join().unwrap();
        opened as f64 / flood_started.elapsed().as_secs_f64()
    });
    proxy.join().unwrap();
    if joined.is_ok() {
        rank0.join().unwrap().unwrap();
    }
    (joined, rate)
}

/// A flood of 3,000 connections a second from 256 loopback addresses that never say a word
/// does not keep out a rank 20 ms away (each way): it joins within a second of its time
/// without the flood, and its error, were it kept out, would say why.
#[test]
fn a_flood_from_many_addresses_does_not_keep_a_distant_rank_out() {
    let delay = Duration::from_millis(20);
    // Once unmeasured, so that deriving the token's key (once per process) counts in neither.
    distant_join(Duration::ZERO, 0).0.unwrap();
    let (alone, _) = distant_join(delay, 0);
    let alone = alone.unwrap();
    let (flooded, rate) = distant_join(delay, 3000);
    println!(
        "a rank 20 ms away: joined in {alone:?} alone; beside {rate:.0} connections/s: {flooded:?}"
    );
    let flooded = flooded.unwrap_or_else(|e| panic!("kept out by {rate:.0} connections/s: {e}"));
    assert!(
        flooded < alone + Duration::from_secs(1),
        "joined in {flooded:?} beside {rate:.0} connections/s, {alone:?} alone"
    );
}

/// A process that holds the port a rank dials and answers every HELLO with a bare "token
/// refused" for `for_how_long`, then forwards connections to the real store: the rank does not
/// believe a refusal nobody proved, and joins once the store answers.
#[test]
fn an_unproven_token_refusal_does_not_end_a_rank() {
    let port = free_port();
    let store: SocketAddr = ([127, 0, 0, 1], port).into();
    let rank0 = spawn_rank(0, 2, port, Duration::from_secs(10));
    wait_listening(port);
    let version = store_version(store);
    let grabber = TcpListener::bind("127.0.0.1:0").unwrap();
    let via = grabber.local_addr().unwrap().port();
    let refusing_until = Instant::now() + Duration::from_millis(600);
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&refused);
    let liar = thread::spawn(move || {
        grabber.set_nonblocking(true).unwrap();
        while Instant::now() < refusing_until {
            let Ok((mut s, _)) = grabber.accept() else {
                thread::sleep(Duration::from_millis(1));
                continue;
            };
            s.set_nonblocking(false).unwrap();
            let mut challenge = header(version, b'C', 32);
            challenge.extend_from_slice(&[7; 32]);
            let _ = s.write_all(&challenge);
            let mut hello = [0u8; 10 + 72];
            let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
            if s.read_exact(&mut hello).is_ok() {
                // "Token refused": nothing proven.
                let _ = s.write_all(&header(version, b'T', 0));
                counted.fetch_add(1, Ordering::Relaxed);
            }
        }
        // From now on the port leads to the store.
        let stop = Arc::new(AtomicBool::new(false));
        (
            delaying_proxy(grabber, store, Duration::ZERO, Arc::clone(&stop)),
            stop,
        )
    });
    let started = Instant::now();
    let mut env = job(1, 2, port, SECRET);
    env.master_port = via;
    let joined = Rendezvous::connect(&env, Duration::from_secs(5)).and_then(|rdv| {
        rdv.all_gather(&[1; 3])?;
        rdv.barrier()
    });
    let took = started.elapsed();
    let (proxy, stop) = liar.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    proxy.join().unwrap();
    let refused = refused.load(Ordering::Relaxed);
    assert!(
        refused > 0,
        "the rank never met the false refusal: {joined:?} after {took:?}"
    );
    joined.unwrap_or_else(|e| panic!("ended after {took:?} by {refused} unproven refusals: {e}"));
    rank0.join().unwrap().unwrap();
}
