//! The rendezvous through a real PyTorch c10d `TCPStore`, the store torchrun's agent hosts:
//! a Python process runs it (and reads, writes or forges keys on request), the ranks are
//! threads of this process. No GPU is needed, but a Python with torch is: `GPUCAST_TEST_PYTHON`
//! names it (default `python3`); without one each test prints why and passes, unless
//! `GPUCAST_REQUIRE_TORCH=1` (set by CI, which installs torch) makes that a failure.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use gpucast::rendezvous::{random_token, Exchange, JobEnv, Rendezvous, RendezvousError, StoreKind};

const PREFIX: &str = "/worker/attempt_0";

/// A `TCPStore` server in Python, with a `PrefixStore` of torchrun's worker prefix, that
/// answers one command per line.
const STORE_PY: &str = r#"
import sys, datetime
import torch.distributed as d
s = d.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
p = d.PrefixStore(sys.argv[1], s)
print(s.port, flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    try:
        if cmd == "get":
            out = p.get(args[0]).hex()
        elif cmd == "wait":
            p.wait([args[0]], datetime.timedelta(seconds=30))
            # A key deleted since it appeared fails in 2 s, not the store's 30.
            s.set_timeout(datetime.timedelta(seconds=2))
            try:
                out = p.get(args[0]).hex()
            finally:
                s.set_timeout(datetime.timedelta(seconds=30))
        elif cmd == "set":
            p.set(args[0], bytes.fromhex(args[1]) if len(args) > 1 else b"")
            out = "ok"
        elif cmd == "check":
            out = str(p.check([args[0]]))
        else:
            out = "unknown " + cmd
    except Exception as e:
        out = "error " + str(e).replace("\n", " ")
    print(out, flush=True)
"#;

/// One test at a time: a rank of one test that still retries after its store went (each
/// retries until its deadline) could otherwise reach another test's store on a reused port and
/// write there, under another token.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

fn python() -> Option<String> {
    let py = std::env::var("GPUCAST_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import torch.distributed"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        Some(py)
    } else if std::env::var("GPUCAST_REQUIRE_TORCH").is_ok_and(|v| v == "1") {
        panic!("{py} cannot import torch.distributed, and GPUCAST_REQUIRE_TORCH=1");
    } else {
        eprintln!("SKIPPED: {py} cannot import torch.distributed (set GPUCAST_TEST_PYTHON)");
        None
    }
}

struct TorchStore {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    port: u16,
}

impl TorchStore {
    fn start(py: &str) -> TorchStore {
        let mut child = Command::new(py)
            .args(["-c", STORE_PY, PREFIX])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let port = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("python said {line:?}"));
        TorchStore {
            child,
            stdin,
            stdout,
            port,
        }
    }

    /// Runs one command of `STORE_PY` and returns its answer.
    fn ask(&mut self, cmd: &str) -> String {
        self.send(cmd);
        self.answer()
    }

    /// Hands `STORE_PY` one command without waiting for its answer: a `wait` sent before the
    /// ranks start is waiting in the store's owner before any rank can set, then delete, the
    /// key (a recorder that starts late can miss a round's keys on a loaded machine).
    fn send(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The answer to the oldest command sent and not answered yet.
    fn answer(&mut self) -> String {
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_owned()
    }

    fn get(&mut self, key: &str) -> Vec<u8> {
        let hex = self.ask(&format!("get {key}"));
        decode_hex(&hex).unwrap_or_else(|| panic!("get {key}: {hex}"))
    }
}

impl Drop for TorchStore {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Writes `value` under `key` of the store, as a stranger who reaches its port can.
fn plant(store: &mut TorchStore, key: &str, value: &[u8]) {
    assert_eq!(
        store.ask(&format!("set {key} {}", hex(value))),
        "ok",
        "{key}"
    );
}

/// Rank `rank` of a torchrun-style job whose agent store listens on `port`.
fn job(rank: usize, world: usize, port: u16, token: &str) -> JobEnv {
    let vars = [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("GROUP_RANK", "0".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
        ("TORCHELASTIC_RESTART_COUNT", "0".into()),
        ("GPUCAST_JOB_TOKEN", token.into()),
    ];
    let env = JobEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()))
        .unwrap();
    assert_eq!(
        env.store,
        StoreKind::Torch {
            prefix: PREFIX.into()
        }
    );
    env
}

fn payload(rank: usize, round: usize) -> Vec<u8> {
    let len = if rank == 1 && round == 2 {
        1 << 20
    } else {
        rank * 5 + round
    };
    (0..len)
        .map(|i| (rank * 31 + round * 7 + i).to_le_bytes()[0])
        .collect()
}

#[test]
fn ranks_meet_through_torchs_own_store() {
    let _alone = alone();
    let Some(py) = python() else { return };
    let mut store = TorchStore::start(&py);
    let (port, token) = (store.port, random_token().unwrap());
    let world = 3;
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let token = token.clone();
            thread::spawn(move || -> Result<(), RendezvousError> {
                let rdv =
                    Rendezvous::connect(&job(rank, world, port, &token), Duration::from_secs(20))?;
                for round in 0..4 {
                    let all = rdv.all_gather(&payload(rank, round))?;
                    for (r, got) in all.iter().enumerate() {
                        assert!(
                            *got == payload(r, round),
                            "round {round}: rank {r}'s bytes differ"
                        );
                    }
                }
                rdv.barrier()?;
                drop(rdv);
                // A second rendezvous in the same launch gets keys of its own.
                let again =
                    Rendezvous::connect(&job(rank, world, port, &token), Duration::from_secs(20))?;
                assert_eq!(again.broadcast_from(2, &rank.to_le_bytes()[..1])?, [2u8]);
                again.barrier()
            })
        })
        .collect();
    for r in ranks {
        r.join().unwrap().unwrap();
    }
    // What torch sees under its worker prefix: the instance counters, as torch's ADD keeps
    // them, and tagged values only.
    for rank in 0..world {
        assert_eq!(store.get(&format!("gpucast/instance/{rank}")), b"2");
    }
    // The hello keys went once every rank was past them; the last round's keys remain, each
    // value followed by its 32-byte tag (values are readable, not forgeable: see
    // forged_and_replayed_values_are_refused).
    assert_eq!(store.ask("check gpucast/1/hello/0"), "False");
    assert_eq!(store.ask("check gpucast/1/0/0"), "False");
    let last = store.get("gpucast/1/4/1");
    assert!(last.len() >= 32, "{last:?}");
}

/// A value that a process without the token wrote is refused, and so is a value recorded in an
/// earlier launch with the same token.
#[test]
fn forged_and_replayed_values_are_refused() {
    let _alone = alone();
    let Some(py) = python() else { return };
    let token = random_token().unwrap();

    // Garbage of a hello's size (40 bytes and a 32-byte tag) where rank 1's hello belongs,
    // before rank 1 comes: rank 0 refuses it.
    let mut store = TorchStore::start(&py);
    plant(&mut store, "gpucast/1/hello/1", &[0x42; 72]);
    plant(&mut store, "gpucast/1/hello/count", b"1");
    let e =
        Rendezvous::connect(&job(0, 2, store.port, &token), Duration::from_secs(5)).unwrap_err();
    assert!(matches!(e, RendezvousError::Forged { .. }), "{e:?}");
    assert!(e.to_string().contains("rank 1's hello"), "{e}");
    drop(store);

    // A first launch; the store's owner records rank 1's hello and first contribution (again
    // where a loaded machine let a key go before it was read: see `recorded`).
    let (hello, round0) = recorded(|| {
        let mut first = TorchStore::start(&py);
        let port = first.port;
        first.send("wait gpucast/1/hello/1");
        first.send("wait gpucast/1/0/1");
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let token = token.clone();
                thread::spawn(move || -> Result<(), RendezvousError> {
                    let rdv =
                        Rendezvous::connect(&job(rank, 2, port, &token), Duration::from_secs(20))?;
                    thread::sleep(Duration::from_millis(500));
                    rdv.all_gather(b"first launch")?;
                    // Round 0's keys stay until every rank is past the next round: time for the
                    // store's owner to record them.
                    thread::sleep(Duration::from_millis(1500));
                    rdv.barrier()
                })
            })
            .collect();
        let hello = decode_hex(&first.answer());
        let round0 = decode_hex(&first.answer());
        for r in ranks {
            r.join().unwrap().unwrap();
        }
        hello.zip(round0)
    });

    // A second launch on a fresh store with the same token: the recorded values are planted
    // for rank 1, which never comes. Rank 0 must not take the old contribution as rank 1's.
    let mut second = TorchStore::start(&py);
    plant(&mut second, "gpucast/1/hello/1", &hello);
    plant(&mut second, "gpucast/1/0/1", &round0);
    for count in ["hello", "confirm", "0"] {
        plant(&mut second, &format!("gpucast/1/{count}/count"), b"1");
    }
    let outcome = Rendezvous::connect(&job(0, 2, second.port, &token), Duration::from_secs(2))
        .and_then(|rdv| rdv.all_gather(b"second launch"));
    // The recorded hello cannot confirm this launch's session: rank 1 is missing, and its old
    // contribution is never taken.
    let e = outcome.unwrap_err();
    assert!(
        matches!(&e, RendezvousError::Timeout { missing, .. } if missing == &[1]),
        "{e:?}"
    );
}

/// A launch of `world` ranks in which rank 1 aborts once all have joined; the store's owner
/// records the values under `keys` as they appear (what a stranger who reaches the port can
/// read), and they are returned in that order.
fn record_launch_where_rank_1_aborts(
    py: &str,
    token: &str,
    world: usize,
    keys: &[&str],
) -> Vec<Vec<u8>> {
    recorded(|| record_once(py, token, world, keys))
}

/// What `record` returns, tried again (at most five launches) where it returns `None`: a rank
/// 0 deletes a round's keys once every rank is past the next round, which on a loaded machine
/// can come before the store's owner, woken by the key, reads it.
fn recorded<T>(mut record: impl FnMut() -> Option<T>) -> T {
    (0..5)
        .find_map(|_| record())
        .expect("five launches went without the store's owner reading the keys in time")
}

/// One launch of [`record_launch_where_rank_1_aborts`]; `None` where a key went unread.
fn record_once(py: &str, token: &str, world: usize, keys: &[&str]) -> Option<Vec<Vec<u8>>> {
    let mut store = TorchStore::start(py);
    let port = store.port;
    for k in keys {
        store.send(&format!("wait {k}"));
    }
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let token = token.to_owned();
            thread::spawn(move || {
                let env = job(rank, world, port, &token);
                let rdv = Rendezvous::connect(&env, Duration::from_secs(20)).unwrap();
                if rank == 1 {
                    rdv.abort("launch 1 gave up").unwrap();
                } else {
                    assert!(rdv.all_gather(b"x").is_err());
                }
            })
        })
        .collect();
    let values = keys.iter().map(|_| decode_hex(&store.answer())).collect();
    for r in ranks {
        r.join().unwrap();
    }
    values
}

/// A rank that fails tells the others through the store; a rank that never comes is named.
#[test]
fn failures_reach_every_rank_fast() {
    let _alone = alone();
    let Some(py) = python() else { return };
    let store = TorchStore::start(&py);
    let (port, token) = (store.port, random_token().unwrap());
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let token = token.clone();
            thread::spawn(move || {
                let rdv = Rendezvous::connect(&job(rank, 2, port, &token), Duration::from_secs(20))
                    .unwrap();
                if rank == 1 {
                    rdv.abort("rank 1 ran out of memory").unwrap();
                    return None;
                }
                thread::sleep(Duration::from_millis(200));
                let started = Instant::now();
                let e = rdv.all_gather(b"x").unwrap_err();
                Some((e, started.elapsed()))
            })
        })
        .collect();
    let outcomes: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
    let (e, took) = outcomes[0].as_ref().unwrap();
    assert!(
        matches!(e, RendezvousError::JobFailed { reason, .. } if reason.contains("out of memory")),
        "{e:?}"
    );
    assert!(*took < Duration::from_secs(1), "{took:?}");

    let token = random_token().unwrap();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let token = token.clone();
            thread::spawn(move || {
                let started = Instant::now();
                let e = Rendezvous::connect(&job(rank, 3, port, &token), Duration::from_secs(1))
                    .unwrap_err();
                (e, started.elapsed())
            })
        })
        .collect();
    for r in ranks {
        let (e, took) = r.join().unwrap();
        assert_eq!(e.missing_ranks(), [2], "{e:?}");
        assert!(
            matches!(
                e,
                RendezvousError::Timeout { .. } | RendezvousError::JobFailed { .. }
            ),
            "{e:?}"
        );
        assert!(took < Duration::from_secs(3), "{took:?}");
    }
    drop(store);
}

/// An abort recorded in an earlier launch with the same token fails nobody in a later one,
/// and a value larger than a contribution can be is refused before it is read.
#[test]
fn replayed_aborts_and_oversize_values_are_refused() {
    let _alone = alone();
    let Some(py) = python() else { return };
    let token = random_token().unwrap();

    // Launch 1: rank 1 aborts; the store's owner records the abort.
    let abort = record_launch_where_rank_1_aborts(&py, &token, 2, &["gpucast/1/abort"]).remove(0);

    // Launch 2, same token, the recorded abort planted before anyone comes: it is ignored.
    let mut second = TorchStore::start(&py);
    assert_eq!(
        second.ask(&format!("set gpucast/1/abort {}", hex(&abort))),
        "ok"
    );
    let port = second.port;
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let token = token.clone();
            thread::spawn(move || -> Result<Vec<Vec<u8>>, RendezvousError> {
                let rdv =
                    Rendezvous::connect(&job(rank, 2, port, &token), Duration::from_secs(20))?;
                let all = rdv.all_gather(b"launch 2")?;
                rdv.barrier()?;
                Ok(all)
            })
        })
        .collect();
    for r in ranks {
        assert_eq!(
            r.join().unwrap().unwrap(),
            [b"launch 2".to_vec(), b"launch 2".to_vec()]
        );
    }
    drop(second);

    // 8 MiB of junk where a hello of 72 bytes belongs: refused from its length.
    let mut third = TorchStore::start(&py);
    let junk = "5a".repeat(8 << 20);
    assert_eq!(third.ask(&format!("set gpucast/1/hello/1 {junk}")), "ok");
    plant(&mut third, "gpucast/1/hello/count", b"1");
    let e =
        Rendezvous::connect(&job(0, 2, third.port, &token), Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(e, RendezvousError::TooLarge { max: 72, .. }),
        "{e:?}"
    );
}

/// A hello recorded in an earlier launch, planted for a rank that never comes (with that
/// rank's recorded abort), neither completes the rendezvous nor fails it with the planted
/// reason: the ranks time out naming the missing rank.
#[test]
fn a_replayed_hello_does_not_pass_for_a_rank() {
    let _alone = alone();
    let Some(py) = python() else { return };
    let token = random_token().unwrap();
    for world in [2usize, 3] {
        // Launch 1: every rank joins, rank 1 aborts; its hello and abort are recorded.
        let recorded = record_launch_where_rank_1_aborts(
            &py,
            &token,
            world,
            &["gpucast/1/hello/1", "gpucast/1/abort"],
        );
        let (hello, abort) = (&recorded[0], &recorded[1]);

        // Launch 2, same token: rank 1 never comes, its recorded values are planted.
        let mut second = TorchStore::start(&py);
        plant(&mut second, "gpucast/1/hello/1", hello);
        plant(&mut second, "gpucast/1/hello/count", b"1");
        plant(&mut second, "gpucast/1/confirm/count", b"1");
        plant(&mut second, "gpucast/1/abort", abort);
        plant(&mut second, "gpucast/1/abort-hello", abort);
        let port = second.port;
        let ranks: Vec<_> = (0..world)
            .filter(|&r| r != 1)
            .map(|rank| {
                let token = token.clone();
                thread::spawn(move || {
                    let env = job(rank, world, port, &token);
                    Rendezvous::connect(&env, Duration::from_secs(2)).map(drop)
                })
            })
            .collect();
        // Each rank times out naming rank 1, or hears that another did first; none takes the
        // planted reason, and at least one timed out itself.
        let errors: Vec<_> = ranks
            .into_iter()
            .map(|r| r.join().unwrap().unwrap_err())
            .collect();
        for e in &errors {
            assert_eq!(e.missing_ranks(), [1], "world {world}: {e:?}");
            assert!(
                matches!(e, RendezvousError::Timeout { .. })
                    || matches!(e, RendezvousError::JobFailed { reason, .. } if !reason.contains("launch 1")),
                "world {world}: {e:?}"
            );
        }
        assert!(
            errors
                .iter()
                .any(|e| matches!(e, RendezvousError::Timeout { .. })),
            "world {world}: {errors:?}"
        );
    }
}

/// An abort of the first round recorded in an earlier launch, planted where this launch's is
/// looked for, is not taken for one: its sender's hello here carries another nonce. The rank
/// times out naming the missing rank instead of failing with the recorded reason.
#[test]
fn a_replayed_first_round_abort_is_ignored() {
    let Some(py) = python() else { return };
    let token = random_token().unwrap();
    // Launch 1: rank 0 of 2 comes alone, times out in the first round and aborts it.
    let mut first = TorchStore::start(&py);
    first.send("wait gpucast/1/abort-hello");
    let env = job(0, 2, first.port, &token);
    let e = Rendezvous::connect(&env, Duration::from_millis(500)).unwrap_err();
    assert!(matches!(e, RendezvousError::Timeout { .. }), "{e:?}");
    let abort = decode_hex(&first.answer()).expect("rank 0's abort of the first round");

    // Launch 2, same token: the recorded abort is there before rank 0 comes, rank 1 never does.
    let mut second = TorchStore::start(&py);
    plant(&mut second, "gpucast/1/abort-hello", &abort);
    let env = job(0, 2, second.port, &token);
    let e = Rendezvous::connect(&env, Duration::from_secs(1)).unwrap_err();
    assert!(
        matches!(&e, RendezvousError::Timeout { missing, .. } if missing == &[1]),
        "{e:?}"
    );
}

/// A rank that learns of the job's failure from the store does not abort in turn: a rank that
/// looks later still reads the first reason, not one passed on.
#[test]
fn a_failure_heard_from_the_store_is_not_passed_on() {
    let Some(py) = python() else { return };
    let store = TorchStore::start(&py);
    let (port, token) = (store.port, random_token().unwrap());
    let joining: Vec<_> = (0..3)
        .map(|rank| {
            let token = token.clone();
            thread::spawn(move || {
                Rendezvous::connect(&job(rank, 3, port, &token), Duration::from_secs(20)).unwrap()
            })
        })
        .collect();
    let rdvs: Vec<Rendezvous> = joining.into_iter().map(|j| j.join().unwrap()).collect();
    rdvs[1].abort("rank 1 ran out of memory").unwrap();
    for rank in [0, 2] {
        match rdvs[rank].all_gather(b"x") {
            Err(RendezvousError::JobFailed { reason, .. }) => {
                assert!(
                    reason.starts_with("rank 1 aborted"),
                    "rank {rank}: {reason}"
                );
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
    drop(store);
}
