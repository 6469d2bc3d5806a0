//! What the load tool reads of an answer: the verdicts, nothing else.
//!
//! A response carries a dozen fields per decision (header values, the
//! rule's name and rate, durations); the load tool counts only whether each
//! decision was allowed and whether it was degraded. Decoding into these
//! two-field messages skips the rest on the wire (prost passes over unknown
//! fields without allocating), which roughly halves the client's CPU per
//! batch item and leaves more of the shared machine to the server under
//! test. The server still builds and sends every field. The field numbers
//! are those of `proto/tollgate/v1/tollgate.proto`.

use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;

/// A `ShouldAllowResponse`, verdict fields only.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Verdict {
    /// `allowed = 1`.
    #[prost(bool, tag = "1")]
    pub allowed: bool,
    /// `degraded = 10` (`Degraded`; 0 = the store answered).
    #[prost(int32, tag = "10")]
    pub degraded: i32,
}

/// A `ShouldAllowBatchResponse`, verdict fields only.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BatchVerdicts {
    /// `results = 2`.
    #[prost(message, repeated, tag = "2")]
    pub results: Vec<Verdict>,
}

/// Calls the unary method at `path` (`/package.Service/Method`), decoding
/// the answer as `Resp`.
pub async fn unary<Req, Resp>(
    grpc: &mut tonic::client::Grpc<Channel>,
    path: &'static str,
    request: Req,
) -> Result<Resp, tonic::Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("the connection is not ready: {e}")))?;
    let codec = tonic_prost::ProstCodec::<Req, Resp>::default();
    let response = grpc
        .unary(
            tonic::Request::new(request),
            PathAndQuery::from_static(path),
            codec,
        )
        .await?;
    Ok(response.into_inner())
}
