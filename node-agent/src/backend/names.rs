//! Kernel object names derived from service and endpoint identities (kube-proxy's scheme, our
//! prefixes): stable, collision-resistant hashes plus readable suffixes where the kernel allows.

use sha2::{Digest, Sha256};

use crate::model::{Endpoint, ServicePortName};

const BASE32: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

/// RFC 4648 base32 (no padding needed: callers take a prefix) of sha256(`input`), first `len` chars.
pub fn hash_base32(input: &str, len: usize) -> String {
    let digest = Sha256::digest(input.as_bytes());
    let mut out = String::with_capacity(len);
    let (mut buffer, mut bits) = (0u32, 0u32);
    for byte in digest {
        buffer = (buffer << 8) | u32::from(byte);
        bits += 8;
        while bits >= 5 && out.len() < len {
            bits -= 5;
            out.push(BASE32[((buffer >> bits) & 31) as usize] as char);
        }
    }
    out
}

/// `ns/svc/proto/portName`: the nftables chain-name base of a service port.
pub fn nft_service_base(name: &ServicePortName) -> String {
    format!("{}/{}/{}", name.service, name.protocol.as_str(), name.port_name)
}

/// `HASH8-ns/svc/proto/portName`, truncated like kube-proxy's `hashAndTruncate` (240 chars).
pub fn nft_hashed(base: &str) -> String {
    let mut s = format!("{}-{base}", hash_base32(base, 8));
    if s.len() > 240 {
        s.truncate(237);
        s.push_str("...");
    }
    s
}

/// nft chain of a service port with `prefix` (`service-`, `local-`, `external-`, `firewall-`).
pub fn nft_service_chain(prefix: &str, name: &ServicePortName) -> String {
    format!("{prefix}{}", nft_hashed(&nft_service_base(name)))
}

/// nft chain/set name of one endpoint of a service port (`endpoint-`, `affinity-`); IPv6 colons
/// become dots, as kube-proxy writes them, since nft's parser reads `:` as a separator.
pub fn nft_endpoint_name(prefix: &str, name: &ServicePortName, ep: &Endpoint) -> String {
    let ip = ep.ip.to_string().replace(':', ".");
    format!(
        "{prefix}{}",
        nft_hashed(&format!("{}__{ip}/{}", nft_service_base(name), ep.port))
    )
}

/// iptables chain of a service port: `SWY-<kind>-<16 base32>` (28-character limit).
pub fn ipt_service_chain(kind: &str, name: &ServicePortName) -> String {
    format!(
        "SWY-{kind}-{}",
        hash_base32(&format!("{name}{}", name.protocol.as_str()), 16)
    )
}

/// iptables chain of one endpoint: `SWY-SEP-<16 base32>`.
pub fn ipt_endpoint_chain(name: &ServicePortName, ep: &Endpoint) -> String {
    format!(
        "SWY-SEP-{}",
        hash_base32(
            &format!("{name}{}{}:{}", name.protocol.as_str(), ep.ip, ep.port),
            16
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_match_kube_proxys_vectors() {
        // Vectors from ../shared/reference/kubeproxy.md (same hash function as kube-proxy).
        assert_eq!(hash_base32("ns1/svc1/tcp/p80", 8), "ULMVA6XW");
        assert_eq!(hash_base32("ns1/svc1/tcp/p80__10.180.0.1/80", 8), "5OJB2KTY");
        assert_eq!(hash_base32("default/kubernetes/tcp/https", 8), "2QRHZV4L");
        assert_eq!(hash_base32("kube-system/kube-dns:dnsudp", 16), "TCOU7JCQXEZGVUNU");
        assert_eq!(
            hash_base32("kube-system/kube-dns:dnsudp10.244.0.3:53", 16),
            "6E7XQMQ4RAYOWTTM"
        );
    }
}
