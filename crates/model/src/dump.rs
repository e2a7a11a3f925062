//! A debugging dump of every layer's block outputs, to find where two placements or
//! kernel flavours part (`tools/debug/layer_diff.py` compares two dumps).
//!
//! With `TESSERA_DUMP_DIR` set, each step appends, per layer, the attention block's and
//! the FFN block's output rows (`attn`, `ffn`: f32, `tokens × hidden`, whole rows on
//! every member) to `DIR/<block>.<layer>.tp<rank>.f32`; grouped-query attention also
//! this rank's q, k, v and heads' outputs (`q`, `k`, `v`, `heads`). Off by default; a failed write is reported once
//! on stderr and the step goes on (a debugging aid must not change what it observes).

use crate::shard::ShardSpec;
use std::io::Write;
use std::path::PathBuf;

pub(crate) struct Dump {
    dir: PathBuf,
    rank: usize,
    failed: std::cell::Cell<bool>,
}

impl Dump {
    pub(crate) fn from_env(spec: &ShardSpec) -> Option<Dump> {
        let dir = std::env::var_os("TESSERA_DUMP_DIR")?;
        Some(Dump { dir: dir.into(), rank: spec.tp_rank.max(spec.moe_rank), failed: false.into() })
    }

    pub(crate) fn write(&self, layer: usize, block: &str, rows: &[f32]) {
        if self.failed.get() {
            return;
        }
        let path = self.dir.join(format!("{block}.{layer:03}.tp{}.f32", self.rank));
        let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
        let res = std::fs::OpenOptions::new().create(true).append(true).open(&path).and_then(|mut f| f.write_all(&bytes));
        if let Err(e) = res {
            if !self.failed.replace(true) {
                eprintln!("TESSERA_DUMP_DIR: cannot write {}: {e} (dumping stops)", path.display());
            }
        }
    }
}
