//! `tollgate limits …`: read and edit the limits table directly.

use clap::{Args, Subcommand};

use std::io::Write;

use super::{LimitsLocation, WaitFor};
use crate::limits::file::{Format, read_rows, write_header, write_row};
use crate::limits::table::RowFilter;
use crate::limits::{LimitRow, Mode, OnStoreUnavailable, Scope, StoredRow, policy_str};

/// `tollgate limits …`.
#[derive(Debug, Subcommand)]
pub enum LimitsCommand {
    /// Print rows in name order, a page at a time (`--after` the last name
    /// printed for the next page).
    List {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// Only this tenant's rows.
        #[arg(long, default_value = "")]
        tenant: String,
        /// Only this plan's rows.
        #[arg(long, default_value = "")]
        plan: String,
        /// Only rows whose name starts with this.
        #[arg(long, default_value = "")]
        prefix: String,
        /// Only rows named after this (the previous page's last name).
        #[arg(long, default_value = "")]
        after: String,
        /// At most this many rows.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Add a row, or change the row with the same owner (tenant or plan),
    /// resource, scope, mode and kind.
    Set(SetArgs),
    /// Delete a row by name.
    Delete {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// The server to wait for.
        #[command(flatten)]
        wait: WaitFor,
        /// The row's name.
        #[arg(long)]
        name: String,
    },
    /// Upsert every row of a file (CSV with a header line, or JSON lines)
    /// in one transaction: all rows or, if any line is bad, none.
    Import {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// The server to wait for.
        #[command(flatten)]
        wait: WaitFor,
        /// The file ('-' for standard input).
        file: String,
        /// The file's format (default: csv for a .csv file, else jsonl).
        #[arg(long, value_enum)]
        format: Option<Format>,
    },
    /// Write every row, in id order, as `import` reads them.
    Export {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// The file to write (default: standard output).
        #[arg(long)]
        output: Option<String>,
        /// The format (default: csv for a .csv output, else jsonl).
        #[arg(long, value_enum)]
        format: Option<Format>,
    },
}

/// `tollgate limits set`.
#[derive(Debug, Args)]
pub struct SetArgs {
    /// The limits table.
    #[command(flatten)]
    pub location: LimitsLocation,
    /// The server to wait for.
    #[command(flatten)]
    pub wait: WaitFor,
    /// Tenant ('' or omitted: the default rows, or the plan's).
    #[arg(long, default_value = "", conflicts_with = "plan")]
    pub tenant: String,
    /// The plan the row belongs to (instead of a tenant); the plan must
    /// exist (`tollgate plans create`).
    #[arg(long, default_value = "")]
    pub plan: String,
    /// Resource ('' or omitted: any resource).
    #[arg(long, default_value = "")]
    pub resource: String,
    /// `key` (one bucket per key) or `tenant` (one ceiling for all keys).
    #[arg(long, default_value = Scope::default().as_str())]
    pub scope: String,
    /// Capacity: the largest burst.
    #[arg(long, required_unless_present_any = ["concurrency", "quota"])]
    pub burst: Option<i64>,
    /// Sustained rate as N/unit, e.g. 600/minute.
    #[arg(long, required_unless_present_any = ["concurrency", "quota"])]
    pub rate: Option<String>,
    /// A concurrency rule instead of a rate rule: at most this many leases
    /// held at once (Acquire / Release).
    #[arg(long, conflicts_with_all = ["burst", "rate", "debt", "quota"])]
    pub concurrency: Option<i64>,
    /// A quota instead of a rate rule: N per day, week, month or year of
    /// the tenant's billing cycle, e.g. 1000000/month.
    #[arg(long, conflicts_with_all = ["burst", "rate"])]
    pub quota: Option<String>,
    /// `enforce` or `shadow`.
    #[arg(long, default_value = Mode::default().as_str())]
    pub mode: String,
    /// When the shared store is down: `allow`, `deny` or `local`.
    #[arg(long, default_value = policy_str(OnStoreUnavailable::default()))]
    pub on_store_unavailable: String,
    /// Tokens below zero that usage charged after the work (Charge,
    /// Settle) may take a bucket; 0 for none.
    #[arg(long, default_value_t = 0)]
    pub debt: i64,
    /// A quota's alert thresholds, in percent of its count, e.g. 50,80,100
    /// (1 to 999 %, at most 6): the decision that reaches one records an
    /// alert, delivered by webhook once per tenant per period.
    #[arg(long, value_parser = parse_alerts)]
    pub alert: Option<crate::algorithm::alerts::Alerts>,
    /// The row's name (default: TENANT-RESOURCE-SCOPE, plus -concurrency,
    /// -quota and -shadow).
    #[arg(long)]
    pub name: Option<String>,
}

/// Runs a `limits` subcommand, printing to stdout.
pub async fn limits(command: LimitsCommand) -> anyhow::Result<()> {
    match command {
        LimitsCommand::List {
            location,
            tenant,
            plan,
            prefix,
            after,
            limit,
            json,
        } => {
            let table = location.open().await?;
            let filter = RowFilter {
                tenant,
                plan,
                prefix,
                after,
                limit,
            };
            let rows = table.rows_page(&filter).await?;
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
            if let Some(last) = rows.last().filter(|_| rows.len() == limit) {
                eprintln!("(more rows: --after {:?})", last.name);
            }
        }
        LimitsCommand::Import {
            location,
            wait,
            file,
            format,
        } => {
            let format = format.unwrap_or(Format::of_path(&file));
            let rows = if file == "-" {
                read_rows(std::io::stdin().lock(), format)
            } else {
                let f = std::fs::File::open(&file)
                    .map_err(|e| anyhow::anyhow!("cannot open {file}: {e}"))?;
                read_rows(std::io::BufReader::new(f), format)
            }
            .map_err(|e| anyhow::anyhow!("{file}: {e}; nothing was imported"))?;
            let table = location.open().await?;
            let total = rows.len();
            let mut shown = 0;
            table
                .import(&rows, |done| {
                    if done == total || done >= shown + 10_000 {
                        shown = done;
                        eprint!("\rstaged {done}/{total} rows");
                    }
                })
                .await
                .map_err(|e| {
                    eprintln!();
                    anyhow::anyhow!("{file}: {e}")
                })?;
            eprintln!();
            outln!("imported {total} rows from {file} in one transaction");
            wait.applied(&table).await?;
        }
        LimitsCommand::Export {
            location,
            output,
            format,
        } => {
            let format = format.unwrap_or(Format::of_path(output.as_deref().unwrap_or("")));
            let table = location.open().await?;
            let mut out: Box<dyn std::io::Write> = match &output {
                Some(path) => Box::new(std::io::BufWriter::new(
                    std::fs::File::create(path)
                        .map_err(|e| anyhow::anyhow!("cannot create {path}: {e}"))?,
                )),
                None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
            };
            write_header(&mut out, format)?;
            let mut n = 0u64;
            table
                .export(|row| {
                    n += 1;
                    write_row(&mut out, format, &row)
                })
                .await?;
            out.flush()?;
            if let Some(path) = &output {
                eprintln!("exported {n} rows to {path}");
            }
        }
        LimitsCommand::Set(args) => {
            let (kind, burst, rate) = match (args.concurrency, args.quota) {
                (Some(cap), _) => ("concurrency", cap, String::new()),
                (None, Some(quota)) => ("quota", 0, quota),
                (None, None) => (
                    "rate",
                    args.burst.unwrap_or_default(),
                    args.rate.unwrap_or_default(),
                ),
            };
            let named = args.name.is_some();
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
            .map_err(anyhow::Error::msg)?
            .with_alerts(args.alert.unwrap_or_default())
            .for_plan(args.plan, named);
            let rule = row.validate()?;
            let table = args.location.open().await?;
            table.upsert(&row).await?;
            outln!("set {rule}");
            args.wait.applied(&table).await?;
        }
        LimitsCommand::Delete {
            location,
            wait,
            name,
        } => {
            let table = location.open().await?;
            if !table.delete(&name).await? {
                anyhow::bail!("no row is named {name:?}; `tollgate limits list` shows the names");
            }
            outln!("deleted {name}");
            wait.applied(&table).await?;
        }
    }
    Ok(())
}

/// Renders rows as an aligned table.
pub fn render_rows(rows: &[StoredRow]) -> String {
    let mut lines = vec![[
        "NAME".to_owned(),
        "TENANT".into(),
        "PLAN".into(),
        "RESOURCE".into(),
        "SCOPE".into(),
        "BURST".into(),
        "RATE".into(),
        "MODE".into(),
        "STORE_DOWN".into(),
        "DEBT".into(),
        "ALERTS".into(),
        "UPDATED_AT".into(),
    ]];
    let or = |s: &str, d: &str| {
        if s.is_empty() { d.to_owned() } else { shown(s) }
    };
    for r in rows {
        lines.push([
            shown(&r.name),
            or(&r.tenant, if r.plan.is_empty() { "(default)" } else { "" }),
            shown(&r.plan),
            or(&r.resource, "(any)"),
            shown(&r.scope),
            r.burst.to_string(),
            if r.kind == "concurrency" {
                "concurrency".to_owned()
            } else {
                format!("{}/{}", r.rate, r.rate_unit)
            },
            shown(&r.mode),
            shown(&r.on_store_unavailable),
            r.debt.to_string(),
            if r.alerts.is_empty() {
                "-".to_owned()
            } else {
                shown(&r.alerts)
            },
            shown(&r.updated_at),
        ]);
    }
    super::aligned(&lines)
}

/// A value from the table as a terminal may show it: as it is when it keeps
/// to the characters of a label, else quoted with its control, format
/// (U+202E ...) and escape characters escaped and a long value shortened:
/// rows written by plain SQL may hold anything.
fn shown(value: &str) -> String {
    let plain = value
        .bytes()
        .all(|b| (b.is_ascii_graphic() && b != b'"' && b != b'\\') || b == b' ');
    if plain && value.len() <= crate::limits::MAX_LABEL_LEN {
        value.to_owned()
    } else {
        format!("{:?}", crate::limits::short(value))
    }
}

fn parse_alerts(s: &str) -> Result<crate::algorithm::alerts::Alerts, String> {
    s.parse()
}
