//! The Connect protocol (v1, JSON codec) as the E2B SDK speaks it to envd:
//! unary calls are a JSON body in and out; server-streaming calls are one
//! enveloped request message in and a sequence of enveloped messages out,
//! closed by an end-of-stream envelope. Pure framing, no I/O.
//!
//! Envelope: `flags: u8 | length: u32 big-endian | payload`. Flag `0x02`
//! marks the end-of-stream message; `0x01` (compressed) is refused, since
//! the SDK never compresses and poold advertises identity only.

use crate::error::{Code, RpcError, RpcResult};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;

/// Flag of a data message.
pub const FLAG_DATA: u8 = 0x00;
/// Flag of a compressed message (refused).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Flag of the end-of-stream message.
pub const FLAG_END: u8 = 0x02;
/// Largest request message accepted (a process config or a path).
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// `v` as JSON bytes.
pub fn json_bytes(v: &impl Serialize) -> Vec<u8> {
    // Serializing a `Value` or a derived struct of strings cannot fail.
    serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec())
}

/// One envelope.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(flags);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

/// A data envelope holding `msg` as JSON.
pub fn message(msg: &impl Serialize) -> Bytes {
    envelope(FLAG_DATA, &json_bytes(msg))
}

/// The successful end-of-stream envelope (`{}`).
pub fn end_ok() -> Bytes {
    envelope(FLAG_END, b"{}")
}

/// The single request message of a server-streaming call: exactly one
/// uncompressed data envelope filling the body.
pub fn single_message(body: &[u8]) -> RpcResult<&[u8]> {
    if body.len() < 5 {
        return Err(RpcError::invalid(format!(
            "a streaming request must be one Connect envelope (5-byte header, then the message); got {} bytes",
            body.len()
        )));
    }
    let len = checked_len(body)?;
    if body.len() != 5 + len {
        return Err(RpcError::invalid(format!(
            "the envelope says {len} bytes but the body holds {} after the header; send exactly one message",
            body.len() - 5
        )));
    }
    Ok(&body[5..])
}

/// The length a request envelope's header (`h`, at least 5 bytes)
/// announces, once its flags say uncompressed data and the length is
/// within [`MAX_REQUEST_BYTES`].
fn checked_len(h: &[u8]) -> RpcResult<usize> {
    let flags = h[0];
    let len = u32::from_be_bytes([h[1], h[2], h[3], h[4]]) as usize;
    if flags & FLAG_COMPRESSED != 0 {
        return Err(RpcError::invalid(
            "compressed messages are not accepted; send Connect-Content-Encoding: identity",
        ));
    }
    if flags != FLAG_DATA {
        return Err(RpcError::invalid(format!(
            "the request envelope has flags {flags:#04x}; want a data message (0x00)"
        )));
    }
    if len > MAX_REQUEST_BYTES {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("request message of {len} bytes; at most {MAX_REQUEST_BYTES}"),
        ));
    }
    Ok(len)
}

/// The request messages of a client stream (`StreamInput`), taken from
/// the body as its chunks arrive: at most [`MAX_REQUEST_BYTES`] per
/// message, and never more than one message buffered past that.
#[derive(Default)]
pub struct Envelopes {
    buf: BytesMut,
}

impl Envelopes {
    /// Adds a chunk of the body.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next whole data message, if one has arrived.
    pub fn next_message(&mut self) -> RpcResult<Option<Bytes>> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let len = checked_len(&self.buf)?;
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        let mut m = self.buf.split_to(5 + len);
        Ok(Some(m.split_off(5).freeze()))
    }

    /// Whether bytes of an unfinished message are left (at the body's end:
    /// a truncated stream).
    pub fn has_partial(&self) -> bool {
        !self.buf.is_empty()
    }
}

/// Parses a request message as JSON into `T`.
pub fn parse<T: serde::de::DeserializeOwned>(msg: &[u8]) -> RpcResult<T> {
    let msg = if msg.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        msg
    };
    serde_json::from_slice(msg).map_err(|e| RpcError::invalid(format!("bad request message: {e}")))
}

/// The answer of a client stream: its one message, then the end.
pub fn client_stream_ok(msg: &impl Serialize) -> Vec<Bytes> {
    vec![message(msg), end_ok()]
}

/// A unary success answer: 200 with `msg` as JSON.
pub fn unary_ok(msg: &impl Serialize) -> Response {
    (
        StatusCode::OK,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        json_bytes(msg),
    )
        .into_response()
}

/// What waiting on a server stream's next item gave.
pub enum Tick<T> {
    /// The item.
    Item(T),
    /// `keepalive` passed in silence: send the stream's keepalive message.
    Keepalive,
    /// The call's deadline (`Connect-Timeout-Ms`) passed: end the stream
    /// with `deadline_exceeded`.
    Deadline,
}

/// Waits for `next` until the keepalive interval or the call's deadline,
/// whichever comes first: the one loop every envd server stream runs.
pub async fn next_or_tick<T>(
    next: impl std::future::Future<Output = T>,
    keepalive: std::time::Duration,
    deadline: Option<tokio::time::Instant>,
) -> Tick<T> {
    let ping = tokio::time::Instant::now() + keepalive;
    let wake = deadline.map_or(ping, |d| d.min(ping));
    match tokio::time::timeout_at(wake, next).await {
        Ok(t) => Tick::Item(t),
        Err(_) if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) => Tick::Deadline,
        Err(_) => Tick::Keepalive,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    #[test]
    fn a_client_stream_is_cut_into_messages_as_it_arrives() {
        let mut e = Envelopes::default();
        let (a, b) = (message(&json!({"start": 1})), message(&json!({"data": 2})));
        let both = [a.as_ref(), b.as_ref()].concat();
        // Split mid-header and mid-message.
        e.push(&both[..3]);
        assert!(e.next_message().unwrap().is_none());
        e.push(&both[3..a.len() + 7]);
        assert_eq!(&e.next_message().unwrap().unwrap()[..], br#"{"start":1}"#);
        assert!(e.next_message().unwrap().is_none());
        assert!(e.has_partial());
        e.push(&both[a.len() + 7..]);
        assert_eq!(&e.next_message().unwrap().unwrap()[..], br#"{"data":2}"#);
        assert!(!e.has_partial());
        // Compressed, or larger than the bound: refused from the header.
        let mut e = Envelopes::default();
        e.push(&envelope(FLAG_COMPRESSED, b"x"));
        assert!(e.next_message().is_err());
        let mut e = Envelopes::default();
        e.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert!(e.next_message().is_err());
    }

    #[test]
    fn envelope_round_trip() {
        let m = message(&json!({"process": {"cmd": "/bin/bash"}}));
        assert_eq!(m[0], FLAG_DATA);
        let inner = single_message(&m).unwrap();
        let v: Value = parse(inner).unwrap();
        assert_eq!(v["process"]["cmd"], "/bin/bash");
        assert_eq!(&end_ok()[..], &[2, 0, 0, 0, 2, b'{', b'}']);
    }

    #[test]
    fn refuses_malformed_envelopes() {
        let good = message(&json!({}));
        assert!(single_message(&good[..4]).is_err());
        let mut compressed = good.to_vec();
        compressed[0] = FLAG_COMPRESSED;
        assert!(single_message(&compressed)
            .unwrap_err()
            .message
            .contains("identity"));
        let mut trailing = good.to_vec();
        trailing.push(b' ');
        assert!(single_message(&trailing).is_err());
        let mut short = good.to_vec();
        short.pop();
        assert!(single_message(&short).is_err());
        let huge = [0u8, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(
            single_message(&huge).unwrap_err().code,
            Code::ResourceExhausted
        );
        assert!(single_message(&end_ok()).is_err());
    }

    #[test]
    fn empty_unary_body_is_an_empty_message() {
        let v: Value = parse(b"").unwrap();
        assert_eq!(v, json!({}));
        assert!(parse::<Value>(b"{nope").is_err());
    }
}
