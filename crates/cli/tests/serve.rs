//! `tessera serve` as a real process over real HTTP (a plain HTTP/1.1 client here; the
//! official `openai` client in `openai_client_talks_to_the_server`): the default model,
//! greedy chat equal to `tessera generate --chat`, streaming, concurrency, stop strings,
//! the queue's bound, cancellation, API keys, and every error's status and shape.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn smollm2() -> PathBuf {
    let m = repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(m.exists(), "{} is missing: run scripts/fetch-model (scripts/test does)", m.display());
    m
}

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// A running server, stopped when dropped.
struct Server {
    child: Child,
    addr: String,
    /// What the server printed (shown when a test fails).
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- the server's stderr ---\n{}", self.stderr.lock().unwrap());
        }
    }
}

fn serve(extra: &[&str]) -> Server {
    serve_on(1, extra)
}

/// `tessera serve` alone (`ranks` 1) or under `tessera launch -n RANKS` (one thread each).
fn serve_on(ranks: usize, extra: &[&str]) -> Server {
    serve_model(ranks, &smollm2(), extra)
}

fn serve_model(ranks: usize, model: &Path, extra: &[&str]) -> Server {
    serve_with(ranks, model, extra, &[])
}

/// [`spawn_server`], then waits (30 s at most) until `/ready` says every rank has loaded.
fn serve_with(ranks: usize, model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
    let mut server = spawn_server(ranks, model, extra, env);
    let t0 = Instant::now();
    while http(&server.addr, "GET", "/ready", &[], "").0 != 200 {
        if let Some(exit) = server.child.try_wait().unwrap() {
            panic!("tessera serve exited while loading: {exit:?}");
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "tessera serve never became ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    server
}

/// A server process, returned once its port answers (the model may still be loading).
fn spawn_server(ranks: usize, model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera"));
    cmd.envs(env.iter().copied());
    if ranks > 1 {
        cmd.args(["launch", "-n", &ranks.to_string(), "--"]);
    }
    let threads = if ranks > 1 { "1" } else { "2" };
    // A context of 1024 tokens unless the test names one (the tiny MoE's limit is 256).
    let ctx: &[&str] = if extra.contains(&"--ctx") { &[] } else { &["--ctx", "1024"] };
    let mut child = cmd
        .args(["serve", "--model", &model.to_string_lossy(), "--port", "0", "--threads", threads])
        .args(ctx)
        .args(extra)
        .env_remove("TESSERA_RANK")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("starting tessera serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let addr = loop {
        let line = lines.next().unwrap_or_else(|| panic!("tessera serve exited before listening:\n{}", stderr.lock().unwrap())).unwrap();
        stderr.lock().unwrap().push_str(&format!("{line}\n"));
        if let Some(a) = line.split("listening on http://").nth(1) {
            break a.trim().to_string();
        }
    };
    // Keep draining stderr so the server never blocks on it.
    let kept = stderr.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            kept.lock().unwrap().push_str(&format!("{line}\n"));
        }
    });
    Server { child, addr, stderr }
}

/// One request; the status, the headers (lower-case names) and the body.
fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, Vec<(String, String)>, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("a response head");
    let mut lines = head.lines();
    let status: u16 = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines.filter_map(|l| l.split_once(": ")).map(|(k, v)| (k.to_ascii_lowercase(), v.to_string())).collect();
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked { dechunk(rest) } else { rest.to_string() };
    (status, headers, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

fn post(addr: &str, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let (status, _, text) = http(addr, "POST", path, &[], &body.to_string());
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
}

fn chat(content: &str, max_tokens: usize) -> serde_json::Value {
    serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": max_tokens})
}

/// `tessera generate --chat` for one message: the text it prints.
fn generate_chat(content: &str, max_tokens: usize) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["generate", "--model", &smollm2().to_string_lossy(), "--chat", content, "--max-tokens", &max_tokens.to_string(), "--threads", "2", "--ctx", "1024"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    text.strip_suffix('\n').unwrap_or(&text).to_string()
}

/// The `data:` payloads of an SSE body, in order.
fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(String::from).collect()
}

/// A greedy chat completion is `tessera generate --chat`'s text; streamed, its chunks
/// concatenate to the same text, `include_usage` adds one chunk with no choices and the
/// usage, and `[DONE]` ends it; /v1/completions and the tokenizer routes agree.
#[test]
fn greedy_chat_equals_generate_streamed_or_not() {
    let server = serve(&[]);
    let question = "What is the capital of France?";
    let want = generate_chat(question, 24);
    let (status, v) = post(&server.addr, "/v1/chat/completions", &chat(question, 24));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap(), want);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 24);
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();

    let mut req = chat(question, 24);
    req["stream"] = true.into();
    req["stream_options"] = serde_json::json!({"include_usage": true});
    let (status, headers, body) = http(&server.addr, "POST", "/v1/chat/completions", &[], &req.to_string());
    assert_eq!(status, 200);
    assert!(headers.iter().any(|(k, v)| k == "content-type" && v.starts_with("text/event-stream")), "{headers:?}");
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<serde_json::Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    let text: String = chunks.iter().filter_map(|c| c["choices"].get(0)?.get("delta")?.get("content")?.as_str().map(String::from)).collect();
    assert_eq!(text, want, "streamed chunks");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0, "the usage chunk has no choices");
    assert_eq!(usage["usage"]["completion_tokens"], 24);
    assert_eq!(usage["usage"]["prompt_tokens"].as_u64().unwrap(), prompt_tokens);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks.iter().filter(|c| c.get("usage").is_some()).count(), 1);
    // Without include_usage: no usage chunk.
    req.as_object_mut().unwrap().remove("stream_options");
    let (_, _, body) = http(&server.addr, "POST", "/v1/chat/completions", &[], &req.to_string());
    assert!(!body.contains("\"usage\""), "{body}");

    // The same prompt through /tokenize, then /v1/completions on those ids.
    let (status, t) = post(&server.addr, "/tokenize", &serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": question}]}));
    assert_eq!(status, 200);
    assert_eq!(t["count"].as_u64().unwrap(), prompt_tokens);
    let (status, c) = post(&server.addr, "/v1/completions", &serde_json::json!({"model": MODEL, "prompt": t["tokens"], "temperature": 0, "max_tokens": 24}));
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["choices"][0]["text"].as_str().unwrap(), want);
    let (status, d) = post(&server.addr, "/detokenize", &serde_json::json!({"tokens": t["tokens"]}));
    assert_eq!(status, 200);
    assert!(d["prompt"].as_str().unwrap().contains(question));
}

/// Under `tessera launch` (rank 0 serves HTTP, the others follow its step plans), TP2 and
/// PP2 answer a greedy chat as `generate --chat` on one node does, alone and with
/// requests beside it.
#[test]
fn serving_under_launch_gives_one_nodes_output() {
    let question = "What is the capital of France?";
    let want = generate_chat(question, 16);
    for placement in [["--tp", "2"], ["--pp", "2"]] {
        let server = serve_on(2, &[placement[0], placement[1], "--parallel", "3"]);
        let (status, v) = post(&server.addr, "/v1/chat/completions", &chat(question, 16));
        assert_eq!(status, 200, "{placement:?}: {v}");
        assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap(), want, "{placement:?}");
        let together: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3).map(|_| s.spawn(|| post(&server.addr, "/v1/chat/completions", &chat(question, 16)))).collect();
            handles.into_iter().map(|h| h.join().unwrap().1["choices"][0]["message"]["content"].as_str().unwrap().to_string()).collect()
        });
        assert!(together.iter().all(|t| *t == want), "{placement:?}: concurrent requests {together:?}");
        // Again, with two choices: every rank copies the cached prompt.
        let mut two = chat(question, 16);
        two["n"] = 2.into();
        let (status, v) = post(&server.addr, "/v1/chat/completions", &two);
        assert_eq!(status, 200, "{placement:?}: {v}");
        assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{placement:?}: {v}");
        for k in 0..2 {
            assert_eq!(v["choices"][k]["message"]["content"].as_str().unwrap(), want, "{placement:?} choice {k}");
        }
    }
    // Expert parallelism, on a tiny MoE GGUF (8-bit activations, its byte-level
    // vocabulary): the same ids as one node, concurrent and with a cache hit.
    let moe = repo().join("tests/fixtures/gguf_moe/qwen3_moe.q8_0.gguf");
    let body = serde_json::json!({"model": "qwen3_moe.q8_0.gguf", "prompt": [5, 17, 99, 3, 64, 120, 7], "max_tokens": 12, "temperature": 0, "logprobs": 0});
    let ids = |v: &serde_json::Value| v["choices"][0]["logprobs"]["tokens"].clone();
    let single = serve_model(1, &moe, &["--ctx", "256"]);
    let (status, want) = post(&single.addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{want}");
    assert_eq!(ids(&want).as_array().map(Vec::len), Some(12), "{want}");
    let server = serve_model(2, &moe, &["--ctx", "256", "--ep", "2", "--parallel", "3"]);
    let three_at_once = |server: &Server| -> Vec<serde_json::Value> {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..3).map(|_| s.spawn(|| post(&server.addr, "/v1/completions", &body).1)).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    for v in &three_at_once(&server) {
        assert_eq!(ids(v), ids(&want), "EP2: {v}");
    }
    let again = post(&server.addr, "/v1/completions", &body).1;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 6, "{again}");
    assert_eq!(ids(&again), ids(&want));
    // Every rank's steps, collectives and memory reach /metrics (gathered every 2 s).
    let t0 = Instant::now();
    let rank_metric = |name: &str, rank: usize| -> Option<f64> {
        let (_, _, m) = http(&server.addr, "GET", "/metrics", &[], "");
        let key = format!("tessera:{name}{{rank=\"{rank}\"}} ");
        m.lines().find_map(|l| l.strip_prefix(&key)).map(|v| v.parse().unwrap())
    };
    while rank_metric("rank_steps_total", 1).unwrap_or(0.0) == 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "no per-rank metrics");
        std::thread::sleep(Duration::from_millis(100));
    }
    for rank in 0..2 {
        assert!(rank_metric("rank_steps_total", rank).unwrap() >= 12.0, "rank {rank}");
        assert!(rank_metric("rank_collective_seconds_total", rank).unwrap() > 0.0, "rank {rank}: EP exchanges tokens");
        assert!(rank_metric("rank_busy_seconds_total", rank).unwrap() >= rank_metric("rank_collective_seconds_total", rank).unwrap());
        assert!(rank_metric("rank_resident_bytes", rank).unwrap() > 1e6, "rank {rank}");
    }
    drop(server);
    // Data-parallel attention: the three requests spread over both ranks (each attends
    // for its own), the same ids; the repeat reuses its prefix on the rank that holds it.
    let server = serve_model(2, &moe, &["--ctx", "256", "--ep", "2", "--dp-attention", "--parallel", "3"]);
    for v in &three_at_once(&server) {
        assert_eq!(ids(v), ids(&want), "EP2 --dp-attention: {v}");
    }
    let again = post(&server.addr, "/v1/completions", &body).1;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 6, "{again}");
    assert_eq!(ids(&again), ids(&want));
}

/// 32 concurrent greedy requests (four times the slots) each get their output alone; a
/// seeded sample is the same alone and with 8 other requests running; a stop string
/// across tokens ends the text before it with finish_reason `stop`.
#[test]
fn concurrent_requests_seeds_and_stop_strings() {
    let server = serve(&["--parallel", "8"]);
    let questions: Vec<String> = (0..32).map(|i| format!("Write a short sentence about the number {i}.")).collect();
    let alone: Vec<String> = questions.iter().map(|q| post(&server.addr, "/v1/chat/completions", &chat(q, 16)).1["choices"][0]["message"]["content"].as_str().unwrap().to_string()).collect();
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = questions.iter().map(|q| s.spawn(|| post(&server.addr, "/v1/chat/completions", &chat(q, 16)))).collect();
        handles.into_iter().map(|h| h.join().unwrap().1["choices"][0]["message"]["content"].as_str().unwrap().to_string()).collect()
    });
    assert_eq!(together, alone, "concurrent requests differ from each alone");

    let mut sampled = chat("Invent a name for a cat.", 16);
    sampled["temperature"] = 0.9.into();
    sampled["seed"] = 1234.into();
    let by_itself = post(&server.addr, "/v1/chat/completions", &sampled).1;
    let beside = std::thread::scope(|s| {
        let others: Vec<_> = questions[..8].iter().map(|q| s.spawn(|| post(&server.addr, "/v1/chat/completions", &chat(q, 24)))).collect();
        let mine = s.spawn(|| post(&server.addr, "/v1/chat/completions", &sampled));
        others.into_iter().for_each(|h| assert_eq!(h.join().unwrap().0, 200));
        mine.join().unwrap().1
    });
    assert_eq!(beside["choices"][0]["message"]["content"], by_itself["choices"][0]["message"]["content"], "a seeded sample with 8 others running");
    // A logit bias of +100 on one token: every token is that one.
    let (_, t) = post(&server.addr, "/tokenize", &serde_json::json!({"prompt": " banana", "add_special_tokens": false}));
    let banana = t["tokens"][0].as_u64().unwrap();
    let mut biased = chat("Say something.", 5);
    biased["logit_bias"] = serde_json::json!({banana.to_string(): 100});
    let v = post(&server.addr, "/v1/chat/completions", &biased).1;
    let (_, d) = post(&server.addr, "/detokenize", &serde_json::json!({"tokens": [banana, banana, banana, banana, banana]}));
    assert_eq!(v["choices"][0]["message"]["content"], d["prompt"], "{v}");
    sampled["seed"] = 99.into();
    let other_seed = post(&server.addr, "/v1/chat/completions", &sampled).1;
    assert_ne!(other_seed["choices"][0]["message"]["content"], by_itself["choices"][0]["message"]["content"], "another seed, another sample");

    // A stop string in the middle of a known output, spanning tokens.
    let full = &alone[0];
    let cut = full.char_indices().map(|(i, _)| i).find(|&i| i >= full.len() / 2).unwrap();
    let stop: String = full[cut..].chars().take(3).collect();
    let want = &full[..full.find(&stop).unwrap()];
    let mut req = chat(&questions[0], 16);
    req["stop"] = serde_json::json!(["\u{1F980}never", stop]);
    let (status, v) = post(&server.addr, "/v1/chat/completions", &req);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap(), want, "stop {stop:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    req["stream"] = true.into();
    let (_, _, body) = http(&server.addr, "POST", "/v1/chat/completions", &[], &req.to_string());
    let data = sse_data(&body);
    let text: String = data.iter().filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok()?["choices"][0]["delta"]["content"].as_str().map(String::from)).collect();
    assert_eq!(text, want, "streamed with a stop string");
}

/// With one slot and one place in the queue, a third request is refused at once (429,
/// Retry-After); a client that disconnects mid-stream cancels its request, and the
/// waiting one runs; `/metrics` shows it all and ends with nothing running.
#[test]
fn queue_bound_cancellation_and_metrics() {
    let server = serve(&["--parallel", "1", "--queue-max", "1"]);
    let mut long = chat("Tell me a very long story about a dragon.", 400);
    long["stream"] = true.into();
    // A: streams, holding the slot.
    let mut a = TcpStream::connect(&server.addr).unwrap();
    let body = long.to_string();
    write!(a, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut reader = BufReader::new(a.try_clone().unwrap());
    let mut line = String::new();
    while !line.contains("\"content\"") || line.contains("\"content\":\"\"") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    // B: waits in the queue (not streamed, 8 tokens).
    let b = std::thread::spawn({
        let addr = server.addr.clone();
        move || post(&addr, "/v1/chat/completions", &chat("Say hi.", 8))
    });
    let t0 = Instant::now();
    let metric = |name: &str| -> f64 {
        let (_, _, m) = http(&server.addr, "GET", "/metrics", &[], "");
        m.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()).unwrap().parse().unwrap()
    };
    while metric("tessera:num_requests_waiting") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "B never waited");
        std::thread::sleep(Duration::from_millis(20));
    }
    // C: refused at once.
    let (status, headers, text) = http(&server.addr, "POST", "/v1/chat/completions", &[], &chat("Hello", 4).to_string());
    assert_eq!(status, 429, "{text}");
    assert!(headers.iter().any(|(k, v)| k == "retry-after" && v == "1"), "{headers:?}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_exceeded");
    assert!(v["error"]["message"].as_str().unwrap().contains("queue limit"), "{v}");
    // A's client goes away: its request is cancelled, B takes the slot and finishes.
    drop(reader);
    a.shutdown(std::net::Shutdown::Both).unwrap();
    drop(a);
    let (status, v) = b.join().unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 8);
    let t0 = Instant::now();
    while metric("tessera:num_requests_running") > 0.0 || metric("tessera:request_success_total{finished_reason=\"abort\"}") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "the cancelled request never ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(metric("tessera:num_requests_waiting"), 0.0);
    assert!(metric("tessera:generation_tokens_total") >= 9.0);
    assert!(metric("tessera:request_refused_total") >= 1.0);
    // The latency histograms saw the two finished requests (B's 8 tokens: 7 gaps), and B
    // waited in the queue for a while.
    assert!(metric("tessera:time_to_first_token_seconds_count") >= 2.0);
    assert!(metric("tessera:inter_token_latency_seconds_count") >= 7.0);
    assert!(metric("tessera:e2e_request_latency_seconds_count") >= 2.0);
    assert!(metric("tessera:request_queue_time_seconds_sum") > 0.0);
    assert_eq!(metric("tessera:kv_cache_usage_perc"), 0.0, "no running request holds KV once all ended");
    // Every line is a comment or `name{labels} value` (Prometheus' text format).
    let (_, _, m) = http(&server.addr, "GET", "/metrics", &[], "");
    for l in m.lines().filter(|l| !l.starts_with('#')) {
        let (name, value) = l.rsplit_once(' ').unwrap();
        assert!(name.starts_with("tessera:") && value.parse::<f64>().is_ok(), "{l}");
    }
}

/// Every error in OpenAI's shape with its status; API keys on the API routes only.
#[test]
fn errors_and_api_keys() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-serve");
    std::fs::create_dir_all(&dir).unwrap();
    let key_file = dir.join("key");
    std::fs::write(&key_file, "sk-test-123\n").unwrap();
    let server = serve(&["--api-key-file", &key_file.to_string_lossy(), "--body-bytes-max", "4096"]);
    let auth = [("Authorization", "Bearer sk-test-123")];
    let call = |body: &serde_json::Value, headers: &[(&str, &str)]| {
        let (status, _, text) = http(&server.addr, "POST", "/v1/chat/completions", headers, &body.to_string());
        (status, serde_json::from_str::<serde_json::Value>(&text).unwrap_or_else(|_| panic!("not JSON: {text}")))
    };
    let shape = |v: &serde_json::Value| {
        let e = &v["error"];
        assert!(e["message"].is_string() && e["type"].is_string() && e.get("param").is_some() && e.get("code").is_some(), "{v}");
    };
    for headers in [&[][..], &[("Authorization", "Bearer wrong")][..]] {
        let (status, v) = call(&chat("hi", 2), headers);
        assert_eq!(status, 401, "{v}");
        assert_eq!(v["error"]["code"], "invalid_api_key");
        shape(&v);
    }
    assert_eq!(call(&chat("hi", 2), &auth).0, 200);
    for open in ["/health", "/ready", "/metrics"] {
        assert_eq!(http(&server.addr, "GET", open, &[], "").0, 200, "{open} without a key");
    }
    assert_eq!(http(&server.addr, "GET", "/v1/models", &[], "").0, 401);
    let with = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v = chat("hi", 2);
        f(&mut v);
        v
    };
    let cases: Vec<(serde_json::Value, u16, Option<&str>, Option<&str>)> = vec![
        (with(&|v| v["model"] = "gpt-4".into()), 400, Some("model"), Some("model_not_found")),
        (with(&|v| v["temperature"] = 3.into()), 400, Some("temperature"), None),
        (with(&|v| v["n"] = 17.into()), 400, Some("n"), None),
        (with(&|v| v["n"] = 0.into()), 400, Some("n"), None),
        (with(&|v| { v["logprobs"] = true.into(); v["top_logprobs"] = 21.into() }), 400, Some("top_logprobs"), None),
        (with(&|v| v["top_logprobs"] = 2.into()), 400, Some("top_logprobs"), None),
        (with(&|v| v["logprobs"] = 3.into()), 400, Some("logprobs"), None),
        (with(&|v| v["logit_bias"] = serde_json::json!({"99999999": 5})), 400, Some("logit_bias"), None),
        (with(&|v| v["logit_bias"] = serde_json::json!({"5": 500})), 400, Some("logit_bias"), None),
        (with(&|v| v["frequency_penalty"] = 3.into()), 400, Some("frequency_penalty"), None),
        (with(&|v| v["stop"] = serde_json::json!(["a", "b", "c", "d", "e"])), 400, Some("stop"), None),
        (with(&|v| v["max_tokens"] = 5000.into()), 400, Some("max_tokens"), Some("context_length_exceeded")),
        (with(&|v| v["messages"] = serde_json::json!([])), 400, Some("messages"), None),
        (with(&|v| v["messages"][0]["content"] = "word ".repeat(1000).into()), 413, None, None),
        (with(&|v| v["stream_options"] = serde_json::json!({"include_usage": true})), 400, Some("stream_options"), None),
        (with(&|v| v["unknown_field"] = "ignored".into()), 200, None, None),
    ];
    for (body, status, param, code) in cases {
        let (got, v) = call(&body, &auth);
        assert_eq!(got, status, "{body}: {v}");
        if status != 200 {
            shape(&v);
            assert_eq!(v["error"]["param"].as_str(), param, "{v}");
            assert_eq!(v["error"]["code"].as_str(), code, "{v}");
        }
    }
    // A prompt longer than the context (1024): 400 context_length_exceeded.
    let server2 = serve(&[]);
    let (status, v) = post(&server2.addr, "/v1/chat/completions", &chat(&"word ".repeat(1100), 2));
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let (status, _, text) = http(&server2.addr, "POST", "/v1/chat/completions", &[], "{not json");
    assert_eq!(status, 400, "{text}");
    let (status, _, text) = http(&server2.addr, "GET", "/v1/nothing", &[], "");
    assert_eq!(status, 404, "{text}");
    shape(&serde_json::from_str(&text).unwrap());
}

/// The official `openai` Python client (pinned in tools/serve/requirements.txt; scripts/test
/// installs it and sets TESSERA_TEST_PYTHON): models, a greedy chat equal to `generate
/// --chat` with a system message, streaming with usage, a text completion, and errors as
/// the client's exception classes with OpenAI's param and code.
#[test]
fn openai_client_talks_to_the_server() {
    let python = std::env::var("TESSERA_TEST_PYTHON").expect("TESSERA_TEST_PYTHON is not set: run scripts/test, which installs the pinned openai client");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-serve-openai");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("key"), "sk-openai-test").unwrap();
    let server = serve(&["--api-key-file", &dir.join("key").to_string_lossy()]);
    let out = Command::new(&python).arg(repo().join("tools/serve/openai_client.py")).args([&format!("http://{}/v1", server.addr), MODEL, "sk-openai-test"]).output().unwrap();
    assert!(out.status.success(), "the openai client failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["models"], serde_json::json!([MODEL]));
    // The same conversation through `tessera generate --chat --system`.
    let gen = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["generate", "--model", &smollm2().to_string_lossy(), "--system", "You are terse.", "--chat", "Name three colours.", "--max-tokens", "20", "--threads", "2", "--ctx", "1024"])
        .output()
        .unwrap();
    let want = String::from_utf8(gen.stdout).unwrap();
    let want = want.strip_suffix('\n').unwrap_or(&want);
    assert_eq!(v["chat"]["content"].as_str().unwrap(), want, "{v}");
    assert_eq!(v["stream"]["content"].as_str().unwrap(), want, "{v}");
    let usage = &v["chat"]["usage"];
    assert_eq!(usage[0].as_u64().unwrap() + usage[1].as_u64().unwrap(), usage[2].as_u64().unwrap());
    assert_eq!(v["stream"]["usage_chunks"], serde_json::json!([[usage[0], usage[1]]]), "{v}");
    assert_eq!(v["stream"]["empty_choices"], 1);
    assert_eq!(v["stream"]["finish_reason"], serde_json::json!([v["chat"]["finish_reason"]]));
    assert_eq!(v["chat"]["cached"], 0);
    assert!(v["completion"]["text"].as_str().is_some_and(|t| !t.is_empty()), "{v}");
    // n = 2 with logprobs, parsed by the client's types: both choices greedy, equal, and
    // spelled by their tokens; the best alternative is the token; the prompt was cached.
    let c = &v["choices"];
    assert_eq!(c["indexes"], serde_json::json!([0, 1]), "{c}");
    let first_six: String = v["chat"]["content"].as_str().unwrap().to_string();
    for k in 0..2 {
        let content = c["contents"][k].as_str().unwrap();
        assert!(first_six.starts_with(content), "choice {k}: {content:?} is not the start of {first_six:?}");
        let tokens: Vec<&str> = c["tokens"][k].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(tokens.concat(), content, "{c}");
        for (i, top) in c["top"][k].as_array().unwrap().iter().enumerate() {
            assert_eq!(top[0], tokens[i], "{c}");
        }
        assert!(c["logprobs"][k].as_array().unwrap().iter().all(|l| l.as_f64().unwrap() <= 0.0));
    }
    assert_eq!(c["contents"][0], c["contents"][1]);
    assert_eq!(c["cached"].as_u64().unwrap() + 1, c["prompt_tokens"].as_u64().unwrap(), "{c}");
    let e = &v["errors"];
    assert_eq!(e["unknown_model"], serde_json::json!({"status": 400, "class": "BadRequestError", "param": "model", "code": "model_not_found"}));
    assert_eq!(e["bad_temperature"]["status"], 400);
    assert_eq!(e["bad_temperature"]["param"], "temperature");
    assert_eq!(e["wrong_key"]["status"], 401);
    assert_eq!(e["wrong_key"]["class"], "AuthenticationError");
    // /metrics through Prometheus' own parser: the families and their types.
    let m = &v["metrics"];
    for (family, kind) in [("tessera:prompt_tokens", "counter"), ("tessera:generation_tokens", "counter"), ("tessera:num_requests_running", "gauge"), ("tessera:time_to_first_token_seconds", "histogram"), ("tessera:e2e_request_latency_seconds", "histogram")] {
        assert_eq!(m[family]["type"], kind, "{family}: {m}");
    }
    // Four requests finished (chat, stream, two choices, completion): 20 + 20 + 2 × 6 + 8
    // tokens at most.
    let generated = m["tessera:generation_tokens"]["samples"]["tessera:generation_tokens_total{}"].as_f64().unwrap();
    assert!((4.0..=60.0).contains(&generated), "{generated}");
    assert_eq!(m["tessera:e2e_request_latency_seconds"]["samples"]["tessera:e2e_request_latency_seconds_count{}"], 4.0);
}

/// Structured output and tool calls through the official `openai` client
/// (tools/serve/structured_client.py), every output validated by the `jsonschema` package:
/// six schemas (objects, arrays of enums, const and numeric bounds, string lengths and
/// patterns, nesting, nullable unions; `additionalProperties: false` throughout) at
/// temperature 0 and 1, streamed and not; `json_object`; the legacy endpoint; a schema
/// llguidance cannot do refused naming the keywords; tool calls `required` and named,
/// streamed and not, their arguments validated against the function's parameters, no
/// marker in the text; `auto`, `none`, and a tool result back through the template.
#[test]
fn structured_output_and_tool_calls_through_the_openai_client() {
    let python = std::env::var("TESSERA_TEST_PYTHON").expect("TESSERA_TEST_PYTHON is not set: run scripts/test, which installs the pinned openai and jsonschema");
    let server = serve(&[]);
    let out = Command::new(&python).arg(repo().join("tools/serve/structured_client.py")).args([&format!("http://{}/v1", server.addr), MODEL]).output().unwrap();
    assert!(out.status.success(), "structured_client.py failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Every output that ended of itself is valid; one cut by max_tokens may not be (a small
    // model can write digits for ever inside a number the schema allows), but most end.
    let mut stopped = 0;
    for (name, runs) in v["schemas"].as_object().unwrap() {
        for r in runs.as_array().unwrap() {
            if r["finish"] == "stop" {
                stopped += 1;
                assert!(r["invalid"].is_null(), "{name}: a finished output does not validate: {r}");
            } else {
                assert_eq!(r["finish"], "length", "{name}: {r}");
            }
        }
    }
    assert!(stopped >= 20, "only {stopped} of 24 schema outputs finished: {}", v["schemas"]);
    assert_eq!(v["json_object"]["is_object"], true, "{}", v["json_object"]);
    assert!(v["completion"]["invalid"].is_null(), "{}", v["completion"]);
    let e = &v["errors"];
    for name in ["unsupported_keyword", "bad_type", "schema_not_object"] {
        assert_eq!(e[name]["status"], 400, "{name}: {e}");
        assert_eq!(e[name]["param"], "response_format", "{name}: {e}");
    }
    let why = e["unsupported_keyword"]["message"].as_str().unwrap();
    assert!(why.contains("if") && why.contains("then"), "{why}");
    assert_eq!(e["unknown_tool"], serde_json::json!({"status": 400, "param": "tool_choice"}));
    let t = &v["tools"];
    for name in ["required", "required_stream", "named", "named_stream"] {
        let calls = t[name]["calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "{name}: no call: {}", t[name]);
        assert_eq!(t[name]["problems"], serde_json::json!([]), "{name}: {}", t[name]);
        assert_eq!(t[name]["finish"], "tool_calls", "{name}: {}", t[name]);
        assert_eq!(t[name]["marker_in_content"], false, "{name}: {}", t[name]);
        if name.starts_with("named") {
            assert!(calls.iter().all(|c| c["name"] == "get_time"), "{name}: {}", t[name]);
            assert_eq!(calls.len(), 1, "parallel_tool_calls false: one call: {}", t[name]);
        }
    }
    // Streamed and not, greedy: the same calls.
    let names = |k: &str| t[k]["calls"].as_array().unwrap().iter().map(|c| (c["name"].clone(), c["arguments"].clone())).collect::<Vec<_>>();
    assert_eq!(names("required"), names("required_stream"));
    assert_eq!(names("named"), names("named_stream"));
    for name in ["auto", "none"] {
        assert_eq!(t[name]["problems"], serde_json::json!([]), "{name}: {}", t[name]);
        assert_eq!(t[name]["marker_in_content"], false, "{name}: {}", t[name]);
    }
    assert_eq!(t["none"]["calls"], serde_json::json!([]), "tool_choice none: no calls: {}", t["none"]);
    assert!(t["round_trip"]["content"].as_str().is_some_and(|c| !c.is_empty()), "{}", t["round_trip"]);
}

/// A template that writes tools itself (`--chat-template`, in the manner of Qwen3's): the
/// tools go through it, not through a system message of the server's, and a required call
/// comes back valid, streamed or not; its result goes back through the template.
#[test]
fn tools_go_through_a_template_that_knows_them() {
    let template = repo().join("tests/fixtures/templates/chatml_tools.jinja");
    let server = serve(&["--chat-template", &template.to_string_lossy()]);
    let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": false}}}]);
    let ask = serde_json::json!([{"role": "user", "content": "Weather in Oslo?"}]);
    let body = serde_json::json!({"model": MODEL, "messages": ask, "tools": tools, "tool_choice": "required", "temperature": 0, "max_tokens": 60, "parallel_tool_calls": false});
    let (status, r) = post(&server.addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{r}");
    let m = &r["choices"][0]["message"];
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
    let calls = m["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{r}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: serde_json::Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].as_str().is_some_and(|c| c.chars().count() <= 20) && args.as_object().unwrap().len() == 1, "{args}");
    // The prompt is the template's: it lists the tools in its own system turn (not in the
    // server's description for templates without tools); with none offered, none shown.
    let prompt = |tools: &serde_json::Value| {
        let (_, tokenized) = post(&server.addr, "/tokenize", &serde_json::json!({"messages": ask, "tools": tools}));
        let (_, detok) = post(&server.addr, "/detokenize", &serde_json::json!({"tokens": tokenized["tokens"]}));
        detok["prompt"].as_str().unwrap().to_string()
    };
    let with = prompt(&tools);
    assert!(with.contains("# Tools\n<tools>") && with.contains("{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"") && !with.contains("You may call"), "{with}");
    assert!(!prompt(&serde_json::json!([])).contains("<tools>"));
    // Streamed: the same call, whole, in one delta.
    let mut streamed = body.clone();
    streamed["stream"] = serde_json::json!(true);
    let (status, _, text) = http(&server.addr, "POST", "/v1/chat/completions", &[], &streamed.to_string());
    assert_eq!(status, 200);
    let deltas: Vec<serde_json::Value> = sse_data(&text).iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    let streamed_calls: Vec<&serde_json::Value> = deltas.iter().filter_map(|d| d["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(streamed_calls.len(), 1, "{text}");
    assert_eq!(streamed_calls[0]["function"]["arguments"], calls[0]["function"]["arguments"]);
    // The result goes back through the template; the model answers in text.
    let history = serde_json::json!([ask[0], {"role": "assistant", "content": null, "tool_calls": [calls[0]]}, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "12 degrees"}]);
    let (status, r) = post(&server.addr, "/v1/chat/completions", &serde_json::json!({"model": MODEL, "messages": history, "tools": tools, "tool_choice": "none", "temperature": 0, "max_tokens": 16}));
    assert_eq!(status, 200, "{r}");
    assert!(r["choices"][0]["message"]["content"].as_str().is_some_and(|c| !c.is_empty()), "{r}");
}

/// The pid of rank `rank` among the children of launcher `launcher` (its environment says
/// `TESSERA_RANK=rank`).
fn rank_pid(launcher: u32, rank: usize) -> u32 {
    let want = format!("TESSERA_RANK={rank}");
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
        let parent = status.lines().find_map(|l| l.strip_prefix("PPid:")).map(|p| p.trim().parse::<u32>().unwrap_or(0));
        let env = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        if parent == Some(launcher) && env.split(|&b| b == 0).any(|kv| kv == want.as_bytes()) {
            return pid;
        }
    }
    panic!("no rank {rank} under launcher {launcher}")
}

/// A rank SIGKILLed under `serve` fails the requests in flight (a stream gets one error
/// event, then `[DONE]`; a plain request a 503) within the bound, and the server exits
/// non-zero so a supervisor can restart it.
#[test]
fn a_killed_rank_fails_the_requests_in_flight_and_stops_the_server() {
    let mut server = serve_on(2, &["--tp", "2", "--parallel", "2"]);
    let rank1 = rank_pid(server.child.id(), 1);
    // Both still running at the kill: the end-of-text tokens are barred (a greedy answer
    // that stops after 128 tokens can finish before it on an idle host).
    let endless = |content: &str| {
        let mut c = chat(content, 900);
        c["logit_bias"] = serde_json::json!({"0": -100, "2": -100});
        c
    };
    let mut long = endless("Tell me a very long story about a dragon.");
    long["stream"] = true.into();
    let streamed = std::thread::spawn({
        let (addr, body) = (server.addr.clone(), long.to_string());
        move || http(&addr, "POST", "/v1/chat/completions", &[], &body)
    });
    let plain = std::thread::spawn({
        let (addr, body) = (server.addr.clone(), endless("Tell me another long story.").to_string());
        move || http(&addr, "POST", "/v1/chat/completions", &[], &body)
    });
    std::thread::sleep(Duration::from_millis(1500));
    let killed = Instant::now();
    assert!(Command::new("kill").args(["-9", &rank1.to_string()]).status().unwrap().success());
    let (status, _, body) = streamed.join().unwrap();
    assert_eq!(status, 200);
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let error: serde_json::Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert!(error["error"]["message"].as_str().unwrap().contains("lost rank 1"), "{error}");
    let (status, _, body) = plain.join().unwrap();
    assert_eq!(status, 503, "{body}");
    // The collective notices a closed connection at once; the deadline (30 s) bounds a silent one.
    assert!(killed.elapsed() < Duration::from_secs(32), "requests failed after {:?}", killed.elapsed());
    let exit = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(killed.elapsed() < Duration::from_secs(40), "the server is still up");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!exit.success(), "the server exits non-zero");
}

/// A client that disconnects while its request waits in the queue takes it out of the
/// queue; one that disconnects while its long prompt is still being prefilled (in chunks
/// of 4 tokens), streamed or not, cancels it there: it never produces a token, and the
/// request behind it runs. (The prompt's prefill is the window the queue checks need: at
/// 881 tokens in chunks of 16 it was ~0.5 s, and once, in CI beside other servers, it
/// ended first.)
#[test]
fn a_client_gone_in_the_queue_or_during_prefill_cancels_its_request() {
    let server = serve(&["--parallel", "1", "--prefill-chunk", "4", "--ctx", "2048"]);
    let mut long = chat(&"word ".repeat(1800), 100);
    long["stream"] = true.into();
    let body = long.to_string();
    let mut a = TcpStream::connect(&server.addr).unwrap();
    write!(a, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut reader = BufReader::new(a.try_clone().unwrap());
    let mut line = String::new();
    while !line.contains("\"role\"") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    // Q waits in the queue behind A (one slot); its client goes away there: it leaves
    // the queue while A still runs.
    let gauge = |name: &str| -> f64 {
        let (_, _, m) = http(&server.addr, "GET", "/metrics", &[], "");
        m.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()).unwrap().parse().unwrap()
    };
    let q_body = chat("Say hello.", 8).to_string();
    let mut q = TcpStream::connect(&server.addr).unwrap();
    write!(q, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{q_body}", q_body.len()).unwrap();
    let t0 = Instant::now();
    while gauge("tessera:num_requests_waiting") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "Q never waited");
        std::thread::sleep(Duration::from_millis(10));
    }
    q.shutdown(std::net::Shutdown::Both).unwrap();
    drop(q);
    while gauge("tessera:num_requests_waiting") > 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "Q stayed in the queue after its client left");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(gauge("tessera:num_requests_running"), 1.0, "A still runs");
    drop(reader);
    a.shutdown(std::net::Shutdown::Both).unwrap();
    drop(a);
    // The same prompt not streamed: its client goes away 300 ms in, mid-prefill.
    long.as_object_mut().unwrap().remove("stream");
    let body = long.to_string();
    let mut a2 = TcpStream::connect(&server.addr).unwrap();
    write!(a2, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    a2.shutdown(std::net::Shutdown::Both).unwrap();
    drop(a2);
    let (status, v) = post(&server.addr, "/v1/chat/completions", &chat("Say hi.", 8));
    assert_eq!(status, 200, "{v}");
    let (_, _, m) = http(&server.addr, "GET", "/metrics", &[], "");
    let metric = |name: &str| -> f64 { m.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()).unwrap().parse().unwrap() };
    assert_eq!(metric("tessera:generation_tokens_total"), 8.0, "a cancelled prompt produced tokens:\n{m}");
    assert_eq!(metric("tessera:request_success_total{finished_reason=\"abort\"}"), 3.0, "{m}");
    assert_eq!(metric("tessera:num_requests_running"), 0.0, "{m}");
}

/// `n` choices, log-probabilities and the prefix cache over HTTP: greedy choices are each
/// `generate --chat`'s text, streamed by index; a sampled request's first choice is the
/// same request with `n` 1; logprobs' tokens spell the text, the sampled token is the
/// best alternative at temperature 0, in both endpoints' formats; a second conversation
/// that shares a system prompt, and a second turn, report cached prompt tokens and give
/// the text a server without a prefix cache gives.
#[test]
fn choices_logprobs_and_the_prefix_cache() {
    let server = serve(&["--parallel", "4"]);
    let plain = serve(&["--parallel", "4", "--prefix-block-tokens", "0"]);
    // 8 tokens: the answer is longer, so every choice ends for length.
    let want = generate_chat("Name a fruit.", 8);
    let mut two = chat("Name a fruit.", 8);
    two["n"] = 2.into();
    let (status, v) = post(&server.addr, "/v1/chat/completions", &two);
    assert_eq!(status, 200, "{v}");
    for k in 0..2 {
        assert_eq!(v["choices"][k]["index"], k);
        assert_eq!(v["choices"][k]["message"]["content"].as_str().unwrap(), want, "choice {k}: {v}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["choices"][1]["finish_reason"], "length");
    two["stream"] = true.into();
    two["stream_options"] = serde_json::json!({"include_usage": true});
    let (_, _, body) = http(&server.addr, "POST", "/v1/chat/completions", &[], &two.to_string());
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<serde_json::Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    for k in 0..2 {
        let of_k = chunks.iter().filter(|c| c["choices"].as_array().is_some_and(|a| !a.is_empty()) && c["choices"][0]["index"] == k);
        let text: String = of_k.clone().filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(String::from)).collect();
        assert_eq!(text, want, "streamed choice {k}");
        assert_eq!(of_k.filter(|c| !c["choices"][0]["finish_reason"].is_null()).count(), 1, "one end for choice {k}");
    }
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 16);
    let mut sampled = chat("Invent a word.", 10);
    (sampled["temperature"], sampled["seed"]) = (1.0.into(), 77.into());
    let one = post(&server.addr, "/v1/chat/completions", &sampled).1;
    sampled["n"] = 3.into();
    let three = post(&server.addr, "/v1/chat/completions", &sampled).1;
    assert_eq!(three["choices"][0]["message"]["content"], one["choices"][0]["message"]["content"], "{three}");
    assert_eq!(three["choices"].as_array().unwrap().len(), 3);

    // Log-probabilities, chat format.
    let mut lp = chat("Name a fruit.", 8);
    (lp["logprobs"], lp["top_logprobs"]) = (true.into(), 3.into());
    let v = post(&server.addr, "/v1/chat/completions", &lp).1;
    assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap(), want);
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 8);
    assert_eq!(content.iter().map(|t| t["token"].as_str().unwrap()).collect::<String>(), want);
    for t in content {
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], t["token"], "greedy takes the best: {t}");
        assert_eq!(top[0]["logprob"], t["logprob"]);
        let lps: Vec<f64> = top.iter().map(|a| a["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0, "{t}");
        assert_eq!(t["bytes"], serde_json::json!(t["token"].as_str().unwrap().as_bytes()));
    }
    // The legacy completions format.
    let body = serde_json::json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 2});
    let v = post(&server.addr, "/v1/completions", &body).1;
    let (text, l) = (v["choices"][0]["text"].as_str().unwrap(), &v["choices"][0]["logprobs"]);
    let tokens: Vec<&str> = l["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.concat(), text, "{v}");
    let offsets: Vec<usize> = l["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap() as usize).collect();
    assert_eq!(offsets, tokens.iter().scan(0, |at, t| Some(std::mem::replace(at, *at + t.len()))).collect::<Vec<_>>());
    for (i, top) in l["top_logprobs"].as_array().unwrap().iter().enumerate() {
        assert_eq!(top.as_object().unwrap().len(), 2);
        assert_eq!(top[tokens[i]], l["token_logprobs"][i], "{v}");
    }

    // The prefix cache: a shared system prompt, then a second turn.
    let system = "You are a helpful assistant who answers in one short sentence, always politely, and never uses lists or bullet points.";
    let convo = |turns: &[(&str, &str)]| {
        let messages: Vec<serde_json::Value> = std::iter::once(serde_json::json!({"role": "system", "content": system})).chain(turns.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c}))).collect();
        serde_json::json!({"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 16})
    };
    let ask = |addr: &str, body: &serde_json::Value| {
        let (status, v) = post(addr, "/v1/chat/completions", body);
        assert_eq!(status, 200, "{v}");
        (v["choices"][0]["message"]["content"].as_str().unwrap().to_string(), v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(), v["usage"]["prompt_tokens"].as_u64().unwrap())
    };
    let (a1, cached, _) = ask(&server.addr, &convo(&[("user", "What is rust?")]));
    // Earlier requests' template head (`<|im_start|>system\n`) at most.
    assert!(cached < 10, "{cached}");
    let (b1, cached_b, _) = ask(&server.addr, &convo(&[("user", "What is iron?")]));
    assert!(cached_b >= cached + 20, "the system prompt is reused: {cached_b} tokens");
    let second = convo(&[("user", "What is rust?"), ("assistant", &a1), ("user", "And steel?")]);
    let (a2, cached_2, prompt_2) = ask(&server.addr, &second);
    let (_, _, prompt_1) = ask(&plain.addr, &convo(&[("user", "What is rust?")]));
    assert!(cached_2 >= prompt_1, "the second turn reuses the whole first prompt ({cached_2} of {prompt_2}, the first was {prompt_1})");
    for (body, got) in [(convo(&[("user", "What is rust?")]), &a1), (convo(&[("user", "What is iron?")]), &b1), (second, &a2)] {
        let (reference, cached, _) = ask(&plain.addr, &body);
        assert_eq!(cached, 0, "no prefix cache there");
        assert_eq!(&reference, got, "the same text without the prefix cache");
    }
    let metric = |addr: &str, name: &str| -> f64 {
        let (_, _, m) = http(addr, "GET", "/metrics", &[], "");
        m.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()).unwrap().parse().unwrap()
    };
    assert!(metric(&server.addr, "tessera:prefix_cache_hits_total") >= (cached_b + cached_2) as f64);
    assert!(metric(&server.addr, "tessera:prefix_cache_queries_total") > metric(&server.addr, "tessera:prefix_cache_hits_total"));
    assert_eq!(metric(&plain.addr, "tessera:prefix_cache_hits_total"), 0.0);
    assert!(metric(&server.addr, "tessera:prefix_cache_kept_tokens") > 0.0);
}

/// The watchdog: an engine that stops making progress inside a step (the fault hook
/// stalls its 6th) fails the stream in flight with one error event, then `[DONE]`,
/// within the step timeout and the flush, and the server exits with code 3.
#[test]
fn a_stalled_engine_fails_its_requests_and_exits() {
    let mut server = serve_with(1, &smollm2(), &["--step-timeout-s", "1"], &[("TESSERA_FAULT_STALL_AFTER_STEPS", "5")]);
    let mut long = chat("Tell me a very long story about a dragon.", 200);
    long["stream"] = true.into();
    let t0 = Instant::now();
    let (status, _, body) = http(&server.addr, "POST", "/v1/chat/completions", &[], &long.to_string());
    assert_eq!(status, 200);
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let error: serde_json::Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert!(error["error"]["message"].as_str().unwrap().contains("no progress"), "{error}");
    assert_eq!(error["error"]["type"], "server_error");
    let exit = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "the stalled server is still up");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(exit.code(), Some(3), "{exit:?}");
    // One second of timeout, the flush (at most 2 s), and loading.
    assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
}

/// The page (`GET /`) in headless Chromium (Debian's `chromium`; scripts/test installs it
/// and sets TESSERA_TEST_CHROMIUM), driven over the DevTools protocol by
/// tools/serve/page_check.py under TP2: it shows the model, the placement and a row per
/// rank with its memory and step time; a message typed into the chat box streams back
/// `generate --chat`'s greedy answer; a screenshot is taken.
#[test]
fn the_page_shows_the_placement_and_chats() {
    let python = std::env::var("TESSERA_TEST_PYTHON").expect("TESSERA_TEST_PYTHON is not set: run scripts/test");
    let chromium = std::env::var("TESSERA_TEST_CHROMIUM").expect("TESSERA_TEST_CHROMIUM is not set: run scripts/test, which installs Debian's chromium");
    let question = "What is the capital of France?";
    let want = generate_chat(question, 24);
    let server = serve_on(2, &["--tp", "2"]);
    let (status, headers, page) = http(&server.addr, "GET", "/", &[], "");
    assert_eq!(status, 200);
    assert!(headers.iter().any(|(k, v)| k == "content-type" && v.starts_with("text/html")), "{headers:?}");
    assert!(page.contains("<title>tessera serve</title>"));
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-serve-page");
    std::fs::create_dir_all(&dir).unwrap();
    let shot = dir.join("page.png");
    let out = Command::new(&python).arg(repo().join("tools/serve/page_check.py")).args([format!("http://{}", server.addr), chromium, shot.to_string_lossy().into_owned(), question.to_string(), "24".to_string()]).output().unwrap();
    assert!(out.status.success(), "page_check.py failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["model"], MODEL, "{v}");
    assert!(v["placement"].as_str().unwrap().contains("TP2 · PP1 · EP1 · 2 ranks"), "{v}");
    assert!(v["ready"].as_str().unwrap().contains("ready") && !v["ready"].as_str().unwrap().contains("not"), "{v}");
    assert_eq!(v["state"], "done", "{v}");
    assert_eq!(v["errors"], serde_json::json!([]), "{v}");
    assert_eq!(v["answer"].as_str().unwrap(), want, "the page's chat is the greedy answer: {v}");
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2, "one row per rank: {v}");
    for (r, row) in ranks.iter().enumerate() {
        assert_eq!(row[0], r.to_string());
        assert!(row[1].as_str().unwrap().ends_with("MiB"), "rank {r}'s memory: {row}");
        assert!(row[2].as_str().unwrap().ends_with(" ms"), "rank {r}'s step time: {row}");
    }
    assert_eq!(v["done"], "1", "{v}");
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "a screenshot of {} bytes", png.len());
}

/// Rank 0 answers HTTP while every rank loads (the fault hook makes loading 1.5 s
/// longer): `/health` 200, `/ready` and the API 503 (OpenAI's shape, Retry-After), `/info`
/// says not loaded; then `/ready` 200 and requests run.
#[test]
fn ready_is_503_until_every_rank_has_loaded() {
    let server = spawn_server(2, &smollm2(), &["--tp", "2"], &[("TESSERA_FAULT_LOAD_DELAY_MS", "1500")]);
    let (status, _, _) = http(&server.addr, "GET", "/health", &[], "");
    assert_eq!(status, 200);
    let (status, _, body) = http(&server.addr, "GET", "/ready", &[], "");
    assert_eq!(status, 503, "{body}");
    let (status, headers, body) = http(&server.addr, "POST", "/v1/chat/completions", &[], &chat("Hi", 4).to_string());
    assert_eq!(status, 503, "{body}");
    assert!(headers.iter().any(|(k, _)| k == "retry-after"), "{headers:?}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("still loading"), "{v}");
    let (_, _, info) = http(&server.addr, "GET", "/info", &[], "");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&info).unwrap()["loaded"], false, "{info}");
    let t0 = Instant::now();
    while http(&server.addr, "GET", "/ready", &[], "").0 != 200 {
        assert!(t0.elapsed() < Duration::from_secs(30), "never ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, v) = post(&server.addr, "/v1/chat/completions", &chat("Hi", 4));
    assert_eq!(status, 200, "{v}");
}
