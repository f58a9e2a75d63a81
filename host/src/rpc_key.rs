//! The RPC pre-shared key (`--rpc-key`, `SDHOST_RPC_KEY`): a
//! challenge–response that runs on a new connection before ggml's
//! protocol, so that only clients that hold the key reach a server's
//! device, and a client learns the server holds it too. The key itself
//! never travels; what does is two random nonces and two HMAC-SHA256
//! values over them:
//!
//! ```text
//! client → server   "SDHRPCK1" ‖ client nonce (32)
//! server → client   server nonce (32)
//! client → server   HMAC(key, "sdhost-rpc client" ‖ nonces)
//! server → client   HMAC(key, "sdhost-rpc server" ‖ nonces)   (or it closes)
//! ```
//!
//! A fresh server nonce makes a recorded exchange useless to replay. What
//! it does not give: secrecy or integrity of what follows (ggml's protocol
//! is plain TCP), so someone on the path can read the tensors or take over
//! a connection after the exchange; docs/rpc.md says to use a tunnel or a
//! private network for that.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{Read, Write};

/// What a keyed client sends first. Its first byte is no ggml command, so
/// a server without a key closes the connection at once.
pub const MAGIC: [u8; 8] = *b"SDHRPCK1";
const NONCE: usize = 32;
/// The fewest characters a key may have (an exchange seen on the wire
/// allows guessing a key offline, so a short one is refused).
pub const MIN_LEN: usize = 16;

/// A pre-shared key.
#[derive(Clone)]
pub struct Key(Vec<u8>);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(…)")
    }
}

impl Key {
    /// The key written in `text` (surrounding blanks trimmed), from
    /// `source` (named in the error, which never shows the key).
    pub fn parse(text: &str, source: &str) -> Result<Key, String> {
        let k = text.trim();
        if k.chars().count() < MIN_LEN {
            return Err(format!(
                "{source}: a key needs at least {MIN_LEN} characters (e.g. the output of `openssl rand -hex 32`)"
            ));
        }
        if k.chars().any(char::is_control) {
            return Err(format!("{source}: the key holds control characters"));
        }
        Ok(Key(k.as_bytes().to_vec()))
    }

    fn mac(&self, role: &[u8], client: &[u8], server: &[u8]) -> Hmac<Sha256> {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(role);
        m.update(client);
        m.update(server);
        m
    }
}

fn nonce() -> Result<[u8; NONCE], String> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| format!("no random numbers: {e}"))?;
    Ok(n)
}

fn io(step: &str) -> impl Fn(std::io::Error) -> String + '_ {
    move |e| {
        match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("no answer within the time limit during the key exchange ({step})")
        }
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted
        | std::io::ErrorKind::BrokenPipe => format!(
            "the connection closed during the key exchange ({step}): the server runs without --rpc-key, refused this key, or is not sdhost's rpc-server"
        ),
        _ => format!("key exchange ({step}): {e}"),
    }
    }
}

/// The client's side, on a fresh connection (the caller sets deadlines).
pub fn client(s: &mut (impl Read + Write), key: &Key) -> Result<(), String> {
    let mine = nonce()?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&mine);
    s.write_all(&hello).map_err(io("sending the nonce"))?;
    let mut theirs = [0u8; NONCE];
    s.read_exact(&mut theirs)
        .map_err(io("reading the server's nonce"))?;
    let proof = key
        .mac(b"sdhost-rpc client", &mine, &theirs)
        .finalize()
        .into_bytes();
    s.write_all(&proof).map_err(io("sending the proof"))?;
    let mut answer = [0u8; 32];
    s.read_exact(&mut answer)
        .map_err(io("reading the server's proof"))?;
    key.mac(b"sdhost-rpc server", &mine, &theirs)
        .verify_slice(&answer)
        .map_err(|_| "the server does not hold this key".to_string())
}

/// The server's side, after the client's first byte `first` was read (the
/// caller sets deadlines). `Err` names why the client is refused.
pub fn server(s: &mut (impl Read + Write), key: &Key, first: u8) -> Result<(), String> {
    let mut rest = [0u8; MAGIC.len() - 1 + NONCE];
    if first != MAGIC[0] {
        return Err("a client without the key (this server needs --rpc-key)".into());
    }
    s.read_exact(&mut rest)
        .map_err(|e| format!("key exchange: {e}"))?;
    if rest[..MAGIC.len() - 1] != MAGIC[1..] {
        return Err("a client without the key (this server needs --rpc-key)".into());
    }
    let theirs = &rest[MAGIC.len() - 1..];
    let mine = nonce()?;
    s.write_all(&mine)
        .map_err(|e| format!("key exchange: {e}"))?;
    let mut proof = [0u8; 32];
    s.read_exact(&mut proof)
        .map_err(|e| format!("key exchange: {e}"))?;
    key.mac(b"sdhost-rpc client", theirs, &mine)
        .verify_slice(&proof)
        .map_err(|_| "a client with a wrong key".to_string())?;
    let answer = key
        .mac(b"sdhost-rpc server", theirs, &mine)
        .finalize()
        .into_bytes();
    s.write_all(&answer)
        .map_err(|e| format!("key exchange: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn exchange(client_key: &str, server_key: &str) -> (Result<(), String>, Result<(), String>) {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let sk = Key::parse(server_key, "test").unwrap();
        let server_side = std::thread::spawn(move || {
            let mut first = [0u8; 1];
            b.read_exact(&mut first).unwrap();
            server(&mut b, &sk, first[0])
        });
        let ck = Key::parse(client_key, "test").unwrap();
        let c = client(&mut a, &ck);
        drop(a);
        (c, server_side.join().unwrap())
    }

    #[test]
    fn both_sides_prove_the_key() {
        let k = "0123456789abcdef0123";
        assert_eq!(exchange(k, k), (Ok(()), Ok(())));
        let (c, s) = exchange(k, "another key of enough length");
        assert!(s.unwrap_err().contains("wrong key"));
        assert!(c.is_err());
    }

    #[test]
    fn keys_are_checked_and_never_shown() {
        assert!(Key::parse("short", "--rpc-key")
            .unwrap_err()
            .contains("at least 16"));
        assert!(Key::parse("  0123456789abcdef  ", "x").is_ok());
        let e = Key::parse("0123456789abcdef\u{7}", "--rpc-key").unwrap_err();
        assert!(!e.contains("0123"), "{e}");
        assert_eq!(
            format!("{:?}", Key::parse("0123456789abcdef", "x").unwrap()),
            "Key(…)"
        );
    }

    #[test]
    fn a_plain_ggml_client_is_refused() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let k = Key::parse("0123456789abcdef", "x").unwrap();
        a.write_all(&[14u8]).unwrap();
        let mut first = [0u8; 1];
        b.read_exact(&mut first).unwrap();
        assert!(server(&mut b, &k, first[0])
            .unwrap_err()
            .contains("without the key"));
    }
}
