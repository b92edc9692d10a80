//! The kernel object names kube-proxy (and Switchyard, with its own prefixes) derive from service
//! and endpoint identities: base32 of a SHA-256, so the benchmark can ask the kernel for one chain
//! instead of listing tens of thousands. SHA-256 is written out here (FIPS 180-4) because the
//! harness has no hashing dependency; the unit test checks it against kube-proxy's own vectors.

use std::net::Ipv4Addr;

const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

const H0: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

fn compress(h: &mut [u32; 8], block: &[u8]) {
    let mut w = [0u32; 64];
    for (i, word) in block.chunks_exact(4).enumerate() {
        w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
    }
    for i in 16..64 {
        let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
        let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16].wrapping_add(s0).wrapping_add(w[i - 7]).wrapping_add(s1);
    }
    let mut v = *h;
    for (k, w) in K.iter().zip(w) {
        let s1 = v[4].rotate_right(6) ^ v[4].rotate_right(11) ^ v[4].rotate_right(25);
        let ch = (v[4] & v[5]) ^ (!v[4] & v[6]);
        let t1 = v[7]
            .wrapping_add(s1)
            .wrapping_add(ch)
            .wrapping_add(*k)
            .wrapping_add(w);
        let s0 = v[0].rotate_right(2) ^ v[0].rotate_right(13) ^ v[0].rotate_right(22);
        let maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
        let t2 = s0.wrapping_add(maj);
        v = [
            t1.wrapping_add(t2),
            v[0],
            v[1],
            v[2],
            v[3].wrapping_add(t1),
            v[4],
            v[5],
            v[6],
        ];
    }
    for (a, b) in h.iter_mut().zip(v) {
        *a = a.wrapping_add(b);
    }
}

/// SHA-256 of `data`.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    let mut message = data.to_vec();
    message.push(0x80);
    while message.len() % 64 != 56 {
        message.push(0);
    }
    message.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    let mut h = H0;
    for block in message.chunks_exact(64) {
        compress(&mut h, block);
    }
    let mut out = [0u8; 32];
    for (chunk, word) in out.chunks_exact_mut(4).zip(h) {
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out
}

/// The first `len` characters of RFC 4648 base32 of sha256(`input`) (kube-proxy's chain hash).
pub fn hash_base32(input: &str, len: usize) -> String {
    const BASE32: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(len);
    let (mut buffer, mut bits) = (0u32, 0u32);
    for byte in sha256(input.as_bytes()) {
        buffer = (buffer << 8) | u32::from(byte);
        bits += 8;
        while bits >= 5 && out.len() < len {
            bits -= 5;
            out.push(BASE32[((buffer >> bits) & 31) as usize] as char);
        }
    }
    out
}

/// The nftables service chain of `default/<service>` port `http`/TCP (kube-proxy's `service-`
/// chain; Switchyard uses the same name where it keeps a chain).
pub fn nft_service_chain(service: &str) -> String {
    let base = format!("default/{service}/tcp/http");
    format!("service-{}-{base}", hash_base32(&base, 8))
}

/// The part of kube-proxy's nftables endpoint chain name that names the endpoint.
pub fn nft_endpoint_suffix(ip: Ipv4Addr, port: u16) -> String {
    format!("__{ip}/{port}")
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
    fn sha256_of_known_texts() {
        let hex = |d: [u8; 32]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(
            hex(sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        // Two blocks.
        assert_eq!(
            hex(sha256(
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"
            )),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
    }

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
