//! What the apiserver alone needs to hand a proxy its start-up state: the whole Service list and
//! the whole EndpointSlice list, fetched concurrently (as a starting proxy does) in one response
//! each, the bytes read and not decoded, as JSON and as protobuf. That is a floor under any
//! proxy's start → all rules that lists before its first sync, whatever it decodes with: the
//! bench prints it beside the proxies' start times.

use std::time::{Duration, Instant};

use futures::AsyncReadExt;
use kube::Client;

use crate::{Error, Result};

/// The two list paths a proxy reads at start-up.
const PATHS: [&str; 2] = ["/api/v1/services", "/apis/discovery.k8s.io/v1/endpointslices"];

/// An encoding the apiserver serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// `application/json` (what kube-rs clients read).
    Json,
    /// `application/vnd.kubernetes.protobuf` (what client-go's informers in kube-proxy read).
    Protobuf,
}

impl Encoding {
    /// The `Accept` header that asks for it.
    fn accept(self) -> &'static str {
        match self {
            Encoding::Json => "application/json",
            Encoding::Protobuf => "application/vnd.kubernetes.protobuf",
        }
    }

    /// Its name in the table.
    pub fn name(self) -> &'static str {
        match self {
            Encoding::Json => "JSON",
            Encoding::Protobuf => "protobuf",
        }
    }
}

/// One fetch of both lists.
#[derive(Debug, Clone, Copy)]
pub struct ListFetch {
    /// From the first request sent to the last byte of the later response.
    pub wall: Duration,
    /// Bytes of the Service list and of the EndpointSlice list.
    pub bytes: [usize; 2],
}

/// Reads the whole response to GET `path` in `encoding`.
async fn fetch(client: &Client, path: &str, encoding: Encoding) -> Result<Vec<u8>> {
    let request = http::Request::get(path)
        .header(http::header::ACCEPT, encoding.accept())
        .body(Vec::new())
        .map_err(|e| Error::Prerequisite(format!("list request {path}: {e}")))?;
    let mut body = client.request_stream(request).await?;
    let mut bytes = Vec::new();
    body.read_to_end(&mut bytes)
        .await
        .map_err(|e| Error::Prerequisite(format!("reading the list {path}: {e}")))?;
    check_encoding(path, encoding, &bytes)?;
    Ok(bytes)
}

/// Fails unless `bytes` are in `encoding`: a protobuf response starts with the magic `k8s\0`, a
/// JSON one with `{` (so an apiserver that ignored the `Accept` header cannot pass for faster).
fn check_encoding(path: &str, encoding: Encoding, bytes: &[u8]) -> Result<()> {
    let ok = match encoding {
        Encoding::Protobuf => bytes.starts_with(b"k8s\0"),
        Encoding::Json => bytes.first() == Some(&b'{'),
    };
    if ok {
        Ok(())
    } else {
        Err(Error::Prerequisite(format!(
            "{path}: the apiserver did not answer in {} ({} bytes)",
            encoding.name(),
            bytes.len()
        )))
    }
}

/// Fetches both lists concurrently in `encoding`, `reps` times one after the other.
pub async fn fetch_both(client: &Client, encoding: Encoding, reps: usize) -> Result<Vec<ListFetch>> {
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        let (services, slices) = futures::try_join!(
            fetch(client, PATHS[0], encoding),
            fetch(client, PATHS[1], encoding)
        )?;
        out.push(ListFetch {
            wall: start.elapsed(),
            bytes: [services.len(), slices.len()],
        });
    }
    Ok(out)
}

/// One line for the bench's output: the median of `fetches`, each fetch, and the two sizes.
pub fn describe(encoding: Encoding, fetches: &[ListFetch]) -> String {
    let ms: Vec<f64> = fetches.iter().map(|f| f.wall.as_secs_f64() * 1e3).collect();
    let each = ms
        .iter()
        .map(|m| format!("{m:.0}"))
        .collect::<Vec<_>>()
        .join(" / ");
    let mb = |i: usize| fetches.first().map_or(0.0, |f| f.bytes[i] as f64 / 1e6);
    format!(
        "{}: median {:.0} ms ({each} ms); Services {:.1} MB, EndpointSlices {:.1} MB",
        encoding.name(),
        super::median(&ms),
        mb(0),
        mb(1)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_in_another_encoding_is_an_error() {
        assert!(check_encoding("/x", Encoding::Protobuf, b"k8s\0\n\x0c").is_ok());
        assert!(check_encoding("/x", Encoding::Protobuf, b"{\"kind\":\"List\"}").is_err());
        assert!(check_encoding("/x", Encoding::Json, b"{\"kind\":\"List\"}").is_ok());
        assert!(check_encoding("/x", Encoding::Json, b"k8s\0").is_err());
        assert!(check_encoding("/x", Encoding::Json, b"").is_err());
    }
}
