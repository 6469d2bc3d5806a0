//! How many quota streams and subscribed buckets one instance and one peer
//! may hold.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use tonic::Status;

use super::RlqsOptions;
use crate::telemetry::metrics;

/// Open streams and subscribed buckets, in all and per peer address.
#[derive(Default)]
pub(super) struct Streams {
    open: AtomicUsize,
    buckets: AtomicUsize,
    per_peer: Mutex<HashMap<IpAddr, Held>>,
}

/// What one peer holds.
#[derive(Default)]
struct Held {
    streams: usize,
    buckets: usize,
}

/// A stream's place under the caps, and its buckets', given back when
/// dropped.
pub(super) struct StreamSlot {
    streams: Arc<Streams>,
    peer: Option<IpAddr>,
    buckets: usize,
}

impl StreamSlot {
    /// Counts one more bucket subscribed on this stream, unless its peer
    /// holds `max_per_peer` already: then says what to fix.
    pub(super) fn take_bucket(&mut self, max_per_peer: usize) -> Result<(), Status> {
        if let Some(peer) = self.peer {
            let mut per_peer = self.streams.per_peer.lock();
            let held = per_peer.entry(peer).or_default();
            if held.buckets >= max_per_peer {
                metrics::rlqs_refused("buckets_per_peer");
                return Err(Status::resource_exhausted(format!(
                    "{peer} subscribes {max_per_peer} quota buckets over its streams, the most \
                     one peer may (--rlqs-max-buckets-per-peer); build bucket ids from fewer \
                     distinct values"
                )));
            }
            held.buckets += 1;
        }
        self.buckets += 1;
        let now = self.streams.buckets.fetch_add(1, Ordering::AcqRel) + 1;
        metrics::rlqs_buckets(now);
        Ok(())
    }

    /// Gives `n` buckets of this stream back.
    pub(super) fn give_buckets(&mut self, n: usize) {
        let n = n.min(self.buckets);
        if n == 0 {
            return;
        }
        self.buckets -= n;
        if let Some(peer) = self.peer
            && let Some(held) = self.streams.per_peer.lock().get_mut(&peer)
        {
            held.buckets -= n;
        }
        let now = self.streams.buckets.fetch_sub(n, Ordering::AcqRel) - n;
        metrics::rlqs_buckets(now);
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.give_buckets(self.buckets);
        self.streams.open.fetch_sub(1, Ordering::AcqRel);
        metrics::rlqs_streams(self.streams.open.load(Ordering::Acquire));
        if let Some(peer) = self.peer {
            let mut per_peer = self.streams.per_peer.lock();
            if let Some(held) = per_peer.get_mut(&peer) {
                held.streams -= 1;
                if held.streams == 0 {
                    per_peer.remove(&peer);
                }
            }
        }
    }
}

impl Streams {
    /// Takes a stream slot for `peer` under `o`'s caps, or says which
    /// cap refused it.
    pub(super) fn admit(
        self: &Arc<Self>,
        peer: Option<IpAddr>,
        o: &RlqsOptions,
    ) -> Result<StreamSlot, Status> {
        if let Some(peer) = peer {
            let mut per_peer = self.per_peer.lock();
            let held = per_peer.entry(peer).or_default();
            if held.streams >= o.max_streams_per_peer {
                metrics::rlqs_refused("streams_per_peer");
                return Err(Status::resource_exhausted(format!(
                    "{peer} holds {} quota streams, the most one peer may \
                     (--rlqs-max-streams-per-peer); an Envoy needs one per filter \
                     configuration",
                    o.max_streams_per_peer
                )));
            }
            held.streams += 1;
        }
        let slot = StreamSlot {
            streams: self.clone(),
            peer,
            buckets: 0,
        };
        let open = self.open.fetch_add(1, Ordering::AcqRel) + 1;
        if open > o.max_streams {
            metrics::rlqs_refused("streams");
            // Dropping the slot gives both counts back.
            drop(slot);
            return Err(Status::resource_exhausted(format!(
                "this instance holds {} quota streams, the most it may (--rlqs-max-streams); \
                 connect to another instance or raise the cap",
                o.max_streams
            )));
        }
        metrics::rlqs_streams(open);
        Ok(slot)
    }
}
