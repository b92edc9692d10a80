//! The persisted switch state, written so that it cannot lie: atomically (temp file, `fsync`,
//! rename, `fsync` of the directory) as a versioned envelope carrying the SHA-256 of the state.
//! Reading tells a missing file ([`Loaded::Absent`]) from a damaged one ([`Loaded::Corrupt`]: empty,
//! truncated, not JSON, wrong checksum or version), which the driver must not read as absent: it
//! then asks the kernel what serves.
//!
//! The same file keeps the conntrack sysctl values the agent replaced ([`Replaced`], optional
//! `sysctls` field): files without it (older agents) load as before, and storing either part keeps
//! the other. The checksum of a file with `sysctls` covers both parts.

use std::{
    io::Write,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{node_sysctls::Replaced, switch::SwitchState};

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
    /// Absent only in a file the sysctl values were stored to before any switch state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    state: Option<SwitchState>,
    /// The conntrack sysctl values the agent replaced (absent in older files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sysctls: Option<Replaced>,
}

/// What the checksum covers: the state's compact JSON alone (the format of files without
/// `sysctls`), else both parts.
fn checked_text(state: Option<&SwitchState>, sysctls: Option<&Replaced>) -> String {
    match (state, sysctls) {
        (Some(state), None) => serde_json::to_string(state).unwrap_or_default(),
        (state, sysctls) => serde_json::to_string(&(state, sysctls)).unwrap_or_default(),
    }
}

/// Both parts of a state file, or why it cannot be trusted.
fn decode_parts(bytes: &[u8]) -> Result<(Option<SwitchState>, Option<Replaced>), String> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err("the state file is empty".into());
    }
    let envelope: Envelope = match serde_json::from_slice(bytes) {
        Ok(e) => e,
        // Agents before the envelope wrote the bare state; accept it (the kernel check still runs).
        Err(e) => {
            return match serde_json::from_slice::<SwitchState>(bytes) {
                Ok(state) => Ok((Some(state), None)),
                Err(_) => Err(format!("the state file is not a valid state: {e}")),
            };
        }
    };
    if envelope.version != FORMAT_VERSION {
        return Err(format!(
            "the state file has format version {} (this agent reads {FORMAT_VERSION})",
            envelope.version
        ));
    }
    if digest(&checked_text(envelope.state.as_ref(), envelope.sysctls.as_ref())) != envelope.sha256 {
        return Err("the state file's checksum does not match its content".into());
    }
    Ok((envelope.state, envelope.sysctls))
}

/// Encodes both parts as the bytes of a state file.
fn encode_parts(state: Option<&SwitchState>, sysctls: Option<&Replaced>) -> Vec<u8> {
    let envelope = Envelope {
        version: FORMAT_VERSION,
        sha256: digest(&checked_text(state, sysctls)),
        state: state.cloned(),
        sysctls: sysctls.cloned(),
    };
    serde_json::to_vec(&envelope).unwrap_or_default()
}

fn digest(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Encodes `state` as the bytes of a state file.
pub fn encode(state: &SwitchState) -> Vec<u8> {
    encode_parts(Some(state), None)
}

/// Decodes the bytes of a state file. Pure.
pub fn decode(bytes: &[u8]) -> Loaded {
    match decode_parts(bytes) {
        Ok((Some(state), _)) => Loaded::Valid(state),
        Ok((None, _)) => Loaded::Absent,
        Err(why) => Loaded::Corrupt(why),
    }
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

    /// Both parts as the file holds them now (none when it is missing); an error when it exists
    /// but cannot be read or trusted.
    fn parts(&self) -> std::io::Result<(Option<SwitchState>, Option<Replaced>)> {
        match std::fs::read(&self.0) {
            Ok(bytes) => decode_parts(&bytes).map_err(std::io::Error::other),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((None, None)),
            Err(e) => Err(e),
        }
    }

    /// The conntrack sysctl values the agent replaced, as last stored (none stored, or a file
    /// that cannot be trusted: empty).
    pub fn load_sysctls(&self) -> Replaced {
        self.parts().ok().and_then(|p| p.1).unwrap_or_default()
    }

    /// Stores the replaced sysctl values durably, keeping the switch state (an empty set removes
    /// the field). A file that cannot be trusted is left as it is: judging it (and reporting it)
    /// is the driver's, which a rewrite without its state would turn into "no state".
    pub fn store_sysctls(&self, sysctls: &Replaced) -> std::io::Result<()> {
        let (state, _) = self.parts().map_err(|e| {
            std::io::Error::other(format!(
                "{} is not overwritten, it cannot be trusted: {e}",
                self.0.display()
            ))
        })?;
        let sysctls = (!sysctls.0.is_empty()).then_some(sysctls);
        Self::write_durably(&self.0, &encode_parts(state.as_ref(), sysctls))
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
        let sysctls = self.parts().ok().and_then(|p| p.1);
        Self::write_durably(&self.0, &encode_parts(Some(state), sysctls.as_ref()))
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
    fn sysctl_values_live_beside_the_state_and_old_files_still_load() {
        use crate::node_sysctls::Knob;
        let dir = tempfile::tempdir().expect("tempdir");
        let mut file = StateFile(dir.path().join("state.json"));
        // An older agent's file (no sysctls field) loads, with nothing replaced.
        std::fs::write(&file.0, encode(&state())).expect("old file");
        assert_eq!(file.load(), Loaded::Valid(state()));
        assert_eq!(file.load_sysctls(), Replaced::default());

        let replaced = Replaced([(Knob::UdpTimeout, 30)].into_iter().collect());
        file.store_sysctls(&replaced).expect("store sysctls");
        assert_eq!(file.load(), Loaded::Valid(state()), "the state is kept");
        assert_eq!(file.load_sysctls(), replaced);
        let other = SwitchState::active(ProxyMode::Iptables);
        file.store(&other).expect("store state");
        assert_eq!(
            file.load_sysctls(),
            replaced,
            "storing the state keeps the sysctls"
        );
        assert_eq!(file.load(), Loaded::Valid(other));

        // The checksum covers the sysctls too.
        let text = std::fs::read_to_string(&file.0).expect("read");
        let tampered = text.replace(":30", ":31");
        std::fs::write(&file.0, &tampered).expect("tamper");
        assert!(matches!(file.load(), Loaded::Corrupt(_)));

        // A file that cannot be trusted is not rewritten by a sysctl store: the driver must
        // still find it Corrupt (a rewrite without its state would read as Absent).
        assert!(file.store_sysctls(&replaced).is_err());
        assert_eq!(std::fs::read_to_string(&file.0).expect("read"), tampered);
        assert!(matches!(file.load(), Loaded::Corrupt(_)));
        assert_eq!(file.load_sysctls(), Replaced::default());

        // Sysctls stored before any state: the state reads as absent.
        let fresh = StateFile(dir.path().join("fresh.json"));
        fresh.store_sysctls(&replaced).expect("store");
        assert_eq!(fresh.load(), Loaded::Absent);
        assert_eq!(fresh.load_sysctls(), replaced);
        fresh.store_sysctls(&Replaced::default()).expect("clear");
        assert_eq!(fresh.load_sysctls(), Replaced::default());
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
