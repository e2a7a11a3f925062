//! tessera-comm: the communication layer. N ranks over TCP, an authenticated full mesh, and
//! collectives on contiguous buffers of f32, bf16, f16, u8 and i32 that never hang: every
//! operation completes or fails within its deadline, and a failure on one rank is broadcast
//! so every rank stops with the same diagnosis (which rank, which operation, which step).
//!
//! The crate moves bytes typed as five element types; it knows nothing of models.
//!
//! ```no_run
//! use tessera_comm::{CommConfig, Communicator, Peers};
//! let cfg = CommConfig::new(0, 2, Peers::Master("10.0.0.1:29500".parse().unwrap()), b"a shared 32-byte cluster secret!".to_vec());
//! let comm = Communicator::connect(cfg)?;
//! let mut x = vec![1.0f32; 3584];
//! comm.all_reduce_sum(&mut x, "layer 17 attn out")?;
//! # Ok::<(), tessera_comm::CommError>(())
//! ```

mod auth;
mod comm;
pub mod config;
pub mod doctor;
mod elem;
mod engine;
pub mod error;
pub mod frame;
mod mesh;

pub use comm::{Communicator, Group};
pub use config::{CommConfig, Peers};
pub use elem::{DType, Elem};
pub use error::{ClusterReport, CommError, Diagnosis, OpDesc, RankStatus};
pub use frame::OpKind;
pub use mesh::Listening;

/// The handshake a listening rank runs on a new connection, fed `bytes` as what the peer
/// sends (over a loopback socket): for the fuzz targets (`crates/fuzz`). Any bytes end in
/// a rank or an error, never a panic or a hang.
#[doc(hidden)]
pub fn accept_handshake_from(bytes: &[u8], secret: &[u8], world: usize) -> Result<usize, String> {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let mut peer = std::net::TcpStream::connect(listener.local_addr().map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let (mut s, _) = listener.accept().map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(std::time::Duration::from_millis(200))).map_err(|e| e.to_string())?;
    peer.write_all(bytes).map_err(|e| e.to_string())?;
    // The peer says nothing more: a handshake waiting for more bytes ends at the timeout.
    peer.shutdown(std::net::Shutdown::Write).map_err(|e| e.to_string())?;
    auth::accept(&mut s, secret, 0, world, |r| if r < world { Ok(()) } else { Err(format!("rank {r}")) })
}

