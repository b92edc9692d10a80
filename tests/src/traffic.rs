//! Real traffic in the namespace nodes: `swy-echo` servers in pod namespaces answer with their
//! identity; clients in any namespace make bounded TCP/UDP attempts and report what answered.
//! Servers listen on both families; targets are IPv4 or IPv6 socket addresses, and the peer a
//! server saw reads `a.b.c.d:port` or `[v6]:port`.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    net::{IpAddr, SocketAddr},
    process::{Child, Command, Stdio},
    time::Duration,
};

use crate::{Error, Result, binaries, io_err, netns::Pod, sweep};

/// A running echo server; killed on drop.
pub struct Server {
    child: Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        sweep::stop_child(&mut self.child, Duration::from_secs(2));
    }
}

/// Starts `swy-echo serve` in `pod`, named after the pod, and waits until it listens.
pub fn start_server(pod: &Pod, tcp: &[u16], udp: &[u16]) -> Result<Server> {
    let join = |p: &[u16]| p.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    let bin = binaries::workspace_bin("swy-echo")?;
    let mut child = Command::new("ip")
        .args(["netns", "exec", &pod.netns])
        .arg(bin)
        .args([
            "serve",
            "--name",
            &pod.name,
            "--tcp",
            &join(tcp),
            "--udp",
            &join(udp),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(io_err("start swy-echo"))?;
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    if line.trim() != "ready" {
        let _ = child.kill();
        return Err(Error::Prerequisite(format!(
            "swy-echo in {} did not start",
            pod.netns
        )));
    }
    Ok(Server { child })
}

/// Result of one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// An endpoint answered: its name and the client address it saw.
    Answered {
        /// Server (pod) name.
        server: String,
        /// Source address the server saw: `a.b.c.d:port` or `[v6]:port`.
        peer: String,
    },
    /// Connection refused (ICMP port unreachable or RST).
    Refused,
    /// No answer in time.
    Timeout,
    /// Anything else.
    Error(String),
}

impl Outcome {
    /// The answering server, if any.
    pub fn server(&self) -> Option<&str> {
        match self {
            Outcome::Answered { server, .. } => Some(server),
            _ => None,
        }
    }

    /// The source IP the answering server saw, if any.
    pub fn peer_ip(&self) -> Option<IpAddr> {
        match self {
            Outcome::Answered { peer, .. } => peer.parse::<SocketAddr>().ok().map(|p| p.ip()),
            _ => None,
        }
    }
}

/// Makes `count` attempts from `netns` to `target` and returns their outcomes, exactly `count`;
/// a client that could not run (no such namespace, a missing binary) is an error.
pub fn probe(
    netns: &str,
    target: SocketAddr,
    udp: bool,
    count: u32,
    timeout_ms: u64,
) -> Result<Vec<Outcome>> {
    let bin = binaries::workspace_bin("swy-echo")?;
    let out = Command::new("ip")
        .args(["netns", "exec", netns])
        .arg(bin)
        .args([
            "client",
            "--target",
            &target.to_string(),
            "--proto",
            if udp { "udp" } else { "tcp" },
        ])
        .args([
            "--count",
            &count.to_string(),
            "--timeout-ms",
            &timeout_ms.to_string(),
        ])
        .output()
        .map_err(io_err("run swy-echo client"))?;
    // Exactly one outcome per attempt, from a client that ran: a check that every outcome is a
    // timeout (or a refusal) must not pass on an empty list because the client never started.
    let outcomes = parse(&String::from_utf8_lossy(&out.stdout));
    if !out.status.success() || outcomes.len() != count as usize {
        return Err(Error::Command {
            command: format!("swy-echo client --target {target} in {netns}"),
            detail: format!(
                "{}, {} of {count} outcomes: {}",
                out.status,
                outcomes.len(),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(outcomes)
}

fn parse(text: &str) -> Vec<Outcome> {
    text.lines()
        .map(|l| {
            let mut parts = l.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("ok"), Some(server), Some(peer)) => Outcome::Answered {
                    server: server.into(),
                    peer: peer.into(),
                },
                (Some("refused"), _, _) => Outcome::Refused,
                (Some("timeout"), _, _) => Outcome::Timeout,
                _ => Outcome::Error(l.to_owned()),
            }
        })
        .collect()
}

/// Answers per server name.
pub fn tally(outcomes: &[Outcome]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for o in outcomes {
        let key = o.server().map(str::to_owned).unwrap_or_else(|| format!("{o:?}"));
        *m.entry(key).or_insert(0) += 1;
    }
    m
}

/// A steady client load running in the background.
pub struct Load {
    child: Option<Child>,
}

/// Starts `count` TCP attempts from `netns` to `target`, one every `interval_ms`.
pub fn start_load(netns: &str, target: SocketAddr, count: u32, interval_ms: u64) -> Result<Load> {
    let bin = binaries::workspace_bin("swy-echo")?;
    let child = Command::new("ip")
        .args(["netns", "exec", netns])
        .arg(bin)
        .args(["client", "--target", &target.to_string(), "--proto", "tcp"])
        .args([
            "--count",
            &count.to_string(),
            "--timeout-ms",
            "1000",
            "--interval-ms",
            &interval_ms.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(io_err("start load"))?;
    Ok(Load { child: Some(child) })
}

impl Load {
    /// Stops the load now and returns the outcomes so far.
    pub fn stop(mut self) -> Result<Vec<Outcome>> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| Error::Prerequisite("load already finished".into()))?;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let mut text = String::new();
        if let Some(mut out) = child.stdout.take() {
            use std::io::Read;
            let _ = out.read_to_string(&mut text);
        }
        let _ = child.wait();
        // The last line may be cut by the signal; keep only complete answers and failures.
        Ok(parse(&text)
            .into_iter()
            .filter(|o| !matches!(o, Outcome::Error(_)))
            .collect())
    }

    /// Waits for the load to finish and returns every outcome.
    pub fn finish(mut self) -> Result<Vec<Outcome>> {
        let child = self
            .child
            .take()
            .ok_or_else(|| Error::Prerequisite("load already finished".into()))?;
        let out = child.wait_with_output().map_err(io_err("wait for load"))?;
        Ok(parse(&String::from_utf8_lossy(&out.stdout)))
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            sweep::stop_child(&mut c, Duration::from_secs(1));
        }
    }
}

/// One HTTP GET from `netns`: (status code, full response text).
pub fn http_get(netns: &str, target: SocketAddr, path: &str) -> Result<(u16, String)> {
    let bin = binaries::workspace_bin("swy-echo")?;
    let out = Command::new("ip")
        .args(["netns", "exec", netns])
        .arg(bin)
        .args(["http", "--target", &target.to_string(), "--path", path])
        .output()
        .map_err(io_err("run swy-echo http"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let code = text
        .lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or(0);
    Ok((code, text))
}
