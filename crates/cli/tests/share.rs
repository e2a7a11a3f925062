//! `tessera share` with real processes on loopback: every rank ends up with its slice (or
//! the whole model), runs from the received slices give one node's ids, a share killed
//! midway sends only what is missing when run again, a corrupted chunk is caught and sent
//! again, `--verify` finds a changed byte, and a rank with the wrong secret is refused.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-share").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tessera(n: usize, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera"));
    if n > 1 {
        cmd.args(["launch", "-n", &n.to_string(), "--"]);
    }
    cmd.args(args).current_dir(repo()).env_remove("TESSERA_RANK").env_remove("RANK");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("running tessera")
}

fn ok(out: &Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{what} failed ({}):\n{}\n{err}", out.status, String::from_utf8_lossy(&out.stdout));
    format!("{}{err}", String::from_utf8_lossy(&out.stdout))
}

fn ids(model: &str, n: usize, placement: &[&str]) -> String {
    let mut args = vec!["generate", "--model", model, "--prompt-ids", "1,50,34,28,43,31", "--max-tokens", "12", "--threads", "1", "--kv-cache", "f32"];
    args.extend(placement);
    let out = ok(&tessera(n, &args, &[]), &format!("generate {model} {placement:?}"));
    out.lines().find_map(|l| l.split("ids: ").nth(1)).unwrap_or_else(|| panic!("no ids in {out}")).trim().to_string()
}

#[test]
fn each_rank_gets_its_slice_and_runs_as_one_node() {
    for (model, placement) in [
        ("models/SmolLM2-135M-Instruct.Q4_1.gguf", vec!["--tp", "3"]),
        ("models/SmolLM2-135M-Instruct.Q4_1.gguf", vec!["--pp", "3"]),
        ("tests/fixtures/qwen3_moe", vec!["--ep", "3"]),
        ("tests/fixtures/qwen3_moe", vec!["--pp", "3"]),
    ] {
        let dir = scratch(&format!("slices-{}-{}", Path::new(model).file_name().unwrap().to_string_lossy(), placement.join("")));
        let out = format!("{}/r{{rank}}", dir.display());
        let mut args = vec!["share", "--model", model, "--out", &out, "--chunk-mib", "1"];
        args.extend(&placement);
        let log = ok(&tessera(3, &args, &[]), "share");
        assert!(log.matches("0 sent again after a failed hash").count() == 2, "both other ranks got every chunk right the first time: {log}");
        for r in 0..3 {
            let d = dir.join(format!("r{r}"));
            assert!(d.join("tessera-shard.json").exists() && d.join("tessera-share.json").exists() && !dir.join(format!("r{r}.partial")).exists(), "{}", d.display());
        }
        assert_eq!(ids(&out, 3, &placement), ids(model, 1, &[]), "{model} {placement:?} from the shared slices");
    }
}

fn same_bytes(a: &Path, b: &Path) -> bool {
    std::fs::read(a).unwrap() == std::fs::read(b).unwrap()
}

#[test]
fn a_killed_share_resumes_and_a_bad_chunk_is_sent_again() {
    let model = repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let dir = scratch("resume");
    let out = format!("{}/r{{rank}}", dir.display());
    let args = ["launch", "-n", "2", "--", "share", "--model", model.to_str().unwrap(), "--out", &out, "--full", "--chunk-mib", "1"];
    // Slowed to 30 ms a chunk, killed (the launcher and its ranks, SIGKILL) midway.
    let mut child = {
        use std::os::unix::process::CommandExt;
        Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).env("TESSERA_SHARE_PAUSE_MS", "30").stdout(Stdio::null()).stderr(Stdio::null()).process_group(0).spawn().unwrap()
    };
    std::thread::sleep(std::time::Duration::from_millis(2000));
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.wait();
    assert!(dir.join("r1.partial").exists() && !dir.join("r1").exists(), "killed before the end: no output, a partial one");
    // Run again, with one chunk corrupted on the way: it is caught, sent again, and only
    // the missing chunks travel.
    let log = ok(&tessera(1, &args, &[("TESSERA_SHARE_CORRUPT_CHUNK", "2")]), "share again");
    assert!(log.contains("failed its hash: asking for it again") && log.contains("1 sent again after a failed hash"), "{log}");
    let line = log.lines().find(|l| l.contains("rank 1: sent")).unwrap();
    let already: usize = line.split(", ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(already > 0, "the second run sent only what was missing: {line}");
    assert!(same_bytes(&dir.join("r1").join(model.file_name().unwrap()), &model), "the copy is the source");
    // A finished share run again sends nothing.
    let log = ok(&tessera(1, &args, &[]), "share a third time");
    assert!(log.contains("rank 1: sent 0.0 MiB"), "{log}");
    // --verify passes, then finds a changed byte.
    ok(&tessera(2, &["share", "--model", model.to_str().unwrap(), "--out", &out, "--verify"], &[]), "verify");
    let f = dir.join("r1").join(model.file_name().unwrap());
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[3 << 20] ^= 1;
    std::fs::write(&f, bytes).unwrap();
    let v = tessera(2, &["share", "--model", model.to_str().unwrap(), "--out", &out, "--verify"], &[]);
    let err = String::from_utf8_lossy(&v.stderr);
    assert!(!v.status.success() && err.contains("chunk 3 of") && err.contains("does not match its hash"), "{err}");
}

#[test]
fn a_rank_with_the_wrong_secret_is_refused() {
    let dir = scratch("secret");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let master = format!("127.0.0.1:{port}");
    let spawn = |rank: &str, secret: &str| {
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["share", "--model", "tests/fixtures/qwen3", "--out", &format!("{}/r{{rank}}", dir.display()), "--full"])
            .current_dir(repo())
            .envs([("TESSERA_RANK", rank), ("TESSERA_WORLD_SIZE", "2"), ("TESSERA_MASTER_ADDR", master.as_str()), ("TESSERA_CLUSTER_SECRET", secret)])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut leader = spawn("0", "the right secret, 32 bytes long..");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let joiner = spawn("1", "a wrong secret, also long enough.").wait_with_output().unwrap();
    let _ = leader.kill();
    let _ = leader.wait();
    let err = String::from_utf8_lossy(&joiner.stderr);
    assert!(!joiner.status.success() && (err.contains("secret") || err.contains("auth")), "{err}");
    assert!(!dir.join("r1").exists(), "nothing written");
}

#[test]
fn the_whole_model_goes_down_a_chain() {
    let model = repo().join("tests/fixtures/qwen3_moe");
    let dir = scratch("chain");
    let out = format!("{}/r{{rank}}", dir.display());
    let args = ["share", "--model", model.to_str().unwrap(), "--out", &out, "--full", "--chunk-mib", "1"];
    let log = ok(&tessera(3, &args, &[("TESSERA_SHARE_CORRUPT_CHUNK", "0")]), "share --full to 3 ranks");
    assert!(log.contains("the chunks went down the chain 1 → 2") && log.contains("on to rank 2") && log.contains("1 sent again after a failed hash"), "{log}");
    for r in 1..3 {
        for f in ["model.safetensors", "config.json"] {
            assert!(same_bytes(&dir.join(format!("r{r}")).join(f), &model.join(f)), "rank {r}'s {f}");
        }
    }
    // Both already hold it all: nothing travels.
    let log = ok(&tessera(3, &args, &[]), "share --full again");
    assert!(log.contains("sent 0.0 MiB"), "{log}");
    assert_eq!(ids(&format!("{}/r2", dir.display()), 1, &[]), ids(model.to_str().unwrap(), 1, &[]));
}

#[test]
fn an_output_that_is_not_the_shares_is_refused_by_name() {
    let dir = scratch("taken");
    std::fs::create_dir_all(dir.join("r1")).unwrap();
    std::fs::write(dir.join("r1/notes.txt"), "mine").unwrap();
    let out = format!("{}/r{{rank}}", dir.display());
    let o = tessera(2, &["share", "--model", "tests/fixtures/qwen3", "--out", &out, "--full"], &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("r1 exists and is not this share's output"), "{err}");
    assert_eq!(std::fs::read_to_string(dir.join("r1/notes.txt")).unwrap(), "mine", "left alone");
}
