//! The copy-engine path's schedule: pure, tested without a GPU. The ranks form a chain from
//! the root ([`chain`]); the message goes in chunks ([`chunks`], [`chunk_bytes`]); each call is
//! a list of operations on the ranks' streams ([`ChainOp`]): ordered by events when eager
//! ([`eager_ops`]), by flags in device memory when captured ([`captured_ops`]).

/// The order in which `n` ranks receive a copy-engine broadcast from `root`: the root, then the
/// ranks after it, wrapping around. Rank `chain[i]` copies from `chain[i - 1]`, so each rank's
/// links carry the message once in and once out, whatever N.
pub(crate) fn chain(root: usize, n: usize) -> Vec<usize> {
    (0..n).map(|i| (root + i) % n).collect()
}

/// Smallest chunk of a chained copy: a copy costs a few microseconds to queue and start, so
/// chunks below a few MiB would spend more time there than on the link.
pub(crate) const CHUNK_MIN: usize = 4 << 20;

/// Most chunks of one chained call (one ordering event per chunk and rank).
pub(crate) const CHUNKS_MAX: usize = 64;

/// Chunk size of a chained copy of `total` bytes over `n` ranks. With 2 ranks there is nothing
/// to pipeline: one copy per tensor. Above, the pipeline fills in `n - 2` chunk times, so
/// chunks are at most 1/64 of the message (a fill of 6/64 on 8 GPUs), and at least
/// [`CHUNK_MIN`]; whole MiB.
pub(crate) fn chunk_bytes(total: usize, n: usize) -> usize {
    if n <= 2 {
        return usize::MAX;
    }
    total
        .div_ceil(CHUNKS_MAX)
        .max(CHUNK_MIN)
        .next_multiple_of(1 << 20)
}

/// `len` bytes at `offset` of tensor `tensor`: one copy of a chained call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub tensor: usize,
    pub offset: usize,
    pub len: usize,
}

/// Splits `tensors` (of `bytes[t]` bytes) into chunks of at most `chunk` bytes, tensor by
/// tensor; zero-length tensors give none.
pub(crate) fn chunks(tensors: &[usize], bytes: &[usize], chunk: usize) -> Vec<Chunk> {
    let chunk = chunk.max(1);
    let mut out = Vec::new();
    for &tensor in tensors {
        let mut offset = 0;
        while offset < bytes[tensor] {
            let len = chunk.min(bytes[tensor] - offset);
            out.push(Chunk {
                tensor,
                offset,
                len,
            });
            offset += len;
        }
    }
    out
}

/// Chunks of one captured hand-off window: each has an arrival flag of its own.
pub(crate) const WINDOW: usize = 64;

/// A flag of one rank's copy-engine flag area (captured calls).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Flag {
    /// Chunk `k` of the current window has arrived in this rank's output.
    Arrive(usize),
    /// This rank's successor's output is free for the current window: its stream reached the
    /// call (first window) or has seen every chunk of the previous window.
    Free,
}

/// One operation of a chained copy, queued on the stream of `rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChainOp {
    /// Record `rank`'s chain event.
    Record { rank: usize },
    /// Make `rank` wait for the latest record of `of`'s chain event.
    Wait { rank: usize, of: usize },
    /// On `rank`'s stream (its copy engine), copy chunk `chunk` from `from`'s buffer (the
    /// root's input when `from` is the root) into `into`'s output.
    Copy {
        rank: usize,
        into: usize,
        from: usize,
        chunk: usize,
    },
    /// Make `rank` wait until its flag `flag` is at least 1.
    WaitFlag { rank: usize, flag: Flag },
    /// Write `value` into flag `flag` of `owner`'s area, in order on `rank`'s stream.
    WriteFlag {
        rank: usize,
        owner: usize,
        flag: Flag,
        value: u32,
    },
}

impl ChainOp {
    /// Whether the op still goes out after an earlier op of the same call failed: records and
    /// waits do, so that each rank's stream still waits for the copies into its buffers that did
    /// go out (its caller may free them once the stream moves on); copies and flag operations
    /// do not.
    pub(crate) fn after_failure(&self) -> bool {
        matches!(self, ChainOp::Record { .. } | ChainOp::Wait { .. })
    }
}

/// The operations of an eager chained copy of `chunks` chunks along `order` (see [`chain`]),
/// ordered by one event per rank. Each rank pushes every chunk to its successor with its own
/// copy engine, so a buffer is only ever read on its own stream:
/// - every rank but the root first records its event, and its predecessor waits for that
///   record before its first copy into it: earlier work on its output is done;
/// - a rank forwards chunk k once its predecessor's event, recorded after copying chunk k into
///   it, has passed (calls are queued chunk by chunk, so that is the latest record when the
///   wait is queued);
/// - at the end every rank but the root waits for its predecessor's last copy, so no stream
///   moves past the call before its output holds the message.
pub(crate) fn eager_ops(order: &[usize], chunks: usize) -> Vec<ChainOp> {
    let n = order.len();
    let mut ops = Vec::new();
    if n < 2 || chunks == 0 {
        return ops;
    }
    for &rank in &order[1..] {
        ops.push(ChainOp::Record { rank });
    }
    for chunk in 0..chunks {
        for i in 1..n {
            let (rank, into) = (order[i - 1], order[i]);
            if chunk == 0 {
                ops.push(ChainOp::Wait { rank, of: into });
            }
            if i > 1 {
                ops.push(ChainOp::Wait {
                    rank,
                    of: order[i - 2],
                });
            }
            ops.push(ChainOp::Copy {
                rank,
                into,
                from: rank,
                chunk,
            });
            ops.push(ChainOp::Record { rank });
        }
    }
    for i in 1..n {
        ops.push(ChainOp::Wait {
            rank: order[i],
            of: order[i - 1],
        });
    }
    ops
}

/// The operations of a captured chained copy: the same hand-offs as [`eager_ops`], through
/// flags set to 1 by the writer and reset to 0 by the reader, so that every replay of a graph
/// starts from zeroed flags. Chunks go in windows of [`WINDOW`]: a rank tells its predecessor
/// its output is free ([`Flag::Free`]) at the start of each window, after it has reset the
/// arrival flags of the previous one, so no arrival is written before its reset.
pub(crate) fn captured_ops(order: &[usize], chunks: usize) -> Vec<ChainOp> {
    let n = order.len();
    let mut ops = Vec::new();
    if n < 2 {
        return ops;
    }
    let mut first = 0;
    while first < chunks {
        let len = WINDOW.min(chunks - first);
        for i in 1..n {
            ops.push(ChainOp::WriteFlag {
                rank: order[i],
                owner: order[i - 1],
                flag: Flag::Free,
                value: 1,
            });
        }
        for k in 0..len {
            for i in 1..n {
                let (rank, into) = (order[i - 1], order[i]);
                if k == 0 {
                    ops.push(ChainOp::WaitFlag {
                        rank,
                        flag: Flag::Free,
                    });
                    ops.push(ChainOp::WriteFlag {
                        rank,
                        owner: rank,
                        flag: Flag::Free,
                        value: 0,
                    });
                }
                if i > 1 {
                    ops.push(ChainOp::WaitFlag {
                        rank,
                        flag: Flag::Arrive(k),
                    });
                    ops.push(ChainOp::WriteFlag {
                        rank,
                        owner: rank,
                        flag: Flag::Arrive(k),
                        value: 0,
                    });
                }
                ops.push(ChainOp::Copy {
                    rank,
                    into,
                    from: rank,
                    chunk: first + k,
                });
                ops.push(ChainOp::WriteFlag {
                    rank,
                    owner: into,
                    flag: Flag::Arrive(k),
                    value: 1,
                });
            }
        }
        // The last rank forwards nothing: it takes in (and resets) every arrival.
        let last = order[n - 1];
        for k in 0..len {
            ops.push(ChainOp::WaitFlag {
                rank: last,
                flag: Flag::Arrive(k),
            });
            ops.push(ChainOp::WriteFlag {
                rank: last,
                owner: last,
                flag: Flag::Arrive(k),
                value: 0,
            });
        }
        first += len;
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After a failed copy, every copy that went out is still waited for by the stream of the
    /// rank it writes into: a record of the copying rank after the copy, then a wait of the
    /// receiving rank for that record, both among the ops that still go out.
    #[test]
    fn a_failed_copy_still_leaves_every_earlier_copy_waited_for() {
        for n in 2..=8 {
            for root in [0, n - 1] {
                let order = chain(root, n);
                for chunks in 1..=3 {
                    let ops = eager_ops(&order, chunks);
                    for (f, _) in ops
                        .iter()
                        .enumerate()
                        .filter(|(_, o)| matches!(o, ChainOp::Copy { .. }))
                    {
                        let queued: Vec<(usize, &ChainOp)> = ops
                            .iter()
                            .enumerate()
                            .filter(|&(i, o)| i < f || (i > f && o.after_failure()))
                            .collect();
                        for &(j, op) in &queued {
                            let ChainOp::Copy { rank, into, .. } = *op else {
                                continue;
                            };
                            let record = queued.iter().find(|&&(i, o)| {
                                i > j && matches!(*o, ChainOp::Record { rank: r } if r == rank)
                            });
                            let waited = record.is_some_and(|&(ri, _)| {
                                queued.iter().any(|&(i, o)| {
                                    i > ri
                                        && matches!(*o, ChainOp::Wait { rank: r, of }
                                            if r == into && of == rank)
                                })
                            });
                            assert!(
                                waited,
                                "{n} ranks, root {root}, {chunks} chunks, copy {j} by {rank} \
                                 into {into} not waited for after op {f} failed"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn chains_start_at_the_root_and_visit_every_rank_once() {
        assert_eq!(chain(0, 2), vec![0, 1]);
        assert_eq!(chain(1, 2), vec![1, 0]);
        assert_eq!(chain(5, 8), vec![5, 6, 7, 0, 1, 2, 3, 4]);
        for n in 1..=8 {
            for root in 0..n {
                let mut c = chain(root, n);
                assert_eq!(c[0], root);
                c.sort_unstable();
                assert_eq!(c, (0..n).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn chunks_cover_every_byte_once() {
        assert_eq!(chunk_bytes(1 << 30, 2), usize::MAX);
        assert_eq!(chunk_bytes(1 << 30, 8), 16 << 20);
        assert_eq!(chunk_bytes(1 << 20, 4), CHUNK_MIN);
        assert_eq!(chunk_bytes((300 << 20) + 1, 3) % (1 << 20), 0);
        let bytes = [10usize, 0, 25, 7];
        let c = chunks(&[0, 1, 2, 3], &bytes, 10);
        assert_eq!(c.len(), 1 + 3 + 1);
        for (t, &total) in bytes.iter().enumerate() {
            let mut next = 0;
            for k in c.iter().filter(|k| k.tensor == t) {
                assert_eq!(k.offset, next);
                assert!(k.len > 0 && k.len <= 10);
                next += k.len;
            }
            assert_eq!(next, total);
        }
        assert_eq!(
            chunks(&[2], &bytes, usize::MAX),
            vec![Chunk {
                tensor: 2,
                offset: 0,
                len: 25
            }]
        );
        for n in 3..=8 {
            for total in [1usize, 5 << 20, 1 << 30, 10 << 30] {
                let k = chunks(&[0], &[total], chunk_bytes(total, n)).len();
                assert!(k <= CHUNKS_MAX, "{n} GPUs, {total} bytes: {k} chunks");
            }
        }
    }

    /// Runs `calls` (each a list of operations queued in that order) on a model of `n` streams:
    /// at every step one stream whose next operation can run, picked at random, runs it. Events
    /// are waited on as they were recorded when the wait was queued; flags as they are when the
    /// wait runs. Checks that every copy reads a chunk its source holds and writes into a rank
    /// whose stream has reached the call, that no stream finishes a call before its output
    /// holds every chunk or while its buffer is still to be read, that nothing deadlocks and
    /// that the flags end at zero.
    fn simulate(n: usize, root: usize, chunks: usize, calls: &[Vec<ChainOp>], seed: u64) {
        use rand::{Rng, SeedableRng};
        use std::collections::HashMap;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for ops in calls {
            // Queue: per stream, (op, for waits the record index captured at queue time).
            let mut queues: Vec<Vec<(ChainOp, Option<usize>)>> = vec![Vec::new(); n];
            let mut records = vec![0usize; n];
            for op in ops {
                match *op {
                    ChainOp::Record { rank } => {
                        records[rank] += 1;
                        queues[rank].push((*op, Some(records[rank])));
                    }
                    ChainOp::Wait { rank, of } => queues[rank].push((*op, Some(records[of]))),
                    ChainOp::Copy { rank, .. }
                    | ChainOp::WaitFlag { rank, .. }
                    | ChainOp::WriteFlag { rank, .. } => queues[rank].push((*op, None)),
                }
            }
            let mut done_records = vec![0usize; n];
            let mut flags: HashMap<(usize, Flag), u32> = HashMap::new();
            let mut has = vec![vec![false; chunks]; n];
            has[root] = vec![true; chunks];
            let mut reads_left: Vec<usize> = (0..n)
                .map(|r| {
                    ops.iter()
                        .filter(|o| matches!(o, ChainOp::Copy { from, .. } if *from == r))
                        .count()
                })
                .collect();
            let mut heads = vec![0usize; n];
            loop {
                let runnable: Vec<usize> = (0..n)
                    .filter(|&r| {
                        heads[r] < queues[r].len()
                            && match queues[r][heads[r]] {
                                (ChainOp::Wait { of, .. }, Some(want)) => done_records[of] >= want,
                                (ChainOp::WaitFlag { rank, flag }, _) => {
                                    flags.get(&(rank, flag)).copied().unwrap_or(0) >= 1
                                }
                                _ => true,
                            }
                    })
                    .collect();
                if runnable.is_empty() {
                    let stuck: Vec<_> = (0..n).filter(|&r| heads[r] < queues[r].len()).collect();
                    assert!(stuck.is_empty(), "deadlock: streams {stuck:?} cannot go on");
                    break;
                }
                let r = runnable[rng.random_range(0..runnable.len())];
                match queues[r][heads[r]] {
                    (ChainOp::Record { rank }, Some(i)) => done_records[rank] = i,
                    (
                        ChainOp::Copy {
                            rank,
                            into,
                            from,
                            chunk,
                        },
                        _,
                    ) => {
                        assert!(
                            has[from][chunk],
                            "rank {rank} read chunk {chunk} from rank {from} before it arrived"
                        );
                        assert!(
                            heads[into] > 0,
                            "rank {rank} wrote into rank {into} before its stream reached the call"
                        );
                        has[into][chunk] = true;
                        reads_left[from] -= 1;
                    }
                    (
                        ChainOp::WriteFlag {
                            owner, flag, value, ..
                        },
                        _,
                    ) => {
                        flags.insert((owner, flag), value);
                    }
                    _ => {}
                }
                heads[r] += 1;
                if heads[r] == queues[r].len() {
                    assert_eq!(
                        reads_left[r], 0,
                        "rank {r}'s stream left the call while its buffer was still to be read"
                    );
                    assert!(
                        has[r].iter().all(|&x| x),
                        "rank {r}'s stream left the call before its output was complete"
                    );
                }
            }
            for (r, h) in has.iter().enumerate() {
                assert!(h.iter().all(|&x| x), "rank {r} lacks a chunk");
            }
            assert!(flags.values().all(|&v| v == 0), "flags left set: {flags:?}");
        }
    }

    #[test]
    fn chained_copies_are_ordered_under_any_schedule() {
        for n in 2..=8 {
            for root in [0, n - 1, n / 2] {
                let order = chain(root, n);
                for chunks in [1usize, 2, 5, WINDOW, WINDOW + 3] {
                    for seed in 0..8 {
                        let eager = eager_ops(&order, chunks);
                        simulate(n, root, chunks, &[eager.clone(), eager], seed);
                        let captured = captured_ops(&order, chunks);
                        // Two replays back to back: the flags must start from zero again.
                        simulate(n, root, chunks, &[captured.clone(), captured], seed);
                    }
                }
            }
        }
    }

    #[test]
    fn the_model_catches_a_missing_wait() {
        let order = chain(0, 3);
        let ops = eager_ops(&order, 4);
        let without = |pick: &dyn Fn(&ChainOp) -> bool, nth: usize| {
            let mut ops = ops.clone();
            let at = ops
                .iter()
                .enumerate()
                .filter(|(_, o)| pick(o))
                .map(|(i, _)| i)
                .nth(nth)
                .unwrap();
            ops.remove(at);
            ops
        };
        let caught = |ops: Vec<ChainOp>| {
            (0..64).any(|seed| {
                std::panic::catch_unwind(|| simulate(3, 0, 4, std::slice::from_ref(&ops), seed))
                    .is_err()
            })
        };
        // Rank 1 forwards its second chunk without waiting for it to arrive.
        assert!(caught(without(
            &|o| matches!(o, ChainOp::Wait { rank: 1, of: 0 }),
            1
        )));
        // Rank 1 copies into rank 2 before rank 2's stream reached the call.
        assert!(caught(without(
            &|o| matches!(o, ChainOp::Wait { rank: 1, of: 2 }),
            0
        )));
        // Rank 2 leaves the call without waiting for its last chunk.
        assert!(caught(without(
            &|o| matches!(o, ChainOp::Wait { rank: 2, of: 1 }),
            0
        )));
        // And the captured form without the last rank's final wait.
        let captured = captured_ops(&order, 4);
        let mut cut = captured.clone();
        let at = cut
            .iter()
            .rposition(|o| matches!(o, ChainOp::WaitFlag { rank: 2, .. }))
            .unwrap();
        cut.remove(at);
        assert!((0..64).any(|seed| {
            std::panic::catch_unwind(|| simulate(3, 0, 4, &[cut.clone()], seed)).is_err()
        }));
    }
}
