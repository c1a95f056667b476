//! How one call's tensors are split into launches: pure, tested without a GPU.
//!
//! A single broadcast and a fused list go through the same plan: each tensor takes the route a
//! single broadcast of its size would take; P2P tensors become one kernel launch each when
//! alone, or fused launches of at most [`LIST_MAX`] copies; NCCL tensors go in groups of at most
//! [`NCCL_GROUP_MAX_OPS`] operations.

use crate::config::{self, Path, Route, Thresholds};
use crate::error::{Error, Result};
use crate::p2p::abi::LIST_MAX;

/// Most operations NCCL accepts between `ncclGroupStart` and `ncclGroupEnd`.
pub(crate) const NCCL_GROUP_MAX_OPS: usize = 2048;

/// One launch step of a planned call, naming tensors by index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// One tensor through the P2P kernel of `route` (packet or pull).
    P2pOne { tensor: usize, route: Route },
    /// Several tensors through one fused pull launch.
    P2pList { tensors: Vec<usize> },
    /// Tensors broadcast by NCCL inside one group.
    NcclGroup { tensors: Vec<usize> },
}

/// Plans a call of tensors of `bytes[i]` bytes on `nranks` ranks. Zero-length tensors are
/// skipped; P2P steps come first, then NCCL groups. Without `fuse`, every P2P tensor gets a
/// launch of its own.
pub(crate) fn plan(
    bytes: &[usize],
    path: Path,
    p2p: std::result::Result<(), &Error>,
    thresholds: &Thresholds,
    nranks: usize,
    fuse: bool,
) -> Result<Vec<Step>> {
    let mut p2p_tensors = Vec::new();
    let mut nccl_tensors = Vec::new();
    for (i, &b) in bytes.iter().enumerate() {
        match config::choose(path, b, p2p, thresholds)? {
            Route::Empty => {}
            Route::Nccl => nccl_tensors.push(i),
            route => p2p_tensors.push((i, route)),
        }
    }
    let mut steps = Vec::new();
    let per_list = if fuse { LIST_MAX } else { 1 };
    for chunk in p2p_tensors.chunks(per_list) {
        steps.push(match chunk {
            [(tensor, route)] => Step::P2pOne {
                tensor: *tensor,
                route: *route,
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
            }
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensors_of(steps: &[Step]) -> (Vec<usize>, Vec<usize>) {
        let (mut p, mut n) = (Vec::new(), Vec::new());
        for s in steps {
            match s {
                Step::P2pOne { tensor, .. } => p.push(*tensor),
                Step::P2pList { tensors } => p.extend(tensors),
                Step::NcclGroup { tensors } => n.extend(tensors),
            }
        }
        (p, n)
    }

    #[test]
    fn splits_by_size_and_limits() {
        let t = Thresholds {
            p2p_max_bytes: 1000,
            packet_max_bytes: 100,
        };
        let sizes = [10usize, 0, 5000, 1000, 1001, 3];
        let steps = plan(&sizes, Path::Auto, Ok(()), &t, 2, true).unwrap();
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
        let all_nccl = plan(&sizes, Path::Auto, Err(&no), &t, 2, true).unwrap();
        assert_eq!(tensors_of(&all_nccl), (vec![], vec![0, 2, 3, 4, 5]));
        let forced = plan(&sizes, Path::P2p, Ok(()), &t, 2, true).unwrap();
        assert_eq!(tensors_of(&forced), (vec![0, 2, 3, 4, 5], vec![]));
        assert!(plan(&sizes, Path::P2p, Err(&no), &t, 2, true).is_err());
        assert!(plan(&[], Path::Auto, Ok(()), &t, 2, true)
            .unwrap()
            .is_empty());
        assert!(plan(&[0, 0], Path::P2p, Ok(()), &t, 2, true)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn a_lone_p2p_tensor_keeps_its_protocol() {
        let t = Thresholds {
            p2p_max_bytes: usize::MAX,
            packet_max_bytes: 100,
        };
        assert_eq!(
            plan(&[64], Path::Auto, Ok(()), &t, 2, true).unwrap(),
            vec![Step::P2pOne {
                tensor: 0,
                route: Route::P2pPacket
            }]
        );
        assert_eq!(
            plan(&[0, 101], Path::P2p, Ok(()), &t, 2, true).unwrap(),
            vec![Step::P2pOne {
                tensor: 1,
                route: Route::P2pPull
            }]
        );
        assert_eq!(
            plan(&[101], Path::Nccl, Ok(()), &t, 2, true).unwrap(),
            vec![Step::NcclGroup { tensors: vec![0] }]
        );
    }

    #[test]
    fn launches_respect_list_and_group_limits() {
        let t = Thresholds::for_gpus(8);
        let many = vec![8usize; 1000];
        let p = plan(&many, Path::P2p, Ok(()), &t, 8, true).unwrap();
        assert_eq!(p.len(), 1000usize.div_ceil(LIST_MAX));
        for s in &p {
            assert!(matches!(s, Step::P2pList { tensors } if tensors.len() <= LIST_MAX));
        }
        assert_eq!(tensors_of(&p).0, (0..1000).collect::<Vec<_>>());
        // 1000 = 8 lists of 120 and one of 40: no lone list.
        let n = plan(&many, Path::Nccl, Ok(()), &t, 8, true).unwrap();
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
        };
        let unfused = plan(&[10, 500, 0], Path::P2p, Ok(()), &t, 2, false).unwrap();
        assert_eq!(
            unfused,
            vec![
                Step::P2pOne {
                    tensor: 0,
                    route: Route::P2pPacket
                },
                Step::P2pOne {
                    tensor: 1,
                    route: Route::P2pPull
                }
            ]
        );
        let t = Thresholds::for_gpus(8);
        // A last chunk of one P2P tensor becomes a single launch.
        let p = plan(&vec![8usize; LIST_MAX + 1], Path::P2p, Ok(()), &t, 2, true).unwrap();
        assert!(matches!(p.last(), Some(Step::P2pOne { tensor, .. }) if *tensor == LIST_MAX));
    }
}
