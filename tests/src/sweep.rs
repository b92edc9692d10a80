//! Ownership marks and the sweep of leftovers from crashed runs.
//!
//! Every run directory is `$TMPDIR/swyt-<pid>-<seq>` and every network namespace `swyt<pid>x<seq>-...`,
//! where `<pid>` is the test process. A run directory lists the PIDs of the processes it started in
//! `pids`. When a test starts, anything carrying the prefix of a process that no longer exists is
//! removed: its recorded processes are killed (after checking their command line still names the run
//! directory, so a reused PID is never touched), processes inside its namespaces are killed, and the
//! directories and namespaces are deleted.
//!
//! The real-node tier ([`crate::kubelet`]) adds processes nobody recorded (containerd's shims, the
//! containers) and kernel objects outside the run directory: every process whose command line names
//! a dead run's directory is killed (containerd, kubelet, shims, the mount-namespace holders), every
//! top-level cgroup `swyt<pid>x<seq>-...` of a dead owner is emptied and removed in each hierarchy,
//! and any mount left under a dead run's directory is detached before the directory is removed.

use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
};

use nix::{sys::signal, unistd::Pid};

/// Prefix of everything the harness creates.
pub const PREFIX: &str = "swyt";

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A fresh `(pid, seq)` pair for naming one run's objects.
pub fn next_id() -> (u32, u32) {
    (std::process::id(), SEQ.fetch_add(1, Ordering::SeqCst))
}

fn alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// Parses the owner PID out of `swyt-<pid>-...` or `swyt<pid>x...`.
pub fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(PREFIX)?.trim_start_matches('-');
    rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// Records `pid` as started by the run in `dir`.
pub fn record_pid(dir: &Path, pid: u32) {
    use std::io::Write;
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("pids"))
    {
        let _ = writeln!(f, "{pid}");
    }
}

/// Sends SIGTERM, waits up to `grace`, then SIGKILL.
pub fn stop_child(child: &mut std::process::Child, grace: std::time::Duration) {
    let pid = Pid::from_raw(child.id() as i32);
    let _ = signal::kill(pid, signal::Signal::SIGTERM);
    // A child a test froze (SIGSTOP) handles its SIGTERM only once thawed.
    let _ = signal::kill(pid, signal::Signal::SIGCONT);
    let deadline = std::time::Instant::now() + grace;
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Removes leftovers of dead test processes. Safe to call concurrently from several tests.
pub fn sweep_leftovers() {
    let tmp = std::env::temp_dir();
    if let Ok(entries) = std::fs::read_dir(&tmp) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(pid) = owner_pid(&name).filter(|p| !alive(*p)) {
                let _ = pid;
                sweep_run_dir(&entry.path());
            }
        }
    }
    // After the run directories: their kubelets (killed there) no longer restart containers.
    sweep_cgroups_of_dead();
    if let Ok(list) = crate::run("ip", &["netns", "list"]) {
        for ns in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if owner_pid(ns).is_some_and(|p| !alive(p)) {
                if let Ok(pids) = crate::run("ip", &["netns", "pids", ns]) {
                    for p in pids.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                        let _ = signal::kill(Pid::from_raw(p), signal::Signal::SIGKILL);
                    }
                }
                let _ = crate::run("ip", &["netns", "del", ns]);
            }
        }
    }
}

fn sweep_run_dir(dir: &PathBuf) {
    let marker = dir.to_string_lossy().into_owned();
    kill_naming(&format!("{marker}/"));
    unmount_under(dir);
    if let Ok(pids) = std::fs::read_to_string(dir.join("pids")) {
        for pid in pids.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&marker) {
                let _ = signal::kill(Pid::from_raw(pid), signal::Signal::SIGKILL);
            }
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// SIGKILLs every process (but this one) whose command line contains `marker`, and waits (at most
/// 5 s) until they are gone; returns how many there were.
pub fn kill_naming(marker: &str) -> usize {
    let own = std::process::id();
    let mut killed = Vec::new();
    for pid in all_pids().into_iter().filter(|p| *p != own) {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(marker) {
            let _ = signal::kill(Pid::from_raw(pid as i32), signal::Signal::SIGKILL);
            killed.push(pid);
        }
    }
    wait_gone(&killed, std::time::Duration::from_secs(5));
    killed.len()
}

/// PIDs of all processes.
pub fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until none of `pids` exists any more (zombies count as gone), at most `limit`.
pub fn wait_gone(pids: &[u32], limit: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let left = pids.iter().any(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .map(|s| !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
                .unwrap_or(false)
        });
        if !left {
            return true;
        }
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Mount points of cgroup hierarchies (v1 controllers and the v2 one), from this process's view.
pub fn cgroup_mounts() -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split_whitespace().next()?;
            let point = left.split_whitespace().nth(4)?;
            (fstype == "cgroup" || fstype == "cgroup2").then(|| PathBuf::from(point))
        })
        .collect()
}

/// Kills every process in the top-level cgroup `name` and below, in every hierarchy, then removes
/// those cgroups (deepest first). Bounded: gives up after 10 s. Returns whether all are gone.
pub fn remove_cgroup(name: &str) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mounts = cgroup_mounts();
    loop {
        let mut left = false;
        for mount in &mounts {
            let top = mount.join(name);
            if !top.exists() {
                continue;
            }
            let mut dirs = Vec::new();
            collect_dirs(&top, &mut dirs);
            // Deepest first.
            dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
            for dir in &dirs {
                if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                        let _ = signal::kill(Pid::from_raw(pid), signal::Signal::SIGKILL);
                    }
                }
                if std::fs::remove_dir(dir).is_err() {
                    left = true;
                }
            }
        }
        if !left {
            return true;
        }
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                collect_dirs(&entry.path(), out);
            }
        }
    }
}

/// Removes the harness's top-level cgroups (`swyt<pid>x...`) whose owner is dead.
fn sweep_cgroups_of_dead() {
    let mut names = std::collections::BTreeSet::new();
    for mount in cgroup_mounts() {
        if let Ok(entries) = std::fs::read_dir(&mount) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if owner_pid(&name).is_some_and(|p| !alive(p)) {
                    names.insert(name);
                }
            }
        }
    }
    for name in names {
        remove_cgroup(&name);
    }
}

/// Detaches (lazily) every mount at or under `dir` in this mount namespace, deepest first.
pub fn unmount_under(dir: &Path) {
    let base = dir.to_string_lossy().into_owned();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<String> = info
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .map(|p| p.replace("\\040", " "))
        .filter(|p| p == &base || p.starts_with(&format!("{base}/")))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for point in points {
        let _ = crate::run("umount", &["-l", &point]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pid_reads_both_name_shapes() {
        assert_eq!(owner_pid("swyt-1234-0"), Some(1234));
        assert_eq!(owner_pid("swyt1234x2-node-1"), Some(1234));
        assert_eq!(owner_pid("swyt"), None);
        assert_eq!(owner_pid("other-1234"), None);
    }
}
