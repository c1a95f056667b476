//! How one call's tensors are split into launches: pure, tested without a GPU.
//!
//! A single broadcast and a fused list go through the same plan: each tensor takes the route a
//! single broadcast of its size would take; P2P tensors become one kernel launch each when
//! alone, or fused launches of at most [`LIST_MAX`] copies; NCCL tensors go in groups of at most
//! [`NCCL_GROUP_MAX_OPS`] operations.

use crate::config::{self, Available, BroadcastPath, Route, Thresholds};
use crate::error::Result;
use crate::p2p::abi::LIST_MAX;
use crate::p2p::Protocol;

/// Most operations NCCL accepts between `ncclGroupStart` and `ncclGroupEnd`.
pub(crate) const NCCL_GROUP_MAX_OPS: usize = 2048;

/// One launch step of a planned call, naming tensors by index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// One tensor through the P2P kernel with `protocol`.
    P2pOne { tensor: usize, protocol: Protocol },
    /// Several tensors through one fused pull launch.
    P2pList { tensors: Vec<usize> },
    /// Tensors broadcast by NCCL inside one group.
    NcclGroup { tensors: Vec<usize> },
    /// Tensors copied by the copy engines along the chain of ranks, as one chunked stream.
    CopyEngine { tensors: Vec<usize> },
}

impl Step {
    /// Whether the step runs the P2P kernel.
    pub(crate) fn is_p2p(&self) -> bool {
        matches!(self, Step::P2pOne { .. } | Step::P2pList { .. })
    }
}

/// The step of a single broadcast (tensor `tensor`) on `route`; `None` for an empty one.
pub(crate) fn single(tensor: usize, route: Route) -> Option<Step> {
    let protocol = match route {
        Route::Empty => return None,
        Route::Nccl => {
            return Some(Step::NcclGroup {
                tensors: vec![tensor],
            })
        }
        Route::CopyEngine => {
            return Some(Step::CopyEngine {
                tensors: vec![tensor],
            })
        }
        Route::P2pPacket => Protocol::Packet,
        Route::P2pPull => Protocol::Pull,
        Route::P2pChain => Protocol::Chain,
    };
    Some(Step::P2pOne { tensor, protocol })
}

/// Plans a call of tensors of `bytes[i]` bytes on `nranks` ranks. Zero-length tensors are
/// skipped; copy-engine tensors come first (one step: the copy engines start while the P2P
/// kernel and NCCL run), then P2P steps, then NCCL groups. Without `fuse`, every P2P tensor
/// gets a launch of its own.
pub(crate) fn plan(
    bytes: &[usize],
    path: BroadcastPath,
    available: Available<'_>,
    thresholds: &Thresholds,
    nranks: usize,
    fuse: bool,
) -> Result<Vec<Step>> {
    let mut p2p_tensors = Vec::new();
    let mut nccl_tensors = Vec::new();
    let mut ce_tensors = Vec::new();
    for (i, &b) in bytes.iter().enumerate() {
        match config::choose(path, b, available, thresholds)? {
            Route::Empty => {}
            Route::Nccl => nccl_tensors.push(i),
            Route::CopyEngine => ce_tensors.push(i),
            Route::P2pPacket => p2p_tensors.push((i, Protocol::Packet)),
            Route::P2pPull => p2p_tensors.push((i, Protocol::Pull)),
            Route::P2pChain => p2p_tensors.push((i, Protocol::Chain)),
        }
    }
    let mut steps = Vec::new();
    if !ce_tensors.is_empty() {
        steps.push(Step::CopyEngine {
            tensors: ce_tensors,
        });
    }
    // A chained tensor is a launch of its own: the fused kernel fans out from the root.
    let (chained, p2p_tensors): (Vec<_>, Vec<_>) = p2p_tensors
        .into_iter()
        .partition(|&(_, protocol)| protocol == Protocol::Chain);
    for (tensor, protocol) in chained {
        steps.push(Step::P2pOne { tensor, protocol });
    }
    let per_list = if fuse { LIST_MAX } else { 1 };
    for chunk in p2p_tensors.chunks(per_list) {
        steps.push(match chunk {
            [(tensor, protocol)] => Step::P2pOne {
                tensor: *tensor,
                protocol: *protocol,
            },
            _ => Step::P2pList {
                tensors: chunk.iter().map(|c| c.0).collect(),
            },
        });
    }
    let per_group = (NCCL_GROUP_MAX_OPS / nranks.max(1)).max(1);
    for group in nccl_tensors.chunks(per_group) {
        steps.push(Step::NcclGroup {
            tensors: group.to_vec(),
        });
    }
    Ok(steps)
}

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

/// What a fused broadcast did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FusedReport {
    /// Tensors broadcast (zero-length ones included).
    pub tensors: usize,
    /// Bytes per GPU.
    pub bytes: usize,
    /// Tensors that went by the P2P kernel.
    pub p2p_tensors: usize,
    /// Their bytes.
    pub p2p_bytes: usize,
    /// P2P kernel launches (per GPU).
    pub p2p_launches: usize,
    /// Tensors that went by NCCL.
    pub nccl_tensors: usize,
    /// Their bytes.
    pub nccl_bytes: usize,
    /// NCCL groups.
    pub nccl_groups: usize,
    /// Tensors that went by the copy engines.
    pub copy_engine_tensors: usize,
    /// Their bytes.
    pub copy_engine_bytes: usize,
}

impl FusedReport {
    /// The report of `steps` over tensors of `bytes[i]` bytes.
    pub(crate) fn of(steps: &[Step], bytes: &[usize]) -> FusedReport {
        let mut r = FusedReport {
            tensors: bytes.len(),
            bytes: bytes.iter().sum(),
            ..FusedReport::default()
        };
        for step in steps {
            match step {
                Step::P2pOne { tensor, .. } => {
                    r.p2p_launches += 1;
                    r.p2p_tensors += 1;
                    r.p2p_bytes += bytes[*tensor];
                }
                Step::P2pList { tensors } => {
                    r.p2p_launches += 1;
                    r.p2p_tensors += tensors.len();
                    r.p2p_bytes += tensors.iter().map(|&t| bytes[t]).sum::<usize>();
                }
                Step::NcclGroup { tensors } => {
                    r.nccl_groups += 1;
                    r.nccl_tensors += tensors.len();
                    r.nccl_bytes += tensors.iter().map(|&t| bytes[t]).sum::<usize>();
                }
                Step::CopyEngine { tensors } => {
                    r.copy_engine_tensors += tensors.len();
                    r.copy_engine_bytes += tensors.iter().map(|&t| bytes[t]).sum::<usize>();
                }
            }
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::sync::OnceLock;

    /// After a failed copy, every copy that went out is still waited for by the stream of the
    /// rank it writes into: a record of the copying rank after the copy, then a wait of the
    /// receiving rank for that record, both among the ops that still go out.
    #[test]
    fn a_single_broadcast_takes_the_step_of_its_route() {
        assert_eq!(single(3, Route::Empty), None);
        assert_eq!(
            single(3, Route::Nccl),
            Some(Step::NcclGroup { tensors: vec![3] })
        );
        assert_eq!(
            single(3, Route::CopyEngine),
            Some(Step::CopyEngine { tensors: vec![3] })
        );
        for (route, protocol) in [
            (Route::P2pPacket, Protocol::Packet),
            (Route::P2pPull, Protocol::Pull),
            (Route::P2pChain, Protocol::Chain),
        ] {
            assert_eq!(
                single(3, route),
                Some(Step::P2pOne {
                    tensor: 3,
                    protocol
                })
            );
        }
    }

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

    fn no_ce() -> &'static Error {
        static E: OnceLock<Error> = OnceLock::new();
        E.get_or_init(|| Error::CopyEngineUnavailable("ranks in other processes".into()))
    }

    /// The P2P kernel as given, no copy engines.
    fn p2p_only(p2p: std::result::Result<(), &Error>) -> Available<'_> {
        Available {
            p2p,
            copy_engine: Err(no_ce()),
            nccl: true,
            p2p_chain: false,
        }
    }

    fn tensors_of(steps: &[Step]) -> (Vec<usize>, Vec<usize>) {
        let (mut p, mut n) = (Vec::new(), Vec::new());
        for s in steps {
            match s {
                Step::P2pOne { tensor, .. } => p.push(*tensor),
                Step::P2pList { tensors } => p.extend(tensors),
                Step::NcclGroup { tensors } | Step::CopyEngine { tensors } => n.extend(tensors),
            }
        }
        (p, n)
    }

    #[test]
    fn splits_by_size_and_limits() {
        let t = Thresholds {
            p2p_max_bytes: 1000,
            packet_max_bytes: 100,
            copy_engine_min_bytes: usize::MAX,
            p2p_chain_min_bytes: usize::MAX,
        };
        let sizes = [10usize, 0, 5000, 1000, 1001, 3];
        let steps = plan(&sizes, BroadcastPath::Auto, p2p_only(Ok(())), &t, 2, true).unwrap();
        assert_eq!(
            steps,
            vec![
                Step::P2pList {
                    tensors: vec![0, 3, 5]
                },
                Step::NcclGroup {
                    tensors: vec![2, 4]
                }
            ]
        );
        let r = FusedReport::of(&steps, &sizes);
        assert_eq!((r.tensors, r.bytes), (6, 7014));
        assert_eq!((r.p2p_tensors, r.p2p_bytes, r.p2p_launches), (3, 1013, 1));
        assert_eq!((r.nccl_tensors, r.nccl_bytes, r.nccl_groups), (2, 6001, 1));

        let no = Error::P2pUnavailable("no NVRTC".into());
        let all_nccl = plan(&sizes, BroadcastPath::Auto, p2p_only(Err(&no)), &t, 2, true).unwrap();
        assert_eq!(tensors_of(&all_nccl), (vec![], vec![0, 2, 3, 4, 5]));
        let forced = plan(&sizes, BroadcastPath::P2p, p2p_only(Ok(())), &t, 2, true).unwrap();
        assert_eq!(tensors_of(&forced), (vec![0, 2, 3, 4, 5], vec![]));
        assert!(plan(&sizes, BroadcastPath::P2p, p2p_only(Err(&no)), &t, 2, true).is_err());
        assert!(
            plan(&[], BroadcastPath::Auto, p2p_only(Ok(())), &t, 2, true)
                .unwrap()
                .is_empty()
        );
        assert!(
            plan(&[0, 0], BroadcastPath::P2p, p2p_only(Ok(())), &t, 2, true)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn a_lone_p2p_tensor_keeps_its_protocol() {
        let t = Thresholds {
            p2p_max_bytes: usize::MAX,
            packet_max_bytes: 100,
            copy_engine_min_bytes: usize::MAX,
            p2p_chain_min_bytes: usize::MAX,
        };
        assert_eq!(
            plan(&[64], BroadcastPath::Auto, p2p_only(Ok(())), &t, 2, true).unwrap(),
            vec![Step::P2pOne {
                tensor: 0,
                protocol: Protocol::Packet
            }]
        );
        assert_eq!(
            plan(&[0, 101], BroadcastPath::P2p, p2p_only(Ok(())), &t, 2, true).unwrap(),
            vec![Step::P2pOne {
                tensor: 1,
                protocol: Protocol::Pull
            }]
        );
        assert_eq!(
            plan(&[101], BroadcastPath::Nccl, p2p_only(Ok(())), &t, 2, true).unwrap(),
            vec![Step::NcclGroup { tensors: vec![0] }]
        );
    }

    #[test]
    fn launches_respect_list_and_group_limits() {
        let t = Thresholds::for_gpus(8);
        let many = vec![8usize; 1000];
        let p = plan(&many, BroadcastPath::P2p, p2p_only(Ok(())), &t, 8, true).unwrap();
        assert_eq!(p.len(), 1000usize.div_ceil(LIST_MAX));
        for s in &p {
            assert!(matches!(s, Step::P2pList { tensors } if tensors.len() <= LIST_MAX));
        }
        assert_eq!(tensors_of(&p).0, (0..1000).collect::<Vec<_>>());
        // 1000 = 8 lists of 120 and one of 40: no lone list.
        let n = plan(&many, BroadcastPath::Nccl, p2p_only(Ok(())), &t, 8, true).unwrap();
        for s in &n {
            assert!(
                matches!(s, Step::NcclGroup { tensors } if tensors.len() * 8 <= NCCL_GROUP_MAX_OPS)
            );
        }
        assert_eq!(tensors_of(&n).1, (0..1000).collect::<Vec<_>>());
        // Unfused, every P2P tensor is a launch of its own with its own protocol.
        let t = Thresholds {
            p2p_max_bytes: usize::MAX,
            packet_max_bytes: 100,
            copy_engine_min_bytes: usize::MAX,
            p2p_chain_min_bytes: usize::MAX,
        };
        let unfused = plan(
            &[10, 500, 0],
            BroadcastPath::P2p,
            p2p_only(Ok(())),
            &t,
            2,
            false,
        )
        .unwrap();
        assert_eq!(
            unfused,
            vec![
                Step::P2pOne {
                    tensor: 0,
                    protocol: Protocol::Packet
                },
                Step::P2pOne {
                    tensor: 1,
                    protocol: Protocol::Pull
                }
            ]
        );
        let t = Thresholds::for_gpus(8);
        // A last chunk of one P2P tensor becomes a single launch.
        let p = plan(
            &vec![8usize; LIST_MAX + 1],
            BroadcastPath::P2p,
            p2p_only(Ok(())),
            &t,
            2,
            true,
        )
        .unwrap();
        assert!(matches!(p.last(), Some(Step::P2pOne { tensor, .. }) if *tensor == LIST_MAX));
    }

    #[test]
    fn copy_engine_tensors_share_one_step_ahead_of_the_rest() {
        let t = Thresholds {
            p2p_max_bytes: 1000,
            packet_max_bytes: 100,
            copy_engine_min_bytes: 5000,
            p2p_chain_min_bytes: usize::MAX,
        };
        let both = Available {
            p2p: Ok(()),
            copy_engine: Ok(()),
            nccl: true,
            p2p_chain: false,
        };
        let sizes = [10usize, 6000, 2000, 0, 5000];
        let steps = plan(&sizes, BroadcastPath::Auto, both, &t, 2, true).unwrap();
        assert_eq!(
            steps,
            vec![
                Step::CopyEngine {
                    tensors: vec![1, 4]
                },
                Step::P2pOne {
                    tensor: 0,
                    protocol: Protocol::Packet
                },
                Step::NcclGroup { tensors: vec![2] },
            ]
        );
        let r = FusedReport::of(&steps, &sizes);
        assert_eq!((r.copy_engine_tensors, r.copy_engine_bytes), (2, 11000));
        assert_eq!((r.p2p_tensors, r.nccl_tensors), (1, 1));
        // Without the copy engines, Auto falls back; forcing them is the reason's error.
        let steps = plan(&sizes, BroadcastPath::Auto, p2p_only(Ok(())), &t, 2, true).unwrap();
        assert!(!steps.iter().any(|s| matches!(s, Step::CopyEngine { .. })));
        assert!(matches!(
            plan(
                &sizes,
                BroadcastPath::CopyEngine,
                p2p_only(Ok(())),
                &t,
                2,
                true
            ),
            Err(Error::CopyEngineUnavailable(_))
        ));
        let forced = plan(&sizes, BroadcastPath::CopyEngine, both, &t, 2, true).unwrap();
        assert_eq!(
            forced,
            vec![Step::CopyEngine {
                tensors: vec![0, 1, 2, 4]
            }]
        );
    }

    #[test]
    fn chained_p2p_tensors_are_launches_of_their_own() {
        let t = Thresholds {
            p2p_max_bytes: 1000,
            packet_max_bytes: 100,
            copy_engine_min_bytes: usize::MAX,
            p2p_chain_min_bytes: 3000,
        };
        let chained = Available {
            p2p: Ok(()),
            copy_engine: Err(no_ce()),
            nccl: true,
            p2p_chain: true,
        };
        let sizes = [5000usize, 200, 3000, 2999, 10];
        let steps = plan(&sizes, BroadcastPath::P2p, chained, &t, 4, true).unwrap();
        assert_eq!(
            steps,
            vec![
                Step::P2pOne {
                    tensor: 0,
                    protocol: Protocol::Chain
                },
                Step::P2pOne {
                    tensor: 2,
                    protocol: Protocol::Chain
                },
                Step::P2pList {
                    tensors: vec![1, 3, 4]
                },
            ]
        );
        // Across processes the same tensors fan out from the root (staged, one at a time).
        let apart = Available {
            p2p_chain: false,
            ..chained
        };
        let steps = plan(&sizes, BroadcastPath::P2p, apart, &t, 4, false).unwrap();
        assert!(steps.iter().all(|s| matches!(
            s,
            Step::P2pOne { protocol, .. } if *protocol != Protocol::Chain
        )));
        assert_eq!(steps.len(), 5);
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
