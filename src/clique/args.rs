//! Argument checks, pure: device lists and broadcast arguments are validated here before any
//! GPU work, from plain descriptions of the buffers. Tested without a GPU.

use crate::config::MAX_GPUS;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ranks::{local_of, JobRank, Local, Root};

/// Checks a device list without touching the driver: 1 to 8 distinct ordinals.
pub(crate) fn check_device_list(ordinals: &[usize], shared: bool) -> Result<()> {
    if ordinals.is_empty() {
        return Err(Error::NoDevice("the device list is empty".into()));
    }
    if ordinals.len() > MAX_GPUS {
        return Err(Error::TooManyDevices {
            requested: ordinals.len(),
            max: MAX_GPUS,
        });
    }
    for (i, &o) in ordinals.iter().enumerate() {
        if !shared && ordinals[..i].contains(&o) {
            return Err(Error::DuplicateDevice { ordinal: o });
        }
    }
    Ok(())
}

/// Checks that every ordinal exists on a machine with `available` devices.
pub(crate) fn check_in_range(ordinals: &[usize], available: usize) -> Result<()> {
    match ordinals.iter().find(|&&o| o >= available) {
        Some(&ordinal) => Err(Error::DeviceOutOfRange { ordinal, available }),
        None => Ok(()),
    }
}

/// Where a rank lives: its device ordinal and its context (as an opaque id).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Place {
    pub ordinal: usize,
    pub ctx: usize,
}

/// A buffer as validation sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BufferInfo {
    pub place: Place,
    pub len: usize,
    pub dtype: DType,
}

/// The ranks a process drives and their place in the job.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ranks<'a> {
    /// Device and context of each local rank.
    pub places: &'a [Place],
    /// The job rank of each local rank.
    pub globals: &'a [JobRank],
    /// Ranks in the job.
    pub world: usize,
}

impl Ranks<'_> {
    /// Job rank `root` as a call's root, with its local index where this process holds it: the
    /// one conversion of a call's root, made where the call begins; its checks, its buffers and
    /// the engine take the result.
    pub(crate) fn root(&self, root: usize) -> Root {
        let job = JobRank(root);
        Root {
            job,
            local: local_of(self.globals.iter().copied(), job),
        }
    }
}

/// The element count and byte size of a validated broadcast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub count: usize,
    pub bytes: usize,
    pub dtype: DType,
}

/// Checks one broadcast against the local ranks. `input` is the root's source (only where
/// the root is local, out of place); `None` in place (the root's entry of `outputs` is the
/// source) or where the root is in another process. `tensor` names the tensor in errors of
/// fused calls.
pub(crate) fn check_broadcast(
    ranks: &Ranks<'_>,
    root: Root,
    input: Option<BufferInfo>,
    outputs: &[BufferInfo],
    tensor: Option<usize>,
) -> Result<Shape> {
    let n = ranks.places.len();
    check_root(ranks, root)?;
    let label = |what: &str| match tensor {
        Some(t) => format!("tensor {t} {what}"),
        None => what.to_string(),
    };
    if outputs.len() != n {
        return Err(Error::OutputCount {
            what: if input.is_some() {
                "outputs"
            } else {
                "buffers"
            },
            expected: n,
            got: outputs.len(),
        });
    }
    if n == 0 {
        return Err(Error::OutputCount {
            what: "buffers",
            expected: 1,
            got: 0,
        });
    }
    let reference = match (input, root.local) {
        (Some(inp), Some(Local(local))) => {
            check_place(|| label("input"), root.job.0, ranks.places[local], inp.place)?;
            inp
        }
        (Some(_), None) => {
            return Err(Error::InvalidArgument(format!(
                "{} was given, but the root (rank {}) belongs to another process: only the root's process passes an input",
                label("an input"),
                root.job
            )))
        }
        (None, Some(Local(local))) => outputs[local],
        (None, None) => outputs[0],
    };
    for (local, out) in outputs.iter().enumerate() {
        let rank = ranks.globals[local].0;
        let what = || {
            label(&if input.is_some() {
                format!("output {rank}")
            } else {
                format!("buffer {rank}")
            })
        };
        check_place(what, rank, ranks.places[local], out.place)?;
        if out.dtype != reference.dtype {
            return Err(Error::InvalidList(format!(
                "{} holds {}, the source holds {}",
                what(),
                out.dtype,
                reference.dtype
            )));
        }
        if out.len != reference.len {
            return Err(Error::LengthMismatch {
                what: what(),
                expected: reference.len,
                got: out.len,
            });
        }
    }
    let bytes = reference
        .len
        .checked_mul(reference.dtype.size())
        .filter(|&b| isize::try_from(b).is_ok())
        .ok_or_else(|| Error::TooLarge {
            what: label(if input.is_some() { "input" } else { "source" }),
            elements: reference.len,
            element_size: reference.dtype.size(),
        })?;
    Ok(Shape {
        count: reference.len,
        bytes,
        dtype: reference.dtype,
    })
}

/// Checks that the root is a rank of the job.
fn check_root(ranks: &Ranks<'_>, root: Root) -> Result<()> {
    if root.job.0 >= ranks.world {
        return Err(Error::RootOutOfRange {
            root: root.job.0,
            size: ranks.world,
        });
    }
    Ok(())
}

/// Checks that a buffer or stream at `found` sits where rank `rank` (at `expected`) is; `what`
/// names it in the error (built only then).
pub(crate) fn check_place(
    what: impl FnOnce() -> String,
    rank: usize,
    expected: Place,
    found: Place,
) -> Result<()> {
    if found.ordinal != expected.ordinal {
        return Err(Error::WrongDevice {
            what: what(),
            rank,
            expected: expected.ordinal,
            found: found.ordinal,
        });
    }
    if found.ctx != expected.ctx {
        return Err(Error::ForeignContext {
            what: what(),
            rank,
            ordinal: expected.ordinal,
        });
    }
    Ok(())
}

/// Checks a fused call: `inputs` (or, in place, `outputs[root]`) gives the tensors; every rank
/// has one output per tensor. Returns each tensor's shape.
/// Errors name the tensor (`tensor 2 output 1`) unless the call is a single broadcast.
pub(crate) fn check_many(
    ranks: &Ranks<'_>,
    root: Root,
    inputs: Option<&[BufferInfo]>,
    outputs: &[Vec<BufferInfo>],
    single: bool,
) -> Result<Vec<Shape>> {
    let n = ranks.places.len();
    check_root(ranks, root)?;
    if outputs.len() != n {
        return Err(Error::OutputCount {
            what: "output lists",
            expected: n,
            got: outputs.len(),
        });
    }
    let count = inputs.map_or(outputs[root.local.map_or(0, |l| l.0)].len(), <[_]>::len);
    for (list, rank) in outputs.iter().zip(ranks.globals) {
        if list.len() != count {
            return Err(Error::InvalidList(format!(
                "rank {rank} has {} tensors, the {} has {count}",
                list.len(),
                if inputs.is_some() {
                    "input list"
                } else {
                    "root"
                }
            )));
        }
    }
    let mut column = Vec::with_capacity(n);
    (0..count)
        .map(|t| {
            column.clear();
            column.extend(outputs.iter().map(|list| list[t]));
            let tensor = (!single).then_some(t);
            check_broadcast(ranks, root, inputs.map(|i| i[t]), &column, tensor)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`super::check_broadcast`] of a call from job rank `root`.
    fn check_broadcast(
        ranks: &Ranks<'_>,
        root: usize,
        input: Option<BufferInfo>,
        outputs: &[BufferInfo],
        tensor: Option<usize>,
    ) -> Result<Shape> {
        super::check_broadcast(ranks, ranks.root(root), input, outputs, tensor)
    }

    /// [`super::check_many`] of a call from job rank `root`.
    fn check_many(
        ranks: &Ranks<'_>,
        root: usize,
        inputs: Option<&[BufferInfo]>,
        outputs: &[Vec<BufferInfo>],
        single: bool,
    ) -> Result<Vec<Shape>> {
        super::check_many(ranks, ranks.root(root), inputs, outputs, single)
    }

    #[test]
    fn device_lists_are_checked_without_a_driver() {
        assert!(check_device_list(&[0, 1], false).is_ok());
        assert!(check_device_list(&[0, 1, 0], true).is_ok());
        assert!(matches!(
            check_device_list(&[], false),
            Err(Error::NoDevice(_))
        ));
        assert!(matches!(
            check_device_list(&[0, 1, 0], false),
            Err(Error::DuplicateDevice { ordinal: 0 })
        ));
        let nine: Vec<usize> = (0..9).collect();
        assert!(matches!(
            check_device_list(&nine, true),
            Err(Error::TooManyDevices {
                requested: 9,
                max: 8
            })
        ));
        assert!(check_in_range(&[0, 1], 2).is_ok());
        assert!(matches!(
            check_in_range(&[0, 2], 2),
            Err(Error::DeviceOutOfRange {
                ordinal: 2,
                available: 2
            })
        ));
    }

    const A: Place = Place {
        ordinal: 3,
        ctx: 30,
    };
    const B: Place = Place {
        ordinal: 5,
        ctx: 50,
    };

    const JOB: [JobRank; 8] = [
        JobRank(0),
        JobRank(1),
        JobRank(2),
        JobRank(3),
        JobRank(4),
        JobRank(5),
        JobRank(6),
        JobRank(7),
    ];

    /// All ranks local, as in a clique.
    fn clique(places: &[Place]) -> Ranks<'_> {
        Ranks {
            places,
            globals: &JOB[..places.len()],
            world: places.len(),
        }
    }

    fn buf(place: Place, len: usize) -> BufferInfo {
        BufferInfo {
            place,
            len,
            dtype: DType::F32,
        }
    }

    #[test]
    fn broadcast_arguments() {
        let places = [A, B];
        let outs = [buf(A, 10), buf(B, 10)];
        let shape = check_broadcast(&clique(&places), 1, Some(buf(B, 10)), &outs, None).unwrap();
        assert_eq!((shape.count, shape.bytes), (10, 40));
        assert_eq!(
            check_broadcast(&clique(&places), 0, None, &outs, None)
                .unwrap()
                .count,
            10
        );
        assert!(matches!(
            check_broadcast(&clique(&places), 2, Some(buf(A, 10)), &outs, None),
            Err(Error::RootOutOfRange { root: 2, size: 2 })
        ));
        assert!(matches!(
            check_broadcast(&clique(&places), 0, Some(buf(A, 10)), &outs[..1], None),
            Err(Error::OutputCount {
                expected: 2,
                got: 1,
                ..
            })
        ));
        assert!(matches!(
            check_broadcast(&clique(&places), 0, Some(buf(B, 10)), &outs, None),
            Err(Error::WrongDevice { ref what, expected: 3, found: 5, .. }) if what == "input"
        ));
        assert!(matches!(
            check_broadcast(
                &clique(&places),
                0,
                Some(buf(A, 10)),
                &[buf(A, 10), buf(A, 10)],
                None
            ),
            Err(Error::WrongDevice { rank: 1, .. })
        ));
        assert!(matches!(
            check_broadcast(
                &clique(&places),
                0,
                Some(buf(A, 10)),
                &[buf(A, 10), buf(B, 9)],
                None
            ),
            Err(Error::LengthMismatch {
                expected: 10,
                got: 9,
                ..
            })
        ));
        assert!(matches!(
            check_broadcast(&clique(&places), 1, None, &[buf(A, 9), buf(B, 10)], None),
            Err(Error::LengthMismatch { ref what, .. }) if what == "buffer 0"
        ));
        let zero = check_broadcast(
            &clique(&places),
            0,
            Some(buf(A, 0)),
            &[buf(A, 0), buf(B, 0)],
            None,
        );
        assert_eq!(zero.unwrap().bytes, 0);
    }

    #[test]
    fn a_buffer_of_another_context_is_named() {
        let other = Place {
            ordinal: 5,
            ctx: 51,
        };
        let e = check_broadcast(
            &clique(&[A, B]),
            0,
            Some(buf(A, 4)),
            &[buf(A, 4), buf(other, 4)],
            None,
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::ForeignContext { ref what, rank: 1, ordinal: 5 } if what == "output 1"),
            "{e}"
        );
        assert!(e.to_string().contains("clique.stream(1)"), "{e}");
    }

    #[test]
    fn byte_counts_cannot_overflow() {
        let huge = BufferInfo {
            place: A,
            len: usize::MAX / 4,
            dtype: DType::F64,
        };
        let e = check_broadcast(&clique(&[A]), 0, Some(huge), &[huge], None).unwrap_err();
        assert!(
            matches!(
                e,
                Error::TooLarge {
                    element_size: 8,
                    ..
                }
            ),
            "{e}"
        );
        // Past isize::MAX bytes is no valid allocation either.
        let half = BufferInfo {
            place: A,
            len: usize::MAX / 2,
            dtype: DType::U8,
        };
        assert!(matches!(
            check_broadcast(&clique(&[A]), 0, Some(half), &[half], None),
            Ok(Shape { .. })
        ));
        let over = BufferInfo {
            len: usize::MAX / 2 + 1,
            ..half
        };
        assert!(matches!(
            check_broadcast(&clique(&[A]), 0, Some(over), &[over], None),
            Err(Error::TooLarge { .. })
        ));
    }

    #[test]
    fn one_rank_of_a_job() {
        // Rank 2 of 4, alone in its process.
        let places = [B];
        let me = Ranks {
            places: &places,
            globals: &[JobRank(2)],
            world: 4,
        };
        // In place from a remote root: the buffer is the reference.
        assert_eq!(
            check_broadcast(&me, 0, None, &[buf(B, 7)], None)
                .unwrap()
                .count,
            7
        );
        // Out of place on the root.
        assert_eq!(
            check_broadcast(&me, 2, Some(buf(B, 7)), &[buf(B, 7)], None)
                .unwrap()
                .count,
            7
        );
        // An input on a process without the root is an error.
        assert!(matches!(
            check_broadcast(&me, 1, Some(buf(B, 7)), &[buf(B, 7)], None),
            Err(Error::InvalidArgument(ref m)) if m.contains("rank 1")
        ));
        assert!(matches!(
            check_broadcast(&me, 4, None, &[buf(B, 7)], None),
            Err(Error::RootOutOfRange { root: 4, size: 4 })
        ));
        assert!(matches!(
            check_broadcast(&me, 0, None, &[buf(A, 7)], None),
            Err(Error::WrongDevice { rank: 2, .. })
        ));
        let lists = vec![vec![buf(B, 3), buf(B, 4)]];
        assert_eq!(check_many(&me, 3, None, &lists, false).unwrap().len(), 2);
    }

    #[test]
    fn the_root_is_a_job_rank_found_among_the_local_ranks() {
        // Job ranks 5 and 2 of 6, held here in that order: job rank 2 is local rank 1.
        let places = [A, B];
        let held = Ranks {
            places: &places,
            globals: &[JobRank(5), JobRank(2)],
            world: 6,
        };
        let root = held.root(2);
        assert_eq!((root.job, root.local), (JobRank(2), Some(Local(1))));
        assert_eq!(held.root(0).local, None);
        // The root's input sits with local rank 1, on B.
        let outs = [buf(A, 4), buf(B, 4)];
        assert!(check_broadcast(&held, 2, Some(buf(B, 4)), &outs, None).is_ok());
        assert!(matches!(
            check_broadcast(&held, 2, Some(buf(A, 4)), &outs, None),
            Err(Error::WrongDevice {
                rank: 2,
                expected: 5,
                found: 3,
                ..
            })
        ));
        // In place, local rank 1's buffer is the source, and errors name job ranks.
        assert!(matches!(
            check_broadcast(&held, 2, None, &[buf(A, 3), buf(B, 4)], None),
            Err(Error::LengthMismatch { ref what, expected: 4, got: 3 }) if what == "buffer 5"
        ));
        let lists = vec![vec![buf(A, 1), buf(A, 1)], vec![buf(B, 1)]];
        assert!(matches!(
            check_many(&held, 2, None, &lists, false),
            Err(Error::InvalidList(ref m)) if m.starts_with("rank 5 has 2 tensors, the root has 1")
        ));
    }

    #[test]
    fn element_types_must_agree() {
        let half = BufferInfo {
            place: B,
            len: 10,
            dtype: DType::F16,
        };
        let e = check_broadcast(
            &clique(&[A, B]),
            0,
            Some(buf(A, 10)),
            &[buf(A, 10), half],
            None,
        )
        .unwrap_err();
        assert!(matches!(e, Error::InvalidList(ref m) if m.contains("f16") && m.contains("f32")));
    }

    #[test]
    fn fused_lists() {
        let places = [A, B];
        let ins = [buf(A, 4), buf(A, 0), buf(A, 7)];
        let outs = vec![ins.to_vec(), vec![buf(B, 4), buf(B, 0), buf(B, 7)]];
        let shapes = check_many(&clique(&places), 0, Some(&ins), &outs, false).unwrap();
        assert_eq!(
            shapes.iter().map(|s| s.bytes).collect::<Vec<_>>(),
            vec![16, 0, 28]
        );
        assert_eq!(
            check_many(&clique(&places), 0, None, &outs, false)
                .unwrap()
                .len(),
            3
        );
        let short = vec![ins.to_vec(), vec![buf(B, 4)]];
        assert!(matches!(
            check_many(&clique(&places), 0, Some(&ins), &short, false),
            Err(Error::InvalidList(ref m)) if m.contains("rank 1 has 1 tensors")
        ));
        let bad = vec![ins.to_vec(), vec![buf(B, 4), buf(B, 0), buf(B, 6)]];
        assert!(matches!(
            check_many(&clique(&places), 0, Some(&ins), &bad, false),
            Err(Error::LengthMismatch { ref what, .. }) if what == "tensor 2 output 1"
        ));
        let one = vec![vec![buf(A, 4)], vec![buf(B, 5)]];
        assert!(matches!(
            check_many(&clique(&places), 0, Some(&ins[..1]), &one, true),
            Err(Error::LengthMismatch { ref what, .. }) if what == "output 1"
        ));
        assert!(matches!(
            check_many(&clique(&places), 0, Some(&ins), &outs[..1], false),
            Err(Error::OutputCount { .. })
        ));
        assert!(matches!(
            check_many(&clique(&places), 2, Some(&ins), &outs, false),
            Err(Error::RootOutOfRange { .. })
        ));
    }
}
