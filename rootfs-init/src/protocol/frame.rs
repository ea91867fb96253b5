//! Binary framing for the host↔agent channel.
//!
//! The channel is a byte stream (a virtio-serial port on the guest side, a unix
//! socket on the host side) that can carry garbage: a host that reconnects in the
//! middle of a frame, or a buggy client. Every frame therefore starts with a magic
//! so the decoder can resynchronise, and both length fields are bounded before
//! anything is allocated.
//!
//! Layout (little endian):
//!
//! ```text
//! 0   4  magic  b"FKD1"
//! 4   4  header length  (JSON, at most MAX_HEADER)
//! 8   4  payload length (raw bytes, at most MAX_PAYLOAD)
//! 12  .. header, then payload
//! ```

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Marks the start of every frame.
pub const MAGIC: [u8; 4] = *b"FKD1";
/// Bytes before the header.
pub const PREFIX_LEN: usize = 12;
/// Largest accepted JSON header.
pub const MAX_HEADER: usize = 1 << 20;
/// Largest accepted payload. Bigger transfers are split by the sender.
pub const MAX_PAYLOAD: usize = 32 << 20;

/// One decoded frame: a JSON header and an opaque, binary-safe payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The JSON header's bytes.
    pub header: Bytes,
    /// The payload's bytes (binary, may be empty).
    pub payload: Bytes,
}

/// Why bytes were discarded while decoding. The decoder has already skipped
/// past the bad bytes when this is returned, so the caller may keep decoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Bytes skipped because they did not start with the frame magic.
    #[error("discarded {0} bytes that do not start a frame (bad magic)")]
    BadMagic(usize),
    /// A frame announced a header of this many bytes, over [`MAX_HEADER`]; its magic was skipped.
    #[error("frame header of {0} bytes exceeds the {MAX_HEADER}-byte limit")]
    HeaderTooLarge(usize),
    /// A frame announced a payload of this many bytes, over [`MAX_PAYLOAD`]; its magic was skipped.
    #[error("frame payload of {0} bytes exceeds the {MAX_PAYLOAD}-byte limit")]
    PayloadTooLarge(usize),
}

/// Encodes one frame into `out`.
///
/// Panics if `header` or `payload` exceed the limits: senders split payloads,
/// and headers are small JSON documents built by this crate.
pub fn encode(header: &[u8], payload: &[u8], out: &mut BytesMut) {
    out.reserve(PREFIX_LEN + header.len() + payload.len());
    encode_head(header, payload.len(), out);
    out.put_slice(payload);
}

/// Encodes everything of a frame but its payload, which the sender writes
/// right after: a large payload is then never copied into the frame.
pub fn encode_head(header: &[u8], payload_len: usize, out: &mut BytesMut) {
    assert!(header.len() <= MAX_HEADER, "frame header too large");
    assert!(payload_len <= MAX_PAYLOAD, "frame payload too large");
    out.reserve(PREFIX_LEN + header.len());
    out.put_slice(&MAGIC);
    out.put_u32_le(header.len() as u32);
    out.put_u32_le(payload_len as u32);
    out.put_slice(header);
}

/// Incremental decoder: feed bytes with [`FrameDecoder::extend`], pull frames
/// with [`FrameDecoder::next_frame`].
///
/// Invariant: after `next_frame` returns `Err`, the offending bytes are gone
/// from the buffer, so a loop over `next_frame` always makes progress and never
/// spins on the same garbage.
#[derive(Default)]
pub struct FrameDecoder {
    buf: BytesMut,
}

impl FrameDecoder {
    /// A decoder with nothing buffered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn extend(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Drops any partial frame, e.g. when the peer disconnects.
    pub fn reset(&mut self) {
        self.buf.clear();
    }

    /// Bytes buffered but not yet decoded.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Returns the next complete frame, `Ok(None)` if more bytes are needed, or
    /// an error describing bytes that were skipped.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if let Some(skipped) = self.skip_to_magic() {
            return Err(FrameError::BadMagic(skipped));
        }
        if self.buf.len() < PREFIX_LEN {
            return Ok(None);
        }
        let header_len = u32::from_le_bytes(self.buf[4..8].try_into().unwrap()) as usize;
        let payload_len = u32::from_le_bytes(self.buf[8..12].try_into().unwrap()) as usize;
        if header_len > MAX_HEADER {
            self.buf.advance(MAGIC.len());
            return Err(FrameError::HeaderTooLarge(header_len));
        }
        if payload_len > MAX_PAYLOAD {
            self.buf.advance(MAGIC.len());
            return Err(FrameError::PayloadTooLarge(payload_len));
        }
        let total = PREFIX_LEN + header_len + payload_len;
        if self.buf.len() < total {
            self.buf.reserve(total - self.buf.len());
            return Ok(None);
        }
        self.buf.advance(PREFIX_LEN);
        let header = self.buf.split_to(header_len).freeze();
        let payload = self.buf.split_to(payload_len).freeze();
        Ok(Some(Frame { header, payload }))
    }

    /// Discards bytes up to the next possible magic. Returns how many bytes
    /// were dropped, if any. A trailing partial magic is kept.
    fn skip_to_magic(&mut self) -> Option<usize> {
        if self.buf.starts_with(&MAGIC) {
            return None;
        }
        let keep_from = find_magic_or_partial(&self.buf);
        if keep_from == 0 {
            return None;
        }
        self.buf.advance(keep_from);
        Some(keep_from)
    }
}

/// Index of the first full magic, or of a magic prefix at the very end of
/// `buf`, or `buf.len()` when neither exists.
fn find_magic_or_partial(buf: &[u8]) -> usize {
    for start in 0..buf.len() {
        let rest = &buf[start..];
        let n = rest.len().min(MAGIC.len());
        if rest[..n] == MAGIC[..n] {
            return start;
        }
    }
    buf.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn frame(h: &[u8], p: &[u8]) -> Vec<u8> {
        let mut b = BytesMut::new();
        encode(h, p, &mut b);
        b.to_vec()
    }

    #[test]
    fn round_trip_split_at_every_byte() {
        let bytes = frame(br#"{"id":1}"#, b"\x00\xffpayload");
        for cut in 0..bytes.len() {
            let mut d = FrameDecoder::new();
            d.extend(&bytes[..cut]);
            assert_eq!(d.next_frame(), Ok(None));
            d.extend(&bytes[cut..]);
            let f = d.next_frame().unwrap().unwrap();
            assert_eq!(&f.header[..], br#"{"id":1}"#);
            assert_eq!(&f.payload[..], b"\x00\xffpayload");
            assert_eq!(d.buffered(), 0);
        }
    }

    #[test]
    fn resyncs_after_garbage() {
        let mut d = FrameDecoder::new();
        d.extend(b"garbageFK");
        d.extend(&frame(b"{}", b"x"));
        assert_eq!(d.next_frame(), Err(FrameError::BadMagic(9)));
        assert_eq!(
            d.next_frame().unwrap().unwrap().payload,
            Bytes::from_static(b"x")
        );
    }

    #[test]
    fn oversized_lengths_are_refused_without_allocating() {
        let mut d = FrameDecoder::new();
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        d.extend(&b);
        assert_eq!(
            d.next_frame(),
            Err(FrameError::HeaderTooLarge(u32::MAX as usize))
        );
        assert!(d.buf.capacity() < 1 << 16);
    }

    /// Random bytes never panic, and every call makes progress or asks for more.
    #[test]
    fn fuzz_random_bytes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..2000 {
            let mut d = FrameDecoder::new();
            let len = rng.gen_range(0..4096);
            let mut data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            if rng.gen_bool(0.3) {
                let at = rng.gen_range(0..=data.len());
                data.splice(at..at, MAGIC);
            }
            d.extend(&data);
            let mut rounds = 0;
            loop {
                rounds += 1;
                assert!(rounds < 10_000, "decoder did not make progress");
                let before = d.buffered();
                match d.next_frame() {
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(_) => assert!(d.buffered() < before),
                }
            }
        }
    }
}
