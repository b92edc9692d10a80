//! Running the userspace tools the agent relies on (iptables-restore, ipset, ip, ...).

use std::{
    io::Write,
    process::{Command, Stdio},
};

/// Outcome of a command that ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// Exit status was 0.
    pub success: bool,
    /// Exit code (-1 when killed by a signal).
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error, trimmed.
    pub stderr: String,
}

/// Runs `program args...` with `stdin` as its standard input (none: `/dev/null`). An `Err` means
/// the program could not be started or waited for; a failing program is an `Ok` with
/// `success == false`.
pub fn run_with_input(program: &str, args: &[&str], stdin: Option<&str>) -> std::io::Result<Output> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A failed write (the tool exited early) shows up in its exit status and stderr.
        let _ = pipe.write_all(input.as_bytes());
    }
    let out = child.wait_with_output()?;
    Ok(Output {
        success: out.status.success(),
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
    })
}

/// Runs `program args...`; `Err` carries a one-line reason when the program cannot be started.
pub fn run(program: &str, args: &[&str]) -> std::result::Result<Output, String> {
    run_with_input(program, args, None).map_err(|e| format!("{program}: {e}"))
}
