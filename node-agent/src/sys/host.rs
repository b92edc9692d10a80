//! Host facts read from files: kernel release, sysctls, kernel module lists.

use std::path::Path;

/// Kernel release, as `uname -r` prints it.
pub fn kernel_release() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .map(|s| s.trim().to_owned())
}

/// Reads an integer sysctl under `/proc/sys/` (per network namespace for `net/...`).
pub fn sysctl_i64(path: &str) -> Option<i64> {
    std::fs::read_to_string(Path::new("/proc/sys").join(path))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Sets the sysctl `path` (under `/proc/sys/`, e.g. `net/ipv4/conf/all/route_localnet`) to
/// `value` unless it has it; returns whether it wrote. With `netns`, in that named network
/// namespace (`ip netns exec NETNS sysctl`), as the kernel tests run backends.
pub fn ensure_sysctl(netns: Option<&str>, path: &str, value: &str) -> Result<bool, String> {
    match netns {
        None => {
            let file = Path::new("/proc/sys").join(path);
            let current = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            if current.trim() == value {
                return Ok(false);
            }
            std::fs::write(&file, value).map_err(|e| format!("{}: {e}", file.display()))?;
            Ok(true)
        }
        Some(ns) => {
            let read = super::exec::run("ip", &["netns", "exec", ns, "sysctl", "-n", path])?;
            if read.success && read.stdout.trim() == value {
                return Ok(false);
            }
            let setting = format!("{path}={value}");
            let out = super::exec::run("ip", &["netns", "exec", ns, "sysctl", "-q", "-w", &setting])?;
            if out.success {
                Ok(true)
            } else {
                Err(format!("sysctl -w {setting} in {ns}: {}", out.stderr))
            }
        }
    }
}

/// Names of IPVS schedulers the kernel has loaded or could load: `ip_vs_<name>` modules shipped
/// for `release`, built-in ones, and any listed as loaded.
pub fn ipvs_scheduler_modules(release: &str) -> Vec<String> {
    let mut names = Vec::new();
    let base = Path::new("/lib/modules").join(release);
    if let Ok(dir) = std::fs::read_dir(base.join("kernel/net/netfilter/ipvs")) {
        names.extend(
            dir.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned)),
        );
    }
    for list in ["modules.builtin", "/proc/modules"] {
        let path = if list.starts_with('/') {
            Path::new(list).to_path_buf()
        } else {
            base.join(list)
        };
        if let Ok(text) = std::fs::read_to_string(path) {
            names.extend(
                text.lines()
                    .filter_map(|l| l.split_whitespace().next())
                    .map(|s| s.rsplit('/').next().unwrap_or(s).to_owned()),
            );
        }
    }
    names
}

/// Whether this network namespace has IPv6 (`/proc/net/if_inet6` exists unless IPv6 is disabled).
pub fn ipv6_enabled() -> bool {
    std::path::Path::new("/proc/net/if_inet6").exists()
}
