//! Running the userspace tools the agent relies on (iptables-restore, ipset, ...).

use std::process::Command;

/// Outcome of a command that ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// Exit status was 0.
    pub success: bool,
    /// Standard output.
    pub stdout: String,
    /// Standard error, trimmed.
    pub stderr: String,
}

/// Runs `program args...`; `Err` carries a one-line reason when the program cannot be started.
pub fn run(program: &str, args: &[&str]) -> std::result::Result<Output, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    Ok(Output {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
    })
}
