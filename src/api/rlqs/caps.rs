//! How many quota streams one instance and one peer may hold.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use tonic::Status;

use super::RlqsOptions;
use crate::telemetry::metrics;

/// Open streams, in all and per peer address.
#[derive(Default)]
pub(super) struct Streams {
    open: AtomicUsize,
    per_peer: Mutex<HashMap<IpAddr, usize>>,
}

/// A stream's place under the caps, given back when dropped.
pub(super) struct StreamSlot {
    streams: Arc<Streams>,
    peer: Option<IpAddr>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.streams.open.fetch_sub(1, Ordering::AcqRel);
        metrics::rlqs_streams(self.streams.open.load(Ordering::Acquire));
        if let Some(peer) = self.peer {
            let mut per_peer = self.streams.per_peer.lock();
            if let Some(n) = per_peer.get_mut(&peer) {
                *n -= 1;
                if *n == 0 {
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
            let n = per_peer.entry(peer).or_default();
            if *n >= o.max_streams_per_peer {
                metrics::rlqs_refused("streams_per_peer");
                return Err(Status::resource_exhausted(format!(
                    "{peer} holds {} quota streams, the most one peer may \
                     (--rlqs-max-streams-per-peer); an Envoy needs one per filter \
                     configuration",
                    o.max_streams_per_peer
                )));
            }
            *n += 1;
        }
        let slot = StreamSlot {
            streams: self.clone(),
            peer,
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
