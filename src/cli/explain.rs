//! `tollgate explain`: why a request gets the answer it gets, from a
//! running server's `Admin/Explain`.

use clap::Args;

use crate::proto::v1::admin_client::AdminClient;
use crate::proto::v1::explain_descriptor::Entry;
use crate::proto::v1::{
    BucketState, ExplainDescriptor, ExplainRequest, ExplainResponse, RecentDecisions,
};

/// What to explain, and where.
#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// The server's gRPC address.
    #[arg(
        long,
        env = "TOLLGATE_SERVER",
        default_value = "http://127.0.0.1:50051"
    )]
    pub server: String,
    /// The admin token (the server's --admin-token).
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: String,
    /// The tenant.
    #[arg(long, default_value = "")]
    pub tenant: String,
    /// The key (required unless --domain).
    #[arg(long, default_value = "")]
    pub key: String,
    /// The resource.
    #[arg(long, default_value = "")]
    pub resource: String,
    /// The cost of the dry run.
    #[arg(long, default_value_t = 1)]
    pub cost: u64,
    /// Explain an Envoy request of this domain instead.
    #[arg(long, default_value = "")]
    pub domain: String,
    /// With --domain: one descriptor, `key=value[,key=value...]` ('\'
    /// makes the next character literal); repeat for more.
    #[arg(long = "descriptor", requires = "domain")]
    pub descriptors: Vec<String>,
    /// With --domain: hits each descriptor asks for.
    #[arg(long, default_value_t = 1, requires = "domain")]
    pub hits: u32,
}

/// Runs `explain`.
pub async fn explain(args: ExplainArgs) -> anyhow::Result<()> {
    let mut descriptors = Vec::new();
    for text in &args.descriptors {
        let d = crate::api::explain::parse_descriptor(text).map_err(|e| anyhow::anyhow!(e))?;
        descriptors.push(ExplainDescriptor {
            entries: d
                .entries
                .into_iter()
                .map(|e| Entry {
                    key: e.key,
                    value: e.value,
                })
                .collect(),
            requests_per_unit: 0,
            unit: 0,
            hits_addend: Some(args.hits),
        });
    }
    if !args.domain.is_empty() && descriptors.is_empty() {
        anyhow::bail!("--domain needs at least one --descriptor key=value[,key=value...]");
    }
    let mut client = AdminClient::connect(args.server.clone())
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach {}: {e}", args.server))?;
    let mut request = tonic::Request::new(ExplainRequest {
        tenant: args.tenant.clone(),
        key: args.key.clone(),
        resource: args.resource.clone(),
        cost: args.cost,
        domain: args.domain.clone(),
        descriptors,
    });
    let bearer = format!("Bearer {}", args.admin_token)
        .parse()
        .map_err(|_| anyhow::anyhow!("--admin-token holds characters a header cannot carry"))?;
    request.metadata_mut().insert("authorization", bearer);
    let e = client
        .explain(request)
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    out!("{}", render(&args, &e));
    Ok(())
}

fn secs(d: &Option<prost_types::Duration>) -> String {
    match d {
        Some(d) => format!("{:.1} s", d.seconds as f64 + f64::from(d.nanos) / 1e9),
        None => "never".into(),
    }
}

fn bucket(s: &BucketState, cost: &str, allowed: bool) -> String {
    let mut now = match (s.held, s.used) {
        (Some(held), _) => format!(
            "{held} held, {} free, all free in {}",
            s.remaining,
            secs(&s.full_in)
        ),
        (_, Some(used)) => format!(
            "{used} used, {} left, period ends {}",
            s.remaining, s.period_end
        ),
        _ => format!("{} tokens, full in {}", s.remaining, secs(&s.full_in)),
    };
    if s.debt > 0 {
        now.push_str(&format!(", {} in debt", s.debt));
    }
    if s.next_free_in.is_some() {
        now.push_str(&format!(", a slot frees in {}", secs(&s.next_free_in)));
    }
    if s.degraded {
        now.push_str(" (store unavailable: the rule's policy answered)");
    }
    let dry = if s.would_admit && allowed {
        format!("{cost}: admitted, {} left", s.remaining_after)
    } else if s.would_admit {
        format!("{cost}: admitted here, but refused by another rule: nothing spent")
    } else {
        format!("{cost}: refused, retry in {}", secs(&s.retry_after))
    };
    format!("      {}: {now}\n      {dry}\n", s.bucket)
}

fn recent(r: &RecentDecisions) -> String {
    let mut out = format!(
        "recent decisions (newest first; {} admissions sampled out):\n",
        r.admissions_not_shown
    );
    if r.decisions.is_empty() {
        out.push_str("  none recorded\n");
    }
    for d in &r.decisions {
        out.push_str(&format!(
            "  {:>8} ago  {:<15}  cost {:<6}  {}\n",
            secs(&d.ago),
            d.outcome,
            d.cost,
            d.rule
        ));
    }
    out
}

fn render(args: &ExplainArgs, e: &ExplainResponse) -> String {
    let mut out = String::new();
    let dry = e.dry_run.clone().unwrap_or_default();
    let verdict = if dry.allowed {
        format!("ALLOWED, {} left", dry.remaining)
    } else {
        format!(
            "REFUSED by {}, retry in {}",
            dry.rule,
            secs(&dry.retry_after)
        )
    };
    if args.domain.is_empty() {
        out.push_str(&format!(
            "tenant {:?}, key {:?}, resource {:?}{}, at {}\n",
            args.tenant,
            args.key,
            args.resource,
            if e.plan.is_empty() {
                String::new()
            } else {
                format!(", plan {:?}", e.plan)
            },
            e.at
        ));
        out.push_str(&format!("a request of cost {}: {verdict}\n", args.cost));
        if e.rules.is_empty() {
            out.push_str("no rule applies: the request is not limited (see --unmatched)\n");
        } else {
            out.push_str("rules, in the order a decision meets them:\n");
        }
        for r in &e.rules {
            let limit = r.limit.clone().unwrap_or_default();
            out.push_str(&format!(
                "  {} ({} row): {} per {}, {}{}, burst {}{}{}\n",
                r.name,
                r.owner,
                r.kind,
                r.scope,
                if r.resource.is_empty() {
                    "any resource".to_string()
                } else {
                    format!("resource {}", r.resource)
                },
                if r.mode == "shadow" { ", shadow" } else { "" },
                limit.burst,
                if limit.rate.is_empty() {
                    String::new()
                } else {
                    format!(", {}", limit.rate)
                },
                if limit.debt > 0 {
                    format!(", debt {}", limit.debt)
                } else {
                    String::new()
                },
            ));
            for o in &r.won_over {
                out.push_str(&format!("    won over {} ({} row)\n", o.name, o.owner));
            }
            if let Some(s) = &r.state {
                let cost = if r.kind == "concurrency" {
                    "one more lease".to_string()
                } else {
                    format!("cost {}", args.cost)
                };
                // A lease is not part of the dry run: whether one more fits.
                let alone = r.kind == "concurrency";
                out.push_str(&bucket(s, &cost, dry.allowed || alone));
            }
        }
        if let Some(r) = &e.recent {
            out.push_str(&recent(r));
        }
    } else {
        out.push_str(&format!(
            "domain {:?}{}, at {}\n",
            args.domain,
            if e.domain_known {
                ""
            } else {
                " (not configured)"
            },
            e.at
        ));
        out.push_str(&format!("the request: {verdict}\n"));
        for (i, d) in e.descriptors.iter().enumerate() {
            out.push_str(&format!(
                "descriptor {} ({}), {} hits:\n",
                i + 1,
                d.entries.join(", "),
                d.hits
            ));
            match &d.rule {
                Some(r) => out.push_str(&format!(
                    "  rule {} {}{}: {} ({}){}\n",
                    if r.key.is_empty() {
                        "(override)"
                    } else {
                        &r.key
                    },
                    if r.name.is_empty() {
                        String::new()
                    } else {
                        format!("named {:?} ", r.name)
                    },
                    if r.shadow { "in shadow mode" } else { "" },
                    r.limit,
                    r.algorithm,
                    if r.counter.is_empty() {
                        String::new()
                    } else {
                        format!(", counter {}", r.counter)
                    },
                )),
                None => out.push_str("  no rule applies\n"),
            }
            if !d.why.is_empty() {
                out.push_str(&format!("  {}\n", d.why));
            }
            if let Some(s) = &d.state {
                out.push_str(&bucket(s, &format!("{} hits", d.hits), dry.allowed));
            }
            if let Some(r) = &d.recent {
                out.push_str(&recent(r));
            }
        }
    }
    out
}
