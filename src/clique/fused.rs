//! Many tensors in one fused call.

use super::Clique;
use crate::config::BroadcastOptions;
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
    /// With [`crate::BroadcastPath::Auto`] each tensor takes the path a single broadcast of its
    /// size would take; P2P tensors are copied by one kernel launch per 120 tensors (a table of
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
    ) -> Result<FusedReport> {
        self.broadcast_many_in_place_with(root, buffers, &BroadcastOptions::default())
    }

    /// [`Clique::broadcast_many_in_place`] with per-call options.
    pub fn broadcast_many_in_place_with(
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
        self.core.many(root, inputs, outputs, options)
    }
}
