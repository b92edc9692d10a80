//! `syn-cost --netns NS --src IP --flows N --batches B DST...`: the CPU per new TCP flow to
//! port 80 of `DST...` (round robin) inside the network namespace `NS`, measured as `api-bench
//! --first-packet` measures it (a thread's exact CPU clock over a batch of SYNs from fresh source
//! ports, conntrack flushed before each batch; `scale::first_packet`). Prints one line:
//! `<µs per flow, median of the batches> <flows of the last batch destination-NATed>`.
//! `tests/bench/ruleset_ablation.py --sender rust` calls it: a Python loop's own CPU per SYN is
//! several times the rules' and varies with it.

use std::net::Ipv4Addr;

use switchyard_e2e::scale::first_packet::{FlowOpts, cost_per_flow};

fn main() {
    if let Err(e) = run() {
        eprintln!("syn-cost: {e}");
        std::process::exit(1);
    }
}

fn value(args: &[String], name: &str) -> Result<String, String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .ok_or_else(|| format!("{name} is required"))
}

fn number<T: std::str::FromStr>(args: &[String], name: &str) -> Result<T, String> {
    let text = value(args, name)?;
    text.parse().map_err(|_| format!("{name} {text}: not a number"))
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let netns = value(&args, "--netns")?;
    let src: Ipv4Addr = number(&args, "--src")?;
    let opts = FlowOpts {
        flows: number(&args, "--flows")?,
        batches: number(&args, "--batches")?,
    };
    let mut targets = Vec::new();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        if arg.starts_with("--") {
            rest.next();
        } else {
            targets.push(
                arg.parse::<Ipv4Addr>()
                    .map_err(|_| format!("{arg}: not an IPv4 address"))?,
            );
        }
    }
    let cost = cost_per_flow(&netns, src, &targets, 80, opts).map_err(|e| e.to_string())?;
    println!("{:.4} {}", cost.us_per_flow, cost.dnated);
    Ok(())
}
