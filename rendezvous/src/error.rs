//! The rendezvous module's error type.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

/// Result with [`RendezvousError`].
pub type Result<T, E = RendezvousError> = std::result::Result<T, E>;

/// Everything that can go wrong while processes of a job find each other and exchange bytes.
///
/// Each variant carries what was being done or waited for, and the addresses, ranks and
/// variables involved. The refusals that gpucast's store proves
/// ([`RendezvousError::WorldSizeMismatch`], [`RendezvousError::DuplicateRank`],
/// [`RendezvousError::JobFailed`], ...) and the failures ranks leave in a store arrive as the
/// same variant.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// None of the environment variables that give a value is set.
    #[error("cannot tell the {what}: none of {} is set", .vars.join(", "))]
    MissingEnv {
        /// What could not be determined (`"rank"`, `"world size"`, ...).
        what: &'static str,
        /// The variables that were looked up, in order of precedence.
        vars: Vec<&'static str>,
    },
    /// An environment variable is set but its value is unusable.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    InvalidEnv {
        /// The variable's name.
        var: String,
        /// Its value.
        value: String,
        /// Why it was rejected.
        reason: String,
    },
    /// An argument given in code is out of range or inconsistent: what is wrong with it.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Rank 0 could not listen on this address because another socket already holds the port.
    #[error(
        "cannot host the rendezvous store on {0}: the port is already in use (another job \
         or process on this node holds it; under torchrun the agent's own store holds \
         MASTER_PORT). Pick another port, e.g. with GPUCAST_MASTER_PORT"
    )]
    PortInUse(SocketAddr),
    /// Rank 0 could not listen on the store address for another reason.
    #[error("cannot host the rendezvous store on {addr}: {source}")]
    Bind {
        /// The address rank 0 tried to listen on.
        addr: SocketAddr,
        /// The OS error.
        source: io::Error,
    },
    /// No connection to the store could be made before the deadline.
    #[error(
        "could not connect to the rendezvous store at {addr} within {waited:?} ({}); is rank 0 \
         running, and do MASTER_ADDR and MASTER_PORT name its node and a reachable port?",
        .last_error.as_ref().map_or("no attempt could be made".into(), |e| format!("last error: {e}"))
    )]
    ConnectTimeout {
        /// The `host:port` that was tried.
        addr: String,
        /// How long connecting was retried.
        waited: Duration,
        /// The last OS error (refused, unreachable, name resolution, ...), if any.
        #[source]
        last_error: Option<io::Error>,
    },
    /// A connection to or from the store failed or was closed in the middle of an operation.
    #[error("I/O error on the rendezvous connection with {peer} during {during}: {source}")]
    Io {
        /// The other end of the connection.
        peer: String,
        /// The operation in progress.
        during: String,
        /// The OS error (`UnexpectedEof` when the other end closed the connection).
        source: io::Error,
    },
    /// The other end sent bytes that are not a valid message of the protocol.
    #[error("rendezvous protocol error with {peer}: {reason}")]
    Protocol {
        /// The other end of the connection.
        peer: String,
        /// What was wrong.
        reason: String,
    },
    /// A key, value or token exceeds its limit.
    #[error("{what} of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// What was too large (`"key"`, `"value"`, ...).
        what: String,
        /// Its size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A rank was started with a different world size than rank 0.
    #[error(
        "rank {rank} was started with world size {client} but rank 0 (which hosts the store) \
         with world size {server}; every rank of a job must agree on WORLD_SIZE"
    )]
    WorldSizeMismatch {
        /// The rank that said hello.
        rank: usize,
        /// The world size that rank gave.
        client: usize,
        /// Rank 0's world size.
        server: usize,
    },
    /// A rank is not below the world size.
    #[error("rank {rank} is out of range for a world of {world_size} ranks (0..{world_size})")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// Two processes claimed the same rank.
    #[error("rank {rank} joined twice: {detail}")]
    DuplicateRank {
        /// The rank claimed twice.
        rank: usize,
        /// Which connections claimed it.
        detail: String,
    },
    /// The store at this address refused this process's proof of the job token: the process
    /// belongs to another job or launch than rank 0, or was given another token.
    /// Such a refusal cannot be proven (the store cannot prove the token to a process whose
    /// token differs): the rank tries again until its deadline, then says this.
    #[error(
        "the rendezvous store at {0} refused this process's job token until the deadline: \
         it belongs to another job or launch than rank 0 (every rank needs the same \
         GPUCAST_JOB_TOKEN, torchrun run id or Slurm job id; check MASTER_ADDR and MASTER_PORT)"
    )]
    JobTokenMismatch(String),
    /// The store (or whatever answered at its address: the answer cannot be proven) kept
    /// turning this process's connections away until its deadline, for want of room among the
    /// connections that have not proven the job token: something floods its port.
    #[error(
        "the rendezvous store at {store} kept turning this rank away until the deadline: \
         {reason} (something floods its port with connections that never prove the job \
         token; this answer was not proven, so whatever holds the port may have sent it)"
    )]
    Crowded {
        /// The store's address.
        store: String,
        /// What the store said.
        reason: String,
    },
    /// The process at the store's address (the one given) could not prove it knows the job
    /// token: it is not this job's store (another job's, or a process that took the port first).
    #[error(
        "the process listening at {0} is not this job's rendezvous store: it could not \
         prove it knows the job token (another job or process may hold the port)"
    )]
    StoreNotAuthentic(String),
    /// A value in a shared store (torchrun's) failed authentication: a process outside the
    /// job wrote it, or it belongs to another launch.
    #[error("{what} in the store at {store} failed authentication: a process outside the job wrote it, or it is from another launch")]
    Forged {
        /// Which value.
        what: String,
        /// The store's address.
        store: String,
    },
    /// The operating system gave no random bytes (for nonces and tokens): its error.
    #[error("no random bytes from the operating system: {0}")]
    NoRandomness(String),
    /// The store refused a request for the reason given (a claim of a rank, or of another
    /// world size, after every rank of the job has joined).
    #[error("the rendezvous store refused the request: {0}")]
    Rejected(String),
    /// A wait ran past its deadline.
    #[error("timed out after {timeout:?} waiting for {what}{}", missing_text(.missing))]
    Timeout {
        /// What was waited for.
        what: String,
        /// The time limit that passed.
        timeout: Duration,
        /// The ranks that had not arrived or contributed, when known.
        missing: Vec<usize>,
    },
    /// The job was marked failed (by the store or by a rank's abort); every later request fails
    /// with the same reason.
    #[error("the rendezvous failed: {reason}")]
    JobFailed {
        /// Why, as first reported.
        reason: String,
        /// Ranks named as missing by the failure, when it was a timeout somewhere.
        missing: Vec<usize>,
    },
    /// The caller-supplied exchange (see [`super::FnExchange`]) returned an error: its message.
    #[error("the caller's exchange failed: {0}")]
    External(String),
    /// An exchange returned a result of the wrong shape: what was wrong.
    #[error("the exchange returned a malformed all-gather: {0}")]
    BadGather(String),
}

impl RendezvousError {
    /// The ranks this error names as missing (empty if none are known).
    pub fn missing_ranks(&self) -> &[usize] {
        match self {
            Self::Timeout { missing, .. } | Self::JobFailed { missing, .. } => missing,
            _ => &[],
        }
    }

    /// [`RendezvousError::Protocol`] with `peer`.
    pub(crate) fn protocol(peer: &str, reason: impl Into<String>) -> Self {
        let (peer, reason) = (peer.to_owned(), reason.into());
        Self::Protocol { peer, reason }
    }

    /// [`RendezvousError::WorldSizeMismatch`]: `rank` gave `client`, rank 0 has `server`.
    pub(crate) fn world_size_mismatch(rank: usize, client: usize, server: usize) -> Self {
        Self::WorldSizeMismatch {
            rank,
            client,
            server,
        }
    }
}

/// `; missing ranks: [2, 5]` (the first 32 ranks, and a count when there are more), or
/// nothing when `missing` is empty.
fn missing_text(missing: &[usize]) -> String {
    let listed: Vec<String> = missing.iter().take(32).map(ToString::to_string).collect();
    match missing.len() {
        0 => String::new(),
        n if n > 32 => format!("; missing ranks: [{}, ... ({n} in all)]", listed.join(", ")),
        _ => format!("; missing ranks: [{}]", listed.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_missing_ranks() {
        let e = RendezvousError::Timeout {
            what: "hello from all 3 ranks".into(),
            timeout: Duration::from_secs(2),
            missing: vec![2],
        };
        assert_eq!(
            e.to_string(),
            "timed out after 2s waiting for hello from all 3 ranks; missing ranks: [2]"
        );
        assert_eq!(e.missing_ranks(), &[2]);
        let many: Vec<usize> = (0..100).collect();
        let s = missing_text(&many);
        assert!(
            s.starts_with("; missing ranks: [0, 1, 2") && s.ends_with("(100 in all)]"),
            "{s}"
        );
    }
}
