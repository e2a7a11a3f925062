//! `tessera serve`: the model behind an OpenAI-compatible HTTP API (`tessera-serve`), on
//! one machine or, under `tessera launch`, a cluster (rank 0 serves; the others follow
//! its step plans).

use crate::{chat_template, engine_for, load_for, Engine, Loaded, RuntimeArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use tessera_engine::{CacheConfig, QueueLimits};
use tessera_model::Tokenizer;

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// A Jinja chat template to use instead of the checkpoint's (a file).
    #[arg(long)]
    chat_template: Option<std::path::PathBuf>,
    /// A GGUF file or a Hugging Face directory.
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// 0: any free port (printed as `listening on http://…`).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// A file holding the API key clients must send (`Authorization: Bearer KEY`).
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Requests generating at once (KV-cache slots).
    #[arg(long, default_value_t = 8)]
    parallel: usize,
    /// Requests waiting for a slot; beyond them, 429.
    #[arg(long, default_value_t = 64)]
    queue_max: usize,
    /// Prompt tokens waiting for slots, all requests together; beyond them, 429.
    #[arg(long, default_value_t = 262_144)]
    queued_prompt_tokens_max: usize,
    /// Request bodies over this many bytes are refused (413).
    #[arg(long, default_value_t = 4 << 20)]
    body_bytes_max: usize,
    /// Tokens of KV cache all requests together may hold (reserved for running requests'
    /// prompts and outputs, or kept for the prefix cache); default: --parallel × --ctx.
    #[arg(long)]
    kv_tokens_max: Option<usize>,
    /// Tokens per prefix-cache block (requests that share a prompt prefix reuse its
    /// cache); 0 turns the prefix cache off.
    #[arg(long, default_value_t = 16)]
    prefix_block_tokens: usize,
    /// A step running longer than this many seconds is a hung engine: every request in
    /// flight fails, and the server exits (code 3) for its supervisor to restart it.
    #[arg(long, default_value_t = 600.0)]
    step_timeout_s: f64,
    /// The model name clients use (default: the file or directory name).
    #[arg(long)]
    served_name: Option<String>,
    #[command(flatten)]
    runtime: RuntimeArgs,
}

pub(crate) fn run(a: ServeArgs) -> Result<()> {
    if !(1..=tessera_engine::generate::SEQUENCES_MAX).contains(&a.parallel) {
        bail!("--parallel {}: choose 1..={}", a.parallel, tessera_engine::generate::SEQUENCES_MAX);
    }
    if a.kv_tokens_max == Some(0) {
        bail!("--kv-tokens-max 0 would refuse every request");
    }
    if !(a.step_timeout_s > 0.0 && a.step_timeout_s <= 86_400.0) {
        bail!("--step-timeout-s {}: choose a number of seconds in (0, 86400]", a.step_timeout_s);
    }
    if a.queue_max == 0 {
        bail!("--queue-max 0 would refuse every request");
    }
    let api_key = match &a.api_key_file {
        Some(f) => {
            let key = std::fs::read_to_string(f).with_context(|| format!("reading the API key from {}", f.display()))?.trim().to_string();
            if key.is_empty() {
                bail!("{} holds no API key", f.display());
            }
            Some(key)
        }
        None => None,
    };
    let model_name = a.served_name.clone().unwrap_or_else(|| a.model.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned()));
    let p = &a.runtime.placement;
    let cfg = tessera_serve::ServeConfig {
        addr: SocketAddr::new(a.host, a.port),
        model_name,
        placement: format!("TP{} · PP{} · EP{}", p.tp, p.pp, p.ep),
        ranks: p.tp.max(p.ep) * p.pp,
        parallel: a.parallel,
        api_key,
        queue: QueueLimits { requests_max: a.queue_max, prompt_tokens_max: a.queued_prompt_tokens_max },
        cache: CacheConfig { kv_tokens_max: a.kv_tokens_max.unwrap_or(usize::MAX), prefix_block_tokens: a.prefix_block_tokens },
        body_bytes_max: a.body_bytes_max,
        commands_max: a.queue_max + a.parallel + 64,
        step_timeout: std::time::Duration::from_secs_f64(a.step_timeout_s),
    };
    // Rank 0 answers HTTP while every rank loads (`/ready` 503 until then).
    let leads = crate::cluster::leads_from_env();
    let server = if leads { Some(tessera_serve::Server::bind(cfg).map_err(anyhow::Error::msg)?) } else { None };
    tessera_serve::faults::delay_load();
    let Loaded { model, cluster } = load_for(&a.model, &a.runtime, crate::Fit { sequences: a.parallel, min_ctx: 0 })?;
    let template = match &a.chat_template {
        // A template of the user's own, in place of the checkpoint's.
        Some(f) => Some(tessera_model::ChatTemplate::new(std::fs::read_to_string(f).with_context(|| format!("--chat-template {}", f.display()))?, f.clone())),
        None => chat_template(&model).ok(),
    };
    let (tok, template) = if leads { (Some(Tokenizer::from_checkpoint(model.checkpoint())?), template) } else { (None, None) };
    let mut gen = match engine_for(&model, cluster, &a.runtime, 0, a.parallel)? {
        Engine::Follow(rank) => return rank.follow().map(drop).map_err(Into::into),
        Engine::Drive(g) => g,
    };
    let server = server.expect("rank 0 serves");
    server.run(gen.stepper(), tok.expect("the leader has the tokenizer"), template).map_err(anyhow::Error::msg)
}
