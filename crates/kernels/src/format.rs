//! Weight storage formats: block geometry and byte layout.
//!
//! Byte layouts follow ggml/GGUF (see `shared/spec/ARCHITECTURES.md` §4.3):
//! - Q4_0: 32 weights in 18 bytes: f16 d, 16 bytes of nibbles; w = d·(q−8)
//! - Q4_1: 32 weights in 20 bytes: f16 d, f16 m, 16 bytes of nibbles; w = d·q + m
//! - Q8_0: 32 weights in 34 bytes: f16 d, 32 × i8; w = d·q
//!
//! Nibble order: element j < 16 is the low nibble of byte j, element j+16 the high one.
//!
//! - MXFP4: 32 weights in 17 bytes: u8 E8M0 exponent e, 16 bytes of E2M1 nibbles (same
//!   order); w = e2m1(q)·2^(e−127). GGUF type 39; MLX `mxfp4` is repacked into it.
//! - Q5_0: 32 weights in 22 bytes: f16 d, u32 qh, 16 bytes of nibbles; w = d·(q−16),
//!   q = nibble | (bit j of qh) << 4 (nibble order as Q4_0).
//! - Q5_1: 32 weights in 24 bytes: f16 d, f16 m, u32 qh, 16 bytes; w = d·q + m.
//! - Q5_0x8 / Q5_1x8 (repacked at load on x86, groups of 8 rows; same bytes per row): as
//!   Q4_0x8 / Q4_1x8, each block's 128 nibble bytes followed by 32 bytes of fifth bits
//!   matching them position for position (bit 2j: chunk j's low-nibble element, 2j + 1:
//!   its high one), as in Q5_Kx8.
//! - Q4_0x8 / Q4_1x8 (GGUF Q4_0 / Q4_1 repacked at load, groups of 8 rows): per
//!   32-column block, the 8 rows' f16 d (then, Q4_1, their f16 m), then 128 bytes of
//!   nibbles: byte 32·j + 4·r + e holds row r's element 4·j + e (low nibble) and element
//!   4·(j + 4) + e (high nibble), j < 4. One 32-byte load is then four elements of all
//!   eight rows, so an integer dot covers 8 rows per instruction and the 8 results land
//!   in 8 lanes (no horizontal sums, scales applied 8 at a time). Same bytes per row as
//!   the source format.
//! - Q8_0x8 (GGUF Q8_0 repacked the same way): per 32-column block the 8 rows' f16 d,
//!   then 256 bytes: byte 32·j + 4·r + e is row r's element 4·j + e, j < 8.
//! - Q4_Kx8 (GGUF Q4_K repacked at load on x86, groups of 8 rows): per 256-column
//!   super-block (1184 bytes, 148 per row), the 8 rows' f16 d, their f16 dmin, then the
//!   6-bit sub-block scales unpacked to bytes (byte 8·s + r: row r's sub-block s), the
//!   mins likewise, then per 32-column sub-block s 128 bytes of nibbles in Q4_0x8's
//!   order for its 32 columns. w = d·scale_s·q − dmin·min_s, as in Q4_K. Unpacked scales
//!   cost 4 bytes per 256 weights (+2.8 %) and spare the kernel the bit surgery.
//! - Q5_Kx8 (GGUF Q5_K, likewise; 180 bytes per row): Q4_Kx8 with 160 bytes per
//!   sub-block, the 128 of nibbles then 32 bytes of fifth bits matching the nibble bytes
//!   position for position (bit 2j: chunk j's low-nibble element, 2j + 1: its high one).
//! - Q6_Kx8 (GGUF Q6_K repacked at load on x86, groups of 8 rows; 210 bytes per row as
//!   in Q6_K): per 256-column super-block, the 8 rows' f16 d, their i8 scales (byte
//!   16 + 8·g + r: row r's scale of 16-column group g), then per 32-column sub-block s
//!   192 bytes: the low 4 bits of the 6-bit quants in Q4_0x8's nibble order, then two
//!   32-byte vectors of their high 2 bits, matching the nibble bytes position for
//!   position: vector j / 2, bits 4·(j % 2) .. +1 for chunk j's low-nibble element, the
//!   next two bits for its high-nibble element. w = d·scale_g·(q − 32), as in Q6_K.
//! - IQ4_NLx8 (GGUF IQ4_NL repacked at load on x86, groups of 8 rows; 18 bytes per row
//!   as in IQ4_NL): Q4_0x8's layout (IQ4_NL's blocks are Q4_0's), the nibbles indexing
//!   the 16 levels; w = d·level.
//! - IQ4_XSx8 (GGUF IQ4_XS likewise; 138 bytes per row): per 256-column super-block the 8
//!   rows' f16 d, their 6-bit sub-block scales less 32 as i8 (byte 16 + 8·s + r: row r's
//!   sub-block s), then per 32-column sub-block 128 bytes of indices in Q4_0x8's order.
//!   w = d·scale_s·level; the unpacked scales cost 2 bytes per 256 weights.
//! - Q2_Kx8 (GGUF Q2_K repacked at load on x86, groups of 8 rows; 84 bytes per row as in
//!   Q2_K): per 256-column super-block the 8 rows' f16 d, their f16 dmin, their scale |
//!   min << 4 bytes (byte 32 + 8·g + r: row r's 16-column group g), then per 32-column
//!   sub-block 64 bytes of 2-bit values in Q6_Kx8's high-bit order: vector j / 2, bits
//!   4·(j % 2) .. +1 for chunk j's low-nibble element (Q4_0x8 positions), the next two
//!   for its high-nibble element. w = d·scale_g·q − dmin·min_g.
//! - Q3_Kx8 (GGUF Q3_K likewise; 114 bytes per row): the 8 rows' f16 d, their 6-bit group
//!   scales less 32 as i8 (byte 16 + 8·g + r, as Q6_Kx8), then per sub-block 96 bytes:
//!   Q2_Kx8's 64 of low bits and 32 of third bits in Q5_0x8's order (bit 2j: chunk j's
//!   low-nibble element, 2j + 1: its high one). w = d·scale_g·(q − 4).
//! - F16x4 / BF16x4 / F32x4 (F16 / BF16 / F32 repacked at load on x86, groups of 4
//!   rows): per 16-column piece, the 4 rows' 16 values one row after another (128
//!   bytes; 256 for F32x4). A group is one stream of memory instead of four rows read
//!   one after another; same bytes per row as the source.
//! - A4 / A8 (MLX affine, repacked at load): per group of g weights an f32 scale s, an
//!   f32 bias b, then the quantized values (4-bit: per 32 values 16 bytes in the Q4_0
//!   nibble order; 8-bit: one byte each); w = s·q + b.

use std::fmt;

/// How activations become 8-bit blocks for the integer kernels. Either way the kernels
/// see blocks of 32 ([`crate::q8::BlockQ8`]); the schemes differ in how the scales are
/// chosen and rounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationBlocks {
    /// llama.cpp's q8_0 / q8_1: per 32 values d = amax / 127, values rounded half away
    /// from zero, d and d·Σq stored as f16 (the legacy formats, IQ4_NL).
    Per32,
    /// llama.cpp's q8_K: per 256 values d = −max / 127 of the signed largest, values
    /// rounded half to even and capped at 127, d kept as f32 (the K-quants, IQ4_XS).
    Per256,
}

impl ActivationBlocks {
    /// Values that share a scale: a row split at multiples of it quantizes apart into
    /// the whole row's blocks.
    pub fn values(self) -> usize {
        match self {
            ActivationBlocks::Per32 => crate::q8::QK,
            ActivationBlocks::Per256 => crate::q8::QK_K,
        }
    }
}

/// Bytes of one group's weights and one token's activations (8-bit blocks of 44
/// bytes per 32 columns, or f32) that a column panel may hold: three quarters of a
/// 32 KiB L1, leaving room for the kernel's other lines ([`WeightFormat::panels`]).
pub const PANEL_BYTES_MAX: usize = 24 << 10;

/// Bytes of one 8-bit activation block ([`crate::q8::BlockQ8`], asserted there).
pub(crate) const Q8_BLOCK_BYTES: usize = 44;

/// How a row of weights is stored. All formats store little-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Mxfp4,
    /// GGUF k-quants: super-blocks of 256 with 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K)
    /// sub-block scales (spec §4.3).
    Q4K,
    Q5K,
    Q6K,
    /// GGUF Q2_K (84 bytes per 256: 16 bytes of 4-bit scale | 4-bit min per 16, 64 bytes
    /// of 2-bit quants, f16 d, f16 dmin; w = d·sc·q − dmin·m) and Q3_K (110 bytes: 32
    /// bytes of high bits, 64 of low 2 bits, 12 of 6-bit scales, f16 d; w = d·(sc − 32)·
    /// (q − 4), q the 3-bit value): the bulk of the 2–3-bit mixes 1T-parameter MoE
    /// checkpoints ship in.
    Q2K,
    Q3K,
    /// GGUF IQ4_NL (per 32: f16 d, 16 bytes of 4-bit indices into a fixed non-linear
    /// table of 16 int8 levels; w = d·level) and IQ4_XS (per 256: f16 d, 6-bit scales per
    /// 32, the same indices; w = d·(sc − 32)·level). llama.cpp's K-quant mixes fall back to
    /// IQ4_NL for matrices whose width is not a multiple of 256.
    Iq4Nl,
    Iq4Xs,
    /// MLX nvfp4: per 32, two E4M3 scales (elements 0..16, then 16..32) and 16 bytes of
    /// E2M1 codes in Q4_0's nibble order (byte j: element j low, j + 16 high);
    /// w = e2m1(q)·scale. MLX writes a U8 E4M3 scale per 16 and no global scale.
    Nvfp4,
    /// FP8 E4M3 with a per-block scale (DeepSeek-V3/Kimi-K2 "fp8" checkpoints, whose
    /// 128×128 `weight_scale_inv` blocks are repacked per 32 columns): f32 scale, then
    /// 32 E4M3 bytes; w = e4m3(q)·scale.
    Fp8,
    /// Q4_0 / Q4_1 interleaved by groups of 8 rows (see the module docs).
    Q4_0x8,
    Q4_1x8,
    Q5_0x8,
    Q5_1x8,
    Q8_0x8,
    /// Q4_K, Q5_K and Q6_K interleaved by groups of 8 rows (module docs).
    Q4Kx8,
    Q5Kx8,
    Q6Kx8,
    /// IQ4_NL and IQ4_XS interleaved by groups of 8 rows (module docs).
    Iq4Nlx8,
    Iq4Xsx8,
    /// Q2_K and Q3_K interleaved by groups of 8 rows (module docs).
    Q2Kx8,
    Q3Kx8,
    /// MLX affine 8-bit as 8 interleaved rows (made at load by `a8_as_rows8`, only in this
    /// layout): per 32 columns the 8 rows' scales d and biases b as f16, then Q8_0x8's 256
    /// code bytes holding q − 128 (i8), so w = d·q' + b + 128·d is the MLX weight s·q + b.
    A8x8,
    /// MXFP4 as integer levels (made at load by `mxfp4_as_levels`, only in this layout):
    /// IQ4_NLx8's bytes, with MXFP4's values doubled (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12:
    /// `scalar::MXFP4_LEVELS`) in place of IQ4_NL's table and d = 2^(e − 128) per 32, so
    /// w = d·level is the MXFP4 weight exactly.
    Mxfp4x8,
    /// NVFP4 as integer levels (made at load by `nvfp4_as_levels`, only in this layout):
    /// NVFP4's own blocks interleaved as Q4_0x8's (each row's two E4M3 scale bytes where
    /// Q4_0's f16 d goes, elements 0..16's first; the codes in Q4_0x8's order, the low
    /// nibbles being elements 0..16), taken with MXFP4's doubled levels and d = scale / 2,
    /// so w = d·level is the NVFP4 weight exactly. 18 bytes per row and 32, as the source.
    Nvfp4x8,
    /// F16 / BF16 / F32 interleaved by groups of 4 rows in 16-column pieces (module docs).
    F16x4,
    Bf16x4,
    F32x4,
    /// MLX affine 4-bit with `group` elements per scale/bias (32, 64 or 128).
    A4 { group: u16 },
    /// MLX affine 8-bit.
    A8 { group: u16 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FormatError {
    /// A row length that is not a whole number of blocks.
    RowNotBlockMultiple { format: WeightFormat, cols: usize, block: usize },
}

impl std::error::Error for FormatError {}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FormatError::RowNotBlockMultiple { format, cols, block } => write!(
                f,
                "{format} rows must be a multiple of {block} elements, got {cols}"
            ),
        }
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl WeightFormat {
    /// One of each kind (affine formats with each supported group), for tests.
    pub const ALL: [WeightFormat; 24] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::Bf16,
        WeightFormat::Q8_0,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Mxfp4,
        WeightFormat::Q4K,
        WeightFormat::Q5K,
        WeightFormat::Q6K,
        WeightFormat::Q2K,
        WeightFormat::Q3K,
        WeightFormat::Iq4Nl,
        WeightFormat::Iq4Xs,
        WeightFormat::Fp8,
        WeightFormat::Nvfp4,
        WeightFormat::A4 { group: 32 },
        WeightFormat::A4 { group: 64 },
        WeightFormat::A4 { group: 128 },
        WeightFormat::A8 { group: 32 },
        WeightFormat::A8 { group: 64 },
        WeightFormat::A8 { group: 128 },
    ];

    /// Largest block in elements (sizes stack buffers of the scalar path).
    pub const BLOCK_ELEMS_MAX: usize = 256;

    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "F32",
            WeightFormat::F16 => "F16",
            WeightFormat::Bf16 => "BF16",
            WeightFormat::Q8_0 => "Q8_0",
            WeightFormat::Q4_0 => "Q4_0",
            WeightFormat::Q4_1 => "Q4_1",
            WeightFormat::Q5_0 => "Q5_0",
            WeightFormat::Q5_1 => "Q5_1",
            WeightFormat::Q5_0x8 => "Q5_0x8",
            WeightFormat::Q5_1x8 => "Q5_1x8",
            WeightFormat::Q4_0x8 => "Q4_0x8",
            WeightFormat::Q4_1x8 => "Q4_1x8",
            WeightFormat::Q8_0x8 => "Q8_0x8",
            WeightFormat::Q4Kx8 => "Q4_Kx8",
            WeightFormat::Q5Kx8 => "Q5_Kx8",
            WeightFormat::Q6Kx8 => "Q6_Kx8",
            WeightFormat::Iq4Nlx8 => "IQ4_NLx8",
            WeightFormat::Mxfp4x8 => "MXFP4x8",
            WeightFormat::Nvfp4x8 => "NVFP4x8",
            WeightFormat::A8x8 => "MLX-A8x8",
            WeightFormat::Iq4Xsx8 => "IQ4_XSx8",
            WeightFormat::Q2Kx8 => "Q2_Kx8",
            WeightFormat::Q3Kx8 => "Q3_Kx8",
            WeightFormat::F16x4 => "F16x4",
            WeightFormat::Bf16x4 => "BF16x4",
            WeightFormat::F32x4 => "F32x4",
            WeightFormat::Mxfp4 => "MXFP4",
            WeightFormat::Q4K => "Q4_K",
            WeightFormat::Q5K => "Q5_K",
            WeightFormat::Q6K => "Q6_K",
            WeightFormat::Q2K => "Q2_K",
            WeightFormat::Q3K => "Q3_K",
            WeightFormat::Iq4Nl => "IQ4_NL",
            WeightFormat::Iq4Xs => "IQ4_XS",
            WeightFormat::Fp8 => "FP8-E4M3",
            WeightFormat::Nvfp4 => "NVFP4",
            WeightFormat::A4 { group: 32 } => "MLX-A4/g32",
            WeightFormat::A4 { group: 64 } => "MLX-A4/g64",
            WeightFormat::A4 { .. } => "MLX-A4/g128",
            WeightFormat::A8 { group: 32 } => "MLX-A8/g32",
            WeightFormat::A8 { group: 64 } => "MLX-A8/g64",
            WeightFormat::A8 { .. } => "MLX-A8/g128",
        }
    }

    /// Whether matmul quantizes activations to int8 for this format (llama.cpp's
    /// scheme for its block formats). Other formats compute with f32 activations, which
    /// is what mlx does for its own quantized formats.
    pub fn int8_activations(self) -> bool {
        matches!(
            self,
            WeightFormat::Q8_0
                | WeightFormat::Q4_0
                | WeightFormat::Q4_1
                | WeightFormat::Q5_0
                | WeightFormat::Q5_1
                | WeightFormat::Q5_0x8
                | WeightFormat::Q5_1x8
                | WeightFormat::Q4_0x8
                | WeightFormat::Q4_1x8
                | WeightFormat::Q8_0x8
                | WeightFormat::Q4Kx8
                | WeightFormat::Q5Kx8
                | WeightFormat::Q6Kx8
                | WeightFormat::Q4K
                | WeightFormat::Q5K
                | WeightFormat::Q6K
                | WeightFormat::Q2K
                | WeightFormat::Q3K
                | WeightFormat::Iq4Nl
                | WeightFormat::Iq4Xs
                | WeightFormat::Iq4Nlx8
                | WeightFormat::Iq4Xsx8
                | WeightFormat::Q2Kx8
                | WeightFormat::Q3Kx8
                | WeightFormat::Mxfp4x8
                | WeightFormat::Nvfp4x8
                | WeightFormat::A8x8
        )
    }

    /// How matmul quantizes the activations this format multiplies (`None`: f32
    /// activations): the scheme llama.cpp picks for the format (its `vec_dot_type`), so
    /// both engines multiply the same integers by the same scales.
    pub fn activation_blocks(self) -> Option<ActivationBlocks> {
        use WeightFormat::*;
        match self {
            Q2K | Q3K | Q4K | Q5K | Q6K | Iq4Xs | Q2Kx8 | Q3Kx8 | Q4Kx8 | Q5Kx8 | Q6Kx8 | Iq4Xsx8 => Some(ActivationBlocks::Per256),
            _ if self.int8_activations() => Some(ActivationBlocks::Per32),
            _ => None,
        }
    }

    /// Rows stored together (8 or 4 for the interleaved formats): matmul computes them
    /// together, and row slices must fall on multiples of it.
    pub fn rows_per_group(self) -> usize {
        match self {
            WeightFormat::Q4_0x8 | WeightFormat::Q4_1x8 | WeightFormat::Q5_0x8 | WeightFormat::Q5_1x8 | WeightFormat::Q8_0x8 => 8,
            WeightFormat::Q4Kx8 | WeightFormat::Q5Kx8 | WeightFormat::Q6Kx8 | WeightFormat::Iq4Nlx8 | WeightFormat::Iq4Xsx8 | WeightFormat::Mxfp4x8 | WeightFormat::Nvfp4x8 | WeightFormat::A8x8 => 8,
            WeightFormat::Q2Kx8 | WeightFormat::Q3Kx8 => 8,
            WeightFormat::F16x4 | WeightFormat::Bf16x4 | WeightFormat::F32x4 => 4,
            _ => 1,
        }
    }

    /// The 8-row layouts whose two consecutive groups the AVX-512 VNNI kernel runs in
    /// one 512-bit pass (`Isa::dot_q8_rows16_x4`); the others take two 256-bit passes.
    pub fn pairs_in_512_bits(self) -> bool {
        matches!(self, WeightFormat::Q4_0x8 | WeightFormat::Q4_1x8 | WeightFormat::Q8_0x8)
    }

    /// Column panels of a row `cols` wide: 1, or P equal panels of a multiple of 256
    /// columns each. A product of a wider row is the sum of its panels' dot products,
    /// added in panel order (each panel's dot in the format's one arithmetic), in every
    /// layout and on every kernel flavour; interleaved layouts store such a matrix
    /// panel by panel (each panel an interleaved matrix of its own). Why: a one-token
    /// pass streams a group's weights (8 interleaved rows; 4 of F16/BF16; one row of a
    /// format without such a layout) through L1 while it rereads the token's
    /// activations for every group; where the two together outgrow L1 (Q4_0 rows of
    /// 6,144 columns and more), the activations were evicted between groups and the
    /// stream slowed (Zen 4, one thread, 3072 × 8192 Q4_0 from 1 GB: 0.73 of the read
    /// rate whole, 0.97 in two panels). The width counts the source format's bytes
    /// (a row and its interleaved twin split alike) and the activations' (8-bit blocks
    /// or f32) against [`PANEL_BYTES_MAX`]; a width of no suitable divisor stays whole.
    pub fn panels(self, cols: usize) -> usize {
        const UNIT: usize = 256;
        let source = self.source();
        let Ok(row_bytes) = source.row_bytes(cols) else { return 1 };
        let activation_bytes = if source.activation_blocks().is_some() { cols / 32 * Q8_BLOCK_BYTES } else { cols * 4 };
        // A work unit's rows: a group of the interleaved layout (one row where none).
        let rows = source.interleaved().unwrap_or(source).rows_per_group();
        let need = rows * row_bytes + activation_bytes;
        let least = need.div_ceil(PANEL_BYTES_MAX);
        if least <= 1 || !cols.is_multiple_of(UNIT) {
            return 1;
        }
        let units = cols / UNIT;
        (least..=units.min(2 * least)).find(|p| units.is_multiple_of(*p)).unwrap_or(1)
    }

    /// The format this one is a layout of (an interleaved layout's row format), whose
    /// bytes decide [`WeightFormat::panels`]; itself for the others.
    pub fn source(self) -> WeightFormat {
        use WeightFormat::*;
        [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4K, Q5K, Q6K, Iq4Nl, Q2K, Q3K, Iq4Xs, F16, Bf16, F32].into_iter().find(|f| f.interleaved() == Some(self)).unwrap_or(self)
    }

    /// The interleaved layout this format is repacked into at load, if it has one.
    pub fn interleaved(self) -> Option<WeightFormat> {
        match self {
            WeightFormat::Q4_0 => Some(WeightFormat::Q4_0x8),
            WeightFormat::Q4_1 => Some(WeightFormat::Q4_1x8),
            WeightFormat::Q5_0 => Some(WeightFormat::Q5_0x8),
            WeightFormat::Q5_1 => Some(WeightFormat::Q5_1x8),
            WeightFormat::Q8_0 => Some(WeightFormat::Q8_0x8),
            WeightFormat::Q4K => Some(WeightFormat::Q4Kx8),
            WeightFormat::Q5K => Some(WeightFormat::Q5Kx8),
            WeightFormat::Q6K => Some(WeightFormat::Q6Kx8),
            WeightFormat::Iq4Nl => Some(WeightFormat::Iq4Nlx8),
            WeightFormat::Q2K => Some(WeightFormat::Q2Kx8),
            WeightFormat::Q3K => Some(WeightFormat::Q3Kx8),
            WeightFormat::Iq4Xs => Some(WeightFormat::Iq4Xsx8),
            WeightFormat::F16 => Some(WeightFormat::F16x4),
            WeightFormat::Bf16 => Some(WeightFormat::Bf16x4),
            WeightFormat::F32 => Some(WeightFormat::F32x4),
            _ => None,
        }
    }

    /// Elements per block (1 for plain float formats).
    pub fn block_elems(self) -> usize {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => 1,
            WeightFormat::Q8_0 | WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q5_0 | WeightFormat::Q5_1 | WeightFormat::Mxfp4 | WeightFormat::Fp8 | WeightFormat::Nvfp4 | WeightFormat::Iq4Nl => 32,
            WeightFormat::Q4_0x8 | WeightFormat::Q4_1x8 | WeightFormat::Q5_0x8 | WeightFormat::Q5_1x8 | WeightFormat::Q8_0x8 | WeightFormat::Iq4Nlx8 | WeightFormat::Mxfp4x8 | WeightFormat::Nvfp4x8 | WeightFormat::A8x8 => 32,
            WeightFormat::F16x4 | WeightFormat::Bf16x4 | WeightFormat::F32x4 => 16,
            WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K | WeightFormat::Q4Kx8 | WeightFormat::Q5Kx8 | WeightFormat::Q6Kx8 => 256,
            WeightFormat::Q2K | WeightFormat::Q3K | WeightFormat::Iq4Xs | WeightFormat::Iq4Xsx8 | WeightFormat::Q2Kx8 | WeightFormat::Q3Kx8 => 256,
            WeightFormat::A4 { group } | WeightFormat::A8 { group } => group as usize,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::F16 | WeightFormat::Bf16 => 2,
            WeightFormat::F16x4 | WeightFormat::Bf16x4 => 32,
            WeightFormat::F32x4 => 64,
            WeightFormat::Q8_0 | WeightFormat::Q8_0x8 => 34,
            WeightFormat::Q4_0 | WeightFormat::Q4_0x8 => 18,
            WeightFormat::Q4_1 | WeightFormat::Q4_1x8 => 20,
            WeightFormat::Q5_0 | WeightFormat::Q5_0x8 => 22,
            WeightFormat::Q5_1 | WeightFormat::Q5_1x8 => 24,
            WeightFormat::Mxfp4 => 17,
            WeightFormat::Nvfp4 => 18,
            WeightFormat::Q4K => 144,
            WeightFormat::Q4Kx8 => 148,
            WeightFormat::Q5Kx8 => 180,
            WeightFormat::Q6Kx8 => 210,
            WeightFormat::Q5K => 176,
            WeightFormat::Q6K => 210,
            WeightFormat::Q2K | WeightFormat::Q2Kx8 => 84,
            WeightFormat::Q3K => 110,
            WeightFormat::Q3Kx8 => 114,
            WeightFormat::Iq4Nl | WeightFormat::Iq4Nlx8 | WeightFormat::Mxfp4x8 | WeightFormat::Nvfp4x8 => 18,
            WeightFormat::A8x8 => 36,
            WeightFormat::Iq4Xs => 136,
            WeightFormat::Iq4Xsx8 => 138,
            WeightFormat::Fp8 => 36,
            WeightFormat::A4 { group } => 8 + group as usize / 2,
            WeightFormat::A8 { group } => 8 + group as usize,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1 && !matches!(self, WeightFormat::F16x4 | WeightFormat::Bf16x4 | WeightFormat::F32x4)
    }

    /// Bytes of one row of `cols` elements, or an error when `cols` is not a whole
    /// number of blocks.
    pub fn row_bytes(self, cols: usize) -> Result<usize, FormatError> {
        let block = self.block_elems();
        if !cols.is_multiple_of(block) {
            return Err(FormatError::RowNotBlockMultiple { format: self, cols, block });
        }
        Ok(cols / block * self.block_bytes())
    }
}
