//! Bad input gets the right status and a message that says what to fix,
//! and never changes state.

use crate::common;

use common::{TestServer, ask, raw, req, row};
use tollgate::engine::Unmatched;
use tollgate::proto::v1::{BatchItem, ShouldAllowBatchRequest, ShouldAllowRequest};
use tonic::Code;

async fn refused(server: &TestServer, request: ShouldAllowRequest) -> tonic::Status {
    let mut client = server.client().await;
    client
        .should_allow(request)
        .await
        .expect_err("should be refused")
}

#[tokio::test]
async fn each_bad_field_is_named() {
    let server = TestServer::start().await;
    let cases = [
        (
            req("", ""),
            "key is empty; send the caller's API key, user id or IP address",
        ),
        (
            req("", &"k".repeat(257)),
            "key is 257 bytes; at most 256 are allowed (hash longer keys first)",
        ),
        (
            req(&"t".repeat(129), "k"),
            "tenant is 129 bytes; at most 128 are allowed",
        ),
        (
            req("acme corp", "k"),
            "tenant \"acme corp\" contains ' '; use ASCII letters, digits, '.', '_' and '-'",
        ),
        (
            ShouldAllowRequest {
                resource: "a/b".into(),
                ..req("", "k")
            },
            "resource \"a/b\" contains '/'; use ASCII letters, digits, '.', '_' and '-'",
        ),
        (
            ShouldAllowRequest {
                cost: 31,
                ..req("acme", "k")
            },
            "cost 31 of the request exceeds the capacity (burst) 30 of rule \"default-per-key\"; \
             it can never be allowed, so lower the cost or raise the rule's burst",
        ),
    ];
    for (request, message) in cases {
        let status = refused(&server, request).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{}", status.message());
        assert_eq!(status.message(), message);
    }
    // A key of exactly 256 bytes is fine, and nothing above was charged.
    let mut client = server.client().await;
    assert!(ask(&mut client, req("", &"k".repeat(256))).await.allowed);
    assert_eq!(ask(&mut client, req("acme", "k")).await.remaining, 29);
    server.stop().await;
}

fn item(key: &str, cost: u64) -> BatchItem {
    BatchItem {
        key: key.into(),
        cost,
        tenant: String::new(),
        resource: String::new(),
    }
}

#[tokio::test]
async fn bad_batches_are_refused_whole() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let batch = |items: Vec<BatchItem>| ShouldAllowBatchRequest {
        items,
        dry_run: false,
    };
    let cases = [
        (batch(vec![]), "items is empty; send 1 to 1000 items"),
        (
            batch((0..1001).map(|i| item(&i.to_string(), 1)).collect()),
            "items has 1001 entries; at most 1000 are allowed, so split the batch",
        ),
        (
            batch(vec![item("a", 1), item("", 1)]),
            "items[1].key is empty; send the caller's API key, user id or IP address",
        ),
        (
            batch(vec![item("a", 1), item("b", 40)]),
            "cost 40 of items[1] exceeds the capacity (burst) 30 of rule \"default-per-key\"; \
             it can never be allowed, so lower the cost or raise the rule's burst",
        ),
        (
            batch(vec![item("a", 20), item("a", 20)]),
            "cost 40 of the items sharing bucket \":k::a\" exceeds the capacity (burst) 30 of rule \
             \"default-per-key\"; it can never be allowed, so lower the cost or raise the rule's burst",
        ),
    ];
    for (request, message) in cases {
        let status = client
            .should_allow_batch(request)
            .await
            .expect_err("refused");
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), message);
    }
    // Nothing was charged by the refused batches.
    assert_eq!(ask(&mut client, req("", "a")).await.remaining, 29);
    server.stop().await;
}

#[tokio::test]
async fn a_malformed_message_is_invalid_argument_not_internal() {
    let server = TestServer::start().await;
    let mut grpc = tonic::client::Grpc::new(server.channel().await);
    grpc.ready().await.unwrap();
    // Field 1 (key) declared as a 100-byte string, but only 3 bytes follow.
    let garbage = vec![0x0a, 100, b'a', b'b', b'c'];
    let status = grpc
        .unary(
            tonic::Request::new(garbage),
            "/tollgate.v1.RateLimiter/ShouldAllow".parse().unwrap(),
            raw::RawCodec,
        )
        .await
        .expect_err("malformed");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .starts_with("the request is not a valid ShouldAllowRequest message"),
        "{}",
        status.message()
    );
    assert!(
        status
            .message()
            .ends_with("encode it from proto/tollgate/v1/tollgate.proto")
    );
    server.stop().await;
}

/// The proto promises that a bad message on `ShouldAllowStream` gets an
/// answer with `error_code` set and the stream goes on: one that does not
/// parse at all included, between good ones, in order.
#[tokio::test]
async fn an_undecodable_message_on_a_stream_is_answered_and_the_stream_goes_on() {
    use prost::Message;
    let server = TestServer::with_rows(&[row("acme", "acme", "", "key", 5, "1/hour")]).await;
    let good = req("acme", "k").encode_to_vec();
    // Field 1 (key) declared as a 100-byte string, but only 3 bytes follow.
    let garbage = vec![0x0a, 100, b'a', b'b', b'c'];
    let messages = vec![good.clone(), garbage.clone(), good.clone(), garbage, good];
    let answers = raw::stream_decisions(server.channel().await, messages).await;
    assert_eq!(answers.len(), 5, "{answers:#?}");
    for (i, answer) in answers.iter().enumerate() {
        if i % 2 == 0 {
            assert_eq!(answer.error_code, 0, "{answer:?}");
            let decision = answer.decision.as_ref().unwrap();
            assert!(decision.allowed);
            assert_eq!(decision.remaining, 4 - i as u64 / 2);
        } else {
            assert_eq!(answer.error_code, Code::InvalidArgument as u32);
            assert!(answer.decision.is_none());
            assert!(
                answer
                    .error_message
                    .starts_with("the request is not a valid ShouldAllowRequest message"),
                "{}",
                answer.error_message
            );
        }
    }
    // Unary calls on other connections still fail a malformed message whole
    // (the lenient decoding is the stream's alone).
    let mut unary = tonic::client::Grpc::new(server.channel().await);
    unary.ready().await.unwrap();
    let status = unary
        .unary(
            tonic::Request::new(vec![0x0a, 100, b'a']),
            "/tollgate.v1.RateLimiter/ShouldAllow".parse().unwrap(),
            raw::RawCodec,
        )
        .await
        .expect_err("malformed");
    assert_eq!(status.code(), Code::InvalidArgument);
    server.stop().await;
}

/// A message over `--grpc-max-message-bytes` on `ShouldAllowStream` costs
/// that message, not the stream: it is answered OUT_OF_RANGE and the
/// messages after it are decided, in order. One of exactly the limit is
/// read (and refused for its over-long key, which shows it was decoded);
/// one byte more is skipped unread.
#[tokio::test]
async fn an_oversized_message_on_a_stream_is_answered_and_the_stream_goes_on() {
    use prost::Message;
    let rows = [row("acme", "acme", "", "key", 5, "1/hour")];
    let server = TestServer::launch(Some(&rows), |c| c.grpc_limits.max_message_bytes = 4096).await;
    let good = req("acme", "k").encode_to_vec();
    let sized = |len: usize| {
        (1..len)
            .map(|k| req("acme", &"x".repeat(k)).encode_to_vec())
            .find(|m| m.len() == len)
            .unwrap()
    };
    let at_limit = sized(4096);
    let over = sized(4097);
    let huge = req("acme", &"y".repeat(1 << 20)).encode_to_vec();
    let messages = vec![
        good.clone(),
        over,
        good.clone(),
        huge,
        at_limit,
        good.clone(),
    ];
    let answers = raw::stream_decisions(server.channel().await, messages).await;
    let codes: Vec<u32> = answers.iter().map(|a| a.error_code).collect();
    let (ok, out_of_range, invalid) = (0, Code::OutOfRange as u32, Code::InvalidArgument as u32);
    assert_eq!(
        codes,
        [ok, out_of_range, ok, out_of_range, invalid, ok],
        "{answers:#?}"
    );
    let remaining: Vec<u64> = answers
        .iter()
        .filter_map(|a| a.decision.as_ref().map(|d| d.remaining))
        .collect();
    assert_eq!(remaining, [4, 3, 2], "the good ones decided in order");
    assert_eq!(
        answers[1].error_message,
        "message length too large: 4097 bytes, the limit is 4096 bytes \
         (--grpc-max-message-bytes); this message was skipped and the stream goes on"
    );
    assert!(
        answers[3].error_message.starts_with(&format!(
            "message length too large: {} bytes",
            req("acme", &"y".repeat(1 << 20)).encoded_len()
        )),
        "{}",
        answers[3].error_message
    );
    assert!(
        answers[4].error_message.starts_with("key"),
        "{}",
        answers[4].error_message
    );
    server.stop().await;
}

#[tokio::test]
async fn unmatched_deny_refuses_requests_no_rule_covers() {
    let server = TestServer::start_with(
        Some(&[row("acme", "acme", "", "key", 5, "1/second")]),
        Unmatched::Deny,
        1000,
    )
    .await;
    let status = refused(&server, req("globex", "k")).await;
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        status.message(),
        "no limit applies to tenant \"globex\" (resource \"\") and this server refuses unlimited requests; \
         add a row for the tenant or a default row (tenant '') to the limits table"
    );
    let mut client = server.client().await;
    assert!(ask(&mut client, req("acme", "k")).await.allowed);
    server.stop().await;
}
