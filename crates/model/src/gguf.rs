//! GGUF v2/v3 reader: metadata of every value type, tensor infos, alignment.
//! Knows nothing of models: it hands out tensor descriptions and byte ranges.
//!
//! Layout: magic "GGUF", u32 version, u64 tensor_count, u64 kv_count, KVs, tensor
//! infos, padding to `general.alignment` (default 32), data. Little-endian.

use crate::checkpoint::{TensorDtype, TensorInfo};
use crate::error::{LoadError, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// Sanity limits: a corrupt count must not make us allocate terabytes.
const TENSORS_MAX: u64 = 1 << 20;
const KVS_MAX: u64 = 1 << 20;
const STRING_BYTES_MAX: u64 = 1 << 30;
const ARRAY_ELEMS_MAX: u64 = 1 << 28;
const DIMS_MAX: u32 = 8;

#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::F32(_) => "f32",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F64(_) => "f64",
        }
    }

    /// Any integer type as u64 (negative values are refused).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v as i64),
            GgufValue::I16(v) => Some(v as i64),
            GgufValue::I32(v) => Some(v as i64),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Parsed GGUF header: metadata and tensor infos with absolute byte ranges.
pub struct GgufFile {
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    /// Tensors in file order, names as stored; shapes outermost-first (torch order).
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    pub data_offset: u64,
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let end = (self.pos as u64).checked_add(n).filter(|&e| e <= self.bytes.len() as u64).ok_or_else(|| {
            LoadError::format(
                self.path,
                format!(
                    "truncated header: {what} needs {n} bytes at offset {} but the file has {} bytes",
                    self.pos,
                    self.bytes.len()
                ),
            )
        })?;
        let s = &self.bytes[self.pos..end as usize];
        self.pos = end as usize;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().expect("2 bytes")))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > STRING_BYTES_MAX {
            return Err(LoadError::format(self.path, format!("{what}: string length {len} exceeds {STRING_BYTES_MAX}")));
        }
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec())
            .map_err(|_| LoadError::format(self.path, format!("{what}: string is not valid UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<GgufValue> {
        let path = self.path;
        let bad = |r: &str| LoadError::key(path, key, r.to_string());
        Ok(match ty {
            0 => GgufValue::U8(self.u8(key)?),
            1 => GgufValue::I8(self.u8(key)? as i8),
            2 => GgufValue::U16(self.u16(key)?),
            3 => GgufValue::I16(self.u16(key)? as i16),
            4 => GgufValue::U32(self.u32(key)?),
            5 => GgufValue::I32(self.u32(key)? as i32),
            6 => GgufValue::F32(f32::from_bits(self.u32(key)?)),
            7 => match self.u8(key)? {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(bad(&format!("bool value {b} is neither 0 nor 1"))),
            },
            8 => GgufValue::String(self.string(key)?),
            9 => {
                if depth > 0 {
                    return Err(bad("nested arrays are not supported"));
                }
                let elem_ty = self.u32(key)?;
                let n = self.u64(key)?;
                if n > ARRAY_ELEMS_MAX {
                    return Err(bad(&format!("array of {n} elements exceeds the limit of {ARRAY_ELEMS_MAX}")));
                }
                // Each element takes at least one byte: a cheap bound before allocating.
                if n > (self.bytes.len() - self.pos) as u64 {
                    return Err(bad(&format!("array claims {n} elements but the file ends first (truncated?)")));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem_ty, key, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(self.u64(key)?),
            11 => GgufValue::I64(self.u64(key)? as i64),
            12 => GgufValue::F64(f64::from_bits(self.u64(key)?)),
            t => return Err(bad(&format!("unknown value type {t}"))),
        })
    }
}

/// ggml type id → (dtype, elements per block, bytes per block).
fn ggml_type(id: u32) -> Option<(TensorDtype, u64, u64)> {
    Some(match id {
        0 => (TensorDtype::F32, 1, 4),
        1 => (TensorDtype::F16, 1, 2),
        2 => (TensorDtype::Q4_0, 32, 18),
        3 => (TensorDtype::Q4_1, 32, 20),
        6 => (TensorDtype::Q5_0, 32, 22),
        7 => (TensorDtype::Q5_1, 32, 24),
        8 => (TensorDtype::Q8_0, 32, 34),
        10 => (TensorDtype::Q2K, 256, 84),
        11 => (TensorDtype::Q3K, 256, 110),
        20 => (TensorDtype::Iq4Nl, 32, 18),
        23 => (TensorDtype::Iq4Xs, 256, 136),
        12 => (TensorDtype::Q4K, 256, 144),
        13 => (TensorDtype::Q5K, 256, 176),
        14 => (TensorDtype::Q6K, 256, 210),
        39 => (TensorDtype::Mxfp4, 32, 17),
        24 => (TensorDtype::I8, 1, 1),
        25 => (TensorDtype::I16, 1, 2),
        26 => (TensorDtype::I32, 1, 4),
        27 => (TensorDtype::I64, 1, 8),
        28 => (TensorDtype::F64, 1, 8),
        30 => (TensorDtype::Bf16, 1, 2),
        _ => return None,
    })
}

/// The ggml type id of a dtype this reader maps (the inverse of [`ggml_type`]).
fn ggml_type_id(dtype: TensorDtype) -> Option<u32> {
    (0..64).find(|&id| ggml_type(id).is_some_and(|(d, _, _)| d == dtype))
}

/// One tensor for [`write`]: its name, type, shape (outermost first, as the reader
/// reports it) and data in that type's layout.
pub struct TensorOut<'a> {
    pub name: &'a str,
    pub dtype: TensorDtype,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// What a heap allocation of `bytes` costs with glibc's malloc: its 8-byte header,
/// rounded to 16, at least 32 (the estimate `tessera plan` counts headers with).
pub(crate) fn heap_chunk_bytes(bytes: usize) -> usize {
    if bytes == 0 {
        0
    } else {
        (bytes + 8).next_multiple_of(16).max(32)
    }
}

impl GgufValue {
    /// The heap this value holds beyond its own `size_of` (strings and arrays).
    pub fn heap_bytes(&self) -> usize {
        match self {
            GgufValue::String(s) => heap_chunk_bytes(s.capacity()),
            GgufValue::Array(items) => heap_chunk_bytes(items.capacity() * std::mem::size_of::<GgufValue>()) + items.iter().map(GgufValue::heap_bytes).sum::<usize>(),
            _ => 0,
        }
    }
}

fn value_type(v: &GgufValue) -> u32 {
    match v {
        GgufValue::U8(_) => 0,
        GgufValue::I8(_) => 1,
        GgufValue::U16(_) => 2,
        GgufValue::I16(_) => 3,
        GgufValue::U32(_) => 4,
        GgufValue::I32(_) => 5,
        GgufValue::F32(_) => 6,
        GgufValue::Bool(_) => 7,
        GgufValue::String(_) => 8,
        GgufValue::Array(_) => 9,
        GgufValue::U64(_) => 10,
        GgufValue::I64(_) => 11,
        GgufValue::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.push(*x as u8),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::String(x) => put_string(out, x),
        GgufValue::Array(items) => {
            // An empty array's element type is lost when read; u8 is as good as any.
            out.extend_from_slice(&items.first().map_or(0, value_type).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i);
            }
        }
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

/// Writes a GGUF v3 file: `metadata` as given, then `tensors` in order, each aligned
/// to `general.alignment` (32 when absent). Shapes are written innermost first, as
/// the format wants. Used for one rank's shard of a GGUF checkpoint.
pub fn write(path: &Path, metadata: &BTreeMap<String, GgufValue>, tensors: &[TensorOut<'_>]) -> Result<()> {
    use std::io::Write;
    let alignment = metadata.get("general.alignment").and_then(|v| v.as_u64()).unwrap_or(32) as usize;
    let mut head = Vec::with_capacity(1 << 16);
    head.extend_from_slice(b"GGUF");
    head.extend_from_slice(&3u32.to_le_bytes());
    head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_string(&mut head, k);
        head.extend_from_slice(&value_type(v).to_le_bytes());
        put_value(&mut head, v);
    }
    let mut offset = 0usize;
    for t in tensors {
        let ty = ggml_type_id(t.dtype)
            .ok_or_else(|| LoadError::tensor(path, t.name, format!("{:?} has no ggml type", t.dtype)))?;
        let (_, block, block_bytes) = ggml_type(ty).expect("a mapped type");
        let elems: usize = t.shape.iter().product();
        if !(elems as u64).is_multiple_of(block) || (elems as u64 / block * block_bytes) as usize != t.data.len() {
            return Err(LoadError::tensor(path, t.name, format!("{} bytes for shape {:?} of {:?}", t.data.len(), t.shape, t.dtype)));
        }
        put_string(&mut head, t.name);
        head.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for &d in t.shape.iter().rev() {
            head.extend_from_slice(&(d as u64).to_le_bytes());
        }
        head.extend_from_slice(&ty.to_le_bytes());
        head.extend_from_slice(&(offset as u64).to_le_bytes());
        offset = (offset + t.data.len()).div_ceil(alignment) * alignment;
    }
    head.resize(head.len().div_ceil(alignment) * alignment, 0);
    let io = |error| LoadError::Write { path: path.into(), error };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    f.write_all(&head).map_err(io)?;
    let zeros = vec![0u8; alignment];
    for t in tensors {
        f.write_all(t.data).map_err(io)?;
        let pad = t.data.len().div_ceil(alignment) * alignment - t.data.len();
        f.write_all(&zeros[..pad]).map_err(io)?;
    }
    f.flush().map_err(io)
}

fn ggml_type_name(id: u32) -> &'static str {
    match id {
        9 => "Q8_1",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        21 => "IQ3_S",
        22 => "IQ2_S",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        _ => "an unknown type",
    }
}

impl GgufFile {
    /// Parses the header of `bytes` (the whole file) and checks every tensor's byte
    /// range against the file size.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<GgufFile> {
        let mut r = Reader { bytes, pos: 0, path };
        let magic = r.take(4, "magic")?;
        if magic != b"GGUF" {
            return Err(LoadError::format(path, format!("bad magic {magic:02x?}, expected \"GGUF\"")));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(LoadError::format(path, format!("GGUF version {version} is not supported (2 and 3 are)")));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        if n_tensors > TENSORS_MAX || n_kv > KVS_MAX {
            return Err(LoadError::format(
                path,
                format!("header claims {n_tensors} tensors and {n_kv} keys; limits are {TENSORS_MAX} and {KVS_MAX}"),
            ));
        }
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("key #{i}"))?;
            let ty = r.u32(&key)?;
            let value = r.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(LoadError::key(path, key, "appears twice in the metadata"));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => return Err(LoadError::key(path, "general.alignment", format!("must be a power of two, got {v:?}"))),
            },
        };
        struct Raw {
            name: String,
            dims: Vec<u64>,
            ty: u32,
            offset: u64,
        }
        let mut raw = Vec::with_capacity(n_tensors.min(4096) as usize);
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor #{i} name"))?;
            let n_dims = r.u32(&name)?;
            if n_dims == 0 || n_dims > DIMS_MAX {
                return Err(LoadError::tensor(path, name, format!("{n_dims} dimensions (1..={DIMS_MAX} supported)")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&name)?);
            }
            let ty = r.u32(&name)?;
            let offset = r.u64(&name)?;
            raw.push(Raw { name, dims, ty, offset });
        }
        let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
        let file_len = bytes.len() as u64;
        let mut tensors = Vec::with_capacity(raw.len());
        let mut seen = std::collections::HashSet::new();
        for t in raw {
            if !seen.insert(t.name.clone()) {
                return Err(LoadError::tensor(path, &t.name, "appears twice in the tensor table"));
            }
            let (dtype, block, block_bytes) = ggml_type(t.ty).ok_or_else(|| {
                LoadError::tensor(
                    path,
                    &t.name,
                    format!(
                        "ggml type {} ({}) is not supported yet; weights may be F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, \
                         Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS or MXFP4 (llama.cpp's llama-quantize \
                         --allow-requantize converts a file to one of them)",
                        t.ty,
                        ggml_type_name(t.ty)
                    ),
                )
            })?;
            let elems = t
                .dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| LoadError::tensor(path, &t.name, format!("shape {:?} overflows", t.dims)))?;
            if t.dims[0] % block != 0 {
                return Err(LoadError::tensor(
                    path,
                    &t.name,
                    format!("row length {} is not a multiple of the {dtype:?} block of {block}", t.dims[0]),
                ));
            }
            let size = (elems / block)
                .checked_mul(block_bytes)
                .ok_or_else(|| LoadError::tensor(path, &t.name, format!("shape {:?} overflows", t.dims)))?;
            if t.offset % alignment != 0 {
                return Err(LoadError::tensor(path, &t.name, format!("offset {} is not aligned to {alignment}", t.offset)));
            }
            let start = data_offset.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(size));
            match (start, end) {
                (Some(s), Some(e)) if e <= file_len => {
                    let shape = t.dims.iter().rev().map(|&d| d as usize).collect();
                    tensors.push(TensorInfo {
                        name: t.name,
                        dtype,
                        shape,
                        file: 0,
                        range: s as usize..e as usize,
                    });
                }
                _ => {
                    return Err(LoadError::tensor(
                        path,
                        &t.name,
                        format!(
                            "data [{} + {}, +{size} bytes) runs past the end of the file ({file_len} bytes): truncated download?",
                            data_offset, t.offset
                        ),
                    ))
                }
            }
        }
        // Overlapping tensors mean a corrupt table: check on sorted ranges.
        let mut ranges: Vec<(usize, usize, &str)> = tensors.iter().map(|t| (t.range.start, t.range.end, t.name.as_str())).collect();
        ranges.sort();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 && w[0].1 > w[0].0 && w[1].1 > w[1].0 {
                return Err(LoadError::tensor(path, w[1].2, format!("data overlaps tensor `{}`", w[0].2)));
            }
        }
        Ok(GgufFile { version, metadata, tensors, alignment, data_offset })
    }
}
