//! The five element types the layer moves, and how each is summed.
//!
//! bf16 and f16 are accumulated in f32 with one rounding at the end, whichever algorithm runs
//! (the ring sends f32 partial sums for them: 2x the bytes in the reduce-scatter half, the
//! price of a result that does not depend on the world size or message size). Integers wrap.

use half::{bf16, f16};
use std::fmt;

#[cfg(target_endian = "big")]
compile_error!("tessera-comm sends little-endian bytes and reinterprets buffers in place");

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[repr(u8)]
pub enum DType {
    F32 = 1,
    BF16 = 2,
    F16 = 3,
    U8 = 4,
    I32 = 5,
}

impl DType {
    pub fn from_u8(v: u8) -> Option<DType> {
        Some(match v {
            1 => DType::F32,
            2 => DType::BF16,
            3 => DType::F16,
            4 => DType::U8,
            5 => DType::I32,
            _ => return None,
        })
    }
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U8 => "u8",
            DType::I32 => "i32",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
    impl Sealed for u8 {}
    impl Sealed for i32 {}
}

/// An accumulator type: plain old data whose in-memory bytes are its little-endian wire form.
pub trait Acc: Copy + Default + Send + Sync + 'static + sealed::Sealed {
    const SIZE_BYTES: usize;
    fn add(self, other: Self) -> Self;
    fn read_le(b: &[u8]) -> Self;
}

impl Acc for f32 {
    const SIZE_BYTES: usize = 4;
    #[inline(always)]
    fn add(self, o: f32) -> f32 {
        self + o
    }
    #[inline(always)]
    fn read_le(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}
impl Acc for i32 {
    const SIZE_BYTES: usize = 4;
    #[inline(always)]
    fn add(self, o: i32) -> i32 {
        self.wrapping_add(o)
    }
    #[inline(always)]
    fn read_le(b: &[u8]) -> i32 {
        i32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}
impl Acc for u8 {
    const SIZE_BYTES: usize = 1;
    #[inline(always)]
    fn add(self, o: u8) -> u8 {
        self.wrapping_add(o)
    }
    #[inline(always)]
    fn read_le(b: &[u8]) -> u8 {
        b[0]
    }
}

/// An element type of a communication buffer.
pub trait Elem: Copy + Default + Send + Sync + 'static + sealed::Sealed {
    const DTYPE: DType;
    /// What sums are carried in (f32 for the 16-bit floats).
    type Acc: Acc;
    /// True when `Acc` is `Self`: the ring can reduce in the caller's buffer.
    const ACC_IS_SELF: bool;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(a: Self::Acc) -> Self;
    fn read_le(b: &[u8]) -> Self;
}

macro_rules! plain_elem {
    ($t:ty, $d:expr) => {
        impl Elem for $t {
            const DTYPE: DType = $d;
            type Acc = $t;
            const ACC_IS_SELF: bool = true;
            #[inline(always)]
            fn to_acc(self) -> $t {
                self
            }
            #[inline(always)]
            fn from_acc(a: $t) -> $t {
                a
            }
            #[inline(always)]
            fn read_le(b: &[u8]) -> $t {
                <$t as Acc>::read_le(b)
            }
        }
    };
}
plain_elem!(f32, DType::F32);
plain_elem!(i32, DType::I32);
plain_elem!(u8, DType::U8);

/// Half-precision types travel as themselves and are summed in f32 (one rounding).
macro_rules! half_elem {
    ($t:ty, $d:expr) => {
        impl Elem for $t {
            const DTYPE: DType = $d;
            type Acc = f32;
            const ACC_IS_SELF: bool = false;
            #[inline(always)]
            fn to_acc(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn from_acc(a: f32) -> $t {
                <$t>::from_f32(a)
            }
            #[inline(always)]
            fn read_le(b: &[u8]) -> $t {
                <$t>::from_bits(u16::from_le_bytes([b[0], b[1]]))
            }
        }
    };
}
half_elem!(bf16, DType::BF16);
half_elem!(f16, DType::F16);

/// The bytes of a slice of plain elements (all five types and their accumulators have no
/// padding and no invalid bit patterns, and the host is little-endian).
pub fn as_bytes<T: Copy + sealed::Sealed>(s: &[T]) -> &[u8] {
    // SAFETY: T is one of f32/bf16/f16/u8/i32 (sealed): no padding; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

/// `dst[i] += src[i]` where `src` holds little-endian `A` values.
#[inline]
pub fn add_bytes_into<A: Acc>(dst: &mut [A], src: &[u8]) {
    debug_assert_eq!(dst.len() * A::SIZE_BYTES, src.len());
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(A::SIZE_BYTES)) {
        *d = d.add(A::read_le(s));
    }
}

/// `dst[i] = src[i]` where `src` holds little-endian `T` values.
#[cfg(test)]
pub fn copy_bytes_into<T: Elem>(dst: &mut [T], src: &[u8]) {
    debug_assert_eq!(std::mem::size_of_val(dst), src.len());
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(T::DTYPE.size_bytes())) {
        *d = T::read_le(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_dtype() {
        assert_eq!(std::mem::size_of::<f32>(), DType::F32.size_bytes());
        assert_eq!(std::mem::size_of::<bf16>(), DType::BF16.size_bytes());
        assert_eq!(std::mem::size_of::<f16>(), DType::F16.size_bytes());
        assert_eq!(std::mem::size_of::<u8>(), DType::U8.size_bytes());
        assert_eq!(std::mem::size_of::<i32>(), DType::I32.size_bytes());
        for v in 0..=255u8 {
            assert_eq!(DType::from_u8(v).map(|d| d as u8), if (1..=5).contains(&v) { Some(v) } else { None });
        }
    }

    #[test]
    fn byte_views_round_trip() {
        let x = [1.5f32, -2.0, 3.25];
        let mut y = [0f32; 3];
        copy_bytes_into(&mut y, as_bytes(&x));
        assert_eq!(x, y);
        let mut acc = [1.0f32; 3];
        add_bytes_into(&mut acc, as_bytes(&x));
        assert_eq!(acc, [2.5, -1.0, 4.25]);
        let b = [bf16::from_f32(1.0), bf16::from_f32(-3.0)];
        let mut c = [bf16::ZERO; 2];
        copy_bytes_into(&mut c, as_bytes(&b));
        assert_eq!(b, c);
        let mut w = [250u8];
        add_bytes_into(&mut w, &[10u8]);
        assert_eq!(w, [4]);
    }
}
