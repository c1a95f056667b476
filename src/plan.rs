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
}
