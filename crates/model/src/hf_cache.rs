//! A model named by its Hugging Face repo id (`org/name`, or `org/name/FILE.gguf`), found in
//! the local Hugging Face cache, as mlx-lm and vLLM users expect; never downloaded.
//!
//! The cache's layout (huggingface_hub's): the hub directory is `$HF_HUB_CACHE`, else
//! `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; a model's repo is
//! `models--ORG--NAME`, whose `refs/main` names a commit and `snapshots/<commit>/` holds
//! its files. (The `hf-hub` crate's cache reader ignores `HF_HUB_CACHE` and cannot list a
//! snapshot, which a repo of several GGUF files needs: so these few lines.)

use std::path::{Path, PathBuf};

/// The hub directory the environment names.
fn hub_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("HF_HUB_CACHE").filter(|d| !d.is_empty()) {
        return Some(d.into());
    }
    if let Some(h) = std::env::var_os("HF_HOME").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(h).join("hub"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface/hub"))
}

/// `arg` split as a repo id and an optional file in it, if it has that shape.
fn repo_id(arg: &str) -> Option<(&str, &str, Option<&str>)> {
    let ok = |s: &str| !s.is_empty() && !s.starts_with('.') && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    let mut parts = arg.split('/');
    let (org, name, file) = (parts.next()?, parts.next()?, parts.next());
    if parts.next().is_some() || !ok(org) || !ok(name) || file.is_some_and(|f| !ok(f)) {
        return None;
    }
    Some((org, name, file))
}

/// `path` as given where it exists (or is not shaped like a repo id); else the model the
/// Hugging Face cache holds under that repo id: the snapshot directory (a HF or MLX
/// checkpoint), its only GGUF file, or the GGUF file named after the repo id. An error
/// says where it looked and what to do.
pub fn resolve(path: &Path) -> Result<PathBuf, String> {
    let Some(arg) = path.to_str().filter(|_| !path.exists()) else { return Ok(path.into()) };
    let Some((org, name, file)) = repo_id(arg) else { return Ok(path.into()) };
    let hub = hub_dir().ok_or("no Hugging Face cache: set HF_HUB_CACHE or HF_HOME")?;
    let repo = hub.join(format!("models--{org}--{name}"));
    let fetch = format!("download it first (`huggingface-cli download {org}/{name}`; Tessera never downloads), or give a path");
    let commit = std::fs::read_to_string(repo.join("refs/main")).map_err(|_| format!("{arg} is neither a path nor a model in the Hugging Face cache ({} has no refs/main): {fetch}", repo.display()))?;
    let snapshot = repo.join("snapshots").join(commit.trim());
    if !snapshot.is_dir() {
        return Err(format!("{arg}: the cache's refs/main names {}, which is not in {}: {fetch}", commit.trim(), repo.join("snapshots").display()));
    }
    if let Some(f) = file {
        let p = snapshot.join(f);
        return if p.exists() { Ok(p) } else { Err(format!("{arg}: {f} is not in the cached snapshot {}", snapshot.display())) };
    }
    if snapshot.join("config.json").exists() {
        return Ok(snapshot);
    }
    let mut ggufs: Vec<String> = std::fs::read_dir(&snapshot)
        .map_err(|e| format!("{}: {e}", snapshot.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".gguf"))
        .collect();
    ggufs.sort();
    match ggufs.as_slice() {
        [one] => Ok(snapshot.join(one)),
        [] => Err(format!("{arg}: the cached snapshot {} has neither config.json nor a GGUF file", snapshot.display())),
        many => Err(format!("{arg} holds {} GGUF files: name one, as {org}/{name}/FILE ({})", many.len(), many.join(", "))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_are_told_from_paths() {
        assert_eq!(repo_id("HuggingFaceTB/SmolLM2-135M-Instruct"), Some(("HuggingFaceTB", "SmolLM2-135M-Instruct", None)));
        assert_eq!(repo_id("org/name/model.Q4_0.gguf"), Some(("org", "name", Some("model.Q4_0.gguf"))));
        for not in ["models/x.gguf/..", "/abs/path", "a", "a/b/c/d", "./a/b", "a//b", "a/b c"] {
            assert_eq!(repo_id(not), None, "{not}");
        }
    }
}
