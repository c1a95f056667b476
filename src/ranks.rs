//! A rank of the job and the index of one of this process's ranks are different things: a
//! clique's ranks are the job's, but a communicator drives one rank of many. Job ranks travel
//! as [`JobRank`], local indices as [`Local`]; [`local_of`] is the one place that turns the
//! first into the second, and a call's root is turned once, when its arguments are checked
//! (`clique::args::Ranks::root`), into a [`Root`] that carries both down to the engine.

/// A rank of the job (what callers pass as `root`, what peers and errors name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct JobRank(pub(crate) usize);

impl std::fmt::Display for JobRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The index of one of this process's ranks in its per-rank tables (streams, places,
/// destinations), in local order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Local(pub(crate) usize);

/// The root of one call: its job rank, and its local index where this process holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Root {
    pub job: JobRank,
    pub local: Option<Local>,
}

/// The local index of job rank `rank` among this process's ranks (`held`, in local order),
/// if this process holds it.
pub(crate) fn local_of(held: impl IntoIterator<Item = JobRank>, rank: JobRank) -> Option<Local> {
    held.into_iter().position(|g| g == rank).map(Local)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_rank_is_found_among_the_ranks_held_here() {
        let held = [JobRank(2), JobRank(5)];
        assert_eq!(local_of(held, JobRank(5)), Some(Local(1)));
        assert_eq!(local_of(held, JobRank(0)), None);
    }
}
