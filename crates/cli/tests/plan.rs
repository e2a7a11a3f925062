//! `tessera plan` end to end: the placements it lists for a hand-written cluster, each
//! rank's bytes against what a real load of that rank reads (`inspect --json`), memory
//! refusals a program can read, a config alone, and bad input named.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tessera-plan").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).current_dir(repo()).output().expect("running tessera")
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = tessera(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Nodes of `memory` bytes each (a 10 GB/s, 100 GMAC/s machine), fully linked at 50 µs, 5 GB/s.
fn cluster(dir: &Path, memory: &[u64]) -> String {
    let nodes: Vec<_> = memory
        .iter()
        .enumerate()
        .map(|(i, m)| serde_json::json!({ "name": format!("n{i}"), "memory_free_bytes": m, "read_gb_s": 10.0, "int8_gmac_s": 100.0, "f32_gmac_s": 50.0, "cores": 4 }))
        .collect();
    let n = memory.len();
    let links: Vec<_> = (0..n).flat_map(|a| (a + 1..n).map(move |b| serde_json::json!({ "from": a, "to": b, "latency_us": 50.0, "bandwidth_gb_s": 5.0 }))).collect();
    let path = dir.join("cluster.json");
    std::fs::write(&path, serde_json::json!({ "nodes": nodes, "links": links }).to_string()).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn plan_lists_placements_with_the_loaders_bytes() {
    let dir = scratch("placements");
    let c = cluster(&dir, &[8 << 30, 8 << 30, 8 << 30]);
    let v = json(&["plan", "--model", "tests/fixtures/qwen3_moe", "--cluster", &c, "--ctx", "128", "--sequences", "4", "--json"]);
    let by: std::collections::HashMap<&str, &serde_json::Value> = v["placements"].as_array().unwrap().iter().map(|p| (p["name"].as_str().unwrap(), p)).collect();
    for name in ["single", "pp2", "pp3", "tp2", "tp3", "ep2", "ep3", "ep2-dp", "ep3-dp", "tp2-ep", "tp3-ep"] {
        let p = by.get(name).unwrap_or_else(|| panic!("{name} missing: {v}"));
        assert_eq!(p["valid"], true, "{name}: {p}");
        assert!(p["decode_tok_s"].as_f64().unwrap() > 0.0 && p["decode_tok_s_batch"].as_f64().unwrap() >= p["decode_tok_s"].as_f64().unwrap() * 0.99, "{name}: {p}");
        assert!(tessera_bottleneck(p["bottleneck"].as_str().unwrap()), "{p}");
        assert!(p["ctx_max"].as_u64().unwrap() >= 128, "{p}");
    }
    // Each rank's disk bytes are what a real load of that rank reads.
    for (name, flags) in [("tp2", vec!["--tp", "2"]), ("ep3", vec!["--ep", "3"]), ("ep3-dp", vec!["--ep", "3", "--dp-attention"]), ("pp2", vec!["--pp", "2"])] {
        let real = json(&[&["inspect", "tests/fixtures/qwen3_moe", "--json"][..], &flags].concat());
        let planned = by[name]["nodes"].as_array().unwrap();
        let ranks = real["ranks"].as_array().unwrap();
        assert_eq!(planned.len(), ranks.len(), "{name}");
        for (p, r) in planned.iter().zip(ranks) {
            assert_eq!(p["disk_bytes"], r["bytes_loaded"], "{name}: {p} / {r}");
            assert_eq!(p["bytes_per_token"], r["bytes_per_token"], "{name}: {p} / {r}");
            assert_eq!(p["layers"], r["layers"], "{name}");
        }
    }
    // Data-parallel attention deals the 4 sequences' caches round the ranks (2, 1, 1 of
    // them); without it the leader holds them all.
    let kv = |name: &str| by[name]["nodes"].as_array().unwrap().iter().map(|n| n["kv_bytes"].as_u64().unwrap()).collect::<Vec<_>>();
    let whole = kv("ep3")[0];
    assert!(whole > 0 && kv("ep3-dp") == [whole / 2, whole / 4, whole / 4], "{:?} {:?}", kv("ep3"), kv("ep3-dp"));
    assert_eq!(by["ep3-dp"]["dp_attention"], true);
    // A pipeline's nodes together hold what one node holds (its split covers every layer).
    let single = by["single"]["nodes"][0]["weights_bytes"].as_u64().unwrap();
    let pp: u64 = by["pp2"]["nodes"].as_array().unwrap().iter().map(|n| n["weights_bytes"].as_u64().unwrap()).sum();
    assert!(pp >= single && pp < single + single / 4, "{pp} vs {single}");
}

fn tessera_bottleneck(b: &str) -> bool {
    ["memory bandwidth", "compute", "link latency", "link bandwidth", "pipeline bubble"].contains(&b)
}

#[test]
fn plan_refuses_what_does_not_fit_with_need_and_have() {
    let dir = scratch("memory");
    // A node of 520 MiB: under the 512 MiB reserve plus the runtime (12 MiB) and 256 tokens of 64 sequences.
    let c = cluster(&dir, &[520 << 20, 16 << 30]);
    let v = json(&["plan", "--model", "tests/fixtures/qwen3", "--cluster", &c, "--ctx", "256", "--sequences", "64", "--json"]);
    let single = &v["placements"][0];
    assert_eq!((single["name"].as_str(), single["valid"].as_bool()), (Some("single"), Some(false)), "{single}");
    let e = &single["error"];
    assert_eq!((e["code"].as_str(), e["node"].as_u64()), (Some("memory"), Some(0)), "{e}");
    assert!(e["need"].as_u64().unwrap() > e["have"].as_u64().unwrap() && e["have"].as_u64() == Some(520 << 20), "{e}");
    assert!(e["message"].as_str().unwrap().contains("n0"), "{e}");
    // A TP that exceeds the heads is refused by the engine's own placement check.
    let v = json(&["plan", "--model", "tests/fixtures/qwen3", "--cluster", &cluster(&dir, &[1 << 34; 8]), "--ctx", "64", "--json"]);
    let tp8 = v["placements"].as_array().unwrap().iter().find(|p| p["name"] == "tp8").unwrap();
    assert_eq!((tp8["valid"].as_bool(), tp8["error"]["code"].as_str()), (Some(false), Some("placement")), "{tp8}");
}

#[test]
fn plan_sizes_a_config_alone_and_names_bad_input() {
    let dir = scratch("config");
    let c = cluster(&dir, &[16 << 30, 16 << 30]);
    let from_config = json(&["plan", "--model", "tests/fixtures/qwen3/config.json", "--quant", "f32", "--cluster", &c, "--ctx", "64", "--json"]);
    let from_files = json(&["plan", "--model", "tests/fixtures/qwen3", "--cluster", &c, "--ctx", "64", "--json"]);
    // The fixture is float32: the computed checkpoint is the same, byte for byte.
    for (a, b) in from_config["placements"].as_array().unwrap().iter().zip(from_files["placements"].as_array().unwrap()) {
        assert_eq!(a["nodes"].to_string().replace("config.json", ""), b["nodes"].to_string(), "{}", a["name"]);
    }
    let q4 = json(&["plan", "--model", "tests/fixtures/qwen3/config.json", "--quant", "q8_0", "--cluster", &c, "--ctx", "64", "--json"]);
    let (w8, w32) = (q4["placements"][0]["nodes"][0]["bytes_per_token"].as_u64().unwrap(), from_files["placements"][0]["nodes"][0]["bytes_per_token"].as_u64().unwrap());
    assert!(w8 * 3 < w32, "Q8_0 reads about a quarter of f32: {w8} vs {w32}");
    for (args, needle) in [
        (vec!["plan", "--model", "tests/fixtures/qwen3/config.json", "--cluster", &c], "--quant"),
        (vec!["plan", "--model", "tests/fixtures/qwen3/config.json", "--quant", "q9", "--cluster", &c], "q4_k_m"),
        (vec!["plan", "--model", "tests/fixtures/qwen3", "--cluster", "Cargo.toml"], "Cargo.toml"),
        (vec!["plan", "--model", "tests/fixtures/qwen3", "--cluster", &c, "--sequences", "0"], "--sequences"),
        (vec!["plan", "--model", "tests/fixtures/qwen3", "--cluster", &c, "--ctx", "100000"], "context limit of 256"),
    ] {
        let out = tessera(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(needle), "{args:?}: {err}");
    }
    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"nodes": [{"name": "x", "memory_free_bytes": 1, "read_gb_s": 0, "int8_gmac_s": 1, "f32_gmac_s": 1, "cores": 1}]}"#).unwrap();
    let out = tessera(&["plan", "--model", "tests/fixtures/qwen3", "--cluster", bad.to_str().unwrap()]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("read_gb_s"), "{out:?}");
}

/// The seed's model from its published config alone, on the seed's cluster: what fits where,
/// against the seed's measured 420.8 GB resident per rank under TP4 (MLX, MXFP4 experts).
#[test]
fn plan_sizes_kimi_k3_from_its_published_config() {
    let config = repo().join("tests/fixtures/configs/moonshotai__Kimi-K3.json");
    let v = json(&["plan", "--model", config.to_str().unwrap(), "--quant", "mxfp4", "--cluster", "docs/clusters/m3-ultra-tb5.json", "--ctx", "32768", "--json"]);
    let by: std::collections::HashMap<&str, &serde_json::Value> = v["placements"].as_array().unwrap().iter().map(|p| (p["name"].as_str().unwrap(), p)).collect();
    let single = by["single"];
    assert_eq!((single["valid"].as_bool(), single["error"]["code"].as_str()), (Some(false), Some("memory")), "2.78 T parameters do not fit one node");
    for name in ["tp4", "pp4", "pp5"] {
        let p = by[name];
        assert_eq!(p["valid"], true, "{name}: {p}");
        for n in p["nodes"].as_array().unwrap() {
            let gb = n["memory_bytes"].as_f64().unwrap() / 1e9;
            let bound = if name == "pp5" { 300.0..340.0 } else { 370.0..430.0 };
            assert!(bound.contains(&gb), "{name}: {gb:.1} GB on node {}", n["node"]);
        }
    }
    let tp4 = by["tp4"]["nodes"][0]["memory_bytes"].as_f64().unwrap() / 1e9;
    assert!((tp4 / 420.8 - 1.0).abs() < 0.1, "TP4 {tp4:.1} GB a node against the seed's 420.8 GB resident");
}

/// The in-cache decode rates apply where a rank's weights fit in the cache, and nowhere else.
#[test]
fn plan_streams_weights_from_the_cache_only_where_they_fit() {
    let dir = scratch("cache");
    let plan = |cache_bytes: u64| {
        let node = serde_json::json!({ "name": "n", "memory_free_bytes": 8u64 << 30, "read_gb_s": 10.0, "int8_gmac_s": 1e6, "f32_gmac_s": 1e6, "cores": 4,
            "decode_int8_gb_s": 10.0, "decode_f32_gb_s": 10.0, "cache_bytes": cache_bytes, "cache_probe_bytes": [cache_bytes / 2],
            "decode_int8_gb_s_cached": [40.0], "decode_f32_gb_s_cached": [40.0] });
        let path = dir.join("cluster.json");
        std::fs::write(&path, serde_json::json!({ "nodes": [node] }).to_string()).unwrap();
        let v = json(&["plan", "--model", "tests/fixtures/qwen3_moe", "--cluster", path.to_str().unwrap(), "--ctx", "64", "--json"]);
        v["placements"].as_array().unwrap().iter().find(|p| p["name"] == "single").unwrap_or_else(|| panic!("{v}")).clone()
    };
    let cached = |p: &serde_json::Value| p["terms"].as_array().unwrap().iter().any(|t| t["source"].as_str().unwrap().contains("_gb_s_cached"));
    let big = plan(1 << 40);
    let weights = big["nodes"][0]["weights_bytes"].as_u64().unwrap();
    let small = plan(weights / 2);
    assert!(cached(&big) && !cached(&small), "{big}\n{small}");
    // Same machine otherwise: four times the rate, a faster step.
    assert!(big["decode_tok_s"].as_f64().unwrap() > 2.0 * small["decode_tok_s"].as_f64().unwrap(), "{big}\n{small}");
}
