//! One tensor of a call as the paths see it: device addresses, a count and an element type.

use crate::dtype::DType;
use crate::limits::MAX_GPUS;

/// One tensor of a call, as addresses: `src` on the root, `dsts[rank]` on every rank (the
/// root's own output included; equal to `src` in place).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Item {
    pub src: u64,
    pub dsts: [u64; MAX_GPUS],
    pub count: usize,
    pub dtype: DType,
}

impl Item {
    /// A tensor of `count` elements of `dtype` from `src`, into `dsts[r]` on local rank `r`.
    pub(crate) fn new(src: u64, dsts: &[u64], count: usize, dtype: DType) -> Item {
        let mut item = Item {
            src,
            dsts: [0; MAX_GPUS],
            count,
            dtype,
        };
        item.dsts[..dsts.len()].copy_from_slice(dsts);
        item
    }

    pub(crate) fn bytes(&self) -> usize {
        // Validation checked that this product fits.
        self.count * self.dtype.size()
    }
}
