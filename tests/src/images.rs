//! Container images for the real-node tier, packed here because no image registry is reachable:
//! a single-layer docker-archive (`manifest.json`, config, layer tar) that `ctr images import`
//! loads into a node's containerd ([`crate::kubelet::KubeletNode::import_image`]).
//!
//! Two are built from files already on the machine: the pods' sandbox image (the static
//! `swyt-pause` binary that `scripts/build-control-plane.sh` builds from `scripts/pause`) and a
//! busybox image (Debian's static busybox: `sh`, `httpd`, `wget`, `nc`, ...) for smoke tests. The
//! project's own images come from `scripts/build-images.sh` as archives and load the same way.

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::{Error, Result, binaries, io_err, run};

/// Reference of the sandbox image every node's containerd is configured with.
pub const PAUSE_IMAGE: &str = "docker.io/library/swyt-pause:1";
/// Reference of the busybox smoke-test image.
pub const BUSYBOX_IMAGE: &str = "docker.io/library/swyt-busybox:1";

/// What goes into a single-layer image.
pub struct ImageSpec<'a> {
    /// Full reference, `docker.io/library/<name>:<tag>`.
    pub reference: &'a str,
    /// Files copied in: (source on this machine, absolute path in the image).
    pub files: Vec<(PathBuf, String)>,
    /// Symbolic links: (absolute path in the image, target).
    pub symlinks: Vec<(String, String)>,
    /// Empty directories to create (absolute paths in the image).
    pub dirs: Vec<String>,
    /// The image's entrypoint.
    pub entrypoint: Vec<String>,
    /// The image's default arguments.
    pub cmd: Vec<String>,
}

fn sha256_file(path: &Path) -> Result<String> {
    let out = run("sha256sum", &[&path.display().to_string()])?;
    out.split_whitespace()
        .next()
        .map(str::to_owned)
        .ok_or_else(|| Error::Prerequisite(format!("sha256sum printed nothing for {}", path.display())))
}

/// Packs `spec` as a docker-archive `<work>/<name>.tar` and returns its path. `work` must exist.
pub fn pack(work: &Path, spec: &ImageSpec<'_>) -> Result<PathBuf> {
    let name = spec
        .reference
        .rsplit('/')
        .next()
        .unwrap_or(spec.reference)
        .replace(':', "_");
    let stage = work.join(format!("{name}.build"));
    let rootfs = stage.join("rootfs");
    let _ = std::fs::remove_dir_all(&stage);
    std::fs::create_dir_all(&rootfs).map_err(io_err("create image rootfs"))?;
    let inside = |p: &str| rootfs.join(p.trim_start_matches('/'));
    for dir in &spec.dirs {
        std::fs::create_dir_all(inside(dir)).map_err(io_err(format!("image dir {dir}")))?;
    }
    for (src, dest) in &spec.files {
        let to = inside(dest);
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(io_err("image dir"))?;
        }
        std::fs::copy(src, &to).map_err(io_err(format!("copy {} into the image", src.display())))?;
    }
    for (link, target) in &spec.symlinks {
        let at = inside(link);
        if let Some(parent) = at.parent() {
            std::fs::create_dir_all(parent).map_err(io_err("image dir"))?;
        }
        std::os::unix::fs::symlink(target, &at).map_err(io_err(format!("image link {link}")))?;
    }
    let layer = stage.join("layer.tar");
    run(
        "tar",
        &[
            "--numeric-owner",
            "--owner=0",
            "--group=0",
            "--mtime=@0",
            "--sort=name",
            "-C",
            &rootfs.display().to_string(),
            "-cf",
            &layer.display().to_string(),
            ".",
        ],
    )?;
    let diff_id = sha256_file(&layer)?;
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": spec.entrypoint,
            "Cmd": spec.cmd,
            "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"],
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]},
        "history": [{"created_by": "switchyard e2e harness (tests/src/images.rs)"}],
    });
    std::fs::write(stage.join("config.json"), config.to_string()).map_err(io_err("image config"))?;
    let manifest = json!([{
        "Config": "config.json",
        "RepoTags": [spec.reference],
        "Layers": ["layer.tar"],
    }]);
    std::fs::write(stage.join("manifest.json"), manifest.to_string()).map_err(io_err("image manifest"))?;
    let archive = work.join(format!("{name}.tar"));
    run(
        "tar",
        &[
            "-C",
            &stage.display().to_string(),
            "-cf",
            &archive.display().to_string(),
            "manifest.json",
            "config.json",
            "layer.tar",
        ],
    )?;
    let _ = std::fs::remove_dir_all(&stage);
    Ok(archive)
}

/// The sandbox image ([`PAUSE_IMAGE`]) from the `swyt-pause` binary next to the control plane.
pub fn pause_image(work: &Path) -> Result<PathBuf> {
    let pause = binaries::control_plane_bin()?.join("swyt-pause");
    if !pause.exists() {
        return Err(Error::Prerequisite(format!(
            "{} is missing: run scripts/build-control-plane.sh (it builds scripts/pause)",
            pause.display()
        )));
    }
    pack(
        work,
        &ImageSpec {
            reference: PAUSE_IMAGE,
            files: vec![(pause, "/pause".into())],
            symlinks: Vec::new(),
            dirs: Vec::new(),
            entrypoint: vec!["/pause".into()],
            cmd: Vec::new(),
        },
    )
}

/// A busybox image ([`BUSYBOX_IMAGE`]) from Debian's static busybox, with every applet linked
/// into `/bin` (`sh`, `httpd`, `wget`, `nc`, `ip`, `sleep`, ...).
pub fn busybox_image(work: &Path) -> Result<PathBuf> {
    let busybox = PathBuf::from("/bin/busybox");
    let dynamic = run("ldd", &["/bin/busybox"]).is_ok_and(|o| o.contains("=>"));
    if !busybox.exists() || dynamic {
        return Err(Error::Prerequisite(
            "a static /bin/busybox is needed for the busybox test image: apt-get install busybox-static \
             (scripts/install-deps.sh does)"
                .into(),
        ));
    }
    let applets = run("/bin/busybox", &["--list"])?;
    let symlinks = applets
        .lines()
        .map(str::trim)
        .filter(|a| !a.is_empty() && *a != "busybox")
        .map(|a| (format!("/bin/{a}"), "busybox".to_owned()))
        .collect();
    pack(
        work,
        &ImageSpec {
            reference: BUSYBOX_IMAGE,
            files: vec![(busybox, "/bin/busybox".into())],
            symlinks,
            dirs: vec!["/tmp".into(), "/etc".into(), "/var/www".into()],
            entrypoint: Vec::new(),
            cmd: vec!["/bin/sh".into()],
        },
    )
}

/// An archive built by `scripts/build-images.sh` (`agent`, `operator`, `testbox`):
/// `${SWITCHYARD_CACHE:-~/.cache/switchyard}/images/switchyard-<name>.tar`.
pub fn project_image(name: &str) -> Result<PathBuf> {
    let cache = std::env::var_os("SWITCHYARD_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/switchyard")))
        .ok_or_else(|| Error::Prerequisite("neither SWITCHYARD_CACHE nor HOME is set".into()))?;
    let path = cache.join("images").join(format!("switchyard-{name}.tar"));
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::Prerequisite(format!(
            "{} is missing: run scripts/build-images.sh",
            path.display()
        )))
    }
}

/// The image reference a docker-archive carries (the first `RepoTags` entry of `manifest.json`),
/// which is what `ctr images import` names it.
pub fn archive_reference(archive: &Path) -> Result<String> {
    let manifest = run("tar", &["-xOf", &archive.display().to_string(), "manifest.json"])?;
    let parsed: serde_json::Value =
        serde_json::from_str(&manifest).map_err(|e| Error::Prerequisite(format!("manifest.json: {e}")))?;
    parsed[0]["RepoTags"][0]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| Error::Prerequisite(format!("{}: no RepoTags", archive.display())))
}
