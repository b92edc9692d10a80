//! Ownership marks and the sweep of leftovers from crashed runs.
//!
//! Every run directory is `$TMPDIR/swyt-<pid>-<seq>` and every network namespace `swyt<pid>x<seq>-...`,
//! where `<pid>` is the test process. A run directory lists the PIDs of the processes it started in
//! `pids`. When a test starts, anything carrying the prefix of a process that no longer exists is
//! removed: its recorded processes are killed (after checking their command line still names the run
//! directory, so a reused PID is never touched), processes inside its namespaces are killed, and the
//! directories and namespaces are deleted.

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
