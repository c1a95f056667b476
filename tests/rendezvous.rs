//! Rendezvous between real processes on localhost.
//!
//! Each multi-process test re-runs this test binary as the ranks of a job: the child runs the
//! ignored test `child_rank`, which reads its job from torchrun-style variables and its
//! scenario from `RDV_TEST_SCENARIO` (and returns at once without it), then prints one
//! `@@rdv-result` line that the parent checks. Every test uses its own free port, so tests run
//! in parallel.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use gpucast::rendezvous::{random_token, Exchange, JobEnv, Rendezvous, RendezvousError};

/// The store's admission messages: each starts with this magic and the version.
const MAGIC: &[u8; 4] = b"GCRV";
const HEADER_LEN: usize = 10;

const SCENARIO_ENV: &str = "RDV_TEST_SCENARIO";
const TIMEOUT_ENV: &str = "RDV_TEST_TIMEOUT_MS";
const RESULT_TAG: &str = "@@rdv-result";
/// A child still running this long after its rendezvous timeout has hung.
const HANG_SLACK: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------------------------
// Child side.

fn payload(rank: usize, round: usize) -> Vec<u8> {
    // Different lengths per rank and round, including empty ones, and one 1 MiB contribution.
    let len = if rank == 1 && round == 3 {
        1 << 20
    } else {
        (rank * 7 + round * 3) % 11
    };
    (0..len)
        .map(|i| (rank * 31 + round * 17 + i).to_le_bytes()[0])
        .collect()
}

fn gather_scenario(env: &JobEnv, timeout: Duration) -> Result<(), RendezvousError> {
    let rdv = Rendezvous::connect(env, timeout)?;
    assert_eq!((rdv.rank(), rdv.world_size()), (env.rank, env.world_size));
    for round in 0..6 {
        let all = rdv.all_gather(&payload(env.rank, round))?;
        assert_eq!(all.len(), env.world_size);
        for (r, got) in all.iter().enumerate() {
            assert!(
                *got == payload(r, round),
                "round {round}: rank {r}'s bytes differ"
            );
        }
    }
    rdv.barrier()?;
    let root = env.world_size - 1;
    let b = rdv.broadcast_from(root, format!("from {}", env.rank).as_bytes())?;
    assert_eq!(b, format!("from {root}").as_bytes());
    // Through the trait, as gpucast's init will use it.
    let ex: &dyn Exchange = &rdv;
    let byte = |r: usize| vec![u8::try_from(r).unwrap()];
    let ranks = ex.all_gather(&byte(env.rank))?;
    assert_eq!(ranks, (0..env.world_size).map(byte).collect::<Vec<_>>());
    // Rank 0 hosts the store: everyone passes this barrier before anyone drops.
    rdv.barrier()
}

fn join_scenario(env: &JobEnv, timeout: Duration) -> Result<(), RendezvousError> {
    let rdv = Rendezvous::connect(env, timeout)?;
    // Stay a while, so that a process arriving late still finds the job running.
    thread::sleep(Duration::from_millis(1500));
    rdv.barrier()
}

#[test]
#[ignore = "a rank of the multi-process tests; they run it as a child process"]
fn child_rank() {
    let Ok(scenario) = std::env::var(SCENARIO_ENV) else {
        return;
    };
    let timeout = Duration::from_millis(std::env::var(TIMEOUT_ENV).unwrap().parse().unwrap());
    let env = JobEnv::from_env().expect("the parent sets a valid job");
    let start = Instant::now();
    let outcome = match scenario.as_str() {
        "gather" => gather_scenario(&env, timeout),
        "join" => join_scenario(&env, timeout),
        other => panic!("unknown scenario {other}"),
    };
    let ms = start.elapsed().as_millis();
    let line = match outcome {
        Ok(()) => format!(
            "{RESULT_TAG} rank={} ms={ms} kind=Ok missing= msg=",
            env.rank
        ),
        Err(e) => {
            let debug = format!("{e:?}");
            let kind = debug
                .split([' ', '{', '('])
                .next()
                .unwrap_or("?")
                .to_owned();
            let missing: Vec<String> = e.missing_ranks().iter().map(|r| r.to_string()).collect();
            let msg = e.to_string().replace('\n', " ");
            format!(
                "{RESULT_TAG} rank={} ms={ms} kind={kind} missing={} msg={msg}",
                env.rank,
                missing.join(",")
            )
        }
    };
    // On a line of its own (the harness has printed "test child_rank ... " without a newline).
    println!("\n{line}");
}

// ---------------------------------------------------------------------------------------------
// Parent side.

#[derive(Debug)]
struct Outcome {
    rank: usize,
    ms: u64,
    kind: String,
    missing: Vec<usize>,
    msg: String,
}

struct Job {
    port: u16,
    token: String,
    timeout: Duration,
    children: Vec<(String, Child)>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Job {
    fn new(timeout: Duration) -> Self {
        Self {
            port: free_port(),
            token: random_token().unwrap(),
            timeout,
            children: Vec::new(),
        }
    }

    /// Starts a rank that claims `rank` of `world_size`.
    fn spawn(&mut self, scenario: &str, rank: usize, world_size: usize) {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new(exe);
        cmd.args([
            "--exact",
            "child_rank",
            "--nocapture",
            "--include-ignored",
            "--test-threads=1",
        ]);
        for var in [
            "GPUCAST_MASTER_ADDR",
            "GPUCAST_MASTER_PORT",
            "GPUCAST_JOB_TOKEN",
            "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_RUN_ID",
        ] {
            cmd.env_remove(var);
        }
        cmd.env(SCENARIO_ENV, scenario)
            .env(TIMEOUT_ENV, self.timeout.as_millis().to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", world_size.to_string())
            .env("GROUP_RANK", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", self.port.to_string())
            .env("GPUCAST_JOB_TOKEN", &self.token)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = cmd.spawn().unwrap();
        self.children
            .push((format!("rank {rank} of {world_size}"), child));
    }

    /// Waits for every child (killing any that hangs) and returns their outcomes.
    fn wait(self) -> Vec<Outcome> {
        let limit = Instant::now() + self.timeout + HANG_SLACK;
        let mut outcomes = Vec::new();
        for (name, mut child) in self.children {
            loop {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                if Instant::now() > limit {
                    let _ = child.kill();
                    let out = child.wait_with_output().unwrap();
                    panic!(
                        "{name} hung; stdout:\n{}\nstderr:\n{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                thread::sleep(Duration::from_millis(20));
            }
            let out = child.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "{name} failed ({}); stdout:\n{stdout}\nstderr:\n{stderr}",
                out.status
            );
            let line = stdout
                .lines()
                .find_map(|l| l.find(RESULT_TAG).map(|at| &l[at + RESULT_TAG.len()..]))
                .unwrap_or_else(|| panic!("{name} printed no result; stdout:\n{stdout}"));
            let outcome = parse(line);
            // Shown when a test fails (or with --nocapture).
            println!("{name}: {outcome:?}");
            outcomes.push(outcome);
        }
        outcomes
    }
}

fn parse(line: &str) -> Outcome {
    let field = |name: &str| {
        let start = line.find(&format!(" {name}=")).unwrap() + name.len() + 2;
        let rest = &line[start..];
        if name == "msg" {
            rest.to_owned()
        } else {
            rest.split(' ').next().unwrap().to_owned()
        }
    };
    Outcome {
        rank: field("rank").parse().unwrap(),
        ms: field("ms").parse().unwrap(),
        kind: field("kind"),
        missing: field("missing")
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().unwrap())
            .collect(),
        msg: field("msg"),
    }
}

#[test]
fn four_processes_all_gather_several_rounds() {
    let mut job = Job::new(Duration::from_secs(20));
    // Ranks 1..4 start first and retry until rank 0's store is up.
    for rank in 1..4 {
        job.spawn("gather", rank, 4);
    }
    thread::sleep(Duration::from_millis(300));
    job.spawn("gather", 0, 4);
    for o in job.wait() {
        assert_eq!(o.kind, "Ok", "{o:?}");
    }
}

#[test]
fn world_size_mismatch_fails_every_rank_fast() {
    let timeout = Duration::from_secs(10);
    let mut job = Job::new(timeout);
    job.spawn("join", 0, 3);
    job.spawn("join", 1, 4);
    job.spawn("join", 2, 3);
    let outcomes = job.wait();
    for o in &outcomes {
        assert!(o.ms < 5000, "not a fast failure: {o:?}");
        if o.rank == 1 {
            assert_eq!(o.kind, "WorldSizeMismatch", "{o:?}");
            assert!(
                o.msg.contains("world size 4") && o.msg.contains("world size 3"),
                "{o:?}"
            );
        } else {
            assert_eq!(o.kind, "JobFailed", "{o:?}");
            assert!(o.msg.contains("world size 4"), "{o:?}");
        }
    }
}

#[test]
fn duplicate_rank_fails_every_rank_fast() {
    let timeout = Duration::from_secs(10);
    let mut job = Job::new(timeout);
    job.spawn("join", 0, 3);
    job.spawn("join", 1, 3);
    job.spawn("join", 1, 3);
    // Rank 2 comes late: the job has already failed, and it must hear why.
    thread::sleep(Duration::from_millis(800));
    job.spawn("join", 2, 3);
    let outcomes = job.wait();
    let dups: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.kind == "DuplicateRank")
        .collect();
    assert_eq!(dups.len(), 1, "{outcomes:?}");
    assert_eq!(dups[0].rank, 1);
    for o in &outcomes {
        assert!(o.ms < 5000, "not a fast failure: {o:?}");
        assert!(o.msg.contains("rank 1 joined twice"), "{o:?}");
        if o.kind != "DuplicateRank" {
            assert_eq!(o.kind, "JobFailed", "{o:?}");
        }
    }
}

#[test]
fn a_missing_rank_is_named_by_every_other_rank() {
    let timeout = Duration::from_secs(2);
    let mut job = Job::new(timeout);
    job.spawn("join", 0, 3);
    job.spawn("join", 1, 3);
    let outcomes = job.wait();
    assert_eq!(outcomes.len(), 2);
    for o in &outcomes {
        assert!(
            o.kind == "Timeout" || o.kind == "JobFailed",
            "expected a timeout (own or another rank's): {o:?}"
        );
        assert_eq!(o.missing, [2], "{o:?}");
        assert!(o.msg.contains("missing ranks: [2]"), "{o:?}");
        assert!(
            o.ms >= 1900 && o.ms < 3500,
            "timeout 2 s, took {} ms: {o:?}",
            o.ms
        );
    }
    // At least one rank timed out itself; the other may have heard it from that one.
    assert!(outcomes.iter().any(|o| o.kind == "Timeout"), "{outcomes:?}");
}

// ---------------------------------------------------------------------------------------------
// In-process tests.

/// Reads until the server closes the connection (or 3 s pass); returns what it sent.
fn read_until_closed(mut s: TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut buf = Vec::new();
    match s.read_to_end(&mut buf) {
        Ok(_) => buf,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => buf,
        Err(e) => panic!("the server did not close the connection: {e}"),
    }
}

fn header(version: u8, kind: u8, len: u32) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&[version, kind]);
    h.extend_from_slice(&len.to_le_bytes());
    assert_eq!(h.len(), HEADER_LEN);
    h
}

/// Strangers that send garbage, oversize or malformed admission messages, c10d requests
/// before any HELLO, or half a HELLO, are closed after the store's challenge with nothing
/// more said, and none of it fails the job or takes a rank.
#[test]
fn garbage_and_oversize_messages_do_not_hurt_the_server() {
    let port = free_port();
    let token = random_token().unwrap();
    let t = Duration::from_secs(10);
    let rank = |r: usize, token: String| {
        thread::spawn(move || {
            let mut env = JobEnv::single_node(r, 2, port).unwrap();
            env.job_token = token;
            let rdv = Rendezvous::connect(&env, t)?;
            let all = rdv.all_gather(&[u8::try_from(r).unwrap(); 3])?;
            rdv.barrier()?;
            Ok::<_, RendezvousError>(all)
        })
    };
    let rank0 = rank(0, token.clone());
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "the store never listened");
        thread::sleep(Duration::from_millis(5));
    }
    // The store speaks first: its challenge gives the version it speaks.
    let version = {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut h = [0u8; HEADER_LEN];
        s.read_exact(&mut h).unwrap();
        assert_eq!(&h[..4], MAGIC);
        assert_eq!(h[5], b'C');
        h[4]
    };
    let send = |bytes: &[u8]| {
        let mut s = TcpStream::connect(addr).unwrap();
        // The server may close before reading everything; a reset on write is fine.
        let _ = s.write_all(bytes);
        let started = Instant::now();
        let reply = read_until_closed(s);
        assert!(started.elapsed() < Duration::from_secs(2), "kept open");
        // The challenge, and nothing after it.
        assert_eq!(reply.len(), HEADER_LEN + 32, "{reply:?}");
        assert!(reply.starts_with(MAGIC), "{reply:?}");
    };
    send(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n");
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let noise: Vec<u8> = (0..65536)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24).to_le_bytes()[0]
        })
        .collect();
    send(&noise);
    // A HELLO header announcing 4 GiB - 1, or any length but a HELLO's: refused from the header.
    send(&header(version, b'H', u32::MAX));
    let mut big = header(version, b'H', 4096);
    big.extend(vec![0u8; 4096]);
    send(&big);
    // Another protocol version, and another kind of message.
    send(&header(version + 1, b'H', 72));
    send(&header(version, b'W', 72));
    // c10d requests before any HELLO: VALIDATE, then a SET.
    let mut c10d = vec![0u8];
    c10d.extend_from_slice(&0x3C85_F7CEu32.to_le_bytes());
    c10d.extend_from_slice(&[1, 1, 0, 0, 0, 0, 0, 0, 0, b'k']);
    send(&c10d);
    // A truncated HELLO: the header promises 72 bytes, 10 come, then the client leaves.
    let mut cut = header(version, b'H', 72);
    cut.extend([1u8; 10]);
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&cut).unwrap();
    drop(s);

    // None of that failed the job or took a rank: the second rank still joins, and both
    // see the right bytes.
    let rank1 = rank(1, token);
    for r in [rank0, rank1] {
        assert_eq!(r.join().unwrap().unwrap(), [vec![0u8; 3], vec![1u8; 3]]);
    }
}

#[test]
fn port_in_use_is_a_typed_error() {
    let holder = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = holder.local_addr().unwrap();
    let env = JobEnv::single_node(0, 2, addr.port()).unwrap();
    let started = Instant::now();
    match Rendezvous::connect(&env, Duration::from_secs(2)) {
        Err(RendezvousError::PortInUse(got)) => {
            assert_eq!(got, addr);
            let msg = RendezvousError::PortInUse(got).to_string();
            assert!(msg.contains(&addr.to_string()), "{msg}");
        }
        other => panic!("expected PortInUse, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[test]
fn unreachable_store_is_a_connect_timeout_naming_it() {
    let port = free_port();
    let env = JobEnv::single_node(1, 2, port).unwrap();
    let started = Instant::now();
    match Rendezvous::connect(&env, Duration::from_millis(500)) {
        Err(RendezvousError::ConnectTimeout {
            addr, last_error, ..
        }) => {
            assert_eq!(addr, format!("127.0.0.1:{port}"));
            assert!(last_error.is_some());
        }
        other => panic!("expected ConnectTimeout, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_millis(1500));
}

#[test]
fn a_stalled_rank_is_named_by_the_all_gather_timeout() {
    // Three ranks as threads of this process; rank 2 joins, then stalls before the all-gather.
    let port = free_port();
    let timeout = Duration::from_secs(1);
    let token = random_token().unwrap();
    let ranks: Vec<_> = (0..3usize)
        .map(|rank| {
            let token = token.clone();
            thread::spawn(move || {
                let mut env = JobEnv::single_node(rank, 3, port).unwrap();
                env.job_token = token;
                let mut rdv = Rendezvous::connect(&env, Duration::from_secs(5)).unwrap();
                rdv.set_timeout(timeout);
                rdv.barrier().unwrap();
                if rank == 2 {
                    thread::sleep(Duration::from_millis(2500));
                }
                let started = Instant::now();
                let result = rdv.all_gather(b"x");
                (rank, started.elapsed(), result, rdv)
            })
        })
        .collect();
    let results: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, elapsed, result, _rdv) in &results {
        let e = result.as_ref().unwrap_err();
        assert_eq!(e.missing_ranks(), [2], "rank {rank}: {e}");
        if *rank == 2 {
            // By the time it calls, the others have aborted the job.
            assert!(matches!(e, RendezvousError::JobFailed { .. }), "{e}");
            assert!(*elapsed < Duration::from_millis(500), "{elapsed:?}");
        } else {
            assert!(
                matches!(
                    e,
                    RendezvousError::Timeout { .. } | RendezvousError::JobFailed { .. }
                ),
                "rank {rank}: {e}"
            );
            assert!(
                *elapsed >= Duration::from_millis(900) && *elapsed < Duration::from_millis(2500),
                "rank {rank}: {elapsed:?}"
            );
        }
    }
}

/// The process hosting the store (rank 0) is killed after every rank joined: the others get an
/// error as soon as they next talk to the store, long before their timeout.
#[test]
fn the_store_host_dying_fails_the_other_ranks_fast() {
    let mut job = Job::new(Duration::from_secs(20));
    job.spawn("join", 0, 2);
    job.spawn("join", 1, 2);
    // Both ranks are in the job after well under a second; "join" then waits 1.5 s before
    // its barrier.
    thread::sleep(Duration::from_millis(800));
    let (_, mut host) = job.children.remove(0);
    host.kill().unwrap();
    host.wait().unwrap();
    let killed = Instant::now();
    let outcomes = job.wait();
    let o = &outcomes[0];
    assert_eq!(o.rank, 1);
    assert_ne!(o.kind, "Ok", "{o:?}");
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "rank 1 noticed after {:?}: {o:?}",
        killed.elapsed()
    );
}
