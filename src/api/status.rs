//! The one place errors become gRPC statuses, for every API.
//!
//! Caller mistakes carry a message that says what to fix. Store failures
//! are logged here with their details and reach the caller only as
//! UNAVAILABLE with a generic message.

use tonic::Status;

use crate::engine::DecideError;
use crate::engine::StoreError;

/// Converts a decision error into the status the caller sees.
pub fn from_decide_error(err: DecideError) -> Status {
    match err {
        DecideError::InvalidField(_)
        | DecideError::InvalidBatch(_)
        | DecideError::InvalidToken(_)
        | DecideError::TooManyBuckets { .. }
        | DecideError::CostExceedsCapacity { .. } => Status::invalid_argument(err.to_string()),
        DecideError::NoRule { .. }
        | DecideError::ExpiredReservation { .. }
        | DecideError::LeaseGone { .. } => Status::failed_precondition(err.to_string()),
        DecideError::UnknownReservation(_) | DecideError::UnknownLease(_) => {
            Status::not_found(err.to_string())
        }
        DecideError::Store(StoreError::Unsupported(why)) => Status::invalid_argument(why),
        DecideError::Store(StoreError::TooManyRecords(why)) => Status::resource_exhausted(why),
        DecideError::Store(store) => {
            tracing::warn!(error = %store, transient = store.is_transient(), "store call failed");
            Status::unavailable("the rate-limit store is unavailable; retry shortly")
        }
    }
}
