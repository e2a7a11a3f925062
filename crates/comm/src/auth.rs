//! Challenge–response authentication of one TCP connection, in both directions, before any
//! frame is read: a peer without the cluster secret learns nothing and nothing it sends is
//! processed beyond these fixed-size messages.
//!
//! ```text
//! dialer   -> acceptor  HELLO      magic "TSHK", version, world, dialer rank, acceptor rank, nonce_d
//! acceptor -> dialer    CHALLENGE  magic, version, world, acceptor rank, nonce_a,
//!                                  mac_a = HMAC(secret, "acceptor" | HELLO | CHALLENGE w/o mac)
//! dialer   -> acceptor  PROOF      mac_d = HMAC(secret, "dialer" | HELLO | CHALLENGE)
//! acceptor -> dialer    "OKAY"
//! ```
//! Both nonces are fresh 32-byte random values, so a recorded exchange cannot be replayed,
//! and the labels keep the acceptor's answer from being reflected as a dialer's proof.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{Read, Write};
use std::net::TcpStream;

type HmacSha256 = Hmac<Sha256>;

const MAGIC: [u8; 4] = *b"TSHK";
const VERSION: u16 = 1;
const NONCE_BYTES: usize = 32;
const MAC_BYTES: usize = 32;
const HELLO_BYTES: usize = 4 + 2 + 2 + 4 + 4 + 4 + NONCE_BYTES;
/// Same layout as HELLO: magic, version, flags, world, 0, acceptor rank, nonce.
const CHALLENGE_BODY_BYTES: usize = HELLO_BYTES;
const ACK: [u8; 4] = *b"OKAY";

fn nonce() -> Result<[u8; NONCE_BYTES], String> {
    let mut n = [0u8; NONCE_BYTES];
    getrandom::fill(&mut n).map_err(|e| format!("no randomness for a nonce: {e}"))?;
    Ok(n)
}

fn mac(secret: &[u8], label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC accepts keys of any length");
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m
}

fn read_exact(s: &mut TcpStream, buf: &mut [u8], what: &str) -> Result<(), String> {
    s.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => format!("connection closed while reading {what} (the peer refused us or gave up)"),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!("no {what} before the handshake deadline"),
        _ => format!("reading {what}: {e}"),
    })
}

fn header(world: u32, a: u32, b: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(HELLO_BYTES);
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(&0u16.to_le_bytes());
    v.extend_from_slice(&world.to_le_bytes());
    v.extend_from_slice(&a.to_le_bytes());
    v.extend_from_slice(&b.to_le_bytes());
    v
}

fn check_magic(b: &[u8], what: &str) -> Result<(), String> {
    if b[0..4] != MAGIC {
        return Err(format!("{what} has bad magic {:02x?}: not a tessera-comm peer", &b[0..4]));
    }
    let v = u16::from_le_bytes([b[4], b[5]]);
    if v != VERSION {
        return Err(format!("{what} speaks handshake version {v}, this build {VERSION}: run the same build everywhere"));
    }
    Ok(())
}

/// Dialer side. The stream must have read/write timeouts set (the handshake deadline).
pub fn dial(s: &mut TcpStream, secret: &[u8], my_rank: usize, world: usize, peer_rank: usize) -> Result<(), String> {
    let mut hello = header(world as u32, my_rank as u32, peer_rank as u32);
    hello.extend_from_slice(&nonce()?);
    assert_eq!(hello.len(), HELLO_BYTES);
    s.write_all(&hello).map_err(|e| format!("sending hello: {e}"))?;

    let mut ch = [0u8; CHALLENGE_BODY_BYTES + MAC_BYTES];
    read_exact(s, &mut ch, "challenge")?;
    check_magic(&ch, "challenge")?;
    let (body, mac_a) = ch.split_at(CHALLENGE_BODY_BYTES);
    mac(secret, b"tessera-comm acceptor v1", &[&hello, body])
        .verify_slice(mac_a)
        .map_err(|_| format!("rank {peer_rank}'s proof does not match our secret (its secret differs, or it is not our cluster)"))?;
    let u32_at = |i: usize| u32::from_le_bytes(body[i..i + 4].try_into().unwrap());
    // The challenge body is laid out like HELLO: world at 8, the acceptor's rank at 16.
    if u32_at(8) as usize != world || u32_at(16) as usize != peer_rank {
        return Err(format!(
            "expected rank {peer_rank} of world {world}, the peer is rank {} of world {}",
            u32_at(16),
            u32_at(8)
        ));
    }
    let proof = mac(secret, b"tessera-comm dialer v1", &[&hello, &ch]).finalize().into_bytes();
    s.write_all(&proof).map_err(|e| format!("sending proof: {e}"))?;
    let mut ack = [0u8; 4];
    read_exact(s, &mut ack, "acknowledgement")?;
    if ack != ACK {
        return Err(format!("bad acknowledgement {ack:02x?}"));
    }
    Ok(())
}

/// Acceptor side: returns the authenticated dialer's rank once `accept_rank` approves it.
pub fn accept(
    s: &mut TcpStream,
    secret: &[u8],
    my_rank: usize,
    world: usize,
    accept_rank: impl Fn(usize) -> Result<(), String>,
) -> Result<usize, String> {
    let mut hello = [0u8; HELLO_BYTES];
    read_exact(s, &mut hello, "hello")?;
    check_magic(&hello, "hello")?;
    let mut body = header(world as u32, 0, my_rank as u32);
    body.extend_from_slice(&nonce()?);
    assert_eq!(body.len(), CHALLENGE_BODY_BYTES);
    let mac_a = mac(secret, b"tessera-comm acceptor v1", &[&hello, &body]).finalize().into_bytes();
    let mut ch = body.clone();
    ch.extend_from_slice(&mac_a);
    s.write_all(&ch).map_err(|e| format!("sending challenge: {e}"))?;

    let mut proof = [0u8; MAC_BYTES];
    read_exact(s, &mut proof, "proof")?;
    mac(secret, b"tessera-comm dialer v1", &[&hello, &ch])
        .verify_slice(&proof)
        .map_err(|_| "wrong cluster secret (HMAC proof does not verify)".to_string())?;
    // Only now are the claimed fields authenticated.
    let u32_at = |i: usize| u32::from_le_bytes(hello[i..i + 4].try_into().unwrap());
    let (peer_world, peer_rank, wants) = (u32_at(8) as usize, u32_at(12) as usize, u32_at(16) as usize);
    if peer_world != world {
        return Err(format!("peer says world size {peer_world}, ours is {world}"));
    }
    if wants != my_rank {
        return Err(format!("peer wanted rank {wants}, this is rank {my_rank} (hostfile order differs?)"));
    }
    accept_rank(peer_rank)?;
    s.write_all(&ACK).map_err(|e| format!("sending acknowledgement: {e}"))?;
    Ok(peer_rank)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::Duration;

    fn pair(secret_a: &'static [u8], secret_d: &'static [u8]) -> (Result<usize, String>, Result<(), String>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            dial(&mut s, secret_d, 1, 2, 0)
        });
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let a = accept(&mut s, secret_a, 0, 2, |r| if r == 1 { Ok(()) } else { Err("no".into()) });
        drop(s);
        (a, t.join().unwrap())
    }

    #[test]
    fn same_secret_authenticates_both_ways() {
        let (a, d) = pair(b"0123456789abcdef0123", b"0123456789abcdef0123");
        assert_eq!(a, Ok(1));
        assert_eq!(d, Ok(()));
    }

    #[test]
    fn wrong_secret_is_refused_on_both_sides() {
        let (a, d) = pair(b"0123456789abcdef0123", b"XXXX456789abcdef0123");
        assert!(d.unwrap_err().contains("does not match our secret"));
        assert!(a.is_err());
    }

    #[test]
    fn garbage_is_refused() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&[0x47; 200]).unwrap();
        });
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let e = accept(&mut s, b"0123456789abcdef", 0, 2, |_| Ok(())).unwrap_err();
        assert!(e.contains("bad magic"), "{e}");
        t.join().unwrap();
    }
}
