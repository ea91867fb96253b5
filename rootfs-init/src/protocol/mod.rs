//! The host↔agent protocol: binary frames ([`frame`]) whose JSON headers are
//! the [`messages`]. Shared by forkd-agent (guest) and the host's agent client.

pub mod frame;
pub mod messages;

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

/// Encodes a reply frame.
pub fn encode_reply(header: &ReplyHeader, payload: &[u8], out: &mut BytesMut) {
    let json = serde_json::to_vec(header).expect("reply headers always serialise");
    frame::encode(&json, payload, out);
}

/// [`encode_reply`] without the payload, which the sender writes after it.
pub fn encode_reply_head(header: &ReplyHeader, payload_len: usize, out: &mut BytesMut) {
    let json = serde_json::to_vec(header).expect("reply headers always serialise");
    frame::encode_head(&json, payload_len, out);
}
