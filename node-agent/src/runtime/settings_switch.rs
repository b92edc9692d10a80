//! Which policy settings (`spec.proxy`) are in force: a new rollout token brings the spec's
//! settings behind the health gate, like a mode. When the token's switch starts, the settings that
//! ran before it are remembered (in `settings.json` next to the state file, so a restart does not
//! forget them); when the switch fails its gate (RolledBack, or Failed) they are put back and kept
//! while the spec asks for that token, or asks for nothing (the operator withdrew the ask of a
//! node that waits); when it succeeds they are forgotten. Any other spec without a token (no
//! policy governs the node) is taken as it comes.
//!
//! The switch machine starts a switch for a new token with the mode the node runs only when the
//! settings change ([`crate::switch::GateProgress::settings_changed`]): a settings switch.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use switchyard_crds::v1alpha1::{ProxySettings, SwitchOutcome};

/// The settings before the switch of `token`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Before {
    token: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    settings: Option<ProxySettings>,
}

/// What the keeper remembers across rounds (and restarts).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Memory {
    /// Whether `ran` is known (false in a fresh agent without a file).
    #[serde(default)]
    known: bool,
    /// The settings the last round ran (`None`: the flags' alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ran: Option<ProxySettings>,
    /// The switch that changes them, and the settings before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    before: Option<Before>,
}

/// What the switch driver says about the spec's token.
#[derive(Debug, Clone, Copy)]
pub(super) struct SwitchView<'a> {
    /// A switch is under way.
    pub switching: bool,
    /// The last token the driver answered.
    pub answered: Option<&'a str>,
    /// The last finished switch: its token and outcome (`None`: not known yet after a restart).
    pub last: Option<(Option<&'a str>, &'a SwitchOutcome)>,
}

/// The round's settings.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct InForce {
    /// The policy settings to run.
    pub settings: Option<ProxySettings>,
    /// The spec's token asks for other settings than the node ran before it.
    pub changed: bool,
}

impl Memory {
    /// The settings to run this round, given the spec's settings and token.
    pub fn round(
        &mut self,
        spec: Option<&ProxySettings>,
        token: Option<&str>,
        sw: SwitchView<'_>,
    ) -> InForce {
        let Some(token) = token else {
            // The ask withdrawn after a failed switch: the settings put back stay.
            let kept = self
                .before
                .as_ref()
                .filter(|b| sw.answered == Some(b.token.as_str()) && !succeeded(&sw, &b.token))
                .map(|b| b.settings.clone());
            if let Some(settings) = kept {
                return self.run(settings, false);
            }
            self.before = None;
            return self.run(spec.cloned(), false);
        };
        let remembered = self.before.as_ref().is_some_and(|b| b.token == token);
        if !remembered {
            if sw.answered == Some(token) {
                // Answered before anything was remembered for it (an older agent): as it comes.
                self.before = None;
                return self.run(spec.cloned(), false);
            }
            // A new request: what ran before it is what a failed gate puts back (the flags'
            // settings when a fresh agent does not know).
            self.before = Some(Before {
                token: token.to_owned(),
                settings: self.ran.clone().filter(|_| self.known),
            });
        }
        let previous = self.before.as_ref().and_then(|b| b.settings.clone());
        let changed = previous.as_ref() != spec || !self.known && !remembered;
        if sw.switching || sw.answered != Some(token) {
            return self.run(spec.cloned(), changed);
        }
        if succeeded(&sw, token) {
            self.before = None;
            return self.run(spec.cloned(), false);
        }
        // Failed (or not known yet after a restart): the settings from before stay.
        self.run(previous, changed)
    }

    fn run(&mut self, settings: Option<ProxySettings>, changed: bool) -> InForce {
        self.known = true;
        self.ran.clone_from(&settings);
        InForce { settings, changed }
    }
}

/// The driver's last finished switch answered `token` and succeeded.
fn succeeded(sw: &SwitchView<'_>, token: &str) -> bool {
    sw.last
        .is_some_and(|(t, outcome)| t == Some(token) && *outcome == SwitchOutcome::Succeeded)
}

/// The keeper's file: `settings.json` in the state directory.
#[derive(Debug, Clone)]
pub(super) struct MemoryFile(pub PathBuf);

impl MemoryFile {
    /// The remembered settings; an unreadable file is logged and read as empty (the flags' then
    /// stand for the settings before a switch).
    pub fn load(&self) -> Memory {
        match std::fs::read(&self.0) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!(file = %self.0.display(), error = %e, "cannot read the remembered settings; starting without");
                Memory::default()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Memory::default(),
            Err(e) => {
                tracing::warn!(file = %self.0.display(), error = %e, "cannot read the remembered settings; starting without");
                Memory::default()
            }
        }
    }

    /// Stores `memory` (temp file, rename); failures are logged, the keeper goes on in memory.
    pub fn store(&self, memory: &Memory) {
        if let Err(e) = write(&self.0, memory) {
            tracing::warn!(file = %self.0.display(), error = %e, "cannot store the remembered settings");
        }
    }
}

fn write(path: &Path, memory: &Memory) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(memory).map_err(std::io::Error::other)?)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn masq(on: bool) -> ProxySettings {
        ProxySettings {
            masquerade_all: Some(on),
            ..Default::default()
        }
    }

    fn view<'a>(
        switching: bool,
        answered: Option<&'a str>,
        last: Option<(&'a str, &'a SwitchOutcome)>,
    ) -> SwitchView<'a> {
        SwitchView {
            switching,
            answered,
            last: last.map(|(t, o)| (Some(t), o)),
        }
    }

    /// One node's settings switch, round by round: (case, spec settings, token, driver, expected
    /// settings in force, changed).
    #[test]
    fn settings_switch_rounds() {
        use SwitchOutcome::{RolledBack, Succeeded};
        let (old, new) = (masq(false), masq(true));
        type Round<'a> = (
            &'a str,
            Option<&'a ProxySettings>,
            Option<&'a str>,
            SwitchView<'a>,
            Option<&'a ProxySettings>,
            bool,
        );
        let rounds: Vec<Round<'_>> = vec![
            (
                "no token: as it comes",
                Some(&old),
                None,
                view(false, None, None),
                Some(&old),
                false,
            ),
            (
                "first token, same settings",
                Some(&old),
                Some("g1"),
                view(false, None, None),
                Some(&old),
                false,
            ),
            (
                "g1 answered",
                Some(&old),
                Some("g1"),
                view(false, Some("g1"), Some(("g1", &Succeeded))),
                Some(&old),
                false,
            ),
            (
                "new settings with g2: taken, changed",
                Some(&new),
                Some("g2"),
                view(false, Some("g1"), None),
                Some(&new),
                true,
            ),
            (
                "g2 switching: the new ones",
                Some(&new),
                Some("g2"),
                view(true, Some("g1"), None),
                Some(&new),
                true,
            ),
            (
                "g2 rolled back: the old ones",
                Some(&new),
                Some("g2"),
                view(false, Some("g2"), Some(("g2", &RolledBack))),
                Some(&old),
                true,
            ),
            (
                "still asked for g2: kept",
                Some(&new),
                Some("g2"),
                view(false, Some("g2"), Some(("g2", &RolledBack))),
                Some(&old),
                true,
            ),
            (
                "the ask withdrawn (node waits): still kept",
                Some(&new),
                None,
                view(false, Some("g2"), Some(("g2", &RolledBack))),
                Some(&old),
                false,
            ),
            (
                "g3 asks again: from the old ones",
                Some(&new),
                Some("g3"),
                view(false, Some("g2"), None),
                Some(&new),
                true,
            ),
            (
                "g3 succeeded: the new ones",
                Some(&new),
                Some("g3"),
                view(false, Some("g3"), Some(("g3", &Succeeded))),
                Some(&new),
                false,
            ),
            (
                "and stay",
                Some(&new),
                Some("g3"),
                view(false, Some("g3"), Some(("g3", &Succeeded))),
                Some(&new),
                false,
            ),
        ];
        let mut m = Memory::default();
        for (name, spec, token, sw, want, changed) in rounds {
            let got = m.round(spec, token, sw);
            assert_eq!((got.settings.as_ref(), got.changed), (want, changed), "{name}");
        }
    }

    /// A restart after a failed gate: the file keeps the settings from before, also before the
    /// driver knows how the switch ended.
    #[test]
    fn a_restart_keeps_the_settings_from_before() {
        let dir = std::env::temp_dir().join(format!("switchyard-settings-{}", std::process::id()));
        let file = MemoryFile(dir.join("settings.json"));
        let (old, new) = (masq(false), masq(true));
        let mut m = file.load();
        m.round(Some(&old), Some("g1"), view(false, Some("g1"), None));
        m.round(Some(&new), Some("g2"), view(false, Some("g1"), None));
        file.store(&m);
        let mut again = file.load();
        assert_eq!(again, m);
        let got = again.round(Some(&new), Some("g2"), view(false, Some("g2"), None));
        assert_eq!(got.settings, Some(old));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_fresh_agent_takes_a_new_token_as_a_change() {
        let mut m = Memory::default();
        let new = masq(true);
        let got = m.round(Some(&new), Some("g2"), view(false, Some("g1"), None));
        assert_eq!((got.settings, got.changed), (Some(new), true));
    }
}
