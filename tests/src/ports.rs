//! Loopback ports for the test processes that listen in the root namespace (etcd, the
//! apiserver, operator health endpoints).
//!
//! A port found by binding `127.0.0.1:0` comes from the kernel's ephemeral range — the same range
//! the kernel draws from for outgoing connections. Between releasing such a port and the
//! component binding it, any `connect()` on the machine (the apiserver's own connections to etcd,
//! a test's client) may take it as its local port, and the listen then fails with "address already
//! in use" (CI saw this twice in one run). So ports here come from below the ephemeral range,
//! which `connect()` never picks; a port is checked free by binding it, and never handed out twice
//! by one test process.

use std::{
    collections::BTreeSet,
    hash::{BuildHasher, RandomState},
    net::TcpListener,
    sync::Mutex,
};

use crate::{Error, Result, io_err};

/// Lowest port handed out (clear of well-known and registered low ports in common use).
const FLOOR: u16 = 10_000;

/// Ports this process already handed out, so parallel tests never get the same one.
static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// The first port of the kernel's ephemeral range (`net.ipv4.ip_local_port_range`).
fn ephemeral_low() -> Result<u16> {
    let path = "/proc/sys/net/ipv4/ip_local_port_range";
    let text = std::fs::read_to_string(path).map_err(|e| Error::Prerequisite(format!("read {path}: {e}")))?;
    text.split_whitespace()
        .next()
        .and_then(|low| low.parse().ok())
        .ok_or_else(|| Error::Prerequisite(format!("{path} reads {text:?}")))
}

/// A free TCP port on 127.0.0.1 outside the ephemeral range, not handed out before by this
/// process. Random start, so concurrent test processes rarely probe the same ports.
pub fn free_loopback_port() -> Result<u16> {
    let low = ephemeral_low()?;
    let Some(span) = low.checked_sub(FLOOR).filter(|span| *span >= 1_000) else {
        // No room below a wide ephemeral range: take the kernel's pick (the start retries).
        eprintln!("ephemeral ports start at {low}: test listeners use kernel-picked ports");
        let listener = TcpListener::bind("127.0.0.1:0").map_err(io_err("bind free port"))?;
        return Ok(listener.local_addr().map_err(io_err("local addr"))?.port());
    };
    let start = RandomState::new().hash_one(std::process::id()) % u64::from(span);
    let mut handed_out = HANDED_OUT
        .lock()
        .map_err(|_| Error::Prerequisite("port registry poisoned".into()))?;
    for i in 0..u64::from(span) {
        // Below `low`, so it fits.
        let port = FLOOR + ((start + i) % u64::from(span)) as u16;
        if handed_out.contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed_out.insert(port);
            return Ok(port);
        }
    }
    Err(Error::Prerequisite(format!(
        "no free loopback port in {FLOOR}..{low}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_below_the_ephemeral_range_free_and_distinct() {
        let low = ephemeral_low().expect("ephemeral range");
        // Each port is bound the moment it is handed out, and held. Another test process on the
        // machine may still take one in between: its hand-out also probes by binding and leaves
        // the port free until its etcd or apiserver binds it, seconds later (a suite run saw
        // this once). So a port found taken is counted, not failed; a hand-out that gave taken
        // ports would exceed the allowance (with ~22,000 ports and a few components starting at
        // a time, more than 5 of 50 taken is not chance).
        let mut held = Vec::new();
        let mut taken = Vec::new();
        for _ in 0..50 {
            let port = free_loopback_port().expect("port");
            if low >= FLOOR + 1_000 {
                assert!((FLOOR..low).contains(&port), "{port} outside {FLOOR}..{low}");
            }
            match TcpListener::bind(("127.0.0.1", port)) {
                Ok(listener) => held.push((port, listener)),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => taken.push(port),
                Err(e) => panic!("bind handed-out port {port}: {e}"),
            }
        }
        assert!(taken.len() <= 5, "handed-out ports already in use: {taken:?}");
        let distinct: BTreeSet<u16> = held
            .iter()
            .map(|(p, _)| *p)
            .chain(taken.iter().copied())
            .collect();
        assert_eq!(distinct.len(), held.len() + taken.len(), "{distinct:?}");
    }
}
