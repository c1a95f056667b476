//! Type-erased device buffers, for broadcasts of many tensors of mixed element types.

use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};

use crate::dtype::{DType, Element};

mod sealed {
    pub trait Sealed {}
}

/// A device buffer of any [`Element`] type that a broadcast can read: cudarc's `CudaSlice<T>`,
/// `CudaView<T>` and `CudaViewMut<T>`, [`ExternalSlice<T>`], and references to them. The one
/// buffer trait of every call, eager or captured; used as `&dyn DeviceTensor` in
/// [`crate::clique::CliqueBroadcast::broadcast_many`]. Element types and lengths are checked at run
/// time, before anything is queued.
pub trait DeviceTensor: sealed::Sealed + Send + Sync {
    /// Element type.
    fn dtype(&self) -> DType;
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether the buffer has no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Size in bytes.
    fn num_bytes(&self) -> usize {
        self.len().saturating_mul(self.dtype().size())
    }
    /// CUDA ordinal of the device holding the buffer.
    fn ordinal(&self) -> usize {
        self.stream().context().ordinal()
    }
    /// The stream the buffer was allocated on (where it is freed, and what gpucast orders its
    /// work with).
    #[doc(hidden)]
    fn stream(&self) -> &Arc<CudaStream>;
    /// cudarc's read access: `stream` waits for the buffer's pending writes, and the returned
    /// guard records the read when dropped.
    #[doc(hidden)]
    fn read_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>);
}

/// A device buffer of any [`Element`] type that a broadcast can write: `CudaSlice<T>`,
/// `CudaViewMut<T>` and [`ExternalSlice<T>`].
pub trait DeviceTensorMut: DeviceTensor {
    /// cudarc's write access (see [`DeviceTensor::read_ptr`]).
    #[doc(hidden)]
    fn write_ptr<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>);
}

macro_rules! readable {
    ($($ty:ty),*) => {$(
        impl<T: Element> sealed::Sealed for $ty {}
        impl<T: Element> DeviceTensor for $ty {
            fn dtype(&self) -> DType {
                T::DTYPE
            }
            fn len(&self) -> usize {
                DeviceSlice::len(self)
            }
            fn stream(&self) -> &Arc<CudaStream> {
                DeviceSlice::stream(self)
            }
            fn read_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
                self.device_ptr(stream)
            }
        }
    )*};
}

readable!(
    CudaSlice<T>,
    CudaView<'_, T>,
    CudaViewMut<'_, T>,
    ExternalSlice<T>
);

impl<T: Element> DeviceTensorMut for CudaSlice<T> {
    fn write_ptr<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        self.device_ptr_mut(stream)
    }
}

impl<T: Element> DeviceTensorMut for ExternalSlice<T> {
    fn write_ptr<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        self.device_ptr_mut(stream)
    }
}

impl<T: Element> DeviceTensorMut for CudaViewMut<'_, T> {
    fn write_ptr<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        self.device_ptr_mut(stream)
    }
}

// A reference passes for its buffer, so that a list of `&mut` buffers (or the buffers a graph
// lends out) can be passed where buffers are.
impl<B: DeviceTensor + ?Sized> sealed::Sealed for &B {}
impl<B: DeviceTensor + ?Sized> sealed::Sealed for &mut B {}

macro_rules! by_reference {
    ($($ty:ty),*) => {$(
        impl<B: DeviceTensor + ?Sized> DeviceTensor for $ty {
            fn dtype(&self) -> DType {
                (**self).dtype()
            }
            fn len(&self) -> usize {
                (**self).len()
            }
            fn stream(&self) -> &Arc<CudaStream> {
                (**self).stream()
            }
            fn read_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
                (**self).read_ptr(stream)
            }
        }
    )*};
}

by_reference!(&B, &mut B);

impl<B: DeviceTensorMut + ?Sized> DeviceTensorMut for &mut B {
    fn write_ptr<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (**self).write_ptr(stream)
    }
}

/// Device memory that cudarc does not own (a PyTorch, CuPy or JAX tensor, memory of another
/// library), as a buffer of `T` that every gpucast call accepts, ordered with a stream of its
/// owner.
///
/// A call that takes it is ordered with its stream both ways: the call starts after the work
/// queued on that stream so far, and work queued on that stream after the call returns starts
/// after the call is done with the buffer (so a stream-ordered free or overwrite queued there
/// is safe). Unlike cudarc's buffers it carries no events of its own: work its owner queues on
/// other streams is the owner's to order (as `torch.Tensor.record_stream` does for PyTorch).
///
/// Its cudarc traits (`DevicePtr`, `DevicePtrMut`) order nothing on their own: pass it to
/// gpucast's calls, or use it with cudarc only on its own stream.
pub struct ExternalSlice<T> {
    ptr: u64,
    len: usize,
    plain: bool,
    /// The allocation the memory was checked against (`None` when empty).
    allocation: Option<crate::driver::Allocation>,
    stream: Arc<CudaStream>,
    _element: std::marker::PhantomData<fn() -> T>,
}

/// The device allocation an [`ExternalSlice`] was checked against
/// ([`ExternalSlice::allocation`]): another buffer whose address lies in it is checked
/// against it without asking the driver again ([`ExternalSlice::new_in`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckedAllocation(crate::driver::Allocation);

/// The checks of [`ExternalSlice::new_in`] once the byte count and the alignment are known
/// good: the allocation that holds `ptr` (`known` when `ptr` lies in it, else `lookup`'s),
/// which must be of GPU `expected` and hold all `bytes`.
fn check_allocation(
    ptr: u64,
    bytes: usize,
    expected: usize,
    known: &[CheckedAllocation],
    lookup: impl FnOnce() -> crate::error::Result<crate::driver::Allocation>,
) -> crate::error::Result<crate::driver::Allocation> {
    let inside = |a: &&CheckedAllocation| ptr >= a.0.start && ptr - a.0.start < a.0.size;
    let range = match known.iter().find(inside) {
        Some(&CheckedAllocation(a)) => a,
        None => lookup()?,
    };
    if range.ordinal != expected {
        return Err(crate::error::Error::WrongDevice {
            what: format!("external buffer at {ptr:#x}"),
            rank: 0,
            expected,
            found: range.ordinal,
        });
    }
    let end = ptr.checked_add(bytes as u64);
    if end.is_none_or(|end| end > range.start.saturating_add(range.size)) {
        return Err(crate::error::Error::InvalidArgument(format!(
            "external buffer at {ptr:#x} of {bytes} bytes runs past the end of its \
             allocation ({:#x}, {} bytes)",
            range.start, range.size
        )));
    }
    Ok(range)
}

impl<T> std::fmt::Debug for ExternalSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalSlice")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("stream", &self.stream.cu_stream())
            .finish()
    }
}

impl<T: Element> ExternalSlice<T> {
    /// `len` elements of `T` at device address `ptr`, ordered with `stream` (a stream of the
    /// context whose GPU holds the memory: wrap a foreign handle with
    /// [`CudaContext::wrap_borrowed_stream`](cudarc::driver::CudaContext::wrap_borrowed_stream);
    /// the legacy and per-thread default streams are fine).
    ///
    /// Checked here, as errors: the byte count fits in `usize`; for `len > 0`, `ptr` is aligned
    /// to `T`, and `ptr .. ptr + len * size_of::<T>()` lies inside one device allocation of
    /// the stream's GPU ([`Error::InvalidArgument`](crate::error::Error::InvalidArgument),
    /// [`Error::WrongDevice`](crate::error::Error::WrongDevice) otherwise).
    ///
    /// # Safety
    /// - The memory is device memory allocated in the primary context of its GPU
    ///   (`cudaMalloc`, `cuMemAlloc`, or what PyTorch's default allocator returns), or memory
    ///   that every other GPU of the call has been granted access to (a memory pool or a
    ///   `cuMemMap` mapping with peer access set): a peer's kernel or copy may read or write
    ///   it. [`ExternalSlice::is_plain_allocation`] tells the first kind.
    /// - It stays allocated, and nothing touches it except work ordered through `stream`, until
    ///   the work queued on `stream` by the time the last call given this buffer returns has
    ///   run: free it only stream-ordered on `stream` or after synchronizing with that stream.
    /// - `stream` stays a live stream of its context for as long as this value or a call
    ///   given it may use it.
    /// - Outputs of one call do not overlap each other or the call's input (an in-place
    ///   root's buffer is both, by design).
    pub unsafe fn new(ptr: u64, len: usize, stream: Arc<CudaStream>) -> crate::error::Result<Self> {
        // SAFETY: per this function's contract (no known allocation).
        unsafe { Self::new_in(ptr, len, stream, &[]) }
    }

    /// [`ExternalSlice::new`] with the same checks and errors, against the allocation of
    /// `known` (allocations other buffers were checked against: [`ExternalSlice::allocation`])
    /// that holds `ptr`, without asking the driver, if any: buffers of one allocation (tensors
    /// of one segment of PyTorch's caching allocator) cost one driver query, not one each.
    ///
    /// # Safety
    /// As for [`ExternalSlice::new`]; and the memory of the buffers `known` comes from is
    /// still allocated (so that each is still the allocation that holds its addresses: a freed
    /// allocation's addresses may be handed to another allocation, of another size or GPU).
    pub unsafe fn new_in(
        ptr: u64,
        len: usize,
        stream: Arc<CudaStream>,
        known: &[CheckedAllocation],
    ) -> crate::error::Result<Self> {
        let size = std::mem::size_of::<T>();
        let mut plain = true;
        let mut allocation = None;
        let bytes = len
            .checked_mul(size)
            .ok_or_else(|| crate::error::Error::TooLarge {
                what: "external buffer".into(),
                elements: len,
                element_size: size,
            })?;
        if len > 0 {
            if !ptr.is_multiple_of(std::mem::align_of::<T>() as u64) {
                return Err(crate::error::Error::InvalidArgument(format!(
                    "external buffer at {ptr:#x} is not aligned to its {}-byte elements",
                    std::mem::align_of::<T>()
                )));
            }
            let expected = stream.context().ordinal();
            let range = check_allocation(ptr, bytes, expected, known, || {
                crate::driver::allocation_of(stream.context(), ptr)
            })?;
            plain = range.plain;
            allocation = Some(range);
        }
        Ok(ExternalSlice {
            ptr,
            len,
            plain,
            allocation,
            stream,
            _element: std::marker::PhantomData,
        })
    }
}

impl<T> ExternalSlice<T> {
    /// Whether the memory is a plain `cuMemAlloc` / `cudaMalloc` allocation (or empty), which
    /// every GPU with peer access to its device can reach; memory of a pool or of a `cuMemMap`
    /// mapping reaches another GPU only where its owner granted access.
    pub fn is_plain_allocation(&self) -> bool {
        self.plain
    }

    /// The device allocation the memory was checked against (`None` for an empty buffer), for
    /// [`ExternalSlice::new_in`].
    pub fn allocation(&self) -> Option<CheckedAllocation> {
        self.allocation.map(CheckedAllocation)
    }
}

impl<T: Element> DeviceSlice<T> for ExternalSlice<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T: Element> DevicePtr<T> for ExternalSlice<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        // No event: ordering is with `self.stream`, which every call orders both ways.
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T: Element> DevicePtrMut<T> for ExternalSlice<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::Allocation;
    use crate::error::Error;

    const A: Allocation = Allocation {
        ordinal: 1,
        start: 0x1000,
        size: 0x1000,
        plain: true,
    };

    fn asked() -> crate::error::Result<Allocation> {
        panic!("the driver was asked for an address inside the known allocation")
    }

    #[test]
    fn an_address_inside_a_known_allocation_is_checked_against_it_without_the_driver() {
        let known = &[CheckedAllocation(A)];
        assert_eq!(
            check_allocation(0x1000, 0x1000, 1, known, asked).unwrap(),
            A
        );
        assert_eq!(check_allocation(0x1ffc, 4, 1, known, asked).unwrap(), A);
        // The same errors as after a query: past the end, another GPU.
        let past = check_allocation(0x1800, 0x801, 1, known, asked);
        assert!(matches!(&past, Err(Error::InvalidArgument(m)) if m.contains("past the end")));
        let wrong = check_allocation(0x1800, 4, 0, known, asked);
        assert!(matches!(
            wrong,
            Err(Error::WrongDevice {
                found: 1,
                expected: 0,
                ..
            })
        ));
        // The one of several that holds the address.
        let other = Allocation { start: 0x4000, ..A };
        let both = &[CheckedAllocation(other), CheckedAllocation(A)];
        assert_eq!(check_allocation(0x1800, 4, 1, both, asked).unwrap(), A);
        assert_eq!(check_allocation(0x4800, 4, 1, both, asked).unwrap(), other);
    }

    #[test]
    fn an_address_outside_the_known_allocation_asks_the_driver() {
        let other = Allocation {
            start: 0x2000,
            plain: false,
            ..A
        };
        let known = &[CheckedAllocation(A)];
        for ptr in [0x2000, 0x2800, 0xfff] {
            let mut queried = false;
            let got = check_allocation(ptr, 4, 1, known, || {
                queried = true;
                Ok(other)
            });
            assert!(queried, "{ptr:#x}");
            if ptr >= other.start {
                assert_eq!(got.unwrap(), other);
            }
        }
        let mut queried = false;
        let _ = check_allocation(0x1800, 4, 1, &[], || {
            queried = true;
            Ok(A)
        });
        assert!(queried, "no known allocation");
    }
}
