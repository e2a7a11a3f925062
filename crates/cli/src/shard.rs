//! `tessera shard`: one rank's slice of a checkpoint, written as a standalone
//! checkpoint, so a node needs only its own files on disk; and reading it back.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tessera_engine::Placement;
use tessera_model::{Checkpoint, CheckpointKind, DenseTransformer, ModelConfig, TensorDtype};

pub const MANIFEST: &str = "tessera-shard.json";

/// The placement and rank a shard directory was written for.
pub struct Manifest {
    pub rank: usize,
    pub placement: Placement,
}

fn placement_json(p: &Placement) -> serde_json::Value {
    serde_json::json!({"world": p.world, "tp": p.tp, "pp": p.pp, "ep": p.ep, "pp_split": p.pp_split})
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
    Ok(Some(Manifest { rank, placement: Placement { world: num("world")?, tp: num("tp")?, pp: num("pp")?, ep: num("ep")?, pp_split } }))
}

fn dtype_name(d: TensorDtype) -> Option<&'static str> {
    Some(match d {
        TensorDtype::F32 => "F32",
        TensorDtype::F16 => "F16",
        TensorDtype::Bf16 => "BF16",
        TensorDtype::I32 => "I32",
        TensorDtype::U32 => "U32",
        TensorDtype::U8 => "U8",
        _ => return None,
    })
}

/// Writes rank `rank`'s slice of `model` under `placement` into `out`.
pub fn write(model: &Path, placement: &Placement, rank: usize, out: &Path) -> Result<()> {
    let ckpt = Arc::new(Checkpoint::open(model).with_context(|| format!("loading {}", model.display()))?);
    if ckpt.kind != CheckpointKind::HfDir {
        bail!("{}: `tessera shard` writes safetensors and reads Hugging Face directories; GGUF sources are not supported yet", model.display());
    }
    if read_manifest(model)?.is_some() {
        bail!("{} is already a shard", model.display());
    }
    let cfg = ModelConfig::from_checkpoint(&ckpt)?;
    if rank >= placement.world {
        bail!("--rank {rank} is not below the placement's {} ranks", placement.world);
    }
    let spec = placement.spec(rank, &cfg);
    let (_, tensors) = DenseTransformer::load_recording(Arc::clone(&ckpt), cfg, spec).with_context(|| format!("reading rank {rank}'s slice"))?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    // Header, then data in the same order; offsets relative to the data section.
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for t in &tensors {
        let dtype = dtype_name(t.dtype).with_context(|| format!("tensor {}: dtype {:?} cannot be written to safetensors", t.name, t.dtype))?;
        header.insert(t.name.clone(), serde_json::json!({"dtype": dtype, "shape": t.shape, "data_offsets": [offset, offset + t.bytes.len()]}));
        offset += t.bytes.len();
    }
    let mut h = serde_json::to_string(&header)?;
    while (8 + h.len()) % 8 != 0 {
        h.push(' ');
    }
    let path = out.join("model.safetensors");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?);
    use std::io::Write;
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(h.as_bytes())?;
    for t in &tensors {
        f.write_all(&t.bytes)?;
    }
    f.flush()?;
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"] {
        let src = model.join(name);
        if src.exists() {
            std::fs::copy(&src, out.join(name)).with_context(|| format!("copying {}", src.display()))?;
        }
    }
    let manifest = serde_json::json!({
        "format": "tessera-shard", "version": 1, "rank": rank,
        "placement": placement_json(placement), "source": model.display().to_string(), "tensor_bytes": offset,
    });
    std::fs::write(out.join(MANIFEST), serde_json::to_string_pretty(&manifest)?)?;
    eprintln!("wrote rank {rank} of [{}]: {} tensors, {} bytes, to {}", placement.describe(), tensors.len(), offset, out.display());
    Ok(())
}

/// `--model` may name each rank's own directory with `{rank}` (e.g. `shards/r{rank}`).
pub fn model_path(template: &Path, rank: usize) -> PathBuf {
    PathBuf::from(template.to_string_lossy().replace("{rank}", &rank.to_string()))
}
