//! CUDA graphs: what the engine asks of a graph beyond cudarc's `result::graph`.

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{self, CUgraph};

/// The number of nodes in `graph` (`cuGraphGetNodes` with a null array, which asks only for
/// the count).
///
/// # Safety
/// `graph` is a live graph.
pub(crate) unsafe fn node_count(graph: CUgraph) -> Result<usize, DriverError> {
    let mut nodes = 0usize;
    // SAFETY: `graph` is live (this function's contract); a null array asks only for the
    // count, and `nodes` is a live local, a valid out pointer.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut nodes) }.result()?;
    Ok(nodes)
}
