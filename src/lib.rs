//! # gpucast
//!
//! Broadcast a tensor from one GPU to every other GPU, as fast as the links allow: within one
//! process (a clique) or across the processes of a job, one per GPU (a communicator).
//!
//! A [`Clique`] holds up to eight GPUs of this process: a context and a stream per GPU, peer
//! access between every pair that supports it, one NCCL communicator per GPU, and a small signal
//! area per GPU for gpucast's own kernel. [`Clique::broadcast`] copies the root's buffer into an
//! output on every GPU along one of three paths:
//!
//! - **NCCL**: `ncclBroadcast` in one group (NCCL is loaded at run time, `libnccl.so.2` included).
//! - **P2P**: a kernel that every GPU runs, synchronised through flags in device memory. Small
//!   messages use a *packet* protocol (the root writes {data, flag} packets straight into each
//!   peer's inbox; no barrier at all); medium ones a *pull* protocol (peers read the root's
//!   buffer over NVLink after its arrival flag and report when done). Counters live on the
//!   device, so the kernel can be captured in a CUDA graph; every wait is bounded by a timeout.
//! - **Copy engine**: no kernel at all. Each rank pushes the message into the rank after it in
//!   a chain that starts at the root (`cuMemcpyAsync` on its own copy engine, chunked beyond
//!   two ranks so that every link carries it once), ordered by events, or by stream memory
//!   operations inside a graph. It leaves every SM to the caller's compute.
//!
//! A [`Communicator`] is one rank of a job that runs one process per GPU (torchrun, Slurm,
//! MPI): the same broadcasts, each process passing its own buffer, after a rendezvous through
//! torchrun's own store or a TCP store that rank 0 hosts, which admit only processes that know
//! the job's secret token ([`rendezvous`]); ranks on one host share P2P memory.
//!
//! [`BroadcastPath::Auto`] (the default) takes the copy engines for large messages, P2P for
//! smaller ones when every pair of GPUs has peer access, and NCCL otherwise, at thresholds
//! measured on H200s.
//! The caller can force a path or move the thresholds per clique, per call, or by environment
//! variable.
//!
//! ## Failures
//!
//! No wait is unbounded: P2P kernels time out on their own, and a watchdog thread aborts NCCL
//! work that does not finish within the timeout once started (a dead peer process), so every
//! stream moves on. Errors name what failed and which calls have undefined outputs;
//! [`Clique::recover`] rebuilds what failed without a new process. The README's "Failure model"
//! has the whole table.
//!
//! ## Example
//!
//! ```no_run
//! use gpucast::{Clique, BroadcastPath, BroadcastOptions};
//!
//! let clique = Clique::new(&[0, 1])?;
//! let n = 1 << 20;
//! // The root (rank 0) holds the data; every rank gets an output buffer on its own GPU.
//! let input = clique.stream(0).clone_htod(&vec![1.5f32; n])?;
//! let mut outputs = clique.alloc_outputs::<f32>(n)?;
//! clique.broadcast(0, &input, &mut outputs)?;
//! // Or force a path for one call:
//! clique.broadcast_with(0, &input, &mut outputs, &BroadcastOptions::path(BroadcastPath::Nccl))?;
//! clique.synchronize()?;
//! assert_eq!(clique.stream(1).clone_dtoh(&outputs[1])?, vec![1.5f32; n]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Choosing the CUDA version
//!
//! cudarc binds one version of the driver and NVRTC APIs, picked by a cargo feature. gpucast
//! forwards it: the default is `cuda-13000` (driver 580 or newer, `libnvrtc.so.13`). For CUDA 12
//! use `default-features = false, features = ["cuda-12080"]` (or `cuda-12040`, `cuda-12060`,
//! `cuda-12090`); enable exactly one. A driver older than the feature is reported as
//! [`Error::DriverTooOld`].
//!
//! ## Libraries at run time
//!
//! Nothing is linked at build time. `libcuda` (from the driver) and `libnccl` are needed to
//! create a clique; `libnvrtc` to compile the P2P kernel (once per architecture per process).
//! Each missing library is an [`Error::LibraryMissing`] naming it and the fix; without NVRTC,
//! `Auto` falls back to NCCL with a warning and a forced P2P path returns that error.
//! `GPUCAST_NCCL_LIBRARY` names the NCCL file to load; [`ENV_VARS`] lists every variable.
//!
//! ## Buffers, ordering and threads
//!
//! The API takes cudarc buffers ([`cudarc::driver::CudaSlice`] and its views), whose lengths,
//! devices and contexts are checked before any work is queued. Work is asynchronous and runs on
//! the clique's streams ([`Clique::stream`]); any buffer passed to a call may be dropped, reused
//! or overwritten, on any stream, as soon as the call returns (see [`Clique`]'s "Ordering"
//! section). A clique may be shared between threads: its calls go through one lock.
//! [`Clique::broadcast_raw`] is the `unsafe` door for code that keeps raw device pointers.

#![deny(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod clique;
mod config;
mod copy;
mod driver;
mod dtype;
mod engine;
mod error;
mod limits;
mod nccl;
mod p2p;
mod plan;
/// The rendezvous: the crate `gpucast-rendezvous`, which uses nothing of gpucast. The rest of
/// gpucast sees it through [`rendezvous::Exchange`].
pub use gpucast_rendezvous as rendezvous;
mod tensor;
mod topology;
mod util;
mod wait;

pub use clique::{
    device_count, Capture, Clique, CliqueBuilder, CliqueGraph, Communicator, CommunicatorBuilder,
    GraphBuffers, OutputLists, OwnedCapture, OwnedGraph, RawBroadcast, UncheckedCapture,
    DEFAULT_INIT_TIMEOUT,
};
#[doc(hidden)]
pub use config::parse_bytes;
pub use config::{BroadcastOptions, BroadcastPath, Route, Thresholds, DEFAULT_TIMEOUT, ENV_VARS};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use limits::{MAX_GPUS, PACKET_MAX_BYTES};
pub use nccl::nccl_version;
pub use plan::FusedReport;
pub use tensor::{DeviceTensor, DeviceTensorMut, ExternalSlice};
pub use topology::{Link, Topology};

/// Re-export of the cudarc version gpucast is built with, so callers name the same buffer types.
pub use cudarc;
/// Re-export of `half`, for the `f16` and `bf16` element types.
pub use half;
