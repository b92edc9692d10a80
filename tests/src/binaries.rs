//! Locating the binaries the tests run: the Go-built control plane (built on demand by
//! `scripts/build-control-plane.sh` into a cache outside git) and the workspace's own binaries.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{Mutex, OnceLock},
};

use crate::{Error, Result, sweep};

/// Root of the workspace.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Directory with `etcd`, `kube-apiserver` and `kubectl`, building them on first use.
/// `SWITCHYARD_K8S_BIN` overrides it.
pub fn control_plane_bin() -> Result<PathBuf> {
    static BIN: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Ok(dir) = std::env::var("SWITCHYARD_K8S_BIN") {
            return Ok(PathBuf::from(dir));
        }
        let script = workspace_root().join("scripts/build-control-plane.sh");
        let out = std::process::Command::new("bash")
            .arg(&script)
            .stderr(std::process::Stdio::inherit())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        match (out.status.success(), stdout.lines().last()) {
            (true, Some(dir)) => Ok(PathBuf::from(dir.trim())),
            _ => Err(format!(
                "the test control plane could not be built ({}); see the lines above",
                script.display()
            )),
        }
    })
    .clone()
    .map_err(Error::Prerequisite)
}

/// Path of a binary of this workspace (built by `cargo build` before the tests run).
pub fn workspace_bin(name: &str) -> Result<PathBuf> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let path = target.join(profile).join(name);
    if path.is_file() {
        Ok(pinned(name, &path))
    } else {
        Err(Error::Prerequisite(format!(
            "{} is missing: run `cargo build --workspace --bins` first (the test script does)",
            path.display()
        )))
    }
}

/// This process's directory of pinned binaries ([`pinned`]).
fn pin_dir() -> PathBuf {
    std::env::temp_dir().join(format!("{}-{}-bin", sweep::PREFIX, std::process::id()))
}

/// Removes this process's pinned binaries, for a one-shot program (a bench) at its end; a test
/// process leaves them to the sweep of its leftovers. Running processes keep their files.
pub fn remove_pinned() {
    let _ = std::fs::remove_dir_all(pin_dir());
}

/// The binary at `path` as it was when this test process first asked for `name`: a hard link in
/// `$TMPDIR/swyt-<pid>-bin/` (swept with the run's other leftovers once the process is gone). A
/// `cargo build` during the run replaces `target/debug/<name>` with a new file and leaves the
/// linked one alone, so one test never runs, say, an agent killed mid-switch and its successor
/// from two different builds. Falls back to `path` where no hard link can be made.
fn pinned(name: &str, path: &Path) -> PathBuf {
    static PINNED: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());
    let mut pinned = PINNED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = pinned.get(name) {
        return p.clone();
    }
    let dir = pin_dir();
    let link = dir.join(name);
    let made = std::fs::create_dir_all(&dir).and_then(|()| {
        let _ = std::fs::remove_file(&link);
        std::fs::hard_link(path, &link)
    });
    let p = if made.is_ok() { link } else { path.to_path_buf() };
    pinned.insert(name.to_owned(), p.clone());
    p
}
