//! `tessera`: a thin command line over the engine. It parses arguments, wires the
//! crates together and prints; the work happens in the libraries.

mod bench;
mod cluster;
mod doctor;
mod inspect;
mod dry_run;
mod npy;
mod plan;
mod serve;
mod shard;
mod share;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;
use std::sync::Arc;
use tessera_comm::Communicator;
use tessera_engine::{EngineConfig, Generator, Placement, Rank, SamplingParams, StopReason};
use tessera_model::{ChatTemplate, Checkpoint, Model, KvDtype, Message, ModelConfig, Tokenizer};

#[derive(Parser)]
#[command(name = "tessera", version, about = "Run large language models on one machine or many.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt or a chat message, streaming it to stdout.
    #[command(after_help = "Examples:\n  tessera generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf --chat \"What are three uses of copper?\"\n  tessera generate --model HuggingFaceTB/SmolLM2-135M-Instruct --prompt \"Once upon a time\" --temperature 0.8 --seed 1\n  tessera generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf --chat \"A pet, as JSON\" --json-schema pet.schema.json\n  tessera launch -n 2 -- generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf --tp 2 --chat Hello")]
    Generate(GenerateArgs),
    /// Write float32 logits [n_tokens, vocab] of one forward pass to a .npy file.
    #[command(after_help = "Example:\n  tessera logits --model models/SmolLM2-135M-Instruct.Q4_1.gguf --tokens 1,2,3 --out logits.npy")]
    Logits(LogitsArgs),
    /// Print the token ids of a text (or of a chat message rendered with the template).
    #[command(after_help = "Examples:\n  tessera tokenize --model models/SmolLM2-135M-Instruct.Q4_1.gguf \"Hello world\"\n  tessera tokenize --model models/SmolLM2-135M-Instruct.Q4_1.gguf --chat \"Hello\"")]
    Tokenize {
        #[arg(long)]
        model: PathBuf,
        text: String,
        /// Treat TEXT as a user message and render the chat template first.
        #[arg(long)]
        chat: bool,
    },
    /// Describe a checkpoint: architecture, parameters, formats, bytes per token; with
    /// placement flags, each rank's share.
    #[command(after_help = "Examples:\n  tessera inspect models/SmolLM2-135M-Instruct.Q4_1.gguf\n  tessera inspect MODEL_DIR --tp 4 --json")]
    Inspect {
        /// A GGUF file or a Hugging Face directory.
        path: PathBuf,
        #[command(flatten)]
        placement: PlacementArgs,
        /// Print one JSON object (the same facts) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write one rank's slice of a Hugging Face checkpoint as a standalone checkpoint,
    /// so each node needs only its own files (run it with `--model DIR/{rank}`-style paths).
    #[command(after_help = "Example:\n  tessera shard --model MODEL --world 2 --tp 2 --rank 1 --out shards/r1\n  tessera launch -n 2 -- generate --model 'shards/r{rank}' --tp 2 --prompt hi")]
    Shard {
        #[arg(long)]
        model: PathBuf,
        /// Ranks of the placement.
        #[arg(long)]
        world: usize,
        #[command(flatten)]
        placement: PlacementArgs,
        /// Which rank's slice to write.
        #[arg(long)]
        rank: usize,
        #[arg(long)]
        out: PathBuf,
    },
    /// Start N ranks of a tessera command (locally, or over ssh on a hostfile's hosts),
    /// wired together; stops them all when one fails.
    #[command(after_help = "Examples:\n  tessera launch -n 2 -- generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf --tp 2 --chat Hello\n  tessera launch -n 4 --hostfile hosts.txt -- serve --model MODEL --pp 2 --tp 2\n  tessera launch -n 4 --dry-run -- generate --model MODEL --pp 4 --prompt hi")]
    Launch {
        /// Number of ranks.
        #[arg(short = 'n', long)]
        n: usize,
        /// One host per rank, one per line (ssh; same binary path and directory there).
        #[arg(long)]
        hostfile: Option<PathBuf>,
        /// Print which host runs which rank, its threads and its share of the model; start nothing.
        #[arg(long)]
        dry_run: bool,
        /// The tessera subcommand and its flags, after `--`.
        #[arg(last = true, required = true)]
        args: Vec<String>,
    },
    /// Under `launch`: give every rank the bytes its placement reads (or `--full` the
    /// whole model) from the rank that holds it, chunk by checked chunk, resumable.
    #[command(after_help = "Examples:\n  tessera launch -n 3 --hostfile hosts.txt -- share --model MODEL --out 'slices/r{rank}' --tp 3\n  tessera launch -n 3 --hostfile hosts.txt -- share --model MODEL --out 'slices/r{rank}' --verify")]
    Share(share::ShareArgs),
    /// Start or join a cluster; print link latency/bandwidth and all_reduce latency.
    #[command(after_help = "Examples:\n  tessera doctor --local 2\n  tessera launch -n 4 --hostfile hosts.txt -- doctor --json > cluster.json")]
    Doctor(doctor::DoctorArgs),
    /// Which placements of a model fit a cluster: each node's memory, the largest context,
    /// predicted decode and prefill speed and what bounds it (reads headers only).
    #[command(after_help = "Examples:\n  tessera plan --model MODEL --cluster cluster.json --ctx 32768 --sequences 4\n  tessera plan --model config.json --quant q4_k_m --cluster docs/clusters/m3-ultra-tb5.json --json")]
    Plan(plan::PlanArgs),
    /// Measure prompt, decode and batched-decode speed on random tokens, and read bandwidth.
    #[command(after_help = "Examples:\n  tessera bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf\n  tessera bench --model MODEL --pp 0 --tg 64 --batch 1,32 --profile\n  tessera launch -n 2 -- bench --model MODEL --tp 2")]
    Bench(bench::BenchArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (continuous batching).
    #[command(after_help = "Examples:\n  tessera serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --port 8080\n  tessera serve --model MODEL --parallel 16 --ctx 8192 --api-key-file key.txt\n  tessera launch -n 2 -- serve --model MODEL --tp 2")]
    Serve(serve::ServeArgs),
}

#[derive(Args, Clone)]
struct PlacementArgs {
    /// Tensor-parallel ranks per pipeline stage (attention heads, MLP width, vocabulary).
    #[arg(long, default_value_t = 1)]
    pub(crate) tp: usize,
    /// Pipeline stages (contiguous layer ranges).
    #[arg(long, default_value_t = 1)]
    pub(crate) pp: usize,
    /// Layers per pipeline stage, e.g. 10,14 (default: even).
    #[arg(long, value_delimiter = ',')]
    pub(crate) pp_split: Option<Vec<usize>>,
    /// Expert-parallel ranks per stage (whole experts per rank).
    #[arg(long, default_value_t = 1)]
    pub(crate) ep: usize,
    /// With --ep: each rank runs attention and holds KV caches for its own sequences
    /// only; at each MoE layer tokens go to the ranks of their experts (all-to-all).
    #[arg(long)]
    pub(crate) dp_attention: bool,
}

impl PlacementArgs {
    fn is_single(&self) -> bool {
        self.tp == 1 && self.pp == 1 && self.ep == 1 && self.pp_split.is_none() && !self.dp_attention
    }

    /// These flags as a placement of `cfg` over `world` ranks, checked.
    pub(crate) fn placement(&self, world: usize, cfg: &ModelConfig) -> std::result::Result<Placement, String> {
        Placement::new(world, self.tp, self.pp, self.ep, self.pp_split.clone(), cfg)?.with_dp_attention(self.dp_attention)
    }
}

#[derive(Args)]
pub(crate) struct RuntimeArgs {
    #[command(flatten)]
    pub(crate) placement: PlacementArgs,
    /// File holding the cluster secret (else TESSERA_CLUSTER_SECRET).
    #[arg(long)]
    pub(crate) secret_file: Option<PathBuf>,
    /// Compute threads (default: this host's cores ÷ the ranks `launch` runs on it).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// KV-cache capacity in tokens (default: min(model limit, 4096)).
    #[arg(long)]
    pub(crate) ctx: Option<usize>,
    /// Allow a context beyond the model's own limit (its `max_position_embeddings`): the
    /// positions past it were never trained, and output there degrades.
    #[arg(long)]
    pub(crate) ctx_over_limit: bool,
    /// Load even where this node's available memory (MemAvailable) is less than what the
    /// model, its caches at --ctx × sequences and the workspace need (checked before
    /// loading, from the tensor headers).
    #[arg(long)]
    pub(crate) no_memory_check: bool,
    /// Prompt tokens per prefill step.
    #[arg(long, default_value_t = 2048)]
    pub(crate) prefill_chunk: usize,
    /// Element type of cached keys and values: f16 (half the memory and attention
    /// reads of f32), q8 (8-bit blocks of 32 with a scale: 36 bytes where f16 takes
    /// 64) or f32 (exact float32 attention). MLA's latent cache is always f32.
    #[arg(long, default_value = "f16")]
    pub(crate) kv_cache: KvDtype,
}

#[derive(Args)]
struct GenerateArgs {
    /// A GGUF file or a Hugging Face directory.
    #[arg(long)]
    model: PathBuf,
    /// Raw prompt text (no chat template).
    #[arg(long, conflicts_with_all = ["chat", "prompt_ids"], required_unless_present_any = ["chat", "prompt_ids"])]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids (no tokenizer needed). Repeat the flag for
    /// several sequences, generated together.
    #[arg(long, conflicts_with = "chat")]
    prompt_ids: Vec<String>,
    /// Generate this many sequences from each prompt at once (seeds seed, seed+1, ...):
    /// batched decode on one node, one micro-batch per stage under --pp.
    #[arg(long, default_value_t = 1)]
    parallel: usize,
    /// Also print the generated token ids, as a last line `ids: 1,2,3`.
    #[arg(long)]
    print_ids: bool,
    /// A user message, wrapped in the model's chat template.
    #[arg(long)]
    chat: Option<String>,
    /// A system message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 64)]
    penalty_window: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The output must be an instance of this JSON schema (a file): each token is
    /// sampled among those that keep the text a valid prefix of it.
    #[arg(long, conflicts_with = "prompt_ids")]
    json_schema: Option<PathBuf>,
    #[command(flatten)]
    runtime: RuntimeArgs,
}

#[derive(Args)]
struct LogitsArgs {
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    /// Output .npy file.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    runtime: RuntimeArgs,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => generate(a),
        Command::Logits(a) => logits(a),
        Command::Inspect { path, placement, json } => inspect::inspect(&path, &placement, json),
        Command::Launch { n, hostfile, dry_run, args } => cluster::launch(n, hostfile, args, dry_run),
        Command::Shard { model, world, placement, rank, out } => shard_cmd(&model, world, &placement, rank, &out),
        Command::Doctor(a) => doctor::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Share(a) => share::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Tokenize { model, text, chat } => tokenize(&model, &text, chat),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn load(path: &Path) -> Result<Model> {
    let model = tessera_model::load_model(path).with_context(|| format!("loading {}", path.display()))?;
    prefetch(&model);
    Ok(model)
}

/// Reads every weight page once so the first token does not pay for disk reads,
/// with a progress bar for checkpoints large enough to notice (> 1 GiB).
fn prefetch(model: &Model) {
    let ckpt = model.checkpoint();
    let linears = model.linears();
    let total: usize = linears.iter().map(|l| l.bytes()).sum();
    let bar = (total > 1 << 30).then(|| {
        let bar = indicatif::ProgressBar::with_draw_target(Some(total as u64), indicatif::ProgressDrawTarget::stderr());
        bar.set_style(
            indicatif::ProgressStyle::with_template("loading {bar:40} {bytes}/{total_bytes} ({eta})")
                .expect("static template"),
        );
        bar
    });
    let mut sink = 0u8;
    for l in linears {
        let data = l.weights(ckpt).data;
        for page in data.chunks(4096) {
            sink ^= page[0];
        }
        if let Some(b) = &bar {
            b.inc(l.bytes() as u64);
        }
    }
    std::hint::black_box(sink);
    if let Some(b) = bar {
        b.finish_and_clear();
    }
}

fn engine_config(model: &Model, rt: &RuntimeArgs) -> EngineConfig {
    let mut cfg = EngineConfig::for_model(model);
    cfg.threads = rt.threads.unwrap_or_else(cluster::default_threads);
    if let Some(c) = rt.ctx {
        cfg.context_max = c;
    }
    cfg.prefill_chunk = rt.prefill_chunk;
    cfg.kv_cache = rt.kv_cache;
    cfg
}

/// A model loaded for this process: the whole of it, or this rank's shard with the
/// cluster it belongs to.
pub(crate) struct Loaded {
    pub(crate) model: Model,
    pub(crate) cluster: Option<(Communicator, Placement)>,
}

fn shard_cmd(model: &Path, world: usize, p: &PlacementArgs, rank: usize, out: &Path) -> Result<()> {
    let ckpt = Checkpoint::open(model).with_context(|| format!("loading {}", model.display()))?;
    let cfg = ModelConfig::from_checkpoint(&ckpt)?;
    let placement = p.placement(world, &cfg).map_err(|e| anyhow::anyhow!("placement refused: {e}"))?;
    shard::write(model, &placement, rank, out)
}

/// Refuses, before a byte of weights is read, a load this node cannot hold: the loader
/// run dry over the headers (`Model::footprint`) gives the weights and workspace, the
/// cache comes at the context and sequences asked for, against `MemAvailable`.
fn check_memory(ckpt: &Arc<Checkpoint>, cfg: &ModelConfig, spec: tessera_model::ShardSpec, rt: &RuntimeArgs, fit: Fit, leader: bool, who: &str) -> Result<()> {
    let Some(have) = tessera_model::memory::available_bytes().filter(|_| !rt.no_memory_check) else { return Ok(()) };
    let ctx = rt.ctx.unwrap_or(cfg.context_max.min(4096)).max(fit.min_ctx);
    let limits = tessera_model::StepLimits { tokens_per_step_max: rt.prefill_chunk.max(fit.sequences), context_max: ctx, sequences_per_step_max: fit.sequences };
    let threads = rt.threads.unwrap_or_else(cluster::default_threads);
    let f = Model::footprint(Arc::clone(ckpt), cfg.clone(), spec, limits, threads)?;
    let (need, cache, _) = tessera_plan::rank_bytes(&f, rt.kv_cache, ctx, fit.sequences, leader);
    if need > have {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        bail!(
            "{who} needs {:.2} GiB (weights {:.2}, cache {:.2} for {} × {ctx} tokens, workspace {:.2}) and this node has {:.2} GiB available: lower --ctx or the sequences, place the model over more nodes (`tessera plan`), or pass --no-memory-check to load anyway",
            gib(need),
            gib((f.weights_bytes + f.mapped_bytes) as u64),
            gib(cache),
            fit.sequences,
            gib(f.workspace_bytes as u64),
            gib(have)
        );
    }
    Ok(())
}

/// What a run will hold besides the weights: sequences at once, and the context the
/// prompts and tokens asked for need at least.
#[derive(Clone, Copy)]
pub(crate) struct Fit {
    pub(crate) sequences: usize,
    pub(crate) min_ctx: usize,
}

pub(crate) fn load_for(path: &Path, rt: &RuntimeArgs, fit: Fit) -> Result<Loaded> {
    let p = &rt.placement;
    let env = cluster::ClusterEnv::from_env(rt.secret_file.as_ref())?;
    let owned_path = shard::model_path(path, env.as_ref().map_or(0, |e| e.rank));
    let path = owned_path.as_path();
    let manifest = shard::read_manifest(path)?;
    let Some(env) = env else {
        if let Some(m) = &manifest {
            bail!("{} holds rank {}'s slice of [{}]: run it under `tessera launch -n {}` with the same placement", path.display(), m.rank, m.placement.describe(), m.placement.world);
        }
        if p.dp_attention && p.ep < 2 {
            bail!("--dp-attention spreads sequences over the expert-parallel ranks of a stage: add --ep N and run it under `tessera launch -n N -- ...`");
        }
        if !p.is_single() {
            let world = p.tp.max(p.ep) * p.pp;
            bail!("this placement needs {world} ranks: run it under `tessera launch -n {world} -- ...` (or another launcher)");
        }
        let ckpt = Arc::new(Checkpoint::open(path).with_context(|| format!("loading {}", path.display()))?);
        let cfg = ModelConfig::from_checkpoint(&ckpt)?;
        check_memory(&ckpt, &cfg, tessera_model::ShardSpec::whole(cfg.layers), rt, fit, true, &format!("{}", path.display()))?;
        drop(ckpt);
        return Ok(Loaded { model: load(path)?, cluster: None });
    };
    let open = manifest.as_ref().map_or(path, |m| m.checkpoint.as_path());
    let ckpt = Arc::new(Checkpoint::open(open).with_context(|| format!("loading {}", open.display()))?);
    let cfg = ModelConfig::from_checkpoint(&ckpt)?;
    let placement = p
        .placement(env.world, &cfg)
        .map_err(|e| anyhow::anyhow!("placement refused before loading {}: {e}", path.display()))?;
    if let Some(m) = &manifest {
        if m.rank != env.rank || m.placement != placement {
            bail!(
                "{} holds rank {}'s slice of [{}], but this is rank {} of [{}]",
                path.display(),
                m.rank,
                m.placement.describe(),
                env.rank,
                placement.describe()
            );
        }
    }
    let rank = env.rank;
    let spec = placement.spec(rank, &cfg);
    if manifest.is_none() {
        check_memory(&ckpt, &cfg, spec.clone(), rt, fit, rank == 0, &format!("rank {rank}'s share of {}", path.display()))?;
    }
    let comm = env.connect()?;
    comm.set_loading(true);
    let model = if manifest.is_some() {
        Model::load_presliced(ckpt, cfg, spec)
    } else {
        Model::load_shard(ckpt, cfg, spec)
    }
    .with_context(|| format!("rank {} loading {}", rank, path.display()))?;
    comm.set_loading(false);
    Ok(Loaded { model, cluster: Some((comm, placement)) })
}

#[allow(clippy::large_enum_variant)] // one per process
pub(crate) enum Engine<'m> {
    /// This process drives generation (alone, or as the cluster's leader).
    Drive(Generator<'m>),
    /// A follower rank: runs the leader's plans.
    Follow(Rank<'m>),
}

pub(crate) fn engine_for<'m>(model: &'m Model, cluster: Option<(Communicator, Placement)>, rt: &RuntimeArgs, min_ctx: usize, sequences: usize) -> Result<Engine<'m>> {
    let mut cfg = engine_config(model, rt);
    cfg.context_max = cfg.context_max.max(min_ctx);
    // An explicit --ctx past the model's limit is refused; the prompt and --max-tokens of
    // a --prompt-ids run may take it there, with a warning.
    let limit = model.cfg.context_max;
    if let Some(c) = rt.ctx.filter(|&c| c > limit && !rt.ctx_over_limit) {
        bail!("--ctx {c} is beyond this model's context limit of {limit} tokens (its max_position_embeddings): lower --ctx, or add --ctx-over-limit to run past the trained context anyway");
    }
    if cfg.context_max > limit {
        eprintln!("warning: a context of {} tokens, beyond this model's limit of {limit}: output past {limit} tokens degrades", cfg.context_max);
    }
    cfg.sequences_max = sequences;
    Ok(match cluster {
        None => Engine::Drive(Generator::new(model, cfg)?),
        Some((comm, placement)) => {
            let rank = Rank::new(model, comm, placement, cfg.clone())?;
            if rank.rank() == 0 {
                Engine::Drive(Generator::with_stepper(Box::new(rank.leader()), cfg))
            } else {
                Engine::Follow(rank)
            }
        }
    })
}

fn generate(a: GenerateArgs) -> Result<()> {
    let t0 = Instant::now();
    let id_prompts = a.prompt_ids.iter().map(|p| parse_ids(p)).collect::<Result<Vec<_>>>()?;
    if !(1..=tessera_engine::generate::SEQUENCES_MAX).contains(&a.parallel) {
        bail!("--parallel {}: choose 1..={}", a.parallel, tessera_engine::generate::SEQUENCES_MAX);
    }
    let sequences = id_prompts.len().max(1) * a.parallel;
    let min_ctx = id_prompts.iter().map(|p| p.len() + a.max_tokens + 1).max().unwrap_or(0);
    let Loaded { model, cluster } = load_for(&a.model, &a.runtime, Fit { sequences, min_ctx })?;
    let leads = cluster.as_ref().is_none_or(|(c, _)| c.rank() == 0);
    let tok = if leads && id_prompts.is_empty() { Some(Tokenizer::from_checkpoint(model.checkpoint())?) } else { None };
    let mut gen = match engine_for(&model, cluster, &a.runtime, min_ctx, sequences)? {
        Engine::Follow(rank) => return rank.follow().map(drop).map_err(Into::into),
        Engine::Drive(g) => g,
    };
    if !id_prompts.is_empty() {
        return generate_ids(&mut gen, &id_prompts, &a);
    }
    let tok = tok.expect("the leader has the tokenizer");
    let prompt_ids = match (&a.prompt, &a.chat) {
        (Some(p), _) => tok.encode(p, true).map_err(anyhow::Error::msg)?,
        (None, Some(user)) => {
            let mut messages = Vec::new();
            if let Some(s) = &a.system {
                messages.push(Message::new("system", s));
            }
            messages.push(Message::new("user", user));
            chat_ids(&model, &tok, &messages)?
        }
        (None, None) => bail!("give --prompt or --chat"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens (this tokenizer adds no BOS token to {:?}): give some text", a.prompt.as_deref().unwrap_or_default());
    }
    let load_secs = t0.elapsed().as_secs_f64();
    let sampling = sampling_of(&a);
    if let Some(path) = &a.json_schema {
        let constraint = json_schema_constraint(path, &tok, model.cfg.vocab)?;
        return generate_constrained(&mut gen, &tok, &prompt_ids, &a, constraint);
    }
    if a.parallel > 1 {
        return generate_text_parallel(&mut gen, &tok, &prompt_ids, &a);
    }
    let mut stream = tessera_model::TextStream::new();
    let mut out = std::io::stdout().lock();
    let mut write_err = None;
    let (ids, reason, stats) = gen.generate(&prompt_ids, a.max_tokens, &sampling, &tok.stop, |id| {
        match stream.push(&tok, id) {
            Ok(text) => {
                if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                    write_err = Some(e);
                    return false;
                }
            }
            Err(e) => {
                write_err = Some(std::io::Error::other(e));
                return false;
            }
        }
        true
    })?;
    if let Some(e) = write_err {
        bail!("writing output: {e}");
    }
    let _ = writeln!(out);
    if a.print_ids {
        let _ = writeln!(out, "ids: {}", ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(","));
    }
    let why = match reason {
        StopReason::Stop => "stop token",
        StopReason::Length => "max tokens",
        StopReason::Context => "context full",
        StopReason::Cancelled => "cancelled",
        StopReason::Grammar => "grammar failed",
    };
    eprintln!(
        "\n[load {:.2} s] prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s | time to first token: {:.0} ms | stopped: {why} | {} threads, {}",
        load_secs,
        stats.prompt_tokens,
        stats.prompt_tok_per_sec(),
        stats.generated_tokens,
        stats.decode_tok_per_sec(),
        stats.time_to_first_token_secs * 1000.0,
        gen.config().threads,
        model.isa().name(),
    );
    Ok(())
}

/// The checkpoint's chat template (an error naming the file where it has none).
pub(crate) fn chat_template(model: &Model) -> Result<ChatTemplate> {
    ChatTemplate::from_checkpoint(model.checkpoint())?
        .with_context(|| format!("{} has no chat template: use --prompt for raw text", model.checkpoint().path.display()))
}

/// The prompt ids of a conversation: the template's markers special, the messages' text
/// plain (`ChatTemplate::encode`).
fn chat_ids(model: &Model, tok: &Tokenizer, messages: &[Message]) -> Result<Vec<u32>> {
    Ok(chat_template(model)?.encode(tok, messages)?)
}

fn tokenize(path: &Path, text: &str, chat: bool) -> Result<()> {
    let model = tessera_model::load_model(path).with_context(|| format!("loading {}", path.display()))?;
    let tok = Tokenizer::from_checkpoint(model.checkpoint())?;
    let ids = if chat { chat_ids(&model, &tok, &[Message::new("user", text)])? } else { tok.encode(text, true).map_err(anyhow::Error::msg)? };
    let list: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    println!("{}", list.join(","));
    Ok(())
}

fn sampling_of(a: &GenerateArgs) -> SamplingParams {
    SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repeat_penalty,
        presence_penalty: a.presence_penalty,
        penalty_window: a.penalty_window,
        seed: a.seed,
        ..SamplingParams::default()
    }
}

/// Generation from token ids: no tokenizer, ids out (tests, models without one).
/// `1,2,3` → ids.
fn parse_ids(text: &str) -> Result<Vec<u32>> {
    let ids = text
        .split(',')
        .map(|t| t.trim().parse::<u32>().with_context(|| format!("--prompt-ids: {t:?} is not a token id")))
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("--prompt-ids: empty prompt");
    }
    Ok(ids)
}

/// Every prompt × `--parallel`, each with its own seed.
fn requests_of(prompts: &[Vec<u32>], a: &GenerateArgs) -> Vec<tessera_engine::Request> {
    let base = sampling_of(a);
    let mut out = Vec::with_capacity(prompts.len() * a.parallel);
    for p in prompts {
        for _ in 0..a.parallel {
            let sampling = SamplingParams { seed: base.seed.wrapping_add(out.len() as u64), ..base.clone() };
            out.push(tessera_engine::Request::new(p.clone(), a.max_tokens, sampling));
        }
    }
    out
}

fn print_batch_stats(s: &tessera_engine::BatchStats) {
    eprintln!(
        "{} sequences in {} micro-batches: prompt {} tokens | generated {} tokens in {} steps, {:.2} s: {:.1} tok/s overall, {:.1} tok/s once all were decoding",
        s.sequences,
        s.micro_batches,
        s.prompt_tokens,
        s.generated_tokens,
        s.steps,
        s.secs,
        s.tok_per_sec(),
        s.decode_tok_per_sec()
    );
}

fn generate_ids(gen: &mut Generator, prompts: &[Vec<u32>], a: &GenerateArgs) -> Result<()> {
    if prompts.len() == 1 && a.parallel == 1 {
        let (ids, _, stats) = gen.generate(&prompts[0], a.max_tokens, &sampling_of(a), &[], |_| true)?;
        println!("ids: {}", ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(","));
        eprintln!(
            "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s | {} threads",
            stats.prompt_tokens,
            stats.prompt_tok_per_sec(),
            stats.generated_tokens,
            stats.decode_tok_per_sec(),
            gen.config().threads
        );
        return Ok(());
    }
    let (done, stats) = tessera_engine::generate_batch(gen.stepper(), &requests_of(prompts, a), &[], |_, _| true)?;
    for c in &done {
        println!("ids: {}", c.ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(","));
    }
    print_batch_stats(&stats);
    Ok(())
}

/// The grammar of `--json-schema FILE`, checked.
fn json_schema_constraint(path: &Path, tok: &Tokenizer, vocab: usize) -> Result<tessera_engine::SharedSource> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--json-schema {}", path.display()))?;
    let schema: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("--json-schema {}: not JSON", path.display()))?;
    let grammars = tessera_grammar::Grammars::new(tok, vocab).map_err(|e| anyhow::anyhow!("--json-schema: structured output is not available for this model: {e}"))?;
    grammars.compile(&tessera_grammar::Spec::JsonSchema(schema)).map_err(|e| anyhow::anyhow!("--json-schema {}: {e}", path.display()))
}

/// A text prompt under a grammar (`--json-schema`): through the scheduler, which masks
/// each step's logits; one sequence streams its text, several print one after another.
fn generate_constrained(gen: &mut Generator, tok: &Tokenizer, prompt: &[u32], a: &GenerateArgs, constraint: tessera_engine::SharedSource) -> Result<()> {
    let requests: Vec<_> = requests_of(&[prompt.to_vec()], a).into_iter().map(|r| tessera_engine::Request { constraint: Some(constraint.clone()), ..r }).collect();
    let mut stream = tessera_model::TextStream::new();
    let mut out = std::io::stdout().lock();
    let streamed = requests.len() == 1;
    let (done, stats) = tessera_engine::generate_batch(gen.stepper(), &requests, &tok.stop, |_, id| {
        if streamed && !tok.stop.contains(&id) {
            if let Ok(text) = stream.push(tok, id) {
                let _ = out.write_all(text.as_bytes()).and_then(|_| out.flush());
            }
        }
        true
    })?;
    for (i, c) in done.iter().enumerate() {
        if let Some(e) = &c.error {
            bail!("sequence {i}: the grammar failed: {e}");
        }
        if !streamed {
            writeln!(out, "--- sequence {i} ({:?}) ---\n{}", c.reason, tok.decode(&c.ids, true).map_err(anyhow::Error::msg)?).context("writing output")?;
        }
        if a.print_ids {
            writeln!(out, "\nids: {}", c.ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")).context("writing output")?;
        }
    }
    let _ = writeln!(out);
    print_batch_stats(&stats);
    Ok(())
}

/// `--parallel N` with a text prompt: N completions, printed one after another.
fn generate_text_parallel(gen: &mut Generator, tok: &Tokenizer, prompt: &[u32], a: &GenerateArgs) -> Result<()> {
    let (done, stats) = tessera_engine::generate_batch(gen.stepper(), &requests_of(&[prompt.to_vec()], a), &tok.stop, |_, _| true)?;
    let mut out = std::io::stdout().lock();
    for (i, c) in done.iter().enumerate() {
        let text = tok.decode(&c.ids, true).map_err(anyhow::Error::msg)?;
        writeln!(out, "--- sequence {i} ({:?}) ---\n{text}", c.reason).context("writing output")?;
        if a.print_ids {
            writeln!(out, "ids: {}", c.ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")).context("writing output")?;
        }
    }
    print_batch_stats(&stats);
    Ok(())
}

fn logits(a: LogitsArgs) -> Result<()> {
    let Loaded { model, cluster } = load_for(&a.model, &a.runtime, Fit { sequences: 1, min_ctx: a.tokens.len() })?;
    let mut gen = match engine_for(&model, cluster, &a.runtime, a.tokens.len(), 1)? {
        Engine::Follow(rank) => return rank.follow().map(drop).map_err(Into::into),
        Engine::Drive(g) => g,
    };
    let logits = gen.logits_all(&a.tokens)?;
    npy::write_f32(&a.out, &[a.tokens.len(), model.cfg.vocab], &logits)
        .with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!("wrote {} [{} x {}] float32", a.out.display(), a.tokens.len(), model.cfg.vocab);
    Ok(())
}
