//! The commands that talk to a running server over gRPC: `check`,
//! `charge`, `acquire`, `release`, `top`, `health`.

use std::time::Duration;

use clap::Args;

use super::parse_duration;
use crate::proto::v1::ShouldAllowRequest;
use crate::proto::v1::rate_limiter_client::RateLimiterClient;

/// Which server: what the commands that talk to one share.
#[derive(Debug, Args)]
pub struct Server {
    /// The server's gRPC address.
    #[arg(
        long,
        env = "TOLLGATE_SERVER",
        default_value = "http://127.0.0.1:50051"
    )]
    pub server: String,
}

impl Server {
    async fn client(&self) -> anyhow::Result<RateLimiterClient<tonic::transport::Channel>> {
        RateLimiterClient::connect(self.server.clone())
            .await
            .map_err(|e| anyhow::anyhow!("cannot reach {}: {e}", self.server))
    }
}

/// Which server, and whose budget: what `check`, `charge` and `acquire`
/// share.
#[derive(Debug, Args)]
pub struct Asking {
    /// The server.
    #[command(flatten)]
    pub server: Server,
    /// Tenant.
    #[arg(long, default_value = "")]
    pub tenant: String,
    /// Key.
    #[arg(long)]
    pub key: String,
    /// Resource.
    #[arg(long, default_value = "")]
    pub resource: String,
}

impl Asking {
    async fn client(&self) -> anyhow::Result<RateLimiterClient<tonic::transport::Channel>> {
        self.server.client().await
    }
}

/// `tollgate check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Which server, and whose budget.
    #[command(flatten)]
    pub asking: Asking,
    /// Cost in tokens.
    #[arg(long, default_value_t = 1)]
    pub cost: u64,
    /// Decide without spending.
    #[arg(long)]
    pub dry_run: bool,
    /// Ask this many times in a row, one line each.
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,
}

/// Runs `check`: prints one line per decision.
pub async fn check(args: CheckArgs) -> anyhow::Result<()> {
    let mut client = args.asking.client().await?;
    let asking = &args.asking;
    for i in 1..=args.repeat.max(1) {
        let response = client
            .should_allow(ShouldAllowRequest {
                key: asking.key.clone(),
                cost: args.cost,
                tenant: asking.tenant.clone(),
                resource: asking.resource.clone(),
                dry_run: args.dry_run,
            })
            .await
            .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
            .into_inner();
        let prefix = if args.repeat > 1 {
            format!("#{i:<3} ")
        } else {
            String::new()
        };
        outln!("{prefix}{}", describe(&response));
    }
    Ok(())
}

/// `tollgate usage`.
#[derive(Debug, Args)]
pub struct UsageArgs {
    /// The server.
    #[command(flatten)]
    pub server: Server,
    /// The tenant (required but with --periods, where it narrows the list).
    #[arg(long, default_value = "")]
    pub tenant: String,
    /// The key, for per-key quotas (without it, only per-tenant quotas).
    #[arg(long, default_value = "")]
    pub key: String,
    /// The resource ('' for quotas of any resource only).
    #[arg(long, default_value = "")]
    pub resource: String,
    /// List recorded periods instead (ListUsage: every counter's periods
    /// with their final counts, for billing).
    #[arg(long)]
    pub periods: bool,
    /// With --periods: closed periods only.
    #[arg(long, requires = "periods")]
    pub closed: bool,
    /// With --periods: periods that started at or after this RFC 3339
    /// instant.
    #[arg(long, requires = "periods", value_parser = crate::algorithm::calendar::parse_rfc3339)]
    pub since: Option<u64>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn instant(t: &Option<prost_types::Timestamp>) -> String {
    t.as_ref().map_or_else(String::new, |t| {
        crate::algorithm::calendar::rfc3339(t.seconds.max(0) as u64 * 1_000_000)
    })
}

/// Runs `usage --periods`: every recorded period, page after page.
async fn usage_periods(args: UsageArgs) -> anyhow::Result<()> {
    let mut client = args.server.client().await?;
    let mut periods = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_usage(crate::proto::v1::ListUsageRequest {
                tenant: args.tenant.clone(),
                since: args.since.map(|s| prost_types::Timestamp {
                    seconds: (s / 1_000_000) as i64,
                    nanos: 0,
                }),
                until: None,
                closed_only: args.closed,
                page_size: 1_000,
                page_token,
            })
            .await
            .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
            .into_inner();
        periods.extend(page.periods);
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    let used = |f: &crate::proto::v1::PeriodFigure| match (f.used, f.closed) {
        (Some(u), _) => u.to_string(),
        (None, false) => "open".into(),
        (None, true) => "lost".into(),
    };
    if args.json {
        let rows: Vec<serde_json::Value> = periods
            .iter()
            .map(|p| {
                let f = p.figure.unwrap_or_default();
                serde_json::json!({
                    "tenant": p.tenant,
                    "scope": p.scope,
                    "resource": p.resource,
                    "key": p.key,
                    "rule": p.rule,
                    "shadow": p.shadow,
                    "limit": p.limit,
                    "period_start": instant(&f.period_start),
                    "period_end": instant(&f.period_end),
                    "used": f.used,
                    "closed": f.closed,
                })
            })
            .collect();
        outln!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let mut lines = vec![[
        "TENANT".to_owned(),
        "KEY".into(),
        "RESOURCE".into(),
        "RULE".into(),
        "FROM".into(),
        "TO".into(),
        "USED".into(),
        "LIMIT".into(),
    ]];
    for p in &periods {
        let f = p.figure.unwrap_or_default();
        lines.push([
            p.tenant.clone(),
            p.key.clone(),
            p.resource.clone(),
            p.rule.clone(),
            instant(&f.period_start),
            instant(&f.period_end),
            used(&f),
            p.limit.to_string(),
        ]);
    }
    out!("{}", super::aligned(&lines));
    Ok(())
}

/// Runs `usage`: each quota's current period, used and remaining.
pub async fn usage(args: UsageArgs) -> anyhow::Result<()> {
    if args.periods {
        return usage_periods(args).await;
    }
    let mut client = args.server.client().await?;
    let response = client
        .get_usage(crate::proto::v1::GetUsageRequest {
            tenant: args.tenant.clone(),
            key: args.key.clone(),
            resource: args.resource.clone(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    let previous = |q: &crate::proto::v1::QuotaUsage| match &q.previous {
        Some(p) => match (p.used, p.closed) {
            (Some(u), _) => u.to_string(),
            (None, false) => "closing".into(),
            (None, true) => "lost".into(),
        },
        None => String::new(),
    };
    if args.json {
        let quotas: Vec<serde_json::Value> = response
            .quotas
            .iter()
            .map(|q| {
                serde_json::json!({
                    "rule": q.rule,
                    "scope": q.scope,
                    "resource": q.resource,
                    "period": q.period,
                    "period_start": instant(&q.period_start),
                    "period_end": instant(&q.period_end),
                    "used": q.used,
                    "limit": q.limit,
                    "remaining": q.remaining,
                    "debt": q.debt,
                    "shadow": q.shadow,
                    "previous": q.previous.as_ref().map(|p| serde_json::json!({
                        "period_start": instant(&p.period_start),
                        "period_end": instant(&p.period_end),
                        "used": p.used,
                        "closed": p.closed,
                    })),
                })
            })
            .collect();
        outln!("{}", serde_json::to_string_pretty(&quotas)?);
        return Ok(());
    }
    if response.quotas.is_empty() {
        outln!("no quota applies to tenant {}", args.tenant);
        return Ok(());
    }
    let mut lines = vec![[
        "QUOTA".to_owned(),
        "PERIOD".into(),
        "FROM".into(),
        "TO".into(),
        "USED".into(),
        "LIMIT".into(),
        "REMAINING".into(),
        "PREVIOUS".into(),
    ]];
    for q in &response.quotas {
        lines.push([
            q.rule.clone(),
            q.period.clone(),
            instant(&q.period_start),
            instant(&q.period_end),
            q.used.to_string(),
            q.limit.to_string(),
            q.remaining.to_string(),
            previous(q),
        ]);
    }
    out!("{}", super::aligned(&lines));
    Ok(())
}

/// `tollgate charge`.
#[derive(Debug, Args)]
pub struct ChargeArgs {
    /// Which server, and whose budget.
    #[command(flatten)]
    pub asking: Asking,
    /// Tokens used, charged in full (into debt where the rule allows it).
    #[arg(long)]
    pub cost: u64,
}

/// Runs `charge`: records usage after the fact and prints what is left.
pub async fn charge(args: ChargeArgs) -> anyhow::Result<()> {
    let mut client = args.asking.client().await?;
    let r = client
        .charge(crate::proto::v1::ChargeRequest {
            key: args.asking.key,
            cost: args.cost,
            tenant: args.asking.tenant,
            resource: args.asking.resource,
        })
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    if r.limit_name.is_empty() {
        outln!("CHARGED   (no rule applies: nothing recorded)");
        return Ok(());
    }
    outln!(
        "CHARGED   remaining {}  debt {}  forgiven {}  rule {}{}",
        r.remaining,
        r.debt,
        r.forgiven,
        r.limit_name,
        if r.degraded == 0 {
            ""
        } else {
            "  (store unavailable: recorded by the rule's policy)"
        }
    );
    Ok(())
}

/// `tollgate acquire`.
#[derive(Debug, Args)]
pub struct AcquireArgs {
    /// Which server, and whose caps.
    #[command(flatten)]
    pub asking: Asking,
    /// Tokens to spend from the rate rules in the same step (0 leaves them
    /// alone).
    #[arg(long, default_value_t = 1)]
    pub cost: u64,
    /// How long the lease is held unless released (e.g. 30s, 5m; at most
    /// 1h).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub ttl: Duration,
}

/// Runs `acquire`: prints whether a slot was granted, the lease token and
/// how full the cap is. Exits with an error when refused, so that scripts
/// can branch on it.
pub async fn acquire(args: AcquireArgs) -> anyhow::Result<()> {
    use crate::proto::v1::AcquireRequest;

    let mut client = args.asking.client().await?;
    let r = client
        .acquire(AcquireRequest {
            key: args.asking.key,
            tenant: args.asking.tenant,
            resource: args.asking.resource,
            ttl: Some(prost_types::Duration {
                seconds: args.ttl.as_secs() as i64,
                nanos: args.ttl.subsec_nanos() as i32,
            }),
            cost: args.cost,
        })
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    let decision = r.decision.as_ref().map(describe).unwrap_or_default();
    if !r.granted {
        outln!(
            "REFUSED   in flight {}/{}  {decision}",
            r.in_flight,
            r.limit
        );
        anyhow::bail!("no slot was free; `tollgate release --lease TOKEN` frees one");
    }
    if r.lease.is_empty() {
        outln!(
            "GRANTED   (no slot held: no concurrency rule applies, or the store was unavailable)  {decision}"
        );
    } else {
        outln!(
            "GRANTED   lease {}  in flight {}/{}  {decision}",
            r.lease,
            r.in_flight,
            r.limit
        );
    }
    Ok(())
}

/// `tollgate release`.
#[derive(Debug, Args)]
pub struct ReleaseArgs {
    /// The server.
    #[command(flatten)]
    pub server: Server,
    /// The lease token `acquire` printed.
    #[arg(long)]
    pub lease: String,
}

/// Runs `release`: prints what the release found.
pub async fn release(args: ReleaseArgs) -> anyhow::Result<()> {
    use crate::proto::v1::{LeaseStatus, ReleaseRequest};

    let mut client = args.server.client().await?;
    let r = client
        .release(ReleaseRequest { lease: args.lease })
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    outln!(
        "{}",
        match r.status() {
            LeaseStatus::Done => "RELEASED",
            LeaseStatus::AlreadyReleased => "ALREADY RELEASED (nothing changed)",
            LeaseStatus::Expired => "EXPIRED (its slot was free already)",
            LeaseStatus::Unknown | LeaseStatus::Unspecified =>
                "UNKNOWN (not held: never granted, or expired long ago)",
        }
    );
    Ok(())
}

fn describe(r: &crate::proto::v1::ShouldAllowResponse) -> String {
    let secs = |d: &Option<prost_types::Duration>| {
        d.as_ref()
            .map_or(0.0, |d| d.seconds as f64 + f64::from(d.nanos) / 1e9)
    };
    if r.limit_name.is_empty() {
        return format!(
            "{}  (no rule applies: unlimited)",
            if r.allowed { "ALLOWED" } else { "REJECTED" }
        );
    }
    let mut headers: Vec<_> = r.headers.iter().collect();
    headers.sort();
    let headers: Vec<String> = headers
        .into_iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    format!(
        "{:<8}  remaining {}/{}  retry_after {:.3}s  reset_after {:.3}s  rule {} ({}){}  [{}]",
        if r.allowed { "ALLOWED" } else { "REJECTED" },
        r.remaining,
        r.limit,
        secs(&r.retry_after),
        secs(&r.reset_after),
        r.limit_name,
        r.rate,
        if r.shadow {
            "  shadow: would reject"
        } else {
            ""
        },
        headers.join(", "),
    )
}

/// `tollgate top`.
#[derive(Debug, Args)]
pub struct TopArgs {
    /// The server's gRPC address.
    #[arg(
        long,
        env = "TOLLGATE_SERVER",
        default_value = "http://127.0.0.1:50051"
    )]
    pub server: String,
    /// Tenants to show.
    #[arg(long, default_value_t = 10)]
    pub tenants: u32,
    /// Keys to show per tenant.
    #[arg(long, default_value_t = 3)]
    pub keys: u32,
    /// Time between refreshes.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub interval: Duration,
    /// Stop after this many refreshes (default: until Ctrl-C).
    #[arg(long)]
    pub count: Option<u32>,
}

/// Runs `top`: a table of the most limited tenants, redrawn in place on a
/// terminal (appended otherwise).
pub async fn top(args: TopArgs) -> anyhow::Result<()> {
    use crate::proto::v1::TopLimitedRequest;
    use crate::proto::v1::admin_client::AdminClient;
    use std::io::IsTerminal;

    let mut client = AdminClient::connect(args.server.clone())
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach {}: {e}", args.server))?;
    let terminal = std::io::stdout().is_terminal();
    let mut shown = 0;
    loop {
        let response = client
            .top_limited(TopLimitedRequest {
                tenants: args.tenants,
                keys: args.keys,
            })
            .await
            .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
            .into_inner();
        let window = response.window.map_or(0, |w| w.seconds);
        let mut out = String::new();
        if terminal {
            out.push_str("\x1b[H\x1b[2J");
        }
        out.push_str(&format!(
            "Most limited tenants on {} (rejections over the last {}-{} s)\n",
            args.server,
            window,
            2 * window
        ));
        let mut rows = vec![[
            "RANK".to_owned(),
            "TENANT".into(),
            "REJECTIONS".into(),
            "TOP KEYS".into(),
        ]];
        for (i, t) in response.tenants.iter().enumerate() {
            let tenant = if t.tenant.is_empty() {
                "(default)".to_owned()
            } else {
                t.tenant.clone()
            };
            let rejections = if t.error > 0 {
                format!("{} (±{})", t.rejections, t.error)
            } else {
                t.rejections.to_string()
            };
            let keys: Vec<String> = t
                .keys
                .iter()
                .map(|k| format!("{} ({})", k.key, k.rejections))
                .collect();
            rows.push([(i + 1).to_string(), tenant, rejections, keys.join(", ")]);
        }
        if response.tenants.is_empty() {
            out.push_str("no rejections in the window\n");
        } else {
            out.push_str(&super::aligned(&rows));
        }
        if !response.in_debt.is_empty() {
            out.push_str("Tenants in debt (usage charged after the work)\n");
            let mut rows = vec![[
                "TENANT".to_owned(),
                "KEY".into(),
                "DEBT".into(),
                "SEEN".into(),
            ]];
            for d in &response.in_debt {
                rows.push([
                    if d.tenant.is_empty() {
                        "(default)".to_owned()
                    } else {
                        d.tenant.clone()
                    },
                    if d.key.is_empty() {
                        "(tenant-wide)".to_owned()
                    } else {
                        d.key.clone()
                    },
                    d.debt.to_string(),
                    format!("{} s ago", d.seen_ago.map_or(0, |s| s.seconds)),
                ]);
            }
            out.push_str(&super::aligned(&rows));
        }
        if !response.holding.is_empty() {
            out.push_str("Holding the most concurrency slots\n");
            let mut rows = vec![[
                "TENANT".to_owned(),
                "KEY".into(),
                "HELD".into(),
                "ALL EXPIRE WITHIN".into(),
            ]];
            for h in &response.holding {
                rows.push([
                    if h.tenant.is_empty() {
                        "(default)".to_owned()
                    } else {
                        h.tenant.clone()
                    },
                    if h.key.is_empty() {
                        "(tenant-wide)".to_owned()
                    } else {
                        h.key.clone()
                    },
                    h.held.to_string(),
                    format!("{} s", h.expires_in.map_or(0, |s| s.seconds)),
                ]);
            }
            out.push_str(&super::aligned(&rows));
        }
        out!("{out}");
        shown += 1;
        if args.count.is_some_and(|n| shown >= n) {
            return Ok(());
        }
        tokio::time::sleep(args.interval).await;
    }
}

/// Runs `health`: prints the serving status; an error unless SERVING.
pub async fn health(server: String, service: String) -> anyhow::Result<()> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let channel = tonic::transport::Endpoint::from_shared(server.clone())?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach {server}: {e}"))?;
    let status = HealthClient::new(channel)
        .check(HealthCheckRequest { service })
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
        .into_inner()
        .status();
    outln!("{}", status.as_str_name());
    if status == ServingStatus::Serving {
        Ok(())
    } else {
        anyhow::bail!("not serving")
    }
}
