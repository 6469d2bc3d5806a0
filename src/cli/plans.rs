//! `tollgate plans …`: named sets of rules, and which plan each tenant is
//! on.

use clap::Subcommand;

use super::{LimitsLocation, WaitFor};
use crate::limits::check_label;

/// `tollgate plans …`.
#[derive(Debug, Subcommand)]
pub enum PlansCommand {
    /// Print the plans, with their rules and tenants counted.
    List {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Create a plan (its rules are rows: `tollgate limits set --plan NAME`).
    Create {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// The server to wait for.
        #[command(flatten)]
        wait: WaitFor,
        /// The plan's name.
        name: String,
        /// What the plan is for.
        #[arg(long, default_value = "")]
        description: String,
    },
    /// Delete a plan and its rules (refused while tenants are on it).
    Delete {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// The server to wait for.
        #[command(flatten)]
        wait: WaitFor,
        /// The plan's name.
        name: String,
        /// Delete even with tenants on it (they get the default rows).
        #[arg(long)]
        force: bool,
    },
    /// Put a tenant on a plan (one row; takes effect within a second).
    Assign {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// The server to wait for.
        #[command(flatten)]
        wait: WaitFor,
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The plan.
        #[arg(long)]
        plan: String,
    },
    /// Take a tenant off its plan (it gets the default rows).
    Unassign {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// The server to wait for.
        #[command(flatten)]
        wait: WaitFor,
        /// The tenant.
        #[arg(long)]
        tenant: String,
    },
}

fn nonempty_label(what: &str, value: &str) -> anyhow::Result<()> {
    if value.is_empty() {
        anyhow::bail!("the {what} is empty");
    }
    check_label(what, value).map_err(anyhow::Error::msg)
}

/// Runs a `plans` subcommand, printing to stdout.
pub async fn plans(command: PlansCommand) -> anyhow::Result<()> {
    match command {
        PlansCommand::List { location, json } => {
            let table = location.open().await?;
            let plans = table.plans().await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&plans)?);
            } else {
                let mut lines = vec![[
                    "PLAN".to_owned(),
                    "RULES".into(),
                    "TENANTS".into(),
                    "DESCRIPTION".into(),
                ]];
                for p in plans {
                    lines.push([
                        p.name,
                        p.rules.to_string(),
                        p.tenants.to_string(),
                        p.description,
                    ]);
                }
                out!("{}", super::aligned(&lines));
            }
        }
        PlansCommand::Create {
            location,
            wait,
            name,
            description,
        } => {
            nonempty_label("plan", &name)?;
            let table = location.open().await?;
            table.create_plan(&name, &description).await?;
            outln!(
                "plan {name} exists; add its rules with `tollgate limits set --plan {name} ...`"
            );
            wait.applied(&table).await?;
        }
        PlansCommand::Delete {
            location,
            wait,
            name,
            force,
        } => {
            nonempty_label("plan", &name)?;
            let table = location.open().await?;
            if !table.delete_plan(&name, force).await? {
                anyhow::bail!("no plan is named {name:?}; `tollgate plans list` shows the plans");
            }
            outln!("deleted plan {name} and its rules");
            wait.applied(&table).await?;
        }
        PlansCommand::Assign {
            location,
            wait,
            tenant,
            plan,
        } => {
            nonempty_label("tenant", &tenant)?;
            nonempty_label("plan", &plan)?;
            let table = location.open().await?;
            match table.assign(&tenant, Some(&plan)).await? {
                Some(before) if before != plan => {
                    outln!("tenant {tenant}: plan {before} -> {plan}")
                }
                Some(_) => outln!("tenant {tenant} is on plan {plan}"),
                None => outln!("tenant {tenant}: no plan -> {plan}"),
            }
            wait.applied(&table).await?;
        }
        PlansCommand::Unassign {
            location,
            wait,
            tenant,
        } => {
            nonempty_label("tenant", &tenant)?;
            let table = location.open().await?;
            match table.assign(&tenant, None).await? {
                Some(before) => outln!("tenant {tenant}: plan {before} -> no plan (default rows)"),
                None => outln!("tenant {tenant} was on no plan"),
            }
            wait.applied(&table).await?;
        }
    }
    Ok(())
}
