//! `tollgate limits …`: read and edit the limits table directly.

use clap::{Args, Subcommand};

use super::LimitsLocation;
use crate::limits::table::LimitsTable;
use crate::limits::{LimitRow, StoredRow};

/// `tollgate limits …`.
#[derive(Debug, Subcommand)]
pub enum LimitsCommand {
    /// Print every row.
    List {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Add a row, or change the row with the same tenant, resource, scope
    /// and mode.
    Set(SetArgs),
    /// Delete a row by name.
    Delete {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// The row's name.
        #[arg(long)]
        name: String,
    },
}

/// `tollgate limits set`.
#[derive(Debug, Args)]
pub struct SetArgs {
    /// The limits table.
    #[command(flatten)]
    pub location: LimitsLocation,
    /// Tenant ('' or omitted: the default rows).
    #[arg(long, default_value = "")]
    pub tenant: String,
    /// Resource ('' or omitted: any resource).
    #[arg(long, default_value = "")]
    pub resource: String,
    /// `key` (one bucket per key) or `tenant` (one ceiling for all keys).
    #[arg(long, default_value = "key")]
    pub scope: String,
    /// Capacity: the largest burst.
    #[arg(long, required_unless_present = "concurrency")]
    pub burst: Option<i64>,
    /// Sustained rate as N/unit, e.g. 600/minute.
    #[arg(long, required_unless_present = "concurrency")]
    pub rate: Option<String>,
    /// A concurrency rule instead of a rate rule: at most this many leases
    /// held at once (Acquire / Release).
    #[arg(long, conflicts_with_all = ["burst", "rate", "debt"])]
    pub concurrency: Option<i64>,
    /// `enforce` or `shadow`.
    #[arg(long, default_value = "enforce")]
    pub mode: String,
    /// When the shared store is down: `allow`, `deny` or `local`.
    #[arg(long, default_value = "allow")]
    pub on_store_unavailable: String,
    /// Tokens below zero that usage charged after the work (Charge,
    /// Settle) may take a bucket; 0 for none.
    #[arg(long, default_value_t = 0)]
    pub debt: i64,
    /// The row's name (default: TENANT-RESOURCE-SCOPE, plus -shadow).
    #[arg(long)]
    pub name: Option<String>,
}

/// Runs a `limits` subcommand, printing to stdout.
pub async fn limits(command: LimitsCommand) -> anyhow::Result<()> {
    match command {
        LimitsCommand::List { location, json } => {
            let table = LimitsTable::open(&location.limits).await?;
            let rows = table.rows().await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                out!("{}", render_rows(&rows));
            }
            for row in &rows {
                if let Err(err) = row.validate() {
                    eprintln!("warning: {err}");
                }
            }
        }
        LimitsCommand::Set(args) => {
            let (kind, burst, rate) = match args.concurrency {
                Some(cap) => ("concurrency", cap, String::new()),
                None => (
                    "rate",
                    args.burst.unwrap_or_default(),
                    args.rate.unwrap_or_default(),
                ),
            };
            let row = LimitRow::from_request(
                args.tenant,
                args.resource,
                &args.scope,
                burst,
                &rate,
                &args.mode,
                &args.on_store_unavailable,
                args.debt,
                kind,
                args.name,
            )
            .map_err(anyhow::Error::msg)?;
            let rule = row.validate()?;
            let table = LimitsTable::open(&args.location.limits).await?;
            table.upsert(&row).await?;
            outln!("set {rule}");
        }
        LimitsCommand::Delete { location, name } => {
            let table = LimitsTable::open(&location.limits).await?;
            if !table.delete(&name).await? {
                anyhow::bail!("no row is named {name:?}; `tollgate limits list` shows the names");
            }
            outln!("deleted {name}");
        }
    }
    Ok(())
}

/// Renders rows as an aligned table.
pub fn render_rows(rows: &[StoredRow]) -> String {
    let mut lines = vec![[
        "NAME".to_owned(),
        "TENANT".into(),
        "RESOURCE".into(),
        "SCOPE".into(),
        "BURST".into(),
        "RATE".into(),
        "MODE".into(),
        "STORE_DOWN".into(),
        "DEBT".into(),
        "UPDATED_AT".into(),
    ]];
    let or = |s: &str, d: &str| {
        if s.is_empty() {
            d.to_owned()
        } else {
            s.to_owned()
        }
    };
    for r in rows {
        lines.push([
            r.name.clone(),
            or(&r.tenant, "(default)"),
            or(&r.resource, "(any)"),
            r.scope.clone(),
            r.burst.to_string(),
            if r.kind == "concurrency" {
                "concurrency".to_owned()
            } else {
                format!("{}/{}", r.rate, r.rate_unit)
            },
            r.mode.clone(),
            r.on_store_unavailable.clone(),
            r.debt.to_string(),
            r.updated_at.clone(),
        ]);
    }
    super::aligned(&lines)
}
