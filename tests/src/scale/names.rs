//! The kernel object names kube-proxy (and Switchyard, with its own prefixes) derive from service
//! and endpoint identities: base32 of a SHA-256, so the benchmark can ask the kernel for one chain
//! instead of listing tens of thousands. The hash is the agent's own (`backend::names`); the unit
//! test checks it against kube-proxy's own vectors.

use std::net::Ipv4Addr;

/// The first `len` characters of RFC 4648 base32 of sha256(`input`) (kube-proxy's chain hash):
/// the agent's own naming function.
pub use switchyard_agent::backend::names::hash_base32;

/// The nftables service chain of `default/<service>` port `http`/TCP (kube-proxy's `service-`
/// chain; Switchyard uses the same name where it keeps a chain).
pub fn nft_service_chain(service: &str) -> String {
    let base = format!("default/{service}/tcp/http");
    format!("service-{}-{base}", hash_base32(&base, 8))
}

/// The iptables service chain (`<prefix>-SVC-…`) of `default/<service>:http`/TCP.
pub fn ipt_service_chain(prefix: &str, service: &str) -> String {
    format!(
        "{prefix}-SVC-{}",
        hash_base32(&format!("default/{service}:httptcp"), 16)
    )
}

/// The iptables endpoint chain (`<prefix>-SEP-…`) of one endpoint of `default/<service>:http`.
pub fn ipt_endpoint_chain(prefix: &str, service: &str, ip: Ipv4Addr, port: u16) -> String {
    format!(
        "{prefix}-SEP-{}",
        hash_base32(&format!("default/{service}:httptcp{ip}:{port}"), 16)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_match_kube_proxys_vectors() {
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
