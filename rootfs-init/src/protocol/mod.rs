//! The host↔agent protocol: binary frames ([`frame`]) whose JSON headers are
//! the [`messages`]. Shared by forkd-agent (guest) and the host's agent client.

pub mod frame;
pub mod messages;
pub mod metadata;

pub use frame::{Frame, FrameDecoder, FrameError, MAX_PAYLOAD};
pub use messages::*;

use bytes::BytesMut;

/// Encodes a request frame.
///
/// Requests carry caller data (code, argv, file contents), so the frame
/// limits are checked here and reported, never asserted.
pub fn encode_request(
    header: &RequestHeader,
    payload: &[u8],
    out: &mut BytesMut,
) -> Result<(), frame::FrameError> {
    let json = serde_json::to_vec(header).expect("request headers always serialise");
    if json.len() > frame::MAX_HEADER {
        return Err(frame::FrameError::HeaderTooLarge(json.len()));
    }
    if payload.len() > frame::MAX_PAYLOAD {
        return Err(frame::FrameError::PayloadTooLarge(payload.len()));
    }
    frame::encode(&json, payload, out);
    Ok(())
}

/// Encodes a reply frame. A reply whose header would exceed
/// [`frame::MAX_HEADER`] (an eval returning megabytes, a huge listing) is
/// sent as an error reply to the same request instead, without payload:
/// the caller learns what went wrong at once and the agent never panics.
pub fn encode_reply(header: &ReplyHeader, payload: &[u8], out: &mut BytesMut) {
    if encode_reply_head(header, payload.len(), out) {
        out.extend_from_slice(payload);
    }
}

/// [`encode_reply`] without the payload, which the sender writes after it
/// only when this returns true (false: the reply was replaced by a
/// too-large error that carries no payload).
pub fn encode_reply_head(header: &ReplyHeader, payload_len: usize, out: &mut BytesMut) -> bool {
    let json = serde_json::to_vec(header).expect("reply headers always serialise");
    if json.len() <= frame::MAX_HEADER {
        frame::encode_head(&json, payload_len, out);
        return true;
    }
    let too_large = ReplyHeader {
        id: header.id,
        body: Reply::Error {
            error: AgentError::new(
                ErrorKind::BadRequest,
                format!(
                    "the reply is {} bytes, over the agent channel's {}-byte limit for a result; \
                     return less (write a large result to a file and read it with the files API)",
                    json.len(),
                    frame::MAX_HEADER
                ),
            ),
        },
    };
    let json = serde_json::to_vec(&too_large).expect("reply headers always serialise");
    frame::encode_head(&json, 0, out);
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An over-limit reply header (an eval of a 2 MB string) becomes an
    /// error reply to the same request: it used to panic the agent task.
    #[test]
    fn an_oversized_reply_becomes_an_error_for_its_request() {
        let big = ReplyHeader {
            id: 7,
            body: Reply::Ok {
                result: serde_json::json!({ "value": "x".repeat(2 << 20) }),
            },
        };
        let mut out = BytesMut::new();
        encode_reply(&big, b"payload", &mut out);
        let mut d = FrameDecoder::new();
        d.extend(&out);
        let f = d.next_frame().unwrap().unwrap();
        assert!(f.payload.is_empty());
        let h: ReplyHeader = serde_json::from_slice(&f.header).unwrap();
        assert_eq!(h.id, 7);
        match h.body {
            Reply::Error { error } => assert!(error.message.contains("files API"), "{error:?}"),
            other => panic!("expected an error reply, got {other:?}"),
        }
        assert_eq!(d.buffered(), 0);
    }
}
