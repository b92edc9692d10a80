//! A protobuf list response decoded as its bytes arrive, without IO: the list's metadata as soon
//! as it is in, then each item once its own bytes are. The apiserver streams a list's encoding
//! item by item, so decoding alongside its serving takes our decoding off the start-up's critical
//! path, where reading the whole body first made the two add up (at 10k Services on 2 slow cores:
//! the apiserver served both lists in about 190 ms, bytes only; our lists took 390–490 ms, of which
//! about 140 ms of CPU was decoding).
//!
//! Layout (apimachinery's protobuf serializer, see [`super::wire`]): the magic `k8s\0`, then the
//! fields of a `runtime.Unknown` — `typeMeta` (1), `raw` (2), `contentEncoding` (3),
//! `contentType` (4) — with the list inside `raw`: `metadata` (1, a `ListMeta`) and `items` (2,
//! one field per object). Fields are read in any order; unknown ones are skipped.

use k8s_pb::apimachinery::pkg::apis::meta::v1 as pb_meta;
use prost::Message;

use super::wire::{MAGIC, WireKind};
use crate::{Error, Result};

/// Varints are at most this long (a `u64` in 7-bit groups).
const MAX_VARINT: usize = 10;

/// Consumed bytes are dropped from the buffer's front once there are this many (and they are at
/// least half of it), so that a long list never holds more than about one item and a chunk.
const COMPACT_AT: usize = 64 << 10;

/// What the stream has read so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Before the magic.
    Magic,
    /// Between the envelope's fields.
    Envelope,
    /// Inside `raw` (the list), which ends at this offset of the whole body.
    List { end: usize },
}

/// One decoded part of a list.
#[derive(Debug, PartialEq)]
pub enum ListPart<K> {
    /// The list's metadata: its resource version and the next page's token (None: the last).
    Meta {
        /// The list's resource version.
        resource_version: String,
        /// The token of the next page; None when this is the last.
        continue_token: Option<String>,
    },
    /// One object.
    Item(K),
}

/// A list response decoded as it arrives: [`ListStream::push`] the bytes, take the parts with
/// [`ListStream::next_part`], and [`ListStream::finish`] at the end of the body.
#[derive(Debug)]
pub struct ListStream<K> {
    buffer: Vec<u8>,
    /// Where reading goes on in `buffer`.
    at: usize,
    /// Bytes dropped from `buffer`'s front (so `dropped + at` is the offset in the body).
    dropped: usize,
    place: Place,
    /// Whether the envelope's `raw` has been read to its end.
    list_read: bool,
    _kind: std::marker::PhantomData<fn() -> K>,
}

impl<K> Default for ListStream<K> {
    fn default() -> Self {
        Self {
            buffer: Vec::new(),
            at: 0,
            dropped: 0,
            place: Place::Magic,
            list_read: false,
            _kind: std::marker::PhantomData,
        }
    }
}

/// A field's key and, for a length-delimited field, its length: where its payload starts.
struct Field {
    tag: u64,
    wire_type: u8,
    /// Offset in the buffer just after the key (and the length, when there is one).
    payload: usize,
    /// The payload's length for a length-delimited field.
    length: Option<usize>,
}

/// Protobuf's wire types this stream reads (groups are not used by Kubernetes' types).
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

fn error(detail: impl std::fmt::Display) -> Error {
    Error::Decode {
        what: "list stream",
        detail: detail.to_string(),
    }
}

/// The varint at the start of `bytes` and its length; None when it is not all there yet.
fn varint(bytes: &[u8]) -> Result<Option<(u64, usize)>> {
    let mut value = 0u64;
    for (i, byte) in bytes.iter().take(MAX_VARINT).enumerate() {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok(Some((value, i + 1)));
        }
    }
    if bytes.len() >= MAX_VARINT {
        return Err(error("a varint longer than 10 bytes"));
    }
    Ok(None)
}

impl<K: WireKind> ListStream<K> {
    /// Appends bytes of the body as they arrive.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.at >= COMPACT_AT && self.at * 2 >= self.buffer.len() {
            self.buffer.drain(..self.at);
            self.dropped += self.at;
            self.at = 0;
        }
        self.buffer.extend_from_slice(bytes);
    }

    /// The next part whose bytes have all arrived; None until more are pushed.
    pub fn next_part(&mut self) -> Result<Option<ListPart<K>>> {
        loop {
            match self.place {
                Place::Magic => {
                    let Some(head) = self.buffer.get(self.at..self.at + MAGIC.len()) else {
                        return Ok(None);
                    };
                    if head != MAGIC {
                        return Err(error(format!(
                            "not protobuf (starts with {:?})",
                            String::from_utf8_lossy(head)
                        )));
                    }
                    self.at += MAGIC.len();
                    self.place = Place::Envelope;
                }
                Place::Envelope => {
                    if !self.envelope_field()? {
                        return Ok(None);
                    }
                }
                Place::List { end } => {
                    if self.offset() == end {
                        self.place = Place::Envelope;
                        self.list_read = true;
                        continue;
                    }
                    if self.offset() > end {
                        return Err(error("a list field runs past the list's end"));
                    }
                    match self.list_field()? {
                        Step::More => return Ok(None),
                        Step::Skipped => {}
                        Step::Part(part) => return Ok(Some(part)),
                    }
                }
            }
        }
    }

    /// Checks that the body ended where a whole list does.
    pub fn finish(&self) -> Result<()> {
        if self.place != Place::Envelope || !self.list_read {
            return Err(error(format!(
                "the body ended inside the list (at byte {})",
                self.offset()
            )));
        }
        if self.at != self.buffer.len() {
            return Err(error(format!(
                "the body ended inside a field ({} bytes left over)",
                self.buffer.len() - self.at
            )));
        }
        Ok(())
    }

    /// The reading position as an offset in the whole body.
    fn offset(&self) -> usize {
        self.dropped + self.at
    }

    /// Reads the key (and length) of the field at the reading position; None until all there.
    fn field(&self) -> Result<Option<Field>> {
        let Some((key, key_len)) = varint(&self.buffer[self.at..])? else {
            return Ok(None);
        };
        let (tag, wire_type) = (key >> 3, (key & 7) as u8);
        let mut payload = self.at + key_len;
        let mut length = None;
        if wire_type == LEN {
            let Some((len, len_len)) = varint(&self.buffer[payload..])? else {
                return Ok(None);
            };
            payload += len_len;
            length = Some(usize::try_from(len).map_err(|_| error("a field too long for memory"))?);
        }
        Ok(Some(Field {
            tag,
            wire_type,
            payload,
            length,
        }))
    }

    /// The end of a field's payload in the buffer; None until all of it has arrived.
    fn payload_end(&self, field: &Field) -> Result<Option<usize>> {
        let size = match (field.wire_type, field.length) {
            (LEN, Some(length)) => length,
            (FIXED64, _) => 8,
            (FIXED32, _) => 4,
            (VARINT, _) => match varint(&self.buffer[field.payload..])? {
                Some((_, n)) => n,
                None => return Ok(None),
            },
            (other, _) => return Err(error(format!("wire type {other} is not read here"))),
        };
        let end = field
            .payload
            .checked_add(size)
            .ok_or_else(|| error("a field too long for memory"))?;
        Ok((end <= self.buffer.len()).then_some(end))
    }

    /// Reads one envelope field; false until its bytes have arrived (`raw`: its key and length).
    fn envelope_field(&mut self) -> Result<bool> {
        let Some(field) = self.field()? else {
            return Ok(false);
        };
        if field.tag == 2 && field.wire_type == LEN && !self.list_read {
            let length = field.length.unwrap_or_default();
            self.at = field.payload;
            self.place = Place::List {
                end: self.offset() + length,
            };
            return Ok(true);
        }
        let Some(end) = self.payload_end(&field)? else {
            return Ok(false);
        };
        // contentEncoding (3): a compressed `raw` is not read (the apiserver sends none).
        if field.tag == 3 && field.wire_type == LEN && end > field.payload {
            return Err(error(format!(
                "content encoding {} is not supported",
                String::from_utf8_lossy(&self.buffer[field.payload..end])
            )));
        }
        self.at = end;
        Ok(true)
    }

    /// Reads one field of the list: its metadata, an item, or a field to skip.
    fn list_field(&mut self) -> Result<Step<K>> {
        let Some(field) = self.field()? else {
            return Ok(Step::More);
        };
        let Some(end) = self.payload_end(&field)? else {
            return Ok(Step::More);
        };
        let bytes = &self.buffer[field.payload..end];
        let step = match (field.tag, field.wire_type) {
            (1, LEN) => {
                let meta =
                    pb_meta::ListMeta::decode(bytes).map_err(|e| error(format!("list metadata: {e}")))?;
                Step::Part(ListPart::Meta {
                    resource_version: meta.resource_version.unwrap_or_default(),
                    continue_token: meta.r#continue.filter(|c| !c.is_empty()),
                })
            }
            (2, LEN) => Step::Part(ListPart::Item(K::decode_object(bytes)?)),
            _ => Step::Skipped,
        };
        self.at = end;
        Ok(step)
    }
}

/// What reading one list field gave.
enum Step<K> {
    /// Its bytes have not all arrived.
    More,
    /// A field the list has no use for.
    Skipped,
    /// A part to hand out.
    Part(ListPart<K>),
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Service;
    use k8s_pb::api::core::v1 as pb_core;

    use super::*;
    use crate::model::wire::tests::{meta, whole};

    fn list(names: &[&str], version: &str, token: Option<&str>) -> Vec<u8> {
        whole(&pb_core::ServiceList {
            metadata: Some(pb_meta::ListMeta {
                resource_version: Some(version.to_owned()),
                r#continue: token.map(str::to_owned),
                ..Default::default()
            }),
            items: names
                .iter()
                .map(|n| pb_core::Service {
                    metadata: meta(n, "7", &[("app", n)]),
                    ..Default::default()
                })
                .collect(),
        })
    }

    /// Feeds `body` in chunks of `chunk` bytes; the parts in order, then `finish`'s verdict.
    fn read(body: &[u8], chunk: usize) -> (Vec<ListPart<Service>>, Result<()>) {
        let mut stream = ListStream::<Service>::default();
        let mut parts = Vec::new();
        for piece in body.chunks(chunk.max(1)) {
            stream.push(piece);
            loop {
                match stream.next_part() {
                    Ok(Some(part)) => parts.push(part),
                    Ok(None) => break,
                    Err(e) => return (parts, Err(e)),
                }
            }
        }
        let done = stream.finish();
        (parts, done)
    }

    fn names(parts: &[ListPart<Service>]) -> Vec<String> {
        parts
            .iter()
            .filter_map(|p| match p {
                ListPart::Item(s) => s.metadata.name.clone(),
                ListPart::Meta { .. } => None,
            })
            .collect()
    }

    #[test]
    fn items_and_metadata_come_out_whatever_the_chunks() {
        let body = list(&["a", "b", "c"], "42", Some("next"));
        for chunk in [1, 2, 3, 7, 64, body.len()] {
            let (parts, done) = read(&body, chunk);
            done.unwrap_or_else(|e| panic!("chunks of {chunk}: {e}"));
            assert_eq!(
                parts.first(),
                Some(&ListPart::Meta {
                    resource_version: "42".into(),
                    continue_token: Some("next".into())
                }),
                "chunks of {chunk}: the metadata first (the apiserver writes it first)"
            );
            assert_eq!(names(&parts), ["a", "b", "c"], "chunks of {chunk}");
        }
    }

    #[test]
    fn each_item_comes_out_as_soon_as_its_bytes_are_in() {
        let body = list(&["a", "b"], "1", None);
        let mut stream = ListStream::<Service>::default();
        let mut seen_at = Vec::new();
        for (i, byte) in body.iter().enumerate() {
            stream.push(std::slice::from_ref(byte));
            while let Some(part) = stream.next_part().expect("a valid list") {
                if let ListPart::Item(_) = part {
                    seen_at.push(i);
                }
            }
        }
        // The first item is out at its own last byte, before any of the second's (a key, a
        // one-byte length and the object); the second at the body's last byte.
        let second = pb_core::Service {
            metadata: meta("b", "7", &[("app", "b")]),
            ..Default::default()
        }
        .encoded_len();
        assert!(second < 128, "a one-byte length");
        assert_eq!(seen_at, [body.len() - 1 - (second + 2), body.len() - 1]);
    }

    #[test]
    fn an_empty_token_ends_the_list_and_an_empty_list_is_whole() {
        let (parts, done) = read(&list(&[], "9", Some("")), 5);
        done.expect("an empty list is a whole list");
        assert_eq!(
            parts,
            vec![ListPart::Meta {
                resource_version: "9".into(),
                continue_token: None
            }]
        );
    }

    #[test]
    fn a_cut_body_is_an_error_not_a_shorter_list() {
        let body = list(&["a", "b", "c"], "42", None);
        for cut in [0, 3, 4, 10, body.len() / 2, body.len() - 1] {
            let (parts, done) = read(&body[..cut], 3);
            assert!(done.is_err(), "cut at {cut} of {}: {parts:?}", body.len());
        }
    }

    #[test]
    fn foreign_bodies_and_compressed_lists_are_refused() {
        let (_, json) = read(br#"{"kind":"ServiceList","items":[]}"#, 8);
        assert!(json.is_err(), "JSON is not protobuf");
        let mut out = MAGIC.to_vec();
        k8s_pb::apimachinery::pkg::runtime::Unknown {
            raw: Some(vec![]),
            content_encoding: Some("gzip".into()),
            ..Default::default()
        }
        .encode(&mut out)
        .expect("a Vec grows");
        let (_, gzip) = read(&out, 64);
        let err = gzip.expect_err("a compressed list is refused");
        assert!(err.to_string().contains("gzip"), "{err}");
    }

    #[test]
    fn a_varint_that_never_ends_is_an_error() {
        let mut body = MAGIC.to_vec();
        body.extend([0xff; 11]);
        let (_, done) = read(&body, 4);
        assert!(done.is_err());
    }

    #[test]
    fn the_buffer_keeps_only_what_is_unread() {
        let many: Vec<String> = (0..6000).map(|i| format!("service-{i:05}")).collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        let body = list(&refs, "5", None);
        assert!(body.len() > 4 * COMPACT_AT, "a body of {} bytes", body.len());
        let mut stream = ListStream::<Service>::default();
        let (mut items, mut peak) = (0, 0);
        for piece in body.chunks(4096) {
            stream.push(piece);
            peak = peak.max(stream.buffer.len());
            while let Some(part) = stream.next_part().expect("a valid list") {
                items += usize::from(matches!(part, ListPart::Item(_)));
            }
        }
        stream.finish().expect("whole");
        assert_eq!(items, 6000);
        assert!(
            peak <= 2 * COMPACT_AT + 4096,
            "peak buffer {peak} bytes for a {} byte body",
            body.len()
        );
    }
}
