//! Helpers shared by the tests that run inside the Debian kernel VM (`scripts/ipvs-vm.sh`):
//! commands, entering network namespaces, and wiring one namespace to the VM's root namespace (the
//! node) with a veth pair.

use std::{fs::File, os::fd::AsFd, process::Command};

use nix::sched::{CloneFlags, setns};

/// Fails unless running inside the VM (`scripts/ipvs-vm.sh` sets `SWITCHYARD_IPVS_VM`).
pub fn require_vm() {
    assert!(
        std::env::var_os("SWITCHYARD_IPVS_VM").is_some(),
        "VM-only test: run scripts/ipvs-vm.sh"
    );
}

/// Runs `args`; returns whether it succeeded and its stdout plus stderr.
fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Runs `args`, which must succeed; returns its output.
pub fn sh(args: &[&str]) -> String {
    let (ok, text) = run(args);
    assert!(ok, "{args:?}: {text}");
    text
}

/// `ip LINE`, which must succeed.
pub fn ipcmd(line: &str) {
    let args: Vec<&str> = std::iter::once("ip").chain(line.split_whitespace()).collect();
    sh(&args);
}

/// Moves the calling thread into network namespace `ns`.
pub fn enter(ns: &str) {
    let file = File::open(format!("/run/netns/{ns}")).unwrap_or_else(|e| panic!("netns {ns}: {e}"));
    setns(file.as_fd(), CloneFlags::CLONE_NEWNET).unwrap_or_else(|e| panic!("setns {ns}: {e}"));
}

/// Runs `f` on a thread inside `ns`.
pub fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            enter(ns);
            f()
        })
        .join()
        .unwrap_or_else(|_| panic!("thread in {ns} panicked"))
    })
}

/// Creates namespace `ns` with `addr`/24 on its `eth0`, a veth to the root namespace named
/// `{prefix}{ns}` holding `gateway`/24, and a default route through it.
pub fn wired_netns(ns: &str, prefix: &str, addr: &str, gateway: &str) {
    ipcmd(&format!("netns add {ns}"));
    ipcmd(&format!(
        "link add {prefix}{ns} type veth peer name eth0 netns {ns}"
    ));
    ipcmd(&format!("addr add {gateway}/24 dev {prefix}{ns}"));
    ipcmd(&format!("link set {prefix}{ns} up"));
    ipcmd(&format!("-n {ns} addr add {addr}/24 dev eth0"));
    ipcmd(&format!("-n {ns} link set eth0 up"));
    ipcmd(&format!("-n {ns} link set lo up"));
    ipcmd(&format!("-n {ns} route add default via {gateway}"));
}
