//! Throwaway network namespaces for kernel tests (root): created with `ip netns add`, deleted on
//! drop (also when the test panics). Kernel tests touch nothing outside them.

use std::{fs::File, os::fd::AsFd, process::Command};

use nix::sched::{CloneFlags, setns};

/// A network namespace for one test, deleted on drop.
pub struct TestNetns(pub String);

impl TestNetns {
    /// Creates `swyu<pid>-<tag>` (replacing a leftover of the same name).
    pub fn new(tag: &str) -> Self {
        let name = format!("swyu{}-{tag}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        let out = Command::new("ip")
            .args(["netns", "add", &name])
            .output()
            .expect("run ip");
        assert!(
            out.status.success(),
            "ip netns add {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self(name)
    }

    /// Runs `f` on a thread inside the namespace (netlink sockets it opens belong to it).
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/run/netns/{}", self.0);
        std::thread::scope(|s| {
            s.spawn(move || {
                let ns = File::open(&path).expect("netns file");
                setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).expect("setns");
                f()
            })
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
        })
    }

    /// Runs `args` inside the namespace; it must succeed. Returns its stdout.
    pub fn sh(&self, args: &[&str]) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.0])
            .args(args)
            .output()
            .expect("run");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}
