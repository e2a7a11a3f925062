//! Repacking at load: GGUF blocks into the 8-row (and F16/BF16 into the 4-row)
//! interleaved layouts of `format`'s module docs, MLX and FP8 tensors into kernel
//! formats, and MLX's 4/8-bit and FP8 weights into their integer twins. Every repack is
//! lossless (the same scales and values, moved) except where a name says otherwise.

use crate::format::WeightFormat;

/// Repacks `rows` rows of `format` into its interleaved layout ([`WeightFormat::interleaved`]):
/// groups of 8 rows for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 ([`repack_rows8`]) and the
/// K-quants, of 4 rows in 16-column pieces for F16 / BF16. Lossless: the same values,
/// moved (Q4_K's and Q5_K's 6-bit scales unpacked to bytes).
pub fn repack_interleaved(format: WeightFormat, rows: usize, cols: usize, data: &[u8]) -> Vec<u8> {
    let mut out = vec![0; interleaved_bytes(format, rows, cols)];
    repack_interleaved_into(format, rows, cols, data, &mut out);
    out
}

/// Bytes of `rows × cols` of `format` once repacked into its interleaved layout.
/// Panics (a caller bug) when `format` has no such layout or `cols` is not a whole
/// number of its blocks: loaders check both with [`WeightFormat::interleaved`] and
/// [`WeightFormat::row_bytes`] first.
pub fn interleaved_bytes(format: WeightFormat, rows: usize, cols: usize) -> usize {
    let to = format.interleaved().unwrap_or_else(|| panic!("{format} has no interleaved layout"));
    rows * to.row_bytes(cols).unwrap_or_else(|e| panic!("repack_interleaved: {e}"))
}

/// [`repack_interleaved`] into `out` ([`interleaved_bytes`] long), so a loader can
/// place matrices in memory of its choosing. A matrix of several column panels
/// ([`WeightFormat::panels`]) is stored panel by panel.
pub fn repack_interleaved_into(format: WeightFormat, rows: usize, cols: usize, data: &[u8], out: &mut [u8]) {
    assert_eq!(out.len(), interleaved_bytes(format, rows, cols), "repack_interleaved: {format} {rows}×{cols}: output size");
    let to = format.interleaved().expect("checked by interleaved_bytes");
    if to.panels(cols) > 1 {
        let mut whole = vec![0; out.len()];
        repack_whole_into(format, rows, cols, data, &mut whole);
        into_panels(to, rows, cols, &whole, out);
    } else {
        repack_whole_into(format, rows, cols, data, out);
    }
}

/// `whole`, an interleaved matrix of `format` with each group's bytes in one run,
/// into `out` panel by panel ([`WeightFormat::panels`]): panel p holds every group's
/// bytes for its columns, group after group. Every interleaved layout runs a group's
/// column blocks (or super-blocks, or 16-column pieces) in order, each the same size,
/// so a panel's columns of a group are one run of its bytes.
fn into_panels(format: WeightFormat, rows: usize, cols: usize, whole: &[u8], out: &mut [u8]) {
    let panels = format.panels(cols);
    let group_bytes = format.rows_per_group() * format.row_bytes(cols).expect("whole blocks");
    assert!(group_bytes.is_multiple_of(panels) && whole.len() == out.len() && whole.len() == rows / format.rows_per_group() * group_bytes, "into_panels: {format} {rows}×{cols}");
    let part = group_bytes / panels;
    let mut parts = out.chunks_exact_mut(part);
    for p in 0..panels {
        for group in whole.chunks_exact(group_bytes) {
            parts.next().expect("sized above").copy_from_slice(&group[p * part..(p + 1) * part]);
        }
    }
}

/// [`into_panels`] of a whole interleaved matrix made here; itself when one panel.
fn panelled(format: WeightFormat, rows: usize, cols: usize, whole: Vec<u8>) -> Vec<u8> {
    if format.panels(cols) == 1 {
        return whole;
    }
    let mut out = vec![0; whole.len()];
    into_panels(format, rows, cols, &whole, &mut out);
    out
}

/// [`repack_interleaved_into`] with every group's bytes in one run (one panel).
fn repack_whole_into(format: WeightFormat, rows: usize, cols: usize, data: &[u8], out: &mut [u8]) {
    match format {
        WeightFormat::Q4K => repack_k4_rows8_into::<false>(rows, cols, data, out),
        WeightFormat::Q5K => repack_k4_rows8_into::<true>(rows, cols, data, out),
        WeightFormat::Q6K => repack_k6_rows8_into(rows, cols, data, out),
        WeightFormat::Iq4Xs => repack_iq4xs_rows8_into(rows, cols, data, out),
        WeightFormat::Q2K => repack_k23_rows8_into::<false>(rows, cols, data, out),
        WeightFormat::Q3K => repack_k23_rows8_into::<true>(rows, cols, data, out),
        WeightFormat::F16 | WeightFormat::Bf16 | WeightFormat::F32 => {
            // A row's 16-column piece: 32 bytes (64 for F32).
            let (esize, piece_row) = (format.block_bytes(), 16 * format.block_bytes());
            assert!(rows.is_multiple_of(4) && cols.is_multiple_of(16) && data.len() == rows * cols * esize, "repack_interleaved: {format} {rows}×{cols} in {} bytes", data.len());
            let row_bytes = cols * esize;
            let mut pieces = out.chunks_exact_mut(piece_row);
            for g in 0..rows / 4 {
                for piece in 0..cols / 16 {
                    for r in 0..4 {
                        let at = (4 * g + r) * row_bytes + piece_row * piece;
                        pieces.next().expect("sized above").copy_from_slice(&data[at..at + piece_row]);
                    }
                }
            }
        }
        _ => repack_rows8_into(format, rows, cols, data, out),
    }
}

/// Q4_K (Q5_K when `FIVE`) rows into [`WeightFormat::Q4Kx8`] ([`WeightFormat::Q5Kx8`])
/// (module docs): the same d, dmin, scales, mins, nibbles (and fifth bits), the 6-bit
/// scales and mins unpacked to bytes.
fn repack_k4_rows8_into<const FIVE: bool>(rows: usize, cols: usize, data: &[u8], out: &mut [u8]) {
    let supers = cols / 256;
    let (src_bytes, qs_at, sub_bytes) = if FIVE { (176, 48, 160) } else { (144, 16, 128) };
    assert!(rows.is_multiple_of(8) && cols.is_multiple_of(256) && data.len() == rows * supers * src_bytes, "repack Q4_K/Q5_K: shape");
    let mut chunks = out.chunks_exact_mut(160 + 8 * sub_bytes);
    for g in 0..rows / 8 {
        for sb in 0..supers {
            let o = chunks.next().expect("sized by the caller");
            let src = |r: usize| &data[((g * 8 + r) * supers + sb) * src_bytes..][..src_bytes];
            for r in 0..8 {
                o[2 * r..2 * r + 2].copy_from_slice(&src(r)[0..2]);
                o[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src(r)[2..4]);
                for s in 0..8 {
                    let (scale, min) = crate::scalar::scale_min_k4(&src(r)[4..16], s);
                    o[32 + 8 * s + r] = scale;
                    o[96 + 8 * s + r] = min;
                }
            }
            // Sub-block s element l: nibble s % 2 of byte 32·(s / 2) + l of the row's qs
            // (Q5_K: its fifth bit is bit s of qh[l]). Word j of a row's chunk packs
            // elements 4j.. (low nibbles) and 16 + 4j.. (high): four bytes at once.
            let fifth = |r: usize, s: usize, l: usize| (src(r)[16 + l] >> s) & 1;
            for s in 0..8 {
                let sub = &mut o[160 + sub_bytes * s..160 + sub_bytes * (s + 1)];
                let base = qs_at + 32 * (s / 2);
                for j in 0..4 {
                    for r in 0..8 {
                        let v = nibble_pairs(word(src(r), base + 4 * j), word(src(r), base + 16 + 4 * j), s % 2 == 1);
                        sub[32 * j + 4 * r..32 * j + 4 * r + 4].copy_from_slice(&v.to_le_bytes());
                    }
                }
                if FIVE {
                    for r in 0..8 {
                        for e in 0..4 {
                            sub[128 + 4 * r + e] = (0..4).map(|j| (fifth(r, s, 4 * j + e) | (fifth(r, s, 16 + 4 * j + e) << 1)) << (2 * j)).sum();
                        }
                    }
                }
            }
        }
    }
}

/// Q2_K (Q3_K when `THREE`) rows into [`WeightFormat::Q2Kx8`] ([`WeightFormat::Q3Kx8`])
/// (module docs): the same d (dmin), scales (mins) and values, Q3_K's 6-bit scales
/// unpacked to bytes.
fn repack_k23_rows8_into<const THREE: bool>(rows: usize, cols: usize, data: &[u8], out: &mut [u8]) {
    use crate::scalar::{q2k_at, q3k_at, q3k_scale};
    let supers = cols / 256;
    let (src_bytes, head, sub_bytes) = if THREE { (110, 144, 96) } else { (84, 160, 64) };
    assert!(rows.is_multiple_of(8) && cols.is_multiple_of(256) && data.len() == rows * supers * src_bytes, "repack Q2_K/Q3_K: shape");
    let mut chunks = out.chunks_exact_mut(head + 8 * sub_bytes);
    for g in 0..rows / 8 {
        for sb in 0..supers {
            let o = chunks.next().expect("sized by the caller");
            o.fill(0);
            let src = |r: usize| &data[((g * 8 + r) * supers + sb) * src_bytes..][..src_bytes];
            for r in 0..8 {
                if THREE {
                    o[2 * r..2 * r + 2].copy_from_slice(&src(r)[108..110]);
                    for grp in 0..16 {
                        o[16 + 8 * grp + r] = q3k_scale(src(r), grp) as i8 as u8;
                    }
                } else {
                    o[2 * r..2 * r + 2].copy_from_slice(&src(r)[80..82]);
                    o[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src(r)[82..84]);
                    for grp in 0..16 {
                        o[32 + 8 * grp + r] = src(r)[grp];
                    }
                }
            }
            // Element n's value as stored: Q2_K 0..3; Q3_K 0..7 (the −4 is the kernel's).
            let v = |r: usize, n: usize| if THREE { (q3k_at(src(r), n) + 4) as u8 } else { q2k_at(src(r), n) as u8 };
            for s in 0..8 {
                let sub = &mut o[head + sub_bytes * s..head + sub_bytes * (s + 1)];
                for j in 0..4 {
                    for r in 0..8 {
                        for e in 0..4 {
                            let (a, b) = (v(r, 32 * s + 4 * j + e), v(r, 32 * s + 16 + 4 * j + e));
                            let p = 4 * r + e;
                            sub[32 * (j / 2) + p] |= ((a & 3) | ((b & 3) << 2)) << (4 * (j % 2));
                            if THREE {
                                sub[64 + p] |= ((a >> 2) << (2 * j)) | ((b >> 2) << (2 * j + 1));
                            }
                        }
                    }
                }
            }
        }
    }
}

/// IQ4_XS rows into [`WeightFormat::Iq4Xsx8`] (module docs): the same d, scales and
/// indices, the 6-bit scales unpacked to bytes.
fn repack_iq4xs_rows8_into(rows: usize, cols: usize, data: &[u8], out: &mut [u8]) {
    let supers = cols / 256;
    assert!(rows.is_multiple_of(8) && cols.is_multiple_of(256) && data.len() == rows * supers * 136, "repack IQ4_XS: shape");
    let mut chunks = out.chunks_exact_mut(8 * 138);
    for g in 0..rows / 8 {
        for sb in 0..supers {
            let o = chunks.next().expect("sized by the caller");
            let src = |r: usize| &data[((g * 8 + r) * supers + sb) * 136..][..136];
            for r in 0..8 {
                o[2 * r..2 * r + 2].copy_from_slice(&src(r)[0..2]);
                for s in 0..8 {
                    o[16 + 8 * s + r] = crate::scalar::iq4xs_scale(src(r), s) as i8 as u8;
                }
            }
            // Sub-block s element l: nibble of byte 8 + 16·s + l % 16 (low for l < 16).
            let q = |r: usize, s: usize, l: usize| {
                let byte = src(r)[8 + 16 * s + l % 16];
                if l < 16 { byte & 0x0F } else { byte >> 4 }
            };
            for s in 0..8 {
                let sub = &mut o[80 + 128 * s..80 + 128 * (s + 1)];
                for j in 0..4 {
                    for r in 0..8 {
                        for e in 0..4 {
                            sub[32 * j + 4 * r + e] = q(r, s, 4 * j + e) | (q(r, s, 4 * (j + 4) + e) << 4);
                        }
                    }
                }
            }
        }
    }
}

/// Q6_K rows into [`WeightFormat::Q6Kx8`] (module docs): the same d, scales and 6-bit
/// quants, moved.
fn repack_k6_rows8_into(rows: usize, cols: usize, data: &[u8], out: &mut [u8]) {
    let supers = cols / 256;
    assert!(rows.is_multiple_of(8) && cols.is_multiple_of(256) && data.len() == rows * supers * 210, "repack Q6_K: shape");
    let mut chunks = out.chunks_exact_mut(8 * 210);
    for g in 0..rows / 8 {
        for sb in 0..supers {
            let o = chunks.next().expect("sized by the caller");
            let src = |r: usize| &data[((g * 8 + r) * supers + sb) * 210..][..210];
            for r in 0..8 {
                o[2 * r..2 * r + 2].copy_from_slice(&src(r)[208..210]);
                for grp in 0..16 {
                    o[16 + 8 * grp + r] = src(r)[192 + grp];
                }
            }
            // Sub-block s (elements 32s.., ggml's Q6_K layout): element l's low four bits
            // are nibble s % 4 / 2 of ql[64·(s / 4) + 32·(s % 2) + l], its high two bits
            // 2·(s % 4).. of qh[32·(s / 4) + l]. Word j of a row's chunk packs elements
            // 4j.. and 16 + 4j..: their low bits as nibbles, their high bits beside word
            // j ^ 1's in the 2-bit plane (bits 4·(j % 2)..).
            for s in 0..8 {
                let (h, jj) = (s / 4, s % 4);
                let (ql, qh) = (64 * h + 32 * (jj % 2), 128 + 32 * h);
                let sub = &mut o[144 + 192 * s..144 + 192 * (s + 1)];
                sub[128..].fill(0);
                for j in 0..4 {
                    for r in 0..8 {
                        let b = src(r);
                        let low = nibble_pairs(word(b, ql + 4 * j), word(b, ql + 16 + 4 * j), jj >= 2);
                        let (ha, hb) = ((word(b, qh + 4 * j) >> (2 * jj)) & 0x0303_0303, (word(b, qh + 16 + 4 * j) >> (2 * jj)) & 0x0303_0303);
                        let high = (ha | (hb << 2)) << (4 * (j % 2));
                        sub[32 * j + 4 * r..32 * j + 4 * r + 4].copy_from_slice(&low.to_le_bytes());
                        let at = 128 + 32 * (j / 2) + 4 * r;
                        let was = word(sub, at);
                        sub[at..at + 4].copy_from_slice(&(was | high).to_le_bytes());
                    }
                }
            }
        }
    }
}

/// The little-endian u32 at `bytes[at..at + 4]`.
#[inline]
fn word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("four bytes"))
}

/// Four bytes of two 4-bit elements each, from the bytes holding elements `4j..` (`a`)
/// and `16 + 4j..` (`b`): the low nibbles of both, or (`high`) their high nibbles; `a`'s
/// in each byte's low half.
#[inline]
fn nibble_pairs(a: u32, b: u32, high: bool) -> u32 {
    if high {
        ((a >> 4) & 0x0F0F_0F0F) | (b & 0xF0F0_F0F0)
    } else {
        (a & 0x0F0F_0F0F) | ((b & 0x0F0F_0F0F) << 4)
    }
}

/// Quantizes `x` (whole blocks of 32 values) to Q8_0 (the block maximum at ±127, an f16
/// scale, as llama.cpp's `quantize_row_q8_0`) and stores it as row `r` (< 8) of the
/// `Q8_0x8` group `group`, in [`repack_rows8`]'s layout: a cache of keys is then read
/// as an interleaved matrix by the matmul kernels. A NaN or infinity in a block makes
/// its scale NaN, so it reaches the output as a float cache would pass it on.
pub fn put_q8_0x8_row(group: &mut [u8], r: usize, x: &[f32]) {
    const BLOCK: usize = 8 * 34;
    let blocks = x.len() / 32;
    assert!(r < 8 && x.len().is_multiple_of(32) && group.len() == blocks * BLOCK, "put_q8_0x8_row: row {r} of {} values into a {}-byte group", x.len(), group.len());
    for (b, xs) in x.chunks_exact(32).enumerate() {
        let amax = if xs.iter().all(|v| v.is_finite()) { xs.iter().fold(0.0f32, |m, v| m.max(v.abs())) } else { f32::NAN };
        let d = amax / 127.0;
        let id = if d != 0.0 && d.is_finite() { 1.0 / d } else { 0.0 };
        let at = b * BLOCK;
        group[at + 2 * r..at + 2 * r + 2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for (j, chunk) in xs.chunks_exact(4).enumerate() {
            let q = at + 16 + 32 * j + 4 * r;
            for (k, &v) in chunk.iter().enumerate() {
                group[q + k] = (v * id).round() as i8 as u8;
            }
        }
    }
}

/// Repacks `rows` rows of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (GGUF layout) into groups of 8 interleaved rows
/// ([`WeightFormat::interleaved`]; layout in the module docs). `rows` must be a multiple
/// of 8. Lossless: the same scales and nibbles, moved.
pub fn repack_rows8(format: WeightFormat, rows: usize, cols: usize, data: &[u8]) -> Vec<u8> {
    let mut out = vec![0; data.len()];
    repack_rows8_into(format, rows, cols, data, &mut out);
    panelled(format.interleaved().expect("checked by repack_rows8_into"), rows, cols, out)
}

fn repack_rows8_into(format: WeightFormat, rows: usize, cols: usize, data: &[u8], out: &mut [u8]) {
    let (min, five) = match format {
        // IQ4_NL's blocks are Q4_0's (f16 d, 16 bytes of nibbles): the same moves.
        WeightFormat::Q4_0 | WeightFormat::Q8_0 | WeightFormat::Iq4Nl => (false, false),
        WeightFormat::Q4_1 => (true, false),
        WeightFormat::Q5_0 => (false, true),
        WeightFormat::Q5_1 => (true, true),
        _ => panic!("repack_rows8: {format} has no interleaved layout"),
    };
    let (bb, blocks) = (format.block_bytes(), cols / 32);
    assert!(rows.is_multiple_of(8) && cols.is_multiple_of(32) && data.len() == rows * blocks * bb && out.len() == data.len(), "repack_rows8: shape");
    // Where the quants start (after d, m and, for Q5, the u32 of fifth bits), and their
    // 4-byte words: element i of a 4-bit block is the low nibble of byte i (i < 16),
    // else the high nibble of byte i − 16, so word j of the interleaved chunk (elements
    // 4j.. and 16 + 4j..) is the source's own bytes 4j..4j + 4; Q8_0's are its bytes.
    let q_at = 2 + 2 * usize::from(min) + 4 * usize::from(five);
    let words = (bb - q_at) / 4;
    for (g, group) in out.chunks_exact_mut(8 * bb * blocks).enumerate() {
        let rows_of = &data[g * 8 * blocks * bb..][..8 * blocks * bb];
        for (b, o) in group.chunks_exact_mut(8 * bb).enumerate() {
            let src: [&[u8]; 8] = std::array::from_fn(|r| &rows_of[(r * blocks + b) * bb..][..bb]);
            let mut at = 0;
            let mut put = |bytes: &[u8]| {
                o[at..at + bytes.len()].copy_from_slice(bytes);
                at += bytes.len();
            };
            src.iter().for_each(|s| put(&s[..2]));
            if min {
                src.iter().for_each(|s| put(&s[2..4]));
            }
            for j in 0..words {
                src.iter().for_each(|s| put(&s[q_at + 4 * j..q_at + 4 * j + 4]));
            }
            if five {
                // Q5: each element's fifth bit (bit i of the u32 before the nibbles)
                // beside its nibble's: word j's element e holds bits (4j + e, 16 + 4j + e)
                // at bits 2j, 2j + 1 of byte e.
                for s in &src {
                    let qh = u32::from_le_bytes(s[q_at - 4..q_at].try_into().expect("four bytes"));
                    let bit = |i: usize| (qh >> i) as u8 & 1;
                    put(&std::array::from_fn::<u8, 4, _>(|e| (0..4).map(|j| (bit(4 * j + e) | (bit(16 + 4 * j + e) << 1)) << (2 * j)).sum()));
                }
            }
            debug_assert_eq!(at, 8 * bb);
        }
    }
}

/// Repacks MLX-quantized rows into Tessera's block layout (see the module docs).
///
/// `packed` holds `rows` rows of `cols` elements in MLX's packing: a little-endian
/// bitstream per row, element i at bits `[i·b, (i+1)·b)`. `scales` (and `biases` for
/// affine) hold `rows · cols / group` values, already converted to f32; for mxfp4
/// and mxfp8 `e8m0` holds the raw exponent bytes instead (for nvfp4 its E4M3 scale
/// bytes, one per 16). mxfp8 (E4M3 codes, an E8M0
/// exponent per 32) becomes [`WeightFormat::Fp8`]: the same codes, the exponent as its
/// f32 scale 2^(e−127), exactly (e = 255 reads as +inf, as in MLX).
pub fn repack_mlx(format: WeightFormat, rows: usize, cols: usize, packed: &[u8], scales: &[f32], biases: &[f32], e8m0: &[u8]) -> Vec<u8> {
    let g = format.block_elems();
    let groups = cols / g;
    let bits = match format {
        WeightFormat::A4 { .. } | WeightFormat::Mxfp4 | WeightFormat::Nvfp4 => 4,
        // FP8 blocks from mxfp8: the codes as they are, the exponent as an f32 scale.
        WeightFormat::A8 { .. } | WeightFormat::Fp8 => 8,
        _ => panic!("repack_mlx: {format} is not an MLX format"),
    };
    let row_in = cols * bits / 8;
    assert_eq!(packed.len(), rows * row_in, "repack_mlx: packed size");
    let bb = format.block_bytes();
    let mut out = vec![0u8; rows * groups * bb];
    for (at, block) in out.chunks_exact_mut(bb).enumerate() {
        let src = &packed[at * g * bits / 8..][..g * bits / 8];
        let header = match format {
            WeightFormat::Mxfp4 => {
                block[0] = e8m0[at];
                1
            }
            // Two E4M3 scales per 32: MLX's groups are 16 wide.
            WeightFormat::Nvfp4 => {
                block[..2].copy_from_slice(&e8m0[2 * at..2 * at + 2]);
                2
            }
            WeightFormat::Fp8 => {
                block[..4].copy_from_slice(&crate::scalar::e8m0(e8m0[at]).to_le_bytes());
                4
            }
            _ => {
                block[..4].copy_from_slice(&scales[at].to_le_bytes());
                block[4..8].copy_from_slice(&biases[at].to_le_bytes());
                8
            }
        };
        let body = &mut block[header..];
        if bits == 8 {
            body.copy_from_slice(src);
            continue;
        }
        // 4-bit: element i is the low nibble of byte i/2 when i is even; a block's byte
        // j holds elements j and j + 16, which sit in bytes j/2 and 8 + j/2 at the same
        // parity: the even bytes take both low nibbles, the odd ones both high nibbles.
        for (sub, o) in src.chunks_exact(16).zip(body.chunks_exact_mut(16)) {
            let (a, b) = (u64::from_le_bytes(sub[..8].try_into().expect("8 bytes")), u64::from_le_bytes(sub[8..].try_into().expect("8 bytes")));
            const LOW: u64 = 0x0F0F_0F0F_0F0F_0F0F;
            let even = (a & LOW) | ((b & LOW) << 4);
            let odd = ((a >> 4) & LOW) | (b & !LOW);
            o.copy_from_slice(&(spread_bytes(even) | (spread_bytes(odd) << 8)).to_le_bytes());
        }
    }
    out
}

/// The bytes of `x` at the even bytes of the result (byte k at byte 2k), zeros between.
#[inline]
fn spread_bytes(x: u64) -> u128 {
    let mut y = x as u128;
    y = (y | (y << 32)) & 0x0000_0000_FFFF_FFFF_0000_0000_FFFF_FFFF;
    y = (y | (y << 16)) & 0x0000_FFFF_0000_FFFF_0000_FFFF_0000_FFFF;
    (y | (y << 8)) & 0x00FF_00FF_00FF_00FF_00FF_00FF_00FF_00FF
}

/// MLX affine 4-bit rows ([`WeightFormat::A4`]: per group of `group`, an f32 scale and
/// bias, then each 32's nibbles in GGUF order) as [`WeightFormat::Q4_1`] rows, so they
/// run on the integer kernels with 8-bit activations: per 32, the group's scale as `d`
/// and its bias as `m` in f16 (w = d·q + m in both), then the same 16 nibble bytes.
/// The f16 rounding is exact for scales and biases stored as bf16 or f16 within f16's
/// normal range, as MLX writes them for bf16/f16 models. `None` when a scale or bias
/// does not fit an f16 (beyond ±65504, or not finite): the caller keeps the f32 path.
///
/// Size: 20 bytes per 32 weights against A4's 24 (group 32), 20 (64) or 18 (128).
pub fn a4_as_q4_1(group: usize, rows: usize, cols: usize, data: &[u8]) -> Option<Vec<u8>> {
    let a4 = WeightFormat::A4 { group: group as u16 };
    assert!(matches!(group, 32 | 64 | 128) && cols.is_multiple_of(group), "a4_as_q4_1: {cols} columns in groups of {group}");
    assert_eq!(data.len(), rows * a4.row_bytes(cols).expect("whole groups"), "a4_as_q4_1: {rows}×{cols} of {a4}");
    let mut out = Vec::with_capacity(rows * cols / 32 * 20);
    for g in data.chunks_exact(a4.block_bytes()) {
        let (d, m) = affine_scale_bias_f16(g)?;
        for nibbles in g[8..].chunks_exact(16) {
            out.extend(d.to_le_bytes());
            out.extend(m.to_le_bytes());
            out.extend_from_slice(nibbles);
        }
    }
    Some(out)
}

/// MLX affine 8-bit rows ([`WeightFormat::A8`]: per group of `group`, an f32 scale and
/// bias, then the u8 codes) as [`WeightFormat::A8x8`]: scale and bias as f16 (exact for
/// the bf16/f16 scales MLX writes), the codes less 128 as i8, interleaved by 8 rows in
/// Q8_0x8's order. `None` when a scale or bias does not fit an f16: the caller keeps
/// the f32 path.
pub fn a8_as_rows8(group: usize, rows: usize, cols: usize, data: &[u8]) -> Option<Vec<u8>> {
    let a8 = WeightFormat::A8 { group: group as u16 };
    let gb = a8.block_bytes();
    assert!(matches!(group, 32 | 64 | 128) && cols.is_multiple_of(group) && rows.is_multiple_of(8), "a8_as_rows8: {rows}×{cols} in groups of {group}");
    let row_in = a8.row_bytes(cols).expect("whole groups");
    assert_eq!(data.len(), rows * row_in, "a8_as_rows8: {rows}×{cols} of {a8}");
    let mut out = Vec::with_capacity(rows * cols / 32 * 36);
    for g8 in 0..rows / 8 {
        for b in 0..cols / 32 {
            let (c0, gi) = (32 * b, 32 * b / group);
            let header = |r: usize| &data[(8 * g8 + r) * row_in + gi * gb..][..gb];
            let mut halves = [(half::f16::ZERO, half::f16::ZERO); 8];
            for (r, h) in halves.iter_mut().enumerate() {
                *h = affine_scale_bias_f16(header(r))?;
            }
            halves.iter().for_each(|(d, _)| out.extend(d.to_le_bytes()));
            halves.iter().for_each(|(_, m)| out.extend(m.to_le_bytes()));
            for j in 0..8 {
                for r in 0..8 {
                    let codes = &header(r)[8 + (c0 + 4 * j) % group..][..4];
                    out.extend(codes.iter().map(|&q| (q as i32 - 128) as i8 as u8));
                }
            }
        }
    }
    Some(panelled(WeightFormat::A8x8, rows, cols, out))
}

/// Whether [`a4_as_q4_1`] or [`a8_as_rows8`] can convert these rows of MLX affine
/// `format` (A4 or A8: every scale and bias fits an f16), read from the group headers
/// alone: a loader decides before it sizes buffers.
pub fn affine_fits_f16(format: WeightFormat, data: &[u8]) -> bool {
    assert!(matches!(format, WeightFormat::A4 { .. } | WeightFormat::A8 { .. }), "affine_fits_f16: {format} is not MLX affine");
    data.chunks_exact(format.block_bytes()).all(|g| affine_scale_bias_f16(g).is_some())
}

/// An MLX affine group's f32 scale and bias (its first 8 bytes, A4 and A8 alike) as
/// f16, if both fit.
fn affine_scale_bias_f16(group_bytes: &[u8]) -> Option<(half::f16, half::f16)> {
    let f = |at: usize| half::f16::from_f32(f32::from_le_bytes(group_bytes[at..at + 4].try_into().expect("4 bytes")));
    let (d, m) = (f(0), f(4));
    (d.is_finite() && m.is_finite()).then_some((d, m))
}

/// FP8 E4M3 rows ([`WeightFormat::Fp8`]: per 32, an f32 block scale and 32 codes)
/// requantized to [`WeightFormat::Q8_0`], so they run on the integer kernels with
/// 8-bit activations: per 32, d = max|w| / 127 (as f16) and q = round(w / d). Lossy, as
/// llama.cpp's FP8 → Q8_0 conversions are: each weight moves by at most d/2 (0.4 % of
/// its block's largest), where E4M3 itself keeps 3 mantissa bits. `None` when a block
/// holds a NaN code or its d does not fit an f16: the caller keeps the FP8 path.
pub fn fp8_as_q8_0(rows: usize, cols: usize, data: &[u8]) -> Option<Vec<u8>> {
    assert!(cols.is_multiple_of(32) && data.len() == rows * cols / 32 * 36, "fp8_as_q8_0: {rows}×{cols} in {} bytes", data.len());
    let mut out = Vec::with_capacity(rows * cols / 32 * 34);
    let mut w = [0.0f32; 32];
    for b in data.chunks_exact(36) {
        crate::scalar::dequantize_row(WeightFormat::Fp8, b, &mut w);
        let amax = w.iter().try_fold(0.0f32, |m, v| v.is_finite().then(|| m.max(v.abs())))?;
        let d = half::f16::from_f32(amax / 127.0);
        if !d.is_finite() {
            return None;
        }
        // A d below f16's range means weights below ~1e-5: zeros.
        let inv = if d.to_f32() == 0.0 { 0.0 } else { 1.0 / d.to_f32() };
        out.extend(d.to_le_bytes());
        out.extend(w.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8));
    }
    Some(out)
}

/// Whether [`fp8_as_q8_0`] can convert these FP8 rows, from the block scales and codes
/// alone (no NaN code; d ≤ 448·|scale| / 127 fits an f16): a loader decides before it
/// sizes buffers.
pub fn fp8_fits_q8_0(data: &[u8]) -> bool {
    data.chunks_exact(36).all(|b| {
        let scale = f32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
        scale.is_finite() && half::f16::from_f32(448.0 * scale.abs() / 127.0).is_finite() && b[4..].iter().all(|q| q & 0x7F != 0x7F)
    })
}

/// MXFP4 rows ([`WeightFormat::Mxfp4`]: per 32, an e8m0 exponent byte and 16 bytes of
/// E2M1 codes in GGUF's nibble order) as [`WeightFormat::Mxfp4x8`]: each 32's scale
/// 2^(e − 127) halved into an f16 d (the levels are the values doubled), the codes
/// unchanged, interleaved by 8 rows. Exact: every weight keeps its value. `None` when an
/// exponent's d is not an f16 normal (e outside 114..=142, weights below 2^-14 or above
/// 2^15 in scale): the caller keeps the f32 path.
pub fn mxfp4_as_levels(rows: usize, cols: usize, data: &[u8]) -> Option<Vec<u8>> {
    assert!(rows.is_multiple_of(8) && cols.is_multiple_of(32) && data.len() == rows * cols / 32 * 17, "mxfp4_as_levels: {rows}×{cols} in {} bytes", data.len());
    if !mxfp4_fits_levels(data) {
        return None;
    }
    // IQ4_NL's row bytes (f16 d, then the 16 code bytes), then its 8-row layout.
    let mut rows_bytes = Vec::with_capacity(rows * cols / 32 * 18);
    for b in data.chunks_exact(17) {
        rows_bytes.extend(half::f16::from_f32(mxfp4_d(b[0])).to_le_bytes());
        rows_bytes.extend_from_slice(&b[1..17]);
    }
    let mut out = vec![0u8; rows_bytes.len()];
    repack_rows8_into(WeightFormat::Iq4Nl, rows, cols, &rows_bytes, &mut out);
    Some(panelled(WeightFormat::Mxfp4x8, rows, cols, out))
}

/// NVFP4 rows ([`WeightFormat::Nvfp4`]: per 32, two E4M3 scale bytes and 16 bytes of
/// E2M1 codes in Q4_0's nibble order, so Q4_0's block shape) as [`WeightFormat::Nvfp4x8`]:
/// Q4_0's 8-row interleave of the same bytes, the scales kept as E4M3 (the kernels widen
/// them exactly). `None` when a scale is negative or a NaN code (MLX writes neither; the
/// kernels' widening takes neither): the caller keeps the f32 path, where they stay what
/// they are.
pub fn nvfp4_as_levels(rows: usize, cols: usize, data: &[u8]) -> Option<Vec<u8>> {
    assert!(rows.is_multiple_of(8) && cols.is_multiple_of(32) && data.len() == rows * cols / 32 * 18, "nvfp4_as_levels: {rows}×{cols} in {} bytes", data.len());
    nvfp4_fits_levels(data).then(|| {
        let mut out = vec![0; data.len()];
        repack_rows8_into(WeightFormat::Q4_0, rows, cols, data, &mut out);
        panelled(WeightFormat::Nvfp4x8, rows, cols, out)
    })
}

/// Whether [`nvfp4_as_levels`] can convert these NVFP4 rows: every scale positive (or
/// +0) and not E4M3's NaN.
pub fn nvfp4_fits_levels(data: &[u8]) -> bool {
    data.chunks_exact(18).all(|b| b[0] < 0x7F && b[1] < 0x7F)
}

/// Whether [`mxfp4_as_levels`] can convert these MXFP4 rows (every exponent's d an f16
/// normal), from the exponent bytes alone.
pub fn mxfp4_fits_levels(data: &[u8]) -> bool {
    data.chunks_exact(17).all(|b| (114..=142).contains(&b[0]))
}

/// A block's d for the doubled levels: 2^(e − 127) / 2.
fn mxfp4_d(e: u8) -> f32 {
    2f32.powi(e as i32 - 128)
}

/// Repacks FP8 E4M3 rows `[rows, cols]` with block scales `scales[⌈rows/br⌉, ⌈cols/bc⌉]`
/// (DeepSeek's `weight_scale_inv`, which despite its name multiplies) into [`WeightFormat::Fp8`].
/// `bc` must be a multiple of 32 so no 32-block straddles two scales.
pub fn repack_fp8(rows: usize, cols: usize, w: &[u8], scales: &[f32], (br, bc): (usize, usize)) -> Vec<u8> {
    assert!(cols.is_multiple_of(32) && bc % 32 == 0 && w.len() == rows * cols);
    let scale_cols = cols.div_ceil(bc);
    assert_eq!(scales.len(), rows.div_ceil(br) * scale_cols, "repack_fp8: scale grid");
    let mut out = Vec::with_capacity(rows * cols / 32 * 36);
    for r in 0..rows {
        for c0 in (0..cols).step_by(32) {
            out.extend(scales[(r / br) * scale_cols + c0 / bc].to_le_bytes());
            out.extend_from_slice(&w[r * cols + c0..r * cols + c0 + 32]);
        }
    }
    out
}
