//! One process per GPU for the benchmark and the `broadcast_weights` example: starting the
//! ranks (`--procs N`), telling a rank from a launcher, and what the ranks share besides the
//! broadcasts themselves (a TCP store for barriers and small exchanges, a common clock).
//!
//! The bench (`bench/benches/procs/mod.rs`) and the example (`broadcast_weights/main.rs`) both
//! include this file with a `#[path]` attribute; each uses a different subset of it, hence the
//! `dead_code` allowance.
//!
//! # Launching
//!
//! [`launch`] re-executes the current binary `n` times with the arguments it was given minus
//! `--procs N`, and with the variables torchrun sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR=127.0.0.1`, `MASTER_PORT` = a free port), a
//! random job token of its own ([`gpucast::rendezvous::random_token`]), [`CHILD_ENV`] (which
//! marks a rank), and NVLink multicast switched off
//! (`NCCL_NVLS_ENABLE=0`, `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`, `NVSHMEM_DISABLE_NVLS=1`). The
//! ranks share the launcher's stdout and stderr. Once any rank fails, the others get
//! [`GRACE`] to finish, then they are killed; the launcher returns an error naming every rank
//! that failed. A launcher dropped early (an error, a panic) kills the ranks it started.
//!
//! A process is a rank ([`in_job`]) when [`CHILD_ENV`] is set or when both `RANK` and
//! `WORLD_SIZE` are (torchrun started it).
//!
//! # The store and the clock
//!
//! [`Job::join`] connects to the job's store (`gpucast::rendezvous::Rendezvous`: gpucast's own,
//! hosted by rank 0 on `MASTER_ADDR:MASTER_PORT`, or torchrun's agent store under torchrun) and
//! builds the [`Communicator`] through it, so the store stays up for the whole run: barriers
//! ([`Job::barrier`]), agreement on errors ([`Job::agree`]) and the gathering of timestamps
//! ([`Job::spans`]) go through it, never through the GPUs being measured.
//!
//! Timestamps are nanoseconds on one clock for every rank of a host: each rank reads the real
//! time clock once at start ([`Job::stamp`] adds the monotonic time elapsed since), so a span
//! from one rank's start to another rank's end is meaningful on one host (Linux has one
//! system-wide clock); across hosts [`Job::spans`] falls back to the slowest rank's own span.
#![allow(
    dead_code,
    reason = "the benchmark and the broadcast_weights example each use a different subset"
)]

use std::ffi::OsString;
use std::process::{Child, Command, ExitStatus};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context, Result};
use gpucast::rendezvous::{Exchange, FnExchange, JobEnv, Rendezvous};
use gpucast::Communicator;

/// Set (to `1`) in the environment of every rank that [`launch`] starts.
pub const CHILD_ENV: &str = "GPUCAST_PROCS_CHILD";

/// How long the other ranks may keep running once one has failed.
pub const GRACE: Duration = Duration::from_secs(15);

/// NVLink multicast stays off in every process started here.
pub const NO_MULTICAST: [(&str, &str); 3] = [
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
];

/// Variables of a launcher (torchrun, this module) that a process started by a rank must not
/// inherit, or it would take itself for a rank of this job.
pub const JOB_VARS: [&str; 14] = [
    CHILD_ENV,
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GPUCAST_MASTER_ADDR",
    "GPUCAST_MASTER_PORT",
    "GPUCAST_JOB_TOKEN",
];

fn set(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| !v.is_empty())
}

/// Whether this process is a rank of a job: started by [`launch`], or by torchrun (`RANK` and
/// `WORLD_SIZE` set).
pub fn in_job() -> bool {
    set(CHILD_ENV) || (set("RANK") && set("WORLD_SIZE"))
}

/// `args` without `--procs N` / `--procs=N` (everything else, in order).
pub fn args_without_procs(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut skip_value = false;
    for a in args {
        if skip_value {
            skip_value = false;
            continue;
        }
        if a == "--procs" {
            skip_value = true;
            continue;
        }
        if a.to_str().is_some_and(|s| s.starts_with("--procs=")) {
            continue;
        }
        out.push(a);
    }
    out
}

/// A TCP port that was free a moment ago, for the store.
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// The ranks started by [`launch`]; dropping it kills (and reaps) those still running.
struct Ranks {
    children: Vec<(usize, Child)>,
}

impl Ranks {
    fn kill_all(&mut self) {
        for (rank, child) in &mut self.children {
            if let Ok(None) = child.try_wait() {
                eprintln!("# procs: killing rank {rank}");
                let _ = child.kill();
            }
            let _ = child.wait();
        }
        self.children.clear();
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn describe(status: ExitStatus) -> String {
    match status.code() {
        Some(c) => format!("exit code {c}"),
        None => format!("{status} (killed by a signal)"),
    }
}

/// Starts `n` ranks of this binary on this host (rank `r` on GPU `r`) and waits for them; see
/// the module docs. `Ok` when every rank exited successfully.
pub fn launch(n: usize) -> Result<()> {
    ensure!(n >= 1, "--procs needs at least 1 process");
    let exe = std::env::current_exe().context("finding this executable")?;
    let args = args_without_procs(std::env::args_os().skip(1));
    let port = free_port()?;
    // A secret per job: a process that reaches the port without it joins nothing.
    let token = gpucast::rendezvous::random_token().context("making a job token")?;
    println!(
        "# procs: starting {n} ranks of {} (store 127.0.0.1:{port})",
        exe.display()
    );
    let mut ranks = Ranks {
        children: Vec::with_capacity(n),
    };
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(&args);
        for var in JOB_VARS {
            cmd.env_remove(var);
        }
        cmd.env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .env(CHILD_ENV, "1")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("GROUP_RANK", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("GPUCAST_JOB_TOKEN", &token);
        for (k, v) in NO_MULTICAST {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting rank {rank} ({})", exe.display()))?;
        ranks.children.push((rank, child));
    }

    let mut failed: Vec<(usize, String)> = Vec::new();
    let mut deadline: Option<Instant> = None;
    let mut running: Vec<usize> = (0..n).collect();
    while !running.is_empty() {
        let mut still = Vec::with_capacity(running.len());
        for i in running {
            let (rank, child) = &mut ranks.children[i];
            match child.try_wait() {
                Ok(Some(status)) if status.success() => {}
                Ok(Some(status)) => {
                    let why = describe(status);
                    eprintln!("# procs: rank {rank} failed ({why})");
                    failed.push((*rank, why));
                    deadline.get_or_insert_with(|| Instant::now() + GRACE);
                }
                Ok(None) => still.push(i),
                Err(e) => {
                    failed.push((*rank, format!("cannot wait for it: {e}")));
                    deadline.get_or_insert_with(|| Instant::now() + GRACE);
                }
            }
        }
        running = still;
        if running.is_empty() {
            break;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            for &i in &running {
                let rank = ranks.children[i].0;
                failed.push((
                    rank,
                    format!(
                        "still running {} s after another rank failed: killed",
                        GRACE.as_secs()
                    ),
                ));
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    ranks.kill_all();
    if failed.is_empty() {
        return Ok(());
    }
    failed.sort_by_key(|(r, _)| *r);
    let list: Vec<String> = failed
        .iter()
        .map(|(r, why)| format!("rank {r}: {why}"))
        .collect();
    bail!(
        "{} of {n} ranks failed ({}); their own messages are above",
        failed.len(),
        list.join("; ")
    )
}

/// This rank's place in the job and the store shared with the other ranks.
pub struct Job {
    rdv: Arc<Rendezvous>,
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Whether every rank is on this host (then timestamps of different ranks compare).
    pub single_host: bool,
    /// (monotonic, real time in ns since the epoch), read together at start.
    anchor: (Instant, u64),
}

impl Job {
    /// Joins the job described by torchrun's variables: the store first, then a
    /// [`Communicator`] (on GPU `LOCAL_RANK`) built through it. A failure is reported to the
    /// store, so that the other ranks stop waiting at once.
    pub fn join(timeout: Duration) -> Result<(Job, Communicator)> {
        let env = JobEnv::from_env().context("reading the job (RANK, WORLD_SIZE, ...)")?;
        let rdv = Arc::new(Rendezvous::connect(&env, timeout).with_context(|| {
            format!(
                "rank {} of {}: joining the store at {}",
                env.rank,
                env.world_size,
                env.master()
            )
        })?);
        let exchange = {
            let rdv = rdv.clone();
            FnExchange::new(env.rank, env.world_size, move |mine: &[u8]| {
                rdv.all_gather(mine)
            })?
        };
        let built = Communicator::builder()
            .job(env.clone())
            .exchange(exchange)
            .init_timeout(timeout)
            .build();
        let comm = match built {
            Ok(c) => c,
            Err(e) => {
                let _ = rdv.abort(&format!("rank {}: {e}", env.rank));
                return Err(anyhow::Error::new(e).context(format!(
                    "rank {} of {}: creating the communicator",
                    env.rank, env.world_size
                )));
            }
        };
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .context("the system clock is before 1970")?;
        let anchor = (
            Instant::now(),
            u64::try_from(wall.as_nanos()).context("the system clock is past 2554")?,
        );
        Ok((
            Job {
                rdv,
                rank: comm.rank(),
                world: comm.world_size(),
                single_host: comm.single_host(),
                anchor,
            },
            comm,
        ))
    }

    /// Returns once every rank has called it (through the store, not the GPUs).
    pub fn barrier(&self) -> Result<()> {
        self.rdv
            .barrier()
            .with_context(|| format!("rank {}: barrier", self.rank))
    }

    /// Every rank's `mine`, in rank order.
    pub fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.rdv
            .all_gather(mine)
            .with_context(|| format!("rank {}: all-gather", self.rank))
    }

    /// `bytes` of rank `root` on every rank.
    pub fn broadcast_bytes(&self, root: usize, bytes: &[u8]) -> Result<Vec<u8>> {
        self.rdv
            .broadcast_from(root, bytes)
            .with_context(|| format!("rank {}: exchanging bytes from rank {root}", self.rank))
    }

    /// Every rank's `ok`: `true` only when every rank passed `true`.
    pub fn all(&self, ok: bool) -> Result<bool> {
        Ok(self.all_gather(&[u8::from(ok)])?.iter().all(|v| v == &[1]))
    }

    /// Every rank reports how its part went; `Ok(value)` on every rank when all succeeded,
    /// otherwise the same error on every rank, naming each rank that failed and why.
    pub fn agree<T>(&self, mine: Result<T>) -> Result<T> {
        let text = match &mine {
            Ok(_) => String::new(),
            Err(e) => format!("{e:#}"),
        };
        // The store takes up to 16 MiB per rank; an error message is far shorter.
        let text: String = text.chars().take(4000).collect();
        let all = self.all_gather(text.as_bytes())?;
        let failures: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.is_empty())
            .map(|(r, t)| format!("rank {r}: {}", String::from_utf8_lossy(t)))
            .collect();
        if failures.is_empty() {
            mine
        } else {
            bail!("{}", failures.join("; "))
        }
    }

    /// `t` in nanoseconds on the clock shared by the ranks of this host (see the module docs).
    pub fn stamp(&self, t: Instant) -> u64 {
        let since = t.saturating_duration_since(self.anchor.0);
        self.anchor
            .1
            .saturating_add(u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
    }

    /// Gathers every rank's `(start, end)` stamps (the same number on every rank, one per
    /// repeat); on rank 0 returns the span of each repeat in seconds: from the earliest start
    /// to the latest end over the ranks when they share a host, else the longest single rank's
    /// own `end - start`. Other ranks get `None`.
    pub fn spans(&self, samples: &[(u64, u64)]) -> Result<Option<Vec<f64>>> {
        let mut mine = Vec::with_capacity(samples.len() * 16);
        for (s, e) in samples {
            mine.extend_from_slice(&s.to_le_bytes());
            mine.extend_from_slice(&e.to_le_bytes());
        }
        let all = self.all_gather(&mine)?;
        if self.rank != 0 {
            return Ok(None);
        }
        let decoded: Vec<Vec<(u64, u64)>> = all
            .iter()
            .map(|b| {
                b.chunks_exact(16)
                    .map(|c| {
                        let (s, e) = c.split_at(8);
                        (
                            u64::from_le_bytes(s.try_into().expect("8 bytes")),
                            u64::from_le_bytes(e.try_into().expect("8 bytes")),
                        )
                    })
                    .collect()
            })
            .collect();
        for (r, d) in decoded.iter().enumerate() {
            ensure!(
                d.len() == samples.len(),
                "rank {r} sent {} timestamps, rank 0 has {}",
                d.len(),
                samples.len()
            );
        }
        let spans = (0..samples.len())
            .map(|i| {
                let ns = if self.single_host {
                    let start = decoded.iter().map(|d| d[i].0).min().unwrap_or(0);
                    let end = decoded.iter().map(|d| d[i].1).max().unwrap_or(0);
                    end.saturating_sub(start)
                } else {
                    decoded
                        .iter()
                        .map(|d| d[i].1.saturating_sub(d[i].0))
                        .max()
                        .unwrap_or(0)
                };
                ns as f64 * 1e-9
            })
            .collect();
        Ok(Some(spans))
    }
}
