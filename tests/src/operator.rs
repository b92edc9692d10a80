//! Running `switchyard-operator` as a process with the operator's real RBAC identity (a token of
//! the `switchyard-operator` service account), killed on drop.

use std::{
    io::{Read, Write},
    net::TcpStream,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use crate::{
    Result,
    agent::SYSTEM_NAMESPACE,
    binaries,
    controlplane::{ControlPlane, Credential},
    io_err, sweep,
};

/// A running operator replica; SIGTERM then SIGKILL on drop.
pub struct Operator {
    /// Its identity (Lease holder name).
    pub identity: String,
    /// Port of its /healthz and /metrics on 127.0.0.1.
    pub port: u16,
    /// Its log file.
    pub log: PathBuf,
    child: Child,
}

impl Operator {
    /// Starts a replica named `identity` with short leases (6 s, renewed 2 s before expiry).
    pub async fn start(cp: &ControlPlane, identity: &str, extra_args: &[&str]) -> Result<Self> {
        Self::start_as(cp, SYSTEM_NAMESPACE, "switchyard-operator", identity, extra_args).await
    }

    /// Like [`Operator::start`], as service account `account` of `namespace` (which also holds the
    /// Lease), e.g. the service account a Helm release created.
    pub async fn start_as(
        cp: &ControlPlane,
        namespace: &str,
        account: &str,
        identity: &str,
        extra_args: &[&str],
    ) -> Result<Self> {
        let token = cp.service_account_token(namespace, account, None).await?;
        let kubeconfig = cp.write_kubeconfig(
            &format!("operator-{identity}"),
            &format!("https://127.0.0.1:{}", cp.port),
            Credential::Token(token),
        )?;
        let port = crate::ports::free_loopback_port()?;
        let log = cp.dir().join(format!("operator-{identity}.log"));
        let out = std::fs::File::create(&log).map_err(io_err("operator log"))?;
        let err = out.try_clone().map_err(io_err("operator log"))?;
        let child = Command::new(binaries::workspace_bin("switchyard-operator")?)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--namespace", namespace, "--identity", identity])
            .args(["--lease-duration-seconds", "6", "--lease-grace-seconds", "2"])
            .args(["--healthz-bind-address", &format!("127.0.0.1:{port}")])
            .args(extra_args)
            .env("RUST_LOG", "info,switchyard_operator=debug")
            .env(crate::logs::NO_COLOR.0, crate::logs::NO_COLOR.1)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io_err("start operator"))?;
        sweep::record_pid(cp.dir(), child.id());
        Ok(Self {
            identity: identity.into(),
            port,
            log,
            child,
        })
    }

    /// Kills the process with SIGKILL (no Lease release: the standby waits for expiry).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The log so far, as plain text (no colours).
    pub fn log_text(&self) -> String {
        crate::logs::read(&self.log)
    }

    /// `GET path` on its health/metrics port: (status code, body), or `None` when unreachable.
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        let mut s =
            TcpStream::connect_timeout(&([127, 0, 0, 1], self.port).into(), Duration::from_secs(2)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        let code = text.split_whitespace().nth(1)?.parse().ok()?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Some((code, body))
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        sweep::stop_child(&mut self.child, Duration::from_secs(5));
    }
}
