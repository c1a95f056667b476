//! Device memory that the other processes of a host can map: virtual-memory-management
//! allocations (`cuMemCreate`) with POSIX file-descriptor handles. The owner exports a file
//! descriptor once; a peer process that receives it (over a Unix socket, `ipc`) imports and
//! maps it into its own address space. Every mapping is unmapped and released on drop.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr, CUmemGenericAllocationHandle};
use cudarc::driver::CudaContext;

use crate::driver::vmm;
use crate::error::{Error, Result};

/// An allocation of this process (exportable) or a mapping of a peer's.
pub(crate) struct SharedMemory {
    ctx: Arc<CudaContext>,
    handle: CUmemGenericAllocationHandle,
    va: CUdeviceptr,
    size: usize,
}

fn properties(ordinal: usize) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is valid (every enum has a zero variant);
    // the fields that matter are set below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: i32::try_from(ordinal).expect("ordinals are small"),
    };
    prop
}

/// The size `bytes` rounds up to for a VMM allocation on `ordinal`.
pub(crate) fn rounded_size(ctx: &CudaContext, bytes: usize) -> Result<usize> {
    let prop = properties(ctx.ordinal());
    // SAFETY: a valid property struct, whose pointer (Win32 metadata) `properties` leaves null.
    let granularity = unsafe {
        vmm::granularity(
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }
    .map_err(Error::cuda("reading the VMM allocation granularity"))?;
    Ok(bytes.next_multiple_of(granularity.max(1)))
}

impl SharedMemory {
    /// `bytes` (rounded up to the granularity) of exportable memory on `ctx`'s device, mapped
    /// here with read-write access for that device.
    pub(crate) fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<SharedMemory> {
        ctx.bind_to_thread()
            .map_err(Error::cuda("binding a context"))?;
        let size = rounded_size(ctx, bytes)?;
        let prop = properties(ctx.ordinal());
        // SAFETY: valid properties (as in `rounded_size`); released in `Drop` (or in `map` on
        // error).
        let handle = unsafe { vmm::create(size, &prop) }.map_err(Error::cuda(format!(
            "allocating {size} bytes of shareable memory on device {}",
            ctx.ordinal()
        )))?;
        // SAFETY: created just above, handed over.
        unsafe { SharedMemory::map(ctx, handle, size) }
    }

    /// Maps a peer's allocation received as `fd` (which is closed once imported) for this
    /// process's device `ctx`.
    pub(crate) fn import(ctx: &Arc<CudaContext>, fd: OwnedFd, size: usize) -> Result<SharedMemory> {
        ctx.bind_to_thread()
            .map_err(Error::cuda("binding a context"))?;
        // `fd` is an open descriptor exported by cuMemExportToShareableHandle in a peer; the
        // driver reads it during the call and the descriptor is closed when `fd` drops.
        let handle =
            vmm::import_fd(fd.as_fd()).map_err(Error::cuda("importing a peer process's memory"))?;
        drop(fd);
        // SAFETY: imported just above, handed over.
        unsafe { SharedMemory::map(ctx, handle, size) }
    }

    /// Reserves an address range, maps `handle` there and grants `ctx`'s device access; on
    /// failure releases what it took.
    ///
    /// # Safety
    /// `handle` is a live allocation handle owned by the caller, who hands it over (it is
    /// released here on failure, or by the result's drop).
    unsafe fn map(
        ctx: &Arc<CudaContext>,
        handle: CUmemGenericAllocationHandle,
        size: usize,
    ) -> Result<SharedMemory> {
        // A fresh reservation of `size` bytes.
        let va = match vmm::reserve(size) {
            Ok(va) => va,
            Err(e) => {
                // SAFETY: `handle` is ours and unused.
                let _ = unsafe { vmm::release(handle) };
                return Err(Error::Cuda {
                    during: "reserving addresses for shared memory".into(),
                    source: e,
                });
            }
        };
        // SAFETY: `va` is a fresh reservation of `size` bytes and `handle` a live allocation
        // handle (of as many bytes, or, for an import, of what the peer's card says: the driver
        // refuses a map larger than the allocation).
        if let Err(e) = unsafe { vmm::map(va, size, handle) } {
            // Nothing owns them yet (no `SharedMemory`, whose drop would free them again).
            // SAFETY: an unmapped reservation and an unused handle, both ours, freed once.
            unsafe {
                let _ = vmm::free_addresses(va, size);
                let _ = vmm::release(handle);
            }
            return Err(Error::Cuda {
                during: "mapping shared memory".into(),
                source: e,
            });
        }
        // From here on, its drop unmaps and frees them.
        let mem = SharedMemory {
            ctx: ctx.clone(),
            handle,
            va,
            size,
        };
        let desc = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: i32::try_from(ctx.ordinal()).expect("ordinals are small"),
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: `va` is mapped with `size` bytes; one valid descriptor.
        unsafe { vmm::set_access(va, size, &desc) }.map_err(Error::cuda(format!(
            "granting device {} access to shared memory",
            ctx.ordinal()
        )))?;
        Ok(mem)
    }

    /// A file descriptor that a peer process can import (the caller closes it).
    pub(crate) fn export(&self) -> Result<OwnedFd> {
        // SAFETY: the handle is a live POSIX-fd-exportable allocation (`properties` requests
        // that handle type).
        unsafe { vmm::export_fd(self.handle) }.map_err(Error::cuda("exporting shared memory"))
    }

    /// The mapped address in this process.
    pub(crate) fn ptr(&self) -> u64 {
        self.va
    }

    /// The mapped size.
    pub(crate) fn size(&self) -> usize {
        self.size
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // Not cudarc's bind_to_thread: an error it stored would return early (a leak) and be
        // lost.
        if crate::driver::make_current(&self.ctx).is_err() {
            return;
        }
        // SAFETY: our mapping and handle; no kernel uses them any more (the engine drains its
        // streams, or leaks the P2P state, before dropping them).
        unsafe {
            let _ = vmm::unmap(self.va, self.size);
            let _ = vmm::free_addresses(self.va, self.size);
            let _ = vmm::release(self.handle);
        }
    }
}
