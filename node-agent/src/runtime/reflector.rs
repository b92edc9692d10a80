//! List-then-watch of Services and EndpointSlices in protobuf, as client-go's reflector in
//! kube-proxy does (kube-rs' watcher speaks only JSON, which the apiserver serves about 3× slower
//! at 10k Services; see `model::wire`). Hands out kube-runtime's [`watcher::Event`]s so intake
//! treats both alike.
//!
//! Semantics kept from kube-runtime's watcher: a list (in pages) is `Init`, `InitApply` per object,
//! `InitDone`; a watch follows from the list's resource version with bookmarks; a watch that ends
//! (server timeout, closed connection) is resumed from the last resource version seen; a 410 (the
//! version is too old) relists; every other error is handed out and the same step retried by the
//! caller after its backoff.

use std::time::Duration;

use http_body_util::BodyExt;
use kube::{Client, client::Body, runtime::watcher};

use crate::{
    Error, Result,
    model::{
        list_stream::{ListPart, ListStream},
        wire::{self, Frames, WatchEvent, WireKind},
    },
};

/// How long the apiserver keeps one watch open (kube-runtime's watcher asks for the same).
const WATCH_TIMEOUT: Duration = Duration::from_secs(290);

/// Silence after which a response counts as stalled: a watch hears a bookmark about once a minute
/// and ends itself after [`WATCH_TIMEOUT`]; a list page arrives in well under a second at 44k
/// Services. Without it, a connection cut without a reset (a node's link down) would hang intake.
const STALL: Duration = Duration::from_secs(WATCH_TIMEOUT.as_secs() + 30);

/// Where the next step starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Position {
    /// Nothing known: list.
    Unlisted,
    /// Watch from this resource version.
    At(String),
}

/// Runs one step from `position`: a whole list, or one watch until it ends. Events go to `emit`
/// as they arrive; returns where the next step starts. On an error, `position` is where to retry
/// (a 410 sets it to [`Position::Unlisted`]).
pub(super) async fn step<K: WireKind>(
    client: &Client,
    position: &mut Position,
    list_page: u32,
    emit: &mut impl FnMut(watcher::Event<K>),
) -> Result<()> {
    let outcome = match position.clone() {
        Position::Unlisted => list(client, list_page, emit).await.map(Position::At),
        Position::At(version) => watch(client, version, emit).await,
    };
    match outcome {
        Ok(next) => {
            *position = next;
            Ok(())
        }
        Err(e) => {
            if matches!(e, Error::ApiStatus { code: 410, .. }) {
                *position = Position::Unlisted;
            }
            Err(e)
        }
    }
}

/// Lists every object of `K` in pages; returns the list's resource version. Each page is decoded
/// as its bytes arrive ([`ListStream`]), its items handed out one by one.
async fn list<K: WireKind>(
    client: &Client,
    list_page: u32,
    emit: &mut impl FnMut(watcher::Event<K>),
) -> Result<String> {
    emit(watcher::Event::Init);
    let mut continue_token: Option<String> = None;
    loop {
        let mut query = format!("{}?limit={list_page}", K::PATH);
        if let Some(token) = &continue_token {
            query.push_str("&continue=");
            query.push_str(&urlencode(token));
        }
        let action = || format!("listing {}s", K::WHAT);
        let (version, next) = list_page_streamed(client, &query, &action, emit).await?;
        match next {
            Some(token) => continue_token = Some(token),
            None => {
                emit(watcher::Event::InitDone);
                return Ok(version);
            }
        }
    }
}

/// One page of a list, its items emitted as they are decoded; returns the list's resource version
/// and the next page's token.
async fn list_page_streamed<K: WireKind>(
    client: &Client,
    path_and_query: &str,
    action: &impl Fn() -> String,
    emit: &mut impl FnMut(watcher::Event<K>),
) -> Result<(String, Option<String>)> {
    let mut body = open(client, path_and_query, wire::PROTOBUF, action).await?;
    let mut stream = ListStream::<K>::default();
    let mut meta = None;
    while let Some(chunk) = next_chunk(&mut body, action).await? {
        stream.push(&chunk);
        while let Some(part) = stream.next_part()? {
            match part {
                ListPart::Item(item) => emit(watcher::Event::InitApply(item)),
                ListPart::Meta {
                    resource_version,
                    continue_token,
                } => meta = Some((resource_version, continue_token)),
            }
        }
    }
    stream.finish()?;
    meta.ok_or_else(|| stream_error(action, "the list has no metadata"))
}

/// Watches `K` from `version` until the apiserver ends the watch; returns where to go on.
async fn watch<K: WireKind>(
    client: &Client,
    version: String,
    emit: &mut impl FnMut(watcher::Event<K>),
) -> Result<Position> {
    let query = format!(
        "{}?watch=true&allowWatchBookmarks=true&timeoutSeconds={}&resourceVersion={}",
        K::PATH,
        WATCH_TIMEOUT.as_secs(),
        urlencode(&version)
    );
    let action = || format!("watching {}s", K::WHAT);
    let mut body = open(client, &query, wire::PROTOBUF_WATCH, &action).await?;
    let mut frames = Frames::default();
    let mut at = version;
    loop {
        let Some(chunk) = next_chunk(&mut body, &action).await? else {
            return if frames.pending() == 0 {
                Ok(Position::At(at))
            } else {
                Err(stream_error(
                    &action,
                    format!("cut inside a frame ({} bytes)", frames.pending()),
                ))
            };
        };
        frames.push(&chunk);
        while let Some(frame) = frames.next_frame()? {
            match wire::watch_event::<K>(&frame)? {
                WatchEvent::Apply(object) => {
                    at = K::resource_version(&object).unwrap_or(&at).to_owned();
                    emit(watcher::Event::Apply(object));
                }
                WatchEvent::Delete(object) => {
                    at = K::resource_version(&object).unwrap_or(&at).to_owned();
                    emit(watcher::Event::Delete(object));
                }
                WatchEvent::Bookmark(version) if !version.is_empty() => at = version,
                WatchEvent::Bookmark(_) => {}
                WatchEvent::Error(failure) => return Err(status_error(action(), failure)),
            }
        }
    }
}

/// Sends GET `path_and_query` accepting `accept`; a failure status becomes an error.
async fn open(
    client: &Client,
    path_and_query: &str,
    accept: &str,
    action: &impl Fn() -> String,
) -> Result<Body> {
    let request = http::Request::get(path_and_query)
        .header(http::header::ACCEPT, accept)
        .body(Body::empty())
        .map_err(|e| stream_error(action, e))?;
    let response = tokio::time::timeout(STALL, client.send(request))
        .await
        .map_err(|_| stream_error(action, "no response"))?
        .map_err(|source| Error::Kube {
            action: action(),
            source,
        })?;
    let code = response.status();
    if code.is_success() {
        return Ok(response.into_body());
    }
    let body = collect(response.into_body(), action).await.unwrap_or_default();
    let failure = wire::failure(&body).unwrap_or_else(|| wire::Failure {
        code: code.as_u16(),
        reason: code.canonical_reason().unwrap_or_default().to_owned(),
        message: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
    });
    Err(status_error(action(), failure))
}

async fn collect(mut body: Body, action: &impl Fn() -> String) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    while let Some(chunk) = next_chunk(&mut body, action).await? {
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

/// The next data of `body`; None at its end. Fails when nothing arrives for [`STALL`].
async fn next_chunk(body: &mut Body, action: &impl Fn() -> String) -> Result<Option<bytes::Bytes>> {
    loop {
        let frame = tokio::time::timeout(STALL, body.frame())
            .await
            .map_err(|_| stream_error(action, format!("nothing received for {} s", STALL.as_secs())))?;
        match frame {
            None => return Ok(None),
            Some(Err(source)) => {
                return Err(Error::Kube {
                    action: action(),
                    source,
                });
            }
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    return Ok(Some(data));
                }
                // A trailers frame: nothing to read.
            }
        }
    }
}

fn status_error(action: String, failure: wire::Failure) -> Error {
    Error::ApiStatus {
        action,
        code: failure.code,
        reason: failure.reason,
        message: failure.message,
    }
}

fn stream_error(action: &impl Fn() -> String, detail: impl std::fmt::Display) -> Error {
    Error::ApiStream {
        action: action(),
        detail: detail.to_string(),
    }
}

/// Percent-encodes a query value (continue tokens are base64, which has `+`, `/` and `=`).
fn urlencode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::{
        collections::VecDeque,
        sync::{Arc, Mutex},
    };

    use http_body_util::Full;
    use k8s_openapi::api::core::v1::Service;
    use k8s_pb::{api::core::v1 as pb_core, apimachinery::pkg::apis::meta::v1 as pb_meta};

    use super::*;
    use crate::model::wire::tests::{frame, meta, whole};

    /// A client whose apiserver answers from `answers` (status, body), one per request in order;
    /// also returns the path and query of every request made.
    fn scripted(answers: Vec<(u16, Vec<u8>)>) -> (Client, Arc<Mutex<Vec<String>>>) {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&asked);
        let script = Mutex::new(VecDeque::from(answers));
        let apiserver = tower::service_fn(move |request: http::Request<Body>| {
            seen.lock().expect("lock").push(request.uri().to_string());
            let (code, body) = script
                .lock()
                .expect("lock")
                .pop_front()
                .expect("a scripted answer");
            std::future::ready(
                http::Response::builder()
                    .status(code)
                    .body(Full::new(bytes::Bytes::from(body))),
            )
        });
        (Client::new(apiserver, "default"), asked)
    }

    fn service(name: &str, version: &str) -> pb_core::Service {
        pb_core::Service {
            metadata: meta(name, version, &[]),
            ..Default::default()
        }
    }

    fn expired() -> Vec<u8> {
        whole(&pb_meta::Status {
            code: Some(410),
            reason: Some("Expired".to_owned()),
            message: Some("too old resource version: 5 (30)".to_owned()),
            ..Default::default()
        })
    }

    /// Runs one step and names what it emitted.
    async fn run(client: &Client, position: &mut Position, events: &mut Vec<String>) -> Result<()> {
        let mut emit = |event: watcher::Event<Service>| {
            let name = |s: &Service| s.metadata.name.clone().unwrap_or_default();
            events.push(match event {
                watcher::Event::Init => "init".to_owned(),
                watcher::Event::InitApply(s) => format!("init-apply {}", name(&s)),
                watcher::Event::InitDone => "init-done".to_owned(),
                watcher::Event::Apply(s) => format!("apply {}", name(&s)),
                watcher::Event::Delete(s) => format!("delete {}", name(&s)),
            });
        };
        step(client, position, 500, &mut emit).await
    }

    #[tokio::test]
    async fn a_forgotten_version_relists_and_the_watch_goes_on_from_the_list() {
        let list = pb_core::ServiceList {
            metadata: Some(pb_meta::ListMeta {
                resource_version: Some("50".to_owned()),
                ..Default::default()
            }),
            items: vec![service("a", "40")],
        };
        let mut stream = frame("ADDED", whole(&service("b", "51")));
        stream.extend(frame("ERROR", expired()));
        let (client, asked) = scripted(vec![
            (410, expired()),
            (200, whole(&list)),
            (200, stream),
            (410, b"not a Status".to_vec()),
        ]);
        let mut position = Position::At("5".to_owned());
        let mut events = Vec::new();

        let gone = run(&client, &mut position, &mut events).await;
        assert!(
            matches!(gone, Err(Error::ApiStatus { code: 410, .. })),
            "{gone:?}"
        );
        assert_eq!(position, Position::Unlisted, "a 410 answer relists");
        run(&client, &mut position, &mut events).await.expect("the list");
        assert_eq!(
            position,
            Position::At("50".to_owned()),
            "the watch follows the list"
        );
        let gone = run(&client, &mut position, &mut events).await;
        assert!(
            matches!(gone, Err(Error::ApiStatus { code: 410, .. })),
            "{gone:?}"
        );
        assert_eq!(position, Position::Unlisted, "a 410 event in the stream relists");
        position = Position::At("7".to_owned());
        let gone = run(&client, &mut position, &mut events).await;
        assert!(
            matches!(gone, Err(Error::ApiStatus { code: 410, .. })),
            "{gone:?}"
        );
        assert_eq!(
            position,
            Position::Unlisted,
            "a 410 without a Status body (a proxy's)"
        );

        assert_eq!(events, ["init", "init-apply a", "init-done", "apply b"]);
        let asked = asked.lock().expect("lock");
        assert!(
            asked[0].contains("watch=true") && asked[0].contains("resourceVersion=5"),
            "{asked:?}"
        );
        assert!(
            asked[1].contains("limit=500") && !asked[1].contains("watch"),
            "{asked:?}"
        );
        assert!(
            asked[2].contains("watch=true") && asked[2].contains("resourceVersion=50"),
            "{asked:?}"
        );
    }

    #[tokio::test]
    async fn a_watch_resumes_from_the_last_version_it_heard() {
        let mut ended = frame("MODIFIED", whole(&service("a", "51")));
        ended.extend(frame("BOOKMARK", whole(&service("", "60"))));
        let mut cut = frame("DELETED", whole(&service("a", "61")));
        cut.extend(&frame("ADDED", whole(&service("b", "62")))[..9]);
        let (client, asked) = scripted(vec![(200, ended), (200, cut), (500, Vec::new())]);
        let mut position = Position::At("50".to_owned());
        let mut events = Vec::new();

        run(&client, &mut position, &mut events)
            .await
            .expect("a clean end");
        assert_eq!(position, Position::At("60".to_owned()), "from the bookmark");
        let cut = run(&client, &mut position, &mut events).await;
        assert!(matches!(cut, Err(Error::ApiStream { .. })), "{cut:?}");
        assert_eq!(
            position,
            Position::At("60".to_owned()),
            "a broken watch is retried from where it started (its events again: applies are idempotent)"
        );
        let failed = run(&client, &mut position, &mut events).await;
        assert!(
            matches!(failed, Err(Error::ApiStatus { code: 500, .. })),
            "{failed:?}"
        );
        assert_eq!(
            position,
            Position::At("60".to_owned()),
            "other errors retry the same watch"
        );

        assert_eq!(events, ["apply a", "delete a"]);
        let asked = asked.lock().expect("lock");
        assert!(asked[1].contains("resourceVersion=60") && asked[2].contains("resourceVersion=60"));
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(urlencode("abc-1_2.3~"), "abc-1_2.3~");
        assert_eq!(urlencode("eyJ2+/="), "eyJ2%2B%2F%3D");
    }
}
