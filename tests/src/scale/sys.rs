//! What the benchmark reads from outside a process: its RSS and CPU seconds from `/proc`, its
//! Prometheus metrics over HTTP inside a node namespace, and commands run in a namespace through
//! `nsenter --net` (cheaper than `ip netns exec`, which also remounts `/sys`: the kernel checks
//! run up to a hundred times a second).

use std::{
    fs::File,
    io::{Read, Write},
    net::TcpStream,
    os::fd::AsFd,
    time::Duration,
};

use nix::sched::{CloneFlags, setns};

use crate::{Error, Result, io_err, run};

/// Runs `args` in network namespace `netns`; stdout, or an error when it exits non-zero.
pub fn in_netns(netns: &str, args: &[&str]) -> Result<String> {
    let target = format!("--net=/run/netns/{netns}");
    let mut full = vec![target.as_str()];
    full.extend_from_slice(args);
    run("nsenter", &full)
}

/// The elements with `keys` of Switchyard's IPv4 nft map `map` in `netns` (one netlink
/// `GETSETELEM` from a thread inside it; no `nft` process, no listing); `None` when any is missing.
pub fn nft_elements_in_netns(
    netns: &str,
    map: &str,
    keys: &[switchyard_agent::sys::nft::ir::Key],
) -> Result<Option<Vec<Vec<u8>>>> {
    in_netns_thread(netns, || {
        switchyard_agent::sys::nft::get_elements(switchyard_agent::model::IpFamily::V4, map, keys)
            .map_err(|e| Error::Prerequisite(format!("nft get elements {map} in {netns}: {e}")))
    })
}

/// Each nftables generation of a namespace with when it was first seen and when the poll before
/// that ran (time from the poller's `t0`), polled every `period` by [`poll_generations`].
#[derive(Debug, Default)]
pub struct Generations {
    seen: std::sync::Mutex<Vec<(u32, Duration, Duration)>>,
    stop: std::sync::atomic::AtomicBool,
}

impl Generations {
    /// The latest generation seen, with its (first seen, poll before) times.
    pub fn latest(&self) -> Option<(u32, Duration, Duration)> {
        self.seen.lock().ok()?.last().copied()
    }

    /// Ends the poll.
    pub fn stop(&self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Polls the nftables generation of `netns` into `into` every `period` until stopped or `limit`
/// (time from `t0`) has passed. Run it on its own thread (it enters the namespace once).
pub fn poll_generations(
    netns: &str,
    into: &Generations,
    t0: std::time::Instant,
    period: Duration,
    limit: Duration,
) -> Result<()> {
    in_netns_thread(netns, || {
        let mut previous = t0.elapsed();
        while !into.stop.load(std::sync::atomic::Ordering::Relaxed) && t0.elapsed() < limit {
            let generation = switchyard_agent::sys::nft::generation()
                .map_err(|e| Error::Prerequisite(format!("nft generation in {netns}: {e}")))?;
            let now = t0.elapsed();
            let mut seen = into
                .seen
                .lock()
                .map_err(|_| Error::Prerequisite("generation poller poisoned".into()))?;
            if seen.last().is_none_or(|(g, _, _)| *g != generation) {
                seen.push((generation, now, previous));
            }
            drop(seen);
            previous = now;
            std::thread::sleep(period);
        }
        Ok(())
    })
}

/// Runs `f` on a thread inside network namespace `netns` (a thread, not a process: the API
/// benchmark's kernel checks run up to hundreds of times a second).
pub fn in_netns_thread<T: Send>(netns: &str, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    let path = format!("/run/netns/{netns}");
    std::thread::scope(|s| {
        s.spawn(|| {
            let ns = File::open(&path).map_err(io_err(format!("open {path}")))?;
            setns(ns.as_fd(), CloneFlags::CLONE_NEWNET)
                .map_err(|e| Error::Prerequisite(format!("setns {netns}: {e}")))?;
            f()
        })
        .join()
        .map_err(|_| Error::Prerequisite(format!("thread in {netns} panicked")))?
    })
}

/// A process's resident set and CPU time (its own and its waited-for children's: kube-proxy and
/// the iptables backends run `iptables-restore`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    /// Resident set size, MiB.
    pub rss_mib: f64,
    /// Of it, file-backed pages (`RssFile`: the executable's and libraries' pages), MiB.
    pub rss_file_mib: f64,
    /// User + system CPU seconds, children included.
    pub cpu_s: f64,
}

/// The usage of process `pid` now.
pub fn usage(pid: u32) -> Result<Usage> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(io_err("proc status"))?;
    let kib = |field: &str| -> f64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            // A field the kernel does not report prints as "–", not as a measured 0.
            .unwrap_or(f64::NAN)
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(io_err("proc stat"))?;
    // Fields after the command name (which may hold spaces): state is field 3, utime 14.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(4)
        .filter_map(|f| f.parse().ok())
        .collect();
    let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    Ok(Usage {
        rss_mib: kib("VmRSS:") / 1024.0,
        rss_file_mib: kib("RssFile:") / 1024.0,
        cpu_s: fields.iter().sum::<f64>() / ticks,
    })
}

/// The process in `netns` whose command name starts with `comm` (the proxy: the only long-lived
/// process in a fresh node namespace).
pub fn pid_in_netns(netns: &str, comm: &str) -> Result<Option<u32>> {
    let pids = run("ip", &["netns", "pids", netns])?;
    Ok(pids
        .lines()
        .filter_map(|l| l.trim().parse::<u32>().ok())
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim().starts_with(comm))
        }))
}

/// The process of the root namespace whose command line contains `needle`.
pub fn pid_with_arg(needle: &str) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).replace('\0', " ").contains(needle))
        })
}

/// `GET /metrics` from `127.0.0.1:port` inside `netns` (a thread enters it to connect).
pub fn metrics_in_netns(netns: &str, port: u16) -> Result<String> {
    let netns = netns.to_owned();
    std::thread::spawn(move || -> Result<String> {
        let own = File::open("/proc/thread-self/ns/net").map_err(io_err("open own netns"))?;
        let target = File::open(format!("/run/netns/{netns}")).map_err(io_err("open netns"))?;
        setns(target.as_fd(), CloneFlags::CLONE_NEWNET)
            .map_err(|e| Error::Prerequisite(format!("setns {netns}: {e}")))?;
        let body = http_get(port, "/metrics");
        setns(own.as_fd(), CloneFlags::CLONE_NEWNET)
            .map_err(|e| Error::Prerequisite(format!("setns back: {e}")))?;
        body
    })
    .join()
    .map_err(|_| Error::Prerequisite("metrics thread panicked".into()))?
}

/// `GET path` (HTTP/1.0, so no chunked body) from `127.0.0.1:port`; the body.
pub fn http_get(port: u16, path: &str) -> Result<String> {
    let addr = ([127, 0, 0, 1], port).into();
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(io_err("metrics connect"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(io_err("metrics timeout"))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").map_err(io_err("metrics request"))?;
    let mut text = String::new();
    s.read_to_string(&mut text).map_err(io_err("metrics read"))?;
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default())
}

/// The sum over every series of a Prometheus histogram's `_sum` and `_count` (all label sets, e.g.
/// both IP families of kube-proxy).
pub fn histogram(text: &str, name: &str) -> Option<(f64, f64)> {
    let (sum, count) = (format!("{name}_sum"), format!("{name}_count"));
    let mut found: Option<(f64, f64)> = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let metric = series.split('{').next().unwrap_or_default();
        let Ok(v) = value.parse::<f64>() else { continue };
        if metric == sum {
            found.get_or_insert((0.0, 0.0)).0 += v;
        } else if metric == count {
            found.get_or_insert((0.0, 0.0)).1 += v;
        }
    }
    found
}

/// The sum over every series of counter or gauge `name` (0 when absent).
pub fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(series, _)| {
            let metric = series.split('{').next().unwrap_or_default();
            metric == name || metric == format!("{name}_total")
        })
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_sum_every_series() {
        let text = "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum{ip_family=\"IPv4\"} 1.5\nh_count{ip_family=\"IPv4\"} 1\nh_sum{ip_family=\"IPv6\"} 0.5\nh_count{ip_family=\"IPv6\"} 2\nc_total 4\n";
        assert_eq!(histogram(text, "h"), Some((2.0, 3.0)));
        assert_eq!(histogram(text, "missing"), None);
        assert_eq!(counter(text, "c"), 4.0);
    }
}
