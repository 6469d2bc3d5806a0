//! Coalescing: concurrent decisions share script calls.
//!
//! Each Redis node has its own queue: at most [`COALESCE_IN_FLIGHT`]
//! script calls are in flight to one node, so a slow or dead node holds up
//! only the decisions bound for it. A decision
//! that finds a slot free is sent at once from its own task, together with
//! whatever had queued; one that finds none queues, and the slot's holder
//! takes the queue when its call returns. The script decides the decisions
//! of one call one after another, in order, each all-or-nothing on its own,
//! so the verdicts are those of the same decisions sent one by one.
//!
//! Redis runs a script to its end before serving anyone else, so large
//! requests (batches) share a call only up to [`MAX_KEYS_PER_CALL`]
//! buckets, and small ones (single decisions) join whatever call goes next,
//! ahead of large ones that queued earlier: a flood of thousand-item
//! batches delays a single decision by a few calls of a few milliseconds,
//! not by the whole backlog. Requests in the same queue are concurrent, so
//! any order between them is one they could have arrived in.
//!
//! Every decision has a deadline (the store's timeout from when it was
//! asked), kept without a timer of its own: a script call runs by the
//! earliest deadline among its decisions, but for at least a fifth of the
//! timeout (so one decision about to expire cannot fail a call to a
//! healthy Redis, and count against its breaker, for all the others), and
//! a decision still queued when its deadline passes is answered
//! "unavailable" by the next take from the queue (which comes when a call
//! in flight ends, by that call's own deadline). So a decision is answered
//! by its deadline, or at worst a fifth of the timeout after it.

use std::sync::Arc;

use smallvec::SmallVec;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::node::Node;
use super::{Reply, Request, Shared};
use crate::store::StoreError;
use crate::telemetry::metrics;

/// The coalescing state: how many script calls are in flight, and the
/// decisions that arrived while [`COALESCE_IN_FLIGHT`] were.
#[derive(Default)]
pub(super) struct Waiting {
    in_flight: usize,
    queue: Vec<Queued>,
}

/// Most buckets the large requests of one coalesced call carry together.
/// Small requests always join (64 of them add at most 512), and a call
/// that starts empty takes its oldest request whatever its size (a batch of
/// 1 000 items under several rules goes alone). At ~3 µs of Redis CPU per
/// bucket, a call holds Redis for a few milliseconds at most.
const MAX_KEYS_PER_CALL: usize = 500;

/// A request of at most this many buckets (a single decision under up to
/// four rules, or a tiny batch) is small: it goes before large ones.
const SMALL_REQUEST_KEYS: usize = 8;

impl Waiting {
    /// Moves queued decisions into `batch`, at most `max` in all: an empty
    /// batch first takes the oldest request whatever its size (so a large
    /// one is never passed over for ever), then every small request, then
    /// large ones in arrival order while the call stays within
    /// [`MAX_KEYS_PER_CALL`] buckets. The script decides in `batch`'s
    /// order: small ones first.
    ///
    /// Decisions whose callers stopped waiting are dropped rather than
    /// sent (they must not spend tokens now), and those whose deadline
    /// passed at `now` are answered "unavailable", so their rule's
    /// store-unavailable policy decides.
    fn take_into(&mut self, batch: &mut Vec<Queued>, max: usize, now: Instant) {
        self.queue.retain(|q| {
            if q.reply.is_closed() {
                return false;
            }
            if q.deadline > now {
                return true;
            }
            metrics::store_error("redis", "timeout");
            false
        });
        let mut keys: usize = batch.iter().map(|q| q.request.keys.len()).sum();
        let mut count = batch.len();
        let mut take: SmallVec<[bool; 64]> = SmallVec::from_elem(false, self.queue.len());
        if count == 0 && max > 0 && !self.queue.is_empty() {
            take[0] = true;
            keys = self.queue[0].request.keys.len();
            count = 1;
        }
        for small in [true, false] {
            for (i, q) in self.queue.iter().enumerate() {
                let n = q.request.keys.len();
                if take[i] || (n <= SMALL_REQUEST_KEYS) != small {
                    continue;
                }
                // Small requests always fit: they are why the cap exists.
                if count >= max || (!small && keys + n > MAX_KEYS_PER_CALL) {
                    break;
                }
                take[i] = true;
                keys += n;
                count += 1;
            }
        }
        // One pass: small ones straight into the batch, large ones after
        // them; what is not taken stays queued in its order.
        batch.reserve(count - batch.len());
        let mut large: Vec<Queued> = Vec::new();
        let mut i = 0;
        for q in self.queue.extract_if(.., |_| {
            i += 1;
            take[i - 1]
        }) {
            if q.request.keys.len() <= SMALL_REQUEST_KEYS {
                batch.push(q);
            } else {
                large.push(q);
            }
        }
        batch.append(&mut large);
    }
}

/// A decision waiting for a shared script call. Its request is boxed from
/// the start: a decision moves a few times on its way into a call (into
/// the queue, the batch, the call's order), each a few words instead of
/// the request's hundreds of bytes.
pub(super) struct Queued {
    request: Box<Request>,
    reply: oneshot::Sender<Result<Reply, StoreError>>,
    /// When its caller's wait ends (see the module docs).
    deadline: Instant,
}

/// A script call has at least the store's timeout divided by this to run,
/// whatever its decisions' deadlines (see the module docs).
const MIN_CALL_SHARE: u32 = 5;

/// Script calls in flight at once when coalescing. A decision that finds a
/// free slot is sent at once from its own task, together with whatever has
/// queued up; one that finds none queues, and the next call takes it. So
/// the batch size follows the load: one at a time when idle (no extra hop),
/// up to the configured maximum under pressure.
const COALESCE_IN_FLIGHT: usize = 2;

/// A decision's place in its node's coalescing (see [`join`]).
pub(super) enum Joined<'a> {
    /// A free slot and nothing else waiting: the caller sends the call
    /// itself, from its own task, with no hop. The slot's guard frees it
    /// (or drains what queued meanwhile) even if the caller is cancelled
    /// mid-call.
    Alone {
        slot: Slot<'a>,
        batch: Vec<Queued>,
        answer: Answer,
    },
    /// Queued for the next call, or carried by one that others' decisions
    /// share: the answer comes from that call.
    Carried(Answer),
}

/// Where a coalesced decision's answer arrives.
type Answer = oneshot::Receiver<Result<Reply, StoreError>>;

/// Puts `request` into `node`'s coalescing, to be answered by `deadline`
/// (see the module docs). Done before any wait, so the request moves once,
/// into the queue or the call, and no future holds a copy of it.
pub(super) fn join<'a>(
    shared: &'a Arc<Shared>,
    node: Arc<Node>,
    request: Box<Request>,
    deadline: Instant,
) -> Joined<'a> {
    let Some(coalesce) = &node.waiting else {
        unreachable!("join is called for nodes that coalesce")
    };
    let (reply, answer) = oneshot::channel();
    let mine = Queued {
        request,
        reply,
        deadline,
    };
    let batch = {
        let mut waiting = coalesce.lock();
        if waiting.in_flight < COALESCE_IN_FLIGHT {
            waiting.in_flight += 1;
            let mut batch = Vec::with_capacity(waiting.queue.len().min(shared.config.coalesce) + 1);
            batch.push(mine);
            waiting.take_into(&mut batch, shared.config.coalesce, Instant::now());
            Some(batch)
        } else {
            waiting.queue.push(mine);
            None
        }
    };
    match batch {
        Some(batch) if batch.len() == 1 => Joined::Alone {
            slot: Slot(shared, node),
            batch,
            answer,
        },
        // A free slot and others waiting: the call carries their
        // decisions too, so it runs in a task of its own, which a
        // cancelled caller cannot abandon half-way.
        Some(mut batch) => {
            let shared = shared.clone();
            tokio::spawn(async move {
                let _slot = Slot(&shared, node);
                send_coalesced(&shared, &mut batch).await;
            });
            Joined::Carried(answer)
        }
        // Every slot busy: the next call takes this decision, or the take
        // after its deadline answers it.
        None => Joined::Carried(answer),
    }
}

impl Joined<'_> {
    /// The decision's answer (the call sent first when alone), or
    /// "unavailable" when its call ended without one; `timeout` is the
    /// store's, for the message.
    pub(super) async fn answer(self, timeout: std::time::Duration) -> Result<Reply, StoreError> {
        let answer = match self {
            Joined::Alone {
                slot,
                mut batch,
                answer,
            } => {
                send_coalesced(slot.0, &mut batch).await;
                drop(slot);
                answer
            }
            Joined::Carried(answer) => answer,
        };
        answer.await.unwrap_or_else(|_| {
            Err(StoreError::Unavailable(format!(
                "no answer within {timeout:?}"
            )))
        })
    }
}

/// A coalescing slot held by a script call in flight; dropping it (after
/// the call, or when the call is cancelled) hands it on.
pub(super) struct Slot<'a>(&'a Arc<Shared>, Arc<Node>);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        release_or_drain(self.0, &self.1);
    }
}

/// After a coalesced call: frees its slot if nothing is queued, otherwise
/// keeps the slot and drains the queue in a task of its own (so the caller
/// that made the call gets its answer now).
fn release_or_drain(shared: &Arc<Shared>, node: &Arc<Node>) {
    let Some(coalesce) = &node.waiting else {
        return;
    };
    {
        let mut waiting = coalesce.lock();
        if waiting.queue.is_empty() {
            waiting.in_flight -= 1;
            return;
        }
    }
    let shared = shared.clone();
    let node = node.clone();
    tokio::spawn(async move {
        let Some(coalesce) = &node.waiting else {
            return;
        };
        // One batch, emptied by each call and filled again by the next take.
        let mut batch = Vec::new();
        loop {
            {
                let mut waiting = coalesce.lock();
                waiting.take_into(&mut batch, shared.config.coalesce, Instant::now());
                if batch.is_empty() {
                    waiting.in_flight -= 1;
                    return;
                }
            }
            send_coalesced(&shared, &mut batch).await;
        }
    });
}

/// Sends coalesced decisions, one script call per hash tag (a cluster runs
/// a script on one slot; a single Redis takes them all in one call), the
/// calls in one write, by the earliest deadline among their decisions or
/// [`MIN_CALL_SHARE`] of the timeout from now, whichever is later, and
/// answers each; `taken` is left empty.
async fn send_coalesced(shared: &Shared, taken: &mut Vec<Queued>) {
    if taken.is_empty() {
        return;
    }
    let floor = Instant::now() + shared.config.timeout / MIN_CALL_SHARE;
    // (hash tag, members, the earliest deadline among them)
    let mut groups: SmallVec<[(&str, Vec<usize>, Instant); 1]> = SmallVec::new();
    if shared.routes.is_cluster() {
        for (i, q) in taken.iter().enumerate() {
            let tag = hash_tag(&q.request.keys[0]);
            match groups.iter_mut().find(|(t, ..)| *t == tag) {
                Some((_, members, deadline)) => {
                    members.push(i);
                    *deadline = (*deadline).min(q.deadline);
                }
                None => groups.push((tag, vec![i], q.deadline)),
            }
        }
    } else if let Some(deadline) = taken.iter().map(|q| q.deadline).min() {
        groups.push(("", (0..taken.len()).collect(), deadline));
    }
    // Each form of the call is boxed: its state would otherwise enlarge
    // every decision's future, which the store moves into a box of its own
    // per decision.
    let answers: SmallVec<[Result<Vec<Reply>, StoreError>; 1]> =
        if let [(_, _, deadline)] = &groups[..] {
            let group: SmallVec<[&Request; 16]> = taken.iter().map(|q| &*q.request).collect();
            let call = Box::pin(shared.run_refs_by(&group, (*deadline).max(floor)));
            smallvec::smallvec![call.await]
        } else {
            // Several tags share one write, and so its deadline.
            let deadline = groups.iter().map(|(.., d)| *d).min().unwrap_or(floor);
            Box::pin(run_tags(shared, taken, &groups, deadline.max(floor)))
                .await
                .into()
        };
    let members: SmallVec<[Vec<usize>; 1]> = groups.into_iter().map(|(_, m, _)| m).collect();
    let mut replies: Vec<Option<oneshot::Sender<_>>> =
        taken.drain(..).map(|q| Some(q.reply)).collect();
    for (members, result) in members.into_iter().zip(answers) {
        match result {
            Ok(outcomes) => {
                for (i, outcome) in members.into_iter().zip(outcomes) {
                    if let Some(reply) = replies[i].take() {
                        let _ = reply.send(Ok(outcome));
                    }
                }
            }
            Err(err) => {
                for i in members {
                    if let Some(reply) = replies[i].take() {
                        let _ = reply.send(Err(err.clone()));
                    }
                }
            }
        }
    }
}

/// The script calls of several hash tags' `groups` of `taken`, in one
/// write by `deadline`: each call's result in the groups' order.
async fn run_tags(
    shared: &Shared,
    taken: &[Queued],
    groups: &[(&str, Vec<usize>, Instant)],
    deadline: Instant,
) -> Vec<Result<Vec<Reply>, StoreError>> {
    let requests: SmallVec<[SmallVec<[&Request; 8]>; 8]> = groups
        .iter()
        .map(|(_, members, _)| members.iter().map(|&i| &*taken[i].request).collect())
        .collect();
    let calls: SmallVec<[&[&Request]; 8]> = requests.iter().map(|r| &r[..]).collect();
    shared.run_many_by(&calls, deadline).await
}

/// The `{…}` part of a Redis key (what Redis Cluster hashes).
pub(super) fn hash_tag(key: &str) -> &str {
    key.split_once('{')
        .and_then(|(_, rest)| rest.split_once('}'))
        .map_or(key, |(tag, _)| tag)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(key: &str) -> (Queued, oneshot::Receiver<Result<Reply, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        let request = Request {
            keys: smallvec::smallvec![key.to_owned()],
            charges: SmallVec::new(),
            kind: super::super::Kind::Decide { spend: true },
        };
        let deadline = Instant::now() + std::time::Duration::from_secs(60);
        (
            Queued {
                request: Box::new(request),
                reply,
                deadline,
            },
            answer,
        )
    }

    #[test]
    fn taking_from_the_queue_skips_callers_that_gave_up_and_respects_the_maximum() {
        let mut waiting = Waiting::default();
        let mut answers = Vec::new();
        for i in 0..6 {
            let (q, answer) = queued(&format!("k{i}"));
            waiting.queue.push(q);
            answers.push(Some(answer));
        }
        // The callers of k1 and k3 timed out: their receivers are gone.
        answers[1] = None;
        answers[3] = None;
        let keys = |batch: &[Queued]| -> Vec<String> {
            batch.iter().map(|q| q.request.keys[0].clone()).collect()
        };

        let (mine, _answer) = queued("mine");
        let mut batch = vec![mine];
        waiting.take_into(&mut batch, 3, Instant::now());
        assert_eq!(keys(&batch), ["mine", "k0", "k2"]);
        assert_eq!(
            waiting.queue.len(),
            2,
            "k4 and k5 stay queued; k1 and k3 are gone"
        );

        let mut batch = Vec::new();
        waiting.take_into(&mut batch, 64, Instant::now());
        assert_eq!(keys(&batch), ["k4", "k5"], "k3 was dropped, not sent");
        assert!(waiting.queue.is_empty());
    }

    /// A request of `n` buckets named `name`.
    fn sized(name: &str, n: usize) -> (Queued, oneshot::Receiver<Result<Reply, StoreError>>) {
        let (mut q, answer) = queued(name);
        q.request.keys = (0..n).map(|i| format!("{name}-{i}")).collect();
        (q, answer)
    }

    #[test]
    fn calls_stay_under_the_key_cap_and_small_requests_go_first() {
        let mut waiting = Waiting::default();
        let mut answers = Vec::new();
        for (name, n) in [
            ("b1", 300),
            ("b2", 1000),
            ("s1", 1),
            ("b3", 150),
            ("s2", 4),
            ("b4", 100),
            ("s3", 1),
        ] {
            let (q, answer) = sized(name, n);
            waiting.queue.push(q);
            answers.push(answer);
        }
        let names = |batch: &[Queued]| -> Vec<String> {
            batch
                .iter()
                .map(|q| q.request.keys[0].split('-').next().unwrap().to_owned())
                .collect()
        };
        let keys = |batch: &[Queued]| -> usize { batch.iter().map(|q| q.request.keys.len()).sum() };

        // A caller's own single decision: every small one joins it, then
        // large ones in arrival order while the call stays within 500
        // buckets; b2 does not fit, and b3 waits behind it.
        let (mine, _answer) = sized("mine", 2);
        let mut batch = vec![mine];
        waiting.take_into(&mut batch, 64, Instant::now());
        assert_eq!(names(&batch), ["mine", "s1", "s2", "s3", "b1"]);
        assert_eq!(keys(&batch), 308);

        // A call that starts empty takes the oldest request whatever its
        // size, and nothing large after it beyond the cap.
        let mut batch = Vec::new();
        waiting.take_into(&mut batch, 64, Instant::now());
        assert_eq!(names(&batch), ["b2"]);

        // Small requests that arrive later still go first.
        let (late, _late_answer) = sized("late", 1);
        waiting.queue.push(late);
        let mut batch = Vec::new();
        waiting.take_into(&mut batch, 64, Instant::now());
        assert_eq!(names(&batch), ["late", "b3", "b4"]);
        assert!(waiting.queue.is_empty());

        // The decision count caps small ones too.
        for i in 0..5 {
            let (q, answer) = sized(&format!("t{i}"), 1);
            waiting.queue.push(q);
            answers.push(answer);
        }
        let mut batch = Vec::new();
        waiting.take_into(&mut batch, 3, Instant::now());
        assert_eq!(names(&batch), ["t0", "t1", "t2"]);
        assert_eq!(waiting.queue.len(), 2);
    }
}
