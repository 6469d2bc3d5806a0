//! `tollgate tenants`: a tenant's plan and billing cycle.

use clap::Subcommand;

use super::{LimitsLocation, WaitFor};
use crate::algorithm::calendar::Cycle;
use crate::limits::check_label;

/// `tollgate tenants …`
#[derive(Debug, Subcommand)]
pub enum TenantsCommand {
    /// Set the billing cycle a tenant's quotas count periods of: the time
    /// zone and the day periods turn on (takes effect within a second).
    Cycle {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// The server to wait for.
        #[command(flatten)]
        wait: WaitFor,
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The IANA time zone its periods follow, e.g. America/New_York.
        #[arg(long, default_value = "UTC")]
        time_zone: String,
        /// The day of the month monthly and yearly periods start on (1 to
        /// 31; 31 means the last day of shorter months).
        #[arg(long, default_value_t = 1)]
        day: u8,
        /// The month yearly periods start in (1 to 12).
        #[arg(long, default_value_t = 1)]
        month: u8,
        /// The weekday weekly periods start on.
        #[arg(long, default_value = "monday")]
        weekday: String,
    },
    /// Print a tenant's plan and billing cycle.
    Show {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// The tenant.
        #[arg(long)]
        tenant: String,
    },
}

/// Runs a `tenants` subcommand, printing to stdout.
pub async fn tenants(command: TenantsCommand) -> anyhow::Result<()> {
    match command {
        TenantsCommand::Cycle {
            location,
            wait,
            tenant,
            time_zone,
            day,
            month,
            weekday,
        } => {
            label(&tenant)?;
            let cycle = Cycle::new(&time_zone, day, month, &weekday).map_err(anyhow::Error::msg)?;
            let table = location.open().await?;
            table.set_cycle(&tenant, &cycle).await?;
            outln!("tenant {tenant}: billing cycle {cycle}");
            wait.applied(&table).await?;
        }
        TenantsCommand::Show { location, tenant } => {
            label(&tenant)?;
            let table = location.open().await?;
            let (plan, cycle) = table.tenant(&tenant).await?.unwrap_or_default();
            let plan = if plan.is_empty() {
                "no plan".into()
            } else {
                format!("plan {plan}")
            };
            outln!("tenant {tenant}: {plan}; billing cycle {cycle}");
        }
    }
    Ok(())
}

fn label(tenant: &str) -> anyhow::Result<()> {
    if tenant.is_empty() {
        anyhow::bail!("the tenant is empty");
    }
    check_label("tenant", tenant).map_err(anyhow::Error::msg)
}
