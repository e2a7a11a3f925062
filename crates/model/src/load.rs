//! The loader: looks tensors up by HF name in either container, checks them against
//! the config, reads exactly a shard's bytes (positioned, counted) or records them for
//! `tessera shard`, turns MLX and FP8 layouts into kernel formats, and places every
//! streamed matrix in one arena.

use crate::checkpoint::{Checkpoint, TensorInfo};
use crate::error::{LoadError, Result};
use crate::linear::{Linear, Storage};
use crate::memory::WeightBuffer;
use crate::names::stored_name;
use std::ops::Range;
use std::sync::Arc;
use tessera_kernels::{scalar, WeightFormat};

pub(crate) fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

/// Looks tensors up by HF name in a checkpoint of either container, checking shapes
/// and dtypes against the config.
pub(crate) struct Loader<'a> {
    pub(crate) c: &'a Checkpoint,
    pub(crate) arch: &'static str,
    /// Read shards with positioned reads of exactly their bytes (counted), instead of
    /// viewing whole tensors in the memory map.
    pub(crate) sharded: bool,
    pub(crate) bytes_read: std::cell::Cell<usize>,
    /// The checkpoint is one rank's pre-sliced shard (`tessera shard`): tensors already
    /// have the shapes this rank selects, and are read whole.
    pub(crate) presliced: bool,
    /// When set, every tensor part read is kept (name, dtype, shape, bytes) so
    /// `tessera shard` can write this rank's slice as a standalone checkpoint.
    pub(crate) record: Option<std::cell::RefCell<Vec<RecordedTensor>>>,
    /// Prefix of every tensor name ([`crate::config::ModelConfig::weight_prefix`]).
    pub(crate) prefix: &'a str,
    /// Size everything from the tensor headers, read nothing (`Model::footprint`):
    /// matrices come back [`Storage::Dry`], vectors as zeros; every check still runs.
    pub(crate) dry: bool,
    /// Bytes of the f32 vectors (norms, biases, KDA's taps and decays) read so far.
    pub(crate) floats_held: std::cell::Cell<usize>,
}

/// DeepSeek's FP8 block-scale grid (spec §2.5).
const FP8_BLOCK: usize = 128;

/// An MLX module's quantization, inferred from its tensors' shapes.
#[derive(Clone, Copy)]
struct MlxLayout {
    format: WeightFormat,
    /// Columns per scale (and bias).
    group: usize,
    /// Packed u32 words per group.
    words_per_group: usize,
    /// Bytes per scale / bias element.
    scale_bytes: usize,
}

/// Places `moves` (each matrix and the layout it takes, if any) one after another in
/// one new buffer, on huge pages if `huge`, each at a 64-byte boundary; the copies and
/// repacks run on every core, in runs of about equal bytes (big models have
/// thousands of matrices). Returns the buffer, shared by the matrices' storage.
/// With `dry`, only sizes it: the matrices are marked placed, nothing is allocated, and
/// the arena's bytes come back as the buffer's length would be.
pub(crate) fn place_in_arena(mut moves: Vec<(&mut Linear, Option<WeightFormat>)>, ckpt: &Checkpoint, huge: bool, dry: bool) -> (Option<Arc<WeightBuffer>>, usize) {
    if moves.is_empty() {
        return (None, 0);
    }
    let mut ranges = Vec::with_capacity(moves.len());
    let mut end = 0usize;
    for (l, to) in &moves {
        let start = end.next_multiple_of(64);
        // A layout may store more per row than its source (Q4_Kx8's unpacked scales).
        end = start + to.map_or(l.bytes(), |to| l.rows * to.row_bytes(l.cols).expect("whole groups, checked by `interleaved`"));
        ranges.push(start..end);
    }
    if dry {
        for (l, to) in moves {
            l.format = to.unwrap_or(l.format);
            l.storage = Storage::Dry { in_arena: true };
        }
        return (None, end);
    }
    let mut arena = WeightBuffer::zeroed(end, huge);
    {
        let mut jobs: Vec<(&mut Linear, Option<WeightFormat>, &mut [u8])> = Vec::with_capacity(moves.len());
        let mut rest: &mut [u8] = &mut arena;
        let mut at = 0;
        for ((l, to), r) in moves.iter_mut().zip(&ranges) {
            let (mine, tail) = std::mem::take(&mut rest)[r.start - at..].split_at_mut(r.len());
            jobs.push((&mut **l, *to, mine));
            rest = tail;
            at = r.end;
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(jobs.len());
        let share = end.div_ceil(threads).max(1);
        std::thread::scope(|scope| {
            let mut jobs = jobs.as_mut_slice();
            while !jobs.is_empty() {
                // The next run: matrices up to about `share` bytes (at least one).
                let mut bytes = 0;
                let n = jobs.iter().take_while(|j| {
                    bytes += j.2.len();
                    bytes <= share
                }).count().max(1);
                let (run, tail) = std::mem::take(&mut jobs).split_at_mut(n);
                jobs = tail;
                scope.spawn(move || run.iter_mut().for_each(|(l, to, out)| l.place(ckpt, *to, out)));
            }
        });
    }
    let arena = Arc::new(arena);
    for ((l, _), r) in moves.iter_mut().zip(ranges) {
        l.placed(&arena, r);
    }
    let len = arena.len();
    (Some(arena), len)
}

/// A repacked FP8 matrix from its E4M3 bytes and f32 block scales.
fn fp8_linear(name: &str, rows: usize, cols: usize, bytes: &[u8], scales: &[f32]) -> Linear {
    let data = tessera_kernels::repack_fp8(rows, cols, bytes, scales, (FP8_BLOCK, FP8_BLOCK));
    let len = data.len();
    Linear { name: name.to_string(), format: WeightFormat::Fp8, rows, cols, storage: Storage::Owned(Arc::new(data.into()), 0..len), bias: None }
}

/// One tensor as a shard holds it.
pub struct RecordedTensor {
    pub name: String,
    pub dtype: crate::checkpoint::TensorDtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// A selection of a matrix (of each element of a stack): stack elements, rows, columns.
#[derive(Clone, Debug)]
pub(crate) struct Sel {
    pub(crate) stack: Option<Range<usize>>,
    pub(crate) rows: Range<usize>,
    pub(crate) cols: Range<usize>,
}

impl Sel {
    pub(crate) fn rows(rows: Range<usize>, cols: usize) -> Sel {
        Sel { stack: None, rows, cols: 0..cols }
    }
    pub(crate) fn all(rows: usize, cols: usize) -> Sel {
        Sel { stack: None, rows: 0..rows, cols: 0..cols }
    }
}

impl<'a> Loader<'a> {
    /// Part `sel` of matrix `hf` (`[rows, cols]`, or `[n, rows, cols]` with `stack`),
    /// as one matrix of the selected rows of the selected stack elements. Sharded
    /// loads read exactly those bytes; column splits must fall on quant-block bounds.
    pub(crate) fn part(&self, hf: &str, stack: Option<usize>, rows: usize, cols: usize, sel: &Sel) -> Result<Linear> {
        let n = stack.unwrap_or(1);
        let elems = sel.stack.clone().unwrap_or(0..1);
        let whole = sel.rows == (0..rows) && sel.cols == (0..cols) && elems == (0..n);
        // A whole model views whole tensors in the map; a part of one even there (K3's
        // fused qkv_proj is three matrices) is read like a shard's.
        if !self.sharded && whole {
            return self.matrix(hf, stack, rows, cols);
        }
        let t = self.require(hf)?;
        let file = self.c.file_of(t);
        let base = hf.strip_suffix(".weight").unwrap_or(hf);
        let repacked = self.find(&format!("{base}.scales")).is_some() || t.dtype == crate::checkpoint::TensorDtype::F8E4M3;
        let sliced: Vec<usize> = match &sel.stack {
            Some(st) => vec![st.len(), sel.rows.len(), sel.cols.len()],
            None => vec![sel.rows.len(), sel.cols.len()],
        };
        if self.record.is_some() && repacked {
            self.record_repacked(hf, t, stack, rows, cols, sel)?;
        }
        if self.presliced {
            // A shard holds this rank's part as its own tensor: read it whole. Plain and
            // GGUF tensors must have exactly the part's shape; MLX/FP8 ones are checked by
            // `matrix` (their packed and scale shapes follow from it).
            let want = if stack.is_some() && sel.stack.is_none() { vec![sel.rows.len(), sel.cols.len()] } else { sliced.clone() };
            let k = want.len();
            let rows = want[..k - 1].iter().product();
            let wrong_shard = |e: String| LoadError::tensor(file, &t.name, format!("{e}: was this shard written for another placement or rank?"));
            if !repacked && t.shape != want {
                return Err(wrong_shard(format!("this shard holds {} but this rank needs {}", shape_str(&t.shape), shape_str(&want))));
            }
            if repacked && want.contains(&0) {
                // This rank's share of the matrix is empty (a width split with fewer
                // quant groups than ranks): nothing stored, nothing to compute.
                return Ok(Linear { name: t.name.clone(), format: WeightFormat::F32, rows, cols: want[k - 1], storage: Storage::Owned(Arc::new(Vec::new().into()), 0..0), bias: None });
            }
            let mut l = self.matrix(hf, (k == 3).then_some(want[0]), want[k - 2], want[k - 1]).map_err(|e| wrong_shard(e.to_string()))?;
            l.rows = rows;
            let mut read = t.range.len();
            for suffix in ["scales", "biases", "weight_scale_inv"].iter().filter(|_| repacked) {
                read += self.find(&format!("{base}.{suffix}")).map_or(0, |s| s.range.len());
            }
            self.bytes_read.set(self.bytes_read.get() + read);
            return Ok(l);
        }
        // MLX and FP8 tensors: read the bytes covering this part, repack them, and
        // select from that cover (rows, cols and elements relative to it).
        let cover = if repacked { Some(self.repacked_cover(hf, t, stack, rows, cols, sel)?) } else { None };
        let (rows, cols, sel, elems) = match &cover {
            Some((sub, rel)) => {
                let elems = rel.stack.clone().unwrap_or(0..1);
                (sub.rows / elems.len(), sub.cols, rel, elems)
            }
            None => (rows, cols, sel, elems),
        };
        let (format, src): (WeightFormat, Option<Linear>) = if let Some((sub, _)) = cover.as_ref() {
            (sub.format, Some(sub.clone()))
        } else {
            let lead: Vec<usize> = stack.into_iter().collect();
            let want = [lead.as_slice(), &[rows, cols]].concat();
            if t.shape != want {
                return Err(LoadError::tensor(file, &t.name, format!("shape {} does not match the config's {}", shape_str(&t.shape), shape_str(&want))));
            }
            (self.format_of(t)?, None)
        };
        let (be, bb) = (format.block_elems(), format.block_bytes());
        if sel.cols.start % be != 0 || (sel.cols.end % be != 0 && sel.cols.end != cols) {
            return Err(LoadError::tensor(
                file,
                &t.name,
                format!(
                    "this placement splits its {cols} columns at {}..{}, inside {format} blocks of {be}: choose a placement whose splits fall on multiples of {be}",
                    sel.cols.start, sel.cols.end
                ),
            ));
        }
        let rb = format.row_bytes(cols).map_err(|e| LoadError::tensor(file, &t.name, e.to_string()))?;
        let (cb0, cb1) = (sel.cols.start / be * bb, sel.cols.end.div_ceil(be) * bb);
        let piece = cb1 - cb0;
        if self.dry {
            if src.is_none() {
                self.bytes_read.set(self.bytes_read.get() + elems.len() * sel.rows.len() * piece);
            }
            return Ok(Linear::dry(t.name.clone(), format, elems.len() * sel.rows.len(), sel.cols.len()));
        }
        let mut data = vec![0u8; elems.len() * sel.rows.len() * piece];
        let mut at = 0;
        let src_bytes: Option<&[u8]> = src.as_ref().map(|full| full.weights(self.c).data);
        for e in elems.clone() {
            let elem_off = e * rows * rb;
            if piece == rb {
                let len = sel.rows.len() * rb;
                let off = elem_off + sel.rows.start * rb;
                match src_bytes {
                    Some(b) => data[at..at + len].copy_from_slice(&b[off..off + len]),
                    None => self.c.read_at(t.file, t.range.start + off, &mut data[at..at + len])?,
                }
                at += len;
                continue;
            }
            for r in sel.rows.clone() {
                let off = elem_off + r * rb + cb0;
                match src_bytes {
                    Some(b) => data[at..at + piece].copy_from_slice(&b[off..off + piece]),
                    None => self.c.read_at(t.file, t.range.start + off, &mut data[at..at + piece])?,
                }
                at += piece;
            }
        }
        if src.is_none() {
            self.bytes_read.set(self.bytes_read.get() + data.len());
        }
        // (Repacked tensors were recorded above, as stored.)
        if let (Some(rec), false) = (&self.record, repacked) {
            rec.borrow_mut().push(RecordedTensor { name: t.name.clone(), dtype: t.dtype, shape: sliced, bytes: data.clone() });
        }
        let len = data.len();
        Ok(Linear {
            name: t.name.clone(),
            format,
            rows: elems.len() * sel.rows.len(),
            cols: sel.cols.len(),
            storage: Storage::Owned(Arc::new(data.into()), 0..len),
            bias: None,
        })
    }

    /// Records the stored tensors behind an MLX-quantized or FP8 matrix, sliced to `sel`,
    /// for `tessera shard`: packed weight, scales and biases (MLX, whole groups), or E4M3
    /// bytes and the 128×128 scale grid (FP8, whole scale blocks).
    fn record_repacked(&self, hf: &str, t: &TensorInfo, stack: Option<usize>, rows: usize, cols: usize, sel: &Sel) -> Result<()> {
        use crate::checkpoint::TensorDtype;
        let file = self.c.file_of(t);
        let base = hf.strip_suffix(".weight").unwrap_or(hf);
        let n = stack.unwrap_or(1);
        let elems = sel.stack.clone().unwrap_or(0..1);
        let rec = self.record.as_ref().expect("recording");
        // Rows `row_sel` of each selected element, bytes `bytes` of each row (a shard
        // is written offline: these reads are not counted as the rank's).
        let slice = |src: &TensorInfo, rows_of: usize, row_sel: Range<usize>, bytes: Range<usize>| self.gather_rows(src, n, rows_of, elems.clone(), row_sel, bytes);
        let lead: Vec<usize> = if sel.stack.is_some() { vec![elems.len()] } else { vec![] };
        let shape = |r: usize, c: usize| [lead.as_slice(), &[r, c]].concat();
        let push = |name: &str, dtype: TensorDtype, shape: Vec<usize>, bytes: Vec<u8>| {
            rec.borrow_mut().push(RecordedTensor { name: name.to_string(), dtype, shape, bytes });
        };
        if t.dtype == TensorDtype::F8E4M3 {
            const BLOCK: usize = 128;
            let s = self.require(&format!("{base}.weight_scale_inv"))?;
            let inside = |r: &Range<usize>, total: usize| !r.start.is_multiple_of(BLOCK) || (!r.end.is_multiple_of(BLOCK) && r.end != total);
            if stack.is_some() || inside(&sel.rows, rows) || inside(&sel.cols, cols) {
                return Err(LoadError::tensor(
                    file,
                    &t.name,
                    format!(
                        "this placement cuts rows {:?} / columns {:?} inside its 128×128 FP8 scale blocks: a shard cannot hold part of a block (choose a placement whose splits fall on multiples of 128)",
                        sel.rows, sel.cols
                    ),
                ));
            }
            push(&t.name, TensorDtype::F8E4M3, shape(sel.rows.len(), sel.cols.len()), slice(t, rows, sel.rows.clone(), sel.cols.clone())?);
            let (gr, gc) = (sel.rows.start / BLOCK..sel.rows.end.div_ceil(BLOCK), sel.cols.start / BLOCK..sel.cols.end.div_ceil(BLOCK));
            push(&s.name, s.dtype, vec![gr.len(), gc.len()], slice(s, rows.div_ceil(BLOCK), gr, gc.start * 4..gc.end * 4)?);
            return Ok(());
        }
        let scales = self.require(&format!("{base}.scales"))?;
        let groups = *scales.shape.last().unwrap_or(&1);
        let group = cols / groups.max(1);
        let packed_cols = *t.shape.last().unwrap_or(&0);
        let words_per_group = packed_cols / groups.max(1);
        let (g0, g1) = (sel.cols.start / group, sel.cols.end.div_ceil(group));
        push(&t.name, t.dtype, shape(sel.rows.len(), (g1 - g0) * words_per_group), slice(t, rows, sel.rows.clone(), g0 * words_per_group * 4..g1 * words_per_group * 4)?);
        for aux in std::iter::once(scales).chain(self.find(&format!("{base}.biases"))) {
            let es = aux.range.len() / aux.elements().max(1);
            push(&aux.name, aux.dtype, shape(sel.rows.len(), g1 - g0), slice(aux, rows, sel.rows.clone(), g0 * es..g1 * es)?);
        }
        Ok(())
    }

    /// The name HF tensor `hf` has in this checkpoint (its container's names, the
    /// config's prefix: Kimi-K3's `language_model.`).
    pub(crate) fn stored(&self, hf: &str) -> String {
        stored_name(self.c.kind, &format!("{}{hf}", self.prefix))
    }

    pub(crate) fn find(&self, hf: &str) -> Option<&'a TensorInfo> {
        self.c.get(&self.stored(hf))
    }

    pub(crate) fn require(&self, hf: &str) -> Result<&'a TensorInfo> {
        self.find(hf).ok_or_else(|| {
            let tensor = self.stored(hf);
            // A near miss is usually a renamed or damaged entry: say where it is.
            let near = match self.c.closest_name(&tensor, 3) {
                Some(t) => format!("; {} holds `{}`, a near match: a renamed or corrupted entry?", self.c.file_of(t).display(), t.name),
                None => String::new(),
            };
            LoadError::MissingTensor { path: self.c.path.clone(), tensor, hint: format!(" (required by the {} config{near})", self.arch) }
        })
    }

    fn format_of(&self, t: &TensorInfo) -> Result<WeightFormat> {
        t.dtype.weight_format().ok_or_else(|| {
            LoadError::tensor(self.c.file_of(t), &t.name, format!("dtype {:?} cannot be used as a weight matrix", t.dtype))
        })
    }

    pub(crate) fn linear(&self, hf: &str, rows: usize, cols: usize, bias: bool) -> Result<Linear> {
        let mut l = self.part(hf, None, rows, cols, &Sel::all(rows, cols))?;
        if bias {
            let name = hf.strip_suffix(".weight").unwrap_or(hf).to_string() + ".bias";
            l.bias = Some(self.vector(&name, rows)?);
        }
        Ok(l)
    }

    /// `n` matrices `[rows, cols]` stacked in one tensor `[n, rows, cols]`, as views.
    pub(crate) fn stacked(&self, hf: &str, n: usize, rows: usize, cols: usize) -> Result<Vec<Linear>> {
        let all = self.matrix(hf, Some(n), rows, cols)?;
        Ok((0..n).map(|e| all.sub_rows(e * rows..(e + 1) * rows, format!("{}[{e}]", all.name))).collect())
    }

    /// A matrix `[rows, cols]`, or with `stack = Some(n)` a stack `[n, rows, cols]`
    /// returned as one `[n·rows, cols]` matrix. Plain and GGUF block formats stay in the
    /// memory map; MLX-quantized modules (`<name>.scales` present) are repacked.
    pub(crate) fn matrix(&self, hf: &str, stack: Option<usize>, rows: usize, cols: usize) -> Result<Linear> {
        let t = self.require(hf)?;
        let file = self.c.file_of(t);
        let lead: Vec<usize> = stack.into_iter().collect();
        let want = [lead.as_slice(), &[rows, cols]].concat();
        let n = stack.unwrap_or(1);
        let base = hf.strip_suffix(".weight").unwrap_or(hf);
        if let Some(scales) = self.find(&format!("{base}.scales")) {
            return self.mlx_quantized(t, scales, self.find(&format!("{base}.biases")), &lead, rows, cols);
        }
        if t.shape != want {
            return Err(LoadError::tensor(
                file,
                &t.name,
                format!("shape {} does not match the config's {}", shape_str(&t.shape), shape_str(&want)),
            ));
        }
        if t.dtype == crate::checkpoint::TensorDtype::F8E4M3 {
            if self.dry {
                self.fp8_scales(t, &format!("{base}.weight_scale_inv"), n * rows, cols)?;
                return Ok(Linear::dry(t.name.clone(), WeightFormat::Fp8, n * rows, cols));
            }
            return self.fp8(t, &format!("{base}.weight_scale_inv"), n * rows, cols);
        }
        let format = self.format_of(t)?;
        format.row_bytes(cols).map_err(|e| LoadError::tensor(file, &t.name, e.to_string()))?;
        Ok(Linear {
            name: t.name.clone(),
            format,
            rows: n * rows,
            cols,
            storage: Storage::Mapped { file: t.file, range: t.range.clone() },
            bias: None,
        })
    }

    /// A DeepSeek/Kimi FP8 matrix: E4M3 weights with 128×128 block scales
    /// (`weight_scale_inv`, spec §2.5), repacked for the kernels; never dequantized.
    fn fp8(&self, w: &TensorInfo, scale_name: &str, rows: usize, cols: usize) -> Result<Linear> {
        let s = self.fp8_scales(w, scale_name, rows, cols)?;
        let mut scales = vec![0.0; s.elements()];
        scalar::dequantize_row(WeightFormat::F32, self.c.bytes(s), &mut scales);
        Ok(fp8_linear(&w.name, rows, cols, self.c.bytes(w), &scales))
    }

    /// The block-scale tensor of FP8 weight `w`, checked against its shape.
    fn fp8_scales(&self, w: &TensorInfo, scale_name: &str, rows: usize, cols: usize) -> Result<&'a TensorInfo> {
        let err = |t: &TensorInfo, reason: String| LoadError::tensor(self.c.file_of(t), &t.name, reason);
        let s = self.find(scale_name).ok_or_else(|| err(w, format!("FP8 weights need their block scales `{scale_name}`, which are missing")))?;
        let grid = [rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)];
        if s.shape != grid || s.dtype != crate::checkpoint::TensorDtype::F32 {
            return Err(err(s, format!("expected F32 {grid:?} block scales for a [{rows}, {cols}] FP8 weight, found {:?} {}", s.dtype, shape_str(&s.shape))));
        }
        if !cols.is_multiple_of(32) {
            return Err(err(w, format!("FP8 rows of {cols} columns are not a multiple of 32")));
        }
        Ok(s)
    }

    /// An MLX-quantized module (spec §3–4.1): U32-packed `weight`, `scales` and (affine)
    /// `biases`; bits and group size inferred from the shapes, as mlx does.
    fn mlx_quantized(&self, w: &TensorInfo, scales: &TensorInfo, biases: Option<&TensorInfo>, lead: &[usize], rows: usize, cols: usize) -> Result<Linear> {
        let layout = self.mlx_layout(w, scales, biases, lead, rows, cols)?;
        let n: usize = lead.iter().product();
        if self.dry {
            return Ok(Linear::dry(w.name.clone(), layout.format, n * rows, cols));
        }
        self.mlx_repack(w, layout, n * rows, cols, self.c.bytes(w), scales, self.c.bytes(scales), biases.map(|b| self.c.bytes(b)))
    }

    /// Checks an MLX-quantized module's tensors against `[lead.., rows, cols]` and infers
    /// its format (bits, group size) from their shapes.
    fn mlx_layout(&self, w: &TensorInfo, scales: &TensorInfo, biases: Option<&TensorInfo>, lead: &[usize], rows: usize, cols: usize) -> Result<MlxLayout> {
        let err = |t: &TensorInfo, reason: String| LoadError::tensor(self.c.file_of(t), &t.name, reason);
        if w.dtype != crate::checkpoint::TensorDtype::U32 || w.shape.len() != lead.len() + 2 || w.shape[..lead.len() + 1] != [lead, &[rows]].concat()[..] {
            return Err(err(w, format!("quantized weight must be U32 {:?} + [packed]; found {:?} {}", [lead, &[rows]].concat(), w.dtype, shape_str(&w.shape))));
        }
        let packed_cols = w.shape[lead.len() + 1];
        let groups = *scales.shape.last().unwrap_or(&0);
        if scales.shape.len() != w.shape.len() || scales.shape[..lead.len() + 1] != w.shape[..lead.len() + 1] || groups == 0 || !cols.is_multiple_of(groups) {
            return Err(err(scales, format!("scales shape {} does not fit a [{rows}, {cols}] weight", shape_str(&scales.shape))));
        }
        if let Some(b) = biases {
            if b.shape != scales.shape {
                return Err(err(b, format!("biases shape {} differs from scales {}", shape_str(&b.shape), shape_str(&scales.shape))));
            }
        }
        let group = cols / groups;
        let bits = packed_cols * 32 / cols;
        if packed_cols * 32 != bits * cols {
            return Err(err(w, format!("{packed_cols} packed words do not hold {cols} columns at a whole number of bits")));
        }
        let format = if scales.dtype == crate::checkpoint::TensorDtype::U8 {
            // Microscaling, no biases: mxfp4 and mxfp8 (E8M0 exponents per 32; mxfp8
            // runs as FP8 blocks), nvfp4 (E4M3 scales per 16).
            match (bits, group, biases.is_some()) {
                (4, 32, false) => WeightFormat::Mxfp4,
                (8, 32, false) => WeightFormat::Fp8,
                (4, 16, false) if cols.is_multiple_of(32) => WeightFormat::Nvfp4,
                _ => {
                    let what = if biases.is_some() { "with biases" } else { "without biases" };
                    return Err(err(scales, format!("U8 scales mean a microscaling mode; mxfp4, mxfp8 (4 or 8 bits, group 32) and nvfp4 (4 bits, group 16, rows a multiple of 32 wide), all without biases, are supported; found {bits} bits, group {group}, {what}, {cols} columns")));
                }
            }
        } else {
            let g = match group {
                32 | 64 | 128 => group as u16,
                _ => return Err(err(scales, format!("group size {group} is not supported (32, 64, 128)"))),
            };
            match bits {
                4 => WeightFormat::A4 { group: g },
                8 => WeightFormat::A8 { group: g },
                b => return Err(err(w, format!("{b}-bit MLX affine quantization is not supported yet (4 and 8 are)"))),
            }
        };
        let elem_bytes = |t: &TensorInfo| t.range.len() / t.elements().max(1);
        Ok(MlxLayout { format, group, words_per_group: packed_cols / groups, scale_bytes: elem_bytes(scales) })
    }

    /// Repacks `rows` × `cols` of an MLX module from its stored bytes (whole, or a slice
    /// of whole groups) for the kernels.
    #[allow(clippy::too_many_arguments)]
    fn mlx_repack(&self, w: &TensorInfo, layout: MlxLayout, rows: usize, cols: usize, packed: &[u8], scales: &TensorInfo, scale_bytes: &[u8], bias_bytes: Option<&[u8]>) -> Result<Linear> {
        let err = |t: &TensorInfo, reason: String| LoadError::tensor(self.c.file_of(t), &t.name, reason);
        let floats = |bytes: &[u8]| -> Result<Vec<f32>> {
            let f = scales.dtype.weight_format().filter(|f| !f.is_quantized()).ok_or_else(|| err(scales, format!("dtype {:?} is not a float type", scales.dtype)))?;
            let mut out = vec![0.0; bytes.len() / layout.scale_bytes];
            scalar::dequantize_row(f, bytes, &mut out);
            Ok(out)
        };
        // Microscaling scales are raw bytes (E8M0, E4M3); affine ones are floats.
        let data = if scales.dtype == crate::checkpoint::TensorDtype::U8 {
            tessera_kernels::repack_mlx(layout.format, rows, cols, packed, &[], &[], scale_bytes)
        } else {
            let b = bias_bytes.ok_or_else(|| err(w, "affine quantization needs a `.biases` tensor beside `.scales`".into()))?;
            tessera_kernels::repack_mlx(layout.format, rows, cols, packed, &floats(scale_bytes)?, &floats(b)?, &[])
        };
        let len = data.len();
        Ok(Linear { name: w.name.clone(), format: layout.format, rows, cols, storage: Storage::Owned(Arc::new(data.into()), 0..len), bias: None })
    }

    /// Rows `row_sel` of elements `elems` of a row-major `[n, rows_of, row bytes]`
    /// tensor, bytes `bytes` of each row: positioned reads of exactly those bytes, counted.
    #[allow(clippy::too_many_arguments)]
    fn read_rows(&self, t: &TensorInfo, n: usize, rows_of: usize, elems: Range<usize>, row_sel: Range<usize>, bytes: Range<usize>) -> Result<Vec<u8>> {
        if self.dry {
            self.bytes_read.set(self.bytes_read.get() + elems.len() * row_sel.len() * bytes.len());
            return Ok(Vec::new());
        }
        let out = self.gather_rows(t, n, rows_of, elems, row_sel, bytes)?;
        self.bytes_read.set(self.bytes_read.get() + out.len());
        Ok(out)
    }

    /// [`Self::read_rows`] without counting the bytes.
    #[allow(clippy::too_many_arguments)]
    fn gather_rows(&self, t: &TensorInfo, n: usize, rows_of: usize, elems: Range<usize>, row_sel: Range<usize>, bytes: Range<usize>) -> Result<Vec<u8>> {
        let rb = t.range.len() / (n * rows_of).max(1);
        let piece = bytes.len();
        let mut out = vec![0u8; elems.len() * row_sel.len() * piece];
        let mut at = 0;
        for e in elems {
            let first = t.range.start + (e * rows_of + row_sel.start) * rb;
            if piece == rb {
                let len = row_sel.len() * rb;
                self.c.read_at(t.file, first, &mut out[at..at + len])?;
                at += len;
                continue;
            }
            for r in 0..row_sel.len() {
                self.c.read_at(t.file, first + r * rb + bytes.start, &mut out[at..at + piece])?;
                at += piece;
            }
        }
        Ok(out)
    }

    /// This rank's part of an MLX or FP8 matrix, read with positioned reads of only the
    /// bytes that cover it (MLX: its rows, whole groups of columns; FP8: the 128×128
    /// scale blocks it touches) and repacked. Returns the repacked cover and `sel`
    /// relative to it.
    fn repacked_cover(&self, hf: &str, t: &TensorInfo, stack: Option<usize>, rows: usize, cols: usize, sel: &Sel) -> Result<(Linear, Sel)> {
        let base = hf.strip_suffix(".weight").unwrap_or(hf);
        let n = stack.unwrap_or(1);
        let elems = sel.stack.clone().unwrap_or(0..1);
        let lead: Vec<usize> = stack.into_iter().collect();
        let (row_cover, col_cover, sub) = if t.dtype == crate::checkpoint::TensorDtype::F8E4M3 {
            let s = self.fp8_scales(t, &format!("{base}.weight_scale_inv"), n * rows, cols)?;
            if stack.is_some() {
                return Err(LoadError::tensor(self.c.file_of(t), &t.name, "stacked FP8 experts are not supported"));
            }
            let cover = |r: &Range<usize>, total: usize| r.start / FP8_BLOCK * FP8_BLOCK..(r.end.div_ceil(FP8_BLOCK) * FP8_BLOCK).min(total);
            let (rc, cc) = (cover(&sel.rows, rows), cover(&sel.cols, cols));
            let w = self.read_rows(t, 1, rows, 0..1, rc.clone(), cc.clone())?;
            let (gr, gc) = (rc.start / FP8_BLOCK..rc.end.div_ceil(FP8_BLOCK), cc.start / FP8_BLOCK..cc.end.div_ceil(FP8_BLOCK));
            let sb = self.read_rows(s, 1, rows.div_ceil(FP8_BLOCK), 0..1, gr, gc.start * 4..gc.end * 4)?;
            let mut scales = vec![0.0; sb.len() / 4];
            scalar::dequantize_row(WeightFormat::F32, &sb, &mut scales);
            let l = if self.dry { Linear::dry(t.name.clone(), WeightFormat::Fp8, rc.len(), cc.len()) } else { fp8_linear(&t.name, rc.len(), cc.len(), &w, &scales) };
            (rc, cc, l)
        } else {
            let scales = self.require(&format!("{base}.scales"))?;
            let biases = self.find(&format!("{base}.biases"));
            let layout = self.mlx_layout(t, scales, biases, &lead, rows, cols)?;
            // Whole repacked blocks (nvfp4's are two of its groups of 16).
            let unit = layout.format.block_elems();
            assert!(unit.is_multiple_of(layout.group), "{}: blocks of {unit} are not whole groups of {}", layout.format, layout.group);
            let cc = sel.cols.start / unit * unit..(sel.cols.end.div_ceil(unit) * unit).min(cols);
            let (g0, g1) = (cc.start / layout.group, cc.end / layout.group);
            let words = g0 * layout.words_per_group * 4..g1 * layout.words_per_group * 4;
            let packed = self.read_rows(t, n, rows, elems.clone(), sel.rows.clone(), words)?;
            let aux = g0 * layout.scale_bytes..g1 * layout.scale_bytes;
            let sb = self.read_rows(scales, n, rows, elems.clone(), sel.rows.clone(), aux.clone())?;
            let bb = biases.map(|b| self.read_rows(b, n, rows, elems.clone(), sel.rows.clone(), aux.clone())).transpose()?;
            let rows = elems.len() * sel.rows.len();
            let l = if self.dry { Linear::dry(t.name.clone(), layout.format, rows, cc.len()) } else { self.mlx_repack(t, layout, rows, cc.len(), &packed, scales, &sb, bb.as_deref())? };
            (sel.rows.clone(), cc, l)
        };
        let shift = |r: &Range<usize>, by: usize| r.start - by..r.end - by;
        let rel = Sel {
            stack: sel.stack.as_ref().map(|_| 0..elems.len()),
            rows: shift(&sel.rows, row_cover.start),
            cols: shift(&sel.cols, col_cover.start),
        };
        Ok((sub, rel))
    }

    pub(crate) fn vector(&self, hf: &str, n: usize) -> Result<Vec<f32>> {
        let t = self.require(hf)?;
        self.bytes_read.set(self.bytes_read.get() + t.range.len());
        if let Some(rec) = &self.record {
            let mut rec = rec.borrow_mut();
            if !rec.iter().any(|r| r.name == t.name) {
                rec.push(RecordedTensor { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone(), bytes: self.c.bytes(t).to_vec() });
            }
        }
        self.floats_held.set(self.floats_held.get() + 4 * n);
        vector(self.c, t, n, self.dry)
    }

    /// A small float tensor read whole whatever its rank, when its shape is one of
    /// `shapes` (the layouts checkpoints store it in: KDA's conv taps are HF `[P, 1, K]`
    /// and MLX `[P, K, 1]`, the same values in the same order).
    pub(crate) fn floats(&self, hf: &str, shapes: &[&[usize]]) -> Result<Vec<f32>> {
        let t = self.require(hf)?;
        if !shapes.contains(&t.shape.as_slice()) {
            let want: Vec<String> = shapes.iter().map(|s| shape_str(s)).collect();
            return Err(LoadError::tensor(self.c.file_of(t), &t.name, format!("shape {} is none of the config's {}", shape_str(&t.shape), want.join(" or "))));
        }
        self.bytes_read.set(self.bytes_read.get() + t.range.len());
        if let Some(rec) = &self.record {
            let mut rec = rec.borrow_mut();
            if !rec.iter().any(|r| r.name == t.name) {
                rec.push(RecordedTensor { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone(), bytes: self.c.bytes(t).to_vec() });
            }
        }
        self.floats_held.set(self.floats_held.get() + 4 * t.elements());
        floats(self.c, t, self.dry)
    }

    /// [`Self::floats`], also taking a 1-D tensor of at least `n` elements and keeping
    /// its first `n` (as mlx keeps K3's `A_log`).
    pub(crate) fn floats_min(&self, hf: &str, shapes: &[&[usize]], n: usize) -> Result<Vec<f32>> {
        match self.find(hf) {
            Some(t) if t.shape.len() == 1 && t.shape[0] >= n => Ok(self.floats(hf, &[&[t.shape[0]]])?[..n].to_vec()),
            _ => self.floats(hf, &[shapes, &[&[n]]].concat()),
        }
    }

    /// A whole matrix dequantized to f32 (small matrices only: MLA's kv_b).
    pub(crate) fn dense_f32(&self, hf: &str, rows: usize, cols: usize) -> Result<Vec<f32>> {
        let l = self.linear(hf, rows, cols, false)?;
        let w = l.weights(self.c);
        let mut out = vec![0.0; rows * cols];
        for r in 0..rows {
            scalar::dequantize_row(w.format, w.row(r), &mut out[r * cols..(r + 1) * cols]);
        }
        Ok(out)
    }
}

/// A small tensor (norm weight, bias) of `n` elements, read into f32.
/// With `dry`, zeros of its size (checked as a float vector, nothing read).
pub(crate) fn vector(c: &Checkpoint, t: &TensorInfo, n: usize, dry: bool) -> Result<Vec<f32>> {
    let file = c.file_of(t);
    if t.elements() != n || t.shape.len() != 1 {
        return Err(LoadError::tensor(file, &t.name, format!("shape {} does not match the config's [{n}]", shape_str(&t.shape))));
    }
    floats(c, t, dry)
}

/// Every element of a float tensor, checked finite (with `dry`: zeros, nothing read).
fn floats(c: &Checkpoint, t: &TensorInfo, dry: bool) -> Result<Vec<f32>> {
    let file = c.file_of(t);
    let format = t
        .dtype
        .weight_format()
        .filter(|f| !f.is_quantized())
        .ok_or_else(|| LoadError::tensor(file, &t.name, format!("dtype {:?} is not a float vector type", t.dtype)))?;
    let mut out = vec![0.0; t.elements()];
    if dry {
        return Ok(out);
    }
    scalar::dequantize_row(format, c.bytes(t), &mut out);
    if let Some(i) = out.iter().position(|v| !v.is_finite()) {
        return Err(LoadError::tensor(file, &t.name, format!("element {i} is {} (corrupt file?)", out[i])));
    }
    Ok(out)
}
