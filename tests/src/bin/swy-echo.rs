//! Test traffic tool, run inside network namespaces.
//!
//! `swy-echo serve --name N --tcp PORT[,PORT] --udp PORT[,PORT]`: answers every TCP connection and
//! UDP datagram with `N <peer>` (so tests see which endpoint answered and which source address it
//! saw), until killed. It listens on IPv4 and IPv6 (one dual-stack `[::]` socket per port where the
//! namespace allows it; IPv4 alone where it has no IPv6); `<peer>` is `a.b.c.d:port` for IPv4
//! peers (never IPv4-mapped) and `[v6]:port` for IPv6 ones.
//!
//! `swy-echo http --target ADDR --path /P`: one HTTP/1.0 GET; prints the status code, then the
//! headers and body.
//!
//! `swy-echo client --target ADDR --proto tcp|udp --count N [--timeout-ms T] [--interval-ms I]`:
//! makes N bounded attempts and prints one line each: `ok <name> <peer>`, `refused`, `timeout` or
//! `error <detail>`.
//!
//! `ADDR` is `a.b.c.d:port` or `[v6]:port`.
#![cfg_attr(not(test), warn(clippy::too_many_lines))]

use std::{
    io::{self, Read, Write},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    time::Duration,
};

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn ports(list: Option<String>) -> Vec<u16> {
    list.unwrap_or_default()
        .split(',')
        .filter_map(|p| p.trim().parse().ok())
        .collect()
}

/// How a peer is printed: IPv4 peers of a dual-stack socket arrive IPv4-mapped (`::ffff:a.b.c.d`)
/// and are shown as plain IPv4, exactly as an IPv4 socket shows them.
fn show(peer: SocketAddr) -> String {
    SocketAddr::new(peer.ip().to_canonical(), peer.port()).to_string()
}

/// Binds `port` for both families: one dual-stack `[::]` socket; a `0.0.0.0` socket next to it when
/// `[::]` sockets are IPv6-only here (`net.ipv6.bindv6only=1`); `0.0.0.0` alone when the namespace
/// has no IPv6.
fn bind_both<S>(port: u16, bind: impl Fn(SocketAddr) -> io::Result<S>) -> io::Result<Vec<S>> {
    let v4 = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
    // Per network namespace: this process's.
    let v6_only = std::fs::read_to_string("/proc/sys/net/ipv6/bindv6only").is_ok_and(|v| v.trim() == "1");
    let mut sockets = Vec::new();
    if v6_only {
        sockets.push(bind(v4)?);
    }
    match bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port))) {
        Ok(socket) => sockets.push(socket),
        // EAFNOSUPPORT, or IPv6 disabled in this namespace.
        Err(e) if e.raw_os_error() == Some(97) || e.kind() == io::ErrorKind::AddrNotAvailable => {
            if !v6_only {
                sockets.push(bind(v4)?);
            }
        }
        Err(e) => return Err(e),
    }
    Ok(sockets)
}

fn serve(args: &[String]) {
    let name = arg(args, "--name").unwrap_or_else(|| "server".into());
    let mut handles = Vec::new();
    for port in ports(arg(args, "--tcp")) {
        let Ok(listeners) = bind_both(port, TcpListener::bind) else {
            eprintln!("swy-echo: cannot bind tcp {port}");
            std::process::exit(1);
        };
        for listener in listeners {
            let name = name.clone();
            handles.push(std::thread::spawn(move || {
                for mut conn in listener.incoming().flatten() {
                    let peer = conn.peer_addr().map(show).unwrap_or_default();
                    let _ = conn.write_all(format!("{name} {peer}\n").as_bytes());
                }
            }));
        }
    }
    for port in ports(arg(args, "--udp")) {
        let Ok(sockets) = bind_both(port, UdpSocket::bind) else {
            eprintln!("swy-echo: cannot bind udp {port}");
            std::process::exit(1);
        };
        for socket in sockets {
            let name = name.clone();
            handles.push(std::thread::spawn(move || {
                let mut buf = [0u8; 512];
                while let Ok((_, peer)) = socket.recv_from(&mut buf) {
                    let _ = socket.send_to(format!("{name} {}\n", show(peer)).as_bytes(), peer);
                }
            }));
        }
    }
    println!("ready");
    for h in handles {
        let _ = h.join();
    }
}

fn attempt(target: SocketAddr, udp: bool, timeout: Duration) -> String {
    let mut buf = [0u8; 256];
    let result = if udp {
        let local = if target.is_ipv4() {
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0))
        } else {
            SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0))
        };
        UdpSocket::bind(local).and_then(|s| {
            s.set_read_timeout(Some(timeout))?;
            s.connect(target)?;
            s.send(b"hello")?;
            let n = s.recv(&mut buf)?;
            Ok(n)
        })
    } else {
        TcpStream::connect_timeout(&target, timeout).and_then(|mut s| {
            s.set_read_timeout(Some(timeout))?;
            let n = s.read(&mut buf)?;
            Ok(n)
        })
    };
    match result {
        Ok(n) if n > 0 => format!("ok {}", String::from_utf8_lossy(&buf[..n]).trim()),
        Ok(_) => "error empty reply".into(),
        Err(e) => match e.kind() {
            std::io::ErrorKind::ConnectionRefused => "refused".into(),
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => "timeout".into(),
            _ => format!("error {e}"),
        },
    }
}

fn client(args: &[String]) {
    let Some(target) = arg(args, "--target").and_then(|t| t.parse::<SocketAddr>().ok()) else {
        eprintln!("swy-echo client: --target IP:PORT or [IPv6]:PORT is required");
        std::process::exit(2);
    };
    let udp = arg(args, "--proto").as_deref() == Some("udp");
    let count: u32 = arg(args, "--count")
        .and_then(|c| c.parse().ok())
        .unwrap_or(1)
        .min(100_000);
    let timeout = Duration::from_millis(
        arg(args, "--timeout-ms")
            .and_then(|t| t.parse().ok())
            .unwrap_or(1000),
    );
    let interval = Duration::from_millis(
        arg(args, "--interval-ms")
            .and_then(|t| t.parse().ok())
            .unwrap_or(0),
    );
    let mut out = std::io::stdout().lock();
    for _ in 0..count {
        let _ = writeln!(out, "{}", attempt(target, udp, timeout));
        let _ = out.flush();
        if !interval.is_zero() {
            std::thread::sleep(interval);
        }
    }
}

fn http(args: &[String]) {
    let Some(target) = arg(args, "--target").and_then(|t| t.parse::<SocketAddr>().ok()) else {
        eprintln!("swy-echo http: --target IP:PORT or [IPv6]:PORT is required");
        std::process::exit(2);
    };
    let path = arg(args, "--path").unwrap_or_else(|| "/".into());
    let result = TcpStream::connect_timeout(&target, Duration::from_secs(2)).and_then(|mut s| {
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: {target}\r\n\r\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        Ok(text)
    });
    match result {
        Ok(text) => {
            let code = text.split_whitespace().nth(1).unwrap_or("0");
            println!("{code}\n{text}");
        }
        Err(e) => {
            println!("error {e}");
            std::process::exit(1);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("serve") => serve(&args),
        Some("client") => client(&args),
        Some("http") => http(&args),
        _ => {
            eprintln!(
                "usage: swy-echo serve --name N --tcp P --udp P | client --target IP:PORT --proto tcp|udp --count N"
            );
            std::process::exit(2);
        }
    }
}
