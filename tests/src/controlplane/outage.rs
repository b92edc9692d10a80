//! Control-plane outages for fault tests: SIGKILL every control-plane process (etcd's data dir is
//! kept) and start them again with the very same command lines (same ports, certificates and data),
//! as a node reboot or a crashed static pod would; or SIGSTOP them (a hung control plane: open
//! connections stay open and requests hang) and SIGCONT them.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    time::Instant,
};

use super::ControlPlane;
use crate::{Result, io_err, sweep};

/// The command lines of the killed processes, in start order.
pub struct Killed {
    commands: Vec<Vec<String>>,
    /// When they were killed.
    pub at: Instant,
}

fn cmdline(pid: u32) -> Result<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).map_err(io_err(format!("cmdline of {pid}")))?;
    Ok(raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect())
}

impl ControlPlane {
    /// SIGKILLs every control-plane process (the apiserver first), keeping their data.
    pub fn kill_processes(&mut self) -> Result<Killed> {
        let mut commands = Vec::new();
        for child in &self.processes {
            commands.push(cmdline(child.id())?);
        }
        for child in self.processes.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.processes.clear();
        Ok(Killed {
            commands,
            at: Instant::now(),
        })
    }

    /// SIGSTOPs every control-plane process (the apiserver first).
    pub fn stop_processes(&self) {
        self.signal_all(nix::sys::signal::Signal::SIGSTOP);
    }

    /// SIGCONTs every control-plane process (etcd first) and waits until the apiserver is ready;
    /// returns when `/readyz` answers `ok`.
    pub async fn continue_processes(&mut self) -> Result<Instant> {
        self.signal_all(nix::sys::signal::Signal::SIGCONT);
        self.wait_ready().await?;
        Ok(Instant::now())
    }

    fn signal_all(&self, signal: nix::sys::signal::Signal) {
        let mut pids: Vec<u32> = self.processes.iter().map(|c| c.id()).collect();
        if signal == nix::sys::signal::Signal::SIGSTOP {
            pids.reverse();
        }
        for pid in pids {
            if let Ok(pid) = i32::try_from(pid) {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
            }
        }
    }

    /// Starts the killed processes again with the same command lines (logs appended) and waits
    /// until the apiserver is ready. Returns when `/readyz` answers `ok`.
    pub async fn restart_processes(&mut self, killed: Killed) -> Result<Instant> {
        for command in &killed.commands {
            let Some((program, args)) = command.split_first() else {
                continue;
            };
            let name = PathBuf::from(program)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "process".into());
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.join(format!("{name}.log")))
                .map_err(io_err("open log"))?;
            let err = log.try_clone().map_err(io_err("clone log"))?;
            let child = Command::new(program)
                .args(args)
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(err)
                .spawn()
                .map_err(io_err(format!("restart {name}")))?;
            sweep::record_pid(&self.dir, child.id());
            self.processes.push(child);
        }
        self.wait_ready().await?;
        Ok(Instant::now())
    }
}
