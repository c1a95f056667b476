//! What a launcher (torchrun, Slurm) tells each process about the job.

use std::fmt;

use super::error::{RendezvousError, Result};
use super::store::host_port;
use super::{MAX_TOKEN_LEN, MAX_WORLD_SIZE};

/// Overrides `MASTER_ADDR` (and the Slurm node list) for gpucast's rendezvous only.
pub const MASTER_ADDR_ENV: &str = "GPUCAST_MASTER_ADDR";
/// Overrides `MASTER_PORT` for gpucast's rendezvous only; under torchrun it makes gpucast host
/// a store of its own on this port instead of joining torchrun's.
pub const MASTER_PORT_ENV: &str = "GPUCAST_MASTER_PORT";
/// The job token: a secret every rank of one job shares (see [`JobEnv::job_token`]).
pub const JOB_TOKEN_ENV: &str = "GPUCAST_JOB_TOKEN";

/// The process environment as the rendezvous reads it: `name`'s value, `None` when unset or
/// not UTF-8. Every environment read of this module goes through here.
pub fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The store port of a single-process job when no variable names one (it is never opened).
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// Lowest port derived from `SLURM_JOB_ID` when no port variable is set.
pub const SLURM_PORT_BASE: u16 = 15000;
/// Number of ports derived from `SLURM_JOB_ID`: the port is
/// `SLURM_PORT_BASE + SLURM_JOB_ID % SLURM_PORT_SPAN`, i.e. 15000..=29999, below Linux's
/// default ephemeral range.
pub const SLURM_PORT_SPAN: u16 = 15000;

/// Most ranks a job through torchrun's store may have: PyTorch's libuv store takes at most
/// this many keys in one CHECK.
const TORCH_MAX_WORLD: usize = 128 * 1024;

/// Where the job token came from, which tells how secret it can be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenSource {
    /// `GPUCAST_JOB_TOKEN`.
    Explicit,
    /// torchrun's run id (`TORCHELASTIC_RUN_ID`, `--rdzv-id`; `"none"` unless given).
    TorchRunId,
    /// Slurm's job (and step) id: listed to every user of the cluster, so never a secret.
    SlurmJobId,
    /// None of them: the token is empty unless set in code.
    Unset,
}

/// Which store the ranks meet through.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreKind {
    /// gpucast's own store, which rank 0 hosts on `master_addr:master_port`.
    Own,
    /// torchrun's agent store (a c10d `TCPStore`) on `master_addr:master_port`, joined as a
    /// client; gpucast's keys live under `prefix` (torchrun's `/worker/attempt_<restart>`).
    Torch {
        /// The key prefix of this launch attempt.
        prefix: String,
    },
}

/// Where this process sits in the job: its rank, the job's size, its node and the store's address.
///
/// Build it with [`JobEnv::from_env`] (what torchrun or Slurm set), or in code with
/// [`JobEnv::single_node`] and then set fields.
/// [`JobEnv::validate`] checks the invariants; [`super::Rendezvous::connect`]
/// calls it. Its `Debug` form leaves the token out.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobEnv {
    /// This process's rank in the job, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// This process's rank among the processes of its node, `0..local_world_size`.
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_world_size: usize,
    /// Index of this node in the job (torchrun's `GROUP_RANK`, Slurm's `SLURM_NODEID`).
    pub node: usize,
    /// Host name or address of rank 0's node, where the store listens.
    pub master_addr: String,
    /// The store's TCP port.
    pub master_port: u16,
    /// The job's secret; every rank must have the same. Each rank proves it knows the token
    /// (never sending it) to gpucast's store and the store proves it back, so a process without
    /// it joins nothing, and gpucast's values in either store carry tags made with a key
    /// derived from it. From
    /// `GPUCAST_JOB_TOKEN`, else `TORCHELASTIC_RUN_ID`, else `SLURM_JOB_ID[.SLURM_STEP_ID]`,
    /// else empty; only the first can be a real secret (see [`TokenSource`]).
    pub job_token: String,
    /// Where `job_token` came from.
    pub token_source: TokenSource,
    /// The store the ranks meet through.
    pub store: StoreKind,
}

impl fmt::Debug for JobEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let token = format!("<{} bytes, not shown>", self.job_token.len());
        f.debug_struct("JobEnv")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("local_world_size", &self.local_world_size)
            .field("node", &self.node)
            .field("master_addr", &self.master_addr)
            .field("master_port", &self.master_port)
            .field("job_token", &format_args!("{token}"))
            .field("token_source", &self.token_source)
            .field("store", &self.store)
            .finish()
    }
}

fn invalid(var: &str, value: &str, reason: impl Into<String>) -> RendezvousError {
    let (var, value, reason) = (var.to_owned(), value.to_owned(), reason.into());
    RendezvousError::InvalidEnv { var, value, reason }
}

fn parse_count(var: &str, value: &str) -> Result<usize> {
    let bad = |e| invalid(var, value, format!("not a non-negative integer ({e})"));
    value.parse::<usize>().map_err(bad)
}

impl JobEnv {
    /// Reads the job from the process environment; see [`JobEnv::from_lookup`].
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(env_var)
    }

    /// Reads the job from variables given by `lookup` (empty values count as unset).
    ///
    /// torchrun's variables win over Slurm's; for each field the first variable set is used:
    ///
    /// | field | variables |
    /// |---|---|
    /// | `rank` | `RANK`, `SLURM_PROCID` |
    /// | `world_size` | `WORLD_SIZE`, `SLURM_NTASKS`, `SLURM_NPROCS` |
    /// | `local_rank` | `LOCAL_RANK`, `SLURM_LOCALID` |
    /// | `node` | `GROUP_RANK`, `SLURM_NODEID` |
    /// | `local_world_size` | `LOCAL_WORLD_SIZE`, `SLURM_STEP_TASKS_PER_NODE`, `SLURM_TASKS_PER_NODE` (both in Slurm's `4(x2),3` form, entry `node`), `SLURM_NTASKS_PER_NODE` |
    /// | `master_addr` | `GPUCAST_MASTER_ADDR`, `MASTER_ADDR`, first host of `SLURM_STEP_NODELIST`, `SLURM_JOB_NODELIST`, `SLURM_NODELIST` (of a host list like `gpu[01-04,07],login1`: `gpu01`) |
    /// | `master_port` | `GPUCAST_MASTER_PORT`, `MASTER_PORT`, else [`SLURM_PORT_BASE`]` + SLURM_JOB_ID % `[`SLURM_PORT_SPAN`] |
    /// | `job_token` | `GPUCAST_JOB_TOKEN`, `TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID` (`.SLURM_STEP_ID`) |
    ///
    /// Under torchrun the elastic agent hosts a c10d `TCPStore` on `MASTER_ADDR:MASTER_PORT`
    /// and says so with `TORCHELASTIC_USE_AGENT_STORE=True`: gpucast then joins that store as a
    /// client ([`StoreKind::Torch`], keys under `/worker/attempt_<TORCHELASTIC_RESTART_COUNT>`)
    /// and opens no port of its own, unless `GPUCAST_MASTER_PORT` is set (then rank 0 hosts
    /// gpucast's store there).
    ///
    /// Defaults: a job whose `world_size` is 1 needs nothing but the rank and size; when the
    /// job fits on one node (`local_world_size == world_size`) the node is 0 and the master
    /// address `127.0.0.1`. Anything else missing is [`RendezvousError::MissingEnv`] naming the
    /// variables; unparsable or inconsistent values (rank not below world size, local rank not
    /// below local world size, port 0) are [`RendezvousError::InvalidEnv`] naming the variable.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        // Empty values count as unset.
        let get = |var: &str| nonempty(lookup(var));
        let first = |vars: &[&'static str]| vars.iter().find_map(|&var| get(var).map(|v| (var, v)));
        let missing = |what, vars: &[&'static str]| RendezvousError::MissingEnv {
            what,
            vars: vars.to_vec(),
        };

        const RANK: &[&str] = &["RANK", "SLURM_PROCID"];
        const WORLD: &[&str] = &["WORLD_SIZE", "SLURM_NTASKS", "SLURM_NPROCS"];
        const LOCAL_RANK: &[&str] = &["LOCAL_RANK", "SLURM_LOCALID"];
        const NODE: &[&str] = &["GROUP_RANK", "SLURM_NODEID"];
        const LOCAL_WORLD: &[&str] = &[
            "LOCAL_WORLD_SIZE",
            "SLURM_STEP_TASKS_PER_NODE",
            "SLURM_TASKS_PER_NODE",
            "SLURM_NTASKS_PER_NODE",
        ];
        const ADDR: &[&str] = &[
            MASTER_ADDR_ENV,
            "MASTER_ADDR",
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
        ];
        const PORT: &[&str] = &[MASTER_PORT_ENV, "MASTER_PORT", "SLURM_JOB_ID"];

        let num = |vars: &[&'static str]| -> Result<Option<(&'static str, usize)>> {
            let found = first(vars).map(|(var, v)| parse_count(var, &v).map(|n| (var, n)));
            found.transpose()
        };
        // `n` of `var`, unless it is not below `limit` of `limit_var`.
        let below = |what: &str, (var, n): (&str, usize), (limit_var, limit): (&str, usize)| {
            let why = format!("{what} {n} is not below {limit_var}={limit}");
            let ok = (n < limit).then_some(n);
            ok.ok_or_else(|| invalid(var, &n.to_string(), why))
        };
        let (rank_var, rank) = num(RANK)?.ok_or_else(|| missing("rank", RANK))?;
        let (world_var, world_size) = num(WORLD)?.ok_or_else(|| missing("world size", WORLD))?;
        if world_size == 0 {
            return Err(invalid(world_var, "0", "the world size must be at least 1"));
        }
        below("rank", (rank_var, rank), (world_var, world_size))?;
        let single = world_size == 1;
        let node = num(NODE)?.map(|(_, n)| n);
        let (local_world_var, local_world_size) = match first(LOCAL_WORLD) {
            Some((var @ ("SLURM_STEP_TASKS_PER_NODE" | "SLURM_TASKS_PER_NODE"), value)) => {
                let node = node.ok_or_else(|| missing("node index", NODE))?;
                let n = tasks_on_node(&value, node).map_err(|why| invalid(var, &value, why))?;
                (var, n)
            }
            Some((var, value)) => (var, parse_count(var, &value)?),
            None if single => ("WORLD_SIZE", 1),
            None => return Err(missing("number of processes on this node", LOCAL_WORLD)),
        };
        if local_world_size == 0 || local_world_size > world_size {
            let why =
                format!("the processes on this node must number 1..={world_size} ({world_var})");
            return Err(invalid(local_world_var, &local_world_size.to_string(), why));
        }
        let one_node = local_world_size == world_size;
        let local_rank = match num(LOCAL_RANK)? {
            Some(found) => below("local rank", found, (local_world_var, local_world_size))?,
            None if single => 0,
            None => return Err(missing("local rank", LOCAL_RANK)),
        };
        let node = node.or(one_node.then_some(0));
        let node = node.ok_or_else(|| missing("node index", NODE))?;

        let master_addr = match first(ADDR) {
            Some((var @ (MASTER_ADDR_ENV | "MASTER_ADDR"), value)) => {
                if value.chars().any(char::is_whitespace) {
                    return Err(invalid(var, &value, "a host name has no white space"));
                }
                value
            }
            Some((var, value)) => first_host(&value).map_err(|why| invalid(var, &value, why))?,
            None if one_node => "127.0.0.1".to_owned(),
            None => return Err(missing("master address", ADDR)),
        };

        let mut store = StoreKind::Own;
        let master_port = match first(PORT) {
            Some((var @ (MASTER_PORT_ENV | "MASTER_PORT"), value)) => {
                let bad = || invalid(var, &value, "not a TCP port number in 1..=65535");
                let port = value.parse().ok().filter(|&p: &u16| p > 0);
                let port = port.ok_or_else(bad)?;
                let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
                    .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
                if agent_store && var == "MASTER_PORT" {
                    const RESTART: &str = "TORCHELASTIC_RESTART_COUNT";
                    let attempt = get(RESTART).map(|v| parse_count(RESTART, &v)).transpose()?;
                    let prefix = format!("/worker/attempt_{}", attempt.unwrap_or(0));
                    store = StoreKind::Torch { prefix };
                }
                port
            }
            Some((var, value)) => {
                let bad = invalid(var, &value, "not a numeric job id to derive a port from");
                let job: u64 = value.parse().map_err(|_| bad)?;
                // The offset is below SLURM_PORT_SPAN, a u16.
                SLURM_PORT_BASE + u16::try_from(job % u64::from(SLURM_PORT_SPAN)).unwrap_or(0)
            }
            None if single => DEFAULT_MASTER_PORT,
            None => return Err(missing("master port", PORT)),
        };

        let (var, job_token, token_source) = if let Some(t) = get(JOB_TOKEN_ENV) {
            (JOB_TOKEN_ENV, t, TokenSource::Explicit)
        } else if let Some(t) = get("TORCHELASTIC_RUN_ID") {
            ("TORCHELASTIC_RUN_ID", t, TokenSource::TorchRunId)
        } else if let Some(job) = get("SLURM_JOB_ID") {
            let step = get("SLURM_STEP_ID").map_or(String::new(), |s| format!(".{s}"));
            ("SLURM_JOB_ID", job + &step, TokenSource::SlurmJobId)
        } else {
            (JOB_TOKEN_ENV, String::new(), TokenSource::Unset)
        };
        if job_token.len() > MAX_TOKEN_LEN {
            let shown = format!("<{} bytes, not shown>", job_token.len());
            let why = format!("the job token is limited to {MAX_TOKEN_LEN} bytes");
            return Err(invalid(var, &shown, why));
        }
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            node,
            master_addr,
            master_port,
            job_token,
            token_source,
            store,
        })
    }

    /// A job whose processes all run on this node, with the store on `127.0.0.1:master_port`,
    /// and no job token: set `job_token` to the same random secret in every rank (e.g. from
    /// [`super::random_token`]), or any user of the host who finds the port can join.
    pub fn single_node(rank: usize, world_size: usize, master_port: u16) -> Result<Self> {
        let env = Self {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            node: 0,
            master_addr: "127.0.0.1".to_owned(),
            master_port,
            job_token: String::new(),
            token_source: TokenSource::Unset,
            store: StoreKind::Own,
        };
        env.validate().map(|()| env)
    }

    /// Checks the invariants: `rank < world_size`, `local_rank < local_world_size <=
    /// world_size`, a world size of at most [`super::MAX_WORLD_SIZE`] (128 Ki through
    /// torchrun's store, whose CHECKs take no more keys), a non-empty master address, a port
    /// other than 0 and a token of at most [`MAX_TOKEN_LEN`] bytes.
    pub fn validate(&self) -> Result<()> {
        let (rank, world) = (self.rank, self.world_size);
        let (local, local_rank) = (self.local_world_size, self.local_rank);
        let reason = if world == 0 || world > MAX_WORLD_SIZE {
            format!("world size {world} is not in 1..={MAX_WORLD_SIZE}")
        } else if world > TORCH_MAX_WORLD && matches!(self.store, StoreKind::Torch { .. }) {
            format!(
                "{world} ranks: a job through torchrun's store has at most {TORCH_MAX_WORLD} \
                 (set GPUCAST_MASTER_PORT to host gpucast's own store)"
            )
        } else if rank >= world {
            format!("rank {rank} is not below the world size {world}")
        } else if local == 0 || local > world {
            format!("local world size {local} is not in 1..={world}")
        } else if local_rank >= local {
            format!("local rank {local_rank} is not below the local world size {local}")
        } else if self.master_addr.is_empty() {
            "the master address is empty".into()
        } else if self.master_port == 0 {
            "the master port is 0".into()
        } else if self.job_token.len() > MAX_TOKEN_LEN {
            let len = self.job_token.len();
            format!("the job token has {len} bytes, more than {MAX_TOKEN_LEN}")
        } else {
            return Ok(());
        };
        Err(RendezvousError::InvalidArgument(reason))
    }

    /// `master_addr:master_port`, with brackets around an IPv6 address.
    pub fn master(&self) -> String {
        host_port(&self.master_addr, self.master_port)
    }
}

/// The number of tasks on node `node` from Slurm's `SLURM_TASKS_PER_NODE` form, e.g.
/// `4(x2),3` (nodes 0 and 1 run 4 tasks, node 2 runs 3).
pub(crate) fn tasks_on_node(spec: &str, node: usize) -> Result<usize, String> {
    let mut first = node;
    for entry in spec.split(',').map(str::trim) {
        let bad = |what: &str| format!("malformed {what} in {entry:?} (expected like 4(x2),3)");
        let (count, reps) = entry.split_once('(').unwrap_or((entry, "x1)"));
        let reps = reps.strip_prefix('x').and_then(|r| r.strip_suffix(')'));
        let reps = reps.ok_or_else(|| bad("entry"))?;
        let reps: usize = reps.parse().map_err(|_| bad("repeat"))?;
        let count: usize = count.parse().map_err(|_| bad("task count"))?;
        if first < reps {
            return Ok(count);
        }
        first -= reps;
    }
    Err(format!("lists fewer nodes than node index {node} needs"))
}

/// The first host of a Slurm host list such as `gpu[01-04,07],login1` (`gpu01`) or
/// `rack[1-2]-n[1-2]` (`rack1-n1`: the first of each bracket group), keeping zero padding.
/// Its first entry must be well formed (brackets balanced and not nested, each group's first
/// range of digits not descending); the rest of the list is not read.
pub(crate) fn first_host(list: &str) -> Result<String, String> {
    let (mut host, mut rest) = (String::new(), list);
    loop {
        let at = rest.find([',', '[', ']']).unwrap_or(rest.len());
        host.push_str(&rest[..at]);
        match rest[at..].chars().next() {
            Some(']') => return Err("unbalanced or nested brackets".into()),
            Some('[') => {}
            // A comma outside brackets ends the first entry.
            _ => break,
        }
        let (group, after) = rest[at + 1..].split_once(']').ok_or("unbalanced '['")?;
        if group.contains('[') {
            return Err("unbalanced or nested brackets".into());
        }
        let part = group.split(',').next().unwrap_or_default().trim();
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let num = |s: &str| {
            let digits = !s.is_empty() && s.len() <= 18 && s.bytes().all(|b| b.is_ascii_digit());
            let n = s.parse::<u64>().ok().filter(|_| digits);
            n.ok_or_else(|| format!("malformed range {part:?} in {list:?}"))
        };
        if num(lo)? > num(hi)? {
            return Err(format!("descending range {part:?} in {list:?}"));
        }
        // The range's first number as written, zero padding and all.
        host.push_str(lo);
        rest = after;
    }
    let host = host.trim();
    (!host.is_empty())
        .then(|| host.to_owned())
        .ok_or("empty host name".into())
}

/// `v` trimmed, unless that leaves nothing.
fn nonempty(v: Option<String>) -> Option<String> {
    v.map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<JobEnv> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        JobEnv::from_lookup(move |k| map.get(k).cloned())
    }

    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("GROUP_RANK", "1"),
        ("MASTER_ADDR", "node-a"),
        ("MASTER_PORT", "29400"),
        ("TORCHELASTIC_RUN_ID", "run-42"),
    ];

    #[test]
    fn torchrun_variables() {
        let e = env(TORCHRUN).unwrap();
        assert_eq!(
            e,
            JobEnv {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                node: 1,
                master_addr: "node-a".into(),
                master_port: 29400,
                job_token: "run-42".into(),
                token_source: TokenSource::TorchRunId,
                store: StoreKind::Own,
            }
        );
        assert_eq!(e.master(), "node-a:29400");
    }

    #[test]
    fn torchrun_agent_store_is_joined_unless_a_port_is_given() {
        let mut vars = TORCHRUN.to_vec();
        vars.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        let e = env(&vars).unwrap();
        assert_eq!(e.master_port, 29400, "torchrun's own port");
        assert_eq!(
            e.store,
            StoreKind::Torch {
                prefix: "/worker/attempt_0".into()
            }
        );
        vars.push(("TORCHELASTIC_RESTART_COUNT", "3"));
        assert_eq!(
            env(&vars).unwrap().store,
            StoreKind::Torch {
                prefix: "/worker/attempt_3".into()
            }
        );
        vars.push((MASTER_PORT_ENV, "31000"));
        let e = env(&vars).unwrap();
        assert_eq!((e.master_port, e.store), (31000, StoreKind::Own));
        let mut bad = TORCHRUN.to_vec();
        bad.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        bad.push(("TORCHELASTIC_RESTART_COUNT", "x"));
        let err = env(&bad).unwrap_err();
        assert!(
            matches!(&err, RendezvousError::InvalidEnv { var, .. } if var == "TORCHELASTIC_RESTART_COUNT"),
            "{err}"
        );
    }

    #[test]
    fn the_token_is_never_shown() {
        let mut vars = TORCHRUN.to_vec();
        vars.push((JOB_TOKEN_ENV, "a-very-secret-job-token"));
        let e = env(&vars).unwrap();
        assert_eq!(e.token_source, TokenSource::Explicit);
        assert!(!format!("{e:?}").contains("secret"), "{e:?}");
        let long = "secret".repeat(100);
        vars.push((JOB_TOKEN_ENV, &long));
        let mut map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        map.insert(JOB_TOKEN_ENV.into(), long.clone());
        let err = JobEnv::from_lookup(move |k| map.get(k).cloned()).unwrap_err();
        assert!(!format!("{err} {err:?}").contains("secret"), "{err:?}");
    }

    const SLURM: &[(&str, &str)] = &[
        ("SLURM_PROCID", "9"),
        ("SLURM_NTASKS", "11"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "2"),
        ("SLURM_TASKS_PER_NODE", "4(x2),3"),
        ("SLURM_JOB_NODELIST", "gpu[01-04,07],login1"),
        ("SLURM_JOB_ID", "123456"),
    ];

    #[test]
    fn slurm_variables() {
        let e = env(SLURM).unwrap();
        assert_eq!(e.rank, 9);
        assert_eq!(e.world_size, 11);
        assert_eq!(e.local_rank, 1);
        assert_eq!(e.local_world_size, 3);
        assert_eq!(e.node, 2);
        assert_eq!(e.master_addr, "gpu01");
        assert_eq!(e.master_port, 15000 + 3456); // 123456 % 15000 = 3456
        assert_eq!(e.job_token, "123456");
        assert_eq!(e.token_source, TokenSource::SlurmJobId);
    }

    #[test]
    fn slurm_precedence_and_overrides() {
        let mut vars = SLURM.to_vec();
        vars.push(("SLURM_STEP_NODELIST", "a[3-4]"));
        vars.push(("SLURM_STEP_ID", "0"));
        vars.push(("SLURM_NTASKS_PER_NODE", "4"));
        let e = env(&vars).unwrap();
        assert_eq!(e.master_addr, "a3");
        assert_eq!(
            e.local_world_size, 3,
            "the per-node list names this node's count"
        );
        assert_eq!(e.job_token, "123456.0");
        vars.push(("MASTER_ADDR", "head"));
        vars.push(("MASTER_PORT", "4000"));
        vars.push(("SLURM_STEP_TASKS_PER_NODE", "2(x3)"));
        let e = env(&vars).unwrap();
        assert_eq!((e.master_addr.as_str(), e.master_port), ("head", 4000));
        assert_eq!(e.local_world_size, 2);
        vars.push((MASTER_ADDR_ENV, "10.0.0.1"));
        assert_eq!(env(&vars).unwrap().master_addr, "10.0.0.1");
    }

    #[test]
    fn missing_and_invalid_values_name_the_variable() {
        match env(&[("WORLD_SIZE", "2")]) {
            Err(RendezvousError::MissingEnv { what: "rank", vars }) => {
                assert_eq!(vars, ["RANK", "SLURM_PROCID"]);
            }
            other => panic!("{other:?}"),
        }
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "2"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
            (&[("RANK", "0"), ("WORLD_SIZE", "-3")], "WORLD_SIZE"),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "2"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                "LOCAL_RANK",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "0"),
                    ("LOCAL_WORLD_SIZE", "3"),
                ],
                "LOCAL_WORLD_SIZE",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "0"),
                    ("LOCAL_WORLD_SIZE", "2"),
                    ("MASTER_PORT", "0"),
                ],
                "MASTER_PORT",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "0"),
                    ("LOCAL_WORLD_SIZE", "2"),
                    ("MASTER_PORT", "70000"),
                ],
                "MASTER_PORT",
            ),
            (
                &[
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "4"),
                    ("SLURM_LOCALID", "0"),
                    ("SLURM_NODEID", "3"),
                    ("SLURM_TASKS_PER_NODE", "2(x2)"),
                ],
                "SLURM_TASKS_PER_NODE",
            ),
            (
                &[
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "4"),
                    ("SLURM_LOCALID", "0"),
                    ("SLURM_NODEID", "0"),
                    ("SLURM_NTASKS_PER_NODE", "2"),
                    ("SLURM_JOB_NODELIST", "n[1-"),
                ],
                "SLURM_JOB_NODELIST",
            ),
            (
                &[
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "4"),
                    ("SLURM_LOCALID", "0"),
                    ("SLURM_NODEID", "0"),
                    ("SLURM_NTASKS_PER_NODE", "2"),
                    ("SLURM_JOB_NODELIST", "n[1-2]"),
                    ("SLURM_JOB_ID", "abc"),
                ],
                "SLURM_JOB_ID",
            ),
        ];
        for (vars, bad) in cases {
            match env(vars) {
                Err(RendezvousError::InvalidEnv { var, .. }) => assert_eq!(&var, bad, "{vars:?}"),
                other => panic!("{vars:?}: expected InvalidEnv({bad}), got {other:?}"),
            }
        }
        // Two nodes, no node list or address: the master cannot be guessed.
        let err = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "0"),
            ("MASTER_PORT", "5000"),
        ])
        .unwrap_err();
        assert!(
            matches!(
                err,
                RendezvousError::MissingEnv {
                    what: "master address",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn defaults_for_one_process_and_one_node() {
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
        assert_eq!(e, JobEnv::single_node(0, 1, DEFAULT_MASTER_PORT).unwrap());
        let e = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_PORT", "7000"),
        ])
        .unwrap();
        assert_eq!(e, JobEnv::single_node(1, 2, 7000).unwrap());
        assert!(JobEnv::single_node(2, 2, 7000).is_err());
        assert!(JobEnv::single_node(0, 2, 0).is_err());
    }

    #[test]
    fn hostlists() {
        assert_eq!(first_host("gpu[01-04,07],login1").unwrap(), "gpu01");
        assert_eq!(first_host("a,b").unwrap(), "a");
        assert_eq!(first_host(" n[8-10]").unwrap(), "n8");
        assert_eq!(first_host("n[098-100]").unwrap(), "n098");
        assert_eq!(first_host("r[1-2]-n[3,1].ib,x").unwrap(), "r1-n3.ib");
        assert_eq!(first_host("[7-9]").unwrap(), "7");
        for bad in [
            "", " ,a", "n[1-", "n]", "n[[1]]", "n[3-1]", "n[a-b]", "n[]", "n[1]x]", "n[1,2",
        ] {
            assert!(first_host(bad).is_err(), "{bad:?} should be rejected");
        }
        assert_eq!(first_host("gpu[07-09],a").unwrap(), "gpu07");
        assert_eq!(
            first_host("x[1-100000000]").unwrap(),
            "x1",
            "no full expansion needed"
        );
        assert_eq!(first_host("head").unwrap(), "head");
        assert_eq!(first_host("a,,b[").unwrap(), "a", "the rest is not read");
    }

    #[test]
    fn tasks_per_node_forms() {
        let spec = "4(x2),3,2(x3)";
        let want = [4, 4, 3, 2, 2, 2];
        for (node, n) in want.iter().enumerate() {
            assert_eq!(tasks_on_node(spec, node).unwrap(), *n);
        }
        assert!(tasks_on_node(spec, 6).is_err());
        assert_eq!(tasks_on_node("8", 0).unwrap(), 8);
        for bad in ["4(2)", "4(x)", "x", "4(x2", ""] {
            assert!(tasks_on_node(bad, 0).is_err(), "{bad:?}");
        }
    }
}
