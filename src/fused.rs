//! Many tensors in one fused broadcast.

use crate::clique::{BroadcastOptions, Clique};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::{self, BufferInfo};
use crate::tensor::{DeviceTensor, DeviceTensorMut};

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

/// Output lists of a fused broadcast: `outputs[rank][tensor]`.
pub type OutputLists<'a, 'b> = [Vec<&'a mut (dyn DeviceTensorMut + 'b)>];

fn in_tensor(t: usize, e: Error) -> Error {
    match e {
        Error::WrongDevice {
            what,
            rank,
            expected,
            found,
        } => Error::WrongDevice {
            what: format!("tensor {t} {what}"),
            rank,
            expected,
            found,
        },
        Error::LengthMismatch {
            what,
            expected,
            got,
        } => Error::LengthMismatch {
            what: format!("tensor {t} {what}"),
            expected,
            got,
        },
        other => other,
    }
}

impl Clique {
    /// Broadcasts many tensors from `root` in one fused operation.
    ///
    /// `inputs[t]` is tensor `t` on the root's GPU; `outputs[rank][t]` its destination on rank
    /// `rank` (the root's own included). Tensors may have different element types and lengths;
    /// each tensor's outputs must match its input's type and length. Everything is validated
    /// before anything is enqueued.
    ///
    /// With [`crate::Path::Auto`] each tensor takes the path a single broadcast of its size
    /// would take; the P2P tensors are copied by one kernel launch per [`plan::LIST_MAX`]
    /// tensors (a table of source, destination and length; no staging copy), and the NCCL
    /// tensors are broadcast in NCCL groups.
    pub fn broadcast_many(
        &self,
        root: usize,
        inputs: &[&dyn DeviceTensor],
        outputs: &mut OutputLists<'_, '_>,
    ) -> Result<FusedReport> {
        self.broadcast_many_with(root, inputs, outputs, &BroadcastOptions::default())
    }

    /// [`Clique::broadcast_many`] with per-call options.
    pub fn broadcast_many_with(
        &self,
        root: usize,
        inputs: &[&dyn DeviceTensor],
        outputs: &mut OutputLists<'_, '_>,
        options: &BroadcastOptions,
    ) -> Result<FusedReport> {
        let shapes = self.validate_many(root, Some(inputs), outputs)?;
        let _guard = self.lock()?;
        let root_stream = self.stream(root).clone();
        let mut reads = Vec::with_capacity(inputs.len());
        let mut srcs = Vec::with_capacity(inputs.len());
        for input in inputs {
            let (ptr, g) = input.read_ptr(&root_stream);
            srcs.push(ptr);
            reads.push(g);
        }
        // SAFETY: validated; `run_many` only reads `srcs` and writes the outputs, which stay
        // borrowed until it returns.
        unsafe { self.run_many(root, &shapes, &srcs, outputs, options) }
    }

    /// In-place form: `buffers[root][t]` is tensor `t`'s source; every other rank's
    /// `buffers[rank][t]` receives it.
    pub fn broadcast_many_in_place(
        &self,
        root: usize,
        buffers: &mut OutputLists<'_, '_>,
        options: &BroadcastOptions,
    ) -> Result<FusedReport> {
        let shapes = self.validate_many(root, None, buffers)?;
        let _guard = self.lock()?;
        // The root's addresses are both sources and destinations: the kernel and NCCL both
        // skip or handle the self-copy. cudarc's write guards (taken in `run_many`) order them.
        let root_stream = self.stream(root).clone();
        let srcs: Vec<u64> = buffers[root]
            .iter()
            .map(|b| b.read_ptr(&root_stream).0)
            .collect();
        // SAFETY: as in `broadcast_many_with`.
        unsafe { self.run_many(root, &shapes, &srcs, buffers, options) }
    }

    /// Checks a fused broadcast; returns each tensor's (element count, type).
    fn validate_many(
        &self,
        root: usize,
        inputs: Option<&[&dyn DeviceTensor]>,
        outputs: &OutputLists<'_, '_>,
    ) -> Result<Vec<(usize, DType)>> {
        let n = self.len();
        if root >= n {
            return Err(Error::RootOutOfRange { root, size: n });
        }
        if outputs.len() != n {
            return Err(Error::OutputCount {
                what: "output lists",
                expected: n,
                got: outputs.len(),
            });
        }
        let count = inputs.map_or(outputs[root].len(), <[_]>::len);
        for (rank, list) in outputs.iter().enumerate() {
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
        let mut shapes = Vec::with_capacity(count);
        let mut infos = Vec::with_capacity(n);
        for t in 0..count {
            let dtype = inputs.map_or(outputs[root][t].dtype(), |i| i[t].dtype());
            infos.clear();
            for (rank, list) in outputs.iter().enumerate() {
                let o = &list[t];
                if o.dtype() != dtype {
                    return Err(Error::InvalidList(format!(
                        "tensor {t}: rank {rank}'s output is {}, the source is {dtype}",
                        o.dtype()
                    )));
                }
                infos.push(BufferInfo {
                    ordinal: o.ordinal(),
                    len: o.len(),
                });
            }
            let input = inputs.map(|i| BufferInfo {
                ordinal: i[t].ordinal(),
                len: i[t].len(),
            });
            let len = plan::validate_broadcast(self.ordinals(), root, input, &infos)
                .map_err(|e| in_tensor(t, e))?;
            shapes.push((len, dtype));
        }
        Ok(shapes)
    }

    /// Plans and enqueues a validated fused broadcast.
    ///
    /// # Safety
    /// `srcs[t]` holds tensor `t` on the root's device; `outputs` were validated against
    /// `shapes`. The caller holds the launch lock.
    unsafe fn run_many(
        &self,
        root: usize,
        shapes: &[(usize, DType)],
        srcs: &[u64],
        outputs: &mut OutputLists<'_, '_>,
        options: &BroadcastOptions,
    ) -> Result<FusedReport> {
        let n = self.len();
        let bytes: Vec<usize> = shapes.iter().map(|&(len, d)| len * d.size()).collect();
        let mut thresholds = self.thresholds();
        if let Some(t) = options.p2p_threshold {
            thresholds.p2p_max_bytes = t;
        }
        let path = options.path.unwrap_or(self.default_path);
        let fused = plan::plan_fused(&bytes, path, self.p2p_available(), &thresholds, n)?;
        let span = tracing::debug_span!(
            "broadcast_many",
            root,
            tensors = shapes.len(),
            bytes = bytes.iter().sum::<usize>(),
            p2p = fused.p2p_tensors(),
            nccl = fused.nccl_tensors()
        );
        let _enter = span.enter();

        let mut dsts: Vec<Vec<u64>> = Vec::with_capacity(n);
        let mut writes = Vec::new();
        for (rank, list) in outputs.iter_mut().enumerate() {
            let stream = self.stream(rank);
            let mut row = Vec::with_capacity(list.len());
            for o in list.iter_mut() {
                let (ptr, g) = o.write_ptr(stream);
                row.push(ptr);
                writes.push(g);
            }
            dsts.push(row);
        }

        let mut report = FusedReport {
            tensors: shapes.len(),
            bytes: bytes.iter().sum(),
            ..FusedReport::default()
        };
        if !fused.p2p.is_empty() {
            let p2p = self
                .p2p
                .as_ref()
                .map_err(|why| Error::P2pUnavailable(why.clone()))?;
            for batch in &fused.p2p {
                let copies: Vec<Vec<(u64, u64, usize)>> = (0..n)
                    .map(|rank| {
                        batch
                            .iter()
                            .map(|&t| (srcs[t], dsts[rank][t], bytes[t]))
                            .collect()
                    })
                    .collect();
                // SAFETY: per this function's contract.
                unsafe { p2p.launch_list(root, &copies, self.raw_streams()) }?;
                report.p2p_launches += 1;
                report.p2p_tensors += batch.len();
                report.p2p_bytes += batch.iter().map(|&t| bytes[t]).sum::<usize>();
            }
        }
        if !fused.nccl.is_empty() {
            let comms = self.comms.as_ref().expect("comms live until drop");
            for group in &fused.nccl {
                let g = comms.group()?;
                for &t in group {
                    let (len, dtype) = shapes[t];
                    for (rank, row) in dsts.iter().enumerate() {
                        let send = if rank == root { srcs[t] } else { row[t] };
                        let op = crate::nccl::RankOp {
                            rank,
                            root,
                            send,
                            recv: row[t],
                            count: len,
                            dtype: dtype.nccl(),
                            stream: self.raw_streams()[rank],
                        };
                        // SAFETY: per this function's contract.
                        unsafe { comms.broadcast_rank(op) }?;
                    }
                }
                g.end()?;
                report.nccl_groups += 1;
                report.nccl_tensors += group.len();
                report.nccl_bytes += group.iter().map(|&t| bytes[t]).sum::<usize>();
            }
        }
        drop(writes);
        Ok(report)
    }
}
