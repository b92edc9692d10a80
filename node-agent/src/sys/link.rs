//! The dummy link that carries the IPVS service addresses (`swy-ipvs0`) and the node's local
//! addresses, through the `ip` tool. Address changes go through one `ip -batch -` process, so
//! binding thousands of addresses costs one process, not thousands.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

/// Errors of the `ip` tool.
#[derive(Debug, thiserror::Error)]
#[error("ip {args}: {detail}")]
pub struct LinkError {
    /// The arguments.
    pub args: String,
    /// What went wrong.
    pub detail: String,
}

fn ip(args: &[&str], stdin: Option<&str>) -> Result<(bool, String, String), LinkError> {
    let err = |detail: String| LinkError {
        args: args.join(" "),
        detail,
    };
    let out = super::exec::run_with_input("ip", args, stdin).map_err(|e| err(format!("cannot run: {e}")))?;
    Ok((out.success, out.stdout, out.stderr))
}

fn ip_ok(args: &[&str], stdin: Option<&str>) -> Result<String, LinkError> {
    let (ok, stdout, stderr) = ip(args, stdin)?;
    if ok {
        Ok(stdout)
    } else {
        Err(LinkError {
            args: args.join(" "),
            detail: stderr,
        })
    }
}

/// Whether link `name` exists.
pub fn exists(name: &str) -> Result<bool, LinkError> {
    Ok(ip(&["link", "show", "dev", name], None)?.0)
}

/// Creates the dummy link `name` unless it exists, and sets it up (kube-proxy keeps `kube-ipvs0`
/// down; a dummy link's addresses are local either way, but up makes `ip route get` agree).
pub fn ensure_dummy(name: &str) -> Result<bool, LinkError> {
    if exists(name)? {
        return Ok(false);
    }
    ip_ok(&["link", "add", name, "type", "dummy"], None)?;
    ip_ok(&["link", "set", "dev", name, "up"], None)?;
    Ok(true)
}

/// Deletes link `name` if it exists.
pub fn delete(name: &str) -> Result<bool, LinkError> {
    if !exists(name)? {
        return Ok(false);
    }
    ip_ok(&["link", "del", "dev", name], None)?;
    Ok(true)
}

/// Parses `ip -o -4 addr show` output into `(device, address)` pairs.
pub fn parse_addresses(text: &str) -> Vec<(String, Ipv4Addr)> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let _index = words.next()?;
            let dev = words.next()?.trim_end_matches(':').split('@').next()?.to_owned();
            let mut rest = words.skip_while(|w| *w != "inet");
            rest.next()?;
            let addr = rest.next()?.split('/').next()?.parse().ok()?;
            Some((dev, addr))
        })
        .collect()
}

/// IPv4 addresses on link `name` (empty when the link does not exist).
pub fn addresses(name: &str) -> Result<BTreeSet<Ipv4Addr>, LinkError> {
    let (ok, out, _) = ip(&["-o", "-4", "addr", "show", "dev", name], None)?;
    Ok(if ok {
        parse_addresses(&out).into_iter().map(|(_, a)| a).collect()
    } else {
        BTreeSet::new()
    })
}

/// Every local IPv4 address with its device.
pub fn all_addresses() -> Result<Vec<(String, Ipv4Addr)>, LinkError> {
    Ok(parse_addresses(&ip_ok(&["-o", "-4", "addr", "show"], None)?))
}

/// Adds `add` and removes `remove` (as /32) on link `name` with one `ip -batch`.
pub fn update_addresses(
    name: &str,
    add: &BTreeSet<Ipv4Addr>,
    remove: &BTreeSet<Ipv4Addr>,
) -> Result<(), LinkError> {
    if add.is_empty() && remove.is_empty() {
        return Ok(());
    }
    let mut input = String::with_capacity((add.len() + remove.len()) * 40);
    for a in add {
        input.push_str(&format!("addr replace {a}/32 dev {name}\n"));
    }
    for a in remove {
        input.push_str(&format!("addr del {a}/32 dev {name}\n"));
    }
    ip_ok(&["-batch", "-"], Some(&input)).map(|_| ())
}

/// Links and their IPv4 addresses, as the IPVS backend uses them.
pub trait Links: std::fmt::Debug + Send {
    /// Whether link `name` exists.
    fn exists(&self, name: &str) -> Result<bool, LinkError>;
    /// Creates the dummy link `name` (up) unless it exists; returns whether it created it.
    fn ensure_dummy(&mut self, name: &str) -> Result<bool, LinkError>;
    /// Deletes link `name` if it exists; returns whether it existed.
    fn delete(&mut self, name: &str) -> Result<bool, LinkError>;
    /// The IPv4 addresses on link `name`.
    fn addresses(&self, name: &str) -> Result<BTreeSet<Ipv4Addr>, LinkError>;
    /// Every local IPv4 address with its device.
    fn all_addresses(&self) -> Result<Vec<(String, Ipv4Addr)>, LinkError>;
    /// Adds `add` and removes `remove` (as /32) on link `name`.
    fn update_addresses(
        &mut self,
        name: &str,
        add: &BTreeSet<Ipv4Addr>,
        remove: &BTreeSet<Ipv4Addr>,
    ) -> Result<(), LinkError>;
}

/// The kernel's links, through the `ip` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct KernelLinks;

impl Links for KernelLinks {
    fn exists(&self, name: &str) -> Result<bool, LinkError> {
        exists(name)
    }

    fn ensure_dummy(&mut self, name: &str) -> Result<bool, LinkError> {
        ensure_dummy(name)
    }

    fn delete(&mut self, name: &str) -> Result<bool, LinkError> {
        delete(name)
    }

    fn addresses(&self, name: &str) -> Result<BTreeSet<Ipv4Addr>, LinkError> {
        addresses(name)
    }

    fn all_addresses(&self) -> Result<Vec<(String, Ipv4Addr)>, LinkError> {
        all_addresses()
    }

    fn update_addresses(
        &mut self,
        name: &str,
        add: &BTreeSet<Ipv4Addr>,
        remove: &BTreeSet<Ipv4Addr>,
    ) -> Result<(), LinkError> {
        update_addresses(name, add, remove)
    }
}

/// Links in memory: name to addresses.
#[derive(Debug, Clone, Default)]
pub struct FakeLinks {
    links: std::collections::BTreeMap<String, BTreeSet<Ipv4Addr>>,
}

impl FakeLinks {
    /// No links.
    pub fn new() -> Self {
        Self::default()
    }

    fn missing(name: &str) -> LinkError {
        LinkError {
            args: format!("dev {name}"),
            detail: format!("Cannot find device \"{name}\""),
        }
    }
}

impl Links for FakeLinks {
    fn exists(&self, name: &str) -> Result<bool, LinkError> {
        Ok(self.links.contains_key(name))
    }

    fn ensure_dummy(&mut self, name: &str) -> Result<bool, LinkError> {
        if self.links.contains_key(name) {
            return Ok(false);
        }
        self.links.insert(name.to_owned(), BTreeSet::new());
        Ok(true)
    }

    fn delete(&mut self, name: &str) -> Result<bool, LinkError> {
        Ok(self.links.remove(name).is_some())
    }

    /// Empty when the link does not exist, as [`KernelLinks`] answers.
    fn addresses(&self, name: &str) -> Result<BTreeSet<Ipv4Addr>, LinkError> {
        Ok(self.links.get(name).cloned().unwrap_or_default())
    }

    fn all_addresses(&self) -> Result<Vec<(String, Ipv4Addr)>, LinkError> {
        Ok(self
            .links
            .iter()
            .flat_map(|(name, addresses)| addresses.iter().map(move |a| (name.clone(), *a)))
            .collect())
    }

    fn update_addresses(
        &mut self,
        name: &str,
        add: &BTreeSet<Ipv4Addr>,
        remove: &BTreeSet<Ipv4Addr>,
    ) -> Result<(), LinkError> {
        if add.is_empty() && remove.is_empty() {
            return Ok(());
        }
        let addresses = self.links.get_mut(name).ok_or_else(|| Self::missing(name))?;
        if let Some(absent) = remove.iter().find(|a| !addresses.contains(*a)) {
            return Err(LinkError {
                args: format!("addr del {absent}/32 dev {name}"),
                detail: "RTNETLINK answers: Cannot assign requested address".into(),
            });
        }
        addresses.extend(add);
        addresses.retain(|a| !remove.contains(a));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipvs_link_parses_ip_addr_output() {
        let text = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n\
                    4: swy-ipvs0    inet 10.96.0.1/32 scope global swy-ipvs0\\       valid_lft forever\n\
                    7: eth0@if8    inet 10.0.1.1/24 brd 10.0.1.255 scope global eth0\n\
                    garbage\n";
        assert_eq!(
            parse_addresses(text),
            vec![
                ("lo".into(), Ipv4Addr::new(127, 0, 0, 1)),
                ("swy-ipvs0".into(), Ipv4Addr::new(10, 96, 0, 1)),
                ("eth0".into(), Ipv4Addr::new(10, 0, 1, 1)),
            ]
        );
    }

    #[test]
    fn fake_links_hold_addresses_and_refuse_what_the_kernel_refuses() {
        let mut links = FakeLinks::new();
        let a: Ipv4Addr = "10.96.0.1".parse().expect("ip");
        assert_eq!(links.addresses("swy-ipvs0").ok(), Some(BTreeSet::new()));
        assert_eq!(links.ensure_dummy("swy-ipvs0").ok(), Some(true));
        assert_eq!(links.ensure_dummy("swy-ipvs0").ok(), Some(false));
        links
            .update_addresses("swy-ipvs0", &[a].into(), &BTreeSet::new())
            .expect("add");
        assert_eq!(links.addresses("swy-ipvs0").ok(), Some([a].into()));
        let other: Ipv4Addr = "10.96.0.2".parse().expect("ip");
        assert!(
            links
                .update_addresses("swy-ipvs0", &BTreeSet::new(), &[other].into())
                .is_err()
        );
        assert_eq!(links.delete("swy-ipvs0").ok(), Some(true));
        assert_eq!(links.exists("swy-ipvs0").ok(), Some(false));
    }
}
