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
/// `CudaView<T>` and `CudaViewMut<T>`. Used as `&dyn DeviceTensor` in
/// [`crate::Clique::broadcast_many`] and in graph captures.
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

/// A device buffer of any [`Element`] type that a broadcast can write: `CudaSlice<T>` and
/// `CudaViewMut<T>`.
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

readable!(CudaSlice<T>, CudaView<'_, T>, CudaViewMut<'_, T>);

impl<T: Element> DeviceTensorMut for CudaSlice<T> {
    fn write_ptr<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        self.device_ptr_mut(stream)
    }
}

impl<T: Element> DeviceTensorMut for CudaViewMut<'_, T> {
    fn write_ptr<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        self.device_ptr_mut(stream)
    }
}
