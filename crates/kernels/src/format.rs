//! Weight storage formats: block geometry and byte layout.
//!
//! Byte layouts follow ggml/GGUF (see `shared/spec/ARCHITECTURES.md` §4.3):
//! - Q4_0: 32 weights in 18 bytes: f16 d, 16 bytes of nibbles; w = d·(q−8)
//! - Q4_1: 32 weights in 20 bytes: f16 d, f16 m, 16 bytes of nibbles; w = d·q + m
//! - Q8_0: 32 weights in 34 bytes: f16 d, 32 × i8; w = d·q
//! Nibble order: element j < 16 is the low nibble of byte j, element j+16 the high one.

use std::fmt;

/// How a row of weights is stored. All formats store little-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
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
    pub const ALL: [WeightFormat; 6] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::Bf16,
        WeightFormat::Q8_0,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "F32",
            WeightFormat::F16 => "F16",
            WeightFormat::Bf16 => "BF16",
            WeightFormat::Q8_0 => "Q8_0",
            WeightFormat::Q4_0 => "Q4_0",
            WeightFormat::Q4_1 => "Q4_1",
        }
    }

    /// Elements per block (1 for plain float formats).
    pub fn block_elems(self) -> usize {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => 1,
            WeightFormat::Q8_0 | WeightFormat::Q4_0 | WeightFormat::Q4_1 => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::F16 | WeightFormat::Bf16 => 2,
            WeightFormat::Q8_0 => 34,
            WeightFormat::Q4_0 => 18,
            WeightFormat::Q4_1 => 20,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes of one row of `cols` elements, or an error when `cols` is not a whole
    /// number of blocks.
    pub fn row_bytes(self, cols: usize) -> Result<usize, FormatError> {
        let block = self.block_elems();
        if cols % block != 0 {
            return Err(FormatError::RowNotBlockMultiple { format: self, cols, block });
        }
        Ok(cols / block * self.block_bytes())
    }
}
