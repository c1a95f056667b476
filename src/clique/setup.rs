//! Creating a clique: the driver checks, contexts and streams, peer access between every pair,
//! and the topology that results.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{result, CudaContext, CudaStream};

use super::args;
use crate::config::{BroadcastOptions, Settings, MAX_GPUS};
use crate::driver;
use crate::engine::{Engine, Rank};
use crate::error::{Error, Result};
use crate::nccl::{Comms, Nccl};
use crate::p2p::P2p;
use crate::ranks::JobRank;
use crate::topology::{Link, Topology};

const CUDA_HINT: &str =
    "install the NVIDIA driver (it provides libcuda.so.1); in a container, start it with \
GPU access (e.g. `docker run --gpus all` with the NVIDIA container toolkit)";

/// The CUDA version of the driver API gpucast was built against (its `cuda-*` feature).
const BUILT_CUDA: i32 = if cfg!(feature = "cuda-13000") {
    13000
} else if cfg!(feature = "cuda-12090") {
    12090
} else if cfg!(feature = "cuda-12080") {
    12080
} else if cfg!(feature = "cuda-12060") {
    12060
} else {
    12040
};

/// `Ok` when `present` (the result of probing for libcuda) is true, else the typed error with
/// the fix.
pub(crate) fn require_libcuda(present: bool) -> Result<()> {
    if present {
        Ok(())
    } else {
        Err(Error::LibraryMissing {
            library: "libcuda",
            detail: "libcuda.so could not be opened".into(),
            hint: CUDA_HINT,
        })
    }
}

fn check_libcuda() -> Result<()> {
    // SAFETY: only tries to dlopen libcuda; calls nothing in it.
    require_libcuda(unsafe { sys::is_culib_present() })
}

/// Number of CUDA devices visible to this process.
///
/// A missing driver library is [`Error::LibraryMissing`]; a driver with no device is `Ok(0)`.
pub fn device_count() -> Result<usize> {
    check_libcuda()?;
    match CudaContext::device_count() {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => Ok(0),
        Err(e) => Err(Error::Cuda {
            during: "counting CUDA devices".into(),
            source: e,
        }),
    }
}

/// `Ok` when a driver reporting CUDA `driver` can run code built for `built`.
pub(crate) fn check_driver_version(driver: i32, built: i32) -> Result<()> {
    if driver < built {
        return Err(Error::DriverTooOld {
            driver_major: driver / 1000,
            driver_minor: (driver % 1000) / 10,
            built_major: built / 1000,
            built_minor: (built % 1000) / 10,
        });
    }
    Ok(())
}

fn driver_version() -> Result<i32> {
    // The driver is initialised by device_count.
    driver::device::version().map_err(Error::cuda("reading the driver version"))
}

/// Where the clique's GPUs come from.
pub(crate) enum Devices {
    /// Every visible GPU (at most 8).
    All,
    /// These ordinals, in rank order.
    Ordinals(Vec<usize>),
    /// The caller's streams, in rank order (their contexts must be primary contexts).
    Streams(Vec<Arc<CudaStream>>),
}

/// Everything `create` builds.
pub(crate) struct Built {
    pub engine: Engine,
    pub topology: Topology,
    pub nccl_on: bool,
}

/// Creates the contexts, streams, peer access and engine of a clique.
pub(crate) fn create(
    devices: Devices,
    requested: &BroadcastOptions,
    shared: bool,
) -> Result<Built> {
    // Checks that need no driver come first.
    let listed: Option<Vec<usize>> = match &devices {
        Devices::All => None,
        Devices::Ordinals(o) => Some(o.clone()),
        Devices::Streams(s) => Some(s.iter().map(|s| s.context().ordinal()).collect()),
    };
    if let Some(o) = &listed {
        args::check_device_list(o, shared)?;
    }
    if let Devices::Streams(streams) = &devices {
        for (rank, s) in streams.iter().enumerate() {
            if let Some(what) = crate::engine::streams::special_handle(s.cu_stream()) {
                return Err(Error::InvalidArgument(format!(
                    "stream {rank} given to the builder is {what}, which cannot carry a rank's \
                     work: pass a stream of its own (`ctx.new_stream()`)"
                )));
            }
        }
    }
    let env = BroadcastOptions::from_env()?;
    // Reject bad settings before touching the driver (they resolve below, once the number of
    // GPUs is known).
    requested.over(&env).check()?;

    let available = device_count()?;
    let ordinals = match listed {
        Some(o) => o,
        None if available == 0 => {
            return Err(Error::NoDevice("the driver reports no CUDA device".into()))
        }
        None => (0..available.min(MAX_GPUS)).collect(),
    };
    args::check_in_range(&ordinals, available)?;
    check_driver_version(driver_version()?, BUILT_CUDA)?;
    // The thresholds depend on the number of GPUs, unknown above for `All`.
    let settings = Settings::resolve(requested, &env, ordinals.len())?;
    crate::nccl::NcclLib::get()?;

    let mut ranks = Vec::with_capacity(ordinals.len());
    match devices {
        Devices::Streams(streams) => {
            for (rank, s) in streams.into_iter().enumerate() {
                let ctx = s.context().clone();
                require_primary(rank, &ctx)?;
                ranks.push(Rank::new(JobRank(rank), ctx, Some(s))?);
            }
        }
        _ => {
            for (rank, &o) in ordinals.iter().enumerate() {
                let ctx = CudaContext::new(o)
                    .map_err(Error::cuda(format!("creating a context on device {o}")))?;
                ranks.push(Rank::new(JobRank(rank), ctx, None)?);
            }
        }
    }
    let ctxs: Vec<Arc<CudaContext>> = ranks.iter().map(|r| r.ctx.clone()).collect();
    let topology = enable_peer_access(&ordinals, &ctxs)?;
    let distinct = (0..ordinals.len()).all(|i| !ordinals[..i].contains(&ordinals[i]));
    let nccl = if distinct {
        // Every rank is here, so joining takes as long as NCCL's setup: a generous bound.
        Nccl::Live(Comms::init_all(&ctxs, settings.timeouts.nccl_init())?)
    } else {
        for (i, ctx) in ctxs.iter().enumerate() {
            let (o, before, after) = (ordinals[i], &ordinals[..i], &ordinals[i + 1..]);
            // Once per device that holds several ranks.
            if after.contains(&o) && !before.contains(&o) {
                no_pool_dependencies(ctx)?;
            }
        }
        Nccl::Off("a device holds several ranks of this clique (`shared_devices`), and NCCL needs one device per rank".into())
    };
    let p2p = topology
        .p2p_support()
        .map_err(Error::P2pUnavailable)
        .and_then(|()| P2p::new(&ctxs, settings.timeouts.wait, settings.parallel_launch));
    let engine = Engine::new(ranks, settings, nccl, p2p)?;
    Ok(Built {
        engine,
        topology,
        nccl_on: distinct,
    })
}

/// Where one device holds several ranks, their streams share its memory pool, and by default
/// an allocation may reuse memory freed on another stream by making its stream wait for the
/// point of the free. Between the launches of one broadcast on two ranks of the device (another
/// thread allocating on one rank's stream while the broadcast is queued), such a wait makes one
/// rank's kernel wait for the other's, which waits for it in turn, until the P2P timeout. The
/// P2P kernels of such devices run on streams of the engine's own (`EngineGuard::spinning`),
/// which such waits never reach; as a second line, pools of such devices reuse memory only
/// once a free is known complete (the other reuse policies stay on). This changes the device's current pool for the whole process, and
/// applies only to devices that hold several ranks of a clique.
fn no_pool_dependencies(ctx: &Arc<CudaContext>) -> Result<()> {
    ctx.bind_to_thread()
        .map_err(Error::cuda("binding a context"))?;
    let pool = current_pool(ctx.cu_device())?;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES;
    // SAFETY: `pool` is the device's live pool; this attribute takes an int.
    unsafe { driver::pool::set_int_attribute(pool, attr, 0) }
        .map_err(Error::cuda("setting a memory pool's reuse policy"))
}

/// The memory pool cudarc allocates from on `device` (its current pool).
fn current_pool(device: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    driver::pool::current(device).map_err(Error::cuda("finding a device's memory pool"))
}

/// Streams handed in must belong to the device's primary context: the clique's kernels and
/// NCCL run there, and memory of another context is not addressable from it.
fn require_primary(rank: usize, ctx: &Arc<CudaContext>) -> Result<()> {
    let device = ctx.cu_device();
    // SAFETY: `device` is a valid device handle; the retain is balanced right below.
    let primary = unsafe { result::primary_ctx::retain(device) }
        .map_err(Error::cuda("finding a device's primary context"))?;
    // SAFETY: balances the retain above; the clique's own context holds another reference.
    let _ = unsafe { result::primary_ctx::release(device) };
    if primary == ctx.cu_ctx() {
        Ok(())
    } else {
        Err(Error::ForeignContext {
            what: format!("stream {rank} given to the builder"),
            rank,
            ordinal: ctx.ordinal(),
        })
    }
}

/// Enables peer access (context and stream-ordered memory pool) between every pair that
/// supports it, and returns what was found.
fn enable_peer_access(ordinals: &[usize], ctxs: &[Arc<CudaContext>]) -> Result<Topology> {
    let n = ordinals.len();
    let mut links = vec![vec![Link::None; n]; n];
    for i in 0..n {
        links[i][i] = Link::SelfLink;
        for j in 0..n {
            if i == j {
                continue;
            }
            // Two ranks of one device (`shared_devices`): its memory is local to both.
            if ordinals[i] == ordinals[j] {
                links[i][j] = Link::SelfLink;
                continue;
            }
            let (di, dj) = (ctxs[i].cu_device(), ctxs[j].cu_device());
            let can = driver::device::can_access_peer(di, dj)
                .map_err(Error::cuda("querying peer access"))?;
            if !can {
                continue;
            }
            ctxs[i]
                .bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            // SAFETY: both contexts are live; enabling twice reports ALREADY_ENABLED, accepted.
            match unsafe { driver::context::enable_peer_access(ctxs[j].cu_ctx()) } {
                Ok(())
                | Err(result::DriverError(
                    sys::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
                )) => {}
                Err(e) => {
                    return Err(Error::Cuda {
                        during: format!(
                            "enabling peer access from device {} to {}",
                            ordinals[i], ordinals[j]
                        ),
                        source: e,
                    })
                }
            }
            // cudarc allocates from the device's current memory pool; peer access to that
            // memory needs the pool's own access list, which cuCtxEnablePeerAccess does not set.
            let pool = current_pool(dj)?;
            let desc = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: i32::try_from(ordinals[i]).expect("ordinals are small"),
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: `pool` is device j's live pool; `desc` is one valid descriptor.
            unsafe { driver::pool::set_access(pool, &desc) }.map_err(Error::cuda(format!(
                "granting device {} access to device {}'s memory pool",
                ordinals[i], ordinals[j]
            )))?;
            let atomics = driver::device::p2p_attribute(
                sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                di,
                dj,
            )
            .map_err(Error::cuda("querying peer attributes"))?;
            links[i][j] = if atomics != 0 {
                Link::NvLink
            } else {
                Link::Pcie
            };
        }
    }
    let names = ctxs
        .iter()
        .map(|c| c.name().unwrap_or_else(|_| "unknown".into()))
        .collect();
    Ok(Topology::new(ordinals.to_vec(), names, links))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_libcuda_is_a_typed_error_with_a_fix() {
        assert!(require_libcuda(true).is_ok());
        let e = require_libcuda(false).unwrap_err();
        assert!(matches!(
            e,
            Error::LibraryMissing {
                library: "libcuda",
                ..
            }
        ));
        let msg = e.to_string();
        assert!(
            msg.contains("libcuda") && msg.contains("Fix:") && msg.contains("driver"),
            "{msg}"
        );
    }

    #[test]
    fn old_drivers_are_named() {
        assert!(check_driver_version(13000, 13000).is_ok());
        assert!(check_driver_version(13010, 12080).is_ok());
        let e = check_driver_version(12080, 13000).unwrap_err();
        assert!(
            matches!(
                e,
                Error::DriverTooOld {
                    driver_major: 12,
                    driver_minor: 8,
                    built_major: 13,
                    built_minor: 0
                }
            ),
            "{e}"
        );
    }
}
