//! The persisted switch state, written so that it cannot lie: atomically (temp file, `fsync`,
//! rename, `fsync` of the directory) as a versioned envelope carrying the SHA-256 of the state.
//! Reading tells a missing file ([`Loaded::Absent`]) from a damaged one ([`Loaded::Corrupt`]: empty,
//! truncated, not JSON, wrong checksum or version), which the driver must not read as absent: it
//! then asks the kernel what serves.

use std::{
    io::Write,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::switch::SwitchState;

/// Version of the envelope written by this agent.
pub const FORMAT_VERSION: u32 = 1;

/// What reading the persisted state found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Loaded {
    /// No state was ever persisted (or it was removed).
    Absent,
    /// A state whose envelope checks out.
    Valid(SwitchState),
    /// Something is there but cannot be trusted; why.
    Corrupt(String),
}

/// Where the driver persists its switch state (write-ahead: a step whose store fails is not run).
pub trait StateStore: Send {
    /// Reads the persisted state.
    fn load(&self) -> Loaded;
    /// Persists `state` durably, or says why it could not.
    fn store(&mut self, state: &SwitchState) -> std::io::Result<()>;
    /// Where it lives, for logs and status.
    fn location(&self) -> String;
}

/// On-disk form: `{"version":1,"sha256":"…","state":{…}}`, readable by a person. The checksum
/// covers the state's compact JSON, which serialising the same state always reproduces.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    version: u32,
    sha256: String,
    state: SwitchState,
}

fn digest(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Encodes `state` as the bytes of a state file.
pub fn encode(state: &SwitchState) -> Vec<u8> {
    let text = serde_json::to_string(state).unwrap_or_default();
    let envelope = Envelope {
        version: FORMAT_VERSION,
        sha256: digest(&text),
        state: state.clone(),
    };
    serde_json::to_vec(&envelope).unwrap_or_default()
}

/// Decodes the bytes of a state file. Pure.
pub fn decode(bytes: &[u8]) -> Loaded {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Loaded::Corrupt("the state file is empty".into());
    }
    let envelope: Envelope = match serde_json::from_slice(bytes) {
        Ok(e) => e,
        // Agents before the envelope wrote the bare state; accept it (the kernel check still runs).
        Err(e) => {
            return match serde_json::from_slice::<SwitchState>(bytes) {
                Ok(state) => Loaded::Valid(state),
                Err(_) => Loaded::Corrupt(format!("the state file is not a valid state: {e}")),
            };
        }
    };
    if envelope.version != FORMAT_VERSION {
        return Loaded::Corrupt(format!(
            "the state file has format version {} (this agent reads {FORMAT_VERSION})",
            envelope.version
        ));
    }
    if digest(&serde_json::to_string(&envelope.state).unwrap_or_default()) != envelope.sha256 {
        return Loaded::Corrupt("the state file's checksum does not match its content".into());
    }
    Loaded::Valid(envelope.state)
}

/// The state in a file of the node (a hostPath under a DaemonSet, so it survives restarts).
#[derive(Debug, Clone)]
pub struct StateFile(pub PathBuf);

impl StateFile {
    fn write_durably(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let tmp = path.with_extension("tmp");
        {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        // The rename itself is durable only once the directory is.
        std::fs::File::open(dir)?.sync_all()
    }
}

impl StateStore for StateFile {
    fn load(&self) -> Loaded {
        match std::fs::read(&self.0) {
            Ok(bytes) => decode(&bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Loaded::Absent,
            Err(e) => Loaded::Corrupt(format!("the state file cannot be read: {e}")),
        }
    }

    fn store(&mut self, state: &SwitchState) -> std::io::Result<()> {
        Self::write_durably(&self.0, &encode(state))
    }

    fn location(&self) -> String {
        self.0.display().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_crds::v1alpha1::ProxyMode;

    fn state() -> SwitchState {
        SwitchState {
            token: Some("t1".into()),
            ..SwitchState::active(ProxyMode::Nftables)
        }
    }

    #[test]
    fn round_trip_is_valid() {
        assert_eq!(decode(&encode(&state())), Loaded::Valid(state()));
    }

    #[test]
    fn damaged_files_are_corrupt_not_absent() {
        let good = encode(&state());
        let text = String::from_utf8(good.clone()).expect("utf8");
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", Vec::new()),
            ("whitespace", b"  \n".to_vec()),
            ("truncated", good[..good.len() / 2].to_vec()),
            ("garbage", b"\x00\x01garbage".to_vec()),
            ("flipped state", text.replace("nftables", "iptables").into_bytes()),
            (
                "other version",
                text.replace("\"version\":1", "\"version\":9").into_bytes(),
            ),
        ];
        for (name, bytes) in cases {
            assert!(
                matches!(decode(&bytes), Loaded::Corrupt(_)),
                "{name}: {:?}",
                decode(&bytes)
            );
        }
    }

    #[test]
    fn a_bare_state_of_older_agents_is_read() {
        let bare = serde_json::to_vec(&state()).expect("json");
        assert_eq!(decode(&bare), Loaded::Valid(state()));
    }

    #[test]
    fn file_store_writes_atomically_and_reads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut file = StateFile(dir.path().join("sub/state.json"));
        assert_eq!(file.load(), Loaded::Absent);
        file.store(&state()).expect("store");
        assert_eq!(file.load(), Loaded::Valid(state()));
        assert!(!dir.path().join("sub/state.tmp").exists());
        std::fs::write(&file.0, b"").expect("truncate");
        assert!(matches!(file.load(), Loaded::Corrupt(_)));
    }

    #[test]
    fn an_unwritable_directory_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let blocker = dir.path().join("file");
        std::fs::write(&blocker, b"x").expect("write");
        let mut file = StateFile(blocker.join("state.json"));
        assert!(file.store(&state()).is_err());
    }
}
