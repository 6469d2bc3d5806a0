//! Running a command or a script call on the node that serves its key:
//! routing by slot, following `MOVED`, `ASK` and `TRYAGAIN`, loading the
//! script where a node lacks it, and checking that a script call ran by
//! its deadline on the node's clock.

use std::sync::Arc;
use std::time::Duration;

use redis::Value;
use smallvec::SmallVec;
use tokio::time::Instant;

use super::journal::journal_of;
use super::node::{Answer, Node, Wire};
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
    Script(&'a (dyn Fn(i64) -> Written + Sync)),
}

/// A script call as written for one node: the usual call straight in
/// RESP, any other as a command.
pub(super) enum Written {
    /// The general form.
    Cmd(redis::Cmd),
    /// The usual call, in RESP.
    Packed(Vec<u8>),
}

impl Wire for Written {
    fn write_to(&self, out: &mut Vec<u8>) {
        match self {
            Written::Cmd(cmd) => cmd.write_to(out),
            Written::Packed(packed) => packed.write_to(out),
        }
    }

    fn packed(&self) -> std::borrow::Cow<'_, [u8]> {
        match self {
            Written::Cmd(cmd) => cmd.packed(),
            Written::Packed(packed) => packed.packed(),
        }
    }
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

    /// Runs `command` on the node serving `key`'s slot by `deadline`, with
    /// no metrics of its own.
    pub(super) fn exec_by<'a>(
        &'a self,
        deadline: Instant,
        key: &'a str,
        command: Command<'a>,
    ) -> impl Future<Output = Result<Value, StoreError>> + Send + 'a {
        // Not a layer of its own: every decision's future holds this one.
        self.exec_from(deadline, key, command, None)
    }

    /// [`Shared::exec_by`], from `first` when given: the node a call was
    /// sent to and how it answered (so the first try is not made again).
    async fn exec_from(
        &self,
        deadline: Instant,
        key: &str,
        command: Command<'_>,
        first: Option<(Arc<Node>, Option<Answer>)>,
    ) -> Result<Value, StoreError> {
        let (mut node, mut answered) = match first {
            Some(first) => first,
            None => (self.routes.route(slot_of(key), deadline).await?, None),
        };
        let slot = slot_of(key);
        let mut asking = false;
        let mut loaded = false;
        for _ in 0..MAX_REDIRECTS {
            let refused = node.refuses();
            let call = async {
                if let Some(answer) = answered.take() {
                    return Ok(answer);
                }
                match command {
                    Command::Plain(cmd) => node.call(cmd, asking, deadline).await,
                    Command::Script(write) => {
                        let on_node = node.deadline_on_node(deadline).await?;
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
                    match on_time(&node, value, deadline) {
                        Ran::Done(value) => return Ok(value),
                        // Redis's clock stepped forward: ask again with the
                        // clock just learnt.
                        Ran::AskAgain => continue,
                        Ran::TooLate(err) => return Err(err),
                    }
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
        let call = self.prepare(requests);
        let reply = self
            .exec_until(
                "decide",
                deadline,
                call.key(),
                Command::Script(&|on_node| call.write(on_node)),
            )
            .await?;
        call.read(&reply)
    }

    /// Decides each of `calls` in a script call of its own (each one hash
    /// tag's requests, in order), all by `deadline`; the calls bound for
    /// one node go in one write.
    pub(super) async fn run_many_by(
        &self,
        calls: &[&[&Request]],
        deadline: Instant,
    ) -> Vec<Result<Vec<Reply>, StoreError>> {
        let prepared: SmallVec<[Prepared; 4]> = calls.iter().map(|r| self.prepare(r)).collect();
        let keys: SmallVec<[&str; 4]> = prepared.iter().map(Prepared::key).collect();
        let writers: SmallVec<[_; 4]> = prepared
            .iter()
            .map(|call| move |on_node: i64| call.write(on_node))
            .collect();
        let replies = self.exec_scripts_by(deadline, &keys, &writers).await;
        prepared
            .iter()
            .zip(replies)
            .map(|(call, reply)| call.read(&reply?))
            .collect()
    }

    /// Script calls, each named by its first key, all by `deadline`: the
    /// calls bound for one node go in one write. One its node does not
    /// simply answer (a redirect, `TRYAGAIN`, `NOSCRIPT`, a run past its
    /// deadline on a clock that stepped) had nothing applied; it is asked
    /// again on its own, as [`Shared::exec_by`] asks.
    async fn exec_scripts_by<W: Fn(i64) -> Written + Sync>(
        &self,
        deadline: Instant,
        keys: &[&str],
        writers: &[W],
    ) -> Vec<Result<Value, StoreError>> {
        let started = Instant::now();
        let mut results: Vec<Option<Result<Value, StoreError>>> =
            (0..keys.len()).map(|_| None).collect();
        // Each node with the calls bound for it.
        let mut nodes: Vec<(Arc<Node>, Vec<usize>)> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            match self.routes.route(slot_of(key), deadline).await {
                Ok(node) => match nodes.iter_mut().find(|(n, _)| Arc::ptr_eq(n, &node)) {
                    Some((_, members)) => members.push(i),
                    None => nodes.push((node, vec![i])),
                },
                Err(err) => results[i] = Some(Err(err)),
            }
        }
        let writes = nodes.iter().map(|(node, members)| async move {
            let refused = node.refuses();
            let answers = async {
                let on_node = node.deadline_on_node(deadline).await?;
                let cmds: Vec<Written> = members.iter().map(|&i| writers[i](on_node)).collect();
                node.call_many(&cmds, deadline).await
            }
            .await;
            if !refused && answers.as_ref().is_err() {
                self.routes.refresh_soon();
            }
            answers
        });
        let written = futures_util::future::join_all(writes).await;
        // Each call its node did not simply answer, from that answer.
        let mut again: Vec<(usize, Arc<Node>, Option<Answer>)> = Vec::new();
        for ((node, members), answers) in nodes.iter().zip(written) {
            let answers = match answers {
                Ok(answers) => answers,
                Err(err) => {
                    for &i in members {
                        results[i] = Some(Err(err.clone()));
                    }
                    continue;
                }
            };
            for (&i, answer) in members.iter().zip(answers) {
                match answer {
                    Ok(Answer::Value(value)) => match on_time(node, value, deadline) {
                        Ran::Done(value) => results[i] = Some(Ok(value)),
                        Ran::AskAgain => again.push((i, node.clone(), None)),
                        Ran::TooLate(err) => results[i] = Some(Err(err)),
                    },
                    Ok(answer) => again.push((i, node.clone(), Some(answer))),
                    Err(err) => {
                        if !node.refuses() {
                            self.routes.refresh_soon();
                        }
                        results[i] = Some(Err(err));
                    }
                }
            }
        }
        let asked = again.into_iter().map(|(i, node, answer)| async move {
            let command = Command::Script(&writers[i]);
            (
                i,
                self.exec_from(deadline, keys[i], command, Some((node, answer)))
                    .await,
            )
        });
        for (i, result) in futures_util::future::join_all(asked).await {
            results[i] = Some(result);
        }
        for _ in keys {
            metrics::store_call("redis", "decide", started.elapsed());
        }
        results
            .into_iter()
            .map(|r| r.expect("every call is answered"))
            .collect()
    }

    /// A script call of `requests` made ready: counted as sent (unless its
    /// node's breaker refuses it outright), its form chosen.
    fn prepare<'a>(&'a self, requests: &'a [&'a Request]) -> Prepared<'a> {
        let key = &requests[0].keys[0];
        // Quota counters may enter a period: the call journals it.
        let journal = (self.config.journal && requests.iter().any(|r| r.may_enter_a_period()))
            .then(|| journal_of(key))
            .flatten();
        // The usual call (every request spends, every bucket a token
        // bucket) in its own form, which costs Redis far less.
        let usual = journal.is_none().then(|| UsualCall::of(requests)).flatten();
        if !self.routes.refuses(slot_of(key)) {
            metrics::store_decisions("redis", requests.len());
        }
        Prepared {
            shared: self,
            requests,
            now: self
                .clock
                .as_ref()
                .map(|c| c.now().to_string())
                .unwrap_or_default(),
            journal,
            usual,
        }
    }
}

/// A script call's reply checked against its deadline on the node's clock.
enum Ran {
    /// Run in time: the reply.
    Done(Value),
    /// Run after the deadline as the node's clock was known, which applies
    /// nothing, while the caller still waits: ask again.
    AskAgain,
    /// Run after the deadline, and the caller's wait is over.
    TooLate(StoreError),
}

fn on_time(node: &Node, value: Value, deadline: Instant) -> Ran {
    match script::clock_of(&value) {
        Some(script::Clock::OnTime(clock)) => {
            node.observe_clock(clock);
            Ran::Done(value)
        }
        Some(script::Clock::Late(clock)) => {
            node.observe_clock(clock);
            metrics::store_error("redis", "late");
            if Instant::now() < deadline {
                Ran::AskAgain
            } else {
                Ran::TooLate(StoreError::Unavailable(format!(
                    "Redis node {} ran the call after its caller's deadline; nothing was applied",
                    node.addr
                )))
            }
        }
        None => Ran::Done(value),
    }
}

/// One script call of decisions, ready to be written on any node and its
/// reply read.
struct Prepared<'a> {
    shared: &'a Shared,
    requests: &'a [&'a Request],
    /// The fixed clock's instant (tests), or empty: Redis's own.
    now: String,
    journal: Option<String>,
    usual: Option<UsualCall<'a>>,
}

impl Prepared<'_> {
    /// The key that routes the call.
    fn key(&self) -> &str {
        &self.requests[0].keys[0]
    }

    /// The call as written for a node, given the deadline on its clock.
    fn write(&self, deadline_on_node: i64) -> Written {
        let shared = self.shared;
        let margin_ms = shared.config.expiry_margin.as_millis() as u64;
        match &self.usual {
            Some(usual) => Written::Packed(usual.evalsha(
                shared.script.get_hash(),
                &self.now,
                deadline_on_node,
                margin_ms,
            )),
            None => Written::Cmd(script::evalsha(
                shared.script.get_hash(),
                self.requests,
                &self.now,
                deadline_on_node,
                margin_ms,
                shared.config.max_records_per_tenant,
                self.journal.as_deref(),
            )),
        }
    }

    /// The verdicts in `reply`, in the order of the requests.
    fn read(&self, reply: &Value) -> Result<Vec<Reply>, StoreError> {
        // Read in place: the reply is a flat array of integers.
        let ints: Option<SmallVec<[i64; 64]>> = match reply {
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
        if let Some(journal) = &self.journal {
            let appended = ints.pop().unwrap_or_default();
            self.shared.pending.appended(journal, appended);
        }
        if self.usual.is_some() {
            return usual::parse_reply(&ints, self.requests);
        }
        parse_reply(
            &ints,
            self.requests.iter().map(|r| (&r.kind, &r.charges[..])),
        )
    }
}
