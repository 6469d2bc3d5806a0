//! A codec that sends and receives raw bytes as gRPC message bodies, for
//! malformed-message tests and the fuzz harness.

use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

impl Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        use bytes::Buf;
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// Sends `messages` as raw bodies on one `ShouldAllowStream` and returns the
/// answers, decoded.
pub async fn stream_decisions(
    channel: tonic::transport::Channel,
    messages: Vec<Vec<u8>>,
) -> Vec<tollgate::proto::v1::StreamDecision> {
    use prost::Message;
    use tokio_stream::StreamExt;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    grpc.streaming(
        tonic::Request::new(tokio_stream::iter(messages)),
        "/tollgate.v1.RateLimiter/ShouldAllowStream"
            .parse()
            .unwrap(),
        RawCodec,
    )
    .await
    .unwrap()
    .into_inner()
    .map(|m| tollgate::proto::v1::StreamDecision::decode(m.unwrap().as_slice()).unwrap())
    .collect()
    .await
}
