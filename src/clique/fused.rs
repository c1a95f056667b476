//! Many tensors in one fused call.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::access::{self, Foreign};
use super::{args, Clique};
use crate::config::{BroadcastOptions, MAX_GPUS};
use crate::engine::Item;
use crate::error::Result;
use crate::plan::FusedReport;
use crate::tensor::{DeviceTensor, DeviceTensorMut};

/// Output lists of a fused broadcast: `outputs[rank][tensor]`.
pub type OutputLists<'a, 'b> = [Vec<&'a mut (dyn DeviceTensorMut + 'b)>];

impl Clique {
    /// Broadcasts many tensors from `root` in one fused operation.
    ///
    /// `inputs[t]` is tensor `t` on the root's GPU; `outputs[rank][t]` its destination on rank
    /// `rank` (the root's own included). Tensors may have different element types and lengths;
    /// each tensor's outputs must match its input's type and length. Everything is validated
    /// before anything is queued, and every buffer may be dropped or reused when this returns.
    ///
    /// With [`crate::Path::Auto`] each tensor takes the path a single broadcast of its size
    /// would take; P2P tensors are copied by one kernel launch per 120 tensors (a table of
    /// source, destination and length; no staging copy), NCCL tensors are broadcast in groups.
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
        self.many(root, Some(inputs), outputs, options)
    }

    /// In-place form: `buffers[root][t]` is tensor `t`'s source; every other rank's
    /// `buffers[rank][t]` receives it.
    pub fn broadcast_many_in_place(
        &self,
        root: usize,
        buffers: &mut OutputLists<'_, '_>,
        options: &BroadcastOptions,
    ) -> Result<FusedReport> {
        self.many(root, None, buffers, options)
    }

    fn many(
        &self,
        root: usize,
        inputs: Option<&[&dyn DeviceTensor]>,
        outputs: &mut OutputLists<'_, '_>,
        options: &BroadcastOptions,
    ) -> Result<FusedReport> {
        let in_infos: Option<Vec<_>> =
            inputs.map(|i| i.iter().map(|t| access::info_of_dyn(*t)).collect());
        let out_infos: Vec<Vec<_>> = outputs
            .iter()
            .map(|l| l.iter().map(|t| access::info_of_dyn(&**t)).collect())
            .collect();
        let shapes = args::check_many(&self.places, root, in_infos.as_deref(), &out_infos, false)?;
        let bytes: Vec<usize> = shapes.iter().map(|s| s.bytes).collect();
        let steps = self.plan(&bytes, options)?;
        let report = FusedReport::of(&steps, &bytes);
        if steps.is_empty() {
            return Ok(report);
        }
        let mut engine = self.engine.lock()?;
        let in_streams: Vec<Arc<CudaStream>> = inputs
            .unwrap_or_default()
            .iter()
            .map(|t| t.stream().clone())
            .collect();
        let out_streams: Vec<Vec<Arc<CudaStream>>> = outputs
            .iter()
            .map(|l| l.iter().map(|t| t.stream().clone()).collect())
            .collect();
        let mut foreign = Foreign::default();
        for s in &in_streams {
            foreign.note(root, s, self.stream(root));
        }
        for (rank, list) in out_streams.iter().enumerate() {
            for s in list {
                foreign.note(rank, s, self.stream(rank));
            }
        }
        let count = shapes.len();
        let mut srcs = vec![0u64; count];
        let mut reads = Vec::with_capacity(in_streams.len());
        for (t, (input, s)) in inputs
            .unwrap_or_default()
            .iter()
            .zip(&in_streams)
            .enumerate()
        {
            let (ptr, g) = input.read_ptr(s);
            srcs[t] = ptr;
            reads.push(g);
        }
        let mut dsts = vec![[0u64; MAX_GPUS]; count];
        let mut writes = Vec::with_capacity(count * self.len());
        for (rank, (list, streams)) in outputs.iter_mut().zip(&out_streams).enumerate() {
            for (t, (out, s)) in list.iter_mut().zip(streams).enumerate() {
                let (ptr, g) = out.write_ptr(s);
                dsts[t][rank] = ptr;
                writes.push(g);
            }
        }
        let items: Vec<Item> = (0..count)
            .map(|t| Item {
                src: if inputs.is_some() {
                    srcs[t]
                } else {
                    dsts[t][root]
                },
                dsts: dsts[t],
                count: shapes[t].count,
                dtype: shapes[t].dtype,
            })
            .collect();
        // SAFETY: validated against the clique's ranks; the borrows and guards keep every
        // buffer alive and ordered for the queued work (see `access`).
        foreign.around(&mut engine, |e| unsafe { e.run(root, &items, &steps) })?;
        Ok(report)
    }
}
