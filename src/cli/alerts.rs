//! `tollgate alerts`: the quota alert outbox, read from the limits
//! database (as every instance's notifier reads it).

use clap::Subcommand;

use super::LimitsLocation;
use crate::algorithm::calendar::rfc3339;
use crate::limits::table::AlertRow;

/// `tollgate alerts …`.
#[derive(Debug, Subcommand)]
pub enum AlertsCommand {
    /// List quota alerts, newest first: delivered, or waiting with their
    /// tries and last error.
    List {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// Only alerts not delivered yet.
        #[arg(long)]
        pending: bool,
        /// Most alerts listed.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Runs an `alerts` subcommand.
pub async fn alerts(command: AlertsCommand) -> anyhow::Result<()> {
    match command {
        AlertsCommand::List {
            location,
            pending,
            limit,
            json,
        } => {
            let table = location.open().await?;
            let rows = table.alerts(pending, limit).await?;
            let counts = table.alert_counts().await?;
            table.close().await;
            if json {
                let rows: Vec<serde_json::Value> = rows.iter().map(alert_json).collect();
                outln!("{}", serde_json::to_string_pretty(&rows)?);
                return Ok(());
            }
            outln!("{} pending, {} delivered", counts.pending, counts.delivered);
            if rows.is_empty() {
                return Ok(());
            }
            let mut lines = vec![[
                "DETECTED".to_owned(),
                "TENANT".into(),
                "KEY".into(),
                "RULE".into(),
                "THRESHOLD".into(),
                "USED".into(),
                "LIMIT".into(),
                "STATUS".into(),
            ]];
            for a in &rows {
                lines.push([
                    rfc3339(a.detected_at),
                    a.tenant.clone(),
                    if a.key.is_empty() {
                        "-".into()
                    } else {
                        a.key.clone()
                    },
                    a.rule.clone(),
                    format!("{}%", a.threshold),
                    a.used.to_string(),
                    a.quota.to_string(),
                    status(a),
                ]);
            }
            out!("{}", super::aligned(&lines));
            Ok(())
        }
    }
}

/// `delivered`, or `pending (N tries: last error)`.
fn status(a: &AlertRow) -> String {
    match (a.delivered_at, a.attempts, a.last_error.as_str()) {
        (Some(_), _, _) => "delivered".into(),
        (None, 0, _) => "pending".into(),
        (None, n, "") => format!("pending ({n} tries)"),
        (None, n, e) => format!("pending ({n} tries: {e})"),
    }
}

/// An alert as JSON, for the CLI and the admin port.
pub fn alert_json(a: &AlertRow) -> serde_json::Value {
    serde_json::json!({
        "id": a.id,
        "tenant": a.tenant,
        "scope": a.scope,
        "resource": a.resource,
        "key": a.key,
        "rule": a.rule,
        "threshold": a.threshold,
        "used": a.used,
        "limit": a.quota,
        "period_start": rfc3339(a.start),
        "period_end": rfc3339(a.end),
        "detected_at": rfc3339(a.detected_at),
        "attempts": a.attempts,
        "delivered_at": a.delivered_at.map(rfc3339),
        "last_error": a.last_error,
    })
}
