//! `tessera shard`: one rank's slice of a checkpoint, written as a standalone
//! checkpoint, so a node needs only its own files on disk; and reading it back.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tessera_engine::Placement;
use tessera_model::{gguf, Checkpoint, CheckpointKind, Model, ModelConfig, RecordedTensor, TensorDtype};

pub const MANIFEST: &str = "tessera-shard.json";
/// A GGUF source's shard: one GGUF file, its metadata (tokenizer, template) copied.
const GGUF_FILE: &str = "model.gguf";

/// The placement and rank a shard directory was written for.
pub struct Manifest {
    pub rank: usize,
    pub placement: Placement,
    /// What to open: the directory itself (safetensors + config.json) or its GGUF file.
    pub checkpoint: PathBuf,
}

fn placement_json(p: &Placement) -> serde_json::Value {
    serde_json::json!({"world": p.world, "tp": p.tp, "pp": p.pp, "ep": p.ep, "pp_split": p.pp_split, "dp_attention": p.dp_attention})
}

/// The manifest of a shard directory, if `dir` is one.
pub fn read_manifest(dir: &Path) -> Result<Option<Manifest>> {
    let path = dir.join(MANIFEST);
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    let num = |k: &str| -> Result<usize> {
        v["placement"][k].as_u64().map(|x| x as usize).with_context(|| format!("{}: placement.{k} missing", path.display()))
    };
    let pp_split = v["placement"]["pp_split"]
        .as_array()
        .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect::<Option<Vec<_>>>())
        .with_context(|| format!("{}: placement.pp_split missing", path.display()))?;
    let rank = v["rank"].as_u64().with_context(|| format!("{}: rank missing", path.display()))? as usize;
    let checkpoint = match v["checkpoint"].as_str() {
        None | Some("model.safetensors") => dir.to_path_buf(),
        Some(GGUF_FILE) => dir.join(GGUF_FILE),
        Some(other) => bail!("{}: unknown checkpoint {other:?} (written by a newer tessera?)", path.display()),
    };
    Ok(Some(Manifest { rank, placement: Placement { world: num("world")?, tp: num("tp")?, pp: num("pp")?, ep: num("ep")?, pp_split, dp_attention: v["placement"]["dp_attention"].as_bool().unwrap_or(false) }, checkpoint }))
}

fn dtype_name(d: TensorDtype) -> Option<&'static str> {
    Some(match d {
        TensorDtype::F32 => "F32",
        TensorDtype::F16 => "F16",
        TensorDtype::Bf16 => "BF16",
        TensorDtype::I32 => "I32",
        TensorDtype::U32 => "U32",
        TensorDtype::U8 => "U8",
        TensorDtype::F8E4M3 => "F8_E4M3",
        _ => return None,
    })
}

/// Writes rank `rank`'s slice of `model` under `placement` into `out`: safetensors
/// (with config and tokenizer files) for a Hugging Face or MLX directory, a GGUF file
/// (with all the source's metadata) for a GGUF source; and the manifest.
pub fn write(model: &Path, placement: &Placement, rank: usize, out: &Path) -> Result<()> {
    let ckpt = Arc::new(Checkpoint::open(model).with_context(|| format!("loading {}", model.display()))?);
    if read_manifest(model)?.is_some() {
        bail!("{} is already a shard", model.display());
    }
    let cfg = ModelConfig::from_checkpoint(&ckpt)?;
    if rank >= placement.world {
        bail!("--rank {rank} is not below the placement's {} ranks", placement.world);
    }
    let spec = placement.spec(rank, &cfg);
    let (_, tensors) = Model::load_recording(Arc::clone(&ckpt), cfg, spec).with_context(|| format!("reading rank {rank}'s slice"))?;
    let bytes: usize = tensors.iter().map(|t| t.bytes.len()).sum();
    if out.exists() && read_manifest(out)?.is_none() && std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_some()) {
        bail!("{} exists and is not a shard: choose another --out (a shard written there before is replaced)", out.display());
    }
    // Written whole beside `out`, then renamed: a full disk or a kill leaves no half slice.
    let staging = crate::share::manifest::partial_of(out);
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).with_context(|| format!("creating {}", staging.display()))?;
    if let Some(free) = crate::share::manifest::free_bytes(&staging) {
        if free < bytes as u64 + (1 << 20) {
            let _ = std::fs::remove_dir_all(&staging);
            bail!("rank {rank}'s slice is {bytes} bytes and {} has {free} bytes free: make room or choose another --out (nothing was written)", staging.parent().unwrap_or(out).display());
        }
    }
    let written = write_slice(&ckpt, model, &staging, &tensors, placement, rank, bytes).and_then(|file| {
        if out.exists() {
            std::fs::remove_dir_all(out).with_context(|| format!("replacing the shard at {}", out.display()))?;
        }
        std::fs::rename(&staging, out).with_context(|| format!("renaming {} to {}", staging.display(), out.display()))?;
        Ok(file)
    });
    let file = match written {
        Ok(f) => f,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e.context(format!("writing rank {rank}'s slice to {} failed (a full disk?); nothing was left there", out.display())));
        }
    };
    eprintln!("wrote rank {rank} of [{}]: {} tensors, {bytes} bytes, to {}", placement.describe(), tensors.len(), out.join(file).display());
    Ok(())
}

/// The slice's files and manifest into `out`; the checkpoint file's name.
fn write_slice(ckpt: &Checkpoint, model: &Path, out: &Path, tensors: &[RecordedTensor], placement: &Placement, rank: usize, bytes: usize) -> Result<&'static str> {
    let file = match ckpt.kind {
        CheckpointKind::Gguf => {
            let meta = &ckpt.gguf.as_ref().expect("a GGUF checkpoint has its header").metadata;
            let list: Vec<gguf::TensorOut> =
                tensors.iter().map(|t| gguf::TensorOut { name: &t.name, dtype: t.dtype, shape: &t.shape, data: &t.bytes }).collect();
            gguf::write(&out.join(GGUF_FILE), meta, &list).with_context(|| format!("writing {}", out.join(GGUF_FILE).display()))?;
            GGUF_FILE
        }
        CheckpointKind::HfDir => {
            write_safetensors(&out.join("model.safetensors"), tensors)?;
            for name in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"] {
                let src = model.join(name);
                if src.exists() {
                    std::fs::copy(&src, out.join(name)).with_context(|| format!("copying {}", src.display()))?;
                }
            }
            "model.safetensors"
        }
    };
    let manifest = serde_json::json!({
        "format": "tessera-shard", "version": 1, "rank": rank, "checkpoint": file,
        "placement": placement_json(placement), "source": model.display().to_string(), "tensor_bytes": bytes,
    });
    std::fs::write(out.join(MANIFEST), serde_json::to_string_pretty(&manifest)?).with_context(|| format!("writing {}", out.join(MANIFEST).display()))?;
    Ok(file)
}

/// One safetensors file: header, then the data in the same order.
fn write_safetensors(path: &Path, tensors: &[RecordedTensor]) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for t in tensors {
        let dtype = dtype_name(t.dtype).with_context(|| format!("tensor {}: dtype {:?} cannot be written to safetensors", t.name, t.dtype))?;
        header.insert(t.name.clone(), serde_json::json!({"dtype": dtype, "shape": t.shape, "data_offsets": [offset, offset + t.bytes.len()]}));
        offset += t.bytes.len();
    }
    let mut h = serde_json::to_string(&header)?;
    while (8 + h.len()) % 8 != 0 {
        h.push(' ');
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?);
    use std::io::Write;
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(h.as_bytes())?;
    for t in tensors {
        f.write_all(&t.bytes)?;
    }
    f.flush().with_context(|| format!("writing {}", path.display()))
}

/// `--model` may name each rank's own directory with `{rank}` (e.g. `shards/r{rank}`).
pub fn model_path(template: &Path, rank: usize) -> PathBuf {
    PathBuf::from(template.to_string_lossy().replace("{rank}", &rank.to_string()))
}
