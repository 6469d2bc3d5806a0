//! The gRPC port's request timeout (`--grpc-request-timeout`), kept without
//! a timer per request.
//!
//! Every request on the port has the same timeout, so deadlines fall due
//! in the order requests start waiting: one queue in that order, swept
//! every twentieth of the timeout by one task, takes the place of a timer
//! per request. A request answered on its first poll (the usual case in
//! memory) never enters the queue; one that waits enters it then, with its
//! deadline a timeout from that moment, and if still waiting when a sweep
//! finds the deadline passed it is answered CANCELLED "Timeout expired":
//! between the timeout and a twentieth of it later. A caller's own
//! `grpc-timeout` stays with tonic, which keeps a timer for each request
//! that sends one.
//!
//! A request done before its deadline leaves its entry behind (64 bytes);
//! sweeps drop such entries from the front, and when done entries pile up
//! behind one that still waits, a sweep compacts the queue. So the queue
//! holds the entries of requests that waited since the last sweep, and
//! after a sweep at most about twice as many as still wait (or 1 024).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use parking_lot::Mutex;
use tokio::time::Instant;

/// How many sweeps a timeout spans: a timed-out request is answered at most
/// `timeout / SWEEPS_PER_TIMEOUT` late.
const SWEEPS_PER_TIMEOUT: u32 = 20;

/// The shortest time between sweeps.
const SHORTEST_SWEEP: Duration = Duration::from_millis(1);

/// A queue shorter than this is never compacted.
const COMPACT_FROM: usize = 1024;

/// The layer: its queue, and the task sweeping it (which ends once the
/// server holding the layer is dropped).
#[derive(Clone)]
pub struct RequestTimeoutLayer {
    queue: Arc<Queue>,
}

impl RequestTimeoutLayer {
    /// Requests that wait are cancelled `timeout` after their first wait.
    /// Starts the sweeping task on the current runtime.
    pub fn new(timeout: Duration) -> Self {
        let queue = Arc::new(Queue::new(timeout));
        tokio::spawn(sweep_while_used(
            Arc::downgrade(&queue),
            (timeout / SWEEPS_PER_TIMEOUT).max(SHORTEST_SWEEP),
        ));
        Self { queue }
    }
}

async fn sweep_while_used(queue: Weak<Queue>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(queue) = queue.upgrade() else {
            return;
        };
        queue.sweep(Instant::now());
    }
}

impl<S> tower::Layer<S> for RequestTimeoutLayer {
    type Service = RequestTimeout<S>;

    fn layer(&self, inner: S) -> RequestTimeout<S> {
        RequestTimeout {
            inner,
            queue: self.queue.clone(),
        }
    }
}

/// The service [`RequestTimeoutLayer`] wraps.
#[derive(Clone)]
pub struct RequestTimeout<S> {
    inner: S,
    queue: Arc<Queue>,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for RequestTimeout<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    ResBody: Default,
{
    type Response = http::Response<ResBody>;
    type Error = S::Error;
    type Future = Timed<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        Timed {
            inner: self.inner.call(request),
            queue: self.queue.clone(),
            entry: None,
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`RequestTimeout`]: the inner call's, or the
    /// CANCELLED answer once its deadline has passed.
    pub struct Timed<F> {
        #[pin]
        inner: F,
        queue: Arc<Queue>,
        // Set at the first wait.
        entry: Option<Arc<Entry>>,
    }
}

impl<F, B, E> Future for Timed<F>
where
    F: Future<Output = Result<http::Response<B>, E>>,
    B: Default,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        if let ready @ Poll::Ready(_) = this.inner.poll(cx) {
            return ready;
        }
        match this.entry {
            Some(entry) => {
                // Registered before the flag is read: a sweep that sets it
                // after the read wakes this waker.
                entry.waker.register(cx.waker());
                if entry.expired.load(Ordering::Acquire) {
                    let status = tonic::Status::cancelled("Timeout expired");
                    return Poll::Ready(Ok(status.into_http()));
                }
            }
            None => *this.entry = Some(this.queue.enter(cx)),
        }
        Poll::Pending
    }
}

/// A waiting request's place in the queue.
struct Entry {
    deadline: Instant,
    expired: AtomicBool,
    waker: AtomicWaker,
}

/// The requests that have waited, in the order they started waiting.
struct Queue {
    timeout: Duration,
    waiting: Mutex<Waiting>,
}

struct Waiting {
    entries: VecDeque<Arc<Entry>>,
    /// The length past which the next sweep compacts.
    compact_at: usize,
}

impl Queue {
    fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            waiting: Mutex::new(Waiting {
                entries: VecDeque::new(),
                compact_at: COMPACT_FROM,
            }),
        }
    }

    /// Enters a request that waits now, to be woken by `cx` when it expires.
    fn enter(&self, cx: &Context<'_>) -> Arc<Entry> {
        let entry = Arc::new(Entry {
            deadline: Instant::now() + self.timeout,
            expired: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        });
        entry.waker.register(cx.waker());
        self.waiting.lock().entries.push_back(entry.clone());
        entry
    }

    /// Wakes the requests whose deadline has passed at `now`, and drops the
    /// entries of requests already done (the queue holds the last reference
    /// to those).
    fn sweep(&self, now: Instant) {
        let mut due = Vec::new();
        {
            let mut waiting = self.waiting.lock();
            while let Some(front) = waiting.entries.front() {
                if Arc::strong_count(front) == 1 {
                    waiting.entries.pop_front();
                } else if front.deadline <= now {
                    due.extend(waiting.entries.pop_front());
                } else {
                    break;
                }
            }
            if waiting.entries.len() > waiting.compact_at {
                waiting.entries.retain(|e| Arc::strong_count(e) > 1);
                waiting.compact_at = (2 * waiting.entries.len()).max(COMPACT_FROM);
            }
        }
        for entry in due {
            entry.expired.store(true, Ordering::Release);
            entry.waker.wake();
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.waiting.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Waker;

    type Reply = Result<http::Response<String>, std::convert::Infallible>;

    fn answer(body: &str) -> Reply {
        Ok(http::Response::new(body.to_owned()))
    }

    fn timed<F: Future<Output = Reply>>(queue: &Arc<Queue>, inner: F) -> Pin<Box<Timed<F>>> {
        Box::pin(Timed {
            inner,
            queue: queue.clone(),
            entry: None,
        })
    }

    fn poll<F: Future<Output = Reply>>(f: &mut Pin<Box<Timed<F>>>) -> Poll<Reply> {
        f.as_mut().poll(&mut Context::from_waker(Waker::noop()))
    }

    fn status(reply: Poll<Reply>) -> tonic::Status {
        let Poll::Ready(Ok(response)) = reply else {
            panic!("not answered");
        };
        tonic::Status::from_header_map(response.headers()).expect("a gRPC status")
    }

    #[test]
    fn a_request_answered_at_once_never_enters_the_queue() {
        let queue = Arc::new(Queue::new(Duration::from_secs(10)));
        let mut f = timed(&queue, std::future::ready(answer("done")));
        let Poll::Ready(Ok(response)) = poll(&mut f) else {
            panic!("not answered");
        };
        assert_eq!(response.body(), "done");
        assert_eq!(queue.len(), 0);
    }

    #[tokio::test]
    async fn a_waiting_request_is_cancelled_once_a_sweep_finds_its_deadline_passed() {
        let queue = Arc::new(Queue::new(Duration::from_secs(10)));
        let mut f = timed(&queue, std::future::pending::<Reply>());
        assert!(poll(&mut f).is_pending());
        assert_eq!(queue.len(), 1);
        let deadline = f.entry.as_ref().unwrap().deadline;
        queue.sweep(deadline - Duration::from_millis(1));
        assert!(poll(&mut f).is_pending(), "not before its deadline");
        assert_eq!(queue.len(), 1);
        queue.sweep(deadline);
        assert_eq!(queue.len(), 0);
        let status = status(poll(&mut f));
        assert_eq!(status.code(), tonic::Code::Cancelled);
        assert_eq!(status.message(), "Timeout expired");
    }

    #[tokio::test]
    async fn the_sweep_wakes_the_waiting_task() {
        let layer = RequestTimeoutLayer::new(Duration::from_millis(40));
        let started = Instant::now();
        let reply = timed(&layer.queue, std::future::pending::<Reply>()).await;
        assert!(started.elapsed() >= Duration::from_millis(40));
        assert_eq!(status(Poll::Ready(reply)).code(), tonic::Code::Cancelled);
    }

    #[tokio::test]
    async fn entries_of_requests_done_leave_the_queue() {
        let queue = Arc::new(Queue::new(Duration::from_secs(10)));
        // One request that goes on waiting, then many that wait once and
        // are done.
        let mut long = timed(&queue, std::future::pending::<Reply>());
        assert!(poll(&mut long).is_pending());
        for _ in 0..3 * COMPACT_FROM {
            let mut short = timed(&queue, std::future::pending::<Reply>());
            assert!(poll(&mut short).is_pending());
        }
        assert_eq!(queue.len(), 1 + 3 * COMPACT_FROM);
        // The waiting one at the front holds the others back until the
        // queue is long enough to compact.
        queue.sweep(Instant::now());
        assert_eq!(queue.len(), 1);
        assert!(poll(&mut long).is_pending());
        drop(long);
        queue.sweep(Instant::now());
        assert_eq!(queue.len(), 0);
        // Done entries at the front go at the next sweep, compacted or not.
        for _ in 0..10 {
            let mut short = timed(&queue, std::future::pending::<Reply>());
            assert!(poll(&mut short).is_pending());
        }
        assert_eq!(queue.len(), 10);
        queue.sweep(Instant::now());
        assert_eq!(queue.len(), 0);
    }
}
