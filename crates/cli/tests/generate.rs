//! The command line as a first-time user meets it: `tessera generate --json-schema` (the
//! default model's outputs under a schema, checked by hand here; the server's by the
//! `jsonschema` package in serve.rs), a model named by its Hugging Face repo id, limits
//! (context, memory, a full disk) refused with what is needed and what is there.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn smollm2() -> PathBuf {
    let m = repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(m.exists(), "{} is missing: run scripts/fetch-model (scripts/test does)", m.display());
    m
}

fn generate(schema: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["generate", "--model", &smollm2().to_string_lossy(), "--chat", "Describe a pet as JSON.", "--json-schema", &schema.to_string_lossy(), "--threads", "2", "--ctx", "1024"])
        .args(extra)
        .output()
        .unwrap()
}

/// Four sampled outputs and the greedy one each parse, and follow the schema: the keys
/// required and no others, an enum, integer bounds, a string length bound, an array of
/// booleans of at most 3.
#[test]
fn json_schema_outputs_follow_the_schema() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-json-schema");
    std::fs::create_dir_all(&dir).unwrap();
    let schema = dir.join("pet.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["cat", "dog", "fish"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "vaccinated": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["name", "kind", "age", "vaccinated"], "additionalProperties": false}"#,
    )
    .unwrap();
    let sampled = generate(&schema, &["--temperature", "1", "--seed", "11", "--parallel", "4", "--max-tokens", "80"]);
    assert!(sampled.status.success(), "{}", String::from_utf8_lossy(&sampled.stderr));
    let greedy = generate(&schema, &["--max-tokens", "80"]);
    assert!(greedy.status.success(), "{}", String::from_utf8_lossy(&greedy.stderr));
    let text = String::from_utf8(sampled.stdout).unwrap();
    let mut outputs: Vec<String> = text.split("--- sequence ").skip(1).map(|s| s.split_once('\n').unwrap().1.trim().to_string()).collect();
    assert_eq!(outputs.len(), 4, "{text}");
    outputs.push(String::from_utf8(greedy.stdout).unwrap().trim().to_string());
    for out in &outputs {
        let v: serde_json::Value = serde_json::from_str(out).unwrap_or_else(|e| panic!("not JSON ({e}): {out:?}"));
        let o = v.as_object().unwrap_or_else(|| panic!("not an object: {out}"));
        let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, ["age", "kind", "name", "vaccinated"], "{out}");
        assert!(o["name"].as_str().is_some_and(|n| n.chars().count() <= 12), "{out}");
        assert!(["cat", "dog", "fish"].contains(&o["kind"].as_str().unwrap_or("")), "{out}");
        assert!(o["age"].as_u64().is_some_and(|a| a <= 30), "{out}");
        let list = o["vaccinated"].as_array().unwrap_or_else(|| panic!("{out}"));
        assert!(list.len() <= 3 && list.iter().all(serde_json::Value::is_boolean), "{out}");
    }
}

/// A schema llguidance cannot honour, and a file that is not JSON, are errors naming
/// the file and the reason; nothing is generated.
#[test]
fn json_schema_errors_name_the_file_and_the_reason() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-json-schema-bad");
    std::fs::create_dir_all(&dir).unwrap();
    let unsupported = dir.join("if.json");
    std::fs::write(&unsupported, r#"{"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}"#).unwrap();
    let out = generate(&unsupported, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && out.stdout.is_empty(), "{err}");
    assert!(err.contains("if.json") && err.contains("if") && err.contains("then"), "{err}");
    let not_json = dir.join("broken.json");
    std::fs::write(&not_json, "{\"type\": ").unwrap();
    let out = generate(&not_json, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("broken.json") && err.contains("not JSON"), "{err}");
}

fn tessera(args: &[&str], env: &[(&str, &Path)]) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.args(args).env_remove("HF_HUB_CACHE").env_remove("HF_HOME");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// A Hugging Face repo id finds the model in the local cache (`HF_HUB_CACHE`, or
/// `HF_HOME/hub`): its snapshot's only GGUF, or the file named after the id; the same ids
/// as the path itself. Several GGUF files, a repo not in the cache: errors that say what to
/// do, and nothing is downloaded.
#[test]
fn a_repo_id_finds_the_model_in_the_hugging_face_cache() {
    let home = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-hf-home");
    let _ = std::fs::remove_dir_all(&home);
    let repo = home.join("hub/models--HuggingFaceTB--SmolLM2-135M-Instruct");
    let snapshot = repo.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd\n").unwrap();
    std::os::unix::fs::symlink(smollm2(), snapshot.join("model.Q4_1.gguf")).unwrap();
    let run = |model: &str, env: &[(&str, &Path)]| tessera(&["generate", "--model", model, "--prompt-ids", "1,2,3", "--max-tokens", "3", "--threads", "1"], env);
    let direct = run(&smollm2().to_string_lossy(), &[]);
    assert!(direct.status.success(), "{}", String::from_utf8_lossy(&direct.stderr));
    for (id, env) in [("HuggingFaceTB/SmolLM2-135M-Instruct", ("HF_HOME", home.as_path())), ("HuggingFaceTB/SmolLM2-135M-Instruct/model.Q4_1.gguf", ("HF_HUB_CACHE", &home.join("hub")))] {
        let out = run(id, &[env]);
        assert!(out.status.success(), "{id}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.stdout, direct.stdout, "{id}");
    }
    std::os::unix::fs::symlink(smollm2(), snapshot.join("model.Q8_0.gguf")).unwrap();
    let out = run("HuggingFaceTB/SmolLM2-135M-Instruct", &[("HF_HOME", &home)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("2 GGUF files") && err.contains("model.Q4_1.gguf") && err.contains("model.Q8_0.gguf"), "{err}");
    let out = run("nobody/nothing", &[("HF_HOME", &home)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("models--nobody--nothing") && err.contains("never downloads"), "{err}");
}

/// The first-time user's trips: a context above the model's limit is refused naming it
/// (and allowed with --ctx-over-limit), an OS error is said once, `bench --pp 0` skips
/// the prompt test, and every subcommand's --help shows an example.
#[test]
fn first_time_users_get_clear_answers() {
    let m = smollm2();
    let m = m.to_string_lossy();
    let out = tessera(&["generate", "--model", &m, "--prompt", "hi", "--ctx", "9000"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--ctx 9000") && err.contains("8192") && err.contains("--ctx-over-limit"), "{err}");
    let out = tessera(&["generate", "--model", &m, "--prompt", "hi", "--ctx", "9000", "--ctx-over-limit", "--max-tokens", "2", "--threads", "1"], &[]);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stderr).contains("beyond this model's limit of 8192"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = tessera(&["generate", "--model", "/no/such/model.gguf", "--prompt", "hi"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("os error 2").count(), 1, "{err}");
    let out = tessera(&["bench", "--model", &m, "--pp", "0", "--tg", "4", "--batch", "1", "--repeat", "1", "--threads", "1"], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("| tg4") && !text.contains("| pp"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for sub in ["generate", "logits", "tokenize", "inspect", "shard", "launch", "share", "doctor", "plan", "bench", "serve"] {
        let out = tessera(&[sub, "--help"], &[]);
        let help = String::from_utf8_lossy(&out.stdout);
        let shows = help.contains(&format!("tessera {sub} ")) || help.contains(&format!("-- {sub} "));
        assert!(help.contains("Example") && shows, "{sub} --help has no example of it:\n{help}");
    }
}

/// A run whose weights and caches cannot fit this node's available memory is refused
/// before loading, with what it needs (weights, cache at ctx × sequences) and what the
/// node has; --no-memory-check loads it anyway (the caches are committed only as they
/// are written, so a short run still works).
#[test]
fn a_run_that_cannot_fit_is_refused_before_loading() {
    let m = smollm2();
    let m = m.to_string_lossy();
    // 256 sequences × 8192 tokens of f32 cache: 90 GiB.
    let big = ["generate", "--model", &m, "--prompt", "hi", "--parallel", "256", "--ctx", "8192", "--kv-cache", "f32", "--max-tokens", "1", "--threads", "1"];
    let out = tessera(&big, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("needs") && err.contains("256 × 8192 tokens") && err.contains("GiB available") && err.contains("--no-memory-check"), "{err}");
    let out = tessera(&[&big[..], &["--no-memory-check"]].concat(), &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A prompt that encodes to no tokens (SmolLM2's tokenizer adds no BOS) is refused by
/// name, not as an engine step's complaint.
#[test]
fn an_empty_prompt_is_refused_by_name() {
    let m = smollm2();
    let out = tessera(&["generate", "--model", &m.to_string_lossy(), "--prompt", "", "--max-tokens", "1", "--threads", "1"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("the prompt encodes to no tokens") && err.contains("give some text"), "{err}");
}

/// A write that fails midway (a full disk; here a file-size limit makes the kernel
/// refuse the slice's bytes) leaves no half shard behind, neither at `--out` nor beside
/// it, and says what failed; the same command with room writes the whole slice.
#[test]
fn a_shard_that_cannot_be_written_leaves_nothing_half_written() {
    use std::os::unix::process::CommandExt;
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-shard-full");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("r0");
    let args = ["shard", "--model", &smollm2().to_string_lossy(), "--world", "2", "--tp", "2", "--rank", "0", "--out", &out.to_string_lossy()].map(String::from);
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.args(&args);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        c.pre_exec(|| {
            // Writes past 8 MiB fail with EFBIG (the signal that would kill the writer ignored).
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let lim = libc::rlimit { rlim_cur: 8 << 20, rlim_max: 8 << 20 };
            libc::setrlimit(libc::RLIMIT_FSIZE, &lim);
            Ok(())
        });
    }
    let failed = c.output().unwrap();
    let err = String::from_utf8_lossy(&failed.stderr);
    assert!(!failed.status.success(), "{err}");
    assert!(err.contains("failed") && err.contains("nothing was left there"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    let ok = Command::new(env!("CARGO_BIN_EXE_tessera")).args(&args).output().unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let mut files: Vec<String> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    assert_eq!(files, ["model.gguf", "tessera-shard.json"]);
    assert!(!dir.join("r0.partial").exists());
}
