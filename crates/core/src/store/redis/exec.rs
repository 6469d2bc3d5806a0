//! Running a command or a script call on the node that serves its key:
//! routing by slot, following `MOVED`, `ASK` and `TRYAGAIN`, loading the
//! script where a node lacks it, and checking that a script call ran by
//! its deadline on the node's clock.

use std::time::Duration;

use redis::Value;
use smallvec::SmallVec;
use tokio::time::Instant;

use super::journal::journal_of;
use super::node::Answer;
use super::script::{self, Reply, Request, parse_reply};
use super::topology::slot_of;
use super::usual::{self, UsualCall};
use super::{Shared, TOKEN_BUCKET_LUA};
use crate::store::StoreError;
use crate::telemetry::metrics;

/// What [`Shared::exec_by`] sends.
#[derive(Clone, Copy)]
pub(super) enum Command<'a> {
    /// A command as it is.
    Plain(&'a redis::Cmd),
    /// The decision script, written for the node that runs it: given the
    /// call's deadline on that node's clock, so that a call Redis runs
    /// after its caller was answered applies nothing.
    Script(&'a (dyn Fn(i64) -> redis::Cmd + Sync)),
}

/// Most redirects (and `TRYAGAIN` pauses) one call follows.
const MAX_REDIRECTS: usize = 16;

/// The pause before asking again after `TRYAGAIN`.
const TRYAGAIN_PAUSE: Duration = Duration::from_millis(2);

impl Shared {
    /// Runs `cmd` on the node serving `key`'s slot by `deadline`,
    /// following redirects and loading the script where missing.
    pub(super) async fn exec_until(
        &self,
        op: &'static str,
        deadline: Instant,
        key: &str,
        cmd: Command<'_>,
    ) -> Result<Value, StoreError> {
        let started = Instant::now();
        let result = self.exec_by(deadline, key, cmd).await;
        metrics::store_call("redis", op, started.elapsed());
        result
    }

    /// [`Shared::exec_until`] by the store's timeout, the reply converted
    /// to `T`.
    pub(super) async fn exec_as<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        key: &str,
        cmd: &redis::Cmd,
    ) -> Result<T, StoreError> {
        let deadline = Instant::now() + self.config.timeout;
        let value = self
            .exec_until(op, deadline, key, Command::Plain(cmd))
            .await?;
        redis::from_redis_value(value)
            .map_err(|e| StoreError::Protocol(format!("Redis answered {op} unexpectedly: {e}")))
    }

    pub(super) async fn exec_by(
        &self,
        deadline: Instant,
        key: &str,
        command: Command<'_>,
    ) -> Result<Value, StoreError> {
        let slot = slot_of(key);
        let mut node = self.routes.route(slot, deadline).await?;
        let mut asking = false;
        let mut loaded = false;
        for _ in 0..MAX_REDIRECTS {
            let refused = node.refuses();
            let call = async {
                match command {
                    Command::Plain(cmd) => node.call(cmd, asking, deadline).await,
                    Command::Script(write) => {
                        node.learn_clock(deadline).await?;
                        let on_node = node.deadline_on_node(deadline).ok_or_else(|| {
                            StoreError::Unavailable(format!(
                                "Redis node {}: connection dropped",
                                node.addr
                            ))
                        })?;
                        node.call(&write(on_node), asking, deadline).await
                    }
                }
            };
            let answer = match call.await {
                Ok(answer) => answer,
                Err(err) => {
                    // A node that just failed may have been replaced: look
                    // again (one whose breaker is open already is looked
                    // at on the refresher's own period).
                    if !refused {
                        self.routes.refresh_soon();
                    }
                    return Err(err);
                }
            };
            match answer {
                Answer::Value(value) if matches!(command, Command::Script(_)) => {
                    match script::clock_of(&value) {
                        Some(script::Clock::OnTime(clock)) => node.observe_clock(clock),
                        Some(script::Clock::Late(clock)) => {
                            node.observe_clock(clock);
                            metrics::store_error("redis", "late");
                            // Redis ran it after the deadline as this
                            // node's clock was known; when the caller
                            // still waits (Redis's clock stepped forward),
                            // ask again with the clock just learnt.
                            if Instant::now() < deadline {
                                continue;
                            }
                            return Err(StoreError::Unavailable(format!(
                                "Redis node {} ran the call after its caller's deadline; \
                                 nothing was applied",
                                node.addr
                            )));
                        }
                        None => {}
                    }
                    return Ok(value);
                }
                Answer::Value(value) => return Ok(value),
                Answer::Redirect { moved, addr } => {
                    metrics::store_redirect(if moved { "moved" } else { "ask" });
                    node = self.routes.node_at(&addr)?;
                    if moved {
                        self.routes.moved(slot, &node);
                    }
                    asking = !moved;
                }
                Answer::TryAgain => {
                    metrics::store_redirect("tryagain");
                    let pause = (Instant::now() + TRYAGAIN_PAUSE).min(deadline);
                    tokio::time::sleep_until(pause).await;
                }
                // Redis lost its scripts (a restart, a failover, SCRIPT
                // FLUSH), or this node never had it: load it and ask again.
                Answer::NoScript if !loaded => {
                    loaded = true;
                    let load = redis::cmd("SCRIPT")
                        .arg("LOAD")
                        .arg(TOKEN_BUCKET_LUA)
                        .clone();
                    node.call(&load, false, deadline).await?;
                }
                Answer::NoScript => {
                    return Err(StoreError::Unavailable(format!(
                        "Redis node {} keeps forgetting the decision script",
                        node.addr
                    )));
                }
            }
        }
        Err(StoreError::Unavailable(format!(
            "Redis redirected a call {MAX_REDIRECTS} times; the cluster is resharding or misconfigured"
        )))
    }

    /// Decides `requests` in one script call, in order.
    pub(super) async fn run(&self, requests: &[Request]) -> Result<Vec<Reply>, StoreError> {
        let refs: SmallVec<[&Request; 1]> = requests.iter().collect();
        self.run_refs_by(&refs, Instant::now() + self.config.timeout)
            .await
    }

    /// Decides `requests` in one script call, in order, by `deadline`.
    pub(super) async fn run_refs_by(
        &self,
        requests: &[&Request],
        deadline: Instant,
    ) -> Result<Vec<Reply>, StoreError> {
        let now = self
            .clock
            .as_ref()
            .map(|c| c.now().to_string())
            .unwrap_or_default();
        let margin_ms = self.config.expiry_margin.as_millis() as u64;
        let key = &requests[0].keys[0];
        // Quota counters may enter a period: the call journals it.
        let journal = (self.config.journal && requests.iter().any(|r| r.may_enter_a_period()))
            .then(|| journal_of(key))
            .flatten();
        // The usual call (every request spends, every bucket a token
        // bucket) in its own form, which costs Redis far less.
        let usual = journal.is_none().then(|| UsualCall::of(requests)).flatten();
        let write = |deadline_on_node: i64| match &usual {
            Some(usual) => usual.evalsha(self.script.get_hash(), &now, deadline_on_node, margin_ms),
            None => script::evalsha(
                self.script.get_hash(),
                requests,
                &now,
                deadline_on_node,
                margin_ms,
                self.config.max_records_per_tenant,
                journal.as_deref(),
            ),
        };
        // Counted as sent unless the node's breaker refuses it outright.
        if !self.routes.refuses(slot_of(key)) {
            metrics::store_decisions("redis", requests.len());
        }
        let reply = self
            .exec_until("decide", deadline, key, Command::Script(&write))
            .await?;
        // Read in place: the reply is a flat array of integers.
        let ints: Option<SmallVec<[i64; 64]>> = match &reply {
            Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    Value::Int(n) => Some(*n),
                    _ => None,
                })
                .collect(),
            _ => None,
        };
        let Some(mut ints) = ints else {
            return Err(StoreError::Protocol(format!(
                "Redis answered decide unexpectedly: {reply:?}, not an array of integers"
            )));
        };
        if let Some(journal) = &journal {
            let appended = ints.pop().unwrap_or_default();
            self.pending.appended(journal, appended);
        }
        if usual.is_some() {
            return usual::parse_reply(&ints, requests);
        }
        parse_reply(&ints, requests.iter().map(|r| (&r.kind, &r.charges[..])))
    }
}
