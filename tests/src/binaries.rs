//! Locating the binaries the tests run: the Go-built control plane (built on demand by
//! `scripts/build-control-plane.sh` into a cache outside git) and the workspace's own binaries.

use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
};

use crate::{Error, Result};

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
        Ok(path)
    } else {
        Err(Error::Prerequisite(format!(
            "{} is missing: run `cargo build --workspace --bins` first (the test script does)",
            path.display()
        )))
    }
}
