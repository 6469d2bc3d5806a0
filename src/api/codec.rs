//! The protobuf codec for Tollgate's own services.
//!
//! The stock prost codec answers a request that does not parse with
//! INTERNAL, which tells the caller the server is broken. A malformed message
//! is the caller's mistake, so this codec answers INVALID_ARGUMENT and says
//! what to fix; encoding is unchanged.
//!
//! On a stream, one malformed message should cost the caller that message,
//! not the stream: tonic ends a stream at the first decode error. So a
//! stream reads through [`lenient`]: while (and only while) that future is
//! polled on this thread, a message that does not parse is consumed whole
//! and handed over as an error item, and the stream goes on. A message over
//! the size limit arrives here as the marker [`super::frames`] put in its
//! place, and is answered the same way (OUT_OF_RANGE).

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Buf;

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
        let oversized = super::frames::oversized_marker(buf.chunk());
        let status = match oversized {
            Some((len, limit)) => Status::out_of_range(format!(
                "message length too large: {len} bytes, the limit is {limit} bytes \
                 (--grpc-max-message-bytes); this message was skipped and the stream goes on"
            )),
            None => match self.0.decode(buf) {
                Ok(message) => return Ok(message),
                Err(status) => Status::invalid_argument(format!(
                    "the request is not a valid {} message ({}); encode it from proto/tollgate/v1/tollgate.proto",
                    std::any::type_name::<U>()
                        .rsplit("::")
                        .next()
                        .unwrap_or("protobuf"),
                    status.message()
                )),
            },
        };
        if !LENIENT.get() {
            return Err(status);
        }
        // Skip what is left of this message, so the next one starts where
        // the caller put it, and hand the error to `lenient`.
        buf.advance(buf.remaining());
        DECODE_ERROR.replace(Some(status));
        Ok(Some(U::default()))
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

thread_local! {
    /// True while a [`Lenient`] future is being polled on this thread.
    static LENIENT: Cell<bool> = const { Cell::new(false) };
    /// The decode error of the message the lenient decoder just skipped.
    static DECODE_ERROR: RefCell<Option<Status>> = const { RefCell::new(None) };
}

/// Reads the next message of a stream, where a message that does not parse
/// is `Ok(Some(Err(status)))` and the stream goes on; transport errors stay
/// `Err`.
pub fn lenient<F, U>(next: F) -> Lenient<F>
where
    F: Future<Output = Result<Option<U>, Status>>,
{
    Lenient { next }
}

pin_project_lite::pin_project! {
    /// See [`lenient`].
    pub struct Lenient<F> {
        #[pin]
        next: F,
    }
}

impl<F, U> Future for Lenient<F>
where
    F: Future<Output = Result<Option<U>, Status>>,
{
    type Output = Result<Option<Result<U, Status>>, Status>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Decoders run inside this poll, on this thread; outside it (other
        // calls' decoders on the same thread) the flag is off again.
        let was = LENIENT.replace(true);
        DECODE_ERROR.take();
        let polled = self.project().next.poll(cx);
        LENIENT.set(was);
        let skipped = DECODE_ERROR.take();
        polled.map(|next| {
            next.map(|message| {
                message.map(|message| match skipped {
                    Some(status) => Err(status),
                    None => Ok(message),
                })
            })
        })
    }
}
