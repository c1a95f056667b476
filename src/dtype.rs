//! Element types that can be broadcast, and their NCCL names.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::sys::ncclDataType_t;
use half::{bf16, f16};

/// The element type of a tensor, as the broadcast sees it.
///
/// A broadcast copies bytes exactly; the type only matters for NCCL's element count and for what
/// logs and benchmark tables print.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 16-bit IEEE float ([`half::f16`]).
    F16,
    /// bfloat16 ([`half::bf16`]).
    BF16,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
}

impl DType {
    /// Every element type, in a fixed order.
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// Short lowercase name, as nccl-tests and safetensors-like tools print it (`"f32"`, `"bf16"`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
        }
    }

    /// Parses a name printed by [`DType::name`] (case-insensitive; `float`, `half`, `bfloat16`
    /// and `int32`-style aliases are accepted too).
    pub fn parse(name: &str) -> Option<DType> {
        let lower = name.to_ascii_lowercase();
        Some(match lower.as_str() {
            "f32" | "float" | "float32" => DType::F32,
            "f64" | "double" | "float64" => DType::F64,
            "f16" | "half" | "float16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i8" | "int8" => DType::I8,
            "u8" | "uint8" => DType::U8,
            "i32" | "int32" | "int" => DType::I32,
            "u32" | "uint32" => DType::U32,
            "i64" | "int64" => DType::I64,
            "u64" | "uint64" => DType::U64,
            _ => return None,
        })
    }

    pub(crate) fn nccl(self) -> ncclDataType_t {
        match self {
            DType::F32 => ncclDataType_t::ncclFloat32,
            DType::F64 => ncclDataType_t::ncclFloat64,
            DType::F16 => ncclDataType_t::ncclFloat16,
            DType::BF16 => ncclDataType_t::ncclBfloat16,
            DType::I8 => ncclDataType_t::ncclInt8,
            DType::U8 => ncclDataType_t::ncclUint8,
            DType::I32 => ncclDataType_t::ncclInt32,
            DType::U32 => ncclDataType_t::ncclUint32,
            DType::I64 => ncclDataType_t::ncclInt64,
            DType::U64 => ncclDataType_t::ncclUint64,
        }
    }
}

impl std::str::FromStr for DType {
    type Err = crate::error::Error;

    /// As [`DType::parse`], with an error that lists the names.
    fn from_str(s: &str) -> crate::error::Result<DType> {
        DType::parse(s).ok_or_else(|| {
            crate::error::Error::InvalidArgument(format!(
                "unknown element type `{s}`: one of f32, f64, f16, bf16, i8, u8, i32, u32, i64, u64"
            ))
        })
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that can be broadcast: one of the ten types of [`DType`].
///
/// Sealed: the set matches what NCCL can move, so it cannot be extended outside this crate.
pub trait Element:
    DeviceRepr + ValidAsZeroBits + Copy + Send + Sync + sealed::Sealed + 'static
{
    /// The matching [`DType`].
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(
            impl sealed::Sealed for $t {}
            impl Element for $t {
                const DTYPE: DType = DType::$d;
            }
        )*
    };
}

element!(
    f32 => F32,
    f64 => F64,
    f16 => F16,
    bf16 => BF16,
    i8 => I8,
    u8 => U8,
    i32 => I32,
    u32 => U32,
    i64 => I64,
    u64 => U64,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(<f32 as Element>::DTYPE.size(), std::mem::size_of::<f32>());
        assert_eq!(<f64 as Element>::DTYPE.size(), std::mem::size_of::<f64>());
        assert_eq!(<f16 as Element>::DTYPE.size(), std::mem::size_of::<f16>());
        assert_eq!(<bf16 as Element>::DTYPE.size(), std::mem::size_of::<bf16>());
        assert_eq!(<i8 as Element>::DTYPE.size(), 1);
        assert_eq!(<u64 as Element>::DTYPE.size(), 8);
    }

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()), Some(d));
            assert_eq!(DType::parse(&d.name().to_uppercase()), Some(d));
        }
        assert_eq!(DType::parse("bfloat16"), Some(DType::BF16));
        assert_eq!(DType::parse("complex64"), None);
        for d in DType::ALL {
            assert_eq!(d.to_string().parse::<DType>().unwrap(), d);
        }
        let e = "complex64".parse::<DType>().unwrap_err().to_string();
        assert!(e.contains("complex64") && e.contains("bf16"), "{e}");
    }
}
