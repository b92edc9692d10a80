//! Sysctls under `/proc/sys/` (per network namespace for `net/...`): the [`Sysctl`] adapter, the
//! host's implementation ([`HostSysctl`], optionally inside a named network namespace) and an
//! in-memory one ([`FakeSysctl`]).

use std::collections::BTreeMap;

use super::error::{EACCES, EIO, ENOENT, EPERM, EROFS, KernelError, KernelResult};

/// Reading and setting sysctls.
pub trait Sysctl: std::fmt::Debug + Send {
    /// Sets `path` (e.g. `net/ipv4/conf/all/route_localnet`) to `value` unless it has it; returns
    /// whether it wrote.
    fn ensure(&mut self, path: &str, value: &str) -> KernelResult<bool>;
}

/// The host's sysctls, in the current network namespace or (with `netns`) in a named one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostSysctl {
    netns: Option<String>,
}

impl HostSysctl {
    /// Sysctls of the current network namespace, or of `netns` (`ip netns exec NETNS sysctl`).
    pub fn new(netns: Option<String>) -> Self {
        Self { netns }
    }
}

/// The errno a tool's message names.
fn errno_of(message: &str) -> i32 {
    [
        ("Read-only", EROFS),
        ("No such file", ENOENT),
        ("Permission denied", EACCES),
        ("Operation not permitted", EPERM),
    ]
    .iter()
    .find(|(text, _)| message.contains(text))
    .map_or(EIO, |(_, errno)| *errno)
}

impl Sysctl for HostSysctl {
    fn ensure(&mut self, path: &str, value: &str) -> KernelResult<bool> {
        super::host::ensure_sysctl(self.netns.as_deref(), path, value)
            .map_err(|message| KernelError::from_errno(message.clone(), errno_of(&message)))
    }
}

/// Sysctls in memory; a read-only one refuses writes as a read-only `/proc/sys` does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeSysctl {
    values: BTreeMap<String, String>,
    read_only: bool,
}

impl FakeSysctl {
    /// Every sysctl unset (reads as `0`), writable.
    pub fn new() -> Self {
        Self::default()
    }

    /// Refuses every write from now on.
    pub fn make_read_only(&mut self) {
        self.read_only = true;
    }

    /// The value of `path` (`0` when never written).
    pub fn get(&self, path: &str) -> &str {
        self.values.get(path).map_or("0", String::as_str)
    }
}

impl Sysctl for FakeSysctl {
    fn ensure(&mut self, path: &str, value: &str) -> KernelResult<bool> {
        if self.get(path) == value {
            return Ok(false);
        }
        if self.read_only {
            return Err(KernelError::from_errno(format!("/proc/sys/{path}"), EROFS));
        }
        self.values.insert(path.to_owned(), value.to_owned());
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_sysctls_write_once_and_refuse_when_read_only() {
        let mut s = FakeSysctl::new();
        assert_eq!(s.ensure("net/x", "1").ok(), Some(true));
        assert_eq!(s.ensure("net/x", "1").ok(), Some(false));
        assert_eq!(s.get("net/x"), "1");
        s.make_read_only();
        assert!(matches!(
            s.ensure("net/y", "1"),
            Err(KernelError::Refused { errno: EROFS, .. })
        ));
        assert_eq!(errno_of("sysctl: cannot stat: No such file or directory"), ENOENT);
    }
}
