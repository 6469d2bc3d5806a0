//! The protobuf codec for Tollgate's own services.
//!
//! The stock prost codec answers a request that does not parse with
//! INTERNAL, which tells the caller the server is broken. A malformed message
//! is the caller's mistake, so this codec answers INVALID_ARGUMENT and says
//! what to fix; encoding is unchanged.

use std::marker::PhantomData;

use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// [`ProstCodec`] with decode errors mapped to INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct StrictProstCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for StrictProstCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for StrictProstCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = StrictDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        StrictDecoder(ProstDecoder::new(BufferSettings::default()))
    }
}

/// Decodes with prost; a parse failure is INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct StrictDecoder<U>(ProstDecoder<U>);

impl<U: prost::Message + Default> Decoder for StrictDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|status| {
            Status::invalid_argument(format!(
                "the request is not a valid {} message ({}); encode it from proto/tollgate/v1/tollgate.proto",
                std::any::type_name::<U>().rsplit("::").next().unwrap_or("protobuf"),
                status.message()
            ))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
