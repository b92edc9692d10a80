//! Statistical checks with a stated false-failure rate.
//!
//! A load-balancing check looks at random choices (nftables `numgen random`, iptables `statistic
//! mode random`, a new ephemeral source port per UDP attempt), so even a correct data path fails a
//! fixed tolerance now and then. A CI that gates every submission cannot afford that: every check
//! here is built so that a correct, uniform data path fails it with probability at most
//! [`FALSE_FAILURE`] (one in a million), computed exactly from the binomial distribution, not from
//! a normal approximation. The same code computes what a check still catches (its power against a
//! given skew), so a test can state both in a comment and the unit tests below hold it to them.
//!
//! The spread check ([`uniform_range`], [`check_uniform`]): over `n` independent choices among `k`
//! equally likely endpoints each count is `Binomial(n, 1/k)`. The accepted range `[lo, hi]` leaves at
//! most `alpha / (2k)` in each tail of that distribution; by the union bound over the `2k` tails, the
//! chance that any count falls outside is at most `alpha` (whatever the counts' dependence).
//!
//! The coverage check ([`samples_to_see`]): the number of choices after which an endpoint chosen with
//! probability `p` is missing with probability at most `alpha`.

use std::{collections::BTreeMap, ops::RangeInclusive};

/// Choices a spread over 3 endpoints is checked on (see the unit tests for what it catches).
pub const SPREAD_3: u64 = 600;

/// Choices a spread over 2 endpoints is checked on.
pub const SPREAD_2: u64 = 500;

/// The false-failure rate every statistical check of the suite is built for: at most one failure in
/// a million runs of a correct data path, per check.
pub const FALSE_FAILURE: f64 = 1e-6;

/// `ln(n!)`, summed exactly (the suite's `n` are at most a few thousand).
fn ln_factorial(n: u64) -> f64 {
    (2..=n).map(|i| (i as f64).ln()).sum()
}

/// `P(X = j)` for `X ~ Binomial(n, p)`.
pub fn binomial_pmf(n: u64, p: f64, j: u64) -> f64 {
    assert!((0.0..=1.0).contains(&p), "a probability: {p}");
    if j > n {
        return 0.0;
    }
    if p == 0.0 {
        return if j == 0 { 1.0 } else { 0.0 };
    }
    if p == 1.0 {
        return if j == n { 1.0 } else { 0.0 };
    }
    let ln = ln_factorial(n) - ln_factorial(j) - ln_factorial(n - j)
        + j as f64 * p.ln()
        + (n - j) as f64 * (1.0 - p).ln();
    ln.exp()
}

/// `P(X < lo or X > hi)` for `X ~ Binomial(n, p)`: the chance that one count leaves `range`.
pub fn binomial_outside(n: u64, p: f64, range: &RangeInclusive<u64>) -> f64 {
    let below: f64 = (0..*range.start()).map(|j| binomial_pmf(n, p, j)).sum();
    let above: f64 = (range.end() + 1..=n).map(|j| binomial_pmf(n, p, j)).sum();
    below + above
}

/// The accepted range for each of `k` equally likely endpoints over `n` choices, at false-failure
/// rate `alpha` for the whole check: the tightest `[lo, hi]` with `P(X < lo) <= alpha / 2k` and
/// `P(X > hi) <= alpha / 2k` for `X ~ Binomial(n, 1/k)`.
pub fn uniform_range(n: u64, k: u64, alpha: f64) -> RangeInclusive<u64> {
    assert!(k >= 1 && n >= 1 && alpha > 0.0 && alpha < 1.0);
    let p = 1.0 / k as f64;
    let tail = alpha / (2 * k) as f64;
    let pmf: Vec<f64> = (0..=n).map(|j| binomial_pmf(n, p, j)).collect();
    // lo: the largest value whose strict lower tail P(X < lo) stays within `tail`.
    let (mut lo, mut below) = (0, 0.0);
    while lo < n && below + pmf[lo as usize] <= tail {
        below += pmf[lo as usize];
        lo += 1;
    }
    let (mut hi, mut above) = (n, 0.0);
    while hi > 0 && above + pmf[hi as usize] <= tail {
        above += pmf[hi as usize];
        hi -= 1;
    }
    lo..=hi
}

/// A lower bound of the chance that [`check_uniform`] over `n` choices among `weights.len()`
/// endpoints fails when the endpoints are really chosen in proportion to `weights`: the largest
/// single count's chance to leave the range (the check fails if any count does).
pub fn power(n: u64, weights: &[f64], alpha: f64) -> f64 {
    let range = uniform_range(n, weights.len() as u64, alpha);
    let total: f64 = weights.iter().sum();
    weights
        .iter()
        .map(|w| binomial_outside(n, w / total, &range))
        .fold(0.0, f64::max)
}

/// The smallest number of independent choices after which an endpoint chosen with probability `p`
/// has been missed with probability at most `alpha`: `(1 - p)^n <= alpha`.
pub fn samples_to_see(p: f64, alpha: f64) -> u32 {
    assert!(p > 0.0 && p < 1.0 && alpha > 0.0 && alpha < 1.0);
    (alpha.ln() / (1.0 - p).ln()).ceil() as u32
}

/// Checks a tally of `n` answers (answer → count, failures included as their own keys) against
/// a uniform choice among `endpoints`: exactly those keys, each count within
/// [`uniform_range`]`(n, k, FALSE_FAILURE)`. The error says what was seen and what was allowed.
pub fn check_uniform(tally: &BTreeMap<String, usize>, endpoints: &[&str]) -> Result<(), String> {
    let n: usize = tally.values().sum();
    let range = uniform_range(n as u64, endpoints.len() as u64, FALSE_FAILURE);
    let unexpected: Vec<&String> = tally
        .keys()
        .filter(|key| !endpoints.contains(&key.as_str()))
        .collect();
    let outside: Vec<(&str, usize)> = endpoints
        .iter()
        .map(|e| (*e, tally.get(*e).copied().unwrap_or(0)))
        .filter(|(_, c)| !range.contains(&(*c as u64)))
        .collect();
    if unexpected.is_empty() && outside.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{tally:?} over {n} attempts: unexpected answers {unexpected:?}, counts outside \
             {range:?} {outside:?} (a uniform choice among {endpoints:?} leaves that range with \
             probability <= {FALSE_FAILURE:e})"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An independent binomial pmf (the recurrence `pmf(j + 1) = pmf(j) (n - j) / (j + 1) p / q`).
    fn pmf_by_recurrence(n: u64, p: f64) -> Vec<f64> {
        let mut out = vec![(1.0 - p).powi(n as i32)];
        for j in 0..n {
            let next = out[j as usize] * (n - j) as f64 / (j + 1) as f64 * p / (1.0 - p);
            out.push(next);
        }
        out
    }

    #[test]
    fn pmf_matches_an_independent_computation_and_sums_to_one() {
        for (n, p) in [
            (10, 0.5),
            (90, 1.0 / 3.0),
            (300, 1.0 / 3.0),
            (200, 0.5),
            (450, 0.25),
        ] {
            let reference = pmf_by_recurrence(n, p);
            let ours: Vec<f64> = (0..=n).map(|j| binomial_pmf(n, p, j)).collect();
            for (j, (a, b)) in ours.iter().zip(&reference).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-12 + 1e-9 * b,
                    "Bin({n}, {p}) at {j}: {a} vs {b}"
                );
            }
            let total: f64 = ours.iter().sum();
            assert!((total - 1.0).abs() < 1e-9, "Bin({n}, {p}) sums to {total}");
        }
        // Exact small cases: Bin(4, 1/2) = 1, 4, 6, 4, 1 sixteenths.
        let sixteenths: Vec<f64> = (0..=4).map(|j| binomial_pmf(4, 0.5, j) * 16.0).collect();
        for (a, b) in sixteenths.iter().zip([1.0, 4.0, 6.0, 4.0, 1.0]) {
            assert!((a - b).abs() < 1e-9, "{sixteenths:?}");
        }
    }

    #[test]
    fn the_range_keeps_each_tail_within_its_share_and_is_the_tightest() {
        for (n, k) in [(90, 3), (300, 3), (450, 3), (200, 2), (240, 2), (400, 4)] {
            let range = uniform_range(n, k, FALSE_FAILURE);
            let p = 1.0 / k as f64;
            let tail = FALSE_FAILURE / (2 * k) as f64;
            let below: f64 = (0..*range.start()).map(|j| binomial_pmf(n, p, j)).sum();
            let above: f64 = (range.end() + 1..=n).map(|j| binomial_pmf(n, p, j)).sum();
            assert!(below <= tail && above <= tail, "{n}/{k}: {below:e} {above:e}");
            // One more value outside on either side would exceed the tail's share.
            assert!(
                below + binomial_pmf(n, p, *range.start()) > tail,
                "{n}/{k}: lo not tight"
            );
            assert!(
                above + binomial_pmf(n, p, *range.end()) > tail,
                "{n}/{k}: hi not tight"
            );
            // The whole check: k counts, each outside with at most 2 * tail.
            assert!(k as f64 * binomial_outside(n, p, &range) <= FALSE_FAILURE);
            // Symmetric around n/k for k = 2.
            if k == 2 {
                assert_eq!(range.start() + range.end(), n, "{range:?}");
            }
        }
        // The old tolerance of the ClusterIP spread, [15, 45] over 90, is far looser than 1e-6.
        let old = 3.0 * binomial_outside(90, 1.0 / 3.0, &(15..=45));
        assert!(old > 1e-4, "the old check failed a correct data path at {old:e}");
    }

    /// A small xorshift generator: the union bound checked against real multinomial draws.
    struct XorShift(u64);

    impl XorShift {
        fn below(&mut self, k: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % k
        }
    }

    #[test]
    fn simulated_uniform_choices_fail_no_more_often_than_alpha() {
        // At a loose alpha the rate is measurable: 20 000 simulated checks of 90 choices among 3.
        let (n, k, alpha, runs) = (90u64, 3u64, 0.05, 20_000);
        let range = uniform_range(n, k, alpha);
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        let mut failed = 0;
        for _ in 0..runs {
            let mut counts = vec![0u64; k as usize];
            for _ in 0..n {
                counts[rng.below(k) as usize] += 1;
            }
            if counts.iter().any(|c| !range.contains(c)) {
                failed += 1;
            }
        }
        let rate = failed as f64 / runs as f64;
        // alpha plus 4 standard errors of the estimate.
        assert!(
            rate <= alpha + 4.0 * (alpha * (1.0 - alpha) / runs as f64).sqrt(),
            "{rate}"
        );
        assert!(rate > 0.0, "the check can fail at all");
    }

    #[test]
    fn the_suites_sample_sizes_catch_the_skews_their_comments_state() {
        // The dataplane spreads (ClusterIP TCP and UDP, the IPv6-only Service): 600 choices among
        // 3 endpoints, accepted in [143, 260] each.
        let r = uniform_range(SPREAD_3, 3, FALSE_FAILURE);
        assert_eq!(r, 143..=260);
        assert!(*r.start() > 0, "an endpoint never chosen always fails: {r:?}");
        assert!(power(SPREAD_3, &[2.0, 1.0, 1.0], FALSE_FAILURE) >= 0.999, "2:1:1");
        assert!(power(SPREAD_3, &[1.0, 1.0, 0.5], FALSE_FAILURE) >= 0.98, "2:2:1");
        // The SCTP spread (tests/tests/ipvs_vm.rs): 500 associations between 2 endpoints,
        // accepted in [194, 306] each.
        let r = uniform_range(SPREAD_2, 2, FALSE_FAILURE);
        assert_eq!(r, 194..=306);
        assert!(power(SPREAD_2, &[2.0, 1.0], FALSE_FAILURE) >= 0.99, "2:1");
        // An endpoint chosen a third of the time is seen within samples_to_see(1/3) choices.
        let n = samples_to_see(1.0 / 3.0, FALSE_FAILURE);
        assert_eq!(n, 35);
        assert!((2.0f64 / 3.0).powi(n as i32) <= FALSE_FAILURE);
        assert!((2.0f64 / 3.0).powi(n as i32 - 1) > FALSE_FAILURE);
    }

    #[test]
    fn check_uniform_reports_missing_unexpected_and_skewed_endpoints() {
        let tally = |pairs: &[(&str, usize)]| -> BTreeMap<String, usize> {
            pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
        };
        let eps = ["a", "b", "c"];
        assert_eq!(
            check_uniform(&tally(&[("a", 150), ("b", 150), ("c", 150)]), &eps),
            Ok(())
        );
        assert!(check_uniform(&tally(&[("a", 225), ("b", 225)]), &eps).is_err());
        assert!(check_uniform(&tally(&[("a", 225), ("b", 112), ("c", 113)]), &eps).is_err());
        let err = check_uniform(
            &tally(&[("a", 150), ("b", 149), ("c", 150), ("Timeout", 1)]),
            &eps,
        );
        assert!(err.is_err_and(|e| e.contains("Timeout")));
        // The failed cold run's 47/27/16 over 90 is inside the 1e-6 range at 90 samples.
        assert_eq!(
            check_uniform(&tally(&[("a", 47), ("b", 27), ("c", 16)]), &eps),
            Ok(())
        );
    }

    #[test]
    fn print_the_ranges_and_powers_used() {
        for (n, k) in [(90, 3), (300, 3), (600, 3), (24, 2), (240, 2), (500, 2)] {
            let w2 = if k == 3 {
                vec![2.0, 1.0, 1.0]
            } else {
                vec![2.0, 1.0]
            };
            let w3 = if k == 3 {
                vec![1.0, 1.0, 0.5]
            } else {
                vec![1.5, 1.0]
            };
            println!(
                "n={n} k={k}: range {:?}, power vs {w2:?} {:.6}, vs {w3:?} {:.6}",
                uniform_range(n, k, FALSE_FAILURE),
                power(n, &w2, FALSE_FAILURE),
                power(n, &w3, FALSE_FAILURE)
            );
        }
        println!(
            "samples_to_see(1/3) = {}",
            samples_to_see(1.0 / 3.0, FALSE_FAILURE)
        );
        println!("samples_to_see(1/2) = {}", samples_to_see(0.5, FALSE_FAILURE));
    }
}
