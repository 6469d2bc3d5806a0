//! Oversized messages on a decision stream cost that message, not the
//! stream.
//!
//! tonic refuses a message over `--grpc-max-message-bytes` from its length
//! prefix and ends the stream there. On `ShouldAllowStream` a bad message
//! otherwise gets an error answer and the stream goes on, so an oversized
//! one should too. [`SkipOversized`] wraps the native service and, on that
//! method only, reads the request body's gRPC framing as it arrives: a
//! message within the limit passes unchanged, and one over it is dropped
//! byte by byte as it comes (never buffered) and replaced by a small marker
//! message. The codec ([`super::codec`]) turns the marker into an
//! OUT_OF_RANGE answer for that message alone.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Body as HttpBody, Frame};
use tonic::body::Body;
use tonic::server::NamedService;

/// The method whose oversized messages are skipped.
const STREAM_PATH: &str = "/tollgate.v1.RateLimiter/ShouldAllowStream";

/// The marker's payload starts with a zero byte, which no protobuf message
/// can start with (field number 0 is invalid), then this tag, the
/// message's length and the limit (each four bytes, big-endian).
const MARKER_TAG: &[u8] = b"\0tollgate:oversized";
const MARKER_LEN: usize = MARKER_TAG.len() + 8;

/// The length a message skipped by [`SkipOversized`] had and the limit it
/// was over, when `payload` is the marker that replaced it.
pub fn oversized_marker(payload: &[u8]) -> Option<(u32, u32)> {
    let rest = payload.strip_prefix(MARKER_TAG)?;
    let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?);
    let limit = u32::from_be_bytes(rest.get(4..8)?.try_into().ok()?);
    Some((len, limit))
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct SkipOversized<S> {
    inner: S,
    limit: usize,
}

impl<S> SkipOversized<S> {
    /// Wraps `inner`, whose messages may be at most `limit` bytes.
    pub fn new(inner: S, limit: usize) -> Self {
        Self { inner, limit }
    }
}

impl<S: NamedService> NamedService for SkipOversized<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tower::Service<http::Request<Body>> for SkipOversized<S>
where
    S: tower::Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if request.uri().path() != STREAM_PATH {
            return self.inner.call(request);
        }
        let (parts, body) = request.into_parts();
        let body = Body::new(Frames::new(body, self.limit));
        self.inner.call(http::Request::from_parts(parts, body))
    }
}

/// A request body whose oversized gRPC messages are replaced by markers.
struct Frames {
    inner: Body,
    limit: usize,
    /// The length prefix being read, and how much of it has arrived.
    header: [u8; 5],
    have: usize,
    /// Bytes of the current message still to pass on unchanged.
    passing: usize,
    /// Bytes of the current (oversized) message still to drop.
    skipping: usize,
}

impl Frames {
    fn new(inner: Body, limit: usize) -> Self {
        Self {
            inner,
            limit,
            header: [0; 5],
            have: 0,
            passing: 0,
            skipping: 0,
        }
    }

    /// What of `data` goes on: messages within the limit as they are,
    /// oversized ones as markers.
    fn rewrite(&mut self, mut data: Bytes) -> Bytes {
        // The usual case: whole messages within the limit pass as they are,
        // with no copy.
        if self.have == 0 && self.skipping == 0 && self.fits_whole(&data) {
            return data;
        }
        let mut out = BytesMut::new();
        while data.has_remaining() {
            if self.skipping > 0 {
                let n = self.skipping.min(data.len());
                data.advance(n);
                self.skipping -= n;
            } else if self.passing > 0 {
                let n = self.passing.min(data.len());
                out.extend_from_slice(&data.split_to(n));
                self.passing -= n;
            } else {
                let n = (5 - self.have).min(data.len());
                self.header[self.have..self.have + n].copy_from_slice(&data.split_to(n));
                self.have += n;
                if self.have < 5 {
                    continue;
                }
                self.have = 0;
                let len = u32::from_be_bytes([
                    self.header[1],
                    self.header[2],
                    self.header[3],
                    self.header[4],
                ]);
                if len as usize > self.limit {
                    out.extend_from_slice(&[0]);
                    out.extend_from_slice(&(MARKER_LEN as u32).to_be_bytes());
                    out.extend_from_slice(MARKER_TAG);
                    out.extend_from_slice(&len.to_be_bytes());
                    out.extend_from_slice(
                        &(self.limit.min(u32::MAX as usize) as u32).to_be_bytes(),
                    );
                    self.skipping = len as usize;
                } else {
                    out.extend_from_slice(&self.header);
                    self.passing = len as usize;
                }
            }
        }
        out.freeze()
    }

    /// True when `data`, read from a message boundary, holds only whole
    /// messages within the limit (then the state stays at a boundary after
    /// it, or mid-message with `passing` set).
    fn fits_whole(&mut self, data: &Bytes) -> bool {
        let mut at = 0;
        let mut passing = self.passing;
        if passing > 0 {
            if passing >= data.len() {
                self.passing -= data.len();
                return true;
            }
            at = passing;
            passing = 0;
        }
        while at < data.len() {
            let Some(header) = data.get(at..at + 5) else {
                return false;
            };
            let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
            if len > self.limit {
                return false;
            }
            let end = at + 5 + len;
            if end > data.len() {
                passing = end - data.len();
                at = data.len();
            } else {
                at = end;
            }
        }
        self.passing = passing;
        true
    }
}

impl HttpBody for Frames {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        loop {
            let frame = match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
                Some(Ok(frame)) => frame,
                other => return Poll::Ready(other),
            };
            match frame.into_data() {
                Ok(data) => {
                    let data = self.rewrite(data);
                    // All of it dropped (an oversized message's bytes):
                    // read on.
                    if !data.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                }
                Err(frame) => return Poll::Ready(Some(Ok(frame))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: &[u8]) -> Vec<u8> {
        let mut framed = vec![0];
        framed.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        framed.extend_from_slice(payload);
        framed
    }

    /// Feeds `input` in pieces of `piece` bytes and joins what comes out.
    fn through(limit: usize, input: &[u8], piece: usize) -> Vec<u8> {
        let mut frames = Frames::new(Body::empty(), limit);
        let mut out = Vec::new();
        for chunk in input.chunks(piece) {
            out.extend_from_slice(&frames.rewrite(Bytes::copy_from_slice(chunk)));
        }
        out
    }

    #[test]
    fn oversized_messages_become_markers_and_the_rest_pass_unchanged_however_split() {
        let small = message(b"\x0a\x01k");
        let big = message(&[7u8; 100]);
        let input = [small.clone(), big, small.clone(), message(b"")].concat();
        let mut marker = vec![0];
        marker.extend_from_slice(&(MARKER_LEN as u32).to_be_bytes());
        marker.extend_from_slice(MARKER_TAG);
        marker.extend_from_slice(&100u32.to_be_bytes());
        marker.extend_from_slice(&64u32.to_be_bytes());
        let want = [small.clone(), marker.clone(), small, message(b"")].concat();
        for piece in [1, 2, 3, 5, 7, 64, 1000] {
            assert_eq!(through(64, &input, piece), want, "pieces of {piece}");
        }
        assert_eq!(oversized_marker(&marker[5..]), Some((100, 64)));
        assert_eq!(oversized_marker(b"\x0a\x01k"), None);
        // Within the limit nothing changes, whatever the split.
        for piece in [1, 4, 6, 1000] {
            assert_eq!(through(100, &input, piece), input, "pieces of {piece}");
        }
    }
}
