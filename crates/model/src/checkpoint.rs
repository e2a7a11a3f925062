//! Checkpoint containers: a Hugging Face directory of safetensors files, or one GGUF
//! file. Knows nothing of models: it lists tensors (name, dtype, shape, byte range)
//! and hands out zero-copy views of the memory-mapped files.

use crate::error::{LoadError, Result};
use crate::gguf::{GgufFile, GgufValue};
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Element types a tensor can be stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorDtype {
    F32,
    F16,
    Bf16,
    F64,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4K,
    Q5K,
    Q6K,
    Q2K,
    Q3K,
    Iq4Nl,
    Iq4Xs,
    Mxfp4,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    Bool,
    F8E4M3,
    F8E5M2,
}

impl TensorDtype {
    /// The name tools print: the kernel format's (Q4_K, IQ4_XS) where there is one, else
    /// the dtype's own in capitals (I32, F8E4M3).
    pub fn name(self) -> String {
        self.weight_format().map_or_else(|| format!("{self:?}").to_uppercase(), |f| f.name().to_string())
    }

    /// The kernel format this dtype computes as, if any.
    pub fn weight_format(self) -> Option<tessera_kernels::WeightFormat> {
        use tessera_kernels::WeightFormat as W;
        Some(match self {
            TensorDtype::F32 => W::F32,
            TensorDtype::F16 => W::F16,
            TensorDtype::Bf16 => W::Bf16,
            TensorDtype::Q8_0 => W::Q8_0,
            TensorDtype::Q4_0 => W::Q4_0,
            TensorDtype::Q4_1 => W::Q4_1,
            TensorDtype::Q5_0 => W::Q5_0,
            TensorDtype::Q5_1 => W::Q5_1,
            TensorDtype::Q4K => W::Q4K,
            TensorDtype::Q5K => W::Q5K,
            TensorDtype::Q6K => W::Q6K,
            TensorDtype::Q2K => W::Q2K,
            TensorDtype::Q3K => W::Q3K,
            TensorDtype::Iq4Nl => W::Iq4Nl,
            TensorDtype::Iq4Xs => W::Iq4Xs,
            TensorDtype::Mxfp4 => W::Mxfp4,
            _ => return None,
        })
    }
}

/// One tensor: where its bytes are. `shape` is outermost-first (PyTorch order) for
/// both containers; a GGUF `[in, out]` tensor reads as `[out, in]`.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: TensorDtype,
    pub shape: Vec<usize>,
    /// Index into the checkpoint's files.
    pub file: usize,
    /// Absolute byte range in that file.
    pub range: Range<usize>,
}

impl TensorInfo {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointKind {
    /// `config.json` + safetensors.
    HfDir,
    Gguf,
}

pub struct MappedFile {
    pub path: PathBuf,
    pub map: Mmap,
    /// The open file, for explicit reads of exactly the bytes a shard needs.
    pub file: File,
}

/// An opened checkpoint. Cheap to keep: the files are memory-mapped, so only pages a
/// computation touches are ever read from disk.
pub struct Checkpoint {
    /// The path the user gave (directory or .gguf file).
    pub path: PathBuf,
    pub kind: CheckpointKind,
    pub files: Vec<MappedFile>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    /// GGUF metadata (tensor infos moved to `tensors`).
    pub gguf: Option<GgufFile>,
    /// Parsed `config.json` of a HF directory.
    pub config: Option<serde_json::Value>,
}

fn map_file(path: &Path) -> Result<(Mmap, File)> {
    let file = File::open(path).map_err(|error| LoadError::Io { path: path.into(), error })?;
    // SAFETY: the mapping is read-only; a checkpoint rewritten under a running engine
    // is outside what we can defend against (as for every mmap-based loader).
    let map = unsafe { Mmap::map(&file) }.map_err(|error| LoadError::Io { path: path.into(), error })?;
    Ok((map, file))
}

impl Checkpoint {
    /// Opens a HF directory (with `config.json`) or a `.gguf` file.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        // A Hugging Face repo id names the model the local cache holds.
        let resolved = crate::hf_cache::resolve(path).map_err(|reason| LoadError::format(path, reason))?;
        let path = resolved.as_path();
        let meta = std::fs::metadata(path).map_err(|error| LoadError::Io { path: path.into(), error })?;
        if meta.is_dir() {
            Self::open_hf_dir(path)
        } else {
            let (map, file) = map_file(path)?;
            if map.len() >= 4 && &map[..4] == b"GGUF" {
                Self::open_gguf(path, map, file)
            } else if path.extension().is_some_and(|e| e == "safetensors") {
                Err(LoadError::format(
                    path,
                    "a bare .safetensors file has no config: pass the directory that holds it and its config.json",
                ))
            } else {
                Err(LoadError::format(
                    path,
                    "neither a GGUF file (magic \"GGUF\") nor a directory with config.json and safetensors",
                ))
            }
        }
    }

    fn open_gguf(path: &Path, map: Mmap, file: File) -> Result<Checkpoint> {
        let mut gguf = GgufFile::parse(path, &map)?;
        let tensors = std::mem::take(&mut gguf.tensors);
        let by_name = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(Checkpoint {
            path: path.into(),
            kind: CheckpointKind::Gguf,
            files: vec![MappedFile { path: path.into(), map, file }],
            tensors,
            by_name,
            gguf: Some(gguf),
            config: None,
        })
    }

    fn open_hf_dir(dir: &Path) -> Result<Checkpoint> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path)
            .map_err(|error| LoadError::Io { path: config_path.clone(), error })?;
        let config: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| LoadError::format(&config_path, format!("invalid JSON: {e}")))?;
        if !config.is_object() {
            return Err(LoadError::format(&config_path, "expected a JSON object"));
        }
        let index_path = dir.join("model.safetensors.index.json");
        let (file_names, weight_map) = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|error| LoadError::Io { path: index_path.clone(), error })?;
            let index: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| LoadError::format(&index_path, format!("invalid JSON: {e}")))?;
            let map = index
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| LoadError::key(&index_path, "weight_map", "missing or not an object"))?;
            let mut weight_map = HashMap::new();
            let mut files: Vec<String> = Vec::new();
            for (name, file) in map {
                let file = file
                    .as_str()
                    .ok_or_else(|| LoadError::key(&index_path, format!("weight_map.{name}"), "file name is not a string"))?;
                if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                    return Err(LoadError::key(&index_path, format!("weight_map.{name}"), format!("`{file}` is not a plain file name")));
                }
                if !files.iter().any(|f| f == file) {
                    files.push(file.to_string());
                }
                weight_map.insert(name.clone(), file.to_string());
            }
            files.sort();
            (files, Some(weight_map))
        } else {
            let all: Vec<String> = std::fs::read_dir(dir)
                .map_err(|error| LoadError::Io { path: dir.into(), error })?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            // As mlx and transformers do: `model*.safetensors` when present, so other
            // safetensors files beside the model (consolidated copies, adapters) are ignored.
            let mut files: Vec<String> = all.iter().filter(|n| n.starts_with("model")).cloned().collect();
            if files.is_empty() {
                files = all;
            }
            files.sort();
            if files.is_empty() {
                return Err(LoadError::format(dir, "no *.safetensors files and no model.safetensors.index.json"));
            }
            (files, None)
        };

        let mut files = Vec::with_capacity(file_names.len());
        let mut tensors: Vec<TensorInfo> = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        for (file_idx, name) in file_names.iter().enumerate() {
            let path = dir.join(name);
            let (map, file) = map_file(&path)?;
            for t in read_safetensors_header(&path, &map, file_idx)? {
                if let Some(&prev) = by_name.get(&t.name) {
                    return Err(LoadError::tensor(
                        &path,
                        &t.name,
                        format!("also present in {}", file_names[tensors[prev].file]),
                    ));
                }
                if let Some(wm) = &weight_map {
                    match wm.get(&t.name) {
                        Some(f) if f == name => {}
                        Some(f) => {
                            return Err(LoadError::tensor(&path, &t.name, format!("the index says it lives in {f}")))
                        }
                        None => return Err(LoadError::tensor(&path, &t.name, "not listed in model.safetensors.index.json")),
                    }
                }
                by_name.insert(t.name.clone(), tensors.len());
                tensors.push(t);
            }
            files.push(MappedFile { path, map, file });
        }
        if let Some(wm) = &weight_map {
            let mut missing: Vec<&String> = wm.keys().filter(|n| !by_name.contains_key(*n)).collect();
            missing.sort();
            if let Some(name) = missing.first() {
                return Err(LoadError::MissingTensor {
                    path: dir.join(&wm[*name]),
                    tensor: (*name).clone(),
                    hint: format!(" (the index lists it; {} listed tensors are absent)", missing.len()),
                });
            }
        }
        compressed_mxfp4_as_mlx(&mut tensors, &mut by_name);
        Ok(Checkpoint { path: dir.into(), kind: CheckpointKind::HfDir, files, tensors, by_name, gguf: None, config: Some(config) })
    }

    /// A checkpoint of headers only (`synth`): `tensors` as (name, dtype, shape), each
    /// given the bytes its dtype and shape take, laid end to end in no file. It has no
    /// bytes to view or read: only a dry load (`Model::footprint`) takes it.
    pub fn synthetic(path: &Path, tensors: Vec<(String, TensorDtype, Vec<usize>)>, config: serde_json::Value) -> Result<Checkpoint> {
        let mut infos = Vec::with_capacity(tensors.len());
        let mut by_name = HashMap::new();
        let mut at = 0usize;
        for (name, dtype, shape) in tensors {
            let bytes = dtype_bytes(dtype, &shape).ok_or_else(|| LoadError::tensor(path, &name, format!("{dtype:?} {shape:?} is not a whole number of blocks")))?;
            by_name.insert(name.clone(), infos.len());
            infos.push(TensorInfo { name, dtype, shape, file: 0, range: at..at + bytes });
            at += bytes;
        }
        Ok(Checkpoint { path: path.into(), kind: CheckpointKind::HfDir, files: Vec::new(), tensors: infos, by_name, gguf: None, config: Some(config) })
    }

    /// Lets go of every page of the memory maps this process has touched (a load that
    /// copied matrices into its arena read them through the map): the process then holds
    /// its weights once. A view still in use reads its pages again from the page cache
    /// when touched. Advice only: a failure changes nothing but the resident size.
    pub fn release_pages(&self) {
        for f in &self.files {
            // SAFETY: the maps are private and read-only, so dropping their pages loses
            // nothing: the next read of a page refaults it from the file.
            let _ = unsafe { f.map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }

    /// The heap its parsed headers hold, estimated (every rank holds them while it runs;
    /// `tessera plan` counts them): GGUF metadata (a vocabulary of 150k strings is tens
    /// of MB), tensor infos and the name index. A HF `config.json` is a few KB, left out.
    /// Measured on SmolLM2's GGUF (49k tokens, 49k merges): 7.6 MiB; this says 7.5.
    pub fn headers_heap_bytes(&self) -> usize {
        use crate::gguf::heap_chunk_bytes;
        use std::mem::size_of;
        let metadata = self.gguf.as_ref().map_or(0, |g| {
            g.metadata.iter().map(|(k, v)| size_of::<(String, GgufValue)>() + heap_chunk_bytes(k.capacity()) + v.heap_bytes()).sum()
        });
        let tensors: usize = self.tensors.iter().map(|t| size_of::<TensorInfo>() + heap_chunk_bytes(t.name.capacity()) + heap_chunk_bytes(t.shape.capacity() * size_of::<usize>())).sum();
        // A hash map's slot (key, value, control byte) at its 7/8 load factor.
        let index: usize = self.by_name.keys().map(|k| (size_of::<(String, usize)>() + 1) * 8 / 7 + heap_chunk_bytes(k.capacity())).sum();
        metadata + tensors + index
    }

    /// Whether its tensors have bytes (not [`Self::synthetic`]).
    pub fn has_bytes(&self) -> bool {
        !self.files.is_empty()
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor, straight from the memory map.
    pub fn bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.files[t.file].map[t.range.clone()]
    }

    /// Reads `buf.len()` bytes at `offset` of file `file` with a positioned read
    /// (no page of the memory map is touched): how shards load only their own bytes.
    pub fn read_at(&self, file: usize, offset: usize, buf: &mut [u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let f = &self.files[file];
        f.file.read_exact_at(buf, offset as u64).map_err(|error| LoadError::Io { path: f.path.clone(), error })
    }

    /// The stored tensor whose name is closest to `name` (at most `edits_max` character
    /// edits away), for "missing tensor" errors: a renamed or corrupted entry. Names that
    /// differ only in their numbers are another layer's or expert's tensor, not a near
    /// miss, and are skipped. Runs only on that error path; names whose lengths differ by
    /// more than `edits_max` are skipped without comparing.
    pub fn closest_name(&self, name: &str, edits_max: usize) -> Option<&TensorInfo> {
        let want: Vec<char> = name.chars().collect();
        fn shape_of(n: &str) -> Vec<&str> {
            n.split(|c: char| c.is_ascii_digit()).filter(|p| !p.is_empty()).collect()
        }
        let want_shape = shape_of(name);
        self.tensors
            .iter()
            .filter(|t| t.name.chars().count().abs_diff(want.len()) <= edits_max)
            .filter(|t| shape_of(&t.name) != want_shape)
            .filter_map(|t| edit_distance_within(&want, &t.name, edits_max).map(|d| (d, t)))
            .min_by_key(|&(d, _)| d)
            .map(|(_, t)| t)
    }

    /// The file a tensor lives in, for error messages.
    pub fn file_of(&self, t: &TensorInfo) -> &Path {
        self.files.get(t.file).map_or(&self.path, |f| &f.path)
    }

    /// Total bytes of tensor data.
    pub fn data_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.range.len()).sum()
    }
}

/// Bytes a tensor of `dtype` and `shape` takes (`None`: rows not whole blocks).
pub(crate) fn dtype_bytes(dtype: TensorDtype, shape: &[usize]) -> Option<usize> {
    use TensorDtype as D;
    if let Some(f) = dtype.weight_format().filter(|f| f.is_quantized()) {
        let (rows, cols) = match shape.split_last() {
            Some((c, lead)) => (lead.iter().product::<usize>(), *c),
            None => return Some(0),
        };
        return Some(rows * f.row_bytes(cols).ok()?);
    }
    let size = match dtype {
        D::F64 | D::I64 | D::U64 => 8,
        D::F32 | D::I32 | D::U32 => 4,
        D::F16 | D::Bf16 | D::I16 | D::U16 => 2,
        _ => 1,
    };
    Some(shape.iter().product::<usize>() * size)
}

fn read_safetensors_header(path: &Path, bytes: &[u8], file: usize) -> Result<Vec<TensorInfo>> {
    use safetensors::{Dtype, SafeTensors};
    // `deserialize` checks the header JSON, that offsets are contiguous and consistent
    // with dtype × shape, and that the data fits the file.
    let st = SafeTensors::deserialize(bytes).map_err(|e| match e {
        safetensors::SafeTensorError::TensorInvalidInfo => match find_inconsistent_tensor(bytes) {
            Some((name, reason)) => LoadError::tensor(path, name, reason),
            None => LoadError::format(path, describe_safetensors_error(&e)),
        },
        safetensors::SafeTensorError::MetadataIncompleteBuffer => match find_truncated_tensor(bytes) {
            Some((name, reason)) => LoadError::tensor(path, name, reason),
            None => LoadError::format(path, describe_safetensors_error(&e)),
        },
        e => LoadError::format(path, describe_safetensors_error(&e)),
    })?;
    let header_len = 8 + u64::from_le_bytes(bytes[..8].try_into().expect("deserialize checked the length")) as usize;
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.tensors() {
        let dtype = match view.dtype() {
            Dtype::F32 => TensorDtype::F32,
            Dtype::F16 => TensorDtype::F16,
            Dtype::BF16 => TensorDtype::Bf16,
            Dtype::F64 => TensorDtype::F64,
            Dtype::I8 => TensorDtype::I8,
            Dtype::I16 => TensorDtype::I16,
            Dtype::I32 => TensorDtype::I32,
            Dtype::I64 => TensorDtype::I64,
            Dtype::U8 => TensorDtype::U8,
            Dtype::U16 => TensorDtype::U16,
            Dtype::U32 => TensorDtype::U32,
            Dtype::U64 => TensorDtype::U64,
            Dtype::BOOL => TensorDtype::Bool,
            Dtype::F8_E4M3 => TensorDtype::F8E4M3,
            Dtype::F8_E5M2 => TensorDtype::F8E5M2,
            other => return Err(LoadError::tensor(path, name, format!("dtype {other:?} is not supported"))),
        };
        let data = view.data();
        // The view borrows `bytes`; recover its absolute offset.
        let start = data.as_ptr() as usize - bytes.as_ptr() as usize;
        debug_assert!(start >= header_len);
        out.push(TensorInfo { name, dtype, shape: view.shape().to_vec(), file, range: start..start + data.len() });
    }
    out.sort_by_key(|t| t.range.start);
    Ok(out)
}

fn describe_safetensors_error(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall => "file too small for a safetensors header (truncated?)".into(),
        E::HeaderTooLarge => "header length is implausibly large (not a safetensors file?)".into(),
        E::InvalidHeaderLength => "header length runs past the end of the file (truncated?)".into(),
        E::MetadataIncompleteBuffer => "tensor data runs past the end of the file (truncated download?)".into(),
        E::InvalidOffset(name) => format!("tensor `{name}`: byte offsets are not contiguous or do not match its dtype × shape"),
        E::TensorInvalidInfo => "a tensor's dtype × shape does not match its byte range".into(),
        E::InvalidHeader(err) => format!("header is not valid UTF-8: {err}"),
        E::InvalidHeaderDeserialization(err) => format!("header JSON is invalid: {err}"),
        E::InvalidHeaderStart => "header does not start with '{' (not a safetensors file?)".into(),
        other => format!("{other}"),
    }
}

/// compressed-tensors MXFP4 (Kimi-K3's routed experts, spec §2.8): `X.weight_packed` (the
/// FP4 codes, two per byte, stored as bytes or 32-bit words) beside `X.weight_scale` (U8
/// E8M0 exponents per 32) is MLX's mxfp4 byte for byte, as mlx reads it (a U32 view of the
/// codes): the pair is listed as `X.weight` (U32) and `X.scales`, and every later reader
/// sees one layout. Other compressed-tensors schemes are left as they are.
fn compressed_mxfp4_as_mlx(tensors: &mut [TensorInfo], by_name: &mut HashMap<String, usize>) {
    let pairs: Vec<(usize, usize, String)> = tensors
        .iter()
        .enumerate()
        .filter_map(|(i, t)| {
            let base = t.name.strip_suffix(".weight_packed")?;
            let &j = by_name.get(&format!("{base}.weight_scale"))?;
            let row_bytes = t.range.len() / t.shape[..t.shape.len().saturating_sub(1)].iter().product::<usize>().max(1);
            let fits = tensors[j].dtype == TensorDtype::U8 && !t.shape.is_empty() && row_bytes % 4 == 0 && matches!(t.dtype, TensorDtype::U8 | TensorDtype::U32 | TensorDtype::I32);
            (fits && !by_name.contains_key(&format!("{base}.weight"))).then(|| (i, j, base.to_string()))
        })
        .collect();
    for (i, j, base) in pairs {
        let t = &mut tensors[i];
        let row_bytes = t.range.len() / t.shape[..t.shape.len() - 1].iter().product::<usize>().max(1);
        *t.shape.last_mut().expect("checked non-empty") = row_bytes / 4;
        t.dtype = TensorDtype::U32;
        for (k, name) in [(i, format!("{base}.weight")), (j, format!("{base}.scales"))] {
            by_name.remove(&tensors[k].name);
            tensors[k].name = name.clone();
            by_name.insert(name, k);
        }
    }
}

/// The first tensor whose data runs past the end of a truncated file.
fn find_truncated_tensor(bytes: &[u8]) -> Option<(String, String)> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Value = serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
    let data_len = bytes.len().checked_sub(8 + n)?;
    let mut cut: Vec<(usize, usize, &String)> = header
        .as_object()?
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .filter_map(|(name, info)| {
            let o = info.get("data_offsets")?.as_array()?;
            Some((o.first()?.as_u64()? as usize, o.get(1)?.as_u64()? as usize, name))
        })
        .filter(|(_, end, _)| *end > data_len)
        .collect();
    cut.sort();
    let (start, end, name) = cut.first()?;
    Some((
        (*name).clone(),
        format!(
            "data [{start}, {end}) runs past the end of the file's {data_len} data bytes ({} tensors affected): truncated download?",
            cut.len()
        ),
    ))
}

/// Which tensor's dtype × shape disagrees with its byte range (the safetensors crate
/// reports that something does, not what).
fn find_inconsistent_tensor(bytes: &[u8]) -> Option<(String, String)> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Value = serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
    for (name, info) in header.as_object()? {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info.get("dtype")?.as_str()?;
        let elem_bits: usize = match dtype {
            "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 8,
            "U16" | "I16" | "F16" | "BF16" => 16,
            "U32" | "I32" | "F32" => 32,
            "U64" | "I64" | "F64" => 64,
            _ => continue,
        };
        let shape: Vec<usize> = info.get("shape")?.as_array()?.iter().filter_map(|d| d.as_u64().map(|d| d as usize)).collect();
        let offs = info.get("data_offsets")?.as_array()?;
        let (a, b) = (offs.first()?.as_u64()? as usize, offs.get(1)?.as_u64()? as usize);
        let want = shape.iter().product::<usize>() * elem_bits / 8;
        if b.checked_sub(a) != Some(want) {
            return Some((
                name.clone(),
                format!("{dtype} {shape:?} needs {want} bytes but its data_offsets [{a}, {b}) hold {}", b.wrapping_sub(a) as isize),
            ));
        }
    }
    None
}

/// Levenshtein distance between `a` and `b` if it is at most `max`; rows stop early once
/// every entry exceeds `max`.
fn edit_distance_within(a: &[char], b: &str, max: usize) -> Option<usize> {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, &ca) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        if cur.iter().all(|&d| d > max) {
            return None;
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    Some(prev[b.len()]).filter(|&d| d <= max)
}
